"""``python -m hybridpar.train --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE]``.

Only the command line: the run's set-up is ``hybridpar/runtime/run.py``, its loop to the last step
``hybridpar/runtime/trainer.py``. Bad config or input stops with one ``error:`` line that names the
fix (exit code 2), before any data or device is touched where it can be.

A workdir is a run: the same command again resumes it from its latest checkpoint (after
SIGTERM, SIGINT, a crash or kill -9), or says it has finished (exit 0). A config that differs
from the run's own is an error naming the first differing key; ``--allow-config-change``
continues the run with the new config.

With ``--config.distributed=True`` the command runs the trainer as its child, with the same
arguments (``hybridpar/runtime/supervise.py``): where JAX aborts a process because another
one of the run stopped, that is one ``error:`` line saying how to resume, not a C++ abort.
"""

from __future__ import annotations

import os
import sys

from hybridpar.config import cli
from hybridpar.config.schema import sizes_training_ignores
from hybridpar.parallel import distributed
from hybridpar.runtime import checkpoint_dirs, signals, supervise
from hybridpar.runtime.signals import EarlyStop


def main(argv=None) -> None:
    early = EarlyStop()
    try:
        _main(argv, early)
    finally:
        early.restore()


def _main(argv, early: EarlyStop) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.train",
        "Train a model from an experiment config; the same command resumes a stopped run.",
        # by hand: both are required, but a missing one is our error line, not argparse's
        usage="%(prog)s [-h] --config FILE[:ARGS] --workdir WORKDIR [--config.KEY=VALUE ...]\n"
        "       [--allow-config-change] [--compiled FILE] [--recompile]",
    )
    parser.add_argument("--workdir", help="directory for metrics, summary, checkpoints")
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume the workdir's run although this config differs from its own",
    )
    parser.add_argument(
        "--compiled",
        metavar="FILE",
        help="load the steps from this file (python -m hybridpar.compile ... --out FILE) "
        "instead of compiling them",
    )
    parser.add_argument(
        "--recompile",
        action="store_true",
        help="with --compiled: compile here, with a warning, when the file does not fit the run",
    )
    args, config = cli.parse(parser, argv)
    if not args.workdir:
        cli.fail("pass --config experiments/NAME.py and --workdir DIR")
    if args.recompile and not args.compiled:  # else silently a plain run that compiles
        cli.fail("--recompile says what to do when the --compiled file does not fit the run; "
                 "pass --compiled FILE with it, or drop it")  # fmt: skip
    forgotten = None if config.distributed else distributed.forgotten(os.environ)
    if forgotten:
        cli.fail(forgotten)
    as_sigterm = None
    if config.distributed:  # JAX's preemption sync point handles the signals of several hosts
        ckpt = checkpoint_dirs.checkpoint_dir(config, args.workdir)
        if not supervise.is_child():  # the trainer runs as our child: see runtime/supervise.py
            early.restore()
            command = [sys.executable, "-m", "hybridpar.train", *args.argv]
            sys.exit(supervise.run(command, ckpt, heartbeat_s=config.distributed_heartbeat_s))
        # Ctrl-C and SIGHUP as SIGTERM, which JAX's notifier catches: else they stopped this
        # process alone; and a stop while the processes join says so, as before a first step
        as_sigterm = signals.SigintAsSigterm(ckpt, early).install()

    # These import jax: after the command line is known to be good.
    from hybridpar.runtime import trainer
    from hybridpar.runtime.run import log, setup

    def train_and_report():
        for ignored in sizes_training_ignores(config, [k for k, _ in args.config_overrides]):
            log(f"warning: {ignored}")
        r = setup(config, args.workdir, allow_config_change=args.allow_config_change,
              compiled=args.compiled, recompile=args.recompile)  # fmt: skip
        summary = trainer.train(r)
        if summary.get("preempted"):
            again = cli.same_command("hybridpar.train", args.argv)
            why = (as_sigterm and as_sigterm.requested) or summary["preempted"]
            said = (
                f"stopped ({why}) at step {summary['steps']}/{summary['total_steps']} with a "
                f"checkpoint; resume with the same command:\n  {again}"
            )
            if config.distributed:  # every process: each wrote its shards of the checkpoint
                print(said, flush=True)
            else:
                log(said)
            if not config.distributed:  # (several processes leave together, through JAX)
                # Saved and recorded: nothing is left to wait for but a stage's compile that
                # may still run in the background, which the interpreter's exit would join
                # (minutes on an accelerator; a second Ctrl-C there aborts from C++).
                cli.exit_now(0)
            return
        if r.finished is not None:  # train() said the workdir's run is done; nothing new
            return
        ev = summary["final_eval"] or {}
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in summary["time_breakdown"].items() if v)
        log(f"where the time went: {parts}; goodput {summary['goodput']:.0%} (train steps "
            "over the wall time)")  # fmt: skip
        log(
            f"done: top1 {ev.get('top1', float('nan')):.4f} in {summary['wall_s']:.1f}s "
            f"(compile {summary['compile_s']:.1f}s); summary in {args.workdir}/summary.json"
        )

    cli.main(train_and_report)


if __name__ == "__main__":
    main()
