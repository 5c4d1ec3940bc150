"""Train/eval steps: padding masks, mixed precision and float16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import batches as helpers_batches
from helpers import build, hand_built, place, random_state, run, tiny_config

from hybridpar import make_mesh, preset_rules, shard_batch
from hybridpar.input.arrays import eval_batches
from hybridpar.models import ResNetTiny
from hybridpar.program.precision import LossScale, Policy, make_policy
from hybridpar.program.state import create_sharded_state, make_init_fn
from hybridpar.program.steps import (
    cross_entropy,
    jit_eval_step,
    jit_train_step,
    make_eval_step,
    make_train_step,
    normalize,
)

SIZE, CLASSES = 8, 10
MEAN, STD = (127.5,) * 3, (64.0,) * 3


def _setup(mesh_spec, policy=Policy(), loss_scale=None, devices=None):
    mesh = make_mesh(mesh_spec, devices)
    model = ResNetTiny(
        num_classes=CLASSES, dtype=policy.compute_dtype, param_dtype=policy.param_dtype
    )
    tx = optax.sgd(0.05, momentum=0.9)
    loss_scale = loss_scale or LossScale.create(dynamic=False)
    init = make_init_fn(model, tx, (1, SIZE, SIZE, 3), loss_scale)
    state, shardings, _ = create_sharded_state(
        init, preset_rules("auto", mesh), mesh, jax.random.key(0)
    )
    return mesh, model, tx, state, shardings


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (n, SIZE, SIZE, 3), np.uint8),
        "label": rng.integers(0, CLASSES, (n,), np.int32),
    }


def test_eval_counts_each_example_once_with_padding():
    mesh, model, _, state, shardings = _setup("data:8")
    data = _batch(37)  # 37 = 2 full batches of 16 + 5, so the last batch is mostly padding
    step = jit_eval_step(
        make_eval_step(model, Policy(), mean=MEAN, std=STD),
        shardings,
        mesh,
        {"image": 4, "label": 1, "mask": 1},
    )
    sums = None
    for b in eval_batches(data, 16):
        out = step(state, shard_batch(b, mesh))
        sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    # Reference: all 37 at once on the host's default device, no padding at all.
    params = jax.device_get({"params": state.params, "batch_stats": state.batch_stats})
    logits = np.asarray(
        model.apply(params, normalize(data["image"], MEAN, STD, jnp.float32), train=False)
    )
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert float(sums["count"]) == 37
    assert float(sums["top1_sum"]) == np.sum(logits.argmax(1) == data["label"])
    assert float(sums["top5_sum"]) == np.sum((top5 == data["label"][:, None]).any(1))
    want_loss = float(np.sum(cross_entropy(jnp.asarray(logits), data["label"])))
    assert float(sums["loss_sum"]) == pytest.approx(want_loss, rel=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32_loss():
    """bfloat16 compute trains like float32: from the same random (non-trivial) start and
    three steps on one repeated batch, the losses agree to bfloat16's precision and every
    kernel's update points the same way (cosine > 0.9; a wrong or missing bfloat16
    gradient anywhere gives ~0). The initial loss alone would be ~ln(10) whatever the model
    computes."""
    runs = {}
    mesh = make_mesh("data:4,model:2")
    for name in ("float32", "bfloat16"):
        policy = make_policy(name)
        model = ResNetTiny(num_classes=CLASSES, dtype=policy.compute_dtype)
        program = hand_built(model, mesh, preset_rules("auto", mesh), policy=policy)
        start = random_state(program)
        got = run(program.train_jit, program, start, helpers_batches(steps=1) * 3)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got.state.params))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got.state.batch_stats))
        runs[name] = (start, got)
    out = jax.eval_shape(  # the model really computes in bfloat16
        lambda v: model.apply(v, jnp.zeros((2, SIZE, SIZE, 3)), train=False),
        {"params": start.params, "batch_stats": start.batch_stats},
    )
    assert out.dtype == jnp.bfloat16
    (start, f32), (_, bf16) = runs["float32"], runs["bfloat16"]
    assert f32.losses[-1] < f32.losses[0] - 0.1  # the repeated batch is being learnt
    np.testing.assert_allclose(bf16.losses, f32.losses, rtol=2e-2)
    flat = jax.tree_util.tree_leaves_with_path(start.params)
    for (path, p0), a, b in zip(
        flat, jax.tree.leaves(f32.state.params), jax.tree.leaves(bf16.state.params), strict=True
    ):
        if not jax.tree_util.keystr(path).endswith("['kernel']"):
            continue
        da, db = (np.ravel(np.asarray(x, np.float64) - p0) for x in (a, b))
        cos = da @ db / (np.linalg.norm(da) * np.linalg.norm(db))
        assert cos > 0.9, f"{jax.tree_util.keystr(path)}: bfloat16 update cosine {cos:.2f}"


def test_float16_overflow_skips_the_step_and_halves_the_scale():
    policy = make_policy("float16")
    assert policy.needs_loss_scale
    # The largest scale (2**126): the float16 gradients of the scaled loss overflow.
    mesh, model, tx, state, shardings = _setup(
        "data:8", policy, LossScale.create(dynamic=True, initial=2.0**126, period=2)
    )
    step = jit_train_step(
        make_train_step(model, tx, policy, lambda s: 0.05, mean=MEAN, std=STD),
        shardings,
        mesh,
        {"image": 4, "label": 1},
    )
    before = jax.device_get(state.params)
    state, metrics = step(state, shard_batch(_batch(16), mesh))
    assert not bool(metrics["grads_finite"])
    assert int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**125
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)  # skipped: nothing changed
    # Keep halving until the scale fits; then steps apply and, after `period` (2) finite
    # steps in a row, the scale doubles.
    history = []  # (grads finite, the scale that step used)
    for i in range(120):
        state, metrics = step(state, shard_batch(_batch(16, seed=i + 1), mesh))
        history.append((bool(metrics["grads_finite"]), float(metrics["loss_scale"])))
        if sum(f for f, _ in history) >= 3:
            break
    finite = [f for f, _ in history]
    scales = [s for _, s in history]
    assert sum(finite) >= 3 and np.isfinite(float(metrics["loss"]))
    for i, (f, s) in enumerate(history[:-1]):  # every overflow halves the next scale
        if not f:
            assert scales[i + 1] == s / 2, history
    # The first two finite steps in a row after an overflow double the scale after them.
    j = next(i for i in range(1, len(history) - 1) if finite[i] and finite[i + 1])
    assert not finite[j - 1], history
    after = history[j + 2][1] if j + 2 < len(history) else float(state.loss_scale.scale)
    assert after == 2 * scales[j + 1] == 2 * scales[j], history
    assert float(state.loss_scale.scale) < 2.0**126
    changed = any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before))
    )
    assert changed


class _FixedLogits:
    """A stand-in model whose logits are given: the test sees exactly what the head does."""

    def __init__(self, logits):
        self.logits = logits

    def apply(self, variables, images, train, mutable=()):
        return (self.logits, {}) if train else self.logits


@pytest.mark.parametrize("train", [True, False])
def test_precision_output_sets_the_dtype_the_loss_sees(train):
    from hybridpar.program.steps import DenseHead

    # Logits with more mantissa bits than bfloat16 keeps, so rounding them changes the loss.
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, CLASSES)) * 3, jnp.float32)
    labels = jnp.arange(4) % CLASSES
    rounded = logits.astype(jnp.bfloat16).astype(jnp.float32)
    assert not np.array_equal(np.asarray(rounded), np.asarray(logits))

    def loss(output):
        policy = make_policy(output=output)
        out, _ = DenseHead().apply(
            _FixedLogits(logits), {}, None, labels, train=train, policy=policy
        )
        return np.asarray(out["loss"])

    np.testing.assert_array_equal(loss("float32"), np.asarray(cross_entropy(logits, labels)))
    np.testing.assert_array_equal(loss("bfloat16"), np.asarray(cross_entropy(rounded, labels)))
    assert not np.array_equal(loss("bfloat16"), loss("float32"))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_nonfinite_step_changes_nothing_but_the_step_counter(precision):
    """Not only float16: a NaN loss or gradient in any precision skips the update (the
    parameters, optimizer state and BatchNorm statistics stay as they were)."""
    policy = make_policy(precision)
    mesh, model, tx, state, shardings = _setup("data:8", policy)
    step = jit_train_step(
        make_train_step(model, tx, policy, lambda s: 0.05, mean=MEAN, std=STD),
        shardings,
        mesh,
        {"image": 4, "label": 1},
    )

    # float32 images throughout (a uint8 batch cannot hold a NaN): one compilation, not two
    def good(seed):
        b = _batch(16, seed)
        return shard_batch(dict(b, image=b["image"].astype(np.float32)), mesh)

    state, _ = step(state, good(0))  # momentum is non-zero from here
    before = jax.device_get(state)
    bad = dict(_batch(16, seed=1), image=np.full((16, SIZE, SIZE, 3), np.nan, np.float32))
    state, metrics = step(state, shard_batch(bad, mesh))
    assert not bool(metrics["grads_finite"]) and not np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 2
    after = jax.device_get(state.replace(step=before.step))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    # and the next good batch trains again
    state, metrics = step(state, good(2))
    assert bool(metrics["grads_finite"])
    changed = jax.device_get(state.params)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(changed), jax.tree.leaves(before.params))
    )


def _is_count(path) -> bool:
    """An optax step counter: a ``count`` field (its schedules read them)."""
    return isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "count"


def optax_counts(opt_state) -> list[int]:
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return [int(x) for p, x in leaves if _is_count(p)]


@pytest.mark.parametrize("momentum", ["constant", "ramp"])
@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_after_skipped_steps_the_update_applies_the_schedule_at_the_state_step(name, momentum):
    """The learning rate and momentum are functions of the step: after two skipped steps,
    step 3 applies ``schedule(3)``, not the values of step 1 (optax's own counter stops on a
    skip), and reports them. Reference: the state before the skips moved to step 3 with
    optax's counters set to 3, then the same batch: the parameters must agree bitwise."""
    overrides = {"optim.name": name, "optim.schedule": "cosine", "optim.warmup_epochs": 0.5}
    if momentum == "ramp":  # 0.5 -> 0.9 over steps 0..5: a scheduled (injected) momentum
        overrides.update({"optim.momentum_start": 0.5, "optim.momentum_ramp_epochs": 0.5})
    program = build(tiny_config(**overrides), steps_per_epoch=10, total_steps=20)
    step, mesh = program.train_jit, program.mesh
    # the learning rate rises over the warmup: steps 1 and 3 differ
    assert float(program.schedule(1)) < float(program.schedule(3))

    def batch(seed, nan=False):  # float32 images throughout: one compilation
        b = helpers_batches(steps=1, seed=seed)[0]
        image = np.full(b["image"].shape, np.nan if nan else 0, np.float32) + b["image"]
        return shard_batch(dict(b, image=image), mesh)

    state = place(random_state(program), program.shardings)
    state, _ = step(state, batch(0))
    after_first = jax.device_get(state)
    for seed in (1, 2):
        state, metrics = step(state, batch(seed, nan=True))
        assert not bool(metrics["grads_finite"])
    assert int(state.step) == 3
    state, metrics = step(state, batch(3))
    assert bool(metrics["grads_finite"])

    def counts_at(opt_state, n):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: np.int32(n) if _is_count(p) else x, opt_state
        )

    moved = after_first.replace(step=np.int32(3), opt_state=counts_at(after_first.opt_state, 3))
    ref, _ = step(place(moved, program.shardings), batch(3))
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # and what the step reports is what it applied
    assert float(metrics["lr"]) == pytest.approx(float(program.schedule(3)), rel=1e-6)
    hyperparams = optax.tree_utils.tree_get(state.opt_state, "hyperparams")
    if momentum == "ramp":
        assert float(metrics["momentum"]) == pytest.approx(0.5 + 0.4 * 3 / 5, rel=1e-6)
        applied = float(hyperparams["learning_rate"])
        assert applied == pytest.approx(float(program.schedule(3)), rel=1e-6)
    else:
        assert hyperparams is None  # the constant optimizer, optax's own
    assert set(optax_counts(state.opt_state)) == {4}  # a checkpoint's counters agree


