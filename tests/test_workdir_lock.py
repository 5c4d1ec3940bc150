"""One trainer per workdir (hybridpar/runtime/workdir_lock.py).

* A held lock refuses a second one with the holder's host, pid and start time; a clean
  release removes the file and frees the workdir; a probe (``held``) neither takes the lock
  from a trainer nor makes one fail.
* A holder killed with SIGKILL leaves no stale lock.
* Through the CLI: a trainer on a workdir whose lock another process holds is one
  ``error:`` line naming the holder, exit 2, and writes nothing there.
"""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import DIGITS, TINY_DIGITS, config_args

from hybridpar.config.errors import ConfigError
from hybridpar.runtime import workdir_lock

ROOT = Path(__file__).resolve().parents[1]


def test_a_held_lock_refuses_a_second_one_naming_its_holder(tmp_path):
    lock = workdir_lock.acquire(str(tmp_path))
    info = json.loads((tmp_path / ".lock").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert workdir_lock.held(str(tmp_path))
    who = f"in use by another trainer (pid {os.getpid()} on host {socket.gethostname()}, since "
    with pytest.raises(ConfigError, match=re.escape(who + info["since"])):
        workdir_lock.acquire(str(tmp_path), retry_s=0)
    assert json.loads((tmp_path / ".lock").read_text()) == info  # the refused one wrote nothing
    lock.release()
    lock.release()  # a second release does nothing
    assert not (tmp_path / ".lock").exists() and not workdir_lock.held(str(tmp_path))
    workdir_lock.acquire(str(tmp_path), retry_s=0).release()
    # each process of a multi-process run has its own file: they never wait on each other
    a, b = workdir_lock.acquire(str(tmp_path)), workdir_lock.acquire(str(tmp_path), process=1)
    assert (tmp_path / ".lock.1").exists()
    a.release(), b.release()


def test_a_probe_does_not_make_a_trainer_fail(tmp_path):
    (tmp_path / ".lock").write_text("")
    fd = os.open(tmp_path / ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as held() does, held for a moment
    threading.Timer(0.3, os.close, [fd]).start()
    lock = workdir_lock.acquire(str(tmp_path))  # retries past the probe
    assert workdir_lock.held(str(tmp_path))
    lock.release()


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    code = (
        "import sys, time; from hybridpar.runtime import workdir_lock; "
        "lock = workdir_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        assert p.stdout.readline().strip() == "held"
        assert workdir_lock.held(str(tmp_path))
        with pytest.raises(ConfigError, match=f"pid {p.pid} "):
            workdir_lock.acquire(str(tmp_path), retry_s=0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (tmp_path / ".lock").exists()  # the file stays, its lock went with the process
    assert not workdir_lock.held(str(tmp_path))
    workdir_lock.acquire(str(tmp_path), retry_s=0).release()


def test_cli_second_trainer_is_refused_and_touches_nothing(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    lock = workdir_lock.acquire(str(w))  # this process stands for the first trainer
    before = {p.name: p.stat().st_mtime_ns for p in w.iterdir()}
    cmd = [sys.executable, "-m", "hybridpar.train", "--config", DIGITS, "--workdir", str(w),
           "--config.mesh=data:8", *config_args(TINY_DIGITS)]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and f"pid {os.getpid()} on host {socket.gethostname()}" in errors[0]
    assert "stop it (SIGTERM saves a checkpoint)" in errors[0]
    assert {p.name: p.stat().st_mtime_ns for p in w.iterdir()} == before  # only our .lock
    lock.release()


class TryTheLock:
    """A trainer hook that, after each step, checks the workdir's lock is held and that a
    second trainer's attempt on the workdir is refused (a second open file, as another
    process's would be: ``flock`` locks belong to the open file, not the process)."""

    def __init__(self, workdir):
        self.workdir, self.refused = workdir, []

    def __call__(self, loop, state, metrics, stage):
        assert workdir_lock.held(self.workdir), f"the lock was not held at step {loop.step}"
        with pytest.raises(ConfigError, match="is in use by another trainer"):
            workdir_lock.acquire(self.workdir, retry_s=0)
        self.refused.append(loop.step)


def test_a_trainer_holds_its_lock_from_set_up_through_its_last_step(tmp_path):
    """Planted bug that fails it at the first step: the lock released at the end of set-up
    (found before only by an evaluator test's timeout)."""
    from helpers import tiny_digits

    from hybridpar.runtime import trainer
    from hybridpar.runtime.run import setup

    w = str(tmp_path / "w")
    run = setup(tiny_digits(num_epochs=0.1), w)
    assert workdir_lock.held(w)
    probe = TryTheLock(w)
    summary = trainer.train(run, hooks=[probe])
    assert summary["completed"] and probe.refused == list(range(1, summary["steps"] + 1))
    assert not workdir_lock.held(w)  # released at the end, for the next command
