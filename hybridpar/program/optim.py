"""Optimizers and learning-rate schedules (optax), from the ``optim`` config section.

* The learning rate scales linearly with the global batch: ``lr = base_lr * batch / 256``
  (Goyal et al. 2017), so a config keeps its meaning when the batch changes
  (``optim.lr_batch_scaling``: ``linear``, ``sqrt`` or ``none``).
* Linear warmup, then cosine or linear decay to ``end_lr_factor * lr``, as functions of the
  epoch reached (``hybridpar.config.curriculum.StagePlan``), so they stay right when a stage
  changes the batch and so the steps per epoch.
* SGD with (Nesterov) momentum, or LARS (You et al. 2017) for very large batches.
* Momentum constant (``optim.momentum``) or, with ``optim.momentum_start >= 0``, a linear
  ramp from ``momentum_start`` to ``momentum`` over ``momentum_ramp_epochs`` (e.g. 0.98 ->
  0.9 over the warmup), also a function of the epoch reached. A stage may set its own
  momentum (``config.stages``' ``~MOMENTUM``, ``hybridpar/config/curriculum.py``): held for that
  stage, while stages without one follow the above. The scheduled optimizer is wrapped in
  ``optax.inject_hyperparams``, so momentum (and the learning rate) are values in the
  optimizer state: a change of momentum is not a new compiled program. Without a ramp or a
  stage's momentum the optimizer is built as before, so its state and numbers stay the same
  (``optim.momentum=0`` then has no trace at all; with a schedule it has one, and a stage
  without ``~`` runs momentum 0 on it, which is plain SGD).
* Weight decay applies to kernels only: BatchNorm scales/offsets and biases are left alone
  (as fast.ai and MLPerf do), and LARS's trust ratio is masked the same way.
"""

from __future__ import annotations

import difflib
import math
import re

import jax
import jax.numpy as jnp
import optax

from hybridpar.config.curriculum import StagePlan
from hybridpar.config.errors import ConfigError
from hybridpar.config.schedules import (
    lr_batch_factor,  # noqa: F401 (tune.py imports it from here)
    lr_factor,
    momentum_at,
    peak_lr,
)


def decay_mask(params):
    """True for arrays that get weight decay: kernels (ndim > 1); False for BN and biases."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_schedule(cfg, plan: StagePlan) -> optax.Schedule:
    """``step -> learning rate`` over the stages of ``plan``: the epoch a step reaches sets
    the schedule's shape, the batch of its stage the scale (``lr_batch_factor``)."""

    def schedule(step):
        epoch = plan.epoch_at(step)
        return peak_lr(cfg, plan.batch_at(step)) * lr_factor(cfg, epoch, plan.num_epochs)

    return schedule


def make_momentum_schedule(cfg, plan: StagePlan) -> optax.Schedule | None:
    """``step -> momentum`` over the stages of ``plan``: a stage's own momentum
    (``Stage.momentum``) throughout the steps it runs, else ``momentum_at`` the epoch reached
    (with ``momentum_start >= 0``) or ``cfg.momentum``. None when momentum is constant: no
    ramp and no stage sets one. ``step`` may be traced (inside the train step)."""
    ramp = cfg.momentum_start >= 0
    own = [s.stage.momentum for s in plan.stages]
    if all(m is None for m in own):
        return (lambda step: momentum_at(cfg, plan.epoch_at(step))) if ramp else None
    # Per stage: does it set its own, and to what (0.0 where not: ``where`` takes ``base``).
    sets = [m is not None for m in own]
    values = [0.0 if m is None else m for m in own]

    def schedule(step):
        i = plan.stage_index_at(step)
        base = momentum_at(cfg, plan.epoch_at(step)) if ramp else cfg.momentum
        return jnp.where(jnp.asarray(sets)[i], jnp.asarray(values, jnp.float32)[i], base)

    return schedule