def test_a_state_whose_counters_lag_its_step_updates_at_the_step():
    """A checkpoint written before the counters followed the step holds, after skipped
    steps, optax counts behind ``state.step``: its first resumed update must still apply the
    schedule at the step. Reference: the same state with the counts set to the step."""
    overrides = {"optim.name": "sgd", "optim.schedule": "cosine", "optim.warmup_epochs": 0.5}
    program = build(tiny_config(**overrides), steps_per_epoch=10, total_steps=20)
    step, mesh = program.train_jit, program.mesh
    assert float(program.schedule(1)) < float(program.schedule(3))
    b = shard_batch(helpers_batches(steps=1, seed=0)[0], mesh)
    state = jax.device_get(random_state(program))

    def counts_at(opt_state, n):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: np.int32(n) if _is_count(p) else x, opt_state
        )

    lagging = state.replace(step=np.int32(3), opt_state=counts_at(state.opt_state, 1))
    at_three = state.replace(step=np.int32(3), opt_state=counts_at(state.opt_state, 3))
    got, _ = step(place(lagging, program.shardings), b)
    ref, _ = step(place(at_three, program.shardings), b)
    assert optax_counts(jax.device_get(got.opt_state)) == [4] * len(optax_counts(ref.opt_state))
    for a, r in zip(
        jax.tree.leaves(jax.device_get(got.params)),
        jax.tree.leaves(jax.device_get(ref.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, r)


def test_a_float16_step_reports_its_loss_and_the_scale_it_leaves_in_effect():
    """A float16 step whose scaled gradients overflow is skipped, but its loss (unscaled)
    is the true one, finite; it reports the scale it used and the halved one the next step
    uses. A finite step at the end of its period reports the doubled one. Planted bug that
    fails it: ``next_loss_scale`` the scale the step used."""
    policy = make_policy("float16")
    for initial, finite, factor in ((2.0**126, False, 0.5), (1.0, True, 2.0)):
        scale = LossScale.create(dynamic=True, initial=initial, period=1)
        mesh, model, tx, state, shardings = _setup("data:8", policy, scale)
        step = jit_train_step(
            make_train_step(model, tx, policy, lambda s: 0.05, mean=MEAN, std=STD),
            shardings,
            mesh,
            {"image": 4, "label": 1},
        )
        state, metrics = step(state, shard_batch(_batch(16), mesh))
        assert bool(metrics["grads_finite"]) is finite
        loss = float(metrics["loss"])
        assert 0 < loss < 10  # about ln 10 at the start; scaled, it would be ~2**126
        assert float(metrics["loss_scale"]) == initial
        assert float(metrics["next_loss_scale"]) == initial * factor
        assert float(state.loss_scale.scale) == initial * factor
