"""Classifier heads whose logits are never gathered (``model.head``): for 100k-1M classes.

A 1M-class head on 2048-d features is 2G parameters (8 GB in float32, as much again per
optimizer buffer) and a batch x 1M logits tensor; pure data parallelism replicates all of
it on every device. ``model.head`` chooses the plan:

``dense``       the model's own ``Dense`` under ``jax.jit``: XLA places the logits (today's
                behaviour; the ``hybrid`` preset splits the kernel over ``model``).
``sharded``     kernel ``(embed, classes)`` split over ``model`` along the classes. The
                features are all-gathered over ``model``, so each device computes the
                logits of its data slice for its classes, ``(B/d, C/m)``. The kernel is
                replicated over the data axes: its gradient is all-reduced over them,
                ``C*E/m`` values per device per step.
``partial_fc``  kernel split over EVERY device (data x fsdp x model) and the features
                all-gathered over all of them, for the head only (the model-parallel FC
                of Partial FC, An et al. 2021, without its class sampling): each device
                computes the logits of the whole batch for its ``C/n`` classes. Every
                device owns its classes and sees the whole batch, so the kernel's gradient
                needs no reduction at all; the features go out (all-gather) and their
                gradient comes back (reduce-scatter): ``B*E`` each.

In both, the trunk is data parallel over every device, as in the classic data-model hybrid
(Krizhevsky 2014: data-parallel convolutions, model-parallel classifier): its batch is split
over all mesh axes (the input arrives split over data x fsdp, and each device of a model
group keeps its own part: no communication), so no device computes an example twice. A
trunk weight that the rules split over ``model`` (the ``hybrid`` preset) is then gathered
for use like an FSDP weight.

When ``partial_fc`` is the cheaper plan: it moves ~``2*B*E`` per step, ``sharded`` ~``2*B*E/d``
plus the ``C*E/m`` all-reduce of the kernel's gradient, so partial-FC wins whenever the global
batch ``B`` is below ``C/m`` (1M classes, ``m=8``: 1,024 against 125,000). It also holds
``C*E/n`` of the kernel and optimizer state per device instead of ``C*E/m``, and needs no
``model`` axis. The logits take ``B*C/n`` per device in both. ``sharded`` wins for smaller
class counts at large batches (``B > C/m``).

Both run the matmul, softmax cross-entropy and top-k under ``jax.shard_map``, each device
holding its own block of classes, with the collectives written out:

* loss: ``logsumexp_c z - (1-eps) z_label - eps/C sum_c z`` (label smoothing ``eps``), from
  each shard's max (one ``pmax``) and its sum of exponentials, label logit and sum of
  logits (one ``psum`` of the three): ``O(B)`` values, whatever ``C``.
* top-k: an example is a top-k hit iff fewer than k classes rank above its label (higher
  logit, or an equal one with a lower class id, which is ``lax.top_k``'s order), so the
  ranks of all examples need one ``psum`` of ``B`` integers and no gather of anything.

The model stays free of collectives: it returns its features (``return_features=True``)
and the step applies ``params["head"]`` here. Doing the matmul inside ``shard_map`` (rather
than keeping the ``Dense`` in the model and constraining its output) pins exactly what is
communicated, instead of leaving XLA free to gather a 1M-wide tensor.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.parallel.bucketed import unbound_axis
from hybridpar.parallel.mesh import AXES, axes_size, axes_with_devices, axis_names, batch_axes
from hybridpar.parallel.partitioning import Rules


def _shard_offset(logits, axis):
    """This device's first class id: shards are consecutive blocks in ``axis`` order."""
    return lax.axis_index(axis) * logits.shape[-1]


def _my_label_logit(z, labels, axis):
    """The label's logit where this device holds the label's class, else 0: ``(B,)``."""
    local = labels - _shard_offset(z, axis)
    mine = (local >= 0) & (local < z.shape[-1])
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[:, None], axis=-1)
    return jnp.where(mine, picked[:, 0], 0.0)


