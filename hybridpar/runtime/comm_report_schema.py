"""What ``python -m hybridpar.comm_report --json`` prints, as one dataclass.

comm_report builds a `CommReport` and writes it with `to_json`; ``hybridpar.simulate``
reads it back with `from_json`. One definition keeps the writer and the reader from
drifting apart. Plain Python, no JAX: the simulator must run without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

_WRITER = "python -m hybridpar.comm_report --config ... --json"


@dataclass(frozen=True)
class CollectiveRow:
    """The ops of one (kind, bytes, groups, async) in the optimized HLO.

    kind: the HLO opcode without ``-start``/``-done`` (an async pair counts once).
    bytes: of one op's result shape (for a reduce-scatter, one shard), not wire traffic.
    groups: the replica groups as printed, shortened; group_size: devices per op, None where
      the HLO does not say (all devices, or the source-target pairs of a permute).
    over: the groups as the mesh axes they span, e.g. ``over fsdp: 2 groups of 16``, read
      from the groups in full (None in reports written before it).
    """

    kind: str
    count: int
    bytes: int
    total_bytes: int
    groups: str
    group_size: int | None
    is_async: bool  # "async" in the JSON: a Python keyword
    over: str | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["async"] = d.pop("is_async")
        if d["over"] is None:  # a row read from before it: as it was
            del d["over"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CollectiveRow:
        d = dict(d)
        d["is_async"] = d.pop("async")
        return cls(**d)


@dataclass(frozen=True)
class CommReport:
    """One compiled train step: its collectives, FLOPs, memory, mesh and config.

    flops and memory_per_device_bytes are one device's share, None where the backend does
    not report them. memory_text is the table's memory line; the JSON has `memory` instead.
    """

    collectives: tuple[CollectiveRow, ...]
    by_kind: dict[str, dict[str, int]]  # kind -> {"count", "bytes"} summed over its rows
    total_bytes: int
    total_ops: int
    flops: float | None
    memory_per_device_bytes: int | None
    memory: dict[str, int]
    mesh: dict[str, int]  # every axis, size-1 ones too: {"data": 8, "fsdp": 1, "model": 1}
    devices: dict  # {"count": N, "platform": ..., "kind": ..., "virtual": bool}
    xla_flags_applied: list[str]
    global_batch: int
    image_shape: list[int]  # [height, width, channels]
    compile_s: float
    config: dict
    memory_text: str = dataclasses.field(default="", compare=False)
    # by the compiler's cost_analysis, per device; absent from reports written before it
    bytes_accessed: float | None = None
    # Compiled for a TPU or GPU target only (None for XLA:CPU, whose schedule says nothing
    # of an accelerator's, and in reports written before them): the collective bytes the
    # compiler's schedule leaves exposed (synchronous, or nothing scheduled between start
    # and done), and the bytes the compute scheduled beside them hides, by estimate
    # (comm_report.hidden_estimate at the target chip's figures).
    bytes_exposed: int | None = None
    bytes_hidden_est: int | None = None
    # Likewise: the collective bytes the schedule overlaps with compute (compile's count of
    # the same schedule), and the collective seconds the compute hides, by estimate, each
    # collective priced as the scaling model prices it on the target's links (what
    # `plan --target` takes from its comm time); the latter None where those links have no
    # price. Absent from reports written before them.
    bytes_overlapped: int | None = None
    seconds_hidden_est: float | None = None
    # A run compiles one train step per curriculum stage: every figure above is stage
    # `stage`'s (the one needing the most memory per device; global_batch and image_shape
    # are its own), and `stage_programs` has each distinct step's figures, one dict each
    # ("stages": the indices that run it, "global_batch", "image_size",
    # "memory_per_device_bytes", "total_bytes", "total_ops", "flops", "flop_loops",
    # "compile_s"; "flop_loops": the loops of convolutions or dots it runs, whose bodies
    # XLA's FLOP count takes once, so with any its "flops" are short; absent from rows
    # written before it: unknown, not none). Absent from reports written before them.
    stage: int | None = None
    stage_programs: list[dict] | None = None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del d["memory_text"]
        d["collectives"] = [c.to_dict() for c in self.collectives]
        for key in ("stage", "stage_programs"):  # a report read from before them: as it was
            if d[key] is None:
                del d[key]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def hidden_share(self) -> float | None:
        """The share of the step's collective bytes the compiler's schedule hides, by
        estimate; None where the report has no estimate (`hidden_share`)."""
        return hidden_share(self.total_bytes, self.bytes_hidden_est)

    @classmethod
    def from_dict(cls, d, source: str = "the input") -> CommReport:
        """A report from its JSON object; anything else is one ValueError naming `source`."""
        problem = _problem(d)
        if problem is not None:
            raise ValueError(
                f"{source} is not a comm_report JSON ({problem}); write one with `{_WRITER} > FILE`"
            )
        rows = tuple(CollectiveRow.from_dict(c) for c in d["collectives"])
        return cls(**dict(d, collectives=rows))

    @classmethod
    def from_json(cls, text: str, source: str = "the input") -> CommReport:
        """The report in `text`. Lines before it are skipped: a redirect with ``2>&1`` puts
        JAX's warnings ahead of the JSON, which comm_report prints as one last line."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError:
            lines = text.strip().splitlines() or [""]
            try:
                d = json.loads(lines[-1])
            except json.JSONDecodeError:
                raise ValueError(
                    f"{source} is not a comm_report JSON (no JSON object in it); write one "
                    f"with `{_WRITER} > FILE`"
                ) from None
        return cls.from_dict(d, source)


