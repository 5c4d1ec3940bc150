"""Tests for hybridpar.models: parameter counts, dtypes, names and BatchNorm behaviour."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridpar.models import (
    MODELS,
    BottleneckResNetBlock,
    ResNet,
    ResNet18,
    ResNet50,
    ResNetTiny,
    WideResNet50_2,
    create_model,
)

# Threefry init graphs take several times longer to compile on a CPU than the RBG generator.
RNG = jax.random.key(0, impl="unsafe_rbg")
TINY_X = jnp.ones((2, 32, 32, 3), jnp.float32)


def _abstract_init(model, shape):
    # eval_shape traces init without allocating any parameters.
    return jax.eval_shape(lambda: model.init(RNG, jnp.zeros(shape, jnp.float32), train=False))


def _init(model):
    return jax.jit(lambda x: model.init(RNG, x, train=False))(TINY_X)


def _num_params(variables):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(variables["params"])))


@pytest.fixture(scope="module")
def tiny_vars():
    return _init(ResNetTiny(num_classes=10))


@pytest.mark.parametrize(
    "ctor,expected",
    [(ResNet18, 11_689_512), (ResNet50, 25_557_032), (WideResNet50_2, 68_883_240)],
)
def test_param_count_matches_torchvision(ctor, expected):
    variables = _abstract_init(ctor(num_classes=1000), (1, 224, 224, 3))
    assert _num_params(variables) == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiny_output_shape_and_dtypes(dtype, tiny_vars):
    model = ResNetTiny(num_classes=10, dtype=dtype)
    variables = tiny_vars if dtype == jnp.float32 else _init(model)
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, TINY_X)
    assert logits.shape == (2, 10)
    assert logits.dtype == dtype
    for leaf in jax.tree.leaves(nn.unbox(variables["params"])):
        assert leaf.dtype == jnp.float32
    for leaf in jax.tree.leaves(variables["batch_stats"]):
        assert leaf.dtype == jnp.float32


def test_logical_partition_specs(tiny_vars):
    specs = nn.get_partition_spec(tiny_vars)["params"]
    assert tuple(specs["stage3_block0"]["conv2"]["kernel"]) == (
        "conv_h",
        "conv_w",
        "conv_in",
        "conv_out",
    )
    assert tuple(specs["stem_conv"]["kernel"]) == ("conv_h", "conv_w", "conv_in", "conv_out")
    assert tuple(specs["stage1_block0"]["bn1"]["scale"]) == ("norm",)
    assert tuple(specs["head"]["kernel"]) == ("embed", "classes")
    assert tuple(specs["head"]["bias"]) == ("classes",)


@pytest.mark.parametrize("zero_init", [True, False])
def test_zero_init_last_bn(zero_init, tiny_vars):
    variables = (
        tiny_vars if zero_init else _init(ResNetTiny(num_classes=10, zero_init_last_bn=False))
    )
    params = nn.unbox(variables["params"])
    blocks = [k for k in params if k.startswith("stage")]
    assert len(blocks) == 4
    expected = 0.0 if zero_init else 1.0
    for name in blocks:
        np.testing.assert_array_equal(params[name]["bn2"]["scale"], expected)
    # Only the residual branch's last BN is zeroed.
    np.testing.assert_array_equal(params["stage2_block0"]["proj_bn"]["scale"], 1.0)


def test_train_updates_batch_stats_eval_does_not_need_mutable(tiny_vars):
    model = ResNetTiny(num_classes=10)
    x = jax.random.normal(RNG, TINY_X.shape)
    _, updates = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(
        tiny_vars, x
    )
    old = tiny_vars["batch_stats"]["stem_bn"]["mean"]
    new = updates["batch_stats"]["stem_bn"]["mean"]
    assert not np.allclose(old, new)
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(tiny_vars, x)
    assert logits.shape == (2, 10)


def test_submodule_names(tiny_vars):
    params, stats = tiny_vars["params"], tiny_vars["batch_stats"]
    assert {"stem_conv", "stem_bn", "head", "stage1_block0", "stage4_block0"} <= set(params)
    assert set(params["stage1_block0"]) == {"conv1", "bn1", "conv2", "bn2"}
    assert {"proj_conv", "proj_bn"} <= set(params["stage2_block0"])
    assert set(stats["stage1_block0"]["bn1"]) == {"mean", "var"}

    bottleneck = ResNet(
        stage_sizes=[1, 1],
        block_cls=BottleneckResNetBlock,
        num_classes=3,
        num_filters=4,
        small_stem=True,
    )
    bparams = _abstract_init(bottleneck, (1, 8, 8, 3))["params"]
    assert {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "proj_conv", "proj_bn"} == set(
        bparams["stage1_block0"]
    )


def test_registry():
    assert set(MODELS) == {
        "airbench",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnet_tiny",
        "wide_resnet50_2",
    }
    assert isinstance(create_model("resnet_tiny", num_classes=10), ResNet)
    with pytest.raises(ValueError, match="resnet50"):
        create_model("resnet51")


def test_wide_bottleneck_doubles_the_inner_convs_only():
    params = _abstract_init(WideResNet50_2(num_classes=10), (1, 64, 64, 3))["params"]
    block = nn.unbox(params["stage4_block0"])
    assert block["conv1"]["kernel"].shape == (1, 1, 1024, 1024)  # 512 * 2
    assert block["conv2"]["kernel"].shape == (3, 3, 1024, 1024)
    assert block["conv3"]["kernel"].shape == (1, 1, 1024, 2048)  # output as ResNet-50's
    with pytest.raises(ValueError, match="basic blocks"):
        _abstract_init(ResNetTiny(num_classes=10, width_factor=2), (1, 8, 8, 3))


def test_return_features_stops_before_the_head(tiny_vars):
    model = ResNetTiny(num_classes=10)
    x = jax.random.normal(RNG, TINY_X.shape)
    features = model.apply(tiny_vars, x, train=False, return_features=True)
    assert features.shape == (2, 64)
    head = nn.unbox(tiny_vars["params"]["head"])
    np.testing.assert_allclose(
        features @ head["kernel"] + head["bias"],
        model.apply(tiny_vars, x, train=False),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pointwise_dot_equals_the_1x1_convolution(dtype):
    # Same parameters either way; strided projections included (stage 2-4 first blocks).
    # The last BatchNorm of each block starts at 1, not 0 (zero_init_last_bn would stop
    # every gradient inside the blocks, and zeros would be compared with zeros), and the
    # BatchNorm scales are random, so every gradient is non-zero and its own.
    kw = {"stage_sizes": [1, 1, 1, 1], "num_classes": 10, "num_filters": 8, "dtype": dtype,
          "zero_init_last_bn": False}  # fmt: skip
    dot = ResNet(block_cls=BottleneckResNetBlock, pointwise_dot=True, **kw)
    conv = ResNet(block_cls=BottleneckResNetBlock, pointwise_dot=False, **kw)
    x = jax.random.normal(RNG, (2, 32, 32, 3))
    # jitted at XLA's optimisation level 0, as state.init_sharded does on CPU: eager, or at
    # the default level, this init is several times slower (the random-number hashing).
    init = jax.jit(lambda r: dot.init(r, x, train=False)).lower(RNG)
    variables = init.compile(compiler_options={"xla_backend_optimization_level": 0})(RNG)
    abstract = jax.eval_shape(lambda r: conv.init(r, x, train=False), RNG)
    assert jax.tree.structure(variables) == jax.tree.structure(abstract)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: (
            jnp.asarray(rng.uniform(0.5, 1.5, v.shape), v.dtype)
            if jax.tree_util.keystr(p).endswith("['scale']")
            else v
        ),
        variables["params"],
    )
    variables = {**variables, "params": params}

    def loss(params, model):
        # BatchNorm with its running statistics: an affine map, so the comparison sees the
        # convolutions' own rounding. In train mode the batch statistics of 2 images at
        # 1x1 px (stage 4) divide by a variance of 2 values and amplify it ~100x.
        out = model.apply({**variables, "params": params}, x, train=False)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    # float32: the two orders of the same sums differ by rounding, ~1e-6 of an array's
    # largest gradient (bound 1e-4). bfloat16 (8 bits of mantissa, 2**-8 = 0.4%) is rounded
    # after every layer, where the two paths round at different points: errors of a few
    # rounding steps compound over the 13 layers, so the bound is on the whole array's
    # relative error (its norm), not on each element: measured 0.6-5.7% (the largest for
    # the BatchNorm scales of stage 1, sums over the most elements), bound 10%; a wrong
    # gradient (a transposed or misplaced kernel) is off by ~100%.
    rel = 1e-4 if dtype == jnp.float32 else 1e-1
    # jitted: one compilation per model rather than one per op
    (a, ga), (b, gb) = (
        jax.jit(jax.value_and_grad(lambda p, m=m: loss(p, m)))(variables["params"])
        for m in (dot, conv)
    )
    np.testing.assert_allclose(a, b, rtol=rel)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ga)]
    for path, u, v in zip(paths, jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
        assert np.abs(v).max() > 0, f"{path}: zero gradient, nothing compared"
        if dtype == jnp.float32:
            err = np.abs(u - v).max() / np.abs(v).max()
        else:
            err = np.linalg.norm(u - v) / np.linalg.norm(v)
        assert err <= rel, (path, err)
