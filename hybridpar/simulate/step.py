"""The step model: compute, exposed communication, step time, throughput and scaling
efficiency on p devices; the calibrated presets; curriculum stages and time to train.

    compute   = step overhead + FLOPs per device per step / (peak FLOP/s * efficiency)
    param     = parameters * bytes moved per parameter / HBM bandwidth  (not shrinking with
                the batch: the optimizer's update)
    comm      = sum over collectives of count * cost(cheapest algorithm)
    exposed   = sync + max(0, comm - sync - min(overlap, max_overlap) * backward),
                backward = 2/3 * compute; sync: the collectives a TPU or GPU compiler left
                synchronous in a compiled comm report (0 otherwise); where that report
                says what its schedule hides: comm * (1 - hidden share), overlap unused
    input     = images per device per step / (input images/s per core * cores per device)
    step      = max(compute + param + exposed, input, per-step floor)
    run       = start-up + steps * step + evaluation passes + changes of image size,
                steps: each stage's whole steps of full batches, as the trainer plans them
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.config import curriculum
from hybridpar.config.errors import ConfigError
from hybridpar.simulate.compiled import interpolate
from hybridpar.simulate.cost import Topology, best_algorithm
from hybridpar.simulate.hardware import ALIASES, UNCALIBRATED_PRESETS, Preset
from hybridpar.simulate.workload import (
    IMAGENET_EVAL_IMAGES,
    IMAGENET_TRAIN_IMAGES,
    TRAIN_FLOPS_FACTOR,
    Workload,
    cost_kind,
    group_stride,
    resnet50_workload,
)


def param_seconds(workload: Workload, preset: Preset) -> float:
    """The per-parameter work of one step, which does not shrink with the batch: the
    workload's parameters times the bytes the update moves per parameter, over the HBM
    bandwidth. 0 where either is not known."""
    if preset.hbm_bytes_per_s <= 0 or preset.param_bytes_per_param <= 0:
        return 0.0
    return workload.params * preset.param_bytes_per_param / preset.hbm_bytes_per_s


def calibrate(
    measured_images_per_s: float,
    image_size: int,
    batch: int,
    preset: Preset,
    workload: Workload | None = None,
) -> float:
    """Efficiency (fraction of peak) that reproduces a measured single-device rate.

    efficiency = FLOPs per step / (peak * (measured step time - step overhead - param)),
    measured step time = batch / measured_images_per_s.
    """
    if measured_images_per_s <= 0 or batch <= 0:
        raise ValueError("measured rate and batch must be positive")
    workload = workload or resnet50_workload()
    fixed = preset.step_overhead_s + param_seconds(workload, preset)
    step_s = batch / measured_images_per_s - fixed
    if step_s <= 0:
        raise ValueError(
            f"{measured_images_per_s:g} images/s at batch {batch} is a step of "
            f"{batch / measured_images_per_s:.4g} s, not more than the preset's step overhead "
            f"and per-parameter work {fixed:.4g} s"
        )
    flops = workload.step_flops(batch, image_size) * workload.model_parallel
    return flops / (preset.peak_flops * step_s)


def with_calibrated_efficiency(preset: Preset, workload: Workload | None = None) -> Preset:
    eff = calibrate(
        preset.reference_images_per_s,
        preset.reference_image_size,
        preset.reference_batch,
        preset,
        workload,
    )
    return dataclasses.replace(preset, efficiency=eff)


PRESETS: dict[str, Preset] = {p.name: with_calibrated_efficiency(p) for p in UNCALIBRATED_PRESETS}


def get_preset(name: str) -> Preset:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))} "
            f"(aliases: {', '.join(f'{k}={v}' for k, v in ALIASES.items())})"
        )
    return PRESETS[key]


@dataclass(frozen=True)
class StepPrediction:
    devices: int
    nodes: int
    per_device_batch: int
    image_size: int
    global_batch: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    images_per_s: float
    efficiency: float  # scaling efficiency against one device
    algorithms: str  # the chosen algorithm(s), e.g. "hier-ring" or "ring x2, tree x1"
    input_s: float = 0.0  # host seconds to decode one device's images (0: not modelled)
    overhead_s: float = 0.0  # the preset's fixed cost per step, inside compute_s
    param_s: float = 0.0  # per-parameter work (bytes per parameter over HBM bandwidth)

    def parts(self) -> dict[str, float]:
        """The step's seconds by what they are spent on, summing to `step_s`: the FLOPs
        (`compute`), the per-parameter work (`param`), the fixed cost per step (`fixed`),
        exposed communication (`comm`), the input's wait beyond them (`input`) and what the
        per-step floor adds (`floor`)."""
        busy = self.compute_s + self.param_s + self.exposed_comm_s
        return {
            "compute": self.compute_s - self.overhead_s,
            "param": self.param_s,
            "fixed": self.overhead_s,
            "comm": self.exposed_comm_s,
            "input": max(0.0, self.input_s - busy),
            "floor": self.step_s - max(busy, self.input_s),
        }


def _collective_times(workload: Workload, preset: Preset, devices: int):
    """(collective, algorithm, seconds of one op) for each of the workload's collectives."""
    replicas = devices // workload.model_parallel
    for c in workload.collectives:
        if c.group_size is not None:
            p = min(c.group_size, devices)
        else:
            p = devices if c.spans_all else replicas
        yield (c, *best_algorithm(c.kind, c.nbytes, p, preset, c.stride))


