"""``python -m hybridpar.train --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE]``.

Only the command line: the run itself, from set-up to the last step, is
``hybridpar/trainer.py``. Bad config or input stops with one ``error:`` line that names the
fix (exit code 2), before any data or device is touched where it can be.
"""

from __future__ import annotations

from hybridpar import cli


def main(argv=None) -> None:
    parser = cli.ArgumentParser("python -m hybridpar.train", __doc__)
    parser.add_argument("--workdir", help="directory for metrics, summary and events")
    args, config = cli.parse(parser, argv)
    if not args.workdir:
        cli.fail("pass --config experiments/NAME.py and --workdir DIR")

    from hybridpar import trainer  # imports jax: after the command line is known to be good

    def run():
        summary = trainer.train(trainer.setup(config, args.workdir))
        ev = summary["final_eval"] or {}
        trainer.log(
            f"done: top1 {ev.get('top1', float('nan')):.4f} in {summary['wall_s']:.1f}s "
            f"(compile {summary['compile_s']:.1f}s); summary in {args.workdir}/summary.json"
        )

    cli.main(run)


def run() -> None:
    """Console-script entry point (``hybridpar-train``)."""
    main()


if __name__ == "__main__":
    main()
