"""``python -m hybridpar.report W [W2 ...] [--out PATH] [--overwrite] [--target-top1 X]
[--target-top5 X]``.

Compares training runs from their records (``run_records.read_run``): for each workdir
``W``, ``W/metrics.jsonl`` (the trainer's events), ``W/evaluator/metrics.jsonl``
(``python -m hybridpar.evaluate``'s eval events, if any), ``W/summary.json`` and
``W/config.json`` (if written). Writes one PNG (``--out``, default ``W/report.png`` in the
first run's workdir): top-1 and top-5 against wall time (a log axis in plain seconds where
one run is over 4x another's length) and against epochs, one colour and marker per run, the
evaluator's points hollow (the key says so where there are some), each stage switch a
dotted vertical line; where the time went, one stacked bar per run whose summary.json has a
``time_breakdown``; and the schedule against epochs (learning rate, momentum, global batch,
image size) computed from the config, every step from epoch 0 and each stage's change a
step, with the logged values as dots (at the epoch where the step that used each began); a
run resumed with a changed schedule key, from that resume on (a dash-dot line there:
config.json holds only the last start's config).
Only panels some run has data for, rows filled (no empty slot). The title, wrapped to the
figure's width, names the config keys that differ between runs and the schedule series a run
holds fixed: once where every run holds the same value, per run where not (and then not its
config key as well: ``global_batch`` is the global batch). Prints a markdown table of the
runs (name, epochs, steps, best top-1 and top-5, time to target, wall, compile, images/s)
and a line under it naming the config keys that differ (as the title does), then one of
their stages (image size, global batch, steps, the seconds in those steps and images/s: a
curriculum's stages differ in both, so the run-wide images/s hides the switch),
and writes them beside the PNG (the same path with ``.md``, its first line report's
``MARK``); compile time, as summary.json counts it, is what the run waited for
(``run_records.waited_s``). Time to target is the first eval at or over it among all the
run's eval records, the evaluator's too, for summary.json's targets and for
``--target-top1`` / ``--target-top5`` alike; without the run's compile records (while
summary.json counts compile time) its time without compilation is ``-``. A summary.json is
the run's only where it is the latest start's (``run_records.latest_summary``, the
evaluator's rule): a resumed run leaves the earlier start's there while it runs, and where
it is killed, and that one counts as none (the row from the records, status ``running or
killed``).

Report replaces only what it wrote: a FILE.md at ``--out`` whose first line is not report's
(nor, from before that line, the table's header), or a FILE.png with no such .md beside it,
is one ``error:`` line, nothing written, unless ``--overwrite``; its own earlier output is
replaced without a flag. Records known missing from a ``metrics.jsonl`` (lines that do not
read, but for a killed start's cut last line, which its resume follows; records that lack a
field report computes with, ``run_records.whole``: an eval without ``top1``; a completed run's
records ending before its last step: a file cut short or copied in part) are one
``warning:`` line per run, and the figures they would change are ``-``: best top-1/top-5,
time to target, compile time (summary.json's instead) and the run's stages. One workdir
given twice is an ``error:`` line.

Reads only: no JAX, no devices; the PNG needs matplotlib (``pip install -e ".[plot]"``). A
missing workdir or ``metrics.jsonl`` is one ``error:`` line (exit code 2), and so is a
``summary.json`` or ``config.json`` that does not read, or holds no JSON object (report
leaves it as it is; moved aside, the run reads from its ``metrics.jsonl`` alone).
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import sys
import time

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import pyplot
from hybridpar.runtime.run_records import (
    SCHEDULE_KEYS,
    TIME_PARTS,
    RunRecords,
    latest_start,
    latest_summary,
    read_run,
)

COLUMNS = ("run", "epochs", "steps", "best top1", "best top5", "time to target", "wall s",
           "compile s", "images/s", "status")  # fmt: skip
# The table per stage: a curriculum's stages differ in image size and batch, so the run's
# one images/s hides the switch.
STAGE_COLUMNS = ("run", "stage", "image size", "global batch", "steps", "train s", "images/s")
EVALUATOR_RECORDS = os.path.join("evaluator", "metrics.jsonl")
STAGES_NOTE = "per stage (train steps only: each train line's steps x batch / images/s):"


def names(workdirs: list[str]) -> list[str]:
    """Each run's folder name, or the path as given where two folder names are the same."""
    base = [os.path.basename(os.path.normpath(w)) for w in workdirs]
    return [b if base.count(b) == 1 else w for b, w in zip(base, workdirs)]


