"""Workloads: what one device computes and communicates per training step.

Two sources: the analytic ResNet-50 data-parallel step (`resnet50_workload`: one fused
gradient all-reduce, split into buckets) and a compiled step's collectives and FLOPs read
from `python -m hybridpar.comm_report --json` (`load_comm_report`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hybridpar.runtime.comm_report_schema import CommReport

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_EVAL_IMAGES = 50_000
# scikit-learn's digits: the train part of the fixed 80/20 split (hybridpar.input.arrays),
# known without the data, as hybridpar.runtime.executables.data_size finds it
DIGITS_TRAIN_IMAGES = 1_437
DIGITS_EVAL_IMAGES = 360  # and its test part

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
    stride: devices between consecutive members of a group, in device order (the order
      that fills a node first). 1: contiguous (a group over the innermost axes, or over all
      devices). A group over the batch axes has the product of the sizes of the axes that
      vary faster than them: `Workload.model_parallel` on our meshes, whose model axis is
      the innermost (hybridpar.parallel.mesh). It decides how many members share a node
      (`cost.members_per_node`), so how much of the collective crosses the network.
    """

    kind: str
    count: int
    nbytes: float
    group_size: int | None = None
    is_async: bool | None = None
    spans_all: bool = False
    stride: int = 1


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
    compiled_by: str = ""  # the compiler that counted a comm report's FLOPs and collectives
    params: int = 0  # parameters per device, for the per-parameter work (0: not modelled)
    # the compiler's counts of this step per device at `reference_image_size`, at several
    # per-device batches: ((batch, FLOPs, bytes accessed), ...) (hybridpar.simulate.compiled);
    # () where none was compiled: FLOPs from `flops_per_image`
    compiled_steps: tuple[tuple[int, float, float], ...] = ()
    # the share of the collectives' bytes a TPU or GPU compiler's schedule hides behind
    # compute, by estimate (a comm report's bytes_hidden_est / total_bytes); None where no
    # such schedule was read: `overlap` decides
    hidden_share: float | None = None
    # a simulated device count is a multiple of it: the devices of a comm report's axes
    # that keep their size as its data axis grows (fsdp x model; model alone where data is
    # 1, as fsdp then grows in its place); the mesh it says, e.g. "data:8,fsdp:4,model:2"
    devices_multiple: int = 1
    mesh: str = ""
    # the batch axis that grows with the device count: data, or fsdp where a comm report's
    # data axis is 1 (only data crosses a TPU's slices: `step.devices_problem`)
    grows: str = "data"

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
        params=RESNET50_PARAMS,
    )


# hybridpar.parallel.mesh.BATCH_AXES, restated: importing hybridpar.parallel.mesh would start JAX
_BATCH_AXES = ("data", "fsdp")

# comm_report's kinds (comm_report.KINDS) -> the cost model's
_COST_KIND = {
    "all-reduce": "all-reduce",
    "all-gather": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",  # costed at its full output buffer: an upper bound
    "collective-permute": "collective-permute",
    "collective-broadcast": "collective-permute",  # one send from the root to each peer
}


def cost_kind(kind: str) -> str:
    """The cost model's kind of a comm report's collective kind (`_COST_KIND`)."""
    if kind not in _COST_KIND:
        raise ValueError(f"unknown collective kind {kind!r} in the comm report")
    return _COST_KIND[kind]


def inner_size(mesh: dict[str, int], axes: tuple[str, ...]) -> int:
    """Devices between consecutive members of a group over `axes` of `mesh`: the product of
    the sizes of the axes after the innermost of `axes` that has more than one device.

    `mesh` lists its axes outermost first, as comm_report writes `mesh.shape`, and the last
    axis varies fastest in device order (hybridpar.parallel.mesh: data, fsdp, model, so that model's
    groups sit inside a node). A group over `data` on data:8,model:8 has stride 8; on
    data:64 stride 1; 1 also when none of `axes` has more than one device.
    """
    names = list(mesh)
    used = [i for i, a in enumerate(names) if a in axes and mesh[a] > 1]
    if not used:
        return 1
    return math.prod(mesh[a] for a in names[used[-1] + 1 :])