def keep_state_dtypes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose state keeps the dtypes ``init`` gave it. Injected hyperparameters are
    float32 arrays, not weakly typed Python floats, so ``momentum * trace`` would turn a
    bfloat16 trace into float32: another state type, so another compiled step."""

    def update(updates, state, params=None):
        updates, new = tx.update(updates, state, params)
        return updates, jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)

    return optax.GradientTransformation(tx.init, update)


def make_optimizer(cfg, plan: StagePlan):
    """Returns ``(tx, schedule)`` for the ``optim`` config section and the run's stages."""
    schedule = make_schedule(cfg, plan)
    momentum = make_momentum_schedule(cfg, plan)
    scheduled = momentum is not None
    if not scheduled:  # constant: optax's optimizers as they are, so nothing changes
        sgd, lars, momentum = optax.sgd, optax.lars, cfg.momentum
    else:
        # Schedules become values in the state (``hyperparams``), read each step: one
        # compiled step serves every momentum. The masks are functions, not schedules.
        sgd = optax.inject_hyperparams(optax.sgd)
        lars = optax.inject_hyperparams(
            optax.lars, static_args=("weight_decay_mask", "trust_ratio_mask")
        )
    if cfg.name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
            # momentum 0 (constant): no trace at all; a schedule always has one
            sgd(schedule, momentum=momentum or None, nesterov=cfg.nesterov),
        )
    else:  # "lars": the one other name optim.name may hold (schema.validate checks it)
        tx = lars(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=decay_mask,
            trust_coefficient=cfg.lars_trust,
            trust_ratio_mask=decay_mask,
            momentum=momentum,
            nesterov=cfg.nesterov,
        )
    if cfg.frozen:  # last in the chain: no update at all, weight decay's included
        tx = optax.chain(tx, optax.masked(optax.set_to_zero(), frozen_mask(cfg.frozen)))
    return (keep_state_dtypes(tx) if scheduled else tx), schedule


def at_step(opt_state, step):
    """``opt_state`` with optax's step counters (every ``count`` field: the schedules' and
    ``inject_hyperparams``') set to ``step``, the train state's. The train step sets them
    after each update, skipped or not: optax's own count stops on a skipped step (which
    keeps the old optimizer state), and its schedules would fall behind the step for good."""

    def one(path, x):
        named_count = path and isinstance(path[-1], jax.tree_util.GetAttrKey)
        return step.astype(x.dtype) if named_count and path[-1].name == "count" else x

    return jax.tree_util.tree_map_with_path(one, opt_state)


def param_name(path) -> str:
    """A parameter's path as ``optim.frozen`` matches it: "block1/conv1/kernel". Dict keys
    only: flax's boxes (``init`` sees them) add attribute keys."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def describe_frozen(pattern: str, params) -> str:
    """The set-up line of ``optim.frozen``: which parameters it freezes and how much of the
    model that is (``params``: arrays or their shapes)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    regex = re.compile(pattern)
    hit = [(param_name(p), x) for p, x in leaves if regex.search(param_name(p))]
    size = sum(math.prod(x.shape) for _, x in leaves)
    frozen = sum(math.prod(x.shape) for _, x in hit)
    names = ", ".join(n for n, _ in hit[:4]) + (", ..." if len(hit) > 4 else "")
    return (
        f"optim.frozen={pattern!r}: {len(hit)} of {len(leaves)} parameter arrays get no "
        f"update ({names}), {frozen:,} of {size:,} values"
    )


def frozen_mask(pattern: str):
    """``params -> tree of bool``: True where the path ("block1/conv1/kernel") matches. A
    pattern that matches no parameter is a ``ConfigError`` (when the state is built): it
    would freeze nothing, silently (a misspelt path, say)."""
    regex = re.compile(pattern)

    def mask(params):
        names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        if names and not any(regex.search(n) for n in names):
            closest = difflib.get_close_matches(pattern, sorted(set(names)), n=3, cutoff=0.0)
            raise ConfigError(
                f"optim.frozen={pattern!r} matches no parameter path, so it would freeze "
                f"nothing; the closest of the model's {len(names)}: {', '.join(closest)}; set "
                "--config.optim.frozen to a regex that matches the paths to freeze"
            )
        return jax.tree_util.tree_map_with_path(
            lambda p, _: bool(regex.search(param_name(p))), params
        )

    return mask
