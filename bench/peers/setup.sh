#!/usr/bin/env bash
# Install the peers the `peers` benchmark compares escapement with, each into its own virtual
# environment under bench/.peers/, through the project's constraints (torch stays 2.13.0, the
# local CPU build). TorchServe also needs a Java runtime (11+) on PATH.
#
#   bench/peers/setup.sh              # all peers
#   bench/peers/setup.sh torchserve   # one of: torchserve ray triton
#
# triton: the PyPI wheel nvidia-pytriton bundles tritonserver 2.51 and its python backend (used
# both as a plain Triton server over a python-backend model, and through PyTriton).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$root/bench/.peers"
mkdir -p "$dest"
want="${*:-torchserve ray triton}"

install() {  # name, packages...
  local name="$1"; shift
  if [ -x "$dest/$name/bin/python" ] && [ -f "$dest/$name/.installed" ]; then
    echo "$name: already installed in $dest/$name"; return 0
  fi
  echo "$name: installing $* into $dest/$name"
  python3 -m venv "$dest/$name"
  "$dest/$name/bin/pip" install -q --disable-pip-version-check -c "$root/constraints.txt" "torch==2.13.0" "$@"
  touch "$dest/$name/.installed"
}

for peer in $want; do
  case "$peer" in
    torchserve)
      if ! command -v java >/dev/null 2>&1; then
        echo "torchserve: no java on PATH; install a JRE 11+ (e.g. apt-get install openjdk-17-jre-headless)" >&2
      fi
      # the worker imports yaml and numpy without declaring them
      install torchserve torchserve==0.12.0 torch-model-archiver==0.12.0 pyyaml numpy ;;
    ray) install ray "ray[serve]" ;;
    triton) install triton nvidia-pytriton==0.7.0 numpy ;;
    *) echo "unknown peer $peer (torchserve, ray, triton)" >&2; exit 2 ;;
  esac
done
