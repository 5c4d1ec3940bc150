"""``python -m hybridpar.compress --config experiments/NAME.py --workdir W --budget-kb K
[--budget-of weights|file] [--max-drop 1.0] [--step 0.25] [--epochs 3] [--criterion l1|bn]
[--max-rounds 8] [--calibration max|percentile|mse] [--percentile P] [--seed N]
[--init pruned|scratch] [--alpha A]``.

The compress-and-retrain loop on the finished run in ``W`` (the teacher, read only: a run
still training, or stopped before its end, is an ``error:``). Round 0 is the teacher itself
in int8. Round r prunes round r-1's model to ``(1 - step)^r`` of the teacher's channels in
every group (``hybridpar.prune``; where that would land under ``K``, to the largest fraction
that fits ``K``, computed from the pruned shapes), distils it from the teacher for
``--epochs`` epochs (``hybridpar.runtime.distill``; the run's own optimizer and schedule;
with ``--init scratch`` the round's model has the pruned shape but random weights, and
trains with the teacher's stages stretched to ``--epochs``: an edge-sized model trained
from the start, distilled, beside the pruned ones), quantizes it to int8
(``hybridpar.quantize``) and evaluates it on the whole eval split.
Rounds go on while the int8 top-1 stays within ``--max-drop`` points of the float teacher's
and the budgeted size is above ``K`` KB (1 KB = 1000 bytes). ``--budget-of`` says which
size: ``weights`` (the default), the int8 weights (exact from the pruned shapes); ``file``,
the whole LiteRT ``model.tflite``, what an edge device stores (the weights plus the file's
quantization parameters and structure: from the pruned shapes, an upper bound
``edge.predict_bytes`` measured once on a file of the teacher's; whether a round fits is
its real file's size).

Every round is kept in ``W/compress/round_NN/`` (``W/compress_seedN/`` with ``--seed N``,
the distillation runs' seed, ``W/compress[_scratch][_alphaA][_seedN]/`` with ``--init
scratch`` and ``--alpha A``, so
that several seeds and inits of one teacher sit side by side):
``pruned/`` (the pruned model, a run at step 0), ``run/`` (its distillation run, a trainer
workdir: the trainer resumes it),
``quantized/`` (``quantize``'s files: ``model.jax_exported`` is the int8 model) and
``result.json`` once it is done (with ``teacher_step``, the teacher's checkpoint it was made
from, ``classes``, the class names in label order, and its paths absolute; the loop reads
them from its folder as this call names it, so what it prints exists from where it runs).
The loop folder's ``settings.json`` keys the rounds: the flags that make them and the
teacher's step; a loop of other settings or of another teacher step is an ``error:``, never
reused. One loop per loop folder at a time (its ``.lock``). A stopped loop (SIGTERM,
Ctrl-C, kill) goes on from where it stopped with the same command. It prints a row per
round (parameters, int8 KB, FLOPs per image, int8 top-1, its drop in points against the
float teacher, the LiteRT file's top-1, int8 CPU latency at batch 1), writes the table to
``W/compress/rounds.md`` (with the rounds an earlier call made past this call's stop, said
so) and the size/accuracy front to ``W/compress/front.png`` (without matplotlib, a
``warning:`` line instead: the rounds and the result do not need it), and ends with the
smallest model within the drop and the line ``kb_int8=... top1_drop=... top1_se=...
top1=... top1_litert=... params=... flops=... file_kb=... latency_ms=... eval_images=N
chosen_on=S measured_on=S budget_kb=K budget_of=... teacher_step=...`` (top1 and the drop:
our int8 forward's, which the rule holds to ``--max-drop``; top1_se: that top-1's binomial
standard error in points over the ``N`` images of the eval split ``S``, which both chose
the round, the stop rule and the smallest within the drop, and measured it; top1_litert,
file_kb and latency_ms: its LiteRT ``model.tflite``'s top-1 in that runtime, whole size and
one-thread ms per image; budget_of: the size held to ``K``, also in each round's
``result.json``; where the weights meet ``K`` and the file does not, the line before says
so). Exit code 0 when that model is within the budget, 3 when the loop stopped without one
(a line on stderr says why, and what changes that on this loop), 2 for bad input (a budget
under the teacher pruned to one channel per group, of the file or of the weights; one over
it pruned as far as ``--step`` goes by ``--max-rounds`` from where the loop starts; a
pruned run as the teacher).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import sys

import numpy as np

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import pyplot
from hybridpar.config.schema import eval_split_of
from hybridpar.runtime import signals, trained

DIR = "compress"
# What makes the rounds' models: another value on an existing loop is an error. The budget
# and the drop only say when to stop, so they may change.
SETTINGS = ("step", "epochs", "criterion", "calibration_batches", "calibration", "percentile",
            "init", "alpha")  # fmt: skip
# what a loop's settings.json without the key was made with (percentile None: quantize's)
BEFORE = {"calibration": "max", "init": "pruned", "alpha": None, "percentile": None}
# Where a round's model starts: the previous round's pruned weights, or random weights in the
# pruned shape (the teacher's recipe, curriculum included, stretched to --epochs).
INITS = ("pruned", "scratch")


def check_args(args, config) -> None:
    """Flags, the teacher's workdir and its run's config, before any device is touched."""
    from hybridpar.tools import quantize

    if not args.workdir:
        cli.fail("pass --workdir DIR (the trained teacher's run)")
    if args.budget_kb is None or args.budget_kb <= 0:
        what = {"weights": "the int8 weights'", "file": "the LiteRT file's"}[args.budget_of]
        cli.fail(f"pass --budget-kb K > 0: {what} size to reach, in KB, e.g. 100")
    if args.max_drop < 0:
        cli.fail(f"--max-drop={args.max_drop} must be >= 0 (points of top-1), e.g. 1.0")
    if not 0 < args.step < 1:
        cli.fail(f"--step={args.step} must be in (0, 1): the fraction pruned per round, e.g. 0.25")
    if args.epochs <= 0:
        cli.fail(f"--epochs={args.epochs} must be > 0: each round's distillation, e.g. 3")
    if args.max_rounds < 1:
        cli.fail(f"--max-rounds={args.max_rounds} must be >= 1")
    if args.alpha is not None and not 0 <= args.alpha <= 1:
        cli.fail(f"--alpha={args.alpha:g} must be in [0, 1]: the teacher's share of the loss")
    if args.calibration_batches < 1:
        cli.fail(f"--calibration-batches={args.calibration_batches} must be >= 1, e.g. 8")
    if args.percentile is not None and not 0 < args.percentile <= 100:
        cli.fail(f"--percentile={args.percentile:g} is in (0, 100], e.g. 99.99")
    if args.percentile is not None and args.calibration != "percentile":
        cli.fail(f"--percentile is not used with --calibration {args.calibration}; pass "
                 "--calibration percentile with it, or drop it")  # fmt: skip
    # a scratch round keeps only the pruned shape, which the ranking does not change
    if args.init == "scratch" and args.criterion is not None:
        cli.fail("--criterion is not used with --init scratch (its rounds start from random "
                 "weights: only the pruned widths are kept); drop --criterion")  # fmt: skip
    args.criterion = args.criterion or "l1"
    if config.distributed:
        cli.fail("compress runs in one process: pass --config.distributed=False")
    check_not_training(args.workdir)  # first: before its first checkpoint it has none
    quantize.check_trained_run(
        config, args.workdir, "trained", "compress starts from a trained run"
    )
    check_teacher(args.workdir)
    from hybridpar.models import MODELS

    name = config.model.name
    if name != "airbench" and "stage_sizes" not in getattr(MODELS[name], "keywords", {}):
        raise ConfigError(
            f"compress prunes the ResNets of models/resnet.py and the airbench net, not "
            f"model.name={name!r}"
        )
    check_settings(args, teacher_step(config, args.workdir))


def check_not_training(workdir: str) -> dict | None:
    """``trained.unfinished(workdir)``, or the ``ConfigError`` that says a trainer holds
    ``workdir`` (still training)."""
    state = trained.unfinished(workdir)
    if state is not None and state["held"]:
        raise ConfigError(
            f"{workdir!r} {state['why']}: compress starts from a finished run; "
            "run this command again once its training has ended"
        )
    return state


def check_teacher(workdir: str) -> None:
    """The teacher is a finished run that no trainer holds: a checkpoint from the middle of
    a run would be every round's teacher, and the rounds' reference, while the run moves on."""
    state = check_not_training(workdir)
    if trained.is_pruned(workdir):  # a step-0 model: no training to resume
        raise ConfigError(
            f"{workdir!r} is a pruned run (python -m hybridpar.prune's, at step 0, never "
            "trained): compress starts from a trained run; pass the --workdir of the run it "
            "was pruned from, or train it first (the python -m hybridpar.train command prune "
            f"printed, with --config.init_from={workdir}) and pass that run's --workdir"
        )
    if state is not None:
        raise ConfigError(
            f"the run in {workdir!r} {state['why']}: compress starts from a finished run; "
            "finish it first (the same python -m hybridpar.train command resumes it)"
        )


def teacher_step(config, workdir: str) -> int:
    """The step of the teacher's latest checkpoint (the one quantize and the distillation
    read): with the settings, what the rounds are made from."""
    from hybridpar.runtime import checkpoint_dirs

    return max(checkpoint_dirs.committed_steps(checkpoint_dirs.checkpoint_dir(config, workdir)))


def settings_of(args) -> dict:
    return {k: getattr(args, k) for k in SETTINGS}


def saved_teacher_step(root: str, saved: dict) -> int | None:
    """The teacher step a loop was made from: its settings.json's, else (a loop from before
    that key) the step its round 0 quantized, else None (no round made yet)."""
    if "teacher_step" in saved:
        return saved["teacher_step"]
    try:
        with open(os.path.join(root, "round_00", "quantized", "report.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return None


def loop_root(args) -> str:
    """Where the loop lives: ``W/compress``, ``W/compress_seedN`` for ``--seed N``, with
    ``_scratch`` for ``--init scratch`` and ``_alphaA`` for ``--alpha A`` before the seed
    (the loops compared on one teacher apart: each seed's, init's and alpha's)."""
    name = DIR + ("_scratch" if args.init == "scratch" else "")
    name += "" if args.alpha is None else f"_alpha{args.alpha:g}"
    name += "" if args.seed is None else f"_seed{args.seed}"
    return os.path.join(args.workdir, name)


def check_settings(args, step: int | None = None) -> None:
    """A loop already in ``loop_root(args)`` was made with these settings and (``step``)
    from this teacher checkpoint, else the ``ConfigError`` that says which differs."""
    path = os.path.join(loop_root(args), "settings.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    loop = os.path.dirname(path)
    for k, v in settings_of(args).items():
        was = saved.get(k, BEFORE.get(k))
        if k == "criterion" and args.init == "scratch":
            continue  # moot there: a scratch loop of either ranking goes on
        if was != v:
            flag = "--" + k.replace("_", "-")
            same = f"no {flag}" if was is None else f"{flag}={was}"
            raise ConfigError(
                f"{loop} holds a loop with {same} (not {v}): pass {same} to "
                f"continue it, or move {loop} away to start another"
            )
    was = saved_teacher_step(loop, saved)
    if step is not None and was is not None and was != step:
        raise ConfigError(
            f"{loop} holds a loop made from the teacher's checkpoint at step {was}, and "
            f"{args.workdir!r}'s latest is step {step}: its rounds are stale; move {loop} "
            "away (or delete it) to compress the run as it is now"
        )


def round_config(config, workdir: str, pruned: str, epochs: float, seed: int | None = None,
                 init: str = "pruned", alpha: float | None = None):  # fmt: skip
    """The teacher's config for a round's distillation run: the pruned widths, distilled
    from the teacher, ``epochs`` long, evaluated at its end; ``seed`` (None: the teacher's)
    sets its data order and augmentation. ``init="pruned"``: started from ``pruned``'s
    weights, one stage; ``"scratch"``: from random weights, with the teacher's stages
    stretched to ``epochs`` (a model trained from the start needs its recipe). ``alpha``
    (None: the teacher config's ``distill.alpha``): the teacher's share of the loss."""
    from hybridpar.config.curriculum import stretch_stages
    from hybridpar.runtime import checkpoint_dirs

    c = config.copy_and_resolve_references()
    p = trained.load_config(pruned)
    with c.unlocked():
        if seed is not None:
            c.seed = int(seed)
        c.model = p.model
        c.distill.teacher_workdir = os.path.abspath(workdir)
        if alpha is not None:
            c.distill.alpha = float(alpha)
        c.num_epochs = float(epochs)
        if init == "scratch":
            c.init_from = ""
            c.stages = stretch_stages(config.stages, epochs) if config.stages else ""
        else:
            c.init_from = os.path.abspath(pruned)
            c.stages = ""
        c.eval_every_epochs = float(epochs)
        c.optim.warmup_epochs = min(c.optim.warmup_epochs, epochs / 4)
        c.target_top1 = c.target_top5 = -1.0
        c.stop_at_target = False
        if checkpoint_dirs.escapes(c):  # the teacher's own folder: each
            c.checkpoint.dir = ""  # round's run keeps its checkpoints in its workdir
    return c


def step_keep(index: int, step: float, previous: float | None = None) -> tuple[float, float]:
    """``(keep, top)``: round ``index``'s fraction by the step, ``(1 - step)^index``, and
    the previous round's, ``(1 - step)^(index - 1)``; where the previous round kept
    another fraction (``previous``, its row's keep: it was fitted to a budget, and a later
    call goes on with a smaller one), one step down from that one instead."""
    keep, top = (1 - step) ** index, (1 - step) ** (index - 1)
    if previous is not None and abs(previous - top) > 0.001:  # rows hold 4 decimals
        keep, top = previous * (1 - step), previous
    return keep, top


def keep_for(index: int, step: float, budget_kb: float, bytes_at,
             previous: float | None = None) -> float:  # fmt: skip
    """Round ``index``'s fraction of the teacher's channels: ``step_keep``'s (one step down
    from the previous round's), unless that model's size would be under the budget, then
    the largest fraction (to 0.001) below the previous round's whose size fits it, so the
    last round spends the budget rather than undershooting. ``bytes_at(keep)``: the
    budgeted bytes of the teacher pruned to ``keep`` (``teacher_size``: the int8 weights,
    exact, or the file, an upper bound); they never shrink as ``keep`` grows, so a
    bisection finds the largest."""
    keep, top = step_keep(index, step, previous)
    budget = budget_kb * 1000
    if bytes_at(keep) >= budget:
        return keep
    # descending; each evaluated at the value the round then prunes to
    grid = [round(float(k), 3) for k in np.arange(top - 0.001, keep, -0.001)]
    grid = [k for k in grid if keep < k < top]
    lo, hi = 0, len(grid)  # the first index that fits is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if bytes_at(grid[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return grid[lo] if lo < len(grid) else keep


def lowest_keep(index: int, keep: float, step: float, max_rounds: int) -> float:
    """The fraction round ``max_rounds`` prunes to when every round from ``index`` (which
    kept ``keep``) on takes ``step_keep``'s, one step down: the least the loop may reach
    (``keep_for`` only ever keeps more, to land on a budget). ``keep`` as a row holds it."""
    for i in range(index + 1, max_rounds + 1):
        keep = round(step_keep(i, step, keep)[0], 4)
    return keep


def loop_start(root: str, args) -> tuple[int, float] | None:
    """``(index, keep)``: the round this call's new rounds go on from, as ``_run`` reads the
    loop folder ``root``: round 0 (the teacher, 1.0) for a new loop, the last round an
    earlier call finished (its row's keep: it may have been fitted to another budget), or
    the round it pruned and stopped (its pruned fraction). None where the rounds on disk
    already end the loop (one meets the budget or is past the drop, or ``--max-rounds``)."""
    rows = rounds_after(root, 0)
    for row in rows:
        if row["top1_drop"] > args.max_drop or fits(row, args.budget_kb, args.budget_of):
            return None
    if len(rows) > args.max_rounds:
        return None
    made = pruned_keep(os.path.join(root, f"round_{len(rows):02d}")) if rows else None
    if made is not None:
        return len(rows), made
    return (len(rows) - 1, rows[-1]["keep"]) if rows else (0, 1.0)


def check_reachable(root: str, args, bytes_at) -> None:
    """The ``ConfigError`` of a budget the loop cannot reach with ``--step`` and
    ``--max-rounds`` from where it starts (``loop_start``): the model pruned the most it may
    be is over it (``bytes_at``: ``teacher_size``'s). Said before any round, with the fewest
    ``--max-rounds`` (and, for a new loop, the least ``--step``) that reach it."""
    start = loop_start(root, args)
    if start is None:
        return
    budget = 1000 * args.budget_kb
    least = lowest_keep(*start, args.step, args.max_rounds)
    if bytes_at(least) <= budget:
        return
    # the rounds the step needs: the keeps fall round after round, the bytes with them
    index, keep, keeps = *start, []
    while keep > 1e-4 and len(keeps) < 10_000:
        index += 1
        keep = round(step_keep(index, args.step, keep)[0], 4)
        keeps.append((index, keep))
    rounds = bisect_first(keeps, lambda ik: bytes_at(ik[1]) <= budget)
    fixes = [] if rounds is None else [f"--max-rounds {rounds[0]}"]
    new = not os.path.exists(os.path.join(root, "settings.json"))  # else --step is set
    steps = [s / 100 for s in range(1, 100)]
    step = bisect_first(steps, lambda s: bytes_at(lowest_keep(0, 1.0, s, args.max_rounds))
                        <= budget) if new else None  # fmt: skip
    if step is not None:
        fixes.append(f"--step {step:g}")
    size = {"weights": "whose int8 weights weigh", "file": "whose file may weigh"}
    where = (f"--step {args.step:g} and --max-rounds {args.max_rounds} prune to at most "
             f"{least:.3f} of the teacher's channels")  # fmt: skip
    if start != (0, 1.0):
        where = (f"this loop goes on from round {start[0]} at {start[1]:.3f} of the teacher's "
                 f"channels, and --step {args.step:g} up to --max-rounds {args.max_rounds} "
                 f"prunes to at most {least:.3f}")  # fmt: skip
    raise ConfigError(
        f"--budget-kb {args.budget_kb:g} --budget-of {args.budget_of}: {where}, "
        f"{size[args.budget_of]} {bytes_at(least) / 1000:.1f} KB; pass "
        + "".join(f"{f} (or more), or " for f in fixes) + "a larger --budget-kb"
    )


def bisect_first(items: list, ok):
    """The first of ``items`` that is ``ok``, where every one after an ``ok`` one is too;
    None if none is."""
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(items[mid]):
            hi = mid
        else:
            lo = mid + 1
    return items[lo] if lo < len(items) else None


BUDGETS = ("weights", "file")  # what --budget-kb bounds


def bytes_of(row: dict, of: str = "weights") -> float:
    """A row's int8 weights' or LiteRT file's bytes (a row from before the key: its rounded
    KB; without a file: infinite, it fits no file budget)."""
    if of == "file":
        if row.get("file_bytes") is not None:
            return row["file_bytes"]
        return float("inf") if row.get("file_kb") is None else 1000 * row["file_kb"]
    return row.get("bytes_int8", 1000 * row["kb_int8"])


def fits(row: dict, budget_kb: float, of: str = "weights") -> bool:
    return bytes_of(row, of) <= 1000 * budget_kb


def row_of(index: int, keep: float, report: dict, teacher_top1: float, path: str) -> dict:
    top1 = report["eval"]["int8"]["top1"]
    return {
        "round": index,
        "keep": round(keep, 4),
        "params": report["params"],
        "kb_int8": round(report["weight_bytes_int8"] / 1000, 1),
        "bytes_int8": report["weight_bytes_int8"],  # what the budget is held to
        "flops": report["flops_per_image"],
        "top1": round(top1, 4),
        # the LiteRT file's own top-1 (its runtime's; None where none was written): the
        # drop and the stop rule are on ours, the int8 forward above
        "top1_litert": _rounded(report.get("litert", {}).get("top1"), 4),
        "top1_float": round(report["eval"]["float"]["top1"], 4),
        "top1_drop": round(100 * (teacher_top1 - top1), 2),
        "eval_images": report["eval"]["int8"].get("examples"),  # the drop's images
        "ms_b1_int8": report["latency_ms"]["int8_batch1_ms"],
        # the LiteRT file's size and one-thread latency (None where none was written)
        "file_kb": report.get("litert", {}).get("file_kb"),
        "file_bytes": report.get("litert", {}).get("file_bytes"),  # a file budget's measure
        "latency_ms": report.get("litert", {}).get("latency_ms"),
        "exported": os.path.join(path, "quantized", "model.jax_exported"),
        # the class names in label order (output i is classes[i]), as its report's
        # litert_input has them (None where the data names none, or a report before them)
        "classes": report.get("litert_input", {}).get("classes"),
    }


# "file KB" and "file ms b1": the round's LiteRT model.tflite, its whole size and one-thread
# latency per image, as the loop's last line gives them (na where no file was written);
# "top1 int8" is our int8 forward's (the drop's), "top1 file" the file's in its runtime
HEADER = ("round", "keep", "params", "int8 KB", "file KB", "MFLOPs/img", "top1 int8",
          "top1 file", "drop (pts)", "ms b1 int8", "file ms b1")  # fmt: skip


def format_row(r: dict) -> list[str]:
    return [str(r["round"]), f"{r['keep']:.3f}", str(r["params"]), f"{r['kb_int8']:.1f}",
            _figure(r.get("file_kb"), 1), f"{r['flops'] / 1e6:.2f}", f"{r['top1']:.4f}",
            _figure(r.get("top1_litert"), 4), f"{r['top1_drop']:.2f}",
            f"{r['ms_b1_int8']:.3f}", _figure(r.get("latency_ms"), 3)]  # fmt: skip


def table(rows: list[dict], later: list[dict] = ()) -> list[str]:
    """rounds.md: ``rows`` (this call's loop) and ``later``, rounds an earlier call made
    past where this one stopped (another budget or drop), with a line that says so."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in [*rows, *later]]
    if later:
        lines += ["", past_line(rows, later)]
    return lines


def past_line(rows: list[dict], later: list[dict]) -> str:
    which = ", ".join(str(r["round"]) for r in later)
    return (
        f"Rounds {which}: made by an earlier call, past round {rows[-1]['round']} where "
        "this call's budget and drop stopped the loop; not candidates for its model."
    )


def rounds_after(root: str, index: int) -> list[dict]:
    """The rows of the rounds from ``index`` on that an earlier call finished (their
    ``result.json``), in order, up to the first missing."""
    rows = []
    for i in itertools.count(index):
        try:
            rows.append(read_row(root, i))
        except FileNotFoundError:
            return rows


def read_row(root: str, index: int) -> dict:
    """Round ``index``'s ``result.json`` in the loop folder ``root``, its paths as this call
    names them (from ``root``): a file written before they were stored absolute holds them
    relative to the working directory of the call that made it, and the folder may have
    been moved since."""
    rd = os.path.join(root, f"round_{index:02d}")
    with open(os.path.join(rd, "result.json")) as f:
        row = json.load(f)
    row["exported"] = os.path.join(rd, "quantized", "model.jax_exported")
    # round 0 quantized the teacher itself: the run the loop folder is in
    row["run"] = os.path.join(rd, "run") if index else os.path.dirname(root)
    return row


def stored(row: dict) -> dict:
    """``row`` as ``result.json`` keeps it: its paths absolute, so that they hold from any
    working directory (the loop itself reads them back with ``read_row``)."""
    return {**row, "exported": os.path.abspath(row["exported"]),
            "run": os.path.abspath(row["run"])}  # fmt: skip


def best(rows: list[dict], max_drop: float, of: str = "weights") -> dict | None:
    """The smallest int8 model (its weights or its file) within the drop."""
    ok = [r for r in rows if r["top1_drop"] <= max_drop]
    return min(ok, key=lambda r: (bytes_of(r, of), bytes_of(r), -r["top1"])) if ok else None


def plot(rows: list[dict], teacher_top1: float, budget_kb: float, max_drop: float, path,
         of: str = "weights"):  # fmt: skip
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    kb = [bytes_of(r, of) / 1000 for r in rows]
    top1 = [100 * r["top1"] for r in rows]
    ax.plot(kb, top1, "o-", color="C0", label="int8 model per round")
    for i, (r, x, y) in enumerate(zip(rows, kb, top1)):  # above and below in turn: a landed
        # last round sits a few KB from the one before it
        ax.annotate(str(r["round"]), (x, y), textcoords="offset points",
                    xytext=(4, 4 if i % 2 == 0 else -12))  # fmt: skip
    ax.axhline(100 * teacher_top1, color="C2", ls="--", label="float teacher")
    ax.axhline(100 * teacher_top1 - max_drop, color="C3", ls=":", label=f"-{max_drop:g} points")
    ax.axvline(budget_kb, color="C1", ls=":", label=f"budget {budget_kb:g} KB")
    ax.set_xscale("log")
    ax.set_xlabel({"weights": "int8 weights (KB)", "file": "LiteRT file (KB)"}[of])
    ax.set_ylabel("top-1 (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)


def clear_leftovers(directory: str) -> None:
    """What a killed step left half-written beside its result (``NAME.tmp-PID``)."""
    for name in os.listdir(directory):
        if ".tmp-" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def lock_loop(root: str):
    """``root/.lock`` (the loop's folder) for this process's life (``workdir_lock``): a
    second loop there would write the same rounds (and rename the same files) under the
    first."""
    from hybridpar.runtime import workdir_lock

    return workdir_lock.acquire(root, role="compress")


def pruned_keep(rd: str) -> float | None:
    """The fraction an earlier call pruned round folder ``rd`` to, where it did."""
    from hybridpar.runtime import run_records, trained

    record = run_records.read_json(os.path.join(rd, "pruned", trained.PRUNED_RECORD)) or {}
    return record.get("keep_fraction")


def committed(config, run: str) -> bool:
    """Whether the trainer run in ``run`` has a committed checkpoint (a step's folder, not
    orbax's temporary one), so that the trainer resumes it rather than starting at step 0."""
    from hybridpar.runtime import checkpoint_dirs

    return bool(checkpoint_dirs.committed_steps(checkpoint_dirs.checkpoint_dir(config, run)))


def make_round(config, args, index: int, keep: float, rd: str, rows: list, reference, log):
    """Round ``index`` in ``rd``: ``(quantize's report, the run it quantized)``; raises
    ``KeyboardInterrupt`` when its training was stopped."""
    from hybridpar.runtime import run_records
    from hybridpar.tools import prune, quantize, tune

    w = args.workdir
    qkw = dict(calibration_batches=args.calibration_batches, calibration=args.calibration,
               repeats=args.repeats, latency_batches=(1,), overwrite=True,
               litert_calibrated=False)  # fmt: skip
    if args.percentile is not None:  # else quantize's default
        qkw["percentile"] = args.percentile
    if index == 0:  # the teacher itself, in int8
        with tune.quiet(rd):
            return quantize.run(config, w, out=os.path.join(rd, "quantized"), **qkw), w
    fits = f" (the most that fits {args.budget_kb:g} KB of {args.budget_of})"
    fits = "" if keep == step_keep(index, args.step, rows[-1].get("keep"))[0] else fits
    scratch = args.init == "scratch"
    how = "from random weights in the shape of" if scratch else "pruning to"
    alpha = config.distill.alpha if args.alpha is None else args.alpha
    epochs = f"{args.epochs:g} epoch{'' if args.epochs == 1 else 's'}"
    pruned, source = os.path.join(rd, "pruned"), os.path.join(rd, "run")
    # what this call does of the round: an earlier one may have pruned and distilled it
    done = run_records.read_json(os.path.join(source, "summary.json")) or {}
    if done.get("completed"):
        log(f"round {index}: its distillation run finished in an earlier call (pruned to "
            f"{keep:.3f} of the teacher's channels); quantizing it")  # fmt: skip
    elif committed(config, source):
        log(f"round {index}: resuming its distillation run (pruned to {keep:.3f} of the "
            f"teacher's channels in an earlier call; {epochs} in all at alpha "
            f"{alpha:g}), then quantizing it (log: {rd}/run/log.txt)")  # fmt: skip
    elif os.path.exists(pruned):  # stopped before its run's first checkpoint: from step 0
        log(f"round {index}: distilling from step 0 the model an earlier call "
            f"{'shaped' if scratch else 'pruned'} to {keep:.3f} of the teacher's channels "
            f"({epochs} at alpha {alpha:g}; its run had no checkpoint yet), "
            f"then quantizing it (log: {rd}/run/log.txt)")  # fmt: skip
    else:
        log(
            f"round {index}: {how} {keep:.3f} of the teacher's channels{fits}, "
            f"then {epochs} of distillation at alpha {alpha:g} (log: "
            f"{rd}/run/log.txt)"
        )
    previous = w if scratch else rows[-1]["run"]  # scratch: only the widths are used
    if not os.path.exists(pruned):
        with tune.quiet(rd):
            prune.prune_run(previous, pruned, keep, criterion=args.criterion,
                            reference=reference)  # fmt: skip
    c = round_config(config, w, pruned, args.epochs, args.seed, args.init, args.alpha)
    _, summary = tune.run_trainer(c, source)
    if summary.get("preempted"):
        raise KeyboardInterrupt(f"round {index} stopped ({summary['preempted']})")
    with tune.quiet(rd):
        return quantize.run(c, source, out=os.path.join(rd, "quantized"), **qkw), source


def run(config, args, log=print) -> tuple[dict | None, list[dict]]:
    """The loop; returns the chosen row (None if no model is within the drop) and this
    call's rows (the last: where it stopped), or raises ``KeyboardInterrupt`` when a round's
    training was stopped (the same call resumes)."""
    root = loop_root(args)
    made = not os.path.isdir(root)
    os.makedirs(root, exist_ok=True)
    lock = lock_loop(root)
    refused = False
    try:
        return _run(config, args, root, log)
    except ConfigError:
        refused = True
        raise
    finally:
        # a loop this call began and refused before a round was done (the teacher's data
        # of other classes, found as round 0 opens it): nothing of it is left; removed
        # under the lock, so that no other call takes the folder over meanwhile
        if made:
            left = [n for n in os.listdir(root) if n != os.path.basename(lock.path)]
            done = any(os.path.exists(os.path.join(root, n, "result.json")) for n in left)
            if not left or (refused and not done):
                shutil.rmtree(root)
        lock.release()


def _run(config, args, root: str, log) -> tuple[dict | None, list[dict]]:
    import time

    w = args.workdir
    check_teacher(w)  # again, under the lock: the teacher may have changed since check_args
    step = teacher_step(config, w)
    check_settings(args, step)
    # first, outside tune.quiet: the logging handlers orbax sets up keep the stream they find
    # the groups' widths every round's fraction refers to, and the budgeted bytes at a fraction
    reference, bytes_at = teacher_size(w, args.budget_of)
    floor = bytes_at(0.0)  # one channel in every group
    if args.budget_of == "file" and floor > 1000 * args.budget_kb:
        raise ConfigError(
            f"--budget-kb {args.budget_kb:g} --budget-of file: the smallest file this teacher "
            f"prunes to (one channel per group) may weigh {floor / 1000:.1f} KB, most of it "
            "the file's own structure; pass a larger --budget-kb, or --budget-of weights"
        )
    if args.budget_of == "weights" and floor > 1000 * args.budget_kb:
        raise ConfigError(
            f"--budget-kb {args.budget_kb:g} --budget-of weights: the smallest int8 weights "
            f"this teacher prunes to (one channel per group) weigh {floor / 1000:.1f} KB; "
            "pass a --budget-kb of at least that"
        )
    check_reachable(root, args, bytes_at)  # before any round trains
    write_json(os.path.join(root, "settings.json"), {**settings_of(args), "teacher_step": step})
    rows, t0 = [], time.time()
    log("| " + " | ".join(HEADER) + " |")
    for index in itertools.count():
        rd = os.path.join(root, f"round_{index:02d}")
        result = os.path.join(rd, "result.json")
        # --max-rounds bounds the rounds made; one an earlier call made past it still counts
        if index > args.max_rounds and not os.path.exists(result):
            break
        os.makedirs(rd, exist_ok=True)
        clear_leftovers(rd)
        keep = 1.0
        if index > 0:  # from the previous round's keep: it may have been fitted to a budget
            keep = keep_for(index, args.step, args.budget_kb, bytes_at, rows[-1]["keep"])
        made = pruned_keep(rd) if not os.path.exists(result) else None
        if made is not None and made != keep:  # a stopped round goes on as it was pruned
            log(f"round {index}: an earlier call pruned it to {made:.3f} of the teacher's "
                f"channels (this call would take {keep:.3f}); going on with it (delete {rd} "
                "to prune it again)")  # fmt: skip
            keep = made
        if os.path.exists(result):
            row = read_row(root, index)
            if row.get("teacher_step", step) != step:
                raise ConfigError(
                    f"{result} was made from the teacher's step {row['teacher_step']}, not "
                    f"{step}: move {root} away (or delete it) to start another loop"
                )
        else:
            # an earlier call stopped in this round: its distillation time counts too
            start, earlier = time.time(), recorded_seconds(rd)
            report, source = make_round(config, args, index, keep, rd, rows, reference, log)
            if index == 0 and report["step"] != step:  # trained on since the check
                raise ConfigError(
                    f"the teacher in {w!r} moved to step {report['step']} during compress: "
                    f"run this command again once its training has ended"
                )
            # round 0's float top-1 is the teacher's: every later row's reference
            teacher_top1 = (
                report["eval"]["float"]["top1"] if index == 0 else rows[0]["teacher_top1"]
            )
            row = row_of(index, keep, report, teacher_top1, rd)
            # the budget the round was made under, and what its fraction was planned with
            row.update(budget_of=args.budget_of, budget_kb=args.budget_kb,
                       planned_bytes=int(bytes_at(keep)))  # fmt: skip
            row.update(teacher_top1=teacher_top1, teacher_step=step, run=source,
                       seconds=round(time.time() - start + earlier, 1))  # fmt: skip
            write_json(result, stored(row))
        rows.append(row)
        log("| " + " | ".join(format_row(row)) + " |")
        if row["top1_drop"] > args.max_drop or fits(row, args.budget_kb, args.budget_of):
            break
    teacher_top1 = rows[0]["teacher_top1"]
    # the rounds an earlier call made past this call's stop stay on disk: shown, and said
    later = rounds_after(root, len(rows))
    with open(os.path.join(root, "rounds.md"), "w") as f:
        f.write("\n".join(table(rows, later)) + "\n")
    if later:  # their rows as rounds.md has them, then the line that says whose they are
        for row in later:
            log("| " + " | ".join(format_row(row)) + " |")
        log(past_line(rows, later))
    front = os.path.join(root, "front.png")
    try:
        plot([*rows, *later], teacher_top1, args.budget_kb, args.max_drop, front,
             args.budget_of)  # fmt: skip
    except ConfigError as e:  # no matplotlib: the rounds and the result do not need it
        if os.path.exists(front):  # an earlier call's, of other rows
            os.remove(front)
        log(f"warning: {root}/front.png not drawn ({e}); the rounds and the result are "
            "complete without it")  # fmt: skip
        front = "not drawn"
    chosen = best(rows, args.max_drop, args.budget_of)
    took = sum(r.get("seconds", 0) for r in rows)
    log(
        f"teacher: step {step}, float top-1 {teacher_top1:.4f}; rounds took {took:.0f}s in "
        f"all, every call's ({time.time() - t0:.0f}s this time); table {root}/rounds.md, "
        f"front {front}"
    )
    # every round is evaluated on the run's eval split (quantize's): it both chooses the
    # round (the drop, --max-drop, best) and gives its figures
    split = eval_split_of(config.data)
    if chosen is None:
        log(f"no int8 model within {args.max_drop:g} points of the teacher on the {split} "
            "images")  # fmt: skip
        return None, rows
    n = eval_images(chosen)
    se = top1_se(chosen["top1"], n)
    images = f"the {split} split's {n if n else 'na'} images"
    one = f"one image {100 / n:.2f} points, " if n else ""
    reached = "reached" if fits(chosen, args.budget_kb, args.budget_of) else "NOT reached"
    log(f"smallest within {args.max_drop:g} points on {images}, which chose it and measured "
        f"it ({one}top-1's standard error {_figure(se, 2)} points): round {chosen['round']} "
        f"({chosen['kb_int8']:.1f} KB of int8 weights, file "
        f"{_figure(chosen.get('file_kb'), 1)} KB; budget {args.budget_kb:g} KB of "
        f"{args.budget_of} {reached}{file_over(chosen, args)}); int8 model "
        f"{chosen['exported']}{tflite_of(chosen)}")  # fmt: skip
    print(f"kb_int8={chosen['kb_int8']:.1f} top1_drop={chosen['top1_drop']:.2f} "
          f"top1_se={_figure(se, 2)} "
          f"top1={chosen['top1']:.4f} top1_litert={_figure(chosen.get('top1_litert'), 4)} "
          f"params={chosen['params']} flops={chosen['flops']} "
          f"file_kb={_figure(chosen.get('file_kb'), 1)} "
          f"latency_ms={_figure(chosen.get('latency_ms'), 3)} eval_images={n or 'na'} "
          f"chosen_on={split} measured_on={split} budget_kb={args.budget_kb:g} "
          f"budget_of={args.budget_of} teacher_step={step}",
          flush=True)  # fmt: skip
    return chosen, rows


def eval_images(row: dict) -> int | None:
    """The images a row's top-1 is over: its ``eval_images``, else (a row from before
    the key) its round's quantize report's, else None."""
    if row.get("eval_images"):
        return row["eval_images"]
    report = os.path.join(os.path.dirname(row["exported"]), "report.json")
    try:
        with open(report) as f:
            return int(json.load(f)["eval"]["int8"]["examples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def top1_se(top1: float, n: int | None) -> float | None:
    """The binomial standard error of a top-1 over ``n`` images (``eval_images``), in
    points: sqrt(p(1-p)/n), the scale of the noise in a drop (None where n is unknown)."""
    return None if not n else 100 * (top1 * (1 - top1) / n) ** 0.5


def file_over(row: dict, args) -> str:
    """Where a weights budget is met by a model whose LiteRT file (what a device stores)
    is over it: a clause that says so, and how to bound the file."""
    if args.budget_of != "weights" or row.get("file_kb") is None:
        return ""
    if not fits(row, args.budget_kb, "weights"):
        return ""
    if bytes_of(row, "file") <= 1000 * args.budget_kb:
        return ""
    return (f"; its model.tflite, the file a device stores, is {row['file_kb']:.1f} KB, "
            f"over {args.budget_kb:g} KB: --budget-of file bounds the file")  # fmt: skip


def recorded_seconds(rd: str) -> float:
    """The seconds an earlier, stopped call spent distilling round folder ``rd``: its
    run's last record's ``wall_s`` (the trainer's wall time, which goes on over its starts),
    0 where it has none."""
    from hybridpar.runtime import run_records

    records = run_records.read_records(os.path.join(rd, "run", "metrics.jsonl"))[0]
    return next((r.wall_s for r in reversed(records) if r.wall_s is not None), 0.0)


def tflite_of(row: dict) -> str:
    """``, LiteRT file PATH`` of a row's model.tflite (beside its model.jax_exported), or
    nothing where the round wrote none."""
    if row.get("file_kb") is None:
        return ""
    return f", LiteRT file {os.path.join(os.path.dirname(row['exported']), 'model.tflite')}"


def _rounded(value, digits: int):
    return None if value is None else round(value, digits)


def _figure(value, digits: int) -> str:
    """``value`` to ``digits`` places, or ``na`` (a row from before the LiteRT file, or a net
    it does not export)."""
    return "na" if value is None else f"{value:.{digits}f}"


def teacher_size(workdir: str, of: str = "weights"):
    """``(reference, bytes_at)``: each channel group's width in the teacher (the rounds'
    fractions refer to them), and ``bytes_at(keep)``, the bytes of the teacher pruned to
    ``keep`` of every group's channels: ``of`` ``"weights"``, its int8 weights (exact);
    ``"file"``, at most its LiteRT file's (``edge.predict_bytes``, the file's overhead
    measured on the teacher's own file, converted here once)."""
    import jax

    from hybridpar.parallel.mesh import make_mesh
    from hybridpar.program import int8
    from hybridpar.tools import prune

    mesh = make_mesh("data:-1", devices=jax.devices()[:1])
    # the config read here: a missing one is said in the CLI's words, not the library's
    src = trained.TrainedRun(workdir, mesh, config=trained.load_config(workdir))
    params, stats = src.host_variables()
    gs = prune.groups(src.model, params)
    reference = prune.group_widths(gs, params)

    def quantized(keep: float):
        return prune.quantized(src.model, gs, params, stats, prune.counts_for(gs, reference, keep))

    if of == "weights":
        return reference, lambda keep: int8.tree_bytes(quantized(keep)[1])
    from hybridpar.tools import edge  # imports TensorFlow: only for a file budget

    d = src.config.data
    arch, q = quantized(1.0)
    shape = (d.image_size, d.image_size, d.channels)
    blob = edge.convert(arch, q, tuple(d.mean), tuple(d.std), shape, edge.dummy_ranges(arch))
    model = edge.size_model(blob)
    return reference, lambda keep: edge.predict_bytes(quantized(keep)[1], d.channels, model)


NOT_REACHED = 3  # the exit code of a loop that ends without a model within the budget


def outcome(chosen: dict | None, rows: list[dict], args) -> str | None:
    """Why the loop ended without its goal (the line before exit code 3), or None, with
    what changes that on this loop: ``rows`` are this call's, the last where it stopped.
    The drop stopped it: a larger --max-drop, or a loop folder of its own for other rounds
    (--step and --epochs are the loop's settings); the rounds ran out: more --max-rounds
    (no round failed the drop). Either way, a budget the chosen model meets."""
    if chosen is not None and fits(chosen, args.budget_kb, args.budget_of):
        return None
    last, root = rows[-1], loop_root(args)
    if last["top1_drop"] > args.max_drop:
        why = (f"round {last['round']} lost {last['top1_drop']:.2f} points, over --max-drop "
               f"{args.max_drop:g}, which ends the loop")  # fmt: skip
        how = (f"pass --max-drop {last['top1_drop']:g} (or more) to accept it and go on from "
               f"it; for other rounds (another --step or --epochs: this loop's are --step "
               f"{args.step:g} --epochs {args.epochs:g}) move {root} away, or pass another "
               "--seed (a loop folder of its own)")  # fmt: skip
        if last["round"] == 0:  # the teacher itself in int8: no step or epochs made it
            how = (f"pass --max-drop {last['top1_drop']:g} (or more), or another "
                   f"--calibration with {root} moved away (or another --seed)")  # fmt: skip
    else:
        why = f"round {last['round']} was the last that --max-rounds {args.max_rounds} allows"
        how = f"pass --max-rounds {last['round'] + 1} (or more) to go on from it"
    if chosen is None:
        return f"budget not reached: no int8 model within {args.max_drop:g} points ({why}); {how}"
    size = bytes_of(chosen, args.budget_of) / 1000
    need = math.ceil(bytes_of(chosen, args.budget_of) / 100) / 10  # KB, up to a tenth
    return (
        f"budget not reached: the smallest int8 model within {args.max_drop:g} points is "
        f"{size:.1f} KB of {args.budget_of} (round {chosen['round']}), over --budget-kb "
        f"{args.budget_kb:g} ({why}); {how}; or pass --budget-kb {need:g} (or more) to take "
        f"round {chosen['round']}"
    )


def main(argv=None) -> None:
    # from the first line: a stop outside a round's training exits 0 (pruning, quantizing)
    with signals.StopBetweenRuns("stopped; the same command continues the loop"):
        _main(argv)


def _main(argv) -> None:
    from hybridpar.tools import quantize

    parser = cli.ArgumentParser(
        "python -m hybridpar.compress",
        (
            "Prune, distil and quantize a finished run, round after round, until its int8 model "
            "fits --budget-kb within --max-drop points of top-1."
        ),
        # by hand: two are required, but a missing one is our error line, not argparse's
        usage="%(prog)s [-h] --workdir WORKDIR --budget-kb BUDGET_KB\n"
        "       [--budget-of {weights,file}] [--max-drop MAX_DROP] [--step STEP]\n"
        "       [--epochs EPOCHS] [--criterion {l1,bn}] [--init {pruned,scratch}]\n"
        "       [--alpha ALPHA] [--max-rounds MAX_ROUNDS] [--seed SEED]\n"
        "       [--calibration-batches CALIBRATION_BATCHES]\n"
        "       [--calibration {max,percentile,mse}] [--percentile PERCENTILE]\n"
        "       [--repeats REPEATS]",
    )
    parser.epilog = (
        "exit status: 0 when a round's int8 model is within --budget-kb and --max-drop; 3 when\n"
        "none is (a 'budget not reached: ...' line on stderr says why the loop stopped and what\n"
        "changes that); 2 for bad input.\n\n" + parser.epilog
    )
    parser.add_argument("--workdir", help="the trained teacher's run (read only)")
    parser.add_argument("--budget-kb", type=cli.finite_float,
                        help="stop once the budgeted size is at most this many KB")  # fmt: skip
    parser.add_argument("--budget-of", choices=BUDGETS, default="weights",
                        help="what --budget-kb bounds: the int8 weights (default) or the whole "
                             "LiteRT file")  # fmt: skip
    parser.add_argument("--max-drop", type=cli.finite_float, default=1.0,
                        help="points of top-1 the int8 model may lose (default 1.0)")  # fmt: skip
    parser.add_argument("--step", type=cli.finite_float, default=0.25,
                        help="fraction of channels pruned per round (default 0.25)")  # fmt: skip
    parser.add_argument("--epochs", type=cli.finite_float, default=3.0,
                        help="distillation epochs per round (default 3)")  # fmt: skip
    parser.add_argument("--criterion", choices=("l1", "bn"),
                        help="channel ranking (hybridpar.prune; default l1)")  # fmt: skip
    parser.add_argument("--init", choices=INITS, default="pruned",
                        help="where each round's model starts: the previous round's weights, "
                             "pruned (default), or random weights in the pruned shape, trained "
                             "with the teacher's curriculum stretched to --epochs")  # fmt: skip
    parser.add_argument("--alpha", type=cli.finite_float, default=None,
                        help="distillation's weight on the teacher, in [0, 1] (default: the "
                             "run's distill.alpha: 0.5, or 0.9 in runs trained before "
                             "2026-12-06; 0: the labels alone)")  # fmt: skip
    parser.add_argument("--max-rounds", type=int, default=8,
                        help="the last round made (default %(default)s; rounds past it that an "
                             "earlier call made still count)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None,
                        help="the distillation runs' seed (default: the teacher's); the loop "
                             "of seed N lives in W/compress_seedN")  # fmt: skip
    parser.add_argument("--calibration-batches", type=int, default=8,
                        help="training batches that set each round's static activation scales, "
                             "as hybridpar.quantize's (default %(default)s)")  # fmt: skip
    parser.add_argument("--calibration", choices=quantize.CALIBRATIONS, default="mse",
                        help="activation ranges, as hybridpar.quantize's")  # fmt: skip
    parser.add_argument("--percentile", type=cli.finite_float, default=None,
                        help="for --calibration percentile: the percentile of |x| (default "
                             "99.99, as hybridpar.quantize's)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per latency figure (median)")  # fmt: skip
    args, config = cli.parse(parser, argv, from_run=True)
    if not args.workdir:
        cli.fail("pass --workdir DIR (the trained teacher's run)")
    quantize.check_workdir(args.workdir)

    def go():
        c = config or trained.load_config(args.workdir, args.config_overrides)
        check_args(args, c)
        try:
            chosen, rows = run(c, args)
        except KeyboardInterrupt as e:
            print(f"stopped: {e}; the same command continues the loop", flush=True)
            return
        why = outcome(chosen, rows, args)
        if why:
            print(why, file=sys.stderr, flush=True)
            sys.exit(NOT_REACHED)

    cli.main(go)


if __name__ == "__main__":
    main()
