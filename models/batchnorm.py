"""BatchNorm with a choice of how far its batch statistics reach: ``model.bn_sync``.

``global``   statistics over the whole global batch: what one device computes. Under
             ``jax.jit`` with the batch split over the data axes, XLA adds the all-reduces
             itself (one or two per BN layer forward, one backward).
``local``    each device normalises with the statistics of its own examples, as most
             DAWNBench and MLPerf GPU entries did: no communication in the forward or
             backward pass (only the small running-average update is averaged).
``group:N``  statistics over groups of N devices (MLPerf's TPU entries): a middle ground
             when the per-device batch is too small for good statistics.

The trade-off: ``local`` and ``group:N`` remove one or two latency-bound collectives per BN
layer and pass (about 100 for a ResNet-50 step), but they change the model's computation:
with few examples per device the statistics are noisy (below ~32 per group accuracy
drops), and the result depends on the number of devices. ``global`` is the default, since
a run then computes the same thing on any mesh.

The same module serves both ways of running a step:

* under plain ``jax.jit`` (``comm.mode=xla``): ``num_groups=G`` reshapes the batch
  ``(B, ...)`` to ``(G, B/G, ...)`` and normalises each group with its own statistics.
  The batch is split over the data axes in contiguous blocks, so with G equal to the
  data-parallel size each group lives on one device and no collective is needed;
  ``group_sharding`` (optional) pins the group axis to the data axes;
* inside ``jax.shard_map`` (``comm.mode=bucketed``): ``axis_name`` names the data axes the
  statistics are averaged over (``pmean``); ``axis_index_groups`` restricts that average to
  groups of devices. shard_map's ``psum`` has no ``axis_index_groups`` (jax 0.10), so the
  groups are done here with one ``psum`` of a ``(groups, 2, C)`` slot array.

With ``num_groups=1`` and no ``axis_name`` it computes exactly what ``flax.linen.BatchNorm``
does (same variable names, float32 statistics, fast variance, momentum, epsilon).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.config.parsing import parse_bn_sync


def bn_devices_per_group(bn_sync: str, data_parallel_size: int) -> int:
    """How many data-parallel devices share one set of statistics."""
    kind, n = parse_bn_sync(bn_sync)
    dp = int(data_parallel_size)
    if kind == "global":
        return dp
    if kind == "local":
        return 1
    if dp % n:
        raise ConfigError(
            f"model.bn_sync={bn_sync!r}: groups of {n} devices do not divide the "
            f"{dp} data-parallel devices (data x fsdp); choose N dividing {dp}"
        )
    return n


def bn_groups_for(bn_sync: str, data_parallel_size: int) -> int:
    """``num_groups`` (``ResNet.bn_groups``) for a ``jax.jit`` step: 1 for ``global``, the
    data-parallel size for ``local``, ``dp / N`` for ``group:N``."""
    return int(data_parallel_size) // bn_devices_per_group(bn_sync, data_parallel_size)


def bn_axis_index_groups_for(bn_sync: str, data_parallel_size: int):
    """``axis_index_groups`` for a shard_map step over the data axes: ``None`` for
    ``global`` (all devices) and ``local`` (no axis name is used at all), else lists of N
    consecutive device indices (the devices holding consecutive blocks of the batch)."""
    kind, _ = parse_bn_sync(bn_sync)
    n = bn_devices_per_group(bn_sync, data_parallel_size)
    if kind != "group":
        return None
    dp = int(data_parallel_size)
    return [list(range(g, g + n)) for g in range(0, dp, n)]


def _canonical_axes(rank: int, axes) -> tuple[int, ...]:
    if not isinstance(axes, (tuple, list)):
        axes = (axes,)
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


def _group_mean(stats, axis_name, axis_index_groups):
    """Mean of ``stats`` over the devices of this device's group, with one ``psum``."""
    groups = [list(g) for g in axis_index_groups]
    members = sorted(i for g in groups for i in g)
    if members != list(range(len(members))):
        raise ValueError(
            f"axis_index_groups {axis_index_groups} must cover the device indices "
            f"0..{len(members) - 1} once each"
        )
    group_of = np.zeros(len(members), np.int32)
    for gi, g in enumerate(groups):
        group_of[g] = gi
    sizes = np.asarray([len(g) for g in groups], np.float32)
    mine = jnp.asarray(group_of)[lax.axis_index(axis_name)]
    slots = jax.nn.one_hot(mine, len(groups), dtype=stats.dtype)  # (G,)
    total = lax.psum(slots.reshape((-1,) + (1,) * stats.ndim) * stats[None], axis_name)
    return total[mine] / jnp.asarray(sizes)[mine]


