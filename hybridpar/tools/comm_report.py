"""``python -m hybridpar.comm_report --config experiments/NAME.py [--devices N] [--json]``.

Compiles the train step ahead of time with abstract inputs (no data, nothing allocated) and
reports what the optimized HLO communicates: every collective (kind, count, bytes, replica
groups, async or not), the bytes per step, the FLOPs and the per-device memory.

``--devices N`` compiles for N virtual CPU devices instead of the real ones, so a pod's step
can be inspected on a laptop. XLA reads the device count when the backend starts; nothing
imports JAX before the command line is parsed (``import hybridpar`` is lazy), so setting
``XLA_FLAGS`` and ``JAX_PLATFORMS`` then is enough. The set-up is the train CLI's own
(``hybridpar.runtime.run.setup``, without data), so both check a config alike.

Bytes are those of each op's result shape (tuples summed; for async ``-start``/``-done``
pairs, the ``-done`` result): the payload, not the wire traffic (a ring all-reduce of B
bytes over n devices sends 2(n-1)/n x B per device). The counts are of ops in the
program; a collective inside a loop body would run once per iteration. XLA's CPU backend
has no bfloat16 reduction: it widens a bfloat16 all-reduce or reduce-scatter to float32
between two casts; those count at bfloat16's width, what the program asked for and what a
GPU or TPU moves (``comm.reduce_dtype=bfloat16`` halves the gradients' bytes here too).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from collections import Counter

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import byte_size, counted
from hybridpar.runtime.comm_report_schema import CollectiveRow, CommReport, stage_flop_loops

# Nothing above imports JAX (``import hybridpar`` is lazy), so ``--devices N`` can still set
# the virtual CPU device count before the backend starts.

# ---- HLO parsing ----------------------------------------------------------------------------

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)
_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NESTED = r"\{(?:[^{}]|\{[^{}]*\})*\}"
_GROUPS = re.compile(
    r"replica_groups=("
    + _NESTED
    + r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    + r"|mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{[^{}]*\})"
)
_PAIRS = re.compile(r"source_target_pairs=(" + _NESTED + ")")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
# the computations an instruction runs: a fusion's, a call's, a loop's body and condition
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
# The clones of one collective in the TPU compiler's fusions share a continuation chain id
# (chain_id="N"), or else a channel id; a shard_map's collectives may all have channel_id=1.
_CHAIN = re.compile(r'\bchain_id="(\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _clone_key(attrs: str) -> str | None:
    m = _CHAIN.search(attrs) or _CHANNEL.search(attrs)
    return m.group(0) if m else None

# XLA:CPU has no bfloat16 reduction and carries one in float32 in either of two ways. Its
# pass AllReducePromotion (bfloat16 to float32, the only pair it promotes) names the widened
# reduction computation ``<name>_promoted``; with that pass off (``ANALYSIS_XLA_FLAGS``),
# float normalization widens the operands and result but keeps the reduction computation's
# own bfloat16 type: ``%add.1.clone (x: bf16[], y: bf16[]) -> bf16[] {``.
_PROMOTED = re.compile(r"to_apply=%?[\w.\-]+_promoted\b")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
_REDUCER = re.compile(r"^\s*%?([\w.\-]+)\s*\(.*\)\s*->\s*(bf16|f16)\[\]\s*\{\s*$", re.M)
# XLA:CPU flags for compile-only analysis (comm_report --devices, plan): nothing compiled
# with them runs. Memory and collectives come from buffer assignment and the HLO passes,
# before LLVM: skipping LLVM's optimisations and using the older (LLVM IR) fusion emitters
# take a large part of the compile time away (a ResNet-50's memory moves by a few bytes, its
# collectives not at all). Without AllReducePromotion, XLA's all-reduce combiner no longer
# merges widened bfloat16 reductions with float32 ones into one op whose computation is a
# float32 one, which hides how many of its bytes the program asked for at bfloat16's width
# (a ResNet-50's local-BatchNorm gradients counted at float32's); float normalization widens
# them instead and keeps each reduction computation's own type (read by ``_payload_shape``).
ANALYSIS_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_disable_hlo_passes=all-reduce-promotion",
)


def with_analysis_flags(xla_flags: str) -> str:
    """An ``XLA_FLAGS`` value with ``ANALYSIS_XLA_FLAGS`` added: a flag already set keeps its
    value, except a list of disabled passes, which gains ours."""
    flags = xla_flags.split()
    for flag in ANALYSIS_XLA_FLAGS:
        name, value = flag.split("=", 1)
        mine = [i for i, f in enumerate(flags) if f.split("=", 1)[0] == name]
        if not mine:
            flags.append(flag)
        elif name == "--xla_disable_hlo_passes":
            i = mine[-1]  # XLA reads the last
            if value not in flags[i].split("=", 1)[-1].split(","):
                flags[i] += f",{value}"
    return " ".join(flags)


def _narrow_reducers(hlo_text: str) -> dict:
    """Computation name -> its 16-bit float result type, for every scalar reduction
    computation of that type."""
    return dict(_REDUCER.findall(hlo_text))


def _payload_shape(ins: dict, shape: str, narrow: dict) -> str:
    """``shape`` at the width the program asked its reduction in: float32 where XLA:CPU
    widened a bfloat16 (or float16) all-reduce or reduce-scatter reads as that type."""
    if _PROMOTED.search(ins["attrs"]):
        return re.sub(r"\bf32\[", "bf16[", shape)
    m = _TO_APPLY.search(ins["attrs"])
    if m and m.group(1) in narrow:
        return re.sub(r"\bf32\[", f"{narrow[m.group(1)]}[", shape)
    return shape


def _split_balanced(text: str) -> tuple[str, str]:
    """``"(a, (b)) rest"`` -> ``("(a, (b))", " rest")``; text must start with a bracket."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth = 0
    for i, ch in enumerate(text):
        if ch in pairs:
            depth += 1
        elif ch in pairs.values():
            depth -= 1
            if depth == 0:
                return text[: i + 1], text[i + 1 :]
    return text, ""


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape ``(a, b, (c, d))``; ``[shape]`` if not a tuple."""
    if not shape.startswith("("):
        return [shape]
    inner, parts, depth, start = shape[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; tuples are summed, tokens count 0."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            if dtype.startswith(("f8", "f6", "f4")):
                size = 1.0 if dtype.startswith("f8") else 0.5  # f8e4m3fn, f4e2m1fn, ...
            else:
                continue  # token[], opaque: no payload
        else:
            size = _DTYPE_BYTES[dtype]
        count = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                count *= int(d)
        total += count * size
    return int(total)


def _short_groups(text: str | None, pairs: bool = False) -> tuple[str, int | None]:
    """Replica groups as printed, shortened, and the group size (devices per collective)."""
    if text is None:
        return "", None
    if pairs:
        n = len(re.findall(r"\{[^{}]*\}", text[1:-1]))
        return f"{n} source-target pairs", None
    if text.startswith("mesh["):  # mesh['axis_0'=4,'axis_1'=2] {'axis_1'}: over named axes
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", text.split("]", 1)[0]))
        over = set(re.findall(r"'(\w+)'", text.rsplit("{", 1)[-1]))
        ids = re.search(r"device_ids=\(([^{]*)\)\s*\{", text)
        # Axes of size 1 change nothing: drop them and number the rest from 0.
        kept = [(a, int(n)) for a, n in sizes.items() if int(n) > 1 or a in over]
        size = math.prod(n for a, n in kept if a in over)
        where = ",".join(str(i) for i, (a, _) in enumerate(kept) if a in over)
        short = f"mesh[{','.join(str(n) for _, n in kept)}]"
        short += f" ids {ids.group(1)}" if ids else ""
        return f"{short} over axis {where}", size
    if text.startswith("["):  # iota form [groups,size]<=[devices]: already short
        dims = text.split("]", 1)[0][1:].split(",")
        return text, int(dims[-1])
    groups = re.findall(r"\{([^{}]*)\}", text[1:-1])
    if not groups:
        return "{} (all devices)", None
    size = len(groups[0].split(","))
    if len(text) <= 48:
        return text, size
    ids = groups[0].split(",")
    first = ",".join(ids) if len(ids) <= 4 else ",".join(ids[:3]) + ",...," + ids[-1]
    more = ",..." if len(groups) > 1 else ""
    return f"{len(groups)}x{size} {{{{{first}}}{more}}}", size


_MESH_FORM = re.compile(r"^mesh\[([\d,]+)\](?: ids (.+))? over axis ([\d,]+)$")
_IOTA_FORM = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _iota(dims: list[int], perm: list[int] | None):
    """XLA's iota device list ``[dims]T(perm)``: iota reshaped to `dims`, transposed."""
    import numpy as np

    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def group_sets(groups: str, devices: int) -> list[list[int]] | None:
    """The device ids of every replica group a collective row's ``groups`` text names (ids
    as the HLO numbers them: positions in the mesh's device order), or None where the
    text does not list them all (a shortened list, a permute's pairs)."""
    import numpy as np

    if groups.startswith("{} "):
        return [list(range(devices))]
    m = _IOTA_FORM.match(groups)
    if m:  # [groups,size]<=[dims]T(perm): the iota list cut into rows of the group size
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return ids.reshape(_ints(m.group(1))[0], -1).tolist()
    m = _MESH_FORM.match(groups)
    if m:  # the devices laid out on XLA's mesh, each group along the axes it is over
        sizes, ids_text, over = _ints(m.group(1)), m.group(2), _ints(m.group(3))
        iota = ids_text and re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
        if iota:
            ids = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
        elif ids_text:
            if not re.fullmatch(r"[\d, ]+", ids_text):
                return None
            ids = np.array(_ints(ids_text.replace(" ", "")))
        else:
            ids = np.arange(math.prod(sizes))
        if ids.size != math.prod(sizes):
            return None
        rest = [i for i in range(len(sizes)) if i not in over]
        ids = ids.reshape(sizes).transpose(rest + over)
        return ids.reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    if groups.startswith("{{") and "..." not in groups:  # listed in full
        return [_ints(g) for g in re.findall(r"\{([\d,]+)\}", groups)] or None
    return None


