"""Two processes x 4 CPU devices on JAX's distributed runtime equal one device.

Each process feeds only its half of every global batch (``shard_batch`` builds the global
arrays with ``jax.make_array_from_process_local_data``); the losses of three train steps must
match a single-device run of the same global batches (tolerance as in test_parity.py).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_parity import _train

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mesh", ["data:4,model:2", "data:2,fsdp:2,model:2"])
def test_two_processes_match_one_device(mesh):
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), port, str(i), mesh],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    single = _train("data:1", jax.devices()[:1])
    for o in outs:
        assert o["local_devices"] == 4
        assert o["head_local_shards"] == 4  # each process holds only its own shards
        np.testing.assert_allclose(o["losses"], single["losses"], rtol=1e-4, atol=1e-5)
    assert outs[0]["head_sum"] == pytest.approx(
        float(np.sum(jax.device_get(single["state"].params["head"]["kernel"]))), rel=1e-4, abs=1e-5
    )
