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
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import NO_LLVM_OPT_FLAG, free_port
from xla_flags import cpu_flags

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config
from hybridpar.parallel import distributed
from hybridpar.runtime import run_config, supervise

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
    # Every process compiles without LLVM's optimisations (a large part of each compile; the three
    # start at once on 2 cores): the runs are compared with each other, not timed, and the
    # level changes no collective.
    env.update(XLA_FLAGS=cpu_flags(devices, NO_LLVM_OPT_FLAG), JAX_PLATFORMS="cpu")
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


@pytest.mark.parametrize("case", ["another_lr", "another_workdir", "another_count",
                                  "allow_on_one"])  # fmt: skip
def test_processes_of_one_run_with_another_config_or_workdir_stop_with_one_error_each(
    tmp_path, case
):
    """Another LR in one process trained other losses in the same collectives, two
    workdirs hung in the first checkpoint, and a process told JAX_NUM_PROCESSES=3 of a run
    of 2 trained on unnoticed, and --allow-config-change on one process let it train on a
    changed config the others refused: each process now stops at set-up, exit 2. The LR case on a
    workdir that holds the run's config.json, as a resume finds it: process 1 refused the
    workdir alone, at once, and process 0 waited out distributed_timeout_s to blame joining."""
    if case == "another_lr":
        path, overrides, _ = cli.split_config_args([*SHORT, "--config.distributed=True"])
        (tmp_path / "w").mkdir()
        saved = run_config.config_dict(cli.load(path, overrides))
        (tmp_path / "w" / "config.json").write_text(json.dumps(saved))
    port = free_port()
    procs = []
    for i in range(2):
        count = 3 if case == "another_count" and i == 1 else 2
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=count,
                   JAX_PROCESS_ID=i)  # fmt: skip
        w = tmp_path / (f"w{i}" if case == "another_workdir" else "w")
        args = [*SHORT, "--workdir", str(w), "--config.distributed=True"]
        if case == "another_lr" and i == 1:
            args.append("--config.optim.base_lr=0.8")
        if case == "allow_on_one" and i == 0:
            args.append("--allow-config-change")
        procs.append(_start([*args, "--config.distributed_timeout_s=60"], env))
    lines = []
    for rc, _, stderr in _finish(procs, timeout=240):
        errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
        assert rc == 2 and "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
        lines.append(errors[0])
    if case == "another_lr":
        assert lines[0].startswith("error: process(es) 1 run another config than process 0 "
                                   "(process 1: optim.base_lr (here 0.4))")  # fmt: skip
        assert lines[1].startswith(
            "error: process 1 runs another config than process 0: optim.base_lr is 0.8 "
            "here, 0.4 in process 0"
        )
    elif case == "another_workdir":  # each path said as whose it is
        assert f"process 0 writes in --workdir={tmp_path / 'w0'}: every" in lines[0], lines[0]
        assert ("process 0 writes in its --workdir (process 1, this one, was given "
                f"--workdir={tmp_path / 'w1'}): every") in lines[1], lines[1]  # fmt: skip
    elif case == "allow_on_one":
        for line in lines:
            assert line.startswith("error: --allow-config-change is passed to process(es) 0 "
                                   "but not to every other process: pass it on every process")
    else:
        for line in lines:
            assert line.startswith(
                "error: 2 processes joined the run, but JAX_NUM_PROCESSES=3 in process 1: set "
                "JAX_NUM_PROCESSES=2 in every process"
            )
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


