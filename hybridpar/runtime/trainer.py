"""The trainer: a run's loop from its first step to its last, top to bottom.

    run = setup(config, workdir)   # hybridpar/runtime/run.py: config -> mesh -> data -> program
    summary = train(run)           # start, the loop over stages of steps, the summary

``train`` starts (the train state and ``LoopState`` from the workdir's latest checkpoint
or new, every stage's step compiled), runs the loop (for each batch: step, then the hooks:
progress log, evaluation, checkpoints), then writes the summary. Everything a resumed run
needs besides the train state is in ``LoopState``. SIGTERM or SIGINT stops the loop at the
next step boundary with a checkpoint; the same command resumes it
(``hybridpar/runtime/run_config.py`` says what a workdir may hold). Only the train CLI, tune and
tests drive it; every other tool builds its run with ``hybridpar/runtime/run.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from hybridpar.config import formatting
from hybridpar.config.curriculum import PlannedStage, describe
from hybridpar.config.errors import NonFinite, PeerLost, SaveFailed, StopRequested, WorkdirError
from hybridpar.parallel import partitioning
from hybridpar.parallel.mesh import describe_mesh
from hybridpar.program import compile_cache, optim
from hybridpar.program.state import init_sharded
from hybridpar.runtime import checkpoint, run_config, run_records, signals
from hybridpar.runtime.metrics import MetricsWriter
from hybridpar.runtime.run import (
    LoopState,
    Run,
    eval_pass,
    log,
    memory_report,
    memory_text,
    program_name,
    start_position,
)
from hybridpar.runtime.run_records import check_same_classes, last_data

# ---- The loop's state ---------------------------------------------------------------------------


def targets_met(config, loop: LoopState) -> bool:
    """``stop_at_target`` is on and every target set has been reached: the run ends here."""
    wanted = [m for m in ("top1", "top5") if config[f"target_{m}"] > 0]
    reached = loop.time_to_target or {}
    return bool(config.stop_at_target and wanted) and all(m in reached for m in wanted)


def host_batches(run: Run, stage: int, step: int, epoch: int, step_in_epoch: int):
    """This host's batches from a data position (the loop's, passed as values: a thread
    reads this ahead) to the run's last step, stage after stage, as one stream. Each stage
    is one input across its epochs (``train_batches(..., steps=)``), and the next stage's
    (at its own size and batch) is opened and its first batches made while the steps
    before it run, as MoXing's input did, instead of after them (``chain_ahead``)."""
    from hybridpar.input.prefetch import chain_ahead

    def segments(stage, step, epoch, step_in_epoch):  # (epoch, first step, steps, stage)
        for planned in run.plan.stages[stage:]:
            if step == planned.start_step:
                epoch, step_in_epoch = start_position(planned)
            if planned.end_step > step:
                yield epoch, step_in_epoch, planned.end_step - step, planned.stage
            step = planned.end_step

    def opener(epoch, step_in_epoch, n, st):
        kw = dict(global_batch=st.global_batch, image_size=st.image_size, min_scale=st.min_scale)
        return lambda: run.data.train_batches(epoch, step_in_epoch, steps=n, **kw)

    return chain_ahead(opener(*seg) for seg in segments(stage, step, epoch, step_in_epoch))


def global_batches(run: Run, loop: LoopState):
    """``host_batches`` from the loop's position, placed on the mesh ahead of the step
    (``data.prefetch`` deep). The caller takes each stage's steps from it in turn."""
    from hybridpar.input.prefetch import prefetch_to_mesh

    position = (loop.stage, loop.step, loop.epoch, loop.step_in_epoch)
    return prefetch_to_mesh(host_batches(run, *position), run.mesh, run.config.data.prefetch)


class Clock:
    """Where a run's wall time goes (summary.json's ``time_breakdown``): every moment from
    set-up on counts in exactly one part (``run_records.TIME_PARTS``), the one the last
    ``to`` named, so the parts add up to the wall time by construction and what is
    measured is which part each stretch of time belongs to. A resumed run starts from the
    parts its checkpoint saved (``add``), as its wall time does."""

    def __init__(self, start: float, part: str = "setup"):
        self.parts: dict[str, float] = {}
        self.part, self.since = part, start

    def to(self, part: str) -> str:
        """Counts the time since the last switch to the current part, then switches to
        ``part``; returns the part it leaves."""
        now = time.time()
        self.parts[self.part] = self.parts.get(self.part, 0.0) + now - self.since
        left, self.part, self.since = self.part, part, now
        return left

    @contextlib.contextmanager
    def within(self, part: str):
        """``part`` for the block, then back to the part it interrupted."""
        left = self.to(part)
        try:
            yield
        finally:
            self.to(left)

    def add(self, parts: dict) -> None:
        for k, v in parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v

    def totals(self) -> dict:
        """Seconds per part up to now, the current one included."""
        running = {self.part: time.time() - self.since}
        return {k: self.parts.get(k, 0.0) + running.get(k, 0.0) for k in self.parts | running}


def train_examples_change(last, info: dict) -> list | None:
    """``[before, now]``: the training examples of the last start's ``data`` record
    against the data this start opened, where they differ."""
    before, now = last and last.train_examples, info.get("train_examples")
    return [before, now] if before and now and before != now else None


def train_files_changed(last, info: dict) -> bool:
    """The same count of other training files (images swapped between starts): the train
    split's ``train_fingerprint`` differs (a record without one compares as unknown)."""
    before, now = last and last.train_fingerprint, info.get("train_fingerprint")
    return bool(before and now and before != now)


def furthest_step(recs) -> int:
    """The last step the run's records show done: a run resumed from an older checkpoint
    redoes the steps up to it."""
    return max((r.step for r in recs if r.event in ("train", "eval")), default=0)


def mesh_text(shape) -> str:
    """A mesh's axis sizes as a spec, the axes over one device left out: ``data:8``,
    ``data:4,fsdp:2``; ``data:1`` on one device."""
    return ",".join(f"{a}:{n}" for a, n in shape.items() if n > 1) or "data:1"


def mesh_devices(text: str) -> int:
    """The devices of a ``mesh_text``."""
    return math.prod(int(part.partition(":")[2]) for part in text.split(","))


def saved_start(recs, step: int, key: str) -> str | None:
    """``key`` (``mesh``, ``reduce_dtype``) as resolved on the start that saved the
    checkpoint at ``step``: its ``stage`` line's before the checkpoint's line. None where
    the records do not say (no such line, or one from before stage lines named it)."""
    value = found = None
    for r in recs:
        if r.event == "stage":
            value = getattr(r, key) if isinstance(getattr(r, key), str) else None
        elif r.event == "checkpoint" and r.step == step:
            found = value
    return found


