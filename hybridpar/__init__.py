"""hybridpar: data-model hybrid parallel training of image classifiers in JAX/Flax.

The partitioning API for your own training code:

    mesh = hybridpar.make_mesh("data:4,model:2")
    shardings = hybridpar.infer_shardings(params, rules, mesh)
    batch = hybridpar.shard_batch(host_local_numpy_batch, mesh)

A trained run in your own code (docs/evaluation.md):

    run = hybridpar.TrainedRun("runs/digits", hybridpar.make_mesh("data:-1"))
    logits = run.logits(uint8_images)  # normalised as in training; run.model, run.variables()

The names below are imported on first use (PEP 562), so ``import hybridpar`` does not start
JAX: a tool can still set device counts and XLA flags before the backend starts, and the
JAX-free parts (``hybridpar.simulate``, the config schema) stay JAX-free.
"""

from __future__ import annotations

import importlib

from hybridpar.config.errors import ConfigError

# public name -> the module that defines it
_EXPORTS = {
    "AXES": "hybridpar.parallel.mesh",
    "BATCH_AXES": "hybridpar.parallel.mesh",
    "data_parallel_size": "hybridpar.parallel.mesh",
    "make_mesh": "hybridpar.parallel.mesh",
    "parse_mesh_spec": "hybridpar.parallel.mesh",
    "DATA_PARALLEL": "hybridpar.parallel.partitioning",
    "FSDP": "hybridpar.parallel.partitioning",
    "HYBRID": "hybridpar.parallel.partitioning",
    "PRESETS": "hybridpar.parallel.partitioning",
    "TENSOR": "hybridpar.parallel.partitioning",
    "Rules": "hybridpar.parallel.partitioning",
    "batch_sharding": "hybridpar.parallel.partitioning",
    "infer_shardings": "hybridpar.parallel.partitioning",
    "infer_spec": "hybridpar.parallel.partitioning",
    "preset_rules": "hybridpar.parallel.partitioning",
    "shard_batch": "hybridpar.parallel.partitioning",
    "ShardedHead": "hybridpar.parallel.sharded_head",
    "sharded_cross_entropy": "hybridpar.parallel.sharded_head",
    "sharded_topk_hits": "hybridpar.parallel.sharded_head",
    "TrainedRun": "hybridpar.runtime.trained",
}

__all__ = ["ConfigError", *sorted(_EXPORTS)]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
