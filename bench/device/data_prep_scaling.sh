#!/usr/bin/env bash
# data_prep's scaling table on a device machine (16 cores): `bash bench/device/data_prep_scaling.sh
# [bench/data_prep.py arguments]`, from anywhere in the repository, with .whl in the call's carry.
# Installs the wheels of .whl/data_prep/ (bench/device/data_prep_wheels.sh) into /tmp/site-dp once
# per machine, keeping the machine's own numpy when it has one (torch's), and runs
# bench/data_prep.py (default: 32 copies, about 1 GB; workers 1, 2, 4, 8 and all cores; 3 rounds),
# then bench/data_prep_many_files.py (16 copies: about 28,000 files) with a worker per core.
# The classic baseline builds its shards with megatron-core's IndexedDatasetBuilder: it uses the
# megatron-core wheel that bench/device/setup.sh installs from .whl/ and the machine's torch.
# The output goes to $OUT/data_prep_scaling.log ($OUT is the device machine's result folder).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/device/setup.sh
DP=/tmp/site-dp
if [ ! -f $DP/.trainwright-data-prep ]; then
  wheels=(.whl/data_prep/*.whl)
  if python3 -c "import numpy" 2>/dev/null; then
    wheels=($(printf '%s\n' "${wheels[@]}" | grep -v '/numpy-'))
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $DP "${wheels[@]}"
  python3 -m compileall -q -j 0 $DP >/dev/null || true  # else the first timed run compiles them
  touch $DP/.trainwright-data-prep
fi
export PYTHONPATH=$PYTHONPATH:$DP
LOG=${OUT:-/tmp}/data_prep_scaling.log
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
