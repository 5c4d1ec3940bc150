"""Sharded training equals one device: the spine's central promise.

For each mesh, three train steps of the tiny ResNet (float32, built by ``build_program``)
from random non-trivial initial values must give the parameters, BN statistics and losses
of the same three steps on one device, with parameters placed exactly as the rules say.
The check (``helpers.parity_failures``) compares every array with a tolerance measured on
the computation and requires every array to move by far more than that tolerance; its
negative controls here: the gradients of every block's conv1/conv2 kernel zeroed, and the
head's model-split gradient shards swapped, must both be rejected.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from helpers import (
    NO_LLVM_OPT,
    assert_parity,
    assert_rejected,
    batches,
    build,
    compiled_step,
    reference,
    roll_grads,
    run,
    step_with_tx,
    tiny_config,
    zero_grads,
)
from helpers import random_state as random_start
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import FSDP, infer_shardings, make_mesh, preset_rules
from hybridpar.models import ResNet50
from hybridpar.program.precision import LossScale
from hybridpar.program.state import make_init_fn

MESHES = ["data:8", "fsdp:8", "data:4,model:2", "data:2,fsdp:2,model:2"]


# Every step here compiles without LLVM's optimisations (helpers.NO_LLVM_OPT): the same
# optimised HLO, so the same shardings and collectives, a third less compile time; the one
# device reference and the sharded steps alike.


@pytest.fixture(scope="module")
def single():
    program = build(tiny_config("data:1"), jax.devices()[:1])
    start = random_start(program)
    return reference(program, start, batches(), step=compiled_step(program, start, NO_LLVM_OPT))


@pytest.fixture(scope="module")
def programs():
    return {spec: build(tiny_config(spec)) for spec in MESHES}


@pytest.fixture(scope="module")
def steps(programs, single):
    """Each mesh's train step, compiled once for the module."""
    return {spec: compiled_step(p, single.start, NO_LLVM_OPT) for spec, p in programs.items()}


@pytest.fixture(scope="module", params=MESHES)
def sharded(request, programs, steps, single):
    program, step = programs[request.param], steps[request.param]
    return {"program": program, "run": run(step, program, single.start, batches())}


def test_matches_one_device(sharded, single):
    assert_parity(sharded["run"], single)


def test_rejects_zeroed_gradients_inside_every_block(programs, single):
    """The mutation the suite must catch: no gradient for any block's conv1/conv2 kernel
    (what a wrong gradient hidden behind a zero BatchNorm scale would look like)."""
    program = programs["data:8"]
    config = tiny_config("data:8")
    broken = step_with_tx(program, config, zero_grads(program.tx, r"stage\d_block\d/conv[12]/"))
    broken = compiled_step(program, single.start, NO_LLVM_OPT, step=broken)
    assert_rejected(run(broken, program, single.start, batches()), single, r"conv1.*kernel")


def test_rejects_a_permuted_shard(programs, single):
    """The head kernel's gradient split over ``model`` with its two shards swapped."""
    program = programs["data:4,model:2"]
    assert "model" in str(program.shardings.params["head"]["kernel"].spec)
    tx = roll_grads(program.tx, r"^head/kernel$", axis=1, shards=2)
    broken = step_with_tx(program, tiny_config("data:4,model:2"), tx)
    broken = compiled_step(program, single.start, NO_LLVM_OPT, step=broken)
    assert_rejected(run(broken, program, single.start, batches()), single, r"head.*kernel")


def _axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _expected_shard_shape(shape, spec: P, mesh):
    dims = list(shape)
    for d, entry in enumerate(spec):
        dims[d] //= math.prod(mesh.shape[a] for a in _axes(entry))
    return tuple(dims)


def test_shards_follow_rules(sharded):
    mesh, state = sharded["program"].mesh, sharded["run"].device_state
    flat_arrays = jax.tree.leaves(state)
    flat_shardings = jax.tree.leaves(sharded["program"].shardings)
    assert len(flat_arrays) == len(flat_shardings)
    for arr, want in zip(flat_arrays, flat_shardings):
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (arr.sharding, want)
        expected = _expected_shard_shape(arr.shape, want.spec, mesh)
        assert {s.data.shape for s in arr.addressable_shards} == {expected}
    # The rules the mesh calls for are really in force (not everything replicated).
    head = state.params["head"]["kernel"]
    conv = state.params["stage4_block0"]["conv2"]["kernel"]
    if mesh.shape["model"] > 1:
        assert "model" in _axes(head.sharding.spec[1])
        assert "model" in _axes(conv.sharding.spec[3])
    if mesh.shape["fsdp"] > 1:
        assert "fsdp" in _axes(conv.sharding.spec[3])
    if mesh.shape["data"] == 8:
        assert all(s.spec == P() or all(e is None for e in s.spec) for s in flat_shardings)


def _bytes_per_device(leaves, device):
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)


def test_fsdp_holds_an_eighth_per_device(programs, steps, single):
    program = programs["fsdp:8"]
    state = run(steps["fsdp:8"], program, single.start, batches(steps=1)).device_state
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
    raises=AssertionError,  # the wrong gradient, not any crash
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
