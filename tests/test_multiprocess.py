"""Two processes x 4 CPU devices on JAX's distributed runtime equal one device.

Each process feeds only its half of every global batch (``shard_batch`` builds the global
arrays with ``jax.make_array_from_process_local_data``); the losses, every parameter and
every BatchNorm statistic after three train steps must match a single-device run of the
same global batches from the same random start (``helpers.assert_parity``). A second,
short pair checks ``shard_batch``'s errors across hosts (``check_hosts``, mixed leaves).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    Run,
    assert_parity,
    batches,
    build,
    free_port,
    random_state,
    reference,
    tiny_config,
)

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def run_pair(mesh: str, out, timeout: float = 300) -> list[dict]:
    """Runs the worker as processes 0 and 1; the JSON each prints last."""
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), port, str(i), mesh, str(out)],
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
            stdout, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.fixture(scope="module")
def single():
    program = build(tiny_config("data:1"), jax.devices()[:1])
    return reference(program, random_state(program), batches())


# All three axes at once (data:4,model:2 alone would add no layout this one lacks);
# tests/test_multihost_cli.py runs data:8 over two processes through the CLI.
@pytest.mark.parametrize("mesh", ["data:2,fsdp:2,model:2"])
def test_two_processes_match_one_device(mesh, single, tmp_path):
    out = tmp_path / "state.npz"
    outs = run_pair(mesh, out)
    for o in outs:
        assert o["local_devices"] == 4
        assert o["head_local_shards"] == 4  # each process holds only its own shards
    np.testing.assert_array_equal(outs[0]["losses"], outs[1]["losses"])
    with np.load(out) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    want = single.want.state
    parts = jax.tree.unflatten(jax.tree.structure((want.params, want.batch_stats)), leaves)
    got = Run(want.replace(params=parts[0], batch_stats=parts[1]), np.asarray(outs[0]["losses"]))
    assert_parity(got, single)


def test_shard_batch_checks_hosts(tmp_path):
    """Hosts passing batches of different sizes: with check_hosts=True both raise a
    ConfigError naming the leaf and each process's shape (without it the first collective
    aborts or hangs). A batch mixing global and host-local leaves names which is which."""
    outs = run_pair("hosts", tmp_path / "unused", timeout=120)
    for o in outs:
        assert o["same_shape"] == [16, 2]
        assert "'image'" in o["sizes"], o
        assert "process 0 (8, 2) float32" in o["sizes"] and "process 1 (4, 2) float32" in o["sizes"]
        assert "drop or pad" in o["sizes"]
        assert "global jax.Arrays (leaves 'x')" in o["mixed"], o
        assert "host-local arrays ('y')" in o["mixed"]
