"""Compression: channel pruning (``hybridpar/prune.py``), distillation
(``hybridpar/distill.py``) and the compress-and-retrain loop (``python -m
hybridpar.compress``).

* Pruning nothing, with every group's channels in a random order, leaves the logits as they
  were (basic and bottleneck ResNets, the airbench net): residual-tied channels share one
  order. One producer
  of a residual group ordered on its own is rejected by the same check.
* A 50%-pruned model has the shapes of the ResNet its width keys build; a consumer left
  unpruned is rejected.
* On a tiny trained digits run: the pruned run trains from its weights and evaluates through
  ``python -m hybridpar.prune`` and ``python -m hybridpar.train``; the teacher's widths with
  the pruned weights are an ``error:`` line.
* The teacher as its own student: the distillation term stays near 0 (a random student's is
  far above); the distillation step on 8 devices computes what one device does.
* The loop resumes a round stopped by SIGTERM, and bad input is one ``error:`` line.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import DIGITS, config_args, cpu_env, random_variables, tiny_digits

from hybridpar import distill, partitioning, prune, run, trainer
from hybridpar.models.airbench import AirbenchNet
from hybridpar.models.resnet import ResNet50, ResNetTiny

ROOT = Path(__file__).resolve().parents[1]
EPS32 = float(np.finfo(np.float32).eps)
LONGER = {"num_epochs": 1.5, "log_every_s": 5.0, "mesh": "data:1"}  # as test_quantize's run


MODELS = [
    (ResNetTiny(num_classes=10), 16),
    (ResNet50(num_classes=10, num_filters=4), 32),
    (AirbenchNet(num_classes=10, num_filters=8), 16),
]
IDS = ["tiny-basic", "resnet50-bottleneck", "airbench"]


def _logits(model, params, stats, x):
    return np.asarray(model.apply({"params": params, "batch_stats": stats}, x, train=False))


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_pruning_nothing_keeps_the_logits(model, size):
    params, stats = random_variables(model, size)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, size, size, 3)), jnp.float32)
    want = _logits(model, params, stats, x)
    gs = prune.groups(model, params)
    rng = np.random.default_rng(2)
    widths = prune.group_widths(gs, params)
    order = {g.name: rng.permutation(widths[g.name]) for g in gs}  # every channel, reordered
    p, s = prune.apply(gs, params, stats, order)
    got = _logits(model.clone(**prune.widths_of(model, p)), p, s, x)
    # the same sums in another order: a few float32 roundings of the logits' scale
    tol = 1000 * EPS32 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    # negative control: one producer of a residual group ordered apart from the others (the
    # airbench net has none: there, the first conv's readers left in the old order)
    tied = next((g for g in gs if len(g.producers) > 1), None)
    if tied is None:
        broken = [prune.Group(gs[0].name, gs[0].producers, [])] + gs[1:]
    else:
        alone = prune.Group("alone", tied.producers[-1:], [])
        rest = prune.Group(tied.name, tied.producers[:-1], tied.consumers)
        broken = [g for g in gs if g.name != tied.name] + [rest, alone]
        order["alone"] = rng.permutation(widths[tied.name])
    p, s = prune.apply(broken, params, stats, order)
    bad = _logits(model.clone(**prune.widths_of(model, p)), p, s, x)
    assert np.abs(bad - want).max() > 100 * tol


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_half_pruned_shapes_are_the_narrower_resnet(model, size):
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    counts = prune.counts_for(gs, prune.group_widths(gs, params), 0.5)
    keep = prune.keep_masks(gs, params, stats, counts)
    p, s = prune.apply(gs, params, stats, keep)
    narrow = model.clone(**prune.widths_of(model, p))
    x = jnp.zeros((1, size, size, 3), jnp.float32)
    want = meta.unbox(jax.eval_shape(lambda: narrow.init(jax.random.key(0), x, train=False)))
    shapes = lambda t: jax.tree.map(np.shape, t)  # noqa: E731
    assert shapes(want["params"]) == shapes(p) and shapes(want["batch_stats"]) == shapes(s)
    n = sum(np.size(a) for a in jax.tree.leaves(params))
    assert sum(np.size(a) for a in jax.tree.leaves(p)) < 0.4 * n  # widths halved: ~1/4
    # negative control: the head left out of the last group's readers
    last = gs[[i for i, g in enumerate(gs) if "head" in g.consumers][0]]
    last.consumers.remove("head")
    p, s = prune.apply(gs, params, stats, keep)
    assert shapes(want["params"]) != shapes(p)


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_param_count_is_the_pruned_models(model, size):
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    rng = np.random.default_rng(3)
    counts = {g.name: int(rng.integers(1, w + 1)) for g, w in
              zip(gs, prune.group_widths(gs, params).values())}  # fmt: skip
    for name in counts:  # a bottleneck's inner convs share one width
        counts[name] = counts.get(name.replace("/conv2", "/conv1"), counts[name])
    p, _ = prune.apply(gs, params, stats, prune.keep_masks(gs, params, stats, counts))
    assert prune.param_count(gs, params, counts) == sum(np.size(a) for a in jax.tree.leaves(p))
    assert prune.param_count(gs, params, {}) == sum(np.size(a) for a in jax.tree.leaves(params))


def test_the_last_round_spends_the_budget():
    from hybridpar import compress

    model, size = MODELS[2]
    params, _ = random_variables(model, size)
    gs = prune.groups(model, params)
    widths = prune.group_widths(gs, params)
    params_at = lambda k: prune.param_count(gs, params, prune.counts_for(gs, widths, k))  # noqa: E731
    teacher = {"kb_int8": 1.02 * params_at(1.0) / 1000, "params": params_at(1.0)}
    per_param = teacher["kb_int8"] / teacher["params"]
    # step 0.25: round 1 keeps 0.75, which is over a budget at 0.6 of the teacher's size
    budget = 0.6 * teacher["kb_int8"]
    assert compress.keep_for(1, 0.25, teacher, budget, params_at) == 0.75
    # a budget round 1 would undershoot: the largest fraction that fits, not 0.75
    budget = 0.8 * teacher["kb_int8"]
    k = compress.keep_for(1, 0.25, teacher, budget, params_at)
    assert 0.75 < k < 1 and per_param * params_at(k) <= budget
    # the largest: no fraction on the 0.001 grid gives a bigger model within the budget
    fits = [params_at(x) for x in np.arange(0.751, 1.0, 0.001)]
    assert params_at(k) == max(n for n in fits if per_param * n <= budget)
    assert per_param * params_at(0.75) < 0.9 * budget  # what the plain step would have left


# ---- a tiny trained teacher ----------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits run trained in-process on one device, and its 50%-pruned copy."""
    root = tmp_path_factory.mktemp("compress")
    t = root / "teacher"
    one = jax.devices()[:1]
    # a train line every step: the loop's rounds inherit it, and the SIGTERM test waits for one
    config = tiny_digits(**{**LONGER, "log_every_s": 0.0})
    trainer.train(run.setup(config, str(t), devices=one))
    from hybridpar.mesh import make_mesh

    r = prune.prune_run(str(t), str(root / "pruned"), 0.5, mesh=make_mesh("data:1", devices=one))
    return t, root / "pruned", r