def test_a_coordinator_gone_since_it_answered_may_be_an_earlier_runs():
    """A pair started again on the port of one whose process 0 still waited: the new process
    1 joined the old coordinator, which then stopped, and said after 300 s only that not
    every process joined. Now it says the coordinator it reached is gone, and may have been
    an earlier run's. Planted bug that fails it: no such clause."""
    port = free_port()  # nothing listens there now
    kw = {"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2, "process_id": 1}
    line = distributed.timeout_message(kw, 300, reached=True)
    assert line.startswith(f"not every process joined the coordinator at 127.0.0.1:{port} "
                           "within 300 s (the coordinator this process reached has gone "
                           "since: process 0 gave up")  # fmt: skip
    assert "an earlier run's process 0, still waiting on that port" in line
    with socket.socket() as coordinator:  # still there: no such clause
        coordinator.bind(("127.0.0.1", 0))
        coordinator.listen()
        kw["coordinator_address"] = f"127.0.0.1:{coordinator.getsockname()[1]}"
        line = distributed.timeout_message(kw, 300, reached=True)
    assert "gone" not in line and "within 300 s: start all 2 processes" in line


@pytest.mark.parametrize("killed", [1, 0])
def test_a_process_killed_mid_run_leaves_its_peer_one_error_line_and_exit_1(tmp_path, killed):
    """The survivor of a kill -9 printed a traceback, hung in JAX's shutdown barrier, then
    aborted (exit 134, 70 lines); or, the step's collective never failing, sat until JAX's
    heartbeat timeout (100 s) and aborted from C++ with a stack trace. Now: one line saying
    how to go on, the last, exit 1 (a scheduler restarts the run; 2 is for bad input). A
    killed process 0 takes the coordinator with it: process 1 is aborted by JAX at once,
    which the command's supervising parent turns into that line. A 5 s heartbeat keeps the
    wait for a silent process 1 short."""
    port = free_port()
    procs = []
    trace_dir = tmp_path / "tmp"  # where JAX's stack trace goes (TMPDIR), not the machine's /tmp
    trace_dir.mkdir()
    for i in range(2):
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i, TMPDIR=trace_dir)  # fmt: skip
        args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True",
                "--config.num_epochs=4", "--config.checkpoint.every_steps=2",
                "--config.distributed_heartbeat_s=5"]  # fmt: skip
        procs.append(_start([*args, "--config.distributed_timeout_s=120"], env))
    survivor = procs[1 - killed]
    try:
        for line in procs[0].stdout:
            if line.startswith("train step      3/"):
                procs[killed].kill()  # the command: its trainer dies with it
                break
        [(rc, _, stderr)] = _finish([survivor], timeout=120)
    finally:
        _finish(procs)
    errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert rc == 1 and "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == errors[0]
    assert "Check failure stack trace" not in stderr and "    @ " not in stderr
    assert supervise.FATAL not in stderr  # JAX's fatal line, where the trainer's line won too
    assert "start every process again with the same command" in errors[0]
    if errors[0].startswith("error: a step across the run's 2 processes failed at step "):
        # the trainer's own line: a collective failed in Python before JAX's service
        # aborted the process (either may come first, whichever process was killed)
        if killed == 1:  # process 0, which writes the summary, lived on to write it
            summary = json.loads((tmp_path / "summary.json").read_text())
            assert summary["error"] and not summary["completed"]
    else:  # JAX's abort, as the supervising parent says it
        assert errors[0].startswith(f"error: process {killed} of the run ")
        assert re.search(r"resume from step \d+", errors[0]), errors[0]
        assert f"(JAX's stack trace: {trace_dir}/hybridpar-jax-abort-" in errors[0]


