"""The momentum schedule (``optim.momentum_start`` -> ``optim.momentum`` over
``optim.momentum_ramp_epochs``, and a stage's own ``~MOMENTUM`` in ``config.stages``), through
``optax.inject_hyperparams``:

* the optimizer state holds each step's momentum, and it follows the schedule;
* a stage's momentum holds for exactly that stage's steps, the run's schedule goes on in the
  stages without one (a schedule that ignores the stages fails the same check);
* the real train step compiles once while the momentum changes;
* without a schedule the optimizer is optax's own, bitwise (no injected state);
* the trainer's train lines report the momentum used, a stage's included, with one train
  compilation; bad values (the ``~`` suffix's too) are ``ConfigError``s naming the part.
"""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from helpers import batches, build, tiny_config, tiny_digits

from hybridpar import shard_batch
from hybridpar.config.curriculum import (
    Stage,
    parse_stages,
    plan_stages,
    single_stage_plan,
    stage_momenta,
    stages_from_config,
)
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config, validate
from hybridpar.program.optim import decay_mask, make_momentum_schedule, make_optimizer, momentum_at
from hybridpar.program.state import init_sharded
from hybridpar.runtime import trainer
from hybridpar.runtime.run import setup

PLAN = single_stage_plan(10, 100, 256)  # 10 steps an epoch


def optim_cfg(**overrides):
    cfg = ml_collections.ConfigDict(base_config().optim.to_dict())
    cfg.update(overrides)
    return cfg


def params_and_grads():
    rng = np.random.default_rng(0)
    params = {
        "kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }
    g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    return params, [g, jax.tree.map(lambda x: -0.5 * x, g)]  # a turn, so momentum shows


def run_updates(tx, params, grads, steps):
    """``steps`` jitted updates (grads cycled); the updates, the states and the jit."""
    update = jax.jit(tx.update)
    state, out = tx.init(params), []
    for i in range(steps):
        updates, state = update(grads[i % len(grads)], state, params)
        out.append((updates, state))
    return out, update


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_momentum_follows_the_ramp_in_the_optimizer_state_with_one_compilation(name):
    cfg = optim_cfg(name=name, momentum=0.9, momentum_start=0.98, momentum_ramp_epochs=0.5)
    tx, _ = make_optimizer(cfg, PLAN)
    params, grads = params_and_grads()
    out, update = run_updates(tx, params, grads, 8)
    used = [float(optax.tree_utils.tree_get(s, "hyperparams")["momentum"]) for _, s in out]
    # step i runs at epoch i / 10: 0.98 down to 0.9 over 5 steps, then 0.9
    want = [0.98 - 0.08 * min(i / 5, 1.0) for i in range(8)]
    np.testing.assert_allclose(used, want, rtol=1e-6)
    assert used[0] > used[2] > used[4] > used[5] == used[7]
    assert update._cache_size() == 1  # every momentum ran in the one compiled update


def test_a_ramp_from_momentum_to_itself_is_the_constant_optimizer():
    """The scheduled optimizer really uses its momentum: start == end gives the constant
    optimizer's updates; another start gives other updates from the second step on."""
    params, grads = params_and_grads()
    const, _ = make_optimizer(optim_cfg(warmup_epochs=0.0), PLAN)
    same, _ = make_optimizer(
        optim_cfg(warmup_epochs=0.0, momentum_start=0.9, momentum_ramp_epochs=1.0), PLAN
    )
    other, _ = make_optimizer(
        optim_cfg(warmup_epochs=0.0, momentum_start=0.5, momentum_ramp_epochs=1.0), PLAN
    )
    a, b, c = (run_updates(tx, params, grads, 3)[0] for tx in (const, same, other))
    for (ua, _), (ub, _) in zip(a, b):
        for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
            np.testing.assert_allclose(x, y, rtol=1e-6)
    assert not np.allclose(a[1][0]["kernel"], c[1][0]["kernel"])


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_without_a_schedule_the_optimizer_is_optax_own_bitwise(name):
    cfg = optim_cfg(name=name, warmup_epochs=0.0)
    tx, schedule = make_optimizer(cfg, PLAN)
    if name == "sgd":
        ref = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
            optax.sgd(schedule, momentum=cfg.momentum, nesterov=cfg.nesterov),
        )
    else:
        ref = optax.lars(schedule, weight_decay=cfg.weight_decay, weight_decay_mask=decay_mask,
                         trust_coefficient=cfg.lars_trust, trust_ratio_mask=decay_mask,
                         momentum=cfg.momentum, nesterov=cfg.nesterov)  # fmt: skip
    params, grads = params_and_grads()
    got, want = run_updates(tx, params, grads, 3)[0], run_updates(ref, params, grads, 3)[0]
    assert optax.tree_utils.tree_get(got[-1][1], "hyperparams") is None  # nothing injected
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(x, y)