def mesh_axes_of(sets: list[list[int]], mesh: dict[str, int]) -> tuple[str, ...] | None:
    """The axes of `mesh` (outermost first; device order row-major, the last axis fastest)
    whose devices make up each of the groups `sets`, or None where the groups are not
    along whole axes (BatchNorm's ``group:N`` within one, or another mesh)."""
    import numpy as np

    sizes = list(mesh.values())
    n = math.prod(sizes)
    if n != sum(len(g) for g in sets) or any(not 0 <= i < n for g in sets for i in g):
        return None  # not this mesh's devices
    coords = np.array(np.unravel_index(sets[0], sizes)).T  # the first group's positions
    axes = [i for i, n in enumerate(sizes) if n > 1 and len(set(coords[:, i])) > 1]
    rest = [i for i in range(len(sizes)) if i not in axes]
    want = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + axes)
    want = {frozenset(g) for g in want.reshape(-1, math.prod(sizes[i] for i in axes)).tolist()}
    if {frozenset(g) for g in sets} != want:
        return None
    return tuple(a for i, a in enumerate(mesh) if i in axes)


def describe_groups(groups: str, mesh: dict[str, int], sets: list | None = None) -> str:
    """A row's ``groups`` text (``parse_collectives``: XLA's listed, iota or mesh form) for
    the report's table in one form: the axes of the run's `mesh` each group spans, e.g.
    ``over fsdp: 2 groups of 4``; where they span no whole axes, the groups and the first
    of them, e.g. ``4 groups of 2: {0,1},...``. A permute's pairs, or no text, as they are.
    `sets`: the groups' device ids where the caller has them whole (a long list's text is
    shortened past decoding)."""
    devices = math.prod(mesh.values())
    sets = sets or group_sets(groups, devices)
    m = re.match(r"(\d+)x(\d+) \{\{([^{}]*)\}", groups)  # _short_groups' shortened list
    if sets is None and m and (int(m.group(1)), int(m.group(2))) == (1, devices):
        sets = [list(range(devices))]  # one group of every device, whatever its order
    if sets is None:
        if not m:
            return groups
        n, size, first = int(m.group(1)), int(m.group(2)), m.group(3)
    else:
        n, size = len(sets), len(sets[0])
        ids = [str(i) for i in sets[0]]
        first = ",".join(ids) if len(ids) <= 4 else ",".join(ids[:3]) + ",...," + ids[-1]
        axes = mesh_axes_of(sets, mesh)
        if axes is not None:
            count = f"{counted(n, 'group')} of {size}"
            return f"over {','.join(axes)}: {count}" if axes else count
    return f"{counted(n, 'group')} of {size}: {{{first}}}{',...' if n > 1 else ''}"


