"""Run records: the events of a run's ``metrics.jsonl`` (one dataclass per event), their one
line format and one reader, a run's records gathered for the tools that compare runs, and
the one atomic JSON write (``summary.json``, ``config.json`` and the tools' results).

    rec = make("eval", step=330, epoch=15.0, wall_s=65.5, split="test", loss=0.62, ...)
    line = to_line(rec)                             # what metrics.MetricsWriter appends
    recs, offset = read_records(path)               # Record objects, a cut last line left out
    run = read_run(workdir)                         # the trainer's and evaluator's records

Every line is ``{"event", "step", "epoch", "wall_s", ...}``; a field an event does not
declare is a ``TypeError`` when written (add it to the event's class), and is kept in
``extra`` (and written back) when read, so files of other versions read and round-trip.
A field declared with a default of None is left out of the line while it is None.

``summary.json``'s ``time_breakdown`` is ``{part: seconds}`` (``TIME_PARTS`` names the
usual parts, in the order the report stacks them; other parts are drawn after them) and
``goodput`` the fraction of the wall time spent in train steps.

JAX-free: the report, the simulator's calibration and the benches read runs without devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from hybridpar.config.errors import ConfigError, WorkdirError

# summary.json's time_breakdown parts: seconds each; together the run's wall time.
TIME_PARTS = {
    "setup": "set-up before the first compile (config, data, devices, restoring state)",
    "compile": "compiling before the first step",
    "compile_wait": "stage switches waiting for a background compile",
    "train": "train steps (goodput: this over the wall time)",
    "input_wait": "steps waiting for their next batch",
    "eval": "evaluations",
    "checkpoint": "checkpoint saves' blocking parts, and the wait for the last one",
    "redone": "steps run again after a restart from an older checkpoint",
    "lost": "what a stopped start ran after its last checkpoint (to its last record)",
}


@dataclasses.dataclass(kw_only=True)
class Record:
    """An event's common fields; ``extra``: fields this version does not declare."""

    event: str
    step: int | None
    epoch: float | None
    wall_s: float | None  # from the run's start, over every resumed segment
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Data(Record):
    event: str = "data"
    source: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    train_examples: int | None = None
    eval_examples: int | None = None
    num_classes: int | None = None
    skipped: int | None = None
    converted: int | None = None
    rotated: int | None = None
    ignored: int | None = None  # files that may be images but were not read (manifest lists them)
    splits: dict | None = None  # per split: examples, skipped, converted, rotated, ...
    classes: list | None = None  # the class names in label order
    # a digest of the train split's files (datasets.files_digest): other files of the same
    # count between starts differ here (None: not known, as in records before it)
    train_fingerprint: str | None = None


@dataclasses.dataclass(kw_only=True)
class Compile(Record):
    event: str = "compile"
    program: str  # train or eval
    batch: int
    image_size: int
    compile_s: float
    cache_hit: bool | None = None
    loaded_from: str | None = None  # an executables file
    memory_per_device_bytes: dict | None = None
    background: bool | None = None
    wait_s: float | None = None  # a background compile: how long its stage switch waited

    @property
    def waited_s(self) -> float:
        return waited_s(self.background, self.compile_s, self.wait_s)


def waited_s(background: bool | None, compile_s: float, wait_s: float | None) -> float:
    """A compilation's time on the training's critical path, as summary.json's ``compile_s``
    counts it: a background one's wait at its stage switch (the rest overlapped training),
    else the compile itself."""
    return (wait_s or 0.0) if background else compile_s


@dataclasses.dataclass(kw_only=True)
class Stage(Record):
    event: str = "stage"
    stage: int
    image_size: int
    global_batch: int
    min_scale: float | None = None
    steps: int | None = None
    data_parallel: int | None = None
    # the start's mesh as resolved on its devices ("data:8"; the trainer's mesh_text), which
    # a resume compares: the config's "data:-1" reads the same on any number of devices
    mesh: str | None = None
    # the dtype the start's gradients were summed in (comm.reduce_dtype, auto resolved by
    # the mode and mesh), which a resume compares as it does the mesh
    reduce_dtype: str | None = None


@dataclasses.dataclass(kw_only=True)
class Train(Record):
    event: str = "train"
    loss: float | None  # None: a step since the last line had a non-finite loss
    lr: float
    momentum: float | None = None
    images_per_s: float | None = None
    image_size: int | None = None
    global_batch: int | None = None
    stage: int | None = None
    skipped_steps: int | None = None
    loss_scale: float | None = None