def sync_comm_time(workload: Workload, preset: Preset, devices: int) -> float:
    """Seconds per step of the collectives the compiler left synchronous (`is_async`
    False), which no overlap hides: only for a comm report compiled by a TPU or GPU
    compiler (XLA's CPU backend runs every collective synchronously, which says nothing of
    an accelerator's schedule); 0 otherwise."""
    platform = workload.compiled_by.split(" ", 1)[0]
    if not platform or platform == "cpu":
        return 0.0
    return sum(
        c.count * t
        for c, _, t in _collective_times(workload, preset, devices)
        if c.is_async is False
    )


def comm_time(workload: Workload, preset: Preset, devices: int) -> tuple[float, str]:
    """Total collective seconds per step on `devices`, and the algorithms chosen.

    Each collective is costed over its group's devices `stride` apart (`Collective.stride`),
    which sets how many members share a node and so how much crosses the network.
    """
    total = 0.0
    chosen: dict[str, int] = {}
    for c, name, t in _collective_times(workload, preset, devices):
        total += c.count * t
        if name != "none":
            chosen[name] = chosen.get(name, 0) + c.count
    if not chosen:
        return total, "-"
    if len(chosen) == 1:
        return total, next(iter(chosen))
    return total, ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items()))


def op_seconds(kind: str, nbytes: float, group: int, groups: str, preset: Preset) -> float:
    """Seconds of one op of a compiled collective (a comm report's row, or one collective of
    its schedule: its HLO kind, result bytes, devices a group and groups text) on `preset`,
    as `comm_time` prices the report's rows where they were compiled: a reduce-scatter's
    result is one shard of the buffer; the members `group_stride` apart (1 where the text
    does not say)."""
    kind = cost_kind(kind)
    full = nbytes * (group if kind == "reduce-scatter" else 1)
    return best_algorithm(kind, full, group, preset, group_stride(groups or "") or 1)[1]


def exposed_source(hidden_share: float | None, overlap: float, max_overlap: float = 1.0) -> str:
    """What decides the exposed communication: a compiler's schedule (a comm report's
    hidden share) where there is one; else nothing hidden where the preset hides nothing
    (`max_overlap` 0: a TPU's), else the assumed overlap (at most `max_overlap`)."""
    if hidden_share is not None:
        return "compiler schedule"
    if max_overlap <= 0:
        return NONE_HIDDEN
    return f"assumed overlap {min(overlap, max_overlap):g}"


NONE_HIDDEN = "none hidden (a TPU preset: the compiler leaves its collectives synchronous)"


def exposed_seconds(
    workload: Workload, preset: Preset, devices: int, comm: float, compute: float, overlap: float
) -> float:
    """The collective seconds `comm` not hidden behind compute: comm x (1 - hidden share)
    where a TPU or GPU compiler's schedule says what it hides, else the synchronous
    collectives whole and the rest less min(overlap, max_overlap) of the backward pass."""
    if workload.hidden_share is not None:  # the compiler's schedule, not an assumption
        return comm * (1.0 - workload.hidden_share)
    hidden = min(overlap, preset.max_overlap) * workload.backward_fraction * compute
    sync = sync_comm_time(workload, preset, devices)  # exposed whatever the overlap
    return sync + max(0.0, comm - sync - hidden)


