#!/usr/bin/env bash
# The GPU test modules on a (bare) GPU machine: `bash bench/device/run_gpu_tests.sh`, from anywhere
# in the repository. Sources bench/device/setup.sh (installs the packages carried in .whl/ into
# /tmp/site once per machine and puts them on PYTHONPATH), prints the versions that matter, then
# runs tests/test_gpu_layouts.py (every parallel layout through `python -m launcher.train`, two
# ranks sharing one GPU), tests/test_gpu_context_parallel.py and tests/test_gpu_fp8.py (FP8 and
# the fused loss). No -x: every layout reports.
# The log goes to $OUT/gpu_tests.log ($OUT is the device machine's result folder; /tmp without).
# TW_INSTALL_TE=1 first runs setup.sh's te_install (Transformer Engine from the parts in .te/;
# builds its torch extension when no prebuilt one is carried, which takes several minutes).
# Extra arguments go to pytest, e.g. `-k deepspeed` or `tests/test_gpu_layouts.py::test_megatron_cp2`
# (with file arguments only those files run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/device/setup.sh
export PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/gpu_tests.log

if [ "${TW_INSTALL_TE:-0}" = 1 ]; then
  te_install || echo "te_install failed: Transformer Engine tests will skip"
fi

python3 - <<'EOF'
import importlib.metadata as md
import platform

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"

import torch
print(f"python          {platform.python_version()}")
print(f"torch           {torch.__version__} (CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"
      if torch.cuda.is_available() else f"torch           {torch.__version__} (no CUDA device)")
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    print(f"GPU {i}           {props.name}, {props.total_memory / 2**30:.1f} GiB, "
          f"sm_{props.major}{props.minor}")
print(f"megatron-core   {version('megatron-core')}")
print(f"deepspeed       {version('deepspeed')}")
try:
    import transformer_engine
    te = getattr(transformer_engine, "__version__", version("transformer_engine"))
except Exception as exc:  # not installed, or installed but unusable
    te = "absent" if isinstance(exc, ModuleNotFoundError) else f"broken ({exc!r})"[:200]
print(f"TE              {te}")
print(f"hydra-core      {version('hydra-core')}, omegaconf {version('omegaconf')}, "
      f"pydantic {version('pydantic')}, pytest {version('pytest')}, "
      f"pytest-timeout {version('pytest-timeout')}")
EOF

TESTS=(tests/test_gpu_layouts.py tests/test_gpu_context_parallel.py tests/test_gpu_fp8.py)
for arg in "$@"; do
  [[ $arg == tests/* ]] && TESTS=()  # the caller named what to run
done
python3 -m pytest -q -p no:cacheprovider --timeout=900 -rA "${TESTS[@]}" "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "pytest exit status $status; log: $LOG"
exit "$status"