def current(run: RunRecords) -> dict | None:
    """The run's summary.json where it is the latest start's (``latest_summary``, the
    evaluator's rule too); None where there is none, and where it is an earlier start's: a
    resumed run leaves it there while it runs (or where it was killed), and its steps, times
    and status are not the run's."""
    latest = run.summary and latest_summary(run.summary, latest_start(run.resume))
    return run.summary if latest else None


def time_to(run: RunRecords, metric: str, target: float) -> dict | None:
    """The first eval (in wall time) with ``metric`` at or above ``target``, counted as
    summary.json's ``time_to_target`` is: ``wall_s`` from the start of the run, and
    ``wall_s_without_compile`` less the compile time (``Compile.waited_s``) of the compile
    records written before it; None where the run has no compile records but summary.json
    counts compile time (the records that would say when it was spent are missing)."""
    hits = [e for e in run.eval if getattr(e, metric) >= target]
    if not hits:
        return None
    first = min(hits, key=lambda e: e.wall_s)
    if not run.compile and (current(run) or {}).get("compile_s"):
        return {"wall_s": first.wall_s, "wall_s_without_compile": None}
    compile_s = sum(c.waited_s for c in run.compile if c.wall_s <= first.wall_s)
    return {"wall_s": first.wall_s, "wall_s_without_compile": first.wall_s - compile_s}


def targets(run: RunRecords, asked: dict) -> str:
    """``top1 0.8: 22.0s (19.0s w/o compile)`` for each target, the ``asked`` ones or else
    the run's ``target_top1`` / ``target_top5`` (summary.json's; config.json's while there
    is no summary: a run still training, or killed): timed by one rule either way, from all
    the run's eval records (the evaluator's too, which summary.json's time never counts)."""
    s = current(run) or run.config or {}
    cells = []
    for metric in ("top1", "top5"):
        target = asked.get(metric) or s.get(f"target_{metric}")
        if not target or target <= 0:  # config.json's -1: no target
            continue
        hit = time_to(run, metric, target)
        if hit is None:
            cells.append(f"{metric} {target:g}: not reached")
            continue
        without = hit["wall_s_without_compile"]
        cells.append(f"{metric} {target:g}: {hit['wall_s']:.1f}s "
                     f"({'-' if without is None else f'{without:.1f}s'} w/o compile)")  # fmt: skip
    return "; ".join(cells) or "-"


def row(name: str, run: RunRecords, asked: dict) -> dict:
    """The table's values for one run: from the records, and from summary.json (the latest
    start's: ``current``) for what only it knows (wall and images/s over every resumed
    segment, whether the run completed).
    ``asked``: ``{"top1": target, "top5": target}`` in place of summary.json's targets.
    Where records are missing (``missing``), what they would change is None: the bests and
    the time to target (a lost eval), and compile time but for summary.json's."""
    summary = current(run)
    s = summary or run.config or {}
    whole = not missing(run)
    records = run.train + run.eval
    top1, top5 = ([getattr(e, k) for e in run.eval] for k in ("top1", "top5"))
    ips = [t.images_per_s for t in run.train if t.images_per_s]
    # one source for the compile time and the time to target without it: the records, or
    # where there are none (or some are lost), summary.json's total (and no time without it)
    compile_s = sum(c.waited_s for c in run.compile) if run.compile and whole else None
    if not summary:  # config.json's values stand in, but it says nothing of the end
        status = "running or killed " + ("(no summary.json)" if run.summary is None
                                         else "(summary.json is an earlier start's)")  # fmt: skip
    elif s.get("completed"):
        status = "completed"
    else:
        status = "error" if s.get("error") else "stopped"
    return {
        "run": name,
        # the summary's, where there is one: a run stopped between train lines went on
        # past the last one
        "epochs": s.get("epochs", max((r.epoch for r in records), default=0.0)),
        "steps": s.get("steps", max((r.step for r in records), default=0)),
        "best top1": max(top1, default=None) if whole else None,
        "best top5": max(top5, default=None) if whole else None,  # each its own best
        "time to target": targets(run, asked) if whole else None,
        "wall s": s.get("wall_s", max((r.wall_s for r in records), default=None)),
        "compile s": compile_s if compile_s is not None else (summary or {}).get("compile_s"),
        "images/s": s.get("train_images_per_s") or (statistics.median(ips) if ips else None),
        "status": status,
    }