_IOTA_IDS = r"\[([\d,]+)\](?:T\(([\d,]+)\))?"  # XLA's iota(N).reshape(dims).transpose(T)
_IOTA = re.compile(r"^\[([\d,]+)\]<=" + _IOTA_IDS + "$")
_MESH_GROUPS = re.compile(r"^mesh\[([\d,]+)\](?: ids (.+))? over axis ([\d,]+)$")
_LISTED = re.compile(r"\{\{([\d,.]+)\}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def iota_element(dims: list[int], perm: list[int] | None, k: int) -> int:
    """Element k (row-major) of XLA's iota device list ``[dims]T(perm)``: iota(N) reshaped
    to `dims`, transposed by `perm` (None: not transposed), flattened."""
    perm = list(range(len(dims))) if perm is None else perm
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    pos = 0
    for axis in reversed(perm):  # the transposed array's last axis varies fastest
        k, r = divmod(k, dims[axis])
        pos += r * strides[axis]
    return pos


def _device_at(ids: str | None, k: int) -> int | None:
    """Device id at row-major position k of a mesh whose `ids` text comm_report printed
    ("[8,8]T(1,0)", or a full list "0,8,16"); the mesh's own order when None."""
    if ids is None:
        return k
    m = re.fullmatch(_IOTA_IDS, ids.strip())
    if m:
        return iota_element(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None, k)
    listed = [x.strip() for x in ids.strip("()").split(",")]
    if all(x.isdigit() for x in listed) and k < len(listed):
        return int(listed[k])
    return None


def group_stride(groups: str) -> int | None:
    """The stride of a collective's groups, read from comm_report's `groups` text: the first
    group's second member minus its first. None where the text does not say.

    - "mesh[8,8] over axis 0": groups over axes of the mesh's axes of size > 1 (outermost
      first); members 0 and 1 are the mesh positions 0 and 1 step along the innermost axis
      it is over. " ids [8,8]T(1,0)" (or a list) gives the device at each position (XLA
      prints it when the devices are not in the mesh's order); without it, position = id.
    - "[8,8]<=[64]", "[8,8]<=[8,8]T(1,0)": XLA's iota groups: the iota device list cut into
      rows of the group size.
    - "{{0,8,16,...,56},...}" (listed, maybe shortened with "..."): the listed members.
    - "{} (all devices)": 1. Source-target pairs or an empty text: None.
    """
    text = groups.strip()
    if text.startswith("{} "):
        return 1
    m = _MESH_GROUPS.match(text)
    if m:
        sizes, over = _ints(m.group(1)), _ints(m.group(3))
        step = math.prod(sizes[max(over) + 1 :])  # positions between members 0 and 1
        first, second = _device_at(m.group(2), 0), _device_at(m.group(2), step)
        return None if first is None or second is None else abs(second - first)
    m = _IOTA.match(text)
    if m:
        if _ints(m.group(1))[-1] < 2:
            return 1
        dims, perm = _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None
        return abs(iota_element(dims, perm, 1) - iota_element(dims, perm, 0))
    m = _LISTED.search(text)
    if m:
        ids = [x for x in m.group(1).split(",") if x and x != "..."]
        if len(ids) >= 2:
            return abs(int(ids[1]) - int(ids[0])) or None
        return 1
    return None


def workload_from_report(report: CommReport) -> Workload:
    """The step a comm_report describes, as a Workload.

    - FLOPs per image = `flops` (one device's share) / per-device batch, at the report's
      image size (`image_shape[0]`); the per-device batch is `global_batch` over the
      batch-axis (`data`, `fsdp`) devices. Every other mesh axis is model parallelism.
    - A row's `bytes` is one op's result: for a reduce-scatter that is one shard, so the
      full buffer is bytes x group size.
    - A row's stride is what its `groups` text says (`group_stride`); where it says
      nothing, a group of all batch-axis devices has the batch axes' stride in the mesh
      (`inner_size`: the model axes inside them), any other group 1.
    - A group over all batch-axis devices (at their stride) or all devices grows with the
      simulated device count; any other group (a `model` axis) keeps its size.
    - `hidden_share`: the report's hidden bytes over its collective bytes, where a TPU or
      GPU compiler scheduled it (XLA:CPU's schedule says nothing of an accelerator's).
    """
    devices = int(report.devices["count"])
    batch_devs = math.prod(n for a, n in report.mesh.items() if a in _BATCH_AXES)
    model = math.prod(n for a, n in report.mesh.items() if a not in _BATCH_AXES)
    if batch_devs * model != devices:
        raise ValueError(f"the comm report's mesh {report.mesh} is not its {devices} devices")
    batch_stride = inner_size(report.mesh, _BATCH_AXES)
    colls = []
    for c in report.collectives:
        kind = cost_kind(c.kind)
        group = c.group_size or devices
        nbytes = float(c.bytes) * (group if kind == "reduce-scatter" else 1)
        spans_all = group >= devices
        stride = group_stride(c.groups)
        if stride is None:
            stride = batch_stride if group == batch_devs and not spans_all else 1
        # a model-axis group as large as the batch axes (data:8,model:8) is told apart by
        # its stride
        scales = spans_all or (group >= batch_devs and stride == batch_stride)
        colls.append(
            Collective(
                kind,
                c.count,
                nbytes,
                None if scales else group,
                c.is_async,
                spans_all,
                1 if spans_all else stride,
            )
        )
    if not report.flops or report.flops <= 0:
        raise ValueError(
            "the comm report has no positive `flops` (its backend's cost_analysis gave none)"
        )
    b = report.global_batch / batch_devs
    platform = report.devices.get("platform")
    grows = "fsdp" if report.mesh.get("data", 1) == 1 and report.mesh.get("fsdp", 1) > 1 else "data"
    fixed = [a for a in report.mesh if a != "data"] if report.mesh.get("data", 1) > 1 else [
        a for a in report.mesh if a not in _BATCH_AXES]  # fmt: skip
    kinds = len({c.kind for c in report.collectives})  # rows are per kind and size
    ops = sum(c.count for c in report.collectives)
    return Workload(
        name=f"comm_report ({kinds} collective kind{'s' * (kinds != 1)}, {ops} ops, "
        f"mesh {report.mesh})",
        flops_per_image=float(report.flops) / b,
        reference_image_size=int(report.image_shape[0]),
        collectives=tuple(colls),
        model_parallel=model,
        source="comm_report",
        reference_batch=float(b),
        compiled_by=f"{platform} ({report.devices.get('kind')})",
        hidden_share=report.hidden_share() if platform not in (None, "", "cpu") else None,
        devices_multiple=math.prod(report.mesh[a] for a in fixed),
        mesh=",".join(f"{a}:{n}" for a, n in report.mesh.items() if n > 1) or "data:1",
        grows=grows,
    )


def read_comm_report(path: str) -> CommReport:
    with open(path) as f:
        return CommReport.from_json(f.read(), source=path)


def load_comm_report(path: str) -> Workload:
    return workload_from_report(read_comm_report(path))


def report_images_per_epoch(report: CommReport) -> tuple[int | None, str]:
    """(training images per epoch, where that is said) of the run a comm report's config
    describes, or (None, why it does not say). Synthetic data's epoch is its
    data.train_examples; digits' is its fixed split; data read from files has the size of
    the files, which a compile without the data never saw."""
    data = report.config.get("data") or {}
    name = data.get("name")
    if name == "synthetic" and data.get("train_examples"):
        return int(data["train_examples"]), "the comm report's data.train_examples (synthetic)"
    if name == "digits":
        return DIGITS_TRAIN_IMAGES, "the comm report's data: digits, its train split"
    if name is None:
        return None, "its config names no data"
    return None, f"its data (data.name={name!r}) is read from files, whose size it does not hold"


def report_eval(report: CommReport, per_device_batch: int) -> dict | None:
    """``Evaluation``'s fields of the evaluation pass the run a comm report describes makes:
    its eval split (digits' test part, else the config's ``data.eval_examples``) at its image
    size, its eval batch per batch shard; None where the config does not say them. The
    shards: those of the compiled step's batch (``report.global_batch``, a stage's in a run
    with stages, whose config's ``global_batch`` is not used) at ``per_device_batch``."""
    config = report.config
    data = config.get("data") or {}
    if not (data.get("eval_examples") and config.get("eval_batch") and report.global_batch):
        return None
    images = DIGITS_EVAL_IMAGES if data.get("name") == "digits" else int(data["eval_examples"])
    batch = max(config["eval_batch"] * per_device_batch // report.global_batch, 1)
    return dict(images=images, image_size=int(data["image_size"]), per_device_batch=batch)


def report_epochs(report: CommReport) -> tuple[str | float | None, str]:
    """(the config's curriculum text, or its num_epochs, where that is said) of the run a
    comm report describes, or (None, why it does not say)."""
    config = report.config
    if config.get("stages"):
        return config["stages"], "the comm report's stages"
    if config.get("num_epochs"):
        return float(config["num_epochs"]), "the comm report's num_epochs"
    return None, "its config has no num_epochs"
