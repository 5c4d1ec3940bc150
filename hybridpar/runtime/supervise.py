"""The parent of a distributed training process: it turns JAX's C++ abort into one line.

    code = supervise.run(command, checkpoints="WORKDIR/checkpoints", heartbeat_s=100.0)

When a process of a multi-process run dies, JAX's distributed client in each other
process learns it from the coordinator (a task that stopped sending heartbeats within
``distributed_heartbeat_s``, a coordinator that is gone, a process id that connected twice)
and aborts that process from C++: a fatal log line, ~20 lines of stack trace, exit 134. No
Python ``except`` runs there. So ``python -m hybridpar.train ... --config.distributed=True``
runs the trainer as a child with the same arguments, and this parent:

- passes the child's stdout through untouched (inherited) and its stderr line by line;
- passes SIGTERM, SIGINT and SIGHUP on to the child, once each: the child runs in its own
  process group, so a terminal's Ctrl-C reaches only this parent, which hands it on, and
  the child never sees one signal twice (a second would mean "stop at once"); after a
  SIGHUP, a terminal that hung up gets no more lines (``signals.leave_hung_up_terminal``:
  a write there failed, and this parent's end took the child, unsaved, with it);
- exits with the child's exit code (128 + N for a child killed by signal N, as a shell
  says it), except where the child died of a signal after JAX's fatal text: then JAX's
  log lines of it and the stack trace are held back (written to a file in the temporary
  folder, which the line names) and the last line is one ``error:`` naming what JAX saw
  and how to resume, exit 1 (2 for two processes started with one ``JAX_PROCESS_ID``, a
  mistake in the command).

JAX's other lines stay: gloo's ``[Gloo] Rank N is connected to ...`` comes on the
child's stdout, from C++ with no setting to quiet it, and ``TF_CPP_MIN_LOG_LEVEL`` would
quiet XLA's errors of every kind, not only these.

The child dies with this parent (``PR_SET_PDEATHSIG``, Linux): a ``kill -9`` of the
command stops the trainer too, as it did before there was a parent.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import tempfile

from hybridpar.runtime import signals
from hybridpar.runtime.checkpoint_dirs import committed_steps

CHILD = "HYBRIDPAR_SUPERVISED"  # set in the child's environment: it trains, not supervises
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FATAL = "JAX distributed service detected fatal errors"
TRACE = "*** Check failure stack trace"
PY_TRACE = "Traceback (most recent call last):"
# JAX's distributed service's own log lines (glog's format): its errors come just before
# its fatal line, so they are held with the stack trace
SERVICE_LOG = re.compile(r"[EF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*\.cc|client\.h):\d+\]")
SERVICE_HELD = 50  # of those lines in a row, at most this many held (the newest)
TRACE_PREFIX = "hybridpar-jax-abort-"
KEEP_TRACES = 10


def is_child(environ=os.environ) -> bool:
    return environ.get(CHILD) == "1"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux; elsewhere skipped)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def what_failed(text: str, heartbeat_s: float | None = None) -> tuple[str, int]:
    """``(what happened, exit code)`` from the child's stderr after JAX's fatal line;
    ``heartbeat_s``: the run's ``distributed_heartbeat_s``, named where it ran out."""
    twice = re.search(r"\b(\d+) unexpectedly tried to connect", text)
    if twice:
        i = twice.group(1)
        return (
            f"two processes use JAX_PROCESS_ID={i}? JAX's coordinator saw process {i} "
            f"connect twice: give each process its own JAX_PROCESS_ID, 0..JAX_NUM_PROCESSES-1, "
            f"and start every process again",
            2,
        )
    # one task a line, as "1" or "/job:jax_worker/replica:0/task:1"
    unhealthy = re.search(r"tasks are unhealthy[^\n]*\n(.*?)\n\s*The tasks", text, re.S)
    block = unhealthy.group(1) if unhealthy else ""
    ids = re.findall(r"task:(\d+)" if "task:" in block else r"\d+", block)
    ids = ids or re.findall(r"Task (\d+) heartbeat timeout", text)
    if ids:
        ids = sorted(set(ids), key=int)
        who = f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)}"
        within = "distributed_heartbeat_s"
        if heartbeat_s is not None:  # a process only stalled (paused, a busy host) needs more
            within = (f"{heartbeat_s:g} s; if {'they were' if len(ids) > 1 else 'it was'} only "
                      f"slow, raise --config.distributed_heartbeat_s (now {heartbeat_s:g}) on "
                      "every process")  # fmt: skip
        return (
            f"{who} of the run stopped (JAX's distributed service heard no heartbeat from "
            f"{'them' if len(ids) > 1 else 'it'} within {within})",
            1,
        )
    if "leader task" in text or "Failed to send RPC to coordination service" in text:
        return "process 0 of the run (the coordinator) stopped or cannot be reached", 1
    return "a process of the run stopped (JAX's distributed service reported fatal errors)", 1


