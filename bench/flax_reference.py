"""A plain Flax ResNet-50 train step, written the way the Flax ImageNet example writes it.

This is the "what a user would otherwise write" side of ``bench/resnet50_step.py``: a linen
ResNet built with ``nn.Conv`` and ``nn.BatchNorm``, a ``flax.training.train_state.TrainState``,
``optax.sgd`` with Nesterov momentum, weight decay as an L2 penalty in the loss, and one
``jax.jit`` of the step (no shardings, no donation). It imports nothing from hybridpar, so
``tests/test_bench_fairness.py`` can check it computes what hybridpar's step computes.

Where it follows hybridpar rather than the example, so that both do the same arithmetic
(same FLOPs, same loss, same update; the test checks it):

* padding: symmetric, as torchvision and ``models/resnet.py`` pad (the example's 'SAME'
  pads (0, 1) for the strided 3x3 convolutions and the max pool; same cost, shifted grid);
* submodule names: ``stem_conv``, ``stageI_blockJ/conv1`` ... ``head``, as in
  ``models/resnet.py``, so parameter trees copy across unchanged (the example's
  auto-names such as ``ResNetBlock_3/Conv_1`` hold the same arrays in the same order);
* initialisers: He fan-out normal for convolutions, N(0, 0.01) for the head, zero gamma on
  the last BatchNorm of each block (the example zero-inits that gamma too, but uses lecun
  normal elsewhere; initialisation does not change the step's speed);
* input: uint8 pixels normalised on the device with the ImageNet mean/std (the example does
  it on the host, in tf.data), so both steps start from the same bytes;
* loss: softmax cross-entropy in float32 with label smoothing (the example has none and
  takes the softmax in the compute dtype);
* learning rate: ``base_lr * batch / 256``, linear warmup from 0, cosine decay, as the
  example's ``create_learning_rate_fn``.

Weight decay: the example adds ``wd / 2 * sum(w**2)`` over arrays with ``ndim > 1`` to the
loss; its gradient ``wd * w`` is what hybridpar's ``optax.add_decayed_weights`` (mask
``ndim > 1``) adds, so the updates agree. The loss the step reports is the cross-entropy
alone, as hybridpar's is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)

ModuleDef = Any

conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def _pad(k: int):
    p = (k - 1) // 2
    return ((p, p), (p, p))


class BottleneckResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (1, 1), name="conv1")(x)
        y = self.norm(name="bn1")(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3), self.strides, padding=_pad(3), name="conv2")(y)
        y = self.norm(name="bn2")(y)
        y = self.act(y)
        y = self.conv(self.filters * 4, (1, 1), name="conv3")(y)
        y = self.norm(scale_init=nn.initializers.zeros_init(), name="bn3")(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters * 4, (1, 1), self.strides, name="proj_conv")(residual)
            residual = self.norm(name="proj_bn")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(
            nn.Conv, use_bias=False, dtype=self.dtype, padding="VALID", kernel_init=conv_init
        )
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=_pad(7), name="stem_conv")(x)
        x = norm(name="stem_bn")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=_pad(3))
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                    name=f"stage{i + 1}_block{j}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            kernel_init=nn.initializers.normal(0.01),
            name="head",
        )(x)
        return jnp.asarray(x, self.dtype)


ResNet50 = functools.partial(ResNet, stage_sizes=[3, 4, 6, 3], block_cls=BottleneckResNetBlock)


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_learning_rate_fn(
    base_learning_rate: float, steps_per_epoch: int, warmup_epochs: float, num_epochs: float
):
    """Linear warmup from 0, then cosine decay to 0 (the example's schedule)."""
    warmup_steps = int(warmup_epochs * steps_per_epoch)
    cosine_steps = max(int((num_epochs - warmup_epochs) * steps_per_epoch), 1)
    cosine_fn = optax.cosine_decay_schedule(base_learning_rate, cosine_steps)
    if warmup_steps == 0:
        return cosine_fn
    warmup_fn = optax.linear_schedule(0.0, base_learning_rate, warmup_steps)
    return optax.join_schedules([warmup_fn, cosine_fn], [warmup_steps])


def create_train_state(
    rng,
    model,
    image_size: int,
    learning_rate_fn,
    momentum: float = 0.9,
    nesterov: bool = True,
    variables=None,
) -> TrainState:
    """``variables`` (``{"params", "batch_stats"}``) skips the init and uses those."""
    if variables is None:
        variables = jax.jit(functools.partial(model.init, train=False))(
            rng, jnp.ones((1, image_size, image_size, 3), jnp.float32)
        )
    tx = optax.sgd(learning_rate_fn, momentum=momentum, nesterov=nesterov)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )


