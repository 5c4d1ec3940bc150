"""Time to accuracy on CIFAR-10: the curriculum against the same model at one fixed shape.

    python bench/curriculum_tta.py [--variant cpu] [--target 0.8] [--epochs E]
                                   [--out DIR] [--set KEY=VALUE ...] [--curriculum-run DIR]
                                   [--fixed-set KEY=VALUE ...] [--one-after-other]

Two runs of ``experiments/cifar10_fast.py:VARIANT`` in fresh workdirs under ``--out``
(default ``runs/curriculum_tta``), side by side: at once, each on half the cores, its output
in ``--out``/NAME.log (``--one-after-other``: in turn, on all cores). ``curriculum`` (the
recipe's stages, e.g. 24 px then 32 px, at batch 512) and ``fixed`` (the same model,
optimizer, epochs and augmentation at 32 px and the last stage's batch throughout). Both
log every step
(``log_every_s=0``) and evaluate every epoch; time to ``--target`` top-1 is DAWNBench's count
(wall clock from the start, compilation and evaluation included, ``summary.json``'s
``time_to_target``), and also without compilation. The data is prepared before either run
starts, so neither clock includes that one-time cost.

Also per run: the best top-1 and the epoch it came at, and for the curriculum the stall at
each stage switch: the time between the last step of one stage and the first of the next,
against the median step time of the stage after it (an interval with an evaluation or a
checkpoint in it is reported as such, not as a stall; the time from the switch, after any
evaluation, to the next step is reported too). Then ``python -m hybridpar.report``
on both runs (``DIR/report.png`` and ``.md``).

The last line starts with the speedup, ``tta_speedup_80=`` (fixed's time to target over the
curriculum's; ``nan`` where a run did not reach it), target >= 1.3x. Data: the
JPEG tars in ``$HYBRIDPAR_DATA`` (default ``../shared/data``), prepared on first use into
``~/.cache/hybridpar``. On 2 CPU cores an epoch of the cpu variant takes minutes: the whole
bench is hours at the recipe's 8 epochs; ``--epochs`` shortens both runs alike.
``--curriculum-run DIR`` compares with a finished run of the recipe (``python -m
hybridpar.train --config experiments/cifar10_fast.py:cpu``, checked against the stages and
epochs the bench would train) instead of training the curriculum again; the fixed run then
logs as often as that run did, and the last line ends with ``curriculum_reused=1`` (the two
are not side by side). Times to target come from the eval records, so any target works.
``--fixed-set`` overrides the fixed run only: ``--fixed-set stop_at_target=True`` stops it at
the target while the curriculum trains to its end (the recipe's final accuracy in the same
bench); ``--set stop_at_target=True`` stops both there, the shortest bench.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail(message: str) -> None:
    """One ``error:`` line and exit 2, as the trainer does for bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def start(name: str, out: Path, args, overrides: list[str], cores=None):
    """Starts one training run in a fresh workdir (on ``cores`` only, its output in
    ``out/NAME.log``, when given); returns (process, workdir, log file or None)."""
    workdir = out / name
    if workdir.exists():
        fail(f"{workdir} exists; pass another --out (the bench never reuses a run)")
    cmd = [
        sys.executable, "-m", "hybridpar.train",
        "--config", str(ROOT / "experiments" / f"cifar10_fast.py:{args.variant}"),
        "--workdir", str(workdir),
        "--config.log_every_s=0", "--config.eval_every_epochs=1",
        f"--config.target_top1={args.target}",
        *(f"--config.{kv}" for kv in args.set), *overrides,
    ]  # fmt: skip
    if cores is None:
        print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
        return subprocess.Popen(cmd, cwd=ROOT), workdir, None
    log = out / f"{name}.log"
    print(f"== {name} on cores {sorted(cores)} (output in {log}): {' '.join(cmd[3:])}", flush=True)
    with open(log, "w") as f:  # the child holds its own copy of the file
        # XLA's and tf.data's thread pools size themselves by the affinity set.
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))  # fmt: skip
    return proc, workdir, log


def finish(name: str, proc, workdir: Path, log) -> Path:
    code = proc.wait()
    if code != 0:
        where = f"; its output is in {log}" if log else ""
        fail(f"the {name} run failed (exit {code}); its records are in {workdir}{where}")
    return workdir


def run(name: str, out: Path, args, overrides: list[str]) -> Path:
    return finish(name, *start(name, out, args, overrides))


def prepare(args) -> None:
    """The prepared copy of the data both runs read, made (or checked) first, as the
    trainer makes it on first use."""
    code = (
        "import sys; from hybridpar import cli; from hybridpar.input.datasets import make_data; "
        "c = cli.load(sys.argv[1], [tuple(kv.split('=', 1)) for kv in sys.argv[2:]]); "
        "make_data(c, 0, 1)"
    )
    config = str(ROOT / "experiments" / f"cifar10_fast.py:{args.variant}")
    r = subprocess.run([sys.executable, "-c", code, config, *args.set], cwd=ROOT)
    if r.returncode != 0:
        fail(f"preparing the data failed (exit {r.returncode})")