def devices_problem(preset: Preset, devices: int, workload: Workload | None = None) -> str | None:
    """Why `preset` cannot model `devices` devices, else None: more than the most it models
    (`max_devices`: a TPU without a DCN figure, one slice), or, on a TPU beyond one slice,
    not whole slices (`devices_per_node` chips each), or a `workload` whose axes other than
    data would cross slices: only data crosses them (as compile and plan lay a mesh out)."""
    if preset.max_devices and devices > preset.max_devices:
        return (
            f"{devices} devices is more than {preset.name} models: one slice of at most "
            f"{preset.max_devices:,} chips, as the chip table has no DCN bandwidth for the "
            "traffic between slices"
        )
    slice_size = preset.devices_per_node
    if not preset.torus_dims or devices <= slice_size:
        return None
    if devices % slice_size:
        down, up = devices // slice_size * slice_size, (devices // slice_size + 1) * slice_size
        return (
            f"{devices} devices is more than {preset.name}'s largest slice ({slice_size:,} "
            f"chips) and not whole slices of it joined over DCN; use a multiple of "
            f"{slice_size}, e.g. {down} or {up}"
        )
    if workload is not None and workload.grows != "data":
        return (
            f"{devices} devices is more than {preset.name}'s largest slice ({slice_size:,} "
            f"chips), and the comm report's mesh {workload.mesh} grows {workload.grows} with "
            "the devices, while only data crosses slices; use at most "
            f"{slice_size} devices, or a comm report with data > 1"
        )
    if workload is not None and workload.devices_multiple > slice_size:
        return (
            f"{devices} devices is more than {preset.name}'s largest slice ({slice_size:,} "
            f"chips), and the comm report's mesh {workload.mesh} keeps "
            f"{workload.devices_multiple} devices on its axes other than data, which would "
            "cross slices, while only data crosses them; use at most "
            f"{slice_size} devices, or a comm report of a smaller fsdp x model"
        )
    return None


def predict_step(
    workload: Workload,
    preset: Preset,
    devices: int,
    per_device_batch: int,
    image_size: int,
    overlap: float = 0.8,
    efficiency: float | None = None,
) -> StepPrediction:
    """Step time on `devices` devices (weak scaling: fixed per-device batch).

    compute = FLOPs per device per step / (peak * efficiency)
    exposed = max(0, comm - overlap * backward_fraction * compute), or, where a TPU or
      GPU compiler's schedule says what it hides (`Workload.hidden_share`),
      comm * (1 - hidden_share) whatever the overlap
    step = max(compute + exposed, input, floor);  images/s = global batch / step
    scaling efficiency = images/s / (devices * images/s of one device) = compute / step
    """
    if devices < 1:
        raise ValueError("devices must be >= 1")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    m = workload.model_parallel
    if devices % m:
        raise ValueError(f"{devices} devices is not a multiple of the model-parallel size {m}")
    problem = devices_problem(preset, devices, workload)
    if problem:  # nothing priced across slices the preset or the mesh cannot have
        raise ValueError(problem)
    eff = preset.efficiency if efficiency is None else efficiency
    if not eff > 0:
        raise ValueError(f"efficiency must be positive, got {eff}")
    compute = compute_seconds(workload, preset, per_device_batch, image_size, eff)
    param = param_seconds(workload, preset)
    comm, algos = comm_time(workload, preset, devices)
    exposed = exposed_seconds(workload, preset, devices, comm, compute, overlap)
    # The input runs ahead of the device (prefetch), so it only shows when it is slower.
    images = per_device_batch / m  # each device's share of the global batch
    input_s = input_seconds(preset, images, image_size)
    step = max(compute + param + exposed, input_s, preset.step_floor_s)
    global_batch = devices // m * per_device_batch
    images_per_s = global_batch / step
    # one device runs the whole model (m times one device's share) and decodes its batch
    single = per_device_batch / max(
        m * compute + param,
        input_seconds(preset, per_device_batch, image_size),
        preset.step_floor_s,
    )
    scaling = images_per_s / (devices * single)
    assert scaling <= 1.0 + 1e-9, (scaling, compute, step)
    scaling = min(scaling, 1.0)
    return StepPrediction(
        devices=devices,
        nodes=Topology.of(devices, preset.devices_per_node).nodes,
        per_device_batch=per_device_batch,
        image_size=image_size,
        global_batch=global_batch,
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        step_s=step,
        images_per_s=images_per_s,
        efficiency=scaling,
        algorithms=algos,
        input_s=input_s,
        overhead_s=preset.step_overhead_s,
        param_s=param,
    )


