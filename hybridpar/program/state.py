"""Train state, created directly in its sharded layout.

Shapes first (``jax.eval_shape``), then shardings from the rules, then one ``jax.jit`` of the
init with ``out_shardings``: every device computes only its own shards, so an unsharded copy
of the parameters never exists on any device or host (big_vision, MaxText do the same).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from flax.core import meta

from hybridpar.parallel.partitioning import Rules, infer_shardings
from hybridpar.program.precision import LossScale


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any
    loss_scale: LossScale


def make_init_fn(
    model, tx, input_shape, loss_scale: LossScale
) -> Callable[[jax.Array], TrainState]:
    """``rng -> TrainState`` with Flax's logical-axis boxes left on (for the rules)."""

    def init(rng):
        variables = model.init(rng, jnp.zeros(input_shape, jnp.float32), train=False)
        params = variables["params"]
        # optax maps through the boxes, so momentum buffers keep their parameter's axis names.
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            batch_stats=variables.get("batch_stats", {}),
            opt_state=tx.init(params),
            loss_scale=loss_scale,
        )

    return init


def create_sharded_state(init: Callable, rules: Rules, mesh, rng):
    """Returns ``(state, shardings, abstract_state)``; ``abstract_state`` keeps the boxes."""
    abstract = jax.eval_shape(init, rng)
    shardings = infer_shardings(abstract, rules, mesh)
    return init_sharded(init, shardings, rng), shardings, abstract


def init_sharded(init: Callable, shardings, rng):
    """Runs ``init`` with every array born in its place (``out_shardings``)."""
    lowered = jax.jit(lambda r: meta.unbox(init(r)), out_shardings=shardings).lower(rng)
    # The init runs once, but XLA's CPU backend spends several times longer optimising the
    # random-number hashing of a small ResNet's init at the default level than at level 0
    # (the values differ by float rounding only). Other backends compile it quickly as it is.
    platform = jax.tree.leaves(shardings)[0].mesh.devices.flat[0].platform
    options = {"xla_backend_optimization_level": 0} if platform == "cpu" else {}
    return lowered.compile(compiler_options=options)(rng)


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying shardings, for ahead-of-time lowering."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), meta.unbox(tree), shardings
    )
