# Sourced on the GPU machine, from the checkout's root: installs the project (not editable,
# no dependencies: the image has them) and the carried wheels of bench/gpu/wheels.sh into
# /tmp/hybridpar-site, offline, and puts that folder on PYTHONPATH, so `python3 -m
# hybridpar.train` runs there without TensorFlow. Usage: `source bench/gpu/env.sh`, then
# run from another folder than the checkout's root: there the source folder hybridpar/
# (without models/ and input/ mapped into it) would shadow the installed package.
HYBRIDPAR_SITE="${HYBRIDPAR_SITE:-/tmp/hybridpar-site}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --upgrade --target "$HYBRIDPAR_SITE" bench/gpu/wheels/*.whl . || return 1
export PYTHONPATH="$HYBRIDPAR_SITE${PYTHONPATH:+:$PYTHONPATH}"
