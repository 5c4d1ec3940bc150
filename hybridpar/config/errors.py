"""The errors a user sees: each one ``error:`` line with the fix in its message (exit code 2,
``hybridpar.config.cli.main``), no traceback.

    Error                    everything reported as ``error:``
      ConfigError            bad input: a config value, mesh, rule, flag or file
        DataError            data that does not match the config or cannot be read
        WorkdirError         a workdir (or checkpoint directory) that cannot be used
      RunFailed              a run that started and failed
        NonFinite            it diverged: too many non-finite steps in a row
        SaveFailed           a checkpoint was not written
        PeerLost             a collective across processes failed: a process stopped
      StopRequested          a stop asked for (a signal, a hook): the trainer ends cleanly

``ConfigError`` is also a ``ValueError``, and the base of every bad-input error, so
``except ConfigError`` still catches each of them.
"""


class Error(Exception):
    """Anything the command line reports as one ``error:`` line (exit code 2)."""


class ConfigError(Error, ValueError):
    """A config, mesh, rule or input that cannot work. The CLI prints it without a traceback."""


class DataError(ConfigError):
    """Data that does not match the config (classes, shapes, splits) or cannot be read."""


class ClassCountError(DataError):
    """The data has another number of classes than ``data.num_classes``; ``classes``: the
    data's class names in label order (a tool reading a trained run names the labels that
    moved since it trained, which is what such a count means there)."""

    def __init__(self, message: str, classes: list):
        super().__init__(message)
        self.classes = list(classes)


class WorkdirError(ConfigError):
    """A workdir or checkpoint directory that cannot be used: not writable, another
    config's run, held by another trainer, or holding checkpoints that do not read back."""


class RunFailed(Error):
    """A run that started and failed; its summary says how, its checkpoints stay intact."""


class NonFinite(RunFailed):
    """Too many steps in a row with a non-finite loss or gradient (each one skipped)."""


class SaveFailed(RunFailed):
    """A checkpoint could not be written; the ones before it are left as they were."""


class PeerLost(RunFailed):
    """A collective across the run's processes failed mid-run: another process stopped (a
    preempted node, a kill). Exit code 1, not 2 (nothing the user typed is wrong: a
    scheduler should start the run again), and at once: JAX's shutdown barrier would wait
    for the lost process and then abort with a C++ stack trace."""

    exit_code = 1
    exit_at_once = True


class StopRequested(Error):
    """How a hook (or the signal handler, through the checkpointer) asks the training loop
    to stop at this step: raised from the hook, caught by the loop, which then ends the run
    as preempted (``summary["preempted"]`` is the message) and returns its summary. Not a
    failure; it reaches the command line only if raised outside the loop."""
