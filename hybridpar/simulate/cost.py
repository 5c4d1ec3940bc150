"""Alpha-beta collective costs: pure functions of the buffer size n (bytes), the devices p,
the bandwidth (bytes/s) and the latency alpha (seconds), and the cheapest algorithm for a
collective on a preset's links, as NCCL's tuner would pick it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.simulate.hardware import Preset


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


def torus_shape(p: int, dims: int) -> tuple[int, ...]:
    """The sides of a `dims`-dimensional torus slice of p chips, shortest first: the most
    balanced factorisation (least largest side, then least total hops), as Cloud TPU's slice
    shapes are (v3 16 chips 4x4, 128 chips 8x16; v4 64 chips 4x4x4, 3,456 chips 12x16x18).
    ASSUMPTION where the submission does not state its topology."""
    if p < 1 or dims < 1:
        raise ValueError(f"no torus of {p} chips in {dims} dimensions")
    if dims == 1:
        return (p,)
    best = None
    for a in range(1, p + 1):
        if p % a or a**dims > p:
            continue
        rest = torus_shape(p // a, dims - 1)
        if rest[0] < a:
            continue
        shape = (a, *rest)
        key = (max(shape), sum(shape))
        if best is None or key < best[0]:
            best = (key, shape)
    if best is None:  # p has no factor fitting `dims` sides in order: a line of p
        return (1,) * (dims - 1) + (p,)
    return best[1]


def torus_allreduce_time(
    n: float, p: int, dims: int, ici_bytes_per_s: float, alpha: float
) -> float:
    """All-reduce on a `dims`-dimensional torus (TPU ICI): a bidirectional ring along each
    dimension in turn, reduce-scatter X, Y, (Z), then all-gather back.

    Each chip has 2 * dims links; a ring along one dimension uses that dimension's two, half
    the buffer each way, so it runs at B = ici / dims (`ici_bytes_per_s`, the chip's
    bidirectional total over all links). Dimension d of side k_d holds n_d = n / (k_1 ...
    k_{d-1}) bytes, and its ring takes k_d - 1 hops of `alpha` each:

        T = 2 * sum_d [ (k_d - 1) alpha + (k_d - 1)/k_d * n_d / B ]
    """
    if p <= 1:
        return 0.0
    bw = ici_bytes_per_s / dims
    total, part = 0.0, float(n)
    for k in torus_shape(p, dims):
        if k > 1:
            total += (k - 1) * alpha + (k - 1) / k * part / bw
            part /= k
    return 2 * total


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
       parallel, each at B_e = its share of the node's network (`nic_share_per_device`):
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


def members_per_node(p: int, devices_per_node: int, stride: int = 1) -> int:
    """How many of a group's p devices share one node: g = min(p, max(1, D // stride)).

    A group's members are `stride` devices apart in device order, and a node holds D
    consecutive devices (the mesh's last axis varies fastest, so it fills a node first).
    A contiguous group (stride 1) packs D to a node; a `data` group beside `model:8` on
    nodes of 8 (stride 8) has ONE member per node, so all of its traffic crosses the network.
    """
    return min(p, max(1, devices_per_node // max(1, stride)))


def nic_share_per_device(node_bandwidth: float, devices_per_node: int) -> float:
    """Bytes/s of the node's network one device gets while its group crosses nodes: B_node / D.

    Every device of the node takes part in a collective of the same step at the same time:
    a contiguous group that spans nodes fills each node with its own members, and a strided
    group has `stride` sibling groups (one per model shard, the same all-reduce on another
    slice) whose members sit on the same nodes. So the node's NICs are shared by all D of its
    devices, not only by this group's g members.
    """
    return node_bandwidth / devices_per_node


@dataclass(frozen=True)
class Topology:
    """Where a group of p devices sits: `nodes` nodes with `g` of its members each, and the
    node size D (`devices_per_node`) whose devices all share the node's network."""

    p: int
    g: int
    nodes: int
    devices_per_node: int

    @staticmethod
    def of(p: int, devices_per_node: int, stride: int = 1) -> Topology:
        """The nodes a group of p devices, `stride` apart in device order, spans:
        g = members_per_node(p, D, stride), nodes = ceil(p / g)."""
        g = members_per_node(p, devices_per_node, stride)
        return Topology(p, g, math.ceil(p / g), devices_per_node)

    def inter_bandwidth_per_device(self, preset: Preset) -> float:
        """Each member's share of its node's network (`nic_share_per_device`)."""
        return nic_share_per_device(preset.inter_bandwidth_per_node(), self.devices_per_node)


def _flat_link(preset: Preset, topo: Topology) -> tuple[float, float]:
    """(bandwidth, alpha) of a flat ring/tree over all p devices.

    Inside one node: the intra link. Across nodes the ring crosses each node boundary once
    per channel (NCCL runs one per NIC), carrying the traffic of the group's g members on
    that node; the node's D/g concurrent groups share its NICs, so the bus bandwidth is
    min(B_intra, g * B_node / D): min(B_intra, B_node) for a contiguous group (g = D),
    B_node / D for a strided one with one member per node. Every step waits for the slower,
    inter-node alpha.
    """
    if topo.nodes <= 1:
        return preset.intra.bandwidth, preset.intra.latency
    bw = min(preset.intra.bandwidth, topo.g * topo.inter_bandwidth_per_device(preset))
    return bw, max(preset.intra.latency, preset.inter_link().latency)


def allreduce_options(n: float, p: int, preset: Preset, stride: int = 1) -> dict[str, float]:
    """Seconds for one n-byte all-reduce over p devices `stride` apart (`Topology.of`) under
    every applicable algorithm. On a TPU a node is a slice (`devices_per_node` chips on one
    ICI torus): a group within one is rings along the torus sides; one spanning slices adds
    an all-reduce of each chip's shard across them over DCN (`inter`)."""
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node, stride)
    if preset.torus_dims:  # a torus has no tree of log2(p) hops: rings along its sides
        ici, a = 2 * preset.intra.bandwidth, preset.intra.latency
        torus = torus_allreduce_time(n, topo.g, preset.torus_dims, ici, a)
        if topo.nodes <= 1:
            return {"torus": torus}
        # slices over DCN: reduce-scatter on each slice's torus, all-reduce each chip's n/g
        # shard across the slices (ring or tree), all-gather back on the torus
        shard, slices = n / topo.g, topo.nodes
        dcn, ae = topo.inter_bandwidth_per_device(preset), preset.inter_link().latency
        return {
            "torus+dcn-ring": torus + ring_allreduce_time(shard, slices, dcn, ae),
            "torus+dcn-tree": torus + tree_allreduce_time(shard, slices, dcn, ae),
        }
    bw, a = _flat_link(preset, topo)
    opts = {"ring": ring_allreduce_time(n, p, bw, a), "tree": tree_allreduce_time(n, p, bw, a)}
    if topo.nodes > 1:
        t, inner = hierarchical_allreduce_time(
            n,
            topo.g,
            topo.nodes,
            preset.intra.bandwidth,
            preset.intra.latency,
            topo.inter_bandwidth_per_device(preset),
            preset.inter_link().latency,
        )
        opts[f"hier-{inner}"] = t
    return opts


