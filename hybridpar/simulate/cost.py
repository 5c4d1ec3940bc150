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
