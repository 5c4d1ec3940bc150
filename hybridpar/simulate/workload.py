"""Workloads: what one device computes and communicates per training step.

Two sources: the analytic ResNet-50 data-parallel step (`resnet50_workload`: one fused
gradient all-reduce, split into buckets) and a compiled step's collectives and FLOPs read
from `python -m hybridpar.comm_report --json` (`load_comm_report`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_EVAL_IMAGES = 50_000

RESNET50_PARAMS = 25_557_032  # torchvision/Flax ResNet-50, 1,000 classes, incl. BN gamma/beta
RESNET50_FWD_FLOPS_224 = 8.2e9  # 4.1 G multiply-adds forward at 224 px, 2 FLOPs each
TRAIN_FLOPS_FACTOR = 3.0  # forward + backward (backward ~2x forward)
BACKWARD_FRACTION = 2.0 / 3.0  # share of the step's compute that is the backward pass

GRAD_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step.

    nbytes: the full (unsharded) buffer n of ONE op: the all-reduced buffer, the input of a
      reduce-scatter, the output of an all-gather, one device's buffer for all-to-all/permute.
    group_size: devices per replica group; None means the group grows with the simulated
      device count: all data-parallel replicas (devices / model_parallel), or all devices
      when `spans_all`.
    """

    kind: str
    count: int
    nbytes: float
    group_size: int | None = None
    is_async: bool | None = None
    spans_all: bool = False


@dataclass(frozen=True)
class Workload:
    """What one device does per step: FLOPs per image and the collectives.

    flops_per_image: forward + backward FLOPs per image per device at `reference_image_size`
      (scaled by (image_size / reference_image_size)^2 for other sizes).
    model_parallel: devices per model replica (1 for pure data parallelism / FSDP).
    """

    name: str
    flops_per_image: float
    reference_image_size: int
    collectives: tuple[Collective, ...]
    model_parallel: int = 1
    backward_fraction: float = BACKWARD_FRACTION
    source: str = "analytic"
    reference_batch: float | None = None  # per-device batch the FLOPs were measured at

    def step_flops(self, per_device_batch: int, image_size: int) -> float:
        """FLOPs one device executes per step: batch * per-image FLOPs * (size/ref)^2."""
        scale = (image_size / self.reference_image_size) ** 2
        return self.flops_per_image * per_device_batch * scale

    def gradient_bytes(self) -> float:
        return sum(c.count * c.nbytes for c in self.collectives)


