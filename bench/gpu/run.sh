#!/usr/bin/env bash
# ResNet-50 training throughput on one GPU (written for a single H200): hybridpar bfloat16
# vs PyTorch AMP channels_last (eager, and through torch.compile), at 128 and 224 px, batch
# 256, synthetic on-device data, with MFU against a measured bfloat16 matmul peak. Needs jax (with its CUDA plugin), flax,
# optax and torch; not TensorFlow, and hybridpar need not be installed (run from the
# checkout; ml_collections is replaced by a small shim if missing).
#
#   bench/gpu/run.sh            # full: 5 rounds x 20 steps per candidate
#   bench/gpu/run.sh --quick    # under 5 minutes on an H200
#   bench/gpu/run.sh --smoke    # 32 px, batch 2, 1 step: checks it runs (on the CPU if no GPU)
#
# Extra arguments go to bench/gpu/resnet50_gpu.py (--sizes, --batch, --set KEY=VALUE, ...).
# Ends with one key=value line: ratio_vs_torch_128=... (hybridpar / PyTorch images/s).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
# jax 0.11.2's XLA:GPU (an H200 image, 2026-12-04) aborted compiling our ResNet-50 step in its
# Triton GEMM fusion pass ("Check failed: subdim_size_accumulator == dim_size" in
# triton_tiling_propagation.cc); cuBLAS GEMMs avoid it. A triton_gemm flag of your own wins.
case " ${XLA_FLAGS:-} " in
  *xla_gpu_enable_triton_gemm*) ;;
  *) export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" ;;
esac
# The smoke on a machine with no accelerator runs on JAX's CPU backend, as hybridpar's own
# tools choose it (cli.cpu_when_no_accelerator): else JAX first starts every installed plugin
# (libtpu, CUDA), which print warnings and E0000 lines. Never the real run, nor where
# JAX_PLATFORMS is set, nor on a GPU or TPU host (there the smoke checks that device).
case " $* " in
  *" --smoke "*)
    accelerator=""
    for f in /dev/nvidia[0-9]* /dev/accel[0-9]* /dev/vfio/[0-9]* /dev/kfd; do
      [ -e "$f" ] && accelerator="$f"
    done
    if [ -z "${JAX_PLATFORMS+set}" ] && [ -z "$accelerator" ]; then
      export JAX_PLATFORMS=cpu
    fi
    ;;
esac
"$PY" - <<'PYCHECK'
import importlib.util, sys
missing = [m for m in ("jax", "flax", "optax") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: missing Python packages: {', '.join(missing)}")
if importlib.util.find_spec("torch") is None:
    print("note: torch is not installed; the PyTorch row is skipped", file=sys.stderr)
PYCHECK
if "$PY" -c "import torch" 2>/dev/null; then
  exec "$PY" -u bench/gpu/resnet50_gpu.py "$@"
else
  exec "$PY" -u bench/gpu/resnet50_gpu.py --no-torch "$@"
fi
