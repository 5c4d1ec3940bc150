"""Evaluation off the training clock, as MoXing ran it: a second process evaluates the run's
checkpoints while the trainer goes on.

    events = run(config, workdir, watch=True)   # python -m hybridpar.evaluate ... --watch

``run`` checks that ``workdir`` holds a run of ``config`` (its ``config.json``; the keys in
``PLACEMENT_KEYS`` may differ, so ``--config.mesh=...`` fits the evaluator to its own
devices), sets up with ``hybridpar.runtime.run.setup`` (the same program, data and plan as the
trainer, on this process's mesh), then evaluates each committed checkpoint once, oldest
first: read straight into this mesh's shardings (read-only: the trainer's saves and retention
are left alone), then ``run.eval_pass`` on the whole eval split. Each is an ``eval`` event
with the checkpoint's step, the trainer's wall time at that step (``wall_s``, from the
checkpoint's loop state) and ``source: evaluator``; a checkpoint deleted (by the run's
``checkpoint.max_to_keep``) before its turn is an ``eval_skipped`` event. Those events are
also the record of what is done: a restarted evaluator evaluates only what is new (and a
skipped step that is on disk again, saved anew by the trainer).

``from_epoch`` (``--from-epoch``) leaves the checkpoints before that epoch alone: not
evaluated and not recorded, so a later call without it evaluates them (a time-to-accuracy
measurement needs only the checkpoints near its target and the last).

With ``watch`` it polls for new checkpoints and stops once the run's last step
(``plan.total_steps``, which the trainer always checkpoints; the plan of the config the newest
checkpoint holds, which a resume with ``--allow-config-change`` changes) is done, or once
summary.json says the run completed (the latest trainer start's summary: its ``resume`` line
tells) and nothing new is left, and no trainer holds the workdir's lock (one may still take
the run further). It may start before the run (it waits for the workdir's ``config.json``),
and it stops with an error once the run has ended unfinished: no trainer holds the
workdir's lock (said once) and nothing new came for ``dead_after_s``. Without ``watch``
summary.json is not read.
One evaluator per run: it holds ``W/evaluator/.lock`` (``workdir_lock``) while it runs, and a
second one is refused with an error naming the first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax

from hybridpar.config.curriculum import plan_stages, stages_from_config
from hybridpar.config.errors import ConfigError, WorkdirError
from hybridpar.config.schema import from_saved
from hybridpar.parallel.mesh import MeshSpecError, describe_mesh
from hybridpar.runtime import checkpoint, run_config, signals, workdir_lock
from hybridpar.runtime.metrics import MetricsWriter
from hybridpar.runtime.run import Run, eval_pass, log, setup
from hybridpar.runtime.run_records import latest_start, latest_summary, read_json, read_records

# Keys that may differ from the run's, besides run_config.FREE_KEYS: the placement keys
# (where and how fast the evaluation runs: another eval batch pads differently, but every
# example still counts once), and when and to what end the trainer evaluates.
PLACEMENT_KEYS = (*run_config.PLACEMENT_KEYS, "eval_every_epochs", "target_top1", "target_top5")
SKIPPED = "eval_skipped"
SAVED = "checkpoint_mtime_ns"  # in a skip's line: the save it skipped (``Evaluator.saved``)
# With --watch: how long a run may bring no new checkpoint with no trainer alive on it
# before the evaluator stops (a preempted run is usually resumed within minutes).
DEAD_AFTER_S = 300.0
WORKDIR_FIX = "pass the --workdir of a training run (the one given to python -m hybridpar.train)"
# A summary.json that does not read: the evaluator only reads it with --watch.
SUMMARY_UNREADABLE = (
    "the evaluator reads NAME with --watch only, to tell that the run completed: leave out "
    "--watch to evaluate the checkpoints there, or move it aside (e.g. to NAME.bad)"
)
# On a large eval split: a line this often while one checkpoint is evaluated.
PROGRESS_S = 30.0


def check_folder(workdir: str) -> None:
    """A workdir that is a file is an error at once: with ``--watch`` too, as it never
    becomes a run (the trainer refuses it in the same words)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"workdir {workdir!r} is a file, not a folder; {WORKDIR_FIX}")