def test_ctrl_c_in_one_process_saves_every_process_at_the_next_step(tmp_path):
    """Ctrl-C (SIGINT to process 0's command, as a terminal sends it) stopped process 0 at
    once, exit 130, no checkpoint, and JAX then aborted process 1. Now it takes SIGTERM's
    path: its first line as on one process, every process saves at JAX's preemption sync
    point and exits 0, and the same command resumes there. SIGHUP (process 1's ssh session
    closed, at the same time) ended process 1 unsaved: it takes the same path. And only
    process 0 said it stopped: each process says so now."""
    port = free_port()
    procs = []
    for i in range(2):
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i)  # fmt: skip
        args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True",
                "--config.num_epochs=4", "--config.distributed_timeout_s=120"]  # fmt: skip
        procs.append(_start(args, env))
    try:
        said = []
        for line in procs[0].stdout:
            said.append(line)
            if line.startswith("train step      3/"):
                procs[0].send_signal(signal.SIGINT)  # the command hands it to its trainer
                procs[1].send_signal(signal.SIGHUP)
                break
        results = _finish(procs, timeout=120)
    finally:
        _finish(procs)
    for rc, _, stderr in results:
        assert rc == 0 and "error: " not in stderr and "Traceback" not in stderr, stderr[-3000:]
    stdout = "".join(said) + results[0][1]
    assert ("SIGINT: saving a checkpoint at the next step boundary, then stopping (send "
            "SIGINT again to stop at once)") in stdout  # fmt: skip
    assert ("SIGHUP: saving a checkpoint at the next step boundary, then stopping (send "
            "SIGHUP again to stop at once)") in results[1][1]  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] and not summary["completed"]
    step = summary["steps"]
    assert 3 <= step < summary["total_steps"], summary
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) == step  # both processes' shards, or the save would not have committed
    for sig, out in (("SIGINT", stdout), ("SIGHUP", results[1][1])):
        assert f"stopped ({sig}) at step {step}/{summary['total_steps']} with a checkpoint; " \
            "resume with the same command:" in out, out[-2000:]  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_processes_join_exits_0_saying_so(tmp_path, sig):
    """SIGTERM to a process still waiting for its peers to join (the main thread inside
    JAX's C++ connect, for up to distributed_timeout_s) ended it by the default action,
    exit 143, unsaid. Now it is the single-process stop before the first step: one line,
    exit 0, nothing written. Ctrl-C likewise. Something listens at the coordinator's
    address and never answers, so the process is inside the join when the signal comes."""
    with socket.socket() as coordinator:
        coordinator.bind(("127.0.0.1", 0))
        coordinator.listen()
        coordinator.settimeout(60)
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator.getsockname()[1]}",
                   JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1)  # fmt: skip
        w = tmp_path / "w"
        args = [*SHORT, "--workdir", str(w), "--config.distributed=True",
                "--config.distributed_timeout_s=60"]  # fmt: skip
        p = _start(args, env)
        try:
            coordinator.accept()[0].close()  # the process is joining
            time.sleep(1)  # inside JAX's connect by now
            p.send_signal(sig)
        finally:
            [(rc, stdout, stderr)] = _finish([p], timeout=60)
    name = signal.Signals(sig).name
    assert rc == 0 and "error" not in stderr and "Traceback" not in stderr, (rc, stderr)
    assert stdout == (f"{name}: stopped before the first step: nothing to save; the same "
                      "command starts the run\n")  # fmt: skip
    assert not w.exists()


def test_two_processes_with_one_process_id_are_named(tmp_path):
    """A second JAX_PROCESS_ID=1 made JAX abort process 0 and the first process 1 from C++
    (exit 134, "different incarnation"); now they say which id is taken twice, exit 2, and
    the one that never joined says joining failed."""
    port = free_port()
    procs = []
    for i in (0, 1, 1):  # TMPDIR: where JAX's stack traces go, not the machine's /tmp
        env = _env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
                   JAX_PROCESS_ID=i, TMPDIR=tmp_path)  # fmt: skip
        args = [*SHORT, "--workdir", str(tmp_path), "--config.distributed=True"]
        procs.append(_start([*args, "--config.distributed_timeout_s=12"], env))
    lines = []
    for rc, _, stderr in _finish(procs, timeout=120):
        errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
        assert rc == 2 and len(errors) == 1, stderr[-3000:]
        assert stderr.strip().splitlines()[-1] == errors[0]
        assert "Check failure stack trace" not in stderr and "Traceback" not in stderr
        lines.append(errors[0])
    twice = [x for x in lines if "two processes use JAX_PROCESS_ID=1" in x]
    assert len(twice) >= 2, lines  # process 0 and one of the two
    assert lines[0].startswith("error: process 1 joined JAX's coordinator a second time: ")
    assert any(x.startswith("error: another process joined JAX's coordinator as process 1, "
                            "this process's JAX_PROCESS_ID") for x in lines[1:]), lines  # fmt: skip


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


def test_the_heartbeat_timeout_is_passed_to_jax(monkeypatch):
    """``distributed_heartbeat_s`` is JAX's heartbeat timeout: how long a process of a run
    hangs on a silent peer before JAX stops it (JAX's default, 100 s, was all there was)."""
    seen = {}
    monkeypatch.setattr("jax.distributed.is_initialized", lambda: False)
    monkeypatch.setattr("jax.distributed.initialize", lambda **kw: seen.update(kw))
    for var, value in (("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{free_port()}"),
                       ("JAX_NUM_PROCESSES", "2"), ("JAX_PROCESS_ID", "1"),
                       ("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")):  # fmt: skip
        monkeypatch.setenv(var, value)
    config = base_config()
    config.distributed_heartbeat_s = 7.0
    distributed.initialize(config)
    assert seen["heartbeat_timeout_seconds"] == 7 and seen["process_id"] == 1


