"""The trainer: one set-up, a loop over stages, checks before anything is touched.

* A one-stage run through ``trainer.train`` logs, step for step, the losses of the same
  steps built by hand from its program (so the loop adds or drops nothing).
* Two stages of different image size and batch run in one process: each stage's step is
  compiled once, before the first step, and the learning rate (per unit of the batch
  scaling) is continuous at the switch.
* A run resumed at a stage boundary starts in the next stage, step for step the same run.
* A stop while a stage switch waits for its step's background compile saves at the
  boundary at once, and resumes to the same run.
* Too many skipped steps in a row: the error names only a checkpoint saved before the loss
  grew, and tells a float16 loss scale still backing off from a diverged run.
* Config errors (unknown names, out-of-range values, bad stages) are one ``error:`` line,
  exit 2, before the workdir or any data is touched.
* ``import hybridpar`` (and its command-line parser) does not start JAX.
"""

import contextlib
import dataclasses
import glob
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import DIGITS, NO_LLVM_OPT_FLAG, CrashAt, saved_loop, tiny_digits
from xla_flags import FAST_CPU_COMPILE

from hybridpar import shard_batch
from hybridpar.config.errors import ConfigError, NonFinite, StopRequested, WorkdirError
from hybridpar.program.optim import lr_batch_factor
from hybridpar.program.state import init_sharded
from hybridpar.runtime import checkpoint, run_records, trainer
from hybridpar.runtime.run import setup

ROOT = Path(__file__).resolve().parents[1]


def records(workdir, event):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


# Two stages of different image size and batch (data:4 x model:2: per-device batches 8 then
# 16 are global 32 then 64), every stage compiled before the first step.
TWO_STAGES = dict(stages="0.3:16-8,0.6:24-16", num_epochs=0.6)


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """One uninterrupted run of TWO_STAGES (compile_ahead=before), read by the tests that
    check it and by those that compare another run with it (background compile, stopped and
    resumed): one run for all of them. ``(run, summary, workdir, stdout)``."""
    workdir = tmp_path_factory.mktemp("two_stages")
    run = setup(tiny_digits(**TWO_STAGES, compile_ahead="before"), str(workdir))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        summary = trainer.train(run)
    return run, summary, workdir, out.getvalue()


def test_one_stage_run_logs_the_losses_of_the_same_steps_built_by_hand(tmp_path):
    run = setup(tiny_digits(), str(tmp_path))
    summary = trainer.train(run)
    assert summary["completed"] and summary["steps"] == run.plan.total_steps > 5
    logged = [r["loss"] for r in records(tmp_path, "train")]
    assert [r["step"] for r in records(tmp_path, "train")] == list(range(1, summary["steps"] + 1))

    # The same steps by hand: the program's jitted step on the data's own batches.
    program, steps = run.program, summary["steps"]
    state = init_sharded(program.init, program.shardings, jax.random.key(run.config.seed))
    by_hand = []
    for host in run.data.train_batches(0):
        if len(by_hand) == steps:
            break
        state, metrics = program.train_jit(state, shard_batch(host, run.mesh))
        by_hand.append(float(metrics["loss"]))
    assert len(by_hand) == steps
    np.testing.assert_allclose(logged, by_hand, rtol=1e-6)
    assert len(set(np.round(by_hand, 4))) > 1  # the steps really train


def test_two_stages_of_different_size_and_batch_compile_once_and_keep_the_lr_continuous(
    two_stages,
):
    run, summary, workdir, out = two_stages
    config = run.config
    s0, s1 = run.plan.stages
    assert (s0.stage.global_batch, s1.stage.global_batch) == (32, 64)
    assert summary["completed"] and summary["steps"] == s1.end_step

    # Each program compiled once, all of them before the first step.
    compiles = records(workdir, "compile")
    keys = [(c["program"], c["batch"], c["image_size"]) for c in compiles]
    assert sorted(keys) == sorted([("train", 32, 16), ("train", 64, 24), ("eval", 120, 16)])
    assert len(run.program.compiles) == 3  # no compilation after the loop began
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(x)["event"] for x in lines]
    assert max(i for i, e in enumerate(events) if e == "compile") < events.index("train")
    stages = records(workdir, "stage")
    assert [(s["image_size"], s["global_batch"]) for s in stages] == [(16, 32), (24, 64)]
    # said on stdout too, at the switch and in each progress line (planted bug that fails
    # it: the stage in metrics.jsonl only, as before)
    said = [x for x in out.splitlines() if x.startswith("stage 1 begins")]
    assert said == [f"stage 1 begins at step {s1.start_step} (epoch 0.30): 24 px, global "
                    "batch 64"], out  # fmt: skip
    assert any(x.startswith("train step") and x.endswith("stage 1: 24px b64")
               for x in out.splitlines()), out  # fmt: skip

    # Memory before step 1 is every program's, the largest named: here the second stage's
    # (twice the batch at a larger size), not the first stage's that a pre-flight check of
    # the first step alone would show. Each compile line carries its own program's.
    mem = {(c["program"], c["batch"]): c["memory_per_device_bytes"]["total"] for c in compiles}
    assert mem[("train", 64)] > mem[("train", 32)] > 0 and len(set(mem.values())) == 3
    preflight = next(x for x in out.splitlines() if x.startswith("per-device memory"))
    assert "largest of 3 programs: train step (batch 64, 24 px)" in preflight
    assert f"{mem[('train', 64)] / 2**20:.1f} MiB" in preflight
    progress = next(x for x in out.splitlines() if x.startswith("train step "))
    assert out.index(preflight) < out.index(progress)  # before the first progress line
    # each compile said as it starts (a large model's take minutes, silent before): planted
    # bug that fails it, no line
    said = [x for x in out.splitlines() if x.startswith("compiling the ")]
    assert said == ["compiling the train step for batch 32 at 16 px (1/3) ...",
                    "compiling the eval step for batch 120 at 16 px (2/3) ...",
                    "compiling the train step for batch 64 at 24 px (3/3) ..."], out  # fmt: skip
    assert out.index(said[-1]) < out.index(preflight)
    assert summary["memory_per_device_bytes"]["total"] == mem[("train", 64)]
    assert len(summary["memory_by_program"]) == 3

    train = {r["step"]: r for r in records(workdir, "train")}
    assert {train[s0.end_step]["image_size"], train[s0.end_step + 1]["image_size"]} == {16, 24}
    # lr per unit of batch scaling, at each step: continuous across the switch, i.e. the
    # jump there is no larger than the per-step change on either side of it.
    rel = {s: r["lr"] / lr_batch_factor(config.optim, r["global_batch"]) for s, r in train.items()}
    k = s0.end_step
    jump = abs(rel[k + 1] - rel[k])
    assert jump <= 1.5 * max(abs(rel[k] - rel[k - 1]), abs(rel[k + 2] - rel[k + 1])) + 1e-9
    assert train[k + 1]["lr"] > train[k]["lr"]  # the batch doubled: the linear rule holds


