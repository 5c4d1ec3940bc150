"""ResNet v1.5 (stride in the 3x3 conv), NHWC, as in torchvision and the Flax ImageNet example.

Submodule names and logical axis names are a contract with the partitioning rules:
parameter paths look like ``params/stage3_block1/conv2/kernel`` and every parameter is
annotated with logical axes, so the model itself stays free of any parallelism.

``model.apply(..., return_features=True)`` stops before the classifier and returns the pooled
features ``(batch, embed)``: steps that place the head themselves (class-sharded softmax,
``hybridpar/parallel/sharded_head.py``) apply ``params["head"]`` to them. The head's parameters are
still created by ``init`` (which runs the whole model).
"""

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from .batchnorm import BatchNorm
from .im2col import Im2colConv

CONV_AXES = ("conv_h", "conv_w", "conv_in", "conv_out")
NORM_AXES = ("norm",)

# He init on fan_out, as torchvision does for ResNet convs.
conv_kernel_init = nn.with_logical_partitioning(
    nn.initializers.variance_scaling(2.0, "fan_out", "normal"), CONV_AXES
)
norm_ones = nn.with_logical_partitioning(nn.initializers.ones, NORM_AXES)
norm_zeros = nn.with_logical_partitioning(nn.initializers.zeros, NORM_AXES)

ModuleDef = Callable[..., nn.Module]


def norm_factory(model, train: bool):
    """The BatchNorm of ``model`` (a module with the ``bn_*``, ``dtype`` and ``param_dtype``
    fields of ``ResNet``). Defaults (one group, no axis_name): under jax.jit with a sharded
    batch the statistics are global, as on one device."""
    return functools.partial(
        BatchNorm,
        use_running_average=not train,
        momentum=model.bn_momentum,
        epsilon=model.bn_epsilon,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        scale_init=norm_ones,
        bias_init=norm_zeros,
        num_groups=model.bn_groups,
        axis_name=model.bn_axis_name,
        axis_index_groups=model.bn_axis_index_groups,
        group_sharding=model.bn_group_sharding,
    )


class PointwiseConv(nn.Module):
    """A 1x1 convolution (any stride) computed as a matrix product.

    Same parameter as ``nn.Conv`` (``kernel`` of shape ``(1, 1, in, out)``, so paths, rules
    and checkpoints do not change), but run as ``(B*H*W, in) @ (in, out)`` on the strided
    input: XLA's CPU backend ran 1x1 convolutions (forward and backward) 2-5x slower than
    the same product as a dot, and on GPU/TPU both lower to the same GEMM.
    """

    features: int
    strides: tuple[int, int] = (1, 1)
    kernel_init: Callable = nn.initializers.lecun_normal()
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        cin = x.shape[-1]
        kernel = self.param(
            "kernel", self.kernel_init, (1, 1, cin, self.features), self.param_dtype
        )
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        sh, sw = self.strides
        if (sh, sw) != (1, 1):  # a strided 1x1 conv with VALID padding reads every s-th pixel
            x = x[:, ::sh, ::sw, :]
        y = jnp.dot(x.reshape(-1, cin), kernel.reshape(cin, self.features))
        return y.reshape(x.shape[:-1] + (self.features,))


def _conv_factory(pointwise_dot: bool, im2col_grad: bool, **defaults) -> ModuleDef:
    """``conv(features, kernel_size, strides=(1, 1), **kw)``: ``nn.Conv``, or for 1x1
    kernels with ``pointwise_dot`` a ``PointwiseConv`` with the same parameter, or with
    ``im2col_grad`` an ``Im2colConv`` (models/im2col.py), again the same parameter."""

    def conv(features, kernel_size, strides=(1, 1), **kw):
        kw = {**defaults, **kw}
        if pointwise_dot and tuple(kernel_size) == (1, 1) and kw.get("padding") == "VALID":
            return PointwiseConv(
                features,
                tuple(strides),
                kernel_init=kw["kernel_init"],
                dtype=kw["dtype"],
                param_dtype=kw["param_dtype"],
                name=kw.get("name"),
            )
        return (Im2colConv if im2col_grad else nn.Conv)(features, kernel_size, strides, **kw)

    return conv


def _pad(kernel: int):
    # Symmetric padding like torchvision; 'SAME' would pad (0, 1) for stride 2.
    p = (kernel - 1) // 2
    return ((p, p), (p, p))