def startup_seconds(preset: Preset, devices: int, images_per_epoch: int) -> float:
    """What a timed run spends before its steady state: the preset's fixed start-up plus
    the first epoch's decode of each host's share of the data (not yet cached)."""
    out = preset.startup_s
    if preset.startup_images_per_s_per_host > 0:
        hosts = math.ceil(devices / max(1, preset.chips_per_host))
        out += images_per_epoch / hosts / preset.startup_images_per_s_per_host
    return out


def compute_seconds(
    workload: Workload, preset: Preset, per_device_batch: int, image_size: int, efficiency: float
) -> float:
    """One device's train step without communication: the fixed overhead plus its ideal
    seconds (`ideal_seconds`) at `efficiency`."""
    ideal = ideal_seconds(workload, preset, per_device_batch, image_size)
    return preset.step_overhead_s + ideal / efficiency


def ideal_seconds(
    workload: Workload, preset: Preset, per_device_batch: int, image_size: int
) -> float:
    """One device's step at efficiency 1: its FLOPs at peak. The FLOPs are the compiler's
    at this batch where the workload has compiled counts at this image size (interpolated
    between the compiled batches, `compiled.interpolate`), else the analytic count. The
    compiled bytes accessed are not used: they are not HBM traffic (the bytes at the HBM
    bandwidth exceed the steps the calibration logs measured, docs/scaling.md)."""
    if workload.compiled_steps and image_size == workload.reference_image_size:
        points = [(b, f) for b, f, _ in workload.compiled_steps]
        return interpolate(points, per_device_batch) / preset.peak_flops
    return workload.step_flops(per_device_batch, image_size) / preset.peak_flops


def input_seconds(preset: Preset, images: float, image_size: int) -> float:
    """Host seconds to decode and augment `images` at `image_size` with the cores that feed
    one device; decode cost taken to scale with the output pixels (fused crop-decode from a
    pre-resized copy). 0 where the preset does not model its input."""
    rate = preset.input_images_per_s_per_core * preset.cores_per_device
    if rate <= 0:
        return 0.0
    return images / (rate * (preset.input_reference_size / image_size) ** 2)


# --------------------------------------------------------------------------------------------
# Curriculum and time to train
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """Train until `end_epoch` at `image_size` px with `per_device_batch` images per device."""

    end_epoch: float
    image_size: int
    per_device_batch: int


_STAGE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*:\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_stages(text: str) -> list[Stage]:
    """MoXing's curriculum syntax, `END_EPOCH:IMAGE_SIZE-PER_GPU_BATCH,...`.

    "20:128-224,38:224-224,40:288-128" -> epochs 0-20 at 128 px batch 224, 20-38 at 224 px
    batch 224, 38-40 at 288 px batch 128. End epochs must increase.
    """
    stages = []
    prev = 0.0
    for part in text.split(","):
        if not part.strip():
            continue
        m = _STAGE_RE.match(part)
        if not m:
            raise ValueError(
                f"bad stage {part!r}: expected END_EPOCH:IMAGE_SIZE-PER_GPU_BATCH, e.g. 20:128-224"
            )
        end, size, batch = float(m.group(1)), int(m.group(2)), int(m.group(3))
        if end <= prev:
            raise ValueError(f"stage end epochs must increase: {end:g} after {prev:g}")
        if size <= 0 or batch <= 0:
            raise ValueError(f"bad stage {part!r}: size and batch must be positive")
        stages.append(Stage(end, size, batch))
        prev = end
    if not stages:
        raise ValueError("no stages given")
    return stages


def format_stages(stages: Sequence[Stage]) -> str:
    return ",".join(f"{s.end_epoch:g}:{s.image_size}-{s.per_device_batch}" for s in stages)


