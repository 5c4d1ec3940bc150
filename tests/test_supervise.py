"""The train command's parent (``hybridpar/runtime/supervise.py``) on lines recorded from real
2-process runs (2 x 4 CPU devices, loopback): what it shows of the trainer's stderr, what it
holds back, and the ``error:`` line it writes where JAX aborted the trainer. Pure: no child,
no JAX; the runs themselves are in ``test_multihost_cli.py``.
"""

from hybridpar.runtime import supervise

# JAX's log lines are long: each recorded line is kept whole, cut here only to fit the source.
ERROR_LINE = (
    "error: a step across the run's 2 processes failed at step 14 (JaxRuntimeError: UNKNOWN: "
    "Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
    "[127.0.0.1]:11667: Connection reset by peer): another process has probably stopped; "
    "start every process again with the same command (and the same JAX_* variables) to "
    "resume from step 10\n"
)
FATAL_LINE = (
    "F1208 02:14:51.248013   17438 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. This most likely indicates that another task "
    "died; see the other task logs for more details. Disable Python buffering, i.e. `python "
    "-u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to "
    "send RPC to coordination service. Either the leader task was preempted/died/restarted "
    "unexpectedly or this task is experiencing network issues.\n"
)
# Process 1's stderr after a kill -9 of process 0 mid-run: JAX's client saw the coordinator
# go and logged it, and the trainer's step failed in Python in the same moment; the Python
# error won (exit 1), so JAX's abort never came.
PEER_GONE = [
    "W1208 02:14:51.247926   17438 preemption_sync_manager.cc:147] Failed to retrieve "
    "preemption notice from coordination service: UNAVAILABLE: Socket closed\n",
    "Additional GRPC error information from remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/GetKeyValue:\n",
    ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}. This '
    "is only expected if one of the tasks is unhealthy. Check the logs for the actual root "
    "cause.\n",
    "E1208 02:14:51.247955   17438 preemption_sync_manager.cc:159] Failed to cancel "
    "preemption barrier: FAILED_PRECONDITION: Tried to cancel non-existent barrier "
    "PREEMPTION_SYNC_BARRIER. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n",
    "E1208 02:14:51.248009   17438 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n",
    FATAL_LINE,
    "Additional GRPC error information from remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/PollForError:\n",
    ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n',
    ERROR_LINE,
]
# Process 0's stderr where process 1 was stopped (SIGSTOP) for longer than the heartbeat
# timeout: the coordinator's error spans three lines, then the client's fatal line and
# JAX's stack trace; the trainer dies of SIGABRT.
UNHEALTHY = [
    "E1208 02:15:50.246518   17896 coordination_service.cc:1549] [423697816599339234] Use "
    "error polling to propagate the following error to all tasks: UNAVAILABLE: The following "
    "tasks are unhealthy (stopped sending heartbeats):\n",
    "1\n",
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
    "(e.g. preemption, eviction) to debug further. "
    "[type.googleapis.com/tensorflow.CoordinationServiceError='']\n",
    "E1208 02:15:50.247081   17907 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n",
    "F1208 02:15:50.247212   17907 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. This most likely indicates that another task "
    "died. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    "heartbeats):\n",
    "1\n",
    "The tasks have crashed. Check the task logs for an earlier error.\n",
    "\n",
    "RPC: /xla.coordination.CoordinationService/PollForError\n",
    "*** Check failure stack trace: ***\n",
    "    @     0x7f52bd440634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n",
]
# Process 0's text where its process 1 was killed in set-up and the pair was started again on
# the same port: the new process 1 reached the old coordinator, still waiting for the old one.
RESTARTED = (
    "F1208 02:37:15.640633    7506 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has "
    "failed.\nBarrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: "
    "ABORTED: 1 unexpectedly tried to connect with a different incarnation. It has likely "
    "restarted.\n"
)


def _feed(lines: list[str], code: int) -> tuple[str, str | None, supervise.StderrLines]:
    """(what is shown while the child runs, what at its end, the filter) for ``lines``, all
    in one burst (no pause between them), then the child's end with ``code``."""
    filt = supervise.StderrLines()
    shown = b"".join(filt.line(x.encode()) for x in lines)
    end = filt.finish(code)
    return shown.decode(), None if end is None else end.decode(), filt


def test_the_trainers_own_error_line_comes_alone():
    """Where the trainer's step failed in Python as JAX's client logged the coordinator's
    end, its ``error:`` line came ninth, after JAX's warning, errors and fatal line (and
    their next lines): the child's exit 1 made the parent show all it held. Now the
    trainer's line comes alone. Planted bug that fails it: showing every held line at a
    plain exit (``finish`` without the ``error:`` test)."""
    shown, end, _ = _feed(PEER_GONE, 1)
    assert shown + end == ERROR_LINE, shown + end


def test_a_failure_no_error_line_explains_is_shown_whole():
    """A plain Python failure after JAX's lines (no ``error:`` line of the trainer's): the
    user needs all of it, JAX's lines included."""
    crash = ["Traceback (most recent call last):\n", '  File "x.py", line 1\n',
             "ValueError: plain\n"]  # fmt: skip
    shown, end, _ = _feed(PEER_GONE[:-1] + crash, 1)
    assert shown + end == "".join(PEER_GONE[:-1] + crash)


