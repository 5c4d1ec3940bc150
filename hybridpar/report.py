"""``python -m hybridpar.report W [W2 ...] [--out PATH] [--target-top1 X] [--target-top5 X]``.

Compares training runs from their records: for each workdir ``W``, ``W/metrics.jsonl`` (the
trainer's events), ``W/evaluator/metrics.jsonl`` (``python -m hybridpar.evaluate``'s eval
events, if any) and ``W/summary.json`` (if the run has written one). Writes one PNG (``--out``,
default ``report.png``): top-1 and top-5 against wall time and against epochs, one colour per
run, each stage switch a dotted vertical line; and the schedule against epochs (learning
rate, momentum, global batch, image size). Prints a markdown table of the runs (name, epochs,
steps, best top-1 and top-5, time to target, wall, compile, images/s) and writes it beside
the PNG (the same path with ``.md``).

Reads only: no JAX, no devices; the PNG needs matplotlib (``pip install -e ".[plot]"``). A
missing workdir or ``metrics.jsonl`` is one ``error:`` line (exit code 2).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from hybridpar import cli
from hybridpar.errors import ConfigError

COLUMNS = ("run", "epochs", "steps", "best top1", "best top5", "time to target", "wall s",
           "compile s", "images/s", "status")  # fmt: skip


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of ``path``; a line cut short (its writer killed mid-line) is left out."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def read_run(workdir: str) -> dict:
    """One run's records: ``train``, ``eval`` (the trainer's and the evaluator's, one per
    step, by step), ``stage`` (one per stage, in order), ``compile`` and ``summary``."""
    if not os.path.isdir(workdir):
        raise ConfigError(
            f"no workdir {workdir!r}: pass the --workdir of a training run "
            "(python -m hybridpar.train --workdir W)"
        )
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{workdir!r} has no metrics.jsonl: pass the --workdir of a training run (the "
            "trainer writes W/metrics.jsonl once its set-up is done)"
        )
    run = {"train": [], "eval": {}, "stage": {}, "compile": []}
    for r in read_jsonl(path):
        kind = r.get("event")
        if kind == "resume":  # steps after the checkpoint ran again: keep their second run
            last = r.get("from_step", r["step"])
            run["train"] = [t for t in run["train"] if t["step"] <= last]
            run["eval"] = {s: e for s, e in run["eval"].items() if s <= last}
            run["stage"] = {i: s for i, s in run["stage"].items() if s["step"] <= last}
        elif kind == "train":
            run["train"].append(r)
        elif kind == "eval":
            run["eval"][r["step"]] = r
        elif kind == "stage":
            run["stage"].setdefault(r["stage"], r)  # a resume inside a stage marks it again
        elif kind == "compile":
            run["compile"].append(r)
    evaluator = os.path.join(workdir, "evaluator", "metrics.jsonl")
    if os.path.isfile(evaluator):
        for r in read_jsonl(evaluator):  # the trainer's own eval of a step comes first
            if r.get("event") == "eval" and r.get("wall_s") is not None:
                run["eval"].setdefault(r["step"], r)
    run["eval"] = [run["eval"][s] for s in sorted(run["eval"])]
    run["stage"] = [run["stage"][i] for i in sorted(run["stage"])]
    summary_path = os.path.join(workdir, "summary.json")
    run["summary"] = None
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            run["summary"] = json.load(f)
    return run


def names(workdirs: list[str]) -> list[str]:
    """Each run's folder name, or the path as given where two folder names are the same."""
    base = [os.path.basename(os.path.normpath(w)) for w in workdirs]
    return [b if base.count(b) == 1 else w for b, w in zip(base, workdirs)]


def time_to(run: dict, metric: str, target: float) -> dict | None:
    """The first eval (in wall time) with ``metric`` at or above ``target``, counted as
    summary.json's ``time_to_target`` is: ``wall_s`` from the start of the run, and
    ``wall_s_without_compile`` less the compile records written before it."""
    hits = [e for e in run["eval"] if e[metric] >= target]
    if not hits:
        return None
    first = min(hits, key=lambda e: e["wall_s"])
    compile_s = sum(c["compile_s"] for c in run["compile"] if c["wall_s"] <= first["wall_s"])
    return {"wall_s": first["wall_s"], "wall_s_without_compile": first["wall_s"] - compile_s}


def targets(run: dict, asked: dict) -> str:
    """``top1 0.8: 22.0s (19.0s w/o compile)`` for each target: the ``asked`` ones from the
    eval records, else summary.json's ``target_top1`` / ``target_top5``."""
    s = run["summary"] or {}
    reached = s.get("time_to_target") or {}
    if "wall_s" in reached:  # summaries before top-5 targets: one entry, for top-1
        reached = {"top1": reached}
    cells = []
    for metric in ("top1", "top5"):
        target = asked.get(metric) or s.get(f"target_{metric}")
        if not target:
            continue
        hit = time_to(run, metric, target) if asked.get(metric) else reached.get(metric)
        if hit is None:
            cells.append(f"{metric} {target:g}: not reached")
            continue
        text = f"{metric} {target:g}: {hit['wall_s']:.1f}s"
        if hit.get("wall_s_without_compile") is not None:
            text += f" ({hit['wall_s_without_compile']:.1f}s w/o compile)"
        cells.append(text)
    return "; ".join(cells) or "-"