def check_is_run(workdir: str, config, watch: bool) -> None:
    """A folder that holds no training run is an error before any set-up: a tune search's
    (its runs are its trials'), and without ``watch`` one with no ``config.json`` (which the
    trainer writes before any checkpoint) and no checkpoints of ``config`` (None: the
    run's own, which is in that file, so none are looked for)."""
    if not os.path.isdir(workdir):
        return  # check_run_of says it: no such workdir
    if run_config.tune_files(workdir) == "search":
        raise WorkdirError(
            f"{workdir!r} holds a tune search (study.db), not a training run: each trial's "
            "run is in its own folder there; pass one as --workdir, e.g. "
            f"{os.path.join(workdir, 'trials', '000')}"
        )
    if watch or os.path.exists(os.path.join(workdir, "config.json")):
        return
    if config is None:  # the run's config is read from config.json: its checkpoints unknown
        raise WorkdirError(
            f"{workdir!r} holds no config.json: {WORKDIR_FIX}, --config experiments/NAME.py "
            "(the run's checkpoints are then found without it), or --watch to wait for a run "
            "about to start there"
        )
    if not checkpoint.committed_steps(checkpoint.checkpoint_dir(config, workdir)):
        raise WorkdirError(
            f"{workdir!r} holds no training run (no config.json, no checkpoints): "
            f"{WORKDIR_FIX}, or --watch to wait for a run about to start there"
        )


def check_run_of(config, workdir: str) -> bool:
    """Raises unless ``workdir`` exists and, once its trainer has written ``config.json``,
    holds a run of ``config`` (placement keys aside). False while there is no
    ``config.json`` yet (the trainer writes it after its set-up, before any checkpoint)."""
    check_folder(workdir)
    if not os.path.isdir(workdir):
        raise WorkdirError(f"no workdir {workdir!r}: {WORKDIR_FIX}, or start that run first")
    saved = read_json(os.path.join(workdir, "config.json"))
    if saved is None:
        return False
    diff = run_config.differences(saved, run_config.config_dict(config), free=PLACEMENT_KEYS)
    if diff:
        key, old, _ = diff[0]
        # one key is likely an override left out; several, another experiment's --config
        fix = (
            f"pass the run's own config (--config.{key}={old})"
            if len(diff) == 1
            else "leave out --config to read the run's own from the workdir"
        )
        raise ConfigError(
            f"{run_config.another_config(workdir, diff)}; {fix}; only "
            f"{', '.join(k.rstrip('.') for k in PLACEMENT_KEYS)} may differ"
        )
    return True


def check_position(plan, step: int, loop: dict) -> None:
    """The checkpoint's loop must have seen the examples this config's plan gives by
    ``step``, else this plan (epochs, the last step) is not the trainer's: with
    ``config.stages`` the batches are per data-parallel device, so the plan follows the mesh."""
    mine = sum(
        min(max(step - s.start_step, 0), s.num_steps) * s.stage.global_batch for s in plan.stages
    )
    if loop["samples_seen"] != mine:
        raise ConfigError(
            f"checkpoint {step} has seen {loop['samples_seen']} training examples, but this "
            f"config's stages give {mine} by that step: config.stages sets batches per "
            "data-parallel device, so pass a --config.mesh with the trainer's data x fsdp size"
        )


class Stamped:
    """A writer for ``run.eval_pass``: every event it writes gets ``stamp``'s fields, so
    ``wall_s`` is the trainer's wall time at the checkpoint's step, not the evaluator's."""

    def __init__(self, writer, **stamp):  # a MetricsWriter, or Evaluator (which makes one)
        self.writer, self.stamp = writer, stamp

    def write(self, event: str, step: int, epoch: float, **values) -> dict:
        return self.writer.write(event, step, epoch, **{**values, **self.stamp})


