"""Hardware presets as data: devices, nodes and links (public spec figures; assumptions
marked as such).

The presets here are raw: each states the single-device ResNet-50 rate it is calibrated
from, and `hybridpar.simulate.step.PRESETS` fills in the fraction of peak that reproduces
it (calibration needs the workload's FLOPs, which live in `workload.py`).

A preset of a chip in the accelerator table (`hybridpar.config.hardware`: every TPU, the
H100, H200 and A100) takes its peak, memory and link bandwidths from there, as the compile
targets do; only the older GPUs (P100, V100), which nothing else uses, are stated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridpar.config.formatting import GIB
from hybridpar.config.hardware import GPUS, TPUS, Chip

GB = 1e9  # bytes; link figures below are decimal GB/s as vendors quote them
GBIT = 1e9 / 8  # bytes per second in one Gb/s
US = 1e-6  # seconds
TFLOPS = 1e12

# The per-step floor: no step, however small its network and batch, takes less. ASSUMPTION,
# 1 ms: of the order of the host's dispatch of one jitted train step over ResNet-50's train
# state (428 arrays), which bench/step_floor.py measures on this project's machine
# (docs/scaling.md); not measured on a TPU or GPU host. The host dispatches
# step n+1 while the device runs step n, so it bounds the step from below rather than adding
# to it; the device's own fixed costs per step are `step_overhead_s`.
STEP_FLOOR_S = 1e-3


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
    memory_gib: memory per device (HBM), what a plan must fit in (`hybridpar.plan`).
    chip: the accelerator table's entry the figures come from; "" for a preset stated here.

    What a real run spends besides the FLOPs (0: not modelled; set by calibration, see
    `hybridpar.simulate.calibration`):
    step_overhead_s: a fixed cost per step (kernel launches, the optimizer's small kernels,
      host synchronisation), which makes small images and batches run below the peak rate.
    input_images_per_s_per_core / input_reference_size: decode + augment throughput of one
      host core at that image size (scaled by pixels for other sizes); cores_per_device: host
      cores feeding each device. A step cannot be faster than its input.
    eval_overhead_s: a fixed cost per evaluation pass (loader start, synchronisation).
    step_floor_s: the least a step takes (`STEP_FLOOR_S`): step = max(compute + exposed
      comm, input, floor).
    hbm_bytes_per_s / param_bytes_per_param: the per-parameter work of a step that does not
      shrink with the batch (the optimizer's update and the gradient's casts): bytes moved
      per parameter over the memory bandwidth (0: not modelled).
    max_overlap: the most of the backward pass the device's compiler actually hides
      collectives behind, whatever `overlap` asks (1: as asked; 0: every byte exposed).
    startup_s / startup_images_per_s_per_host / chips_per_host: what a timed run spends before
      its steady state: a fixed start-up plus the first epoch's decode of each host's share of
      the data while it is not yet cached (0: not modelled).
    size_change_s: what a curriculum run spends at each change of image size beyond its
      steady epochs (the new size's first reads and kernel selection; 0: not modelled).
    max_devices: the most devices the preset models (0: no bound): a TPU chip without a DCN
      figure, one slice. A TPU preset's node is a slice (`devices_per_node` chips on ICI),
      `inter` the DCN between slices: None where the chip has no DCN figure, so nothing
      between slices is priced (`hybridpar.simulate.cost` refuses it).
    """

    name: str
    description: str
    peak_flops: float
    dtype: str
    grad_dtype: str  # the gradient dtype the reference recipe reduces
    devices_per_node: int
    intra: Link
    inter: Link | None
    reference_images_per_s: float
    reference_image_size: int = 224
    reference_batch: int = 256
    reference_note: str = ""
    torus_dims: int = 0
    memory_gib: float = 16.0
    step_overhead_s: float = 0.0
    input_images_per_s_per_core: float = 0.0
    input_reference_size: int = 224
    cores_per_device: float = 0.0
    eval_overhead_s: float = 0.0
    step_floor_s: float = STEP_FLOOR_S
    efficiency: float = float("nan")
    chip: str = ""
    hbm_bytes_per_s: float = 0.0
    param_bytes_per_param: float = 0.0
    max_overlap: float = 1.0
    startup_s: float = 0.0
    startup_images_per_s_per_host: float = 0.0
    chips_per_host: int = 1
    size_change_s: float = 0.0
    max_devices: int = 0

    def inter_link(self) -> Link:
        """``inter``; a ValueError where it is None (a TPU slice with no DCN figure: nothing
        leaving it has a price)."""
        if self.inter is None:
            raise ValueError(
                f"{self.name} has no DCN bandwidth in the chip table "
                "(hybridpar/config/hardware.py), so traffic between its slices cannot be priced"
            )
        return self.inter

    def inter_bandwidth_per_node(self) -> float:
        """Bytes/s leaving one node (all of its NICs together)."""
        link = self.inter_link()
        return link.bandwidth if link.per == "node" else link.bandwidth * self.devices_per_node

    def scaled(self, intra: float = 1.0, inter: float = 1.0) -> Preset:
        """The same preset with link bandwidths multiplied (for what-if studies and tests)."""
        between = self.inter  # None: no DCN figure, nothing to scale
        if between is not None:
            between = dataclasses.replace(between, bandwidth=between.bandwidth * inter)
        return dataclasses.replace(
            self,
            intra=dataclasses.replace(self.intra, bandwidth=self.intra.bandwidth * intra),
            inter=between,
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


def _gpu_preset(chip: Chip, **kw) -> Preset:
    """A DGX-style node of 8 ``chip``s: a ring all-reduce within the node runs at half of
    the NVLink's bidirectional bandwidth (its per-direction bandwidth, NCCL's bus bandwidth),
    and between nodes at one NIC per GPU."""
    return Preset(
        name=chip.name,
        peak_flops=chip.peak_bf16_flops,
        dtype="bfloat16",
        grad_dtype="bf16",
        devices_per_node=8,
        memory_gib=chip.hbm_bytes / GIB,
        chip=chip.name,
        **kw,
    )


# H100 (DGX H100): NVLink 4, 450 GB/s per direction; NDR InfiniBand 400 Gb/s per GPU.
# Reference rate: ASSUMPTION ~3,000 images/s bf16 at 224 px for a plain framework step
# (tuned MLPerf stacks reach more: see the H200 preset).
_H100 = _gpu_preset(
    GPUS["h100"],
    description="H100 SXM5 bf16, 8/node NVLink 4, NDR IB 400 Gb/s per GPU (DGX H100)",
    intra=Link(GPUS["h100"].ici_bytes_per_s / 2, 3 * US, name="NVLink 4 (450 GB/s)"),
    inter=Link(GPUS["h100"].dcn_bytes_per_s, _IB_ALPHA, name="NDR IB 400 Gb/s per GPU"),
    reference_images_per_s=3000.0,
    reference_note="ASSUMPTION: ~3,000 img/s bf16 at 224 px (plain framework step)",
)
# A100 (DGX A100): NVLink 3, 300 GB/s per direction; HDR InfiniBand 200 Gb/s per GPU.
# Reference rate: ASSUMPTION ~2,500 images/s bf16 at 224 px (MLPerf v1.x-era A100 figures
# are ~2,500-2,800 with MXNet + DALI).
_A100 = _gpu_preset(
    GPUS["a100"],
    description="A100 SXM4 80 GB bf16, 8/node NVLink 3, HDR IB 200 Gb/s per GPU (DGX A100)",
    intra=Link(GPUS["a100"].ici_bytes_per_s / 2, 3 * US, name="NVLink 3 (300 GB/s)"),
    inter=Link(GPUS["a100"].dcn_bytes_per_s, _IB_ALPHA, name="HDR IB 200 Gb/s per GPU"),
    reference_images_per_s=2500.0,
    reference_note="ASSUMPTION: ~2,500 img/s bf16 at 224 px",
)


# TPU presets: every chip of hybridpar.config.hardware.TPUS (peak, HBM, ICI; sources there).
# ASSUMPTIONS: ~2,000 ResNet-50 images/s per v3 chip at 224 px, and every other chip at the
# same fraction of its peak (the published MLPerf runs replace this for v3 and v4:
# hybridpar.simulate.validation fits those from its calibration runs); alpha 2 us per ICI
# hop.
TPU_V3_IMAGES_PER_S = 2000.0
# The most chips one slice joins by ICI alone: the compile targets' largest slice shapes
# (hybridpar.tools.targets: 256 chips of v5e and v6e, 4,096 of v4 and v5p); v3, not a
# compile target, 4,096 (MLPerf's 4,096-chip v3 runs were joined by ICI). Beyond it a pod is
# slices of this size joined over the data-centre network (DCN) at the chip's published
# DCN bandwidth per chip; a chip without one (v3, v4, v6e) is not modelled beyond a slice.
TPU_LARGEST_SLICE = {"v3": 4096, "v4": 4096, "v5e": 256, "v5p": 4096, "v6e": 256}
# ASSUMPTION: alpha of a DCN message step, as for the Ethernet presets' TCP transport.
_DCN_ALPHA = 25 * US
# Bytes the optimizer moves per parameter per step, the same at any batch. ASSUMPTION, 28:
# a LARS/momentum update in float32 reads the parameter, its gradient and momentum and
# writes the parameter and momentum (20 bytes), and LARS's two norms read the parameter and
# gradient again (8).
PARAM_BYTES_PER_PARAM = 28.0
# Hosts: a v3-8, v4-8 or v5p-8 host drives 4 chips; a v5e or v6e host 8.
TPU_CHIPS_PER_HOST = {"v5e": 8, "v6e": 8}


def _tpu_preset(chip) -> Preset:
    # a ring all-reduce moves the buffer out and in through each chip's ICI: half of its
    # bidirectional bandwidth, which is the all-reduce bandwidth per chip the pages quote
    allreduce = chip.ici_bytes_per_s / 2
    ici = Link(allreduce, 2 * US, per="device", name=f"ICI {chip.torus_dims}D torus")
    rate = TPU_V3_IMAGES_PER_S * chip.peak_bf16_flops / TPUS["v3"].peak_bf16_flops
    largest = TPU_LARGEST_SLICE[chip.name]
    if chip.dcn_bytes_per_s:  # slices of `largest` chips joined over DCN beyond one
        dcn = Link(chip.dcn_bytes_per_s, _DCN_ALPHA, per="device", name="DCN per chip")
        beyond = f"; slices of {largest:,} joined over DCN at {chip.dcn_bytes_per_s / GB:.3g} GB/s"
    else:  # no DCN figure: one slice at most, nothing priced between slices
        dcn, beyond = None, f"; at most one slice of {largest:,} chips (no DCN figure)"
    return Preset(
        name=f"tpu-{chip.name}",
        description=f"TPU {chip.name} bf16, {chip.torus_dims}D torus ICI "
        f"(~{allreduce / GB:.0f} GB/s all-reduce bandwidth per chip){beyond}",
        peak_flops=chip.peak_bf16_flops,
        dtype="bfloat16",
        grad_dtype="fp32",
        devices_per_node=largest,
        intra=ici,
        inter=dcn,
        reference_images_per_s=rate,
        reference_note=f"ASSUMPTION: {rate:,.0f} img/s per chip at 224 px "
        "(2,000 on v3, the same fraction of peak on the others)",
        torus_dims=chip.torus_dims,
        memory_gib=chip.hbm_bytes / GIB,
        chip=chip.name,
        hbm_bytes_per_s=chip.hbm_bytes_per_s,
        param_bytes_per_param=PARAM_BYTES_PER_PARAM,
        # The TPU compiler leaves the gradient all-reduce synchronous (compile's overlap
        # report: every byte exposed on a data-parallel step, docs/scaling.md): none hidden.
        max_overlap=0.0,
        chips_per_host=TPU_CHIPS_PER_HOST.get(chip.name, 4),
        max_devices=0 if chip.dcn_bytes_per_s else largest,
    )


def slice_preset(preset: Preset, slice_devices: int, slices: int = 1) -> Preset:
    """A TPU `preset` on `slices` slices of `slice_devices` chips (a compile target's): its
    ICI domain that slice, the traffic between slices over DCN. A ValueError for several
    slices of a chip without a DCN figure (`max_devices`), whose traffic between slices
    cannot be priced."""
    if slices > 1 and preset.max_devices:
        raise ValueError(
            f"{preset.name} has no DCN bandwidth in the chip table "
            "(hybridpar/config/hardware.py), so traffic between its slices cannot be priced"
        )
    return dataclasses.replace(preset, devices_per_node=slice_devices)


# efficiency is NaN here: step.PRESETS calibrates it from each reference rate
UNCALIBRATED_PRESETS = [
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
    _A100,
    # the same A100 with 40 GB (the first DGX A100): what a plan must fit in is all that differs
    dataclasses.replace(
        _A100,
        name="a100-40gb",
        description="A100 SXM4 40 GB bf16, 8/node NVLink 3, HDR IB 200 Gb/s per GPU (DGX A100)",
        memory_gib=GPUS["a100-40gb"].hbm_bytes / GIB,
        chip="a100-40gb",
    ),
    _H100,
    # H200 SXM: the H100's compute and links, more and faster HBM. Reference rate: MLPerf
    # Training v4.0, one node of 8 H200, ResNet-50 in 12.0 min, about 7,700 images/s per
    # GPU: a tuned MXNet + DALI stack. The difference from the h100 preset is the software.
    dataclasses.replace(
        _H100,
        name="h200",
        description="H200 SXM bf16, 8/node NVLink 4, NDR IB 400 Gb/s per GPU",
        reference_images_per_s=7700.0,
        reference_note="MLPerf Training v4.0 (8 x H200, 12.0 min): ~7,700 img/s/GPU, tuned",
        memory_gib=GPUS["h200"].hbm_bytes / GIB,
        chip="h200",
    ),
    *(_tpu_preset(chip) for chip in TPUS.values()),
]

ALIASES = {"v100": "v100-25gbe", "p100": "p100-50gbe"}
