"""The CLI end to end, as a user runs it: in subprocesses where a run needs a signal, a fresh
JAX or its own compiler flags; elsewhere its ``main`` in this process (``_main_here``).

The digits run is the spine's acceptance check: the default main job reaches >= 97% test
top-1 on the hybrid 8-device mesh, stopping there as a time-to-accuracy run does (about a
minute here).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NO_LLVM_OPT_FLAG, TINY_DIGITS, config_args, cpu_env, main_here, signal_at
from xla_flags import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "experiments" / "digits.py")


def _run(args, devices=8, timeout=600, xla_flags=""):
    env = dict(
        os.environ,
        XLA_FLAGS=cpu_flags(devices, xla_flags),
        JAX_PLATFORMS="cpu",
    )
    return subprocess.run(
        [sys.executable, "-m", "hybridpar.train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _main_here(args, capfd):
    """``python -m hybridpar.train ARGS`` by its ``main`` in this process, whose 8 devices are
    the run's (``helpers.main_here``)."""
    from hybridpar.tools import train

    return main_here(train.main, args, capfd)


def _records(workdir):
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


# One hybrid mesh (the one-device computation is the parity tests' reference; a second
# full run on data:1 would be slow and catch nothing they do not). The run
# starts on data:8 and is stopped by SIGTERM after a few steps, then goes on with only the
# mesh changed, as a user moving a run to other devices would (the mesh places the same
# computation: no --allow-config-change needed).
def test_digits_reaches_97_percent_resumed_on_another_mesh(tmp_path):
    # stop_at_target: the run ends at the first evaluation with top-1 >= 0.97 and top-5 >= 0.99,
    # saving the epochs after it. Evaluated after every epoch, not every 3rd as the recipe
    # does: evaluation changes no training step (the same eval losses at epochs 3 and 6 either
    # way), so this is the recipe's training, seen at every epoch instead of epochs 3, 6, 9,
    # 12 and 15. On an AMD EPYC it reached 0.972 at epoch 8 but was below 0.97 at epoch 9
    # (0.967), so with every third epoch it ran on to epoch 12: 264 steps against 176 now.
    # A train line every step, so the resumed steps can be counted.
    args = ["--config", DIGITS, "--workdir", str(tmp_path), "--config.stop_at_target=True",
            "--config.eval_every_epochs=1", "--config.log_every_s=0"]  # fmt: skip
    cmd = [sys.executable, "-m", "hybridpar.train", *args]
    p, _ = signal_at([*cmd, "--config.mesh=data:8"], cpu_env(8), 3, signal.SIGTERM,
                     tmp_path / "stderr")  # fmt: skip
    assert p.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    stop = json.loads((tmp_path / "summary.json").read_text())["steps"]
    seg1 = _records(tmp_path)
    r = _run([*args, "--config.mesh=data:4,model:2"], 8)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert f"resumed from the checkpoint at step {stop} " in out
    assert ("(config changed: mesh data:8 -> data:4,model:2; the numbers are not bitwise "
            "the old mesh's (float sums in another order))") in out  # fmt: skip
    seg2 = _records(tmp_path)[len(seg1) :]
    assert seg2[0]["event"] == "resume" and seg2[0]["changed_keys"] == ["mesh"]
    steps = [rec["step"] for rec in seg2 if rec["event"] == "train"]
    assert steps == list(range(stop + 1, steps[-1] + 1))  # no step done twice or skipped
    # Before the first step: the mesh, the placement table and the compiled step's memory.
    assert (
        out.index("mesh: data=")
        < out.index("placement")
        < out.index("per-device memory")
        < out.index("\ntrain step")  # the first progress line (not "compiling the train step")
    )
    records = _records(tmp_path)
    events = {rec["event"] for rec in records}
    assert {"compile", "train", "eval"} <= events
    for rec in records:
        assert {"event", "step", "epoch", "wall_s"} <= rec.keys()
    train = [rec for rec in records if rec["event"] == "train"]
    assert {"loss", "lr", "images_per_s", "image_size", "global_batch"} <= train[0].keys()
    evals = [rec for rec in records if rec["event"] == "eval"]
    assert evals[-1]["examples"] == 360 and evals[-1]["split"] == "test"
    assert evals[-1]["top1"] >= 0.97, evals[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["final_eval"]["top1"] == evals[-1]["top1"]
    assert summary["resumed_from"] == stop and steps[-1] == summary["steps"]
    # DAWNBench's count (from the start, compilation and evaluation in) and without compiling
    for metric, target in (("top1", 0.97), ("top5", 0.99)):
        reached = summary["time_to_target"][metric]
        assert reached["value"] >= target == reached["target"]
        first = next(e for e in evals if e[metric] >= target)
        assert (reached["step"], reached["wall_s"]) == (first["step"], first["wall_s"])
        compile_s = summary["compile_s"]
        assert compile_s > 0
        assert reached["wall_s_without_compile"] == pytest.approx(
            reached["wall_s"] - compile_s, abs=1e-3
        )
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    # it stopped at the evaluation that reached the last of the two targets, saved there,
    # and counts as completed (the same command then has nothing to do)
    last = max(summary["time_to_target"][m]["step"] for m in ("top1", "top5"))
    assert summary["steps"] == last == evals[-1]["step"] == summary["latest_checkpoint"]
    assert summary["stopped_at_target"] == (last < summary["total_steps"])
    if summary["stopped_at_target"]:
        assert "every target reached at step" in out


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--config.mesh_typo=data:8"], "no config key 'mesh_typo'; did you mean 'mesh'"),
        # another codebase's name, in a section: ours is found by its meaning
        (["--config.optim.learning_rate=0.1"], "did you mean 'optim.base_lr'"),
        # a section ('optim') is never offered: it is not set itself
        (["--config.optim.lr=0.1"], "did you mean 'optim.base_lr' or 'optim.frozen' or"),
        (["--config.mesh=data:3"], "needs 3 devices but 8 are available"),
        (
            ["--config.mesh=data:8", "--config.global_batch=60"],
            "global_batch=60 does not divide over the 8 data-parallel devices",
        ),
        (
            [
                "--config.mesh=data:8",
                "--config.partitioning.rules=((r'head/kernel$', (None, 'data')),)",
            ],
            "array 'params/head/kernel' with shape (128, 10): dimension 1 (size 10) does not "
            "divide mesh axis 'data' (size 8)",
        ),
        (["--config.partitioning.preset=hybrd"], "partitioning.preset='hybrd' is not one of"),
        # labels 5-9 would have no logit, and the loss would look fine
        (["--config.data.num_classes=6"], "data.num_classes=6 but digits has 10 classes"),
        (["--config.data.num_classes=12", "--config.data.on_device=True"],
         "data.num_classes=12 but digits has 10 classes"),
        (["--config.num_epochs=nan"], "num_epochs=nan is not a finite number"),
        (["--config.num_epochs=1e9"], "would take 22,000,000,000 steps to epoch 1e+09"),
        (["--config.optim.base_lr=inf"], "optim.base_lr=inf is not a finite number"),
        (
            ["--config.partitioning.rules=(('w[', (None,)),)"],
            "partitioning rule ('w[', (None,)): 'w[' is not a regex",
        ),
        (
            ["--config.mesh=data:4,model:2", "--config.comm.reduce_dtype=bfloat16"],
            "comm.reduce_dtype='bfloat16' under comm.mode=auto (resolved to xla: a model axis",
        ),
        # a flag another makes moot is refused, not silently unused; before the config is
        # checked (the mesh here would be the next error, and the run's start without it)
        (["--recompile", "--config.mesh=data:3"], "error: --recompile says what to do when "
         "the --compiled file does not fit the run; pass --compiled FILE with it, or drop it"),
    ],
)
def test_bad_input_stops_with_a_short_error(tmp_path, args, expect, capfd):
    w = tmp_path / "w"
    code, _, err = _main_here(["--config", DIGITS, "--workdir", str(w), *args], capfd)
    assert code == 2, (code, err[-2000:])
    assert expect in err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: ")
    # nothing written: the same command, corrected, starts a new run there
    assert not w.exists(), sorted(p.name for p in w.iterdir())


