"""``python -m hybridpar.evaluate --workdir W [--watch] [--from-epoch E] [--config FILE] ...``.

Evaluation off the training clock: evaluates each checkpoint of the training run in ``W``
on the whole eval split, on this process's own devices, while the trainer goes on. Without
``--watch``, every checkpoint not evaluated yet, then exit; with ``--watch``, also each new
one as it is committed, until the run's last step. ``--from-epoch E``: only the checkpoints
from epoch E on (the earlier ones are left for a later call without it). Train with
``--config.eval_every_epochs=0`` to leave it every evaluation but the last.

Only the command line: the evaluation itself is ``hybridpar/runtime/evaluator.py``. The
config is the run's own (its latest checkpoint's, or ``--config`` naming the same);
``--config.mesh=...`` (and the other placement keys) may fit it to the devices here. With
``--watch`` it may start before the trainer, and stops with an error once the run has ended
unfinished (``--dead-after-s``). Records go to ``W/evaluator/metrics.jsonl``. A bad workdir
or config is one ``error:`` line that names the fix (exit code 2), with nothing written.
Ctrl-C, SIGTERM or SIGHUP stops it at once with one line, ``stopped (Ctrl-C): ...``, and exit
code 128 + the signal (130 for Ctrl-C): the records so far are whole, and the same command
goes on.
"""

from __future__ import annotations

from hybridpar.config import cli
from hybridpar.runtime import signals

# what the same command does after a stop (Stop's line; cli.main's, for a KeyboardInterrupt)
RESUMES = "the same command goes on with the next checkpoint not evaluated yet"


class Stop(signals.StopWriting):
    """SIGTERM, SIGINT and SIGHUP in the evaluator, from the command's first line (the
    imports of JAX included): one line, ``stopped (Ctrl-C): RESUMES`` (or ``(SIGTERM)``),
    and exit 128 + the signal, at once, as quantize and prune stop (a KeyboardInterrupt
    raised inside JAX or a gc callback is dropped, and the evaluator went on; a SIGTERM
    ended it unsaid, its lock file left). Nothing is lost but the checkpoint under evaluation: a
    record being written is finished first (``signals.whole``, as ``StopWriting``), and
    ``release`` (set by ``evaluator.run``) closes the records and gives the lock back."""

    def __init__(self):
        self.release = lambda: None
        super().__init__(temp="", said=lambda: RESUMES)  # no folder of its own to remove

    def clean_up(self) -> None:  # before its line and exit (StopWriting.stop)
        self.release()


def main(argv=None) -> None:
    with Stop() as stop:
        _main(argv, stop)


def _main(argv, stop: Stop) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.evaluate",
        (
            "Evaluate a training run's checkpoints on the whole eval split, off the training "
            "clock (--watch: as they are written)."
        ),
        # by hand: --workdir is required, but a missing one is our error line, not argparse's
        usage="%(prog)s [-h] --workdir WORKDIR [--watch] [--from-epoch FROM_EPOCH]\n"
        "       [--poll-s POLL_S] [--dead-after-s DEAD_AFTER_S]",
    )
    parser.add_argument("--workdir", help="the training run's workdir")
    parser.add_argument(
        "--watch", action="store_true", help="wait for new checkpoints until the run's last step"
    )
    parser.add_argument(
        "--from-epoch",
        type=cli.finite_float,
        default=0.0,
        help="evaluate only the checkpoints from this epoch on (default 0: all)",
    )
    parser.add_argument(
        "--poll-s", type=cli.finite_float, help="with --watch: seconds between looks (default 5)"
    )
    parser.add_argument(
        "--dead-after-s",
        type=cli.finite_float,
        help="with --watch: stop with an error once no trainer holds the workdir and no new "
        "checkpoint came for this long (default 300; 0 waits for ever)",
    )
    args, config = cli.parse(parser, argv, from_run=True)
    if not args.workdir:
        cli.fail("pass --workdir DIR (the training run's)")
    # without --watch nothing is waited for: these would be silently unused
    for flag, value in (("--poll-s", args.poll_s), ("--dead-after-s", args.dead_after_s)):
        if value is not None and not args.watch:
            cli.fail(f"{flag} is not used without --watch (nothing is waited for); pass --watch "
                     "with it, or drop it")  # fmt: skip
    args.poll_s = 5.0 if args.poll_s is None else args.poll_s
    args.dead_after_s = 300.0 if args.dead_after_s is None else args.dead_after_s
    if not args.poll_s > 0:
        cli.fail(f"--poll-s={args.poll_s:g} must be > 0, e.g. --poll-s=5")
    if not args.dead_after_s >= 0:
        cli.fail(f"--dead-after-s={args.dead_after_s:g} must be >= 0 (0 waits for ever)")

    if args.from_epoch < 0:
        cli.fail(f"--from-epoch={args.from_epoch:g} must be >= 0 (0: every checkpoint)")

    from hybridpar.runtime import (
        evaluator,  # imports jax: after the command line is known to be good
    )

    cli.main(
        lambda: evaluator.run(
            config,
            args.workdir,
            watch=args.watch,
            poll_s=args.poll_s,
            overrides=args.config_overrides,
            dead_after_s=args.dead_after_s,
            from_epoch=args.from_epoch,
            stop=stop,
        ),
        RESUMES,
    )


if __name__ == "__main__":
    main()