def _instructions(hlo_text: str) -> list[dict]:
    out, computation = [], None
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMPUTATION.match(line)
            if c is not None:
                computation = c.group(1)
            continue
        name, rest = m.group(1), m.group(2).lstrip()
        if rest.startswith("("):
            shape, rest = _split_balanced(rest)
        else:
            shape, _, rest = rest.partition(" ")
            rest = " " + rest
        op = _OPCODE.match(rest)
        if op is None:
            continue
        operands, attrs = _split_balanced(rest[op.end() - 1 :])
        out.append(
            {
                "name": name,
                "shape": shape,
                "opcode": op.group(1),
                "operands": re.findall(r"%([\w.\-]+)", operands),
                "attrs": attrs,
                "computation": computation,
            }
        )
    return out


def _offloaded(ins: dict) -> bool:
    """A ``call-start`` run on another thread of the chip (the TPU compiler's collectives
    offloaded to the SparseCores, ``async_execution_thread="sparsecore"``): the called
    computation runs beside the TensorCore's work until its ``call-done``."""
    return ins["opcode"] == "call-start" and "async_execution_thread" in ins["attrs"]


def parse_collectives(hlo_text: str, mesh: dict[str, int] | None = None) -> list[dict]:
    """Every collective of an HLO module's text, grouped by (kind, bytes, groups, async).

    Returns dicts with ``kind``, ``count``, ``bytes`` (per op), ``total_bytes``, ``groups``
    (replica groups as printed, shortened), ``group_size`` (devices taking part in each op;
    None where the text does not say: all devices, or a collective-permute) and ``async``;
    given the program's `mesh` (axis -> size, in the device order), also ``over``: the
    groups in one form (``describe_groups``), read from the groups as printed in full.
    A collective over groups of one device moves nothing: its bytes are 0.
    An async pair (``-start`` and ``-done``) counts once, as async, with the bytes of the
    ``-done`` result; a collective wrapped in an ``async-start`` computation counts as async.
    A reduction the CPU backend widened from bfloat16 to float32 counts as bfloat16.

    The TPU compiler writes an asynchronous collective into an ``async_collective_fusion``
    computation together with the compute it overlaps, and may clone one collective into
    several fused computations: collectives inside fusions that share a ``channel_id`` are
    one (counted once, async if any copy is), and one inside such a fusion counts as async.
    """
    instrs = _instructions(hlo_text)
    narrow = _narrow_reducers(hlo_text)
    done_shape = {}
    async_computations, fused_computations = set(), set()
    for ins in instrs:
        if ins["opcode"].endswith("-done") and ins["operands"]:
            done_shape[ins["operands"][0]] = ins["shape"]
        if ins["opcode"] == "async-start":
            async_computations.update(_CALLS.findall(ins["attrs"]))
        if _offloaded(ins):
            async_computations.update(_TO_APPLY.findall(ins["attrs"]))
        if ins["opcode"] == "fusion":
            fused_computations.update(_CALLS.findall(ins["attrs"]))
    counts: Counter = Counter()
    over: dict = {}  # groups text -> describe_groups of the full groups it shortens
    seen: dict = {}  # channel_id -> the key it was counted under
    for ins in instrs:
        opcode, is_async = ins["opcode"], False
        if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
            kind, is_async = opcode[: -len("-start")], True
            shape = done_shape.get(ins["name"])
            if shape is None:  # no -done seen: the start's result is (operands, outputs, ...)
                elems = _tuple_elements(ins["shape"])
                shape = elems[1] if kind != "all-reduce" and len(elems) >= 2 else ins["shape"]
        elif opcode in KINDS:
            kind, shape = opcode, ins["shape"]
            is_async = ins["computation"] in async_computations or ins["computation"].startswith(
                "async_collective_fusion"
            )
        else:
            continue
        shape = _payload_shape(ins, shape, narrow)
        if kind == "collective-permute":
            m = _PAIRS.search(ins["attrs"])
            groups, size = _short_groups(m.group(1) if m else None, pairs=True)
        else:
            m = _GROUPS.search(ins["attrs"])
            groups, size = _short_groups(m.group(1) if m else None)
            if mesh is not None and groups not in over:
                text = m.group(1) if m else ""
                listed = re.findall(r"\{([\d,]+)\}", text) if text.startswith("{{") else []
                over[groups] = describe_groups(groups, mesh, [_ints(g) for g in listed] or None)
        # a group of one device (replica_groups={{0}}) moves nothing
        key = (kind, 0 if size == 1 else shape_bytes(shape), groups, size, is_async)
        # channel ids repeat across the CPU backend's collectives: only clones in fusions
        channel = (
            _clone_key(ins["attrs"]) if ins["computation"] in fused_computations else None
        )
        if channel is not None and channel in seen:  # a clone of one counted
            first = seen[channel]
            if is_async and not first[4]:  # count it once, as async
                counts[first] -= 1
                counts[key] += 1
                seen[channel] = key
            continue
        if channel is not None:
            seen[channel] = key
        counts[key] += 1
    counts = +counts  # drop the zero counts a move to async left
    rows = [
        dict(kind=k, count=n, bytes=b, total_bytes=n * b, groups=g, group_size=gs, **{"async": a})
        | ({"over": over.get(g, describe_groups(g, mesh))} if mesh is not None else {})
        for (k, b, g, gs, a), n in counts.items()
    ]
    rows.sort(key=lambda r: (KINDS.index(r["kind"]), -r["total_bytes"], r["groups"], r["async"]))
    return rows


