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
  and how to resume, exit 1 (2 for a process id that joined twice: two processes started
  with one ``JAX_PROCESS_ID``, or a process started again while the coordinator from
  before still ran; either way every process must be started again);
- shows no JAX log line of the failure where the child says what failed itself (its
  Python caught the failure as JAX aborted it: its own ``error:`` line, exit 1, comes
  alone); a line of JAX's distributed service the run went on from is shown, at the
  next line (or a pause), with the lines of its message that follow it.

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
import select
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
SERVICE_LOG = re.compile(
    r"[WEF]\d{4} [\d:.]+\s+\d+ (coordination_service\w*\.cc|preemption_sync_manager\.cc"
    r"|client\.h):\d+\]"
)
# A line that starts a log record: glog's (C++ and absl's Python) or Python's logging. A
# record's message may span lines; the lines after its first start no record.
LOG_RECORD = re.compile(r"[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|(DEBUG|INFO|WARNING|ERROR|CRITICAL):")
OWN_ERROR = "error: "  # the trainer's own last line, where it caught the failure itself
# Lines never taken as the next line of a held JAX record: the trainer's own (its warning:
# and error: lines, a traceback) and Python's warnings ("file.py:12: UserWarning: ...")
OWN_LINE = re.compile(r"(warning|error): |Traceback |\S+\.py:\d+: \w+: ")
SERVICE_HELD = 50  # of those lines in a row, at most this many held (the newest)
# A record's lines come in one write: the lines that follow a held one with no pause of
# this many seconds go with it; after such a pause the held lines are shown.
QUIET_S = 1.0
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


def what_failed(text: str, heartbeat_s: float | None = None,
                process_id: int | None = None) -> tuple[str, int]:  # fmt: skip
    """``(what happened, exit code)`` from the child's stderr after JAX's fatal line;
    ``heartbeat_s``: the run's ``distributed_heartbeat_s``, named where it ran out;
    ``process_id``: this process's ``JAX_PROCESS_ID`` (``None``: not known)."""
    twice = re.search(r"\b(\d+) unexpectedly tried to connect", text)
    if twice:
        # JAX cannot tell a second process with one id from a process that stopped and was
        # started again while the coordinator from before still ran: both "connect twice"
        i = twice.group(1)
        again = (
            "stop every process of the run and start them all again, each with its own "
            "JAX_PROCESS_ID, 0..JAX_NUM_PROCESSES-1"
        )
        if process_id is not None and str(process_id) == i:  # this one is alive: not restarted
            return (
                f"another process joined JAX's coordinator as process {i}, this process's "
                f"JAX_PROCESS_ID: two processes use JAX_PROCESS_ID={i} (the same id twice, or "
                f"process {i} started again while this one still ran); {again}",
                2,
            )
        return (
            f"process {i} joined JAX's coordinator a second time: it was probably started "
            f"again (a restart) while the coordinator from before still ran, or two "
            f"processes use JAX_PROCESS_ID={i}; {again}",
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
               heartbeat_s: float | None = None,
               process_id: int | None = None) -> tuple[str, int]:  # fmt: skip
    what, code = what_failed(text, heartbeat_s, process_id)
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


class StderrLines:
    """The child's stderr, line by line: what to show now, what to hold (see ``run``).

        lines = StderrLines()
        out.write(lines.line(raw))    # each line, bytes with its newline: what to show now
        out.write(lines.quiet())      # no line came for QUIET_S while ``waiting()``
        shown = lines.finish(code)    # the child's end: what to show; None: JAX aborted it

    JAX's distributed service's log lines wait for the next line: shown before another
    line, held with JAX's fatal line and stack trace that follow them (they say what it
    saw). A record's next lines (its message spans lines; they start no record) go with it.
    From JAX's fatal line or a Python traceback on, every line is held until the child's
    end says whether JAX aborted it: then the caller writes ``held`` to a file and
    ``fatal`` says what happened; else everything held is shown, except JAX's lines where
    the child's own ``error:`` line says what failed (its Python caught the failure as JAX
    aborted it: the child's line explains it, JAX's lines would only come before it)."""

    def __init__(self):
        self.fatal: list[str] = []  # the text from JAX's fatal line on
        self.held: list[tuple[bytes, bool]] = []  # (line, JAX's?), held until the end
        self.service: list[bytes] = []  # JAX's service lines, shown at the next other line
        self.holding = False
        self.after_jax = False  # the latest line was JAX's, held: its record may go on

    def is_jax(self, line: str) -> bool:
        if SERVICE_LOG.match(line) or FATAL in line:
            return True
        return self.after_jax and not LOG_RECORD.match(line) and not OWN_LINE.match(line)

    def line(self, raw: bytes) -> bytes:
        line = raw.decode(errors="replace")
        jax = self.after_jax = self.is_jax(line)
        if FATAL in line or self.fatal:
            self.fatal.append(line)
        # JAX's stack trace after its fatal line and a Python traceback (a collective that
        # failed as a peer went, raised just before JAX's abort), and all that follows them
        # (a C++ stack trace too: its frames may come slowly, a pause must not show them)
        if line.startswith((PY_TRACE, TRACE)) or self.fatal:
            self.holding = True
        if self.holding:
            self.held += [(r, True) for r in self.service]
            self.service = []
            self.held.append((raw, jax))
            return b""
        if jax:
            self.service.append(raw)
            return self.service.pop(0) if len(self.service) > SERVICE_HELD else b""
        return self.release() + raw  # a service error the run went on from: shown

    def release(self) -> bytes:
        shown, self.service = b"".join(self.service), []
        return shown

    def waiting(self) -> bool:
        """Whether a pause of ``QUIET_S`` changes anything (ends a held record)."""
        return self.after_jax

    def quiet(self) -> bytes:
        self.after_jax = False
        return b"" if self.holding else self.release()

    def finish(self, code: int) -> bytes | None:
        """What to show at the child's end (``code``: its exit code, -N: killed by signal
        N); ``None`` where JAX aborted it (it died of a signal after JAX's fatal line)."""
        self.held += [(r, True) for r in self.service]
        self.service = []
        if code < 0 and self.fatal:
            return None
        own = any(raw.startswith(OWN_ERROR.encode()) for raw, jax in self.held if not jax)
        return b"".join(raw for raw, jax in self.held if not (own and jax))


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
    lines = StderrLines()
    process_id = env.get("JAX_PROCESS_ID", "").strip()
    process_id = int(process_id) if process_id.isdigit() else None
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
        fd, part = child.stderr.fileno(), []  # part: the pieces of a line not ended yet
        while True:  # read as it comes: a pause ends a held record (QUIET_S)
            if lines.waiting() and not select.select([fd], [], [], QUIET_S)[0]:
                shown = lines.quiet()
            else:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                *whole, tail = chunk.split(b"\n")  # (only the new bytes searched)
                if whole:
                    whole[0], part = b"".join(part) + whole[0], []
                part += [tail] if tail else []
                shown = b"".join(lines.line(raw + b"\n") for raw in whole)
            if shown:
                out.write(shown)
                out.flush()
        if part:  # a last line with no newline
            out.write(lines.line(b"".join(part)))
        code = child.wait()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    shown = lines.finish(code)
    if shown is not None:  # not JAX's abort after all
        out.write(shown)
        out.flush()
        return code if code >= 0 else 128 - code  # a signal: the shell's 128 + N
    held = [raw for raw, _ in lines.held]
    trace_file = write_trace(held) if held else None
    line, exit_code = error_line("".join(lines.fatal), checkpoints, trace_file, heartbeat_s,
                                 process_id)  # fmt: skip
    print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    return exit_code