def records(workdir: Path) -> list[dict]:
    out = []
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short
            continue
    return out


def stalls(recs: list[dict]) -> list[dict]:
    """For each stage switch: the gap between the last step before it and the first after
    it, and the median step interval of the stage after it (none where the run did not log
    both steps)."""
    out = []
    stage_at = [i for i, r in enumerate(recs) if r["event"] == "stage"][1:]
    for i in stage_at:
        before_idx = [j for j in range(i) if recs[j]["event"] == "train"]
        after_idx = [j for j in range(i, len(recs)) if recs[j]["event"] == "train"]
        if not before_idx or not after_idx:
            continue
        last, first = recs[before_idx[-1]], recs[after_idx[0]]
        if first["step"] != last["step"] + 1:  # a run that logged every few steps
            continue
        # what else was logged between the two steps (an epoch's evaluation is written
        # before the stage record)
        between = {r["event"] for r in recs[before_idx[-1] + 1 : after_idx[0]]} - {"stage"}
        steps = [recs[j] for j in after_idx]
        gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(steps, steps[1:])
                if b["step"] == a["step"] + 1]  # fmt: skip
        out.append(
            {
                "at_step": first["step"] - 1,
                "gap_s": round(first["wall_s"] - last["wall_s"], 3),
                # from the stage record (after any evaluation) to the first step of the stage
                "after_switch_s": round(first["wall_s"] - recs[i]["wall_s"], 3),
                "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
                "between": sorted(between),  # an eval or checkpoint: not a stall
            }
        )
    return out


def time_to_target(recs: list[dict], target: float) -> dict | None:
    """The first eval at or above ``target`` top-1: its wall time from the start
    (compilation and evaluation included), that time less the compile time on the critical
    path before it (a background compile counts its wait), and its epoch."""
    compile_s = 0.0
    for r in recs:
        if r["event"] == "compile":
            compile_s += r["wait_s"] if r.get("background") else r["compile_s"]
        if r["event"] == "eval" and r["top1"] >= target:
            return {"wall_s": r["wall_s"], "without_compile_s": round(r["wall_s"] - compile_s, 3),
                    "epoch": r["epoch"]}  # fmt: skip
    return None


def summarize(name: str, workdir: Path, target: float) -> dict:
    summary = json.loads((workdir / "summary.json").read_text())
    recs = records(workdir)
    evals = [r for r in recs if r["event"] == "eval"]
    best = max(evals, key=lambda r: r["top1"]) if evals else {}
    reached = time_to_target(recs, target)
    return {
        "name": name,
        "workdir": str(workdir),
        "tta_s": reached["wall_s"] if reached else math.nan,
        "tta_without_compile_s": reached["without_compile_s"] if reached else math.nan,
        "tta_epoch": reached["epoch"] if reached else math.nan,
        "best_top1": best.get("top1", math.nan),
        "best_epoch": best.get("epoch", math.nan),
        "wall_s": summary["wall_s"],
        "compile_s": summary["compile_s"],
        "stalls": stalls(recs),
    }


