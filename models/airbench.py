"""A small fast CIFAR network in the spirit of airbench (Keller Jordan) and ResNet-9 (Page).

A fixed whitening layer first: a 2x2 convolution whose kernel is set from the training data
(``data_init``: the eigenvectors of the 2x2-patch covariance, scaled by 1/sqrt(eigenvalue),
and their negatives, so 2 x 4 x channels filters), then GELU and three groups of
``conv3x3 -> max-pool 2 -> BN -> GELU -> conv3x3 -> BN -> GELU`` of widths
``num_filters, 2 num_filters, 2 num_filters``, a global max-pool and the linear head on
features scaled by 1/9 (airbench's logit temperature). The whitening kernel is meant to stay
as the data set it: the config freezes it (``optim.frozen``), its bias trains.

Parameter paths (``whiten/kernel``, ``block2/conv1/kernel``, ``head/kernel``) and the logical
axes are the same contract as models/resnet.py's; ``return_features`` as there. The ResNet
options the model factory passes (``zero_init_last_bn``, ``small_stem``, ``pointwise_dot``)
have no meaning here and are accepted unused.
"""

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from .im2col import Im2colConv
from .resnet import CONV_AXES, conv_kernel_init, norm_factory

WHITEN_EPS = 5e-4  # added to each eigenvalue: directions of ~no variance are not blown up


def patches_2x2(x):
    """``(B, H, W, C)`` -> ``(B * (H-1) * (W-1), 4 * C)``, each row one 2x2 patch flattened in
    the kernel's ``(kh, kw, c)`` order."""
    b, h, w, c = x.shape
    views = [x[:, i : h - 1 + i, j : w - 1 + j, :] for i in (0, 1) for j in (0, 1)]
    return jnp.stack(views, axis=3).reshape(b * (h - 1) * (w - 1), 4 * c)


def whitening_kernel(x, eps: float = WHITEN_EPS):
    """The ``(2, 2, C, 8 C)`` kernel that whitens 2x2 patches of ``x`` (normalised images):
    ``V / sqrt(lambda + eps)`` for the eigen-decomposition ``V diag(lambda) V^T`` of the
    (uncentred) patch covariance, and its negative (after GELU both signs carry signal)."""
    p = patches_2x2(x.astype(jnp.float32))
    cov = p.T @ p / p.shape[0]
    lam, vecs = jnp.linalg.eigh(cov)  # ascending; columns are eigenvectors
    lam, vecs = lam[::-1], vecs[:, ::-1]  # strongest direction first
    scaled = vecs / jnp.sqrt(lam + eps)
    c = x.shape[-1]
    return jnp.concatenate([scaled, -scaled], axis=1).reshape(2, 2, c, 8 * c)


class AirbenchNet(nn.Module):
    """Logits of shape (batch, num_classes) in ``dtype``; see the module docstring."""

    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    bn_groups: int = 1
    bn_axis_name: Any = None
    bn_axis_index_groups: Any = None
    bn_group_sharding: Any = None
    im2col_grad: bool = False  # 3x3 kernel gradients as matrix products (models/im2col.py)
    # ResNet options (models/__init__.create_model passes every model the same ones)
    zero_init_last_bn: bool = True
    small_stem: bool = True
    pointwise_dot: bool = True
    # A pruned net's widths (hybridpar/tools/prune.py): each block's conv2 and conv1 outputs;
    # (): num_filters, 2 num_filters, 2 num_filters.
    stage_widths: Sequence[int] = ()
    block_widths: Sequence[int] = ()

    @nn.compact
    def __call__(self, x, train: bool = True, return_features: bool = False):
        conv = functools.partial(
            Im2colConv if self.im2col_grad else nn.Conv,
            kernel_size=(3, 3),
            padding=((1, 1), (1, 1)),
            use_bias=False,
            kernel_init=conv_kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        norm = norm_factory(self, train)
        x = jnp.asarray(x, self.dtype)
        x = nn.Conv(
            8 * x.shape[-1],
            (2, 2),
            padding="VALID",
            kernel_init=conv_kernel_init,  # until data_init sets it
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, CONV_AXES[-1:]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="whiten",
        )(x)
        x = nn.gelu(x, approximate=False)
        w = self.num_filters
        for i, width in enumerate((w, 2 * w, 2 * w), start=1):
            inner = self.block_widths[i - 1] if self.block_widths else width
            out = self.stage_widths[i - 1] if self.stage_widths else width
            x = conv(inner, name=f"block{i}_conv1")(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.gelu(norm(name=f"block{i}_bn1")(x), approximate=False)
            x = conv(out, name=f"block{i}_conv2")(x)
            x = nn.gelu(norm(name=f"block{i}_bn2")(x), approximate=False)
        x = jnp.max(x, axis=(1, 2)) / 9.0  # global max-pool; the scale sets the logits' range
        if return_features and not self.is_initializing():  # init must create the head
            return x
        return nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "classes")
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("classes",)),
            name="head",
        )(x)

    def data_init(self, params, images):
        """``params`` with the whitening kernel set from ``images`` (normalised, global)."""
        kernel = params["whiten"]["kernel"]
        new = whitening_kernel(images).astype(kernel.dtype)
        return {**params, "whiten": {**params["whiten"], "kernel": new}}
