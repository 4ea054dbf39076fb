# Source (bash) on a bare GPU machine from the repo root: installs the Python packages carried
# in .whl/ into /tmp/site (once per machine) and exports PYTHONPATH. Transformer Engine's core
# wheel travels in parts (.te/pNN, too large for one transfer): each call stashes the parts it
# carries in /tmp/te; once all parts are there, `te_install` joins them, checks the sha256 in
# .whl/te.sha256, installs the core and builds transformer_engine_torch from its sdist (sm_90).
SITE=/tmp/site
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p /tmp/te
if [ ! -f $SITE/.trainwright-deps ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $SITE .whl/*.whl && touch $SITE/.trainwright-deps
fi
for part in .te/p*; do [ -f "$part" ] && cp --update=none "$part" /tmp/te/; done
echo "stashed TE parts: $(ls /tmp/te | tr '\n' ' ')"

te_install() {
  [ -f $SITE/.trainwright-te ] && return 0
  local whl=/tmp/te/transformer_engine_cu13-2.9.0-py3-none-manylinux_2_28_x86_64.whl
  cat /tmp/te/p0? > $whl
  echo "$(cat .whl/te.sha256)  $whl" | sha256sum -c - || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \
    $whl .whl/te_meta/transformer_engine-2.9.0-py3-none-any.whl || return 1
  local lib=$SITE/transformer_engine/wheel_lib
  if ls .whl/te_meta/transformer_engine_torch*.so >/dev/null 2>&1; then  # built on an earlier machine
    cp .whl/te_meta/transformer_engine_torch*.so $lib/ && touch $SITE/.trainwright-te && return 0
  fi
  rm -rf /tmp/tetorch && mkdir -p /tmp/tetorch && tar xzf .whl/te_meta/transformer_engine_torch-2.9.0.tar.gz -C /tmp/tetorch
  (cd /tmp/tetorch/transformer_engine_torch-2.9.0 && NVTE_CUDA_ARCHS=90 MAX_JOBS=16 \
     NVTE_FRAMEWORK=pytorch python3 -m pip install --no-index --no-deps --no-build-isolation \
     --no-cache-dir --target $SITE . ) > ${OUT:-/tmp}/te_build.log 2>&1 || { tail -30 ${OUT:-/tmp}/te_build.log; return 1; }
  # pip --target leaves the extension in the build tree (TE's wheel command renames files)
  cp /tmp/tetorch/transformer_engine_torch-2.9.0/build/lib.*/transformer_engine/wheel_lib/transformer_engine_torch*.so $lib/ \
    && cp $lib/transformer_engine_torch*.so ${OUT:-/tmp}/ && touch $SITE/.trainwright-te
}