def test_each_stage_reads_its_own_size_batch_and_crop_scale(tmp_path):
    """``host_batches`` opens each stage's input with the stage's image size, global batch
    and minimum crop scale (``@SCALE`` in the stage string), from the stage's first data
    position: recorded at the data's door, over a run resumed inside the first stage.
    (Synthetic data, digits' size: digits are never cropped, so they refuse a crop scale.)"""
    config = tiny_digits(stages="0.3:16-8@0.35,0.6:24-16@0.7", num_epochs=0.6,
                         **{"data.name": "synthetic", "data.train_examples": 1437})  # fmt: skip
    run = setup(config, str(tmp_path), with_data=True)
    opened, real = [], run.data.train_batches

    def train_batches(epoch, start_step=0, **kw):
        opened.append((epoch, start_step, kw))
        return real(epoch, start_step, **kw)

    run = _with_train_batches(run, train_batches)
    s0, s1 = run.plan.stages
    got = list(trainer.host_batches(run, 0, 2, 0, 2))  # resumed at step 2
    assert len(got) == run.plan.total_steps - 2
    assert [(b["image"].shape[0], b["image"].shape[1]) for b in (got[0], got[-1])] == [
        (32, 16), (64, 24)]  # fmt: skip
    want = [
        (0, 2, dict(steps=s0.end_step - 2, global_batch=32, image_size=16, min_scale=0.35)),
        (*trainer.start_position(s1), dict(steps=s1.num_steps, global_batch=64, image_size=24,
                                           min_scale=0.7)),
    ]  # fmt: skip
    assert opened == want


def test_a_background_compile_s_wait_counts_from_the_first_poll():
    """The trainer polls ``wait_compiled`` at a stage switch (to save on a signal meanwhile)
    and takes the step only once the compile is done: the wait was timed from then, 0 s,
    and summary's compile time left the stall out. Planted bug that fails it: the wait
    timed around ``future.result()`` only. A stand-in build, nothing compiled."""
    import time

    run = setup(tiny_digits(), with_data=False)
    program = run.program

    class Slow:  # a lowered step whose compile takes 0.5 s
        def compile(self, options=None):
            time.sleep(0.5)
            return self

        def memory_analysis(self):
            return None

    program.lower_train = lambda batch, size: Slow()
    program.compile_in_background([("train", 48, 16)])
    while not program.wait_compiled(0.05, "train", 48, 16):
        pass
    assert isinstance(program.train_step(48, 16), Slow)
    record = program.compiles[-1]
    assert record["background"] and 0.3 < record["wait_s"] < 30, record


def test_later_stages_compiled_in_the_background_train_the_same_steps(tmp_path, two_stages):
    """compile_ahead=background: the second stage's step compiles in a thread while the
    first trains; the run is step for step the one that compiles everything first (the
    shared ``two_stages`` run), and metrics.jsonl records the background compile and the
    wait for it at the switch."""
    _, _, before, _ = two_stages
    run = setup(tiny_digits(**TWO_STAGES, compile_ahead="background"),
                str(tmp_path / "background"))  # fmt: skip
    assert trainer.train(run)["completed"]
    losses = {mode: [r["loss"] for r in records(w, "train")]
              for mode, w in (("before", before), ("background", tmp_path / "background"))}
    np.testing.assert_allclose(losses["background"], losses["before"], rtol=1e-6)

    compiles = records(tmp_path / "background", "compile")
    later = [c for c in compiles if c.get("background")]
    assert [(c["program"], c["batch"], c["image_size"]) for c in later] == [("train", 64, 24)]
    assert later[0]["wait_s"] >= 0 and later[0]["step"] == run.plan.stages[1].start_step
    # Written at the switch, after the first stage's steps; the others before the first step.
    lines = (tmp_path / "background" / "metrics.jsonl").read_text().splitlines()
    events = [(r["event"], r.get("background")) for r in map(json.loads, lines)]
    first_train = events.index(("train", None))
    assert events.index(("compile", True)) > first_train
    assert all(i < first_train for i, e in enumerate(events) if e == ("compile", None))