def missing(run: RunRecords) -> str:
    """What of the run's records is known lost, in words ('' where nothing is): lines that
    did not read (``RunRecords.unread``: not a killed start's cut last line; the evaluator's
    file's too, whose evals may be the best), and a completed run's records ending before
    its last step (the trainer evaluates and saves there: the file was cut short, or copied
    in part)."""
    lost = []
    for n, name in ((run.unread, "metrics.jsonl"), (run.unread_evaluator, EVALUATOR_RECORDS)):
        if n:
            lost.append(f"{n} line{'s' * (n > 1)} of {name} did not read")
    trainer = run.train + run.checkpoint + [e for e in run.eval if e.source is None]
    s, last = current(run) or {}, max((r.step for r in trainer), default=0)
    if s.get("completed") and isinstance(s.get("steps"), int) and last < s["steps"]:
        lost.append((f"its records end at step {last}" if last else "it has no records of steps")
                    + f" but the run at step {s['steps']} (summary.json)")  # fmt: skip
    return " and ".join(lost)


def stage_rows(name: str, run: RunRecords) -> list[dict]:
    """One row per stage the run trained: its steps, their seconds as the trainer counts
    them (each train line's steps x batch / images per second: no evaluation, save or
    compile) and their images per second. A line's steps are those since the line before
    it: the trainer logs at every stage's end and every save, so no line spans two stages,
    and a resume goes on from a logged step (``read_run`` keeps the steps' second run).
    None where records are missing (``missing``): their sums would be short."""
    if missing(run):
        return []
    by_stage: dict = {}
    last = 0
    for t in run.train:
        key = (t.stage, t.image_size, t.global_batch)
        steps, last = t.step - last, t.step
        r = by_stage.setdefault(key, {"run": name, "stage": t.stage, "image size": t.image_size,
                                      "global batch": t.global_batch, "steps": 0,
                                      "train s": 0.0, "images": 0})  # fmt: skip
        r["steps"] += steps
        if t.images_per_s and t.global_batch:  # an older line without them: no time
            r["train s"] += steps * t.global_batch / t.images_per_s
            r["images"] += steps * t.global_batch
    rows = list(by_stage.values())
    for r in rows:
        r["images/s"] = r.pop("images") / r["train s"] if r["train s"] else None
    return rows


def markdown(rows: list[dict], columns=COLUMNS) -> str:
    def cell(key, v):
        if v is None:
            return "-"
        if key in ("best top1", "best top5"):
            return f"{v:.4f}"
        if key == "epochs":
            return f"{round(v, 2):g}"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(k, r[k]) for k in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


MARKERS = "os^vD<>ph*"  # one per run, so runs stay apart where their lines overlap
LINES = ("-", "--", "-.", ":")
SCHEDULE = ("learning rate", "momentum", "global batch", "image size (px)")
LOGGED = {"learning rate": "lr", "momentum": "momentum"}  # train lines' fields
# The config key behind a schedule series (where the run has no stages; with stages, the
# series is what it trained at): listed per run, the series says it, the key need not.
CONFIG_KEY = {"global batch": "global_batch", "image size (px)": "data.image_size"}


# The config keys a schedule series reads (the learning rate's, and the image size): a
# resume that changed one leaves config.json without the earlier starts'.
SERIES_KEYS = SCHEDULE_KEYS + ("data.image_size",)


def schedule_change(run: RunRecords) -> tuple | None:
    """``(step, epoch, keys)`` of the run's last standing resume whose ``changed_keys``
    hold a schedule key; None where there is none."""
    for r in reversed(run.resume):
        keys = [k for k in r.changed_keys or () if k.startswith(SERIES_KEYS)]
        if keys:
            return r.step, r.epoch, keys
    return None


