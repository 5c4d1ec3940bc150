"""Train and eval steps: pure functions of (state, batch), jitted with explicit shardings.

Batches hold ``image`` (uint8 or float, NHWC, normalised here on the device so the host ships
1 byte per pixel), ``label`` (int32) and, for eval, ``mask`` (1 for real examples, 0 for the
padding of a last partial batch). Under ``jax.jit`` with the batch split over the data axes,
BatchNorm statistics and the mean loss are global: XLA inserts the all-reduces, so a sharded
step computes what one device would.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from hybridpar.partitioning import batch_sharding, replicated
from hybridpar.precision import Policy, all_finite
from hybridpar.sharded_head import ShardedHead
from hybridpar.state import TrainState


def normalize(images, mean, std, dtype):
    """uint8 or float pixels in 0..255 -> (x - mean) / std in the compute dtype."""
    x = images.astype(jnp.float32)
    x = (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
    return x.astype(dtype)


def cross_entropy(logits, labels, label_smoothing: float = 0.0):
    """Mean softmax cross-entropy with label smoothing, in float32, per example."""
    logits = logits.astype(jnp.float32)
    num_classes = logits.shape[-1]
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)


def logits_in(policy: Policy | None, logits):
    """The logits in the policy's output dtype (``precision.output``); the softmax and the
    loss then run in float32 whatever it is."""
    return logits if policy is None else logits.astype(policy.output_dtype)


def scaled_loss_fn(
    model, batch_stats, images, labels, scale, label_smoothing, head=None, policy=None
):
    """``params -> (loss * scale, (loss, new_batch_stats))`` for ``jax.grad(has_aux=True)``:
    the forward pass in train mode and the mean cross-entropy, shared by every train step.
    ``head`` as in ``make_train_step``; ``policy`` sets the logits' dtype."""

    def loss_fn(params):
        variables = {"params": params, "batch_stats": batch_stats}
        if head is None:
            logits, new_vars = model.apply(variables, images, train=True, mutable=["batch_stats"])
            loss = cross_entropy(logits_in(policy, logits), labels, label_smoothing).mean()
        else:
            features, new_vars = model.apply(
                variables,
                head.split_batch(images),
                train=True,
                mutable=["batch_stats"],
                return_features=True,
            )
            out = head(features, params["head"], labels, label_smoothing=label_smoothing)
            loss = out["loss"].mean()
        return loss * scale, (loss, new_vars["batch_stats"])

    return loss_fn


def make_train_step(
    model,
    tx,
    policy: Policy,
    schedule: Callable,
    *,
    mean,
    std,
    label_smoothing: float = 0.0,
    head: ShardedHead | None = None,
):
    """``train_step(state, batch) -> (state, metrics)``.

    ``head``: None runs the model's own classifier (XLA places the logits); a
    ``ShardedHead`` (``model.head``: sharded, partial_fc) takes the model's features and
    applies ``params["head"]`` class-sharded, never gathering the logits.
    """

    def train_step(state: TrainState, batch):
        images = normalize(batch["image"], mean, std, policy.compute_dtype)
        labels = batch["label"]
        loss_fn = scaled_loss_fn(
            model,
            state.batch_stats,
            images,
            labels,
            state.loss_scale.scale,
            label_smoothing,
            head,
            policy,
        )
        grads, (loss, batch_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
        return apply_gradients(state, grads, loss, batch_stats, tx, schedule)

    return train_step


def apply_gradients(state: TrainState, scaled_grads, loss, batch_stats, tx, schedule):
    """The update shared by every train step: unscale, optimizer, and for float16 the skip
    of a step whose gradients overflowed. Returns ``(new_state, metrics)``."""
    grads = state.loss_scale.unscale(scaled_grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(
        step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state
    )
    finite = jnp.asarray(True)
    if state.loss_scale.dynamic:
        # float16: a step with overflowing gradients changes nothing but the scale.
        finite = all_finite(grads)
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        new = new.replace(step=state.step + 1, loss_scale=state.loss_scale.update(finite))
    metrics = {
        "loss": loss,
        "lr": schedule(state.step),
        "grads_finite": finite,
        "loss_scale": state.loss_scale.scale,
    }
    return new, metrics


def make_eval_step(
    model,
    policy: Policy,
    *,
    mean,
    std,
    label_smoothing: float = 0.0,
    head: ShardedHead | None = None,
):
    """Sums over the batch of loss, top-1 and top-5 hits, and the count of real examples.

    ``head`` as in ``make_train_step``."""

    def eval_step(state: TrainState, batch):
        images = normalize(batch["image"], mean, std, policy.compute_dtype)
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        labels, mask = batch["label"], batch["mask"].astype(jnp.float32)
        if head is None:
            logits = logits_in(policy, model.apply(variables, images, train=False))
            logits = logits.astype(jnp.float32)
            loss = cross_entropy(logits, labels, label_smoothing)
            k = min(5, logits.shape[-1])
            _, top = jax.lax.top_k(logits, k)
            hit5 = jnp.any(top == labels[:, None], axis=-1)
            hit1 = top[:, 0] == labels
        else:
            features = model.apply(
                variables, head.split_batch(images), train=False, return_features=True
            )
            k = min(5, state.params["head"]["kernel"].shape[-1])
            out = head(
                features, state.params["head"], labels, label_smoothing=label_smoothing, topk=(1, k)
            )
            loss, hit1, hit5 = out["loss"], out["top1"], out[f"top{k}"]
        return {
            "loss_sum": jnp.sum(loss * mask),
            "top1_sum": jnp.sum(hit1 * mask),
            "top5_sum": jnp.sum(hit5 * mask),
            "count": jnp.sum(mask),
        }

    return eval_step


def batch_shardings(mesh, batch_spec: dict):
    """``{"image": ndim, ...}`` -> per-key batch shardings."""
    return {k: batch_sharding(mesh, ndim) for k, ndim in batch_spec.items()}


def jit_train_step(step_fn, state_shardings, mesh, batch_spec: dict):
    """Train step with in/out shardings and the old state donated (updated in place)."""
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings(mesh, batch_spec)),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(step_fn, state_shardings, mesh, batch_spec: dict):
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings(mesh, batch_spec)),
        out_shardings=replicated(mesh),
    )
