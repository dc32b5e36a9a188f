# syntax=docker/dockerfile:1
# escapement's container image: the KServe runtime (deploy/kserve/), or any container platform.
#
#   CPU:   docker build -t escapement:0.1.0-cpu .
#   CUDA:  docker build -t escapement:0.1.0-cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# Both install torch==2.13.0 as constraints.txt pins it, from PyTorch's index for the variant
# (choose the CUDA index matching your nodes' driver from pytorch.org; its wheels bring the CUDA
# user-space libraries, and the NVIDIA container toolkit mounts the driver into the container).
# The image runs `escapement serve` on config/escapement.kserve.toml: HTTP on 8080, gRPC on 8081,
# models from /mnt/models. docs/deploy.md says how to run it.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
# daemon/default_config.toml is a symbolic link into config/: both directories are needed.
COPY pyproject.toml constraints.txt README.md ./
COPY config ./config
COPY daemon ./daemon
RUN python -m venv /opt/escapement \
 && /opt/escapement/bin/pip install --no-cache-dir --disable-pip-version-check \
        --extra-index-url "${TORCH_INDEX}" -c constraints.txt . \
 && /opt/escapement/bin/python -c "import torch, daemon.cli; print('torch', torch.__version__)"

FROM python:${PYTHON}-slim-bookworm
COPY --from=build /opt/escapement /opt/escapement
COPY config/escapement.kserve.toml /etc/escapement/escapement.toml
# The user KServe's runtime runs as (runAsUser: 1000); it owns nothing in the image.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp escapement \
 && mkdir -p /mnt/models
USER 1000
ENV PATH=/opt/escapement/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/cache
EXPOSE 8080 8081
ENTRYPOINT ["escapement"]
CMD ["serve", "--config", "/etc/escapement/escapement.toml"]