def test_the_train_step_compiles_once_while_the_momentum_changes():
    """The program's own jitted train step (sharded state, data:4 x model:2) over steps
    whose momentum differs: one compilation, and the metrics carry the momentum used.
    bfloat16 parameters: a float32 momentum must not turn their trace into float32 (another
    state type, so another compilation)."""
    config = tiny_config(
        "data:4,model:2",
        **{
            "precision.params": "bfloat16",
            "precision.compute": "bfloat16",
            "optim.momentum_start": 0.5,
            "optim.momentum_ramp_epochs": 0.4,
        },
    )
    program = build(config, steps_per_epoch=10, total_steps=100)
    state = init_sharded(program.init, program.shardings, jax.random.key(0))
    step, used = program.train_jit, []
    for host in batches(steps=6):
        state, metrics = step(state, shard_batch(host, program.mesh))
        used.append(float(metrics["momentum"]))
    np.testing.assert_allclose(used, [0.5 + 0.4 * min(i / 4, 1.0) for i in range(6)], rtol=1e-6)
    stored = optax.tree_utils.tree_get(state.opt_state, "hyperparams")["momentum"]
    assert float(stored) == pytest.approx(0.9)
    trace = optax.tree_utils.tree_get(state.opt_state, "trace")
    assert {x.dtype for x in jax.tree.leaves(trace)} == {jnp.dtype(jnp.bfloat16)}
    assert step._cache_size() == 1


def test_train_lines_report_the_momentum_used(tmp_path):
    """Three stages of one shape: the ramp (0.98 -> 0.9 over 0.1 epochs) in the first, the
    second's own 0.8, then the ramp's end, 0.9; one compiled train step for all of them."""
    ramp = {"optim.momentum": 0.9, "optim.momentum_start": 0.98, "optim.momentum_ramp_epochs": 0.1}
    c = tiny_digits(
        "data:8", stages="0.1:16-8,0.2:16-8~0.8,0.3:16-8", num_epochs=0.3,
        eval_every_epochs=0, **ramp,
    )  # fmt: skip
    run = setup(c, str(tmp_path))
    assert [s.stage.global_batch for s in run.plan.stages] == [64] * 3
    trainer.train(run)
    lines = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    train = [r for r in lines if r["event"] == "train"]
    # each line: the momentum of its last step, which ran at the epoch of the step before
    schedule = make_momentum_schedule(c.optim, run.plan)
    want = [float(schedule(r["step"] - 1)) for r in train]
    np.testing.assert_allclose([r["momentum"] for r in train], want, rtol=1e-6)
    by_stage = {i: [r["momentum"] for r in train if r["stage"] == i] for i in range(3)}
    assert all(by_stage.values())  # every stage logged steps
    assert by_stage[0][0] > 0.95 and by_stage[0] == sorted(by_stage[0], reverse=True)
    np.testing.assert_allclose(by_stage[1], 0.8, rtol=1e-6)
    np.testing.assert_allclose(by_stage[2], 0.9, rtol=1e-6)
    assert [p["program"] for p in run.program.compiles].count("train") == 1


# ---- A stage's own momentum: "END:SIZE-BATCH[@SCALE][~MOMENTUM]" ---------------------------


@pytest.mark.parametrize(
    "text,scales,momenta",
    [
        ("20:128-224,38:224-224@0.5", [None, 0.5], [None, None]),
        ("20:128-224@0.08~0.98,38:224-224~0,40:288-128@0.5", [0.08, None, 0.5], [0.98, 0.0, None]),
        (" 1:16-8 @ 0.5 ~ 0.9 , 2:16-8~.95", [0.5, None], [0.9, 0.95]),
    ],
)
def test_stages_parse_with_and_without_a_momentum(text, scales, momenta):
    assert [t[3] for t in parse_stages(text)] == scales  # still four fields per stage
    assert stage_momenta(text) == momenta
    c = base_config()
    c.stages = text
    assert [s.momentum for s in stages_from_config(c, 8)] == momenta


@pytest.mark.parametrize(
    "stages,expect",
    [
        (
            "1:16-8~1.0",
            "'1:16-8~1.0' has a momentum of 1; it must be >= 0 and < 1, e.g. 1:16-8~0.9",
        ),
        ("1:16-8~-0.5", "'1:16-8~-0.5' has a momentum of -0.5"),
        ("1:16-8~0.9@0.5", ("'1:16-8~0.9@0.5' is not END_EPOCH:IMAGE_SIZE-BATCH_PER_DEVICE"
         "[@MIN_CROP_SCALE][~MOMENTUM] (@MIN_CROP_SCALE comes before ~MOMENTUM)")),
        ("1:16-8~high", "'1:16-8~high' is not END_EPOCH"),
        ("1:16-8~", "'1:16-8~' is not END_EPOCH"),
    ],
)  # fmt: skip
def test_bad_stage_momenta_are_config_errors_naming_the_part(stages, expect):
    c = base_config()
    c.stages, c.num_epochs = stages, 1.0
    with pytest.raises(ConfigError) as e:
        validate(c)  # the config's own checks, before any device or data
    assert expect in str(e.value)
    assert "e.g." in str(e.value)


