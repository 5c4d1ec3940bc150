"""``python -m hybridpar.tune lr|search --config experiments/NAME.py --workdir DIR [...]``.

``lr``: the LR range test (Smith 2017; fast.ai's ``lr_find``). One short run of the trainer
whose ``optim.base_lr`` rises geometrically from ``tune.lr_min`` to ``tune.lr_max`` over
``tune.lr_epochs`` (``optim.schedule=exponential``, a train line after every step), stopped
once the loss diverges. It writes ``DIR/lr_range.png`` (loss against LR) and
``DIR/lr_range.json`` and prints the suggested peak LR as an override. A test stopped by a
signal says so and writes neither (its curve is cut short); the same command resumes it.
``DIR/tune_lr.json``, written before the set-up, tells the trainer the folder is a test's.

``search --trials N --budget-epochs E``: a study over short runs of the trainer (each
``E`` epochs, its LR decaying to their end; a warmup stays as drawn) that draws the keys of
``tune.space`` with optuna's TPE sampler and stops a trial early (median pruning) when its
top-1 at an evaluation is below the median of the finished trials' at the same one. The
objective is ``tune.objective``: top-1 at the budget, or the wall time to ``target_top1``.
Resumable: the study lives in ``DIR/study.db`` and each trial's run in ``DIR/trials/NNN``,
so the same command continues it (a trial cut off by Ctrl-C or a kill is queued again as a
new trial, which resumes in its folder from its checkpoint: ``trials.md`` and the best line
name each trial's folder); a larger ``--trials`` adds trials. A trial whose run diverged
(``NonFinite``) has no objective: optuna's FAIL, with the trainer's advice as its note. It
prints a line as each trial starts and one as it ends, writes ``DIR/trials.md`` and
``DIR/search.png``, then prints the table, the best overrides and their train command.

The trials' and the range test's own trainer output goes to their ``log.txt`` (named in the
line each prints as it starts); the terminal gets a short progress line every
``PROGRESS_EVERY_S``. A ``--config.KEY=VALUE`` of a key the mode sets itself (the range
test's ``RANGE_TEST_KEYS``, every trial's ``trial_keys``) is a ``warning:`` line, and the
workdir must be new or hold this mode's test or study (``check_kind``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shlex
import sys
import time

from hybridpar.config import cli
from hybridpar.config.curriculum import stretch_stages
from hybridpar.config.errors import ConfigError, Error, StopRequested
from hybridpar.config.formatting import pyplot
from hybridpar.config.schema import config_value

SPACE_EXAMPLE = "optim.base_lr=log:0.01..1,optim.warmup_epochs=0..2,global_batch=32|64"
# the tune keys each mode reads (every key of the schema's tune section is in one)
MODE_KEYS = {
    "lr": ("lr_min", "lr_max", "lr_epochs"),
    "search": ("space", "objective", "eval_every_epochs", "startup_trials",
               "prune_after_trials", "prune_warmup_evals"),  # fmt: skip
}


# ---- The search space: tune.space, checked before anything runs ----------------------------------


def _number(text: str, item: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"tune.space: {text!r} in {item!r} is not a number; write ranges as LO..HI, "
            f"e.g. --config.tune.space={SPACE_EXAMPLE!r}"
        ) from None


def parse_space(config) -> list[dict]:
    """``tune.space`` -> ``[{key, kind ("float", "int", "choice"), low, high, log,
    choices}]``. Each key must be a config key with a number (ranges) or any value
    (choices), and both ends of a range and every choice must pass ``validate``."""
    from hybridpar.config.schema import validate

    keys = set(cli.config_keys(config))
    set_by_tune = trial_keys(config)
    params = []
    for item in [s.strip() for s in config.tune.space.split(",") if s.strip()]:
        key, eq, spec = (s.strip() for s in item.partition("="))
        if not eq or not spec:
            raise ConfigError(
                f"tune.space: {item!r} is not KEY=RANGE; use KEY=LO..HI, KEY=log:LO..HI or "
                f"KEY=A|B|C, e.g. --config.tune.space={SPACE_EXAMPLE!r}"
            )
        if key in set_by_tune:  # the study would report values no trial trained with
            raise ConfigError(
                f"tune.space: {key} is set in every trial by {set_by_tune[key]}, so its "
                f"drawn values would not be used; drop {item!r}"
            )
        if any(p["key"] == key for p in params):  # optuna would keep the first range
            raise ConfigError(f"tune.space: {key} is given twice; give each key once")
        if (
            key not in keys
            or key.startswith("tune.")
            or hasattr(config_value(config, key), "items")
        ):
            leaves = [k for k in keys if not hasattr(config_value(config, k), "items")]
            close = cli.suggest(key, [k for k in leaves if not k.startswith("tune.")])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"tune.space: {key!r} is not a config key to search{hint}; name one of "
                "hybridpar/config/schema.py's keys, e.g. optim.base_lr"
            )
        current = config_value(config, key)
        if "|" in spec:
            choices = [_cast(key, c.strip(), current, item) for c in spec.split("|")]
            param = dict(key=key, kind="choice", choices=choices)
            ends = choices
        else:
            log = spec.startswith("log:")
            low, dots, high = spec.removeprefix("log:").partition("..")
            if not dots or isinstance(current, bool) or not isinstance(current, (int, float)):
                raise ConfigError(
                    f"tune.space: {item!r}: a range LO..HI needs a number key and two dots "
                    f"({key} is {current!r}); for other values list them as {key}=A|B"
                )
            low, high = _number(low, item), _number(high, item)
            kind = "int" if isinstance(current, int) else "float"
            if kind == "int" and (low != int(low) or high != int(high)):
                raise ConfigError(f"tune.space: {item!r}: {key} is an int, so LO and HI must be")
            if not low < high or (log and low <= 0):
                need = "0 < LO < HI for log:" if log else "LO < HI"
                raise ConfigError(f"tune.space: {item!r} needs {need}; e.g. {key}=log:0.01..1")
            if kind == "int":
                low, high = int(low), int(high)
            param = dict(key=key, kind=kind, low=low, high=high, log=log)
            ends = [low, high]
        for value in ends:  # the space may not reach outside what validate accepts
            trial = copy.deepcopy(config)
            _set(trial, key, value)
            try:
                validate(trial)
            except ConfigError as e:
                raise ConfigError(f"tune.space: {item!r} reaches {key}={value!r}: {e}") from None
        params.append(param)
    if not params:
        raise ConfigError(f"tune.space is empty: set e.g. --config.tune.space={SPACE_EXAMPLE!r}")
    return params


BATCH_KEYS = ("global_batch", "eval_batch")


def check_batches(config, space: list[dict]) -> None:
    """Every batch the space can draw splits evenly over the data-parallel devices (data x
    fsdp) of every mesh it can draw, as the trainer requires (``program.check_batch_sizes``).
    Checked for every choice before the first trial: otherwise a bad one fails only when its
    trial starts, after the trials before it have run. A range over a batch key draws
    batches that do not split whenever that size is > 1, so there choices are asked for. A
    curriculum's batches are per device, so its global_batch is not used (as in the trainer).
    """
    by_key = {p["key"]: p for p in space}
    batches = [p for k, p in by_key.items() if k in BATCH_KEYS]
    if not batches:
        return
    from hybridpar.parallel.mesh import data_parallel_size  # imports jax, starts no backend

    meshes = by_key["mesh"]["choices"] if "mesh" in by_key else [config.mesh]
    for mesh in meshes:
        dp = data_parallel_size(mesh)
        where = f"the {dp} data-parallel devices of mesh {mesh!r} (data x fsdp)"
        for p in batches:
            key = p["key"]
            if dp == 1 or (key == "global_batch" and config.stages):
                continue
            if p["kind"] != "choice":
                first = max(dp, -(-p["low"] // dp) * dp)
                fix = "|".join(map(str, range(first, max(p["high"], first) + 1, dp)[:4]))
                raise ConfigError(
                    f"tune.space: {key}={p['low']}..{p['high']} draws batches that do not "
                    f"divide over {where}; list multiples of {dp} as choices instead, e.g. "
                    f"{key}={fix} in --config.tune.space"
                )
            bad = [b for b in p["choices"] if b % dp]
            if bad:
                fix = dict.fromkeys(max(dp, b // dp * dp) for b in p["choices"])
                raise ConfigError(
                    f"tune.space: {key}={'|'.join(map(str, p['choices']))}: "
                    f"{', '.join(map(str, bad))} do{'es' * (len(bad) == 1)} not divide over "
                    f"{where}; use multiples of {dp}, e.g. {key}={'|'.join(map(str, fix))} in "
                    "--config.tune.space"
                )


def _set(config, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        config = config[p]
    config[leaf] = type(config[leaf])(value) if isinstance(config[leaf], float) else value


def _cast(key: str, text: str, current, item: str):
    """A choice as the type of the value it replaces."""
    try:
        if isinstance(current, bool):
            return {"true": True, "false": False}[text.lower()]
        if isinstance(current, (int, float)):
            return type(current)(text)
        return text
    except (ValueError, KeyError):
        raise ConfigError(
            f"tune.space: {text!r} in {item!r} is not a {type(current).__name__} as {key} is"
        ) from None


def check(config, mode: str) -> list[dict] | None:
    """Every tune value of ``mode``, before data or devices are touched."""
    t = config.tune
    if mode == "lr":
        if not 0 < t.lr_min < t.lr_max or t.lr_epochs <= 0:
            raise ConfigError(
                f"tune.lr_min={t.lr_min!r}, tune.lr_max={t.lr_max!r}, tune.lr_epochs="
                f"{t.lr_epochs!r}: the range test needs 0 < lr_min < lr_max and lr_epochs > 0; "
                "set e.g. --config.tune.lr_min=1e-4 --config.tune.lr_max=10"
            )
        return None
    if config.distributed:  # before check_batches: it starts JAX's backend
        raise ConfigError(
            "tune search runs its trials one by one in this one process, so it does not "
            "take --config.distributed=True (each process would ask study.db for a trial of "
            "its own); search on one host without it, then train the best overrides "
            "multi-host with python -m hybridpar.train ... --config.distributed=True"
        )
    from hybridpar.runtime.checkpoint_dirs import escapes

    ckpt = config.checkpoint.dir
    if escapes(config):
        raise ConfigError(  # each trial's run is in its own folder: one outside, all would share
            f"checkpoint.dir={ckpt!r} lies outside each trial's folder, so every trial would "
            "save in the one folder (the second refused as another run's); drop "
            "--config.checkpoint.dir (each trial keeps its checkpoints in its own folder), or "
            "give a relative one, e.g. --config.checkpoint.dir=ckpt"
        )
    if t.objective not in ("top1", "time_to_target"):
        raise ConfigError(
            f"tune.objective={t.objective!r} is not one of top1, time_to_target; use e.g. "
            "--config.tune.objective=top1"
        )
    if t.objective == "time_to_target" and config.target_top1 <= 0:
        raise ConfigError(
            "tune.objective='time_to_target' needs a target: set --config.target_top1=..."
        )
    counts = (t.startup_trials, t.prune_after_trials, t.prune_warmup_evals)
    if t.eval_every_epochs <= 0 or min(counts) < 0:
        raise ConfigError(
            "tune.eval_every_epochs must be > 0 and tune.startup_trials, "
            "tune.prune_after_trials, tune.prune_warmup_evals >= 0; set e.g. "
            "--config.tune.eval_every_epochs=1"
        )
    space = parse_space(config)
    check_batches(config, space)  # before any trial or device: see check_batches
    return space


# ---- Running the trainer quietly -----------------------------------------------------------------


class WarningsToo:
    """``log`` (a file) gets every line; ``terminal`` also gets the ``warning:`` lines, each
    naming the log it comes from: a trial's set-up warnings (data dropped, a key that does
    nothing) must not hide in a file nobody opens until the search is over."""

    def __init__(self, log, terminal, name: str):
        self.log, self.terminal, self.name, self.part = log, terminal, name, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        self.part += text
        *lines, self.part = self.part.split("\n")
        for line in lines:
            if line.startswith("warning:"):
                print(f"{line} ({self.name})", file=self.terminal, flush=True)
        return len(text)

    def flush(self) -> None:
        self.log.flush()


@contextlib.contextmanager
def quiet(workdir: str):
    """The trainer's own lines (mesh, placement, progress) into ``workdir/log.txt``; its
    ``warning:`` lines on the terminal too."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "log.txt")
    with open(path, "a") as f:
        out = WarningsToo(f, sys.stdout, path)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            yield