def test_the_lines_of_a_held_service_message_stay_with_it():
    """The coordinator's "tasks are unhealthy" error spans three lines; the first was held
    and the other two, starting no log record, were shown (releasing the first with them)
    before the ``error:`` line the parent wrote. Now the three go to the trace file with
    JAX's fatal line and stack trace. Planted bug that fails it: a line that starts no
    record is not taken as the held record's next line."""
    shown, end, filt = _feed(UNHEALTHY, -6)
    assert shown == "" and end is None
    assert [raw.decode() for raw, _ in filt.held] == UNHEALTHY  # the trace file's text
    what, code = supervise.what_failed("".join(filt.fatal), 20.0)
    assert what.startswith("process 1 of the run stopped") and code == 1


def test_a_service_error_the_run_goes_on_from_is_shown_with_its_lines():
    """A service error with no fatal line after it is shown, whole and in order, as the next
    record comes or as the stream pauses (``quiet``): held, never hidden."""
    filt = supervise.StderrLines()
    head = UNHEALTHY[:3]
    assert b"".join(filt.line(x.encode()) for x in head) == b""
    assert filt.waiting()
    assert filt.quiet().decode() == "".join(head)  # a pause: shown
    after = "a later line on stderr\n"  # after the pause: not the record's
    assert filt.line(after.encode()).decode() == after
    record = "WARNING:absl:[process=0][thread=MainThread] Reached preemption sync point\n"
    shown = b"".join(filt.line(x.encode()) for x in [*head, record])
    assert shown.decode() == "".join([*head, record])  # the next record: shown before it
    assert filt.finish(0) == b""


def test_a_process_id_that_joined_twice_names_a_restart_and_a_duplicate():
    """A pair started again on the port of one whose process 0 still waited: the old process
    0 said "two processes use JAX_PROCESS_ID=1?" though no two did (process 1 was the new
    run's). JAX cannot tell the two apart; the line now names both, the likelier first (a
    process of the run started again, for the others; a second process with this process's
    own id, for that process) and what fixes both. Planted bug that fails it: the old
    duplicate-only message."""
    what, code = supervise.what_failed(RESTARTED, 100.0, process_id=0)
    assert code == 2
    assert what.startswith("process 1 joined JAX's coordinator a second time: it was "
                           "probably started again (a restart) while the coordinator from "
                           "before still ran, or two processes use JAX_PROCESS_ID=1")  # fmt: skip
    assert "stop every process of the run and start them all again" in what
    for process_id in (None, 2):
        assert supervise.what_failed(RESTARTED, process_id=process_id) == (what, code)
    mine, code = supervise.what_failed(RESTARTED, process_id=1)  # the first process 1
    assert code == 2 and mine.startswith(
        "another process joined JAX's coordinator as process 1, this process's "
        "JAX_PROCESS_ID: two processes use JAX_PROCESS_ID=1"
    ), mine
    assert "stop every process of the run and start them all again" in mine
    line, code = supervise.error_line(RESTARTED, "/no/checkpoints", "/tmp/t.txt", 100.0, 0)
    assert (line, code) == (f"{what} (JAX's stack trace: /tmp/t.txt)", 2)


def test_the_trainers_own_lines_are_never_taken_for_a_jax_records_next_line():
    """A line that starts no log record, after a held JAX line, was taken as that record's
    next line: the trainer's own 'warning:' line (or a Python warning) then went with JAX's
    lines, and was dropped with them where the trainer's error: line came. Planted bug that
    fails it: only a traceback and error: lines kept apart."""
    own = ["warning: the checkpoint at step 2 was not written: disk full\n",
           "/x/y.py:12: UserWarning: something\n"]  # fmt: skip
    shown, end, _ = _feed([PEER_GONE[0], *own, ERROR_LINE], 1)
    assert shown + end == "".join([PEER_GONE[0], *own, ERROR_LINE]), shown + end
    shown, end, _ = _feed([PEER_GONE[0], *own, "Traceback (most recent call last):\n",
                           FATAL_LINE, ERROR_LINE], 1)  # fmt: skip
    # (JAX's line before them shown as they come, the fatal one dropped: the error: says)
    assert shown + end == "".join([PEER_GONE[0], *own, "Traceback (most recent call last):\n",
                                   ERROR_LINE]), shown + end  # fmt: skip


def test_a_stack_traces_frames_are_held_through_a_pause():
    """JAX's frames may come slowly: a pause showed those after it, before the trainer's
    error: line. From a stack trace's first line, every line is held. Planted bug that
    fails it: only the fatal line and a traceback start holding."""
    filt = supervise.StderrLines()
    trace = ["*** Check failure stack trace: ***\n", "    @     0x7f52  SendToLog()\n"]
    assert filt.line(trace[0].encode()) == b""
    assert filt.quiet() == b""
    assert filt.line(trace[1].encode()) == b""
    assert filt.finish(1).decode() == "".join(trace)  # no error: line: shown at the end


def test_a_line_in_pieces_comes_out_whole(capfd):
    """The reader joins a line written in pieces, with pauses between them, and ends with
    a last line that has no newline."""
    import sys

    code = ("import sys, time\n"
            "for piece in ('abc', 'def\\nxyz'):\n"
            "    sys.stderr.write(piece); sys.stderr.flush(); time.sleep(0.3)\n")  # fmt: skip
    assert supervise.run([sys.executable, "-c", code]) == 0
    assert capfd.readouterr().err == "abcdef\nxyz"
