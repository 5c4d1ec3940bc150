"""Mixed-precision policy and dynamic loss scaling.

The policy says which dtype parameters are stored in, which the model computes in, and which
its logits come out in. BatchNorm statistics (Flax reduces them in float32), softmax and the
loss are always float32. float16 needs dynamic loss scaling: gradients are computed for
``loss * scale``; a step whose gradients are not finite is skipped and halves the scale, and
``period`` finite steps in a row double it (as in Micikevicius et al. 2018 and NVIDIA Apex),
up to ``MAX_LOSS_SCALE``. bfloat16 has float32's exponent range and needs no scaling.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import DTYPE_SHORT

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# The largest loss scale: the scale is a float32, and doubling without a cap reaches inf
# after enough finite steps (a model whose gradients stay small, or zero), where halving
# never brings it back and every step is skipped. 2**126 is the largest power of two whose
# reciprocal is a normal float32: ``unscale`` multiplies by 1 / scale, and XLA flushes
# subnormals to zero (1 / 2**127 becomes 0 on XLA:CPU, zeroing every gradient), and a power
# of two keeps that multiplication exact.
MAX_LOSS_SCALE = 2.0**126


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32

    @property
    def needs_loss_scale(self) -> bool:
        return jnp.dtype(self.compute_dtype) == jnp.float16


def _dtype(value, what: str):
    """The dtype of a name in ``DTYPES``, a short name the config's errors suggest it for
    (``DTYPE_SHORT``: "bf16", "fp16"), or a dtype (``jnp.bfloat16``, ``np.dtype("float16")``)."""
    name = value if isinstance(value, str) else None
    if name is None:
        try:
            name = np.dtype(value).name
        except (TypeError, ValueError):  # not a dtype at all
            pass
    name = DTYPE_SHORT.get(name, name)
    if name not in DTYPES:
        raise ConfigError(
            f"make_policy {what}={value!r} is not a dtype we support; use one of "
            f"{', '.join(sorted(DTYPES))} (a name, as precision.{what} takes, or a jnp dtype)"
        )
    return DTYPES[name]


def make_policy(
    compute: str = "float32", params: str = "float32", output: str = "float32"
) -> Policy:
    """Policy from dtypes, each a name (config: precision.compute / .params / .output), a
    short one ("bf16", "fp16") or a dtype (``jnp.bfloat16``)."""
    return Policy(
        param_dtype=_dtype(params, "params"),
        compute_dtype=_dtype(compute, "compute"),
        output_dtype=_dtype(output, "output"),
    )


class LossScale(struct.PyTreeNode):
    """Dynamic loss scale. With ``dynamic=False`` it is a constant 1 and never skips. The
    scale stays within ``MAX_LOSS_SCALE``: ``create`` lowers a larger ``initial`` to it,
    and ``update`` never grows past it."""

    scale: jax.Array
    good_steps: jax.Array
    period: int = struct.field(pytree_node=False, default=2000)
    factor: float = struct.field(pytree_node=False, default=2.0)
    dynamic: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def create(
        cls, dynamic: bool, initial: float = 2.0**15, period: int = 2000, factor: float = 2.0
    ):
        """``initial`` >= 1 (a larger one than ``MAX_LOSS_SCALE`` is lowered to it),
        ``period`` an int >= 1, ``factor`` > 1, as the config checks its
        ``precision.loss_scale_initial`` and ``.loss_scale_period``."""
        if not initial >= 1:  # "not >=": nan fails it too
            raise ConfigError(
                f"LossScale initial={initial!r} must be a number >= 1, e.g. 2.0**15: an overflow "
                "divides the scale down to 1, not below, so a smaller one would grow on it"
            )
        if not (isinstance(period, numbers.Integral) and period >= 1):
            raise ConfigError(
                f"LossScale period={period!r} must be an int >= 1, e.g. 2000: the finite steps "
                "in a row after which the scale grows"
            )
        if not math.inf > factor > 1:
            raise ConfigError(
                f"LossScale factor={factor!r} must be a finite number > 1, e.g. 2.0: the scale "
                "grows by it, and an overflow divides the scale by it"
            )
        return cls(
            # min first, in Python: a larger initial would round to inf as a float32
            scale=jnp.asarray(min(initial, MAX_LOSS_SCALE) if dynamic else 1.0, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            period=period,
            factor=factor,
            dynamic=dynamic,
        )

    def unscale(self, grads):
        inv = 1.0 / self.scale
        return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)

    def update(self, finite: jax.Array) -> "LossScale":
        """Halve on a non-finite step; double after ``period`` finite steps in a row, up to
        ``MAX_LOSS_SCALE`` (a scale already above it, e.g. an inf restored from an older
        checkpoint, comes back to it)."""
        if not self.dynamic:
            return self
        grow = finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(
            finite,
            jnp.where(grow, self.scale * self.factor, self.scale),
            jnp.maximum(self.scale / self.factor, 1.0),
        )
        scale = jnp.minimum(scale, MAX_LOSS_SCALE)
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good)


def all_finite(tree) -> jax.Array:
    """One boolean: every element of every array in ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