@pytest.mark.parametrize(
    "override,expect",
    [
        ("model.name=resnet5", "model.name='resnet5' is not one of"),
        ("data.name=imagenett", "data.name='imagenett' is not one of"),
        ("model.head=full", "model.head='full' is not one of"),
        ("precision.compute=float8", "precision.compute='float8' is not one of"),
        ("data.image_size=0", "data.image_size=0 is out of range"),
        ("num_epochs=-1", "num_epochs=-1.0 is out of range"),
        ("stages=3:32-8,2:32-8", "end epochs must increase"),
        ("stages=1:16-8@1.5", "minimum crop scale of 1.5"),
        ("stages=2:16-8,5:16-8", "num_epochs=15 but stages='2:16-8,5:16-8' end at epoch 5"),
        ("stop_at_target=True target_top1=-1 target_top5=-1", "needs a target to stop at"),
        ("model.name=airbench stages=1:8-8", "image size 8 is too small for model.name"),
        ("data.translate=2", "only for the tf.data pipeline"),
        ("optim.frozen=(", "optim.frozen='(' is not a regex"),
    ],
)
def test_bad_config_values_stop_before_anything_is_touched(tmp_path, override, expect, capfd):
    """The train command's ``main`` in this process (a refusal needs no fresh JAX: a
    Python and JAX start fewer each); capfd: what C++ writes counts too."""
    from hybridpar.tools import train

    workdir = tmp_path / "w"
    overrides = [f"--config.{x}" for x in override.split()]
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--config", DIGITS, "--workdir", str(workdir), *overrides])
    err = capfd.readouterr().err
    assert e.value.code == 2, err[-2000:]
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], err
    assert not workdir.exists()  # not even the workdir: nothing was touched


def test_a_mistake_found_after_the_directory_checks_leaves_no_directory_behind(tmp_path):
    # The workdir, checkpoint and compile-cache checks create their directories; a mesh
    # larger than the devices is only found after them, once JAX is up.
    config = tiny_digits(mesh="data:64", compile_cache="workdir")
    with pytest.raises(ConfigError, match="needs 64 devices"):
        setup(config, str(tmp_path / "new" / "run"))
    assert list(tmp_path.iterdir()) == []
    mine = tmp_path / "mine"  # a workdir that was there keeps what it holds, and itself
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="needs 64 devices"):
        setup(config, str(mine))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_import_hybridpar_and_its_parser_do_not_start_jax():
    code = (
        "import sys, hybridpar, hybridpar.config.cli, hybridpar.config.schema; "
        "import hybridpar.config.curriculum; "
        "assert 'jax' not in sys.modules, 'jax imported'; "
        "hybridpar.make_mesh; assert 'jax' in sys.modules"  # and the names still resolve
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_bench_smoke_runs_without_tensorflow_or_ml_collections():
    """As on the GPU machine, which has neither: the bench must run the first time. The
    tiny ResNet in place of ResNet-50 (a --set override, as a user would pass one) keeps
    the compile short; the imports and the code path are the same. One device, as there;
    compiled without LLVM's optimisations (a large part of the compile; nothing timed here)."""
    blocker = (
        "import runpy, sys; "
        "[sys.modules.__setitem__(m, None) for m in "
        "('tensorflow', 'tensorflow_datasets', 'ml_collections')]; "
        "sys.argv = ['resnet50_gpu.py', '--smoke', '--no-torch', '--set', "
        "'model.name=resnet_tiny']; "
        "runpy.run_path('bench/gpu/resnet50_gpu.py', run_name='__main__')"
    )
    env = dict(os.environ, XLA_FLAGS=f"{NO_LLVM_OPT_FLAG} {FAST_CPU_COMPILE}", JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", blocker],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "hybridpar_ips_32=" in last and "device=cpu" in last


@pytest.mark.parametrize(
    "args,jax_platforms,says",
    [
        (["--smoke"], None, "cpu"),  # no accelerator here: the CPU, without libtpu's E0000 lines
        (["--quick"], None, "unset"),  # never the real run
        (["--smoke"], "cuda", "cuda"),  # the user's choice wins
    ],
    ids=["smoke", "real", "smoke-set"],
)
def test_gpu_run_sh_smoke_runs_on_the_cpu_where_there_is_no_accelerator(
    args, jax_platforms, says, tmp_path
):
    """bench/gpu/run.sh --smoke printed libtpu's E0000 lines on a CPU machine: JAX started every
    installed plugin first. It now sets JAX_PLATFORMS=cpu for the smoke alone, as hybridpar's
    tools do, where there is no GPU or TPU. A stand-in Python (no compile) shows what the
    bench would be started with. Planted bug that fails it: no JAX_PLATFORMS in run.sh."""
    from hybridpar.config import cli

    if any(map(glob.glob, cli.ACCELERATOR_FILES)):
        pytest.skip("an accelerator here: the smoke runs on it")
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in -) cat >/dev/null ;; -c) exit 1 ;; '  # the package check; no torch
        '*) echo "JAX_PLATFORMS=${JAX_PLATFORMS-unset} $*" ;; esac\n'
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHON"] = str(fake)
    if jax_platforms:
        env["JAX_PLATFORMS"] = jax_platforms
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "run.sh"), *args], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        f"JAX_PLATFORMS={says} -u bench/gpu/resnet50_gpu.py --no-torch {' '.join(args)}"
    ), r.stdout


class Poisoned:
    """The run's compiled train step, except that the steps in ``bad`` get images of NaN
    (through the same step, jitted for float images): their loss and gradients are not
    finite, as after an overflow or a corrupt batch."""

    def __init__(self, program, compiled, bad):
        self.program, self.compiled, self.bad, self.calls = program, compiled, bad, 0

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def __call__(self, state, batch):
        self.calls += 1
        if self.calls not in self.bad:
            return self.compiled(state, batch)
        nan = {"image": np.full(batch["image"].shape, np.nan, np.float32)}
        return self.program.train_jit(state, {**batch, **shard_batch(nan, self.program.mesh)})


class Params:
    """A hook that keeps every step's parameters and BatchNorm statistics (host copies)."""

    def __init__(self):
        self.after = {}

    def __call__(self, loop, state, metrics, stage):
        self.after[loop.step] = jax.device_get((state.params, state.batch_stats))


class StopAt:
    """A hook that asks the loop to stop after step ``k``, the one way a hook may."""

    def __init__(self, k):
        self.k, self.seen = k, []

    def __call__(self, loop, state, metrics, stage):
        self.seen.append(loop.step)
        if loop.step == self.k:
            raise StopRequested(f"asked at step {self.k}")


