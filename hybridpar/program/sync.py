"""How a train step reduces its gradients across the data-parallel devices: the
``GradientSync`` a step is built with (``steps.make_train_step(sync=...)``), and
``make_sync``, which picks the one ``comm.mode`` names.

``XlaSync`` (``comm.mode=xla``) leaves the all-reduces to XLA. ``BucketedSync``
(``comm.mode=bucketed``) runs the loss and gradients per device under ``jax.shard_map`` and
reduces them in buckets with ``hybridpar.parallel.bucketed``'s collectives on plain pytrees (that
module's docstring says how); it knows the train state, the model and the loss, which the
collectives beside the partitioning do not. ``OverlapSync`` (``comm.mode=overlap``, any
mesh) is the bucketed sync with each bucket's psum issued from the backward pass
(``hybridpar.parallel.overlap``).
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.models.batchnorm import bn_axis_index_groups_for, bn_groups_for, parse_bn_sync
from hybridpar.parallel.bucketed import (
    Path,
    active_axes,
    bucket_plan,
    flat_pmean,
    forward_params,
    fsdp_dims,
    gather_in_buckets,
    is_spec,
    reduce_in_buckets,
    to_varying,
)
from hybridpar.parallel.comm import platform_name
from hybridpar.parallel.mesh import (
    AXES,
    BATCH_AXES,
    axes_with_devices,
    axis_names,
    data_parallel_size,
)
from hybridpar.parallel.overlap import reduce_in_backward, reduce_in_backward_manual
from hybridpar.parallel.partitioning import path_str
from hybridpar.parallel.sharded_head import class_axes
from hybridpar.program.state import TrainState


def _without_model(spec):
    """``spec`` with the ``model`` axis left out: a shard_map manual over the other axes
    names only those (the arrays keep their model-axis split, which the compiler handles)."""

    def drop(entry):
        kept = tuple(a for a in axis_names(entry) if a != "model")
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(drop(e) for e in spec))


def _head_layout(kind: str, mesh, param_specs):
    """A class-sharded head's step, manual over every axis (the trunk data parallel over
    all devices): ``(axes, splits, sums, n)`` for ``overlap.reduce_in_backward_manual``.
    A trunk parameter's blocks (FSDP's, or a ``model`` split of the rules) are gathered
    for use; the head's own stay split over its classes, its gradient summed over the axes
    it is replicated on (none for partial_fc), blocks stacked on the classes over another
    axis (FSDP's pass) gathered back to the head's. ``n``: the devices one head's batch
    slice is split over, the mean's divisor (each device's loss is its group's).

    The head's class axes are kept even where they have one device (``sharded`` on a mesh
    whose ``model`` is 1): the step is manual over every axis, so the head's kernel arrives
    varying over ``model`` all the same, and so do the gradients flowing back from it;
    each backward rule must reduce over that axis to return its parameter's own type."""
    cls = class_axes(kind, mesh)
    axes = axes_with_devices(mesh, AXES) or BATCH_AXES
    axes = tuple(a for a in AXES if a in axes or a in cls)
    classes = tuple(a for a in cls if a in axes)
    splits, sums = {}, {}
    for kp, spec in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0]:
        path = tuple(path_str(kp).split("/"))
        blocks = [(tuple(a for a in axis_names(e) if a in axes), d)
                  for d, e in enumerate(spec)]  # fmt: skip
        if path[0] == "head":
            owned = tuple(a for b, _ in blocks for a in b if a in classes)
            # a block over the classes starts with them; one on the features (FSDP's, where
            # the classes do not divide) is gathered as a trunk weight's
            classed = [b for b, _ in blocks if set(b) & set(classes)]
            if owned != classes or any(b[: len(owned)] != owned for b in classed):
                raise ConfigError(f"model.head={kind!r}: {path_str(kp)} is split as {spec}, "
                                  f"not over {classes} first")  # fmt: skip
            blocks = [(tuple(a for a in b if a not in classes), d) for b, d in blocks]
            sums[path] = tuple(a for a in axes if a not in owned)
        blocks = tuple((b, d) for b, d in blocks if b)
        if blocks:
            splits[path] = blocks
    n = math.prod(mesh.shape[a] for a in axes if a not in classes)
    return axes, splits, sums, n