def row(name: str, run: dict, asked: dict) -> dict:
    """The table's values for one run: from the records, and from summary.json for what only
    it knows (wall and images/s over every resumed segment, whether the run completed).
    ``asked``: ``{"top1": target, "top5": target}`` to time from the eval records."""
    s = run["summary"] or {}
    records = run["train"] + run["eval"]
    top1, top5 = ([e[k] for e in run["eval"]] for k in ("top1", "top5"))
    ips = [t["images_per_s"] for t in run["train"] if t.get("images_per_s")]
    if not s:
        status = "running or killed (no summary.json)"
    elif s.get("completed"):
        status = "completed"
    else:
        status = "error" if s.get("error") else "stopped"
    return {
        "run": name,
        "epochs": max((r["epoch"] for r in records), default=0.0),
        "steps": s.get("steps", max((r["step"] for r in records), default=0)),
        "best top1": max(top1, default=None),
        "best top5": max(top5, default=None),  # each its own best, as targets count them
        "time to target": targets(run, asked),
        "wall s": s.get("wall_s", max((r["wall_s"] for r in records), default=None)),
        "compile s": sum(c["compile_s"] for c in run["compile"]) or s.get("compile_s"),
        "images/s": s.get("train_images_per_s") or (statistics.median(ips) if ips else None),
        "status": status,
    }


def markdown(rows: list[dict]) -> str:
    def cell(key, v):
        if v is None:
            return "-"
        if key in ("best top1", "best top5"):
            return f"{v:.4f}"
        if key == "epochs":
            return f"{round(v, 2):g}"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, r[k]) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def stage_steps(run: dict, key: str) -> tuple[list, list]:
    """``(epochs, values)`` of a stage field (image size, batch) as a step function to the
    run's last epoch."""
    last = max((r["epoch"] for r in run["train"] + run["eval"]), default=0.0)
    xs = [s["epoch"] for s in run["stage"]] + [last]
    ys = [s[key] for s in run["stage"]]
    return xs, ys + ys[-1:]


def plot(runs: list[tuple[str, dict]], path: str) -> None:
    """The PNG: accuracy against wall time and epochs, and the schedule against epochs."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError('the report\'s PNG needs matplotlib: pip install -e ".[plot]"') from None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (acc_t, acc_e, lr), (mom, batch, size) = axes
    for i, (name, run) in enumerate(runs):
        color = f"C{i % 10}"
        ev, tr = run["eval"], run["train"]
        for ax, x in ((acc_t, "wall_s"), (acc_e, "epoch")):
            ax.plot([e[x] for e in ev], [e["top1"] for e in ev], "o-", color=color,
                    label=f"{name} top-1")  # fmt: skip
            ax.plot([e[x] for e in ev], [e["top5"] for e in ev], "s--", color=color,
                    alpha=0.6, label=f"{name} top-5")  # fmt: skip
        lr.plot([t["epoch"] for t in tr], [t["lr"] for t in tr], color=color, label=name)
        with_m = [t for t in tr if "momentum" in t]  # runs before the momentum schedule lack it
        mom.plot([t["epoch"] for t in with_m], [t["momentum"] for t in with_m], color=color,
                 label=name)  # fmt: skip
        if run["stage"]:
            for ax, key in ((batch, "global_batch"), (size, "image_size")):
                ax.plot(*stage_steps(run, key), color=color, drawstyle="steps-post", label=name)
        for s in run["stage"][1:]:  # the switches (the first stage starts the run)
            acc_t.axvline(s["wall_s"], color=color, linestyle=":", alpha=0.7)
            for ax in (acc_e, lr, mom, batch, size):
                ax.axvline(s["epoch"], color=color, linestyle=":", alpha=0.7)
    labels = ((acc_t, "wall time (s)", "accuracy"), (acc_e, "epoch", "accuracy"),
              (lr, "epoch", "learning rate"), (mom, "epoch", "momentum"),
              (batch, "epoch", "global batch"), (size, "epoch", "image size (px)"))  # fmt: skip
    acc_t.set_xlim(left=0)  # from the run's start: set-up and compilation count, as in DAWNBench
    for ax, xlabel, ylabel in labels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("top-1 (solid) and top-5 (dashed); dotted lines: stage switches", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(workdirs: list[str], out: str, asked: dict | None = None) -> str:
    """Reads the runs, writes ``out`` (PNG) and its ``.md`` table; returns the table.
    ``asked``: targets to time from the eval records, e.g. ``{"top1": 0.8}``."""
    runs = list(zip(names(workdirs), [read_run(w) for w in workdirs]))
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    plot(runs, out)
    table = markdown([row(name, run, asked or {}) for name, run in runs])
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    return table


def main(argv=None) -> None:
    parser = cli.ArgumentParser("python -m hybridpar.report", __doc__)
    parser.add_argument("workdirs", nargs="+", metavar="W", help="training runs' workdirs")
    parser.add_argument("--out", default="report.png", help="the PNG (the table: same, .md)")
    for metric in ("top1", "top5"):
        parser.add_argument(
            f"--target-{metric}",
            type=cli.finite_float,
            default=None,
            help=f"time to this {metric} (a fraction) from the eval records, for every run; "
            f"default: each summary.json's target_{metric} and its time",
        )
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    asked = {"top1": args.target_top1, "top5": args.target_top5}
    for metric, target in asked.items():
        if target is not None and not 0 < target <= 1:
            cli.fail(f"--target-{metric}={target:g} is a fraction: use e.g. 0.93, not 93")

    def run():
        table = report(args.workdirs, args.out, {k: v for k, v in asked.items() if v})
        print(table, end="")
        print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md")

    cli.main(run)


if __name__ == "__main__":
    main()