class SigtermAt:
    """A hook that sends this process SIGTERM (or ``sig``) after step ``k``: the trainer
    saves a checkpoint at that step and stops, as for a real preemption."""

    def __init__(self, k, sig=signal.SIGTERM):
        self.k, self.sig = k, sig

    def __call__(self, loop, state, metrics, stage):
        if loop.step == self.k:
            os.kill(os.getpid(), self.sig)


def test_a_hook_stops_the_run_cleanly_by_raising_stop_requested(tmp_path):
    """The run ends there, not failed: the summary says why and where, the hooks after the
    stopping one (here a second probe, then the checkpointer) do not see that step."""
    run = setup(tiny_digits(), str(tmp_path))
    stop, after = StopAt(3), StopAt(-1)
    summary = trainer.train(run, hooks=[stop, after])
    assert summary["preempted"] == "asked at step 3" and summary["steps"] == 3
    assert summary["epochs"] == round(run.plan.epoch_at(3), 4) > 0  # report's epochs column
    assert not summary["completed"] and summary["error"] is None
    assert stop.seen == [1, 2, 3] and after.seen == [1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["preempted"] == "asked at step 3"


@pytest.mark.parametrize("eval_every_epochs,early", [(0.25, False), (0.125, True)])
def test_the_log_claims_a_stop_at_target_only_where_the_summary_does(
    tmp_path, capsys, eval_every_epochs, early
):
    """Targets reached at the last step's evaluation end no run early: neither the log nor
    the summary says a stop; reached at an earlier evaluation, both do."""
    config = tiny_digits(stop_at_target=True, target_top1=0.001, target_top5=0.001,
                         num_epochs=0.25, eval_every_epochs=eval_every_epochs)  # fmt: skip
    summary = trainer.train(setup(config, str(tmp_path)))
    assert summary["completed"] and summary["stopped_at_target"] is early
    assert (summary["steps"] < summary["total_steps"]) is early
    assert ("stopping there (stop_at_target)" in capsys.readouterr().out) is early


def test_a_nonfinite_step_is_skipped_and_counted_and_k_in_a_row_stop_the_run(tmp_path, capsys):
    """Steps 3 and 6..8 poisoned: each skipped and counted (the progress line and the
    summary say how many), the third in a row stops the run. The error names step 4's
    checkpoint, not step 6's (saved with the parameters that gave step 6 its non-finite
    loss), and its advice works: with step 6's moved away the run resumes from step 4, and
    the summary counts the first start's skipped step too. Planted bugs that fail it: no
    ``skipped N`` on the progress line; the earlier segment's skips left out of the total."""
    config = tiny_digits(**{"max_nonfinite_steps": 3, "checkpoint.every_steps": 2})
    run = setup(config, str(tmp_path))
    compiled = run.program.train_step(config.global_batch, config.data.image_size)
    poisoned = Poisoned(run.program, compiled, bad={3, 6, 7, 8})
    run.program.train_step = lambda batch, size: poisoned
    params = Params()
    with pytest.raises(NonFinite) as e:
        trainer.train(run, hooks=[params])
    msg = str(e.value)
    where = tmp_path / "checkpoints"
    assert "3 steps in a row (6..8) had a non-finite loss or gradient" in msg
    assert "the parameters are those after step 5" in msg
    assert f"the checkpoint of step 6 in {where} was saved after the loss was last sane" in msg
    assert f"move it out of {where} and resume from step 4's with the changed config" in msg
    progress = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train step")]
    assert [x.endswith("skipped 1") for x in progress] == [s in (3, 6, 7) for s in range(1, 8)]

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    # each skipped step changed nothing; the steps between them trained (the stop comes in
    # the progress hook at step 8, before the later hooks see it)
    assert sorted(params.after) == list(range(1, 8))
    assert same(params.after[3], params.after[2]) and not same(params.after[4], params.after[3])
    assert all(same(params.after[s], params.after[5]) for s in (6, 7))
    lines = {r["step"]: r for r in records(tmp_path, "train")}
    assert [lines[s]["skipped_steps"] for s in range(1, 8)] == [0, 0, 1, 0, 0, 1, 1]
    assert lines[3]["loss"] is None and lines[4]["loss"] is not None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["completed"] and "3 steps in a row" in summary["error"]
    # no save after the stop: the checkpoints are those of steps 2, 4 and 6, the last one
    # holding the parameters of step 5 (skipped steps 6 leaves them as they were)
    saver = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
    assert saver.manager.all_steps() == [2, 4, 6]
    step, state, loop, _ = saver.restore(run.program.abstract_state())
    saver.close()
    assert step == 6 and loop["step"] == 6
    assert same(jax.device_get((state.params, state.batch_stats)), params.after[5])
    assert summary["skipped_steps"] == 4 and loop["skipped_steps"] == 2  # 3 and 6

    # the advice: step 6's checkpoint moved away, the same run resumes from step 4's
    (where / "6").rename(tmp_path / "diverged-6")
    resumed = trainer.train(setup(config, str(tmp_path)))
    assert resumed["completed"] and resumed["resumed_from"] == 4
    assert resumed["skipped_steps"] == 1  # step 3's, from the first start


def test_a_diverged_run_names_no_checkpoint_saved_after_its_loss_grew(tmp_path):
    """An LR of 1e8: the loss is huge from step 2 and non-finite soon after, while
    checkpoints go on being saved every 3 steps. They hold the diverged weights, so the
    error must not offer one to resume from: it says they may hold diverged weights and to
    start again in a new workdir. Planted bug that fails it: every checkpoint on disk taken
    as saved before the loss grew (the error's old "the last checkpoint ... is intact")."""
    config = tiny_digits(**{"optim.base_lr": 1e8, "optim.warmup_epochs": 0,
                            "checkpoint.every_steps": 3, "max_nonfinite_steps": 5})  # fmt: skip
    with pytest.raises(NonFinite) as e:
        trainer.train(setup(config, str(tmp_path)))
    msg = str(e.value)
    train = records(tmp_path, "train")
    assert train[0]["loss"] < 10 and train[1]["loss"] > 1e3  # the loss grew at step 2
    saved = [r["step"] for r in records(tmp_path, "checkpoint")]
    assert saved and min(saved) >= 3
    steps = ", ".join(map(str, saved))
    assert f"the checkpoints in {tmp_path / 'checkpoints'} (steps {steps}) were saved" in msg
    assert "may hold diverged weights: start again with the changed config in a new" in msg
    assert "resume from" not in msg and "The run diverged" in msg


def test_the_losses_of_an_earlier_segment_say_where_they_were_last_sane():
    """A resumed run takes up watching its loss from the records up to its checkpoint: the
    first logged loss, and the last line at most 10x it (a line of skipped steps only, with
    no loss, is not sane; lines after the checkpoint were superseded). Planted bug that
    fails it: the lines after the checkpoint read too."""

    def line(step, loss):
        return run_records.make("train", step=step, epoch=0.1, wall_s=1.0, loss=loss, lr=0.1)

    recs = [line(1, 2.0), line(2, 1.5), line(3, 30.0), line(4, None), line(5, 1.8), line(6, 2.1)]
    assert trainer.sane_losses(recs, 5) == trainer.SaneLoss(2.0, 5)
    assert trainer.sane_losses(recs, 4) == trainer.SaneLoss(2.0, 2)
    assert trainer.sane_losses(recs, None) == trainer.SaneLoss(None, 0)  # a new run


def test_float16_still_backing_off_its_loss_scale_says_so_not_that_the_run_diverged(
    tmp_path,
):
    """float16 with a loss scale of 1e30: every step's gradients overflow and the scale
    halves at each, still far above 1 when max_nonfinite_steps stops the run. The error
    says that and how to fix it, not that the run diverged (nor to use loss scaling, which
    it does). Planted bug that fails it: the float16 case not told apart."""
    config = tiny_digits(**{"precision.compute": "float16", "precision.loss_scale_initial": 1e30,
                            "max_nonfinite_steps": 5})  # fmt: skip
    with pytest.raises(NonFinite) as e:
        trainer.train(setup(config, str(tmp_path)))
    msg = str(e.value)
    assert "5 steps in a row (1..5)" in msg
    assert f"loss scale was still backing off (1e+30 at step 1, {1e30 / 16:g} at step 5" in msg
    assert "lower precision.loss_scale_initial (now 1e+30; e.g. 32768) or raise" in msg
    assert "diverged" not in msg and "instead of pure low precision" not in msg


def test_float16_skipping_steps_whose_losses_grew_is_told_the_run_diverged():
    """The scale still backing off, but the skipped steps' losses have grown past 10x the
    first (a far too high LR): the weights diverged, so the error says so, not to lower the
    scale (to the value it already had) or to allow more skipped steps. With sane losses
    it backs off, suggesting a scale below the one reached."""
    from types import SimpleNamespace

    config = tiny_digits(**{"precision.compute": "float16", "max_nonfinite_steps": 3})

    def stop(losses):
        p = trainer.Progress(SimpleNamespace(config=config), writer=None)
        p.pending = [dict(grads_finite=True, loss=2.3, loss_scale=32768.0)]
        p.pending += [dict(grads_finite=False, loss=x, loss_scale=32768.0 / 2**i)
                      for i, x in enumerate(losses)]  # fmt: skip
        with pytest.raises(NonFinite) as e:
            p.count_skips()
        return str(e.value)

    diverged = stop([33547.0, 1e9, 2e12])
    assert "The run diverged" in diverged and "backing off" not in diverged
    backing = stop([2.3, 2.2, 2.4])
    assert "still backing off" in backing and "(now 32768; e.g. 4096)" in backing


def _with_train_batches(run, train_batches):
    """``run`` whose data opens its training batches with ``train_batches``."""
    return dataclasses.replace(run, data=dataclasses.replace(run.data, train_batches=train_batches))


def _slow_input(run, delay_s):
    """``run`` whose training batches each take ``delay_s`` longer to make."""
    real = run.data.train_batches

    def train_batches(*args, **kw):
        for batch in real(*args, **kw):
            time.sleep(delay_s)
            yield batch

    return _with_train_batches(run, train_batches)


DELAY_S = 0.3


def test_where_the_time_went_adds_up_to_the_wall_time_and_measures_the_input_wait(tmp_path):
    """summary.json's ``time_breakdown`` adds up to its wall time (within 2%), with time in
    set-up, compilation, train steps and evaluation, and ``goodput`` = train / wall. The
    input wait is measured: batches made 0.3 s slower each put much of that wait per step
    into ``input_wait``, over the same run's with its normal input.
    Planted bugs that fail it: the wait for a batch counted as train time; evaluation
    counted as train time."""
    summaries = {}
    for name, delay in (("normal", 0.0), ("slow", DELAY_S)):
        run = setup(tiny_digits(eval_every_epochs=0.1), str(tmp_path / name))
        summaries[name] = trainer.train(_slow_input(run, delay) if delay else run)
    for name, s in summaries.items():
        parts, wall = s["time_breakdown"], s["wall_s"]
        assert sum(parts.values()) == pytest.approx(wall, rel=0.02), (name, parts, wall)
        assert set(parts) <= set(run_records.TIME_PARTS) and min(parts.values()) >= 0
        assert all(parts[p] > 0 for p in ("setup", "compile", "train", "eval")), parts
        assert s["goodput"] == pytest.approx(parts["train"] / wall, abs=1e-3)
        assert "redone" not in parts  # nothing was done twice
        saved = json.loads((tmp_path / name / "summary.json").read_text())
        assert saved["time_breakdown"] == parts
    # Each step takes about as long as a slow batch's delay here, and evaluations let the
    # input run ahead: far from all of the delay is waited for, but much of it is.
    waits = {n: s["time_breakdown"]["input_wait"] for n, s in summaries.items()}
    assert waits["slow"] - waits["normal"] >= 0.4 * summaries["slow"]["steps"] * DELAY_S
    assert len(records(tmp_path / "normal", "eval")) >= 2  # the eval part had evaluations


def test_a_run_killed_before_its_first_checkpoint_starts_again_and_supersedes_its_records(
    tmp_path, capsys
):
    """A crash at step 3 with no checkpoint yet (what kill -9 early in a run leaves: train
    records and nothing to resume from): the same call trains from step 0 again, says so,
    and writes a ``resume`` record from step 0, so the run's records hold each step once, as
    in an uninterrupted run (the earlier lines gave a line of negative steps to the bench's
    clock), and the redone steps count as ``redone``. The restart changes a key that needs
    no --allow-config-change (eval_batch). Planted bugs that fail it: no record written on a
    restart from step 0; the first start's compile records kept; the changed key's LR check
    reading the checkpoint that is not there (a TypeError)."""
    config = tiny_digits(**{"checkpoint.every_steps": 0})
    with pytest.raises(RuntimeError, match="crash at step 3"):
        trainer.train(setup(config, str(tmp_path)), hooks=[CrashAt(3)])
    (tmp_path / "summary.json").unlink(missing_ok=True)
    assert [r["step"] for r in records(tmp_path, "train")][-1] == 3
    config.eval_batch //= 2
    again = trainer.train(setup(config, str(tmp_path)))
    assert again["completed"] and again["resumed_from"] is None
    assert "training again from step 0" in capsys.readouterr().out
    restarts = records(tmp_path, "resume")
    assert [(r["step"], r["from_step"]) for r in restarts] == [(0, 0)]
    run = run_records.read_run(str(tmp_path))
    kept = [r.step for r in run.train]
    assert kept == sorted(set(kept)) and kept[-1] == again["steps"]
    assert again["time_breakdown"].get("redone", 0) > 0
    # the first start's compiles were never saved: the records count the restart's, as
    # summary.json does (the report summed both)
    assert len(records(tmp_path, "compile")) > len(run.compile) > 0
    assert sum(c.waited_s for c in run.compile) == pytest.approx(again["compile_s"], abs=2e-3)


def test_a_run_resumed_from_an_older_checkpoint_counts_the_redone_steps_and_the_restart(
    tmp_path,
):
    """Stopped at step 6 with its last checkpoint at step 4, then resumed by the same call:
    steps 5 and 6 are done again (``redone``, not train time), set-up counts both segments'
    (the first's as its checkpoint saved it, plus the restart's), and the parts still add up
    to the wall time, which goes on from the checkpoint. Planted bugs that fail it: the
    earlier segments' parts dropped on resume; redone steps counted as train time."""
    config = tiny_digits(**{"checkpoint.every_steps": 4})
    stopped = trainer.train(setup(config, str(tmp_path)), hooks=[StopAt(6)])
    assert stopped["preempted"] and stopped["latest_checkpoint"] == 4
    saved = saved_loop(tmp_path, 4)["time_parts"]
    assert saved["setup"] > 0 and saved["train"] > 0
    resumed = trainer.train(setup(config, str(tmp_path)))
    assert resumed["completed"] and resumed["resumed_from"] == 4
    parts = resumed["time_breakdown"]
    assert sum(parts.values()) == pytest.approx(resumed["wall_s"], rel=0.02)
    assert parts.get("redone", 0) > 0
    # the first start's time after the checkpoint at 4 (to its last record) counts too: the
    # save's blocking part as checkpoint time (the snapshot could not hold it), the rest lost
    [resume] = records(tmp_path, "resume")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    before = [r for r in map(json.loads, lines) if r.get("wall_s") is not None]
    last_before = before[before.index(resume) - 1]["wall_s"]
    after = resume["lost_s"] + (resume["saving_s"] or 0)
    assert after == pytest.approx(last_before - resume["from_wall_s"], abs=2e-3)
    [saved_4] = [r for r in records(tmp_path, "checkpoint") if r["step"] == 4]
    assert resume["saving_s"] == pytest.approx(saved_4["blocking_s"], abs=2e-3)
    assert resume["lost_s"] > 0 and parts["lost"] == pytest.approx(resume["lost_s"], abs=2e-3)
    assert resume["wall_s"] >= last_before  # the clock never runs back
    assert parts["setup"] > saved["setup"]  # the restart's set-up on top of the first's
    assert parts["compile"] > saved["compile"]  # the restart compiled again
    assert resumed["goodput"] == pytest.approx(parts["train"] / resumed["wall_s"], abs=1e-3)


def test_a_completed_run_extended_counts_its_last_save_as_checkpoint_time_not_lost(tmp_path):
    """A completed run extended (num_epochs raised, --allow-config-change): the time after
    its last checkpoint's snapshot is that checkpoint's own save, which the run waited for,
    not time a restart threw away; it was reported as ``lost``. Planted bug that fails it:
    every second after the snapshot counted as lost."""
    config = tiny_digits()
    assert trainer.train(setup(config, str(tmp_path)))["completed"]
    [last] = records(tmp_path, "checkpoint")[-1:]
    config.num_epochs *= 2
    extended = trainer.train(setup(config, str(tmp_path), allow_config_change=True))
    assert extended["completed"] and extended["resumed_from"] == last["step"]
    [resume] = records(tmp_path, "resume")
    after = (resume["lost_s"] or 0) + resume["saving_s"]
    assert after == pytest.approx(last["wall_s"] - resume["from_wall_s"], abs=2e-3)
    assert resume["saving_s"] == pytest.approx(last["total_s"], abs=2e-3)
    parts = extended["time_breakdown"]
    assert parts.get("lost", 0) == pytest.approx(resume["lost_s"] or 0, abs=2e-3)
    assert sum(parts.values()) == pytest.approx(extended["wall_s"], rel=0.02)


@pytest.mark.parametrize("more, said", [(10, "{n} -> {m}"), (0, "other files, the same {n}")])
def test_a_resume_on_changed_data_says_so_and_records_both_sizes(tmp_path, capsys, more, said):
    """Resumed after the data was prepared again with other examples (files added to an
    images source): the plan follows the new size, so the epochs and the LR schedule
    change mid-run. The log says so and the resume record keeps both sizes. The same
    count of other files (images swapped between starts) is said too: only the counts
    were compared. Planted bugs that fail it: the comparison left out; only counts
    compared."""
    config = tiny_digits(**{"checkpoint.every_steps": 4})
    run = setup(config, str(tmp_path))
    run.data.info["train_fingerprint"] = "0123456789abcdef"  # as an images source records it
    trainer.train(run, hooks=[StopAt(6)])
    run = setup(config, str(tmp_path))
    real = run.data.info["train_examples"]
    run.data.info["train_examples"] = real + more  # as a source prepared again
    run.data.info["train_fingerprint"] = "fedcba9876543210"
    capsys.readouterr()
    assert trainer.train(run)["completed"]
    [resume] = records(tmp_path, "resume")
    counts = [real, real + more] if more else None  # the same count: other files only
    assert resume.get("train_examples_changed") == counts
    assert resume.get("train_files_changed") == (None if more else True)
    out = capsys.readouterr().out
    said = said.format(n=real, m=real + more)
    assert f"the training data changed since the run's last start ({said}" in out


def test_a_train_fingerprint_compares_only_where_both_starts_have_one():
    """A ``data`` record from before ``train_fingerprint`` (or a source without one, as
    digits) compares as unknown: no warning for the same count. Planted bug that fails
    it: a missing digest taken as a change."""
    from hybridpar.runtime.run_records import Data

    def change(before, now):
        last = Data(step=0, epoch=0.0, wall_s=0.0, train_examples=50, train_fingerprint=before)
        return trainer.train_files_changed(last, {"train_examples": 50, "train_fingerprint": now})

    assert not change(None, "a") and not change("a", None) and not change("a", "a")
    assert change("a", "b") is True


def test_a_class_added_or_removed_names_the_counts():
    """check_same_classes on a class list of another length (a folder added): the labels
    that moved and both counts. Planted bug that fails it: only renames compared."""
    from hybridpar.runtime.run_records import Data

    last = Data(step=0, epoch=0.0, wall_s=0.0, classes=["ant", "bee"])
    with pytest.raises(WorkdirError, match=r"\(2 -> 3 classes\): the checkpoint at step 4"):
        trainer.check_same_classes(last, {"classes": ["ant", "bee", "cat"]}, 4, "/d")


def test_a_resume_on_other_classes_is_refused_before_anything_is_written(tmp_path):
    """Class folders renamed between starts (bird -> zbird): prepare saw it and prepared the
    data again, and the resumed run trained on with label 1 now 'cat', where the checkpoint
    had learned 'bird' (only the example count was compared). Planted bug that fails it: no
    check."""
    config = tiny_digits(**{"checkpoint.every_steps": 4})
    names = ["airplane", "bird", "cat"] + [f"c{i}" for i in range(3, 10)]
    run = setup(config, str(tmp_path))
    run.data.info["classes"] = names  # as an images source records them
    trainer.train(run, hooks=[StopAt(6)])
    before = (tmp_path / "metrics.jsonl").read_text()
    run = setup(config, str(tmp_path))
    run.data.info["classes"] = ["airplane", "cat", "zbird"] + names[3:]
    with pytest.raises(WorkdirError) as e:
        trainer.train(run)
    assert str(e.value).startswith(
        "the classes changed since the run's last start (label 1: 'bird' -> 'cat'; label 2: "
        "'cat' -> 'zbird'): the checkpoint at step 4 in "
    ), e.value
    assert (tmp_path / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("warmup, warned", [(0.25, True), (0.4, True), (0.1, False)])
def test_a_warmup_as_long_as_the_run_is_a_warning_at_set_up(tmp_path, capsys, warmup, warned):
    """A warmup of the whole run or longer (num_epochs=0.25): the LR only rises. A warning,
    not an error: a recipe shortened for a smoke test does it on purpose. Planted bug that
    fails it: no check."""
    setup(tiny_digits(**{"optim.warmup_epochs": warmup}), str(tmp_path), with_data=False)
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("warning: optim.warmup_epochs")]
    assert bool(line) == warned, out
    if warned:
        assert f"optim.warmup_epochs={warmup:g} is not shorter than the run" in line[0]
        assert "--config.optim.warmup_epochs=0.025" in line[0]


def test_the_step_is_called_under_a_transfer_guard(tmp_path, monkeypatch):
    """Batches reach the step already on the devices (the prefetch places them); a host
    batch there would be an implicit copy on every step, which the loop's transfer guard
    makes an error. Here the prefetch is bypassed, so numpy batches reach the step. Planted
    bug that fails it: the guard left out (XLA then copies them silently)."""
    from hybridpar.input import prefetch

    monkeypatch.setattr(prefetch, "prefetch_to_mesh", lambda batches, mesh, size: iter(batches))
    run = setup(tiny_digits("data:8"), str(tmp_path))
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        trainer.train(run)


class StageDone:
    """A hook that sets ``done`` after step ``k``, a stage's last."""

    def __init__(self, k):
        self.k, self.done = k, threading.Event()

    def __call__(self, loop, state, metrics, stage):
        if loop.step == self.k:
            self.done.set()


def test_a_stop_while_the_next_stage_compiles_saves_at_the_boundary_at_once(
    tmp_path, two_stages
):
    """compile_ahead=background, the second stage's compile held until released: a SIGTERM
    that comes while the stage switch waits for it saves the checkpoint at the boundary and
    stops there, without waiting for the compile or running a step of the next stage; the
    same config resumes from it to the losses of the run never stopped. Planted bug that
    fails it: the switch waits for the compile without looking at the stop (released after
    ``hold_s`` so that it fails, not hangs: it then stops a step into the next stage).
    The run never stopped is the shared ``two_stages`` (compiled before: the same steps as
    in the background, test_later_stages_compiled_in_the_background_train_the_same_steps)."""
    overrides = dict(**TWO_STAGES, compile_ahead="background")
    run, whole, whole_dir, _ = two_stages
    assert whole["completed"]
    s0, s1 = run.plan.stages

    workdir = tmp_path / "split"
    run = setup(tiny_digits(**overrides), str(workdir))
    stage_done, release, hold_s = StageDone(s0.end_step), threading.Event(), 30
    lower_train = run.program.lower_train
    held_out = []  # the hold ran out and the compile went on

    def held(batch, size):  # the background thread's compile of the second stage's step
        if size == s1.stage.image_size:
            # the signal after the first stage's last step, and late enough for the hooks
            # after StageDone (the checkpointer) to be done: it comes while the switch waits
            if stage_done.done.wait(hold_s):
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGTERM)
            if release.wait(hold_s):  # the run is over: nothing to compile
                raise RuntimeError("the test abandoned this compile")
            held_out.append(size)
        return lower_train(batch, size)

    run.program.lower_train = held
    try:
        stopped = trainer.train(run, hooks=[stage_done])
    finally:
        release.set()
    assert held_out == []  # it stopped while the compile was still held
    assert stopped["preempted"] == "SIGTERM" and not stopped["completed"]
    assert stopped["steps"] == stopped["latest_checkpoint"] == s0.end_step
    assert max(r["step"] for r in records(workdir, "train")) == s0.end_step
    assert [r["stage"] for r in records(workdir, "stage")] == [0]
    # the loop state a stop at that step saves: still in the finished stage
    assert saved_loop(workdir, s0.end_step)["stage"] == 0

    resumed = trainer.train(setup(tiny_digits(**overrides), str(workdir)))
    assert resumed["completed"] and resumed["resumed_from"] == s0.end_step
    want = {r["step"]: r["loss"] for r in records(whole_dir, "train")}
    got = {r.step: r.loss for r in run_records.read_run(str(workdir)).train}
    assert got == want and len(got) == s1.end_step