def test_pruned_run_trains_and_evaluates_through_the_clis(teacher, tmp_path):
    t, _, _ = teacher
    env = cpu_env(devices=1)
    p = tmp_path / "p"
    out = subprocess.run(
        [sys.executable, "-m", "hybridpar.prune", "--workdir", str(t), "--out", str(p),
         "--fraction", "0.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    widths = json.loads((p / "config.json").read_text())["model"]
    assert widths["stage_widths"] == [4, 8, 16, 32] and widths["stem_width"] == 4
    base = [sys.executable, "-m", "hybridpar.train", "--config", DIGITS,
            *config_args({**{k: v for k, v in LONGER.items()}, "num_epochs": 0.5})]  # fmt: skip
    w = tmp_path / "s"
    ok = subprocess.run(
        [*base, "--workdir", str(w), f"--config.init_from={p}",
         f"--config.model.stem_width={widths['stem_width']}",
         f"--config.model.stage_widths={tuple(widths['stage_widths'])}",
         f"--config.model.block_widths={tuple(widths['block_widths'])}",
         *config_args({"model.num_filters": 8, "data.image_size": 16, "global_batch": 32,
                       "eval_batch": 120})],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "done: top1" in ok.stdout, ok.stdout[-2000:]
    summary = json.loads((w / "summary.json").read_text())
    assert summary["completed"] and summary["final_eval"]["examples"] == 360
    # (that init_from starts from the weights: the teacher-as-student test below)
    assert summary["final_eval"]["top1"] > 0.15, summary["final_eval"]  # chance: 0.1
    # negative control: the teacher's widths cannot start from the pruned weights
    bad = subprocess.run(
        [*base, "--workdir", str(tmp_path / "bad"), f"--config.init_from={p}",
         *config_args({"model.num_filters": 8, "data.image_size": 16, "global_batch": 32,
                       "eval_batch": 120})],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("error: init_from="), bad.stderr[-500:]


# ---- distillation --------------------------------------------------------------------------


def test_distill_loss_is_the_cross_entropy_when_student_is_teacher():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 10)) * 3, jnp.float32)
    ce = jnp.arange(4, dtype=jnp.float32)
    got = distill.loss(ce, logits, logits, 4.0, 0.75)
    np.testing.assert_allclose(got, 0.25 * ce, atol=1e-5)
    grad = jax.grad(lambda s: distill.loss(ce, s, logits, 4.0, 0.75).sum())(logits)
    assert np.abs(grad).max() < 1e-5
    # negative control: another student
    assert np.abs(distill.loss(ce, logits[::-1], logits, 4.0, 0.75) - 0.25 * ce).max() > 0.1


def _one_step(config, devices, batch):
    """The first train step's loss and parameters, from ``config``'s ``init_from``."""
    r = run.setup(config, None, devices=devices)
    p = r.program
    from hybridpar.state import init_sharded

    state = init_sharded(p.init, p.shardings, jax.random.key(config.seed))
    if config.init_from:
        state = prune.start_from(config.init_from, state, p)
    step = p.train_step(config.global_batch)
    state, metrics = step(state, partitioning.shard_batch(batch, r.mesh))
    return float(metrics["loss"]), jax.device_get(meta.unbox(state.params))


def _batch(config):
    r = run.setup(config, None, devices=jax.devices()[:1])
    return next(iter(r.data.train_batches(0)))


def test_teacher_as_its_own_student_keeps_the_kl_near_zero(teacher):
    t, _, _ = teacher
    one = jax.devices()[:1]
    c = tiny_digits(**LONGER)
    c.init_from = str(t)
    batch = _batch(c)
    ce, _ = _one_step(c, one, batch)  # the teacher's own loss (train-mode BatchNorm)
    c.distill.teacher_workdir = str(t)
    c.distill.alpha = 0.5
    mixed, _ = _one_step(c, one, batch)
    kl = mixed - 0.5 * ce  # alpha * T^2 * KL(teacher || itself in train mode)
    assert -1e-4 <= kl < 0.02 * ce, (mixed, ce)
    # negative control: a random student of the same shapes
    c.init_from = ""
    random_ce, _ = _one_step(tiny_digits(**LONGER), one, batch)
    random_mixed, _ = _one_step(c, one, batch)
    # measured: 0.014 for the teacher itself, 0.32 for the random student
    assert random_mixed - 0.5 * random_ce > 5 * max(kl, 0.02 * ce)


def test_distillation_on_8_devices_is_one_device(teacher):
    t, pruned, _ = teacher
    widths = json.loads((pruned / "config.json").read_text())["model"]

    def config(mesh, alpha=0.9):
        c = tiny_digits(mesh=mesh, **{k: v for k, v in LONGER.items() if k != "mesh"})
        c.model.update(stem_width=widths["stem_width"],
                       stage_widths=tuple(widths["stage_widths"]),
                       block_widths=tuple(widths["block_widths"]))  # fmt: skip
        c.init_from, c.distill.teacher_workdir, c.distill.alpha = str(pruned), str(t), alpha
        c.optim.warmup_epochs = 0.0  # the first step at LR 0 would change no parameter
        return c

    batch = _batch(config("data:1"))
    loss1, params1 = _one_step(config("data:1"), jax.devices()[:1], batch)
    loss8, params8 = _one_step(config("data:4,model:2"), jax.devices(), batch)
    diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(params1),
                                                   jax.tree.leaves(params8)))  # fmt: skip
    assert abs(loss8 - loss1) <= 1e-5 * abs(loss1) and diff <= 1e-5, (loss1, loss8, diff)
    # negative control: another mix of the two losses on 8 devices
    loss_b, params_b = _one_step(config("data:4,model:2", alpha=0.8), jax.devices(), batch)
    bad = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(params1),
                                                  jax.tree.leaves(params_b)))  # fmt: skip
    assert abs(loss_b - loss1) > 1e-3 * abs(loss1) and bad > 100 * max(diff, 1e-7)


