#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels bench/device/data_prep_scaling.sh needs
# on a bare device machine: bench/device/data_prep-wheels.txt for CPython $PYVER (default 3.12,
# the device machine's) on x86-64 Linux, into $DEST (default .whl/data_prep/, which git ignores:
# name .whl in the device call's carry). About 35 MB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl/data_prep}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
"$PY" -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
  -d "$DEST" -r bench/device/data_prep-wheels.txt
# Pure Python, published as a source archive only.
"$PY" -m pip wheel -q --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