def changed_note(changed: list[str], was: dict, now: dict) -> str:
    """The resume line's ``(config changed: ...)``: a mesh or gradient-sum dtype that
    resolves otherwise than on the checkpoint's start (``was``, ``now``: ``mesh``,
    ``reduce_dtype``) as old -> new, the mesh with the devices where their count changed."""
    if not changed:
        return ""
    names, why = list(changed), ""
    if "mesh" in names and was.get("mesh") not in (None, now["mesh"]):
        before, after = mesh_devices(was["mesh"]), mesh_devices(now["mesh"])
        devices = f" on {before} -> {after} devices" if before != after else ""
        names[names.index("mesh")] = f"mesh {was['mesh']} -> {now['mesh']}{devices}"
        why = "; the numbers are not bitwise the old mesh's (float sums in another order)"
    key = "comm.reduce_dtype"
    if key in names and was.get("reduce_dtype") not in (None, now["reduce_dtype"]):
        names[names.index(key)] = f"gradients summed in {was['reduce_dtype']} -> " + (
            f"{now['reduce_dtype']} ({key})")  # fmt: skip
    return f" (config changed: {', '.join(names)}{why})"


def gone_note(recs, resumed: int) -> str:
    """For the resume line: where the records' last checkpoint is newer than the one resumed
    (the newer ones deleted, or set aside as unreadable), the steps trained again."""
    saved = [r.step for r in recs if r.event == "checkpoint"]
    if not saved or saved[-1] <= resumed:
        return ""
    steps = (f"step {saved[-1]} is" if saved[-1] == resumed + 1 else
             f"steps {resumed + 1}-{saved[-1]} are")  # fmt: skip
    return (f"; the records go to step {saved[-1]}, whose checkpoint is not there: {steps} "
            "trained again")  # fmt: skip


# A loss more than this many times the run's first is taken as the run diverging: the
# checkpoints saved after the last loss below it may hold diverged weights.
LOSS_GROWTH = 10


@dataclasses.dataclass
class SaneLoss:
    """The run's first finite loss, and the last step whose loss was finite and at most
    LOSS_GROWTH times it: the checkpoints saved before that step hold sane weights."""

    first: float | None = None
    last: int = 0

    def see(self, step: int, loss: float | None) -> None:
        if loss is None or not math.isfinite(loss):
            return
        if self.first is None:
            self.first = loss
        if loss <= LOSS_GROWTH * self.first:
            self.last = step


def sane_losses(train, resumed: int | None) -> SaneLoss:
    """``SaneLoss`` of an earlier segment's train records (``RunRecords.train``) up to the
    checkpoint ``resumed``: where ``Progress`` takes up watching the losses. A line's loss
    is the mean over its interval, so this is as fine as the lines were."""
    sane = SaneLoss()
    for r in train:
        if resumed is not None and r.step <= resumed:
            sane.see(r.step, r.loss)
    return sane


def after_checkpoint(recs, from_wall_s: float, step: int | None) -> tuple[float, float]:
    """``(saving, lost)``: seconds the last earlier start ran after the snapshot of the
    checkpoint resumed from (at ``step``), as far as its last record shows (time after that
    record, and between the starts, is unknown): spent on the run, so its wall time counts
    them. ``saving``: that checkpoint's own save, which its snapshot could not hold (the
    whole save where the start ended there, waiting for it; else its blocking part);
    ``lost``: the rest, thrown away by the restart."""
    last = next((r.wall_s for r in reversed(recs) if r.wall_s is not None), None)
    if last is None:
        return 0.0, 0.0
    after = max(0.0, last - from_wall_s)
    saved = [r for r in recs if r.event == "checkpoint" and r.step == step]
    if not saved:
        return 0.0, after
    went_on = any(r.event == "train" and r.step > step for r in recs)
    saving = (saved[-1].blocking_s if went_on else saved[-1].total_s) or 0.0
    saving = min(saving, after)
    return saving, after - saving


# ---- Hooks: what happens after a step ---------------------------------------------------------


class Hook(Protocol):
    """What runs after each step, in order: ``Progress``, ``Evaluate``, the hooks passed to
    ``train``, then the ``Checkpointer`` (``start`` builds the list). A hook may read
    everything and change ``loop``'s bookkeeping; it asks the loop to stop at this step by
    raising ``errors.StopRequested(reason)``: the hooks after it do not run, and the run
    ends cleanly with ``summary["preempted"] = reason`` (no checkpoint of this step unless
    one was already saved). Any other exception fails the run."""

    def __call__(self, loop: LoopState, state, metrics: dict, stage: PlannedStage) -> None: ...