class BatchNorm(nn.Module):
    """Drop-in for ``flax.linen.BatchNorm`` with grouped and device-group statistics.

    Fields as in ``nn.BatchNorm``, plus:

    num_groups: statistics over ``num_groups`` equal, contiguous slices of the batch
      (axis 0); the running averages take the mean of the groups' statistics.
    group_sharding: optional placement of the group axis under ``jax.jit``: a
      ``NamedSharding`` (its first spec entry is used, e.g. ``P(("data", "fsdp"))``), or a
      ``PartitionSpec``/axis name(s) resolved against the mesh in context
      (``jax.set_mesh``). None: leave it to XLA's sharding propagation.
    axis_name / axis_index_groups: inside ``jax.shard_map``, average the statistics over
      the named mesh axes (all devices, or each device's group).
    """

    use_running_average: bool | None = None
    axis: int = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Any = nn.initializers.zeros
    scale_init: Any = nn.initializers.ones
    axis_name: Any = None
    axis_index_groups: Any = None
    num_groups: int = 1
    group_sharding: Any = None

    def _constrain(self, xg):
        s = self.group_sharding
        if s is None:
            return xg
        rest = (P.UNCONSTRAINED,) * (xg.ndim - 1)
        if isinstance(s, NamedSharding):
            spec = s.spec[0] if len(s.spec) else None
            return lax.with_sharding_constraint(xg, NamedSharding(s.mesh, P(spec, *rest)))
        spec = s[0] if isinstance(s, P) else s
        return lax.with_sharding_constraint(xg, P(spec, *rest))

    def _stats(self, x, reduction_axes, groups: int):
        """Per-group ``(mean, var)``, each of shape ``(groups, *feature_shape)``."""
        dtype = jnp.promote_types(self.dtype or jnp.result_type(x), jnp.float32)
        x = x.astype(dtype)
        if groups == 1:  # no (1, B, ...) view: XLA:CPU turned it into thousands of bitcasts
            mu, mu2 = x.mean(reduction_axes)[None], lax.square(x).mean(reduction_axes)[None]
        else:
            xg = self._constrain(x.reshape((groups, x.shape[0] // groups) + x.shape[1:]))
            axes = tuple(a + 1 for a in reduction_axes)
            mu = xg.mean(axes)
            mu2 = lax.square(xg).mean(axes)
        if self.axis_name is not None and not self.is_initializing():
            both = jnp.stack([mu, mu2])
            if self.axis_index_groups is None:
                both = lax.pmean(both, self.axis_name)
            else:
                both = _group_mean(both, self.axis_name, self.axis_index_groups)
            mu, mu2 = both[0], both[1]
        # E[x^2] - E[x]^2 can round below zero.
        return mu, jnp.maximum(0.0, mu2 - lax.square(mu))

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None):
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        feature_axes = _canonical_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = tuple(x.shape[a] for a in feature_axes)
        if 0 in feature_axes and self.num_groups != 1:
            raise ValueError("BatchNorm groups split axis 0, which must not be a feature axis")

        ra_mean = self.variable(
            "batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), feature_shape
        )
        ra_var = self.variable(
            "batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), feature_shape
        )

        groups = int(self.num_groups)
        if not use_running_average and x.shape[0] % groups:
            if self.is_initializing():
                groups = 1  # init may run on a batch of 1; its statistics are not kept
            else:
                raise ValueError(
                    f"BatchNorm num_groups={groups} does not divide the batch of "
                    f"{x.shape[0]} examples it sees; use a batch (per device inside "
                    "shard_map) that is a multiple of the number of groups"
                )

        # Statistics and normalisation in broadcastable shapes: (G, 1.., C) on a
        # (G, B/G, ...) view of x; G = 1 reduces to nn.BatchNorm's arithmetic.
        stat_shape = [1] * (x.ndim + 1)
        for a in feature_axes:
            stat_shape[a + 1] = x.shape[a]
        if use_running_average:
            groups = 1
            mean, var = ra_mean.value[None], ra_var.value[None]
        else:
            mean, var = self._stats(x, reduction_axes, groups)
            if not self.is_initializing():
                ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean.mean(0)
                ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var.mean(0)
        stat_shape[0] = groups
        param_shape = [1] * (x.ndim + 1)
        for a in feature_axes:
            param_shape[a + 1] = x.shape[a]
        if groups == 1:  # plain (B, ...) arithmetic, as nn.BatchNorm's
            stat_shape, param_shape, xg = stat_shape[1:], param_shape[1:], x
        else:
            xg = x.reshape((groups, x.shape[0] // groups) + x.shape[1:])
        mean, var = mean.reshape(stat_shape), var.reshape(stat_shape)
        y = xg - mean
        mul = lax.rsqrt(var + self.epsilon)
        args = [x]
        if self.use_scale:
            scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype)
            mul = mul * scale.reshape(param_shape)
            args.append(scale)
        y = y * mul
        if self.use_bias:
            bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype)
            y = y + bias.reshape(param_shape)
            args.append(bias)
        dtype = dtypes.canonicalize_dtype(*args, dtype=self.dtype)
        return jnp.asarray(y.reshape(x.shape), dtype)