def test_a_compiled_file_for_another_target_is_refused_before_anything_is_written(
    tmp_path, capfd
):
    """A --compiled file for a TPU, given to a run on these CPUs, is one error, and the
    workdir is not made: the set-up enabled the compile cache before the file was checked,
    and left WORKDIR/compile_cache/ with the initial state's programs in it. The file's
    header is all the check reads (no executable is loaded): a hand-written one serves."""
    import pickle

    from hybridpar.runtime import executables

    out = tmp_path / "programs.bin"
    header = {"format": executables.FORMAT, "target": "tpu:v5e-8", "platform": "tpu",
              "device_kind": "TPU v5 lite", "devices": 8}  # fmt: skip
    out.write_bytes(pickle.dumps({"header": header, "entries": []}))
    w = tmp_path / "w"
    code, _, err = _main_here(["--config", DIGITS, "--workdir", str(w), "--compiled", str(out),
                               "--config.compile_cache=workdir"], capfd)  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert err.strip().startswith(f"error: --compiled {out} does not fit this run: platform")
    # the other differences named, not "(and 4 more)"
    assert "device_kind" in err and "more)" not in err, err
    assert not w.exists(), sorted(str(p.relative_to(w)) for p in w.rglob("*"))


def test_missing_config_and_unwritable_workdir(tmp_path, capfd):
    code, _, err = _main_here(["--config", str(tmp_path / "nope.py"), "--workdir",
                               str(tmp_path)], capfd)  # fmt: skip
    assert code == 2 and "could not load the config file" in err
    assert "Traceback" not in err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = _main_here(["--config", DIGITS, "--workdir", str(blocker / "sub")], capfd)
    assert code == 2 and "is not writable" in err
    assert "Traceback" not in err
    code, _, err = _main_here(["--config", DIGITS, "--workdir", str(blocker)], capfd)
    # was "(File exists)"
    assert code == 2 and f"workdir '{blocker}' is a file, not a folder" in err
    assert "Traceback" not in err and blocker.read_text() == "x"


