"""A convolution whose kernel gradient is one matrix product over im2col patches.

XLA's CPU backend computes a convolution's kernel gradient as another convolution, with the
batch as the contracted feature dimension and the whole image as the "kernel". On 2 cores
that ran 3-9x slower than the forward convolution for the images CIFAR networks see (a 3x3
conv, batch 256, 31x31 px, 24 -> 64 channels: forward 0.20 s, kernel gradient 3.3 s; as
one ``(kh*kw*in, B*H*W) @ (B*H*W, out)`` product 0.43 s). No XLA flag changes that (tried:
oneDNN, XNNPACK, the old runtime; see openxla/xla#34273 for the same on other shapes).

``Im2colConv`` keeps ``nn.Conv``'s parameter (``kernel`` of shape ``(kh, kw, in, out)``, so
paths, rules and checkpoints do not change) and forward pass; only the backward pass of
the kernel differs, and only where it pays: below ``MIN_POSITIONS`` output pixels XLA's own
gradient was faster (7x7: 0.09 against 0.14 s), and below ``MIN_FLOPS`` the gradient is too
small to matter while the extra ops still cost compile time (the test suite's tiny models
ran 15-40% slower with the product form everywhere). On GPU/TPU the patches would cost 9x
the activation memory for no gain, so ``model.conv_grad="auto"`` turns it on only on CPU.
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

MIN_POSITIONS = 100  # output pixels per image (10x10) from which the product form runs
# ...and the kernel gradient's FLOPs per step (2 x B x Ho x Wo x kh x kw x in x out) from
# which it runs: cifar10_fast:cpu's smallest such gradient is 4.8 GFLOP, a test model's 0.02.
MIN_FLOPS = 1e9
_DIMS = ("NHWC", "HWIO", "NHWC")


def use_im2col(conv_grad: str, backend: str | None = None) -> bool:
    """Whether ``model.conv_grad`` ("auto", "im2col" or "xla") means the im2col form on
    ``backend`` (default: JAX's default backend)."""
    if conv_grad == "auto":
        return (backend or jax.default_backend()) == "cpu"
    return conv_grad == "im2col"


def _forward(x, kernel, strides, padding):
    return jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=_DIMS)


def patches(x, kernel_shape, strides, padding, out_hw):
    """``(B, Ho, Wo, kh*kw*C)``: for each output pixel, the input window it reads, in the
    kernel's ``(kh, kw, c)`` order."""
    kh, kw = kernel_shape
    sh, sw = strides
    ho, wo = out_hw
    xp = jnp.pad(x, ((0, 0), tuple(padding[0]), tuple(padding[1]), (0, 0)))
    views = [
        xp[:, i : i + sh * (ho - 1) + 1 : sh, j : j + sw * (wo - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    return jnp.concatenate(views, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv2d(x, kernel, strides, padding):
    """``lax.conv_general_dilated`` (NHWC, HWIO, explicit ``((lo, hi), (lo, hi))`` padding)
    with the kernel gradient as an im2col matrix product."""
    return _forward(x, kernel, strides, padding)


def _conv2d_fwd(x, kernel, strides, padding):
    return _forward(x, kernel, strides, padding), (x, kernel)


def _conv2d_bwd(strides, padding, res, g):
    x, kernel = res
    # The input gradient as XLA computes it: a forward-like convolution, fast on CPU too.
    _, vjp_x = jax.vjp(lambda x_: _forward(x_, kernel, strides, padding), x)
    (dx,) = vjp_x(g)
    kh, kw, cin, cout = kernel.shape
    p = patches(x, (kh, kw), strides, padding, g.shape[1:3])
    dk = p.reshape(-1, kh * kw * cin).T @ g.reshape(-1, cout).astype(p.dtype)
    return dx, dk.reshape(kernel.shape).astype(kernel.dtype)


conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


def _explicit_padding(padding, kernel_shape, strides, in_hw):
    """``nn.Conv``'s padding argument as ``((lo, hi), (lo, hi))``."""
    if isinstance(padding, str):
        return tuple(jax.lax.padtype_to_pads(in_hw, kernel_shape, strides, padding.upper()))
    return tuple(tuple(p) for p in padding)


class Im2colConv(nn.Module):
    """``nn.Conv`` (2-D, NHWC, no dilation or groups) with the im2col kernel gradient where
    the output has at least ``MIN_POSITIONS`` pixels and the gradient at least
    ``min_flops`` (None: ``MIN_FLOPS``); see the module docstring."""

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: Any = "SAME"
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros
    dtype: Any = None
    param_dtype: Any = jnp.float32
    min_flops: float | None = None

    @nn.compact
    def __call__(self, x):
        kernel_shape = tuple(self.kernel_size)
        strides = tuple(self.strides)
        kernel = self.param(
            "kernel",
            self.kernel_init,
            kernel_shape + (x.shape[-1], self.features),
            self.param_dtype,
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        padding = _explicit_padding(self.padding, kernel_shape, strides, x.shape[1:3])
        out_hw = [
            (n + lo + hi - k) // s + 1
            for n, (lo, hi), k, s in zip(x.shape[1:3], padding, kernel_shape, strides)
        ]
        flops = 2 * x.shape[0] * out_hw[0] * out_hw[1] * kernel.size
        min_flops = MIN_FLOPS if self.min_flops is None else self.min_flops
        if out_hw[0] * out_hw[1] >= MIN_POSITIONS and flops >= min_flops:
            y = conv2d(x, kernel, strides, padding)
        else:
            y = _forward(x, kernel, strides, padding)
        if bias is not None:
            y = y + bias
        return y