def test_a_resume_may_change_how_long_processes_wait_for_each_other():
    """The join and heartbeat timeouts change no number and nothing a checkpoint holds: a
    run stopped because a slow peer timed out resumes with longer ones, without
    --allow-config-change. Another key still differs."""
    saved = run_config.config_dict(base_config())
    new = base_config()
    new.distributed_timeout_s, new.distributed_heartbeat_s = 900, 300.0
    assert run_config.differences(saved, run_config.config_dict(new)) == []
    new.seed += 1
    assert [d[0] for d in run_config.differences(saved, run_config.config_dict(new))] == ["seed"]


def _as_process_1_of_2(monkeypatch, devices=(4, 4), process_0_config=None):
    """``check_processes_agree`` seen from process 1 of 2 with ``devices`` devices each,
    without a second process: JAX's collectives answer as process 0 would, with
    ``process_0_config`` (its ``config_dict``), and every process agreeing."""
    import jax
    from jax.experimental import multihost_utils as mh

    fake = [type("Device", (), {"process_index": i})() for i, n in enumerate(devices)
            for _ in range(n)]  # fmt: skip
    text = np.frombuffer(json.dumps(process_0_config or {}).encode(), np.uint8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "devices", lambda: fake)

    def as_jax(answer):
        def collective(x):
            np.empty(len(fake)).reshape(2, devices[1])  # as JAX's: processes x local devices
            return answer(x)

        return collective

    size_or_text = as_jax(lambda x: np.int32(text.size) if np.ndim(x) == 0 else text)
    monkeypatch.setattr(mh, "broadcast_one_to_all", size_or_text)
    monkeypatch.setattr(mh, "process_allgather", as_jax(lambda x: np.stack([x, x])))


def test_processes_with_unequal_device_counts_are_one_error_naming_the_counts(monkeypatch):
    """4 devices in process 0 and 2 in process 1 were a 26-line traceback ending in JAX's
    ``cannot reshape array of size 6 into shape (2,4)`` (its broadcast needs equal
    counts); now every process says the counts before any collective."""
    _as_process_1_of_2(monkeypatch, devices=(4, 2))
    with pytest.raises(ConfigError) as e:
        run_config.check_processes_agree(base_config(), None)
    assert str(e.value).startswith(
        "the processes of the run drive different numbers of devices (4 in process 0, 2 in "
        "process 1): give every process the same number"
    )
    assert "JAX_LOCAL_DEVICE_IDS" in str(e.value) and "CUDA_VISIBLE_DEVICES" in str(e.value)


def test_every_process_must_set_the_one_heartbeat_timeout(monkeypatch):
    """Only process 0's ``distributed_heartbeat_s`` timed out a silent process (process 1's
    10 s: the abort came after process 0's default 100 s): a value only some processes set
    is refused as another config, like any key the processes must share."""
    _as_process_1_of_2(monkeypatch, process_0_config=run_config.config_dict(base_config()))
    config = base_config()
    config.distributed_heartbeat_s = 10.0
    with pytest.raises(ConfigError, match=re.escape(
            "process 1 runs another config than process 0: distributed_heartbeat_s is 10.0 "
            "here, 100.0 in process 0")):  # fmt: skip
        run_config.check_processes_agree(config, None)
    config.distributed_heartbeat_s, config.log_every_s = 100.0, 7.0  # still each its own
    run_config.check_processes_agree(config, None)


def test_jax_variables_without_distributed_are_one_error_before_anything_is_written(
    tmp_path, monkeypatch, capfd
):
    """JAX_NUM_PROCESSES=2 and the coordinator's variables set, --config.distributed=True
    forgotten: process 0 trained alone on all the data, exit 0, and process 1 was kept out
    only by the workdir lock (per host on some shared file systems)."""
    from helpers import main_here

    from hybridpar.tools import train

    for var, value in (("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234"),
                       ("JAX_NUM_PROCESSES", "2"), ("JAX_PROCESS_ID", "1")):  # fmt: skip
        monkeypatch.setenv(var, value)
    w = tmp_path / "w"
    code, _, err = main_here(train.main, [*SHORT, "--workdir", str(w)], capfd)
    assert code == 2 and err.strip().splitlines() == [
        "error: JAX_COORDINATOR_ADDRESS=127.0.0.1:1234, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1 "
        "are set but --config.distributed is off: this process would train alone, on all the "
        "data; pass --config.distributed=True on every process, or unset them to train in "
        "one process"
    ], err
    assert not w.exists()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")  # one process: nothing forgotten
    assert distributed.forgotten(os.environ) is None


