"""SIGTERM and SIGINT in training: ``EarlyStop`` before the loop, ``Preemption`` in it, and
``StopBetweenRuns`` in the tools that run the trainer several times (compress, tune).

The train command installs ``EarlyStop`` on its first line: before the first step there is
nothing to save, so a stop exits 0 at once. The loop installs ``Preemption``, which takes
over from it: a stop then saves a checkpoint at the next step boundary, and a second signal
goes to the handler ``EarlyStop`` replaced (``EarlyStop.replaced``), as without either.
After a run that ended with its records written (``Preemption.ended``), ``EarlyStop`` is back
and a signal exits 0 quietly (SIGTERM until the process ends). Nothing here imports JAX at
import time: the command installs ``EarlyStop`` before it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOPPED_EARLY = "stopped before the first step: nothing to save; the same command starts the run"


class EarlyStop:
    """The signal handler from the command's first line until the training loop's
    ``Preemption`` takes over. Before the first step there is nothing to save, so a stop
    exits 0 at once, where the default action exited 143. At once, not at the end of a long
    compilation (a preemption notice may be short), and by ``os._exit``, not an exception:
    one raised inside JAX's compiler or a gc callback is swallowed or crashes the
    interpreter's exit. What set-up writes survives a kill -9 by design (config.json and
    prepared data atomically, whole metrics lines, no checkpoint yet), so the workdir starts
    again as it was."""

    def __init__(self):
        self._replaced = {s: signal.signal(s, self) for s in SIGNALS}
        self.run_ended = False  # set by ``Preemption.ended``: the run's records are written

    def replaced(self, signum: int):
        """The handler of ``signum`` from before this one: what a handler that takes over
        from this one (``Preemption.install``) hands the signal back to."""
        return self._replaced[signum]

    def restore(self) -> None:
        """The handlers from before this one; after an ended run SIGTERM stays with this one,
        as the command returns into the interpreter's exit (JAX's and orbax's teardown), where
        the default action would still end a done run with 143."""
        for s, h in self._replaced.items():
            if signal.getsignal(s) is self and not (self.run_ended and s == signal.SIGTERM):
                signal.signal(s, h)

    def __call__(self, signum, frame):
        if self.run_ended:  # its checkpoint and summary are written: nothing to stop or say
            os._exit(0)
        msg = f"{signal.Signals(signum).name}: {STOPPED_EARLY}"
        try:
            print(msg, flush=True)
        except RuntimeError:  # inside a print to the same stream (see Preemption._handler)
            os.write(2, f"{msg}\n".encode())
        sys.stderr.flush()
        os._exit(0)


class StopBetweenRuns:
    """SIGTERM / SIGINT in a tool that runs the trainer several times (compress's rounds,
    tune's trials), outside those runs: exit 0 at once, saying ``message``. What such a tool
    writes lands whole, so the same command redoes only the unfinished part. The trainer's
    own handler (a checkpoint at the next step) takes over while a run trains and hands this
    one back after it (it is not an ``EarlyStop``, which the trainer passes over)."""

    def __init__(self, message: str):
        self.message = message
        self.previous = {s: signal.signal(s, self) for s in SIGNALS}

    def restore(self) -> None:
        for s, h in self.previous.items():
            if signal.getsignal(s) is self:
                signal.signal(s, h)

    def __enter__(self) -> "StopBetweenRuns":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __call__(self, signum, frame):
        # the terminal's stdout: a run may be writing the trainer's lines to its log
        print(f"{signal.Signals(signum).name}: {self.message}", file=sys.__stdout__,
              flush=True)  # fmt: skip
        os._exit(0)


class Preemption:
    """SIGTERM and SIGINT set ``requested``; the loop saves at the next step boundary and
    exits cleanly. A second signal of the same kind acts as it would have without us (so a
    second Ctrl-C stops at once): it goes to the handler from before, or where that was an
    ``EarlyStop``, to the one the ``EarlyStop`` replaced; where that is Python's default, a
    line says what is lost and how to resume, and the process exits 128 + the signal. Any
    other handler (``StopBetweenRuns``) is handed back itself. On several processes the
    signal handlers stay JAX's: one process saving alone would wait forever for the others,
    so there every process saves at JAX's preemption sync point
    (``CheckpointManager.reached_preemption``)."""

    SIGNALS = SIGNALS

    def __init__(self, directory: str | None = None):
        self.requested: str | None = None
        self.unsaid: str | None = None  # the handler's message, where it could not print
        self.directory = directory  # the run's checkpoints, named by a stop at once
        self._previous = {}
        self._early: EarlyStop | None = None  # the command's handler this one took over from

    def request(self, why: str = "requested") -> None:
        self.requested = self.requested or why

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        self.request(name)
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous in (signal.SIG_DFL, signal.default_int_handler):
            # Python's own would raise KeyboardInterrupt inside JAX (a traceback) or end the
            # process unsaid: stop at once as they would, saying what the same command does
            previous = self._stop_at_once
        signal.signal(signum, previous)
        msg = (f"{name}: saving a checkpoint at the next step boundary, then stopping "
               f"(send {name} again to stop at once)")  # fmt: skip
        try:  # installed on one process only: it prints for the run
            print(msg, flush=True)
        except RuntimeError:  # the signal came inside a print to the same buffered stream,
            self.unsaid = msg  # which refuses a reentrant write: the loop says it (say_unsaid)

    def _stop_at_once(self, signum, frame):
        name = signal.Signals(signum).name
        where = f" in {self.directory}" if self.directory else ""
        msg = (f"{name} again: stopped at once; the steps since the last checkpoint are not "
               f"saved, and the same command resumes from that checkpoint{where} (from step "
               "0 if there is none yet)")  # fmt: skip
        try:
            sys.stdout.flush()
        except RuntimeError:  # inside a print to the same stream: its line may be cut
            pass
        os.write(1, f"{msg}\n".encode())
        os._exit(128 + signum)  # the exit status the signal's default action gives

    def say_unsaid(self) -> None:
        """Prints the handler's message if the handler could not."""
        if self.unsaid is not None:
            msg, self.unsaid = self.unsaid, None
            print(msg, flush=True)

    def install(self) -> "Preemption":
        import jax  # here: the module stays importable before JAX (see above)

        single = jax.process_count() == 1
        if single and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                previous = signal.signal(s, self._handler)
                if isinstance(previous, EarlyStop):  # its job (before the loop) is over
                    self._early, previous = previous, previous.replaced(s)
                self._previous[s] = previous
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def ended(self) -> None:
        """The run ended with its checkpoint and summary written (completed, or stopped and
        saved): a signal from here to the process's exit exits 0 quietly, by the command's
        ``EarlyStop`` put back, not the default action's 143 (the run is done, not killed)."""
        if self._early is not None:
            self._early.run_ended = True
            for s in self.SIGNALS:
                signal.signal(s, self._early)