PROGRESS_EVERY_S = 60.0  # a run's short progress line on the terminal, at most this often


class ProgressLine:
    """A short line on the terminal (the trainer's own lines go to log.txt) every
    ``PROGRESS_EVERY_S``: on a real model a trial or a range test trains for hours."""

    def __init__(self, out, plan):
        self.out, self.plan, self.last = out, plan, time.time()

    def __call__(self, loop, state, metrics, stage) -> None:
        if time.time() - self.last < PROGRESS_EVERY_S:  # every step: nothing else until then
            return
        self.last = time.time()
        loss = float(metrics["loss"])  # waits for this step, once a minute
        print(f"  step {loop.step}/{self.plan.total_steps}  epoch "
              f"{self.plan.epoch_at(loop.step):.2f}  loss {loss:.4f}", file=self.out,
              flush=True)  # fmt: skip


def run_trainer(config, workdir: str, hooks_for=lambda run: [], started=lambda run: None,
                tune_folder: str | None = None):  # fmt: skip
    """Sets up and trains ``config`` in ``workdir``: ``(run, summary)``. ``started(run)``:
    once set up (its plan known), before the training, its prints on the terminal;
    ``hooks_for(run)``: the trainer's hooks (``trainer.Hook``) for the run; ``tune_folder``:
    the kind of tune folder ``workdir`` is (``"lr"``: the range test's own)."""
    from hybridpar.runtime import trainer
    from hybridpar.runtime.run import setup

    terminal = sys.stdout
    with quiet(workdir):
        r = setup(config, workdir, tune_folder=tune_folder)
    started(r)
    hooks = [*hooks_for(r), ProgressLine(terminal, r.plan)]
    with quiet(workdir):
        return r, trainer.train(r, hooks=hooks)