@dataclasses.dataclass(kw_only=True)
class Eval(Record):
    event: str = "eval"
    split: str | None = None
    loss: float | None = None
    top1: float
    top5: float
    examples: int | None = None
    source: str | None = None  # "evaluator": python -m hybridpar.evaluate's


@dataclasses.dataclass(kw_only=True)
class EvalSkipped(Record):
    event: str = "eval_skipped"
    source: str | None = None
    reason: str | None = None


@dataclasses.dataclass(kw_only=True)
class Checkpoint(Record):
    event: str = "checkpoint"
    blocking_s: float | None = None
    total_s: float | None = None
    bytes: int | None = None
    path: str | None = None


@dataclasses.dataclass(kw_only=True)
class Resume(Record):
    event: str = "resume"
    from_step: int | None = None
    from_wall_s: float | None = None  # the resumed checkpoint's wall_s (0.0: none)
    # the last start's time after that checkpoint's snapshot, to its last record: the
    # checkpoint's own save (counted as checkpoint time), then the rest (lost); wall_s goes
    # on from from_wall_s + saving_s + lost_s
    saving_s: float | None = None
    lost_s: float | None = None
    data_epoch: int | None = None
    data_step_in_epoch: int | None = None
    directory: str | None = None
    changed_keys: list | None = None
    # the training set's size at the segment before and now, where it changed (the data
    # was prepared again): the plan, and so the epochs and the schedule, follow the new size
    train_examples_changed: list | None = None
    # the same count of other training files (their digest, the data record's
    # train_fingerprint, differs): the plan stands
    train_files_changed: bool | None = None


EVENTS = {
    cls.__dataclass_fields__["event"].default: cls
    for cls in (Data, Compile, Stage, Train, Eval, EvalSkipped, Checkpoint, Resume)
}
_COMMON = ("event", "step", "epoch", "wall_s")


def make(event: str, *, step, epoch, wall_s, **values) -> Record:
    """The record of ``event`` (a name in ``EVENTS``); an undeclared field is a TypeError."""
    return EVENTS[event](step=int(step), epoch=round(float(epoch), 4), wall_s=wall_s, **values)


def to_dict(rec: Record) -> dict:
    """The line's object: the common fields, the event's own (those with a default of None
    only when set), then ``extra``."""
    out = {}
    for f in dataclasses.fields(rec):
        if f.name == "extra":
            continue
        value = getattr(rec, f.name)
        if value is not None or f.name in _COMMON or f.default is dataclasses.MISSING:
            out[f.name] = value
    return out | rec.extra


def to_line(rec: Record) -> str:
    return json.dumps(to_dict(rec), default=_plain) + "\n"


def from_dict(d: dict) -> Record:
    """A line's object as its event's record (an unknown event: a plain ``Record``); fields
    the line lacks are None, fields the class lacks go to ``extra``."""
    cls = EVENTS.get(d.get("event"), Record)
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known = {k: d.get(k) for k in names if k != "event" or cls is Record}
    return cls(**known, extra={k: v for k, v in d.items() if k not in names})


