"""Explicitly bucketed gradient reduction (``comm.mode=bucketed``), data parallel only.

Under ``jax.jit`` XLA inserts one all-reduce per gradient (and per BatchNorm statistic), and
whether it fuses them is up to the backend (the CPU backend keeps ~100 separate ops for a
ResNet-50). Here the step runs under ``jax.shard_map`` instead: each device computes the
loss and gradients of its own slice of the batch, then the gradients are flattened into
buckets of at most ``bucket_mb`` MiB (a gradient larger than that is a bucket of its own:
the only bucket over the size) and each bucket is reduced with ONE ``psum`` over the
data axes. Buckets are filled in reverse layer order (the last layers' gradients come out of
the backward pass first), so a backend with asynchronous collectives and a latency-hiding
scheduler can reduce the first buckets while the backward pass goes on, as Horovod, PyTorch
DDP and MoXing do. The loss and the BatchNorm running statistics share one more ``psum``.
The optimizer update then runs under ``jax.jit`` on the replicated parameters, exactly as in
``hybridpar.program.steps.make_train_step``, so the two steps are numerically equal.

FSDP (``fsdp`` > 1): parameters split over ``fsdp`` (by the partitioning rules, passed in
as the state ``shardings``) are gathered before the forward pass with ONE ``all_gather`` per bucket
(buckets in forward order), and their gradients are reduced with ONE ``psum_scatter`` per
bucket over ``fsdp`` (plus one ``psum`` over ``data`` when both axes are > 1), so each
device keeps only its shard of the gradient, as ZeRO/FSDP do. Small parameters the rules
leave replicated are reduced with one more ``psum`` per bucket. The optimizer then updates
each shard where it lives.

``comm.mode=overlap`` (``hybridpar/parallel/overlap.py``) uses the same plan and collectives
(``flat_gather``, ``reduce_bucket``), but issues each bucket's from inside the forward and
backward passes (a custom VJP per bucket).

Limits of ``comm.mode=bucketed``: a ``model`` axis > 1 is an error (``comm.mode=overlap``
or ``xla`` run it), and parameters may be split over ``fsdp`` only.

This module is the parallel layer's part: bucket planning and the collectives in buckets,
on plain pytrees of arrays and specs; it knows no train state, step or precision. The
gradient sync that wraps a train step with them, ``BucketedSync``, is ``hybridpar/program/sync.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.parallel.mesh import (
    BATCH_AXES,
    axes_size,
    axes_with_devices,
    axis_names,
    batch_axes,
)
from hybridpar.parallel.partitioning import (
    is_box,
    path_parts,
    path_str,
    rebox_leaf,
    shortlist,
    unbox_leaf,
)

Path = tuple  # a parameter's path in the nested params dict, e.g. ("head", "kernel")


def _nbytes_and_dtype(x) -> tuple[int, np.dtype]:
    x = unbox_leaf(x)
    return int(math.prod(np.shape(x))) * np.dtype(x.dtype).itemsize, np.dtype(x.dtype)


def _leaves_in_order(tree, prefix: Path = ()):
    """``(path, leaf)`` in forward order: a Mapping's items in insertion order (jax.tree.leaves
    would sort dict keys), any other pytree node's children in the order JAX flattens them
    (a list's or tuple's by index). Path parts are strings, as ``_path_of`` gives them (an
    NNX layer list's int keys too); a box (Flax axis box, NNX Variable) is one leaf."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves_in_order(v, prefix + (str(k),))
        return
    if is_box(tree):
        yield prefix, tree
        return
    # One level of JAX's own flattening: the node's children with their keys.
    children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(children) == 1 and children[0][0] == ():  # not a pytree node: a leaf
        yield prefix, tree
        return
    for kp, child in children:  # None (an empty node) yields nothing, as JAX's leaves
        yield from _leaves_in_order(child, prefix + path_parts(kp))


def forward_params(model, input_shape, dtype=jnp.float32, **init_kwargs):
    """The model's parameters (abstract, unboxed) in the order ``model.init`` creates them.

    That is the forward (layer) order for linen modules. ``jax.eval_shape`` alone would not
    do: its output is rebuilt by ``tree_unflatten``, which sorts dict keys, so the order is
    read inside the traced function; so is ``jax.jit(model.init)``'s, which is why a plan
    from jitted parameters buckets in alphabetical order. The dummy input is zeros of
    ``input_shape`` in ``dtype`` (``jnp.int32`` for a model whose input is token ids, as
    ``nn.Embed`` takes). ``init_kwargs`` go to ``model.init`` as they are, e.g.
    ``train=False`` for a model that takes it.
    """
    seen = []

    def init():
        variables = model.init(jax.random.key(0), jnp.zeros(input_shape, dtype), **init_kwargs)
        seen.append(
            [
                (p, jax.ShapeDtypeStruct(np.shape(unbox_leaf(x)), unbox_leaf(x).dtype))
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

    ``params`` is a pytree in forward order: nested dicts as ``model.init`` creates them (or
    ``forward_params``), lists and tuples of layers, an NNX State (whose keys come sorted,
    so its plan goes alphabetically); its leaves are arrays, ShapeDtypeStructs, Flax axis
    boxes or NNX Variables (each one leaf, as ``infer_shardings`` takes them). Leaves
    are taken in REVERSE order and packed greedily: a bucket closes when the next gradient
    would take it over ``bucket_mb`` MiB or has another dtype, so a bucket of several
    gradients holds at most ``bucket_mb`` MiB; a gradient larger than ``bucket_mb`` gets a
    bucket of its own. Every parameter is in exactly one bucket. Sizes are the parameters'
    own (a reduction in a narrower ``reduce_dtype`` moves fewer bytes).
    """
    if not bucket_mb > 0:
        raise ConfigError(
            f"bucket_mb={bucket_mb!r} (comm.bucket_mb in a config): the bucket size must be "
            "> 0 MiB, e.g. 4"
        )
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
    # The keys themselves, not path_str's string split at "/": a key may hold a "/".
    return path_parts(keypath)


def arrays_by_path(tree) -> dict:
    """``{path: array}`` for ``tree``'s arrays, with the paths ``bucket_plan`` gives: an NNX
    Variable or a Flax axis box is one leaf (its path has no ``value``), its array unboxed."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    return {_path_of(kp): unbox_leaf(x) for kp, x in flat}


def rebuilt_tree(tree, arrays: Mapping):
    """``tree`` with each array replaced by ``arrays[its path]``, in the same boxes."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: rebox_leaf(x, arrays[_path_of(kp)]), tree, is_leaf=is_box
    )


def unbound_axis(axes) -> str | None:
    """The first of ``axes`` (one mesh axis name or several) that is not bound here (no
    ``jax.shard_map`` over it), else None. A collective over it would fail deep inside JAX
    (an unbound-axis NameError, or an assertion)."""
    for a in axis_names(axes):
        try:
            lax.axis_size(a)
        except NameError:
            return a
    return None


def check_bound(axes, name: str) -> None:
    """ConfigError unless ``name`` runs inside a ``jax.shard_map`` over every axis of ``axes``,
    saying which axes the shard_map here has."""
    a = unbound_axis(axes)
    if a is None:
        return
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if manual:
        raise ConfigError(
            f"{name}: mesh axis {a!r} is not one of the axes of the jax.shard_map it runs in, "
            f"{manual}; name that shard_map's data axes, e.g. axes=active_axes(mesh)"
        )
    raise ConfigError(
        f"{name} runs inside a jax.shard_map over {axis_names(axes)}, and here it runs outside "
        "any; call it in the function jax.shard_map runs, as docs/communication.md shows"
    )


def _varying(x) -> frozenset:
    """The mesh axes ``x`` varies over inside shard_map (its type's, per JAX version)."""
    aval = jax.typeof(x)
    return aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma


def to_varying(x, axes):
    """Marks ``x`` as per-device (varying over ``axes``: one axis name or a tuple) for
    shard_map's type system.

    Without it, ``jax.grad`` with respect to a replicated (invariant) parameter makes JAX
    insert a ``psum`` per parameter itself: its gradient comes out already summed over
    ``axes`` (``reduce_in_buckets`` refuses such gradients).
    """
    missing = tuple(a for a in axis_names(axes) if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def check_not_summed(grads_by_path: Mapping, axes) -> None:
    """ConfigError if some gradients are already summed over ``axes`` (of > 1 device).

    Under shard_map's type checks (``check_vma=True``, the default) the gradient of a
    parameter that is invariant over an axis comes out invariant: JAX has summed it over
    that axis already (the transpose of the implicit broadcast is a psum), and summing it
    again would make it that many times too large. With ``check_vma=False`` nothing is
    typed varying and ``jax.grad`` sums nothing, so there is nothing to check.
    """
    split = tuple(a for a in axis_names(axes) if lax.axis_size(a) > 1)
    summed = [p for p, g in grads_by_path.items() if set(split) - _varying(g)]
    if not summed:
        return
    # An invariant scalar cast to varying stays untyped when type checks are off.
    if not set(split) <= _varying(to_varying(jnp.zeros((), jnp.float32), split)):
        return
    raise ConfigError(
        f"gradients {shortlist(['/'.join(map(str, p)) for p in summed], 3)} are not varying over "
        f"{split}: the parameters were replicated (invariant) when jax.grad took them, so JAX "
        "has already summed these gradients over the devices, and reduce_in_buckets would sum "
        "them again; make the parameters varying before taking the gradient: "
        "params = jax.tree.map(lambda p: to_varying(p, axes), params)"
    )


def zero_from(x):
    """A scalar 0 that XLA cannot fold away, computed from ``x``: min(|x[0]|, 0) is 0 for
    every finite or infinite value (a NaN stays NaN, and a NaN step is skipped or
    diverged anyway). Adding it changes no value, but orders one psum after another."""
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return jnp.minimum(jnp.abs(first), 0.0)


def flat_pmean(leaves, axes, n, after=None, reduce_dtype=None, concat=True):
    """Mean over devices of several arrays with ONE psum of their concatenation.

    ``reduce_dtype``: the dtype the concatenation is summed in (None: the arrays' own);
    each result comes back in its array's dtype. ``concat=False``: one psum of the arrays
    as they are (one all-reduce of several operands), for arrays split over an axis the
    compiler partitions (``model``), which a concatenation would gather whole first.

    ``after``: an array from an earlier psum that this one must follow. The data dependence
    keeps XLA's all-reduce combiner, which merges independent all-reduces (on CPU into one
    op at the end of the step), from fusing the buckets back together: each bucket stays
    one collective that can start as soon as its own gradients and the previous bucket are
    done, while the backward pass goes on. (``lax.optimization_barrier`` does not do it:
    the CPU and GPU compilers drop barriers before combining.)
    """
    leaves = [to_varying(x, axes) for x in leaves]
    if not leaves:
        return []
    if not concat:
        if after is not None:
            leaves[0] = leaves[0] + zero_from(after).astype(leaves[0].dtype)
        summed = lax.psum([x.astype(reduce_dtype or x.dtype) for x in leaves], axes)
        return [(s.astype(x.dtype) / n).astype(x.dtype) for s, x in zip(summed, leaves)]
    dtype = jnp.result_type(*leaves)
    flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])
    if after is not None:
        flat = flat + zero_from(after).astype(flat.dtype)
    flat = lax.psum(flat.astype(reduce_dtype or dtype), axes).astype(dtype) / n
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return out


def _as_rows(x, dim: int, rows: int):
    """``x`` as ``(rows, -1)``: row i holds shard i of ``x`` split along ``dim``."""
    return jnp.moveaxis(x, dim, 0).reshape(rows, -1)


def _from_rows(flat, shape, dim: int):
    """Inverse of ``_as_rows``: the rows of ``flat``, in order, as an array of ``shape``
    (row i filling block i of ``dim``)."""
    moved = (shape[dim],) + tuple(np.delete(np.asarray(shape), dim))
    return jnp.moveaxis(flat.reshape(moved), 0, dim)


def _with_dim(shape, dim: int, size: int) -> tuple:
    return tuple(size if i == dim else s for i, s in enumerate(shape))


def scatter_flat(leaves, dims, axes, after=None):
    """ONE ``psum_scatter`` over ``axes`` of the leaves' concatenation, laid out so that
    block i of every leaf (along ``dims``) lands on device i: their sums, this device's
    blocks of them, as ``(1, total / k)`` (``unscatter`` splits it), after ``after``."""
    k, dtype = axes_size(axes), jnp.result_type(*leaves)
    flat = jnp.concatenate([_as_rows(x, d, k).astype(dtype) for x, d in zip(leaves, dims)], 1)
    if after is not None:
        flat = flat + zero_from(after).astype(flat.dtype)
    return lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)


def unscatter(flat, leaves, dims, axes) -> list:
    """``scatter_flat``'s result as this device's blocks of ``leaves`` (in ``flat``'s dtype)."""
    k, out, offset = axes_size(axes), [], 0
    for x, d in zip(leaves, dims):
        size = x.size // k
        out.append(_from_rows(flat[:, offset : offset + size],
                              _with_dim(x.shape, d, x.shape[d] // k), d))  # fmt: skip
        offset += size
    return out


def _flat_scatter_mean(leaves, dims, axes, n, after=None, reduce_dtype=None):
    """Mean over the data-parallel devices of several FSDP-split gradients, each device
    keeping only its own ``fsdp`` shard: ONE ``psum_scatter`` over ``fsdp`` of their
    concatenation (``scatter_flat``), then one ``psum`` over ``data`` of the (fsdp times
    smaller) result if ``data`` is in ``axes``. Both sum in ``reduce_dtype`` (None: the
    gradients' own dtype)."""
    leaves = [to_varying(x, axes) for x in leaves]
    dtype = jnp.result_type(*leaves)
    flat = scatter_flat([x.astype(reduce_dtype or dtype) for x in leaves], dims, "fsdp", after)
    if "data" in axes:
        flat = lax.psum(flat, "data")
    flat = flat.astype(dtype) / n
    return [b.astype(x.dtype) for b, x in zip(unscatter(flat, leaves, dims, "fsdp"), leaves)]


def flat_gather(shards, dims, after=None, axes="fsdp"):
    """Whole arrays from their shards over ``axes`` (``fsdp``, or a tuple of mesh axes
    gathered as one; ``dims``: the dimension each is split along) with ONE ``all_gather``
    of their concatenation, after ``after`` if given (see ``flat_pmean``). Returns the
    arrays and the gathered concatenation (an ``after`` for the next gather)."""
    k = axes_size(axes)
    dtype = jnp.result_type(*shards)
    flat = jnp.concatenate([_as_rows(x, d, 1).astype(dtype) for x, d in zip(shards, dims)], 1)
    if after is not None:
        flat = flat + zero_from(after).astype(flat.dtype)
    flat = lax.all_gather(flat, axes, axis=0, tiled=True)  # (k, total / k)
    out, offset = [], 0
    for x, d in zip(shards, dims):
        piece = flat[:, offset : offset + x.size]
        out.append(_from_rows(piece, _with_dim(x.shape, d, x.shape[d] * k), d).astype(x.dtype))
        offset += x.size
    return out, flat


def gather_in_buckets(params, plan, shard_dims: Mapping, after=None):
    """Full parameters from their ``fsdp`` shards, ONE ``all_gather`` per bucket.

    Call inside ``jax.shard_map``. The buckets go in forward order (the reverse of ``plan``,
    which is the gradient order) so the first layers' parameters arrive first. Parameters
    with no entry in ``shard_dims`` (replicated) pass through.
    """
    if any(d is not None for d in shard_dims.values()):
        check_bound("fsdp", "gather_in_buckets")
    by_path = arrays_by_path(params)
    full = dict(by_path)
    for bucket in reversed(plan):
        paths = [p for p in reversed(bucket) if shard_dims.get(p) is not None]
        if not paths:
            continue
        dims = [shard_dims[p] for p in paths]
        out, after = flat_gather([by_path[p] for p in paths], dims, after)
        full.update(zip(paths, out))
    return rebuilt_tree(params, full)


def reduce_bucket(leaves, dims, axes, n, after=None, reduce_dtype=None, concat=True):
    """One bucket's mean over the devices of ``axes``: the gradients split over ``fsdp``
    (``dims[i]``: the dimension, None for a whole one) with one ``psum_scatter`` (each
    device keeps its shard), the whole ones with one ``psum``, each after ``after``.
    Returns the means in ``leaves``' order and the last result (the next bucket's
    ``after``)."""
    out = [None] * len(leaves)
    for split in (True, False):
        idx = [i for i, d in enumerate(dims) if (d is not None) == split]
        if not idx:
            continue
        part = [leaves[i] for i in idx]
        if split:
            got = _flat_scatter_mean(part, [dims[i] for i in idx], axes, n, after, reduce_dtype)
        else:
            got = flat_pmean(part, axes, n, after, reduce_dtype, concat)
        for i, g in zip(idx, got):
            out[i] = g
        after = got[0]
    return out, after


def reduce_in_buckets(
    grads,
    plan,
    axes=BATCH_AXES,
    n: int | None = None,
    after=None,
    shard_dims=None,
    reduce_dtype=None,
):
    """Mean of ``grads`` over the devices of ``axes``, one ``psum`` per bucket of ``plan``.

    Call inside ``jax.shard_map`` over ``axes`` (else a ConfigError); ``grads`` is any pytree
    holding the plan's paths (an NNX State too). ``axes``: one mesh axis name or a
    tuple of them. The gradients must be each device's own, taken with respect to
    parameters made varying over ``axes``
    (``to_varying``): a gradient JAX has already summed is a ConfigError. The buckets are
    reduced in plan order, each after the previous one (and after ``after``, if given), so
    they stay separate collectives. ``shard_dims`` (FSDP) maps a path to the dimension its
    parameter is split along over ``fsdp``: those gradients are reduce-scattered (one
    ``psum_scatter`` per bucket) and come back as this device's shard. ``reduce_dtype``: the
    dtype each bucket is summed in (None: the gradients' own); the means come back in the
    gradients' dtypes.
    """
    axes = axis_names(axes)
    shard_dims = shard_dims or {}
    by_path = arrays_by_path(grads)
    check_plan_covers(plan, by_path, "gradients")
    check_bound(axes, "reduce_in_buckets")
    if n is None:
        n = axes_size(axes)
    check_not_summed(by_path, axes)
    reduced = {}
    for bucket in plan:
        dims = [shard_dims.get(p) for p in bucket]
        out, after = reduce_bucket([by_path[p] for p in bucket], dims, axes, n, after,
                                   reduce_dtype)  # fmt: skip
        reduced.update(zip(bucket, out))
    return rebuilt_tree(grads, reduced)


def check_plan_covers(plan, paths, what: str) -> None:
    """ConfigError unless ``plan`` holds each of ``paths`` exactly once (``what``: the tree's
    name in the message), naming up to 3 missing, extra and repeated paths."""
    planned = [tuple(p) for bucket in plan for p in bucket]
    have, counts = {tuple(p) for p in paths}, Counter(planned)
    missing = [p for p in paths if tuple(p) not in counts]
    extra = [p for p in counts if p not in have]
    twice = [p for p, n in counts.items() if n > 1]
    if not (missing or extra or twice):
        return

    def listed(ps):
        return shortlist(["/".join(map(str, p)) for p in ps], 3)

    problems = []
    if missing:
        problems.append(f"missing from the plan: {listed(missing)}")
    if extra:
        problems.append(f"in the plan but not the {what}: {listed(extra)}")
    if twice:
        problems.append(f"in the plan more than once: {listed(twice)}")
    raise ConfigError(
        f"the bucket plan does not cover the {what} exactly once each ({'; '.join(problems)}); "
        "make the plan from the same tree, e.g. bucket_plan(variables['params'], ...) for the "
        "gradients of the params"
    )


def is_spec(x) -> bool:
    return isinstance(x, (P, jax.sharding.NamedSharding))


def fsdp_dims(specs) -> dict[Path, int]:
    """``{path: dim}`` for the arrays whose spec splits a dimension over ``fsdp``.

    ``specs``: a tree of ``PartitionSpec`` or ``NamedSharding`` (parameters or BatchNorm
    statistics). A spec naming ``data`` (an array split over the batch axis) is an error.
    """
    dims = {}
    for kp, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        spec = getattr(spec, "spec", spec)
        for d, entry in enumerate(spec):
            axes = axis_names(entry)
            if "data" in axes:
                raise ConfigError(
                    f"parameter {path_str(kp)!r} is split over 'data' ({spec}), and the "
                    "bucketed reduction (comm.mode=bucketed in a config) splits parameters "
                    "over 'fsdp' only; split it over 'fsdp' (or use comm.mode=xla)"
                )
            if "fsdp" in axes:
                dims[_path_of(kp)] = d
    return dims


def active_axes(mesh) -> tuple[str, ...]:
    """The data-parallel axes of ``mesh`` with more than one device.

    The step names only these (see ``mesh.axes_with_devices``); on one device, all those
    the mesh has (shard_map refuses an axis it lacks, such as ``fsdp`` on a user's own
    ``jax.make_mesh((1,), ("data",))``).
    """
    return axes_with_devices(mesh, BATCH_AXES) or batch_axes(mesh)


__all__ = [
    "active_axes",
    "bucket_plan",
    "check_bound",
    "check_not_summed",
    "check_plan_covers",
    "flat_pmean",
    "forward_params",
    "fsdp_dims",
    "flat_gather",
    "scatter_flat",
    "unscatter",
    "gather_in_buckets",
    "is_spec",
    "reduce_bucket",
    "reduce_in_buckets",
    "to_varying",
]
