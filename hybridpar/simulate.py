"""Scaling model: predicted step time, throughput, scaling efficiency and time to train.

    python -m hybridpar.simulate [--preset h100] [--devices 8,16,...,4096]
        [--comm-report FILE] [--per-device-batch 256] [--image-size 224]
        [--stages "20:128-224,38:224-224,40:288-128"] [--overlap 0.8] [--png out.png] [--json]

The model (plain Python, no JAX; every number is per training step of data-parallel weak
scaling, i.e. the per-device batch stays fixed while devices are added):

    compute   = FLOPs per device per step / (peak FLOP/s * efficiency)
    comm      = sum over collectives of count * cost(cheapest algorithm)   (alpha-beta model)
    exposed   = max(0, comm - overlap * backward),   backward = 2/3 * compute
    step      = compute + exposed
    images/s  = global batch / step
    scaling efficiency = images/s(p) / (p * images/s(1))          (= compute / step <= 1)
    time to train = sum over curriculum stages of epochs * images per epoch / images/s(stage)
                    + epochs * eval seconds per epoch

`efficiency` is the fraction of peak a single device reaches on a ResNet-50 step; each preset
calibrates it from a stated single-device images/s (`calibrate`). The collectives come either
from the built-in analytic ResNet-50 data-parallel description (one fused gradient all-reduce,
split into buckets) or from `python -m hybridpar.comm_report --json` (`--comm-report FILE`).

What the model leaves out (see docs/scaling.md): the input pipeline, evaluation (except as a
fixed per-epoch cost), stragglers and jitter, link contention from other jobs, the cost of
image size on per-FLOP efficiency (small images run at a lower fraction of peak), compilation
and start-up.

FLOP convention: a multiply-add is 2 FLOPs, as in XLA's `cost_analysis` (so a comm_report
`flops` figure and the built-in ResNet-50 figure mean the same thing). The much-quoted
"4.1 GFLOPs" of a ResNet-50 forward pass at 224 px counts multiply-adds; in this convention it
is 8.2 GFLOP. Since `efficiency` is calibrated against a measured images/s, the convention
changes the reported fraction of peak, never a predicted time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

GB = 1e9  # bytes; link figures below are decimal GB/s as vendors quote them
GBIT = 1e9 / 8  # bytes per second in one Gb/s
US = 1e-6  # seconds
TFLOPS = 1e12

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_EVAL_IMAGES = 50_000

# --------------------------------------------------------------------------------------------
# Hardware presets (public spec figures; assumptions marked as such)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One level of interconnect in the alpha-beta model.

    bandwidth: bytes/s. For an intra-node link it is the per-device bus bandwidth a ring
      all-reduce reaches through each device (NCCL's "busbw"). For an inter-node link it is
      per node or per device, as `per` says (a DGX H100 has one 400 Gb/s NIC per GPU; an AWS
      p3.16xlarge has one 25 Gb/s interface for its 8 GPUs).
    latency: alpha, seconds per message step (one hop of a ring, one level of a tree).
    """

    bandwidth: float
    latency: float
    per: str = "device"  # "device" or "node"; only meaningful for inter-node links
    name: str = ""

    def __post_init__(self):
        if self.per not in ("device", "node"):
            raise ValueError(f"Link.per must be 'device' or 'node', got {self.per!r}")
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"bad link {self}")


@dataclass(frozen=True)
class Preset:
    """A device type, its node and its network.

    peak_flops: per device, dense, for the training dtype (`dtype`).
    reference_images_per_s / reference_image_size / reference_batch: the single-device
      ResNet-50 training rate that `efficiency` is calibrated from (see `calibrate`).
    efficiency: fraction of peak achieved by a ResNet-50 training step; filled in from the
      reference rate when the presets are built (`with_calibrated_efficiency`).
    devices_per_node: devices sharing the fast intra-node link (NVLink island, ICI domain).
    torus_dims: > 0 for TPU ICI, which is a 2D/3D torus rather than nodes + a switch.
    """

    name: str
    description: str
    peak_flops: float
    dtype: str
    grad_dtype: str  # the gradient dtype the reference recipe reduces
    devices_per_node: int
    intra: Link
    inter: Link
    reference_images_per_s: float
    reference_image_size: int = 224
    reference_batch: int = 256
    reference_note: str = ""
    torus_dims: int = 0
    efficiency: float = float("nan")

    def inter_bandwidth_per_node(self) -> float:
        """Bytes/s leaving one node (all of its NICs together)."""
        if self.inter.per == "node":
            return self.inter.bandwidth
        return self.inter.bandwidth * self.devices_per_node

    def scaled(self, intra: float = 1.0, inter: float = 1.0) -> Preset:
        """The same preset with link bandwidths multiplied (for what-if studies and tests)."""
        return dataclasses.replace(
            self,
            intra=dataclasses.replace(self.intra, bandwidth=self.intra.bandwidth * intra),
            inter=dataclasses.replace(self.inter, bandwidth=self.inter.bandwidth * inter),
        )


# Latency assumptions (alpha), not spec figures: NVLink ring step 3-5 us (NCCL "Simple"
# protocol, includes the kernel's per-step synchronisation); InfiniBand/RoCE with GPUDirect
# ~5 us; TCP sockets over Ethernet (NCCL's socket transport or Gloo in 2017-2018) ~25 us;
# TPU ICI ~2 us per hop.
_ETH_ALPHA = 25 * US
_IB_ALPHA = 5 * US

