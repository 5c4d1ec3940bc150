"""The learning-rate and momentum schedules as functions of the epoch reached, from the
``optim`` config section (``hybridpar/program/optim.py`` builds the optimizer on them).

A number or a numpy array is computed with numpy, a traced value (inside the train step)
with ``jax.numpy``, so tools that only read a run's config (the report) draw the same
schedule without JAX.
"""

from __future__ import annotations

import numpy as np

from hybridpar.config.errors import ConfigError


def _xp(x):
    if isinstance(x, (int, float, np.generic, np.ndarray)):
        return np
    import jax.numpy as jnp  # traced: the schedule inside the step

    return jnp


def lr_batch_factor(cfg, global_batch):
    """How the learning rate follows the global batch: ``linear`` (Goyal et al.: x batch /
    lr_batch_base), ``sqrt`` (for LARS at very large batch) or ``none``. ``global_batch``
    may be a traced value (the batch of the stage a step is in)."""
    ratio = global_batch / cfg.lr_batch_base
    if cfg.lr_batch_scaling == "sqrt":
        return ratio**0.5
    return 1.0 if cfg.lr_batch_scaling == "none" else ratio


def peak_lr(cfg, global_batch):
    """The learning rate at the top of the schedule for ``global_batch`` (traced or not):
    ``base_lr`` scaled by ``lr_batch_factor``."""
    return cfg.base_lr * lr_batch_factor(cfg, global_batch)


def lr_factor(cfg, epoch, num_epochs: float):
    """The schedule's shape in [0, 1] at ``epoch`` (float; traced or not): linear warmup from
    ``warmup_start_factor`` over ``warmup_epochs``, then cosine, linear, polynomial (power 2)
    or constant decay to
    ``end_lr_factor`` at ``num_epochs``; or ``exponential`` (the LR range test,
    ``hybridpar/tools/tune.py``): no warmup, a geometric rise from ``warmup_start_factor`` at epoch
    0 to 1 at ``num_epochs``. A function of epochs, so it is continuous however
    the batch (and so the steps per epoch) changes from stage to stage."""
    xp = _xp(epoch)
    warm = min(cfg.warmup_epochs, num_epochs)
    t = xp.clip((epoch - warm) / max(num_epochs - warm, 1e-9), 0.0, 1.0)
    end = cfg.end_lr_factor
    if cfg.schedule == "cosine":
        decay = end + (1 - end) * 0.5 * (1 + xp.cos(xp.pi * t))
    elif cfg.schedule == "linear":
        decay = 1 + (end - 1) * t
    elif cfg.schedule == "poly":  # MLPerf's LARS recipe: polynomial decay of power 2
        decay = end + (1 - end) * (1 - t) ** 2
    elif cfg.schedule == "constant":
        decay = xp.ones_like(t)
    elif cfg.schedule == "exponential":  # the LR range test's: up from warmup_start_factor
        decay = cfg.warmup_start_factor ** (1 - t)
    else:
        raise ConfigError(
            f"optim.schedule={cfg.schedule!r}: use 'cosine', 'linear', 'poly', 'constant' or "
            "'exponential'"
        )
    if warm <= 0:
        return decay
    f0 = cfg.warmup_start_factor
    warmup = f0 + (1 - f0) * xp.clip(epoch / warm, 0.0, 1.0)
    return xp.where(epoch < warm, warmup, decay)


def momentum_at(cfg, epoch):
    """Momentum at ``epoch`` (float; traced or not): linear from ``momentum_start`` to
    ``momentum`` over the first ``momentum_ramp_epochs`` epochs, then ``momentum``."""
    t = _xp(epoch).clip(epoch / cfg.momentum_ramp_epochs, 0.0, 1.0)
    return cfg.momentum_start + (cfg.momentum - cfg.momentum_start) * t
