"""Time to accuracy on CIFAR-10: the curriculum against the same model at one fixed shape,
over several seeds, with the time to target resolved to a fraction of an epoch.

    python bench/curriculum_tta.py [--variant cpu] [--seeds 3] [--first-seed 0]
                                   [--target 0.8] [--epochs E] [--checkpoint-every-epochs 0.25]
                                   [--out DIR] [--set KEY=VALUE ...] [--fixed-set KEY=VALUE ...]
                                   [--curriculum-set KEY=VALUE ...] [--calibration-steps 12]
                                   [--fixed-from OUT] [--one-after-other]
                                   [--evaluate-from-epoch E]

For each seed (the config's ``seed``: initialisation, data order and augmentation), two runs
of ``experiments/cifar10_fast.py:VARIANT`` in fresh workdirs ``--out``/seedS/NAME (default
``--out`` ``runs/curriculum_tta``): ``curriculum`` (the recipe's stages, e.g. 24 px then 32
px, at batch 512) and ``fixed`` (the same model, optimizer, epochs and augmentation at 32 px
and the last stage's batch throughout). The two run side by side: at once, each on half the
cores, its output in seedS/NAME.log, the halves swapped from one seed to the next
(``--one-after-other``: in turn, on all cores). The pairs run one after the other.

Both train the recipe's epochs (a fixed budget: no stop at the target, so the last
evaluation is the recipe's final accuracy) and save a checkpoint every
``--checkpoint-every-epochs`` (the same number of steps in both runs, counted at the largest
batch of either; all kept), and neither evaluates before its last step. After each pair,
``python -m hybridpar.evaluate`` evaluates every checkpoint of both runs (output in
seedS/NAME.eval.log), side by side on the same cores: no evaluation takes a core from a
training run. An evaluator started by hand on a run (``--watch``, on a free core) is waited
for (one evaluator per run); the bench's then evaluates only what it left.
``--evaluate-from-epoch E``: only the checkpoints from epoch E on (``--from-epoch``), fewer
evaluations where the target is known to fall later; a run already at or over a target at
the first one evaluated then has its earlier checkpoints evaluated too, so its time to that
target is still its first checkpoint at or over it (unless it crossed the target before E
and fell back under it by E: keep E well under where the target falls).

Time to a target: the training wall time at the first checkpoint whose top-1 is at or over
it, from the run's start (set-up and compilation included), checkpoint saves and evaluation
excluded: the trainer's own count of time in steps (each train line's steps x batch /
images per second) after the time before its first step. Also without compilation. It is
resolved to the checkpoint interval (the target may have been reached up to one interval
earlier). Also on the steady clock: each step counted at its shape's median step time
(``training_clock``), what the run would have taken with nothing else on the machine; on a
shared machine the two runs of a pair are at different epochs when something else loads
it, so that load need not cost them alike before their targets. The data is prepared
before any run starts, so no clock includes that; what the bench needs of it (the
training set's size and the data-parallel size: the checkpoint interval) is recorded in
--out/data.json, and a call with nothing left to train or evaluate reads it from there,
not the data. Each run's summary.json gets the bench's time to each target beside the
trainer's (``bench_time_to_target``): the trainer's ``time_to_target`` counts its own
evaluations only, here the last step's alone.

The priced clock holds where neither holds: load that changes between the stages of one
run (a 32-px stage trained beside other work, its 24-px stage on a quiet machine) moves
the steady clock's medians too. Before the first pair, two short runs side by side (one per
half of the cores, as the pairs train) time every shape either run trains, each for
``--calibration-steps`` steps in turn, three times (the second run in the reverse order), in
--out/calibration_SHAPES; load that comes and goes over minutes slows the shapes alike
there. Each step of a pair is then counted at its shape's median in those runs, and nothing
else (no set-up, no compilation): the time to a target in steps, priced at one machine's
step costs, the same whatever else ran while the pair trained. The runs are deterministic
at a given core count, so their steps to a target do not depend on load; what the priced
clock leaves out is a stall the step costs do not show (the stage switch's, reported
below). Made once per --out and set of shapes (its commands.json), reused after.

``--fixed-from OUT``: another --out whose finished pairs hold this bench's fixed runs (the
same command, so the same seed and settings): their records are copied in and only the
curriculum trains, on one half of the cores (two such benches, e.g. two curricula, can run
at once under ``taskset``, each on its own core). The wall and steady clocks of such a pair
were not measured side by side: read the priced clock, whose calibration is this --out's.
On another kind of machine the same seed does not give the same floats (a loss 1e-5 apart
from the first step): a reused fixed run is then the same seed, not the same trajectory.

Per seed and run: the time to ``--target`` and to the recipe's final target, and the final
top-1 (at the last step); the speedup, fixed's time over the curriculum's (``inf`` where
only the curriculum reached the target, 0 where only the fixed run did, ``nan`` where
neither); and the stall at each stage switch of the curriculum: the time between the last
step of one stage and the first of the next, against the median step time of the stage
after it (an interval with an evaluation or a checkpoint in it is reported as such, not as a
stall). Over the seeds: the median, min and max of each speedup, each seed's rows in
``--out``/curriculum_tta.json, and ``python -m hybridpar.report`` on each pair
(seedS/report.png and .md).

The last line starts with the figure to read, ``tta_speedup_80_priced=`` (the median over
the seeds of fixed's time to ``--target`` over the curriculum's, on the priced clock), then
``tta_speedup_80_priced_min=``, ``tta_speedup_80_priced_max=`` and ``seeds=``, then the
same on the steady clock (``tta_speedup_80_steady=`` ...) and on the wall clock
(``tta_speedup_80_wall=`` ...), then each run's own median over the seeds
(``curriculum_tta_s_median=``, ``fixed_tta_s_median=``: wall seconds to ``--target``, each
over its own seeds, so their ratio is no speedup; the final top-1 the same way), and ends
with the calibrated step costs (``step_s_24x512=`` ...: image size x global batch).

A run that never reached a target (too few ``--epochs`` for it) gets a ``warning:`` line
on stderr naming the target, the runs and their seeds, and what to change (more
``--epochs``, or a lower ``--target``); its speedups there are 0, inf or nan. Exit code 0,
or 3 where no run of any pair reached ``--target`` (every speedup to it nan; a line on
stderr says so, after the last line), 2 for bad input. Data:
the JPEG tars in ``$HYBRIDPAR_DATA`` (default ``../shared/data``),
prepared on first use into ``~/.cache/hybridpar``. Three pairs of the cpu variant at its 8
epochs are hours of CPU; ``--epochs`` shortens both runs alike (the recipe's stages scaled),
``--seeds`` sets how many pairs.
``--fixed-set`` overrides the fixed run only, ``--curriculum-set`` the curriculum only (e.g.
``stages=...``: another curriculum against the same fixed run). Called again with the same
``--out``, the bench reuses each finished pair (seedS/pair.json holds its runs' commands,
which must be the ones it would run now, but for --target: the runs never stop at a target,
so another one changes only which evaluated checkpoint is read; a pair evaluated from an
epoch on gets its earlier checkpoints evaluated where a lower target may fall there, or a
warning where they are no longer on disk; a refusal names each setting that differs, old ->
new) and runs the seeds it lacks, so an interrupted measurement goes on, and ``--seeds 5``
after ``--seeds 3`` adds two pairs; the records (``metrics.jsonl``, ``summary.json``,
``evaluator/`` and seedS/pair.json: no checkpoint is read again, but for a lower --target's
as above) may move to another ``--out`` or another machine's checkout. A pair whose two
runs finished training but not their evaluation (seedS/commands.json, written when the pair
starts, holds the commands) goes on at the evaluation; a pair stopped while training
resumes: each run not completed goes on from its latest checkpoint (the trainer's own
resume, bit-exact), then the evaluation. Its clocks keep each step's last run (the steps
redone after the restart replace the first ones) and leave out the restart's set-up; the
priced clock is the same as without the stop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from hybridpar.config.curriculum import parse_stages  # JAX-free, as this parent process stays
from hybridpar.runtime import checkpoint_dirs, run_records, workdir_lock

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("curriculum", "fixed")
# What the bench sets itself: a seed per pair, and no stop at the target (the budget is the
# recipe's epochs, whose last evaluation is the final accuracy it reports).
OWN_KEYS = ("seed", "stop_at_target")
PAIR = "pair.json"  # in seedS/, once its pair is trained and evaluated: the runs' commands
STARTED = "commands.json"  # in seedS/, from the pair's start: the same commands
REUSED = "reused.json"  # in seedS/, with --fixed-from: where its fixed run's records came from
DATA = "data.json"  # in --out: what ``prepare`` returned, and the settings it was made with
# The calibration: each shape trained for --calibration-steps steps, in turn, this many times,
# by two runs side by side (the second in the reverse order), in --out/calibration_SHAPES.
CALIBRATION_ROUNDS = 3
# The exit code where no pair's runs reached --target (as hybridpar.compress's for a budget
# not reached): every speedup to it is nan.
NOT_REACHED = 3
RECORDS = ("config.json", "metrics.jsonl", "summary.json", "evaluator/metrics.jsonl")


def completed(workdir: Path) -> bool:
    """Whether the run in ``workdir`` completed training (its summary.json says so)."""
    return bool((run_records.read_json(workdir / "summary.json") or {}).get("completed"))


def portable(commands: dict, out: Path) -> dict:
    """``commands`` with ``--out`` and this checkout written ``{out}`` and ``{root}``, as
    the pair's files record them: a finished pair's records copied to another machine or
    another ``--out`` are still its own."""

    def sub(arg: str) -> str:
        return arg.replace(str(out), "{out}").replace(str(ROOT), "{root}")

    return {n: [sub(a) for a in cmd] for n, cmd in commands.items()}


def in_checkout(path: Path) -> str:
    """``path`` from the checkout's root when it is inside it (as records that move between
    machines read best: ``bench/results/...``), else as it is."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def fail(message: str) -> None:
    """One ``error:`` line and exit 2, as the trainer does for bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def train_cmd(
    workdir: Path, args, overrides: list[str], every_steps: int | None = None
) -> list[str]:
    """A run's command; its checkpoint interval is the pairs' (``args.every_steps``) unless
    ``every_steps`` is given (the calibration's 0: no save)."""
    every_steps = args.every_steps if every_steps is None else every_steps
    return [
        sys.executable, "-m", "hybridpar.train",
        "--config", str(ROOT / "experiments" / f"cifar10_fast.py:{args.variant}"),
        "--workdir", str(workdir),
        "--config.log_every_s=0", "--config.eval_every_epochs=0",
        f"--config.checkpoint.every_steps={every_steps}",
        "--config.checkpoint.every_minutes=0", "--config.checkpoint.max_to_keep=0",
        f"--config.target_top1={args.target}",
        *(f"--config.{kv}" for kv in args.set), *overrides,
    ]  # fmt: skip


def eval_cmd(workdir: Path, from_epoch: float = 0.0) -> list[str]:
    since = [f"--from-epoch={from_epoch:g}"] if from_epoch else []
    return [sys.executable, "-m", "hybridpar.evaluate", "--workdir", str(workdir), *since]


def evaluate_runs(d: Path, names, halves, from_epoch: float, targets: list[float]) -> None:
    """Evaluates the checkpoints of the runs ``names`` in ``d`` from ``from_epoch`` on, each
    on its half of the cores, then ``evaluate_earlier``."""
    wait_for_evaluators([d / n for n in names])
    run_both([(f"seed {d.name[4:]} {n} evaluator", eval_cmd(d / n, from_epoch),
               d / f"{n}.eval.log") for n in names], halves)  # fmt: skip
    if from_epoch:
        evaluate_earlier(d, names, halves, targets)


def on_disk(workdir: Path) -> set[int]:
    """The committed checkpoint steps of the run in ``workdir`` (none where its records were
    moved without them)."""
    saved = run_records.read_json(str(workdir / "config.json")) or {}
    config = SimpleNamespace(
        checkpoint=SimpleNamespace(dir=(saved.get("checkpoint") or {}).get("dir"))
    )
    where = checkpoint_dirs.checkpoint_dir(config, str(workdir))  # the trainer's own rule
    return set(checkpoint_dirs.committed_steps(where))


def evaluate_earlier(d: Path, names, halves, targets: list[float]) -> bool:
    """For each run of ``names`` in ``d`` at or over a target at the first checkpoint
    evaluated, with earlier checkpoints left unevaluated (``--evaluate-from-epoch``: it may
    have reached the target at one of those), evaluates those, on its half of the cores
    (``halves``, by ``names``); a finished pair's too, whose earlier call had higher targets.
    Where they are no longer on disk (records moved without them), a warning that its time
    to the target is at most that checkpoint's. Returns whether it evaluated any."""
    early = []
    for n in names:
        recs = records(d / n / "metrics.jsonl")
        evals = evaluations(recs, records(d / n / "evaluator" / "metrics.jsonl"))
        if not evals:
            continue
        first = evals[0]
        left = {r["step"] for r in recs if r["event"] == "checkpoint" and r["step"] < first["step"]}
        reached = [f"{t:g}" for t in targets if first["top1"] >= t]
        if not (left and reached):
            continue
        at = (f"{d / n}: at {first['top1']:.4f} top-1 already at epoch {first['epoch']:.3f}, "
              "the first checkpoint evaluated")  # fmt: skip
        if left & on_disk(d / n):
            print(f"== {at}: evaluating the earlier ones too", flush=True)
            early.append(n)
        else:
            print(f"warning: {at}; the earlier ones (--evaluate-from-epoch) are not on disk "
                  f"here, so its time to top-1 {' and '.join(reached)} is at most that "
                  "checkpoint's", file=sys.stderr, flush=True)  # fmt: skip
    if early:
        wait_for_evaluators([d / n for n in early])
        run_both([(f"seed {d.name[4:]} {n} evaluator", eval_cmd(d / n), d / f"{n}.eval.log")
                  for n in early],
                 [halves[names.index(n)] for n in early] if halves else None)  # fmt: skip
    return bool(early)


def wait_for_evaluators(workdirs: list[Path]) -> None:
    """An evaluator started by hand on a run (``--watch``, on a free core) holds the lock
    on its records, so the bench's own would be refused: it goes on after that one ends
    (with --watch, at the run's last step), and evaluates only what that one left."""
    for w in workdirs:
        if workdir_lock.held(str(w / "evaluator")):
            print(f"== waiting for the evaluator already running on {w}", flush=True)
        while workdir_lock.held(str(w / "evaluator")):
            time.sleep(5)


# The runs in progress, each in its own session (a terminal's Ctrl-C reaches the bench
# alone): a SIGINT or SIGTERM to the bench is passed to them once each, so they save and
# stop, and the bench waits for them, instead of leaving them training without it.
CHILDREN: list = []
STOPPED: list = []  # the signal's name, once one came


def pass_on(signum, frame) -> None:
    name = signal.Signals(signum).name
    live = [p for p in CHILDREN if p.poll() is None]
    print(f"== {name}: passed to the {len(live)} run(s) in progress, which save a checkpoint "
          "and stop; the same command goes on from there", flush=True)  # fmt: skip
    STOPPED.append(name)
    for p in live:
        p.send_signal(signum)


def check_stopped() -> None:
    """After the runs a signal stopped: one line and exit 0, as the trainer stops."""
    if STOPPED:
        print(f"stopped ({STOPPED[0]}): the runs saved checkpoints; run the same command to go "
              "on", flush=True)  # fmt: skip
        sys.exit(0)


def start(name: str, cmd: list[str], log: Path, cores=None):
    """Starts ``cmd`` (on ``cores`` only, its output appended to ``log``, when given)."""
    check_stopped()
    if cores is None:
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    else:
        print(f"== {name} on cores {sorted(cores)} (output in {log}): {' '.join(cmd[1:])}",
              flush=True)  # fmt: skip
        with open(log, "a") as f:  # the child holds its own copy; a resume goes on in the log
            # XLA's and tf.data's thread pools size themselves by the affinity set.
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=lambda: os.sched_setaffinity(0, cores))  # fmt: skip
    CHILDREN.append(proc)
    return proc