class Progress:
    """Train lines in metrics.jsonl and on stdout every ``log_every_s`` seconds (and before
    each eval). Fetching the metrics waits for the steps, so images/s is honest. A line's
    loss is the mean of its steps' losses, skipped ones included (None where one was not
    finite), ``skipped_steps`` counts its skipped steps and ``loss_scale`` is the scale
    in effect after them.

    Also counts the steps the train step skipped (non-finite loss or gradient): after
    ``max_nonfinite_steps`` in a row it raises ``NonFinite``. It looks at least every that
    many steps, so a diverged run stops within twice the limit whatever ``log_every_s``.
    And it watches every step's loss for the last one still sane (``SaneLoss``), so the
    error can tell the checkpoints saved before the loss grew from those that may hold
    diverged weights (``last_checkpoint_note``)."""

    def __init__(self, run: Run, writer: MetricsWriter, sane: SaneLoss | None = None):
        self.run, self.writer = run, writer
        self.pending, self.t0, self.step0 = [], time.time(), 0
        self.limit = run.config.max_nonfinite_steps
        self.counted = 0  # how many of `pending` count_skips has seen
        self.bad_in_a_row = 0
        self.unlogged = 0  # skipped steps count_skips has seen and no line has logged yet
        self.first_scale = 0.0  # the loss scale at the first step of the skipped run
        # earlier segments' from their records (``sane_losses``), then every step's
        self.sane = sane or SaneLoss()
        # set with NonFinite: the checkpoints from this step on may hold diverged weights
        self.suspect_from = 0

    def restart(self, loop: LoopState) -> None:
        """Time from now on counts as training (after set-up, compilation or evaluation)."""
        self.t0, self.step0 = time.time(), loop.step

    def __call__(self, loop: LoopState, state, metrics, stage: PlannedStage) -> None:
        self.pending.append(metrics)
        if len(self.pending) - self.counted >= self.limit:
            self.count_skips()
        if time.time() - self.t0 >= self.run.config.log_every_s:
            self.flush(loop, stage)

    def count_skips(self) -> None:
        """Counts the skipped steps in a row among the pending steps not yet seen, and
        watches their losses."""
        new = self.pending[self.counted :]
        seen = jax.device_get([(m["grads_finite"], m["loss"], m["loss_scale"]) for m in new])
        for i, (ok, loss, scale) in enumerate(seen):
            step = self.step0 + self.counted + i + 1
            self.sane.see(step, float(loss))
            self.bad_in_a_row = 0 if ok else self.bad_in_a_row + 1
            self.unlogged += not ok
            if self.bad_in_a_row == 1:
                self.first_scale = float(scale)
            if self.bad_in_a_row >= self.limit:
                raise NonFinite(self.too_many(step, float(scale)))
        self.counted = len(self.pending)

    def too_many(self, last: int, scale: float) -> str:
        """The error for ``max_nonfinite_steps`` skipped steps in a row ending at ``last``
        (``scale``: the loss scale that step used); sets ``suspect_from``."""
        c, n = self.run.config, self.bad_in_a_row
        first = last - n + 1
        head = (
            f"{n} steps in a row ({first}..{last}) had a non-finite loss or gradient "
            f"(max_nonfinite_steps={self.limit}); each was skipped, so the parameters are "
            f"those after step {first - 1}. "
        )
        # float16's loss scale halves at each skipped step: still above 1 and falling, it
        # has not backed off far enough yet (the gradients overflow, the weights are fine),
        # unless the skipped steps' losses say otherwise (grown past LOSS_GROWTH x the
        # first: the weights diverged, and more skipped steps would not help)
        backing_off = (
            c.precision.compute == "float16" and self.first_scale > scale > 1
            and self.sane.last >= last
        )  # fmt: skip
        # A step's loss is computed with the parameters after the step before it: the last
        # sane loss vouches for the checkpoints before its step. Outside a loss-scale
        # backoff, the first of the skipped steps in a row says the same of its own step.
        self.suspect_from = self.sane.last if backing_off else min(self.sane.last, first - 1)
        if backing_off:  # the default where it is lower, else below the scale reached
            initial = c.precision.loss_scale_initial
            suggest = 2.0**15 if initial > 2.0**15 else scale / 2
            return head + (
                f"The float16 loss scale was still backing off ({self.first_scale:g} at step "
                f"{first}, {scale:g} at step {last}, halved at each skipped step): lower "
                f"precision.loss_scale_initial (now {c.precision.loss_scale_initial:g}; "
                f"e.g. {suggest:g}) or raise max_nonfinite_steps"
            )
        low = (
            "compute in bfloat16 (float16's loss scale is down to 1)"
            if c.precision.compute == "float16"
            else "use bfloat16 / float16 with loss scaling instead of pure low precision"
        )
        return head + (
            "The run diverged: lower optim.base_lr, add warmup (optim.warmup_epochs), or " + low
        )

    def flush(self, loop: LoopState, stage: PlannedStage) -> None:
        if not self.pending:
            return
        self.count_skips()
        fetched = jax.device_get(self.pending)
        now = time.time()
        # Every step's loss, the skipped steps' too: a float16 step skipped because its
        # scaled gradients overflowed computed a true loss. nan (null in the record) only
        # where a step's loss itself was not finite, so a skipped line with a loss is an
        # overflow, and one without a loss a bad batch or a diverged run.
        losses = [float(f["loss"]) for f in fetched]
        loss = float(np.mean(losses)) if all(map(math.isfinite, losses)) else math.nan
        skipped = sum(not bool(f["grads_finite"]) for f in fetched)
        loop.skipped_steps += skipped  # what count_skips saw of these, now logged
        self.unlogged = 0
        steps, dt = loop.step - self.step0, now - self.t0
        batch = stage.stage.global_batch
        loop.train_time_s += dt
        loop.train_images += steps * batch
        total = self.run.plan.total_steps
        epoch = self.run.plan.epoch_at(loop.step)
        self.writer.write(
            "train",
            loop.step,
            epoch,
            loss=loss if math.isfinite(loss) else None,  # JSON has no NaN
            lr=float(fetched[-1]["lr"]),
            momentum=float(fetched[-1].get("momentum", self.run.config.optim.momentum)),
            images_per_s=round(steps * batch / dt, 2),
            image_size=stage.stage.image_size,
            global_batch=batch,
            stage=stage.index,
            skipped_steps=skipped,
            # the scale in effect now, which the next step uses and a checkpoint of this
            # step holds, not the one the last step used (a skip halved it since)
            loss_scale=float(fetched[-1]["next_loss_scale"]),
        )
        eta = formatting.duration((total - loop.step) * dt / steps)
        stages = len(self.run.plan.stages)
        log(
            f"train step {loop.step:>6}/{total}  epoch {epoch:6.2f}  loss {loss:.4f}  "
            f"{steps * batch / dt:8.1f} img/s  ETA {eta}"
            + (f"  skipped {skipped}" if skipped else "")
            # a curriculum's line says its stage: its img/s is at that size and batch
            + (f"  stage {stage.index}: {stage.stage.image_size}px b{batch}"
               if stages > 1 else "")  # fmt: skip
        )
        self.pending, self.counted = [], 0
        self.restart(loop)


def stage_line(stage: PlannedStage, step: int, epoch: float) -> str:
    """The line a curriculum prints as a stage begins at ``step`` (or a resume goes on
    inside it), its figures as set-up's plan lines (``curriculum.describe``) name them."""
    st = stage.stage
    begins = "begins" if step == stage.start_step else "goes on"
    return (
        f"stage {stage.index} {begins} at step {step} (epoch {epoch:.2f}): {st.image_size} px, "
        f"global batch {st.global_batch}"
        + (f", min crop scale {st.min_scale:g}" if st.cropped else "")
        + ("" if st.momentum is None else f", momentum {st.momentum:g}")
    )


