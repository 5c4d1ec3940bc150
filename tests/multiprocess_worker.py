"""One process of a 2-process x 4-CPU-device run (started by test_multiprocess.py).

With the mesh argument ``hosts`` it checks ``shard_batch``'s errors across hosts instead.

Joins JAX's distributed runtime (gloo collectives on CPU), builds a global 8-device mesh,
feeds only this host's half of each global batch, trains three steps of the tiny ResNet
from ``helpers.random_state`` and prints the losses as JSON on its last line; process 0
also writes every parameter and BatchNorm statistic (gathered) to the given .npz file.
"""

import json
import os
import sys

from xla_flags import cpu_flags

os.environ["XLA_FLAGS"] = cpu_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, mesh_spec, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=120,
)

import numpy as np  # noqa: E402
from helpers import BATCH, batches, build, place, random_state, tiny_config  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from hybridpar import ConfigError, make_mesh, shard_batch  # noqa: E402

if mesh_spec == "hosts":
    # shard_batch's checks across hosts, no training: process 0 passes 8 rows, process 1
    # passes 4 (check_hosts=True), then a batch mixing a global and a host-local leaf.
    mesh = make_mesh("data:4,model:2")
    seen = {}
    same = shard_batch({"x": np.zeros((8, 2), np.float32)}, mesh, check_hosts=True)["x"]
    seen["same_shape"] = list(same.shape)
    try:
        rows = 8 if process_id == 0 else 4
        shard_batch({"image": np.zeros((rows, 2), np.float32)}, mesh, check_hosts=True)
    except ConfigError as e:
        seen["sizes"] = str(e)
    try:
        shard_batch({"x": same, "y": np.zeros(8, np.int32)}, mesh)
    except ConfigError as e:
        seen["mixed"] = str(e)
    print(json.dumps(seen))
    jax.distributed.shutdown()
    sys.exit(0)

program = build(tiny_config(mesh_spec))
assert jax.process_count() == 2 and program.mesh.size == 8
state = place(random_state(program), program.shardings)
half = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
losses = []
for batch in batches():
    local = {k: v[half] for k, v in batch.items()}  # this host reads only its own examples
    state, metrics = program.train_jit(state, shard_batch(local, program.mesh))
    losses.append(float(metrics["loss"]))
head = state.params["head"]["kernel"]
leaves = multihost_utils.process_allgather(
    jax.tree.leaves((state.params, state.batch_stats)), tiled=True
)
if process_id == 0:
    np.savez(out, *[np.asarray(x) for x in leaves])
print(
    json.dumps(
        {
            "losses": losses,
            "local_devices": jax.local_device_count(),
            "head_local_shards": len(head.addressable_shards),
        }
    )
)
jax.distributed.shutdown()