def schedule(run: RunRecords) -> dict[str, tuple]:
    """``{name in SCHEDULE: (epochs, values)}`` to the run's last epoch: from its config.json
    where it has one (every step's value from epoch 0, each stage's change a step), else as
    its train and stage lines sampled it. Resumed with a changed schedule, config.json holds
    only the last start's config, and the earlier starts' is in no record: the config's
    values from that resume on; before it the stage lines' batch and image size, and for
    the learning rate and momentum nothing (the figure's dots are the logged values: a
    line between them would draw a warmup or a decay the lines do not show)."""
    import numpy as np

    last = max((r.epoch for r in run.train + run.eval), default=0.0)
    dp = run.stage[0].data_parallel if run.stage else None
    change = schedule_change(run)
    if run.config and run.stage and (dp or not run.config.get("stages")):
        try:
            computed = config_schedule(run.config, dp or 1, last, change[1] if change else 0.0)
        except (AttributeError, KeyError):  # a config.json of a version without some key
            return logged_schedule(run, last)
        if not change:
            return computed
        step, epoch, _ = change
        before = dataclasses.replace(run, train=[t for t in run.train if t.step <= step],
                                     stage=[s for s in run.stage if s.step < step])  # fmt: skip
        logged = logged_schedule(before, epoch) | {k: ([], []) for k in LOGGED}
        return {k: tuple(np.concatenate([np.asarray(a, float), b])
                         for a, b in zip(logged[k], computed[k]))
                for k in SCHEDULE}  # fmt: skip
    return logged_schedule(run, last)


def config_schedule(config: dict, data_parallel: int, last: float,
                    since: float = 0.0) -> dict[str, tuple]:  # fmt: skip
    """The schedule ``config`` gives from epoch ``since`` to ``last``."""
    import numpy as np
    from ml_collections import ConfigDict

    from hybridpar.config.curriculum import stages_from_config
    from hybridpar.config.schedules import lr_factor, momentum_at, peak_lr

    c = ConfigDict(config)
    o, stages = c.optim, stages_from_config(c, data_parallel)
    parts, start = [], 0.0
    for st in stages:
        if start > last:
            break
        start, end = max(start, since), min(st.end_epoch, last)
        if start > end:  # a stage over before ``since``
            start = st.end_epoch
            continue
        kinks = [k for k in (o.warmup_epochs, o.momentum_ramp_epochs) if start < k < end]
        e = np.union1d(np.linspace(start, end, 200), kinks)  # the warmup's peak drawn
        lr = peak_lr(o, st.global_batch) * lr_factor(o, e, stages[-1].end_epoch)
        m = st.momentum
        if m is None:
            m = momentum_at(o, e) if o.momentum_start >= 0 else o.momentum
        parts.append((e, lr, m + 0 * e, st.global_batch + 0 * e, st.image_size + 0 * e))
        start = st.end_epoch
    e, *values = (np.concatenate(v) for v in zip(*parts))
    return {name: (e, v) for name, v in zip(SCHEDULE, values)}


def logged_schedule(run: RunRecords, last: float) -> dict[str, tuple]:
    import numpy as np

    switch = [s.epoch for s in run.stage] + [last]
    at = began(run)  # where each line's values were used
    out = {"learning rate": (at, [t.lr for t in run.train])}
    with_m = [(x, t.momentum) for t, x in zip(run.train, at) if t.momentum is not None]
    out["momentum"] = ([x for x, _ in with_m], [m for _, m in with_m])  # older lines lack it
    for name, key in (("global batch", "global_batch"), ("image size (px)", "image_size")):
        ys = [getattr(s, key) for s in run.stage]
        out[name] = (np.repeat(switch, 2)[1:-1], np.repeat(ys, 2)) if ys else ([], [])
    return out


def began(run: RunRecords) -> list[float]:
    """The epoch at which each train line's last step began: where the learning rate and
    momentum it logs were used (a line at step ``s`` counts the steps done and logs the
    schedule at step ``s - 1``, which its last update ran with). A step's length in epochs
    is the same all through a stage: from the line and its stage's first line; without stage
    lines (older runs), from the first train line at the same batch, or the run's start."""
    first: dict = {}  # global batch: the first train line at it
    out = []
    for t in run.train:
        starts = [s for s in run.stage if s.step < t.step]  # a line at a switch: the old stage
        anchor = starts[-1] if starts else first.setdefault(t.global_batch, t)
        step, epoch = (anchor.step, anchor.epoch) if anchor is not t else (0, 0.0)
        out.append(t.epoch - (t.epoch - epoch) / (t.step - step) if t.step > step else t.epoch)
    return out


def constant(values) -> bool:
    return len(values) == 0 or max(values) - min(values) <= 1e-9 * max(abs(max(values)), 1e-30)


def plot(runs: list[tuple[str, RunRecords]], path: str) -> None:
    """Writes ``figure(runs)`` to ``path`` (PNG)."""
    plt = pyplot()
    fig = figure(runs)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drawn(schedules: list[dict]) -> list[str]:
    """The schedule series that get a panel: those some run changes."""
    return [k for k in SCHEDULE if not all(constant(s[k][1]) for s in schedules)]