def run_both(jobs: list[tuple[str, list[str], Path]], halves) -> None:
    """Runs (name, command, log) jobs: at once, one on each of ``halves`` (a set of cores
    each), or, with ``halves`` None, one after the other on all cores."""
    if halves is None:
        for name, cmd, log in jobs:
            code = start(name, cmd, log).wait()
            check_stopped()
            if code != 0:
                fail(f"{name} failed (exit {code}); see {log.parent}")
        return
    procs = [
        (name, start(name, cmd, log, cores), log) for (name, cmd, log), cores in zip(jobs, halves)
    ]
    for name, proc, log in procs:
        code = proc.wait()
        if STOPPED:
            for _, other, _ in procs:
                other.wait()
            check_stopped()
        if code != 0:
            for _, other, _ in procs:  # stopped, not left running without the bench
                other.terminate()
            fail(f"{name} failed (exit {code}); its output is in {log}")


def stage_specs(overrides: list[str]) -> list[str]:
    """The shapes (``SIZE-BATCH[@SCALE][~M]``) of the last ``--config.stages=`` in
    ``overrides``, in order."""
    stages = [a.split("=", 1)[1] for a in overrides if a.startswith("--config.stages=")][-1]
    return [part.split(":", 1)[1] for part in stages.split(",") if part.strip()]