@pytest.mark.parametrize(
    "config, expect",
    [
        # a second file would have replaced the first without a word (here one that does
        # not exist, so that the planted bug fails fast)
        ([DIGITS, "--config", str(ROOT / "experiments" / "nope.py")], "--config given twice"),
        ([DIGITS + ":foo"], "get_config() takes no argument, so ':foo' cannot be passed"),
        (["NO_GET_CONFIG"], "defines no get_config()"),
    ],
)  # fmt: skip
def test_a_config_file_the_tool_cannot_use_is_one_line(tmp_path, config, expect, capfd):
    if config == ["NO_GET_CONFIG"]:
        (tmp_path / "c.py").write_text("CONFIG = 1\n")
        config = [str(tmp_path / "c.py")]
    w = tmp_path / "w"
    code, _, err = _main_here(["--config", *config, "--workdir", str(w)], capfd)
    assert code == 2 and expect in err, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")
    assert not w.exists()


@pytest.mark.parametrize("kind", ["ConfigError", "DataError", "WorkdirError", "NonFinite",
                                  "SaveFailed", "StopRequested"])  # fmt: skip
def test_every_error_of_the_family_is_one_error_line_and_exit_2(kind, capsys):
    """Bad input and a failed run alike: ``cli.main`` turns each into one ``error:`` line
    (exit 2), with no traceback."""
    from hybridpar.config import cli, errors

    def fn():
        raise getattr(errors, kind)("what is wrong; how to fix it")

    with pytest.raises(SystemExit) as e:
        cli.main(fn)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: what is wrong; how to fix it\n"


def test_diverging_run_stops_and_keeps_its_records(tmp_path):
    r = _run(
        [
            "--config",
            DIGITS,
            "--workdir",
            str(tmp_path),
            "--config.mesh=data:8",
            *config_args(TINY_DIGITS),
            "--config.optim.base_lr=1e30",
            "--config.num_epochs=1",
            "--config.max_nonfinite_steps=5",
        ],
        xla_flags=NO_LLVM_OPT_FLAG,
    )
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "5 steps in a row" in errors[0] and "non-finite loss or gradient" in errors[0]
    assert "no checkpoint was saved before it" in errors[0]
    assert "Traceback" not in r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["completed"]
    assert any(rec["event"] == "compile" for rec in _records(tmp_path))


