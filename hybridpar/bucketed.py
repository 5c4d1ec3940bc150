"""Explicitly bucketed gradient reduction (``comm.mode=bucketed``), data parallel only.

Under ``jax.jit`` XLA inserts one all-reduce per gradient (and per BatchNorm statistic), and
whether it fuses them is up to the backend (the CPU backend keeps ~100 separate ops for a
ResNet-50). Here the step runs under ``jax.shard_map`` instead: each device computes the
loss and gradients of its own slice of the batch, then the gradients are flattened into
buckets of at most ``bucket_mb`` MiB and each bucket is reduced with ONE ``psum`` over the
data axes. Buckets are filled in reverse layer order (the last layers' gradients come out of
the backward pass first), so a backend with asynchronous collectives and a latency-hiding
scheduler can reduce the first buckets while the backward pass goes on, as Horovod, PyTorch
DDP and MoXing do. The loss and the BatchNorm running statistics share one more ``psum``.
The optimizer update then runs under ``jax.jit`` on the replicated parameters, exactly as in
``hybridpar.steps.make_train_step``, so the two steps are numerically equal.

Limits: parameters must be replicated. A ``model`` axis > 1 is an error (use
``comm.mode=xla`` for model parallelism); so is ``fsdp`` > 1 for now (FSDP needs a
reduce-scatter plus all-gather per bucket, not yet written here: use ``comm.mode=xla``, or
put the data parallelism on the ``data`` axis).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax import lax
from jax.sharding import PartitionSpec as P

from hybridpar.errors import ConfigError
from hybridpar.mesh import BATCH_AXES, data_parallel_size
from hybridpar.models.batchnorm import bn_axis_index_groups_for, parse_bn_sync
from hybridpar.partitioning import path_str
from hybridpar.precision import Policy
from hybridpar.state import TrainState
from hybridpar.steps import apply_gradients, cross_entropy, normalize

Path = tuple  # a parameter's path in the nested params dict, e.g. ("head", "kernel")


def _nbytes_and_dtype(x) -> tuple[int, np.dtype]:
    x = meta.unbox(x)
    return int(math.prod(np.shape(x))) * np.dtype(x.dtype).itemsize, np.dtype(x.dtype)


def _leaves_in_order(tree, prefix: Path = ()):
    """``(path, leaf)`` in the dicts' insertion order (jax.tree.leaves would sort keys)."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves_in_order(v, prefix + (k,))
    else:
        yield prefix, tree


def forward_params(model, input_shape, **apply_kwargs):
    """The model's parameters (abstract, unboxed) in the order ``model.init`` creates them.

    That is the forward (layer) order for linen modules. ``jax.eval_shape`` alone would not
    do: its output is rebuilt by ``tree_unflatten``, which sorts dict keys, so the order is
    read inside the traced function.
    """
    seen = []

    def init():
        variables = model.init(
            jax.random.key(0), jnp.zeros(input_shape, jnp.float32), train=False, **apply_kwargs
        )
        seen.append(
            [
                (p, jax.ShapeDtypeStruct(np.shape(meta.unbox(x)), meta.unbox(x).dtype))
                for p, x in _leaves_in_order(variables["params"])
            ]
        )
        return variables

    jax.eval_shape(init)
    out: dict = {}
    for path, leaf in seen[0]:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = leaf
    return out