def check_reused(workdir: Path, variant: str, stages: list[str], epochs: float) -> float:
    """``workdir``'s ``log_every_s``, after checking that it is a finished run of the
    recipe's curriculum as this bench would train it; else an ``error:`` exit."""
    path = workdir / "config.json"
    if not path.exists() or not (workdir / "summary.json").exists():
        fail(
            f"--curriculum-run {workdir} holds no finished run (config.json and "
            "summary.json); pass the workdir of a finished cifar10_fast run"
        )
    c = json.loads(path.read_text())
    summary = json.loads((workdir / "summary.json").read_text())
    want = {"stages": ",".join(stages), "num_epochs": epochs, "eval_every_epochs": 1.0}
    got = {"stages": c.get("stages"), "num_epochs": c.get("num_epochs"),
           "eval_every_epochs": c.get("eval_every_epochs")}  # fmt: skip
    if got != want or not summary.get("completed"):
        fail(
            f"--curriculum-run {workdir} is not a completed run of "
            f"cifar10_fast.py:{variant}'s curriculum as the bench runs it ({want}; it has "
            f"{got}, completed={summary.get('completed')}); train it with the bench"
        )
    return c.get("log_every_s", 0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--target", type=float, default=0.8, help="top-1 to time (a fraction)")
    p.add_argument("--epochs", type=float, default=0.0, help="both runs' epochs (0: recipe's)")
    p.add_argument("--out", default=str(ROOT / "runs" / "curriculum_tta"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both runs, repeatable")  # fmt: skip
    p.add_argument("--fixed-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the fixed run only, after --set: e.g. "
                        "stop_at_target=True stops it at the target while the curriculum "
                        "trains to its end (the recipe's final accuracy, same run)")  # fmt: skip
    p.add_argument("--curriculum-run", default="", metavar="DIR",
                   help="a finished run of the recipe's curriculum to compare with instead of "
                        "training one (halves the bench; the two runs are then not side by "
                        "side, and the last line says so)")  # fmt: skip
    p.add_argument("--one-after-other", action="store_true",
                   help="train the two runs one after the other on all cores instead of "
                        "side by side on half the cores each (default: 2+ cores)")  # fmt: skip
    args = p.parse_args(argv)
    if not 0 < args.target <= 1:
        fail(f"--target={args.target} is a fraction in (0, 1], e.g. --target 0.8")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT / "experiments"))
    import cifar10_fast  # the recipe's stages: the fixed run takes the last one's shape

    from hybridpar.curriculum import parse_stages  # JAX-free, as this parent process stays

    _, recipe_epochs, recipe_stages, _ = cifar10_fast.VARIANTS[args.variant]
    epochs = args.epochs or recipe_epochs
    # the recipe's stages with their end epochs scaled to --epochs; fixed: the last shape
    stages = []
    for part in recipe_stages.split(","):
        end, shape = part.split(":")
        stages.append(f"{float(end) * epochs / recipe_epochs:g}:{shape}")
    _, size, batch, _ = parse_stages(recipe_stages)[-1]  # the last stage's shape, no @ or ~
    common = [f"--config.num_epochs={epochs:g}", f"--config.data.image_size={size}"]
    fixed_overrides = [*common, f"--config.stages={epochs:g}:{size}-{batch}"]
    fixed_overrides += [f"--config.{kv}" for kv in args.fixed_set]
    if args.curriculum_run:
        curriculum = Path(args.curriculum_run)
        # the fixed run logs as often as the reused one did (logging every step syncs)
        log_every = check_reused(curriculum, args.variant, stages, epochs)
        fixed_overrides.append(f"--config.log_every_s={log_every}")
        print(f"== curriculum: reusing {curriculum}", flush=True)
    prepare(args)  # once, before either clock starts: neither run pays for it
    curriculum_overrides = [*common, f"--config.stages={','.join(stages)}"]
    cores = sorted(os.sched_getaffinity(0))
    side_by_side = not args.curriculum_run and not args.one_after_other and len(cores) >= 2
    if side_by_side:
        # Both at once, each on half the cores: whatever else loads the machine during the
        # hour slows both alike (one after the other, the same run's speed moved by 30%
        # between hours on a shared 2-core machine).
        half = len(cores) // 2  # equal halves: an odd core out stays idle
        c = start("curriculum", out, args, curriculum_overrides, set(cores[:half]))
        f = start("fixed", out, args, fixed_overrides, set(cores[half : 2 * half]))
        curriculum, fixed = finish("curriculum", *c), finish("fixed", *f)
    else:
        if not args.curriculum_run:
            curriculum = run("curriculum", out, args, curriculum_overrides)
        fixed = run("fixed", out, args, fixed_overrides)
    rows = [
        summarize("curriculum", curriculum, args.target),
        summarize("fixed", fixed, args.target),
    ]

    subprocess.run([sys.executable, "-m", "hybridpar.report", str(curriculum), str(fixed),
                    "--out", str(out / "report.png"), f"--target-top1={args.target}"],
                   cwd=ROOT, check=False)  # fmt: skip
    print(f"\ntime to {args.target:g} top-1 (wall from the start, compile and eval included):")
    for r in rows:
        print(
            f"  {r['name']:<10} {r['tta_s']:8.1f} s (without compile "
            f"{r['tta_without_compile_s']:.1f} s, epoch {r['tta_epoch']}); best top-1 "
            f"{r['best_top1']:.4f} at epoch {r['best_epoch']}; wall {r['wall_s']:.1f} s, "
            f"compile {r['compile_s']:.1f} s"
        )
    for s in rows[0]["stalls"]:
        note = f" ({', '.join(s['between'])} in between)" if s["between"] else ""
        print(f"  stage switch after step {s['at_step']}: {s['gap_s']:.3f} s between steps, "
              f"{s['after_switch_s']:.3f} s from the switch to the next step, median step "
              f"{s['median_step_s']} s{note}")  # fmt: skip
    (out / "curriculum_tta.json").write_text(json.dumps(rows, indent=2))
    speedup = rows[1]["tta_s"] / rows[0]["tta_s"]
    key = f"{round(args.target * 100):d}"
    stall = rows[0]["stalls"][0] if rows[0]["stalls"] else {}
    print(
        f"tta_speedup_{key}={speedup:.3f} curriculum_tta_s={rows[0]['tta_s']:.1f} "
        f"fixed_tta_s={rows[1]['tta_s']:.1f} curriculum_best_top1={rows[0]['best_top1']:.4f} "
        f"fixed_best_top1={rows[1]['best_top1']:.4f} switch_gap_s={stall.get('gap_s', math.nan)} "
        f"after_switch_s={stall.get('after_switch_s', math.nan)} "
        f"median_step_s={stall.get('median_step_s', math.nan)} variant={args.variant} "
        f"epochs={epochs:g}"
        + (" curriculum_reused=1" if args.curriculum_run else "")
        + (f" side_by_side=1 cores_each={len(cores) // 2}" if side_by_side else "")
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
