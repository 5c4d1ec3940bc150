"""The evaluator: evaluation off the training clock.

* While a tiny run trains (a checkpoint every 3 steps, all kept, eval_every_epochs=0), a
  watching evaluator in the same process evaluates each checkpoint as it is committed (the
  trainer waits at step 7 until the evaluator has done step 3), writes one ``eval`` event
  per checkpoint with the trainer's wall time at that step, and stops by itself after the
  last one; its final top-1 equals the trainer's own final eval exactly, and the trainer
  evaluated only its last step.
* Called again, it evaluates nothing new.
* Through the command line, restarted on a copy of the run with part of its record gone and
  one checkpoint deleted, on 4 devices with another mesh: only the missing steps are
  evaluated, the deleted one is reported skipped, and ``--watch`` stops by itself.
* ``from_epoch`` evaluates only the checkpoints from that epoch on and records nothing for
  the earlier ones, which a call without it then evaluates; past the last epoch, or
  negative on the command line, it is an error.
* A second evaluator on a run another one holds is refused before it writes anything, and
  through the command line that is one ``error:`` line naming the holder.
* No workdir, a workdir that is a file (with ``--watch`` too, at once), a run of another
  config, no checkpoints without ``--watch`` (writing nothing), and a mesh whose
  data-parallel size gives a curriculum other steps than the trainer's are errors.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    DIGITS,
    TINY_DIGITS,
    config_args,
    cpu_env,
    main_here,
    saved_loop,
    signal_on,
    tiny_digits,
)

from hybridpar.config.curriculum import plan_stages, stages_from_config
from hybridpar.config.errors import ConfigError, WorkdirError
from hybridpar.runtime import evaluator, trainer, workdir_lock
from hybridpar.runtime.run import setup
from hybridpar.tools import evaluate

ROOT = Path(__file__).resolve().parents[1]
RUN = {"checkpoint.every_steps": 3, "checkpoint.max_to_keep": 0, "eval_every_epochs": 0}
STEPS = [3, 6, 9, 11]  # the checkpoints of the 11-step run: every 3 steps and the last


def records(path, event=None):
    lines = Path(path).read_text().splitlines()
    return [r for r in map(json.loads, lines) if event is None or r["event"] == event]


class WaitForEvaluator:
    """A trainer hook: at step ``at``, waits until the evaluator has evaluated ``step``, so
    the test shows the watch picking checkpoints up while the run trains, not after it."""

    def __init__(self, workdir, at, step):
        self.path, self.at, self.step = workdir / "evaluator" / "metrics.jsonl", at, step
        self.waited = None

    def __call__(self, loop, state, metrics, stage):
        if loop.step != self.at:
            return
        t0 = time.time()
        while not (self.path.exists() and self.step in [r["step"] for r in records(self.path)]):
            if time.time() - t0 > 120:
                raise AssertionError(f"the evaluator did not evaluate step {self.step}")
            time.sleep(0.05)
        self.waited = time.time() - t0


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """A run trained in this thread while an evaluator watches it from another."""
    w = tmp_path_factory.mktemp("eval") / "w"
    out = {}

    def watch():  # started before w exists; the run's config comes from its config.json
        try:
            out["events"] = evaluator.run(None, str(w), watch=True, poll_s=0.1, dead_after_s=5)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            out["error"] = e

    thread = threading.Thread(target=watch, daemon=True)  # daemon: a failed run cannot hang
    thread.start()
    # Creates w; config.json comes with train(). Compiling takes longer than dead_after_s:
    # the trainer's lock keeps the evaluator waiting.
    run = setup(tiny_digits(**RUN), str(w))
    assert run.plan.total_steps == STEPS[-1]
    hook = WaitForEvaluator(w, at=7, step=3)
    summary = trainer.train(run, hooks=[hook])
    thread.join(timeout=120)
    return {"w": w, "summary": summary, "out": out, "hook": hook, "alive": thread.is_alive()}


def test_watch_evaluates_each_checkpoint_as_it_comes_and_stops_after_the_last(watched):
    w, summary, out = watched["w"], watched["summary"], watched["out"]
    assert not watched["alive"], "the watching evaluator did not stop after the last step"
    assert "error" not in out, repr(out.get("error"))
    assert watched["hook"].waited is not None  # step 3 evaluated while the trainer was at 7
    assert summary["completed"]
    assert [r["step"] for r in records(w / "metrics.jsonl", "checkpoint")] == STEPS
    # eval_every_epochs=0 leaves the trainer its last step's eval only (the summary's)
    assert [r["step"] for r in records(w / "metrics.jsonl", "eval")] == [STEPS[-1]]

    events = out["events"]
    assert events == records(w / "evaluator" / "metrics.jsonl")
    assert [(r["event"], r["step"]) for r in events] == [("eval", s) for s in STEPS]
    for r in events:
        assert r["source"] == "evaluator" and r["examples"] == 360
        # the trainer's clock, rounded to the millisecond as every record's wall_s
        assert r["wall_s"] == round(saved_loop(w, r["step"])["wall_s"], 3)
    assert [r["wall_s"] for r in events] == sorted(r["wall_s"] for r in events)
    final = summary["final_eval"]
    for key in ("top1", "top5", "loss"):
        assert events[-1][key] == final[key], key
    assert len({r["loss"] for r in events}) == len(STEPS)  # each checkpoint its own model


def test_a_second_call_evaluates_nothing_new(watched, capsys):
    w = watched["w"]
    before = records(w / "evaluator" / "metrics.jsonl")
    assert evaluator.run(tiny_digits(**RUN), str(w)) == []
    assert records(w / "evaluator" / "metrics.jsonl") == before
    assert "evaluated 0 checkpoint(s)" in capsys.readouterr().out


def test_a_trained_run_s_logits_give_the_evaluator_s_top1_and_loss(watched):
    """``hybridpar.TrainedRun``, as docs/evaluation.md shows it: the latest checkpoint's
    logits of the test split (normalised inside, as the eval step does) give the evaluator's
    top-1 and loss on that checkpoint; any number of images (padded over the devices)."""
    import numpy as np

    import hybridpar
    from hybridpar.input.arrays import load_digits
    from hybridpar.program.steps import cross_entropy

    w, events = watched["w"], watched["out"]["events"]
    run = hybridpar.TrainedRun(str(w), hybridpar.make_mesh("data:-1"))
    _, test = load_digits(run.config.data.image_size)
    logits = run.logits(test["image"])
    assert run.step == STEPS[-1] and events[-1]["step"] == STEPS[-1]
    assert logits.shape == (360, 10) and logits.dtype == np.float32
    assert (logits.argmax(-1) == test["label"]).mean() == events[-1]["top1"]
    loss = np.mean(cross_entropy(logits, test["label"], run.config.label_smoothing))
    assert abs(loss - events[-1]["loss"]) < 1e-5 * events[-1]["loss"]
    np.testing.assert_allclose(run.logits(test["image"][:13]), logits[:13], rtol=1e-5, atol=1e-5)


def test_cli_restart_on_another_mesh_goes_on_from_its_record_and_skips_a_deleted_one(
    watched, tmp_path
):
    w = tmp_path / "w"
    shutil.copytree(watched["w"], w)
    record = w / "evaluator" / "metrics.jsonl"
    record.write_text(record.read_text().splitlines()[0] + "\n")  # only step 3 done
    shutil.rmtree(w / "checkpoints" / "6")  # as the trainer's retention would
    tiny_args = config_args(TINY_DIGITS)
    cmd = [sys.executable, "-m", "hybridpar.evaluate", "--config", DIGITS, "--workdir", str(w),
           "--watch", "--poll-s=0.1", *tiny_args, "--config.mesh=data:4"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=cpu_env(4), capture_output=True,
                       text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint 6: skipped, deleted before it was evaluated" in r.stdout
    events = records(record)
    assert [(e["event"], e["step"]) for e in events] == [
        ("eval", 3), ("eval_skipped", 6), ("eval", 9), ("eval", 11)
    ]  # fmt: skip
    assert events[1]["wall_s"] is None and "max_to_keep" in events[1]["reason"]
    # read onto data:4 (the trainer's was data:4,model:2): the same model, to rounding
    final = watched["summary"]["final_eval"]
    assert abs(events[-1]["top1"] - final["top1"]) <= 1 / 360 + 1e-9
    assert events[-1]["loss"] == pytest.approx(final["loss"], rel=1e-5)


def test_from_epoch_leaves_the_earlier_checkpoints_for_a_later_call(watched, tmp_path, capsys):
    w = tmp_path / "w"
    shutil.copytree(watched["w"], w)
    (w / "evaluator" / "metrics.jsonl").unlink()
    epoch = {r["step"]: r["epoch"] for r in records(w / "metrics.jsonl", "checkpoint")}
    events = evaluator.run(tiny_digits(**RUN), str(w), from_epoch=epoch[6])
    assert [(r["event"], r["step"]) for r in events] == [("eval", s) for s in STEPS[1:]]
    assert "from epoch" in capsys.readouterr().out
    # the ones left are evaluated by a call without it, and only they
    assert [r["step"] for r in evaluator.run(tiny_digits(**RUN), str(w))] == STEPS[:1]
    steps = [r["step"] for r in records(w / "evaluator" / "metrics.jsonl")]
    assert sorted(steps) == STEPS
    with pytest.raises(ConfigError, match="after the run's last epoch"):
        evaluator.run(tiny_digits(**RUN), str(w), from_epoch=epoch[11] + 1)
    # a call that fails leaves the earlier calls' records as they were
    assert sorted(r["step"] for r in records(w / "evaluator" / "metrics.jsonl")) == STEPS
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--workdir", str(w), "--from-epoch=-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --from-epoch=-1") and err.count("\n") == 1


def test_a_second_evaluator_on_one_run_is_refused(watched, tmp_path, capsys):
    w = tmp_path / "w"
    shutil.copytree(watched["w"], w)
    record = w / "evaluator" / "metrics.jsonl"
    # step 11 to do (one is enough to be refused or done; each more is a restore and an eval)
    record.write_text("".join(x + "\n" for x in record.read_text().splitlines()[:3]))
    before = record.read_text()
    first = workdir_lock.acquire(str(w / "evaluator"), role="evaluator")  # as a live evaluator
    try:
        with pytest.raises(WorkdirError, match=f"in use by another evaluator \\(pid {os.getpid()}"):
            evaluator.run(tiny_digits(**RUN), str(w), watch=True, poll_s=0.1)
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--config", DIGITS, *config_args(TINY_DIGITS), "--workdir", str(w)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert err.startswith("error: directory") and "stop it (Ctrl-C)" in err
        assert record.read_text() == before  # nothing appended by the refused ones
    finally:
        first.release()
    events = evaluator.run(tiny_digits(**RUN), str(w))  # the lock gone: it goes on
    assert [r["step"] for r in events] == STEPS[3:]
    assert not (w / "evaluator" / ".lock").exists()


def test_no_workdir_another_config_and_no_checkpoints_are_errors(watched, tmp_path, capsys):
    with pytest.raises(ConfigError, match="no workdir .* start that run first"):
        evaluator.run(tiny_digits(), str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"another config: seed was 0, now 1; pass the run's"):
        evaluator.run(tiny_digits(seed=1), str(watched["w"]))
    # several keys: not one override to add, but the run's own config (planted bug that
    # fails it: the one-key hint for any number of keys)
    with pytest.raises(ConfigError, match=r"\(and 1 more\); leave out --config to read"):
        evaluator.run(tiny_digits(seed=1, **{"model.num_filters": 16}), str(watched["w"]))
    (tmp_path / "empty").mkdir()  # not a run (yet): said plainly, before any set-up
    with pytest.raises(WorkdirError, match="holds no training run .*, or --watch to wait"):
        evaluator.run(tiny_digits(), str(tmp_path / "empty"))
    # bad input writes nothing: no evaluator/ with an empty record and TensorBoard file
    # (planted bug that fails it: the MetricsWriter made before the checks)
    assert os.listdir(tmp_path / "empty") == []
    # without --config the checkpoints are not looked for: said so, and --config named, what
    # finds checkpoints without a config.json (planted bug that fails it: "no checkpoints")
    code, _, err = main_here(evaluate.main, ["--workdir", str(tmp_path / "empty")], capsys)
    assert code == 2 and err == (
        f"error: {str(tmp_path / 'empty')!r} holds no config.json: {evaluator.WORKDIR_FIX}, "
        "--config experiments/NAME.py (the run's checkpoints are then found without it), or "
        "--watch to wait for a run about to start there\n"
    ), err
    (tmp_path / "started").mkdir()  # a run that has written its config.json only
    shutil.copy(watched["w"] / "config.json", tmp_path / "started")
    with pytest.raises(ConfigError, match="no checkpoints in .* yet: pass --watch"):
        evaluator.run(tiny_digits(**RUN), str(tmp_path / "started"))
    assert os.listdir(tmp_path / "started") == ["config.json"]
    # and through the command line: one error: line, exit code 2
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--config", DIGITS, "--workdir", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: no workdir") and err.count("\n") == 1


def test_the_empty_folder_goes_while_locked_and_one_removed_before_the_lock_is_made_again(
    tmp_path, monkeypatch
):
    """A call that stops before its first record removed its evaluator/ after releasing the
    lock: a second evaluator that had found the folder, about to lock it, lost it (and a
    folder removed before its lock was a FileNotFoundError). Now the folder goes while the
    lock is held, and one gone before the lock is made again. Planted bugs that fail it: the
    old order (rmdir after release); no lock_records."""
    from hybridpar.runtime.run_config import config_dict

    w = tmp_path / "started"  # a run that has written its config.json only
    w.mkdir()
    (w / "config.json").write_text(json.dumps(config_dict(tiny_digits(**RUN))))
    out = w / "evaluator"
    at_release, release = [], workdir_lock.Lock.release

    def recorded(lock):
        if lock.fd is not None:
            at_release.append(out.exists())
        release(lock)

    acquire, removed = workdir_lock.acquire, []

    def gone_first(path, *args, **kwargs):  # the evaluator before it removed the folder
        if not removed:
            removed.append(os.rmdir(path))
        return acquire(path, *args, **kwargs)

    monkeypatch.setattr(workdir_lock.Lock, "release", recorded)
    monkeypatch.setattr(workdir_lock, "acquire", gone_first)
    with pytest.raises(ConfigError, match="no checkpoints in .* yet: pass --watch"):
        evaluator.run(tiny_digits(**RUN), str(w))
    assert at_release == [False] and os.listdir(w) == ["config.json"]


# --watch: a bug that waits stops after 30s, not 300
@pytest.mark.parametrize("watch", [[], ["--watch", "--dead-after-s=30"]])
def test_a_workdir_that_is_a_file_is_refused_at_once_in_the_trainers_words(tmp_path, capsys, watch):
    """Not "no workdir", and with --watch not a wait for a run that cannot start there
    (planted bugs that fail it: no check_folder; check_folder only after wait_for_run)."""
    f = tmp_path / "afile"
    f.write_text("mine\n")
    code, _, err = main_here(evaluate.main, ["--workdir", str(f), *watch], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: workdir {str(f)!r} is a file, not a folder; pass the --workdir")
    assert f.read_text() == "mine\n" and os.listdir(tmp_path) == ["afile"]


def test_a_plan_other_than_the_trainers_is_an_error():
    """config.stages batches are per data-parallel device, so an evaluator on a mesh with
    another data x fsdp size plans other steps: the checkpoint's loop state shows it."""
    c = tiny_digits(stages="0.1:16-8,0.25:16-16")
    train_plan, other = (
        plan_stages(stages_from_config(c, dp), lambda batch: 1437 // batch) for dp in (4, 8)
    )
    loop = trainer.LoopState()
    for stage in train_plan.stages:  # the trainer's loop up to the end of its run
        loop.enter(stage)
        for _ in range(stage.num_steps):
            loop.advance(stage)
    evaluator.check_position(train_plan, loop.step, loop.to_dict())
    with pytest.raises(ConfigError, match="with the trainer's data x fsdp size"):
        evaluator.check_position(other, loop.step, loop.to_dict())


def test_the_docs_synopsis_shows_the_watch_only_flags_under_watch():
    """--poll-s and --dead-after-s are refused without --watch: the synopsis nests them."""
    import re

    text = (ROOT / "docs" / "evaluation.md").read_text()
    assert re.search(r"\[--watch \[--poll-s \d+\] \[--dead-after-s \d+\]\]", text)


def test_a_readers_left_over_tensorstore_reports_are_dropped_and_others_kept():
    """Reading beside a trainer that deletes a step, the failed reads' siblings leave
    asyncio's "never retrieved" report of a TensorStore error (raised in C++: no Python
    traceback, a status code first) and orbax's read-only notices; the reader reports the
    failure itself (or reads the step again), so these are dropped. The same report of a
    Python exception, and other records, still reach the user."""
    import logging

    from hybridpar.runtime import checkpoint

    checkpoint.quiet_background_failures()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def python_error():
        try:
            raise ValueError("NOT_FOUND: raised in Python")
        except ValueError as e:
            return e

    handler = Keep()
    loggers = [logging.getLogger("asyncio"), logging.getLogger("absl")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        cpp = RuntimeError('NOT_FOUND: Error opening "zarr" driver: no such file')
        never = "Future exception was never retrieved"
        loggers[0].error(never, exc_info=(RuntimeError, cpp, None))
        loggers[1].warning("Given directory is read only=%s", "/w/checkpoints")
        loggers[1].warning("Metadata file does not exist: %s", "/w/checkpoints/4")
        assert seen == []
        loggers[0].error(never, exc_info=(ValueError, e := python_error(), e.__traceback__))
        loggers[0].error("Task was destroyed but it is pending!")
        loggers[1].warning("Given directory is missing=%s", "/w")
        kept = [never, "Task was destroyed but it is pending!", "Given directory is missing=/w"]
        assert seen == kept
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def copy_of(watched, tmp_path, evaluated=None):
    """A copy of the watched run, its evaluator's record cut to the steps ``evaluated``
    (None: all four)."""
    w = tmp_path / "w"
    shutil.copytree(watched["w"], w)
    record = w / "evaluator" / "metrics.jsonl"
    if evaluated is not None:
        kept = [x for x in record.read_text().splitlines() if json.loads(x)["step"] in evaluated]
        record.write_text("".join(x + "\n" for x in kept))
    return w


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_it_with_one_line_its_records_whole_and_the_lock_gone(
    watched, tmp_path, sig
):
    """Ctrl-C returned normally (exit 0, at times a crash in the interpreter's exit) and
    SIGTERM killed it unsaid (143, its lock file left). Both are one ``stopped`` line, exit
    128 + the signal, the records whole. Sent while --watch waits on a run whose trainer is
    gone (checkpoint 11 not there yet), at its line saying so. Planted bugs that fail it:
    run's old ``except KeyboardInterrupt: return``; no ``Stop``; no "no trainer" line."""
    w = copy_of(watched, tmp_path, evaluated=[3])
    shutil.rmtree(w / "checkpoints" / "11")
    (w / "summary.json").unlink()
    trainer_record = w / "metrics.jsonl"
    lines = trainer_record.read_text().splitlines()
    kept = [x for x in lines if not x.startswith('{"event": "checkpoint", "step": 11,')]
    assert len(kept) == len(lines) - 1
    trainer_record.write_text("".join(x + "\n" for x in kept))
    cmd = [sys.executable, "-m", "hybridpar.evaluate", "--workdir", str(w), "--watch",
           "--poll-s=0.1", "--dead-after-s=120"]  # fmt: skip
    p, out = signal_on(cmd, cpu_env(8), lambda line: line.startswith("no trainer is writing"),
                       sig, tmp_path / "err.txt")  # fmt: skip
    err = (tmp_path / "err.txt").read_text()
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert p.returncode == 128 + sig, (p.returncode, out[-2000:], err[-2000:])
    assert "giving up in 12" in out  # 120s, less what has passed
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"stopped ({name}): the same command goes on with the next checkpoint not evaluated yet"
    )
    events = records(w / "evaluator" / "metrics.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("eval", 3), ("eval", 6), ("eval", 9)]
    assert sorted(os.listdir(w / "evaluator")) == ["metrics.jsonl", "tb"]  # no .lock left


def test_ctrl_c_while_it_imports_is_the_one_stopped_line(tmp_path):
    """A Ctrl-C in the first seconds (JAX's imports) was a 25-line traceback. Sent as the
    evaluator's module is about to import. Planted bug that fails it: ``Stop`` installed
    after the import."""
    code = (
        "import os, signal, sys\n"
        "from hybridpar.tools import evaluate\n"
        "class CtrlC:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'hybridpar.runtime.evaluator':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        f"evaluate.main(['--workdir', {str(tmp_path)!r}])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(1),
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr == (
        "stopped (Ctrl-C): the same command goes on with the next checkpoint not evaluated yet\n"
    )


def test_a_closed_stdout_loses_no_record(watched, tmp_path, monkeypatch):
    """``| head``: the print that meets the closed pipe comes after the record is written,
    and the records and lock are closed on the way out (cli.main then exits 1 quietly:
    test_cli). Planted bug that fails it: eval_pass printing before it writes."""
    from hybridpar.runtime import run as run_module

    w = copy_of(watched, tmp_path, evaluated=[3, 6, 9])
    printed = run_module.log

    def closed_at_eval(msg):
        if msg.startswith("eval "):
            raise BrokenPipeError(32, "Broken pipe")
        printed(msg)

    monkeypatch.setattr(run_module, "log", closed_at_eval)
    with pytest.raises(BrokenPipeError):
        evaluator.run(tiny_digits(**RUN), str(w))
    assert [r["step"] for r in records(w / "evaluator" / "metrics.jsonl")] == STEPS
    assert not (w / "evaluator" / ".lock").exists()


def test_watch_follows_a_run_resumed_with_more_epochs(watched, tmp_path, capsys):
    """A run extended with --allow-config-change: its newest checkpoint holds the new
    config, and summary.json is still the first finish's (``completed``), older than the
    trainer's start (its ``resume`` line). --watch stopped at the old last step; now it
    follows the new plan (22 steps), and with no trainer on it, says so and stops with the
    error of a run ended unfinished. Planted bugs that fail it: the plan read once at
    set-up; a summary believed whatever start wrote it."""
    w = copy_of(watched, tmp_path)
    held = w / "checkpoints" / "11" / "config" / "metadata"
    config = json.loads(held.read_text())
    config["num_epochs"] = 0.5
    held.write_text(json.dumps(config))
    resume = {"event": "resume", "step": 11, "epoch": 0.25, "wall_s": 99.0, "from_step": 11,
              "changed_keys": ["num_epochs"]}  # fmt: skip
    with open(w / "metrics.jsonl", "a") as f:
        f.write(json.dumps(resume) + "\n")
    with pytest.raises(ConfigError, match=r"ended before its last step \(22\)"):
        evaluator.run(tiny_digits(**RUN), str(w), watch=True, poll_s=0.1, dead_after_s=0.5)
    out = capsys.readouterr().out
    assert "its last step is now 22" in out and "watching" in out
    assert "no trainer is writing" in out


def test_watch_does_not_stop_while_a_trainer_is_on_the_run(watched, tmp_path, monkeypatch):
    """Its last step done, a run with a trainer on it may still go on (a resume with more
    epochs, before its first checkpoint): --watch waits for the trainer to go. Planted bug
    that fails it: the stop without asking."""
    w = copy_of(watched, tmp_path)
    asked = []

    def trainer(self):  # a trainer for the first three looks
        asked.append(1)
        return len(asked) <= 3

    monkeypatch.setattr(evaluator.Liveness, "trainer", trainer)
    assert evaluator.run(tiny_digits(**RUN), str(w), watch=True, poll_s=0.05) == []
    assert len(asked) >= 4


def test_a_skipped_checkpoint_saved_again_is_evaluated(watched, tmp_path, capsys, monkeypatch):
    """A step skipped as unreadable, which the trainer moved aside and saved again, was
    never evaluated (a skip counted as done); then one still on disk was tried again by
    every call, each adding an ``eval_skipped`` line. Now a skip records the save it saw
    (its folder's time), and only another save of the step is tried again. Also: a large
    eval split says how far it is (here every batch). Planted bugs that fail it: skips
    counted as done; a skip on disk always tried again; no progress lines."""
    w = copy_of(watched, tmp_path, evaluated=[3, 6, 11])
    folder = w / "checkpoints" / "9"
    files = {f: f.read_bytes() for f in (folder / "state").rglob("*") if f.is_file()}
    for f in files:
        f.write_bytes(b"\0garbage")
    [skip] = evaluator.run(tiny_digits(**RUN), str(w))
    assert skip["event"] == "eval_skipped" and skip["step"] == 9, skip
    assert skip["reason"].startswith("does not read back"), skip
    record = w / "evaluator" / "metrics.jsonl"
    before = record.read_text()
    assert evaluator.run(tiny_digits(**RUN), str(w)) == []  # the same save: not again
    assert record.read_text() == before
    for f, data in files.items():  # saved anew: a new folder, a later time
        f.write_bytes(data)
    later = folder.stat().st_mtime_ns + 10**9
    os.utime(folder, ns=(later, later))
    monkeypatch.setattr(evaluator, "PROGRESS_S", 0.0)
    assert [r["step"] for r in evaluator.run(tiny_digits(**RUN), str(w))] == [9]
    assert "checkpoint 9: 3/3 eval batches read" in capsys.readouterr().out


def test_summary_json_is_read_with_watch_only_and_in_the_evaluators_words(watched, tmp_path):
    """A summary.json that does not read stopped the evaluator without --watch too, with
    the trainer's "move it away to start over". Planted bug that fails it: summary.json
    read on every call, with the trainer's advice."""
    w = copy_of(watched, tmp_path, evaluated=[3, 6, 9])
    (w / "summary.json").write_text('{"completed": tr')
    assert [r["step"] for r in evaluator.run(tiny_digits(**RUN), str(w))] == [11]
    with pytest.raises(WorkdirError, match="leave out --watch to evaluate the checkpoints") as e:
        evaluator.run(tiny_digits(**RUN), str(w), watch=True, poll_s=0.1)
    assert "start over" not in str(e.value)


def test_a_tune_search_folder_is_not_a_run_and_names_its_trials(tmp_path, capsys):
    """Its error led to the next (no config.json: pass --config; no checkpoints: pass
    --watch; a wait of 300s), after the set-up's mesh line. Planted bug that fails it: no
    check_is_run."""
    search = tmp_path / "search"
    (search / "trials" / "000").mkdir(parents=True)
    (search / "study.db").write_text("")
    for watch in ([], ["--watch"]):
        code, out, err = main_here(evaluate.main, ["--workdir", str(search), *watch], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "holds a tune search (study.db), not a training run" in err
        assert os.path.join(str(search), "trials", "000") in err


def test_the_runs_own_mesh_too_large_is_said_to_be_the_runs(watched, tmp_path, monkeypatch):
    """Without --config.mesh the evaluator takes the run's mesh: on fewer devices its
    refusal read "mesh spec 'data:8' needs 8 devices", a spec the user never typed. Now it
    says it is the run's, and the evaluator's own --config.mesh; one given is said as
    before. Planted bug that fails it: no prefix."""
    import jax

    from hybridpar.runtime import trained

    w = copy_of(watched, tmp_path)
    load = trained.load_config

    def on_eight(workdir, overrides=(), caller=None):  # the run trained on data:8
        config = load(workdir, overrides, caller)
        if not overrides:
            config.mesh = "data:8"
        return config

    monkeypatch.setattr(trained, "load_config", on_eight)
    with pytest.raises(ConfigError, match=r"^the run's mesh spec 'data:8' needs 8 devices .*"
                       r"--config.mesh=data:-1.*the evaluator may use its own\)$"):  # fmt: skip
        evaluator.run(None, str(w), devices=jax.devices()[:4])
    with pytest.raises(ConfigError, match=r"^mesh spec 'data:8' needs 8 devices"):
        evaluator.run(None, str(w), devices=jax.devices()[:4], overrides=[("mesh", "data:8")])