# ---- What each collective overlaps with ----------------------------------------------------

# Ops that move or name data but compute nothing; anything else scheduled between a
# collective's start and done is compute it can hide behind.
_NO_COMPUTE = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy", "copy-start",
    "copy-done", "async-start", "async-update", "async-done", "after-all", "partition-id",
    "replica-id", "opt-barrier",
}  # fmt: skip
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _custom_call_target(ins: dict) -> str:
    m = _TARGET.search(ins["attrs"])
    return m.group(1) if m else ""


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip()] if m else []


# The GPU compiler's library calls that are a convolution or a matrix product: which operand
# (or -1, the result) is the convolution's output and which its kernel, in the forward
# convolution's terms that ``dim_labels`` keeps (cuDNN's backward passes are convolutions of
# the same size: dx from (dy, w), dw from (x, dy)).
_CUDNN_CONV = {
    "__cudnn$convForward": (-1, 1),
    "__cudnn$convBiasActivationForward": (-1, 1),
    "__cudnn$convBackwardInput": (0, 1),
    "__cudnn$convBackwardFilter": (1, -1),
}
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _first_array(shape: str) -> str:
    """A tuple-shaped result's first element (a library call's output, before its scratch)."""
    m = _ARRAY.search(shape)
    return m.group(0) if m else ""


def _op_flops(ins: dict, shapes: dict) -> int:
    """2 x multiply-adds of a convolution or dot, from its shapes (as XLA's cost analysis);
    also of the GPU compiler's cuDNN convolutions and cuBLAS GEMMs, which it gives none."""
    op, attrs = ins["opcode"], ins["attrs"]
    target = _custom_call_target(ins) if op == "custom-call" else ""
    operand = [shapes.get(o, "") for o in ins["operands"]]

    def dims_of(i):  # -1: the result
        if i < 0:
            return _dims(_first_array(ins["shape"]))
        return _dims(operand[i]) if i < len(operand) else []

    if op == "dot" or target in _GEMMS:
        m = (_LHS_CONTRACTING if op == "dot" else _GEMM_CONTRACTING).search(attrs)
        idx = [int(i.strip('" ')) for i in m.group(1).split(",") if i.strip('" ')] if m else []
        lhs = dims_of(0)
        return 2 * math.prod(dims_of(-1)) * math.prod(lhs[i] for i in idx if i < len(lhs))
    if op == "convolution":
        out, kernel = dims_of(-1), dims_of(1)
    elif target in _CUDNN_CONV:
        out, kernel = (dims_of(i) for i in _CUDNN_CONV[target])
    else:
        return 0
    m = _DIM_LABELS.search(attrs)
    if not kernel or m is None or "o" not in m.group(1):
        return 0
    return 2 * math.prod(out) * math.prod(kernel) // max(kernel[m.group(1).index("o")], 1)