def _shard_options(n: float, p: int, preset: Preset, stride: int = 1) -> dict[str, float]:
    """Reduce-scatter (= all-gather) of an n-byte buffer over p devices `stride` apart: flat
    ring or two-level."""
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node, stride)
    if preset.torus_dims:  # half of the torus all-reduce: the reduce-scatter phases
        ici, a = 2 * preset.intra.bandwidth, preset.intra.latency
        torus = torus_allreduce_time(n, topo.g, preset.torus_dims, ici, a) / 2
        if topo.nodes <= 1:
            return {"torus": torus}
        dcn = topo.inter_bandwidth_per_device(preset)  # then across the slices over DCN
        return {"torus+dcn": torus + reduce_scatter_time(n / topo.g, topo.nodes, dcn,
                                                         preset.inter_link().latency)}  # fmt: skip
    bw, a = _flat_link(preset, topo)
    opts = {"ring": reduce_scatter_time(n, p, bw, a)}
    if topo.nodes > 1:
        per_dev = topo.inter_bandwidth_per_device(preset)
        opts["hier-ring"] = reduce_scatter_time(
            n, topo.g, preset.intra.bandwidth, preset.intra.latency
        ) + reduce_scatter_time(n / topo.g, topo.nodes, per_dev, preset.inter_link().latency)
    return opts


def collective_options(
    kind: str, n: float, p: int, preset: Preset, stride: int = 1
) -> dict[str, float]:
    """Seconds for one collective of `kind` on an n-byte buffer over p devices `stride`
    apart in device order (1: contiguous; see `Topology.of`), per algorithm.

    all-to-all: (p-1) alpha + (p-1)/p n / B (pairwise exchange; across nodes B is the
    device's share of its node's bandwidth). collective-permute: alpha + n / B.
    """
    if kind == "all-reduce":
        return allreduce_options(n, p, preset, stride)
    if kind in ("reduce-scatter", "all-gather"):
        return _shard_options(n, p, preset, stride)
    if p <= 1:
        return {"none": 0.0}
    topo = Topology.of(p, preset.devices_per_node, stride)
    if topo.nodes > 1:  # across nodes (a TPU's slices: DCN)
        bw = min(preset.intra.bandwidth, topo.inter_bandwidth_per_device(preset))
        a = max(preset.intra.latency, preset.inter_link().latency)
    else:
        bw, a = preset.intra.bandwidth, preset.intra.latency
    if kind == "all-to-all":
        return {"pairwise": (p - 1) * a + (p - 1) / p * n / bw}
    if kind == "collective-permute":
        return {"direct": a + n / bw}
    raise ValueError(f"unknown collective kind {kind!r}")


def best_algorithm(
    kind: str, n: float, p: int, preset: Preset, stride: int = 1
) -> tuple[str, float]:
    """The cheapest algorithm (as NCCL's tuner would pick) and its seconds, for p devices
    `stride` apart in device order."""
    opts = collective_options(kind, n, p, preset, stride)
    name = min(opts, key=lambda k: (opts[k], k))
    return name, opts[name]