# A stand-in for the trainer under the supervising parent: what JAX's C++ abort writes
# (the text of a real one, shortened), then SIGABRT; or a plain exit; or it counts signals.
FAKE_TRAINER = r"""
import os, select, signal, sys, time
mode = sys.argv[1]
print("a line on stdout", flush=True)
print("a line on stderr", file=sys.stderr, flush=True)
if mode == "raise":  # a plain Python failure: its traceback, exit 1
    sys.stderr.write("Traceback (most recent call last):\nValueError: plain\n")
    sys.exit(1)
if mode == "raise_then_abort":  # a collective failed in Python as the peer went
    sys.stderr.write("Traceback (most recent call last):\n  File \"x.py\"\n"
                     "jax.errors.JaxRuntimeError: Gloo AllGather failed\n")
if mode in ("abort", "raise_then_abort"):
    sys.stderr.write(
        "E1206 18:23:29.603900 22261 coordination_service_agent.cc:289] Polled an error from "
        "coordination service (this can be an error from this or another task).\n"
        "F1206 18:23:29.603992 22261 client.h:80] Terminating process because the JAX "
        "distributed service detected fatal errors. This most likely indicates that another "
        "task died. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped "
        "sending heartbeats):\n1\nThe tasks have crashed.\n\nRPC: /xla.coordination."
        "CoordinationService/PollForError\n*** Check failure stack trace: ***\n"
        "    @     0x7f12d3240634  absl::log_internal::LogMessage::SendToLog()\n"
    )
    sys.stderr.flush()
    os.abort()
if mode == "service_error":  # a service error line the run goes on from
    sys.stderr.write(
        "E1206 18:23:29.603900 22261 coordination_service_agent.cc:289] Polled an error from "
        "coordination service (this can be an error from this or another task).\n"
        "a later line on stderr\n"
    )
    sys.stderr.flush()
    go, end = os.path.join(os.path.dirname(__file__), "go"), time.time() + 10
    while not os.path.exists(go) and time.time() < end:  # the test saw the lines
        time.sleep(0.05)
    sys.exit(3 if os.path.exists(go) else 4)
if mode == "signals":  # each arrival counted, as the trainer counts them (signals.py)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda n, f: None)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)  # one byte per arrival
    same = os.getpgrp() == os.getpgid(os.getppid())  # in the group a terminal signals?
    print(f"ready; in the parent's process group: {same}", file=sys.stderr, flush=True)
    got, end = b"", time.time() + 20
    while time.time() < end and len(got) < 2:
        if select.select([read], [], [], 0.1)[0]:
            got += os.read(read, 64)
    if select.select([read], [], [], 0.5)[0]:  # a second copy of a signal would come in this
        got += os.read(read, 64)
    print("got " + " ".join(sorted(signal.Signals(n).name for n in got)), file=sys.stderr,
          flush=True)
sys.exit(3)
"""


