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

Call ``reduce_in_backward`` inside ``jax.shard_map`` on replicated (invariant) parameters;
``jax.grad`` through it returns the gradients already averaged over ``axes`` and
replicated. Data-parallel axes only: a parameter split over ``fsdp`` or ``model`` is not
supported here (use ``comm.mode=bucketed`` or ``xla``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridpar.parallel.bucketed import (
    Path,
    _path_of,
    _zero_from,
    flat_pmean,
    to_varying,
)


def _bucket_identity(axes: tuple[str, ...], n: int, reduce_dtype):
    """``(leaves, token) -> (leaves, token)``: the identity whose backward rule averages the
    leaves' cotangents over ``axes`` with one psum, after the token's cotangent."""

    @jax.custom_vjp
    def identity(leaves, token):
        return [to_varying(x, axes) for x in leaves], token

    def fwd(leaves, token):
        return identity(leaves, token), None

    def bwd(_, cts):
        ct_leaves, ct_token = cts
        out = flat_pmean(list(ct_leaves), axes, n, after=ct_token, reduce_dtype=reduce_dtype)
        # The next bucket's reduction (earlier layers) follows this one: see the docstring.
        return out, _zero_from(out[0]).astype(ct_token.dtype)

    identity.defvjp(fwd, bwd)
    return identity


def reduce_in_backward(params, plan: list[list[Path]], axes, n: int, reduce_dtype=None):
    """``params`` with each bucket of ``plan`` wrapped in ``_bucket_identity``: the same
    values (per-device), whose gradients reduce bucket by bucket in the backward pass.

    ``n``: the number of devices over ``axes`` (the mean's divisor). ``reduce_dtype``: the
    dtype each bucket is summed in (None: the gradients' own); the gradients come back in
    their own dtypes.
    """
    by_path = {_path_of(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    planned = [p for bucket in plan for p in bucket]
    if sorted(map(str, planned)) != sorted(map(str, by_path)):
        raise ValueError("the bucket plan does not cover the parameters exactly once each")
    out = dict(by_path)
    token = jnp.zeros((), jnp.float32)
    identity = _bucket_identity(tuple(axes), n, reduce_dtype)
    for bucket in reversed(plan):  # forward order: the token passes from stem to head
        leaves, token = identity([by_path[p] for p in bucket], token)
        out.update(zip(bucket, leaves))
    return jax.tree_util.tree_map_with_path(lambda kp, _: out[_path_of(kp)], params)


__all__ = ["reduce_in_backward"]
