#!/usr/bin/env bash
# The GPU checks in one command, from the repository root:
#
#   bench/gpu/check.sh OUTDIR            on a GPU machine: wheels the image lacks in .whl/
#                                        (bench/gpu/fetch-wheels.sh makes them), its own torch
#   bench/gpu/check.sh --standin OUTDIR  the same flow on the CUDA stand-in (emucuda:0), on any
#                                        machine: proves the script before a GPU is lent
#   bench/gpu/check.sh --no-manymodels OUTDIR   every step but the many-models daemons (about 4 of
#                                        its 8 minutes), for a lease split into two calls; the
#                                        other call is `python -m bench.gpu.manymodels`
#
# Steps: the environment; the demo models built with the local torch; the device-seam and CUDA
# backend tests (tests/device: the stand-in in every mode, and CUDA when present); the gpu-marked
# tests (under TORCH_CUDA_SANITIZER=1 on a GPU); the GPU figures (bench/gpu/figures.py). Each
# step's log and a summary.md land in OUTDIR; the exit status is the number of failed steps.
set -uo pipefail

standin=0
manymodels=1
while [[ "${1:-}" == --* ]]; do
    case $1 in
        --standin) standin=1 ;;
        --no-manymodels) manymodels=0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
out=${1:?usage: bench/gpu/check.sh [--standin] [--no-manymodels] OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
tmp=$(mktemp -d /tmp/escapement-gpu-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
started=$(date +%s)

if [[ $standin == 1 && -x .venv/bin/python ]]; then py=$root/.venv/bin/python; else py=${PYTHON:-python3}; fi
export PYTHONPATH="$root"
if [[ $standin == 0 && -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tmp/site" .whl/*.whl \
        || { echo "installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="$tmp/site:$root"
fi
if [[ $standin == 1 ]]; then
    device=emucuda:0
    export ESCAPEMENT_TEST_GPU=emucuda
    sanitizer=0
else
    device=cuda:0
    sanitizer=1
fi
export PYTHONUNBUFFERED=1

summary=("# GPU check ($([[ $standin == 1 ]] && echo "stand-in: $device" || echo "$device"))" "")
failed=0
step() {  # step NAME LOG COMMAND...
    local name=$1 log=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name" >&2
    "$@" >"$out/$log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 ))
    if [[ $rc == 0 ]]; then
        summary+=("- $name: ok (${took} s, $log)")
    else
        summary+=("- $name: FAILED with status $rc (${took} s, $log)")
        failed=$((failed + 1))
        tail -n 30 "$out/$log" >&2
    fi
}

env_report() {
    "$py" - <<'PY'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
missing = []
for mod in ("numpy", "uvloop", "aiohttp", "httptools", "msgpack", "orjson", "prometheus_client", "sklearn",
            "pytest", "pytest_asyncio", "pytest_timeout", "hypothesis", "tritonclient.grpc", "ml_dtypes"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
if missing:
    sys.exit(f"missing: {', '.join(missing)} (carry them as wheels: bench/gpu/wheels.txt, bench/gpu/fetch-wheels.sh)")
print("every package the daemon and its tests need is importable")
PY
    command -v nvidia-smi >/dev/null && nvidia-smi -L || true
    "$py" -m pip list 2>/dev/null | grep -i -E "^(pytest|grpcio|protobuf|cupy|torchvision|ml.dtypes|numpy|uvloop|aiohttp) " || true
}

step "environment" env.txt env_report
step "demo models built with the local torch" demo.log "$py" -m daemon demo --out "$tmp/models"
export ESCAPEMENT_TEST_DEMO="$tmp/models"  # the tests copy these, not train their own (slow under the sanitizer)
step "device seam and CUDA backend tests" device-tests.log \
    "$py" -m pytest -q -p no:cacheprovider -rs tests/device
if [[ $sanitizer == 1 ]]; then
    step "gpu tests under TORCH_CUDA_SANITIZER=1" gpu-tests.log \
        env TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu tests/device
else
    step "gpu tests on the stand-in" gpu-tests.log "$py" -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu tests/device
fi
step "GPU figures" figures.log "$py" -m bench.gpu.figures --device "$device" --models "$tmp/models" --out "$out" \
    $([[ $standin == 1 ]] && echo --quick)

step "ParM codec: torch against fused cupy" parity-codec.log "$py" -m bench.gpu.parity_codec --device "$device" \
    --out "$out" $([[ $standin == 1 ]] && echo --quick)
if [[ -f bench/gpu/profiles.py ]]; then
    step "INFER profiles of standard architectures" profiles.log "$py" -m bench.gpu.profiles --device "$device" \
        --out "$out" $([[ $standin == 1 ]] && echo --quick)
fi
# (each policy's daemon reads 40 ResNet-18s before READY: 240 s lets both policies run their ladder)
step "shared backbone: a variant's LOAD over it against a full one" sharing-loads.log \
    "$py" -m bench.gpu.sharing --device "$device" --out "$out" --loads-only
[[ $manymodels == 1 ]] && step "many models: clockwork against dynamic on a real daemon" manymodels.log \
    timeout 270 "$py" -m bench.gpu.manymodels --device "$device" --out "$out" --spy \
    $([[ $standin == 1 ]] && echo --quick || echo --budget 240)

summary+=("" "$(( $(date +%s) - started )) s in all; $failed step(s) failed.")
printf '%s\n' "${summary[@]}" > "$out/summary.md"
cat "$out/summary.md"
exit $failed