class Evaluate:
    """Every ``eval_every_epochs`` (and after the last step): the eval split, an ``eval``
    line, and the time to ``target_top1`` the first time it is reached."""

    def __init__(self, run: Run, writer: MetricsWriter, progress: Progress, clock: Clock):
        self.run, self.writer, self.progress, self.clock = run, writer, progress, clock
        self.every = run.config.eval_every_epochs

    def due(self, loop: LoopState) -> bool:
        if loop.step >= self.run.plan.total_steps:
            return True
        if self.every <= 0:
            return False
        plan = self.run.plan
        crossed = math.floor(plan.epoch_at(loop.step) / self.every + 1e-6)
        return crossed > math.floor(plan.epoch_at(loop.step - 1) / self.every + 1e-6)

    def __call__(self, loop: LoopState, state, metrics, stage: PlannedStage) -> None:
        if not self.due(loop):
            return
        self.progress.flush(loop, stage)  # waits for the steps in flight: train time
        with self.clock.within("eval"):
            rec = eval_pass(self.run, state, loop.step, self.writer)
        loop.last_eval = rec
        if loop.best_eval is None or rec["top1"] > loop.best_eval["top1"]:
            loop.best_eval = rec
        reached = loop.time_to_target or {}
        for metric in ("top1", "top5"):
            target = self.run.config[f"target_{metric}"]
            if metric not in reached and target > 0 and rec[metric] >= target:
                reached[metric] = {
                    "target": target,
                    "value": rec[metric],
                    "step": rec["step"],
                    "epoch": rec["epoch"],
                    "wall_s": rec["wall_s"],  # from the start: compilation, eval included
                    "wall_s_without_compile": round(rec["wall_s"] - loop.compile_s, 3),
                }
                at = f"{rec['wall_s']:.1f}s (epoch {rec['epoch']:.2f})"
                log(f"reached {metric} {target:g} at {at}")
        loop.time_to_target = reached or None
        self.progress.restart(loop)  # eval time is not training throughput


class Checkpointer:
    """A checkpoint every ``checkpoint.every_steps`` steps and/or ``every_minutes``
    minutes, at the last step, and when a stop was requested (``preemption``: our signal
    flag; on several processes, JAX's preemption sync point, so all save the same step);
    each save is a ``checkpoint`` event once it is committed. Runs last among the hooks,
    so the loop state it saves includes this step's evaluation."""

    def __init__(self, run: Run, writer: MetricsWriter, progress: Progress, clock: Clock,
                 saver, preemption):  # fmt: skip
        self.run, self.writer, self.progress, self.clock = run, writer, progress, clock
        self.saver, self.preemption = saver, preemption
        self.every_steps = run.config.checkpoint.every_steps
        self.every_s = run.config.checkpoint.every_minutes * 60
        self.last_save = time.time()
        self.config = run_config.config_dict(run.config)
        self.config_written = False  # config.json, at this start's first save (record_config)
        self.finished = False

    def due(self, loop: LoopState) -> bool:
        return (
            loop.step >= self.run.plan.total_steps
            or targets_met(self.run.config, loop)
            or (self.every_steps > 0 and loop.step % self.every_steps == 0)
            or (self.every_s > 0 and time.time() - self.last_save >= self.every_s)
        )

    def __call__(self, loop: LoopState, state, metrics, stage: PlannedStage) -> None:
        self.events()
        stop = self.preemption.requested is not None
        if stop:
            self.preemption.say_unsaid()
        stop = self.saver.manager.reached_preemption(loop.step) or stop
        if stop or self.due(loop):
            self.save(loop, state, stage)
        if stop and loop.step < self.run.plan.total_steps:  # at the last step: just finish
            raise StopRequested(self.preemption.requested or "preemption sync point")

    def save(self, loop: LoopState, state, stage: PlannedStage) -> None:
        if self.saver.latest_step() == loop.step:
            return
        self.progress.flush(loop, stage)  # so the saved loop state counts every step's time
        if not self.config_written:  # a changed config on a resume: from its first checkpoint
            run_config.write_config(self.run.workdir, self.run.config)
            self.config_written = True
        with self.clock.within("checkpoint"):
            loop.wall_s, loop.time_parts = self.writer.wall_s(), self.clock.totals()
            self.saver.save(loop.step, state, loop.to_dict(), self.config)
        self.last_save = time.time()
        self.progress.restart(loop)  # the blocking part is a checkpoint's, not training's
        self.events()

    def finish(self) -> str | None:
        """Waits for the save in flight and closes the manager; the save's error, if any.
        A second call does nothing."""
        if self.finished:
            return None
        self.finished = True
        try:
            self.events(wait=True)
        except SaveFailed as e:
            return str(e)
        finally:
            self.saver.close()
        return None

    def events(self, wait: bool = False) -> None:
        """A ``checkpoint`` line for each save committed since the last call."""
        for rec in self.saver.finished(wait):
            step = rec.pop("step")
            self.writer.write("checkpoint", step, self.run.plan.epoch_at(step), **rec)


# ---- The run -------------------------------------------------------------------------------------

MAX_STEPS_IN_FLIGHT = 2  # dispatched ahead of the device (see run_stages)
STOP_POLL_S = 0.2  # how often a wait for a compiling step looks for a requested stop


def compile_all(run: Run, first_stage: int) -> dict:
    """The train step of every stage from the one the run starts in, and the eval step: now,
    or the later stages' in a background thread while the first one trains
    (``compile_ahead``), so that no stage switch waits for the compiler. Logs the per-device
    memory of every program compiled before the first step, the largest first (a later
    stage at a larger image size can need more than the first), and returns the largest's."""
    c, program = run.config, run.program
    first, *later = run.plan.stages[first_stage:] or run.plan.stages[-1:]
    later = [("train", s.stage.global_batch, s.stage.image_size) for s in later]
    background = c.compile_ahead == "background" or (
        c.compile_ahead == "auto" and jax.default_backend() != "cpu"
    )
    now = [("train", first.stage.global_batch, first.stage.image_size),
           ("eval", c.eval_batch, c.data.image_size), *([] if background else later)]  # fmt: skip
    # each said as it starts: a large model's compile takes minutes, with nothing else to show
    # each once (stages of one batch and size share a step); --compiled's are loaded
    todo = [k for k in dict.fromkeys(now) if k not in program.compiled_programs()]
    for i, (kind, batch, size) in enumerate(todo, 1):
        log(f"compiling the {kind} step for batch {batch} at {size} px ({i}/{len(todo)}) ...")
        (program.train_step if kind == "train" else program.eval_step)(batch, size)
    if background:
        program.compile_in_background(later)
    text, mem = memory_report(program.compiles)
    if program.compiling:
        text += (
            f" ({program.compiling} later stage(s) compiling in the background: "
            "each one's memory is in its compile line; compile_ahead=before gives them all here)"
        )
    log(text)
    return mem