def read_records(
    path: str, offset: int = 0, unread: list | None = None, count_torn: bool = True
) -> tuple[list[Record], int]:
    """The records of ``path`` from byte ``offset`` on, and the offset after the last whole
    line: a line cut short (its writer killed, or still writing) is left out, and so is a
    line that is not a JSON object. A missing file has none. ``unread``: a list that gets,
    for each whole line left out (blank ones aside), the index in the records of the record
    after it (a reader that must know what it did not get: report). ``count_torn=False``:
    not such a line that starts as a record does (its writer killed mid-line, the next
    start's writer ended it)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            d = None
        if isinstance(d, dict):
            records.append(from_dict(d))
        elif unread is not None and line.strip():
            if count_torn or d is not None or not line.startswith(b'{"event": '):
                unread.append(len(records))
    return records, offset + end


def last_data(recs):
    """The run's last start's ``data`` record (the data it trained on), or None."""
    return next((r for r in reversed(recs) if r.event == "data"), None)


def check_same_classes(last, info: dict, step: int | None, directory: str) -> None:
    """The class names, in label order, of the last ``data`` record (the run's last start)
    against the data opened now: a class folder renamed, added or removed since moves labels
    (label 1 was 'bird', now 'cat'), and the checkpoint's outputs would be trained on, or
    scored against, in the new meaning, with no word. ``step``: the checkpoint a resume
    restored, from ``directory``; None where a tool reads the trained run in ``directory``
    (the evaluator, quantize, a distillation teacher: ``trained.check_classes``)."""
    before, now = last and last.classes, info.get("classes")
    if not before or not now or list(before) == list(now):
        return
    old = list(before)
    moved = [f"label {i}: {a!r} -> {b!r}" for i, (a, b) in enumerate(zip(old, now)) if a != b]
    moved = f"{'; '.join(moved[:3])}{'; ...' if len(moved) > 3 else ''}"
    if len(old) != len(now):  # first: a folder added moves every label after it
        moved = f"{len(old)} -> {len(now)} classes" + (f"; {moved}" if moved else "")
    if step is None:
        raise WorkdirError(
            f"the classes changed since run {directory!r} trained ({moved}): its checkpoint "
            "learned the old labels; restore the class folders as they were, or train the "
            "new classes in a new --workdir"
        )
    raise WorkdirError(
        f"the classes changed since the run's last start ({moved}): the checkpoint at step "
        f"{step} in {directory} learned the old labels; restore the class folders as they "
        "were, or train the new classes in a new --workdir"
    )


# The config keys an LR schedule reads: the optimizer's, the run's length and its batches
# (with stages given per device, the mesh sets the global batch). A resume's changed_keys
# among them moved the schedule (the trainer's warning, report's LR panel).
SCHEDULE_KEYS = ("optim.", "num_epochs", "stages", "global_batch", "mesh")


# What to do about a JSON record that does not read, as the trainer sees it; a tool that
# only reads runs says its own (``read_run``'s ``unreadable``).
START_OVER = "move it away to start over"


def read_json(path: str, unreadable: str = START_OVER) -> dict | None:
    """``path``'s JSON object, or None if there is no such file; one that does not read, or
    holds no object (every such file is one: another file was put there), is a WorkdirError
    that says ``unreadable`` (NAME in it: the file's name)."""
    fix = unreadable.replace("NAME", os.path.basename(path))
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise WorkdirError(f"cannot read {path!r} ({e}); {fix}") from None
    if not isinstance(value, dict):
        held = json.dumps(value)
        held = held if len(held) <= 40 else held[:39] + "…"
        raise WorkdirError(f"cannot read {path!r} (it holds {held}, not a JSON object); {fix}")
    return value


def write_json(path: str, value, indent: int | None = 2) -> None:
    """Writes ``value`` to ``path`` through a temporary file beside it, so a reader (or a
    kill) never meets half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=indent, default=_plain)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # the dump failed: the file at path is as it was
            os.remove(tmp)


@dataclasses.dataclass
class RunRecords:
    """One run's records as they stand after its resumes: the records of steps that ran
    again replace the first ones. ``eval``: one per step, by step, the trainer's before the
    evaluator's; ``stage``: the first line of each stage, in order."""

    train: list[Train]
    eval: list[Eval]
    stage: list[Stage]
    compile: list[Compile]
    checkpoint: list[Checkpoint]
    summary: dict | None
    config: dict | None
    # the resumes that stand (one from an earlier step drops those after it), in order
    resume: list[Resume] = dataclasses.field(default_factory=list)
    # metrics.jsonl's whole lines that did not read, but for a killed start's cut last line
    # (the next start ended it, and its resume record follows), and its records that lack a
    # field computed with (``whole``): records lost
    unread: int = 0
    unread_evaluator: int = 0  # the same of evaluator/metrics.jsonl's lines


def resumed_from(resume: Resume | dict) -> int:
    """The last step a ``resume`` record keeps: the steps after it ran again (0 for a run
    started again with no checkpoint), so their earlier records are superseded."""
    r = resume if isinstance(resume, dict) else to_dict(resume)
    return r["step"] if r.get("from_step") is None else r["from_step"]


def latest_start(records: list) -> int | None:
    """The step the latest start among ``records`` resumed from (its ``resume`` record's
    ``resumed_from``), None where none resumed: what ``latest_summary`` compares."""
    resume = next((r for r in reversed(records) if r.event == "resume"), None)
    return None if resume is None else resumed_from(resume)


def latest_summary(summary: dict, started_from: int | None) -> bool:
    """Whether ``summary`` (summary.json) is the latest trainer start's: a start writes its
    own at its end, so while a resumed start runs (or where it was killed) the earlier
    start's is still there. ``started_from``: the step the latest ``resume`` line resumed
    from (``latest_start``); None where there is none (one start)."""
    return started_from is None or (summary.get("resumed_from") or 0) == started_from


def whole(r: Record) -> bool:
    """Whether ``r`` holds what its readers compute with: a step (an int), an epoch and a
    wall time (numbers), each field its event declares without None, and a number in each
    number field (a line edited by hand, or of another writer, may not)."""
    if isinstance(r.step, bool) or not isinstance(r.step, int):
        return False
    for f in dataclasses.fields(r):
        v = getattr(r, f.name)
        # epoch and wall_s: None only in events read_run does not keep
        kinds = ["float"] if f.name in ("epoch", "wall_s") else f.type.split(" | ")
        if v is None and "None" not in kinds:
            return False
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and {"int", "float"} & set(kinds) and not number:
            return False
    return True


def kept(c: Compile, resume: Resume, last: int) -> bool:
    """Whether an earlier segment's compile still counts after ``resume``: the checkpoint
    resumed from counted it in its ``compile_s`` (it was written before the save). Records
    older than ``from_wall_s`` go by step."""
    if resume.from_wall_s is None:
        return c.step <= last
    return c.wall_s <= resume.from_wall_s


def read_run(workdir: str, unreadable: str = START_OVER) -> RunRecords:
    """``W/metrics.jsonl``, ``W/evaluator/metrics.jsonl`` (if any), ``W/summary.json`` and
    ``W/config.json`` (if written). A missing workdir or metrics.jsonl is a ConfigError; a
    summary.json or config.json that does not read, a WorkdirError saying ``unreadable``
    (``read_json``)."""
    if not os.path.isdir(workdir):
        raise ConfigError(
            f"no workdir {workdir!r}: pass the workdir of a training run (the --workdir "
            "given to python -m hybridpar.train)"
        )
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{workdir!r} has no metrics.jsonl: pass the workdir of a training run (the "
            "trainer writes WORKDIR/metrics.jsonl once its set-up is done)"
        )
    kinds: dict[str, list[Any]] = {"train": [], "compile": [], "checkpoint": []}
    evals, stages, resumes = {}, {}, []
    bad: list[int] = []
    records = read_records(path, unread=bad)[0]
    lost = [i for i in bad if not (i < len(records) and isinstance(records[i], Resume))]
    broken = 0  # records that lack what is computed with them: lost as well
    for r in records:
        # (a resume needs only its steps, which it is read by)
        if isinstance(r, (Eval, Stage, Train, Compile, Checkpoint)) and not whole(r):
            broken += 1
        elif isinstance(r, Resume):  # steps after the checkpoint ran again: keep their second run
            last = resumed_from(r)
            resumes = [x for x in resumes if x.step <= last] + [r]
            kinds["train"] = [t for t in kinds["train"] if t.step <= last]
            kinds["compile"] = [c for c in kinds["compile"] if kept(c, r, last)]
            evals = {s: e for s, e in evals.items() if s <= last}
            stages = {i: s for i, s in stages.items() if s.step <= last}
        elif isinstance(r, Eval):
            evals[r.step] = r
        elif isinstance(r, Stage):
            stages.setdefault(r.stage, r)  # a resume inside a stage marks it again
        elif r.event in kinds:
            kinds[r.event].append(r)
    # A record the evaluator was killed in the middle of writing is no loss: its next start
    # evaluates that checkpoint again (the trainer's such line is told by the resume after it)
    bad = []
    path = os.path.join(workdir, "evaluator", "metrics.jsonl")
    for r in read_records(path, unread=bad, count_torn=False)[0]:
        if isinstance(r, Eval) and whole(r):
            evals.setdefault(r.step, r)
        elif isinstance(r, Eval):
            bad.append(r)
    return RunRecords(
        train=kinds["train"],
        eval=[evals[s] for s in sorted(evals)],
        stage=[stages[i] for i in sorted(stages)],
        compile=kinds["compile"],
        checkpoint=kinds["checkpoint"],
        summary=read_json(os.path.join(workdir, "summary.json"), unreadable),
        config=read_json(os.path.join(workdir, "config.json"), unreadable),
        resume=resumes,
        unread=len(lost) + broken,
        unread_evaluator=len(bad),
    )


def _plain(x):
    """numpy and JAX scalars as Python numbers; anything else JSON lacks as its text."""
    try:
        return x.item()
    except AttributeError:
        return str(x)
