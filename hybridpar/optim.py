"""Optimizers and learning-rate schedules (optax), from the ``optim`` config section.

* The learning rate scales linearly with the global batch: ``lr = base_lr * batch / 256``
  (Goyal et al. 2017), so a config keeps its meaning when the batch changes.
* Linear warmup, then cosine or linear decay to ``end_lr_factor * lr``.
* SGD with (Nesterov) momentum, or LARS (You et al. 2017) for very large batches.
* Weight decay applies to kernels only: BatchNorm scales/offsets and biases are left alone
  (as fast.ai and MLPerf do), and LARS's trust ratio is masked the same way.
"""

from __future__ import annotations

import jax
import optax

from hybridpar.errors import ConfigError


def decay_mask(params):
    """True for arrays that get weight decay: kernels (ndim > 1); False for BN and biases."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def peak_lr(cfg, global_batch: int) -> float:
    return cfg.base_lr * global_batch / cfg.lr_batch_base


def make_schedule(cfg, global_batch: int, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
    peak = peak_lr(cfg, global_batch)
    warmup = min(int(round(cfg.warmup_epochs * steps_per_epoch)), max(total_steps - 1, 0))
    end = peak * cfg.end_lr_factor
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_lr_factor)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    elif cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ConfigError(f"optim.schedule={cfg.schedule!r}: use 'cosine', 'linear' or 'constant'")
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(peak * cfg.warmup_start_factor, peak, warmup), decay], [warmup]
    )


def make_optimizer(cfg, global_batch: int, steps_per_epoch: int, total_steps: int):
    """Returns ``(tx, schedule)`` for the ``optim`` config section."""
    schedule = make_schedule(cfg, global_batch, steps_per_epoch, total_steps)
    if cfg.name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
            optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov),
        )
    elif cfg.name == "lars":
        tx = optax.lars(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=decay_mask,
            trust_coefficient=cfg.lars_trust,
            trust_ratio_mask=decay_mask,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
    else:
        raise ConfigError(f"optim.name={cfg.name!r}: use 'sgd' or 'lars'")
    return tx, schedule
