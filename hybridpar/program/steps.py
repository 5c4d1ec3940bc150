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

from hybridpar.parallel.partitioning import Rules, batch_sharding, replicated
from hybridpar.program.optim import at_step
from hybridpar.program.precision import Policy, all_finite
from hybridpar.program.state import TrainState
from hybridpar.program.sync import XlaSync


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


class DenseHead:
    """The model's own classifier: the logits are an activation like any other, placed by
    XLA. A ``heads.Head``, as ``sharded_head.ShardedHead`` is."""

    def rules(self) -> Rules:
        """No placement of its own: the partitioning rules place the head like any layer."""
        return Rules()

    def apply(
        self, model, variables, images, labels, *, train, label_smoothing=0.0, topk=(), policy=None
    ):
        """``({"loss": (B,), "top{k}": (B,) bool for k in topk}, new model variables)``."""
        if train:
            logits, new_vars = model.apply(variables, images, train=True, mutable=["batch_stats"])
        else:
            logits, new_vars = model.apply(variables, images, train=False), {}
        logits = logits_in(policy, logits).astype(jnp.float32)
        out = {"loss": cross_entropy(logits, labels, label_smoothing), "logits": logits}
        if topk:
            _, top = jax.lax.top_k(logits, min(max(topk), logits.shape[-1]))
            out.update({f"top{k}": jnp.any(top[:, :k] == labels[:, None], axis=-1) for k in topk})
        return out, new_vars


DENSE = DenseHead()  # the head wherever none is given (stateless: one serves every step)


def scaled_loss_fn(
    model, batch_stats, images, labels, scale, label_smoothing, head=DENSE, policy=None, soft=None
):
    """``params -> (loss * scale, (loss, new_batch_stats))`` for ``jax.grad(has_aux=True)``:
    the forward pass in train mode and the mean cross-entropy, shared by every train step.
    ``head``: a ``heads.Head``; ``policy`` sets the logits' dtype. ``soft``:
    ``(distill.Teacher, its logits)``, mixed into the loss."""

    def loss_fn(params):
        variables = {"params": params, "batch_stats": batch_stats}
        out, new_vars = head.apply(
            model,
            variables,
            images,
            labels,
            train=True,
            label_smoothing=label_smoothing,
            policy=policy,
        )
        per_example = out["loss"]
        if soft is not None:  # knowledge distillation (hybridpar/runtime/distill.py)
            per_example = soft[0].mix(per_example, out["logits"], soft[1])
        loss = per_example.mean()
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
    head=DENSE,
    sync=None,
    teacher=None,
):
    """``train_step(state, batch) -> (state, metrics)``, with its choices passed in:

    ``head``: a ``heads.Head``, ``DENSE`` (the model's own classifier) or a ``ShardedHead``
    (``model.head``: sharded, partial_fc: classes split, the logits never gathered).
    ``sync``: how the gradients are reduced, ``XlaSync()`` (default) or
    ``sync.BucketedSync`` (``comm.mode=bucketed``) or ``sync.OverlapSync`` (``overlap``).
    ``teacher``: a ``distill.Teacher``; the step then takes its variables as a third
    argument, ``train_step(state, batch, teacher_variables)``.
    """
    sync = sync or XlaSync()

    def train_step(state: TrainState, batch, teacher_variables=None):
        images = normalize(batch["image"], mean, std, policy.compute_dtype)
        labels = batch["label"]
        soft = None if teacher is None else (teacher, teacher.logits(teacher_variables, images))

        def loss_fn_for(m, batch_stats, images, labels, scale):
            return scaled_loss_fn(m, batch_stats, images, labels, scale, label_smoothing, head,
                                  policy, soft)  # fmt: skip

        grads, loss, batch_stats = sync.gradients(model, state, images, labels, loss_fn_for)
        return apply_gradients(state, grads, loss, batch_stats, tx, schedule)

    return train_step


