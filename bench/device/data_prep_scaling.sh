#!/usr/bin/env bash
# data_prep's scaling table on a device machine (16 cores): one of bench/device/verify.sh's steps,
# or by hand, `bash bench/device/data_prep_scaling.sh [bench/data_prep.py arguments]`, from
# anywhere in the repository. Its packages (bench/device/data_prep-wheels.txt, and megatron-core
# for the classic baseline's IndexedDatasetBuilder) come in the bundles of
# bench/device/prepare.sh and are installed by bench/device/setup.sh (the machine's own numpy and
# torch are used). Runs bench/data_prep.py (default: 32 copies, about 1 GB; workers 1, 2, 4, 8
# and all cores; 3 rounds), then bench/data_prep_many_files.py (16 copies: about 28,000 files)
# with a worker per core. The output goes to $DATA_PREP_SCALING_LOG (default
# $OUT/data_prep_scaling.log; $OUT is the device machine's result folder).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/device/setup.sh
LOG=${DATA_PREP_SCALING_LOG:-${OUT:-/tmp}/data_prep_scaling.log}
{
  echo "$(nproc) cores, $(python3 --version), SHA instructions (sha256 of the inputs): $(grep -qw sha_ni /proc/cpuinfo && echo yes || echo no)"
  python3 - <<'PY'
from importlib import metadata
def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"
print(*(f"{d} {version(d)}" for d in ("gigatoken", "numpy", "tiktoken", "megatron-core", "torch")), sep=", ")
PY
  if [ $# -eq 0 ]; then set -- --copies 32 --repeat 3; fi
  python3 bench/data_prep.py "$@"
  echo
  echo "many small files (one document per file) against one JSONL file, all cores:"
  python3 bench/data_prep_many_files.py --copies 16 --repeat 3 --workers "$(nproc)"
} 2>&1 | tee "$LOG"
