#!/bin/sh
# Make the GPU tests' optional packages importable on a machine with no network.
#
#   sh tests/gpu/offline_wheels.sh PYTHON TARGET
#
# For each wheel under tests/gpu/wheels/ (llguidance, for structured outputs: abi3, any
# CPython >= 3.9 on x86_64 Linux) whose package PYTHON cannot import yet, install it into
# TARGET (a folder to put on PYTHONPATH) with pip, offline (--no-index); without pip, unpack
# the wheel there (a wheel is a zip of its installed files). Never touches PYTHON's own
# site-packages. Refresh a wheel with (the venv's version):
#   .venv/bin/pip download llguidance==VERSION --no-deps --only-binary :all: \
#       --platform manylinux_2_31_x86_64 --python-version 3.12 -d tests/gpu/wheels/
set -eu
PYTHON=${1:-python3}
TARGET=${2:-.gpu-site}
HERE=$(dirname "$0")
mkdir -p "$TARGET"
for wheel in "$HERE"/wheels/*.whl; do
    [ -e "$wheel" ] || continue
    name=$(basename "$wheel" | cut -d- -f1)
    if PYTHONPATH="$TARGET" "$PYTHON" -c "import $name" 2>/dev/null; then
        echo "offline_wheels: $name importable"
        continue
    fi
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$TARGET" "$wheel"
    else
        "$PYTHON" -m zipfile -e "$wheel" "$TARGET"
    fi
    PYTHONPATH="$TARGET" "$PYTHON" -c "import $name" && echo "offline_wheels: installed $name into $TARGET"
done
