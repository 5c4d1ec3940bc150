"""Tests for hybridpar.program.optim (schedules, optimizers, weight-decay mask) and
hybridpar.program.precision."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from hybridpar.config.curriculum import single_stage_plan
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config, unused_settings, validate
from hybridpar.program.optim import (
    decay_mask,
    describe_frozen,
    make_optimizer,
    make_schedule,
    peak_lr,
)
from hybridpar.program.precision import (
    DTYPES,
    MAX_LOSS_SCALE,
    LossScale,
    Policy,
    all_finite,
    make_policy,
)


def optim_cfg(**overrides):
    cfg = ml_collections.ConfigDict(base_config().optim.to_dict())
    cfg.update(overrides)
    return cfg


def small_params():
    rng = np.random.default_rng(0)
    return {
        "conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 2, 4)), jnp.float32)},
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        },
        "bn": {
            "scale": jnp.asarray(1.0 + rng.normal(size=(4,)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        },
    }


# ----------------------------------------------------------------------------- optim


def test_decay_mask_kernels_only():
    mask = decay_mask(small_params())
    assert bool(mask["conv"]["kernel"]) and bool(mask["dense"]["kernel"])
    assert not bool(mask["dense"]["bias"])
    assert not bool(mask["bn"]["scale"]) and not bool(mask["bn"]["bias"])


def test_decay_mask_on_shapes():
    tree = {
        "k4": jax.ShapeDtypeStruct((3, 3, 8, 8), jnp.float32),
        "k2": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32),
    }
    assert decay_mask(tree) == {"k4": True, "k2": True, "b": False}


@pytest.mark.parametrize("batch", [128, 256, 1024, 8192])
def test_peak_lr_scales_linearly_with_batch(batch):
    cfg = optim_cfg(base_lr=0.1)
    assert peak_lr(cfg, batch) == pytest.approx(0.1 * batch / 256)


def test_peak_lr_uses_batch_base():
    assert peak_lr(optim_cfg(base_lr=0.2, lr_batch_base=512), 1024) == pytest.approx(0.4)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_schedule_warmup_then_decay(schedule):
    cfg = optim_cfg(
        schedule=schedule,
        base_lr=0.1,
        warmup_epochs=2.0,
        warmup_start_factor=0.1,
        end_lr_factor=0.01,
    )
    spe, total, batch = 10, 100, 512
    peak = 0.1 * batch / 256
    s = make_schedule(cfg, single_stage_plan(spe, total, batch))
    assert float(s(0)) == pytest.approx(0.1 * peak, rel=1e-5)
    assert float(s(10)) == pytest.approx(0.55 * peak, rel=1e-5)  # halfway through warmup
    assert float(s(20)) == pytest.approx(peak, rel=1e-5)  # end of warmup (2 epochs x 10)
    assert float(s(total)) == pytest.approx(0.01 * peak, rel=1e-4)
    lrs = np.array([float(s(i)) for i in range(0, total + 1, 5)])
    assert np.all(np.diff(lrs[:5]) > 0)  # warmup rises
    assert np.all(np.diff(lrs[4:]) < 0)  # then decays monotonically
    assert lrs.max() == pytest.approx(peak, rel=1e-5)


def test_cosine_and_linear_differ_in_the_middle():
    kw = dict(warmup_epochs=0.0, end_lr_factor=0.0)
    cos = make_schedule(optim_cfg(schedule="cosine", **kw), single_stage_plan(10, 100, 256))
    lin = make_schedule(optim_cfg(schedule="linear", **kw), single_stage_plan(10, 100, 256))
    assert float(cos(0)) == pytest.approx(0.1) and float(lin(0)) == pytest.approx(0.1)
    assert float(lin(50)) == pytest.approx(0.05, rel=1e-5)
    assert float(cos(25)) == pytest.approx(0.1 * 0.5 * (1 + np.cos(np.pi * 0.25)), rel=1e-5)
    assert float(cos(100)) == pytest.approx(0.0, abs=1e-7)


def test_constant_schedule():
    s = make_schedule(
        optim_cfg(schedule="constant", warmup_epochs=0.0), single_stage_plan(10, 100, 256)
    )
    assert float(s(0)) == pytest.approx(0.1) and float(s(99)) == pytest.approx(0.1)


def test_unknown_schedule():
    # the name is checked once, by the schema, before any schedule is made
    c = base_config()
    c.optim.schedule = "step"
    with pytest.raises(ConfigError, match="optim.schedule='step' is not one of cosine"):
        validate(c)


def test_unknown_optimizer():
    # the name is checked once, by the schema, before any optimizer is made
    c = base_config()
    c.optim.name = "adam"
    with pytest.raises(ConfigError) as e:
        validate(c)
    want = "optim.name='adam' is not one of sgd, lars; use e.g. --config.optim.name=sgd"
    assert str(e.value) == want


def _one_update(cfg, params, grads):
    tx, _ = make_optimizer(cfg, single_stage_plan(10, 100, 256))
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    return updates


def test_sgd_weight_decay_shrinks_kernels_only():
    cfg = optim_cfg(name="sgd", weight_decay=0.1, warmup_epochs=0.0)
    params = small_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates = _one_update(cfg, params, zeros)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    for path in [("conv", "kernel"), ("dense", "kernel")]:
        p0, p1 = params[path[0]][path[1]], new[path[0]][path[1]]
        assert float(jnp.linalg.norm(p1)) < float(jnp.linalg.norm(p0))
        # the step moves each weight towards zero (same sign, smaller magnitude)
        assert bool(jnp.all(jnp.abs(p1) < jnp.abs(p0)))
    for path in [("dense", "bias"), ("bn", "scale"), ("bn", "bias")]:
        np.testing.assert_array_equal(new[path[0]][path[1]], params[path[0]][path[1]])


def test_lars_one_update_no_decay_on_1d():
    params = small_params()
    grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
    cfg = optim_cfg(name="lars", weight_decay=0.1, warmup_epochs=0.0)
    cfg_nowd = optim_cfg(name="lars", weight_decay=0.0, warmup_epochs=0.0)
    upd = _one_update(cfg, params, grads)
    upd_nowd = _one_update(cfg_nowd, params, grads)
    for leaf in jax.tree.leaves(upd):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    # 1D params: identical update with or without weight decay, and no trust ratio either
    for path in [("dense", "bias"), ("bn", "scale"), ("bn", "bias")]:
        np.testing.assert_allclose(upd[path[0]][path[1]], upd_nowd[path[0]][path[1]], rtol=1e-6)
    # with momentum 0.9 and Nesterov the first step is -(1 + 0.9) * lr * g
    np.testing.assert_allclose(upd["bn"]["scale"], -1.9 * 0.1 * 0.01 * np.ones(4), rtol=1e-5)
    # kernels: weight decay changes the update
    assert not np.allclose(upd["dense"]["kernel"], upd_nowd["dense"]["kernel"])


def test_lars_zero_grads_moves_only_kernels():
    params = small_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd = _one_update(optim_cfg(name="lars", weight_decay=1e-4, warmup_epochs=0.0), params, zeros)
    assert float(jnp.abs(upd["conv"]["kernel"]).max()) > 0
    for path in [("dense", "bias"), ("bn", "scale"), ("bn", "bias")]:
        np.testing.assert_array_equal(upd[path[0]][path[1]], 0.0)


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    "compute,params,output",
    [
        ("float32", "float32", "float32"),
        ("bfloat16", "float32", "float32"),
        ("float16", "float32", "float16"),
        ("bfloat16", "bfloat16", "bfloat16"),
    ],
)
def test_make_policy_names_to_dtypes(compute, params, output):
    p = make_policy(compute=compute, params=params, output=output)
    assert isinstance(p, Policy)
    assert jnp.dtype(p.compute_dtype) == jnp.dtype(compute)
    assert jnp.dtype(p.param_dtype) == jnp.dtype(params)
    assert jnp.dtype(p.output_dtype) == jnp.dtype(output)
    assert p.needs_loss_scale == (compute == "float16")


def test_make_policy_defaults_float32():
    p = make_policy()
    assert jnp.dtype(p.compute_dtype) == jnp.float32
    assert not p.needs_loss_scale


def test_needs_loss_scale_follows_compute_dtype_only():
    assert make_policy(compute="float16").needs_loss_scale
    assert not make_policy(compute="bfloat16", params="float16").needs_loss_scale


@pytest.mark.parametrize(
    "kw", [dict(compute="fp8"), dict(params="float64"), dict(output="BF16"), dict(compute=np.int32)]
)
def test_make_policy_unknown_dtype(kw):
    with pytest.raises(ConfigError) as e:
        make_policy(**kw)
    msg = str(e.value)
    bad = next(iter(kw.values()))
    assert f"make_policy {next(iter(kw))}={bad!r} is not a dtype we support" in msg
    for name in DTYPES:
        assert name in msg


@pytest.mark.parametrize(
    "compute, want",
    [(jnp.bfloat16, "bfloat16"), (np.dtype("float16"), "float16"), (jnp.float32, "float32"),
     ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32")],
)  # fmt: skip
def test_make_policy_takes_dtypes_and_the_short_names_the_config_suggests(compute, want):
    """A script's ``make_policy(compute=jnp.bfloat16)`` or ``"bf16"``: the short names are
    those the config's error maps to its own (``schema.DTYPE_SHORT``), which it still
    refuses."""
    p = make_policy(compute=compute, params=compute, output=compute)
    assert p.compute_dtype is p.param_dtype is p.output_dtype is DTYPES[want]


def test_loss_scale_halves_on_overflow_and_never_below_one():
    ls = LossScale.create(dynamic=True, initial=8.0, period=3)
    ls = ls.update(jnp.asarray(True))
    assert int(ls.good_steps) == 1
    ls = ls.update(jnp.asarray(False))
    assert float(ls.scale) == 4.0
    assert int(ls.good_steps) == 0
    for _ in range(5):
        ls = ls.update(jnp.asarray(False))
    assert float(ls.scale) == 1.0


def test_loss_scale_doubles_after_period_finite_steps():
    period = 3
    ls = LossScale.create(dynamic=True, initial=4.0, period=period)
    for i in range(period - 1):
        ls = ls.update(jnp.asarray(True))
        assert float(ls.scale) == 4.0, f"grew early, after {i + 1} steps"
    ls = ls.update(jnp.asarray(True))
    assert float(ls.scale) == 8.0
    assert int(ls.good_steps) == 0
    for _ in range(period):
        ls = ls.update(jnp.asarray(True))
    assert float(ls.scale) == 16.0


def test_loss_scale_update_under_jit():
    ls = LossScale.create(dynamic=True, initial=2.0, period=2)
    step = jax.jit(lambda s, f: s.update(f))
    ls = step(ls, jnp.asarray(True))
    ls = step(ls, jnp.asarray(True))
    assert float(ls.scale) == 4.0
    ls = step(ls, jnp.asarray(False))
    assert float(ls.scale) == 2.0


def test_loss_scale_at_the_cap_stays_there_after_good_steps():
    ls = LossScale.create(dynamic=True, initial=MAX_LOSS_SCALE, period=1)
    step = jax.jit(lambda s, f: s.update(f))
    for _ in range(3):
        ls = step(ls, jnp.asarray(True))
        assert float(ls.scale) == MAX_LOSS_SCALE
        assert int(ls.good_steps) == 0  # each step is a growth step, capped


@pytest.mark.parametrize("factor", [2.0, 3.0, 1e30])  # 1e30: the product overflows float32
def test_loss_scale_near_the_cap_never_reaches_inf(factor):
    ls = LossScale.create(dynamic=True, initial=MAX_LOSS_SCALE / 4, period=2, factor=factor)
    step = jax.jit(lambda s, f: s.update(f))
    for _ in range(20):
        ls = step(ls, jnp.asarray(True))
        assert np.isfinite(float(ls.scale)) and float(ls.scale) <= MAX_LOSS_SCALE
    assert float(ls.scale) == MAX_LOSS_SCALE


def test_loss_scale_halves_from_the_cap_and_unscales_there():
    ls = LossScale.create(dynamic=True, initial=MAX_LOSS_SCALE)
    g = {"w": jnp.asarray([1.5 * MAX_LOSS_SCALE, -MAX_LOSS_SCALE], jnp.float32)}
    np.testing.assert_array_equal(ls.unscale(g)["w"], [1.5, -1.0])  # 1/scale not flushed
    ls = ls.update(jnp.asarray(False))
    assert float(ls.scale) == MAX_LOSS_SCALE / 2
    ls = ls.update(jnp.asarray(False))
    assert float(ls.scale) == MAX_LOSS_SCALE / 4


@pytest.mark.parametrize("initial", [2.0**127, float(np.finfo(np.float32).max), 1e39, np.inf])
def test_loss_scale_create_never_makes_inf(initial):
    ls = LossScale.create(dynamic=True, initial=initial)
    assert float(ls.scale) == MAX_LOSS_SCALE


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(initial=np.nan), "initial=nan must be a number >= 1"),  # every step was skipped
        (dict(initial=0.0), "initial=0.0 must be a number >= 1"),
        (dict(initial=-4.0), "initial=-4.0 must be a number >= 1"),
        (dict(period=0), "period=0 must be an int >= 1"),
        (dict(period=2.5), "period=2.5 must be an int >= 1"),
        (dict(factor=0.5), "factor=0.5 must be a finite number > 1"),  # an overflow grew it
        (dict(factor=1.0), "factor=1.0 must be a finite number > 1"),  # it never changed
    ],
)
def test_a_loss_scale_that_cannot_work_is_refused_in_create(kw, match):
    with pytest.raises(ConfigError, match=f"LossScale {match}, e.g. "):
        LossScale.create(dynamic=True, **kw)


def test_an_inf_loss_scale_comes_back_to_the_cap():
    """A scale that reached inf before the cap existed (an older checkpoint) is finite again
    after one update, skipped step or not."""
    for finite in (False, True):
        ls = LossScale.create(dynamic=True).replace(scale=jnp.asarray(np.inf, jnp.float32))
        assert float(ls.update(jnp.asarray(finite)).scale) == MAX_LOSS_SCALE


def test_static_loss_scale_is_identity():
    ls = LossScale.create(dynamic=False, initial=1024.0)
    assert float(ls.scale) == 1.0
    assert ls.update(jnp.asarray(False)) is ls
    assert ls.update(jnp.asarray(True)) is ls
    g = {"w": jnp.asarray([1.5, -2.0])}
    np.testing.assert_array_equal(ls.unscale(g)["w"], g["w"])


def test_unscale_divides_and_keeps_dtype():
    ls = LossScale.create(dynamic=True, initial=8.0)
    g = {"a": jnp.asarray([8.0, -16.0], jnp.float32), "b": jnp.asarray([4.0], jnp.float16)}
    out = ls.unscale(g)
    np.testing.assert_allclose(out["a"], [1.0, -2.0])
    np.testing.assert_allclose(np.asarray(out["b"], np.float32), [0.5])
    assert out["b"].dtype == jnp.float16


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_false_on_nan_or_inf(bad):
    tree = {"a": jnp.ones((3,)), "b": {"c": jnp.asarray([1.0, bad, 2.0])}}
    assert not bool(all_finite(tree))


def test_all_finite_true_on_finite_trees():
    assert bool(all_finite({"a": jnp.ones((3,)), "b": [jnp.zeros((2, 2), jnp.bfloat16)]}))
    assert bool(all_finite({}))


@pytest.mark.parametrize("momentum_start", [-1.0, 0.95])  # optax as it is, and injected
def test_frozen_parameters_get_no_update_not_even_weight_decay(momentum_start):
    cfg = optim_cfg(name="sgd", weight_decay=0.1, warmup_epochs=0.0, frozen=r"^conv/kernel$",
                    momentum_start=momentum_start, momentum_ramp_epochs=1.0)  # fmt: skip
    params = small_params()
    grads = jax.tree.map(jnp.ones_like, params)
    updates = _one_update(cfg, params, grads)
    assert not np.any(np.asarray(updates["conv"]["kernel"]))  # frozen: exactly zero
    for leaf in jax.tree.leaves({k: v for k, v in updates.items() if k != "conv"}):
        assert np.all(np.asarray(leaf) != 0)  # the others train (the control)
    # the same config without the freeze moves the kernel: the mask is what stops it
    free = _one_update(optim_cfg(**{**cfg.to_dict(), "frozen": ""}), params, grads)
    assert np.all(np.asarray(free["conv"]["kernel"]) != 0)


def test_a_frozen_regex_that_matches_no_parameter_is_a_config_error_naming_real_paths():
    """``stem/kernel`` for ``stem_conv/kernel`` would freeze nothing, silently: the state's
    init refuses it, naming the regex and the closest real paths."""
    cfg = optim_cfg(warmup_epochs=0.0, frozen="dense/kernal")
    tx, _ = make_optimizer(cfg, single_stage_plan(10, 100, 256))
    with pytest.raises(
        ConfigError, match="optim.frozen='dense/kernal' matches no parameter path"
    ) as e:
        tx.init(small_params())
    assert "the closest of the model's 5: dense/kernel" in str(e.value)
    ok, _ = make_optimizer(optim_cfg(warmup_epochs=0.0, frozen="dense/kernel"),
                           single_stage_plan(10, 100, 256))  # fmt: skip
    ok.init(small_params())  # a regex that matches is fine


def test_the_frozen_line_names_what_it_freezes_and_its_share():
    """Set-up says what ``optim.frozen`` froze: the arrays and their share of the values,
    counted on the shapes (what the trainer passes) as on the arrays."""
    params = small_params()
    line = describe_frozen("kernel$", params)
    assert line == ("optim.frozen='kernel$': 2 of 5 parameter arrays get no update "
                    "(conv/kernel, dense/kernel), 84 of 95 values")  # fmt: skip
    assert describe_frozen("kernel$", jax.eval_shape(lambda: params)) == line


def test_a_frozen_regex_matching_nothing_stops_the_program_build():
    """Through the program (the model's real, boxed parameters): the error at build time."""
    from helpers import build, tiny_config

    with pytest.raises(ConfigError, match="the closest of the model's [0-9]+: stem_conv/kernel"):
        build(tiny_config(**{"optim.frozen": "stem/kernel"}))


@pytest.mark.parametrize("initial", [0.5, 2.0**127, 1e39])
def test_a_loss_scale_initial_outside_1_to_the_cap_is_a_config_error(initial):
    """Below 1 the scale rose on an overflow (it halves down to 1); above MAX_LOSS_SCALE it
    was lowered to the cap without a word (1e39 was float32's inf before the cap)."""
    c = base_config()
    c.precision.compute, c.precision.loss_scale_initial = "float16", initial
    with pytest.raises(ConfigError, match="precision.loss_scale_initial=.* must be >= 1 and <="):
        validate(c, sources=False)
    c.precision.loss_scale_initial = MAX_LOSS_SCALE
    validate(c, sources=False)


def test_a_resume_into_float16_starts_the_loss_scale_at_its_initial_value():
    """A float32 (or bfloat16) run's checkpoint holds a loss scale of 1, its constant; resumed
    in float16 (--allow-config-change) it went on at 1 and would grow only after
    loss_scale_period finite steps. It starts at loss_scale_initial, with no good steps;
    a float16 checkpoint's own scale is kept, and so is any in another compute."""
    from flax import struct
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hybridpar.runtime.trainer import fresh_loss_scale

    class State(struct.PyTreeNode):
        loss_scale: LossScale

    c = base_config()
    c.precision.compute, c.precision.loss_scale_initial = "float16", 1024.0
    # as restored: replicated over the mesh, where the train step takes it (a new array on
    # one device was a disallowed transfer at the first step)
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())
    restored = jax.device_put(
        LossScale(jnp.asarray(1.0), jnp.asarray(7, jnp.int32), period=2000), everywhere
    )
    state = State(restored)
    fresh = fresh_loss_scale(c, state, {"precision": {"compute": "float32"}}).loss_scale
    assert (float(fresh.scale), int(fresh.good_steps), fresh.period) == (1024.0, 0, 2000)
    assert fresh.scale.sharding == fresh.good_steps.sharding == everywhere
    for held in ({"precision": {"compute": "float16"}}, None):
        assert fresh_loss_scale(c, state, held) is state
    c.precision.compute = "bfloat16"
    assert fresh_loss_scale(c, state, {"precision": {"compute": "float32"}}) is state