class _Block(nn.Module):
    """What the two ResNet blocks share: their fields and their ending."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: int = 1
    zero_init_last_bn: bool = True
    width_factor: int = 1
    # Pruned widths (hybridpar/tools/prune.py); 0: the defaults from ``filters``.
    inner_width: int = 0  # the convs inside the block (before the last)
    out_width: int = 0  # the block's output, the residual stream

    def last_norm(self, name: str) -> nn.Module:
        # A zero gamma makes the block start as identity, which helps early training.
        return self.norm(name=name, scale_init=norm_zeros if self.zero_init_last_bn else norm_ones)


def _add_shortcut(block: _Block, residual, y):
    """``relu(shortcut(residual) + y)``; the shortcut projects (1x1 conv + BN, strided) when
    the shapes differ. A function, not a method, so its submodules belong to ``block``'s
    compact ``__call__``."""
    if residual.shape != y.shape:
        s = block.strides
        residual = block.conv(y.shape[-1], (1, 1), (s, s), name="proj_conv")(residual)
        residual = block.norm(name="proj_bn")(residual)
    return nn.relu(residual + y)


class ResNetBlock(_Block):
    """Basic block: two 3x3 convs."""

    @nn.compact
    def __call__(self, x):
        if self.width_factor != 1:  # as torchvision's BasicBlock
            raise ValueError("basic blocks have no bottleneck to widen; use width_factor=1")
        s = self.strides
        inner, out = self.inner_width or self.filters, self.out_width or self.filters
        y = self.conv(inner, (3, 3), (s, s), padding=_pad(3), name="conv1")(x)
        y = nn.relu(self.norm(name="bn1")(y))
        y = self.conv(out, (3, 3), padding=_pad(3), name="conv2")(y)
        return _add_shortcut(self, x, self.last_norm("bn2")(y))


class BottleneckResNetBlock(_Block):
    """Bottleneck block: 1x1, 3x3 (strided, v1.5), 1x1 with 4x expansion.

    ``width_factor`` widens the inner 1x1 and 3x3 convs (not the block's output), as
    torchvision's ``width_per_group=64 * width_factor``: 2 gives Wide-ResNet-50-2.
    """

    @nn.compact
    def __call__(self, x):
        s, width = self.strides, self.inner_width or self.filters * self.width_factor
        y = self.conv(width, (1, 1), name="conv1")(x)
        y = nn.relu(self.norm(name="bn1")(y))
        y = self.conv(width, (3, 3), (s, s), padding=_pad(3), name="conv2")(y)
        y = nn.relu(self.norm(name="bn2")(y))
        y = self.conv(self.out_width or self.filters * 4, (1, 1), name="conv3")(y)
        return _add_shortcut(self, x, self.last_norm("bn3")(y))


class ResNet(nn.Module):
    """ResNet returning logits of shape (batch, num_classes) in ``dtype``."""

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_momentum: float = 0.9
    bn_epsilon: float = 1e-5
    zero_init_last_bn: bool = True
    small_stem: bool = False
    width_factor: int = 1  # bottleneck width multiplier (2: Wide-ResNet-50-2)
    pointwise_dot: bool = True  # 1x1 convolutions as matrix products (see PointwiseConv)
    im2col_grad: bool = False  # kernel gradients as matrix products (models/im2col.py)
    # BatchNorm statistics (see models/batchnorm.py and model.bn_sync): under jax.jit,
    # bn_groups > 1 normalises contiguous groups of the batch separately (bn_group_sharding
    # optionally pins the group axis to the data axes); inside jax.shard_map, bn_axis_name
    # (and bn_axis_index_groups) average the statistics over devices.
    bn_groups: int = 1
    bn_axis_name: Any = None
    bn_axis_index_groups: Any = None
    bn_group_sharding: Any = None
    # Narrower widths, as a pruned model has them (hybridpar/tools/prune.py; model.stem_width etc.
    # in hybridpar/config/schema.py): the stem's output, each stage's output (the residual stream)
    # and each block's inner convs, in block order. 0 / (): the defaults from num_filters.
    stem_width: int = 0
    stage_widths: Sequence[int] = ()
    block_widths: Sequence[int] = ()

    @nn.compact
    def __call__(self, x, train: bool = True, return_features: bool = False):
        conv = _conv_factory(
            self.pointwise_dot,
            self.im2col_grad,
            use_bias=False,
            padding="VALID",
            kernel_init=conv_kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        norm = norm_factory(self, train)

        x = jnp.asarray(x, self.dtype)
        stem = self.stem_width or self.num_filters
        if self.small_stem:
            # Small images (e.g. 32x32) would lose too much resolution to a strided stem.
            x = conv(stem, (3, 3), padding=_pad(3), name="stem_conv")(x)
            x = nn.relu(norm(name="stem_bn")(x))
        else:
            x = conv(stem, (7, 7), (2, 2), padding=_pad(7), name="stem_conv")(x)
            x = nn.relu(norm(name="stem_bn")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=_pad(3))

        inner = iter(self.block_widths or [0] * sum(self.stage_sizes))
        for i, num_blocks in enumerate(self.stage_sizes, start=1):
            for j in range(num_blocks):
                strides = 2 if i > 1 and j == 0 else 1
                x = self.block_cls(
                    filters=self.num_filters * 2 ** (i - 1),
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    zero_init_last_bn=self.zero_init_last_bn,
                    width_factor=self.width_factor,
                    inner_width=next(inner),
                    out_width=self.stage_widths[i - 1] if self.stage_widths else 0,
                    name=f"stage{i}_block{j}",
                )(x)

        x = jnp.mean(x, axis=(1, 2))
        if return_features and not self.is_initializing():  # init must create the head
            return x
        # Small-std normal head init as in Goyal et al.
        x = nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.01), ("embed", "classes")
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("classes",)),
            name="head",
        )(x)
        return x


ResNet18 = functools.partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=ResNetBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)
ResNet101 = functools.partial(ResNet, stage_sizes=[3, 4, 23, 3], block_cls=BottleneckResNetBlock)
ResNet152 = functools.partial(ResNet, stage_sizes=[3, 8, 36, 3], block_cls=BottleneckResNetBlock)
# torchvision's wide_resnet50_2: ResNet-50 with the bottleneck 1x1/3x3 convs twice as wide.
WideResNet50_2 = functools.partial(ResNet50, width_factor=2)
# For tests: stage widths 8, 16, 32, 64, so every channel count divides by 8.
ResNetTiny = functools.partial(
    ResNet, stage_sizes=[1, 1, 1, 1], block_cls=ResNetBlock, num_filters=8, small_stem=True
)