def bucket_sizes(total_bytes: float, bucket_bytes: float | None) -> list[float]:
    """Split a flat gradient of `total_bytes` into buckets of at most `bucket_bytes`.

    Full buckets first, then the remainder; None or <= 0 means one fused buffer.
    """
    if not bucket_bytes or bucket_bytes <= 0 or bucket_bytes >= total_bytes:
        return [float(total_bytes)]
    full = int(total_bytes // bucket_bytes)
    rest = total_bytes - full * bucket_bytes
    return [float(bucket_bytes)] * full + ([float(rest)] if rest > 0 else [])


def resnet50_workload(grad_dtype: str = "fp32", bucket_mb: float | None = 32.0) -> Workload:
    """Analytic ResNet-50 data-parallel training step on ImageNet.

    25.56M parameters -> gradient bytes 102.2 MB in fp32 (51.1 MB in bf16/fp16), reduced as
    fused all-reduces of at most `bucket_mb` MB (BatchNorm statistics local: no extra
    collectives). Forward 4.1 G multiply-adds = 8.2 GFLOP at 224 px, x3 for training.
    """
    if grad_dtype not in GRAD_BYTES:
        raise ValueError(f"grad dtype {grad_dtype!r}: choose from {sorted(GRAD_BYTES)}")
    total = RESNET50_PARAMS * GRAD_BYTES[grad_dtype]
    bucket = None if bucket_mb is None else bucket_mb * 1e6
    sizes = bucket_sizes(total, bucket)
    # group buckets of equal size into one Collective with a count
    groups: dict[float, int] = {}
    for s in sizes:
        groups[s] = groups.get(s, 0) + 1
    colls = tuple(Collective("all-reduce", c, s, None, True) for s, c in groups.items())
    return Workload(
        name=f"resnet50 (analytic, {grad_dtype} gradients, "
        f"{len(sizes)} bucket{'s' if len(sizes) > 1 else ''})",
        flops_per_image=RESNET50_FWD_FLOPS_224 * TRAIN_FLOPS_FACTOR,
        reference_image_size=224,
        collectives=colls,
        source="analytic",
    )


_KIND_ALIASES = {
    "all-reduce": "all-reduce",
    "allreduce": "all-reduce",
    "all_reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "reducescatter": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all-gather": "all-gather",
    "allgather": "all-gather",
    "all_gather": "all-gather",
    "all-to-all": "all-to-all",
    "alltoall": "all-to-all",
    "all_to_all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective_permute": "collective-permute",
    "collective-broadcast": "collective-permute",
}


def _group_size(groups, default: int) -> int:
    """Replica-group size from comm_report's `groups` field, in any of its likely spellings.

    Accepts a list of lists ([[0,1,2,3],[4,5,6,7]]), an int (the size), a dict with
    `group_size`, or HLO text: "{{0,1,2,3},{4,5,6,7}}", comm_report's shortened
    "2x4 {{0,1,2,3},...}", or the iota form "[2,4]<=[8]" (2 groups of 4). Empty, missing,
    "{} (all devices)" or "N source-target pairs" -> `default` (every device).
    """
    if groups is None or groups == "" or groups == [] or groups == "{}":
        return default
    if isinstance(groups, str) and (
        groups.startswith("{}") or "all devices" in groups or "source-target" in groups
    ):
        return default
    if isinstance(groups, bool):
        raise TypeError(f"bad replica groups {groups!r}")
    if isinstance(groups, int):
        return groups
    if isinstance(groups, dict):
        if "group_size" in groups:
            return int(groups["group_size"])
        raise ValueError(f"replica groups dict without group_size: {groups!r}")
    if isinstance(groups, (list, tuple)):
        first = groups[0]
        if isinstance(first, (list, tuple)):
            return len(first) if len(first) else default
        return len(groups)  # a single flat group
    if isinstance(groups, str):
        s = groups.strip()
        m = re.search(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=", s)
        if m:
            return int(m.group(2))
        m = re.search(r"[\[{]\s*[\[{]([^\]}]*)[\]}]", s)
        if m:
            ids = [x for x in re.split(r"[,\s]+", m.group(1)) if x]
            return len(ids) if ids else default
        if s.isdigit():
            return int(s)
    raise ValueError(f"cannot read replica groups {groups!r}")


def _mesh_sizes(mesh, devices: int) -> tuple[int, int]:
    """(batch-axis devices, model-parallel devices) from comm_report's `mesh` field.

    `data` and `fsdp` are batch axes (GUIDE: BATCH_AXES); every other axis multiplies the
    devices per model replica. Accepts {"data": 4, "model": 2}, "data:4,model:2" or a list of
    [name, size] pairs; missing -> pure data parallelism over `devices`.
    """
    if not mesh:
        return devices, 1
    if isinstance(mesh, str):
        pairs = []
        for part in mesh.split(","):
            name, _, size = part.partition(":")
            pairs.append((name.strip(), int(size)))
    elif isinstance(mesh, dict):
        # {"data": 4, "model": 2} or {"axis_names": [...], "shape": [...]}
        if "axis_names" in mesh and "shape" in mesh:
            pairs = list(zip(mesh["axis_names"], mesh["shape"]))
        elif "axes" in mesh and isinstance(mesh["axes"], dict):
            pairs = list(mesh["axes"].items())
        else:
            pairs = list(mesh.items())
    else:
        pairs = [tuple(p) for p in mesh]
    batch = model = 1
    for name, size in pairs:
        size = int(size)
        if size == -1:
            continue
        if name in ("data", "fsdp"):
            batch *= size
        else:
            model *= size
    if batch * model != devices and devices:
        batch = max(1, devices // model)
    return batch, model


def workload_from_report(
    report: dict, per_device_batch: int | None = None, image_size: int | None = None
) -> Workload:
    """A Workload from `python -m hybridpar.comm_report --json` output.

    The report gives, for one step: `collectives` [{kind, count, bytes, groups, async}],
    `total_bytes`, `flops` (one device's share), `mesh`, `devices`.
    - FLOPs per image = flops / per-device batch, at the report's image size. The batch and
      size are read from the report's `per_device_batch` / `image_size` (or `global_batch`
      divided by the batch-axis devices) when present, else taken from the arguments (the CLI
      passes --per-device-batch / --image-size, which must then describe the compiled step).
    - `bytes` is per op when sum(count * bytes) == total_bytes (or no total is given), else
      it is read as the total over `count` ops. It is the HLO result size: for a
      reduce-scatter that is one shard, so the full buffer is bytes * group size (an explicit
      `full_bytes` key wins).
    - The group size is the entry's `group_size` when present (None: all devices), else read
      from `groups`. A collective whose group spans all batch-axis devices (or all devices)
      grows with the simulated device count; a smaller group (a `model` axis) keeps its size.
    - `devices` may be a number or comm_report's {"count": N, ...}; the image size may come
      as `image_size` or `image_shape` [h, w, c].
    - `-done` halves of async pairs are skipped (their `-start` carries the bytes).
    """
    devices = report.get("devices") or 0
    if isinstance(devices, dict):  # comm_report: {"count": N, "platform": ..., ...}
        devices = devices.get("count") or 0
    devices = int(devices)
    batch_devs, model = _mesh_sizes(report.get("mesh"), devices)
    if not devices:
        devices = batch_devs * model
    colls_in = report.get("collectives") or []
    total_bytes = report.get("total_bytes")
    per_op_guess = [float(c.get("bytes", 0)) * int(c.get("count", 1)) for c in colls_in]
    bytes_are_totals = (
        total_bytes is not None
        and colls_in
        and not math.isclose(sum(per_op_guess), float(total_bytes), rel_tol=1e-6)
        and math.isclose(
            sum(float(c.get("bytes", 0)) for c in colls_in), float(total_bytes), rel_tol=1e-6
        )
    )
    colls = []
    for c in colls_in:
        raw_kind = str(c["kind"]).lower().strip()
        if raw_kind.endswith(("-done", "_done")):
            continue
        base = re.sub(r"[-_]start$", "", raw_kind)
        kind = _KIND_ALIASES.get(base)
        if kind is None:
            raise ValueError(f"unknown collective kind {c['kind']!r} in the comm report")
        count = int(c.get("count", 1))
        if count <= 0:
            continue
        nbytes = float(c.get("bytes", 0))
        if bytes_are_totals:
            nbytes /= count
        if "group_size" in c:  # comm_report's own reading of the groups; None = all devices
            group = int(c["group_size"]) if c["group_size"] else devices
        else:
            group = _group_size(c.get("groups"), devices)
        if kind == "reduce-scatter" and "full_bytes" not in c:
            nbytes *= group
        if "full_bytes" in c:
            nbytes = float(c["full_bytes"])
        spans_all = group >= devices
        scales = spans_all or group >= batch_devs
        colls.append(
            Collective(kind, count, nbytes, None if scales else group, c.get("async"), spans_all)
        )
    b = report.get("per_device_batch")
    if b is None and report.get("global_batch") is not None:
        b = report["global_batch"] / batch_devs
    if b is None:
        b = per_device_batch
    size = report.get("image_size")
    if size is None and report.get("image_shape"):
        size = report["image_shape"][0]  # comm_report: [height, width, channels]
    if size is None:
        size = image_size
    if b is None or size is None:
        raise ValueError("the comm report names no batch/image size: pass them explicitly")
    flops = float(report.get("flops") or 0.0)
    if flops <= 0:
        raise ValueError("the comm report has no positive `flops`")
    return Workload(
        name=f"comm_report ({len(colls)} collective kinds, mesh {report.get('mesh')})",
        flops_per_image=flops / float(b),
        reference_image_size=int(size),
        collectives=tuple(colls),
        model_parallel=model,
        source="comm_report",
        reference_batch=float(b),
    )


def load_comm_report(path: str, per_device_batch=None, image_size=None) -> Workload:
    with open(path) as f:
        text = f.read()
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        # tolerate a human-readable preamble: take the last line that parses as an object
        report = None
        for line in reversed(text.strip().splitlines()):
            try:
                report = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
        if report is None:
            raise ValueError(f"{path}: no JSON object found") from None
    return workload_from_report(report, per_device_batch, image_size)