def calibration_dir(specs: list[str]) -> str:
    """The calibration's folder in --out, one per set of shapes."""
    return "calibration_" + "_".join(specs)


def calibrate(out: Path, args, specs: list[str], data: dict, halves) -> dict:
    """The priced clock's cost of a step of each of ``specs`` (``step_costs``), from two runs
    that alternate them (``alternating_stages``), side by side as the pairs train, the
    second in the reverse order; made once per --out and set of shapes, reused after (its
    commands.json, written when both finished, holds the commands)."""
    d = out / calibration_dir(specs)
    orders = {"a": specs, "b": specs[::-1]}
    cmds = {}
    for name, order in orders.items():
        alt = alternating_stages(order, args.calibration_steps, CALIBRATION_ROUNDS,
                                 data["train_examples"], data["data_parallel"])  # fmt: skip
        end, last = alt.split(",")[-1].split(":")
        size = last.split("-")[0]
        cmds[name] = train_cmd(d / name, args, [
            f"--config.num_epochs={end}", f"--config.data.image_size={size}",
            f"--config.stages={alt}", "--config.seed=0", "--config.optim.warmup_epochs=0",
        ], every_steps=0)  # fmt: skip
    commands = portable({n: cmd[1:] for n, cmd in cmds.items()}, out)
    done = d / STARTED
    if done.exists() and costs_of(json.loads(done.read_text())) != costs_of(commands):
        fail(f"{d} holds a calibration made with other settings (its {STARTED} lists its "
             "commands): pass the settings it was made with, or move it away to calibrate "
             "again")  # fmt: skip
    made = done.exists()
    if not made:
        if d.exists():  # stopped before it finished: minutes to make again
            print(f"== {d} holds an unfinished calibration: made again", flush=True)
            shutil.rmtree(d)
        d.mkdir(parents=True)
        print(f"== calibration of {', '.join(specs)}: {args.calibration_steps} steps each, in "
              f"turn, {CALIBRATION_ROUNDS} times", flush=True)  # fmt: skip
        run_both([(f"calibration {n}", cmds[n], d / f"{n}.log") for n in orders], halves)
    costs = step_costs([records(d / n / "metrics.jsonl") for n in orders])
    if not made:
        (d / "costs.json").write_text(json.dumps({f"{k[0]}x{k[1]}": v for k, v in costs.items()}))
        done.write_text(json.dumps(commands, indent=2))
    return costs


# Flags of a pair's commands that change no step of its training: its runs never stop at a
# target (stop_at_target is the bench's own, off), so --target only picks which evaluated
# checkpoint the analysis reads, and a pair trained for another --target is reused.
ANALYSIS_ONLY = ("--config.target_top1=",)
# Flags of a calibration's commands that change no step's cost: another --target or
# checkpoint interval reuses it (its runs save no checkpoint and stop at their last step).
NO_COST = ("--config.checkpoint.every_steps=", *ANALYSIS_ONLY)
# The bench's flag behind a trainer flag it derives, for the refusal of a recorded pair.
BENCH_FLAG = {
    "--config.target_top1": "--target",
    "--config.checkpoint.every_steps": "--checkpoint-every-epochs",
    "--config.num_epochs": "--epochs",
    "--config": "--variant",
}