def _check_mesh(mesh, dp: int | None = None, model_axis_ok: bool = False) -> int:
    if mesh.shape.get("model", 1) > 1 and not model_axis_ok:
        raise ConfigError(
            f"comm.mode=bucketed is data parallel only, but the mesh has model="
            f"{mesh.shape['model']}; use comm.mode=xla for model parallelism"
        )
    return dp or data_parallel_size(mesh)  # the run's plan's, where the caller has one


def bucketed_model(model, bn_sync: str, data_parallel_size: int, axes=BATCH_AXES, batch_stats=None):
    """``model`` with its BatchNorm set up for a per-device step inside shard_map.

    A model without ``hybridpar.models``' BatchNorm sync fields (``bn_axis_name``, ...) is
    used as it is: right when it has no BatchNorm (``batch_stats``, the state's, empty; None:
    not known), or when each device's own statistics are what ``bn_sync`` asks for."""
    kind, _ = parse_bn_sync(bn_sync)
    groups = bn_axis_index_groups_for(bn_sync, data_parallel_size)
    if not hasattr(model, "bn_axis_name"):
        if kind == "local" or data_parallel_size == 1 or not jax.tree.leaves(batch_stats):
            return model
        raise ConfigError(
            f"model.bn_sync={bn_sync!r} over {data_parallel_size} devices in the per-device "
            f"step (comm.mode=bucketed or overlap): {type(model).__name__} has BatchNorm "
            "statistics but not the BatchNorm sync fields (bn_axis_name, ...) of "
            "hybridpar.models, so each device would normalise by its own examples only; use "
            "comm.mode=xla, or model.bn_sync=local"
        )
    return model.clone(
        bn_groups=1,
        bn_group_sharding=None,
        bn_axis_name=None if kind == "local" else axes,
        bn_axis_index_groups=groups,
    )


