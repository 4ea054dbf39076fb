#!/usr/bin/env bash
# A GPU window, host side: `bash bench/device/prepare.sh [--te-torch-so PATH]` on a machine whose
# pip reaches PyPI, in the checkout the device calls are made from. Downloads every package the
# GPU tests and benches need on the device (bench/device/gpu-wheels.txt and data_prep-wheels.txt,
# for its CPython 3.12; torch is already there), checks their requirements, compresses and splits
# them into carry bundles under the device tool's 64 MiB a call (.whl/call1 ... .whl/callN, with
# sha256 manifests), and prints the number of device calls and each call's carry and command.
# Then run `bash bench/device/verify.sh` on the device in each of those calls. Downloads are
# cached in .whl/cache. Exit status 1 with the reasons when a package cannot be had.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-python3}" bench/device/prepare.py "$@"
