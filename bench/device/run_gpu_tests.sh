#!/usr/bin/env bash
# The GPU test pass alone, outside bench/device/verify.sh's bookkeeping: `bash
# bench/device/run_gpu_tests.sh [pytest arguments]` on a device machine. Installs what the carried
# bundles hold (as verify.sh does), then runs tests/test_gpu_layouts.py,
# tests/test_gpu_context_parallel.py and tests/test_gpu_fp8.py with verify.sh's pytest flags
# (xdist workers, module fixtures kept whole, per-test timeout), or only the test files named in
# the arguments, e.g. `tests/test_gpu_fp8.py` or `-k deepspeed`. For a whole window use verify.sh.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
exec "${TW_PYTHON:-python3}" bench/device/verify.py --pytest "$@"