class BucketedSync:
    """``comm.mode=bucketed``: the gradient sync of ``steps.make_train_step`` done by us.

    Each device computes its own slice's loss and gradients under ``jax.shard_map``; the
    gradients are reduced in buckets (one ``psum``, or with FSDP one ``psum_scatter``, per
    bucket), and FSDP-split parameters gathered in buckets before the forward pass. Same
    ``gradients`` as ``XlaSync``, so the step around it is the one plain step.

    ``shardings``: the state's ``NamedSharding`` tree (None: all replicated). The model
    passed to ``gradients`` may be the one built for ``comm.mode=xla`` (any
    ``bn_groups``): its BatchNorm is reconfigured for ``bn_sync`` inside shard_map.
    ``reduce_dtype`` (``comm.reduce_dtype``): each bucket is cast to it before its
    collectives and back to the gradients' dtype after ("float32": no cast, the gradients
    reduce in their own dtype), so ``"bfloat16"`` halves the bytes of float32 gradients.
    """

    model_axis_ok = False  # a model axis > 1 is refused (OverlapSync leaves it to XLA)
    all_manual = False  # the step manual over the data axes only (see OverlapSync's head)

    def __init__(
        self,
        mesh,
        bucket_mb: float,
        bn_sync: str = "global",
        shardings=None,
        reduce_dtype: str = "float32",
        data_parallel: int | None = None,
        gather_dtype=None,
    ):
        self.dp = _check_mesh(mesh, data_parallel, self.model_axis_ok)
        # FSDP's kernels are gathered in the model's compute dtype (None: their own), which
        # each layer casts them to anyway: the same values in fewer bytes.
        self.gather_dtype = None if gather_dtype is None else jnp.dtype(gather_dtype)
        if not bucket_mb > 0:
            raise ConfigError(f"comm.bucket_mb={bucket_mb!r}: the bucket size must be > 0 MiB")
        self.mesh, self.bucket_mb, self.bn_sync = mesh, bucket_mb, bn_sync
        self.reduce_dtype = None if reduce_dtype == "float32" else jnp.dtype(reduce_dtype)
        self.axes = active_axes(mesh)
        bn_axis_index_groups_for(bn_sync, self.dp)  # a bad bn_sync fails here, not in jit
        self.param_specs, self.stats_specs = P(), P()
        self.param_dims, self.stats_dims = {}, {}
        fsdp = mesh.shape.get("fsdp", 1) > 1  # a spec naming fsdp of size 1 splits nothing
        if shardings is not None:
            self.param_specs, self.stats_specs = (
                jax.tree.map(lambda s: s.spec, tree, is_leaf=is_spec)
                for tree in (shardings.params, shardings.batch_stats)
            )
            # fsdp_dims also refuses a parameter split over another axis, fsdp or not.
            dims = fsdp_dims(self.param_specs), fsdp_dims(self.stats_specs)
            if fsdp:
                self.param_dims, self.stats_dims = dims
        self._local: dict[int, object] = {}
        self._plans: dict[tuple, list] = {}

    def _narrowed(self, params):
        """The split kernels (rank >= 2) cast to ``gather_dtype``, the rest as they are."""
        if self.gather_dtype is None:
            return params
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: x.astype(self.gather_dtype)
            if x.ndim >= 2 and self.param_dims.get(tuple(path_str(kp).split("/"))) is not None
            else x,
            params,
        )

    def local_model(self, model, batch_stats=None):
        """``model`` with its BatchNorm set up for a per-device step inside shard_map
        (``bucketed_model``; ``batch_stats``: the state's)."""
        if self._local.get(id(model), model) is model:  # a model used as it is: check again
            self._local[id(model)] = bucketed_model(
                model, self.bn_sync, self.dp, self.axes, batch_stats
            )
        return self._local[id(model)]

    def plan_for(self, model, image_shape) -> list[list[Path]]:
        """The buckets (parameter paths, forward order) for images of ``image_shape``."""
        key = (id(model), tuple(image_shape))
        if key not in self._plans:
            local = self.local_model(model)
            self._plans[key] = bucket_plan(
                forward_params(local, (1, *key[1]), train=False), self.bucket_mb
            )
        return self._plans[key]

    def gradients(self, model, state: TrainState, images, labels, loss_fn_for):
        local, axes, dp = self.local_model(model, state.batch_stats), self.axes, self.dp
        param_dims, stats_dims = self.param_dims, self.stats_dims

        def per_device(params, batch_stats, scale, images, labels):
            plan = self.plan_for(model, images.shape[1:])
            if stats_dims:  # the few BatchNorm statistics FSDP splits: one gather for all
                batch_stats = gather_in_buckets(batch_stats, [list(stats_dims)], stats_dims)
            shards = params
            if param_dims:  # FSDP: this device holds shards; gather them, bucket by bucket
                params = gather_in_buckets(self._narrowed(params), plan, param_dims)
            params = jax.tree.map(lambda p: to_varying(p, axes), params)

            loss_fn = loss_fn_for(local, batch_stats, images, labels, scale)
            grads, (loss, new_stats) = jax.grad(loss_fn, has_aux=True)(params)
            # a narrowed kernel's gradient, widened: the float32 kernel's, exactly
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, shards)
            # Loss and BN running averages (per device for local/group statistics): one
            # psum, first, as they are ready when the forward pass ends; then the buckets.
            # Always in float32, whatever reduce_dtype: it is a few KiB, and the running
            # averages are state kept across steps, where bfloat16 rounding would build up
            # (a gradient's rounding is one step's noise that SGD averages out).
            flat, treedef = jax.tree.flatten((loss, new_stats))
            flat = flat_pmean(flat, axes, dp)
            loss, new_stats = jax.tree.unflatten(treedef, flat)
            grads = reduce_in_buckets(grads, plan, axes, dp, after=flat[0],
                                      shard_dims=param_dims,
                                      reduce_dtype=self.reduce_dtype)  # fmt: skip
            return grads, loss, new_stats

        return self.per_device_map(per_device, state, images, labels)

    def per_device_map(self, per_device, state: TrainState, images, labels):
        """``per_device(params, batch_stats, scale, images, labels)`` on each device's shard
        under ``jax.shard_map``. Gradients come out split like the parameters; the BatchNorm
        statistics come out whole, and jit's out_shardings keep each device's slice (no
        communication)."""
        params, stats = self.param_specs, self.stats_specs
        manual = frozenset()  # all axes
        if self.mesh.shape.get("model", 1) > 1 and not self.all_manual:  # the compiler's
            manual = frozenset(a for a in self.mesh.axis_names if a != "model")
            params, stats = (jax.tree.map(_without_model, t, is_leaf=is_spec)
                             for t in (params, stats))  # fmt: skip
        sharded = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(params, stats, P(), P(self.axes), P(self.axes)),
            out_specs=(params, P(), P()),
            axis_names=manual,
        )
        return sharded(state.params, state.batch_stats, state.loss_scale.scale, images, labels)


