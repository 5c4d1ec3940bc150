"""SIGHUP (the ssh session or terminal a run was started from closed) in the stop signals'
handlers (``hybridpar/runtime/signals.py``): it takes SIGTERM's path, a SIGHUP that
``nohup`` ignores stays ignored, and a terminal that hung up does not end the run with the
next line it writes. The trainer's save on SIGHUP: tests/test_trainer.py; on several
processes: tests/test_multihost_cli.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cpu_env

from hybridpar.runtime import signals

ROOT = Path(__file__).resolve().parents[1]


def test_sighup_takes_sigterms_path_and_every_handler_is_handed_back():
    """SIGHUP ended a training process unsaved (its default action): the loop's handler
    asks for a checkpoint on it, as on SIGTERM, and every handler of the module hands it
    back to the one from before."""
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    early = signals.EarlyStop()
    preemption = signals.Preemption().install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert preemption.requested == "SIGHUP"
    finally:
        preemption.uninstall()
        early.restore()
    with signals.StopBetweenRuns("stopped"):
        assert isinstance(signal.getsignal(signal.SIGHUP), signals.StopBetweenRuns)
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


def test_a_second_run_in_a_process_does_not_take_an_ended_runs_handler_as_its_own():
    """After a run ends, SIGTERM stays with its command's ``EarlyStop`` (marked ended) until
    the process exits. A second run in the process took that one as its own command's, and
    its end then gave SIGINT and SIGHUP to it as well (a Ctrl-C after it exited 0 without a
    word). Planted bug that fails it: ``install`` taking any ``EarlyStop``."""
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    first = signals.EarlyStop()
    one = signals.Preemption().install()
    one.uninstall(ended=True)
    first.restore()
    assert signal.getsignal(signal.SIGTERM) is first  # the first run's, ended
    two = signals.Preemption().install()
    two.uninstall(ended=True)
    after = {s: signal.getsignal(s) for s in signals.SIGNALS}
    assert after == before | {signal.SIGTERM: after[signal.SIGTERM]}, after
    assert after[signal.SIGTERM] in (first, before[signal.SIGTERM])


def test_a_second_distributed_run_in_a_process_hands_back_what_was_before_both():
    """The same for a multi-process run's handler (``SigintAsSigterm``): a second run took
    the first's ended ``EarlyStop`` as the handler to hand SIGTERM back to, so a SIGTERM
    after the second run failed exited 0 without a word. Planted bug that fails it: one
    ``replaced`` step, not the loop."""
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    first = signals.EarlyStop()
    one = signals.Preemption().install()
    one.uninstall(ended=True)
    first.restore()
    second = signals.EarlyStop()
    two = signals.SigintAsSigterm(None, second).install()
    two.uninstall()
    second.restore()
    after = {s: signal.getsignal(s) for s in signals.SIGNALS}
    assert after == before, after


def test_a_sighup_ignored_by_nohup_stays_ignored():
    """``nohup`` says to go on when the terminal goes: no handler here takes SIGHUP then,
    and the others are taken and handed back as before."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        early = signals.EarlyStop()
        preemption = signals.Preemption().install()
        tool = signals.StopBetweenRuns("stopped")
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert isinstance(signal.getsignal(signal.SIGTERM), signals.StopBetweenRuns)
        tool.restore()
        preemption.uninstall()
        early.restore()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_run_whose_terminal_hung_up_goes_on_to_its_save():
    """The ssh session closed: the terminal hangs up (a write to it fails with EIO) and
    SIGHUP comes. The handler's own line, or the run's next one, raised OSError, and the
    run ended before its save. Now stdout and stderr point away from the dead terminal,
    and the run goes on to the step boundary (here: a marker written after more lines)."""
    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"hup-{os.getpid()}-{time.time_ns()}"
    script = (
        "import os, sys, time\n"
        "from hybridpar.runtime import signals\n"
        "signals.EarlyStop()\n"
        "p = signals.Preemption('/runs/x/checkpoints').install()\n"
        "print('ready', flush=True)\n"
        "end = time.time() + 30\n"
        "while p.requested is None and time.time() < end:\n"
        "    time.sleep(0.01)\n"
        "for i in range(100):  # the run's lines up to its step boundary\n"
        "    print('train step', i, flush=True)\n"
        "    print('a warning', file=sys.stderr, flush=True)\n"
        f"open({str(marker)!r}, 'w').write(p.requested)\n"
    )
    try:
        assert _hung_up(script) == 0
        assert marker.read_text() == "SIGHUP"
    finally:
        marker.unlink(missing_ok=True)


