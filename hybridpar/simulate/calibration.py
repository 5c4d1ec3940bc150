"""Calibration: what a real run spends besides the ideal per-device FLOP rate, fitted from
measurements into a preset's fields (`Preset.step_overhead_s`, the input rate, the
evaluation overhead).

A preset's `efficiency` alone says a 128-px image costs (128/224)^2 of a 224-px one, so small
images and small batches are predicted at the peak rate. A measured rate at two or more image
sizes or batches separates the step into a fixed part and a FLOP-proportional part:

    step_s = step_overhead_s + FLOPs(batch, size) / (peak * efficiency)

fitted by least squares (`fit_rate`) to (image size, per-device batch, images/s) points
measured on one device: the train lines of a run's metrics.jsonl (`points_from_metrics`;
a curriculum run gives several sizes in one run) or published figures.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence

from hybridpar.runtime.run_records import Train, read_records
from hybridpar.simulate.hardware import Preset
from hybridpar.simulate.step import Evaluation, eval_pass_s
from hybridpar.simulate.workload import Workload, resnet50_workload


def fit_rate(
    points: Sequence[tuple[int, float, float]],
    preset: Preset,
    workload: Workload | None = None,
    note: str = "",
) -> Preset:
    """`preset` with `step_overhead_s` and `efficiency` fitted to single-device points
    (image size, per-device batch, images/s). One point (or points of one step size) gives
    no overhead: the preset's plain calibration. A negative fitted overhead is clipped to 0."""
    if not points:
        raise ValueError("no measured points to calibrate from")
    workload = workload or resnet50_workload()
    xs, ys = [], []
    for size, batch, rate in points:
        if size <= 0 or batch <= 0 or rate <= 0:
            raise ValueError(f"bad measured point (size {size}, batch {batch}, {rate} img/s)")
        xs.append(workload.step_flops(batch, size) * workload.model_parallel)
        ys.append(batch / rate)
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    overhead = 0.0
    if n > 1 and sxx > 1e-12 * mx * mx:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        overhead = max(0.0, my - slope * mx)
    # seconds per FLOP, refitted through the overhead (least squares with it fixed)
    slope = sum(x * (y - overhead) for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if slope <= 0:
        raise ValueError("the measured rates do not fall with the work per step")
    size, batch, rate = max(points, key=lambda p: p[1] * p[0] ** 2)
    return dataclasses.replace(
        preset,
        step_overhead_s=overhead,
        efficiency=1.0 / (slope * preset.peak_flops),
        reference_images_per_s=rate,
        reference_image_size=int(size),
        reference_batch=int(batch),
        reference_note=note or f"fitted to {n} measured point{'s' * (n > 1)}",
    )


def points_from_metrics(path: str, devices: int = 1) -> list[tuple[int, float, float]]:
    """(image size, per-device batch, images/s per device) from a run's metrics.jsonl: the
    median of the train lines at each (image size, global batch), without the first line
    of each (it includes the warm-up). `devices`: the run's device count (the rate is per
    device; a multi-device run's rate includes its communication)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r} (pass a run's metrics.jsonl)")
    groups: dict[tuple[int, int], list[float]] = {}
    for rec in read_records(path)[0]:
        if isinstance(rec, Train) and rec.images_per_s:
            key = (int(rec.image_size), int(rec.global_batch))
            groups.setdefault(key, []).append(float(rec.images_per_s))
    if not groups:
        raise ValueError(f"{path} has no train lines with images_per_s")
    out = []
    for (size, batch), rates in sorted(groups.items()):
        rates = rates[1:] if len(rates) > 1 else rates
        out.append((size, batch / devices, statistics.median(rates) / devices))
    return out


def fit_eval_overhead(
    measured_pass_s: float, workload: Workload, preset: Preset, devices: int, ev: Evaluation
) -> Preset:
    """`preset` with the fixed cost per evaluation pass that makes the model's pass on
    `devices` take `measured_pass_s` (what a run's log says one evaluation took)."""
    bare = eval_pass_s(workload, dataclasses.replace(preset, eval_overhead_s=0.0), devices, ev)
    if measured_pass_s < bare:
        raise ValueError(
            f"a measured evaluation pass of {measured_pass_s:g} s is faster than the model's "
            f"{bare:.3g} s of compute and input alone: check the devices and batch"
        )
    return dataclasses.replace(preset, eval_overhead_s=measured_pass_s - bare)
