"""hybridpar: data-model hybrid parallel training of image classifiers in JAX/Flax.

The partitioning API for your own training code:

    mesh = hybridpar.make_mesh("data:4,model:2")
    shardings = hybridpar.infer_shardings(params, rules, mesh)
    batch = hybridpar.shard_batch(host_local_numpy_batch, mesh)
"""

from hybridpar.errors import ConfigError
from hybridpar.mesh import AXES, BATCH_AXES, data_parallel_size, make_mesh, parse_mesh_spec
from hybridpar.partitioning import (
    DATA_PARALLEL,
    FSDP,
    HYBRID,
    PRESETS,
    TENSOR,
    Rules,
    batch_sharding,
    infer_shardings,
    infer_spec,
    preset_rules,
    shard_batch,
)
from hybridpar.sharded_head import ShardedHead, sharded_cross_entropy, sharded_topk_hits

__all__ = [
    "AXES",
    "BATCH_AXES",
    "ConfigError",
    "DATA_PARALLEL",
    "FSDP",
    "HYBRID",
    "PRESETS",
    "Rules",
    "ShardedHead",
    "TENSOR",
    "batch_sharding",
    "data_parallel_size",
    "infer_shardings",
    "infer_spec",
    "make_mesh",
    "parse_mesh_spec",
    "preset_rules",
    "shard_batch",
    "sharded_cross_entropy",
    "sharded_topk_hits",
]
