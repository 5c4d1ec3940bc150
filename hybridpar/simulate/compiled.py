"""ResNet-50's train step as the TPU compiler counts it, at several batches per chip: FLOPs
and bytes accessed per chip per step, and the roofline between them (JAX-free: the figures
are copied here from the compiler's JSON; tests/test_simulate.py checks the copy).

Source: ``python -m hybridpar.compile --target tpu:v4-8 --json`` of
experiments/resnet50_imagenet_mlperf.py (224 px, bfloat16, data:4), its train program's
``cost_analysis``; the files and the exact commands are in
bench/results/scaling_validation/compiled/ (NOTES.md there). No v3 target exists
(hybridpar.tools.targets: v3 is in the accelerator table for the scaling model only): the
v4 counts stand for the same program on v3, with v3's own peak and HBM bandwidth.

    flops(b), bytes(b)   the compiled counts, power-law between compiled batches
    roofline(b)          max(flops(b) / peak, bytes(b) / HBM bandwidth)

The step model (`hybridpar.simulate.step.ideal_seconds`) takes the FLOPs only: the bytes
accessed at the HBM bandwidth exceed the measured steps of the calibration runs, so they are
not HBM traffic (docs/scaling.md; bench/results/scaling_validation/compiled/NOTES.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# per-chip batch: (FLOPs per chip per step, bytes accessed per chip per step), the train
# program of bench/results/scaling_validation/compiled/v4-8_bBATCH.json (4 chips' batch)
RESNET50_TRAIN_224: dict[int, tuple[float, float]] = {
    8: (194_639_052_800.0, 11_044_958_208.0),
    16: (388_578_050_048.0, 19_081_476_096.0),
    32: (776_393_850_880.0, 32_289_028_096.0),
    64: (1_549_250_199_552.0, 58_663_084_032.0),
    256: (6_205_340_647_424.0, 167_253_000_192.0),
}


def compiled_steps() -> tuple[tuple[int, float, float], ...]:
    """`RESNET50_TRAIN_224` as a workload's ``compiled_steps``: (batch, FLOPs, bytes)."""
    return tuple((b, f, m) for b, (f, m) in sorted(RESNET50_TRAIN_224.items()))


def interpolate(points: Sequence[tuple[int, float]], batch: float) -> float:
    """A per-step count at `batch` from counts compiled at other batches: straight in
    log(count) against log(batch) between the two nearest compiled batches (a power law,
    exact at each compiled batch), the nearest segment's slope beyond them."""
    pts = sorted(points)
    if not pts or batch <= 0:
        raise ValueError(f"no compiled counts, or batch {batch} not positive")
    if len(pts) == 1:
        b0, v0 = pts[0]
        return v0 * batch / b0  # one point: proportional to the batch
    i = 1
    while i < len(pts) - 1 and pts[i][0] < batch:
        i += 1
    (b0, v0), (b1, v1) = pts[i - 1], pts[i]
    k = math.log(v1 / v0) / math.log(b1 / b0)
    return v0 * (batch / b0) ** k


def counts(table: dict[int, tuple[float, float]], batch: float) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per chip per step at `batch` images per chip."""
    flops = interpolate([(b, f) for b, (f, _) in table.items()], batch)
    nbytes = interpolate([(b, m) for b, (_, m) in table.items()], batch)
    return flops, nbytes


def roofline_seconds(
    table: dict[int, tuple[float, float]], batch: float, peak_flops: float, hbm_bytes_per_s: float
) -> float:
    """The longer of the compiled step's FLOPs at peak and its bytes accessed at the HBM
    bandwidth on one chip at `batch`: the heuristic ``plan --target`` ranks plans with
    (``targets.roofline_step_s``, restated: the scaling model imports no tool), not the
    step's least time, as XLA's byte count is more than the HBM traffic (``compile`` prints
    the FLOPs bound alone, max img/s/chip)."""
    flops, nbytes = counts(table, batch)
    return max(flops / peak_flops, nbytes / hbm_bytes_per_s)
