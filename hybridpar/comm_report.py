"""``python -m hybridpar.comm_report --config experiments/NAME.py [--devices N] [--json]``.

Compiles the train step ahead of time with abstract inputs (no data, nothing allocated) and
reports what the optimized HLO communicates: every collective (kind, count, bytes, replica
groups, async or not), the bytes per step, the FLOPs and the per-device memory.

``--devices N`` compiles for N virtual CPU devices instead of the real ones, so a pod's step
can be inspected on a laptop. XLA reads the device count when the backend starts, and jax
reads ``JAX_PLATFORMS`` when it is imported, which ``python -m`` has already done (through
``hybridpar/__init__.py``) by the time this module runs. So the top of this module, before
anything else of ours is imported, sets ``XLA_FLAGS`` and ``JAX_PLATFORMS`` for any later
process and updates ``jax.config`` (``jax_platforms``, ``jax_num_cpu_devices``) for this one;
only if the backend had somehow started already does it re-execute the interpreter with the
environment set.

Bytes are those of each op's result shape (tuples summed; for async ``-start``/``-done``
pairs, the ``-done`` result): the payload, not the wire traffic (a ring all-reduce of B
bytes over n devices sends 2(n-1)/n x B per device). The counts are of ops in the
program; a collective inside a loop body would run once per iteration.
"""

from __future__ import annotations

import os
import sys

_REEXEC_GUARD = "_HYBRIDPAR_COMM_REPORT_REEXEC"


def _devices_from_argv(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--devices="):
            return a.split("=", 1)[1]
    return None


def _use_virtual_cpu_devices(value: str) -> None:
    """N virtual CPU devices for this process, set before the jax backend starts."""
    try:
        n = int(value)
        if n < 1:
            raise ValueError
    except ValueError:
        print(f"error: --devices={value!r} must be a positive integer", file=sys.stderr)
        sys.exit(2)
    kept = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" not in sys.modules:
        return  # jax will read the environment when it is imported and started
    import jax

    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # private API moved: assume the worst
        started = True
    if not started:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
        return
    if os.environ.get(_REEXEC_GUARD):
        print("error: could not switch to virtual CPU devices", file=sys.stderr)
        sys.exit(2)
    os.environ[_REEXEC_GUARD] = "1"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "hybridpar.comm_report", *sys.argv[1:]])


if __name__ == "__main__":
    _n = _devices_from_argv(sys.argv[1:])
    if _n is not None:
        _use_virtual_cpu_devices(_n)

# ---- From here on jax may start -------------------------------------------------------------
import json
import logging
import math
import re
import time
from collections import Counter

import jax
from absl import app, flags

from hybridpar import comm
from hybridpar.comm_report_schema import CollectiveRow, CommReport
from hybridpar.config import validate
from hybridpar.errors import ConfigError
from hybridpar.mesh import make_mesh
from hybridpar.program import build_program, check_batch_sizes

# The train CLI's --config flag (ml_collections, lock_config=True) and its parser, so both
# tools read configs and report misspelt keys the same way.
from hybridpar.train import _parse_flags, config_from_flags, memory_line

_DEVICES = flags.DEFINE_integer(
    "devices", None, "Compile for this many virtual CPU devices instead of the real ones."
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")

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


def parse_collectives(hlo_text: str) -> list[dict]:
    """Every collective of an HLO module's text, grouped by (kind, bytes, groups, async).

    Returns dicts with ``kind``, ``count``, ``bytes`` (per op), ``total_bytes``, ``groups``
    (replica groups as printed, shortened), ``group_size`` (devices taking part in each op;
    None where the text does not say: all devices, or a collective-permute) and ``async``.
    An async pair (``-start`` and ``-done``) counts once, as async, with the bytes of the
    ``-done`` result; a collective wrapped in an ``async-start`` computation counts as async.
    """
    instrs = _instructions(hlo_text)
    done_shape = {}
    async_computations = set()
    for ins in instrs:
        if ins["opcode"].endswith("-done") and ins["operands"]:
            done_shape[ins["operands"][0]] = ins["shape"]
        if ins["opcode"] == "async-start":
            async_computations.update(_CALLS.findall(ins["attrs"]))
    counts: Counter = Counter()
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
            is_async = ins["computation"] in async_computations
        else:
            continue
        if kind == "collective-permute":
            m = _PAIRS.search(ins["attrs"])
            groups, size = _short_groups(m.group(1) if m else None, pairs=True)
        else:
            m = _GROUPS.search(ins["attrs"])
            groups, size = _short_groups(m.group(1) if m else None)
        counts[(kind, shape_bytes(shape), groups, size, is_async)] += 1
    rows = [
        dict(kind=k, count=n, bytes=b, total_bytes=n * b, groups=g, group_size=gs, **{"async": a})
        for (k, b, g, gs, a), n in counts.items()
    ]
    rows.sort(key=lambda r: (KINDS.index(r["kind"]), -r["total_bytes"], r["groups"], r["async"]))
    return rows


# ---- The report -----------------------------------------------------------------------------


def _flops(compiled) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError, ValueError):  # not on every backend
        return None
    if isinstance(ca, (list, tuple)):
        vals = [d.get("flops") for d in ca if d and d.get("flops") is not None]
        return float(sum(vals)) if vals else None
    if isinstance(ca, dict) and ca.get("flops") is not None:
        return float(ca["flops"])
    return None


