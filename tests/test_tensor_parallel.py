"""Tensor parallelism of wide bottlenecks (partitioning preset ``tensor``) equals one device.

A tiny wide bottleneck ResNet (width_factor 2, as Wide-ResNet-50-2) trains two steps with
the ``tensor`` preset (stage 3-4 conv1 split over ``model`` on output channels, conv2 on
input channels), alone and stacked with FSDP, from random non-trivial initial values, and
must match the same steps on one device in every array (``helpers.assert_parity``). The
strided stage-3/4 conv2 after a model-split activation is the kind of layout where XLA's
SPMD partitioner has computed wrong gradients (tests/test_parity.py pins one such bug), so
this is checked on every mesh; and the check must reject the step with the gradients of the
tensor-split kernels zeroed.
"""

import jax
import pytest
from helpers import (
    assert_parity,
    assert_rejected,
    batches,
    hand_built,
    random_state,
    reference,
    run,
    zero_grads,
)

from hybridpar import make_mesh
from hybridpar.models import BottleneckResNetBlock, ResNet
from hybridpar.parallel.partitioning import FSDP, TENSOR, preset_rules

STEPS = 2
MODEL = ResNet(
    stage_sizes=[1, 1, 1, 1],
    block_cls=BottleneckResNetBlock,
    num_filters=8,
    small_stem=True,
    width_factor=2,
    num_classes=16,
)
# The kernels the tensor preset splits over `model`.
SPLIT = r"stage[34]_block0/conv[12]/kernel"


@pytest.fixture(scope="module")
def single():
    program = hand_built(MODEL, make_mesh("data:1", jax.devices()[:1]), preset_rules("data", None))
    return reference(program, random_state(program), batches(steps=STEPS, classes=16))


@pytest.mark.parametrize(
    "spec,rules", [("data:2,model:4", TENSOR), ("data:2,fsdp:2,model:2", TENSOR + FSDP)]
)
def test_tensor_preset_matches_one_device(spec, rules, single):
    program = hand_built(MODEL, make_mesh(spec), rules)
    got = run(program.train_jit, program, single.start, batches(steps=STEPS, classes=16))
    assert_parity(got, single)
    # Split as the preset says: conv1 on output channels, conv2 on input channels.
    block = got.device_state.params["stage4_block0"]
    model = make_mesh(spec).shape["model"]
    assert block["conv1"]["kernel"].addressable_shards[0].data.shape[3] <= 2 * 64 // model
    assert block["conv2"]["kernel"].addressable_shards[0].data.shape[2] <= 2 * 64 // model
    assert "model" not in str(block["conv3"]["kernel"].sharding.spec)  # replicated over model


def test_rejects_zeroed_gradients_of_the_split_kernels(single):
    """Negative control: the same check fails the step that loses the split kernels'
    gradients (a wrong partitioned gradient looks like that to the parameters)."""
    mesh = make_mesh("data:2,model:4")
    tx = zero_grads(hand_built(MODEL, mesh, TENSOR).tx, SPLIT)
    program = hand_built(MODEL, mesh, TENSOR, tx=tx)
    got = run(program.train_jit, program, single.start, batches(steps=STEPS, classes=16))
    assert_rejected(got, single, r"stage[34]_block0.*conv[12].*kernel")