def _check_inside(axis, name: str) -> None:
    """``axis`` is bound: ``name`` runs inside a ``jax.shard_map`` over it (JAX's own error
    is an unbound-axis NameError deep in the collectives)."""
    a = unbound_axis(axis)
    if a is not None:
        raise ConfigError(
            f"{name} runs inside a jax.shard_map over the axis {a!r} that splits the "
            f"classes, on each device's block of logits; here {a!r} is not bound. Call it "
            f"in a shard_map over {a!r}, or use ShardedHead(mesh, {a!r})(features, params, "
            "labels), which runs it there on whole arrays"
        )


def sharded_cross_entropy(logits, labels, label_smoothing: float, axis):
    """Per-example softmax cross-entropy of class-sharded logits. It runs inside a
    ``jax.shard_map`` over ``axis`` (``model`` for ``model.head=sharded``), on each device's
    block of classes; outside one, ``ShardedHead`` runs it there.

    ``logits``: ``(B, C_local)``, this device's block of classes (block ``axis_index(axis)``
    of the ``C = C_local * axis_size`` classes); ``labels``: ``(B,)`` global class ids, the
    same on every device of ``axis``; ``axis``: the mesh axis (or tuple of axes) the classes
    are split over. Returns ``(B,)`` float32, equal on every device of ``axis``; equal to
    ``steps.cross_entropy`` of the whole logits.
    """
    _check_inside(axis, "sharded_cross_entropy")
    z = logits.astype(jnp.float32)
    num_classes = z.shape[-1] * axes_size(axis)
    # The max only keeps exp() in range; logsumexp does not depend on it, so no gradient.
    m = lax.pmax(jnp.max(lax.stop_gradient(z), axis=-1), axis)
    parts = [jnp.sum(jnp.exp(z - m[:, None]), axis=-1), _my_label_logit(z, labels, axis)]
    if label_smoothing:
        parts.append(jnp.sum(z, axis=-1))  # smoothing puts eps/C on every class
    sums = lax.psum(jnp.stack(parts), axis)  # one collective for all three
    loss = m + jnp.log(sums[0]) - (1.0 - label_smoothing) * sums[1]
    if label_smoothing:
        loss = loss - label_smoothing / num_classes * sums[2]
    return loss


def label_rank(logits, labels, axis):
    """How many classes rank above each example's label (``lax.top_k`` order: higher logit
    first, ties to the lower class id); inside ``jax.shard_map``, ``(B,)`` int32."""
    z = logits.astype(jnp.float32)
    zl = lax.psum(_my_label_logit(lax.stop_gradient(z), labels, axis), axis)[:, None]
    ids = _shard_offset(z, axis) + jnp.arange(z.shape[-1])
    above = (z > zl) | ((z == zl) & (ids[None, :] < labels[:, None]))
    return lax.psum(jnp.sum(above, axis=-1, dtype=jnp.int32), axis)


def sharded_topk_hits(logits, labels, k: int, axis):
    """Whether each label is among the top ``k`` classes of class-sharded logits, without
    gathering them, ``(B,)`` bool. As ``sharded_cross_entropy``, it runs inside a
    ``jax.shard_map`` over ``axis`` (``model`` for ``model.head=sharded``)."""
    _check_inside(axis, "sharded_topk_hits")
    return label_rank(logits, labels, axis) < k


def class_axes(kind: str, mesh) -> tuple[str, ...]:
    """The mesh axes a ``model.head`` of ``kind`` (``sharded`` or ``partial_fc``) splits the
    classes over: ``model``, or every axis with devices (``AXES`` order: batch axes first)."""
    if kind == "sharded":
        return ("model",)
    return axes_with_devices(mesh, AXES) or ("model",)


