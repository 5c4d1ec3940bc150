"""Read an MLPerf Training result log (mllog) for what the scaling model's calibration and
validation rows take from it: the global batch, run_start to run_stop, the epoch of the last
evaluation, the median block (block_start to the next block_start: train and evaluation), the
host's evaluation seconds where the log marks them, and the first block (from run_start).

    python bench/results/scaling_validation/mllog_blocks.py LOG [LOG ...]
    python bench/results/scaling_validation/mllog_blocks.py --git REPO PATH [PATH ...]

Reads both log formats: `:::MLLOG {json}` (v0.7 on) and `:::MLL <time> <key>: {json}` (v0.6).
Plain Python; the logs are mlcommons/training_results_vX.Y's `*/results/*/resnet/result_N.txt`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys

_OLD = re.compile(r":::MLL ([\d.]+) (\w+): (.*)")


def events(text: str) -> list[tuple[float, str, dict]]:
    """(seconds, key, metadata) of every line, in either format."""
    out = []
    for line in text.splitlines():
        i = line.find(":::MLLOG ")
        if i >= 0:
            try:
                e = json.loads(line[i + 9 :])
            except json.JSONDecodeError:
                continue
            out.append(
                (e["time_ms"] / 1e3, e["key"], dict(e.get("metadata") or {}, value=e.get("value")))
            )
            continue
        m = _OLD.match(line.strip())
        if m:
            e = json.loads(m.group(3))
            out.append(
                (float(m.group(1)), m.group(2), dict(e.get("metadata") or {}, value=e.get("value")))
            )
    return out


def summary(text: str) -> dict:
    ev = events(text)

    def get(key):
        return [e for e in ev if e[1] == key]

    t0, t1 = get("run_start")[0][0], get("run_stop")[0][0]
    starts = [e[0] for e in get("block_start")] + [t1]
    firsts = [float(e[2].get("first_epoch_num", 0)) for e in get("block_start")]
    blocks = [b - a for a, b in zip(starts, starts[1:])]
    # a block's epochs from the next block's first epoch (the logs' epoch_count can be wrong)
    epochs = [b - a for a, b in zip(firsts, firsts[1:])]
    steady = [d for d, n in zip(blocks[1:-1], epochs[1:]) if n == 4]
    evals = []
    for (a, _, _), nxt in zip(get("eval_start"), starts[1:]):
        evals.append(nxt - a)  # eval_start to the next block_start: the host's evaluation
    return {
        "global_batch": get("global_batch_size")[0][2]["value"],
        "run_s": t1 - t0,
        "last_eval_epoch": float(get("eval_accuracy")[-1][2]["epoch_num"]),
        "blocks": len(blocks),
        "block_s": statistics.median(steady) if steady else float("nan"),
        "block_eval_s": statistics.median(evals) if evals else 0.0,
        "first_block_s": starts[1] - t0,  # lead-in included
        "first_block_epochs": epochs[0] if epochs else float("nan"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--git", default=None, help="read the paths from this git repository's HEAD")
    args = ap.parse_args(argv)
    for path in args.logs:
        if args.git:
            cmd = ["git", "-C", args.git, "show", f"HEAD:{path}"]
            text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        else:
            with open(path) as f:
                text = f.read()
        s = summary(text)
        print(
            f"{path}: batch {s['global_batch']}, run {s['run_s']:.3f} s, last eval epoch "
            f"{s['last_eval_epoch']:g}, {s['blocks']} blocks, median block {s['block_s']:.3f} s "
            f"(host eval {s['block_eval_s']:.3f} s), first block {s['first_block_s']:.2f} s "
            f"over {s['first_block_epochs']:g} epochs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