def report(config, virtual_devices: int | None = None) -> dict:
    """Compiles the config's train step for the mesh and returns the report as a dict."""
    validate(config)
    platform = comm.detect_platform()
    applied = comm.apply(config.comm, platform)  # before the backend starts

    try:
        mesh = make_mesh(config.mesh)
    except ConfigError as e:
        hint = " (comm_report: --devices N compiles for N virtual CPU devices)"
        raise ConfigError(f"{e}{hint}") from None
    check_batch_sizes(config, mesh)  # the same checks as the train CLI
    d = config.data
    image_shape = (d.image_size, d.image_size, d.channels)

    t0 = time.time()
    program = build_program(config, mesh, image_shape, steps_per_epoch=1, total_steps=1)
    compiled = program.lower_train(config.global_batch).compile()
    compile_s = time.time() - t0

    collectives = parse_collectives(compiled.as_text())
    by_kind: dict = {}
    for r in collectives:
        k = by_kind.setdefault(r["kind"], {"count": 0, "bytes": 0})
        k["count"] += r["count"]
        k["bytes"] += r["total_bytes"]
    mem_text, mem = memory_line(compiled)
    dev = jax.devices()[0]
    return CommReport(
        collectives=tuple(CollectiveRow.from_dict(r) for r in collectives),
        by_kind=by_kind,
        total_bytes=sum(r["total_bytes"] for r in collectives),
        total_ops=sum(r["count"] for r in collectives),
        flops=_flops(compiled),
        memory_per_device_bytes=mem.get("total"),
        memory=mem,
        memory_text=mem_text,
        mesh=dict(mesh.shape),
        devices={
            "count": jax.device_count(),
            "platform": dev.platform,
            "kind": dev.device_kind,
            "virtual": virtual_devices is not None,
        },
        xla_flags_applied=applied,
        global_batch=config.global_batch,
        image_shape=list(image_shape),
        compile_s=round(compile_s, 3),
        config=json.loads(config.to_json()),
    )


def _mib(n: float) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{int(n)} B"


def format_report(rep: CommReport, config_path: str) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in rep.mesh.items())
    dev = rep.devices
    lines = [
        (
            f"comm_report: {config_path} on {dev['count']} {dev['platform']} devices"
            f"{' (virtual)' if dev['virtual'] else ''}; mesh {mesh}; global batch "
            f"{rep.global_batch}; images {'x'.join(map(str, rep.image_shape))}"
        ),
        f"compiled the train step in {rep.compile_s:.1f}s"
        + (f" with {' '.join(rep.xla_flags_applied)}" if rep.xla_flags_applied else ""),
        "",
        "collectives in the optimized HLO (bytes per op from its result shape):",
        f"  {'kind':<20} {'count':>5} {'bytes/op':>12} {'total':>12}  {'async':<5}  groups",
    ]
    for r in rep.collectives:
        lines.append(
            f"  {r.kind:<20} {r.count:>5} {_mib(r.bytes):>12} {_mib(r.total_bytes):>12}"
            f"  {'yes' if r.is_async else 'no':<5}  {r.groups}"
        )
    if not rep.collectives:
        lines.append("  (none)")
    kinds = ", ".join(f"{k} {v['count']} ops {_mib(v['bytes'])}" for k, v in rep.by_kind.items())
    lines += [
        "",
        f"total per step: {rep.total_ops} collective ops, {_mib(rep.total_bytes)}"
        + (f" ({kinds})" if kinds else ""),
        "FLOPs per step per device (cost_analysis): "
        + (f"{rep.flops:.4g}" if rep.flops is not None else "not reported"),
        rep.memory_text,
    ]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = config_from_flags()
    try:
        rep = report(config, _DEVICES.value)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if _JSON.value:
        print(rep.to_json())
    else:
        print(format_report(rep, flags.FLAGS["config"].config_filename))


def run():
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