def _supervised(tmp_path, mode: str, heartbeat_s=None) -> subprocess.Popen:
    """``supervise.run`` (the train command's parent) over ``FAKE_TRAINER`` in a session of
    its own, as a terminal's foreground job: a signal to its group is a Ctrl-C."""
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    code = (
        "import sys; from hybridpar.runtime import supervise; "
        f"sys.exit(supervise.run([sys.executable, {str(fake)!r}, {mode!r}], "
        f"checkpoints={str(tmp_path / 'checkpoints')!r}, heartbeat_s={heartbeat_s!r}))"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the stack trace's file goes there
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def test_jax_abort_under_the_train_command_is_one_error_line(tmp_path):
    """JAX's abort is one line, which names the heartbeat timeout it ran out of and the flag
    that sets it; JAX's own log lines of it (E and F) go to the trace file with its stack
    trace, as they surrounded that line; and the temporary folder keeps the newest
    ``KEEP_TRACES`` trace files (the one named among them), not every one ever written."""
    for step in ("2", "4", "6.orbax-checkpoint-tmp-17"):  # 6: still being written
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    earlier = [tmp_path / f"{supervise.TRACE_PREFIX}earlier{i}.txt" for i in range(12)]
    for i, path in enumerate(earlier):
        path.write_text("an earlier abort's trace")
        os.utime(path, (1e9 + i, 1e9 + i))  # the oldest first
    [(rc, stdout, stderr)] = _finish([_supervised(tmp_path, "abort", 5.0)], timeout=60)
    assert rc == 1 and stdout == "a line on stdout\n", stderr
    lines = stderr.splitlines()
    assert lines == ["a line on stderr", lines[-1]], stderr  # JAX's lines held back
    assert lines[-1].startswith(
        "error: process 1 of the run stopped (JAX's distributed service heard no heartbeat "
        "from it within 5 s; if it was only slow, raise --config.distributed_heartbeat_s "
        "(now 5) on every process), so JAX stopped this process too; the "
        f"checkpoints up to step 4 in {tmp_path / 'checkpoints'} are intact: start every "
        "process again with the same command (and the same JAX_* variables) to resume from "
        "step 4 (JAX's stack trace: "
    ), lines[-1]
    trace = Path(lines[-1].rpartition("JAX's stack trace: ")[2].rstrip(")"))
    assert trace.parent == tmp_path and "LogMessage::SendToLog" in trace.read_text()
    assert "Polled an error" in trace.read_text() and "Terminating process" in trace.read_text()
    kept = sorted(tmp_path.glob(f"{supervise.TRACE_PREFIX}*.txt"))
    assert kept == sorted([*earlier[3:], trace]), kept  # the newest 10, this one among them


def test_a_python_traceback_before_jax_abort_goes_to_the_trace_file(tmp_path):
    """A peer gone in the middle of a collective can raise in Python just before JAX's C++
    abort: that traceback is held with JAX's stack trace, in the file, not shown; a plain
    failure's traceback (no abort after it) is still shown: nothing hidden."""
    [(rc, _, stderr)] = _finish([_supervised(tmp_path, "raise_then_abort")], timeout=60)
    assert rc == 1 and "Traceback" not in stderr and "Terminating process" not in stderr
    lines = stderr.splitlines()
    assert lines[0] == "a line on stderr" and lines[-1].startswith("error: process 1 of the run")
    trace = Path(lines[-1].rpartition("JAX's stack trace: ")[2].rstrip(")"))
    assert "Gloo AllGather failed" in trace.read_text()
    [(rc, _, stderr)] = _finish([_supervised(tmp_path, "raise")], timeout=60)
    assert (rc, stderr) == (1, "a line on stderr\nTraceback (most recent call last):\n"
                               "ValueError: plain\n")  # fmt: skip


def test_a_service_error_the_run_goes_on_from_is_shown_as_it_comes(tmp_path):
    """One non-fatal line of JAX's distributed service held every line after it in memory
    until the trainer's end. Now the service's lines wait only for the next line: shown
    with it, in order, while the trainer runs (it waits here for the test to see them).
    Planted bug that fails it: holding everything from the first service line."""
    p = _supervised(tmp_path, "service_error")
    try:
        lines = [p.stderr.readline() for _ in range(3)]
        (tmp_path / "go").touch()
    finally:
        [(rc, _, stderr)] = _finish([p], timeout=60)
    assert rc == 3 and stderr == "", (rc, stderr)
    assert lines[0] == "a line on stderr\n" and lines[2] == "a later line on stderr\n", lines
    assert supervise.SERVICE_LOG.match(lines[1]) and "Polled an error" in lines[1], lines


def test_a_plain_exit_under_the_train_command_is_the_trainers(tmp_path):
    [(rc, stdout, stderr)] = _finish([_supervised(tmp_path, "exit")], timeout=60)
    assert (rc, stdout, stderr) == (3, "a line on stdout\n", "a line on stderr\n")


def test_the_train_command_hands_each_signal_to_the_trainer_once(tmp_path):
    """A terminal's Ctrl-C reaches the whole foreground group: a trainer in it would get it
    twice (once from the terminal, once passed on; or once, where the two arrive together),
    and a second signal stops it at once without a checkpoint. So the trainer runs in a
    group of its own and gets each signal from the parent, which neither dies of one nor
    prints a traceback."""
    p = _supervised(tmp_path, "signals")
    try:
        assert p.stderr.readline() == "a line on stderr\n"
        assert p.stderr.readline() == "ready; in the parent's process group: False\n"
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C
        os.kill(p.pid, signal.SIGTERM)  # a scheduler's stop, to the command
    finally:
        [(rc, _, stderr)] = _finish([p], timeout=60)
    assert rc == 3 and stderr == "got SIGINT SIGTERM\n", stderr