def test_a_run_resumed_at_a_stage_boundary_starts_in_the_next_stage(
    tmp_path, capsys, two_stages
):
    """Stopped at the first stage's last step, with its checkpoint there, then resumed: the
    resumed start compiles and marks only the second stage (not the finished one, for none
    of its steps), its memory line names only the programs that run, and the losses are
    those of the same run uninterrupted, step for step. Planted bug that fails it: the
    resumed start begins from the checkpoint's ``LoopState.stage`` (the finished stage).
    The run uninterrupted is the shared ``two_stages``. The stop is a SIGHUP (an ssh
    session that closed), which ended the run unsaved: it saves as SIGTERM does."""
    run, whole, whole_dir, _ = two_stages
    assert whole["completed"]
    s0, s1 = run.plan.stages
    config = tiny_digits(**TWO_STAGES)
    workdir = tmp_path / "split"
    hup = SigtermAt(s0.end_step, signal.SIGHUP)
    stopped = trainer.train(setup(config, str(workdir)), hooks=[hup])
    assert stopped["latest_checkpoint"] == stopped["steps"] == s0.end_step
    assert stopped["preempted"] == "SIGHUP"
    capsys.readouterr()
    resumed = trainer.train(setup(config, str(workdir)))
    assert resumed["completed"] and resumed["resumed_from"] == s0.end_step
    out = capsys.readouterr().out

    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    after = recs[next(i for i, r in enumerate(recs) if r["event"] == "resume") :]
    compiled = [(r["program"], r["batch"], r["image_size"]) for r in after
                if r["event"] == "compile"]  # fmt: skip
    assert sorted(compiled) == [("eval", 120, 16), ("train", 64, 24)]
    assert [r["stage"] for r in after if r["event"] == "stage"] == [1]
    preflight = next(x for x in out.splitlines() if x.startswith("per-device memory"))
    assert "batch 32" not in preflight and "largest of 2 programs" in preflight
    assert [p["name"] for p in resumed["memory_by_program"] if "batch 32" in p["name"]] == []

    want = {r["step"]: r["loss"] for r in records(whole_dir, "train")}
    got = {r.step: r.loss for r in run_records.read_run(str(workdir)).train}
    assert got == want and len(got) == s1.end_step
    assert resumed["final_eval"]["loss"] == whole["final_eval"]["loss"]