STAGES = [Stage(1.0, 16, 64, 0.5), Stage(2.0, 16, 64, 0.5, 0.8), Stage(3.0, 16, 128, 0.5)]
STAGE_PLAN = plan_stages(STAGES, lambda batch: 640 // batch)  # 10, 10, then 5 steps an epoch


def check_stage_momenta(schedule, cfg, plan):
    """``schedule`` at every step, Python and traced: a stage's own momentum in its steps,
    elsewhere the run's (the ramp by epoch reached, or ``optim.momentum``)."""
    steps = np.arange(plan.total_steps)
    want = []
    for step in steps:
        own = plan.stages[plan.stage_index_at(int(step))].stage.momentum
        ramp = cfg.momentum_start >= 0
        run = float(momentum_at(cfg, plan.epoch_at(int(step)))) if ramp else cfg.momentum
        want.append(run if own is None else own)
    np.testing.assert_allclose([float(schedule(int(s))) for s in steps], want, rtol=1e-6)
    traced = jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32))
    np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-6)
    return want


@pytest.mark.parametrize("ramp", [True, False])
def test_a_stage_momentum_holds_in_its_steps_and_the_run_schedule_elsewhere(ramp):
    cfg = optim_cfg(momentum=0.9)
    if ramp:  # 0.98 -> 0.9 over 2.5 epochs: still ramping after the stage with its own
        cfg.update(momentum_start=0.98, momentum_ramp_epochs=2.5)
    schedule = make_momentum_schedule(cfg, STAGE_PLAN)
    want = check_stage_momenta(schedule, cfg, STAGE_PLAN)
    assert want[10:20] == [0.8] * 10  # stage 1 is steps 10..19, and only those
    assert want[9] != 0.8 and want[20] != 0.8
    if ramp:
        assert want[0] == pytest.approx(0.98) and want[20] == pytest.approx(0.98 - 0.08 * 0.8)
        assert want[-1] == pytest.approx(0.9)
    else:
        assert set(want[:10] + want[20:]) == {0.9}

    # Negative control: the run's schedule alone, blind to the stages, fails the same check.
    def blind(step):
        return momentum_at(cfg, STAGE_PLAN.epoch_at(step)) if ramp else jnp.float32(cfg.momentum)

    with pytest.raises(AssertionError):
        check_stage_momenta(blind, cfg, STAGE_PLAN)


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_a_stage_momentum_is_in_the_optimizer_state_with_one_compilation(name):
    """Through the optimizer (SGD and LARS), across both switches; with ``optim.momentum=0``
    the stages without their own run plain SGD/LARS on the trace (momentum 0)."""
    plan = plan_stages([Stage(0.4, 16, 64, 0.5), Stage(0.8, 16, 64, 0.5, 0.9),
                        Stage(1.0, 16, 64, 0.5)], lambda batch: 10)  # fmt: skip
    tx, _ = make_optimizer(optim_cfg(name=name, momentum=0.0), plan)
    params, grads = params_and_grads()
    out, update = run_updates(tx, params, grads, 10)
    used = [float(optax.tree_utils.tree_get(s, "hyperparams")["momentum"]) for _, s in out]
    np.testing.assert_allclose(used, [0.0] * 4 + [0.9] * 4 + [0.0] * 2, rtol=1e-6)
    assert update._cache_size() == 1
    plain, _ = make_optimizer(optim_cfg(name=name, momentum=0.0), plan_stages(
        [Stage(1.0, 16, 64, 0.5)], lambda batch: 10))  # fmt: skip
    ref = run_updates(plain, params, grads, 10)[0]
    for i in range(4):  # momentum 0 on the trace: the constant optimizer's updates
        np.testing.assert_allclose(out[i][0]["kernel"], ref[i][0]["kernel"], rtol=1e-6)
    assert not np.allclose(out[5][0]["kernel"], ref[5][0]["kernel"])  # 0.9 really used


@pytest.mark.parametrize(
    "overrides,expect",
    [
        (dict(momentum_start=1.0, momentum_ramp_epochs=1.0), "optim.momentum_start=1.0 must be"),
        (dict(momentum_start=-0.5, momentum_ramp_epochs=1.0), "optim.momentum_start=-0.5"),
        (dict(momentum_start=0.98), "needs optim.momentum_ramp_epochs > 0"),
        (dict(momentum_ramp_epochs=-1.0), "optim.momentum_ramp_epochs=-1.0 is out of range"),
    ],
)
def test_bad_momentum_schedules_are_config_errors(overrides, expect):
    c = base_config()
    c.optim.update(overrides)
    with pytest.raises(ConfigError, match="--config.optim.momentum") as e:
        validate(c)
    assert expect in str(e.value)


def test_the_default_config_has_no_momentum_schedule():
    c = base_config()
    validate(c)
    assert c.optim.momentum_start == -1.0
