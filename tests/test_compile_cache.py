"""The persistent compilation cache (``compile_cache``), through the train CLI.

The cache is JAX's and global to a process, so each run is its own process here. A 3-stage
run of the tiny model compiles every stage's step and the eval step before its first step
(no ``compile`` event after the first ``stage`` event); a second identical run in another
workdir, on the same cache, loads every one of them instead of compiling.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import DIGITS, NO_LLVM_OPT_FLAG, TINY_DIGITS, config_args
from xla_flags import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    **TINY_DIGITS,
    "eval_every_epochs": 0,
    "stages": "0.1:16-4,0.2:24-4,0.3:16-8",
    "num_epochs": 0.3,  # where the last stage ends  # three shapes: (16 px, 32), (24, 32), (16, 64)
    "mesh": "data:8",
}


# What is cached, not how fast the programs run, is under test: LLVM's optimisations (a
# large part of each of the first run's 5 compiles: the init, 3 train steps, the eval step) are
# skipped, as the compile-only tests skip them. Both runs pass the same flags, which are part
# of the cache key.
XLA_FLAGS = cpu_flags(8, NO_LLVM_OPT_FLAG)


def _train(workdir, cache):
    args = config_args(TINY)
    env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-m", "hybridpar.train", "--config", DIGITS, "--workdir",
         str(workdir), f"--config.compile_cache={cache}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_all_stages_compile_before_the_first_and_a_second_run_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "a", cache)
    events = [r["event"] for r in first]
    compiles = [r for r in first if r["event"] == "compile"]
    # every stage's train step (3 shapes) and the eval step, all before the first stage
    assert sorted((r["program"], r["batch"], r["image_size"]) for r in compiles) == [
        ("eval", 120, 16), ("train", 32, 16), ("train", 32, 24), ("train", 64, 16)]  # fmt: skip
    assert max(i for i, e in enumerate(events) if e == "compile") < events.index("stage")
    assert [r["image_size"] for r in first if r["event"] == "stage"] == [16, 24, 16]
    assert not any(r["cache_hit"] for r in compiles)
    assert any(cache.iterdir())  # the programs were written

    second = _train(tmp_path / "b", cache)
    again = [r for r in second if r["event"] == "compile"]
    assert len(again) == 4 and all(r["cache_hit"] for r in again), again
    # the same programs: the same losses, step for step
    losses = [[r["loss"] for r in run if r["event"] == "train"] for run in (first, second)]
    assert losses[0] == losses[1] and len(losses[0]) > 3