@pytest.mark.parametrize("short, dtype", [("fp16", "float16"), ("bf16", "bfloat16"),
                                          ("FP32", "float32")])  # fmt: skip
def test_a_dtypes_short_name_is_refused_naming_that_dtype(short, dtype):
    """fp16 is nearer float32 than float16 by spelling: the advice named float32."""
    c = base_config()
    c.precision.compute = short
    with pytest.raises(ConfigError, match=f"use e.g. --config.precision.compute={dtype}$"):
        validate(c, sources=False)


@pytest.mark.parametrize("key, value", [("loss_scale_initial", 1024.0), ("loss_scale_period", 500)])
def test_a_loss_scale_setting_without_float16_compute_is_named_with_the_fix(key, value):
    """Only float16 scales its loss: set under float32 or bfloat16 compute, these did
    nothing without a word (set-up now warns, ``unused_settings``). The defaults inherited
    say nothing. Planted bug that fails it: the check left out."""
    c = base_config()
    c.precision[key] = value
    for compute in ("float32", "bfloat16"):
        c.precision.compute = compute
        assert unused_settings(c) == [
            f"precision.{key}={value!r} does nothing: only float16 compute scales its loss "
            f"(precision.compute={compute!r}); drop --config.precision.{key}, or set "
            "--config.precision.compute=float16"
        ]
    c.precision.compute = "float16"
    assert unused_settings(c) == []
    inherited = base_config()
    inherited.precision.compute = "bfloat16"
    assert unused_settings(inherited) == []