_REPORT_KEYS = {f.name for f in dataclasses.fields(CommReport)} - {"memory_text"}
_OPTIONAL_KEYS = {
    "bytes_accessed", "bytes_exposed", "bytes_hidden_est", "stage", "stage_programs",
    "bytes_overlapped", "seconds_hidden_est",
}  # fmt: skip
_ROW_KEYS = {f.name for f in dataclasses.fields(CollectiveRow)} - {"is_async"} | {"async"}


def hidden_share(total_bytes, bytes_hidden_est) -> float | None:
    """`bytes_hidden_est` over `total_bytes`, in [0, 1]; None without an estimate. The
    schedule's estimate covers the collectives it sees (not those inside a loop's body):
    the rest count as exposed."""
    if bytes_hidden_est is None:
        return None
    if not total_bytes:
        return 1.0  # no collective bytes: nothing to expose
    return min(1.0, max(0.0, bytes_hidden_est / total_bytes))


def stage_flop_loops(stage_programs: list[dict] | None, stage: int | None) -> int | None:
    """How many loops of convolutions or dots the step of stage `stage` runs (its row of
    `stage_programs`): XLA's FLOP count takes a loop's body once, so with any that count is
    short. None where the report does not say: unknown, not none."""
    for p in stage_programs or []:
        if stage in p.get("stages", []):
            return p.get("flop_loops")
    return None


def _problem(d) -> str | None:
    """The first thing that keeps `d` from being comm_report's JSON object, or None."""
    if (bad := _keys(d, _REPORT_KEYS, _OPTIONAL_KEYS)) is not None:
        return bad
    if not isinstance(d["collectives"], list):
        return "`collectives` is not a list"
    for i, row in enumerate(d["collectives"]):
        if (bad := _keys(row, _ROW_KEYS, {"over"})) is not None:
            return f"collectives[{i}]: {bad}"
    if not isinstance(d["devices"], dict) or "count" not in d["devices"]:
        return "`devices` has no count"
    return None


def _keys(d, keys: set[str], optional: set[str] = frozenset()) -> str | None:
    """What keeps `d` from being an object with exactly `keys` (`optional` ones may be
    absent), or None."""
    if not isinstance(d, dict):
        return f"a {type(d).__name__}, not an object"
    missing, extra = sorted(keys - optional - d.keys()), sorted(d.keys() - keys)
    said = [f"missing {', '.join(missing)}"] * bool(missing)
    said += [f"unexpected {', '.join(extra)}"] * bool(extra)
    return "; ".join(said) or None
