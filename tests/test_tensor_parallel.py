"""Tensor parallelism of wide bottlenecks (partitioning preset ``tensor``) equals one device.

A tiny wide bottleneck ResNet (width_factor 2, as Wide-ResNet-50-2) trains two steps with
the ``tensor`` preset (stage 3-4 conv1 split over ``model`` on output channels, conv2 on
input channels), alone and stacked with FSDP, and must match the same steps on one device.
The strided stage-3/4 conv2 after a model-split activation is the kind of layout where
XLA's SPMD partitioner has computed wrong gradients (tests/test_parity.py pins one such
bug), so this is checked on every mesh. Tolerance as in tests/test_parity.py.
"""

import jax
import numpy as np
import pytest
from test_parity import SIZE, _batches, tiny_tx

from hybridpar import make_mesh, shard_batch
from hybridpar.models import BottleneckResNetBlock, ResNet
from hybridpar.partitioning import FSDP, TENSOR, preset_rules
from hybridpar.precision import LossScale, Policy
from hybridpar.state import create_sharded_state, make_init_fn
from hybridpar.steps import jit_train_step, make_train_step

TOL = dict(rtol=1e-4, atol=1e-5)
MODEL = ResNet(
    stage_sizes=[1, 1, 1, 1],
    block_cls=BottleneckResNetBlock,
    num_filters=8,
    small_stem=True,
    width_factor=2,
    num_classes=16,
)


def _train(spec, rules, devices=None):
    mesh = make_mesh(spec, devices)
    tx = tiny_tx()
    init = make_init_fn(MODEL, tx, (1, SIZE, SIZE, 3), LossScale.create(dynamic=False))
    state, shardings, _ = create_sharded_state(init, rules, mesh, jax.random.key(0))
    step = jit_train_step(
        make_train_step(MODEL, tx, Policy(), lambda s: 0.1, mean=(127.5,) * 3, std=(64.0,) * 3),
        shardings,
        mesh,
        {"image": 4, "label": 1},
    )
    losses = []
    for batch in _batches(steps=2):
        state, metrics = step(state, shard_batch(batch, mesh))
        losses.append(metrics["loss"])
    return state, np.asarray(jax.device_get(losses))


@pytest.fixture(scope="module")
def single():
    return _train("data:1", preset_rules("data", None), jax.devices()[:1])


@pytest.mark.parametrize(
    "spec,rules", [("data:2,model:4", TENSOR), ("data:2,fsdp:2,model:2", TENSOR + FSDP)]
)
def test_tensor_preset_matches_one_device(spec, rules, single):
    state, losses = _train(spec, rules)
    want_state, want_losses = single
    np.testing.assert_allclose(losses, want_losses, **TOL)
    got = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    for (path, g), w in zip(got, jax.tree.leaves(jax.device_get(want_state.params)), strict=True):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))
    # Split as the preset says: conv1 on output channels, conv2 on input channels.
    block = state.params["stage4_block0"]
    model = make_mesh(spec).shape["model"]
    assert block["conv1"]["kernel"].addressable_shards[0].data.shape[3] <= 2 * 64 // model
    assert block["conv2"]["kernel"].addressable_shards[0].data.shape[2] <= 2 * 64 // model
    assert "model" not in str(block["conv3"]["kernel"].sharding.spec)  # replicated over model