def parse_overlap(hlo_text: str) -> list[dict]:
    """What every collective of a scheduled HLO module overlaps with, in schedule order.

    Each collective, one dict: ``kind``, ``bytes`` (as ``parse_collectives`` counts them),
    ``async``, ``computation``, ``start``/``done`` (instruction names), ``compute_ops``
    (compute scheduled between start and done), ``overlaps`` (those ops by kind:
    ``convolution``, ``dot``, ``fusion``, ``custom-call``, ...), ``flops`` (of the
    convolutions and dots among them, from their shapes) and ``exposed``: True for a
    synchronous collective or an asynchronous one with no compute between start and done.

    The asynchronous forms: ``kind-start``/``kind-done`` pairs; ``async-start``/
    ``async-done`` around a computation holding the collective; ``call-start``/``call-done``
    of a computation offloaded to another core (the TPU SparseCores); and the TPU compiler's
    fusions, where a collective starts in one fusion (``AsyncCollectiveStart``), is cloned
    into ``async_collective_fusion`` computations beside the compute it overlaps and ends in
    another (``AsyncCollectiveDone``), the clones sharing a ``channel_id``: from the first
    fusion to the last is one collective, and those fusions' own compute overlaps it.
    """
    instrs = _instructions(hlo_text)
    comps: dict = {}
    for ins in instrs:
        comps.setdefault(ins["computation"], []).append(ins)
    called = set()  # run inside another instruction: not scheduled on their own
    for ins in instrs:
        called.update(_CALLS.findall(ins["attrs"]) + _TO_APPLY.findall(ins["attrs"]))
    shapes = {c: {i["name"]: i["shape"] for i in seq} for c, seq in comps.items()}
    inner_memo: dict = {}

    def inner(comp: str) -> list[dict]:
        """Every instruction of ``comp`` and of the computations it calls."""
        if comp not in inner_memo:
            inner_memo[comp] = []
            out = []
            for ins in comps.get(comp, []):
                out.append(ins)
                for sub in _CALLS.findall(ins["attrs"]):
                    out.extend(inner(sub))
            inner_memo[comp] = out
        return inner_memo[comp]

    def is_compute(ins: dict) -> bool:
        op = ins["opcode"]
        if op in _NO_COMPUTE or op in KINDS or op.endswith(("-start", "-done")):
            return False
        if op == "custom-call":  # not the markers of an async collective or call
            return not _custom_call_target(ins).startswith(("AsyncCollective", "PrepareAsync"))
        if op == "fusion":
            body = [i for c in _CALLS.findall(ins["attrs"]) for i in inner(c)]
            return any(is_compute(i) for i in body if i["opcode"] != "fusion")
        return True

    def label(ins: dict) -> str:
        ops = {i["opcode"] for c in _CALLS.findall(ins["attrs"]) for i in inner(c)}
        for kind in ("convolution", "dot"):
            if ins["opcode"] == kind or kind in ops:
                return kind
        if ins["opcode"] == "custom-call":
            return f"custom-call {_custom_call_target(ins)}"
        return ins["opcode"]

    def flops(ins: dict) -> int:
        if ins["opcode"] in ("convolution", "dot", "custom-call"):
            return _op_flops(ins, shapes[ins["computation"]])
        return sum(flops(i) for c in _CALLS.findall(ins["attrs"]) for i in comps.get(c, []))

    narrow = _narrow_reducers(hlo_text)

    def payload(ins: dict, shape: str) -> int:
        return shape_bytes(_payload_shape(ins, shape, narrow))

    events = []
    for comp, seq in comps.items():
        if comp in called:
            continue
        chains: dict = {}  # channel id -> [collective, its fusions' positions, wrapped]
        for i, ins in enumerate(seq):
            op = ins["opcode"]
            if op in KINDS:
                events.append((comp, seq, i, i, op, payload(ins, ins["shape"]), False, ins))
            elif op.endswith("-start") and op[: -len("-start")] in KINDS:
                kind = op[: -len("-start")]
                done = next((j for j in range(i + 1, len(seq)) if seq[j]["opcode"] == f"{kind}-done"
                             and seq[j]["operands"][:1] == [ins["name"]]), None)  # fmt: skip
                shape = seq[done]["shape"] if done is not None else ins["shape"]
                events.append((comp, seq, i, done or i, kind, payload(ins, shape), True, ins))
            elif _offloaded(ins):
                body = [x for c in _TO_APPLY.findall(ins["attrs"]) for x in inner(c)]
                for coll in (x for x in body if x["opcode"] in KINDS):
                    done = next((j for j in range(i + 1, len(seq)) if seq[j]["opcode"] ==
                                 "call-done" and seq[j]["operands"][:1] == [ins["name"]]), i)
                    events.append((comp, seq, i, done, coll["opcode"],
                                   payload(coll, coll["shape"]), True, coll))  # fmt: skip
            elif _CALLS.search(ins["attrs"]):
                body = [x for c in _CALLS.findall(ins["attrs"]) for x in inner(c)]
                for coll in (x for x in body if x["opcode"] in KINDS):
                    key = _clone_key(coll["attrs"]) or ins["name"]
                    if key not in chains:
                        chains[key] = [coll, [], op == "async-start"]
                    if i not in chains[key][1]:
                        chains[key][1].append(i)
        for coll, places, wrapped in chains.values():
            start, done = places[0], places[-1]
            if wrapped:  # async-start ... async-done: follow the chain of its results
                names = {seq[start]["name"]}
                for j in range(start + 1, len(seq)):
                    if seq[j]["opcode"] in ("async-update", "async-done") and (
                        seq[j]["operands"][:1] and seq[j]["operands"][0] in names
                    ):
                        names.add(seq[j]["name"])
                        done = j
            is_async = wrapped or len(places) > 1
            events.append((comp, seq, start, done, coll["opcode"], payload(coll, coll["shape"]),
                           is_async, coll))  # fmt: skip
    out = []
    events.sort(key=lambda e: (e[0], e[2]))  # by computation, then schedule
    for comp, seq, start, done, kind, nbytes, is_async, coll in events:
        between = [x for x in seq[start + 1 : done] if is_compute(x)]
        groups = _GROUPS.search(coll["attrs"])  # devices per group (None: not stated)
        text, size = _short_groups(groups.group(1) if groups else None)
        out.append(
            dict(
                kind=kind,
                bytes=0 if size == 1 else nbytes,  # a group of one device moves nothing
                groups=text,  # as parse_collectives prints them: where its members sit
                computation=comp,
                start=seq[start]["name"],
                done=seq[done]["name"],
                compute_ops=len(between),
                overlaps=dict(Counter(label(x) for x in between)),
                flops=sum(flops(x) for x in between),
                exposed=not between,
                group_size=size,
                **{"async": is_async},
            )
        )
    return out


def describe_overlap(e: dict) -> str:
    """One collective's overlap in a few words, e.g. ``all-gather 9.0 KiB: async over 3 ops
    (2 convolution, 1 fusion; 1.2 MFLOP)`` or ``all-reduce 64 B: synchronous, exposed``."""
    head = f"{e['kind']} {byte_size(e['bytes'])}"
    if not e["async"]:
        return f"{head}: synchronous, exposed"
    if e["exposed"]:
        return f"{head}: async, nothing between start and done, exposed"
    ops = ", ".join(f"{n} {k}" for k, n in sorted(e["overlaps"].items(), key=lambda kv: -kv[1]))
    flops = f"; {e['flops'] / 1e6:.3g} MFLOP" if e["flops"] else ""
    return f"{head}: async over {e['compute_ops']} ops ({ops}{flops})"


def hidden_estimate(e: dict, peak_flops: float, collective_s: float) -> dict:
    """Whether what a collective overlaps can hide it, by estimate. ``compute_s``: the FLOPs
    scheduled between its start and done at the chip's peak (a lower bound: elementwise and
    memory-bound work count nothing); ``collective_s``: its time on the links
    (``hidden_on_target``: as ``simulate`` prices it); ``bytes_hidden`` and
    ``seconds_hidden``: the bytes and that time times the share of it the compute covers
    (0 where exposed)."""
    compute_s = e["flops"] / peak_flops
    share = 0.0 if e["exposed"] else min(1.0, compute_s / collective_s) if collective_s else 1.0
    return dict(compute_s=compute_s, collective_s=collective_s,
                bytes_hidden=int(round(e["bytes"] * share)),
                seconds_hidden=collective_s * share)  # fmt: skip