def apply_gradients(state: TrainState, scaled_grads, loss, batch_stats, tx, schedule):
    """The update shared by every train step: unscale, optimizer, and the skip of a step
    whose loss or gradients are not finite (whatever the precision: one bad batch must
    not poison the parameters; the trainer counts skips and stops after too many in a
    row). For float16 a skip also halves the loss scale. Returns ``(new_state, metrics)``."""
    grads = state.loss_scale.unscale(scaled_grads)
    # The counters are set on the way in too: a checkpoint written before they followed
    # the step holds counts behind it after skips, and its first resumed update would
    # apply the schedule at the old count (a no-op otherwise: they already equal the step).
    updates, opt_state = tx.update(grads, at_step(state.opt_state, state.step), state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(
        step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state
    )
    # A skipped step changes nothing (parameters, optimizer state, BatchNorm statistics)
    # but the step counter and the loss scale. optax's counters, which its schedules read,
    # are the step's, skipped or not: the learning rate and momentum stay functions of the
    # step, never behind it by the steps skipped so far.
    finite = all_finite(grads) & jnp.isfinite(loss)
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
    new = new.replace(
        step=state.step + 1,
        opt_state=at_step(new.opt_state, state.step + 1),
        loss_scale=state.loss_scale.update(finite),
    )
    metrics = {
        "loss": loss,
        "lr": schedule(state.step),  # what this update applied: its counters are the step
        "grads_finite": finite,
        "loss_scale": state.loss_scale.scale,  # the one this step's gradients were scaled by
        "next_loss_scale": new.loss_scale.scale,  # after this step's halving or doubling
    }
    # A momentum schedule (optax.inject_hyperparams) keeps this step's momentum in the
    # optimizer state: report it. A constant momentum is not in the state (the trainer
    # reports optim.momentum then).
    hyperparams = optax.tree_utils.tree_get(opt_state, "hyperparams") or {}
    if "momentum" in hyperparams:
        metrics["momentum"] = hyperparams["momentum"]
    return new, metrics


class FlipAveraged:
    """``model`` at inference, its output averaged over each image and its mirror image
    (test-time flip). The heads apply it as they apply the model; what it averages, logits or
    (for a sharded head) the features before the linear head, gives the same logits."""

    def __init__(self, model):
        self.model = model

    def apply(self, variables, x, train=False, **kw):
        assert not train, "test-time flip is for evaluation"
        y = self.model.apply(variables, x, train=False, **kw)
        mirrored = self.model.apply(variables, x[:, :, ::-1, :], train=False, **kw)
        return ((y.astype(jnp.float32) + mirrored.astype(jnp.float32)) / 2).astype(y.dtype)


def make_eval_step(
    model,
    policy: Policy,
    *,
    mean,
    std,
    label_smoothing: float = 0.0,
    head=DENSE,
    flip: bool = False,
):
    """Sums over the batch of loss, top-1 and top-5 hits, and the count of real examples.

    ``head`` as in ``make_train_step``; ``flip``: test-time flip (``FlipAveraged``)."""
    model = FlipAveraged(model) if flip else model

    def eval_step(state: TrainState, batch):
        images = normalize(batch["image"], mean, std, policy.compute_dtype)
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        labels, mask = batch["label"], batch["mask"].astype(jnp.float32)
        out, _ = head.apply(
            model,
            variables,
            images,
            labels,
            train=False,
            label_smoothing=label_smoothing,
            topk=(1, 5),
            policy=policy,
        )
        return {
            "loss_sum": jnp.sum(out["loss"] * mask),
            "top1_sum": jnp.sum(out["top1"] * mask),
            "top5_sum": jnp.sum(out["top5"] * mask),
            "count": jnp.sum(mask),
        }

    return eval_step


def batch_shardings(mesh, batch_spec: dict):
    """``{"image": ndim, ...}`` -> per-key batch shardings."""
    return {k: batch_sharding(mesh, ndim) for k, ndim in batch_spec.items()}


def jit_train_step(step_fn, state_shardings, mesh, batch_spec: dict, extra=()):
    """Train step with in/out shardings and the old state donated (updated in place);
    ``extra``: the shardings of more arguments after the batch (a teacher's variables)."""
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings(mesh, batch_spec), *extra),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(step_fn, state_shardings, mesh, batch_spec: dict):
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_shardings(mesh, batch_spec)),
        out_shardings=replicated(mesh),
    )
