#!/usr/bin/env bash
# Download the wheels bench/gpu/wheels.txt lists into .whl/ (for the GPU machine: Python 3.12, x86_64).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' bench/gpu/wheels.txt | grep -v '^$' | while read -r req; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$req"
done
ls -l .whl
