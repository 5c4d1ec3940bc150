"""hybridpar.shard_batch: host-local batches -> global arrays, and the checks on their leaves."""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.parallel.mesh import make_mesh
from hybridpar.parallel.partitioning import infer_shardings, shard_batch


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("data:8")


def test_matching_leaves_become_global_arrays(mesh):
    batch = {"image": np.zeros((16, 4, 4, 3), np.uint8), "label": np.arange(16, dtype=np.int32)}
    out = shard_batch(batch, mesh)
    assert out["image"].shape == (16, 4, 4, 3) and out["label"].shape == (16,)
    np.testing.assert_array_equal(np.asarray(out["label"]), batch["label"])


@pytest.mark.parametrize(
    "labels, expect",
    [
        (np.arange(8, dtype=np.int32), r"'image': 16, 'label': 8"),  # both divide the mesh
        (np.arange(24, dtype=np.int32), r"'image': 16, 'label': 24"),
        (np.int32(3), r"'image': 16, 'label': a scalar"),
    ],
)
def test_leaves_of_different_lengths_are_refused_naming_them(mesh, labels, expect):
    batch = {"image": np.zeros((16, 4, 4, 3), np.uint8), "label": labels}
    with pytest.raises(ConfigError, match=expect):
        shard_batch(batch, mesh)


def test_nested_leaves_are_named_by_path(mesh):
    batch = {"x": {"a": np.zeros((8, 2)), "b": np.zeros((16, 2))}, "mask": np.ones(8)}
    with pytest.raises(ConfigError, match=r"'x/b': 16"):
        shard_batch(batch, mesh)


def test_on_one_process_check_hosts_and_mixed_leaves_change_nothing(mesh):
    """check_hosts compares hosts only where there are several; one process may mix a
    global leaf with a host-local one (their lengths agree there)."""
    batch = {"image": np.zeros((16, 2), np.float32), "label": np.arange(16, dtype=np.int32)}
    out = shard_batch(batch, mesh, check_hosts=True)
    mixed = shard_batch({"image": out["image"], "label": batch["label"]}, mesh)
    assert mixed["image"].shape == (16, 2) and mixed["label"].shape == (16,)
    np.testing.assert_array_equal(np.asarray(mixed["label"]), batch["label"])


# --- a user's own mesh, made with jax.make_mesh ---------------------------------------------


class MLP(nn.Module):
    """A user's own model. ``out_sharding``: the second layer's output sharding, which
    Explicit axes ask for when its contraction dimension is split over ``model``."""

    out_sharding: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        dot = None
        if self.out_sharding is not None:
            dot = functools.partial(jax.lax.dot_general, out_sharding=self.out_sharding)
        return nn.Dense(10, dot_general=dot)(x)


# Dense_0 split on its outputs and Dense_1 on its inputs (Megatron style), over `model`.
MLP_RULES = (
    (r"Dense_0/kernel$", (None, "model")),
    (r"Dense_0/bias$", ("model",)),
    (r"Dense_1/kernel$", ("model", None)),
)


def sgd_steps(model, params, batches, mesh=None, rules=()):
    """Plain SGD steps of the user's own loop; on ``mesh`` through infer_shardings and
    shard_batch, else on one device."""

    def step(p, b):
        def loss(p):
            logits = model.apply(p, b["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        g = jax.grad(loss)(p)
        return jax.tree.map(lambda a, d: a - 0.5 * d, p, g)

    if mesh is None:
        step = jax.jit(step)
        for b in batches:
            params = step(params, b)
        return jax.device_get(params)
    shardings = infer_shardings(params, rules, mesh)
    params = jax.device_put(params, shardings)
    with jax.set_mesh(mesh):  # Explicit axes need the mesh in context under jit
        step = jax.jit(step, out_shardings=shardings)
        for b in batches:
            params = step(params, shard_batch(b, mesh))
    assert params["params"]["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    return jax.device_get(params)


@pytest.mark.parametrize("axis_type", ["default", "auto"])
def test_a_users_jax_make_mesh_trains_as_one_device(axis_type):
    """jax.make_mesh's default axes are Explicit (jax 0.10); shard_batch used to look up
    the `fsdp` axis our own meshes always have."""
    if axis_type == "default":
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        assert set(mesh.axis_types) == {AxisType.Explicit}
        model = MLP(out_sharding=P("data", None))
    else:
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        model = MLP()
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.integers(0, 10, 16)}
        for _ in range(3)
    ]
    start = jax.device_get(MLP().init(jax.random.key(0), np.zeros((1, 12), np.float32)))
    got = sgd_steps(model, start, batches, mesh, MLP_RULES)
    want = sgd_steps(MLP(), start, batches)
    # Only the order of the sums differs: each of the 3 steps reduces at most 32 terms, so
    # results differ by a few float32 roundings of the arrays' scale; 64 eps of it bounds that.
    eps = np.finfo(np.float32).eps
    for (path, w), g, s in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(start)
    ):
        tol = 64 * eps * np.abs(w).max()
        assert np.abs(w - s).max() > 100 * tol, path  # the comparison sees every update
        np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=str(path))


def test_explicit_mesh_without_fsdp_is_accepted():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    out = shard_batch({"label": np.arange(16, dtype=np.int32)}, mesh)
    assert out["label"].sharding.spec == P(("fsdp",))
    assert jax.typeof(out["label"]).sharding.spec == P("fsdp")  # split, in the type too
    np.testing.assert_array_equal(np.asarray(out["label"]), np.arange(16))


def test_a_mesh_with_other_axis_names_is_refused_naming_them():
    mesh = jax.make_mesh((4, 2), ("batch", "model"))
    with pytest.raises(ConfigError, match=r"\('batch',\) not among \('data', 'fsdp', 'model'\)"):
        shard_batch({"label": np.arange(16, dtype=np.int32)}, mesh)
