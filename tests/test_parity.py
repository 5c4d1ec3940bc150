"""Sharded training equals one device: the spine's central promise.

For each mesh, three train steps of the tiny ResNet (float32) must give the parameters, BN
statistics and losses of the same three steps on one device, with parameters placed exactly
as the rules say.

Tolerance: the sharded step sums BatchNorm statistics and gradients in a different order
(per-shard partial sums, then an all-reduce), so float32 results differ by rounding only:
a few ulp per reduction (~1e-7 relative), amplified by three SGD steps and by BatchNorm's
division by small variances. Measured differences are ~1e-6; rtol 1e-4 / atol 1e-5 sits two
orders of magnitude above that and far below any real bug (a wrong reduction or a missing
all-reduce changes losses at the 1e-2 level).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import FSDP, infer_shardings, make_mesh, preset_rules, shard_batch
from hybridpar.models import ResNet50, ResNetTiny
from hybridpar.optim import decay_mask
from hybridpar.precision import LossScale, Policy
from hybridpar.state import create_sharded_state, make_init_fn
from hybridpar.steps import jit_train_step, make_train_step

MESHES = ["data:8", "fsdp:8", "data:4,model:2", "data:2,fsdp:2,model:2"]
BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 3


def _batches(steps=STEPS):
    """The same random batches for every test that compares a sharded run with one device."""
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.integers(0, 256, (BATCH, SIZE, SIZE, 3), np.uint8),
            "label": rng.integers(0, CLASSES, (BATCH,), np.int32),
        }
        for _ in range(steps)
    ]


def tiny_tx():
    return optax.chain(
        optax.add_decayed_weights(1e-4, mask=decay_mask),
        optax.sgd(0.1, momentum=0.9, nesterov=True),
    )


def _step_and_state(mesh, model=None):
    """The tiny ResNet's (or ``model``'s) jitted train step and initial state, placed by
    the auto preset."""
    model = model or ResNetTiny(num_classes=CLASSES)
    tx = tiny_tx()
    init = make_init_fn(model, tx, (1, SIZE, SIZE, 3), LossScale.create(dynamic=False))
    state, shardings, _ = create_sharded_state(
        init, preset_rules("auto", mesh), mesh, jax.random.key(0)
    )
    step = jit_train_step(
        make_train_step(model, tx, Policy(), lambda s: 0.1, mean=(127.5,) * 3, std=(64.0,) * 3),
        shardings,
        mesh,
        {"image": 4, "label": 1},
    )
    return step, state, shardings


def _train(spec, devices):
    mesh = make_mesh(spec, devices)
    step, state, shardings = _step_and_state(mesh)
    losses = []
    for batch in _batches():
        state, metrics = step(state, shard_batch(batch, mesh))
        losses.append(metrics["loss"])
    return {
        "mesh": mesh,
        "state": state,
        "shardings": shardings,
        "losses": np.asarray(jax.device_get(losses)),
    }


@pytest.fixture(scope="module")
def single():
    return _train("data:1", jax.devices()[:1])


@pytest.fixture(scope="module", params=MESHES)
def sharded(request):
    return _train(request.param, jax.devices())


def test_matches_one_device(sharded, single):
    tol = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sharded["losses"], single["losses"], **tol)
    assert single["losses"][-1] != pytest.approx(single["losses"][0])  # the steps did train
    for part in ("params", "batch_stats"):
        got = jax.device_get(getattr(sharded["state"], part))
        want = jax.device_get(getattr(single["state"], part))
        flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
        flat_want = jax.tree.leaves(want)
        assert len(flat_got) == len(flat_want)
        for (path, g), w in zip(flat_got, flat_want):
            np.testing.assert_allclose(g, w, **tol, err_msg=f"{part} {jax.tree_util.keystr(path)}")


def _axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _expected_shard_shape(shape, spec: P, mesh):
    dims = list(shape)
    for d, entry in enumerate(spec):
        dims[d] //= math.prod(mesh.shape[a] for a in _axes(entry))
    return tuple(dims)


def test_shards_follow_rules(sharded):
    mesh, state = sharded["mesh"], sharded["state"]
    flat_arrays = jax.tree.leaves(state)
    flat_shardings = jax.tree.leaves(sharded["shardings"])
    assert len(flat_arrays) == len(flat_shardings)
    for arr, want in zip(flat_arrays, flat_shardings):
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (arr.sharding, want)
        expected = _expected_shard_shape(arr.shape, want.spec, mesh)
        assert {s.data.shape for s in arr.addressable_shards} == {expected}
    # The rules the mesh calls for are really in force (not everything replicated).
    head = sharded["state"].params["head"]["kernel"]
    conv = sharded["state"].params["stage4_block0"]["conv2"]["kernel"]
    if mesh.shape["model"] > 1:
        assert "model" in _axes(head.sharding.spec[1])
        assert "model" in _axes(conv.sharding.spec[3])
    if mesh.shape["fsdp"] > 1:
        assert "fsdp" in _axes(conv.sharding.spec[3])
    if mesh.shape["data"] == 8:
        assert all(s.spec == P() or all(e is None for e in s.spec) for s in flat_shardings)


def _bytes_per_device(leaves, device):
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)


def test_fsdp_holds_an_eighth_per_device():
    state = _train("fsdp:8", jax.devices())["state"]
    min_size = FSDP.fsdp_min_size
    for part in ("params", "opt_state"):
        leaves = [x for x in jax.tree.leaves(getattr(state, part)) if x.size > 1]
        total = sum(x.nbytes for x in leaves)
        # The preset leaves arrays under fsdp_min_size elements (BN vectors, the 3-channel
        # stem) replicated; everything else must be split 8 ways.
        small = sum(x.nbytes for x in leaves if x.size < min_size)
        for device in jax.devices():
            held = _bytes_per_device(leaves, device)
            assert held == pytest.approx((total - small) / 8 + small, rel=1e-6), (part, device)
            assert held / total < 0.2, (part, held / total)  # tiny model: small arrays weigh


def test_fsdp_resnet50_an_eighth_per_device():
    """The same count for ResNet-50 from shapes alone (nothing allocated): ~1/8 per device."""
    mesh = make_mesh("fsdp:8")
    model = ResNet50(num_classes=1000)
    tx = optax.sgd(0.1, momentum=0.9)
    abstract = jax.eval_shape(
        make_init_fn(model, tx, (1, 224, 224, 3), LossScale.create(dynamic=False)),
        jax.random.key(0),
    )
    shardings = infer_shardings(abstract, preset_rules("auto", mesh), mesh)
    leaves = jax.tree.leaves(meta.unbox(abstract))
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    held = sum(
        math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        for x, s in zip(leaves, jax.tree.leaves(shardings))
    )
    assert total / 8 <= held <= total / 8 * 1.01, held / total


@pytest.mark.xfail(
    strict=True,
    reason="XLA SPMD bug (jax 0.10.2): wrong input gradient of a "
    "strided conv whose kernel is split over fsdp (in) and model (out) after a "
    "model-split activation; the FSDP pass avoids that layout. When this XPASSes, "
    "XLA is fixed and the pass may use either layout.",
)
def test_xla_strided_conv_gradient_bug_is_still_there():
    mesh = make_mesh("data:2,fsdp:2,model:2")
    rng = np.random.default_rng(0)
    x, w1, w2 = (
        rng.normal(size=s).astype(np.float32)
        for s in [(16, 4, 4, 16), (1, 1, 16, 32), (1, 1, 32, 64)]
    )

    def conv(x, w, stride):
        return jax.lax.conv_general_dilated(
            x, w, (stride, stride), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def loss(ws, x):
        return jnp.sum(jnp.tanh(conv(jax.nn.relu(conv(x, ws[0], 1)), ws[1], 2)) * jnp.arange(64.0))

    want = jax.grad(loss)((w1, w2), x)
    shard = (
        NamedSharding(mesh, P(None, None, None, "model")),
        NamedSharding(mesh, P(None, None, "fsdp", "model")),
    )
    got = jax.jit(jax.grad(loss), in_shardings=(shard, NamedSharding(mesh, P(("data", "fsdp")))))(
        (w1, w2), x
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3)
