"""From a config to the jitted train and eval steps, with nothing allocated.

``build_program`` does the model, optimizer, precision and placement part of a run, so the
training CLI and tools that only compile (``comm_report``, memory and scaling studies) build
the very same step. Shapes come from ``jax.eval_shape``; lowering uses abstract arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from hybridpar import partitioning
from hybridpar.bucketed import make_bucketed_train_step
from hybridpar.errors import ConfigError
from hybridpar.mesh import data_parallel_size
from hybridpar.models import create_model
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.optim import make_optimizer
from hybridpar.precision import LossScale, Policy, make_policy
from hybridpar.sharded_head import make_head
from hybridpar.state import abstract_like, make_init_fn
from hybridpar.steps import jit_eval_step, jit_train_step, make_eval_step, make_train_step


def rules_from_config(c, mesh, head=None) -> partitioning.Rules:
    """The config's own rules first, then the sharded head's (if any), then the preset's."""
    own = partitioning.Rules(
        path=tuple(tuple(r) for r in c.rules), logical=tuple(tuple(r) for r in c.logical_rules)
    )
    if head is not None:  # the head's kernel must sit where its shard_map computes
        own = own + head.rules()
    rules = own + partitioning.preset_rules(c.preset, mesh)
    if c.fsdp_min_size >= 0:
        rules = partitioning.Rules(rules.path, rules.logical, c.fsdp_min_size)
    return rules


def check_batch_sizes(config, mesh) -> None:
    """Both batches must split evenly over the data-parallel devices (data x fsdp)."""
    dp = data_parallel_size(mesh)
    for name in ("global_batch", "eval_batch"):
        if config[name] % dp:
            raise ConfigError(
                f"{name}={config[name]} does not divide over the {dp} data-parallel devices of "
                f"mesh {config.mesh!r} (data x fsdp); use a multiple of {dp}, e.g. "
                f"--config.{name}={max(dp, config[name] // dp * dp)}"
            )


@dataclasses.dataclass
class Program:
    mesh: Any
    rules: partitioning.Rules
    policy: Policy
    model: Any
    tx: Any
    schedule: Callable
    init: Callable  # rng -> boxed TrainState
    abstract: Any  # boxed abstract TrainState (logical names kept, for the placement table)
    shardings: Any  # NamedSharding tree of the (unboxed) TrainState
    train_jit: Any
    eval_jit: Any
    image_shape: tuple[int, int, int]

    def abstract_state(self):
        return abstract_like(self.abstract, self.shardings)

    def abstract_batch(self, n: int, keys=("image", "label")) -> dict:
        specs = {
            "image": ((n, *self.image_shape), np.uint8),
            "label": ((n,), np.int32),
            "mask": ((n,), np.float32),
        }
        return {
            k: jax.ShapeDtypeStruct(
                specs[k][0],
                specs[k][1],
                sharding=partitioning.batch_sharding(self.mesh, len(specs[k][0])),
            )
            for k in keys
        }

    def lower_train(self, global_batch: int):
        return self.train_jit.lower(self.abstract_state(), self.abstract_batch(global_batch))

    def lower_eval(self, eval_batch: int):
        keys = ("image", "label", "mask")
        return self.eval_jit.lower(self.abstract_state(), self.abstract_batch(eval_batch, keys))


def build_program(config, mesh, image_shape, steps_per_epoch: int, total_steps: int) -> Program:
    head = make_head(config, mesh)  # None for model.head=dense
    rules = rules_from_config(config.partitioning, mesh, head)
    p = config.precision
    policy = make_policy(p.compute, p.params, p.output)
    m = config.model
    model = create_model(
        m.name,
        num_classes=config.data.num_classes,
        num_filters=m.num_filters,
        zero_init_last_bn=m.zero_init_last_bn,
        bn_momentum=m.bn_momentum,
        bn_epsilon=m.bn_epsilon,
        small_stem=m.small_stem,
        pointwise_dot=m.pointwise_dot,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        bn_groups=bn_groups_for(m.bn_sync, data_parallel_size(mesh)),
    )
    tx, schedule = make_optimizer(config.optim, config.global_batch, steps_per_epoch, total_steps)
    loss_scale = LossScale.create(
        policy.needs_loss_scale, p.loss_scale_initial, p.loss_scale_period
    )
    init = make_init_fn(model, tx, (1, *image_shape), loss_scale)
    abstract = jax.eval_shape(init, jax.random.key(config.seed))
    shardings = partitioning.infer_shardings(abstract, rules, mesh)
    mean, std = tuple(config.data.mean), tuple(config.data.std)
    smoothing = config.label_smoothing
    if config.comm.mode == "bucketed":  # our own fused, ordered gradient all-reduces
        step_fn = make_bucketed_train_step(
            model,
            tx,
            policy,
            schedule,
            mean=mean,
            std=std,
            label_smoothing=smoothing,
            mesh=mesh,
            bucket_mb=config.comm.bucket_mb,
            bn_sync=m.bn_sync,
            shardings=shardings,
        )
    elif config.comm.mode == "xla":  # XLA inserts and combines the collectives
        step_fn = make_train_step(
            model, tx, policy, schedule, mean=mean, std=std, label_smoothing=smoothing, head=head
        )
    else:
        raise ConfigError(f"comm.mode={config.comm.mode!r}: use 'xla' or 'bucketed'")
    train_jit = jit_train_step(
        step_fn,
        shardings,
        mesh,
        {"image": 4, "label": 1},
    )
    eval_jit = jit_eval_step(
        make_eval_step(model, policy, mean=mean, std=std, label_smoothing=smoothing, head=head),
        shardings,
        mesh,
        {"image": 4, "label": 1, "mask": 1},
    )
    return Program(
        mesh,
        rules,
        policy,
        model,
        tx,
        schedule,
        init,
        abstract,
        shardings,
        train_jit,
        eval_jit,
        tuple(image_shape),
    )