def error_line(text: str, checkpoints: str | None, trace_file: str | None,
               heartbeat_s: float | None = None) -> tuple[str, int]:  # fmt: skip
    what, code = what_failed(text, heartbeat_s)
    trace = f" (JAX's stack trace: {trace_file})" if trace_file else ""
    if code == 2:
        return what + trace, code
    step = max(committed_steps(checkpoints), default=None) if checkpoints else None
    if step is None:
        kept, where = "no checkpoint was saved yet", "from step 0"
    else:
        kept, where = f"the checkpoints up to step {step} in {checkpoints} are intact", (
            f"from step {step}"
        )
    line = (
        f"{what}, so JAX stopped this process too; {kept}: start every process again with the "
        f"same command (and the same JAX_* variables) to resume {where}{trace}"
    )
    return line, code


def write_trace(held: list[bytes]) -> str:
    """The file in the temporary folder that keeps JAX's stack trace, which the error line
    names. The newest ``KEEP_TRACES`` of them stay, this one among them, and older ones go:
    a named file outlives the process (a run's processes on one host each get theirs, and
    there is time to read them), and the folder does not collect one per abort for ever."""
    fd, path = tempfile.mkstemp(prefix=TRACE_PREFIX, suffix=".txt")
    with os.fdopen(fd, "wb") as f:
        f.writelines(held)

    def age(p):
        try:
            return os.path.getmtime(p)
        except OSError:  # gone meanwhile
            return float("inf")

    traces = sorted(glob.glob(os.path.join(os.path.dirname(path), TRACE_PREFIX + "*.txt")),
                    key=age)  # fmt: skip
    for old in traces[:-KEEP_TRACES]:
        if old != path:
            try:
                os.remove(old)
            except OSError:  # another user's, or gone meanwhile
                pass
    return path


def run(command: list[str], checkpoints: str | None = None, env=None,
        heartbeat_s: float | None = None) -> int:  # fmt: skip
    """Runs ``command`` as the child and returns the exit code this process should end with
    (see the module's docstring). ``checkpoints``: the run's checkpoint folder, and
    ``heartbeat_s``: its ``distributed_heartbeat_s``, both named in the error line."""
    env = dict(os.environ if env is None else env, **{CHILD: "1"})
    children, early = [], []  # the child, once started; the signals that came before

    def forward(signum, frame):
        signals.leave_hung_up_terminal(signum)
        try:
            children[0].send_signal(signum)
        except IndexError:  # not started yet: sent as soon as it is
            early.append(signum)
        except ProcessLookupError:  # it has just ended
            pass

    # an ignored signal (nohup's SIGHUP, SIGINT in a script's background job) stays ignored,
    # here and in the child, which inherits that
    before = {s: signal.getsignal(s) for s in FORWARDED}
    for s, h in before.items():
        if h != signal.SIG_IGN:
            signal.signal(s, forward)
    out = sys.stderr.buffer
    fatal, held = [], []  # the text from JAX's fatal line on; the traces held back
    service = []  # JAX's distributed service's latest log lines, held until the next line
    holding = False
    sys.stdout.flush()  # what this process said comes before the child's lines
    try:
        child = subprocess.Popen(
            command,
            env=env,
            stderr=subprocess.PIPE,
            process_group=0,  # the terminal's signals reach only us: we pass each on once
            preexec_fn=_die_with_parent,
        )
        children.append(child)
        for signum in early:
            child.send_signal(signum)
        for raw in child.stderr:
            line = raw.decode(errors="replace")
            if FATAL in line or fatal:
                fatal.append(line)
            # JAX's stack trace after its fatal line and a Python traceback (a collective
            # that failed as a peer went, raised just before JAX's abort), and all that
            # follows them: held until the child's end says whether JAX aborted it (then
            # they go to a file), else shown. JAX's distributed service's log lines go
            # with the trace they precede; before any other line (a service error the run
            # went on from), they are shown.
            if line.startswith(PY_TRACE) or fatal:
                holding = True
            if holding:
                held += service
                service = []
                held.append(raw)
                continue
            if SERVICE_LOG.match(line):
                service.append(raw)
                if len(service) > SERVICE_HELD:
                    out.write(service.pop(0))
                    out.flush()
                continue
            out.write(b"".join(service) + raw)
            out.flush()
            service = []
        code = child.wait()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    held += service  # the child's last lines, with no trace after them
    if code >= 0 or not fatal:
        out.write(b"".join(held))  # not JAX's abort after all: nothing is hidden
        out.flush()
        return code if code >= 0 else 128 - code  # a signal: the shell's 128 + N
    trace_file = write_trace(held) if held else None
    line, exit_code = error_line("".join(fatal), checkpoints, trace_file, heartbeat_s)
    print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    return exit_code