def cross_entropy_loss(logits, labels, num_classes: int, label_smoothing: float):
    """In float32 (float64 when the model computes in float64: the fairness test's exact
    reference, run under ``jax.enable_x64``)."""
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    one_hot = jax.nn.one_hot(labels, num_classes, dtype=dtype)
    targets = optax.smooth_labels(one_hot, label_smoothing)
    return optax.softmax_cross_entropy(logits.astype(dtype), targets).mean()


def train_step(
    state: TrainState,
    batch,
    *,
    learning_rate_fn,
    weight_decay: float,
    label_smoothing: float,
    dtype=jnp.float32,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
):
    """One SGD step on ``{"image": uint8 NHWC, "label": int32}``; returns (state, metrics)."""
    images = (batch["image"].astype(jnp.float32) - jnp.asarray(mean)) / jnp.asarray(std)
    images = images.astype(dtype)
    labels = batch["label"]

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            images,
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, labels, logits.shape[-1], label_smoothing)
        weight_l2 = sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
        return loss + weight_decay * 0.5 * weight_l2, (new_model_state, logits, loss)

    grads, (new_model_state, logits, loss) = jax.grad(loss_fn, has_aux=True)(state.params)
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
        "learning_rate": learning_rate_fn(state.step),
    }
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def recipe_of(config) -> dict:
    """``make_reference``'s hyperparameters read from a hybridpar experiment config (any
    object with its fields), so the reference trains what hybridpar's step trains."""
    return {
        "num_classes": config.data.num_classes,
        "base_lr": config.optim.base_lr,
        "weight_decay": config.optim.weight_decay,
        "label_smoothing": config.label_smoothing,
        "warmup_epochs": config.optim.warmup_epochs,
        "num_epochs": config.num_epochs,
        "momentum": config.optim.momentum,
        "nesterov": config.optim.nesterov,
    }


def make_reference(
    *,
    image_size: int,
    batch: int,
    dtype=jnp.float32,
    num_classes: int = 1000,
    base_lr: float = 0.1,
    weight_decay: float = 5e-5,
    label_smoothing: float = 0.1,
    warmup_epochs: float = 5.0,
    num_epochs: float = 35.0,
    steps_per_epoch: int = 1251,
    momentum: float = 0.9,
    nesterov: bool = True,
    seed: int = 0,
    model_cls=ResNet50,
    variables=None,
):
    """``(state, jitted_step)`` for a ResNet-50 recipe like experiments/resnet50_imagenet.py.

    ``variables`` (``{"params": ..., "batch_stats": ...}``) replaces the initialisation."""
    model = model_cls(num_classes=num_classes, dtype=dtype)
    lr_fn = create_learning_rate_fn(
        base_lr * batch / 256, steps_per_epoch, warmup_epochs, num_epochs
    )
    state = create_train_state(
        jax.random.key(seed),
        model,
        image_size,
        lr_fn,
        momentum=momentum,
        nesterov=nesterov,
        variables=variables,
    )
    step = jax.jit(
        functools.partial(
            train_step,
            learning_rate_fn=lr_fn,
            weight_decay=weight_decay,
            label_smoothing=label_smoothing,
            dtype=dtype,
        )
    )
    return state, step
