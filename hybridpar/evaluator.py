"""Evaluation off the training clock, as MoXing ran it: a second process evaluates the run's
checkpoints while the trainer goes on.

    events = run(config, workdir, watch=True)   # python -m hybridpar.evaluate ... --watch

``run`` checks that ``workdir`` holds a run of ``config`` (its ``config.json``; the keys in
``PLACEMENT_KEYS`` may differ, so ``--config.mesh=...`` fits the evaluator to its own
devices), sets up with ``trainer.setup`` (the same program, data and plan as the trainer, on
this process's mesh), then evaluates each committed checkpoint once, oldest first: read
straight into this mesh's shardings (read-only: the trainer's saves and retention are left
alone), then ``trainer.evaluate`` on the whole eval split. Each is an ``eval`` event with
the checkpoint's step, the trainer's wall time at that step (``wall_s``, from the
checkpoint's loop state) and ``source: evaluator``; a checkpoint deleted (by the run's
``checkpoint.max_to_keep``) before its turn is an ``eval_skipped`` event. Those events are
also the record of what is done: a restarted evaluator evaluates only what is new.

With ``watch`` it polls for new checkpoints and stops once the run's last step
(``plan.total_steps``, which the trainer always checkpoints) is done, or once summary.json
says the run completed and nothing new is left.
"""

from __future__ import annotations

import json
import os
import time

from hybridpar import checkpoint, trainer
from hybridpar.errors import ConfigError
from hybridpar.mesh import describe_mesh
from hybridpar.metrics import MetricsWriter

# Keys that may differ from the run's, besides checkpoint.FREE_KEYS: they change where and how
# fast the evaluation runs, not what a checkpoint holds or what its evaluation gives (another
# eval batch pads differently, but every example still counts once).
PLACEMENT_KEYS = (
    "mesh",
    "partitioning.",
    "comm.",
    "distributed",
    "eval_batch",
    "eval_every_epochs",
    "target_top1",
    "target_top5",
)
SKIPPED = "eval_skipped"