# ---- the loop ------------------------------------------------------------------------------


def _compress(teacher_dir, *extra):
    return [sys.executable, "-m", "hybridpar.compress", "--workdir", str(teacher_dir),
            "--budget-kb", "1", "--step", "0.5", "--epochs", "4", "--max-rounds", "1",
            "--calibration-batches", "2", "--repeats", "1", *extra]  # fmt: skip


def test_loop_resumes_a_round_stopped_by_sigterm(teacher, tmp_path):
    import shutil

    t = tmp_path / "t"
    shutil.copytree(teacher[0], t)  # the loop writes t/compress/
    env = cpu_env(devices=1)
    metrics = t / "compress" / "round_01" / "run" / "metrics.jsonl"
    log = open(tmp_path / "first.err", "w")
    p = subprocess.Popen(_compress(t), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=log, text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if metrics.exists() and '"event": "train"' in metrics.read_text():
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        out, _ = p.communicate(timeout=240)
    finally:
        p.kill()
        log.close()
    assert p.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert "the same command continues" in out, out
    assert not (t / "compress" / "round_01" / "result.json").exists()
    again = subprocess.run(_compress(t), cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    events = [json.loads(x)["event"] for x in metrics.read_text().splitlines()]
    assert "resume" in events, events  # the round's run went on from its checkpoint
    last = again.stdout.strip().splitlines()[-1]
    assert last.startswith("kb_int8=") and " top1_drop=" in last and " flops=" in last, last
    rows = [json.loads((t / "compress" / f"round_0{i}" / "result.json").read_text())
            for i in (0, 1)]  # fmt: skip
    assert rows[1]["params"] < 0.4 * rows[0]["params"]
    assert (t / "compress" / "front.png").exists() and (t / "compress" / "rounds.md").exists()
    # The round's distilled run is evaluated and quantized without its teacher (moved away
    # with it: the run's config still names the old path).
    moved = tmp_path / "moved"
    t.rename(moved)
    student = moved / "compress" / "round_01" / "run"
    assert json.loads((student / "config.json").read_text())["distill"]["teacher_workdir"]
    for tool in ("evaluate", "quantize"):
        cmd = [sys.executable, "-m", f"hybridpar.{tool}", "--workdir", str(student)]
        cmd += ["--repeats", "1"] if tool == "quantize" else []
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (tool, r.stderr[-3000:])


def test_a_loop_from_before_the_calibration_flag_continues_with_max(tmp_path):
    import argparse

    from hybridpar import compress
    from hybridpar.errors import ConfigError

    (tmp_path / compress.DIR).mkdir()
    old = {"step": 0.25, "epochs": 3.0, "criterion": "l1", "calibration_batches": 8}
    (tmp_path / compress.DIR / "settings.json").write_text(json.dumps(old))
    args = argparse.Namespace(workdir=str(tmp_path), **old, calibration="max")
    compress.check_settings(args)  # the calibration it was made with
    args.calibration = "mse"  # today's default
    with pytest.raises(ConfigError, match="--calibration=max"):
        compress.check_settings(args)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--budget-kb", "0"], "--budget-kb K > 0"),
        (["--step", "1.5"], "--step=1.5 must be in (0, 1)"),
        (["--max-drop", "-1"], "--max-drop=-1.0 must be >= 0"),
        (["--epochs", "2"], "holds a loop with --epochs=4"),
        ([], "config.json: pass the --workdir of a training run"),
        ([], "no checkpoint"),
    ],
    ids=["budget", "step", "drop", "other-loop", "not-a-run", "no-checkpoint"],
)
def test_bad_input_is_one_error_line(teacher, tmp_path, capsys, extra, message):
    from hybridpar import compress

    t = teacher[0]
    if "holds a loop" in message:
        t = tmp_path / "t"
        os.makedirs(t / "compress")
        (t / "config.json").write_text((teacher[0] / "config.json").read_text())
        os.symlink(teacher[0] / "checkpoints", t / "checkpoints")
        (t / "compress" / "settings.json").write_text(json.dumps(
            {"step": 0.5, "epochs": 4.0, "criterion": "l1", "calibration_batches": 2}))  # fmt: skip
    elif message.startswith("config.json") or message == "no checkpoint":  # not a run
        t = tmp_path / "t"
        t.mkdir()
        if message == "no checkpoint":
            (t / "config.json").write_text((teacher[0] / "config.json").read_text())
    argv = _compress(t)[3:] + extra
    with pytest.raises(SystemExit) as e:
        compress.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    if t.parent == tmp_path:
        assert not (t / "compress").exists() or "holds a loop" in message