def bucket_plan(params, bucket_mb: float) -> list[list[Path]]:
    """Buckets of parameter paths for the gradient reduction, first bucket first.

    ``params`` is a nested dict in forward order (as ``model.init`` creates it, or
    ``forward_params``); its leaves are arrays, ShapeDtypeStructs or Flax axis boxes. Leaves
    are taken in REVERSE order and packed greedily: a bucket closes when the next gradient
    would take it over ``bucket_mb`` MiB or has another dtype; a gradient larger than
    ``bucket_mb`` gets a bucket of its own. Every parameter is in exactly one bucket.
    """
    if not bucket_mb > 0:
        raise ConfigError(f"comm.bucket_mb={bucket_mb!r}: the bucket size must be > 0 MiB")
    limit = bucket_mb * 2**20
    plan: list[list[Path]] = []
    cur: list[Path] = []
    cur_bytes, cur_dtype = 0, None
    for path, leaf in reversed(list(_leaves_in_order(params))):
        nbytes, dtype = _nbytes_and_dtype(leaf)
        if cur and (cur_bytes + nbytes > limit or dtype != cur_dtype):
            plan.append(cur)
            cur, cur_bytes = [], 0
        cur.append(path)
        cur_bytes += nbytes
        cur_dtype = dtype
    if cur:
        plan.append(cur)
    return plan


def _path_of(keypath) -> Path:
    return tuple(path_str(keypath).split("/"))


def _to_varying(x, axes):
    """Marks ``x`` as per-device (varying over ``axes``) for shard_map's type system.

    Without it, ``jax.grad`` with respect to a replicated (invariant) parameter makes JAX
    insert a ``psum`` per parameter itself, which is what bucketing avoids.
    """
    aval = jax.typeof(x)
    vma = aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma
    missing = tuple(a for a in axes if a not in vma)
    return lax.pcast(x, missing, to="varying") if missing else x


def _zero_from(x):
    """A scalar 0 that XLA cannot fold away, computed from ``x``: min(|x[0]|, 0) is 0 for
    every finite or infinite value (a NaN stays NaN, and a NaN step is skipped or
    diverged anyway). Adding it changes no value, but orders one psum after another."""
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return jnp.minimum(jnp.abs(first), 0.0)


def _flat_pmean(leaves, axes, n, after=None):
    """Mean over devices of several arrays with ONE psum of their concatenation.

    ``after``: an array from an earlier psum that this one must follow. The data dependence
    keeps XLA's all-reduce combiner, which merges independent all-reduces (on CPU into one
    op at the end of the step), from fusing the buckets back together: each bucket stays
    one collective that can start as soon as its own gradients and the previous bucket are
    done, while the backward pass goes on. (``lax.optimization_barrier`` does not do it:
    the CPU and GPU compilers drop barriers before combining.)
    """
    leaves = [_to_varying(x, axes) for x in leaves]
    if not leaves:
        return []
    dtype = jnp.result_type(*leaves)
    flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])
    if after is not None:
        flat = flat + _zero_from(after).astype(flat.dtype)
    flat = lax.psum(flat, axes) / n
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return out


