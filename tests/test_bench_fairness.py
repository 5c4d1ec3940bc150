"""The ResNet-50 bench compares like with like.

``bench/resnet50_step.py`` times its plain Flax reference step (``bench/flax_reference.py``,
no hybridpar code) against hybridpar's step (``build_program`` on
``experiments/resnet50_imagenet.py``). Here both take one and the same batch from one and
the same parameters and must give the same loss, the same updated parameters (SGD with
Nesterov momentum, weight decay, label smoothing, batch-scaled learning rate: two steps, so
the momentum buffer is used) and the same BatchNorm statistics; so the bench's ratio
measures speed alone. "The same" is judged against the reference run in float64 (under
``jax.enable_x64``): hybridpar's float32 result must be as close to it as float32 rounding
lets the reference's own float32 result be (``_excess``), which holds on any CPU. The
initial parameters are random (not the zero-gamma init), so every block's gradient is
exercised; a second test checks that the two models also initialise
identically (same names, initialisers, zero-init last BN gamma) on a shallow variant.

The steps are compared on the recipe with a shallow trunk of the same bottleneck blocks
(``SHALLOW``: 2 + 1 + 1 + 1 blocks instead of ResNet-50's 3 + 4 + 6 + 3), which has every
kind of layer ResNet-50 has: the stem, a projection block at stride 1 and at stride 2, an
identity block, the head. Both ResNets build every block from one block class and one loop,
so 16 blocks do what 5 do; three full ResNet-50 compiles (float32 and float64 reference,
hybridpar) would be most of the test's time. That the full ResNet-50s have the same arrays
(names, shapes, dtypes: 54 kernels) is checked apart, from their shapes alone. 32-px images
and a batch of 4 on one device keep it fast.

``bench/curriculum_tta.py`` (time to accuracy, curriculum against a fixed shape, over seeds):
its time to target and speedup arithmetic on hand-made records, and its plumbing end to end
on the recipe shrunk to seconds.
"""

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import (
    NO_LLVM_OPT,
    NO_LLVM_OPT_FLAG,
    ROOT,
    bench_module,
    build,
    cpu_env,
    main_here,
    random_like,
)

from hybridpar import shard_batch
from hybridpar.config.schema import load_config
from hybridpar.models import MODELS
from hybridpar.models.resnet import BottleneckResNetBlock, ResNet, ResNet50
from hybridpar.program.precision import LossScale

flax_reference = bench_module("flax_reference")

SIZE, BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 4, 10, 3
# Blocks per stage of the compared trunk (see the module docstring); ResNet-50 has 3, 4, 6, 3.
SHALLOW = (2, 1, 1, 1)


# How far hybridpar's float32 result may be from the exact one, in multiples of float32's
# own spread on this computation (see _excess). Measured on an AMD EPYC (1 and 8 virtual
# devices): hybridpar's largest error over an array is at most 1.8x that spread (median 1x)
# across all 267 arrays of ResNet-50; on the SHALLOW trunk compared now (every step compiled
# without LLVM's optimisations), at most 0.32 of the tolerance (median 0.17) across its 102
# arrays.
ROUNDING_FACTOR = 4.0
# The negative control: an error of this fraction in any one kernel's update must fail. The
# spread reaches 0.5% of the update on one kernel of ResNet-50 (the reference's own float32
# 3x3 convolution gradient, with 8 virtual devices), so 4x that spread is 2%: 5% leaves
# room (on the SHALLOW trunk the spread is at most 0.07% of a kernel's update).
DETECTED = 0.05


def _excess(exact, spreads, ours):
    """How many times its tolerance ``ours`` is from ``exact`` at worst (<= 1 passes).

    ``exact`` is the reference computed in float64 from the same float32 inputs (as close to
    the true result as we can get). ``spreads`` are other results that differ from it by
    float32 rounding alone: the reference computed in float32, and the float64 reference
    from inputs moved by one float32 rounding (which shows what the computation amplifies).
    Their largest distance from ``exact`` over the array is float32's spread on this
    computation: it grows with the reduction sizes, with the steps and with how much the
    gradients cancel (up to 0.5% of the update for some arrays, far beyond a fixed rtol).
    hybridpar orders its sums differently (1x1 convolutions as dots, its own BatchNorm), so
    its error is of the same size but not the same value: we allow ROUNDING_FACTOR times
    the spread, plus two float32 spacings of the result, which no float32 result can beat
    (an update can be far below its parameter's spacing)."""
    exact, ours = np.asarray(exact, np.float64), np.asarray(ours, np.float64)
    spread = max(np.abs(np.asarray(s, np.float64) - exact).max() for s in spreads)
    tol = ROUNDING_FACTOR * spread
    tol = tol + 2 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float((np.abs(ours - exact) / tol).max())


def _nudged(tree, rng):
    """float64 copies moved by up to one float32 rounding (relative 2**-24)."""
    return jax.tree.map(
        lambda x: x.astype(np.float64) * (1 + 2.0**-24 * rng.uniform(-1, 1, x.shape)), tree
    )


def _reference_runs(cfg, inits, batches, dtype):
    """For each ``(params, batch_stats)`` of ``inits``: ``(params, batch_stats, (losses,
    lrs))`` after the reference's steps, computed in ``dtype`` (one compile for all)."""
    cast = functools.partial(jax.tree.map, lambda x: np.asarray(x, dtype))
    ref0, ref_step = flax_reference.make_reference(
        image_size=SIZE,
        batch=BATCH,
        dtype=dtype,
        steps_per_epoch=STEPS_PER_EPOCH,
        model_cls=functools.partial(
            flax_reference.ResNet,
            stage_sizes=SHALLOW,
            block_cls=flax_reference.BottleneckResNetBlock,
        ),
        variables={"params": cast(inits[0][0]), "batch_stats": cast(inits[0][1])},
        **flax_reference.recipe_of(cfg),
    )
    # Compiled as hybridpar's step is, without LLVM's optimisations (helpers.NO_LLVM_OPT)
    ref_step = ref_step.lower(ref0, jax.tree.map(jnp.asarray, batches[0])).compile(NO_LLVM_OPT)
    results = []
    for params, stats in inits:
        params, stats = cast(params), cast(stats)
        ref = ref0.replace(params=params, batch_stats=stats, opt_state=ref0.tx.init(params))
        losses, lrs = [], []
        for host in batches:
            ref, m = ref_step(ref, jax.tree.map(jnp.asarray, host))
            losses.append(float(m["loss"]))
            lrs.append(float(m["learning_rate"]))
        results.append((*jax.tree.map(np.asarray, (ref.params, ref.batch_stats)), (losses, lrs)))
    return results