def check_workdir(config, workdir: str) -> bool:
    """Raises unless ``workdir`` exists and, once its trainer has written ``config.json``,
    holds a run of ``config`` (placement keys aside). False while there is no
    ``config.json`` yet (the trainer writes it after its set-up, before any checkpoint)."""
    if not os.path.isdir(workdir):
        raise ConfigError(
            f"no workdir {workdir!r}: pass the --workdir of a training run (the one given to "
            "python -m hybridpar.train), or start that run first"
        )
    saved = checkpoint.read_json(os.path.join(workdir, "config.json"))
    if saved is None:
        return False
    diff = checkpoint.differences(saved, checkpoint.config_dict(config), free=PLACEMENT_KEYS)
    if diff:
        key, old, _ = diff[0]
        raise ConfigError(
            f"{checkpoint.another_config(workdir, diff)}; pass the run's own config "
            f"(--config.{key}={old}); only {', '.join(k.rstrip('.') for k in PLACEMENT_KEYS)} "
            "may differ"
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


def read_records(path: str, offset: int = 0) -> tuple[list[dict], int]:
    """The JSON lines of ``path`` from byte ``offset`` on, and the offset after the last
    whole line. A line cut short (its writer killed, or still writing) is left out."""
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
            records.append(json.loads(line))
        except ValueError:
            continue
    return records, offset + end


class Stamped:
    """A writer for ``trainer.evaluate``: every event it writes gets ``stamp``'s fields, so
    ``wall_s`` is the trainer's wall time at the checkpoint's step, not the evaluator's."""

    def __init__(self, writer: MetricsWriter, **stamp):
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

    def __init__(self, run: trainer.Run, workdir: str):
        self.run, self.workdir = run, workdir
        self.out = os.path.join(workdir, "evaluator")
        checkpoint.ensure_writable(
            self.out, "evaluator directory", "the evaluator keeps its records in WORKDIR/evaluator"
        )
        done, _ = read_records(os.path.join(self.out, "metrics.jsonl"))
        self.done = {r["step"] for r in done if r["event"] in ("eval", SKIPPED)}
        self.saver = checkpoint.Checkpoints(
            checkpoint.checkpoint_dir(run.config, workdir), read_only=True
        )
        self.writer = MetricsWriter(self.out)
        self.written: list[dict] = []  # this call's events
        self.known: set[int] = set()  # steps committed at some point (listed, or in W's events)
        self._offset = 0  # how far W/metrics.jsonl has been read

    def poll(self) -> list[int]:
        """The committed steps not done yet, oldest first. A step known to have been
        committed that is no longer on disk was deleted (by the run's retention, or by hand)
        before its turn: an ``eval_skipped`` event, not an error."""
        # The trainer's checkpoint events first, then the listing: a step reported committed
        # but not listed is gone, not still to come.
        path = os.path.join(self.workdir, "metrics.jsonl")
        events, self._offset = read_records(path, self._offset)
        self.known |= {r["step"] for r in events if r["event"] == "checkpoint"}
        committed = self.saver.committed_steps()
        self.known |= set(committed)
        for step in sorted(self.known - set(committed) - self.done):
            self.skip(step, "deleted before it was evaluated (keep more with "
                      "--config.checkpoint.max_to_keep in the trainer, or evaluate on faster "
                      "devices)")  # fmt: skip
        return [s for s in committed if s not in self.done]

    def skip(self, step: int, why: str) -> None:
        self.done.add(step)
        trainer.log(f"checkpoint {step}: skipped, {why}")
        # wall_s: the trainer's time at a checkpoint that is gone is not known
        rec = self.writer.write(SKIPPED, step, self.run.plan.epoch_at(step), wall_s=None,
                                source="evaluator", reason=why)  # fmt: skip
        self.written.append(rec)

    def evaluate(self, step: int) -> None:
        """One checkpoint, read into this program's shardings, on the whole eval split."""
        t0 = time.time()
        try:
            _, state, loop, _ = self.saver.restore(self.run.program.abstract_state(), step=step)
        except Exception as e:  # noqa: BLE001 - deleted under us, or it does not read back
            if step not in self.saver.committed_steps():
                return self.skip(step, "deleted while it was being read")
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            return self.skip(step, f"does not read back ({msg})")
        check_position(self.run.plan, step, loop)
        read_s = time.time() - t0
        writer = Stamped(self.writer, wall_s=loop["wall_s"], source="evaluator")
        self.written.append(trainer.evaluate(self.run, state, step, writer))
        self.done.add(step)
        trainer.log(f"checkpoint {step}: at {loop['wall_s']:.1f}s of training; read in "
                    f"{read_s:.1f}s, evaluated in {time.time() - t0 - read_s:.1f}s")  # fmt: skip

    def completed(self) -> bool:
        summary = checkpoint.read_json(os.path.join(self.workdir, "summary.json"))
        return bool(summary and summary.get("completed"))

    def loop(self, watch: bool, poll_s: float, config_checked: bool) -> list[dict]:
        """Evaluates what is there (``watch``: and what comes, until the run's last step is
        done); returns the events written."""
        last = self.run.plan.total_steps
        if watch:
            trainer.log(f"watching {self.saver.directory} every {poll_s:g}s until step {last}")
        while True:
            completed = self.completed()  # read before the listing, which then has its last step
            todo = self.poll()
            if todo and not config_checked:  # the trainer wrote config.json since we began
                if not check_workdir(self.run.config, self.workdir):
                    raise ConfigError(
                        f"{self.saver.directory} holds checkpoints but {self.workdir!r} has no "
                        "config.json: pass the --workdir the training run was given"
                    )
                config_checked = True
            if not watch and not todo and not self.done:
                raise ConfigError(
                    f"no checkpoints in {self.saver.directory} yet: pass --watch to wait for "
                    "them (the trainer saves every checkpoint.every_steps steps and/or "
                    "every_minutes minutes, and at its last step)"
                )
            for step in todo:
                self.evaluate(step)
            if not watch or last in self.done or completed:
                break
            time.sleep(poll_s)
        steps = [r["step"] for r in self.written if r["event"] == "eval"]
        skipped = len(self.written) - len(steps)
        trainer.log(f"evaluated {len(steps)} checkpoint(s) {steps or ''}".rstrip()
                    + (f", skipped {skipped}" if skipped else "")
                    + f"; records in {self.out}/metrics.jsonl")  # fmt: skip
        return self.written

    def close(self) -> None:
        self.writer.close()
        self.saver.close()


def run(config, workdir: str, *, watch=False, poll_s=5.0, devices=None) -> list[dict]:
    """Evaluates ``workdir``'s checkpoints with ``config`` on ``devices`` (default: all);
    returns the events written (``eval`` and ``eval_skipped``)."""
    checked = check_workdir(config, workdir)  # before any device or data is touched
    # workdir None: none of the trainer's workdir checks and writes (we only read there)
    r = trainer.setup(config, None, devices=devices)
    trainer.log(describe_mesh(r.mesh))
    evaluator = Evaluator(r, workdir)
    try:
        return evaluator.loop(watch, poll_s, checked)
    except KeyboardInterrupt:
        trainer.log("stopped (Ctrl-C); the same command goes on with the next checkpoint")
        return evaluator.written
    finally:
        evaluator.close()