@dataclasses.dataclass(frozen=True)
class ShardedHead:
    """Applies the head ``params["head"]`` (``kernel (E, C)``, ``bias (C,)``) to features
    ``(B, E)`` and returns per-example loss (and top-k hits) without gathering the logits.

    ``class_axes``: mesh axes the classes are split over (one name or a tuple).
    ``batch_axes``: mesh axes the trunk's batch, and so the features, are split over, as
    ``P(batch_axes)`` splits them (any order); by default the data axes (``data``, ``fsdp``)
    that the mesh has. The features are all-gathered over the batch axes that also split the
    classes, so that every device holding a block of classes sees every example of its batch
    slice. The per-example outputs are in the order of the features. The class count must be
    a multiple of ``num_shards``.
    """

    mesh: Mesh
    class_axes: tuple[str, ...]
    batch_axes: tuple[str, ...] | None = None

    def __post_init__(self):
        # "model" is one axis, not the axes "m", "o", ...; a list becomes a (hashable) tuple.
        for name in ("class_axes", "batch_axes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, axis_names(getattr(self, name)))
        if self.batch_axes is None:  # a mesh of the user's own may lack fsdp (or data)
            object.__setattr__(self, "batch_axes", batch_axes(self.mesh))
        for name in ("class_axes", "batch_axes"):
            missing = [a for a in getattr(self, name) if a not in self.mesh.axis_names]
            if missing:
                raise ConfigError(
                    f"ShardedHead {name}={getattr(self, name)}: {tuple(missing)} not among the "
                    f"mesh's axes {tuple(self.mesh.axis_names)}; name {name} from those"
                )

    @property
    def num_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.class_axes)

    @property
    def gather_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.batch_axes if a in self.class_axes)

    def rules(self) -> Rules:
        """The placement this head computes in: the classes over ``class_axes``."""
        return Rules(logical=(("classes", self.class_axes),))

    def split_batch(self, x):
        """``x`` (images) split over ``batch_axes`` for the trunk: where they are already
        split over fewer axes (the input's data x fsdp), each device just keeps its part."""
        where = NamedSharding(self.mesh, P(self.batch_axes))
        if AxisType.Explicit in self.mesh.axis_types:  # a constraint names only Auto axes
            return jax.reshard(x, where)
        return lax.with_sharding_constraint(x, where)

    def apply(
        self,
        model,
        variables,
        images,
        labels,
        *,
        train,
        label_smoothing=0.0,
        topk=(),
        policy=None,
        rngs=None,
    ):
        """Runs a Flax linen ``model``'s trunk, then this head: ``({"loss": (B,), "top{k}":
        (B,) bool for k in topk}, new model variables)`` (``batch_stats`` when ``train``).

        The model must return its features ``(B, E)`` from ``model.apply(variables, images,
        train=..., return_features=True)``, and keep its classifier's parameters at
        ``variables["params"]["head"]``: ``kernel (E, C)`` and ``bias (C,)``. ``rngs``: as
        ``model.apply`` takes them, e.g. ``{"dropout": key}`` for a model with Dropout in
        train mode. ``policy`` is unused: the matmul runs in the features' dtype and the
        softmax in float32."""
        del policy
        head = variables["params"].get("head")
        if not (hasattr(head, "keys") and {"kernel", "bias"} <= set(head.keys())):
            raise ConfigError(
                "ShardedHead.apply needs the classifier's parameters at params['head'] (kernel "
                f"(E, C), bias (C,)); the model's params have {sorted(variables['params'])}. "
                "Name the model's final Dense 'head', and have model.apply(..., "
                "return_features=True) return the features that feed it"
            )
        lacking = [k for k in ("train", "return_features") if not _call_takes(model, k)]
        if lacking:
            raise ConfigError(
                f"ShardedHead.apply: {type(model).__name__}.__call__ takes no "
                f"{' or '.join(lacking)} argument; the head needs a model whose "
                "__call__(x, train=..., return_features=False) returns the features (B, E) "
                "that feed its final Dense 'head' when return_features=True"
            )
        x = images if self._inside_manual() else self.split_batch(images)
        if train:
            features, new_vars = model.apply(
                variables, x, train=True, mutable=["batch_stats"], return_features=True, rngs=rngs
            )
        else:
            features = model.apply(variables, x, train=False, return_features=True, rngs=rngs)
            new_vars = {}
        classes = head["kernel"].shape[-1]
        ks = {k: min(k, classes) for k in _ks(topk)}  # fewer classes than k: every class is a hit
        topk = tuple(sorted(set(ks.values())))
        out = self(features, head, labels, label_smoothing=label_smoothing, topk=topk)
        hits = {f"top{k}": out[f"top{v}"] for k, v in ks.items()}
        return {"loss": out["loss"], **hits}, new_vars

    def _inside_manual(self) -> bool:
        """Whether this runs inside a ``jax.shard_map`` already manual over every axis the
        head names (a gradient sync's per-device step, ``sync.OverlapSync`` with a head):
        the inputs are then this device's, and the head's body runs as it is."""
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        mine = set(self.batch_axes) | set(self.class_axes)
        if manual and not mine <= manual:  # a shard_map over all axes cannot nest in it
            raise ValueError(
                f"the {'/'.join(self.class_axes)}-sharded head runs inside a shard_map manual "
                f"over {sorted(manual)} only; it needs every axis of {sorted(mine)} manual "
                "(the gradient sync must know the head: OverlapSync(head=...))"
            )
        return bool(manual)

    def local(self, x, kernel, bias, labels, *, label_smoothing: float = 0.0, topk=()):
        """The head on one device, inside a ``jax.shard_map`` manual over ``batch_axes`` and
        ``class_axes``: ``x`` and ``labels`` this device's slice of the batch, ``kernel``
        and ``bias`` its block of classes. Returns per-example ``loss`` (and ``top{k}``) of
        the slice gathered over ``gather_axes``: equal on every device of that group."""
        gather, cls = self.gather_axes, self.class_axes
        if gather:  # every example of this batch slice meets this device's classes
            x = lax.all_gather(x, gather, axis=0, tiled=True)
            labels = lax.all_gather(labels, gather, axis=0, tiled=True)
        z = x @ kernel.astype(x.dtype) + bias.astype(x.dtype)
        out = {"loss": sharded_cross_entropy(z, labels, label_smoothing, cls)}
        if topk:
            rank = label_rank(z, labels, cls)
            out.update({f"top{k}": rank < k for k in topk})
        return out

    def __call__(self, features, params, labels, *, label_smoothing: float = 0.0, topk=()):
        """``{"loss": (B,), "top{k}": (B,) bool for k in topk}``, per example (``topk``: a
        tuple of ks, or one k).

        ``features`` ``(B, E)``, ``params`` ``{"kernel": (E, C), "bias": (C,)}``, ``labels``
        ``(B,)`` integer class ids. A label outside ``[0, C)`` is not checked (it cannot be
        under jit): no class holds it, so its loss is the logsumexp of its logits (as if its
        label's logit were 0) and its top-k hits are meaningless.

        The matmul runs in the features' dtype (the model's compute dtype, as its ``Dense``
        would), softmax and loss in float32. Inside a shard_map manual over every axis
        (``_inside_manual``) the arrays are this device's and so is the result (``local``).
        """
        if not (hasattr(params, "keys") and {"kernel", "bias"} <= set(params.keys())):
            have = sorted(params.keys()) if hasattr(params, "keys") else type(params).__name__
            raise ConfigError(
                f"ShardedHead: params must be the head's {{'kernel': (E, C), 'bias': (C,)}}, "
                f"not {have}; pass the classifier's own, e.g. variables['params']['head']"
            )
        kernel, bias = params["kernel"], params["bias"]
        topk = _ks(topk)
        per_device = partial(self.local, label_smoothing=label_smoothing, topk=topk)
        if self._inside_manual():
            return per_device(features, kernel, bias, labels)
        _check_shapes(features, kernel, bias, labels)
        n, c = self.num_shards, kernel.shape[-1]
        if c % n:  # each shard holds an equal block of classes
            over = " x ".join(f"{a}:{self.mesh.shape[a]}" for a in self.class_axes)
            raise ConfigError(
                f"ShardedHead: {c} classes over {over} ({n} shards), and {c} is not a multiple "
                f"of {n}: pad the head to num_classes={-(-c // n) * n} (classes no label uses), "
                f"or split the classes over axes whose size divides {c}"
            )
        split = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        if features.shape[0] % split or labels.shape[0] != features.shape[0]:
            over = " x ".join(f"{a}:{self.mesh.shape[a]}" for a in self.batch_axes)
            raise ConfigError(
                f"ShardedHead: a batch of {features.shape[0]} features and {labels.shape[0]} "
                f"labels split over {over}; pass as many labels as features, in a batch "
                f"that is a multiple of {split}"
            )
        gather = self.gather_axes
        keep = tuple(a for a in self.batch_axes if a not in gather)
        if self.batch_axes[len(self.batch_axes) - len(gather) :] == gather:
            # The gathered axes are the innermost: a gather group's rows are one block of
            # the batch, the block P(keep) gives the group.
            body, out_spec = per_device, P(keep or None)
        else:  # they are not one block: each device returns the rows it was given
            body, out_spec = partial(self._own_rows, per_device), P(self.batch_axes)
        batch, cls = P(self.batch_axes), self.class_axes
        specs = (batch, P(None, cls), P(cls), batch)
        args = (features, kernel, bias, labels)
        if AxisType.Explicit in self.mesh.axis_types:
            # On Explicit axes (jax.make_mesh's default) shard_map takes its inputs only as
            # they are already placed, so place them as the head reads them.
            args = tuple(
                jax.reshard(a, NamedSharding(self.mesh, s))
                for a, s in zip(args, specs, strict=True)
            )
        return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out_spec)(*args)

    def _own_rows(self, per_device, x, *args):
        """``per_device``'s outputs for this device's own examples: ``local`` returns those of
        its gather group, in the order of ``gather_axes``."""
        out = per_device(x, *args)
        n, i = x.shape[0], lax.axis_index(self.gather_axes)
        return jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, i * n, n), out)