# V100 SXM2 16 GB (DGX-1V, AWS p3.16xlarge): 125 TFLOP/s fp16 tensor core (datasheet).
# NVLink 2: 6 links x 25 GB/s = 150 GB/s per direction per GPU; we take ~150 GB/s
# effective ring bandwidth within the node of 8 (NCCL measures ~130 on DGX-1V).
# Between nodes: 25 Gb/s (p3.16xlarge, the fast.ai runs) or 100 Gb/s Ethernet per node.
# Reference rate: ASSUMPTION ~1,200 images/s fp16 ResNet-50 at 224 px with DALI
# (MLPerf v0.5/v0.6-era MXNet figures for one V100).
_V100_25GBE = Preset(
    name="v100-25gbe",
    description="V100 SXM2 fp16, 8/node NVLink 2, 25 GbE per node (AWS p3.16xlarge)",
    peak_flops=125 * TFLOPS,
    dtype="float16",
    grad_dtype="fp16",
    devices_per_node=8,
    intra=Link(150 * GB, 5 * US, name="NVLink 2 (~150 GB/s ring)"),
    inter=Link(25 * GBIT, _ETH_ALPHA, per="node", name="25 GbE per node"),
    reference_images_per_s=1200.0,
    reference_note="ASSUMPTION: ~1,200 img/s fp16 at 224 px (MLPerf-era MXNet + DALI)",
)


# H100 SXM5 (DGX H100): 989 TFLOP/s bf16 dense (datasheet; 1,979 with sparsity).
# NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction per GPU.
# 8 x NDR InfiniBand 400 Gb/s, one per GPU.
# Reference rate: ASSUMPTION ~3,000 images/s bf16 at 224 px for a plain framework step
# (tuned MLPerf stacks reach more: see the H200 preset).
_H100 = Preset(
    name="h100",
    description="H100 SXM5 bf16, 8/node NVLink 4, NDR IB 400 Gb/s per GPU (DGX H100)",
    peak_flops=989 * TFLOPS,
    dtype="bfloat16",
    grad_dtype="bf16",
    devices_per_node=8,
    intra=Link(450 * GB, 3 * US, name="NVLink 4 (450 GB/s)"),
    inter=Link(400 * GBIT, _IB_ALPHA, per="device", name="NDR IB 400 Gb/s per GPU"),
    reference_images_per_s=3000.0,
    reference_note="ASSUMPTION: ~3,000 img/s bf16 at 224 px (plain framework step)",
)