def figure(runs: list[tuple[str, RunRecords]]):
    """Accuracy against wall time and epochs (where some run has evals), where the time went
    (runs whose summary.json has a ``time_breakdown``), and the schedule series some run
    changes, against epochs: only panels with something in them, laid out with no empty
    slot. The title names what differs between runs and, once, what every run holds fixed."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    schedules = [schedule(run) for _, run in runs]
    shown = drawn(schedules)
    with_eval = any(run.eval for _, run in runs)
    with_time = [(n, r) for n, r in runs if sum(breakdown(r).values()) > 0]
    panels = (["wall", "epoch"] if with_eval else []) + (["time"] if with_time else []) + shown
    fig, axes = layout(plt, panels)
    if not panels:  # set-up records only: no step or eval yet
        fig.text(0.5, 0.5, "no train or eval records yet", ha="center", va="center")
        return fig
    acc_t, acc_e = axes.get("wall"), axes.get("epoch")
    ends = []
    for i, ((name, run), sched) in enumerate(zip(runs, schedules)):
        color, marker, line = f"C{i % 10}", MARKERS[i % len(MARKERS)], LINES[i % len(LINES)]
        ends.append(max([r.wall_s for r in run.train + run.eval] or [1.0]))
        by_source = [([e for e in run.eval if e.source == source], face)
                     for source, face in ((None, color), ("evaluator", "white"))]  # fmt: skip
        for ax, x in ((acc_t, "wall_s"), (acc_e, "epoch")) if with_eval else ():
            for metric, style, alpha in (("top1", "-", 1.0), ("top5", "--", 0.6)):
                ax.plot([getattr(e, x) for e in run.eval], [getattr(e, metric) for e in run.eval],
                        style, color=color, alpha=alpha)  # fmt: skip
                for ev, face in by_source:
                    ax.plot([getattr(e, x) for e in ev], [getattr(e, metric) for e in ev],
                            marker, color=color, markerfacecolor=face, alpha=alpha)  # fmt: skip
        for key in shown:
            ax = axes[key]
            xs, ys = sched[key]
            ax.plot(xs, ys, line, color=color, linewidth=2.5 - 0.5 * (i % 3), label=name)
            field = LOGGED.get(key)
            if field and run.config:  # the config's curve, and the values the trainer logged
                logged = [(x, getattr(t, field)) for t, x in zip(run.train, began(run))
                          if getattr(t, field) is not None]  # fmt: skip
                ax.plot([x for x, _ in logged], [y for _, y in logged], marker, color=color,
                        markersize=3)  # fmt: skip
        change = schedule_change(run)
        for key in shown if change and run.config else ():  # where config.json's curve starts
            axes[key].axvline(change[1], color=color, linestyle="-.", alpha=0.7,
                              label=f"{name}: resumed with {', '.join(change[2])} changed; "
                              "config.json's schedule from here")  # fmt: skip
        for s in run.stage[1:]:  # the switches (the first stage starts the run)
            if acc_t is not None:
                acc_t.axvline(s.wall_s, color=color, linestyle=":", alpha=0.7)
            for key in ["epoch", *shown] if with_eval else shown:
                axes[key].axvline(s.epoch, color=color, linestyle=":", alpha=0.7)
    if with_time:
        time_breakdown(axes["time"], with_time)
    if with_eval:
        wall_axis(acc_t, ends)
        runs_legend = [Line2D([], [], color=f"C{i % 10}", marker=MARKERS[i % len(MARKERS)],
                              label=name) for i, (name, _) in enumerate(runs)]  # fmt: skip
        styles = [Line2D([], [], color="grey", linestyle="-", label="top-1"),
                  Line2D([], [], color="grey", linestyle="--", label="top-5")]  # fmt: skip
        if by_evaluator(runs):  # which marker is whose, only where some are the evaluator's
            styles += [Line2D([], [], color="grey", marker="o", linestyle="none",
                              label="trainer's eval"),
                       Line2D([], [], color="grey", marker="o", markerfacecolor="white",
                              linestyle="none", label="evaluator's eval")]  # fmt: skip
        acc_t.legend(handles=runs_legend, fontsize=7)
        acc_e.legend(handles=styles, fontsize=7)
        acc_e.set_xlabel("epoch")
    for key, ax in axes.items():
        if key != "time":
            ax.set_ylabel("accuracy" if key in ("wall", "epoch") else key)
            ax.grid(True, alpha=0.3)
        if key in shown:
            ax.set_xlabel("epoch")
            ax.legend(fontsize=7)
    fig.suptitle(fit(fig, title(runs, schedules, shown, with_eval), 10), fontsize=10)
    fig.tight_layout()
    return fig


def fit(fig, text: str, fontsize: float) -> str:
    """``text`` with its lines wrapped to the figure's width as drawn (a centred line wider
    than the figure loses both ends): broken after a "; ", else a ", ", else a space."""
    renderer = fig.canvas.get_renderer()
    width = 0.98 * fig.bbox.width

    def fits(line: str) -> bool:
        probe = fig.text(0, 0, line, fontsize=fontsize)
        try:
            return probe.get_window_extent(renderer).width <= width
        finally:
            probe.remove()

    def wrap(line: str, seps: tuple) -> list[str]:
        if not seps or fits(line):
            return [line]
        pieces = re.split(f"(?<={re.escape(seps[0])})", line) if seps[0] else list(line)
        lines, current = [], ""
        for piece in pieces:
            if current and not fits((current + piece).rstrip()):
                lines.append(current.rstrip())
                current = ""
            current += piece
        lines.append(current.rstrip())
        return [w for part in lines for w in wrap(part, seps[1:])]

    return "\n".join(w for line in text.splitlines() for w in wrap(line, ("; ", ", ", " ", "")))


def breakdown(run: RunRecords) -> dict:
    """summary.json's ``time_breakdown`` (seconds per part; the latest start's summary.json,
    ``current``), or {} where it has none."""
    parts = (current(run) or {}).get("time_breakdown") or {}
    return {k: float(v or 0.0) for k, v in parts.items()}


def layout(plt, panels: list[str]):
    """A figure with one axes per panel, three to a row at most and the rows shared out
    evenly (5: 3 and 2, each of the 2 wider), so no slot of the grid is left empty."""
    n = max(len(panels), 1)
    rows = -(-n // 3)
    counts = [n // rows + (r < n % rows) for r in range(rows)]
    fig = plt.figure(figsize=(15, 4 * rows + 0.8))
    grid = fig.add_gridspec(rows, 6)  # 6 columns: a row of 1, 2 or 3 panels fills it
    slots = [grid[r, j * 6 // k : (j + 1) * 6 // k]
             for r, k in enumerate(counts) for j in range(k)]  # fmt: skip
    return fig, {p: fig.add_subplot(slot) for p, slot in zip(panels, slots)}


def wall_axis(ax, ends: list[float]) -> None:
    """A log axis where one run is over 4x another's length, labelled in plain seconds
    (30, 40, 60, 100, not 3x10^1); else linear from 0."""
    from matplotlib.ticker import LogFormatter

    class Seconds(LogFormatter):  # the same ticks labelled, in plain numbers
        def __call__(self, x, pos=None):
            return (f"{x:,.0f}" if x >= 1 else f"{x:g}") if super().__call__(x, pos) else ""

    if max(ends) > 4 * min(ends):  # a short run next to a long one: both readable
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(Seconds())
        ax.xaxis.set_minor_formatter(Seconds(labelOnlyBase=False))
        ax.set_xlabel("wall time (s, log scale)")
    else:
        ax.set_xlim(left=0)  # from the run's start: set-up and compilation count
        ax.set_xlabel("wall time (s)")


def by_evaluator(runs) -> bool:
    """Whether some run has the evaluator's evals (drawn hollow: the key says so)."""
    return any(e.source == "evaluator" for _, run in runs for e in run.eval)


