"""models/im2col.py: the convolution whose kernel gradient is an im2col matrix product gives
nn.Conv's outputs and gradients (input and kernel) for every padding and stride the models
use, takes that path only where it pays, and ``model.conv_grad`` picks it per backend."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config, validate
from hybridpar.models import im2col
from hybridpar.models.airbench import AirbenchNet
from hybridpar.models.im2col import MIN_FLOPS, MIN_POSITIONS, Im2colConv, use_im2col


def _grads(module, x):
    params = module.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(1), p.shape), params)
    # A loss that weighs each output differently, so a transposed or shifted gradient shows.
    weights = jax.random.normal(jax.random.key(2), module.apply(params, x).shape)

    def loss(params, x):
        return jnp.sum(module.apply(params, x) * weights)

    return jax.jit(module.apply)(params, x), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


@pytest.mark.parametrize(
    "kernel, strides, padding, size",
    [
        ((3, 3), (1, 1), ((1, 1), (1, 1)), 13),  # airbench's and ResNet's 3x3
        ((3, 3), (2, 2), ((1, 1), (1, 1)), 21),  # ResNet's strided 3x3
        ((7, 7), (2, 2), ((3, 3), (3, 3)), 23),  # ResNet's stem
        ((3, 3), (1, 1), "SAME", 11),
        ((2, 2), (1, 1), "VALID", 12),
        ((3, 2), (2, 1), ((0, 2), (1, 0)), 24),  # asymmetric everything
    ],
)
def test_outputs_and_gradients_equal_nn_conv(kernel, strides, padding, size):
    x = jax.random.normal(jax.random.key(3), (3, size, size + 1, 5))
    kw = dict(features=6, kernel_size=kernel, strides=strides, padding=padding, use_bias=True)
    want_y, want = _grads(nn.Conv(**kw), x)
    got_y, got = _grads(Im2colConv(**kw, min_flops=0), x)
    assert got_y.shape[1] * got_y.shape[2] >= MIN_POSITIONS  # the product form ran
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # Negative control: the same check sees a kernel gradient off by one tap.
    bad = jnp.roll(got[0]["params"]["kernel"], 1, axis=0)
    assert not np.allclose(bad, want[0]["params"]["kernel"], rtol=1e-4, atol=1e-4)


def _kernel_grad_ops(module, x) -> str:
    """The gradient's jaxpr, traced on shapes only (``x`` may be a ShapeDtypeStruct)."""
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    grad = jax.grad(lambda p, x: module.apply(p, x).sum())
    return str(jax.make_jaxpr(grad)(params, x))


def test_product_form_only_where_it_pays():
    conv = Im2colConv(features=4, kernel_size=(3, 3), padding="SAME", min_flops=0)
    side = int(np.ceil(np.sqrt(MIN_POSITIONS)))
    assert "dot_general" in _kernel_grad_ops(conv, jnp.ones((1, side, side, 2)))
    assert "dot_general" not in _kernel_grad_ops(conv, jnp.ones((1, side - 2, side - 2, 2)))
    # A gradient below MIN_FLOPS stays XLA's; one above it takes the product form.
    small = Im2colConv(features=4, kernel_size=(3, 3), padding="SAME")
    assert "dot_general" not in _kernel_grad_ops(small, jnp.ones((1, side, side, 2)))
    batch = int(MIN_FLOPS // (2 * side * side * 3 * 3 * 2 * 4)) + 1
    shape = jax.ShapeDtypeStruct((batch, side, side, 2), jnp.float32)  # traced, never run
    assert "dot_general" in _kernel_grad_ops(small, shape)


def test_airbench_gradients_equal_either_way(monkeypatch):
    monkeypatch.setattr(im2col, "MIN_FLOPS", 0)  # a test-sized model's gradients are small
    x = jax.random.normal(jax.random.key(4), (2, 16, 16, 3))
    a, b = AirbenchNet(10, num_filters=8), AirbenchNet(10, num_filters=8, im2col_grad=True)
    v = a.init(jax.random.key(0), x)

    def loss(model):
        def f(p):
            out, _ = model.apply({**v, "params": p}, x, mutable=["batch_stats"])
            return jnp.sum(out * jnp.arange(10.0))

        return f

    assert "dot_general" in str(jax.make_jaxpr(jax.grad(loss(b)))(v["params"]))
    want, got = (jax.jit(jax.grad(loss(m)))(v["params"]) for m in (a, b))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got, want)


def test_conv_grad_choice():
    assert use_im2col("auto", "cpu") and not use_im2col("auto", "gpu")
    assert use_im2col("im2col", "tpu") and not use_im2col("xla", "cpu")
    c = base_config()
    c.model.conv_grad = "gemm"
    with pytest.raises(ConfigError, match="model.conv_grad"):
        validate(c)