def test_reference_and_hybridpar_compute_the_same_steps(monkeypatch):
    # The recipe with its trunk shallow: a registered name, as model.name picks ResNet-50's.
    shallow = functools.partial(ResNet, stage_sizes=SHALLOW, block_cls=BottleneckResNetBlock)
    monkeypatch.setitem(MODELS, "resnet50_shallow", shallow)
    cfg = load_config(str(ROOT / "experiments" / "resnet50_imagenet.py"))
    assert cfg.model.name == "resnet50"
    cfg.model.name = "resnet50_shallow"
    cfg.precision.compute = "float32"
    cfg.global_batch = cfg.eval_batch = BATCH
    cfg.data.image_size = SIZE
    cfg.optim.warmup_epochs = 0.0  # else the first step's learning rate is 0
    # Large enough that decaying the wrong arrays (or not at all) would change the update by
    # far more than the tolerance below (the recipe's 5e-5 would hide in it).
    cfg.optim.weight_decay = 1e-2
    cfg.num_epochs = float(EPOCHS)
    cfg.mesh = "data:1"
    program = build(cfg, jax.devices()[:1], STEPS_PER_EPOCH, EPOCHS * STEPS_PER_EPOCH)
    mesh = program.mesh

    # One set of initial values for both (the same module names: the trees match as they are).
    rng = np.random.default_rng(0)
    abstract = meta.unbox(program.abstract)
    params0 = random_like(abstract.params, rng, "params")
    stats0 = random_like(abstract.batch_stats, rng, "batch_stats")
    batches = [
        {
            "image": rng.integers(0, 256, (BATCH, SIZE, SIZE, 3), dtype=np.uint8),
            "label": rng.integers(0, cfg.data.num_classes, (BATCH,), dtype=np.int32),
        }
        for _ in range(2)  # two steps, so the momentum buffer is used
    ]
    [ref32] = _reference_runs(cfg, [(params0, stats0)], batches, jnp.float32)
    with jax.enable_x64(True):
        inits = [(params0, stats0), (_nudged(params0, rng), _nudged(stats0, rng))]
        exact, nudged = _reference_runs(cfg, inits, batches, jnp.float64)
    # Copies: on CPU, device_put may share a numpy array's memory, and the step donates it.
    hp = jax.device_put(
        abstract.replace(
            step=np.zeros((), np.int32),
            params=jax.tree.map(np.copy, params0),
            batch_stats=jax.tree.map(np.copy, stats0),
            opt_state=program.tx.init(params0),
            loss_scale=LossScale.create(False, period=cfg.precision.loss_scale_period),
        ),
        program.shardings,
    )
    # The three steps (hybridpar's, the reference's in float32 and float64) compile without
    # LLVM's optimisations (helpers.NO_LLVM_OPT: the same HLO, a third less compile time).
    train = program.train_jit.lower(hp, shard_batch(batches[0], mesh)).compile(NO_LLVM_OPT)
    hp_losses, hp_lrs = [], []
    for host in batches:
        hp, hp_m = train(hp, shard_batch(host, mesh))
        hp_losses.append(float(hp_m["loss"]))
        hp_lrs.append(float(hp_m["lr"]))
    ours = (jax.tree.map(np.asarray, hp.params), jax.tree.map(np.asarray, hp.batch_stats))

    assert jax.tree.structure(exact[:2]) == jax.tree.structure(ours)
    assert jax.tree.leaves(exact[0])[0].dtype == np.float64

    assert min(hp_lrs) > 0
    np.testing.assert_allclose(hp_lrs, exact[2][1], rtol=1e-6)
    loss_excess = _excess(exact[2][0], (ref32[2][0], nudged[2][0]), hp_losses)
    assert loss_excess <= 1, f"losses {hp_losses} vs exact {exact[2][0]} ({loss_excess:.1f}x tol)"
    # Every parameter and running statistic, as the update from the initial values.
    failures, kernels, undetected = [], 0, []
    starts = jax.tree.leaves((params0, stats0))
    flat = zip(
        jax.tree_util.tree_leaves_with_path(exact[:2]),
        jax.tree.leaves(ref32[:2]),
        jax.tree.leaves(nudged[:2]),
        jax.tree.leaves(ours),
        starts,
    )
    for (path, e), r, n, h, p0 in flat:
        name = ("params", "batch_stats")[path[0].idx] + jax.tree_util.keystr(path[1:])
        assert np.abs(h - p0).max() > 0, f"{name} did not change"
        x = _excess(e, (r, n), h)
        if x > 1:
            failures.append(f"{name}: {x:.1f}x tol")
        # Negative control: the same check rejects a small error in any kernel's update.
        if name.endswith("kernel']"):
            kernels += 1
            wrong = p0 + (1 + DETECTED) * (h.astype(np.float64) - p0)
            if _excess(e, (r, n), wrong) <= 1:
                undetected.append(name)
    assert not failures, "updates differ from the exact ones: " + ", ".join(failures)
    assert not undetected, f"a {DETECTED:.0%} error in the update passes: {undetected}"
    assert kernels == 1 + 3 * sum(SHALLOW) + len(SHALLOW) + 1  # stem, blocks, projections, head