def record_compiles(run: Run, writer: MetricsWriter, loop: LoopState, written: int) -> int:
    """One ``compile`` line per compilation from index ``written`` on (each with its own
    program's per-device memory), their time on the critical path (the compile itself, or
    the wait for a background one) added to ``loop.compile_s``; returns how many are
    written now."""
    for rec in run.program.compiles[written:]:
        writer.write("compile", loop.step, run.plan.epoch_at(loop.step), **rec)
        loop.compile_s += run_records.waited_s(rec.get("background"), rec["compile_s"],
                                               rec.get("wait_s"))  # fmt: skip
        if rec.get("background"):
            log(f"{rec['program']} step for batch {rec['batch']} at {rec['image_size']} px: "
                f"compiled in the background in {rec['compile_s']:.1f}s, waited "
                f"{rec['wait_s']:.1f}s for it; per-device memory "
                f"{memory_text(rec.get('memory_per_device_bytes') or {})}")  # fmt: skip
    return len(run.program.compiles)


def restore_or_init(run: Run, saver: checkpoint.Checkpoints):
    """``(state, loop, resumed from step or None, the checkpoint's config or None)``: the
    latest checkpoint's, read straight into this program's shardings, or a new state at
    step 0."""
    program = run.program
    restored = saver.restore(program.abstract_state())
    if restored is None:
        state = init_sharded(program.init, program.shardings, jax.random.key(run.config.seed))
        if run.config.init_from:  # a trained or pruned run's weights, e.g. hybridpar.prune's
            from hybridpar.runtime.trained import init_source, start_from

            src = run.init_from or init_source(run.config.init_from, program)
            state = start_from(src, state, program)
            # said: nothing else on screen or in the records shows the weights were loaded
            log(f"started from the weights of {os.path.abspath(src.workdir)} (its checkpoint "
                f"at step {src.step}; init_from)")  # fmt: skip
        elif hasattr(program.model, "data_init"):  # a layer set from the data (airbench's)
            st = run.plan.stages[0].stage
            batches = run.data.train_batches(
                0, global_batch=st.global_batch, image_size=st.image_size, min_scale=st.min_scale
            )
            state = program.data_init(state, batches)
        return state, LoopState(seed=run.config.seed), None, None
    step, state, loop, config = restored
    return state, LoopState.from_dict(loop), step, config


def synthetic_note(config) -> str:
    """The line a run on synthetic data says: the ImageNet recipes fall back to it where no
    data path is given, and their plan then reads like the real run's. With a target, a
    warning: random labels never reach it."""
    c = config
    targets = [f"{k}={c[k]:g}" for k in ("target_top1", "target_top5") if c[k] > 0]
    what = (f"synthetic data (data.name=synthetic): random images and labels, "
            f"{c.data.train_examples} an epoch, for timing")  # fmt: skip
    if not targets:
        return f"data: {what}"
    return (f"warning: {what}; {' and '.join(targets)} cannot be reached: give the recipe "
            "its data's path (see the experiment file's docstring) to train for it")  # fmt: skip


def fresh_loss_scale(config, state, held: dict | None):
    """``state`` resumed from a checkpoint of a run that did not compute in float16, whose
    loss scale is its constant 1: in float16 (``--allow-config-change``) the scale starts at
    ``precision.loss_scale_initial``, as a new float16 run's does, not at 1, where it would
    wait ``loss_scale_period`` finite steps to grow while small gradients underflow."""
    p = config.precision
    was = ((held or {}).get("precision") or {}).get("compute")
    if p.compute != "float16" or was in (None, "float16"):
        return state
    log(f"the checkpoint's run computed in {was}: float16's loss scale starts at "
        f"{p.loss_scale_initial:g} (precision.loss_scale_initial)")  # fmt: skip
    def reset(ls):
        scale = jnp.full_like(ls.scale, p.loss_scale_initial)
        return ls.replace(scale=scale, good_steps=jnp.zeros_like(ls.good_steps))

    # jitted into the restored arrays' own shardings: the step takes them as they were
    places = jax.tree.map(lambda x: x.sharding, state.loss_scale)
    return state.replace(loss_scale=jax.jit(reset, out_shardings=places)(state.loss_scale))


def check_resumed_plan(plan, loop: LoopState, step: int, grown, directory: str) -> None:
    """The steps a resumed checkpoint trained stay as they were: this config's plan must
    end after them, and (the data unchanged: that has its own warning) put as many
    examples before them as the checkpoint has seen. A batch changed on a resume
    (``--allow-config-change``) would replan them: step N at another batch is another
    epoch, so the run would train epochs over again and its LR schedule jump back."""
    if step > plan.total_steps:
        raise WorkdirError(
            f"the checkpoint at step {step} in {directory} is past this config's last step, "
            f"{plan.total_steps} (epoch {plan.num_epochs:g}): the run has trained further "
            "than it asks for; pass a later --config.num_epochs (or stages' end epoch), or "
            "use a new --workdir"
        )
    seen, planned = loop.samples_seen, plan.samples_before(step)
    if grown or not seen or seen == planned:
        return
    at = plan.stages[plan.stage_index_at(max(step - 1, 0))]
    per_epoch = at.steps_per_epoch * at.stage.global_batch
    raise WorkdirError(
        f"the checkpoint at step {step} in {directory} has trained {seen:,} examples "
        f"(about {seen / per_epoch:.3g} epochs), but this config's plan puts {planned:,} "
        f"(epoch {plan.epoch_at(step):.3g}) before that step: a changed batch (global_batch, "
        "the stages' batches, or a mesh that scales them) cannot apply to the steps "
        "already trained, or the run would train epochs again; keep the batch up to the "
        "checkpoint's epoch and change it in a later stage (--config.stages=END_EPOCH:"
        "SIZE-BATCH_PER_DEVICE,...), or use a new --workdir"
    )


def lr_change(run: Run, held: dict | None, loop: LoopState, step: int):
    """``(checkpoint's LR, this config's LR)`` at ``step`` where they differ by more than
    1%: a longer ``num_epochs`` on a finished run restarts the decay from a higher LR, say.
    None where they agree, or where the checkpoint's plan cannot be made again here."""
    from hybridpar.config.curriculum import plan_stages, stages_from_config
    from hybridpar.config.schema import from_saved

    dp = run.plan.data_parallel
    try:
        old = from_saved(held or {}, "the checkpoint's config")
        old_plan = plan_stages(stages_from_config(old, dp), run.data.steps_for, data_parallel=dp)
    except Exception:  # noqa: BLE001 - only a warning: a config this version reads otherwise
        return None
    if old_plan.samples_before(step) != loop.samples_seen or step > old_plan.total_steps:
        return None  # its batches were not these (another mesh's per-device stages)
    before = float(optim.make_schedule(old.optim, old_plan)(step))
    now = float(run.program.schedule(step))
    return (before, now) if abs(now - before) > 0.01 * max(abs(before), abs(now)) else None