def without(commands: dict, flags: tuple[str, ...]) -> dict:
    """``commands`` less the arguments that start with one of ``flags``."""
    return {n: [a for a in cmd if not a.startswith(flags)] for n, cmd in commands.items()}


def costs_of(commands: dict) -> dict:
    """The calibration's ``commands`` less the flags that change no step's cost."""
    return without(commands, NO_COST)


def settings(cmd: list[str]) -> dict[str, str]:
    """A command's flags as flag -> value (``--flag=value`` or ``--flag value``; a flag given
    twice, e.g. ``--config.stages`` by --curriculum-set, as the trainer takes it: the last)."""
    out = {}
    for i, a in enumerate(cmd):
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            if not eq:
                value = cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else ""
            out[flag] = value
    return out


def differences(recorded: dict, planned: dict) -> list[str]:
    """What differs between a pair's recorded commands and the ones this call would run, as
    ``flag old -> new`` (with the bench's flag behind it, and the run where only one
    differs)."""
    found: dict[tuple, list[str]] = {}
    for n, cmd in planned.items():
        old, new = settings(recorded.get(n, [])), settings(cmd)
        for flag in dict.fromkeys([*old, *new]):
            if old.get(flag) != new.get(flag):
                key = (flag, old.get(flag, "(unset)"), new.get(flag, "(unset)"))
                found.setdefault(key, []).append(n)
    return [
        f"{flag} {a} -> {b}"
        + (f" ({BENCH_FLAG[flag]})" if flag in BENCH_FLAG else "")
        + (f" in the {names[0]} run" if len(names) < len(planned) else "")
        for (flag, a, b), names in found.items()
    ] or ["the same settings in another order"]


def local(commands: dict, out: Path) -> dict:
    """``portable``'s ``commands`` with ``{out}`` and ``{root}`` this call's paths again."""
    return {n: [a.replace("{out}", str(out)).replace("{root}", str(ROOT)) for a in cmd]
            for n, cmd in commands.items()}  # fmt: skip


def copy_records(src: Path, dst: Path) -> None:
    """A run's records (``RECORDS``), no checkpoint: enough for ``summarize``."""
    for f in RECORDS:
        if (src / f).exists():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, dst / f)