def title(runs, schedules, shown: list[str], with_eval: bool) -> str:
    """The key to the accuracy panels, the config keys whose values differ between runs,
    the schedule series each run holds fixed at its own value, and those every run holds
    at one value (once)."""
    lines = []
    if with_eval:
        lines.append("accuracy: top-1 solid, top-5 dashed"
                     + (", filled markers the trainer's evals, hollow the evaluator's"
                        if by_evaluator(runs) else "")
                     + ("; dotted lines: stage switches" if any(len(r.stage) > 1 for _, r in runs)
                        else ""))  # fmt: skip
    fixed, per_run, said = [], [], set()
    for k in SCHEDULE:
        if k in shown:
            continue
        values = {n: s[k][1][0] for (n, _), s in zip(runs, schedules) if len(s[k][1])}
        if len(set(values.values())) == 1:
            fixed.append(f"{k} {next(iter(values.values())):g}")
        elif values:
            per_run.append(f"{k} (" + ", ".join(f"{n} {v:g}" for n, v in values.items()) + ")")
            said.add(CONFIG_KEY.get(k))
    # a config key whose schedule series is already listed per run is not listed again
    differ = differing_keys(runs, skip=said)
    if differ or per_run:
        lines.append("runs differ in: " + "; ".join(differ + per_run))
    if fixed:
        lines.append("fixed throughout (not drawn): " + ", ".join(fixed))
    return "\n".join(lines)