class OverlapSync(BucketedSync):
    """``comm.mode=overlap``: the bucketed sync with each bucket's reduction issued from the
    backward pass (``hybridpar.parallel.overlap``: a custom VJP per bucket whose backward rule
    psums its gradients), not after ``jax.grad``. Same buckets, BatchNorm set-up, loss and
    statistics psum and ``reduce_dtype`` as ``BucketedSync``.

    FSDP: each bucket's identity gathers its split parameters in the forward pass and
    reduce-scatters their gradients in the backward pass (ZeRO-3's order, bucket by bucket).
    A ``model`` axis stays the compiler's: the step is manual over the data axes only
    (``shard_map``'s ``axis_names``), so the rules' model-parallel splits, and the
    collectives they need inside the forward and backward passes, are partitioned by XLA as
    under ``comm.mode=xla``, while the gradients' reduction over the data axes is ours.

    ``head`` (``model.head``) other than ``dense``: the class-sharded head's own collectives
    need every axis manual, and its trunk is data parallel over every device, so the step
    is manual over all axes (``_head_layout``): the batch split over all of them, the
    trunk's gradients averaged over all, a trunk weight split over ``model`` gathered and
    reduce-scattered as FSDP's are, the head's kernel reduced only over the axes it is
    replicated on, and the head's body run in place (``ShardedHead.local``)."""

    model_axis_ok = True

    def __init__(self, mesh, bucket_mb, bn_sync="global", shardings=None,
                 reduce_dtype="float32", data_parallel=None, gather_dtype=None,
                 head="dense"):  # fmt: skip
        self.head = head
        if head != "dense":
            self._init_head(mesh, bucket_mb, bn_sync, shardings, reduce_dtype, data_parallel,
                            gather_dtype)  # fmt: skip
            return
        platform = mesh.devices.flat[0].platform
        if mesh.shape.get("model", 1) > 1 and reduce_dtype != "float32" and platform == "cpu":
            # XLA:CPU (jaxlib 0.10.2) aborts the process compiling it (a CHECK failure in
            # HloInstruction); the TPU and GPU compilers build it.
            raise ConfigError(
                f"comm.mode=overlap with a model axis and comm.reduce_dtype={reduce_dtype!r} "
                "does not compile on CPU devices (XLA:CPU aborts); use "
                "--config.comm.reduce_dtype=float32 here (TPU and GPU compile it)"
            )
        super().__init__(mesh, bucket_mb, bn_sync, shardings, reduce_dtype, data_parallel,
                         gather_dtype)  # fmt: skip

    def _init_head(self, mesh, bucket_mb, bn_sync, shardings, reduce_dtype, data_parallel,
                   gather_dtype=None):  # fmt: skip
        if shardings is None:
            raise ValueError(f"OverlapSync(head={self.head!r}) needs the state's shardings")
        super().__init__(mesh, bucket_mb, bn_sync, None, reduce_dtype, data_parallel,
                         gather_dtype)  # fmt: skip
        self.all_manual = True
        self.param_specs, self.stats_specs = (
            jax.tree.map(lambda s: s.spec, tree, is_leaf=is_spec)
            for tree in (shardings.params, shardings.batch_stats)
        )
        self.axes, self.splits, self.sums, self.n = _head_layout(
            self.head, mesh, self.param_specs)  # fmt: skip
        self.n_all = math.prod(mesh.shape[a] for a in self.axes)
        self.stats_dims = fsdp_dims(self.stats_specs) if mesh.shape.get("fsdp", 1) > 1 else {}
        for kp, spec in jax.tree_util.tree_flatten_with_path(self.stats_specs, is_leaf=is_spec)[0]:
            if any(a != "fsdp" for e in spec for a in axis_names(e) if mesh.shape[a] > 1):
                raise ConfigError(f"model.head={self.head!r} with comm.mode=overlap: the "
                                  f"BatchNorm statistics {path_str(kp)} are split as {spec}; "
                                  "only fsdp can split them")  # fmt: skip

    def local_model(self, model, batch_stats=None):
        if self.head == "dense":
            return super().local_model(model, batch_stats)
        if self._local.get(id(model), model) is model:
            # The BatchNorm groups of the xla step (B / groups consecutive examples), each
            # now over n_all / groups devices of the batch split over every axis.
            groups = bn_groups_for(self.bn_sync, self.dp)
            per = self.n_all // groups
            sync = "global" if groups == 1 else "local" if per == 1 else f"group:{per}"
            self._local[id(model)] = bucketed_model(model, sync, self.n_all, self.axes, batch_stats)
        return self._local[id(model)]

    def gradients(self, model, state: TrainState, images, labels, loss_fn_for):
        if self.head != "dense":
            return self._head_gradients(model, state, images, labels, loss_fn_for)
        local, axes, dp = self.local_model(model, state.batch_stats), self.axes, self.dp
        param_dims, stats_dims = self.param_dims, self.stats_dims
        concat = self.mesh.shape.get("model", 1) == 1  # see flat_pmean

        def per_device(params, batch_stats, scale, images, labels):
            plan = self.plan_for(model, images.shape[1:])
            if stats_dims:  # the few BatchNorm statistics FSDP splits: one gather for all
                batch_stats = gather_in_buckets(batch_stats, [list(stats_dims)], stats_dims)
            loss_fn = loss_fn_for(local, batch_stats, images, labels, scale)

            def reduced_loss(params):  # grads come out reduced (and scattered, for FSDP)
                reduced = reduce_in_backward(params, plan, axes, dp, self.reduce_dtype,
                                             param_dims, concat, self.gather_dtype)  # fmt: skip
                return loss_fn(reduced)

            grads, (loss, new_stats) = jax.grad(reduced_loss, has_aux=True)(params)
            # Loss and BN running averages in float32, as BucketedSync does.
            flat, treedef = jax.tree.flatten((loss, new_stats))
            loss, new_stats = jax.tree.unflatten(treedef, flat_pmean(flat, axes, dp))
            return grads, loss, new_stats

        return self.per_device_map(per_device, state, images, labels)

    def _head_gradients(self, model, state: TrainState, images, labels, loss_fn_for):
        local, axes = self.local_model(model, state.batch_stats), self.axes
        stats_dims = self.stats_dims

        def per_device(params, batch_stats, scale, images, labels):
            plan = self.plan_for(model, images.shape[1:])
            if stats_dims:
                batch_stats = gather_in_buckets(batch_stats, [list(stats_dims)], stats_dims)
            loss_fn = loss_fn_for(local, batch_stats, images, labels, scale)

            def reduced_loss(params):
                reduced = reduce_in_backward_manual(params, plan, axes, self.n, self.splits,
                                                    self.sums, self.reduce_dtype,
                                                    self.gather_dtype)  # fmt: skip
                return loss_fn(reduced)

            grads, (loss, new_stats) = jax.grad(reduced_loss, has_aux=True)(params)
            # Each device's loss is its head group's: their mean over all devices is the
            # batch's (the groups are equal).
            flat, treedef = jax.tree.flatten((loss, new_stats))
            loss, new_stats = jax.tree.unflatten(treedef, flat_pmean(flat, axes, self.n_all))
            return grads, loss, new_stats

        return self.per_device_map(per_device, state, images, labels)