def reduce_in_buckets(grads, plan, axes=BATCH_AXES, n: int | None = None, after=None):
    """Mean of ``grads`` over the devices of ``axes``, one ``psum`` per bucket of ``plan``.

    Call inside ``jax.shard_map``; ``grads`` has any dict structure holding the plan's
    paths. The buckets are reduced in plan order, each after the previous one (and after
    ``after``, if given), so they stay separate collectives.
    """
    if n is None:
        n = math.prod(lax.axis_size(a) for a in axes)
    by_path = {_path_of(kp): g for kp, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    planned = [p for bucket in plan for p in bucket]
    if sorted(map(str, planned)) != sorted(map(str, by_path)):
        raise ValueError("the bucket plan does not cover the gradients exactly once each")
    reduced = {}
    for bucket in plan:
        out = _flat_pmean([by_path[p] for p in bucket], axes, n, after)
        reduced.update(zip(bucket, out))
        after = out[0]
    return jax.tree_util.tree_map_with_path(lambda kp, _: reduced[_path_of(kp)], grads)


def _check_mesh(mesh) -> int:
    if mesh.shape.get("model", 1) > 1:
        raise ConfigError(
            f"comm.mode=bucketed is data parallel only, but the mesh has model="
            f"{mesh.shape['model']}; use comm.mode=xla for model parallelism"
        )
    if mesh.shape.get("fsdp", 1) > 1:
        raise ConfigError(
            f"comm.mode=bucketed does not support fsdp > 1 yet (the mesh has fsdp="
            f"{mesh.shape['fsdp']}; FSDP needs a reduce-scatter and an all-gather per bucket): "
            "use comm.mode=xla, or split the batch over the data axis (e.g. mesh=data:-1)"
        )
    return data_parallel_size(mesh)


def bucketed_model(model, bn_sync: str, data_parallel_size: int):
    """``model`` with its BatchNorm set up for a per-device step inside shard_map."""
    kind, _ = parse_bn_sync(bn_sync)
    groups = bn_axis_index_groups_for(bn_sync, data_parallel_size)
    if not hasattr(model, "bn_axis_name"):
        if kind == "global" and data_parallel_size == 1:
            return model
        raise ConfigError(
            f"comm.mode=bucketed needs a model with BatchNorm sync fields (bn_axis_name, ...); "
            f"{type(model).__name__} has none: use comm.mode=xla"
        )
    return model.clone(
        bn_groups=1,
        bn_group_sharding=None,
        bn_axis_name=None if kind == "local" else BATCH_AXES,
        bn_axis_index_groups=groups,
    )


def make_bucketed_train_step(
    model,
    tx,
    policy: Policy,
    schedule: Callable,
    *,
    mean,
    std,
    label_smoothing: float = 0.0,
    mesh,
    bucket_mb: float,
    bn_sync: str = "global",
):
    """``train_step(state, batch) -> (state, metrics)``, like ``steps.make_train_step``.

    Jit it with ``steps.jit_train_step`` and the same state shardings (replicated
    parameters). ``model`` may be the one built for ``comm.mode=xla`` (any ``bn_groups``):
    its BatchNorm is reconfigured for ``bn_sync`` inside shard_map.
    """
    dp = _check_mesh(mesh)
    if not bucket_mb > 0:
        raise ConfigError(f"comm.bucket_mb={bucket_mb!r}: the bucket size must be > 0 MiB")
    local_model = bucketed_model(model, bn_sync, dp)
    axes = BATCH_AXES
    plans: dict[tuple, list] = {}

    def plan_for(image_shape) -> list[list[Path]]:
        key = tuple(image_shape)
        if key not in plans:
            plans[key] = bucket_plan(forward_params(local_model, (1, *key)), bucket_mb)
        return plans[key]

    def per_device(params, batch_stats, scale, images, labels):
        params = jax.tree.map(lambda p: _to_varying(p, axes), params)

        def loss_fn(params):
            logits, new_vars = local_model.apply(
                {"params": params, "batch_stats": batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = cross_entropy(logits, labels, label_smoothing).mean()
            return loss * scale, (loss, new_vars["batch_stats"])

        grads, (loss, new_stats) = jax.grad(loss_fn, has_aux=True)(params)
        # Loss and BN running averages (per device for local/group statistics): one psum,
        # first, as they are ready when the forward pass ends; then the gradient buckets.
        flat, treedef = jax.tree.flatten((loss, new_stats))
        flat = _flat_pmean(flat, axes, dp)
        loss, new_stats = jax.tree.unflatten(treedef, flat)
        grads = reduce_in_buckets(grads, plan_for(images.shape[1:]), axes, dp, after=flat[0])
        return grads, loss, new_stats

    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(axes), P(axes)),
        out_specs=(P(), P(), P()),
    )

    def train_step(state: TrainState, batch):
        images = normalize(batch["image"], mean, std, policy.compute_dtype)
        grads, loss, batch_stats = sharded(
            state.params, state.batch_stats, state.loss_scale.scale, images, batch["label"]
        )
        return apply_gradients(state, grads, loss, batch_stats, tx, schedule)

    train_step.plan_for = plan_for  # the buckets the step uses, for reports and tests
    return train_step


__all__ = [
    "bucket_plan",
    "bucketed_model",
    "forward_params",
    "make_bucketed_train_step",
    "reduce_in_buckets",
]