# ---- lr: the range test --------------------------------------------------------------------------


# The keys range_test_config sets -> why (the warning for an override of one names it). The
# stored config of a test holds them as set from the tune.lr_* keys, which it holds too. Left
# out when a test is compared with the one in its workdir, so that the error names the key
# the user set (tune.lr_epochs, not num_epochs), and an override of one does not count.
RANGE_TEST_KEYS = {
    "optim.schedule": "the LR rises geometrically from tune.lr_min to tune.lr_max",
    "optim.base_lr": "from tune.lr_max, the LR the rise ends at",
    "optim.warmup_start_factor": "from tune.lr_min / tune.lr_max",
    "optim.warmup_epochs": "no warmup before the rise",
    "optim.momentum_start": "a constant momentum",
    "num_epochs": "from tune.lr_epochs",
    "stages": "one stage: the first of config.stages, its size and batch, over tune.lr_epochs",
    "log_every_s": "a train line after every step",
    "eval_every_epochs": "no evaluation until the last step",
    "stop_at_target": "the test runs until the loss diverges",
}


def range_test_config(config):
    """``config`` with the LR rising geometrically from tune.lr_min to tune.lr_max (as
    optim.base_lr) over tune.lr_epochs, one stage, a train line after every step, no
    evaluation until the last step and a constant momentum (a ramp would mix its effect in)."""
    c, t = copy.deepcopy(config), config.tune
    c.optim.update(
        schedule="exponential",
        base_lr=float(t.lr_max),
        warmup_start_factor=t.lr_min / t.lr_max,
        warmup_epochs=0.0,
        momentum_start=-1.0,
    )
    # A curriculum's first stage (its size and batch: where the LR matters first); the
    # flat keys are a recipe's defaults there, which its stages set otherwise.
    first = next((p for p in config.stages.split(",") if p.strip()), "")
    stages = stretch_stages(first, float(t.lr_epochs)) if first else ""
    c.update(num_epochs=float(t.lr_epochs), stages=stages, log_every_s=0.0,
             eval_every_epochs=0.0)  # fmt: skip
    c.stop_at_target = False
    return c


def diverged(first: float, lowest: float, now: float) -> bool:
    """The LR has started to undo what the run learnt: the loss, having fallen by at least
    5% of where it started, is back above half-way from its lowest to the start (or not
    finite). fast.ai's "4x the lowest" never fires on our nets: with BatchNorm (and the
    zero-initialised last BN of each block) the loss climbs back towards chance and then
    wanders, it does not explode."""
    if not math.isfinite(now):
        return True
    drop = first - lowest
    return drop > 0.05 * first and now > lowest + 0.5 * drop


