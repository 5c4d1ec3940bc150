"""One process of a 2-process x 4-CPU-device run (started by test_multiprocess.py).

Joins JAX's distributed runtime (gloo collectives on CPU), builds a global 8-device mesh,
feeds only this host's half of each global batch, trains three steps of the tiny ResNet and
prints the losses as JSON on its last line.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, mesh_spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=120,
)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_parity import BATCH, _batches, _step_and_state  # noqa: E402

from hybridpar import make_mesh, shard_batch  # noqa: E402

mesh = make_mesh(mesh_spec)
assert jax.process_count() == 2 and mesh.size == 8
step, state, _ = _step_and_state(mesh)
half = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
losses = []
for batch in _batches():
    local = {k: v[half] for k, v in batch.items()}  # this host reads only its own examples
    state, metrics = step(state, shard_batch(local, mesh))
    losses.append(float(metrics["loss"]))
head = state.params["head"]["kernel"]
print(
    json.dumps(
        {
            "losses": losses,
            "local_devices": jax.local_device_count(),
            "head_local_shards": len(head.addressable_shards),
            "head_sum": float(
                np.sum(jax.device_get(jax.jit(lambda x: x.sum(), out_shardings=None)(head)))
            ),
        }
    )
)
jax.distributed.shutdown()
