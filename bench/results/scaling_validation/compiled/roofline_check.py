"""Whether the compiled bytes accessed can be HBM traffic: each TPU calibration run's
steady step (as fit_preset reads it: the block less the modelled per-parameter work and
all-reduce, over its steps and device evaluation) against the compiled roofline at its batch
per chip, max(FLOPs / peak, bytes / HBM), with the chip's own peak and HBM bandwidth; then
the fit of step = fixed + roofline / e through the two runs of each chip.

    python bench/results/scaling_validation/compiled/roofline_check.py
"""

import math

from hybridpar.simulate import compiled
from hybridpar.simulate.step import predict_step
from hybridpar.simulate.validation import (
    CALIBRATION_OVERLAP,
    CALIBRATION_RUNS,
    fit_preset,
    published_workload,
)
from hybridpar.simulate.workload import IMAGENET_EVAL_IMAGES, TRAIN_FLOPS_FACTOR

for chip in ("v3", "v4"):
    preset = fit_preset(chip)
    wl = published_workload(preset)
    xs, ys = [], []
    for r in (r for r in CALIBRATION_RUNS if r.chip == chip):
        b = r.per_chip_batch
        step = predict_step(wl, preset, r.chips, b, 224, CALIBRATION_OVERLAP)
        steps = r.steps_per_block()
        ev = 0 if r.block_eval_s else math.ceil(IMAGENET_EVAL_IMAGES / r.global_batch)
        train = r.block_s - r.block_eval_s - steps * (step.param_s + step.exposed_comm_s)
        y = train / (steps + ev / TRAIN_FLOPS_FACTOR)
        f, m = compiled.counts(compiled.RESNET50_TRAIN_224, b)
        fl, by = f / preset.peak_flops, m / preset.hbm_bytes_per_s
        xs.append(max(fl, by))
        ys.append(y)
        print(f"{r.run}: {b}/chip, log step {y * 1e3:.2f} ms; compiled FLOPs at peak "
              f"{fl * 1e3:.2f} ms, bytes at HBM {by * 1e3:.2f} ms")
    slope = (ys[0] - ys[1]) / (xs[0] - xs[1])
    print(f"  {chip}: step = fixed + roofline / e gives e = {1 / slope:.3f}, "
          f"fixed = {(ys[0] - slope * xs[0]) * 1e3:.2f} ms")
    # the v0.6 sweep's steps read the same way, against both fits (the FLOP fit is the model's)
    from hybridpar.simulate.step import ideal_seconds
    from hybridpar.simulate.validation import MLPERF_TPU_RUNS

    for r in (r for r in MLPERF_TPU_RUNS if r.chip == chip):
        b = r.per_chip_batch
        step = predict_step(wl, preset, r.chips, b, 224, CALIBRATION_OVERLAP)
        steps = 4 * 1_281_167 / r.global_batch
        ev = math.ceil(IMAGENET_EVAL_IMAGES / r.global_batch)
        y = (r.block_s - steps * (step.param_s + step.exposed_comm_s)) / (
            steps + ev / TRAIN_FLOPS_FACTOR
        )
        f, m = compiled.counts(compiled.RESNET50_TRAIN_224, b)
        roof = (ys[0] - slope * xs[0]) + slope * max(
            f / preset.peak_flops, m / preset.hbm_bytes_per_s
        )
        flop = preset.step_overhead_s + ideal_seconds(wl, preset, b, 224) / preset.efficiency
        print(f"    {r.run}: {b}/chip, log {y * 1e3:.2f} ms, model (FLOPs) {flop * 1e3:.2f} ms, "
              f"roofline fit {roof * 1e3:.2f} ms")
