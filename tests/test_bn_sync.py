"""BatchNorm statistics choices (model.bn_sync): global, local, group:N.

Each choice on data:8 must equal one device computing the same thing (the same number of
BN groups over the same global batch), in every array (``helpers.assert_parity``: the
sharded step sums in another order, so the tolerance is float32's measured spread).
``local`` must really differ from ``global``: the same check rejects it (the negative
control), and it must drop the BN all-reduces.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    NO_LLVM_OPT,
    assert_parity,
    assert_rejected,
    batches,
    compiled_step,
    hand_built,
    random_state,
    reference,
    run,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import BATCH_AXES, ConfigError, make_mesh, preset_rules
from hybridpar.models import ResNetTiny
from hybridpar.models.batchnorm import (
    BatchNorm,
    bn_axis_index_groups_for,
    bn_groups_for,
    parse_bn_sync,
)

BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 2
TOL = dict(rtol=1e-4, atol=1e-5)


# --- the module --------------------------------------------------------------------------


def _x(shape=(8, 3, 3, 5), seed=1):
    return jax.random.normal(jax.random.key(seed), shape) * 3.0 + 1.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_group_matches_flax_batchnorm(dtype):
    x = _x().astype(dtype)
    kw = dict(momentum=0.9, epsilon=1e-5, dtype=dtype)
    ref, ours = nn.BatchNorm(**kw), BatchNorm(**kw)
    v_ref = ref.init(jax.random.key(0), x, use_running_average=False)
    v_ours = ours.init(jax.random.key(0), x, use_running_average=False)
    assert jax.tree.map(jnp.shape, v_ours) == jax.tree.map(jnp.shape, v_ref)
    v = jax.tree.map(lambda a: a + 0.3 * jnp.arange(a.size, dtype=a.dtype), v_ref)

    def run(mdl, train):
        def f(v, x):
            y, upd = mdl.apply(v, x, use_running_average=not train, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, upd)

        (_, (y, upd)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(v, x)
        return y, upd, grads

    for train in (True, False):
        want, got = run(ref, train), run(ours, train)
        assert got[0].dtype == want[0].dtype == dtype
        tol = TOL if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
        for leaf in jax.tree.leaves(got[1]):
            assert leaf.dtype == jnp.float32  # float32 statistics in any compute dtype


def test_groups_normalise_separately():
    x = _x((8, 3, 3, 5))
    ours = BatchNorm(momentum=0.9, num_groups=4)
    v = ours.init(jax.random.key(0), x, use_running_average=False)
    y, upd = ours.apply(v, x, use_running_average=False, mutable=["batch_stats"])
    ref = nn.BatchNorm(momentum=0.9)
    ys, means, vars_ = [], [], []
    for g in range(4):
        yg, ug = ref.apply(
            v, x[2 * g : 2 * g + 2], use_running_average=False, mutable=["batch_stats"]
        )
        ys.append(yg)
        means.append(ug["batch_stats"]["mean"])
        vars_.append(ug["batch_stats"]["var"])
    np.testing.assert_allclose(y, jnp.concatenate(ys), **TOL)
    # Running averages move by the mean over groups of the groups' statistics.
    np.testing.assert_allclose(upd["batch_stats"]["mean"], np.mean(means, 0), **TOL)
    np.testing.assert_allclose(upd["batch_stats"]["var"], np.mean(vars_, 0), **TOL)
    with pytest.raises(ValueError, match="num_groups=3 does not divide"):
        BatchNorm(num_groups=3).apply(v, x, use_running_average=False, mutable=["batch_stats"])
    # Eval mode ignores the groups.
    y_eval = ours.apply(v, x, use_running_average=True)
    np.testing.assert_allclose(y_eval, ref.apply(v, x, use_running_average=True), **TOL)


def test_group_sharding_constrains_the_group_axis():
    """Optional: XLA already infers it on data:8 (see the all-reduce counts below), but a
    NamedSharding, or a PartitionSpec under jax.set_mesh, pins the (G, B/G, ...) groups to
    the data axes; None leaves the model free of any mesh."""
    mesh = make_mesh("data:8")
    x = jnp.zeros((16, 4, 4, 8))

    def lowered(group_sharding):
        bn = BatchNorm(num_groups=8, group_sharding=group_sharding)
        v = bn.init(jax.random.key(0), x, use_running_average=True)
        f = jax.jit(lambda v, x: bn.apply(v, x, use_running_average=False, mutable=["batch_stats"]))
        return [ln for ln in f.lower(v, x).as_text().splitlines() if "sharding_constraint" in ln]

    assert lowered(None) == []
    for found in (lowered(NamedSharding(mesh, P(BATCH_AXES))), _under_mesh(mesh, lowered)):
        assert len(found) == 1 and "8x2x4x4x8" in found[0], found
        assert '[{"data", "fsdp"}, {?}, {?}, {?}, {?}]' in found[0]


def _under_mesh(mesh, lowered):
    with jax.set_mesh(mesh):
        return lowered(P(BATCH_AXES))


def test_bn_sync_strings():
    assert parse_bn_sync("global") == ("global", 0)
    assert parse_bn_sync("group:4") == ("group", 4)
    assert [bn_groups_for(s, 8) for s in ("global", "local", "group:2", "group:8")] == [1, 8, 4, 1]
    assert bn_groups_for("local", 1) == 1
    assert bn_axis_index_groups_for("global", 8) is None
    assert bn_axis_index_groups_for("local", 8) is None
    assert bn_axis_index_groups_for("group:4", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for bad in ("all", "group", "group:", "group:0", "group:x", "Global", "local:2"):
        with pytest.raises(ConfigError, match="bn_sync"):
            bn_groups_for(bad, 8)
    with pytest.raises(ConfigError, match="do not divide the 8"):
        bn_groups_for("group:3", 8)


# --- sharded step == one device computing the same groups ---------------------------------


def _program(spec, devices, bn_groups):
    mesh = make_mesh(spec, devices)
    model = ResNetTiny(num_classes=CLASSES, bn_groups=bn_groups)
    return hand_built(model, mesh, preset_rules("auto", mesh))


CHOICES = ["global", "local", "group:2"]


@pytest.fixture(scope="module")
def runs():
    out = {}
    for bn_sync in CHOICES:
        groups = bn_groups_for(bn_sync, 8)
        single = _program("data:1", jax.devices()[:1], groups)
        start = random_state(single)
        sharded = _program("data:8", jax.devices(), groups)
        # Both sides without LLVM's optimisations (helpers.NO_LLVM_OPT: the same HLO, a
        # third less compile time for each of the six steps).
        step = compiled_step(sharded, start, NO_LLVM_OPT)
        hlo = step.as_text()
        reference_step = compiled_step(single, start, NO_LLVM_OPT)
        out[bn_sync] = {
            "single": reference(single, start, batches(STEPS), step=reference_step),
            "sharded": run(step, sharded, start, batches(STEPS)),
            "all_reduces": sum(
                " all-reduce(" in ln or "all-reduce-start(" in ln for ln in hlo.splitlines()
            ),
        }
    return out


@pytest.mark.parametrize("bn_sync", CHOICES)
def test_matches_one_device_computing_the_same(runs, bn_sync):
    assert_parity(runs[bn_sync]["sharded"], runs[bn_sync]["single"])


def test_choices_differ(runs):
    """Negative control: each choice, checked against another's reference, is rejected."""
    for a, b in [("local", "global"), ("group:2", "global"), ("local", "group:2")]:
        assert_rejected(runs[a]["sharded"], runs[b]["single"], r"bn\d.*(mean|var)")


def test_local_drops_the_bn_all_reduces(runs):
    n = {k: v["all_reduces"] for k, v in runs.items()}
    print(f"tiny ResNet data:8 all-reduces per train step: {n}")
    # global: one or more per BN layer and pass (12 BN layers); local: the groups are the
    # devices, so only the gradients and the running-average update are reduced (XLA's CPU
    # combiner fuses those independent reductions into one op).
    assert n["local"] < n["global"]
    assert n["global"] >= 12
    assert n["local"] <= 2