def link_preset(target):
    """The scaling model's preset of ``target``'s chip on its links, as ``simulate`` prices
    a collective there: a TPU's slice on its ICI torus and DCN between the target's slices
    (a ValueError for several slices of a chip without a DCN figure, whose traffic between
    them has no price); a GPU's, 8 to a node on NVLink and one NIC each between nodes."""
    from hybridpar import simulate as sim

    if target.platform == "gpu":
        return sim.get_preset(target.chip.name)
    preset = sim.get_preset(f"tpu-{target.chip.name}")
    return sim.slice_preset(preset, target.devices_count // target.slices, target.slices)


def hidden_preset(target):
    """``link_preset``, or None where it has no price (no chip: XLA:CPU's devices; several
    slices of a chip without a DCN figure): then no collective's hidden share is known."""
    if target is None or target.chip is None:
        return None
    try:
        return link_preset(target)
    except ValueError:
        return None


def hidden_on_target(e: dict, target, preset) -> dict:
    """``hidden_estimate`` of one collective compiled for ``target`` (which names a chip):
    its compute at the chip's bfloat16 peak against its time as ``simulate`` prices it on
    ``preset`` (``hidden_preset``: ICI within a slice, DCN between slices; a GPU's NVLink
    and NICs), the price ``plan --target`` takes for the step's collectives."""
    from hybridpar import simulate as sim

    n = e.get("group_size") or target.devices_count
    seconds = sim.op_seconds(e["kind"], e["bytes"], n, e.get("groups", ""), preset)
    return hidden_estimate(e, target.chip.peak_bf16_flops, seconds)


def hidden_of(events: list[dict], target) -> list[dict] | None:
    """``hidden_on_target`` of each of a program's collectives (``parse_overlap``), or None
    where the links have no price (``hidden_preset``): no collective's hidden share known."""
    preset = hidden_preset(target)
    return [hidden_on_target(e, target, preset) for e in events] if preset else None


def schedule_figures_of(events: list[dict], est: list[dict] | None) -> dict:
    """``{"bytes_overlapped", "bytes_exposed", "bytes_hidden_est", "seconds_hidden_est"}``
    of a program's collectives (``parse_overlap``) and their estimates (``hidden_of``):
    the bytes its schedule overlaps with compute and those it leaves exposed, and the bytes
    and collective seconds the compute beside them hides by estimate (None without one)."""
    totals = overlap_totals(events)
    return {
        "bytes_overlapped": totals["bytes_overlapped"],
        "bytes_exposed": totals["bytes_exposed"],
        "bytes_hidden_est": sum(x["bytes_hidden"] for x in est) if est is not None else None,
        "seconds_hidden_est": sum(x["seconds_hidden"] for x in est) if est is not None else None,
    }


def schedule_figures(hlo_text: str, target) -> dict:
    """``schedule_figures_of`` a program compiled for ``target``; all None without a target
    chip (XLA:CPU's schedule says nothing of an accelerator's)."""
    if target is None or target.chip is None:
        return dict.fromkeys(SCHEDULE_KEYS)
    events = parse_overlap(hlo_text)
    return schedule_figures_of(events, hidden_of(events, target))


SCHEDULE_KEYS = ("bytes_overlapped", "bytes_exposed", "bytes_hidden_est", "seconds_hidden_est")


def hidden_text(overlapped: int, hidden: int) -> str:
    """What of a program's overlapped collective bytes its compute hides, by estimate
    (``hidden_on_target``), and what it leaves: an overlapped collective is not hidden by
    being overlapped, only where the compute between takes as long as it."""
    return (
        f"est. {byte_size(hidden)} of the overlapped hidden by the compute between, "
        f"{byte_size(max(overlapped - hidden, 0))} not"
    )


def loops_with_compute(hlo_text: str) -> int:
    """How many while loops of a compiled program run convolutions or dots (in their body or
    the computations it calls): XLA's cost analysis counts a loop's body once, whatever its
    trips (the TPU compiler's windowed einsums of an fsdp mesh are such loops), so a
    program with any computes more FLOPs than its count says."""
    instrs = _instructions(hlo_text)
    comps: dict = {}
    for ins in instrs:
        comps.setdefault(ins["computation"], []).append(ins)
    memo: dict = {}

    def computes(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False  # (a computation does not call itself)
            memo[comp] = any(
                ins["opcode"] in ("convolution", "dot")
                or _custom_call_target(ins) in (*_GEMMS, *_CUDNN_CONV)  # the GPU's
                or any(computes(c) for c in _CALLED.findall(ins["attrs"]))
                for ins in comps.get(comp, [])
            )
        return memo[comp]

    return sum(
        1
        for ins in instrs
        if ins["opcode"] == "while" and any(computes(c) for c in _BODY.findall(ins["attrs"]))
    )


def overlap_totals(events: list[dict]) -> dict:
    """Bytes and ops of the collectives that overlap compute and of those exposed."""
    return {
        "bytes_overlapped": sum(e["bytes"] for e in events if not e["exposed"]),
        "bytes_exposed": sum(e["bytes"] for e in events if e["exposed"]),
        "ops_overlapped": sum(1 for e in events if not e["exposed"]),
        "ops_exposed": sum(1 for e in events if e["exposed"]),
    }


# ---- The report -----------------------------------------------------------------------------


def cost_of(compiled) -> dict:
    """``{"flops": ..., "bytes_accessed": ...}`` per device from the compiler's
    ``cost_analysis`` (each None where the backend does not say)."""
    try:
        ca = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError, ValueError):  # not on every backend
        ca = None
    parts = ca if isinstance(ca, (list, tuple)) else [ca]
    out = {}
    for key, name in (("flops", "flops"), ("bytes_accessed", "bytes accessed")):
        vals = [d[name] for d in parts if isinstance(d, dict) and d.get(name) is not None]
        out[key] = float(sum(vals)) if vals else None
    return out


def _flops(compiled) -> float | None:
    return cost_of(compiled)["flops"]


def report(config, virtual_devices: int | None = None, target=None, say=None) -> CommReport:
    """Compiles the config's train steps for the mesh and returns the report; ``target``: a
    ``hybridpar.tools.targets.Target`` whose devices (a TPU topology's) the mesh is laid on;
    ``say``: called with a line as each program starts compiling.

    A run with ``config.stages`` compiles one train step per stage (its batch and image
    size; ``config.global_batch`` is not used): each is compiled here, as the compile tool
    does (``run.programs_of``), and the report's figures are those of the one needing
    the most memory per device, the one a memory limit must hold; ``stage_programs`` gives
    every stage's, and ``stage`` says which stage the figures are from."""
    import copy

    from hybridpar.runtime.run import check_epoch, memory_line, programs_of, setup

    say = say or (lambda line: None)
    if virtual_devices is not None and config.model.conv_grad == "auto":
        # virtual CPU devices stand for a pod's chips: their kernel gradients, not the im2col
        # form auto picks on XLA:CPU (it changes the memory and the collectives reported)
        config = copy.deepcopy(config)
        config.model.conv_grad = "xla"
    devices = target.devices() if target is not None else None
    try:
        run = setup(config, with_data=False, devices=devices)  # the train CLI's own checks
    except ConfigError as e:
        wanted = re.search(r"needs (\d+) devices but .*?, or run on ", str(e))
        if not wanted:  # (a batch that does not divide over them, ...: the hint is no fix)
            raise
        # a mesh for another count: a target of that count, or this tool's own flag
        n = wanted.group(1)
        head = str(e)[: wanted.end() - len(", or run on ")]
        if target is not None and target.chip is not None:
            from hybridpar.tools.targets import target_hint

            raise ConfigError(f"{head} ({target_hint(target, config.mesh)})") from None
        raise ConfigError(f"{head}, or compile for {n} virtual CPU devices with --devices {n}")
    check_epoch(run)  # a batch over an epoch is the run's error at its start: said now
    mesh, program, applied = run.mesh, run.program, run.xla_flags
    if target is not None:
        program.compiler_options = target.compiler_options()
    steps = [(b, size) for kind, b, size in programs_of(run) if kind == "train"]
    rows = []
    for i, (batch, size) in enumerate(steps, 1):
        say(f"compiling train b{batch} {size}px ({i}/{len(steps)}) ...")
        compiled = program.train_step(batch, size)
        hlo = compiled.as_text()
        collectives = parse_collectives(hlo, dict(mesh.shape))
        mem_text, mem = memory_line(compiled)  # at least the compiler's peak (memory_of)
        rows.append(dict(
            stages=[s.index for s in run.plan.stages
                    if (s.stage.global_batch, s.stage.image_size) == (batch, size)],
            global_batch=batch, image_size=size,
            memory_per_device_bytes=mem.get("total"),
            total_bytes=sum(r["total_bytes"] for r in collectives),
            total_ops=sum(r["count"] for r in collectives),
            flops=_flops(compiled),
            flop_loops=loops_with_compute(hlo),  # XLA's count takes their bodies once
            compile_s=round(program.compiles[-1]["compile_s"], 3),
            figures=(compiled, collectives, mem_text, mem),
        ))  # fmt: skip
    big = max(rows, key=lambda r: r["memory_per_device_bytes"] or 0)  # the first of a tie
    compiled, collectives, mem_text, mem = big["figures"]
    hlo = compiled.as_text()
    by_kind: dict = {}
    for r in collectives:
        k = by_kind.setdefault(r["kind"], {"count": 0, "bytes": 0})
        k["count"] += r["count"]
        k["bytes"] += r["total_bytes"]
    dev = run.mesh.devices.flat[0]
    d = config.data
    return CommReport(
        collectives=tuple(CollectiveRow.from_dict(r) for r in collectives),
        by_kind=by_kind,
        total_bytes=big["total_bytes"],
        total_ops=big["total_ops"],
        flops=big["flops"],
        bytes_accessed=cost_of(compiled)["bytes_accessed"],
        memory_per_device_bytes=big["memory_per_device_bytes"],
        memory=mem,
        memory_text=mem_text,
        mesh=dict(mesh.shape),
        devices={
            "count": run.mesh.size,
            "platform": dev.platform,
            "kind": dev.device_kind,
            "virtual": virtual_devices is not None,
        },
        xla_flags_applied=applied,
        global_batch=big["global_batch"],
        image_shape=[big["image_size"], big["image_size"], d.channels],
        compile_s=round(sum(r["compile_s"] for r in rows), 3),
        config=json.loads(config.to_json()),
        stage=big["stages"][0],
        stage_programs=[{k: v for k, v in r.items() if k != "figures"} for r in rows],
        **schedule_figures(hlo, target),
    )


def format_report(rep: CommReport, config_path: str) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in rep.mesh.items())
    dev = rep.devices
    lines = [
        (
            f"comm_report: {config_path} on {dev['count']} {dev['platform']} devices"
            f"{' (virtual)' if dev['virtual'] else ''}; mesh {mesh}; global batch "
            f"{rep.global_batch}; images {'x'.join(map(str, rep.image_shape))}"
        ),
    ]
    programs = rep.stage_programs or []
    if len(programs) > 1 or rep.config.get("stages"):
        lines.append(
            "the run's train steps, one per stage: "
            + "; ".join(
                f"stage {','.join(map(str, p['stages']))} batch {p['global_batch']} "
                f"{p['image_size']} px: {byte_size(p['memory_per_device_bytes'] or 0)}/device, "
                f"{p['total_ops']} collective ops {byte_size(p['total_bytes'])}"
                for p in programs
            )
        )
        lines.append(
            f"the figures below are stage {rep.stage}'s (batch {rep.global_batch}), the one "
            "needing the most memory per device"
        )
    lines += [
        f"compiled {len(programs) if len(programs) > 1 else 'the'} train step"
        f"{'s' if len(programs) > 1 else ''} in {rep.compile_s:.1f}s"
        + (f" with {' '.join(rep.xla_flags_applied)}" if rep.xla_flags_applied else "")
        + (
            "; kernel gradients as a GPU or TPU computes them (model.conv_grad=xla)"
            if dev["virtual"] and rep.config["model"]["conv_grad"] == "xla"
            else ""
        ),
        "",
        "collectives in the optimized HLO (bytes per op from its result shape):",
        f"  {'kind':<20} {'count':>5} {'bytes/op':>12} {'total':>12}  {'async':<5}  groups",
    ]
    # the groups in one form (describe_groups): XLA writes the same groups in several (mesh,
    # iota), which the JSON keeps as printed; rows that then read alike are one row
    shown: Counter = Counter()
    for r in rep.collectives:
        said = r.over or describe_groups(r.groups, rep.mesh)  # a report before `over`: its text
        shown[(r.kind, r.bytes, said, r.is_async)] += r.count
    for (kind, nbytes, groups, is_async), n in sorted(
        shown.items(), key=lambda kv: (KINDS.index(kv[0][0]), -kv[0][1] * kv[1], *kv[0][2:])
    ):
        lines.append(
            f"  {kind:<20} {n:>5} {byte_size(nbytes):>12} {byte_size(n * nbytes):>12}"
            f"  {'yes' if is_async else 'no':<5}  {groups}"
        )
    if not rep.collectives:
        lines.append("  (none)")
    kinds = ", ".join(
        f"{k} {counted(v['count'], 'op')} {byte_size(v['bytes'])}" for k, v in rep.by_kind.items()
    )
    lines += [
        "",
        f"total per step: {rep.total_ops} collective ops, {byte_size(rep.total_bytes)}"
        + (f" ({kinds})" if kinds else ""),
    ]
    if rep.bytes_overlapped is not None:  # compile's figures of the same schedule
        hidden = rep.bytes_hidden_est
        lines.append(
            f"the compiler's schedule: {byte_size(rep.bytes_overlapped)} overlapped with "
            f"compute, {byte_size(rep.bytes_exposed)} exposed"
            + (f"; {hidden_text(rep.bytes_overlapped, hidden)}" if hidden is not None else "")
        )
    loops = stage_flop_loops(programs, rep.stage)
    lines += [
        "FLOPs per step per device (cost_analysis): "
        + (f"{rep.flops:.4g}" if rep.flops is not None else "not reported")
        + (
            f", short of what the step computes: XLA counts a loop's body once, and the step "
            f"runs {loops} loops of convolutions or dots (on an fsdp mesh, the TPU compiler's "
            "windowed einsums)"
            if loops and rep.flops is not None
            else ""
        ),
        rep.memory_text,
    ]
    return "\n".join(lines)