def prepare(args) -> dict:
    """The prepared copy of the data every run reads, made (or checked) first, as the
    trainer makes it on first use; returns its ``train_examples`` and the mesh's
    ``data_parallel`` size (the checkpoint interval's steps come from them)."""
    code = (
        "import json, sys; from hybridpar.config import cli; from hybridpar.input.datasets import "
        "make_data; from hybridpar.parallel.mesh import make_mesh, data_parallel_size\n"
        "def made():\n"
        "    c = cli.load(sys.argv[1], [tuple(kv.split('=', 1)) for kv in sys.argv[2:]])\n"
        "    d = make_data(c, 0, 1)\n"
        "    print(json.dumps({'train_examples': d.steps_for(1), "
        "'data_parallel': data_parallel_size(make_mesh(c.mesh))}))\n"
        "cli.main(made)"  # a data error: its one line
    )
    config = str(ROOT / "experiments" / f"cifar10_fast.py:{args.variant}")
    r = subprocess.run([sys.executable, "-c", code, config, *args.set], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    if r.returncode != 0:  # the data's own error line (cli.main), else the end of its output
        said = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
        why = said[-1][len("error: "):] if said else r.stderr.strip()[-2000:]
        fail(f"preparing the data failed (exit {r.returncode}): {why}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def data_facts(out: Path, args, needed: bool) -> dict:
    """``prepare``'s facts (the training set's size, the mesh's data-parallel size), from
    --out/data.json where an earlier call recorded them with these settings and nothing
    left to run reads the data (``needed`` False: every pair and the calibration finished,
    so their records are all this call reads); else prepared (a JAX start) and recorded.
    A copied --out of finished pairs is reported again without the data."""
    path = out / DATA
    settings = {"variant": args.variant, "set": list(args.set)}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or cut short: prepared again below
        recorded = {}
    if not needed and recorded.get("settings") == settings and "facts" in recorded:
        print(f"== data: not read (nothing left to train or evaluate); its sizes from {path}",
              flush=True)  # fmt: skip
        return recorded["facts"]
    print("== data: preparing (or checking) the data every run reads", flush=True)
    facts = prepare(args)
    run_records.write_json(str(path), {"settings": settings, "facts": facts})
    return facts


def records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (the trainer's or the evaluator's) as dicts; none
    if absent. A line cut short by a kill is skipped (``run_records``' one reader)."""
    if not path.exists():
        return []
    return [run_records.to_dict(r) for r in run_records.read_records(str(path))[0]]


def stalls(recs: list[dict]) -> list[dict]:
    """For each stage switch: the gap between the last step before it and the first after
    it, and the median step interval of the stage after it (none where the run did not log
    both steps)."""
    out = []
    stage_at = [i for i, r in enumerate(recs) if r["event"] == "stage"][1:]
    for i in stage_at:
        before_idx = [j for j in range(i) if recs[j]["event"] == "train"]
        after_idx = [j for j in range(i, len(recs)) if recs[j]["event"] == "train"]
        if not before_idx or not after_idx:
            continue
        last, first = recs[before_idx[-1]], recs[after_idx[0]]
        if first["step"] != last["step"] + 1:  # a run that logged every few steps
            continue
        # what else was logged between the two steps (an epoch's evaluation is written
        # before the stage record)
        between = {r["event"] for r in recs[before_idx[-1] + 1 : after_idx[0]]} - {"stage"}
        # a save is recorded once committed, after later steps: found by its step
        if any(r["event"] == "checkpoint" and r["step"] == last["step"] for r in recs):
            between.add("checkpoint")
        steps = [recs[j] for j in after_idx]
        gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(steps, steps[1:])
                if b["step"] == a["step"] + 1]  # fmt: skip
        out.append(
            {
                "at_step": first["step"] - 1,
                "gap_s": round(first["wall_s"] - last["wall_s"], 3),
                # from the stage record (after any evaluation) to the first step of the stage
                "after_switch_s": round(first["wall_s"] - recs[i]["wall_s"], 3),
                "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
                "between": sorted(between),  # an eval or checkpoint: not a stall
            }
        )
    return out


def train_lines(recs: list[dict]) -> list[tuple[int, int, float, tuple[int, int]]]:
    """Each train line as (step, steps since the last line, their seconds as the trainer
    counts them: steps x batch / images per second, shape: (image size, global batch)).
    After a resume the steps from its checkpoint on ran again: their second run replaces
    the first (as ``run_records.read_run`` keeps them)."""
    out, last = [], 0
    for r in recs:
        if r["event"] == "resume":
            last = run_records.resumed_from(r)
            out = [line for line in out if line[0] <= last]
        elif r["event"] == "train":
            steps = r["step"] - last
            dt = steps * r["global_batch"] / r["images_per_s"]
            out.append((r["step"], steps, dt, (r["image_size"], r["global_batch"])))
            last = r["step"]
    return out


def training_clock(recs: list[dict], costs: dict | None = None) -> dict[int, tuple]:
    """Step -> (seconds from the run's start, the same less compilation, the steady clock's
    seconds, the priced clock's seconds or None) at the end of each step a train line ends
    at: the time before the first step (set-up, compilation) plus the time in steps as the
    trainer counts it, each train line's steps x batch / images per second, which leaves out
    evaluation and checkpoint saves (the trainer's clock restarts after each). Compilation:
    the compiles before the first step, as the trainer counts them (a background one, its
    wait). The steady clock counts each
    step at the median step time of its shape (image size, batch) over the run instead: what
    a machine with nothing else on it would have taken (the module's docstring says why).
    The priced clock counts each step at ``costs[shape]`` (``step_costs``: the calibration's
    median, measured with the shapes alternating) and nothing else: no set-up, no
    compilation, no load at all."""
    lines = train_lines(recs)
    at = next(i for i, r in enumerate(recs) if r["event"] == "train")
    first = recs[at]
    # The time before the first step holds these (a start killed before it too: the
    # trainer counts it as lost); a resumed start's set-up and compiles are not on the
    # clock, nor a stage switch's wait (the train lines' times leave them out).
    compile_s = sum(r["wait_s"] if r.get("background") else r["compile_s"]
                    for r in recs[:at] if r["event"] == "compile")  # fmt: skip
    start_s = first["wall_s"] - lines[0][2]  # the run's start to its first step
    per_step: dict[tuple, list[float]] = {}
    for _, steps, dt, shape in lines:
        per_step.setdefault(shape, []).append(dt / steps)
    median = {shape: statistics.median(v) for shape, v in per_step.items()}
    if costs is not None and set(median) - set(costs):
        raise KeyError(f"no calibrated cost for the shapes {sorted(set(median) - set(costs))}")
    out, in_steps, steady, priced = {}, 0.0, 0.0, 0.0
    for step, steps, dt, shape in lines:
        in_steps, steady = in_steps + dt, steady + steps * median[shape]
        priced += steps * costs[shape] if costs is not None else 0.0
        out[step] = (
            round(start_s + in_steps, 3),
            round(start_s + in_steps - compile_s, 3),
            round(start_s + steady, 3),
            round(priced, 6) if costs is not None else None,
        )
    return out


def step_costs(runs: list[list[dict]]) -> dict[tuple[int, int], float]:
    """(image size, batch) -> the median step time over ``runs`` (the calibration's
    records, each shape's steps in several short stretches alternating with the others'):
    load that comes and goes over minutes slows every shape alike, so the ratios hold."""
    per_step: dict[tuple, list[float]] = {}
    for recs in runs:
        for _, steps, dt, shape in train_lines(recs):
            per_step.setdefault(shape, []).append(dt / steps)
    return {shape: statistics.median(v) for shape, v in per_step.items()}


def alternating_stages(specs: list[str], steps: int, rounds: int, examples: int, dp: int) -> str:
    """A ``stages`` value that trains each of ``specs`` (``SIZE-BATCH[@SCALE][~M]``, the
    batch per device, ``dp`` devices) for ``steps`` steps, in turn, ``rounds`` times: the
    calibration's."""
    parts, end = [], 0.0
    for _ in range(rounds):
        for spec in specs:
            batch = parse_stages(f"1:{spec}")[0][2] * dp
            end += steps / (examples // batch)  # the trainer's steps per epoch at that batch
            parts.append(f"{end:.12g}:{spec}")
    return ",".join(parts)


def evaluations(run_recs: list[dict], evaluator_recs: list[dict]) -> list[dict]:
    """One eval record per step, by step: the trainer's and the evaluator's (which wins
    where both evaluated a step)."""
    by_step = {r["step"]: r for r in [*run_recs, *evaluator_recs] if r["event"] == "eval"}
    return [by_step[s] for s in sorted(by_step)]


def time_to_target(evals: list[dict], clock: dict, target: float) -> dict | None:
    """The first evaluation at or over ``target`` top-1, by step: its training time
    (``training_clock``), with and without compilation, on the steady clock and on the
    priced clock, its epoch and top-1; None if none."""
    for r in evals:
        if r["top1"] >= target:
            s, without_compile_s, steady_s, priced_s = clock[r["step"]]
            return {"s": s, "without_compile_s": without_compile_s, "steady_s": steady_s,
                    "priced_s": priced_s, "step": r["step"], "epoch": r["epoch"],
                    "top1": r["top1"]}  # fmt: skip
    return None


def summarize(name: str, workdir: Path, targets: list[float], costs: dict | None) -> dict:
    recs = records(workdir / "metrics.jsonl")
    evals = evaluations(recs, records(workdir / "evaluator" / "metrics.jsonl"))
    clock = training_clock(recs, costs)
    final = evals[-1] if evals else {}  # the last step's
    summary = json.loads((workdir / "summary.json").read_text())
    saves = [r for r in recs if r["event"] == "checkpoint"]
    return {
        "name": name,
        "workdir": str(workdir),
        "tta": {f"{t:g}": time_to_target(evals, clock, t) for t in targets},
        "final_top1": final.get("top1", math.nan),
        "final_epoch": final.get("epoch", math.nan),
        "evaluations": len(evals),
        "checkpoint_blocking_s": round(sum(r.get("blocking_s", 0.0) for r in saves), 3),
        "wall_s": summary["wall_s"],
        "compile_s": summary["compile_s"],
        "stalls": stalls(recs),
    }


def note_time_to_target(workdir: Path, row: dict, every_steps: int) -> None:
    """Writes the bench's time to each target (``summarize``'s ``row``) into the run's
    summary.json, beside the trainer's ``time_to_target``, which counts the trainer's own
    evaluations only: the bench's runs evaluate at their last step alone
    (``eval_every_epochs=0``), so that figure is the run's end however early the target
    came. A reader of the run's records then sees both, and which is which. Kept until
    the trainer writes the summary again (a later start of the run)."""
    path = workdir / "summary.json"
    summary = run_records.read_json(str(path))
    own = [r["step"] for r in records(workdir / "metrics.jsonl") if r["event"] == "eval"]
    keys = ("s", "without_compile_s", "steady_s", "step", "epoch", "top1")
    summary["bench_time_to_target"] = {
        "note": (
            f"the trainer's time_to_target counts its own evaluations only (at steps "
            f"{', '.join(map(str, own)) or 'none'}); these are bench/curriculum_tta.py's: "
            f"the first of every checkpoint (each {every_steps} steps, evaluated by python "
            "-m hybridpar.evaluate) at or over each top-1 target, in training seconds from "
            "the run's start (set-up and compilation in, checkpoint saves and evaluation "
            "out; steady_s: each step at its shape's median)"
        ),
        "trainer_eval_steps": own,
        "evaluations": row["evaluations"],
        "every_steps": every_steps,
        "top1": {t: reached and {k: reached[k] for k in keys} for t, reached in row["tta"].items()},
    }
    run_records.write_json(str(path), summary)


def speedup(fixed: dict | None, curriculum: dict | None, clock: str = "s") -> float:
    """Fixed's time to a target over the curriculum's (``time_to_target`` results, on
    ``clock``: ``s`` or ``steady_s``): inf where only the curriculum reached it, 0 where only
    the fixed run did, nan if neither."""
    if fixed is None and curriculum is None:
        return math.nan
    if curriculum is None:
        return 0.0
    if fixed is None:
        return math.inf
    return fixed[clock] / curriculum[clock]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``, leaving out nan (nan if nothing is left)."""
    kept = sorted(v for v in values if not math.isnan(v))
    if not kept:
        return math.nan, math.nan, math.nan
    return statistics.median(kept), kept[0], kept[-1]


def seed_speedups(pairs: list[dict], targets: list[float], clock: str = "s") -> dict:
    """Per target key, each seed's speedup on ``clock`` (``pairs``: per seed,
    ``summarize``'s row of each run by name)."""
    keys = [f"{t:g}" for t in targets]
    return {k: [speedup(p["fixed"]["tta"][k], p["curriculum"]["tta"][k], clock) for p in pairs]
            for k in keys}  # fmt: skip


def seconds(reached: dict | None) -> str:
    if reached is None:
        return "not reached"
    priced = reached.get("priced_s")
    return (f"{reached['s']:.1f} s (epoch {reached['epoch']:.2f}, top-1 {reached['top1']:.4f}; "
            f"without compile {reached['without_compile_s']:.1f} s; steady "
            f"{reached['steady_s']:.1f} s"
            + (f"; priced {priced:.1f} s)" if priced is not None else ")"))  # fmt: skip


def unreached(pairs: list[dict], targets: list[float], epochs: float,
              recipe_epochs: float) -> list[str]:  # fmt: skip
    """A ``warning:`` line per target some run did not reach (``targets[0]``: --target, then
    the recipe's): which runs, in which seeds, their best final top-1, and what to change."""
    lines = []
    for i, t in enumerate(targets):
        missed = {n: [p["seed"] for p in pairs if p[n]["tta"][f"{t:g}"] is None] for n in NAMES}
        missed = {n: seeds for n, seeds in missed.items() if seeds}
        if not missed:
            continue
        runs = " and ".join(f"{n} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})"
                            for n, s in missed.items())  # fmt: skip
        finals = [p[n]["final_top1"] for p in pairs for n in missed if p["seed"] in missed[n]]
        finals = [v for v in finals if not math.isnan(v)]
        best = f", final top-1 at most {max(finals):.4f}" if finals else ""
        what = "--target" if i == 0 else "the recipe's target"
        longer = f"train longer (--epochs, now {epochs:g}; the recipe's {recipe_epochs:g})"
        lower = f"{longer} or pass a lower --target (the same --out reuses the pairs)"
        lines.append(
            f"warning: top-1 {t:g} ({what}) never reached by {runs}{best}: the speedups to it "
            f"there are nan (neither run), 0 or inf; " + (lower if i == 0 else longer)
        )
    return lines


def key_of(target: float) -> str:
    return f"{round(target * 100):d}"


def main(argv=None) -> None:
    from hybridpar.config.cli import (  # JAX-free, as this stays
        cpu_when_no_accelerator,
        finite_float,
    )

    cpu_when_no_accelerator()  # for the processes it starts: no libtpu warnings on a CPU
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, pass_on)

    p = argparse.ArgumentParser(
        description="Time to accuracy on CIFAR-10: the curriculum against the same model at one "
        "fixed shape, over several seeds, with the time to target resolved to a fraction of an "
        "epoch (see the module docstring)."
    )
    p.add_argument("--variant", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--seeds", type=int, default=3, help="pairs of runs, one seed each")
    p.add_argument("--first-seed", type=int, default=0, help="the first pair's seed")
    p.add_argument("--target", type=finite_float, default=0.8, help="top-1 to time (a fraction)")
    p.add_argument(
        "--epochs", type=finite_float, default=0.0, help="both runs' epochs (0: recipe's)"
    )
    p.add_argument("--checkpoint-every-epochs", type=finite_float, default=0.25,
                   help="how often both runs save a checkpoint to evaluate: the resolution "
                        "of the time to target")  # fmt: skip
    p.add_argument("--evaluate-from-epoch", type=finite_float, default=0.0, metavar="E",
                   help="evaluate only the checkpoints from epoch E on (and the earlier ones "
                        "of a run already at a target at epoch E); default 0: all")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "curriculum_tta"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both runs, repeatable")  # fmt: skip
    p.add_argument("--fixed-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the fixed run only, after --set")  # fmt: skip
    p.add_argument("--curriculum-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the curriculum run only, after the recipe's stages: "
                        "e.g. stages=... to try another curriculum against the same fixed "
                        "run")  # fmt: skip
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=12,
        help="steps of each shape per turn in the priced clock's calibration",
    )
    p.add_argument("--fixed-from", default="", metavar="OUT",
                   help="another --out whose finished pairs' fixed runs (the same command) "
                        "stand in for this one's: only the curriculum trains (compare on the "
                        "priced clock: the wall clocks were not side by side)")  # fmt: skip
    p.add_argument("--one-after-other", action="store_true",
                   help="train the two runs one after the other on all cores instead of "
                        "side by side on half the cores each (default: 2+ cores)")  # fmt: skip
    args = p.parse_args(argv)
    if not 0 < args.target <= 1:
        fail(f"--target={args.target} is a fraction in (0, 1], e.g. --target 0.8")
    if args.epochs < 0:
        fail(f"--epochs={args.epochs:g} must be >= 0 (0: the recipe's)")
    if args.seeds < 1 or args.first_seed < 0:
        fail(f"--seeds={args.seeds} --first-seed={args.first_seed}: at least one seed, from 0 up")
    if args.calibration_steps < 1:
        fail(f"--calibration-steps={args.calibration_steps} must be >= 1, e.g. 12")
    fixed_from = Path(args.fixed_from).resolve() if args.fixed_from else None
    if fixed_from is not None and not fixed_from.is_dir():
        fail(f"--fixed-from {args.fixed_from}: no such folder; pass an earlier --out")
    if args.evaluate_from_epoch < 0:
        fail(f"--evaluate-from-epoch={args.evaluate_from_epoch:g} must be >= 0 (0: every "
             "checkpoint)")  # fmt: skip
    if not 0 < args.checkpoint_every_epochs <= 1:
        fail(f"--checkpoint-every-epochs={args.checkpoint_every_epochs} is in (0, 1], e.g. 0.25")
    for kv in [*args.set, *args.fixed_set, *args.curriculum_set]:
        if kv.partition("=")[0] in OWN_KEYS:
            fail(
                f"{kv}: the bench sets {' and '.join(OWN_KEYS)} itself (one seed per pair, "
                "from --first-seed; the recipe's epochs, no stop at the target); drop it"
            )
    out = Path(args.out).resolve()  # as the recorded commands have it
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for seed in seeds:
        d = out / f"seed{seed}"
        if d.exists() and not (d / PAIR).exists() and not (d / STARTED).exists():
            fail(f"{d} holds no pair of this bench (no {PAIR} or {STARTED}); move it away, "
                 "or pass another --out")  # fmt: skip

    sys.path.insert(0, str(ROOT / "experiments"))
    import cifar10_fast  # the recipe's stages: the fixed run takes the last one's shape

    _, recipe_epochs, recipe_stages, recipe_target = cifar10_fast.VARIANTS[args.variant]
    epochs = args.epochs or recipe_epochs
    if args.evaluate_from_epoch > epochs:  # before hours of training, not after
        fail(f"--evaluate-from-epoch={args.evaluate_from_epoch:g} is after the runs' last "
             f"epoch ({epochs:g}); pass one from 0 to {epochs:g}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)  # once the arguments are known to be good
    targets = [args.target] + ([recipe_target] if recipe_target != args.target else [])
    # the recipe's stages with their end epochs scaled to --epochs; fixed: the last shape
    stages = []
    for part in recipe_stages.split(","):
        end, shape = part.split(":")
        stages.append(f"{float(end) * epochs / recipe_epochs:g}:{shape}")
    parsed = parse_stages(recipe_stages)
    _, size, batch, _ = parsed[-1]  # the last stage's shape, no @ or ~
    common = [f"--config.num_epochs={epochs:g}", f"--config.data.image_size={size}"]
    overrides = {
        "curriculum": [*common, f"--config.stages={','.join(stages)}",
                       *(f"--config.{kv}" for kv in args.curriculum_set)],
        "fixed": [*common, f"--config.stages={epochs:g}:{size}-{batch}",
                  *(f"--config.{kv}" for kv in args.fixed_set)],
    }  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    side_by_side = not args.one_after_other and len(cores) >= 2
    half = len(cores) // 2  # equal halves: an odd core out stays idle
    # The priced clock's step costs: every shape either run trains.
    specs = list(
        dict.fromkeys(stage_specs(overrides["curriculum"]) + stage_specs(overrides["fixed"]))
    )
    # Once, before any clock starts: no run pays for it; not at all where every pair and
    # the calibration finished (their records are all that is read).
    needed = not (out / calibration_dir(specs) / STARTED).exists() or any(
        not (out / f"seed{seed}" / PAIR).exists() for seed in seeds
    )
    data = data_facts(out, args, needed)
    # One interval in steps for both runs, at most --checkpoint-every-epochs at either's
    # largest batch (the fixed run's is the last stage's).
    largest = max(b for _, _, b, _ in parsed) * data["data_parallel"]
    args.every_steps = max(1, int(args.checkpoint_every_epochs * data["train_examples"] / largest))
    every_epochs = args.every_steps * largest / data["train_examples"]
    # Each pair's commands, checked against what an earlier call recorded, before anything runs.
    planned = []
    for seed in seeds:
        d = out / f"seed{seed}"
        cmds = {n: train_cmd(d / n, args, [*overrides[n], f"--config.seed={seed}"]) for n in NAMES}
        commands = {n: cmd[1:] for n, cmd in cmds.items()}  # no interpreter path
        recorded = next((d / f for f in (PAIR, STARTED) if (d / f).exists()), None)
        if recorded:  # an older bench recorded the absolute paths: portable() has them too
            theirs, ours = portable(json.loads(recorded.read_text()), out), portable(commands, out)
            trained = without(theirs, ANALYSIS_ONLY), without(ours, ANALYSIS_ONLY)
            if trained[0] != trained[1]:
                fail(f"{d} holds a pair trained with other settings (its {recorded.name} has "
                     f"the commands): {'; '.join(differences(*trained))}; pass the same "
                     "arguments to reuse it (any --target), or another --out")  # fmt: skip
            if theirs != ours:  # its runs as started (a resume refuses another config)
                print(f"== seed {seed}: {'; '.join(differences(theirs, ours))}: its runs are "
                      "reused (they never stop at a target: it changes which checkpoint is "
                      "read, not their training)", flush=True)  # fmt: skip
                commands = local(theirs, out)
                cmds = {n: [sys.executable, *cmd] for n, cmd in commands.items()}
        src = None
        if fixed_from is not None and not (d / PAIR).exists():
            src = fixed_from / f"seed{seed}"  # its fixed run's records stand in for ours
            theirs = json.loads((src / PAIR).read_text()) if (src / PAIR).exists() else {}
            ours = portable(commands, out)
            if "fixed" not in theirs or (without(theirs, ANALYSIS_ONLY)["fixed"]
                                         != without(ours, ANALYSIS_ONLY)["fixed"]):  # fmt: skip
                fail(f"--fixed-from: {src} holds no finished pair whose fixed run is this "
                     "one's (its pair.json has the commands); pass the --out of a bench run "
                     "with the same --set, --fixed-set and --checkpoint-every-epochs")  # fmt: skip
            commands["fixed"] = local(theirs, out)["fixed"]  # the command of those records
            cmds["fixed"] = [sys.executable, *commands["fixed"]]
        planned.append((seed, d, cmds, commands, recorded, src))
    halves_0 = [set(cores[:half]), set(cores[half : 2 * half])] if side_by_side else None
    costs = calibrate(out, args, specs, data, halves_0)
    pairs = []
    for seed, d, cmds, commands, recorded, src in planned:
        # Both at once, each on half the cores: whatever else loads the machine slows both
        # alike. The halves swap from seed to seed, so neither run keeps a core.
        halves = [set(cores[:half]), set(cores[half : 2 * half])][:: -1 if seed % 2 else 1]
        halves = halves if side_by_side else None
        names = NAMES
        if src is not None or (d / REUSED).exists():  # only the curriculum trains
            names = ("curriculum",)
            halves = halves[:1] if halves else None
        if (d / PAIR).exists():  # a finished pair of an earlier call with this --out
            print(f"== seed {seed}: the finished pair in {d}", flush=True)
            # evaluated from an epoch on for higher targets: a lower one may need more
            if evaluate_earlier(d, names, halves, targets):
                for n in names:
                    note_time_to_target(d / n, summarize(n, d / n, targets, None),
                                        args.every_steps)  # fmt: skip
        else:
            to_train = list(names)
            if recorded is None:
                d.mkdir()
                (d / STARTED).write_text(json.dumps(portable(commands, out), indent=2))
                if src is not None:
                    copy_records(src / "fixed", d / "fixed")
                    (d / REUSED).write_text(json.dumps({"fixed": in_checkout(src / "fixed")}))
            else:
                to_train = [n for n in names if not completed(d / n)]
                print(f"== seed {seed}: "
                      + (f"resuming {' and '.join(to_train)} in {d}, stopped while training"
                         if to_train else f"trained in {d}; evaluating its checkpoints"),
                      flush=True)  # fmt: skip
            if to_train:  # each on its own half, as when the pair started
                own = [halves[names.index(n)] for n in to_train] if halves else None
                run_both([(f"seed {seed} {n}", cmds[n], d / f"{n}.log") for n in to_train], own)
            # After both trained: evaluation never shares a core with training.
            evaluate_runs(d, names, halves, args.evaluate_from_epoch, targets)
            for n in names:  # the bench's time where a reader of the run looks
                note_time_to_target(d / n, summarize(n, d / n, targets, None), args.every_steps)
            subprocess.run([sys.executable, "-m", "hybridpar.report", *(str(d / n) for n in NAMES),
                            "--out", str(d / "report.png"), f"--target-top1={args.target}"],
                           cwd=ROOT, check=False)  # fmt: skip
            (d / PAIR).write_text(json.dumps(portable(commands, out), indent=2))
        reused = json.loads((d / REUSED).read_text()) if (d / REUSED).exists() else {}
        pairs.append({"seed": seed, "reused": reused,
                      **{n: summarize(n, d / n, targets, costs) for n in NAMES}})  # fmt: skip
        (out / "curriculum_tta.json").write_text(json.dumps(pairs, indent=2))

    per_seed = seed_speedups(pairs, targets)
    steady = seed_speedups(pairs, targets, "steady_s")
    priced = seed_speedups(pairs, targets, "priced_s")
    shown = ", ".join(f"{k[0]} px at batch {k[1]}: {v:.3f} s" for k, v in sorted(costs.items()))
    print(
        f"\npriced clock: each step at its shape's median step time in the calibration "
        f"({shown}; --calibration-steps {args.calibration_steps} each, in turn, "
        f"{CALIBRATION_ROUNDS} times, two runs side by side), set-up and compilation left "
        "out: the same for every pair, whatever else loaded the machine while it trained"
    )
    print(f"\ntime to target: the training wall time at the first checkpoint at or over it, "
          f"from the run's start (compilation included), checkpoint saves and evaluation "
          f"excluded (the checkpoints, every {args.every_steps} steps = {every_epochs:.3f} "
          f"epoch, evaluated after each pair by python -m hybridpar.evaluate):")  # fmt: skip
    for i, pair in enumerate(pairs):
        print(f"seed {pair['seed']}:")
        for n in NAMES:
            r = pair[n]
            reached = "; ".join(f"{k}: {seconds(v)}" for k, v in r["tta"].items())
            print(f"  {n:<10} {reached}; final top-1 {r['final_top1']:.4f} (epoch "
                  f"{r['final_epoch']:g}); {r['evaluations']} evaluations; saves blocked "
                  f"{r['checkpoint_blocking_s']:.1f} s (excluded); wall {r['wall_s']:.1f} s, "
                  f"compile {r['compile_s']:.1f} s")  # fmt: skip
        if pair["reused"]:
            print(f"  fixed: the records of {pair['reused']['fixed']} (--fixed-from; not side "
                  "by side: read the priced clock)")  # fmt: skip
        print("  speedup on the priced clock "
              + ", ".join(f"to {k}: {v[i]:.3f}" for k, v in priced.items())
              + "; on the steady clock "
              + ", ".join(f"to {k}: {v[i]:.3f}" for k, v in steady.items())
              + "; on the wall clock "
              + ", ".join(f"to {k}: {v[i]:.3f}" for k, v in per_seed.items()))  # fmt: skip
        for s in pair["curriculum"]["stalls"]:
            note = f" ({', '.join(s['between'])} in between)" if s["between"] else ""
            print(f"  stage switch after step {s['at_step']}: {s['gap_s']:.3f} s between "
                  f"steps, {s['after_switch_s']:.3f} s from the switch to the next step, "
                  f"median step {s['median_step_s']} s{note}")  # fmt: skip
    fields = []
    # the priced clock's first: the figure to read (the module's docstring says why), then the
    # steady clock's and the wall clock's
    for speedups, suffix, where in ((priced, "_priced", "on the priced clock"),
                                    (steady, "_steady", "on the steady clock"),
                                    (per_seed, "_wall", "on the wall clock")):  # fmt: skip
        for t in targets:
            med, lo, hi = spread(speedups[f"{t:g}"])
            k = f"tta_speedup_{key_of(t)}{suffix}"
            fields.append(f"{k}={med:.3f} {k}_min={lo:.3f} {k}_max={hi:.3f}")
            print(f"speedup to {t:g} {where} over {len(seeds)} seeds: median {med:.3f}, "
                  f"min {lo:.3f}, max {hi:.3f}")  # fmt: skip
            if t == targets[0] and suffix == "_priced":
                fields.append(f"seeds={len(seeds)}")

    def median_of(name, get):
        return spread([get(p[name]) for p in pairs])[0]

    def tta_s(row):
        return (row["tta"][f"{targets[0]:g}"] or {}).get("s", math.inf)

    def first_stall(key):
        def get(row):
            value = row["stalls"][0][key] if row["stalls"] else None
            return math.nan if value is None else value

        return get

    print(
        *fields,
        # each run's median over the seeds on its own: not a pair, so no ratio of them is a
        # speedup (the tta_speedup_ keys are)
        f"curriculum_tta_s_median={median_of('curriculum', tta_s):.1f}",
        f"fixed_tta_s_median={median_of('fixed', tta_s):.1f}",
        f"curriculum_final_top1_median={median_of('curriculum', lambda r: r['final_top1']):.4f}",
        f"fixed_final_top1_median={median_of('fixed', lambda r: r['final_top1']):.4f}",
        f"switch_gap_s={median_of('curriculum', first_stall('gap_s')):.3f}",
        f"median_step_s={median_of('curriculum', first_stall('median_step_s')):.3f}",
        f"checkpoint_every_epochs={every_epochs:.3f} variant={args.variant} epochs={epochs:g}",
        *([f"side_by_side=1 cores_each={half}"] if side_by_side else []),
        *([f"fixed_reused={sum(bool(p['reused']) for p in pairs)}"] if fixed_from else []),
        *(f"step_s_{k[0]}x{k[1]}={v:.6g}" for k, v in sorted(costs.items())),
    )
    for line in unreached(pairs, targets, epochs, recipe_epochs):
        print(line, file=sys.stderr, flush=True)
    if all(math.isnan(v) for v in per_seed[f"{targets[0]:g}"]):  # no pair has a speedup
        print(
            f"target not reached: no run of the {len(seeds)} pair(s) reached top-1 "
            f"{targets[0]:g} (--target); every speedup to it is nan",
            file=sys.stderr,
        )
        sys.exit(NOT_REACHED)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