def _ks(topk) -> tuple:
    """``topk`` as a tuple of ks: one int is one k (``topk=5`` as ``topk=(5,)``)."""
    return (topk,) if isinstance(topk, int) else tuple(topk)


def _call_takes(model, name: str) -> bool:
    """Whether ``model.__call__`` accepts the keyword ``name`` (True where it cannot tell)."""
    try:
        params = inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _check_shapes(features, kernel, bias, labels):
    """The head's inputs as ``__call__`` takes them, checked before ``shard_map`` (whose
    errors would name per-shard shapes)."""
    shapes = (
        f"features {tuple(features.shape)}, kernel {tuple(kernel.shape)}, bias "
        f"{tuple(bias.shape)}, labels {tuple(labels.shape)} {labels.dtype}"
    )
    problems = []
    if kernel.ndim != 2:
        problems.append("the kernel must be 2-D, (features E, classes C)")
    elif tuple(bias.shape) != kernel.shape[-1:]:
        problems.append(f"the bias must be (C,) = ({kernel.shape[-1]},), one value per class")
    if kernel.ndim == 2 and (features.ndim != 2 or features.shape[-1] != kernel.shape[0]):
        problems.append(f"the features must be (B, E) = (B, {kernel.shape[0]})")
    if labels.ndim != 1 or not jnp.issubdtype(labels.dtype, jnp.integer):
        problems.append("the labels must be integer class ids, (B,) (not one-hot or float)")
    if problems:
        raise ConfigError(f"ShardedHead: {shapes}: {'; '.join(problems)}")


__all__ = [
    "ShardedHead",
    "class_axes",
    "label_rank",
    "sharded_cross_entropy",
    "sharded_topk_hits",
]