def lr_change_warning(moved: tuple[float, float], step: int, changed: list[str],
                      stages: bool = True) -> str:  # fmt: skip
    """``lr_change``'s warning, naming the changed keys the schedule reads (all of them
    where none is one of those: something else moved it). The mesh moves it only through
    ``stages``' per-device batches."""
    keys = tuple(k for k in run_records.SCHEDULE_KEYS if stages or k != "mesh")
    named = [k for k in changed if k.startswith(keys)] or changed
    return (
        f"warning: the learning rate at step {step} is {moved[1]:.4g} under this config, "
        f"{moved[0]:.4g} under the checkpoint's ({', '.join(named)} changed its schedule): "
        f"the run goes on at {moved[1]:.4g}"
    )


def enter_next_stage(plan, loop: LoopState) -> None:
    """Moves ``loop`` to the stage that runs its next step, and to that stage's data
    position where it begins there. A checkpoint saved at a stage's last step holds the
    finished stage (``LoopState.stage`` changes only when the loop enters the next one):
    resumed from it, the run would compile that stage's step and mark it again for none
    of its steps. Inside a stage (and at step 0) nothing changes."""
    stage = plan.stages[plan.stage_index_at(loop.step)]
    loop.stage = stage.index
    loop.enter(stage)


def release(run: Run) -> None:
    """The workdir's lock, for the next trainer (also released by the OS if we die)."""
    if run.lock is not None:
        run.lock.release()


@dataclasses.dataclass
class Training:
    """A started run: what its loop and its summary share."""

    run: Run
    writer: MetricsWriter
    saver: checkpoint.Checkpoints
    state: object
    loop: LoopState
    resumed: int | None  # the checkpoint's step it resumed from
    memory: dict  # the largest program's per-device memory
    progress: Progress
    checkpointer: Checkpointer
    preemption: signals.Preemption
    hooks: list
    batches: object  # every stage's, in order, read ahead across switches
    written: int  # compile lines written so far
    clock: Clock  # where the wall time goes
    redo_until: int  # the steps up to it were done before the restart: they are redone


def train(run: Run, hooks=()) -> dict:
    """Trains ``run`` to its last step, from the workdir's latest checkpoint if it holds
    one; returns (and writes) the summary. ``hooks``: more ``Hook``s, run after each step
    before the checkpointer (tune's pruner, tests' stops and probes)."""
    if run.finished is not None:
        log(f"{run.workdir} holds a run that completed ({run.finished['steps']} steps): "
            "nothing to do; pass a new --workdir to train again")  # fmt: skip
        release(run)
        return run.finished
    t = start(run, hooks)
    try:
        preempted = run_stages(t)
    except NonFinite as e:  # no save after it: the checkpoints on disk stay as they were
        failure = str(e) + last_checkpoint_note(t)
        end(t, failure=failure)
        raise NonFinite(failure) from None
    except BaseException as e:  # recorded in the summary, then raised as it was
        end(t, failure=f"{type(e).__name__}: {e}")
        if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
            raise peer_lost(t, e) from None
        raise
    summary, save_error = end(t, preempted=preempted)
    if save_error:
        raise SaveFailed(save_error)
    return summary