def test_reference_initialises_like_hybridpar():
    """Same names and initialisers (He fan-out convs, N(0, 0.01) head, zero gamma on each
    block's last BN) give bit-identical variables from one key; shallow, to keep it quick."""
    kw = {"stage_sizes": [1, 1, 1, 1], "num_classes": 10, "num_filters": 8}
    ours = ResNet(block_cls=BottleneckResNetBlock, **kw)
    theirs = flax_reference.ResNet(block_cls=flax_reference.BottleneckResNetBlock, **kw)
    x = jnp.zeros((1, SIZE, SIZE, 3), jnp.float32)
    key = jax.random.key(1)

    def init(model):  # XLA's CPU backend optimises random-number code slowly: level 0
        lowered = jax.jit(lambda k: meta.unbox(model.init(k, x, train=False))).lower(key)
        return lowered.compile(NO_LLVM_OPT)(key)

    a, b = init(ours), init(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(
            np.asarray(u), np.asarray(v), err_msg=jax.tree_util.keystr(path)
        )
    zero_gammas = [
        k for k, blk in a["params"].items() if "block" in k and not blk["bn3"]["scale"].any()
    ]
    assert len(zero_gammas) == 4


def test_reference_resnet50_has_the_arrays_of_hybridpars():
    """The full ResNet-50s (the bench's two sides) hold the same arrays: names, shapes and
    dtypes of every parameter and running statistic, from their shapes alone (no compile)."""
    x = jnp.zeros((1, SIZE, SIZE, 3), jnp.float32)
    key = jax.random.key(0)

    def shapes(model):
        return meta.unbox(jax.eval_shape(lambda k: model.init(k, x, train=False), key))

    ours = shapes(ResNet50(num_classes=1000))
    theirs = shapes(flax_reference.ResNet50(num_classes=1000))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        assert (u.shape, u.dtype) == (v.shape, v.dtype), jax.tree_util.keystr(path)
    kernels = [p for p, _ in jax.tree_util.tree_leaves_with_path(ours["params"])
               if jax.tree_util.keystr(p).endswith("['kernel']")]  # fmt: skip
    assert len(kernels) == 54  # 53 convolutions and the head
    assert sum(x.size for x in jax.tree.leaves(ours["params"])) == 25_557_032


# ---- bench/curriculum_tta.py: time to accuracy over seeds --------------------------------------

tta = bench_module("curriculum_tta")


def _train(step, wall_s, batch=100, images_per_s=50.0, size=32):
    return {"event": "train", "step": step, "wall_s": wall_s, "global_batch": batch,
            "images_per_s": images_per_s, "image_size": size}  # fmt: skip


def _eval(step, top1, **kw):
    return {"event": "eval", "step": step, "epoch": step / 4, "top1": top1, **kw}


def test_curriculum_tta_times_the_first_checkpoint_at_target_on_the_training_clock():
    """Time to target is the training clock at the first evaluated checkpoint at or over
    the target: the time before the first step (compilation included) plus each train
    line's steps x batch / images per second, so an evaluation or a checkpoint save between
    steps is left out; a later dip under the target changes nothing, and the trainer's own
    evaluations count beside the evaluator's. Planted bugs that fail it: ``>`` for ``>=``,
    the wall time of the step instead of the clock, the best evaluation instead of the
    first, one step per train line whatever its step count, the evaluator's records left
    out."""
    run = [
        {"event": "compile", "step": 0, "compile_s": 10.0, "program": "train"},
        _train(1, 15.0),  # 2 s a step at 100 images / 50 per s: the first step began at 13
        _train(2, 17.0),
        {"event": "checkpoint", "step": 2, "blocking_s": 0.5},
        _eval(2, 0.5),  # the trainer's own evaluation: 12.5 s outside the steps
        _train(4, 34.0),  # two steps in one line: 4 s
        _train(5, 36.0, batch=200, images_per_s=100.0),  # another stage's batch: 2 s
        _eval(5, 0.81),
    ]
    # the evaluator's records carry the trainer's wall time at each checkpoint
    walls = {1: 15.0, 2: 17.0, 3: 32.0, 4: 34.0, 5: 36.0}
    evaluator = [_eval(s, t, wall_s=walls[s]) for s, t in zip(walls, (0.3, 0.5, 0.79, 0.8, 0.81))]
    clock = tta.training_clock(run)
    # (every step took its shape's median, 2 s: the steady clock is the same)
    assert clock == {1: (15.0, 5.0, 15.0, None), 2: (17.0, 7.0, 17.0, None),
                     4: (21.0, 11.0, 21.0, None), 5: (23.0, 13.0, 23.0, None)}  # fmt: skip
    evals = tta.evaluations(run, evaluator)
    assert [r["step"] for r in evals] == [1, 2, 3, 4, 5]
    clock[3] = (19.0, 9.0, 19.0, None)  # the evaluator's checkpoint at step 3
    reached = tta.time_to_target(evals, clock, 0.8)
    assert reached == {"s": 21.0, "without_compile_s": 11.0, "steady_s": 21.0,
                       "priced_s": None, "step": 4, "epoch": 1.0, "top1": 0.8}  # fmt: skip
    assert tta.time_to_target(evals, clock, 0.805)["s"] == 23.0
    assert tta.time_to_target(evals, clock, 0.9) is None
    # only the trainer's last evaluation: the target at its step
    assert tta.time_to_target(tta.evaluations(run, []), clock, 0.8)["step"] == 5


def test_curriculum_tta_steady_clock_counts_each_step_at_its_shapes_median():
    """A stretch of load (steps 6-7 five times slower) counts in full on the wall clock and
    at the median on the steady clock, where each shape (image size, batch) has its own
    median: the 24-px steps' 1 s, the 32-px steps' 2 s; set-up and compilation as
    measured. Planted bugs that fail it: the mean for the median, one median over both
    shapes, the slow steps kept."""
    run = [{"event": "compile", "step": 0, "compile_s": 4.0, "program": "train"}]
    run += [_train(s, 5.0 + s, images_per_s=100.0, size=24) for s in range(1, 6)]  # 1 s each
    run += [_train(s, 5.0 * s - 15, images_per_s=20.0, size=24) for s in (6, 7)]  # loaded: 5 s
    run += [_train(s, 20.0 + 2 * (s - 7)) for s in (8, 9, 10)]  # 32 px: 2 s each
    clock = tta.training_clock(run)
    assert clock[10][:2] == (26.0, 22.0)  # the wall clock keeps the load
    assert [clock[s][2] for s in range(1, 11)] == [6, 7, 8, 9, 10, 11, 12, 14, 16, 18]


def test_curriculum_tta_priced_clock_counts_steps_at_the_calibrations_costs():
    """The priced clock counts each step at its shape's calibrated cost and nothing else:
    load that slowed one stage of the run (here all of its 32-px steps, so the steady
    clock's median keeps it) and the set-up and compilation are not on it. The calibration's
    cost of a shape is the median over both its runs' steps of that shape, with a stretch
    of load that slowed both shapes alike left out. Planted bugs that fail it: the mean
    for the median, the run's own median for the cost, the set-up counted, the costs keyed
    by image size alone."""
    run = [{"event": "compile", "step": 0, "compile_s": 4.0, "program": "train"}]
    run += [_train(s, 5.0 + s, images_per_s=100.0, size=24) for s in range(1, 4)]  # 1 s each
    run += [_train(s, 8.0 + 6 * (s - 3), batch=200, images_per_s=200 / 6) for s in (4, 5)]
    costs = {(24, 100): 0.5, (32, 200): 2.0, (32, 100): 9.0}
    clock = tta.training_clock(run, costs)
    assert clock[5][2] == 20.0  # the steady clock keeps a load that lasted a whole stage
    assert [clock[s][3] for s in (1, 2, 3, 4, 5)] == [0.5, 1.0, 1.5, 3.5, 5.5]
    with pytest.raises(KeyError):
        tta.training_clock(run, {(24, 100): 0.5})  # a shape the calibration did not time

    # The calibration: two runs, the shapes in turn (1 s at 24 px, 2 s at 32); a loaded
    # stretch of the second (its steps 3-4, 3x slower) does not move the medians.
    def small(step, slow=1):
        return _train(step, 0.0, images_per_s=100.0 / slow, size=24)

    def large(step, slow=1):
        return _train(step, 0.0, batch=200, images_per_s=100.0 / slow)

    a = [small(1), large(2), small(3), large(4), small(5), large(6)]
    b = [large(1), small(2), large(3, slow=3), small(4, slow=3), large(5), small(6)]
    assert tta.step_costs([a, b]) == {(24, 100): 1.0, (32, 200): 2.0}


def test_curriculum_tta_clocks_keep_the_second_run_of_steps_redone_after_a_resume():
    """A run stopped after step 4 and resumed from its checkpoint at step 2 runs steps 3
    and 4 again: their second run replaces the first, on every clock (as
    ``run_records.read_run`` keeps them). Planted bug that fails it: the resume record
    ignored (steps 3-4 counted twice, a line of -1 steps); the resumed start's compile taken
    off the clock without compile (which holds only the first start's set-up)."""
    run = [{"event": "compile", "step": 0, "compile_s": 4.0, "program": "train"}]
    run += [_train(s, 5.0 + s, images_per_s=100.0) for s in range(1, 5)]  # 1 s each
    run += [{"event": "resume", "step": 2, "from_step": 2}]
    # the resumed start compiles again: not on the clock, so not taken off it either
    run += [{"event": "compile", "step": 2, "compile_s": 3.0, "program": "train"}]
    run += [_train(s, 10.0 + 2 * s, images_per_s=50.0) for s in (3, 4)]  # 2 s each, again
    assert [line[:2] for line in tta.train_lines(run)] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    clock = tta.training_clock(run, {(32, 100): 0.5})
    assert sorted(clock) == [1, 2, 3, 4]
    assert clock[4][0] == 5.0 + 1 + 1 + 2 + 2 and clock[4][3] == 2.0
    assert clock[4][1] == clock[4][0] - 4.0  # the first start's compile only
    # killed before its first checkpoint: started again, the trainer's record is from step 0
    restart = run[:4] + [{"event": "resume", "step": 0, "from_step": 0}] + run[1:5]
    assert [line[:2] for line in tta.train_lines(restart)] == [(1, 1), (2, 1), (3, 1), (4, 1)]


def test_curriculum_tta_calibration_stages_alternate_the_shapes_for_the_steps_asked():
    """The calibration's stages: each shape for the steps asked, in turn, the rounds asked;
    the trainer's plan of them (its whole steps per epoch at each batch) gives exactly
    those steps. Planted bugs that fail it: the batch per device taken as global, an epoch
    of examples / batch steps (not the trainer's whole steps)."""
    from hybridpar.config.curriculum import Stage, plan_stages

    # 1,100 examples: 5 whole steps per epoch at a global batch of 200, 3 at 300
    text = tta.alternating_stages(["24-100@0.5", "32-150~0.95"], 7, 2, 1100, 2)
    parts = text.split(",")
    assert [p.split(":", 1)[1] for p in parts] == ["24-100@0.5", "32-150~0.95"] * 2
    stages = [Stage(float(p.split(":")[0]), 0, int(p.split("-")[1].split("@")[0].split("~")[0])
                    * 2, 0.0) for p in parts]  # fmt: skip
    plan = plan_stages(stages, lambda gb: 1100 // gb)
    assert [s.num_steps for s in plan.stages] == [7, 7, 7, 7]


def test_curriculum_tta_calibration_commands_give_each_setting_once(tmp_path, monkeypatch):
    """The calibration's runs save no checkpoint: --config.checkpoint.every_steps=0, once (it
    was the pairs' interval, then 0). Planted bug that fails it: both passed."""
    calls = []

    def run_both(jobs, halves):
        for _, cmd, _ in jobs:
            calls.append(cmd)
            w = Path(cmd[cmd.index("--workdir") + 1])
            w.mkdir(parents=True)
            (w / "metrics.jsonl").write_text(json.dumps(_train(1, 1.0, batch=512)) + "\n")

    monkeypatch.setattr(tta, "run_both", run_both)
    args = types.SimpleNamespace(variant="cpu", calibration_steps=2, target=0.8, set=[],
                                 every_steps=4)  # fmt: skip
    data = {"train_examples": 4096, "data_parallel": 1}
    assert tta.calibrate(tmp_path, args, ["24-512@0.5", "32-512"], data, None)
    assert len(calls) == 2
    for cmd in calls:
        flags = [a.split("=")[0] for a in cmd if a.startswith("--config.")]
        assert len(flags) == len(set(flags)), cmd
        assert "--config.checkpoint.every_steps=0" in cmd


def test_curriculum_tta_stall_counts_a_save_at_the_switch_as_a_save():
    """A checkpoint saved at the last step of a stage is recorded once committed, after the
    next stage's first step: the gap across the switch is still reported as holding a save,
    not as a stall. Planted bug that fails it: only the records between the two steps
    looked at."""
    stage = {"event": "stage", "step": 2, "wall_s": 4.0}
    recs = [{"event": "stage", "step": 0, "wall_s": 0.0}, _train(1, 2.0), _train(2, 4.0), stage,
            _train(3, 7.0), {"event": "checkpoint", "step": 2, "blocking_s": 1.0},
            _train(4, 9.0), _train(5, 11.0)]  # fmt: skip
    (switch,) = tta.stalls(recs)
    assert switch["gap_s"] == 3.0 and switch["median_step_s"] == 2.0
    assert switch["between"] == ["checkpoint"]
    assert tta.stalls([r for r in recs if r["event"] != "checkpoint"])[0]["between"] == []


def test_curriculum_tta_speedups_per_seed_and_their_spread():
    """Per seed, fixed's time over the curriculum's (inf where only the curriculum reached
    the target, 0 where only the fixed run did, nan where neither); over the seeds, the
    median, min and max with nan left out. Planted bugs that fail it: the ratio inverted,
    an unreached target counted as nan (dropping a seed the curriculum lost), the mean for
    the median, nan kept in."""

    def row(*times):  # a run's time to 0.8 and to 0.85 (None: not reached)
        return {"tta": {k: t and {"s": t} for k, t in zip(("0.8", "0.85"), times)}}

    pairs = [
        {"curriculum": row(100.0, 200.0), "fixed": row(150.0, None)},
        {"curriculum": row(100.0, None), "fixed": row(110.0, 300.0)},
        {"curriculum": row(200.0, None), "fixed": row(300.0, None)},
        {"curriculum": row(100.0, 250.0), "fixed": row(400.0, 250.0)},
    ]
    per_seed = tta.seed_speedups(pairs, [0.8, 0.85])
    assert per_seed["0.8"] == [1.5, 1.1, 1.5, 4.0]
    assert per_seed["0.85"][:2] == [math.inf, 0.0] and math.isnan(per_seed["0.85"][2])
    assert per_seed["0.85"][3] == 1.0
    assert tta.spread(per_seed["0.8"]) == (1.5, 1.1, 4.0)
    assert tta.spread(per_seed["0.85"]) == (1.0, 0.0, math.inf)
    assert all(math.isnan(v) for v in tta.spread([math.nan]))


def test_curriculum_tta_warns_of_each_target_a_run_never_reached():
    """One warning: line per target some run missed, naming the runs and their seeds and
    what to change; none for a target every run reached. Planted bugs that fail it: no
    warning, or a run that reached it named."""

    def row(reached_80, reached_85, top1):
        return {
            "tta": {
                "0.8": {"s": 1.0} if reached_80 else None,
                "0.85": {"s": 2.0} if reached_85 else None,
            },
            "final_top1": top1,
        }

    pairs = [
        {"seed": 0, "curriculum": row(True, False, 0.84), "fixed": row(True, True, 0.86)},
        {"seed": 1, "curriculum": row(True, False, 0.83), "fixed": row(True, False, 0.82)},
    ]
    (line,) = tta.unreached(pairs, [0.8, 0.85], 8.0, 8.0)
    assert line.startswith("warning: top-1 0.85 (the recipe's target) never reached by "
                           "curriculum (seeds 0, 1) and fixed (seed 1), final top-1 at most "
                           "0.8400")  # fmt: skip
    assert "train longer (--epochs, now 8" in line
    for p in pairs:
        p["curriculum"]["tta"]["0.8"] = None
    first = tta.unreached(pairs, [0.8, 0.85], 0.2, 8.0)[0]
    assert first.startswith("warning: top-1 0.8 (--target) never reached by curriculum "
                            "(seeds 0, 1),")  # fmt: skip
    assert "(--epochs, now 0.2; the recipe's 8) or pass a lower --target" in first
    for p in pairs:
        for n in tta.NAMES:
            p[n]["tta"] = {"0.8": {"s": 1.0}, "0.85": {"s": 2.0}}
    assert tta.unreached(pairs, [0.8, 0.85], 8.0, 8.0) == []


def test_step_floor_refuses_counts_under_one_with_one_error_line():
    """--steps 0 and --repeats 0 time nothing: one error: line and exit code 2, not a
    ZeroDivisionError or min() of nothing. Planted bug that fails it: type=int."""
    for flag in ("--steps", "--repeats", "--arrays"):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "step_floor.py"), flag, "0"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: argument {flag}: '0' must be 1 or more"), r.stderr
        assert len(r.stderr.splitlines()) == 1 and "floor_us" not in r.stdout


# (bench, argv, the error line's start): each refused before anything is compiled or prepared.
# Planted bugs that fail them: type=int on a count; mesh_overhead without check_mesh;
# input_pipeline's missing data raised as SystemExit(message) (exit code 1).
RESNET = ["--impls", "hybridpar", "--dtypes", "float32", "--sizes", "32", "--batch", "8",
          "--matmul-n", "64"]  # fmt: skip
BAD_BENCH_FLAGS = [
    ("mesh_overhead", ["--repeats", "0"],
     "argument --repeats: '0' is not a number of timed blocks >= 1; e.g. 7"),
    ("mesh_overhead", ["--mesh", "data:3"],
     "--mesh data:3: mesh spec 'data:3' needs 3 devices but 8 are available; give axes whose "
     "sizes multiply to the 8 devices here, e.g. --mesh data:4,model:2"),
    ("mesh_overhead", ["--batch", "6"],
     "--batch 6 does not divide over the 4 data-parallel devices of --mesh data:4,model:2 "
     "(data x fsdp); use a multiple of 4, e.g. --batch 4"),
    ("input_pipeline", ["--images", "0"], "argument --images: '0' is not a number of images >= 1"),
    ("input_pipeline", ["--workers", "0"], "argument --workers: '0' is not a number of cores >= 1"),
    ("input_pipeline", ["--repeats", "0"], "argument --repeats: '0' is not a number of repeats"),
    ("input_pipeline", [], "{data}/imagenet-sample/train.tar not found; set HYBRIDPAR_DATA"),
    ("resnet50_step", [*RESNET, "--batch", "0"], "argument --batch: '0' is not a global batch"),
    ("resnet50_step", [*RESNET, "--sizes", "32,0"], "argument --sizes: '0' is not an image side"),
    ("resnet50_step", [*RESNET, "--sizes", "32,x"], "argument --sizes: 'x' is not an image side"),
    ("resnet50_step", [*RESNET, "--repeats", "0"], "argument --repeats: '0' is not a number of"),
    ("resnet50_step", [*RESNET, "--steps", "0"], "argument --steps: '0' is not a number of steps"),
    ("resnet50_step", [*RESNET, "--matmul-n", "0"], "argument --matmul-n: '0' is not a matrix"),
    ("resnet50_step", [*RESNET, "--warmup", "-1"], "--warmup -1 must be >= 0"),
    ("resnet50_step", [*RESNET, "--impls", "hybridpar,flaxx"], "--impls: flaxx is not one of"),
    ("resnet50_step", [*RESNET, "--set", "foo"], "--set/--variant: 'foo' is not KEY=VALUE"),
]  # fmt: skip


@pytest.mark.parametrize(
    "bench,argv,says",
    BAD_BENCH_FLAGS,
    ids=[f"{b}:{' '.join(a[-2:]) or 'no-data'}" for b, a, _ in BAD_BENCH_FLAGS],
)
def test_benches_refuse_bad_flags_with_one_error_line(
    bench, argv, says, tmp_path, monkeypatch, capsys
):
    """A count of 0 (StatisticsError, ZeroDivisionError, a pool of no processes), a mesh or
    batch that does not fit (a ConfigError traceback naming the trainer's --config flags) and
    missing data (exit code 1) were found after seconds to minutes of work: each is one
    error: line naming the flag, exit code 2, and nothing printed, before that work."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # resnet50_step adds bench/ to it
    module = bench_module(bench)
    monkeypatch.setattr(module, "DATA", tmp_path, raising=False)  # input_pipeline's data: none
    code, out, err = main_here(module.main, argv, capsys, monkeypatch,
                               ("XLA_FLAGS", "JAX_PLATFORMS"))  # fmt: skip
    assert code == 2 and out == "", (out, err)
    assert err.startswith("error: " + says.format(data=tmp_path)), err
    assert len(err.splitlines()) == 1, err


def _summary(out: str) -> str:
    """--help's line under the usage (usage, blank line, the summary)."""
    return out.split("\n\n")[1]


@pytest.mark.parametrize("bench", ["mesh_overhead", "curriculum_tta", "step_floor"])
def test_bench_help_says_what_it_does_in_whole_sentences(bench, monkeypatch, capsys):
    """--help's description was the docstring's first line, cut mid-sentence ("...: how",
    "... (8 virtual"). Planted bug that fails it: description=__doc__.splitlines()[0]."""
    if bench == "step_floor":  # a script with no main(): JAX-free up to its flags
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "step_floor.py"), "--help"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        code, out = r.returncode, r.stdout
    else:
        module = bench_module(bench)
        monkeypatch.setattr(signal, "signal", lambda *a: None)  # curriculum_tta's handlers
        code, out, _ = main_here(module.main, ["--help"], capsys)
    summary = _summary(out)
    assert code == 0 and "``" not in summary, out
    assert len(summary.split()) >= 12 and summary.rstrip().endswith("."), summary
    if bench == "step_floor":  # it runs on the host's accelerator, and says so
        assert "accelerator" in summary and "JAX_PLATFORMS" in summary, summary


