"""hybridpar: data-model hybrid parallel training of image classifiers in JAX/Flax.

The partitioning API for your own training code:

    mesh = hybridpar.make_mesh("data:4,model:2")
    shardings = hybridpar.infer_shardings(params, rules, mesh)
    batch = hybridpar.shard_batch(host_local_numpy_batch, mesh)

The names below are imported on first use (PEP 562), so ``import hybridpar`` does not start
JAX: a tool can still set device counts and XLA flags before the backend starts, and the
JAX-free parts (``hybridpar.simulate``, the config schema) stay JAX-free.
"""

from __future__ import annotations

import importlib

from hybridpar.errors import ConfigError

# public name -> the module that defines it
_EXPORTS = {
    "AXES": "hybridpar.mesh",
    "BATCH_AXES": "hybridpar.mesh",
    "data_parallel_size": "hybridpar.mesh",
    "make_mesh": "hybridpar.mesh",
    "parse_mesh_spec": "hybridpar.mesh",
    "DATA_PARALLEL": "hybridpar.partitioning",
    "FSDP": "hybridpar.partitioning",
    "HYBRID": "hybridpar.partitioning",
    "PRESETS": "hybridpar.partitioning",
    "TENSOR": "hybridpar.partitioning",
    "Rules": "hybridpar.partitioning",
    "batch_sharding": "hybridpar.partitioning",
    "infer_shardings": "hybridpar.partitioning",
    "infer_spec": "hybridpar.partitioning",
    "preset_rules": "hybridpar.partitioning",
    "shard_batch": "hybridpar.partitioning",
    "ShardedHead": "hybridpar.sharded_head",
    "sharded_cross_entropy": "hybridpar.sharded_head",
    "sharded_topk_hits": "hybridpar.sharded_head",
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