_PRESET_LIST = [
    # P100 SXM2 (Goyal et al. 2017, Facebook "Big Basin": 8 P100 + NVLink per server, one
    # Mellanox ConnectX-4 50 Gb/s Ethernet NIC per server). Peak: 10.6 TFLOP/s fp32,
    # 21.2 TFLOP/s fp16 (NVIDIA P100 datasheet); Goyal et al. trained in fp32.
    # NVLink 1: 4 links x 20 GB/s per direction per GPU; a ring uses part of them:
    # ASSUMPTION ~40 GB/s ring bus bandwidth.
    # Reference rate: the paper says backprop takes 120 ms per GPU at 32 images; with the
    # backward pass = 2/3 of the step that is 180 ms per 32 images = ~178 images/s (fp32, 224 px).
    Preset(
        name="p100-50gbe",
        description="P100 SXM2 fp32, 8/node NVLink 1, 50 GbE per node (Goyal et al. 2017)",
        peak_flops=10.6 * TFLOPS,
        dtype="float32",
        grad_dtype="fp32",
        devices_per_node=8,
        intra=Link(40 * GB, 5 * US, name="NVLink 1 (~40 GB/s ring, assumed)"),
        inter=Link(50 * GBIT, _ETH_ALPHA, per="node", name="50 GbE per node"),
        reference_images_per_s=32 / 0.180,
        reference_batch=32,
        reference_note="Goyal et al. 2017: backprop 120 ms at 32 img/GPU -> step ~180 ms",
    ),
    _V100_25GBE,
    dataclasses.replace(
        _V100_25GBE,
        name="v100-100gbe",
        description="V100 SXM2 fp16, 8/node NVLink 2, 100 GbE per node",
        inter=Link(100 * GBIT, _ETH_ALPHA, per="node", name="100 GbE per node"),
    ),
    # A100 SXM4 (DGX A100): 312 TFLOP/s bf16 dense (datasheet). NVLink 3: 600 GB/s
    # bidirectional = 300 GB/s per direction per GPU, taken as the ring bus bandwidth.
    # 8 x HDR InfiniBand 200 Gb/s, one per GPU.
    # Reference rate: ASSUMPTION ~2,500 images/s bf16 at 224 px (MLPerf v1.x-era A100 figures
    # are ~2,500-2,800 with MXNet + DALI).
    Preset(
        name="a100",
        description="A100 SXM4 bf16, 8/node NVLink 3, HDR IB 200 Gb/s per GPU (DGX A100)",
        peak_flops=312 * TFLOPS,
        dtype="bfloat16",
        grad_dtype="bf16",
        devices_per_node=8,
        intra=Link(300 * GB, 3 * US, name="NVLink 3 (300 GB/s)"),
        inter=Link(200 * GBIT, _IB_ALPHA, per="device", name="HDR IB 200 Gb/s per GPU"),
        reference_images_per_s=2500.0,
        reference_note="ASSUMPTION: ~2,500 img/s bf16 at 224 px",
    ),
    _H100,
    # H200 SXM: same compute and links as H100 (989 TFLOP/s bf16 dense, NVLink 4, NDR 400);
    # 141 GB HBM3e at 4.8 TB/s. Reference rate: MLPerf Training v4.0, one node of 8 H200,
    # ResNet-50 in 12.0 min, about 7,700 images/s per GPU (GUIDE section 5): a tuned
    # MXNet + DALI stack. The difference from the h100 preset is the software, not the chip.
    dataclasses.replace(
        _H100,
        name="h200",
        description="H200 SXM bf16, 8/node NVLink 4, NDR IB 400 Gb/s per GPU",
        reference_images_per_s=7700.0,
        reference_note="MLPerf Training v4.0 (8 x H200, 12.0 min): ~7,700 img/s/GPU, tuned",
    ),
    # TPU v3: 123 TFLOP/s bf16 per chip; pod of 1,024 chips on a 2D torus; "all-reduce
    # bandwidth per pod 340 TB/s" (Cloud TPU v3 docs) = ~332 GB/s per chip, used as the
    # ring bus bandwidth. ASSUMPTIONS: ICI spans the whole slice (no separate "node" link:
    # MLPerf's 4,096-chip v3 multipod was also joined by ICI), alpha 2 us per hop, and
    # ~2,000 images/s per chip at 224 px.
    Preset(
        name="tpu-v3",
        description="TPU v3 bf16, 2D torus ICI (~332 GB/s all-reduce bandwidth per chip)",
        peak_flops=123 * TFLOPS,
        dtype="bfloat16",
        grad_dtype="fp32",
        devices_per_node=4096,
        intra=Link(340e12 / 1024, 2 * US, name="ICI 2D torus"),
        inter=Link(340e12 / 1024, 2 * US, per="device", name="ICI 2D torus"),
        reference_images_per_s=2000.0,
        reference_note="ASSUMPTION: ~2,000 img/s per chip at 224 px",
        torus_dims=2,
    ),
    # TPU v4: 275 TFLOP/s bf16 per chip; pod of 4,096 chips, 3D torus; "all-reduce bandwidth
    # per pod 1.1 PB/s" (Cloud TPU v4 docs) = ~269 GB/s per chip. ASSUMPTIONS: alpha 2 us,
    # and the same fraction of peak as the v3 assumption (2,000 * 275/123 = ~4,470 img/s).
    Preset(
        name="tpu-v4",
        description="TPU v4 bf16, 3D torus ICI (~269 GB/s all-reduce bandwidth per chip)",
        peak_flops=275 * TFLOPS,
        dtype="bfloat16",
        grad_dtype="fp32",
        devices_per_node=4096,
        intra=Link(1.1e15 / 4096, 2 * US, name="ICI 3D torus"),
        inter=Link(1.1e15 / 4096, 2 * US, per="device", name="ICI 3D torus"),
        reference_images_per_s=2000.0 * 275 / 123,
        reference_note="ASSUMPTION: same fraction of peak as the tpu-v3 assumption",
        torus_dims=3,
    ),
]

ALIASES = {"v100": "v100-25gbe", "p100": "p100-50gbe"}


# --------------------------------------------------------------------------------------------
# Workloads: FLOPs per image and the collectives of one step
# --------------------------------------------------------------------------------------------

RESNET50_PARAMS = 25_557_032  # torchvision/Flax ResNet-50, 1,000 classes, incl. BN gamma/beta
RESNET50_FWD_FLOPS_224 = 8.2e9  # 4.1 G multiply-adds forward at 224 px, 2 FLOPs each
TRAIN_FLOPS_FACTOR = 3.0  # forward + backward (backward ~2x forward)
BACKWARD_FRACTION = 2.0 / 3.0  # share of the step's compute that is the backward pass

GRAD_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

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


# --------------------------------------------------------------------------------------------
# Alpha-beta collective costs (pure functions; n in bytes, bw in bytes/s, alpha in seconds)
# --------------------------------------------------------------------------------------------


def ring_allreduce_time(n: float, p: int, bw: float, alpha: float) -> float:
    """Ring all-reduce: T = 2(p-1) alpha + 2 (p-1)/p * n / B.

    A reduce-scatter then an all-gather around a ring of p devices, each of p-1 steps moving
    n/p bytes per device. 0 for p <= 1.
    """
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw


