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

Call ``reduce_in_backward`` inside ``jax.shard_map``; ``jax.grad`` through it returns the
gradients already averaged over ``axes``. FSDP: a bucket's parameters split over ``fsdp``
are gathered whole by the identity's forward rule (one all_gather per bucket, in forward
order) and their gradients reduce-scattered back to the shard by its backward rule (one
psum_scatter per bucket), as ZeRO-3 does. A ``model`` axis is the compiler's
(``OverlapSync`` leaves it out of the shard_map's manual axes); its split gradients are
reduced as they are, since concatenating them would gather them whole first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridpar.parallel.bucketed import (
    Path,
    _path_of,
    _zero_from,
    flat_gather,
    reduce_bucket,
    to_varying,
)


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
            token = token + _zero_from(flat).astype(token.dtype)  # the next gather follows
        return out, token

    def fwd(leaves, token):
        return identity(leaves, token), None

    def bwd(_, cts):
        ct_leaves, ct_token = cts
        out, last = reduce_bucket(list(ct_leaves), list(dims), axes, n, ct_token, reduce_dtype,
                                  concat)  # fmt: skip
        # The next bucket's reduction (earlier layers) follows this one: see the docstring.
        return out, to_varying(_zero_from(last).astype(ct_token.dtype), axes)

    identity.defvjp(fwd, bwd)
    return identity


def reduce_in_backward(params, plan: list[list[Path]], axes, n: int, reduce_dtype=None,
                       shard_dims=None, concat=True, gather_dtype=None):  # fmt: skip
    """``params`` with each bucket of ``plan`` wrapped in ``_bucket_identity``: the same
    values (per-device, whole), whose gradients reduce bucket by bucket in the backward pass.

    ``n``: the number of devices over ``axes`` (the mean's divisor). ``reduce_dtype``: the
    dtype each bucket is summed in (None: the gradients' own); the gradients come back in
    their own dtypes. ``shard_dims`` (FSDP): ``{path: dim}`` of the parameters this device
    holds a shard of (split along ``dim`` over ``fsdp``): gathered in the forward pass, their
    gradients reduce-scattered back to the shard. ``concat=False``: each bucket's whole
    gradients are summed as they are, not concatenated (``flat_pmean``), as a ``model`` axis
    the compiler partitions needs. ``gather_dtype`` (FSDP): the dtype the split kernels
    (arrays of 2 or more dimensions) are gathered in, the model's compute dtype, which every
    layer casts its kernel to anyway: the same values in half the bytes.
    """
    shard_dims = shard_dims or {}
    by_path = {_path_of(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    planned = [p for bucket in plan for p in bucket]
    if sorted(map(str, planned)) != sorted(map(str, by_path)):
        raise ValueError("the bucket plan does not cover the parameters exactly once each")
    out = dict(by_path)
    # Per-device over ``axes`` from the start, so that its type is the same before and after
    # a bucket whose gathered parameters it follows (custom_vjp checks the cotangent's type).
    token = to_varying(jnp.zeros((), jnp.float32), tuple(axes))
    for bucket in reversed(plan):  # forward order: the token passes from stem to head
        dims = tuple(shard_dims.get(p) for p in bucket)
        identity = _bucket_identity(tuple(axes), n, reduce_dtype, dims, concat, gather_dtype)
        leaves, token = identity([by_path[p] for p in bucket], token)
        out.update(zip(bucket, leaves))
    return jax.tree_util.tree_map_with_path(lambda kp, _: out[_path_of(kp)], params)


__all__ = ["reduce_in_backward"]