@pytest.mark.parametrize("accelerator", [True, False], ids=["accelerator", "none"])
def test_step_floor_defaults_to_the_cpu_only_where_there_is_no_accelerator(
    accelerator, tmp_path, monkeypatch, capsys
):
    """The floor wanted is a GPU or TPU host's: there the bench leaves JAX_PLATFORMS unset
    (JAX takes the accelerator), and sets it to cpu only where there is none. Planted bug that
    fails it: os.environ.setdefault("JAX_PLATFORMS", "cpu") (a GPU host timed its CPU)."""
    import runpy

    from hybridpar.config import cli

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    # an accelerator's device file: one that exists (this folder), or none
    monkeypatch.setattr(cli, "ACCELERATOR_FILES", (str(tmp_path),) if accelerator else ())
    monkeypatch.setattr(sys, "argv", ["step_floor.py", "--arrays", "2", "--steps", "2",
                                      "--repeats", "1"])  # fmt: skip
    runpy.run_path(str(ROOT / "bench" / "step_floor.py"), run_name="__main__")
    assert os.environ.get("JAX_PLATFORMS") == (None if accelerator else "cpu")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("floor_us=") and last.endswith("device=cpu"), last  # JAX's, here


def test_curriculum_tta_waits_for_an_evaluator_started_by_hand(tmp_path, monkeypatch, capsys):
    """One evaluator per run: the bench's own waits for one that holds the run's records."""
    from hybridpar.runtime import workdir_lock

    runs = [tmp_path / "curriculum", tmp_path / "fixed"]
    for w in runs:
        (w / "evaluator").mkdir(parents=True)
    tta.wait_for_evaluators(runs)  # none running: no wait
    assert capsys.readouterr().out == ""
    watcher = workdir_lock.acquire(str(runs[1] / "evaluator"), role="evaluator")
    polls = []

    def sleep(s):  # the watcher ends at the bench's second look
        polls.append(s)
        if len(polls) == 2:
            watcher.release()

    monkeypatch.setattr(tta.time, "sleep", sleep)
    tta.wait_for_evaluators(runs)
    assert len(polls) == 2 and not workdir_lock.held(str(runs[1] / "evaluator"))
    assert f"waiting for the evaluator already running on {runs[1]}" in capsys.readouterr().out