# XLA:CPU makes every virtual device as its backend starts, in a time that grows nearly as
# the count squared (4,096: 2 s; 16,384: 25 s; 100,000: minutes, with no output). 4,096 is
# also the most chips of a TPU target (tpu:v5p-8192).
MAX_VIRTUAL_DEVICES = 4096


def check_virtual_devices(n: int, flag: str, gpu: bool = True) -> None:
    """``n`` virtual CPU devices are at least one and at most ``MAX_VIRTUAL_DEVICES``, or one
    ``error:`` line naming ``flag`` (``gpu``: whether the tool compiles for GPU targets)."""
    if n < 1:
        cli.fail(f"{flag} must be a positive integer")
    if n > MAX_VIRTUAL_DEVICES:
        pods = "tpu:CHIP-N" + (" or gpu:GPU-N" if gpu else "")
        cli.fail(
            f"{flag}: at most {MAX_VIRTUAL_DEVICES} virtual CPU devices (XLA:CPU's start-up "
            f"grows about as their count squared); to compile for a real pod use --target {pods} "
            "instead, e.g. --target tpu:v5p-8192"
        )


def use_virtual_cpu_devices(n: int) -> None:
    """N virtual CPU devices for this process, compiled for only (``ANALYSIS_XLA_FLAGS``);
    must run before JAX's backend starts."""
    from hybridpar.tools import targets

    check_virtual_devices(n, f"--devices={n}")
    targets.prepare(targets.Target("cpu", n))
    os.environ["XLA_FLAGS"] = with_analysis_flags(os.environ["XLA_FLAGS"])


