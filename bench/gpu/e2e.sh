#!/usr/bin/env bash
# The trainer on one GPU, end to end, in one device call: the README's
# digits job, CIFAR-10 to 94% on device-resident data beside airbench94, the DAWNBench
# ResNet-50 stages against the step bench, and a program compiled ahead and loaded. Writes
# bench/results/gpu/e2e_<gpu>_<date>_<time>.txt (tables, then one key=value line, ratios
# first); with $OUT set (the device machine), copies it there with the runs' records and logs.
# Exit 1 where a section failed or lacked an input (the file keeps what ran), 2 on a refusal.
#
#   bash bench/gpu/e2e.sh --prepare   # here first: CIFAR-10 pack, compiled files, sizes
#   bash bench/gpu/e2e.sh             # the GPU machine: about 8 minutes on one H100
#   bash bench/gpu/e2e.sh --smoke     # CPU, tiny shapes, a few steps (tests/test_gpu_e2e.py)
#
# Carry bench/gpu/{wheels,data,peers,compiled} with the device call (all ignored by git);
# options: python3 bench/gpu/e2e.py --help.
set -uo pipefail
PY="${PYTHON:-python3}"
# A relative interpreter path is the caller's (resolved before the cd's below)
if [[ "$PY" == */* ]]; then
  [ -x "$PY" ] || { echo "error: PYTHON=$PY is not an executable file"; exit 2; }
  PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
elif ! command -v "$PY" >/dev/null; then
  echo "error: no $PY on PATH: set PYTHON to the interpreter to use"; exit 2
fi
cd "$(dirname "$0")/../.."
# From / : in the checkout's root, `import hybridpar` would find the uninstalled source.
if ! (cd / && "$PY" -c "import ml_collections, hybridpar.models") 2>/dev/null; then
  if [ -d bench/gpu/wheels ]; then
    # shellcheck source=/dev/null
    source bench/gpu/env.sh || { echo "error: bench/gpu/env.sh could not install the project"; exit 2; }
  else
    echo "error: hybridpar is not installed and bench/gpu/wheels/ is absent (run bench/gpu/wheels.sh)"
    exit 2
  fi
fi
exec "$PY" -u bench/gpu/e2e.py "$@"