def start(run: Run, hooks) -> Training:
    """Everything between set-up and the first step: the config recorded, the train state
    restored or new, the ``resume`` and ``data`` lines, every stage's step compiled (or
    compiling in the background) and the hooks."""
    c, program, plan = run.config, run.program, run.plan
    clock = Clock(run.start_time)  # set-up began in setup()
    log(describe_mesh(run.mesh))
    log(program.sync.choice)
    if c.optim.frozen:
        log(optim.describe_frozen(c.optim.frozen, program.abstract.params))
    saver = checkpoint.Checkpoints(
        checkpoint.checkpoint_dir(c, run.workdir),
        max_to_keep=c.checkpoint.max_to_keep,
        async_save=c.checkpoint["async"],
    )
    state, loop, resumed, held_config = restore_or_init(run, saver)
    if resumed is not None:
        state = fresh_loss_scale(c, state, held_config)
    # Steps an earlier segment recorded: redone from the checkpoint (or from step 0 when it
    # was killed before its first checkpoint, which leaves records but nothing to resume).
    recorded, _ = run_records.read_records(f"{run.workdir}/metrics.jsonl")
    redo_until = furthest_step(recorded)
    last = last_data(recorded) if resumed is not None else None
    grown = train_examples_change(last, run.data.info)
    swapped = not grown and train_files_changed(last, run.data.info)
    if resumed is not None:  # before anything is written or compiled
        check_same_classes(last, run.data.info, resumed, saver.directory)
        check_resumed_plan(plan, loop, resumed, grown, saver.directory)
    enter_next_stage(plan, loop)
    # changed_keys: against the checkpoint resumed from, not config.json (a file anyone may edit)
    held = None if resumed is None else (resumed, held_config)
    changed = run_config.record_config(run.workdir, c, held)
    # the same mesh spec may resolve otherwise on other devices (data:-1 on 8, then on 1),
    # and reduce_dtype=auto otherwise under another comm.mode (a free key)
    now = {"mesh": mesh_text(run.mesh.shape), "reduce_dtype": program.sync.summed_in}
    was = {k: saved_start(recorded, resumed, k) for k in now} if resumed is not None else {}
    for key, name in (("mesh", "mesh"), ("reduce_dtype", "comm.reduce_dtype")):
        if was.get(key) not in (None, now[key]) and name not in changed:
            changed.append(name)
    if resumed is not None:  # the checkpoint read (an unreadable newer one was skipped)
        signals.note_resume(resumed, saver.directory)
    clock.add(loop.time_parts)  # the earlier segments', up to the checkpoint
    log(
        "parameter and optimizer-state placement:\n"
        + partitioning.sharding_table(program.shardings, program.abstract)
    )
    log(describe(plan))
    if c.data.name == "synthetic":
        log(synthetic_note(c))
    # wall_s goes on from where the checkpoint left it, plus what the last start spent after
    # it: this segment started that much earlier
    saving, lost = after_checkpoint(recorded, loop.wall_s, resumed)
    clock.add({k: v for k, v in (("checkpoint", saving), ("lost", lost)) if v})
    # TensorBoard drops an earlier start's points of the steps this one records again (those
    # after the checkpoint; all of them without one, as the resume line says below)
    purge = resumed + 1 if resumed is not None else (0 if recorded else None)
    writer = MetricsWriter(run.workdir, run.start_time - loop.wall_s - saving - lost, purge)
    # an earlier segment's records after the checkpoint (all of them, without one) are
    # superseded from here: a start stopped before its first step leaves some too
    if resumed is not None or recorded:
        writer.write("resume", loop.step, plan.epoch_at(loop.step), from_step=resumed or 0,
                     from_wall_s=round(loop.wall_s, 3), saving_s=round(saving, 3) or None,
                     lost_s=round(lost, 3) or None,
                     data_epoch=loop.epoch,
                     data_step_in_epoch=loop.step_in_epoch, directory=saver.directory,
                     changed_keys=changed, train_examples_changed=grown,
                     train_files_changed=swapped or None)  # fmt: skip
    if resumed is not None:
        log(f"resumed from the checkpoint at step {resumed} in {saver.directory}"
            + changed_note(changed, was, now)
            + (f"; the {lost:.1f}s the last start ran after it count in the wall time"
               if lost >= 1 else "")
            + gone_note(recorded, resumed))  # fmt: skip
    # (without a checkpoint the run starts again at step 0: no LR to compare)
    moved = lr_change(run, held_config, loop, resumed) if changed and resumed is not None else None
    if moved:
        log(lr_change_warning(moved, resumed, changed, bool(run.config.stages)))
    if swapped:  # other files of the same count: the plan stands
        log(f"warning: the training data changed since the run's last start (other files, "
            f"the same {run.data.info['train_examples']} examples): from step {resumed} the "
            "run trains on the new files; to train on the old data, restore it and run the "
            "same command again")  # fmt: skip
    if grown:
        log(f"warning: the training data changed since the run's last start ({grown[0]} -> "
            f"{grown[1]} examples): from step {resumed} the plan has {plan.total_steps} steps "
            f"({plan.num_epochs:g} epochs of the new data), so the epochs and the LR "
            "schedule follow the new size; to train on the old data, restore it "
            "and run the same command again")  # fmt: skip
    if resumed is None and redo_until:
        log(f"no checkpoint in {saver.directory}: the {redo_until} steps recorded before it "
            "stopped were not saved (checkpoint.every_steps sets how often); training again "
            "from step 0")  # fmt: skip
    elif resumed is None and recorded:
        log("starting again: the run's last start stopped before its first step")
    writer.write("data", loop.step, plan.epoch_at(loop.step), **run.data.info)
    with clock.within("compile"):
        mem = compile_all(run, loop.stage)
    before = loop.compile_s  # a resumed run's earlier segments
    written = record_compiles(run, writer, loop, 0)
    compile_s = loop.compile_s - before
    cached = sum(r["cache_hit"] for r in program.compiles)
    # programs loaded from a --compiled file were not compiled by this start: said apart
    loaded = [r["loaded_from"] for r in program.compiles if r.get("loaded_from")]
    built = len(program.compiles) - len(loaded)
    made = [f"loaded {len(loaded)} programs from {loaded[0]}"] if loaded else []
    if built or not loaded:
        made.append(
            f"compiled {built} programs"
            + (f" ({cached} loaded from {compile_cache.active()})" if cached else "")
        )
    pending = program.compiling
    left = max(plan.total_steps - loop.step, 0)  # a resumed run's
    log(
        f"{' and '.join(made)} in {compile_s:.1f}s"
        + (f", {pending} more compiling in the background" if pending else "")
        + f"; training {plan.total_steps} steps"
        + (" in all" if loop.step else "")
        + f" ({plan.num_epochs:g} epoch{'s' * (plan.num_epochs != 1)}, {len(plan.stages)} stage(s))"
        + (f", {left} to go from step {loop.step}" if loop.step else "")
    )
    earlier = run_records.read_run(run.workdir).train if recorded else []
    progress = Progress(run, writer, sane_losses(earlier, resumed))
    preemption = signals.Preemption(saver.directory)
    checkpointer = Checkpointer(run, writer, progress, clock, saver, preemption)
    hooks: list[Hook] = [progress, Evaluate(run, writer, progress, clock), *hooks, checkpointer]
    batches = global_batches(run, loop)
    preemption.install()
    return Training(run, writer, saver, state, loop, resumed, mem, progress, checkpointer,
                    preemption, hooks, batches, written, clock, redo_until)  # fmt: skip


def compiled_step(t: Training, stage: PlannedStage):
    """``stage``'s train step, waiting for its background compile if it still runs. A stop
    requested meanwhile (a signal: ``Preemption.requested``) saves a checkpoint at this step,
    the stage boundary, and stops the run there (the checkpointer's ``StopRequested``), at
    once, not after the compile (minutes on an accelerator) and a step more. On several
    processes no signal sets the flag: they stop at the next step's sync point, as before."""
    program, st = t.run.program, stage.stage
    while not program.wait_compiled(STOP_POLL_S, "train", st.global_batch, st.image_size):
        if t.preemption.requested is not None:
            t.checkpointer(t.loop, t.state, None, stage)  # saves, then raises StopRequested
    return program.train_step(st.global_batch, st.image_size)


def run_stages(t: Training) -> str | None:
    """The loop: each stage's steps, each step followed by the hooks, until the last step,
    the targets (``stop_at_target``) or a requested stop; returns the stop's reason."""
    run, loop = t.run, t.loop
    c, plan = run.config, run.plan
    # Steps dispatched but not yet computed. JAX dispatch returns at once, so without a bound
    # the loop would run up to max_nonfinite_steps steps ahead of the device, and a SIGTERM's
    # save would wait for all of them. Two in flight keep the device busy.
    in_flight = collections.deque()
    try:
        for stage in plan.stages[loop.stage :]:
            if targets_met(c, loop):
                break
            st = stage.stage
            # before entering the stage: a stop while it compiles saves the loop as the last
            # step left it, the checkpoint a stop at that step would have written
            with t.clock.within("compile_wait"):  # compiled ahead, or compiling still
                train_step = compiled_step(t, stage)
            loop.enter(stage)
            t.written = record_compiles(run, t.writer, loop, t.written)
            # (inside the stage on a resume: the step and its epoch, as every record has)
            t.writer.write("stage", loop.step, plan.epoch_at(loop.step), stage=stage.index,
                           image_size=st.image_size, global_batch=st.global_batch,
                           min_scale=st.min_scale, steps=stage.num_steps,
                           data_parallel=plan.data_parallel,
                           mesh=mesh_text(run.mesh.shape),
                           reduce_dtype=run.program.sync.summed_in)  # fmt: skip
            if len(plan.stages) > 1:  # the switch said where it happens, not only recorded
                log(stage_line(stage, loop.step, plan.epoch_at(loop.step)))
            t.progress.restart(loop)
            batches = itertools.islice(t.batches, stage.end_step - loop.step)
            while True:
                t.clock.to("input_wait")
                batch = next(batches, None)
                # the step, and the hooks' waits for it (a redone step's in "redone")
                t.clock.to("redone" if loop.step < t.redo_until else "train")
                if batch is None:
                    break
                # a named step for the profiler; and no implicit host-to-device copy in the
                # step's call: the batch and state are on the devices, anything else is a bug
                with jax.profiler.StepTraceAnnotation("train", step_num=loop.step), \
                        jax.transfer_guard("disallow"):  # fmt: skip
                    t.state, metrics = train_step(t.state, batch)
                in_flight.append(metrics["loss"])
                if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                    in_flight.popleft().block_until_ready()
                loop.advance(stage)
                for hook in t.hooks:
                    hook(loop, t.state, metrics, stage)
                # saved by the checkpointer above; at the last step nothing is stopped early
                # (the summary's stopped_at_target is false), so nothing is said
                if targets_met(c, loop) and loop.step < plan.total_steps:
                    log(f"every target reached at step {loop.step}/{plan.total_steps}: "
                        "stopping there (stop_at_target)")  # fmt: skip
                    break
            t.progress.flush(loop, stage)  # a stage's steps are logged at its own batch
    except StopRequested as e:  # a hook's request (Hook), a signal's by the checkpointer
        return str(e)
    return None