def reduce_scatter_time(n: float, p: int, bw: float, alpha: float) -> float:
    """Ring reduce-scatter of an n-byte buffer: T = (p-1) alpha + (p-1)/p * n / B."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + (p - 1) / p * n / bw


def all_gather_time(n: float, p: int, bw: float, alpha: float) -> float:
    """Ring all-gather into an n-byte buffer: T = (p-1) alpha + (p-1)/p * n / B."""
    return reduce_scatter_time(n, p, bw, alpha)


def tree_allreduce_time(n: float, p: int, bw: float, alpha: float) -> float:
    """Tree all-reduce (reduce up a binary tree, broadcast down), upper-level model:

    T = 2 ceil(log2 p) alpha + 2 n / B.
    Latency grows with log p instead of p, so it wins for small buffers on many devices.
    """
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * alpha + 2 * n / bw


def torus_allreduce_time(n: float, p: int, dims: int, bw: float, alpha: float) -> float:
    """All-reduce on a `dims`-dimensional torus (TPU ICI), one ring phase per dimension:

    T = 2 * dims * (p^(1/dims) - 1) alpha + 2 (p-1)/p * n / B
    with B the per-chip all-reduce bandwidth (all links of the chip working at once).
    Idealised: a cube-shaped slice, no congestion.
    """
    if p <= 1:
        return 0.0
    side = p ** (1.0 / dims)
    return 2 * dims * max(side - 1.0, 0.0) * alpha + 2 * (p - 1) / p * n / bw


def hierarchical_allreduce_time(
    n: float,
    g: int,
    nodes: int,
    intra_bw: float,
    intra_alpha: float,
    inter_bw_per_device: float,
    inter_alpha: float,
) -> tuple[float, str]:
    """Two-level all-reduce over `nodes` nodes of `g` devices:

    1. intra-node reduce-scatter over the fast link: (g-1) a_i + (g-1)/g n / B_i
    2. inter-node all-reduce of each device's n/g shard across the nodes, g of them in
       parallel, each at B_e = (node bandwidth)/g or the per-device NIC:
       ring 2(N-1) a_e + 2 (N-1)/N (n/g) / B_e, or tree 2 ceil(log2 N) a_e + 2 (n/g) / B_e,
       whichever is cheaper
    3. intra-node all-gather: (g-1) a_i + (g-1)/g n / B_i
    Returns (seconds, "ring" or "tree" for step 2). With one node it is exactly a ring.
    """
    rs = reduce_scatter_time(n, g, intra_bw, intra_alpha)
    ag = all_gather_time(n, g, intra_bw, intra_alpha)
    if nodes <= 1:
        return rs + ag, "ring"
    shard = n / g
    ring = ring_allreduce_time(shard, nodes, inter_bw_per_device, inter_alpha)
    tree = tree_allreduce_time(shard, nodes, inter_bw_per_device, inter_alpha)
    return (rs + ring + ag, "ring") if ring <= tree else (rs + tree + ag, "tree")


@dataclass(frozen=True)
class Topology:
    """Where a group of p devices sits: `nodes` nodes of `g` devices each (g <= per node)."""

    p: int
    g: int
    nodes: int

    @staticmethod
    def of(p: int, devices_per_node: int) -> Topology:
        if p <= devices_per_node:
            return Topology(p, p, 1)
        nodes = math.ceil(p / devices_per_node)
        return Topology(p, devices_per_node, nodes)


def _flat_link(preset: Preset, topo: Topology) -> tuple[float, float]:
    """(bandwidth, alpha) of a flat ring/tree over all p devices.

    Inside one node: the intra link. Across nodes the ring crosses each node boundary; with
    one ring per NIC the rings share the node's bandwidth, so the bus bandwidth is
    min(B_intra, node bandwidth), and every step waits for the slower, inter-node alpha.
    """
    if topo.nodes <= 1:
        return preset.intra.bandwidth, preset.intra.latency
    bw = min(preset.intra.bandwidth, preset.inter_bandwidth_per_node())
    return bw, max(preset.intra.latency, preset.inter.latency)


def allreduce_options(n: float, p: int, preset: Preset) -> dict[str, float]:
    """Seconds for one n-byte all-reduce over p devices under every applicable algorithm."""
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node)
    if preset.torus_dims:
        bw, a = preset.intra.bandwidth, preset.intra.latency
        return {
            "torus": torus_allreduce_time(n, p, preset.torus_dims, bw, a),
            "tree": tree_allreduce_time(n, p, bw, a),
        }
    bw, a = _flat_link(preset, topo)
    opts = {"ring": ring_allreduce_time(n, p, bw, a), "tree": tree_allreduce_time(n, p, bw, a)}
    if topo.nodes > 1:
        per_dev = preset.inter_bandwidth_per_node() / topo.g
        t, inner = hierarchical_allreduce_time(
            n,
            topo.g,
            topo.nodes,
            preset.intra.bandwidth,
            preset.intra.latency,
            per_dev,
            preset.inter.latency,
        )
        opts[f"hier-{inner}"] = t
    return opts


def _shard_options(n: float, p: int, preset: Preset) -> dict[str, float]:
    """Reduce-scatter (= all-gather) of an n-byte buffer: flat ring or two-level."""
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node)
    if preset.torus_dims:
        side = p ** (1.0 / preset.torus_dims)
        bw, a = preset.intra.bandwidth, preset.intra.latency
        lat = preset.torus_dims * max(side - 1.0, 0.0) * a
        return {"torus": lat + (p - 1) / p * n / bw}
    bw, a = _flat_link(preset, topo)
    opts = {"ring": reduce_scatter_time(n, p, bw, a)}
    if topo.nodes > 1:
        per_dev = preset.inter_bandwidth_per_node() / topo.g
        opts["hier-ring"] = reduce_scatter_time(
            n, topo.g, preset.intra.bandwidth, preset.intra.latency
        ) + reduce_scatter_time(n / topo.g, topo.nodes, per_dev, preset.inter.latency)
    return opts


def collective_options(kind: str, n: float, p: int, preset: Preset) -> dict[str, float]:
    """Seconds for one collective of `kind` on an n-byte buffer over p devices, per algorithm.

    all-to-all: (p-1) alpha + (p-1)/p n / B (pairwise exchange; across nodes B is the
    device's share of its node's bandwidth). collective-permute: alpha + n / B.
    """
    if kind == "all-reduce":
        return allreduce_options(n, p, preset)
    if kind in ("reduce-scatter", "all-gather"):
        return _shard_options(n, p, preset)
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node)
    if topo.nodes > 1 and not preset.torus_dims:
        bw = min(preset.intra.bandwidth, preset.inter_bandwidth_per_node() / topo.g)
        a = max(preset.intra.latency, preset.inter.latency)
    else:
        bw, a = preset.intra.bandwidth, preset.intra.latency
    if kind == "all-to-all":
        return {"pairwise": (p - 1) * a + (p - 1) / p * n / bw}
    if kind == "collective-permute":
        return {"direct": a + n / bw}
    raise ValueError(f"unknown collective kind {kind!r}")


def best_algorithm(kind: str, n: float, p: int, preset: Preset) -> tuple[str, float]:
    """The cheapest algorithm (as NCCL's tuner would pick) and its seconds."""
    opts = collective_options(kind, n, p, preset)
    name = min(opts, key=lambda k: (opts[k], k))
    return name, opts[name]


# --------------------------------------------------------------------------------------------
# Step, throughput, efficiency, calibration
# --------------------------------------------------------------------------------------------


def calibrate(
    measured_images_per_s: float,
    image_size: int,
    batch: int,
    preset: Preset,
    workload: Workload | None = None,
) -> float:
    """Efficiency (fraction of peak) that reproduces a measured single-device rate.

    efficiency = FLOPs per step / (peak * measured step time),
    measured step time = batch / measured_images_per_s.
    """
    if measured_images_per_s <= 0 or batch <= 0:
        raise ValueError("measured rate and batch must be positive")
    workload = workload or resnet50_workload()
    step_s = batch / measured_images_per_s
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


PRESETS: dict[str, Preset] = {p.name: with_calibrated_efficiency(p) for p in _PRESET_LIST}


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


def comm_time(workload: Workload, preset: Preset, devices: int) -> tuple[float, str]:
    """Total collective seconds per step on `devices`, and the algorithms chosen."""
    replicas = devices // workload.model_parallel
    total = 0.0
    chosen: dict[str, int] = {}
    for c in workload.collectives:
        if c.group_size is not None:
            p = min(c.group_size, devices)
        else:
            p = devices if c.spans_all else replicas
        name, t = best_algorithm(c.kind, c.nbytes, p, preset)
        total += c.count * t
        if name != "none":
            chosen[name] = chosen.get(name, 0) + c.count
    if not chosen:
        return total, "-"
    if len(chosen) == 1:
        return total, next(iter(chosen))
    return total, ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items()))


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
    exposed = max(0, comm - overlap * backward_fraction * compute)
    step = compute + exposed;  images/s = global batch / step
    scaling efficiency = images/s / (devices * images/s of one device) = compute / step
    """
    if devices < 1:
        raise ValueError("devices must be >= 1")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    m = workload.model_parallel
    if devices % m:
        raise ValueError(f"{devices} devices is not a multiple of the model-parallel size {m}")
    eff = preset.efficiency if efficiency is None else efficiency
    if not eff > 0:
        raise ValueError(f"efficiency must be positive, got {eff}")
    compute = workload.step_flops(per_device_batch, image_size) / (preset.peak_flops * eff)
    comm, algos = comm_time(workload, preset, devices)
    exposed = max(0.0, comm - overlap * workload.backward_fraction * compute)
    step = compute + exposed
    global_batch = devices // m * per_device_batch
    images_per_s = global_batch / step
    # one device runs the whole model: m times one device's share of the work
    single = per_device_batch / (m * compute)
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
    )


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


@dataclass(frozen=True)
class TrainPrediction:
    devices: int
    total_s: float
    train_s: float
    eval_s: float
    epochs: float
    stages: tuple[tuple[Stage, StepPrediction, float], ...]  # (stage, step, seconds)


def time_to_train(
    workload: Workload,
    preset: Preset,
    devices: int,
    stages: Sequence[Stage],
    images_per_epoch: int = IMAGENET_TRAIN_IMAGES,
    overlap: float = 0.8,
    efficiency: float | None = None,
    eval_s_per_epoch: float = 0.0,
) -> TrainPrediction:
    """Sum over stages of (end - start epochs) * images per epoch / images/s at that stage,
    plus `eval_s_per_epoch` for every epoch trained."""
    start = 0.0
    parts = []
    train_s = 0.0
    for st in stages:
        step = predict_step(
            workload, preset, devices, st.per_device_batch, st.image_size, overlap, efficiency
        )
        secs = (st.end_epoch - start) * images_per_epoch / step.images_per_s
        parts.append((st, step, secs))
        train_s += secs
        start = st.end_epoch
    epochs = stages[-1].end_epoch
    eval_s = eval_s_per_epoch * epochs
    return TrainPrediction(devices, train_s + eval_s, train_s, eval_s, epochs, tuple(parts))


# --------------------------------------------------------------------------------------------
# Validation against published runs (docs/scaling.md shows this table)
# --------------------------------------------------------------------------------------------

MOXING_STAGES = "20:128-224,38:224-224,40:288-128"
# fast.ai / DIU, 16 x p3.16xlarge (cybertronai/imagenet18, train.py `sixteen_machines`,
# "16:08 to 93.04"): 128 px (per-GPU batch 64 to epoch 6, then 128) to epoch 16; 224 px
# (batch 64 to 19, then 192) to 37; 288 px at batch 128 from 37. ASSUMPTION: the target
# was met after one epoch at 288 px (the LR reaches its final value at epoch 38).
FASTAI_STAGES = "6:128-64,16:128-128,19:224-64,37:224-192,38:288-128"


@dataclass(frozen=True)
class ValidationCase:
    run: str
    reported: str
    reported_value: float  # seconds, or an efficiency
    metric: str  # "time_s" or "efficiency"
    preset: str
    devices: int
    stages: str
    grad_dtype: str
    note: str = ""
    reference_images_per_s: float | None = None  # override the preset's calibration
    base_devices: int = 1  # efficiency measured against this many devices


VALIDATION_CASES = [
    ValidationCase(
        "MoXing 2018, 25 GbE",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-25gbe",
        128,
        MOXING_STAGES,
        "fp16",
    ),
    ValidationCase(
        "MoXing 2018, 100 GbE",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-100gbe",
        128,
        MOXING_STAGES,
        "fp16",
    ),
    ValidationCase(
        "fast.ai 2018, 25 GbE",
        "18 min (1,080 s) to 93%",
        1080.0,
        "time_s",
        "v100-25gbe",
        128,
        FASTAI_STAGES,
        "fp16",
    ),
    ValidationCase(
        "MoXing 2018, 25 GbE, V100 at 610 img/s",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-25gbe",
        128,
        MOXING_STAGES,
        "fp16",
        note="calibrated to the 2018 PyTorch step logged in imagenet18's README",
        reference_images_per_s=224 / 0.367,
    ),
    ValidationCase(
        "fast.ai 2018, 25 GbE, V100 at 610 img/s",
        "18 min (1,080 s) to 93%",
        1080.0,
        "time_s",
        "v100-25gbe",
        128,
        FASTAI_STAGES,
        "fp16",
        note="calibrated to the 2018 PyTorch step logged in imagenet18's README",
        reference_images_per_s=224 / 0.367,
    ),
    ValidationCase(
        "Goyal et al. 2017, 8 -> 256 P100",
        "~90% scaling efficiency",
        0.90,
        "efficiency",
        "p100-50gbe",
        256,
        "90:224-32",
        "fp32",
        base_devices=8,
    ),
    ValidationCase(
        "Goyal et al. 2017, 256 P100, 90 epochs",
        "~1 hour",
        3600.0,
        "time_s",
        "p100-50gbe",
        256,
        "90:224-32",
        "fp32",
    ),
]


def run_validation_case(case: ValidationCase, overlap: float = 0.8, bucket_mb=32.0) -> dict:
    """Predict one published figure; `predicted_no_overlap` repeats it with overlap 0."""
    out = _validation_prediction(case, overlap, bucket_mb)
    out["predicted_no_overlap"] = _validation_prediction(case, 0.0, bucket_mb)["predicted"]
    out["overlap"] = overlap
    return out


def _validation_prediction(case: ValidationCase, overlap: float, bucket_mb) -> dict:
    preset = get_preset(case.preset)
    workload = resnet50_workload(case.grad_dtype, bucket_mb)
    if case.reference_images_per_s is not None:
        preset = dataclasses.replace(preset, reference_images_per_s=case.reference_images_per_s)
        preset = with_calibrated_efficiency(preset)
    stages = parse_stages(case.stages)
    if case.metric == "efficiency":
        st = stages[0]
        hi = predict_step(
            workload, preset, case.devices, st.per_device_batch, st.image_size, overlap
        )
        lo = predict_step(
            workload, preset, case.base_devices, st.per_device_batch, st.image_size, overlap
        )
        predicted = hi.images_per_s / (case.devices / case.base_devices * lo.images_per_s)
        detail = hi
    else:
        tt = time_to_train(workload, preset, case.devices, stages, overlap=overlap)
        predicted = tt.total_s
        detail = tt.stages[-1][1]
    return {
        "run": case.run,
        "reported": case.reported,
        "reported_value": case.reported_value,
        "predicted": predicted,
        "ratio": predicted / case.reported_value,
        "metric": case.metric,
        "preset": preset.name,
        "efficiency_of_peak": preset.efficiency,
        "reference_images_per_s": preset.reference_images_per_s,
        "devices": case.devices,
        "stages": case.stages,
        "grad_dtype": case.grad_dtype,
        "algorithm": detail.algorithms,
        "note": case.note,
    }


def validation_table(overlap: float = 0.8) -> list[dict]:
    return [run_validation_case(c, overlap) for c in VALIDATION_CASES]


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

DEFAULT_DEVICES = [2**k for k in range(3, 13)]  # 8 .. 4096


def parse_devices(text: str) -> list[int]:
    """ "8,16,32" or a doubling range "8..4096" (or a mix)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ".." in part:
            lo, hi = (int(x) for x in part.split(".."))
            if lo < 1 or hi < lo:
                raise ValueError(f"bad device range {part!r}")
            v = lo
            while v <= hi:
                out.append(v)
                v *= 2
        else:
            v = int(part)
            if v < 1:
                raise ValueError(f"device counts must be >= 1, got {v}")
            out.append(v)
    if not out:
        raise ValueError("no device counts given")
    return out