def _hung_up(script: str) -> int:
    """Runs ``script`` on a pseudo-terminal; once it prints 'ready', the terminal hangs up
    (the ssh session closes) and SIGHUP comes: its exit code."""
    main, tty = os.openpty()
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=cpu_env(1),
                         stdout=tty, stderr=tty, start_new_session=True)  # fmt: skip
    os.close(tty)
    try:
        said = b""
        while b"ready" not in said:
            said += os.read(main, 100)
        os.close(main)  # the terminal hangs up
        p.send_signal(signal.SIGHUP)
        return p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()


def test_evaluate_stops_on_sighup_from_a_terminal_that_hung_up():
    """evaluate's ``Stop`` copied ``StopWriting.stop`` without its SIGHUP fix: on a terminal
    that hung up its line raised OSError (EIO) after ``release`` had closed the records and
    given the lock back, and the evaluator went on (or ended in a traceback, exit 1). Now it
    is ``StopWriting``'s stop after the release: exit 128 + SIGHUP. Planted bug that fails
    it: evaluate's own copy of the stop back."""
    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"hup-{os.getpid()}-{time.time_ns()}"
    script = (
        "import time\n"
        "from hybridpar.tools import evaluate\n"
        "stop = evaluate.Stop()\n"
        f"stop.release = lambda: open({str(marker)!r}, 'w').write('released')\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    try:
        assert _hung_up(script) == 128 + signal.SIGHUP
        assert marker.read_text() == "released"
    finally:
        marker.unlink(missing_ok=True)


def test_a_stop_before_the_first_step_runs_the_registered_cleanups_first(monkeypatch, capsys):
    """``EarlyStop`` ends the process by ``os._exit``, which runs no ``finally`` block: a
    first-use prepare's workers went on writing shards after the trainer said it stopped.
    What ``on_early_stop`` registered runs before the line and the exit, the last first,
    each once; one that raises does not keep the others from running, and one taken back
    does not run. Planted bug that fails it: ``__call__`` without the clean-ups."""
    ran = []

    class Exited(Exception):
        pass

    def exit_(code):
        ran.append(f"exit {code}")
        raise Exited

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(signals, "EARLY_STOP_CLEANUPS", [])
    early = signals.EarlyStop()
    try:
        signals.on_early_stop(lambda: ran.append("pool stopped"))
        signals.on_early_stop(lambda: 1 / 0)
        forget = signals.on_early_stop(lambda: ran.append("a finished prepare's"))
        signals.on_early_stop(
            lambda: ran.append(f"staging removed, said: {capsys.readouterr().out!r}")
        )
        forget()
        with pytest.raises(Exited):
            early(signal.SIGTERM, None)
    finally:
        early.restore()
    assert ran == ["staging removed, said: ''", "pool stopped", "exit 0"]
    assert capsys.readouterr().out == f"SIGTERM: {signals.STOPPED_EARLY}\n"
    assert signals.EARLY_STOP_CLEANUPS == []


def test_a_stop_while_the_data_opens_removes_a_prepare_s_partial_files(monkeypatch):
    """The run's data opens (a first-use prepare) with prepare's clean-up registered for a
    stop before the first step, and taken back after. Planted bug that fails it: open_data
    without the registration (a compressed tar's staging copy was left, as large as its
    data)."""
    from hybridpar.input import datasets
    from hybridpar.input.prepare import remove_partial_files
    from hybridpar.runtime.run import open_data

    seen = []
    monkeypatch.setattr(datasets, "make_data",
                        lambda *a: seen.append(list(signals.EARLY_STOP_CLEANUPS)))  # fmt: skip
    open_data(None, None, [])
    assert seen == [[remove_partial_files]] and signals.EARLY_STOP_CLEANUPS == []