def peer_lost(t: Training, e: Exception) -> PeerLost:
    """A runtime error on several processes: a collective whose peer is gone (gloo's
    "Connection closed by peer", a NCCL or ICI timeout), said in one line with the way on."""
    first = " ".join(str(e).split())[:200]
    last = t.saver.latest_step()
    where = f"from step {last}" if last is not None else "from step 0 (no checkpoint yet)"
    return PeerLost(
        f"a step across the run's {jax.process_count()} processes failed at step "
        f"{t.loop.step + 1} ({type(e).__name__}: {first}): another process has probably "
        f"stopped; start every process again with the same command (and the same JAX_* "
        f"variables) to resume {where}"
    )


def last_checkpoint_note(t: Training) -> str:
    """For a diverged run: the checkpoint to resume from, if one was saved before its loss
    grew (``Progress.suspect_from``), and the failed save if any. The later checkpoints
    may hold the diverged weights: resuming takes the newest, so they must go first."""
    error = t.checkpointer.finish()
    where, steps = t.saver.directory, t.saver.committed_steps()
    good = [s for s in steps if s < t.progress.suspect_from]
    later = ", ".join(str(s) for s in steps if s >= t.progress.suspect_from)
    if not steps:
        note = "; no checkpoint was saved before it (checkpoint.every_steps sets how often)"
    elif not good:
        note = (
            f"; the checkpoints in {where} (steps {later}) were saved after the loss was last "
            "sane and may hold diverged weights: start again with the changed config in a "
            "new --workdir"
        )
    elif not later:
        note = (
            f"; the last checkpoint, step {good[-1]} in {where}, was saved before the loss "
            "grew: resume from it with the changed config and --allow-config-change"
        )
    else:
        several = "," in later
        note = (
            f"; the checkpoint{'s' if several else ''} of step{'s' if several else ''} "
            f"{later} in {where} {'were' if several else 'was'} saved after the loss was last "
            f"sane and may hold diverged weights: move {'them' if several else 'it'} out of "
            f"{where} and resume from step {good[-1]}'s with the changed config and "
            "--allow-config-change"
        )
    return note + (f" ({error})" if error else "")


def part_order(part: str) -> int:
    order = list(run_records.TIME_PARTS)
    return order.index(part) if part in order else len(order)


def end(t: Training, failure: str | None = None, preempted: str | None = None):
    """Stops the input and background threads, waits for the save in flight (committed
    before we may exit), writes the summary and releases the workdir, whether the loop
    ended, stopped or failed. Returns ``(summary, the failed save's error or None)``."""
    run, loop, saver = t.run, t.loop, t.saver
    c, program, plan = run.config, run.program, run.plan
    t.batches.close()  # stops the prefetch thread
    program.stop_background()
    t.preemption.ending()  # its handlers stay until the records are written (below)
    t.clock.to("checkpoint")  # the save in flight
    save_error = t.checkpointer.finish()
    failure = failure or save_error
    parts, wall_s = t.clock.totals(), t.writer.wall_s()
    summary = {
        "mesh": dict(run.mesh.shape),
        "steps": loop.step,
        "epochs": round(plan.epoch_at(loop.step), 4),
        "total_steps": plan.total_steps,
        "completed": not failure
        and not preempted
        and (loop.step >= plan.total_steps or targets_met(c, loop)),
        "stopped_at_target": targets_met(c, loop) and loop.step < plan.total_steps,
        "error": failure,
        "preempted": preempted,
        "resumed_from": t.resumed,
        "latest_checkpoint": saver.latest_step(),
        "final_eval": loop.last_eval,
        "best_eval": loop.best_eval,
        "wall_s": round(wall_s, 3),
        "compile_s": round(loop.compile_s, 3),  # every segment's
        "time_breakdown": {k: round(parts[k], 3) for k in sorted(parts, key=part_order)},
        "goodput": round(parts.get("train", 0.0) / wall_s, 4) if wall_s > 0 else None,
        "train_images_per_s": (
            round(loop.train_images / loop.train_time_s, 2) if loop.train_time_s else None
        ),
        "target_top1": c.target_top1 if c.target_top1 > 0 else None,
        "target_top5": c.target_top5 if c.target_top5 > 0 else None,
        "time_to_target": loop.time_to_target,
        # the earlier segments' up to the checkpoint resumed from (the loop state counts
        # them), and this start's, the ones that stopped it included
        "skipped_steps": loop.skipped_steps + t.progress.unlogged,
        "memory_per_device_bytes": t.memory,  # the largest program's, named in "program"
        "memory_by_program": [
            {"name": program_name(r), "bytes": r.get("memory_per_device_bytes") or {}}
            for r in program.compiles
        ],
        "stages": [dataclasses.asdict(s.stage) | {"steps": s.num_steps} for s in plan.stages],
        "loop": loop.to_dict(),
    }
    t.writer.summary(summary)
    t.writer.close()
    release(run)
    # only now: a second signal in the save's wait above stops at once and says so, where
    # the handlers from before ended the process unsaid (143) with the save half-written;
    # after a run whose records are written, a late signal exits 0 (the command's last lines)
    t.preemption.uninstall(ended=not summary["error"])
    return summary, save_error
