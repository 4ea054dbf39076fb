# shellcheck shell=bash
# Source (bash) on a device machine from the repository root, for commands of your own in a GPU
# window (bench/gpu_train.py, bench/step_overhead.py, one test): installs what the carried
# bundles hold, as bench/device/verify.sh does (once per machine; Transformer Engine's extension
# too once its parts are in), and exports PYTHONPATH so that python3 finds the packages. Inside a
# verify.sh step (TW_VERIFY_SITE set) it only sets PYTHONPATH.
#   source bench/device/setup.sh && python3 bench/gpu_train.py --preset speed
TW_VERIFY_DIR=${TW_VERIFY_DIR:-/tmp/tw-verify}
if [ -z "${TW_VERIFY_SITE:-}" ]; then
  "${TW_PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/verify.py" --install-only \
    || echo "bench/device/setup.sh: the install is not complete: see $TW_VERIFY_DIR/logs/install.log" >&2
fi
_tw_path=$TW_VERIFY_DIR/site
if [ -f "$TW_VERIFY_DIR/site-te/.tw-installed" ] && [ ! -e "$TW_VERIFY_DIR/te-disabled" ]; then
  _tw_path=$_tw_path:$TW_VERIFY_DIR/site-te
fi
case ":${PYTHONPATH:-}:" in
  *":$TW_VERIFY_DIR/site:"*) ;;
  *) export PYTHONPATH=$_tw_path${PYTHONPATH:+:$PYTHONPATH} ;;
esac
export PYTHONUNBUFFERED=1
unset _tw_path
