"""The train CLI as 2 processes x 4 CPU devices (loopback, gloo) gives what 1 x 8 gives.

Both are the digits job on ``data:8`` for the same 6 steps (a quarter epoch, 16-px images,
a narrower ResNet, to keep it short), every step logged, a checkpoint at the end. The pair
is started by hand, as ``experiments/launch/`` describes: ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and ``--config.distributed=True``, sharing one
workdir as hosts share a file system. Each process reads its half of every global batch,
only process 0 writes the records, both write their checkpoint shards. The evaluator as 2
processes on that workdir records the run's own final evaluation.

And the two ways it can fail before a step: no variables and no cluster, and a
coordinator that does not answer; each one ``error:`` line, exit 2, no traceback.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import NO_LLVM_OPT_FLAG, free_port

from hybridpar.config.errors import ConfigError
from hybridpar.parallel import distributed

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "experiments" / "digits.py")
STEPS = 6  # 0.25 epoch of 1,437 examples at batch 64 (22 steps an epoch), rounded
SHORT = [
    "--config", DIGITS, "--config.mesh=data:8", "--config.num_epochs=0.25",
    "--config.log_every_s=0", "--config.eval_every_epochs=0",  # every step; eval at the end
    "--config.checkpoint.every_steps=0", "--config.checkpoint.every_minutes=0",  # at the end
    "--config.data.image_size=16", "--config.model.num_filters=8",
]  # fmt: skip
# Where JAX would look for a cluster: none of it may leak in from the machine running the tests.
CLUSTER_ENV = ("SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "TPU_", "MEGASCALE_", "JAX_")

# Relative tolerance on the losses. Both runs compile the same program for 8 devices; only
# the all-reduces differ (gloo across the two processes against the in-process one), so
# their sums of 8 partial values round in another order: at most 7 float32 roundings each
# (7 x 2**-24 = 4e-7 relative), carried a few steps through the gradients. Measured: 1 ulp
# (1e-7) at step 1, bit-equal after. 1e-5 is 20x the worst of one reordered reduction,
# and 100x below how much the loss moves per step (the test asserts that), so a wrong share,
# a batch read twice or a lost gradient contribution cannot pass.
RTOL = 1e-5


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_ENV)}
    # Every process compiles without LLVM's optimisations (a third of each compile; the three
    # start at once on 2 cores): the runs are compared with each other, not timed, and the
    # level changes no collective.
    flags = f"--xla_force_host_platform_device_count={devices} {NO_LLVM_OPT_FLAG}"
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(args, env, module="hybridpar.train") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs, timeout=300) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:  # one hung or failed: do not leave its partner waiting
                p.kill()
                p.communicate()
    return out


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(workdir) if r["event"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1 x 8 reference and the 2 x 4 pair, all three started at once (2 cores)."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    port = free_port()
    procs = [_start([*SHORT, "--workdir", str(one)], _env(8))]
    for i in range(2):
        env = _env(
            4,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=2,
            JAX_PROCESS_ID=i,
        )
        args = [*SHORT, "--workdir", str(two), "--config.distributed=True"]
        procs.append(_start([*args, "--config.distributed_timeout_s=120"], env))
    results = _finish(procs)
    for rc, _, stderr in results:
        assert rc == 0, stderr[-3000:]
    return one, two, results


def test_two_processes_give_the_losses_of_one(runs):
    one, two, _ = runs
    want, got = _losses(one), _losses(two)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    w = np.array([want[s] for s in sorted(want)])
    g = np.array([got[s] for s in sorted(want)])
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=0)
    assert np.abs(np.diff(w)).max() > 100 * RTOL * w.max(), f"the losses did not move: {w}"
    e1, e2 = (json.loads((d / "summary.json").read_text())["final_eval"] for d in (one, two))
    assert e1["examples"] == e2["examples"] == 360  # each example once over both processes
    np.testing.assert_allclose(e2["loss"], e1["loss"], rtol=RTOL)


def test_only_process_0_writes_the_records(runs):
    _, two, results = runs
    records = _records(two)
    train = [r["step"] for r in records if r["event"] == "train"]
    assert train == list(range(1, STEPS + 1))  # a second writer would repeat every step
    assert [r["event"] for r in records].count("data") == 1
    assert len(list((two / "tb").iterdir())) == 1  # one TensorBoard events file
    summary = json.loads((two / "summary.json").read_text())
    assert summary["completed"] and summary["mesh"] == {"data": 8, "fsdp": 1, "model": 1}
    assert json.loads((two / "config.json").read_text())["distributed"] is True
    assert "train step" in results[1][1] and "train step" not in results[2][1]  # stdout too


def test_both_processes_write_their_checkpoint_shards(runs):
    _, two, _ = runs
    state = two / "checkpoints" / str(STEPS) / "state"
    assert sorted(p.name for p in state.glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    assert [r["step"] for r in _records(two) if r["event"] == "checkpoint"] == [STEPS]


def test_a_distributed_evaluator_reads_the_checkpoint_as_the_run_evaluated_it(runs):
    """``hybridpar.evaluate`` as 2 processes on the pair's workdir: each process locks its
    own file (``.lock``, ``.lock.1``; one shared file refused the second process), the
    checkpoint is read from both processes' shards, and process 0 records the evaluation the
    run made of the same state at its end."""
    _, two, _ = runs
    port = free_port()
    procs = []
    for i in range(2):
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i)  # fmt: skip
        args = ["--workdir", str(two), "--config.distributed=True",
                "--config.distributed_timeout_s=120"]  # fmt: skip
        procs.append(_start(args, env, module="hybridpar.evaluate"))
    for rc, _, stderr in _finish(procs):
        assert rc == 0, stderr[-3000:]
    evals = [json.loads(x) for x in (two / "evaluator" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in evals] == [("eval", STEPS)]  # one writer
    final = json.loads((two / "summary.json").read_text())["final_eval"]
    assert evals[0]["examples"] == final["examples"] == 360
    np.testing.assert_allclose(evals[0]["loss"], final["loss"], rtol=RTOL)
    assert not list((two / "evaluator").glob(".lock*"))  # both released


@pytest.mark.parametrize("case", ["another_lr", "another_workdir"])
def test_processes_of_one_run_with_another_config_or_workdir_stop_with_one_error_each(
    tmp_path, case
):
    """Another LR in one process trained other losses in the same collectives, and two
    workdirs hung in the first checkpoint: each process now stops at set-up, exit 2."""
    port = free_port()
    procs = []
    for i in range(2):
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i)  # fmt: skip
        w = tmp_path / (f"w{i}" if case == "another_workdir" else "w")
        args = [*SHORT, "--workdir", str(w), "--config.distributed=True"]
        if case == "another_lr" and i == 1:
            args.append("--config.optim.base_lr=0.8")
        procs.append(_start([*args, "--config.distributed_timeout_s=120"], env))
    lines = []
    for rc, _, stderr in _finish(procs, timeout=240):
        errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
        assert rc == 2 and "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
        lines.append(errors[0])
    if case == "another_lr":
        assert lines[0].startswith("error: process(es) 1 run another config than process 0")
        assert lines[1].startswith(
            "error: process 1 runs another config than process 0: optim.base_lr is 0.8 "
            "here, 0.4 in process 0"
        )
    else:
        for line in lines:
            assert "process(es) 1 do not see the files process 0 writes in --workdir=" in line
    assert not list(tmp_path.rglob("metrics.jsonl"))  # stopped before the run's first record


def _cli_error(tmp_path, **env) -> str:
    args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True"]
    [(rc, _, stderr)] = _finish(
        [_start([*args, "--config.distributed_timeout_s=1"], _env(8, **env))]
    )
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and stderr.strip().splitlines()[-1] == lines[0], stderr[-3000:]
    return lines[0]


def test_no_variables_and_no_cluster_is_one_error_line(tmp_path):
    line = _cli_error(tmp_path)
    for var in distributed.VARIABLES:
        assert var in line
    assert "SLURM" in line and "experiments/launch" in line


def test_a_coordinator_that_does_not_answer_is_one_error_line(tmp_path):
    port = free_port()  # nothing listens there: process 0 never started
    line = _cli_error(
        tmp_path,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=2,
        JAX_PROCESS_ID=1,
    )
    assert f"nothing answered at the coordinator JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}" in line
    assert "JAX_PROCESS_ID=0" in line and "distributed_timeout_s" in line


def test_a_missing_third_process_is_what_process_1_names_after_process_0_gave_up(tmp_path):
    """Process 1 once blamed process 0 ("nothing answered at the coordinator") when process
    0 had answered and then left on its own, earlier timeout."""
    port = free_port()
    procs = []
    for i, timeout_s in ((0, 5), (1, 15)):  # process 0 gives up (and goes) first
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=3,
                   JAX_PROCESS_ID=i)  # fmt: skip
        args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True"]
        procs.append(_start([*args, f"--config.distributed_timeout_s={timeout_s}"], env))
    for rc, _, stderr in _finish(procs, timeout=120):
        assert rc == 2, stderr[-3000:]
        assert f"error: not every process joined the coordinator at 127.0.0.1:{port}" in stderr
        assert "all 3 processes (JAX_PROCESS_ID=0..2)" in stderr


def test_a_process_killed_mid_run_leaves_its_peer_one_error_line_and_exit_1(tmp_path):
    """The survivor of a kill -9 printed a traceback, hung in JAX's shutdown barrier, then
    aborted (exit 134, 70 lines). Now: one line saying how to go on, exit 1 (a scheduler
    restarts the run; 2 is for bad input), and the summary says what failed."""
    port = free_port()
    procs = []
    for i in range(2):
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i)  # fmt: skip
        args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True",
                "--config.num_epochs=4", "--config.checkpoint.every_steps=2"]  # fmt: skip
        procs.append(_start([*args, "--config.distributed_timeout_s=120"], env))
    try:
        for line in procs[0].stdout:
            if line.startswith("train step      3/"):
                procs[1].kill()
                break
        [(rc, _, stderr)] = _finish(procs[:1], timeout=120)
    finally:
        _finish(procs)
    errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert rc == 1 and "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: a step across the run's 2 processes failed at step ")
    assert "start every process again with the same command" in errors[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] and not summary["completed"]


@pytest.mark.parametrize(
    "env,expect",
    [
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1"}, "must be HOST:PORT"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99999"}, "must be HOST:PORT"),
        ({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' must be an integer >= 1"),
        ({"JAX_NUM_PROCESSES": "0"}, "must be an integer >= 1"),
        ({"JAX_PROCESS_ID": "-1"}, "JAX_PROCESS_ID='-1' must be an integer >= 0"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "number the processes 0..1"),
        ({"JAX_LOCAL_DEVICE_IDS": "0;1"}, "separated by commas"),
    ],
)
def test_bad_variables_are_named_before_jax_is_called(env, expect):
    with pytest.raises(ConfigError, match=re.escape(expect)):
        distributed.from_env(env)


def test_variables_become_the_arguments_of_initialize():
    env = {
        "JAX_COORDINATOR_ADDRESS": "host-0.jobs:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
        "JAX_LOCAL_DEVICE_IDS": "0, 1",
    }
    assert distributed.from_env(env) == {
        "coordinator_address": "host-0.jobs:1234",
        "num_processes": 4,
        "process_id": 3,
        "local_device_ids": [0, 1],
    }
    assert distributed.from_env({"JAX_PROCESS_ID": ""}) == {}  # empty is unset: JAX detects


def test_a_taken_coordinator_port_is_named():
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    with socket.socket(family) as s:  # where a live coordinator listens
        s.bind((host, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} of JAX_COORDINATOR_ADDRESS"):
            distributed.check_port_free(f"127.0.0.1:{port}", environ={})
