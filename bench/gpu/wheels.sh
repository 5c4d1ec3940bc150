#!/usr/bin/env bash
# Fetches, here, the pure-Python wheels the lent GPU machine's image lacks for the trainer
# (it has jax, flax, optax, orbax, absl-py, PyYAML, protobuf, Pillow; not ml_collections or
# tensorboardX), into bench/gpu/wheels/ (ignored by git; about 0.2 MB). Carry that folder
# with the device call; bench/gpu/env.sh installs them there with the project, offline.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
mkdir -p wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d wheels ml-collections==1.1.0 tensorboardX==2.6.5
du -sh wheels
