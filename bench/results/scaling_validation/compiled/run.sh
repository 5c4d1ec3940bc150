#!/bin/bash
# Compile the MLPerf ResNet-50 train step for tpu:v4-8 (4 chips, data:4) at B images per chip.
cd "$(dirname "$0")/../../../.."  # the repository root
for B in "$@"; do
  G=$((4 * B))
  /usr/bin/time -v env JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONWARNINGS=ignore \
    .venv/bin/python -m hybridpar.compile --config experiments/resnet50_imagenet_mlperf.py:,$G \
    --target tpu:v4-8 --config.eval_batch=$G --json \
    > bench/results/scaling_validation/compiled/v4-8_b$B.json \
    2> bench/results/scaling_validation/compiled/v4-8_b$B.stderr
done