def test_curriculum_tta_evaluates_from_an_epoch_and_earlier_where_the_target_came_first(
    tmp_path, monkeypatch, capsys
):
    """--evaluate-from-epoch: each run's evaluator gets --from-epoch; a run already at or
    over a target at the first checkpoint evaluated gets a second evaluator without it (its
    earlier checkpoints), on its own half of the cores, the other run none. Planted bugs
    that fail it: no --from-epoch passed, no second evaluation, the second on every run, or
    on the other run's cores."""
    d = tmp_path / "seed3"
    # epoch 2 on: the fixed run is at 0.82 at once (it may have reached 0.8 before), the
    # curriculum at 0.7 (it had not); both saved at steps 4 and 8 (epochs 1 and 2)
    first = {"curriculum": 0.7, "fixed": 0.82}
    for n in tta.NAMES:
        _saved(d / n, [4, 8])
    calls = []

    def run_both(jobs, halves):
        calls.append([(cmd[cmd.index("--workdir") + 1 :], halves) for _, cmd, _ in jobs])
        for _, cmd, _ in jobs:
            w = Path(cmd[cmd.index("--workdir") + 1])
            if "--from-epoch=2" in cmd:
                (w / "evaluator").mkdir(parents=True)
                rec = {**_eval(8, first[w.name]), "epoch": 2.0}
                (w / "evaluator" / "metrics.jsonl").write_text(json.dumps(rec) + "\n")

    monkeypatch.setattr(tta, "run_both", run_both)
    halves = [{0}, {1}]
    tta.evaluate_runs(d, tta.NAMES, halves, 2.0, [0.8, 0.85])
    assert calls == [
        [([str(d / "curriculum"), "--from-epoch=2"], halves),
         ([str(d / "fixed"), "--from-epoch=2"], halves)],
        [([str(d / "fixed")], [{1}])],  # the fixed run's half
    ]  # fmt: skip
    assert "fixed: at 0.8200 top-1 already at epoch 2.000" in capsys.readouterr().out
    calls.clear()
    tta.evaluate_runs(tmp_path / "seed4", tta.NAMES, None, 0.0, [0.8])  # default: all, once
    assert calls == [[([str(tmp_path / "seed4" / n)], None) for n in tta.NAMES]]
    # an epoch outside the runs' is refused before anything runs
    for epoch, why in (("-1", "must be >= 0"), ("9", "after the runs' last epoch (8)")):
        with pytest.raises(SystemExit) as e:
            tta.main(["--evaluate-from-epoch", epoch, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and err.startswith("error:"), err
    assert not (tmp_path / "out").exists()


def _saved(workdir: Path, steps: list[int], on_disk: bool = True) -> None:
    """A run's checkpoint records at ``steps`` (and the checkpoints, where ``on_disk``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps({"event": "checkpoint", "step": step}) + "\n")
            if on_disk:
                (workdir / "checkpoints" / str(step)).mkdir(parents=True)


def _fake_pairs(monkeypatch, top1: dict) -> list:
    """``tta.main`` in this process with nothing trained or evaluated for real: a run saves
    at steps 2 and 4 (epochs 1 and 2) and ends at 0.5 s a step, at 32 px and batch 512; its
    evaluator evaluates what is saved from ``--from-epoch`` on and not yet evaluated, at
    ``top1[step]``. Returns the jobs run, as (kind, workdir, --from-epoch or None; a run's:
    its --config.target_top1)."""
    jobs = []

    def run_both(batch, halves):
        for _, cmd, _ in batch:
            w = Path(cmd[cmd.index("--workdir") + 1])
            if "hybridpar.train" in cmd:
                target = next(a.split("=")[1] for a in cmd if "--config.target_top1=" in a)
                jobs.append(("train", w, target))
                w.mkdir()
                (w / "config.json").write_text("{}")
                lines = [_train(s, 1.0 + s / 2, batch=512, images_per_s=1024) for s in (1, 2, 3, 4)]
                (w / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
                _saved(w, [2, 4])
                (w / "summary.json").write_text(json.dumps({"completed": True, "wall_s": 3.0,
                                                            "compile_s": 0.5}))  # fmt: skip
                continue
            since = next((float(a.split("=")[1]) for a in cmd if "--from-epoch" in a), None)
            jobs.append(("evaluate", w, since))
            done = {r["step"] for r in tta.records(w / "evaluator" / "metrics.jsonl")}
            (w / "evaluator").mkdir(exist_ok=True)
            with open(w / "evaluator" / "metrics.jsonl", "a") as f:
                for step in sorted(tta.on_disk(w) - done):
                    if step / 2 >= (since or 0):
                        f.write(json.dumps({**_eval(step, top1[step]), "epoch": step / 2}) + "\n")

    monkeypatch.setattr(tta, "run_both", run_both)
    monkeypatch.setattr(tta, "prepare", lambda args: {"train_examples": 4096, "data_parallel": 1})
    monkeypatch.setattr(tta, "calibrate", lambda *a: {(32, 512): 0.25})
    monkeypatch.setattr(tta.subprocess, "run", lambda *a, **k: None)  # the report PNG
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's handlers
    monkeypatch.setattr(sys, "path", list(sys.path))  # main adds experiments/ to it
    return jobs


def test_curriculum_tta_reuses_a_pair_for_another_target_and_names_what_else_differs(
    tmp_path, monkeypatch, capsys
):
    """Its warning says to pass a lower --target where a run never reached it, and that
    refused the pair on the same --out: --target is in the runs' commands (target_top1),
    but they never stop at a target (stop_at_target is off), so it changes which evaluated
    checkpoint is read, not the training: the pair is reused, nothing trains or evaluates
    again; a pair stopped while training resumes with the commands it was started with.
    Another setting is refused, naming each that differs, old -> new. Planted bugs that fail
    it: the commands compared with the target in them, a refusal that names no setting, a
    resume with this call's target."""
    jobs = _fake_pairs(monkeypatch, {2: 0.22, 4: 0.3})
    out = tmp_path / "out"
    argv = ["--seeds", "1", "--out", str(out)]
    code, _, err = main_here(tta.main, [*argv, "--target", "0.35"], capsys, monkeypatch,
                             ("JAX_PLATFORMS",))  # fmt: skip
    assert code == tta.NOT_REACHED and "or pass a lower --target" in err, err
    assert [kind for kind, _, _ in jobs] == ["train", "train", "evaluate", "evaluate"]
    jobs.clear()
    code, said, err = main_here(tta.main, [*argv, "--target", "0.25"], capsys)
    assert code == 0 and jobs == [], err
    assert "--config.target_top1 0.35 -> 0.25 (--target): its runs are reused" in said
    rows = json.loads((out / "curriculum_tta.json").read_text())
    assert rows[0]["fixed"]["tta"]["0.25"]["step"] == 4  # read at this call's target
    code, _, err = main_here(tta.main, [*argv, "--checkpoint-every-epochs", "0.5"], capsys)
    assert code == 2 and jobs == [] and err.count("\n") == 1, err
    assert err.startswith(
        f"error: {out / 'seed0'} holds a pair trained with other settings "
        "(its pair.json has the commands): --config.checkpoint.every_steps "
        "2 -> 4 (--checkpoint-every-epochs); pass the same arguments"
    )
    assert "--config.target_top1" not in err  # 0.35 -> 0.8, which changes no training
    code, _, err = main_here(tta.main, [*argv, "--fixed-set", "data.translate=1"], capsys)
    assert code == 2 and jobs == [], err
    assert (
        "has the commands): --config.data.translate (unset) -> 1 in the fixed run; pass "
        "the same arguments to reuse it (any --target), or another --out"
    ) in err
    # A pair stopped while training resumes its run with the command it was started with
    # (the trainer refuses to resume with another config), then evaluates.
    (out / "seed0" / tta.PAIR).unlink()
    fixed = out / "seed0" / "fixed"
    shutil.rmtree(fixed)
    code, said, err = main_here(tta.main, [*argv, "--target", "0.25"], capsys)
    assert code == 0 and "its runs are reused" in said, err
    assert jobs[0] == ("train", fixed, "0.35") and [kind for kind, _, _ in jobs[1:]] == [
        "evaluate", "evaluate"]  # fmt: skip


def test_curriculum_tta_evaluates_earlier_checkpoints_for_a_lower_target_on_a_finished_pair(
    tmp_path, monkeypatch, capsys
):
    """A pair evaluated from an epoch on (--evaluate-from-epoch), called again with a lower
    --target that its runs are at or over at the first checkpoint evaluated: the earlier
    checkpoints are evaluated (on disk, the runs may have reached it there), once; where the
    records moved without them, a warning says the time is at most that checkpoint's.
    Planted bugs that fail it: a finished pair reused as it is, the checkpoints before the
    last evaluation (not the first) taken as the ones left, the warning where none is on
    disk replaced by an evaluator."""
    jobs = _fake_pairs(monkeypatch, {2: 0.26, 4: 0.3})
    out = tmp_path / "out"
    argv = ["--seeds", "1", "--out", str(out), "--evaluate-from-epoch", "2"]
    code, _, _ = main_here(tta.main, [*argv, "--target", "0.35"], capsys, monkeypatch,
                           ("JAX_PLATFORMS",))  # fmt: skip
    assert code == tta.NOT_REACHED and ("evaluate", out / "seed0" / "fixed", 2.0) in jobs
    moved = tmp_path / "moved"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("checkpoints"))
    jobs.clear()
    code, said, _ = main_here(tta.main, [*argv, "--target", "0.25"], capsys)
    assert code == 0 and "already at epoch 2.000, the first checkpoint evaluated" in said
    assert jobs == [("evaluate", out / "seed0" / n, None) for n in tta.NAMES]
    rows = json.loads((out / "curriculum_tta.json").read_text())
    assert rows[0]["curriculum"]["tta"]["0.25"]["step"] == 2  # not 4: it was there at 2
    noted = json.loads((out / "seed0" / "fixed" / "summary.json").read_text())
    assert noted["bench_time_to_target"]["top1"]["0.25"]["step"] == 2
    jobs.clear()
    assert main_here(tta.main, [*argv, "--target", "0.25"], capsys)[0] == 0 and jobs == []
    argv[argv.index(str(out))] = str(moved)
    code, _, err = main_here(tta.main, [*argv, "--target", "0.25"], capsys)
    assert code == 0 and jobs == [], err
    assert "the earlier ones (--evaluate-from-epoch) are not on disk here, so its time to " \
        "top-1 0.25 is at most that checkpoint's" in err  # fmt: skip


def test_curriculum_tta_records_a_source_in_the_checkout_by_its_repository_path(tmp_path):
    """reused.json names --fixed-from's runs: from the checkout's root when they are in it
    (records in bench/results/ read the same on every machine), else as given."""
    inside = ROOT / "bench" / "results" / "curriculum_tta" / "before" / "seed0" / "fixed"
    assert tta.in_checkout(inside) == "bench/results/curriculum_tta/before/seed0/fixed"
    assert tta.in_checkout(tmp_path / "fixed") == str(tmp_path / "fixed")


def test_curriculum_tta_records_the_data_facts_and_reads_the_data_only_when_needed(
    tmp_path, monkeypatch, capsys
):
    """``prepare`` (a JAX start) runs on a first call and wherever something left to run
    reads the data; a call with nothing left to run (every pair and the calibration
    finished, e.g. a copied --out) takes the facts recorded in --out/data.json, unless they
    were made with other settings or the file does not read. Planted bugs that fail it:
    prepare on every call, the recorded facts taken whatever their settings."""
    calls = []

    def prepare(args):
        calls.append(list(args.set))
        return {"train_examples": 1000 + len(calls), "data_parallel": 2}

    monkeypatch.setattr(tta, "prepare", prepare)
    args = types.SimpleNamespace(variant="cpu", set=["model.num_filters=8"])
    first = tta.data_facts(tmp_path, args, needed=False)  # nothing recorded yet
    assert first == {"train_examples": 1001, "data_parallel": 2} and len(calls) == 1
    assert "preparing" in capsys.readouterr().out
    assert tta.data_facts(tmp_path, args, needed=False) == first and len(calls) == 1
    assert "not read (nothing left to train or evaluate)" in capsys.readouterr().out
    # something left to run reads the data: prepared again, and recorded
    assert tta.data_facts(tmp_path, args, needed=True)["train_examples"] == 1002
    assert tta.data_facts(tmp_path, args, needed=False)["train_examples"] == 1002
    # other settings: the recorded facts are not theirs
    other = types.SimpleNamespace(variant="cpu", set=["model.num_filters=16"])
    assert tta.data_facts(tmp_path, other, needed=False)["train_examples"] == 1003
    (tmp_path / tta.DATA).write_text('{"settings"')  # cut short
    assert tta.data_facts(tmp_path, other, needed=False)["train_examples"] == 1004
    assert len(calls) == 4


def test_curriculum_tta_writes_its_time_to_target_into_the_runs_summary(tmp_path):
    """The trainer's ``time_to_target`` in a bench run's summary.json counts its own
    evaluation at the last step alone (eval_every_epochs=0); the bench writes its own time
    (the first evaluated checkpoint at or over each target) beside it, with the trainer's
    evaluation steps and how many checkpoints were evaluated, and leaves the trainer's as it
    is. Planted bugs that fail it: the trainer's evaluations alone (the evaluator's left
    out), the trainer's figure overwritten."""
    w = tmp_path / "curriculum"
    run = [{"event": "compile", "step": 0, "compile_s": 2.0, "program": "train"}]
    run += [_train(s, 5.0 + 2 * s) for s in range(1, 5)]  # 2 s a step, the first from 5 s
    run += [_eval(4, 0.85, wall_s=20.0)]  # the trainer's, at its last step
    top1 = {1: 0.3, 2: 0.81, 3: 0.7, 4: 0.85}  # the bench's evaluator, every checkpoint
    evaluator = [_eval(s, t, wall_s=5.0 + 2 * s) for s, t in top1.items()]
    for path, recs in ((w / "metrics.jsonl", run), (w / "evaluator" / "metrics.jsonl", evaluator)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    trainer = {"top1": {"target": 0.8, "value": 0.85, "step": 4, "wall_s": 20.0}}
    (w / "summary.json").write_text(json.dumps({"wall_s": 21.0, "compile_s": 2.0,
                                                "time_to_target": trainer}))  # fmt: skip
    tta.note_time_to_target(w, tta.summarize("curriculum", w, [0.8, 0.9], None), 1)
    summary = json.loads((w / "summary.json").read_text())
    assert summary["time_to_target"] == trainer
    bench = summary["bench_time_to_target"]
    assert bench["trainer_eval_steps"] == [4] and bench["evaluations"] == 4
    assert bench["every_steps"] == 1 and "its own evaluations only" in bench["note"]
    reached = {"s": 9.0, "without_compile_s": 7.0, "steady_s": 9.0, "step": 2, "epoch": 0.5,
               "top1": 0.81}  # fmt: skip
    assert bench["top1"] == {"0.8": reached, "0.9": None}


def test_curriculum_tta_plumbing(tmp_path):
    """The whole bench, shrunk (a tiny airbench on 256 synthetic images, one epoch, 12 then
    16 px at batch 64, two seeds): each pair trains with its seed (both arms; the two seeds
    start from different losses), every checkpoint (each step, a quarter epoch) is evaluated,
    and the last line's median and spread are those of the clocks in the records (at the
    first checkpoint, no save or evaluation before it: the step's wall time); called again,
    it reuses the finished pairs, unless their settings differ. Planted bugs that fail it:
    the seed not passed to the runs, the evaluator not run, the last line's median from the
    first seed only, a finished pair reused whatever its commands, the commands recorded with
    --out's absolute path, the wall clock's speedup first on the last line, exit code 0 where
    no run reached --target, the data prepared on a call with nothing left to run, the
    bench's time to target not written into the runs' summary.json. A pair stopped while
    training resumes its unfinished run.

    Each call starts Python and JAX processes (a data check where something is left to run,
    two per run), so the
    checks share calls: "called again" is the call on the records moved to another --out
    (the same reuse, with no checkpoint to lean on), one call resumes a pair stopped in its
    evaluation (seed 0) and one stopped while training (seed 1), and the --fixed-from call
    gets a copy of the first call's calibration (the same shapes, so it is reused)."""
    out = tmp_path / "tta"
    sets = {"model.num_filters": 8, "data.name": "synthetic", "data.train_examples": 256,
            "data.eval_examples": 128, "eval_batch": 128, "data.translate": 0}  # fmt: skip
    argv = ["--seeds", "2", "--target", "0.01", "--out", str(out), "--calibration-steps", "2"]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    # The recipe shrunk in the bench's process, which is JAX-free (its runs are not).
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import cifar10_fast; "
        "cifar10_fast.VARIANTS['cpu'] = (8, 1.0, '0.5:12-64@0.5,1:16-64', 0.85); "
        f"sys.argv = sys.argv[2:]; sys.path.insert(0, {str(ROOT / 'bench')!r}); "
        "import curriculum_tta\n"
        # Each train run gets a compile cache per role (the runs go two at a time, and two
        # processes must not share one), so seed 1's pair, the resumed run and every
        # evaluator (which reads its run's config) load the programs seed 0's pair compiled.
        # Added as the run starts: the commands the bench records and compares are its own.
        "start = curriculum_tta.start\n"
        "def cached(name, cmd, log, cores=None):\n"
        "    role = next((k for k in ('curriculum', 'fixed') if k in name), name.split()[-1])\n"
        f"    at = '--config.compile_cache=' + {str(tmp_path / 'xla')!r} + '/' + role\n"
        "    return start(name, cmd + [at] * ('hybridpar.train' in cmd), log, cores)\n"
        "curriculum_tta.start = cached\n"
        "curriculum_tta.main()"
    )
    env = cpu_env(1, NO_LLVM_OPT_FLAG)
    # not the suite's cache: each run has its own above
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def bench(*args):
        cmd = [sys.executable, "-c", code, str(ROOT / "experiments"), "bench", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    r = bench(*argv)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    rows = json.loads((out / "curriculum_tta.json").read_text())
    # Called again, it reuses the finished pairs (nothing trains, nothing is evaluated) and
    # says the same, from their records alone moved to another --out; with other settings it
    # refuses them.
    moved = tmp_path / "moved"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("checkpoints"))
    elsewhere = bench(*[str(moved) if a == str(out) else a for a in argv])
    assert elsewhere.returncode == 0, elsewhere.stdout[-3000:] + elsewhere.stderr[-3000:]
    assert "hybridpar.train" not in elsewhere.stdout
    assert "hybridpar.evaluate --workdir" not in elsewhere.stdout
    # nor is the data read: the facts the first call recorded in --out
    assert "== data: preparing" in r.stdout and "== data: preparing" not in elsewhere.stdout
    assert elsewhere.stdout.strip().splitlines()[-1] == last
    other = bench(*argv, "--checkpoint-every-epochs", "0.5")
    assert (
        other.returncode == 2 and "seed0 holds a pair trained with other settings" in other.stderr
    )
    # A calibration made with other settings is kept, not made again over (its costs price
    # every pair): refused, naming how to calibrate again.
    recal = bench(*argv, "--calibration-steps", "3")
    assert recal.returncode == 2 and "holds a calibration made with other settings" in recal.stderr
    assert (out / "calibration_12-64@0.5_16-64" / "costs.json").exists()
    # A pair trained but stopped in its evaluation (seed 0) goes on at the evaluation; one
    # stopped while training (seed 1) resumes the run that did not complete, from its latest
    # checkpoint.
    for name in tta.NAMES:
        shutil.rmtree(out / "seed0" / name / "evaluator")
    (out / "seed0" / tta.PAIR).unlink()
    fixed1 = out / "seed1" / "fixed"
    summary = fixed1 / "summary.json"
    summary.write_text(summary.read_text().replace('"completed": true', '"completed": false'))
    for step in (3, 4):  # stopped after step 2's checkpoint: steps 3 and 4 to run again
        shutil.rmtree(fixed1 / "checkpoints" / str(step))
    shutil.rmtree(fixed1 / "evaluator")
    (out / "seed1" / tta.PAIR).unlink()
    stopped = bench(*argv)
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert f"trained in {out / 'seed0'}; evaluating its checkpoints" in stopped.stdout
    assert "seed 0 fixed on cores" not in stopped.stdout
    assert "seed 0 curriculum on cores" not in stopped.stdout
    assert "seed 0 fixed evaluator" in stopped.stdout
    assert "seed 0 curriculum evaluator" in stopped.stdout
    # the evaluation gone on gives seed 0 the rows it had
    assert json.loads((out / "curriculum_tta.json").read_text())[0] == rows[0]
    assert "resuming fixed in" in stopped.stdout and "seed 1 fixed on cores" in stopped.stdout
    assert "seed 1 curriculum on cores" not in stopped.stdout  # it completed: not run again
    recs = tta.records(fixed1 / "metrics.jsonl")
    assert [r["from_step"] for r in recs if r["event"] == "resume"] == [2]
    # The redone steps replace their first run: the priced clock and the top-1 (an exact
    # resume) are as before the stop.
    after = dict(kv.split("=") for kv in stopped.stdout.strip().splitlines()[-1].split())
    before = dict(kv.split("=") for kv in last.split())
    for key in before:
        if "priced" in key or "top1" in key or key.startswith("step_s_"):
            assert after[key] == before[key], key
    assert [line[0] for line in tta.train_lines(recs)] == [1, 2, 3, 4]
    first_losses, speedups = [], []
    for seed in (0, 1):
        clocks = {}
        for name in tta.NAMES:
            workdir = out / f"seed{seed}" / name
            assert json.loads((workdir / "config.json").read_text())["seed"] == seed
            # the bench's own time to target where a reader of the run looks
            noted = json.loads((workdir / "summary.json").read_text())["bench_time_to_target"]
            assert noted["top1"]["0.01"]["step"] == rows[seed][name]["tta"]["0.01"]["step"]
            recs = tta.records(workdir / "metrics.jsonl")
            evaluated = tta.records(workdir / "evaluator" / "metrics.jsonl")
            assert [r["step"] for r in evaluated if r["event"] == "eval"] == [1, 2, 3, 4]
            train = [r for r in recs if r["event"] == "train"]
            clocks[name] = train[0]["wall_s"]
            first_losses.append(train[0]["loss"])
        speedups.append(clocks["fixed"] / clocks["curriculum"])
    # curriculum seed 0 against seed 1, fixed seed 0 against seed 1
    assert first_losses[0] != first_losses[2] and first_losses[1] != first_losses[3]
    fields = dict(kv.split("=") for kv in last.split())
    # the priced clock's first: the figure to read
    assert last.startswith("tta_speedup_1_priced=") and fields["seeds"] == "2"
    assert float(fields["tta_speedup_1_wall"]) == pytest.approx(sum(speedups) / 2, abs=2e-3)
    assert float(fields["tta_speedup_1_wall_min"]) == pytest.approx(min(speedups), abs=1e-3)
    assert float(fields["tta_speedup_1_wall_max"]) == pytest.approx(max(speedups), abs=1e-3)
    assert fields["tta_speedup_85_wall"] == "nan"  # random labels: never reached
    assert "warning: top-1 0.85 (the recipe's target) never reached by curriculum (seeds 0, 1)" \
        in r.stderr  # fmt: skip
    # each run's median over the seeds on its own, said so
    assert {"curriculum_tta_s_median", "fixed_tta_s_median"} <= set(fields)
    assert float(fields["tta_speedup_1_steady_min"]) <= float(fields["tta_speedup_1_steady"])
    # The calibration: two runs, the shapes in turn for the steps asked (the second in the
    # reverse order), made once. The priced clock at the first checkpoint (step 1) is one
    # step at its shape's cost: the speedup is the 16-px step's cost over the 12-px one's.
    calibration = out / "calibration_12-64@0.5_16-64"
    sizes = {n: [r["image_size"] for r in tta.records(calibration / n / "metrics.jsonl")
                 if r["event"] == "train"] for n in ("a", "b")}  # fmt: skip
    assert sizes == {"a": [12, 12, 16, 16] * 3, "b": [16, 16, 12, 12] * 3}
    assert float(fields["tta_speedup_1_priced"]) == pytest.approx(
        float(fields["step_s_16x64"]) / float(fields["step_s_12x64"]), abs=2e-3
    )
    # Another curriculum against those fixed runs (--fixed-from): only the curriculum
    # trains; the fixed rows are the records of the first call's; the priced clock as above.
    # Its shapes are the first call's in the same order, so that call's calibration, copied
    # to its --out, is reused (not made again: two runs saved).
    lever = tmp_path / "lever"
    shutil.copytree(calibration, lever / calibration.name)
    lever_argv = [str(lever) if a == str(out) else a for a in argv]
    lever_argv[lever_argv.index("--seeds") + 1] = "1"  # --calibration-steps as before
    lever_argv += ["--curriculum-set", "stages=0.25:12-64@0.5,0.5:16-64,0.75:12-64@0.5,1:16-64",
                   "--fixed-from", str(out)]  # fmt: skip
    r = bench(*lever_argv)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "seed 0 curriculum on" in r.stdout and "seed 0 fixed" not in r.stdout
    assert "== calibration of" not in r.stdout  # the copy was reused
    for f in ("metrics.jsonl", "evaluator/metrics.jsonl"):
        mine, theirs = (o / "seed0" / "fixed" / f for o in (lever, out))
        assert mine.read_text() == theirs.read_text()
    lever_fields = dict(kv.split("=") for kv in r.stdout.strip().splitlines()[-1].split())
    assert lever_fields["fixed_reused"] == "1" and lever_fields["seeds"] == "1"
    assert float(lever_fields["tta_speedup_1_priced"]) == pytest.approx(
        float(lever_fields["step_s_16x64"]) / float(lever_fields["step_s_12x64"]), abs=2e-3
    )
    # A source whose fixed runs are not this bench's is refused before anything runs.
    other = [str(tmp_path / "other") if a == str(lever) else a for a in lever_argv]
    refused = bench(*other, "--fixed-set", "data.translate=1")
    assert refused.returncode == 2 and "holds no finished pair whose fixed run" in refused.stderr
    assert "calibration" not in refused.stdout
    # Where no run reached --target (the same pairs with every evaluation at 0 top-1): a
    # warning that says so and what to change, and exit code 3, not 0 with nan everywhere.
    missed = tmp_path / "missed"
    shutil.copytree(out, missed, ignore=shutil.ignore_patterns("checkpoints"))
    for f in missed.glob("seed*/*/**/metrics.jsonl"):
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "top1": 0.0} if r["event"] == "eval" else r)
                             + "\n" for r in lines))  # fmt: skip
    r = bench(*[str(missed) if a == str(out) else a for a in argv])
    assert r.returncode == tta.NOT_REACHED == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hybridpar.train" not in r.stdout and "== data: preparing" not in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("tta_speedup_1_priced=nan ")
    assert (
        "warning: top-1 0.01 (--target) never reached by curriculum (seeds 0, 1) and "
        "fixed (seeds 0, 1)"
    ) in r.stderr and "or pass a lower --target" in r.stderr