def _fmt_duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def simulate(
    workload: Workload,
    preset: Preset,
    devices: Iterable[int],
    per_device_batch: int,
    image_size: int,
    stages: Sequence[Stage],
    overlap: float = 0.8,
    efficiency: float | None = None,
    images_per_epoch: int = IMAGENET_TRAIN_IMAGES,
    eval_s_per_epoch: float = 0.0,
) -> list[dict]:
    """One row per device count: the step at (per_device_batch, image_size) and the time to
    train through `stages`. Device counts that the model-parallel size does not divide are
    skipped."""
    rows = []
    for p in devices:
        if p % workload.model_parallel:
            continue
        step = predict_step(workload, preset, p, per_device_batch, image_size, overlap, efficiency)
        tt = time_to_train(
            workload, preset, p, stages, images_per_epoch, overlap, efficiency, eval_s_per_epoch
        )
        row = dataclasses.asdict(step)
        row["time_to_train_s"] = tt.total_s
        row["eval_s"] = tt.eval_s
        row["stage_s"] = [secs for _, _, secs in tt.stages]
        row["stage_efficiency"] = [s.efficiency for _, s, _ in tt.stages]
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    header = [
        "devices",
        "nodes",
        "algorithm",
        "step ms",
        "compute ms",
        "exposed ms",
        "comm ms",
        "images/s",
        "efficiency",
        "time to train",
    ]
    body = [
        [
            str(r["devices"]),
            str(r["nodes"]),
            r["algorithms"],
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['compute_s'] * 1e3:.1f}",
            f"{r['exposed_comm_s'] * 1e3:.1f}",
            f"{r['comm_s'] * 1e3:.1f}",
            f"{r['images_per_s']:,.0f}",
            f"{r['efficiency']:.3f}",
            _fmt_duration(r["time_to_train_s"]),
        ]
        for r in rows
    ]
    return _table(body, header)