def test_a_run_on_synthetic_data_says_so_and_that_its_target_cannot_be_reached():
    """The ImageNet recipes without a data path train on synthetic images, and their plan
    reads like the real run's: the run says what it trains on, and with a target (93%
    top-5 for DAWNBench) warns that random labels never reach it."""
    c = tiny_digits(**{"data.name": "synthetic", "data.train_examples": 512,
                       "target_top1": -1.0, "target_top5": -1.0})  # fmt: skip
    assert trainer.synthetic_note(c).startswith("data: synthetic data (data.name=synthetic)")
    c.target_top1, c.target_top5 = -1.0, 0.93
    note = trainer.synthetic_note(c)
    assert note.startswith("warning: synthetic") and "target_top5=0.93 cannot be reached" in note
    assert "target_top1" not in note and "512 an epoch" in note


def test_stages_of_one_batch_and_size_compile_one_program_said_once(tmp_path, capsys):
    """Stages that differ only in momentum share a train step: the compile lines counted it
    once per stage ('(3/3)' for 2 programs). Planted bug that fails it: the list not
    de-duplicated."""
    config = tiny_digits(stages="0.2:16-8~0.9,0.4:16-8~0.95", num_epochs=0.4,
                         compile_ahead="before")  # fmt: skip
    run = setup(config, None, with_data=False)
    capsys.readouterr()
    trainer.compile_all(run, 0)
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("compiling the ")]
    assert [x.rsplit(" (", 1)[1] for x in said] == ["1/2) ...", "2/2) ..."], said
    assert len(run.program.compiles) == 2