def test_resnet50_recipe_runs_on_the_hybrid_mesh(tmp_path):
    """The full ResNet-50 config (bfloat16, SGD + Nesterov, label smoothing) on synthetic
    data, shrunk to 2 steps at 32 px: it builds, shards, compiles and trains, the second
    step on the state the first one returned."""
    cfg = str(ROOT / "experiments" / "resnet50_imagenet.py")
    r = _run(
        [
            "--config",
            cfg,
            "--workdir",
            str(tmp_path),
            "--config.mesh=data:2,fsdp:2,model:2",
            "--config.data.image_size=32",
            "--config.global_batch=16",
            "--config.eval_batch=16",
            "--config.data.train_examples=32",
            "--config.data.eval_examples=16",
            "--config.num_epochs=1",
        ],
        # 2 steps: the compile is the test's time, and LLVM's optimisations a large part of it
        # (skipped here, as in the other runs that are neither timed nor held to an accuracy)
        xla_flags=NO_LLVM_OPT_FLAG,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "('model', 'fsdp')" in r.stdout  # hybrid and FSDP both in force
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2
    assert summary["final_eval"]["examples"] == 16
    assert summary["memory_per_device_bytes"]["total"] > 0


def test_cifar10_trains_from_the_tar_through_the_pipeline(tmp_path, cifar10_test_prepared):
    """experiments/cifar10.py on 8 devices, from a JPEG tar through the tf.data pipeline to
    global arrays, the eval split read once to the example. test.tar stands in for both
    splits, and its prepared copy is the one conftest.py made (as train would on first use),
    which the run must find up to date and reuse. A narrower ResNet at batch 128 keeps it
    short: the pipeline is under test here, not the model. Without the shared data it skips,
    or fails where CI is set (require_shared_data)."""
    tar, prepared, _ = cifar10_test_prepared
    args = [
        "--config",
        str(ROOT / "experiments" / "cifar10.py"),
        "--workdir",
        str(tmp_path / "w"),
        f"--config.data.source={tar}",
        f"--config.data.prepared_dir={prepared}",
        "--config.data.train_split=test",
        "--config.num_epochs=0.1",
        "--config.eval_every_epochs=1",
        "--config.mesh=data:4,model:2",
        "--config.model.num_filters=8",
        "--config.global_batch=128",
    ]
    r = _run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preparing" not in r.stdout  # the prepared copy matches the tar: reused
    records = _records(tmp_path / "w")
    data = next(rec for rec in records if rec["event"] == "data")
    assert data["train_examples"] == data["eval_examples"] == 10000 and data["skipped"] == 0
    assert [rec["global_batch"] for rec in records if rec["event"] == "stage"] == [128]
    evals = [rec for rec in records if rec["event"] == "eval"]
    assert evals[-1]["examples"] == 10000
    # Above chance: 10 classes give 0.1 (exactly 0.1 for a constant prediction, and
    # sigma = 0.003 over 10,000 examples), 0.115 is 5 sigma above it; 8 steps reached 0.164
    # on an AMD EPYC. Eval labels misaligned with images, or an untrained model, stay at 0.1.
    assert 0.115 <= evals[-1]["top1"] <= 1.0, evals[-1]


def test_bucketed_mode_with_local_bn_trains_and_refuses_model_parallelism(tmp_path, capfd):
    common = ["--config", DIGITS, "--config.comm.mode=bucketed", "--config.model.bn_sync=local"]
    r = _run([*common, "--workdir", str(tmp_path / "a"), "--config.mesh=data:8",
              *config_args(TINY_DIGITS)], xla_flags=NO_LLVM_OPT_FLAG)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["completed"]
    # the refusal (in set-up) needs no process of its own
    code, _, err = _main_here([*common, "--workdir", str(tmp_path / "b"),
                               "--config.mesh=data:4,model:2"], capfd)  # fmt: skip
    assert code == 2 and "comm.mode=xla" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def stopped_then_completed(tmp_path_factory):
    """One tiny run's workdir and two starts of the same command, each a process of its own
    (each gets a signal): the first sent SIGTERM when it prints its mesh, in set-up before
    anything is compiled (a fixed delay would land in the first steps on a fast machine);
    the second run to the end, then sent SIGTERM by itself after ``main`` returned. The two
    SIGTERM tests below read it: one tiny run for both, not one each."""
    w = tmp_path_factory.mktemp("sigterm")
    argv = ["--config", DIGITS, "--workdir", str(w), "--config.mesh=data:8",
            *config_args(TINY_DIGITS)]  # fmt: skip
    p = subprocess.Popen([sys.executable, "-m", "hybridpar.train", *argv], cwd=ROOT,
                         env=cpu_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if line.startswith("mesh:"):
                p.send_signal(signal.SIGTERM)
                break
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    stopped = dict(rc=p.returncode, out="".join(seen) + out, err=err,
                   summary=(w / "summary.json").exists(),
                   checkpoints=list((w / "checkpoints").glob("*")))  # fmt: skip
    # The same command again (its main, then a SIGTERM sent by the process itself, after
    # the train command returned, so it lands there every time).
    code = (
        "import os, signal, time; from hybridpar.tools import train; "
        f"train.main({argv!r}); "
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(60); print('not stopped')"
    )
    completed = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                               env=cpu_env(8, NO_LLVM_OPT_FLAG), capture_output=True,
                               text=True, timeout=300)  # fmt: skip
    return w, stopped, completed


def test_sigterm_before_the_first_step_exits_0_and_the_run_starts_again(
    stopped_then_completed,
):
    """A stop during set-up or compilation (as preemption often comes) used to exit 143 by
    the default action."""
    w, stopped, completed = stopped_then_completed
    assert stopped["rc"] == 0, (stopped["rc"], stopped["err"][-3000:])
    assert (
        "SIGTERM: stopped before the first step: nothing to save; the same command starts "
        "the run" in stopped["out"]
    )
    assert "\ntrain step" not in stopped["out"] and "Traceback" not in stopped["err"]
    assert not stopped["summary"] and not stopped["checkpoints"]
    # The same command starts the run from step 0 and completes it.
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = _records(w)
    assert "resume" not in {rec["event"] for rec in records}
    assert [rec["step"] for rec in records if rec["event"] == "train"][:2] == [1, 2]
    assert json.loads((w / "summary.json").read_text())["completed"]


def test_sigterm_after_a_completed_run_exits_0_quietly(stopped_then_completed):
    """The command's last lines and the interpreter's exit come after the run is done and
    written: a SIGTERM there exits 0, not 143, and says nothing."""
    w, _, r = stopped_then_completed
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.splitlines()[-1].startswith("done: ")  # nothing said after it
    assert json.loads((w / "summary.json").read_text())["completed"]


def test_signals_in_the_last_saves_wait_are_the_loops(tmp_path):
    """The loop's handlers went before the wait for the last save: a signal there met the
    default action (killed, 143, unsaid, the save half-written). Two SIGTERMs while the
    completed run's last save is waited for: the first says the run is ending, the second
    stops at once in its line."""
    argv = ["--config", DIGITS, "--workdir", str(tmp_path / "w"), "--config.mesh=data:8",
            *config_args(TINY_DIGITS)]  # fmt: skip
    code = (
        "import os, signal, time\n"
        "from hybridpar.runtime import trainer\n"
        "from hybridpar.tools import train\n"
        "finish = trainer.Checkpointer.finish\n"
        "def signalled(self):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "    return finish(self)\n"
        "trainer.Checkpointer.finish = signalled\n"
        f"train.main({argv!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(8, NO_LLVM_OPT_FLAG),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    lines = r.stdout.splitlines()
    assert lines[-2:] == [
        "SIGTERM: the run is ending; finishing its last save and records, then stopping "
        "(send SIGTERM again to stop at once)",
        "SIGTERM again: stopped at once; the steps since the last checkpoint are not saved, "
        f"and the same command resumes from that checkpoint in {tmp_path / 'w' / 'checkpoints'} "
        "(from step 0 if there is none yet)",
    ]


def test_the_training_loop_takes_over_the_early_handler_so_a_second_signal_stops_at_once():
    """In-process: once the loop's handler is in, the first SIGTERM asks for a checkpoint
    and hands the signal back to the handler from before the CLI's, not to the CLI's."""
    from hybridpar.runtime import signals

    def before(signum, frame):  # a handler of the embedding program's (Python's own: below)
        pass

    outer = signal.signal(signal.SIGTERM, before)
    early = signals.EarlyStop()
    preemption = signals.Preemption().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) is before  # the second one: as without us
    finally:
        preemption.uninstall()
        early.restore()
        assert signal.getsignal(signal.SIGTERM) is before
        signal.signal(signal.SIGTERM, outer)


def test_the_training_loop_hands_a_handler_other_than_the_early_one_back_itself():
    """Only ``EarlyStop`` is passed over: another tool's handler (``StopBetweenRuns``) gets
    the second signal itself, whatever attributes it has."""
    from hybridpar.runtime import signals

    class Other:
        original = {signal.SIGTERM: signal.SIG_DFL}  # EarlyStop's attribute once read by name

        def __call__(self, signum, frame):
            pass

    other = Other()
    before = signal.signal(signal.SIGTERM, other)
    preemption = signals.Preemption().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) is other
    finally:
        preemption.uninstall()
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_in_one_line_without_a_traceback(sig):
    """A second Ctrl-C went to Python's default handler: a KeyboardInterrupt raised inside
    JAX, a traceback, and no word of what the same command does. The command's handlers
    as the train CLI installs them, then a loop that never reaches a step boundary."""
    script = (
        "import os, signal, time\n"
        "from hybridpar.runtime import signals\n"
        # as in a terminal: a background job of a script starts with SIGINT ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signals.EarlyStop()\n"
        "p = signals.Preemption('/runs/x/checkpoints').install()\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "assert p.requested\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=cpu_env(1),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    name = signal.Signals(sig).name
    assert r.returncode == 128 + sig, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines()[-1] == (
        f"{name} again: stopped at once; the steps since the last checkpoint are not saved, "
        "and the same command resumes from that checkpoint in /runs/x/checkpoints (from "
        "step 0 if there is none yet)"
    )


@pytest.mark.parametrize("before", ["default_int_handler", "SIG_IGN"])
def test_two_signals_while_the_main_thread_waits_in_native_code_stop_at_once(before):
    """Python runs a handler only once the main thread is back in Python: two Ctrl-C during
    a slow step (the main thread waiting in XLA) ran it once, and the run went on to save at
    the next step and exit 0. Here the main thread waits in C (a key derivation that takes
    minutes and never looks at signals, as a step in XLA), while another thread sends the
    signals; each arrival counts, the first says its line then, the second stops at once.
    SIGINT ignored before (a background job of a script) is no reason to ignore the second."""
    script = (
        "import hashlib, os, signal, threading, time\n"
        "from hybridpar.runtime import signals\n"
        f"signal.signal(signal.SIGINT, signal.{before})\n"
        "signals.EarlyStop()\n"
        "signals.Preemption('/runs/x/checkpoints').install()\n"
        "def send():\n"
        "    time.sleep(1)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "    os._exit(3)  # not stopped: the second signal was lost\n"
        "threading.Thread(target=send, daemon=True).start()\n"
        "hashlib.pbkdf2_hmac('sha256', b'x', b'y', 2**31 - 1)\n"
        "print('returned')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=cpu_env(1),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 128 + signal.SIGINT, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines() == [
        "SIGINT: saving a checkpoint at the next step boundary, then stopping (send SIGINT "
        "again to stop at once)",
        "SIGINT again: stopped at once; the steps since the last checkpoint are not saved, "
        "and the same command resumes from that checkpoint in /runs/x/checkpoints (from "
        "step 0 if there is none yet)",
    ]


def test_a_stop_in_the_set_up_of_a_resumed_run_names_its_checkpoint():
    """Ctrl-C in the set-up of a resumed run said "nothing to save; the same command starts
    the run": it resumes from its checkpoint (set-up notes it: test_checkpoint.py)."""
    script = (
        "import os, signal, time\n"
        "from hybridpar.runtime import signals\n"
        "signals.EarlyStop()\n"
        "signals.note_resume(3, '/runs/x/checkpoints')\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=cpu_env(1),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.splitlines() == [
        "SIGINT: stopped before this start's first step: nothing new to save; the same "
        "command resumes from the checkpoint at step 3 in /runs/x/checkpoints"
    ]


def test_a_signal_inside_a_print_is_said_at_the_step_boundary(monkeypatch):
    """A signal that lands while the loop prints to a buffered log file: the handler's own
    print there raises (a reentrant write), which once ended a compress run with a
    traceback. The stop is still requested and its message comes at the step boundary."""
    from hybridpar.runtime import signals

    said = []

    def busy_stream(*args, **kwargs):  # what print does inside another print to one file
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='log.txt'>")

    monkeypatch.setattr(signals, "print", busy_stream, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    preemption = signals.Preemption().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested == "SIGTERM"
        monkeypatch.setattr(signals, "print", lambda *a, **k: said.append(a[0]), raising=False)
        preemption.say_unsaid()
        preemption.say_unsaid()  # once
    finally:
        preemption.uninstall()
        signal.signal(signal.SIGTERM, before)
    assert said == ["SIGTERM: saving a checkpoint at the next step boundary, then stopping "
                    "(send SIGTERM again to stop at once)"]  # fmt: skip


def test_a_folder_with_a_summary_but_no_run_is_refused_and_kept(tmp_path):
    """A workdir holding someone's summary.json but no run of ours (no config.json, no
    checkpoint): training there would overwrite it (and a bare {"completed": true} was a
    KeyError), so it is one error naming the folder, and the file stays as it was."""
    import json

    from hybridpar.config import cli
    from hybridpar.config.errors import WorkdirError
    from hybridpar.runtime import run_config

    w = tmp_path / "mine"
    w.mkdir()
    (w / "summary.json").write_text(json.dumps({"completed": True}))
    with pytest.raises(WorkdirError, match="holds a summary.json but no run"):
        run_config.check_run(str(w), cli.load(DIGITS))
    assert json.loads((w / "summary.json").read_text()) == {"completed": True}
    (w / "summary.json").unlink()
    assert run_config.check_run(str(w), cli.load(DIGITS)) is None  # the control: a new run
    (w / "config.json").write_text("[1, 2]")  # JSON, but no config (was an AttributeError)
    with pytest.raises(WorkdirError, match=r"config.json' \(it holds \[1, 2\], not a JSON object"):
        run_config.check_run(str(w), cli.load(DIGITS))


@pytest.mark.parametrize(
    "files, says",
    [
        ({"study.db": "", "trials.md": "| trial |\n", "trials/000/log.txt": ""},
         "holds a search study (tune search's study.db), not a training run: train does not "
         "run in it; use a new --workdir (each trial's own run is in trials/NNN there)"),
        ({"lr_range.json": "{}", "metrics.jsonl": ""},
         "holds an LR range test (tune lr's lr_range.json), not a training run"),
    ],
)  # fmt: skip
def test_a_tune_study_or_range_test_folder_is_refused_and_kept(tmp_path, files, says, capfd):
    """train in a tune search's folder trained beside its study.db (it has no config.json,
    so nothing refused it); in a range test's it was refused only when the config differed.
    One error naming what the folder holds, nothing written. Planted bug that fails it: no
    check_not_tune in set-up."""
    w = tmp_path / "tuned"
    for rel, text in files.items():
        (w / rel).parent.mkdir(parents=True, exist_ok=True)
        (w / rel).write_text(text)
    before = sorted(str(p.relative_to(w)) for p in w.rglob("*"))
    code, _, err = _main_here(["--config", DIGITS, "--workdir", str(w),
                               *config_args(TINY_DIGITS)], capfd)  # fmt: skip
    assert code == 2 and err.startswith(f"error: workdir {str(w)!r} {says}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(str(p.relative_to(w)) for p in w.rglob("*")) == before