# The largest global batches at which ResNet-50 has been published reaching the MLPerf
# target (75.9% top-1) on ImageNet, with the epochs it took (the epoch of the last
# evaluation in each result log): epochs grow with the batch, and past the largest no run
# says how many it would take, so the model predicts no time to train there.
PUBLISHED_CONVERGED_BATCHES = {
    3200: (35, "MLPerf v3.0 NVIDIA, 8 x DGX H100"),
    4096: (60, "MLPerf v0.6 Google, TPU v3-32"),
    16384: (64, "MLPerf v0.6 Google, TPU v3-128"),
    20480: (50, "MLPerf v3.0 NVIDIA, 64 x DGX H100"),
    32768: (76, "MLPerf v0.6 Google, TPU v3-1024"),
    55296: (80, "MLPerf v2.0 Google, TPU v4-6912"),
    57344: (77, "MLPerf v3.0 CoreWeave, 448 x HGX H100"),
    65536: (92, "MLPerf v0.7 Google, TPU v3-8192, JAX (LARS)"),
}
MAX_CONVERGED_BATCH = max(PUBLISHED_CONVERGED_BATCHES)


def beyond_converged_batch(stages: Sequence[Stage], devices: int, model_parallel: int = 1) -> bool:
    """Whether a stage's global batch on `devices` is beyond any published converged
    ImageNet batch (`MAX_CONVERGED_BATCH`): its epochs to the target are unknown."""
    replicas = devices // model_parallel
    return any(st.per_device_batch * replicas > MAX_CONVERGED_BATCH for st in stages)


def stage_global_batch(stage: Stage, devices: int, model_parallel: int = 1) -> int:
    """A stage's global batch on `devices`: its batch per batch-shard device times the
    batch-shard devices (data x fsdp: the devices over the model-parallel size)."""
    return devices // model_parallel * stage.per_device_batch


def over_one_epoch(
    stages: Sequence[Stage], devices: int, images_per_epoch: int, model_parallel: int = 1
) -> int | None:
    """The first stage's global batch on `devices` that is more than one epoch's images,
    else None: the trainer runs full batches only, so such a stage has no step to take
    (`config.curriculum.plan_stages` refuses it)."""
    for st in stages:
        batch = stage_global_batch(st, devices, model_parallel)
        if batch > images_per_epoch:
            return batch
    return None