class XlaSync:
    """Gradients of the global batch's loss under ``jax.jit``: XLA inserts the all-reduces
    (and combines them as its flags allow; ``comm.mode=xla``). ``BucketedSync`` is the
    other choice, with the same ``gradients``.

    ``reduce_dtype`` other than float32 (``comm.reduce_dtype``, data-parallel meshes): XLA
    would reduce each gradient in the dtype of the op computing it, before any cast of ours,
    so each device computes its own slice's gradient under ``jax.shard_map`` and they are
    summed with one ``psum`` in ``reduce_dtype``, cast back to the gradients' dtype after;
    the loss and BatchNorm statistics are averaged in float32 (the bucketed step's psums,
    in one bucket).
    """

    def __init__(self, mesh=None, reduce_dtype: str = "float32", bn_sync: str = "global",
                 mode: str = "comm.mode=xla"):  # fmt: skip
        """``mode``: how the config came to this sync, for its errors (``make_sync``'s:
        ``comm.mode=auto`` says so, and why it resolved to xla)."""
        self.mesh, self.bn_sync = mesh, bn_sync
        self.reduce_dtype = None if reduce_dtype == "float32" else jnp.dtype(reduce_dtype)
        others = {a: n for a, n in (mesh.shape.items() if mesh else ()) if a != "data" and n > 1}
        if self.reduce_dtype is not None and others:
            # Data parallel only: FSDP's split parameters would be gathered whole per device,
            # and with a model axis left to XLA inside shard_map the TPU compiler moved several
            # times the bytes, while XLA:CPU could not widen the bfloat16 psum.
            fix = ("--config.comm.mode=overlap (on CPU with --config.model.head=sharded; the "
                   "bucketed mode is data and fsdp only)" if "model" in others else
                   "--config.comm.mode=bucketed (data and fsdp)")  # fmt: skip
            raise ConfigError(
                f"comm.reduce_dtype={reduce_dtype!r} under {mode} needs a mesh over "
                f"data only (this one has {', '.join(f'{a}={n}' for a, n in others.items())}); "
                f"use {fix} or --config.comm.reduce_dtype=float32"
            )

    def gradients(self, model, state: TrainState, images, labels, loss_fn_for):
        if self.reduce_dtype is not None:
            return self._one_bucket.gradients(model, state, images, labels, loss_fn_for)
        loss_fn = loss_fn_for(model, state.batch_stats, images, labels, state.loss_scale.scale)
        grads, (loss, batch_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
        return grads, loss, batch_stats

    @functools.cached_property
    def _one_bucket(self):
        """The reduction made explicit: the bucketed sync with one bucket of every gradient
        (no size limit) over replicated parameters, the mesh being data parallel only."""
        return BucketedSync(self.mesh, math.inf, self.bn_sync, None, self.reduce_dtype)


class GradientSync(Protocol):
    """How a train step reduces its gradients across the data-parallel devices: the loss
    and BatchNorm statistics of the global batch and the gradients of the (scaled) loss,
    from ``loss_fn_for(model, batch_stats, images, labels, scale) -> params -> (scaled
    loss, (loss, new batch_stats))``. ``steps.make_train_step`` applies the update.
    ``make_sync`` sets ``choice``: the line the run's log gives (mode, and why), and
    ``summed_in``: the dtype the gradients are summed in (``comm.reduce_dtype``, auto
    resolved), which a resume compares."""

    choice: str
    summed_in: str

    def gradients(self, model, state, images, labels, loss_fn_for) -> tuple: ...


# comm.mode=auto, by platform: the mode whose compiled schedule hid the most of ResNet-50's
# gradient reduction (224 px, bfloat16, bench/results/overlap_tpu/NOTES.md), and why.
AUTO_BY_PLATFORM = {
    "gpu": ("overlap", "XLA:GPU runs the buckets beside the backward convolutions, est. 88% "
                       "of ResNet-50's bytes hidden against 0.2% under xla"),
    # said so it is true on every TPU: the offload (and its hiding) is v5p's alone
    "tpu": ("xla", "the overlap mode's buckets hid 8% of the gradient's bytes, for 1.6-1.9x "
                   "the activation memory; on v5p the SparseCore offload runs XLA's all-reduces "
                   "beside the backward convolutions, est. 82% hidden"),
    "cpu": ("xla", "XLA:CPU runs every collective synchronously: nothing to hide it behind"),
}  # fmt: skip


def choose_mode(config, platform: str, mesh_shape: dict, data_parallel: int) -> tuple[str, str]:
    """The gradient sync mode for ``comm.mode`` on this platform and mesh, and why: the
    config's own, or for ``auto`` the overlap mode where it hides the reduction for no more
    bytes than XLA's (``AUTO_BY_PLATFORM``) and nothing rules it out, else xla."""
    mode = config.comm.mode
    if mode != "auto":
        return mode, "comm.mode"
    if data_parallel <= 1:
        return "xla", "auto: one data-parallel device, no gradient to reduce"
    if config.model.head != "dense":
        return "xla", f"auto: a {config.model.head} head, not measured in the overlap mode"
    if config.distill.teacher_workdir:
        return "xla", "auto: distillation's step"
    if mesh_shape.get("model", 1) > 1:
        return "xla", "auto: a model axis, where the overlap mode moved 4.3x the bytes on TPU"
    if mesh_shape.get("fsdp", 1) > 1:
        return "xla", "auto: an fsdp axis, where the overlap mode took 1.9x the memory on TPU"
    if config.precision.compute == "float16":  # XLA reduces float16 gradients: half our bytes
        return "xla", "auto: float16 compute, whose gradients XLA sums in float16"
    mode, why = AUTO_BY_PLATFORM.get(platform_name(platform), AUTO_BY_PLATFORM["cpu"])
    return mode, f"auto: {why}"


def reduce_dtype_for(config, mode: str, mesh_shape: dict) -> str:
    """``comm.reduce_dtype`` with ``auto`` resolved: bfloat16 where the bucketed or overlap
    mode sums data and fsdp buckets of a bfloat16 step (XLA's own reduction sums the
    kernels' gradients in it too: the same bytes), else float32."""
    r = config.comm.reduce_dtype
    if r != "auto":
        return r
    own = mode in ("bucketed", "overlap") and mesh_shape.get("model", 1) == 1
    return "bfloat16" if own and config.precision.compute == "bfloat16" else "float32"


def make_sync(config, mesh, shardings, data_parallel: int | None = None) -> GradientSync:
    """The gradient sync ``comm.mode`` names (``config.validate`` checked the name), or
    ``auto`` chooses (``choose_mode``): ``XlaSync``, ``BucketedSync`` or ``OverlapSync``,
    whose ``choice`` says which and why. ``data_parallel``: the run plan's (None: the
    mesh's)."""
    dp = data_parallel or data_parallel_size(mesh)
    shape = dict(mesh.shape)
    mode, why = choose_mode(config, mesh.devices.flat[0].platform, shape, dp)
    c, reduce_dtype = config.comm, reduce_dtype_for(config, mode, shape)
    p = config.precision  # gather kernels narrower only: wider would add bytes
    narrower = jnp.dtype(p.compute).itemsize < jnp.dtype(p.params).itemsize
    gather = p.compute if narrower else None
    if mode == "bucketed":
        sync = BucketedSync(mesh, c.bucket_mb, config.model.bn_sync, shardings, reduce_dtype,
                            data_parallel, gather)  # fmt: skip
    elif mode == "overlap":
        sync = OverlapSync(mesh, c.bucket_mb, config.model.bn_sync, shardings, reduce_dtype,
                           data_parallel, gather, config.model.head)  # fmt: skip
    else:
        # for its errors: the mode the config set, and what auto resolved to and why
        said = f"comm.mode={c.mode}"
        if c.mode != mode:
            said += f" (resolved to xla: {why.removeprefix('auto: ')})"
        sync = XlaSync(mesh, reduce_dtype, config.model.bn_sync, said)
    how = f", {c.bucket_mb:g} MiB buckets" if mode != "xla" else ""
    how += f" summed in {reduce_dtype}" if mode != "xla" or reduce_dtype != "float32" else ""
    sync.choice = f"gradient sync: {mode}{how} ({why})"
    sync.summed_in = reduce_dtype
    return sync