def format_validation(results: list[dict]) -> str:
    ov = results[0]["overlap"] if results else 0.8
    header = [
        "run",
        "reported",
        f"predicted (overlap {ov:g})",
        "ratio",
        "algorithm",
        "predicted (overlap 0)",
        "ratio",
    ]
    body = []
    for r in results:
        fmt = (lambda v: f"{v:.3f}") if r["metric"] == "efficiency" else (lambda v: f"{v:.0f} s")
        body.append(
            [
                r["run"],
                r["reported"],
                fmt(r["predicted"]),
                f"{r['ratio']:.2f}",
                r["algorithm"],
                fmt(r["predicted_no_overlap"]),
                f"{r['predicted_no_overlap'] / r['reported_value']:.2f}",
            ]
        )
    return _table(body, header)


def write_png(rows: list[dict], path: str, title: str) -> bool:
    """Images/s and scaling efficiency against devices. False (and a message) when
    matplotlib is not installed: it is an optional dependency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed: skipping {path} "
            "(pip install matplotlib to get the plot)",
            file=sys.stderr,
        )
        return False
    devs = np.array([r["devices"] for r in rows], dtype=float)
    ips = np.array([r["images_per_s"] for r in rows])
    eff = np.array([r["efficiency"] for r in rows])
    ideal = ips / eff  # devices x one device's images/s (efficiency = ips / ideal)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.loglog(devs, ips, "o-", label="predicted")
    a1.loglog(devs, ideal, "--", color="gray", label="devices x one device")
    a1.set_xlabel("devices")
    a1.set_ylabel("images/s")
    a1.legend()
    a1.grid(True, which="both", alpha=0.3)
    a2.semilogx(devs, eff, "o-")
    a2.set_ylim(0, 1.05)
    a2.set_xlabel("devices")
    a2.set_ylabel("scaling efficiency vs one device")
    a2.grid(True, which="both", alpha=0.3)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridpar.simulate",
        description="Predict ResNet-50 step time, throughput, scaling efficiency and time to "
        "train on 8 to 4,096 devices (alpha-beta communication model).",
    )
    ap.add_argument(
        "--preset", default="h100", help=f"hardware: {', '.join(PRESETS)} (aliases: v100, p100)"
    )
    ap.add_argument(
        "--devices",
        default=None,
        help="comma list and/or doubling range, e.g. 8,16,32 or 8..4096 (default 8..4096)",
    )
    ap.add_argument(
        "--comm-report",
        default=None,
        metavar="FILE",
        help="take FLOPs and collectives from `hybridpar.comm_report --json`",
    )
    ap.add_argument(
        "--per-device-batch",
        type=int,
        default=None,
        help="images per device (per batch shard) per step (default 256, or the comm "
        "report's own batch)",
    )
    ap.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="image side in px (default 224, or the comm report's own size)",
    )
    ap.add_argument(
        "--stages",
        default=None,
        help="curriculum END_EPOCH:IMAGE_SIZE-PER_GPU_BATCH,... "
        "(default: --epochs at --image-size/--per-device-batch)",
    )
    ap.add_argument(
        "--epochs", type=float, default=35.0, help="epochs when --stages is not given (default 35)"
    )
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.8,
        help="fraction of the backward pass that can hide communication "
        "(0.8: bucketed/fused reductions; 0: no overlap)",
    )
    ap.add_argument(
        "--grad-dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16", "preset"],
        help="gradient dtype of the analytic ResNet-50 all-reduce (default fp32: "
        "hybridpar keeps float32 parameters, so their gradients are float32; "
        "'preset': the dtype the preset's reference recipe reduced)",
    )
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=32.0,
        help="analytic model: gradient buckets of at most this many MB (0: one fused buffer)",
    )
    ap.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="fraction of peak for a ResNet-50 step (default: the preset's calibrated value)",
    )
    ap.add_argument(
        "--calibrate",
        type=float,
        default=None,
        metavar="IMAGES_PER_S",
        help="calibrate efficiency from a measured single-device rate at "
        "--image-size and --per-device-batch",
    )
    ap.add_argument("--images-per-epoch", type=int, default=IMAGENET_TRAIN_IMAGES)
    ap.add_argument(
        "--eval-s-per-epoch",
        type=float,
        default=0.0,
        help="fixed evaluation cost added per epoch (seconds)",
    )
    ap.add_argument("--png", default=None, help="also write a plot (needs matplotlib)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--validate", action="store_true", help="print the validation table against published runs"
    )
    ap.add_argument("--list-presets", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except (ValueError, TypeError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.list_presets:
        rows = [
            [
                p.name,
                f"{p.peak_flops / TFLOPS:g}",
                p.dtype,
                f"{p.efficiency:.3f}",
                f"{p.reference_images_per_s:,.0f}",
                str(p.devices_per_node),
                f"{p.intra.bandwidth / GB:.4g}",
                f"{p.inter.bandwidth / GB:.4g}/{p.inter.per}",
            ]
            for p in PRESETS.values()
        ]
        hdr = [
            "preset",
            "peak TFLOP/s",
            "dtype",
            "eff",
            "ref img/s",
            "per node",
            "intra GB/s",
            "inter GB/s",
        ]
        if args.json:
            print(json.dumps({k: dataclasses.asdict(v) for k, v in PRESETS.items()}))
        else:
            print(_table(rows, hdr))
        return 0
    if args.validate:
        results = validation_table(args.overlap)
        if args.json:
            print(json.dumps({"validation": results}))
        else:
            print(format_validation(results))
        return 0

    preset = get_preset(args.preset)
    if args.comm_report:
        workload = load_comm_report(args.comm_report, args.per_device_batch, args.image_size)
        # by default simulate the step the report was compiled for
        if args.per_device_batch is None:
            args.per_device_batch = round(workload.reference_batch)
        if args.image_size is None:
            args.image_size = workload.reference_image_size
    else:
        grad_dtype = preset.grad_dtype if args.grad_dtype == "preset" else args.grad_dtype
        workload = resnet50_workload(grad_dtype, args.bucket_mb or None)
    if args.per_device_batch is None:
        args.per_device_batch = 256
    if args.image_size is None:
        args.image_size = 224
    efficiency = args.efficiency
    if args.calibrate is not None:
        efficiency = calibrate(
            args.calibrate, args.image_size, args.per_device_batch, preset, workload
        )
    devices = parse_devices(args.devices) if args.devices else DEFAULT_DEVICES
    if args.stages:
        stages = parse_stages(args.stages)
    else:
        stages = [Stage(args.epochs, args.image_size, args.per_device_batch)]
    rows = simulate(
        workload,
        preset,
        devices,
        args.per_device_batch,
        args.image_size,
        stages,
        args.overlap,
        efficiency,
        args.images_per_epoch,
        args.eval_s_per_epoch,
    )
    eff = preset.efficiency if efficiency is None else efficiency
    title = (
        f"{preset.name}: {workload.name}; {args.per_device_batch}/device at "
        f"{args.image_size} px; overlap {args.overlap:g}; efficiency {eff:.3f} of "
        f"{preset.peak_flops / TFLOPS:g} TFLOP/s"
    )
    png_written = None
    if args.png:
        png_written = write_png(rows, args.png, title)
    if args.json:
        print(
            json.dumps(
                {
                    "preset": dataclasses.asdict(preset),
                    "efficiency": eff,
                    "workload": {
                        "name": workload.name,
                        "source": workload.source,
                        "flops_per_image": workload.flops_per_image,
                        "reference_image_size": workload.reference_image_size,
                        "model_parallel": workload.model_parallel,
                        "gradient_bytes": workload.gradient_bytes(),
                        "collectives": [dataclasses.asdict(c) for c in workload.collectives],
                    },
                    "per_device_batch": args.per_device_batch,
                    "image_size": args.image_size,
                    "overlap": args.overlap,
                    "stages": format_stages(stages),
                    "images_per_epoch": args.images_per_epoch,
                    "eval_s_per_epoch": args.eval_s_per_epoch,
                    "png": args.png if png_written else None,
                    "rows": rows,
                }
            )
        )
        return 0
    print(title)
    print(
        f"time to train: {format_stages(stages)} (END_EPOCH:SIZE-BATCH), "
        f"{args.images_per_epoch:,} images/epoch"
        + (f", eval {args.eval_s_per_epoch:g} s/epoch" if args.eval_s_per_epoch else "")
    )
    print(format_rows(rows))
    if png_written:
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