class Evaluator:
    """Evaluates a run's committed checkpoints, oldest first, each once.

    Its records go to ``W/evaluator/`` (``metrics.jsonl``, ``tb/``), not into the trainer's
    files: TensorBoard event files are one writer's each (a second writer of ``eval/top1``
    in ``W/tb`` would tangle with the trainer's series), and the trainer's ``metrics.jsonl``
    stays one process's record, appended only by its own resumes. Appending from both would
    hold on a local disk (each line is one short ``O_APPEND`` write) but not on every network
    file system through which an evaluator on another machine may see ``W``."""

    def __init__(self, run: Run, workdir: str, from_epoch: float = 0.0):
        self.run, self.workdir, self.from_epoch = run, workdir, from_epoch
        self.out = os.path.join(workdir, "evaluator")  # made writable and locked by run()
        self.saver = checkpoint.Checkpoints(
            checkpoint.checkpoint_dir(run.config, workdir), read_only=True
        )
        done, _ = read_records(os.path.join(self.out, "metrics.jsonl"))
        # A skipped step is tried again only if the trainer saved it anew (after moving an
        # unreadable one aside, or resumed from an earlier checkpoint): its folder is not
        # the one the skip saw (none, where it was gone). Untouched, it would fail again.
        there = set(self.saver.committed_steps())
        skips = {r.step: r.extra.get(SAVED) for r in done if r.event == SKIPPED}  # the last
        same = [s for s, saved in skips.items() if s not in there or saved == self.saved(s)]
        self.done = {r.step for r in done if r.event == "eval"} | set(same)
        self.plan_of = run_config.config_dict(run.config)  # the config run.plan was made of
        self.started_from: int | None = None  # the latest trainer start's checkpoint step
        self.writer = None  # made by the first record: a call that stops on an error writes none
        self.written: list[dict] = []  # this call's events
        self.known: set[int] = set()  # steps committed at some point (listed, or in W's events)
        self._offset = 0  # how far W/metrics.jsonl has been read

    def poll(self) -> list[int]:
        """The committed steps not done yet, oldest first. A step known to have been
        committed that is no longer on disk was deleted (by the run's retention, or by hand)
        before its turn: an ``eval_skipped`` event, not an error."""
        # The trainer's checkpoint events first, then the listing: a step reported committed
        # but not listed is gone, not still to come.
        self.read_trainer_records()
        committed = [s for s in self.saver.committed_steps() if self.wanted(s)]
        self.known = {s for s in self.known | set(committed) if self.wanted(s)}
        for step in sorted(self.known - set(committed) - self.done):
            self.skip(step, "deleted before it was evaluated (keep more with "
                      "--config.checkpoint.max_to_keep in the trainer, or evaluate on faster "
                      "devices)")  # fmt: skip
        return [s for s in committed if s not in self.done]

    def read_trainer_records(self) -> None:
        """The trainer's new lines in ``W/metrics.jsonl``: its checkpoints, and its starts
        (``resume`` lines)."""
        path = os.path.join(self.workdir, "metrics.jsonl")
        events, self._offset = read_records(path, self._offset)
        self.known |= {r.step for r in events if r.event == "checkpoint"}
        started = latest_start(events)
        if started is not None:
            self.started_from = started

    def follow_config(self) -> None:
        """The plan of the run's config as its newest checkpoint holds it: a run resumed with
        ``--allow-config-change`` (more epochs, say) has another last step from there on."""
        held = run_config.held_config(self.saver.directory)
        if held is None or not run_config.differences(held[1], self.plan_of, free=PLACEMENT_KEYS):
            return
        plan, config = self.run.plan, from_saved(held[1], f"checkpoint {held[0]}")
        stages = stages_from_config(config, plan.data_parallel)
        new = plan_stages(stages, self.run.data.steps_for, data_parallel=plan.data_parallel)
        self.run, self.plan_of = dataclasses.replace(self.run, plan=new), held[1]
        if new.total_steps != plan.total_steps:
            log(f"the run's config changed at checkpoint {held[0]}: its last step is now "
                f"{new.total_steps}")  # fmt: skip

    def wanted(self, step: int) -> bool:
        """At or after ``from_epoch``, to the records' 4 decimals (an epoch read off
        ``metrics.jsonl`` names its own checkpoint)."""
        return self.run.plan.epoch_at(step) >= self.from_epoch - 5e-5

    def saved(self, step: int) -> int | None:
        """What tells one save of ``step`` from another: its folder's modification time (a
        save anew is a new folder); None while there is none."""
        try:
            return os.stat(os.path.join(self.saver.directory, str(step))).st_mtime_ns
        except OSError:
            return None

    def skip(self, step: int, why: str) -> None:
        self.done.add(step)
        log(f"checkpoint {step}: skipped, {why}")
        # wall_s: the trainer's time at a checkpoint that is gone is not known. The save it
        # skipped goes in ``extra`` (a line's undeclared fields): only this class reads it.
        rec = self.write(SKIPPED, step, self.run.plan.epoch_at(step), wall_s=None,
                         source="evaluator", reason=why,
                         extra={SAVED: self.saved(step)})  # fmt: skip
        self.written.append(rec)

    def evaluate(self, step: int) -> None:
        """One checkpoint, read into this program's shardings, on the whole eval split."""
        t0 = time.time()
        try:
            _, state, loop, _ = self.saver.restore(self.run.program.abstract_state(), step=step)
        except Exception as e:  # noqa: BLE001 - deleted under us, or it does not read back
            if step not in self.saver.committed_steps():
                return self.skip(step, "deleted while it was being read")
            return self.skip(step, f"does not read back ({checkpoint.read_error(e)})")
        check_position(self.run.plan, step, loop)
        read_s = time.time() - t0
        # to the millisecond, as MetricsWriter rounds its own clock's
        writer = Stamped(self, wall_s=round(loop["wall_s"], 3), source="evaluator")
        self.written.append(eval_pass(self.with_progress(step), state, step, writer))
        self.done.add(step)
        log(f"checkpoint {step}: at {loop['wall_s']:.1f}s of training; read in "
                    f"{read_s:.1f}s, evaluated in {time.time() - t0 - read_s:.1f}s")  # fmt: skip

    def with_progress(self, step: int) -> Run:
        """``run`` whose eval batches say how far they are every ``PROGRESS_S`` seconds (a
        large eval split takes minutes; a small one says nothing)."""
        data, total = self.run.data, math.ceil(self.run.data.num_eval / self.run.config.eval_batch)

        def batches():
            said = time.time()
            for i, batch in enumerate(data.eval_batches(), 1):
                if time.time() - said >= PROGRESS_S:
                    log(f"checkpoint {step}: {i}/{total} eval batches read")
                    said = time.time()
                yield batch

        return dataclasses.replace(self.run, data=dataclasses.replace(data, eval_batches=batches))

    def write(self, event: str, step: int, epoch: float, **values) -> dict:
        with signals.whole():  # a stop (the command's Stop) waits for the whole record
            if self.writer is None:
                self.writer = MetricsWriter(self.out)
            return self.writer.write(event, step, epoch, **values)

    def completed(self) -> bool:
        """summary.json says the run completed, and it is the latest trainer start's: a run
        resumed with another config (``--allow-config-change``) keeps the first finish's
        until it finishes again."""
        self.read_trainer_records()
        summary = read_json(os.path.join(self.workdir, "summary.json"), SUMMARY_UNREADABLE)
        if not (summary and summary.get("completed")):
            return False
        return latest_summary(summary, self.started_from)

    def loop(self, watch: bool, poll_s: float, config_checked: bool, liveness=None) -> list[dict]:
        """Evaluates what is there (``watch``: and what comes, until the run's last step is
        done, or an error once ``liveness`` says the run has ended unfinished); returns the
        events written."""
        liveness = liveness or Liveness(self.workdir, DEAD_AFTER_S)
        if self.from_epoch:
            log(f"evaluating the checkpoints from epoch {self.from_epoch:g} on; the earlier "
                "ones are left for a call without --from-epoch")  # fmt: skip
        if watch:
            self.follow_config()
            log(f"watching {self.saver.directory} every {poll_s:g}s until step "
                f"{self.run.plan.total_steps}")  # fmt: skip
        while True:
            # summary.json without --watch: not needed (one that does not read stops nothing)
            # read before the listing, which then has its last step
            completed = watch and self.completed()
            if watch:
                self.follow_config()
            todo = self.poll()
            if todo and not config_checked:  # the trainer wrote config.json since we began
                if not check_run_of(self.run.config, self.workdir):
                    raise ConfigError(
                        f"{self.saver.directory} holds checkpoints but {self.workdir!r} has no "
                        "config.json: pass the --workdir the training run was given"
                    )
                config_checked = True
            if not watch and not todo and not self.done:
                since = f" from epoch {self.from_epoch:g} on" if self.from_epoch else ""
                raise ConfigError(
                    f"no checkpoints{since} in {self.saver.directory} yet: pass --watch to "
                    "wait for them (the trainer saves every checkpoint.every_steps steps "
                    "and/or every_minutes minutes, and at its last step)"
                    + (", or a lower --from-epoch" if since else "")
                )
            for step in todo:
                self.evaluate(step)
            last = self.run.plan.total_steps
            # a trainer still on the run may take it further (resumed with more epochs)
            if not watch or (last in self.done or completed) and not liveness.trainer():
                break
            if todo:
                liveness.progress()
            elif liveness.dead():
                latest = max(self.known, default=None)
                raise ConfigError(
                    f"the run in {self.workdir!r} ended before its last step ({last}): no "
                    f"trainer has held its lock and no checkpoint came for "
                    f"{liveness.dead_after_s:g}s (the latest is "
                    f"{'step ' + str(latest) if latest is not None else 'none'}); resume it "
                    "with its training command and run this again (it goes on from its "
                    "record), or pass a larger --dead-after-s"
                )
            time.sleep(poll_s)
        steps = [r["step"] for r in self.written if r["event"] == "eval"]
        skipped = len(self.written) - len(steps)
        log(f"evaluated {len(steps)} checkpoint(s) {steps or ''}".rstrip()
                    + (f", skipped {skipped}" if skipped else "")
                    + f"; records in {self.out}/metrics.jsonl")  # fmt: skip
        return self.written

    def close_records(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        self.close_records()
        self.saver.close()


class Liveness:
    """Whether a watched run can still bring something new: a live trainer holds the
    workdir's lock (``workdir_lock.held``, a probe that never blocks it), or something new
    came within ``dead_after_s`` (0: wait for ever). Between a stop and its resume no
    trainer holds the lock for a while: hence the timeout rather than a look."""

    def __init__(self, workdir: str, dead_after_s: float):
        self.workdir, self.dead_after_s = workdir, dead_after_s
        self.last = time.time()
        self.said = False  # that no trainer is writing, since it was last seen

    def progress(self) -> None:
        self.last = time.time()
        self.said = False

    def trainer(self) -> bool:
        """Whether a trainer holds the run's lock now."""
        return os.path.isdir(self.workdir) and workdir_lock.held(self.workdir)

    def dead(self, say: bool = True) -> bool:
        """``say``: once no trainer is seen, a line saying how long it is waited for (else
        nothing came until the error, 5 minutes later by default)."""
        if self.trainer():
            self.progress()
        elif say and not self.said:
            self.said = True
            left = max(self.dead_after_s - (time.time() - self.last), 0)
            until = f"giving up in {left:.0f}s" if self.dead_after_s > 0 else "waiting"
            log(f"no trainer is writing {self.workdir}; {until} unless it resumes")
        return self.dead_after_s > 0 and time.time() - self.last > self.dead_after_s


def wait_for_run(workdir: str, watch: bool, poll_s: float, liveness: Liveness) -> None:
    """With ``watch``: until ``workdir`` and its ``config.json`` exist (the trainer writes it
    when its set-up is done), so the evaluator may start before the trainer."""
    config_json = os.path.join(workdir, "config.json")
    if not watch or os.path.exists(config_json):
        return
    log(f"waiting for the run in {workdir} to start (for its config.json)")
    while not os.path.exists(config_json):
        if liveness.dead(say=False):  # (the line above says what is waited for)
            raise ConfigError(
                f"no training run started in {workdir!r} within {liveness.dead_after_s:g}s "
                "(no config.json, no trainer holding its lock): start it with python -m "
                "hybridpar.train and this --workdir, or pass a larger --dead-after-s "
                "(0 waits for ever)"
            )
        time.sleep(poll_s)


def run(
    config,
    workdir: str,
    *,
    watch=False,
    poll_s=5.0,
    devices=None,
    overrides=(),
    dead_after_s: float = DEAD_AFTER_S,
    from_epoch: float = 0.0,
    stop=None,
) -> list[dict]:
    """Evaluates ``workdir``'s checkpoints with ``config`` (None: the run's own, its latest
    checkpoint's, with ``overrides``) on ``devices`` (default: all), those from
    ``from_epoch`` on; returns the events written (``eval`` and ``eval_skipped``). With
    ``watch`` it may start before the run and stops with an error once the run has ended
    unfinished (``Liveness``). ``stop``: the command's signal handler
    (``tools.evaluate.Stop``), given what to close before it exits (``release``)."""
    check_folder(workdir)  # before any wait: a file never becomes a run
    check_is_run(workdir, config, watch)  # before the set-up's lines and any wait
    liveness = Liveness(workdir, dead_after_s)
    wait_for_run(workdir, watch, poll_s, liveness)
    # the mesh is the run's unless given: its refusal says so (the user typed none)
    runs_mesh = config is None and not any(k == "mesh" for k, _ in overrides)
    if config is None:
        from hybridpar.runtime import trained

        if not os.path.isdir(workdir):
            check_run_of(config, workdir)  # its error: no such workdir
        config = trained.load_config(workdir, overrides)
    checked = check_run_of(config, workdir)  # before any device or data is touched
    # One evaluator per run, as one trainer: two would append the same records. Taken
    # before the set-up, so a second one stops at once, not after compiling.
    out = os.path.join(workdir, "evaluator")
    made = not os.path.exists(out)
    # A distributed evaluator's processes lock a file each (.lock, .lock.N), once the
    # runtime has said which process this is (as the trainer's do).
    lock = None if config.distributed else lock_records(out)
    evaluator = None
    released = False

    def release() -> None:
        """The records closed (their TensorBoard lines written out) and the lock given
        back, once: at the end, or at a stop by ``stop``, which exits at once after it."""
        nonlocal released
        if released:
            return
        released = True
        if evaluator is not None:
            evaluator.close_records()
        if made:  # a call that stopped before its first record leaves no empty folder
            remove_if_empty(out, lock)
        if lock is not None:
            lock.release()

    if stop is not None:
        stop.release = release
    try:
        # workdir None: none of the trainer's workdir checks and writes (we only read there);
        # reads: the data must have the classes the run trained on
        try:
            r = setup(config, None, devices=devices, for_training=False, reads=workdir)
        except MeshSpecError as e:
            if runs_mesh:
                raise ConfigError(f"the run's {e} (the mesh it trained on, from its config; "
                                  "the evaluator may use its own)") from None  # fmt: skip
            raise
        if lock is None:
            lock = lock_records(out, jax.process_index())
        if from_epoch > r.plan.num_epochs:
            raise ConfigError(
                f"--from-epoch={from_epoch:g} is after the run's last epoch "
                f"({r.plan.num_epochs:g}): pass one from 0 to {r.plan.num_epochs:g}"
            )
        log(describe_mesh(r.mesh))
        evaluator = Evaluator(r, workdir, from_epoch)
        # a KeyboardInterrupt (no ``stop``) goes on to cli.main: its line and exit code 130
        return evaluator.loop(watch, poll_s, checked, liveness)
    finally:
        with signals.whole():  # a stop meanwhile waits for the records and the lock
            if evaluator is not None:
                evaluator.close()
            release()


def lock_records(out: str, process: int = 0) -> workdir_lock.Lock:
    """The evaluator's lock in ``out``, the folder made where missing. An evaluator that
    ends as this one starts may remove the folder, empty, between the two
    (``remove_if_empty``): then it is made again."""
    while True:
        checkpoint.ensure_writable(
            out, "evaluator directory", "the evaluator keeps its records in WORKDIR/evaluator"
        )
        try:
            return workdir_lock.acquire(out, process, role="evaluator")
        except FileNotFoundError:  # removed by the evaluator before this one
            continue


def remove_if_empty(out: str, lock) -> None:
    """Removes ``out`` if it holds nothing but ``lock``'s file, while the lock is still
    held: removed after the release, it could be the folder a second evaluator had just
    found and was about to lock. One that waits for the lock meanwhile finds the folder
    gone and makes it again (``lock_records``)."""
    try:
        if lock is not None:
            os.remove(lock.path)  # as lock.release() would, but still locked
        os.rmdir(out)  # only while empty: never an earlier call's records
    except OSError:
        pass