class StopOnDivergence:
    """Stops the range test once the loss diverged (``diverged``, on a bias-corrected
    running mean): the larger LRs say nothing more and cost time. ``earlier``: ``(step,
    loss)`` of a stopped test's steps; resumed, the mean goes on from those before the step
    it resumes at, as in a test that was never stopped."""

    def __init__(self, earlier=()):
        self.mean, self.first, self.lowest, self.n, self.stopped = 0.0, None, math.inf, 0, None
        self.earlier = list(earlier)

    def see(self, loss: float) -> bool:
        self.n += 1
        self.mean = 0.8 * self.mean + 0.2 * loss
        now = self.mean / (1 - 0.8**self.n)
        self.first = now if self.first is None else self.first
        self.lowest = min(self.lowest, now)
        return diverged(self.first, self.lowest, now)

    def __call__(self, loop, state, metrics, stage) -> None:
        import jax

        for step, loss in self.earlier:  # the first step of this start: loop.step
            if step < loop.step:
                self.see(math.nan if loss is None else loss)
        self.earlier = []
        if self.see(float(jax.device_get(metrics["loss"]))):
            self.stopped = f"the loss diverged at step {loop.step}"
            raise StopRequested(self.stopped)


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average: no lag, so a minimum or a slope stays at its own LR."""
    h = window // 2
    return [sum(values[max(0, i - h) : i + h + 1]) / len(values[max(0, i - h) : i + h + 1])
            for i in range(len(values))]  # fmt: skip


def suggest(base_lrs: list[float], losses: list[float]) -> dict:
    """The suggested peak ``optim.base_lr``: where the smoothed loss falls fastest against
    log LR, before its minimum (and before it diverged). That is the LR that learns fastest
    (Smith 2017; Lightning's ``lr_find``), a fair peak for warmup + decay. Not fast.ai's
    "minimum / 10": on our nets the loss falls slowly for decades of LR and then steeply, so
    a tenth of the minimum lands in the slow part (digits: 0.12, a third of the hand-tuned
    0.4), where a short run barely moves; it is kept in the result for comparison."""
    import numpy as np

    smoothed = smooth(losses, max(5, len(losses) // 8) | 1)
    lowest = np.minimum.accumulate(smoothed)
    end = next((i for i in range(len(smoothed))
                if diverged(smoothed[0], lowest[i], smoothed[i])), len(smoothed))  # fmt: skip
    i = int(np.argmin(smoothed[:end]))
    # The slope over the whole curve, so each point's is a centred difference: over the curve
    # cut at the minimum, the minimum's own was a one-sided one into it, often the steepest.
    # The steepest is then taken among the points before the minimum.
    j = 0  # lowest at the first LR: the loss never fell
    if i > 0:
        slope = np.gradient(smoothed, np.log(base_lrs))
        j = int(np.argmin(slope[:i]))
    return {
        "smoothed": smoothed,
        "diverged_base_lr": base_lrs[end] if end < len(smoothed) else None,
        "min_loss": smoothed[i],
        "min_loss_base_lr": base_lrs[i],
        "steepest_base_lr": base_lrs[j],
        "min_over_10_base_lr": base_lrs[i] / 10,
        "suggested_base_lr": float(f"{base_lrs[j]:.2g}"),
    }


def lr_range(config, workdir: str, command: str | None = None, made: list[str] = ()) -> dict:
    """``command``: the one that resumes the test, for train's refusal of its folder;
    ``made``: the folders the command created for it (``missing_dirs`` before its check of the
    workdir), removed again, while empty, if the set-up refuses the input."""
    import jax
    from jax.experimental import multihost_utils

    from hybridpar.config.schedules import lr_factor
    from hybridpar.program.optim import lr_batch_factor
    from hybridpar.runtime.run_config import (
        LR_TEST_MARK,
        another_config,
        config_dict,
        differences,
    )
    from hybridpar.runtime.run_records import read_json, read_run, write_json

    c = range_test_config(config)
    saved = read_json(os.path.join(workdir, "config.json"))
    if saved is not None and "stages" in saved:  # a stopped test resumes as it started
        c.stages = saved["stages"]  # (before a curriculum's first stage, one of flat keys)
    diff = differences(saved, config_dict(c)) if saved is not None else []
    diff = [d for d in diff if d[0] not in RANGE_TEST_KEYS]
    if diff:
        where = another_config(workdir, diff).replace("a run", "an LR range test")
        raise ConfigError(f"{where}; use a new --workdir for this test")
    path = os.path.join(workdir, "lr_range.json")
    if os.path.isfile(path):  # done before: the same command shows it again
        with open(path) as f:
            result = json.load(f)
        print(f"{workdir} holds a finished LR range test (pass a new --workdir to run another)")
        return result
    # a stopped test resumes: its steps so far go into the divergence check as they were
    earlier = []
    if os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
        earlier = [(t.step, t.loss) for t in read_run(workdir).train]
    stop = StopOnDivergence(earlier)
    # Before the set-up: a test stopped from here on is one to resume, which train refuses
    # (run_config.check_not_tune). Every process writes the same (JAX has not started yet).
    # What this call adds is removed again if the set-up refuses the input (a mesh larger
    # than the devices): bad input writes nothing, and the mark would send train back here.
    from hybridpar.runtime.run import missing_dirs, remove_made

    made = [*made, *missing_dirs(workdir)]
    mark = os.path.join(workdir, LR_TEST_MARK)
    added = [f for f in (mark, os.path.join(workdir, "log.txt")) if not os.path.exists(f)]
    os.makedirs(workdir, exist_ok=True)
    write_json(mark, {"command": command})
    set_up = []

    def started(run):
        set_up.append(run)
        # A step trains at the LR of the epoch it starts at: the last one a step short of
        # the end of the rise, where the LR is tune.lr_max.
        p, t = run.plan, c.tune
        last = t.lr_max * float(lr_factor(c.optim, p.epoch_at(p.total_steps - 1), p.num_epochs))
        print(f"LR range test: {p.total_steps} steps of optim.base_lr {t.lr_min:g} -> "
              f"{last:.3g} (tune.lr_max={t.lr_max:g} at the end of the last step), stopped "
              f"once the loss diverges (progress: {workdir}/log.txt)", flush=True)  # fmt: skip

    try:
        _, summary = run_trainer(c, workdir, lambda run: [stop], started, tune_folder="lr")
    except Error as e:
        if not set_up and not isinstance(e, StopRequested):
            remove_made(made, added)
        raise
    if summary.get("preempted") and stop.stopped is None:  # a signal's stop, not the loss's
        # its curve is cut short: a suggestion from it would be far too low
        raise KeyboardInterrupt(
            f"LR range test stopped ({summary['preempted']}) at step {summary['steps']}/"
            f"{summary['total_steps']} with a checkpoint, before it could suggest an LR"
        )
    several = jax.process_count() > 1
    if several:  # process 0 writes the records: every process reads them once it is done
        multihost_utils.sync_global_devices("hybridpar: lr range test records written")
    factor = lr_batch_factor(c.optim, set_up[0].plan.stages[0].stage.global_batch)
    records = [t for t in read_run(workdir).train if t.loss is not None]
    if len(records) < 5:
        raise ConfigError(
            f"the range test ran {len(records)} steps with a finite loss, too few to read a "
            "curve from: raise --config.tune.lr_epochs or lower --config.tune.lr_min"
        )
    base_lrs = [t.lr / factor for t in records]
    losses = [t.loss for t in records]
    result = {"base_lr": base_lrs, "loss": losses, "steps": len(records), "stopped": stop.stopped}
    result |= suggest(base_lrs, losses)
    result["override"] = f"--config.optim.base_lr={result['suggested_base_lr']:g}"
    if stop.stopped is None and result["diverged_base_lr"] is None:
        # Without the blow-up the test cannot tell where the LR becomes too large: the
        # steepest descent seen so far may lie well below the one that learns fastest.
        result["warning"] = (
            f"the loss did not diverge up to optim.base_lr={base_lrs[-1]:.3g}, so the test "
            "was too short to see where the LR becomes too large and the suggestion may be "
            f"too low; run it again in a new --workdir with a larger --config.tune.lr_max "
            f"(now {c.tune.lr_max:g}) or --config.tune.lr_epochs (now {c.tune.lr_epochs:g})"
        )
    if jax.process_index() == 0:  # one writer of the shared workdir
        write_json(path, result, indent=1)
        plot_lr_range(result, os.path.join(workdir, "lr_range.png"))
    if several:  # no process leaves before the files are whole (a rerun reads them)
        multihost_utils.sync_global_devices("hybridpar: lr range test written")
    return result


def plot_lr_range(result: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.semilogx(result["base_lr"], result["loss"], color="C0", alpha=0.35, label="loss")
    ax.semilogx(result["base_lr"], result["smoothed"], color="C0", label="smoothed")
    ax.axvline(result["min_loss_base_lr"], color="C3", linestyle=":", label="minimum")
    ax.axvline(result["suggested_base_lr"], color="C2", linestyle="--",
               label=f"suggested {result['suggested_base_lr']:g} (steepest descent)")  # fmt: skip
    top = min(max(result["loss"]), 3 * result["loss"][0])  # the blow-up would hide the curve
    ax.set_ylim(min(result["loss"]) * 0.9, top)
    ax.set_xlabel("optim.base_lr (LR at lr_batch_base)")
    ax.set_ylabel("train loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_lr_range(result: dict, workdir: str, shown_again: bool = False) -> None:
    """``shown_again``: the files are an earlier call's (``lr_range`` wrote nothing)."""
    lrs = result["base_lr"]
    print(
        f"lr range test: {result['steps']} steps, optim.base_lr {lrs[0]:.3g} -> {lrs[-1]:.3g}"
        + (f" ({result['stopped']}: stopped)" if result["stopped"] else "")
    )
    print(
        f"smoothed loss lowest ({result['min_loss']:.4f}) at optim.base_lr="
        f"{result['min_loss_base_lr']:.3g}, falling fastest at {result['steepest_base_lr']:.3g}"
        f"\nsuggested peak LR (the steepest descent): {result['override']}"
    )
    files = f"{workdir}/lr_range.png and {workdir}/lr_range.json"
    print(f"its plot and numbers: {files}" if shown_again else f"wrote {files}")
    if result.get("warning"):
        print(f"warning: {result['warning']}")


# ---- search: the study ---------------------------------------------------------------------------


class Prune:
    """Reports each evaluation's top-1 to the trial (the error, 1 - top-1, when the study
    minimises time) and stops the run cleanly (``StopRequested``) where the pruner says so.
    The step optuna sees is the evaluation's index, not the train step, so trials with
    different batches compare at the same epochs."""

    def __init__(self, trial, config, minimise: bool, total_steps: int):
        self.trial, self.config, self.minimise = trial, config, minimise
        self.every = config.tune.eval_every_epochs
        self.total_steps, self.pruned = total_steps, None

    def __call__(self, loop, state, metrics, stage) -> None:
        from hybridpar.runtime.trainer import targets_met

        ev = loop.last_eval
        if ev is None or ev["step"] != loop.step:
            return
        index = round(ev["epoch"] / self.every)
        self.trial.report(1 - ev["top1"] if self.minimise else ev["top1"], index)
        last = loop.step >= self.total_steps or targets_met(self.config, loop)
        if not last and self.trial.should_prune():
            self.pruned = f"pruned at epoch {ev['epoch']:g} (top1 {ev['top1']:.4f})"
            raise StopRequested(self.pruned)


def trial_keys(config) -> dict:
    """The keys ``trial_config`` sets in every trial -> what sets them: tune.space may not
    draw them."""
    keys = {"num_epochs": "--budget-epochs", "eval_every_epochs": "tune.eval_every_epochs"}
    if config.tune.objective == "time_to_target":
        keys["stop_at_target"] = "tune.objective=time_to_target"
    return keys


def trial_config(config, params: dict, budget: float):
    # sets the keys of trial_keys: keep the two in step
    c = copy.deepcopy(config)
    for key, value in params.items():
        _set(c, key, value)
    c.num_epochs = float(budget)
    c.eval_every_epochs = float(config.tune.eval_every_epochs)
    if config.tune.objective == "time_to_target":
        c.stop_at_target = True
    return c


def suggest_params(trial, space: list[dict]) -> dict:
    out = {}
    for p in space:
        if p["kind"] == "choice":
            out[p["key"]] = trial.suggest_categorical(p["key"], p["choices"])
        elif p["kind"] == "int":
            out[p["key"]] = trial.suggest_int(p["key"], p["low"], p["high"], log=p["log"])
        else:
            out[p["key"]] = trial.suggest_float(p["key"], p["low"], p["high"], log=p["log"])
    return out


def open_study(config, workdir: str, budget: float):
    """The study in ``workdir/study.db``: new, or the one a previous call left, which must
    be of this config and budget. Trials a previous call left unfinished (killed: still
    RUNNING; or stopped by a signal) are queued again with their workdir, to resume there."""
    import optuna
    from optuna.trial import TrialState

    from hybridpar.runtime.run_config import another_config, config_dict, differences

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.makedirs(workdir, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{os.path.abspath(workdir)}/study.db")
    minimise = config.tune.objective == "time_to_target"
    study = optuna.create_study(
        study_name="search",
        storage=storage,
        direction="minimize" if minimise else "maximize",
        load_if_exists=True,
    )
    this = {"config": config_dict(config), "budget_epochs": budget}
    saved = study.user_attrs.get("search")
    if saved is None:
        study.set_user_attr("search", this)
    else:
        # the keys every trial sets: the study is keyed on what sets them (--budget-epochs, tune.*)
        same = [d for d in differences(saved["config"], this["config"])
                if d[0] not in trial_keys(config)]  # fmt: skip
        diff = [("--budget-epochs", saved["budget_epochs"], budget)] * (
            saved["budget_epochs"] != budget
        ) + same
        if diff:
            raise ConfigError(
                f"{another_config(workdir, diff).replace('a run', 'a search')}; use a new "
                "--workdir for another search"
            )
    trials = study.get_trials(deepcopy=False)
    kept = {t.user_attrs.get("workdir") for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING)}  # fmt: skip
    for t in trials:
        if t.state == TrialState.RUNNING:  # its process was killed: nothing runs it now
            # (a stop in its set-up, before the loop's own handler, ends the process too)
            storage.set_trial_user_attr(t._trial_id, "note", "interrupted (killed, or "
                                        "stopped in its set-up)")  # fmt: skip
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        elif not (t.state == TrialState.FAIL and t.user_attrs.get("interrupted")):
            continue
        if t.user_attrs.get("workdir") not in kept:
            study.enqueue_trial(t.params, user_attrs={"workdir": t.user_attrs["workdir"]})
            kept.add(t.user_attrs["workdir"])
    # Seeded by how far the study is, so a resumed study does not draw its first trials again.
    study.sampler = optuna.samplers.TPESampler(
        seed=config.seed + len(trials), n_startup_trials=config.tune.startup_trials
    )
    study.pruner = optuna.pruners.MedianPruner(  # evaluations count from 1: see Prune
        n_startup_trials=config.tune.prune_after_trials,
        n_warmup_steps=config.tune.prune_warmup_evals + 1,
    )
    return study


def run_trial(study, config, space, workdir: str, budget: float) -> str:
    """One trial: its run, then ``tell``. Returns its line; raises ``KeyboardInterrupt``
    when a signal stopped it (it resumes on the next call)."""
    from optuna.trial import TrialState

    from hybridpar.config.errors import NonFinite

    trial = study.ask()
    again = trial.user_attrs.get("workdir")  # queued again by open_study: resumes there
    sub = again or os.path.join("trials", f"{trial.number:03d}")
    trial.set_user_attr("workdir", sub)
    params = suggest_params(trial, space)
    c = trial_config(config, params, budget)
    prunes = []  # the trial's pruner, once its run is set up (it needs the run's last step)

    def hooks_for(run):
        prunes.append(Prune(trial, c, config.tune.objective == "time_to_target",
                            run.plan.total_steps))  # fmt: skip
        return prunes

    print(f"trial {trial.number}{f' (resumed {sub})' if again else ''}: {overrides(params)} "
          f"(progress: {workdir}/{sub}/log.txt)", flush=True)  # fmt: skip
    start, note, value = time.time(), "", None
    try:
        _, summary = run_trainer(c, os.path.join(workdir, sub), hooks_for)
    except NonFinite as e:  # a diverging LR is a bad trial, not a broken search
        summary, note = None, f"diverged: {e}"
        with quiet(os.path.join(workdir, sub)):  # the trainer raised it, unwritten
            print(f"error: {e}")
    except Error as e:  # a bad input or a failed save: the study cannot go on
        study.tell(trial, state=TrialState.FAIL)
        raise type(e)(f"trial {trial.number} ({overrides(params)}): {e}") from None
    # A resumed trial's time is the whole run's: its stopped part's and this one's (each
    # part's counts those before it; a killed part's time is lost)
    before = max((t.user_attrs.get("seconds", 0.0) for t in study.get_trials(deepcopy=False)
                  if again and t.number < trial.number and t.user_attrs.get("workdir") == sub),
                 default=0.0)  # fmt: skip
    seconds = time.time() - start + before
    trial.set_user_attr("seconds", round(seconds, 1))
    took = f"{seconds:.0f}s" + (f" (with {before:.0f}s before it was stopped)" if before else "")
    head = f"trial {trial.number:>3}"  # its values are on its first line
    if summary is None:  # diverged: no top-1 to tell, and never the best (optuna's FAIL)
        trial.set_user_attr("diverged", True)
        trial.set_user_attr("note", note)
        study.tell(trial, state=TrialState.FAIL)
        return f"{head}  {note}  {took}"
    skipped = summary.get("skipped_steps") or 0  # steps that changed nothing
    if skipped:
        note = f"{skipped} of {summary['steps']} steps skipped (non-finite)"
    pruned = prunes[0].pruned if prunes else None
    if pruned:
        trial.set_user_attr("note", note)
        study.tell(trial, state=TrialState.PRUNED)
        return f"{head}  {pruned}{f'; {note}' if note else ''}  {took}"
    if summary.get("preempted"):
        trial.set_user_attr("interrupted", True)
        trial.set_user_attr("note", f"stopped by {summary['preempted']}")
        study.tell(trial, state=TrialState.FAIL)
        raise KeyboardInterrupt(f"trial {trial.number} stopped ({summary['preempted']})")
    if config.tune.objective == "top1":
        value = (summary.get("final_eval") or {}).get("top1", 0.0)
    else:
        hit = (summary.get("time_to_target") or {}).get("top1")
        value = hit["wall_s"] if hit else math.inf
        note = "; ".join(n for n in (note, "" if hit else "target not reached") if n)
    trial.set_user_attr("note", note)
    study.tell(trial, value)
    return f"{head}  {config.tune.objective} {value:.4f}  {note or 'complete'}  {took}"


def overrides(params: dict) -> str:
    """The trial's values as overrides, exactly (rounded, they trained another run)."""
    return " ".join(f"--config.{k}={v!r}" if isinstance(v, float) else f"--config.{k}={v}"
                    for k, v in params.items())  # fmt: skip


# The best trial's train command starts with it: the command line's --config and overrides
TRAIN = "python -m hybridpar.train --config CONFIG --workdir NEW_DIR"


def finished(study) -> list:
    """The trials that count towards --trials: complete, pruned or diverged."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or t.user_attrs.get("diverged")]  # fmt: skip


def search(config, workdir: str, n_trials: int, budget: float, stop=None,
           train: str = TRAIN) -> object:  # fmt: skip
    """The study (``stop``, ``train``: see ``write_results``)."""
    space = check(config, "search")
    study = open_study(config, workdir, budget)
    done = len(finished(study))
    if done >= n_trials:
        print(f"the study in {workdir} has finished {done} trials (--trials {n_trials}): "
              "nothing to run; pass a larger --trials to add more")  # fmt: skip
    else:
        where = f"each trial's run in {workdir}/trials/"
        print(f"study {workdir}/study.db: {done} of {n_trials} trials done, {budget:g} epochs "
              f"each; {where}", flush=True)  # fmt: skip
    while len(finished(study)) < n_trials:
        print(run_trial(study, config, space, workdir, budget), flush=True)
    write_results(study, config, workdir, stop, train)
    return study


def write_results(study, config, workdir: str, stop=None, train: str = TRAIN) -> None:
    """``DIR/trials.md`` and ``DIR/search.png``, then the table and the best trial on stdout.
    ``stop``: the command's ``StopBetweenRuns``, told once the files are written that a stop
    leaves nothing to continue. ``train``: ``python -m hybridpar.train --config FILE
    --workdir NEW_DIR`` and the search's overrides, the start of the best trial's command."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    keys = [p["key"] for p in parse_space(config)]
    name = config.tune.objective
    # A trial that resumes a stopped one has a number of its own but runs on in the stopped
    # one's folder: the run column names each trial's folder.
    lines = ["| trial | run | state | " + name + " | " + " | ".join(keys) + " | seconds | note |",
             "|" + "---|" * (len(keys) + 6)]  # fmt: skip
    for t in trials:
        value = "-" if t.value is None else f"{t.value:.4f}"
        if t.state == TrialState.PRUNED and t.intermediate_values:
            last = max(t.intermediate_values)
            value = f"({t.intermediate_values[last]:.4f} at eval {last})"
        cells = [f"{t.params[k]:.4g}" if isinstance(t.params.get(k), float)
                 else str(t.params.get(k, "-")) for k in keys]  # fmt: skip
        seconds, note = t.user_attrs.get("seconds", "-"), t.user_attrs.get("note", "")
        state = t.state.name.lower()
        run = t.user_attrs.get("workdir", "-")
        if t.state == TrialState.FAIL and not t.user_attrs.get("diverged"):  # interrupted
            redo = [u for u in trials if u.number > t.number
                    and u.user_attrs.get("workdir") == run]  # fmt: skip
            note = note.removesuffix(", queued again")  # an older study's note said it
            if not redo or redo[0].state == TrialState.WAITING:
                note += ", queued again" + (f" as trial {redo[0].number}" if redo else "")
            else:
                note += f", redone as trial {redo[0].number}"
        lines.append(
            f"| {t.number} | {run} | {state} | {value} | {' | '.join(cells)} | {seconds} | "
            f"{note} |"
        )
    table = "\n".join(lines) + "\n"
    # Both files first: a stop while the lines below print leaves nothing undone.
    with open(os.path.join(workdir, "trials.md"), "w") as f:
        f.write(table)
    plot_search(study, os.path.join(workdir, "search.png"), name)
    if stop is not None:
        stop.message = (f"stopped; the study is finished, its results in {workdir}/trials.md "
                        "and search.png; the same command shows them again")  # fmt: skip
    print(table, end="")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial if complete else None
    diverged = [t for t in trials if t.user_attrs.get("diverged")]
    if best is None and diverged and len(diverged) == len(finished(study)):
        print("best: none (every trial diverged; each one's note has the trainer's advice: "
              "e.g. lower the top of optim.base_lr's range in --config.tune.space, or draw a "
              "warmup with optim.warmup_epochs)")  # fmt: skip
    elif best is None:
        print("best: none (no trial completed; pass a larger --trials to run more)")
    elif best is not None and math.isinf(best.value):  # time_to_target: none reached it
        print(f"best: none, no trial reached target_top1={config.target_top1:g}")
    elif best is not None:
        run = best.user_attrs.get("workdir")
        where = f" (run {os.path.join(workdir, run)})" if run else ""
        budget = study.user_attrs.get("search", {}).get("budget_epochs")
        at = f" at --budget-epochs {budget:g}" if budget else ""
        print(f"best: trial {best.number}, {name} {best.value:.4f}{at}{where}: "
              f"{overrides(best.params)}")  # fmt: skip
        print(f"train it: {train} {overrides(best.params)}")
        if budget and name == "top1" and budget != config.num_epochs:
            print(f"  (that top1 is at the search's --budget-epochs {budget:g}: add "
                  f"--config.num_epochs={budget:g} to train as the trial did; without it, "
                  f"the config's num_epochs={config.num_epochs:g} trains longer)")  # fmt: skip
    print(f"wrote {workdir}/trials.md and {workdir}/search.png")


def plot_search(study, path: str, name: str) -> None:
    from optuna.trial import TrialState

    plt = pyplot()
    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]  # fmt: skip
    fig, (obj, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    obj.plot([t.number for t in done], [t.value for t in done], "o", label="complete")
    pick = min if study.direction.name == "MINIMIZE" else max
    best = [pick(t.value for t in done if t.number <= n.number) for n in done]
    obj.step([t.number for t in done], best, where="post", color="C2", label="best so far")
    cut = [t for t in trials if t.state == TrialState.PRUNED and t.intermediate_values
           and pick is max]  # intermediates are the objective only when it is top-1  # fmt: skip
    obj.plot([t.number for t in cut], [t.intermediate_values[max(t.intermediate_values)]
             for t in cut], "x", color="0.5", label="pruned (its last eval)")  # fmt: skip
    for t in trials:
        xs = sorted(t.intermediate_values)
        pruned = t.state == TrialState.PRUNED
        curves.plot(xs, [t.intermediate_values[x] for x in xs], "--" if pruned else "-",
                    color="0.6" if pruned else None, marker=".", label=None if pruned
                    else f"trial {t.number}")  # fmt: skip
    obj.set_xlabel("trial")
    obj.set_ylabel(name)
    curves.set_xlabel("evaluation (tune.eval_every_epochs apart)")
    curves.set_ylabel("1 - top1" if study.direction.name == "MINIMIZE" else "top1")
    curves.set_title("each trial's evaluations (pruned: dashed grey)", fontsize=9)
    for ax in (obj, curves):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # none where every trial diverged
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- Command line --------------------------------------------------------------------------------


def is_range_test(saved: dict) -> bool:
    """``saved`` (a run's config, as config.json holds it) is an LR range test's: the keys
    ``range_test_config`` sets hold what it sets from the config's own tune keys."""
    import ml_collections

    from hybridpar.runtime.run_config import config_dict, flatten

    try:
        made = flatten(config_dict(range_test_config(ml_collections.ConfigDict(saved))))
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return False  # not a config with a tune section: not a test's
    held = flatten(saved)
    return all(held.get(k, "<missing>") == made.get(k) for k in RANGE_TEST_KEYS)


def held_kind(workdir: str, config) -> str | None:
    """What ``workdir`` holds, as a key of ``run_config.KINDS``, or None where it holds none
    of them."""
    from hybridpar.runtime.run_config import of_workdir, tune_files

    if not os.path.isdir(workdir):
        return None
    held = tune_files(workdir)  # tune's own files, which the trainer refuses too
    if held is not None:
        return held
    saved = of_workdir(workdir, config)
    if saved is not None:
        return "lr" if is_range_test(saved) else "train"
    ran = any(os.path.exists(os.path.join(workdir, n)) for n in ("summary.json", "metrics.jsonl"))
    return "train" if ran else None


def check_kind(mode: str, config, workdir: str) -> None:
    """``workdir`` is new or holds this mode's test or study: tune would otherwise write its
    own run or study into another tool's (a study inside a finished training run)."""
    from hybridpar.runtime.run_config import KINDS

    # Any folder inside a study's (its trials/, a trial's run, a new one there): its folder
    # holds its trials' runs, and held_kind sees no study in the folder itself.
    study = os.path.abspath(workdir)
    while study != os.path.dirname(study):
        study = os.path.dirname(study)
        if os.path.exists(os.path.join(study, "study.db")):
            raise ConfigError(
                f"workdir {workdir!r} is inside the search study in {study!r} (which holds "
                f"its trials' runs): tune {mode} does not run there; use a new --workdir "
                "outside it"
            )
    held = held_kind(workdir, config)
    if held not in (None, mode):
        what = "the test" if mode == "lr" else "the search"
        raise ConfigError(
            f"workdir {workdir!r} holds {KINDS[held]}, not {KINDS[mode]}: tune {mode} does "
            f"not run in it; use a new --workdir for {what}"
        )


def unused_overrides(mode: str, config, overrides, budget=None) -> list[str]:
    """A ``warning:`` line for each ``--config.KEY=VALUE`` the mode sets otherwise (the range
    test's keys, every trial's): tune runs with its own value, so the user's does nothing."""
    if mode == "lr":
        used, why = range_test_config(config), RANGE_TEST_KEYS
        where = "tune lr sets"
    else:
        used, why = trial_config(config, {}, budget), trial_keys(config)
        why = {k: f"from {v}" for k, v in why.items()}
        where = "every trial of tune search sets"
    lines = []
    for key, raw in dict(overrides).items():  # the last of a key given twice is the one set
        if key in why and config_value(used, key) != config_value(config, key):
            # the range test trains a curriculum's first stage: that much of it is used
            said = "is used in part" if mode == "lr" and key == "stages" and raw else "is not used"
            lines.append(f"warning: --config.{key}={raw} {said}: {where} "
                         f"{key}={config_value(used, key)!r} ({why[key]})")  # fmt: skip
    return lines


def main(argv=None) -> None:
    from hybridpar.runtime.signals import StopBetweenRuns

    # from the first line: a stop outside a trial's training exits 0 (its loop saves)
    with StopBetweenRuns("stopped; the same command continues the study or the test") as stop:
        _main(argv, stop)


def _main(argv, stop) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.tune",
        "lr: the LR range test: one short run with optim.base_lr rising geometrically from\n"
        "  tune.lr_min to tune.lr_max over tune.lr_epochs, stopped once the loss diverges;\n"
        "  prints the suggested peak LR and writes DIR/lr_range.png and .json.\n"
        "search: an optuna study over tune.space (comma-separated KEY=LO..HI, KEY=log:LO..HI\n"
        "  or KEY=A|B|C, e.g. --config.tune.space='optim.base_lr=log:0.05..2,global_batch=32|64'"
        "),\n"
        "  each trial --budget-epochs of the trainer, scored by tune.objective (top1 or\n"
        "  time_to_target); writes DIR/trials.md and prints the best trial's train command.\n"
        f"tune keys: lr: tune.{', tune.'.join(MODE_KEYS['lr'])};\n"
        f"  search: tune.{', tune.'.join(MODE_KEYS['search'][:4])},\n"
        f"  tune.{', tune.'.join(MODE_KEYS['search'][4:])}.\n"
        "Set them with --config.tune.KEY=VALUE; docs/tuning.md says what each does.",
    )
    parser.add_argument("mode", choices=("lr", "search"), help="the LR range test or a search")
    parser.add_argument("--workdir", required=True, help="the test's or the study's directory")
    parser.add_argument("--trials", type=int,
                        help="search: trials in all (finished ones count); required there, "
                             "no default")  # fmt: skip
    parser.add_argument("--budget-epochs", type=cli.finite_float,
                        help="search: epochs of each trial; required there, no "
                             "default")  # fmt: skip
    args, config = cli.parse(parser, argv)
    if args.mode == "search":
        if args.trials is None or args.trials < 1:
            cli.fail("search needs --trials N (N >= 1), e.g. --trials 12")
        if args.budget_epochs is None or args.budget_epochs <= 0:
            cli.fail("search needs --budget-epochs E (E > 0), e.g. --budget-epochs 3")
    elif args.trials is not None or args.budget_epochs is not None:
        cli.fail("--trials and --budget-epochs are for search, not lr")
    # the other mode's tune keys, set here, would be silently unused
    other = "search" if args.mode == "lr" else "lr"
    for key, _ in args.config_overrides:
        if key.partition(".")[2] in MODE_KEYS[other] and key.startswith("tune."):
            cli.fail(f"--config.{key} is not used by tune {args.mode} (it is a tune {other} "
                     "key); drop it")  # fmt: skip

    def run():
        from hybridpar.config.schema import validate

        pyplot()  # the PNGs it ends with need matplotlib: say so now, not after the training
        if args.mode == "lr":  # the test's config: not the keys it sets as the user set them
            check(config, "lr")
            validate(range_test_config(config))
        else:
            validate(config)
            space = check(config, "search")
            if all(p["key"] != "mesh" for p in space):  # the mesh every trial takes
                from hybridpar.parallel import comm
                from hybridpar.parallel.mesh import make_mesh

                # one too large is refused before the study is written; the devices start
                # here, so the collective flags a trial's set-up sets go first, as there
                comm.apply(config.comm)
                make_mesh(config.mesh)
        from hybridpar.runtime.run import check_workdir, missing_dirs

        check_kind(args.mode, config, args.workdir)  # before anything is written there
        made = missing_dirs(args.workdir)  # check_workdir creates them: lr's set-up may undo it
        check_workdir(args.workdir)
        for line in unused_overrides(args.mode, config, args.config_overrides,
                                     args.budget_epochs):  # fmt: skip
            print(line, flush=True)
        if args.mode == "lr":
            shown_again = os.path.isfile(os.path.join(args.workdir, "lr_range.json"))
            again = cli.same_command("hybridpar.tune", args.argv)
            try:
                result = lr_range(config, args.workdir, again, made)
            except KeyboardInterrupt as e:
                print(f"{e}; resume it with the same command:\n  {again}")
                return
            print_lr_range(result, args.workdir, shown_again)
            return
        # the best trial's train command: this one's config and overrides (tune's own keys,
        # which train does not read, left out)
        train = shlex.join(["python", "-m", "hybridpar.train", "--config", args.config_path,
                            "--workdir", "NEW_DIR", *(f"--config.{k}={v}" for k, v in
                            args.config_overrides if not k.startswith("tune."))])  # fmt: skip
        try:
            search(config, args.workdir, args.trials, args.budget_epochs, stop, train)
        except KeyboardInterrupt as e:
            print(f"stopped: {e or 'interrupted'}; the same command continues the study")

    cli.main(run)


if __name__ == "__main__":
    main()