def differing_keys(runs, most: int = 4, skip=()) -> list[str]:
    """``key (run value, run value)`` for the config.json keys whose values differ between
    runs (a run without config.json takes no part), the first ``most`` of them, leaving out
    the keys in ``skip``."""
    flat = {n: flatten(r.config) for n, r in runs if r.config}
    if len(flat) < 2:
        return []
    keys = sorted({k for c in flat.values() for k in c} - set(skip))
    differ = [k for k in keys if len({repr(c.get(k)) for c in flat.values()}) > 1]

    def short(v):  # None: the run's config.json has no such key
        text = "-" if v is None else "''" if v == "" else str(v)
        return text if len(text) <= 30 else text[:29] + "…"

    out = [f"{k} (" + ", ".join(f"{n} {short(c.get(k))}" for n, c in flat.items()) + ")"
           for k in differ[:most]]  # fmt: skip
    if len(differ) > most:
        out.append(f"{len(differ) - most} more config keys")
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def time_breakdown(ax, runs: list[tuple[str, RunRecords]]) -> None:
    """One stacked bar per run: summary.json's ``time_breakdown`` (seconds per part,
    ``run_records.TIME_PARTS`` first, in their order), labelled with its goodput (the
    summary's, else train seconds over the parts' sum)."""
    parts = {name: breakdown(run) for name, run in runs}
    order = [p for p in TIME_PARTS if any(p in b for b in parts.values())]
    order += sorted({p for b in parts.values() for p in b} - set(order))
    left = [0.0] * len(runs)
    for j, part in enumerate(order):
        widths = [float(b.get(part) or 0.0) for b in parts.values()]
        ax.barh(list(parts), widths, left=left, height=0.5, color=f"C{j % 10}",
                hatch="//" * (j >= 10), label=part, edgecolor="white")  # fmt: skip
        left = [a + w for a, w in zip(left, widths)]
    for y, ((name, run), total) in enumerate(zip(runs, left)):
        goodput = current(run).get("goodput")
        if goodput is None and total:
            goodput = float(parts[name].get("train") or 0.0) / total
        if goodput is not None:
            ax.text(total, y, f" goodput {goodput:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()  # the first run on top, as in the legends
    ax.set_xlabel("wall time (s)")
    ax.set_title("where the time went", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax.margins(x=0.15)


# What report can do about a summary.json or config.json that does not read (cut short,
# overwritten): it only reads, so it leaves the file as it is.
UNREADABLE = (
    "report only reads a run and leaves the file as it is: move it aside (e.g. to "
    "NAME.bad) and report reads the run from its metrics.jsonl alone"
)


def read(workdir: str) -> RunRecords:
    """``read_run``, with report's own advice for a JSON record that does not read."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):  # as the trainer words it
        raise ConfigError(
            f"workdir {workdir!r} is a file, not a folder; pass the workdir of a training run "
            "(the --workdir given to python -m hybridpar.train)"
        )
    return read_run(workdir, unreadable=UNREADABLE)


# The .md's first line: report replaces a FILE.md that starts with it (or, written before
# it, with the table's header) and the FILE.png beside one; any other file is the user's.
MARK = "<!-- written by python -m hybridpar.report, which replaces it when run again -->"
OURS = (MARK, markdown([]).splitlines()[0])


def theirs(out: str) -> list[str]:
    """The files at ``out`` and its ``.md`` that report would replace and did not write:
    any there, unless the .md's first line is report's (``OURS``)."""
    md = os.path.splitext(out)[0] + ".md"
    try:
        with open(md, errors="replace") as f:
            if f.readline().rstrip("\n") in OURS:
                return []
    except OSError:  # none there (or not a file: the write says so)
        pass
    return [p for p in (md, out) if os.path.exists(p)]


def warn_missing(workdir: str, run: RunRecords) -> None:
    lost = missing(run)
    if lost:
        print(f"warning: {workdir}: {lost}: records are missing, so the run's best "
              "top1/top5, time to target and stages are left out ('-') and its compile s is "
              "summary.json's (if any)", file=sys.stderr)  # fmt: skip


def report(workdirs: list[str], out: str, asked: dict | None = None) -> str:
    """Reads the runs, writes ``out`` (PNG) and its ``.md`` table; returns the table.
    ``asked``: targets in place of summary.json's, e.g. ``{"top1": 0.8}``. A run whose
    records are missing (``missing``) is one ``warning:`` line."""
    runs = list(zip(names(workdirs), [read(w) for w in workdirs]))
    for w, (_, run) in zip(workdirs, runs):
        warn_missing(w, run)
    table = markdown([row(name, run, asked or {}) for name, run in runs])
    differ = differing_keys(runs)  # as the PNG's title names them
    if differ:
        table += "\nruns differ in: " + "; ".join(differ) + "\n"
    stages = [r for name, run in runs for r in stage_rows(name, run)]
    if stages:
        table += "\n" + STAGES_NOTE + "\n\n" + markdown(stages, STAGE_COLUMNS)
    try:  # a finished run is often read from a read-only copy
        if os.path.dirname(out):
            os.makedirs(os.path.dirname(out), exist_ok=True)
        plot(runs, out)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(MARK + "\n\n" + table)
    except OSError as e:
        raise ConfigError(
            f"cannot write {e.filename or out!r} ({e.strerror or e}): pass --out "
            "FOLDER/report.png in a folder you can write"
        ) from None
    return table


def main(argv=None) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.report",
        (
            "Compare training runs from their records: one PNG (accuracy against wall time and "
            "epochs, where the time went, the schedule against epochs) and tables of the runs "
            "and their stages."
        ),
        takes_config=False,
    )
    parser.add_argument("workdirs", nargs="+", metavar="W", help="training runs' workdirs")
    parser.add_argument(
        "--out",
        help="the PNG (the table: same, .md); default: report.png in the first workdir W. "
        "report replaces the two only where it wrote them (the .md's first line says so)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a --out FILE.png or FILE.md that report did not write",
    )
    for metric in ("top1", "top5"):
        parser.add_argument(
            f"--target-{metric}",
            type=cli.finite_float,
            default=None,
            help=f"time to this {metric} (a fraction) for every run; default: each "
            f"summary.json's target_{metric}. Timed from all eval records, the evaluator's too",
        )
    args = parser.parse_args(argv)  # argparse reads sys.argv[1:] itself when None
    asked = {"top1": args.target_top1, "top5": args.target_top5}
    for metric, target in asked.items():
        if target is not None and target > 1:
            cli.fail(f"--target-{metric}={target:g} is a fraction: use e.g. 0.93, not 93")
        if target is not None and target <= 0:
            cli.fail(f"--target-{metric}={target:g} must be in (0, 1]: the {metric} to time "
                     "each run to, e.g. 0.93")  # fmt: skip
    seen: dict = {}
    for w in args.workdirs:  # one run twice: two identical rows
        if os.path.realpath(w) in seen:
            same = seen[os.path.realpath(w)]
            cli.fail(f"{w} is given twice" + (f" (as {same})" if same != w else "")
                     + ": name each run's workdir once")  # fmt: skip
        seen[os.path.realpath(w)] = w
    # beside the first run's records, not in the current directory (a checkout, or a
    # report.png of the user's there)
    args.out = args.out or os.path.join(args.workdirs[0], "report.png")
    if os.path.splitext(args.out)[1].lower() != ".png":  # else matplotlib fails after the reading
        cli.fail(f"--out {args.out}: the figure is a PNG; name it FILE.png (the table goes "
                 "beside it as FILE.md)")  # fmt: skip
    replaced = theirs(args.out)
    if replaced and not args.overwrite:  # the user's files: nothing is read or written
        written = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(replaced[0])))
        cli.fail(f"{replaced[0]} exists (written {written}) and report did not write it "
                 f"(report's own FILE.md starts with `{MARK.partition(',')[0]}`): pass "
                 f"--overwrite to replace {' and '.join(replaced)}, or name another --out "
                 "FILE.png")  # fmt: skip

    def run():
        table = report(args.workdirs, args.out, {k: v for k, v in asked.items() if v})
        print(table, end="")
        print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md"
              + (" (replaced the files there, --overwrite)" if replaced else ""))  # fmt: skip

    cli.main(run)


if __name__ == "__main__":
    main()
