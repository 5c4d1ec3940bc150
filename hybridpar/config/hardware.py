"""The one table of accelerators: TPU chips and GPUs, per chip, from public spec sheets.

The compile targets (``hybridpar.tools.targets``), the planner (``hybridpar.tools.plan``)
and the scaling model's presets (``hybridpar.simulate.hardware``) all read their figures
here, so a chip's peak, memory and links are stated once. Plain data, no JAX.

    TPUS["v5p"].hbm_bytes        # 95 GiB
    GPUS["h100"].peak_bf16_flops # dense bfloat16 FLOP/s

TPU figures are per chip, from the Cloud TPU system-architecture pages for each version
(cloud.google.com/tpu/docs/v3, /v4, /v5e, /v5p, /v6e): peak dense bfloat16 FLOP/s, HBM
capacity and bandwidth, bidirectional ICI bandwidth, and data-centre network (DCN) bandwidth
where the page gives it. v3 has no slice shapes in the compile targets: it is there for the
scaling model (the published MLPerf runs on it).

GPU figures are per GPU, from NVIDIA's datasheets: dense bfloat16 FLOP/s (the datasheets'
figures are with sparsity: halved), HBM capacity (decimal GB, as the datasheets give it)
and bandwidth, NVLink bandwidth (bidirectional, in the ICI field), and the network of a DGX
node, one NIC per GPU, in the DCN field.
"""

from __future__ import annotations

import dataclasses

from hybridpar.config.formatting import GIB


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # dense, per chip
    hbm_bytes: int
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # bidirectional, per chip (a GPU's: NVLink)
    dcn_bytes_per_s: float | None  # per chip, where published (a GPU's: its NIC)
    cores_per_chip: int  # TensorCores: what v4-N / v5p-N count
    torus_dims: int  # 2: a 2D torus (v5e, v6e); 3: 3D (v4, v5p); 0: a GPU (nodes + switch)
    chip_config: str  # libtpu's chip_config_name ("megacore": one device per chip); "": none


TPUS = {
    # v3: 123 TFLOP/s, 32 GiB HBM2 at 900 GB/s, 1,024 chips a pod on a 2D torus. ASSUMPTION:
    # ICI taken at twice the all-reduce bandwidth per chip (340 TB/s a pod over 1,024 chips,
    # 332 GB/s a chip), as for v4 below. DCN not published.
    "v3": Chip("v3", 123e12, 32 * GIB, 900e9, 2 * 340e12 / 1024, None, 2, 2, ""),
    # v4: 275 TFLOP/s, 32 GiB HBM2 at 1200 GB/s. ASSUMPTION: the page gives no per-chip ICI,
    # only the all-reduce bandwidth per pod (1.1 PB/s over 4,096 chips, 269 GB/s a chip);
    # taken at twice that, as the v5e page gives 200 GB/s a chip of all-reduce bandwidth
    # (51.2 TB/s over 256) against 400 GB/s of ICI. DCN not published.
    "v4": Chip("v4", 275e12, 32 * GIB, 1200e9, 2 * 1.1e15 / 4096, None, 2, 3, "megacore"),
    # v5e: 197 TFLOP/s, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s bidirectional; DCN 2 x 100 Gb/s
    # NICs per 8-chip host = 25 Gb/s per chip.
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819e9, 400e9, 25e9 / 8, 1, 2, "default"),
    # v5p: 459 TFLOP/s, 95 GiB HBM2e at 2765 GB/s, ICI 1200 GB/s bidirectional, DCN 50 Gb/s
    # per chip.
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765e9, 1200e9, 50e9 / 8, 2, 3, "megacore"),
    # v6e: 918 TFLOP/s, 32 GB HBM at 1638 GB/s, ICI 800 GB/s bidirectional; DCN not
    # published per chip.
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1638e9, 800e9, None, 1, 2, "default"),
}

GPUS = {
    # H100 SXM5 80 GB (DGX H100): 989 TFLOP/s bf16 dense (1,979 with sparsity), 3.35 TB/s;
    # NVLink 4, 900 GB/s bidirectional; 8 x 400 Gb/s ConnectX-7 (NDR InfiniBand), one per GPU.
    "h100": Chip("h100", 989e12, 80 * 10**9, 3.35e12, 900e9, 400e9 / 8, 1, 0, ""),
    # H200 SXM 141 GB: the H100's compute and links, 141 GB HBM3e at 4.8 TB/s.
    "h200": Chip("h200", 989e12, 141 * 10**9, 4.8e12, 900e9, 400e9 / 8, 1, 0, ""),
    # A100 SXM4 80 GB (DGX A100 640 GB): 312 TFLOP/s bf16 dense, 2.039 TB/s; NVLink 3,
    # 600 GB/s bidirectional; 8 x 200 Gb/s HDR InfiniBand, one per GPU.
    "a100": Chip("a100", 312e12, 80 * 10**9, 2.039e12, 600e9, 200e9 / 8, 1, 0, ""),
    # A100 SXM4 40 GB (the first DGX A100, 320 GB): the same chip and links, 40 GB HBM2 at
    # 1.555 TB/s.
    "a100-40gb": Chip("a100-40gb", 312e12, 40 * 10**9, 1.555e12, 600e9, 200e9 / 8, 1, 0, ""),
}
GPUS_PER_NODE = 8  # a DGX/HGX node: 8 GPUs joined by NVLink
