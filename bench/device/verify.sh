#!/usr/bin/env bash
# A GPU window, device side: `bash bench/device/verify.sh` in every device call, the first ones
# with the carry that `bash bench/device/prepare.sh` printed (.whl/call1, .whl/call2, ...), then
# with no carry until $OUT/summary.md says COMPLETE. Installs what has arrived (parts stashed in
# /tmp/tw-verify across calls, joined and checked against their sha256 once all are in), then
# runs what it can within the call's 10 minutes, each step under its own timeout, resuming where
# the last call stopped: Transformer Engine's PyTorch extension, the GPU tests (every layout,
# FP8 and the fused loss, context parallel), checkpoint GB/s against the disk and data_prep's
# scaling table. Writes $OUT/summary.md, $OUT/state.json and $OUT/logs.tar.gz. Exit status 0:
# complete, all passed; 10: not complete (the summary's first line names the next call); 1:
# complete with a failure. See bench/device/verify.py for the environment variables
# (TW_VERIFY_DRY=1 rehearses it without a GPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
exec "${TW_PYTHON:-python3}" bench/device/verify.py "$@"
