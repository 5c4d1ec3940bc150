"""Gradient reduction issued from the backward pass, bucket by bucket (``comm.mode=overlap``).

``comm.mode=bucketed`` takes ``jax.grad`` of the whole per-device loss, then reduces the
gradient tree in buckets. Here each bucket's parameters go through an identity with a custom
VJP before the model reads them: its forward rule marks them per-device (varying over the
data axes) and its backward rule reduces their cotangents with ONE ``psum`` of their
concatenation, averaged over the devices. So the all-reduce of a bucket is part of the
backward pass and depends only on its own layers' gradients (and, to keep the buckets
separate collectives, on the bucket reduced before it), which leaves a scheduler free to run
it beside the backward pass of the layers before it, as PyTorch DDP's bucket hooks do.
(``bucketed.reduce_in_buckets`` after ``jax.grad`` has the same data dependences; what
differs is where the psums sit in the program XLA schedules. The TPU compiler, measured on
the digits job, treats both alike: synchronous with libtpu's defaults, some buckets
asynchronous with its async collective fusion flags.)

The buckets are ``bucketed.bucket_plan``'s (the last layers' first). Each backward rule adds
a zero computed from the previous bucket's result (``bucketed.flat_pmean``'s ``after``):
without it XLA's all-reduce combiner may merge the independent psums into one at the end.
The dependency travels as a scalar "token" the identities pass along in forward order, whose
cotangent carries it back in the reverse order.

Call ``reduce_in_backward`` inside ``jax.shard_map`` and inside the function ``jax.grad``
differentiates, ``jax.grad(lambda p: loss_fn(reduce_in_backward(p, plan, axes), x, y))``:
that returns the gradients already averaged over ``axes`` (its docstring has the example).
FSDP: a bucket's parameters split over ``fsdp`` are gathered whole by the identity's forward
rule (one all_gather per bucket, in forward order) and their gradients reduce-scattered back
to the shard by its backward rule (one psum_scatter per bucket), as ZeRO-3 does. A ``model``
axis is the compiler's (``OverlapSync`` leaves it out of the shard_map's manual axes); its
split gradients are reduced as they are, since concatenating them would gather them whole
first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybridpar.parallel.bucketed import (
    Path,
    arrays_by_path,
    check_bound,
    check_plan_covers,
    flat_gather,
    rebuilt_tree,
    reduce_bucket,
    scatter_flat,
    to_varying,
    unscatter,
    zero_from,
)
from hybridpar.parallel.mesh import axes_size, axis_names


def _bucket_identity(axes: tuple[str, ...], n: int, reduce_dtype, dims: tuple, concat: bool,
                     gather_dtype=None):  # fmt: skip
    """``(leaves, token) -> (leaves, token)`` for one bucket. Forward: the leaves split over
    ``fsdp`` (``dims[i]`` not None) gathered whole with one all_gather after the token (the
    kernels, 2 or more dimensions, in a second one in ``gather_dtype`` where given), the
    others marked per-device. Backward: their cotangents averaged over ``axes`` with one
    psum (whole) or psum_scatter (split, back to this device's shard), after the token's
    cotangent."""

    @jax.custom_vjp
    def identity(leaves, token):
        out = [to_varying(x, axes) for x in leaves]
        split = [i for i, d in enumerate(dims) if d is not None]
        kernels = [i for i in split if gather_dtype is not None and leaves[i].ndim >= 2]
        rest = [i for i in split if i not in kernels]
        for group, cast in ((kernels, gather_dtype), (rest, None)):
            if not group:
                continue
            shards = [leaves[i].astype(cast or leaves[i].dtype) for i in group]
            full, flat = flat_gather(shards, [dims[i] for i in group], after=token)
            for i, x in zip(group, full):
                out[i] = to_varying(x.astype(leaves[i].dtype), axes)
            token = token + zero_from(flat).astype(token.dtype)  # the next gather follows
        return out, token

    def fwd(leaves, token):
        return identity(leaves, token), None

    def bwd(_, cts):
        ct_leaves, ct_token = cts
        out, last = reduce_bucket(list(ct_leaves), list(dims), axes, n, ct_token, reduce_dtype,
                                  concat)  # fmt: skip
        # The next bucket's reduction (earlier layers) follows this one: see the docstring.
        return out, to_varying(zero_from(last).astype(ct_token.dtype), axes)

    identity.defvjp(fwd, bwd)
    return identity


def reduce_in_backward(params, plan: list[list[Path]], axes, n: int | None = None,
                       reduce_dtype=None, shard_dims=None, concat=True,
                       gather_dtype=None):  # fmt: skip
    """``params`` with each bucket of ``plan`` wrapped in ``_bucket_identity``: the same
    values (per-device, whole), whose gradients reduce bucket by bucket in the backward pass.

    Call it inside ``jax.shard_map`` over ``axes`` and inside the function ``jax.grad``
    differentiates: the reduction is its backward pass, so only a gradient taken through
    the call is reduced::

        def per_device(params, x, y):  # the function jax.shard_map runs
            loss = lambda p: loss_fn(reduce_in_backward(p, plan, axes), x, y)
            return jax.grad(loss)(params)  # already the mean over ``axes``

    Wrapping first, ``p = reduce_in_backward(params, ...)`` and then ``jax.grad(loss_fn)(p)``,
    reduces nothing: the gradients stay each device's own (JAX's "out_specs ... possibly
    varying" error under ``out_specs=P()``).

    ``n``: the number of devices over ``axes`` (the mean's divisor; None: all of them).
    ``reduce_dtype``: the
    dtype each bucket is summed in (None: the gradients' own); the gradients come back in
    their own dtypes. ``shard_dims`` (FSDP): ``{path: dim}`` of the parameters this device
    holds a shard of (split along ``dim`` over ``fsdp``): gathered in the forward pass, their
    gradients reduce-scattered back to the shard. ``concat=False``: each bucket's whole
    gradients are summed as they are, not concatenated (``flat_pmean``), as a ``model`` axis
    the compiler partitions needs. ``gather_dtype`` (FSDP): the dtype the split kernels
    (arrays of 2 or more dimensions) are gathered in, the model's compute dtype, which every
    layer casts its kernel to anyway: the same values in half the bytes.
    """
    shard_dims, axes = shard_dims or {}, axis_names(axes)
    by_path = arrays_by_path(params)
    check_plan_covers(plan, by_path, "parameters")
    check_bound(axes, "reduce_in_backward")
    if n is None:
        n = axes_size(axes)
    out = dict(by_path)
    # Per-device over ``axes`` from the start, so that its type is the same before and after
    # a bucket whose gathered parameters it follows (custom_vjp checks the cotangent's type).
    token = to_varying(jnp.zeros((), jnp.float32), axes)
    for bucket in reversed(plan):  # forward order: the token passes from stem to head
        dims = tuple(shard_dims.get(p) for p in bucket)
        identity = _bucket_identity(axes, n, reduce_dtype, dims, concat, gather_dtype)
        leaves, token = identity([by_path[p] for p in bucket], token)
        out.update(zip(bucket, leaves))
    return rebuilt_tree(params, out)


# --- a step manual over every axis (a class-sharded head: the trunk data parallel over all) ---


def _groups(keys) -> dict:
    """Indices grouped by key, in first-seen order: the leaves one collective serves."""
    out: dict = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return out


def _manual_bucket_identity(axes, n, reduce_dtype, splits, sums, gather_dtype):
    """``_bucket_identity`` for a step manual over every axis in ``axes``. ``splits[i]``:
    the ``(mesh axes, dim)`` blocks leaf i arrives split in, gathered whole in the forward
    rule (one all_gather per bucket and split, kernels in ``gather_dtype`` where given);
    ``sums[i]``: the axes its gradient sums over in the backward rule, the split ones by
    psum_scatter back to this device's block, the rest by one psum; then / ``n``."""

    @jax.custom_vjp
    def identity(leaves, token):
        out = list(leaves)
        cast = [gather_dtype if gather_dtype is not None and x.ndim >= 2 else None
                for x in leaves]  # fmt: skip
        keys = [(tuple(a for a, _ in s), c) if s else None for s, c in zip(splits, cast)]
        for key, idx in _groups(keys).items():
            if key is None:
                continue
            xs = [leaves[i].astype(key[1] or leaves[i].dtype) for i in idx]
            for k, split_axes in enumerate(key[0]):  # the outer blocks first
                xs, flat = flat_gather(xs, [splits[i][k][1] for i in idx], token, split_axes)
                token = token + zero_from(flat).astype(token.dtype)  # the next gather follows
            for i, x in zip(idx, xs):
                out[i] = x.astype(leaves[i].dtype)
        return [to_varying(x, axes) for x in out], token

    def fwd(leaves, token):
        return identity(leaves, token), None

    def bwd(_, cts):
        ct_leaves, after = cts
        out = [None] * len(ct_leaves)
        keys = [(tuple(a for a, _ in s), tuple(m)) for s, m in zip(splits, sums)]
        for (split_axes, sum_axes), idx in _groups(keys).items():
            gs = [to_varying(ct_leaves[i], axes) for i in idx]
            done = {a for a_s in split_axes for a in a_s}
            rest = tuple(a for a in sum_axes if a not in done)
            dtype = jnp.result_type(*gs)
            if split_axes or rest:  # owned gradients (no collective) keep their dtype
                gs = [g.astype(reduce_dtype or dtype) for g in gs]
            for k in reversed(range(len(split_axes))):
                dims = [splits[i][k][1] for i in idx]
                after = scatter_flat(gs, dims, split_axes[k], after)
                gs = unscatter(after, gs, dims, split_axes[k])
            flat = jnp.concatenate([jnp.ravel(g) for g in gs]) + zero_from(after).astype(
                gs[0].dtype
            )
            if rest:
                flat = lax.psum(flat, rest)
            flat, offset = flat.astype(dtype) / n, 0
            for i, g in zip(idx, gs):
                out[i] = flat[offset : offset + g.size].reshape(g.shape).astype(ct_leaves[i].dtype)
                offset += g.size
            after = flat
        return out, to_varying(zero_from(after).astype(jnp.float32), axes)

    identity.defvjp(fwd, bwd)
    return identity


def reduce_in_backward_manual(params, plan, axes, n: int | None = None, splits=None, sums=None,
                              reduce_dtype=None, gather_dtype=None):  # fmt: skip
    """``reduce_in_backward`` for a step manual over every mesh axis in ``axes`` (the trunk
    data parallel over all devices, as under a class-sharded head). ``splits``:
    ``{path: ((mesh axes, dim), ...)}`` of the parameters this device holds a block of and
    computes with whole (FSDP, or a trunk weight the rules split over ``model``): gathered
    in the forward pass, their gradients reduce-scattered back to the block. ``sums``:
    ``{path: axes}`` for parameters whose gradient sums over other axes than all of
    ``axes`` (a sharded head's kernel: over the axes it is replicated on; none where every
    device owns its classes); they are not gathered. Every gradient is divided by ``n``
    (default: the devices over ``axes``).
    """
    splits, sums = splits or {}, sums or {}
    by_path = arrays_by_path(params)
    check_plan_covers(plan, by_path, "parameters")
    axes = axis_names(axes)
    check_bound(axes, "reduce_in_backward_manual")
    if n is None:  # the mean over the axes, as reduce_in_backward's
        n = axes_size(axes)
    out = dict(by_path)
    token = to_varying(jnp.zeros((), jnp.float32), axes)
    for bucket in reversed(plan):
        identity = _manual_bucket_identity(
            axes, n, reduce_dtype,
            tuple(tuple(splits.get(p, ())) for p in bucket),
            tuple(tuple(sums.get(p, axes)) for p in bucket),
            gather_dtype,
        )  # fmt: skip
        leaves, token = identity([by_path[p] for p in bucket], token)
        out.update(zip(bucket, leaves))
    return rebuilt_tree(params, out)


__all__ = ["reduce_in_backward", "reduce_in_backward_manual"]