# (the bench's own process never imports JAX, this test's has: its fork warns)
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_curriculum_tta_passes_a_signal_to_its_runs_and_stops_after_them(tmp_path):
    """A SIGTERM or SIGINT to the bench goes to the runs in progress once each (in their own
    sessions, so a terminal's Ctrl-C reaches the bench alone): they save and stop, and the
    bench says so and exits 0, instead of leaving them training without it."""
    import signal

    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
            "print('ready', flush=True); time.sleep(60); sys.exit(1)")  # fmt: skip
    log = tmp_path / "run.log"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = tta.start("run", [sys.executable, "-c", code], log, cores={0})
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None
        assert os.getsid(proc.pid) == proc.pid  # its own session
        tta.pass_on(signal.SIGTERM, None)
        assert proc.wait(timeout=30) == 0  # it got the signal, and stopped as asked
        with pytest.raises(SystemExit) as e:
            tta.check_stopped()
        assert e.value.code == 0
    finally:
        for p in tta.CHILDREN:
            p.kill()
        tta.CHILDREN.clear()
        tta.STOPPED.clear()
        for s, h in handlers.items():  # tta.start's pass_on: not for the tests after it
            signal.signal(s, h)


def test_curriculum_tta_data_that_fails_to_prepare_is_one_error_line(tmp_path, monkeypatch, capsys):
    """The data's own error, one line (it was the preparing process's whole traceback)."""
    monkeypatch.setenv("HYBRIDPAR_DATA", str(tmp_path))  # no CIFAR-10 tars there
    args = types.SimpleNamespace(variant="cpu", set=[])
    with pytest.raises(SystemExit) as e:
        tta.prepare(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(
        "error: preparing the data failed (exit 2): data.source "), err