def _flushed(pending, capsys):
    """The train record and progress line ``trainer.Progress.flush`` makes of the step
    metrics ``pending`` (plain values, as the step's come back from the device)."""
    import time
    from types import SimpleNamespace

    from hybridpar.runtime.run import LoopState
    from hybridpar.runtime.trainer import Progress

    records = []

    class Writer:
        def write(self, event, step, epoch, **values):
            records.append(values)

    plan = SimpleNamespace(total_steps=10, epoch_at=lambda step: step / 10, stages=[None])
    progress = Progress(SimpleNamespace(config=base_config(), plan=plan), Writer())
    progress.pending, progress.t0 = pending, time.time() - 1.0
    stage = SimpleNamespace(index=0, stage=SimpleNamespace(global_batch=32, image_size=16))
    capsys.readouterr()
    progress.flush(LoopState(step=len(pending)), stage)
    return records[0], capsys.readouterr().out


def _step(loss, finite, scale, next_scale):
    return dict(loss=loss, grads_finite=finite, loss_scale=scale, next_loss_scale=next_scale,
                lr=0.1)  # fmt: skip


def test_a_line_of_overflowed_float16_steps_logs_their_loss_and_the_scale_now_in_effect(capsys):
    """A float16 step skipped because its scaled gradients overflowed computed a true
    (finite) loss: the line's loss counts it, with the skip, so an overflow does not read
    as a divergence, where the loss itself is not finite (null, ``nan``). ``loss_scale`` is
    the scale after the line's steps. Planted bugs that fail it: the loss of the applied
    steps only (the old rule: null for a line of skipped steps); the scale the last step
    used."""
    applied, overflow = _step(2.0, True, 1024.0, 1024.0), _step(4.0, False, 1024.0, 512.0)
    rec, line = _flushed([applied, overflow], capsys)
    assert (rec["loss"], rec["skipped_steps"], rec["loss_scale"]) == (3.0, 1, 512.0)
    assert "loss 3.0000" in line and line.rstrip().endswith("skipped 1")
    rec, line = _flushed([overflow], capsys)
    assert (rec["loss"], rec["skipped_steps"], rec["loss_scale"]) == (4.0, 1, 512.0)
    rec, line = _flushed([applied, _step(float("nan"), False, 1024.0, 512.0)], capsys)
    assert (rec["loss"], rec["skipped_steps"]) == (None, 1)
    assert "loss nan" in line
    rec, line = _flushed([applied], capsys)
    assert (rec["loss"], rec["skipped_steps"]) == (2.0, 0) and "skipped" not in line


def test_a_float16_run_records_an_overflow_as_a_skip_with_its_loss(tmp_path):
    """A whole (tiny) float16 run from a loss scale of 1e30: every step overflows and is
    skipped. Its train records keep each step's finite loss, count the skip, and give the
    scale the next step runs at, halved at each line; the summary counts them all. Planted
    bugs that fail it: the line's loss of the applied steps only; the step's
    ``next_loss_scale`` the scale it used."""
    from helpers import tiny_digits

    from hybridpar.runtime import run_records, trainer
    from hybridpar.runtime.run import setup

    config = tiny_digits(**{"precision.compute": "float16",
                            "precision.loss_scale_initial": 1e30, "num_epochs": 0.1})  # fmt: skip
    summary = trainer.train(setup(config, str(tmp_path)))
    lines = run_records.read_run(str(tmp_path)).train
    assert [t.step for t in lines] == list(range(1, summary["steps"] + 1))
    for t in lines:
        assert t.loss is not None and 0 < t.loss < 10 and t.skipped_steps == 1
        assert t.loss_scale == pytest.approx(1e30 / 2**t.step, rel=1e-6)
    assert summary["skipped_steps"] == len(lines)