def trainer_plan(
    stages: Sequence[Stage], devices: int, images_per_epoch: int, model_parallel: int = 1
) -> curriculum.StagePlan:
    """`stages` on `devices` as the trainer plans them (`config.curriculum.plan_stages`),
    an epoch being `images_per_epoch` images: its full batches, the last partial one left
    out. A ValueError (`ConfigError`) where a global batch is more than one epoch."""
    planned = [
        curriculum.Stage(st.end_epoch, st.image_size,
                         stage_global_batch(st, devices, model_parallel), 1.0)
        for st in stages
    ]  # fmt: skip
    return curriculum.plan_stages(planned, lambda batch: images_per_epoch // batch)


def no_step_stage(
    stages: Sequence[Stage], devices: int, images_per_epoch: int, model_parallel: int = 1
) -> str | None:
    """The trainer's refusal of a stage that rounds to no step on `devices`
    (`config.curriculum.check_every_stage_trains`), else None; None too where a global
    batch is more than one epoch (`over_one_epoch` says that)."""
    if over_one_epoch(stages, devices, images_per_epoch, model_parallel) is not None:
        return None
    try:
        curriculum.check_every_stage_trains(
            trainer_plan(stages, devices, images_per_epoch, model_parallel)
        )
    except ConfigError as e:
        return str(e)
    return None


def stage_steps(
    stages: Sequence[Stage], devices: int, images_per_epoch: int, model_parallel: int = 1
) -> list[int]:
    """Each stage's steps as the trainer plans them (`trainer_plan`): round((end - start
    epoch) * full steps an epoch), the first stage at least one. A ValueError where a
    global batch is more than one epoch, or where a stage rounds to no step (the trainer
    refuses both)."""
    batch = over_one_epoch(stages, devices, images_per_epoch, model_parallel)
    if batch is not None:
        raise ValueError(
            f"a global batch of {batch:,} on {devices} devices is more than one epoch of "
            f"{images_per_epoch:,} images: the trainer runs full batches only, so it takes no "
            "step; lower the per-device batch or the devices (or train on more images)"
        )
    plan = trainer_plan(stages, devices, images_per_epoch, model_parallel)
    curriculum.check_every_stage_trains(plan)
    return [s.num_steps for s in plan.stages]


@dataclass(frozen=True)
class TrainPrediction:
    devices: int
    total_s: float
    train_s: float
    eval_s: float
    epochs: float
    stages: tuple[tuple[Stage, StepPrediction, float], ...]  # (stage, step, seconds)
    startup_s: float = 0.0
    size_change_s: float = 0.0  # all the changes of image size together

    def parts(self) -> dict[str, float]:
        """`total_s` by what it is spent on: each stage's steps split as
        `StepPrediction.parts`, the evaluation (`eval`), the start-up (`startup`) and the
        changes of image size (`size change`)."""
        out = dict.fromkeys(("compute", "param", "fixed", "comm", "input", "floor"), 0.0)
        for _, step, secs in self.stages:
            for k, v in step.parts().items():
                out[k] += v * secs / step.step_s
        out["eval"] = self.eval_s
        out["startup"] = self.startup_s
        out["size change"] = self.size_change_s
        return out


@dataclass(frozen=True)
class Evaluation:
    """The evaluation passes on the training clock: one every `every_epochs` epochs (0:
    none), each over `images` at `image_size`, `per_device_batch` images per device."""

    every_epochs: float = 0.0
    images: int = IMAGENET_EVAL_IMAGES
    image_size: int = 224
    per_device_batch: int = 256


def eval_pass_s(workload: Workload, preset: Preset, devices: int, ev: Evaluation) -> float:
    """One evaluation pass: its steps, each a forward pass (1/TRAIN_FLOPS_FACTOR of a train
    step at that size and batch, overhead included), its input or the per-step floor,
    whichever is slowest, plus the preset's fixed cost per pass."""
    m = workload.model_parallel
    per_step = devices // m * ev.per_device_batch
    steps = math.ceil(ev.images / per_step)
    train = compute_seconds(workload, preset, ev.per_device_batch, ev.image_size, preset.efficiency)
    forward = train / TRAIN_FLOPS_FACTOR
    step = max(
        forward,
        input_seconds(preset, ev.per_device_batch / m, ev.image_size),
        preset.step_floor_s,
    )
    return steps * step + preset.eval_overhead_s


def time_to_train(
    workload: Workload,
    preset: Preset,
    devices: int,
    stages: Sequence[Stage],
    images_per_epoch: int = IMAGENET_TRAIN_IMAGES,
    overlap: float = 0.8,
    efficiency: float | None = None,
    eval_s_per_epoch: float = 0.0,
    evaluation: Evaluation | None = None,
    whole_steps: bool = True,
) -> TrainPrediction:
    """Sum over stages of the stage's steps (`stage_steps`: whole steps of full batches, as
    the trainer plans them) * the step at that stage, plus `eval_s_per_epoch` for every
    epoch trained, the passes of `evaluation`, the preset's start-up (`startup_seconds`)
    and its cost per change of image size. A ValueError where a global batch is more than
    one epoch or a stage rounds to no step. `whole_steps=False`: (end - start epochs) *
    images per epoch / images/s, for another trainer that does not count its steps this way
    (the published runs of `validation`)."""
    m = workload.model_parallel
    steps = stage_steps(stages, devices, images_per_epoch, m) if whole_steps else None
    start = 0.0
    parts = []
    train_s = 0.0
    for i, st in enumerate(stages):
        step = predict_step(
            workload, preset, devices, st.per_device_batch, st.image_size, overlap, efficiency
        )
        if steps is not None:
            secs = steps[i] * step.step_s
        else:
            secs = (st.end_epoch - start) * images_per_epoch / step.images_per_s
        parts.append((st, step, secs))
        train_s += secs
        start = st.end_epoch
    epochs = stages[-1].end_epoch
    eval_s = eval_s_per_epoch * epochs
    if evaluation is not None and evaluation.every_epochs > 0:
        passes = math.floor(epochs / evaluation.every_epochs + 1e-9)
        eval_s += passes * eval_pass_s(workload, preset, devices, evaluation)
    startup = startup_seconds(preset, devices, images_per_epoch)
    changes = sum(a.image_size != b.image_size for a, b in zip(stages, stages[1:]))
    size_change = changes * preset.size_change_s
    total = train_s + eval_s + startup + size_change
    return TrainPrediction(
        devices, total, train_s, eval_s, epochs, tuple(parts), startup, size_change
    )