def target_of(spec: str | None, devices: int | None, gpu: bool = True):
    """The ``--target`` of plan and comm_report alike, parsed (None without one), or one
    ``error:`` line; ``--devices`` beside it must be its count, the one compiled for
    (``gpu``: as ``check_virtual_devices``)."""
    if not spec:
        return None
    from hybridpar.tools import targets

    try:
        target = targets.parse(spec)
    except ConfigError as e:
        cli.fail(str(e))
    if devices not in (None, target.devices_count):
        cli.fail(
            f"--devices={devices} but --target {spec} has {target.devices_count} "
            "devices; pass one of them"
        )
    if target.platform == "cpu":
        check_virtual_devices(target.devices_count, f"--target {spec}", gpu)
    return target


def main(argv=None) -> None:
    if argv is None:  # the command itself (a TPU target's compile needs it: see there)
        from hybridpar.tools import targets

        targets.unlimited_stack_for_tpu(sys.argv[1:])
    parser = cli.ArgumentParser(
        "python -m hybridpar.comm_report",
        (
            "Compile the train step ahead of time and report what it communicates: every "
            "collective, bytes, FLOPs and per-device memory."
        ),
    )
    parser.add_argument(
        "--devices", type=int, help="compile for N virtual CPU devices instead of the real ones"
    )
    parser.add_argument(
        "--target",
        help="compile for a TPU topology with the TPU compiler (no TPU needed), e.g. "
        "tpu:v5e-16, or for GPUs with the GPU compiler (no GPU needed), e.g. gpu:h100-16; "
        "or cpu:N, as --devices N",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, config = cli.parse(parser, argv)
    target = target_of(args.target, args.devices)
    if target is not None:
        from hybridpar.tools import targets

        try:
            targets.prepare(target, config.comm)
        except ConfigError as e:
            cli.fail(str(e))
        if target.platform == "cpu":
            args.devices, target = target.devices_count, None
    if args.devices is not None:
        use_virtual_cpu_devices(args.devices)

    def say(line):  # progress: on stderr under --json, so stdout is the one object
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    def run():
        if not args.json:
            print(format_report(report(config, args.devices, target, say), args.config_path))
            return
        # the run's set-up prints its warnings on stdout, as the trainer's log does: here
        # they go to stderr, so stdout is the one object
        with contextlib.redirect_stdout(sys.stderr):
            rep = report(config, args.devices, target, say)
        print(rep.to_json())

    cli.main(run)


if __name__ == "__main__":
    main()
