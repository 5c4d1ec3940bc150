"""Compression: channel pruning (``hybridpar/tools/prune.py``), distillation
(``hybridpar/runtime/distill.py``) and the compress-and-retrain loop (``python -m
hybridpar.compress``).

* Pruning nothing, with every group's channels in a random order, leaves the logits as they
  were (basic and bottleneck ResNets, the airbench net): residual-tied channels share one
  order. One producer
  of a residual group ordered on its own is rejected by the same check.
* A 50%-pruned model has the shapes of the ResNet its width keys build; a consumer left
  unpruned is rejected.
* On a tiny trained digits run: the pruned run trains from its weights and evaluates through
  ``python -m hybridpar.prune`` and the train command it prints; the teacher's widths with
  the pruned weights are an ``error:`` line.
* The distillation step on 8 devices computes what one device does.
* Distillation's loss and gradient are Hinton's, T^2 included, at several temperatures;
  the teacher's logits are its inference-mode ones, and the train step's loss is the
  formula on them (the teacher as its own student, where a train-mode teacher's KL is 0).
* The loop: the int8 bytes it plans rounds with are what ``quantize`` writes, so the round
  that spends the budget fits it; with each round's work stood in for, it stops at the
  round that meets the budget (of the int8 weights, or of the LiteRT file: a tiny
  teacher's file-budget round writes a model.tflite within it; a file budget under the
  smallest file is an ``error:``), exits 3 where none does, refuses a teacher still training
  or unfinished, a loop of another teacher step, and a second loop on the same workdir;
  its results' paths hold from any working directory.
* The loop resumes a round stopped by SIGTERM, and bad input is one ``error:`` line.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import NO_LLVM_OPT_FLAG, cpu_env, random_variables, tiny_digits

from hybridpar.models.airbench import AirbenchNet
from hybridpar.models.resnet import ResNet50, ResNetTiny
from hybridpar.parallel import partitioning
from hybridpar.runtime import distill, run, trained, trainer
from hybridpar.tools import prune

ROOT = Path(__file__).resolve().parents[1]
EPS32 = float(np.finfo(np.float32).eps)
# The tools' processes (prune, train, compress, evaluate, quantize): one device, and no
# LLVM optimisations (a large part of each compile; neither speed nor accuracy is held here).
CLI_ENV = cpu_env(devices=1, xla_flags=NO_LLVM_OPT_FLAG)
LONGER = {"num_epochs": 1.5, "log_every_s": 5.0, "mesh": "data:1"}  # as test_quantize's run


MODELS = [
    (ResNetTiny(num_classes=10), 16),
    (ResNet50(num_classes=10, num_filters=4), 32),
    (AirbenchNet(num_classes=10, num_filters=8), 16),
]
IDS = ["tiny-basic", "resnet50-bottleneck", "airbench"]


def _logits(model, params, stats, x):
    return np.asarray(model.apply({"params": params, "batch_stats": stats}, x, train=False))


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_pruning_nothing_keeps_the_logits(model, size):
    params, stats = random_variables(model, size)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, size, size, 3)), jnp.float32)
    want = _logits(model, params, stats, x)
    gs = prune.groups(model, params)
    rng = np.random.default_rng(2)
    widths = prune.group_widths(gs, params)
    order = {g.name: rng.permutation(widths[g.name]) for g in gs}  # every channel, reordered
    p, s = prune.apply(gs, params, stats, order)
    got = _logits(model.clone(**prune.widths_of(model, p)), p, s, x)
    # the same sums in another order: a few float32 roundings of the logits' scale
    tol = 1000 * EPS32 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    # negative control: one producer of a residual group ordered apart from the others (the
    # airbench net has none: there, the first conv's readers left in the old order)
    tied = next((g for g in gs if len(g.producers) > 1), None)
    if tied is None:
        broken = [prune.Group(gs[0].name, gs[0].producers, [])] + gs[1:]
    else:
        alone = prune.Group("alone", tied.producers[-1:], [])
        rest = prune.Group(tied.name, tied.producers[:-1], tied.consumers)
        broken = [g for g in gs if g.name != tied.name] + [rest, alone]
        order["alone"] = rng.permutation(widths[tied.name])
    p, s = prune.apply(broken, params, stats, order)
    bad = _logits(model.clone(**prune.widths_of(model, p)), p, s, x)
    assert np.abs(bad - want).max() > 100 * tol


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_half_pruned_shapes_are_the_narrower_resnet(model, size):
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    counts = prune.counts_for(gs, prune.group_widths(gs, params), 0.5)
    keep = prune.keep_masks(gs, params, stats, counts)
    p, s = prune.apply(gs, params, stats, keep)
    narrow = model.clone(**prune.widths_of(model, p))
    x = jnp.zeros((1, size, size, 3), jnp.float32)
    want = meta.unbox(jax.eval_shape(lambda: narrow.init(jax.random.key(0), x, train=False)))
    shapes = lambda t: jax.tree.map(np.shape, t)  # noqa: E731
    assert shapes(want["params"]) == shapes(p) and shapes(want["batch_stats"]) == shapes(s)
    n = sum(np.size(a) for a in jax.tree.leaves(params))
    assert sum(np.size(a) for a in jax.tree.leaves(p)) < 0.4 * n  # widths halved: ~1/4
    # negative control: the head left out of the last group's readers
    last = gs[[i for i, g in enumerate(gs) if "head" in g.consumers][0]]
    last.consumers.remove("head")
    p, s = prune.apply(gs, params, stats, keep)
    assert shapes(want["params"]) != shapes(p)


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_param_count_is_the_pruned_models(model, size):
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    rng = np.random.default_rng(3)
    counts = {g.name: int(rng.integers(1, w + 1)) for g, w in
              zip(gs, prune.group_widths(gs, params).values())}  # fmt: skip
    for name in counts:  # a bottleneck's inner convs share one width
        counts[name] = counts.get(name.replace("/conv2", "/conv1"), counts[name])
    p, _ = prune.apply(gs, params, stats, prune.keep_masks(gs, params, stats, counts))
    assert prune.param_count(gs, params, counts) == sum(np.size(a) for a in jax.tree.leaves(p))
    assert prune.param_count(gs, params, {}) == sum(np.size(a) for a in jax.tree.leaves(params))


def _real_int8_bytes(model, size, params, stats, keep):
    """What ``quantize`` writes for the model pruned to ``keep``: calibrated on random
    images, folded, quantized, measured (``prune.int8_bytes``'s shapes-only path aside)."""
    from hybridpar.program import int8

    gs = prune.groups(model, params)
    counts = prune.counts_for(gs, prune.group_widths(gs, params), keep)
    p, s = prune.apply(gs, params, stats, prune.keep_masks(gs, params, stats, counts))
    arch = int8.architecture(model, p)
    layers = int8.fold_batchnorm(arch, p, s, model.bn_epsilon)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, size, size, 3)), jnp.float32)
    return int8.tree_bytes(int8.quantize(layers, int8.calibrate(arch, layers, [x])))


@pytest.mark.parametrize("model,size", MODELS, ids=IDS)
def test_int8_bytes_are_what_quantize_writes(model, size):
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    widths = prune.group_widths(gs, params)
    for keep in (0.8, 0.3):
        got = prune.int8_bytes(model, gs, params, stats, prune.counts_for(gs, widths, keep))
        assert got == _real_int8_bytes(model, size, params, stats, keep), keep


def test_the_last_round_spends_the_budget():
    from hybridpar.tools import compress

    model, size = MODELS[2]
    params, stats = random_variables(model, size)
    gs = prune.groups(model, params)
    widths = prune.group_widths(gs, params)

    def bytes_at(k):
        return prune.int8_bytes(model, gs, params, stats, prune.counts_for(gs, widths, k))

    def real(k):
        return _real_int8_bytes(model, size, params, stats, k)

    teacher, step = real(1.0), real(0.75)
    # step 0.25: round 1 keeps 0.75, whose weights are over a budget just under them
    assert compress.keep_for(1, 0.25, 0.99 * step / 1000, bytes_at) == 0.75
    # a budget round 1 would undershoot: the largest fraction whose int8 weights fit it,
    # as quantize then measures them (the round "fitted" 200 KB and landed at 200.8)
    for share in (0.2, 0.5, 0.8):
        budget_kb = (step + share * (teacher - step)) / 1000
        k = compress.keep_for(1, 0.25, budget_kb, bytes_at)
        assert 0.75 < k < 1 and real(k) <= 1000 * budget_kb, (share, k, real(k))
        assert real(round(k + 0.001, 3)) > 1000 * budget_kb, (share, k)  # the largest


# ---- the loop's rules, with each round's work stood in for ---------------------------------

# A stand-in teacher: int8 bytes at a fraction of its channels, growing as the real ones do.
FAKE_STEP = 40


def _fake_bytes(keep):
    return int(100_000 * keep**2) + 500


FAKE_OVERHEAD = 10_000  # the stand-in LiteRT file: its int8 weights and this


def _fake_size(workdir, of="weights"):
    """``compress.teacher_size``'s stand-in: the file's bound is its size."""
    return {}, _fake_bytes if of == "weights" else lambda k: _fake_bytes(k) + FAKE_OVERHEAD


def _fake_teacher(path):
    """A finished run as compress sees it before any device: config.json, a checkpoint's
    directory and a completed summary (the rounds themselves are ``_fake_rounds``')."""
    from hybridpar.runtime import run_config

    path.mkdir()
    config = tiny_digits(**LONGER)
    (path / "config.json").write_text(json.dumps(run_config.config_dict(config)))
    (path / "checkpoints" / str(FAKE_STEP)).mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(
        {"completed": True, "steps": FAKE_STEP, "total_steps": FAKE_STEP}))  # fmt: skip
    return path


def _fake_rounds(monkeypatch, drops=None, previous=None):
    """Each round's work (prune, distil, quantize) replaced by a report of ``_fake_bytes``
    at its fraction and a top-1 ``drops[index]`` points under the teacher's (default 0);
    returns the list of ``(index, keep)`` of the rounds made. ``previous``: a list that
    gets the run each round after round 0 would prune (the previous row's ``run``)."""
    from hybridpar.tools import compress

    made = []

    def make_round(config, args, index, keep, rd, rows, reference, log):
        made.append((index, keep))
        if previous is not None and index > 0:
            previous.append(rows[-1]["run"])
        top1 = 0.9 - (drops or {}).get(index, 0.0) / 100
        ev = {"float": {"top1": 0.9 if index == 0 else top1},
              "int8": {"top1": top1, "examples": 360}}  # fmt: skip
        file_bytes = _fake_bytes(keep) + FAKE_OVERHEAD
        report = {"eval": ev, "params": int(1000 * keep), "weight_bytes_int8": _fake_bytes(keep),
                  "flops_per_image": 1, "latency_ms": {"int8_batch1_ms": 1.0},
                  "step": FAKE_STEP if index == 0 else 0,
                  "litert": {"file_bytes": file_bytes, "file_kb": round(file_bytes / 1000, 1),
                             "latency_ms": 0.25, "top1": top1 - 1 / 360},
                  "litert_input": {"classes": [str(i) for i in range(10)]}}  # fmt: skip
        return report, args.workdir if index == 0 else os.path.join(rd, "run")

    monkeypatch.setattr(compress, "teacher_size", _fake_size)
    monkeypatch.setattr(compress, "make_round", make_round)
    monkeypatch.setattr(compress, "plot", lambda *a: None)
    return made


def _main(w, *extra):
    """``compress.main`` on ``w``: ``(exit code, stdout lines, stderr lines)``."""
    import contextlib
    import io

    from hybridpar.tools import compress

    out, err = io.StringIO(), io.StringIO()
    argv = ["--workdir", str(w), "--step", "0.25", "--max-drop", "1", *extra]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            compress.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue().splitlines(), err.getvalue().splitlines()


def test_the_loop_stops_at_the_round_that_meets_the_budget(tmp_path, monkeypatch):
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    # 100.5 KB, then 56.8 KB at 0.75, then the most of (0.5625, 0.75) that fits 40 KB
    code, out, err = _main(w, "--budget-kb", "40")
    assert code == 0, (out, err)
    assert [i for i, _ in made] == [0, 1, 2], made  # not a round past the budget
    keep = made[2][1]
    assert _fake_bytes(keep) <= 40_000 < _fake_bytes(round(keep + 0.001, 3)), keep
    assert out[-1].startswith("kb_int8=39.9 ") and out[-1].endswith(f" teacher_step={FAKE_STEP}")
    rows = [json.loads((w / "compress" / f"round_0{i}" / "result.json").read_text())
            for i in range(3)]  # fmt: skip
    assert [r["teacher_step"] for r in rows] == [FAKE_STEP] * 3
    assert not (w / "compress" / "round_03").exists()
    # the same command again: every round read back, none made
    code, out2, _ = _main(w, "--budget-kb", "40")
    assert code == 0 and len(made) == 3 and out2[-1] == out[-1], made
    # again with fewer --max-rounds: it bounds the rounds made, not those on disk (planted
    # bug that fails it: round 2 left out of the table, and the budget said not reached)
    code, out3, err = _main(w, "--budget-kb", "40", "--max-rounds", "1")
    assert code == 0 and len(made) == 3 and out3[-1] == out[-1], (made, err)
    assert len((w / "compress" / "rounds.md").read_text().splitlines()) == 2 + 3


def test_a_loop_continued_with_another_budget(tmp_path, monkeypatch):
    """A finished loop (round 2 fitted to 40 KB, at 0.628) continued with 35 KB: round 3
    prunes from round 2's fraction, to the most that fits 35 KB (0.587), not from the step's
    0.5625 (which fits it too, as 0.562). Then a larger budget, met by round 1: the rounds
    past it stay in rounds.md, said to be an earlier call's."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "40")[0] == 0 and made[-1] == (2, 0.628), made
    code, out, err = _main(w, "--budget-kb", "35")
    assert code == 0 and made[-1] == (3, 0.587), (made, err)
    assert _fake_bytes(0.587) <= 35_000 < _fake_bytes(0.588)
    assert out[-1].startswith("kb_int8=35.0 "), out[-1]
    code, out, err = _main(w, "--budget-kb", "60")
    assert code == 0 and len(made) == 4 and out[-1].startswith("kb_int8=56.8 "), (out, err)
    lines = (w / "compress" / "rounds.md").read_text().splitlines()
    rounds = [x.split("|")[1].strip() for x in lines[2:] if x.startswith("| ")]
    assert rounds == ["0", "1", "2", "3"], lines
    assert lines[-1].startswith("Rounds 2, 3: made by an earlier call, past round 1"), lines
    assert lines[-1] in out, out
    # printed as rounds.md has them: their rows, then the line (planted bug that fails it:
    # the line printed without the rows)
    printed = [x.split("|")[1].strip() for x in out if x.startswith("| ")]
    assert printed == ["round", "0", "1", "2", "3"], out
    assert out.index(lines[-1]) > out.index(lines[2 + 3]), out


def test_a_round_stopped_after_pruning_goes_on_at_its_pruned_fraction(tmp_path, monkeypatch):
    """Round 2 pruned to 0.628 (fitted to 40 KB), then stopped while distilling; continued
    with 35 KB, it goes on with the model it pruned, so its row says 0.628, not the 0.587
    this budget would take, and the loop says so. Planted bug that fails it: the row records
    the fraction planned now while the pruned folder holds the old one."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "40")[0] == 0 and made[-1] == (2, 0.628), made
    rd = w / "compress" / "round_02"
    (rd / "result.json").unlink()  # as a round stopped before its quantize
    (rd / "pruned").mkdir()
    (rd / "pruned" / "pruned.json").write_text(json.dumps({"keep_fraction": 0.628}))
    code, out, err = _main(w, "--budget-kb", "35")
    assert code == 0 and made[3:] == [(2, 0.628), (3, 0.587)], (made, err)
    row = json.loads((rd / "result.json").read_text())
    assert row["keep"] == 0.628
    assert any(x.startswith("round 2: an earlier call pruned it to 0.628 of the teacher's "
                            "channels (this call would take 0.587)") for x in out), out


def test_a_file_budget_bounds_the_file(tmp_path, monkeypatch):
    """``--budget-of file``: the rounds go on past the weights' 40 KB until the file fits,
    the last fitted to the file's bound; the rows and the last line say which budget."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    code, out, err = _main(w, "--budget-kb", "40", "--budget-of", "file")
    assert code == 0, (out, err)
    # 110.5 KB, 66.8 at 0.75, 42.1 at 0.5625: then the most of (0.42, 0.5625) that fits
    assert [i for i, _ in made] == [0, 1, 2, 3], made
    keep = made[3][1]
    file_at = _fake_size(w, "file")[1]
    assert file_at(keep) <= 40_000 < file_at(round(keep + 0.001, 3)), keep
    assert out[-1].startswith("kb_int8=30.0 ") and " file_kb=40.0 " in out[-1], out[-1]
    assert out[-1].endswith(f" budget_kb=40 budget_of=file teacher_step={FAKE_STEP}"), out[-1]
    assert not any("over 40 KB: --budget-of file" in x for x in out), out  # the file fits
    row = json.loads((w / "compress" / "round_03" / "result.json").read_text())
    assert row["budget_of"] == "file" and row["budget_kb"] == 40.0
    assert row["file_bytes"] == row["planned_bytes"] == file_at(keep)
    # the same rounds under the default budget, the weights: round 2's 32.1 KB fit it
    made.clear()
    code, out, _ = _main(tmp_path / "t", "--budget-kb", "40")
    assert code == 0 and made == [] and out[-1].endswith(" budget_of=weights teacher_step=40")
    assert out[-1].startswith("kb_int8=32.1 ") and " file_kb=42.1 " in out[-1], out[-1]
    # the weights met the budget, the file a device stores did not: the result says so,
    # the file's KB beside the budget's (planted bug that fails it: "reached" alone)
    assert " budget_kb=40 budget_of=weights " in out[-1], out[-1]
    chosen = [x for x in out if x.startswith("smallest within")]
    assert (
        "budget 40 KB of weights reached; its model.tflite, the file a device stores, is "
        "42.1 KB, over 40 KB: --budget-of file bounds the file); "
    ) in chosen[0], chosen


def test_the_rounds_table_has_each_files_size_and_latency(tmp_path, monkeypatch):
    """rounds.md: per round the LiteRT file's KB and one-thread ms (the loop's last line's
    ``file_kb``, ``latency_ms``), ``na`` for a round without a file."""
    from hybridpar.tools import compress

    w = _fake_teacher(tmp_path / "t")
    _fake_rounds(monkeypatch)
    code, out, _ = _main(w, "--budget-kb", "40")
    assert code == 0
    lines = (w / "compress" / "rounds.md").read_text().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]
    kb, ms = header.index("file KB"), header.index("file ms b1")
    ours, file = header.index("top1 int8"), header.index("top1 file")
    assert len(rows) == 3 and all(len(r) == len(header) for r in rows), cells
    for i, r in enumerate(rows):
        row = json.loads((w / "compress" / f"round_0{i}" / "result.json").read_text())
        assert r[kb] == f"{row['file_kb']:.1f}" and r[ms] == "0.250", (r, row)
        # the file's own top-1 beside ours (the stand-in's file: one image under it)
        assert r[ours] == "0.9000" and r[file] == "0.8972" == f"{row['top1_litert']:.4f}", r
    assert " top1=0.9000 top1_litert=0.8972 " in out[-1], out[-1]
    # the chosen model's line names its LiteRT file beside its StableHLO one
    chosen = [x for x in out if x.startswith("smallest within")]
    tflite = w / "compress" / "round_02" / "quantized" / "model.tflite"
    assert len(chosen) == 1 and chosen[0].endswith(f", LiteRT file {tflite}"), chosen
    no_file = {**row, "file_kb": None, "file_bytes": None, "latency_ms": None,
               "top1_litert": None}  # fmt: skip
    r = compress.format_row(no_file)
    assert r[kb] == r[ms] == r[file] == "na", r


def test_a_file_budget_under_the_files_overhead_is_an_error(tmp_path, monkeypatch):
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    code, out, err = _main(w, "--budget-kb", "10", "--budget-of", "file")
    assert code == 2 and made == [], (out, err)
    assert len(err) == 1 and err[0].startswith("error: --budget-kb 10 --budget-of file:"), err
    assert "10.5 KB" in err[0], err  # one channel per group: 500 bytes and the overhead
    assert not (w / "compress").exists()  # refused: no folder left, not even an empty one
    # the weights too: under one channel per group's 500 bytes, refused before any round
    code, out, err = _main(w, "--budget-kb", "0.4")
    assert code == 2 and made == [], (out, err)
    assert len(err) == 1 and err[0].startswith("error: --budget-kb 0.4 --budget-of weights:")
    assert "weigh 0.5 KB" in err[0] and not (w / "compress").exists(), err
    assert _main(w, "--budget-kb", "10")[0] == 0  # a weights budget of 10 KB is reachable


def test_a_budget_not_reached_exits_3(tmp_path, monkeypatch):
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch, drops={2: 3.0})  # round 2 loses 3 points: the loop stops
    code, out, err = _main(w, "--budget-kb", "40")
    assert code == 3, (out, err)
    assert [i for i, _ in made] == [0, 1, 2]
    assert "budget 40 KB of weights NOT reached" in "\n".join(out), out
    assert out[-1].startswith("kb_int8=56.8 "), out  # round 1: the smallest within the drop
    assert len(err) == 1 and err[0].startswith("budget not reached: ") and "56.8 KB" in err[0]


def test_the_advice_of_exit_3_works_on_the_loop(tmp_path, monkeypatch):
    """The line before exit 3 says why the loop stopped and names what changes that on this
    loop, and each thing it names does. The drop stopped it: --max-drop, a loop folder of
    its own for another --step or --epochs (the loop's settings: on it they are an error),
    a budget the chosen round meets; never --max-rounds. The rounds ran out: --max-rounds.
    Planted bug that fails it: one advice for every stop ("a larger --epochs, a smaller
    --step ... or more --max-rounds")."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch, drops={2: 3.0})
    code, _, err = _main(w, "--budget-kb", "40")
    assert code == 3 and len(err) == 1, err
    loop = w / "compress"
    assert err[0] == (
        "budget not reached: the smallest int8 model within 1 points is 56.8 KB of weights "
        "(round 1), over --budget-kb 40 (round 2 lost 3.00 points, over --max-drop 1, which "
        "ends the loop); pass --max-drop 3 (or more) to accept it and go on from it; for "
        "other rounds (another --step or --epochs: this loop's are --step 0.25 --epochs 3) "
        f"move {loop} away, or pass another --seed (a loop folder of its own); or pass "
        "--budget-kb 56.8 (or more) to take round 1"
    ), err
    # what it does not name does nothing here: more rounds, the same drop, the same stop
    assert _main(w, "--budget-kb", "40", "--max-rounds", "9")[2] == err
    assert _main(w, "--budget-kb", "40", "--epochs", "6")[0] == 2  # the loop's setting
    # what it names: each ends the loop at the budget, or runs another loop
    assert _main(w, "--budget-kb", "56.8")[0] == 0
    assert _main(w, "--budget-kb", "40", "--max-drop", "3")[0] == 0 and len(made) == 3
    code, _, err2 = _main(w, "--budget-kb", "40", "--seed", "8", "--epochs", "6")
    assert code == 3 and len(made) == 6 and (w / "compress_seed8").is_dir(), err2
    # the rounds ran out (round 1 fitted to 60 KB; --max-rounds 1 at 40 KB stops there)
    w = _fake_teacher(tmp_path / "t2")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "60")[0] == 0 and len(made) == 2
    code, _, err = _main(w, "--budget-kb", "40", "--max-rounds", "1")
    assert code == 3 and err == [
        "budget not reached: the smallest int8 model within 1 points is 59.9 KB of weights "
        "(round 1), over --budget-kb 40 (round 1 was the last that --max-rounds 1 allows); "
        "pass --max-rounds 2 (or more) to go on from it; or pass --budget-kb 60 (or more) "
        "to take round 1"
    ], err
    assert _main(w, "--budget-kb", "40", "--max-rounds", "2")[0] == 0 and len(made) == 3
    # round 0, the teacher in int8, past the drop: --max-drop, or another --calibration
    w = _fake_teacher(tmp_path / "t3")
    made = _fake_rounds(monkeypatch, drops={0: 2.0})
    code, _, err = _main(w, "--budget-kb", "40")
    assert code == 3 and made == [(0, 1.0)], (made, err)
    assert err == [
        "budget not reached: no int8 model within 1 points (round 0 lost 2.00 points, over "
        "--max-drop 1, which ends the loop); pass --max-drop 2 (or more), or another "
        f"--calibration with {w / 'compress'} moved away (or another --seed)"
    ], err
    assert _main(w, "--budget-kb", "40", "--max-drop", "2")[0] == 0


def test_the_result_says_which_images_chose_and_measured_it(tmp_path, monkeypatch):
    """The drop that chose the round and the top-1 reported are on the same eval images
    (the test split): the result says so, with their count and top-1's binomial standard
    error in points (0.9 over 360 images: 1.58), also for a row from before the key (its
    quantize report's count). Planted bug that fails it: the line without them."""
    from hybridpar.tools import compress

    w = _fake_teacher(tmp_path / "t")
    _fake_rounds(monkeypatch)
    code, out, _ = _main(w, "--budget-kb", "40")
    assert code == 0
    assert out[-1].startswith("kb_int8=39.9 top1_drop=0.00 top1_se=1.58 top1=0.9000 "), out[-1]
    assert " eval_images=360 chosen_on=test measured_on=test budget_kb=40 " in out[-1], out[-1]
    chosen = [x for x in out if x.startswith("smallest within")]
    assert chosen[0].startswith(
        "smallest within 1 points on the test split's 360 images, which chose it and "
        "measured it (one image 0.28 points, top-1's standard error 1.58 points): round 2 "
    ), chosen
    rd = tmp_path / "old" / "quantized"
    rd.mkdir(parents=True)
    (rd / "report.json").write_text(json.dumps({"eval": {"int8": {"examples": 100}}}))
    old = {"top1": 0.5, "exported": str(rd / "model.jax_exported")}
    assert compress.eval_images(old) == 100 and compress.top1_se(old["top1"], 100) == 5.0
    assert compress.eval_images({**old, "exported": str(tmp_path / "none" / "m")}) is None
    assert compress.top1_se(old["top1"], None) is None


def test_the_results_paths_hold_from_any_working_directory(tmp_path, monkeypatch):
    """A loop made with a relative --workdir, then continued from another working
    directory with the absolute one: result.json keeps absolute paths, and what the second
    call prints and prunes from are paths that exist from where it runs, also for a
    result.json written before they were absolute (relative to the first call's working
    directory). Planted bug that fails it: the paths as the first call built them. Each
    result.json carries the class names in label order, as its quantize report has them."""
    (tmp_path / "a").mkdir()
    w = _fake_teacher(tmp_path / "a" / "t")
    previous = []
    made = _fake_rounds(monkeypatch, previous=previous)
    monkeypatch.chdir(tmp_path / "a")
    assert _main("t", "--budget-kb", "60")[0] == 0 and len(made) == 2, made
    root = w / "compress"
    rows = [json.loads((root / f"round_0{i}" / "result.json").read_text()) for i in (0, 1)]
    assert rows[1]["exported"] == str(root / "round_01" / "quantized" / "model.jax_exported")
    assert rows[0]["run"] == str(w) and rows[1]["run"] == str(root / "round_01" / "run")
    assert rows[1]["classes"] == [str(i) for i in range(10)], rows[1]
    for i, row in enumerate(rows):  # as a result.json from before: the first call's cwd's
        row.update(exported=os.path.relpath(row["exported"]), run=os.path.relpath(row["run"]))
        (root / f"round_0{i}" / "result.json").write_text(json.dumps(row))
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = _main(w, "--budget-kb", "40")
    assert code == 0 and made[2:] == [(2, 0.628)], (made, err)
    assert previous[-1] == str(root / "round_01" / "run"), previous  # round 1's run, from here
    chosen = [x for x in out if x.startswith("smallest within")]
    model = root / "round_02" / "quantized" / "model.jax_exported"
    assert chosen[0].endswith(f"int8 model {model}, LiteRT file {model.parent / 'model.tflite'}")
    code, again, _ = _main(w, "--budget-kb", "40")  # every row read back: the same paths
    assert code == 0 and len(made) == 3 and again[-2:] == out[-2:], (again, out)


def test_a_round_an_earlier_call_stopped_counts_both_calls_time(tmp_path, monkeypatch):
    """Round 1's distillation ran 50 s in a call that was stopped (its run's records); the
    call that finishes it counts them in the round's seconds and the loop's total. Planted
    bug that fails it: this call's time alone."""
    w = _fake_teacher(tmp_path / "t")
    _fake_rounds(monkeypatch)
    run = w / "compress" / "round_01" / "run"
    run.mkdir(parents=True)
    lines = [{"event": "data", "step": 0, "epoch": 0.0, "wall_s": 3.0},
             {"event": "train", "step": 5, "epoch": 0.2, "wall_s": 50.0, "loss": 1.0}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = _main(w, "--budget-kb", "60")
    assert code == 0, out
    rows = [json.loads((w / "compress" / f"round_0{i}" / "result.json").read_text())
            for i in (0, 1)]  # fmt: skip
    assert rows[0]["seconds"] < 50 <= rows[1]["seconds"] < 60, rows
    assert any(" rounds took 50s in all, every call's " in x for x in out), out


def test_the_loop_runs_without_matplotlib(tmp_path, monkeypatch):
    """No matplotlib: the rounds, the table and the result as with it; a warning line says
    the front was not drawn and how to get it, and an earlier call's front.png, of other
    rows, is removed. Planted bug that fails it: matplotlib required before any round."""
    from hybridpar.tools import compress

    w = _fake_teacher(tmp_path / "t")
    real_plot = compress.plot
    made = _fake_rounds(monkeypatch)
    drawn = []
    monkeypatch.setattr(compress, "plot", lambda *a: drawn.append(a[4]))
    code, out, _ = _main(w, "--budget-kb", "60")
    assert code == 0 and drawn == [str(w / "compress" / "front.png")], out
    (w / "compress" / "front.png").write_bytes(b"an earlier front")
    monkeypatch.setattr(compress, "plot", real_plot)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    code, out2, err = _main(w, "--budget-kb", "40")
    assert code == 0 and len(made) == 3 and out2[-1].startswith("kb_int8=39.9 "), (out2, err)
    warning = [x for x in out2 if x.startswith("warning:")]
    assert warning == [
        f"warning: {w / 'compress'}/front.png not drawn (drawing a PNG needs matplotlib: pip "
        'install -e ".[plot]"); the rounds and the result are complete without it'
    ], out2
    assert not (w / "compress" / "front.png").exists()
    assert (w / "compress" / "rounds.md").read_text().count("\n| ") == 3


def test_a_budget_the_rounds_cannot_reach_is_refused_before_any_round(tmp_path, monkeypatch):
    """--step 0.25 and --max-rounds 8 prune to 0.75^8 = 0.100 at the most: 1,502 bytes of
    the stand-in's weights, over 1 KB though its floor (one channel per group, 500 bytes) is
    under it. Refused with the fewest rounds (10: 0.056) and the least step (0.29: 0.71^8)
    that reach it, and no round made. Planted bug that fails it: the floor check alone."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    code, out, err = _main(w, "--budget-kb", "1")
    assert code == 2 and made == [] and not (w / "compress").exists(), (out, err)
    assert err == ["error: --budget-kb 1 --budget-of weights: --step 0.25 and --max-rounds 8 "
                   "prune to at most 0.100 of the teacher's channels, whose int8 weights weigh "
                   "1.5 KB; pass --max-rounds 10 (or more), or --step 0.29 (or more), or a "
                   "larger --budget-kb"], err  # fmt: skip
    assert _fake_bytes(0.75**9) > 1000 >= _fake_bytes(0.75**10)
    assert _fake_bytes(0.72**8) > 1000 >= _fake_bytes(0.71**8)
    # a file budget the same way: the bound at 0.100 is its weights and the overhead
    code, out, err = _main(w, "--budget-kb", "11", "--budget-of", "file")
    assert code == 2 and made == [] and "whose file may weigh 11.5 KB" in err[0], err
    # one round allowed: what the loop reaches at round 1 is over the budget, said at once
    code, out, err = _main(w, "--budget-kb", "40", "--max-rounds", "1")
    assert code == 2 and made == [] and "--max-rounds 2 (or more)" in err[0], err
    # what the suggestions name is reached: the loop runs, and stops at the budget
    assert _main(w, "--budget-kb", "1", "--max-rounds", "10")[0] == 0 and made[-1][0] == 10


def test_a_continued_loop_is_refused_from_where_it_goes_on(tmp_path, monkeypatch):
    """A loop whose round 2 was fitted to 40 KB (0.628, above the step's 0.5625) goes on
    from there: with --max-rounds 8 it reaches 0.628 x 0.75^6 = 0.112 (1,749 bytes), not
    the 0.100 (1,502 bytes) of a new loop, so a 1.61 KB budget is refused for it (naming
    9 rounds, not --step: the loop's is set) while a new loop takes it. Planted bug that
    fails it: the rule applied from round 0 (1 - step)^max_rounds whatever is on disk."""
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "40")[0] == 0 and made[-1] == (2, 0.628), made
    code, out, err = _main(w, "--budget-kb", "1.61")
    assert code == 2 and len(made) == 3, (made, out, err)
    assert err == ["error: --budget-kb 1.61 --budget-of weights: this loop goes on from round "
                   "2 at 0.628 of the teacher's channels, and --step 0.25 up to --max-rounds 8 "
                   "prunes to at most 0.112, whose int8 weights weigh 1.7 KB; pass --max-rounds "
                   "9 (or more), or a larger --budget-kb"], err  # fmt: skip
    other = _fake_teacher(tmp_path / "new")  # a new loop: 0.100 fits 1.61 KB
    assert _main(other, "--budget-kb", "1.61")[0] == 0 and made[-1][0] == 8, made
    # a round pruned and stopped goes on from its pruned fraction: 0.2 at round 3 reaches
    # 0.2 x 0.75^5 = 0.047 (722 bytes) by round 8, where round 2's row alone says 0.112:
    # taken, and the loop goes on from it
    rd = w / "compress" / "round_03"
    (rd / "pruned").mkdir(parents=True)
    (rd / "pruned" / "pruned.json").write_text(json.dumps({"keep_fraction": 0.2}))
    code, out, err = _main(w, "--budget-kb", "1.61")
    assert code == 0 and (3, 0.2) in made and made[-1][0] > 3, (made, err)


def test_a_loop_of_another_teacher_step_is_not_reused(tmp_path, monkeypatch):
    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "40")[0] == 0 and len(made) == 3
    # the run trained on (a config change resumed it): the rounds were made from step 40
    (w / "checkpoints" / "80").mkdir()
    code, out, err = _main(w, "--budget-kb", "40")
    assert code == 2 and len(made) == 3, (out, err)
    assert len(err) == 1 and err[0].startswith("error: ") and "at step 40" in err[0], err
    assert "latest is step 80" in err[0], err
    # a loop from before settings.json named the teacher's step: round 0's report tells it
    settings = w / "compress" / "settings.json"
    old = json.loads(settings.read_text())
    del old["teacher_step"]
    settings.write_text(json.dumps(old))
    q = w / "compress" / "round_00" / "quantized"
    q.mkdir()
    (q / "report.json").write_text(json.dumps({"step": FAKE_STEP}))
    code, _, err = _main(w, "--budget-kb", "40")
    assert code == 2 and len(made) == 3 and "at step 40" in err[0], err


@pytest.mark.parametrize("state", ["training", "training-no-checkpoint", "no-summary", "stopped",
                                   "pruned", "pruned-old"])  # fmt: skip
def test_a_teacher_not_finished_is_refused(tmp_path, monkeypatch, state):
    from hybridpar.runtime import workdir_lock

    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    lock = None
    if state.startswith("training"):  # a trainer holds the workdir (its summary: the last
        lock = workdir_lock.acquire(str(w))  # segment's)
        if state == "training-no-checkpoint":  # before its first: not "train it first"
            (w / "checkpoints" / str(FAKE_STEP)).rmdir()
    elif state == "no-summary":
        (w / "summary.json").unlink()
    elif state.startswith("pruned"):  # as prune writes a run: a step-0 checkpoint, no records
        (w / "summary.json").unlink()
        (w / "checkpoints" / str(FAKE_STEP)).rename(w / "checkpoints" / "0")
        if state == "pruned":
            (w / prune.RECORD).write_text("{}")
    else:
        (w / "summary.json").write_text(json.dumps(
            {"completed": False, "steps": 12, "total_steps": FAKE_STEP}))  # fmt: skip
    try:
        code, out, err = _main(w, "--budget-kb", "40")
    finally:
        if lock is not None:
            lock.release()
    assert code == 2 and made == [], (out, err)
    pruned = "is a pruned run (python -m hybridpar.prune's, at step 0, never trained)"
    message = {"training": "is still training", "no-summary": "has no summary.json",
               "training-no-checkpoint": "is still training",
               "stopped": "stopped at step 12 of 40", "pruned": pruned,
               "pruned-old": pruned}[state]  # fmt: skip
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert ("resumes it" in err[0]) == (state in ("no-summary", "stopped")), err
    # still training: compress waits for its end, whether or not it has a checkpoint yet
    assert ("once its training has ended" in err[0]) == state.startswith("training"), err
    assert not (w / "compress").exists()


def test_two_loops_on_one_workdir_exclude_each_other(tmp_path, monkeypatch):
    from hybridpar.tools import compress

    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    (w / "compress").mkdir()
    other = compress.lock_loop(str(w / "compress"))  # another compress's, for its whole loop
    try:
        code, out, err = _main(w, "--budget-kb", "40")
    finally:
        other.release()
    assert code == 2 and made == [], (out, err)
    assert len(err) == 1 and "in use by another compress" in err[0], err
    assert not (w / "compress" / "settings.json").exists()
    assert _main(w, "--budget-kb", "40")[0] == 0 and len(made) == 3  # once it has ended


def test_each_seed_has_its_own_loop_and_distils_with_that_seed(tmp_path, monkeypatch):
    """``--seed N``: the rounds in W/compress_seedN (never mixed with the teacher-seed loop
    in W/compress, nor with the --init scratch loop in W/compress_scratch), and the
    distillation config carries the seed."""
    from hybridpar.tools import compress

    w = _fake_teacher(tmp_path / "t")
    made = _fake_rounds(monkeypatch)
    assert _main(w, "--budget-kb", "40", "--seed", "7")[0] == 0 and len(made) == 3
    assert (w / "compress_seed7" / "round_02" / "result.json").exists()
    assert not (w / "compress").exists()
    assert _main(w, "--budget-kb", "40")[0] == 0 and len(made) == 6  # its own rounds
    assert _main(w, "--budget-kb", "40", "--seed", "7")[0] == 0 and len(made) == 6  # reused
    assert _main(w, "--budget-kb", "40", "--init", "scratch")[0] == 0 and len(made) == 9
    assert (w / "compress_scratch" / "round_02" / "result.json").exists()  # its own loop
    # another alpha beside a seed's loop: its own folder, not a refusal of the seed's
    assert _main(w, "--budget-kb", "40", "--alpha", "0.5", "--seed", "7")[0] == 0
    assert len(made) == 12 and (w / "compress_alpha0.5_seed7" / "round_02").exists()

    teacher = trained.load_config(str(w))
    pruned = tmp_path / "p"
    pruned.mkdir()
    (pruned / "config.json").write_text((w / "config.json").read_text())
    assert compress.round_config(teacher, str(w), str(pruned), 1.0, 7).seed == 7
    assert compress.round_config(teacher, str(w), str(pruned), 1.0).seed == teacher.seed
    # a teacher's checkpoint.dir outside its workdir is its own: each round's run keeps its
    # checkpoints in its workdir, not in the teacher's (planted bug that fails it: kept)
    teacher.checkpoint.dir = str(tmp_path / "ck")
    assert compress.round_config(teacher, str(w), str(pruned), 1.0).checkpoint.dir == ""
    teacher.checkpoint.dir = "ck"  # inside each round's workdir: kept
    assert compress.round_config(teacher, str(w), str(pruned), 1.0).checkpoint.dir == "ck"


@pytest.mark.parametrize("init", ["pruned", "scratch"])
def test_a_scratch_round_starts_from_random_weights_with_the_teachers_curriculum(
    tmp_path, monkeypatch, init
):
    """``--init scratch``: the round's run has the pruned widths but no ``init_from`` and
    the teacher's stages stretched to ``--epochs``, its shape taken from the teacher; the
    default starts from the previous round's pruned weights in one stage. Through
    ``make_round`` (its pruning, trainer and quantizing stood in for), and the loop's
    settings key it: a loop of the other init is not reused."""
    import argparse

    from hybridpar.config.errors import ConfigError
    from hybridpar.runtime import run_config
    from hybridpar.tools import compress, quantize, tune

    w = tmp_path / "t"
    w.mkdir()
    config = tiny_digits(**{**LONGER, "stages": "1:16-32,1.5:16-64", "num_epochs": 1.5})
    (w / "config.json").write_text(json.dumps(run_config.config_dict(config)))
    pruned_from, ran = [], []

    def fake_prune(source, out, keep, **kw):
        pruned_from.append(source)
        os.makedirs(out)
        narrow = tiny_digits(**{**LONGER, "model.num_filters": 3})
        (Path(out) / "config.json").write_text(json.dumps(run_config.config_dict(narrow)))

    monkeypatch.setattr(prune, "prune_run", fake_prune)
    monkeypatch.setattr(tune, "run_trainer", lambda c, d: ran.append(c) or (None, {}))
    monkeypatch.setattr(quantize, "run", lambda *a, **k: {"stand-in": True})
    args = argparse.Namespace(workdir=str(w), budget_kb=100.0, budget_of="weights", step=0.5,
                              epochs=3.0, criterion="l1", seed=None, init=init, alpha=None,
                              calibration_batches=1, calibration="max", percentile=None,
                              repeats=1)  # fmt: skip
    rows = [{"run": str(tmp_path / "round_01_run")}]
    rd = tmp_path / "round_02"
    rd.mkdir()
    compress.make_round(config, args, 2, 0.25, str(rd), rows, {}, lambda *a: None)
    (c,) = ran
    assert c.model.num_filters == 3 and c.num_epochs == 3.0
    assert c.distill.teacher_workdir == str(w) and c.distill.alpha == config.distill.alpha
    # --alpha: the teacher's share of every round's loss
    assert (
        compress.round_config(config, str(w), str(rd / "pruned"), 3.0, alpha=0.25).distill.alpha
        == 0.25
    )
    if init == "scratch":
        assert c.init_from == "" and c.stages == "2:16-32,3:16-64"
        assert pruned_from == [str(w)]  # the shape at 0.25 of the teacher's channels
    else:
        assert c.init_from == str(rd / "pruned") and c.stages == ""
        assert pruned_from == [rows[-1]["run"]]

    loop = w / {"pruned": "compress", "scratch": "compress_scratch"}[init]
    assert compress.loop_root(args) == str(loop)  # each init's rounds apart
    loop.mkdir()
    saved = {k: getattr(args, k) for k in compress.SETTINGS}
    (loop / "settings.json").write_text(json.dumps(saved))
    compress.check_settings(args)  # the same loop
    args.alpha = 0.5  # another alpha: a loop folder of its own, nothing refused
    assert compress.loop_root(args) == str(loop) + "_alpha0.5"
    compress.check_settings(args)
    args.alpha = None
    (loop / "settings.json").write_text(json.dumps({**saved, "alpha": 0.5}))  # made by hand
    with pytest.raises(ConfigError, match="holds a loop with --alpha=0.5 .not None."):
        compress.check_settings(args)
    saved["init"] = {"pruned": "scratch", "scratch": "pruned"}[init]  # made by hand
    (loop / "settings.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=f"--init={saved['init']}"):
        compress.check_settings(args)


# ---- a tiny trained teacher ----------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits run trained in-process on one device, and its 50%-pruned copy."""
    root = tmp_path_factory.mktemp("compress")
    t = root / "teacher"
    one = jax.devices()[:1]
    # a train line every step: the loop's rounds inherit it, and the SIGTERM test waits for one
    config = tiny_digits(**{**LONGER, "log_every_s": 0.0})
    trainer.train(run.setup(config, str(t), devices=one))
    from hybridpar.parallel.mesh import make_mesh

    r = prune.prune_run(str(t), str(root / "pruned"), 0.5, mesh=make_mesh("data:1", devices=one))
    return t, root / "pruned", r


def test_pruned_run_trains_and_evaluates_through_the_clis(teacher, tmp_path, capsys,
                                                          monkeypatch):  # fmt: skip
    import shlex
    import shutil

    from hybridpar.config import cli
    from hybridpar.runtime import run_config, workdir_lock

    # the teacher as a run stopped before its end (its summary says so): pruned with a
    # warning that names the step read and the run's steps, recorded in pruned.json
    t = tmp_path / "t"
    shutil.copytree(teacher[0], t)
    (t / "summary.json").write_text(json.dumps(
        {"completed": False, "steps": 66, "total_steps": 132}))  # fmt: skip
    env = CLI_ENV
    p = tmp_path / "p"
    # prune's command in this process (a subprocess would only add JAX's start): a relative
    # --out (orbax refused one: "should be absolute")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    prune.main(["--workdir", str(t), "--out", "p", "--fraction", "0.5"])
    out = capsys.readouterr()
    warning = [x for x in out.out.splitlines() if x.startswith("warning:")]
    assert warning == [
        f"warning: the run in {str(t)!r} stopped at step 66 of 132: pruned its "
        "checkpoint at step 66 of the run's 132 steps, not a finished model"
    ], out
    record = json.loads((p / prune.RECORD).read_text())
    assert record["source"] == str(t) and record["source_step"] == 66, record
    assert record["source_unfinished"]["why"] == "stopped at step 66 of 132", record
    widths = json.loads((p / "config.json").read_text())["model"]
    assert widths["stage_widths"] == [4, 8, 16, 32] and widths["stem_width"] == 4
    # the train command it prints: the pruned run's config.json as its config (every key,
    # the run's own overrides too, not the widths alone; a command of the keys that differ
    # from the defaults lost those the run's file sets otherwise), started from its weights
    lines = out.out.splitlines()
    said = lines.index(next(x for x in lines if x.startswith("wrote p: ")))
    assert "train it with its config (the run's, with the narrower widths" in lines[said], lines
    command = shlex.split(lines[said + 1])
    where = os.path.abspath("p")  # (the command is pasted anywhere: absolute paths)
    assert command == ["python", "-m", "hybridpar.train", "--config", f"{where}/config.json",
                       "--workdir", "NEW_DIR", f"--config.init_from={where}"], command  # fmt: skip
    c = cli.load(command[4], [("init_from", where)])
    saved = json.loads((p / "config.json").read_text())
    assert run_config.differences(saved, run_config.config_dict(c)) == [
        ("init_from", "", where)]  # fmt: skip
    # a run still training (no summary yet): the warning names the run's steps too, from
    # its records (planted bug that fails it: the summary's alone)
    (t / "summary.json").unlink()
    lock = workdir_lock.acquire(str(t))
    try:
        prune.main(["--workdir", str(t), "--out", "p2", "--fraction", "0.5"])
    finally:
        lock.release()
    warning = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert len(warning) == 1 and " is still training (pid " in warning[0], warning
    assert warning[0].endswith("pruned its checkpoint at step 66 of the run's 66 steps, not a "
                               "finished model"), warning  # fmt: skip
    # ... and the command trains: shortened to 0.5 epochs, in a new folder
    w = tmp_path / "s"
    argv = [str(w) if a == "NEW_DIR" else a for a in command[3:]]
    ok = subprocess.run([sys.executable, "-m", "hybridpar.train", *argv,
                         "--config.num_epochs=0.5"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    monkeypatch.undo()
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "done: top1" in ok.stdout, ok.stdout[-2000:]
    # said, or nothing shows the weights were read (planted: no line fails it)
    said = f"started from the weights of {where} (its checkpoint at step 0; init_from)"
    assert said in ok.stdout.splitlines(), ok.stdout[-2000:]
    summary = json.loads((w / "summary.json").read_text())
    assert summary["completed"] and summary["final_eval"]["examples"] == 360
    # (that init_from starts from the weights: the teacher-as-student test below)
    assert summary["final_eval"]["top1"] > 0.15, summary["final_eval"]  # chance: 0.1
    # negative control: the teacher's widths cannot start from the pruned weights. In this
    # process (a train process more would start JAX again for one error): a new state of
    # the teacher's widths started from init_from, as the trainer starts it; the train CLI
    # writes any such ConfigError as its one error: line (test_train_cli).
    from hybridpar.config.errors import ConfigError
    from hybridpar.program.state import init_sharded

    c = tiny_digits(**{**LONGER, "num_epochs": 0.5})  # the teacher's widths
    r = run.setup(c, None, devices=jax.devices()[:1])
    state = init_sharded(r.program.init, r.program.shardings, jax.random.key(c.seed))
    with pytest.raises(ConfigError, match=r"^init_from="):
        trained.start_from(str(p), state, r.program)


def test_a_pruned_runs_checkpoints_are_its_own_where_the_source_kept_them_elsewhere():
    """A source trained with ``--config.checkpoint.dir=/elsewhere``: the pruned run's
    config.json kept that dir, so evaluate, quantize and init_from read the source's
    checkpoints for the pruned run's ('holds a run of another config: model.stem_width was
    8'). Its checkpoint is in its own folder; its config says so. Planted bug that fails
    it: the dir left as the source's."""
    c = tiny_digits(**{"checkpoint.dir": "/elsewhere/ckpts"})
    pruned = prune.pruned_config(c, {"stem_width": 4})
    assert pruned.checkpoint.dir == "" and pruned.model.stem_width == 4
    assert c.checkpoint.dir == "/elsewhere/ckpts"  # the source's config as it was


def test_prune_help_says_fraction_is_the_share_removed(capsys):
    with pytest.raises(SystemExit) as e:
        prune.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "Remove --fraction of the channels" in out, out
    assert "keeping --fraction" not in out, out


def test_prune_out_inside_the_source_run_is_refused(tmp_path, capsys):
    w = _fake_teacher(tmp_path / "t")
    for out in (w / "pruned", w):
        with pytest.raises(SystemExit) as e:
            prune.main(["--workdir", str(w), "--out", str(out), "--fraction", "0.5"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --out "), err
        assert "is inside --workdir" in err[0] and not (w / "pruned").exists(), err


def _stubbed_round(tmp_path, monkeypatch, epochs: float = 3.0):
    """``(line, rd)``: ``line()`` runs round 1's ``make_round`` (its pruning, trainer and
    quantizing stood in for) and returns the line it said; ``rd``: the round's folder."""
    import argparse

    from hybridpar.tools import compress, quantize, tune

    w = tmp_path / "t"
    w.mkdir()
    config = tiny_digits(**LONGER)
    monkeypatch.setattr(prune, "prune_run", lambda *a, **k: None)
    monkeypatch.setattr(tune, "run_trainer", lambda c, d: (None, {}))
    monkeypatch.setattr(quantize, "run", lambda *a, **k: {})
    monkeypatch.setattr(compress, "round_config", lambda *a: config)
    args = argparse.Namespace(workdir=str(w), budget_kb=100.0, budget_of="weights", step=0.5,
                              epochs=epochs, criterion="l1", seed=None, init="pruned",
                              alpha=None, calibration_batches=1, calibration="max",
                              percentile=None, repeats=1)  # fmt: skip
    rd, lines = tmp_path / "round_01", []
    rd.mkdir()

    def line():
        compress.make_round(config, args, 1, 0.5, str(rd), [{"run": str(w), "keep": 1.0}], {},
                            lines.append)  # fmt: skip
        return lines[-1]

    return line, rd


def test_a_resumed_round_says_what_it_does(tmp_path, monkeypatch):
    """A round an earlier call pruned (and distilled): its line says it resumes the
    distillation, or only quantizes it, not that it prunes and distils."""
    line, rd = _stubbed_round(tmp_path, monkeypatch)
    assert line().startswith("round 1: pruning to 0.500 of the teacher's channels, then 3 ")
    (rd / "pruned").mkdir()
    (rd / "run").mkdir()  # stopped before its first checkpoint: the trainer starts at step 0
    # (planted bug that fails it: a run/ folder taken for a run to resume)
    assert line().startswith("round 1: distilling from step 0 the model an earlier call "
                             "pruned to 0.500 of the teacher's channels (3 epochs ")
    (rd / "run" / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir(parents=True)
    assert line().startswith("round 1: distilling from step 0 ")  # not committed
    (rd / "run" / "checkpoints" / "5").mkdir()
    assert line().startswith("round 1: resuming its distillation run (pruned to 0.500 ")
    (rd / "run" / "summary.json").write_text(json.dumps({"completed": True}))
    assert line() == ("round 1: its distillation run finished in an earlier call (pruned to "
                      "0.500 of the teacher's channels); quantizing it")  # fmt: skip


@pytest.mark.parametrize("epochs,said",
                         [(1.0, "1 epoch "), (1.5, "1.5 epochs "), (3.0, "3 epochs ")])
def test_a_rounds_line_counts_its_epochs_in_words(tmp_path, monkeypatch, epochs, said):
    """``--epochs 1`` printed "1 epochs of distillation". Each of the round's lines (a new
    round, one from step 0, one resumed)."""
    line, rd = _stubbed_round(tmp_path, monkeypatch, epochs)
    lines = [line()]
    for then in ("pruned", "run/checkpoints/5"):  # from step 0 after the first, then resumed
        (rd / then).mkdir(parents=True, exist_ok=True)
        lines.append(line())
    assert [said in x for x in lines] == [True] * 3, lines


# ---- distillation --------------------------------------------------------------------------


def test_distill_loss_is_the_cross_entropy_when_student_is_teacher():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 10)) * 3, jnp.float32)
    ce = jnp.arange(4, dtype=jnp.float32)
    got = distill.loss(ce, logits, logits, 4.0, 0.75)
    np.testing.assert_allclose(got, 0.25 * ce, atol=1e-5)
    grad = jax.grad(lambda s: distill.loss(ce, s, logits, 4.0, 0.75).sum())(logits)
    assert np.abs(grad).max() < 1e-5
    # negative control: another student
    assert np.abs(distill.loss(ce, logits[::-1], logits, 4.0, 0.75) - 0.25 * ce).max() > 0.1


def _one_step(config, devices, batch):
    """The first train step's loss and parameters, from ``config``'s ``init_from``."""
    r = run.setup(config, None, devices=devices)
    p = r.program
    from hybridpar.program.state import init_sharded

    state = init_sharded(p.init, p.shardings, jax.random.key(config.seed))
    if config.init_from:
        state = trained.start_from(config.init_from, state, p)
    step = p.train_step(config.global_batch)
    state, metrics = step(state, partitioning.shard_batch(batch, r.mesh))
    return float(metrics["loss"]), jax.device_get(meta.unbox(state.params))


def _batch(config):
    # not for training: the data alone, no teacher read for a batch
    r = run.setup(config, None, devices=jax.devices()[:1], for_training=False)
    return next(iter(r.data.train_batches(0)))


def _softmax64(z, t):
    z = np.asarray(z, np.float64) / t
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _distill_loss64(ce, student, teacher_logits, t, alpha):
    """Hinton et al.'s loss per example, in float64: ``(1 - alpha) ce + alpha T^2 KL``."""
    ps, pt = _softmax64(student, t), _softmax64(teacher_logits, t)
    kl = (pt * (np.log(pt) - np.log(ps))).sum(-1)
    return (1 - alpha) * np.asarray(ce, np.float64) + alpha * t * t * kl


@pytest.mark.parametrize("t", [1.0, 2.0, 4.0])
def test_distill_loss_and_its_gradient_are_hintons(t):
    rng = np.random.default_rng(0)
    s, te = (rng.normal(size=(2, 4, 10)) * 3).astype(np.float32)
    ce = rng.uniform(0.5, 2.0, size=4).astype(np.float32)
    alpha = 0.7
    want = _distill_loss64(ce, s, te, t, alpha)
    soft = want - (1 - alpha) * ce
    assert soft.min() > 0.05 * want.max()  # the KL term weighs in every example
    # float32 softmaxes of logits of a few units: a few hundred eps of the loss
    tol = 300 * EPS32 * np.abs(want).max()
    got = np.asarray(distill.loss(ce, s, te, t, alpha), np.float64)
    assert np.abs(got - want).max() <= tol, (got, want)
    # the gradient in the student's logits: alpha * T * (p_student - p_teacher); the T^2
    # keeps it on the hard term's scale whatever T
    grad = jax.grad(lambda x: distill.loss(ce, x, te, t, alpha).sum())(s)
    want_grad = alpha * t * (_softmax64(s, t) - _softmax64(te, t))
    assert np.abs(np.asarray(grad) - want_grad).max() <= 300 * EPS32 * np.abs(want_grad).max()


def test_the_teacher_runs_in_inference_mode(teacher):
    """The teacher's logits are its model's at inference (running BatchNorm statistics),
    and the train step's loss is Hinton's on them; the teacher as its own student, so that a
    teacher in train mode (the batch's statistics, the student's own logits) would hide
    behind a KL of 0."""
    from hybridpar.program import steps

    t, _, _ = teacher
    one = jax.devices()[:1]
    c = tiny_digits(**LONGER)
    c.init_from = c.distill.teacher_workdir = str(t)
    c.distill.alpha = 0.5
    batch = _batch(c)
    r = run.setup(c, None, devices=one)
    x = steps.normalize(batch["image"], c.data.mean, c.data.std, np.float32)
    model, teach = r.program.model, distill.Teacher(c, r.mesh)
    variables = jax.device_get(meta.unbox(teach.variables()))
    inference = np.asarray(model.apply(variables, x, train=False), np.float64)
    train_mode = np.asarray(model.apply(variables, x, train=True, mutable=["batch_stats"])[0],
                            np.float64)  # fmt: skip
    tol = 100 * EPS32 * np.abs(inference).max()
    got = np.asarray(teach.logits(teach.variables(), x), np.float64)
    assert np.abs(got - inference).max() <= tol, np.abs(got - inference).max()
    assert np.abs(train_mode - inference).max() > 1000 * tol  # the two modes differ here
    # the step: its student (the teacher's weights at step 0) in train mode, its teacher not
    loss, _ = _one_step(c, one, batch)
    ce = np.asarray(steps.cross_entropy(train_mode, batch["label"], c.label_smoothing))
    d = c.distill
    want = _distill_loss64(ce, train_mode, inference, d.temperature, d.alpha).mean()
    hard = (1 - d.alpha) * ce.mean()  # what a teacher in train mode would leave
    step_tol = 1e-4 * abs(want)  # one jitted forward against another: float32 roundings
    assert abs(loss - want) <= step_tol, (loss, want, hard)
    assert want - hard > 20 * step_tol, (want, hard)  # the KL term is well above that


def test_distillation_on_8_devices_is_one_device(teacher):
    t, pruned, _ = teacher
    widths = json.loads((pruned / "config.json").read_text())["model"]

    def config(mesh, alpha=0.9):
        c = tiny_digits(mesh=mesh, **{k: v for k, v in LONGER.items() if k != "mesh"})
        c.model.update(stem_width=widths["stem_width"],
                       stage_widths=tuple(widths["stage_widths"]),
                       block_widths=tuple(widths["block_widths"]))  # fmt: skip
        c.init_from, c.distill.teacher_workdir, c.distill.alpha = str(pruned), str(t), alpha
        c.optim.warmup_epochs = 0.0  # the first step at LR 0 would change no parameter
        return c

    batch = _batch(config("data:1"))
    loss1, params1 = _one_step(config("data:1"), jax.devices()[:1], batch)
    loss8, params8 = _one_step(config("data:4,model:2"), jax.devices(), batch)
    diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(params1),
                                                   jax.tree.leaves(params8)))  # fmt: skip
    assert abs(loss8 - loss1) <= 1e-5 * abs(loss1) and diff <= 1e-5, (loss1, loss8, diff)
    # negative control: another mix of the two losses, which the same check must tell
    # apart (on one device: a second 8-device compile would show no more)
    loss_b, params_b = _one_step(config("data:1", alpha=0.8), jax.devices()[:1], batch)
    bad = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(params1),
                                                  jax.tree.leaves(params_b)))  # fmt: skip
    assert abs(loss_b - loss1) > 1e-3 * abs(loss1) and bad > 100 * max(diff, 1e-7)


# ---- the loop ------------------------------------------------------------------------------


def _compress(teacher_dir, *extra):
    return [sys.executable, "-m", "hybridpar.compress", "--workdir", str(teacher_dir),
            "--budget-kb", "1", "--step", "0.5", "--epochs", "4", "--max-rounds", "1",
            "--calibration-batches", "2", "--repeats", "1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def file_budget_loop(teacher, tmp_path_factory):
    """One loop on a copy of the tiny teacher, read by the two tests below (each loop is
    a teacher quantized, a round distilled, quantized and converted, in fresh processes):
    ``--budget-of file``, the budget halfway between the teacher's files at 0.5 and all of
    its channels, stopped by SIGTERM at round 1's first train line, then the same command
    again. ``(workdir, budget, first call's (returncode, stdout, stderr), second call)``."""
    import shutil

    from hybridpar.tools import compress

    root = tmp_path_factory.mktemp("loop")
    t = root / "t"
    shutil.copytree(teacher[0], t)  # the loop writes t/compress/
    _, file_at = compress.teacher_size(str(t), "file")
    budget = (file_at(0.5) + file_at(1.0)) // 2
    cmd = _compress(t, "--budget-kb", f"{budget / 1000}", "--budget-of", "file", "--epochs", "1",
                    "--max-drop", "100")  # fmt: skip
    env = CLI_ENV
    metrics = t / "compress" / "round_01" / "run" / "metrics.jsonl"
    log = open(root / "first.err", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log,
                         text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if metrics.exists() and '"event": "train"' in metrics.read_text():
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        out, _ = p.communicate(timeout=240)
    finally:
        p.kill()
        log.close()
    first = (p.returncode, out, (root / "first.err").read_text())
    done_after_first = (t / "compress" / "round_01" / "result.json").exists()
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    return t, budget, first, done_after_first, again


def test_loop_resumes_a_round_stopped_by_sigterm(file_budget_loop, tmp_path, capsys):
    from hybridpar.runtime import evaluator, trained
    from hybridpar.tools import compress, quantize

    t, _, (code, out, err), done_after_first, again = file_budget_loop
    assert code == 0, err[-3000:]
    assert "the same command continues" in out, out
    assert not done_after_first
    assert again.returncode == 0, again.stderr[-3000:]
    assert " of file reached); " in again.stdout, again.stdout
    metrics = t / "compress" / "round_01" / "run" / "metrics.jsonl"
    events = [json.loads(x)["event"] for x in metrics.read_text().splitlines()]
    assert "resume" in events, events  # the round's run went on from its checkpoint
    # the round's seconds count both calls' training: at least its run's wall time, which
    # goes on over the starts (the stopped one's part of it, from_wall_s, in it); a sanity
    # check on real records (test_a_round_an_earlier_call_stopped_counts_both_calls_time
    # holds the sum itself: here this call's quantize alone may outlast the first call)
    first_s = next(json.loads(x)["from_wall_s"] for x in metrics.read_text().splitlines()
                   if json.loads(x)["event"] == "resume")  # fmt: skip
    row = json.loads((t / "compress" / "round_01" / "result.json").read_text())
    run_s = json.loads((t / "compress" / "round_01" / "run" / "summary.json").read_text())
    assert row["seconds"] >= run_s["wall_s"] > first_s > 0, (row, run_s["wall_s"], first_s)
    last = again.stdout.strip().splitlines()[-1]
    assert last.startswith("kb_int8=") and " top1_drop=" in last and " flops=" in last, last
    rows = [json.loads((t / "compress" / f"round_0{i}" / "result.json").read_text())
            for i in (0, 1)]  # fmt: skip
    assert rows[1]["params"] < rows[0]["params"]
    # each round names the teacher's checkpoint it was made from
    step = compress.teacher_step(trained.load_config(str(t)), str(t))
    assert [r["teacher_step"] for r in rows] == [step, step] and last.endswith(f"={step}")
    # the int8 sizes the loop plans weight budgets with are the ones quantize wrote, to the
    # byte
    _, bytes_at = compress.teacher_size(str(t))
    assert [r["bytes_int8"] for r in rows] == [bytes_at(1.0), bytes_at(rows[1]["keep"])]
    assert (t / "compress" / "front.png").exists() and (t / "compress" / "rounds.md").exists()
    # The round's distilled run is evaluated and quantized without its teacher (moved away
    # with it: the run's config still names the old path), by what the two commands call
    # (in this process, on one device: a subprocess would add JAX's and TensorFlow's start,
    # and the converter's own calibration reads the same batches), and the loop put back for
    # the other test.
    moved = tmp_path / "moved"
    t.rename(moved)
    try:
        student = moved / "compress" / "round_01" / "run"
        assert json.loads((student / "config.json").read_text())["distill"]["teacher_workdir"]
        one = jax.devices()[:1]
        events = evaluator.run(None, str(student), devices=one)
        assert events and all(e["examples"] == 360 for e in events), events
        capsys.readouterr()
        quantize.run(trained.load_config(str(student)), str(student), repeats=1, devices=one,
                     litert_calibrated=False)  # fmt: skip
        out = capsys.readouterr().out
        assert " top1_int8=" in out.strip().splitlines()[-1], out[-2000:]  # its last line
    finally:
        moved.rename(t)


def test_a_file_budget_round_writes_a_file_within_it(file_budget_loop):
    """``--budget-of file`` on the tiny teacher, the budget halfway between its files at
    0.5 and all of its channels: round 1 prunes to the largest fraction whose predicted file
    fits, and the real ``model.tflite`` it distils, calibrates and converts is within the
    budget (a prediction under the real file, as the weights alone would make, fails)."""
    t, budget, _, _, r = file_budget_loop
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert " budget_of=file " in last, last
    row = json.loads((t / "compress" / "round_01" / "result.json").read_text())
    size = (t / "compress" / "round_01" / "quantized" / "model.tflite").stat().st_size
    assert 0.5 < row["keep"] < 1 and row["budget_of"] == "file", row
    assert row["file_bytes"] == size <= row["planned_bytes"] <= budget, (size, row, budget)
    assert f" file_kb={size / 1000:.1f} " in last, last


@pytest.mark.parametrize("percentile", [None, 99.5])
def test_percentile_reaches_every_rounds_quantize(tmp_path, monkeypatch, percentile):
    """``--percentile`` (with ``--calibration percentile``) is what each round's quantize
    calibrates with, the teacher's round 0 too; without it, quantize's own default. Through
    ``make_round`` with its pruning, trainer and quantizing stood in for."""
    import argparse

    from hybridpar.runtime import run_config
    from hybridpar.tools import compress, prune, quantize, tune

    w = tmp_path / "t"
    w.mkdir()
    config = tiny_digits(**LONGER)
    (w / "config.json").write_text(json.dumps(run_config.config_dict(config)))
    calls = []
    monkeypatch.setattr(prune, "prune_run", lambda *a, **k: None)
    monkeypatch.setattr(tune, "run_trainer", lambda c, d: (None, {}))
    monkeypatch.setattr(quantize, "run", lambda *a, **k: calls.append(k) or {})
    monkeypatch.setattr(compress, "round_config", lambda *a: config)
    args = argparse.Namespace(workdir=str(w), budget_kb=100.0, budget_of="weights", step=0.5,
                              epochs=3.0, criterion="l1", seed=None, init="pruned", alpha=None,
                              calibration_batches=1, calibration="percentile",
                              percentile=percentile, repeats=1)  # fmt: skip
    for index in (0, 1):
        rd = tmp_path / f"round_{index:02d}"
        rd.mkdir()
        compress.make_round(config, args, index, 0.5, str(rd), [{"run": str(w)}], {},
                            lambda *a: None)  # fmt: skip
    assert [k["calibration"] for k in calls] == ["percentile"] * 2
    assert [k.get("percentile") for k in calls] == [percentile] * 2


def test_a_loop_from_before_the_calibration_flag_continues_with_max(tmp_path):
    import argparse

    from hybridpar.config.errors import ConfigError
    from hybridpar.tools import compress

    (tmp_path / compress.DIR).mkdir()
    old = {"step": 0.25, "epochs": 3.0, "criterion": "l1", "calibration_batches": 8}
    (tmp_path / compress.DIR / "settings.json").write_text(json.dumps(old))
    args = argparse.Namespace(
        workdir=str(tmp_path), **old, calibration="max", seed=None, init="pruned", alpha=None,
        percentile=None,
    )  # a loop from before --init, --alpha and --percentile: pruned, the run's alpha
    compress.check_settings(args)  # the calibration it was made with
    args.calibration = "mse"  # today's default
    with pytest.raises(ConfigError, match="--calibration=max"):
        compress.check_settings(args)


def test_a_scratch_loop_goes_on_whatever_ranking_it_was_saved_with(tmp_path):
    """--criterion is refused with --init scratch (the rounds keep only the pruned shape), so
    a scratch loop saved with --criterion bn must go on without it; a pruned loop must not."""
    import argparse

    from hybridpar.config.errors import ConfigError
    from hybridpar.tools import compress

    saved = {"step": 0.25, "epochs": 3.0, "criterion": "bn", "calibration_batches": 8,
             "calibration": "mse", "alpha": None}  # fmt: skip
    for init in ("scratch", "pruned"):
        args = argparse.Namespace(workdir=str(tmp_path), **{**saved, "criterion": "l1"},
                                  seed=None, init=init, percentile=None)  # fmt: skip
        os.makedirs(compress.loop_root(args))
        path = os.path.join(compress.loop_root(args), "settings.json")
        with open(path, "w") as f:
            json.dump({**saved, "init": init}, f)
        if init == "scratch":
            compress.check_settings(args)
        else:
            with pytest.raises(ConfigError, match="--criterion=bn"):
                compress.check_settings(args)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--budget-kb", "0"], "--budget-kb K > 0"),
        (["--step", "1.5"], "--step=1.5 must be in (0, 1)"),
        (["--max-drop", "-1"], "--max-drop=-1.0 must be >= 0"),
        (["--alpha", "1.5"], "--alpha=1.5 must be in [0, 1]"),
        (["--calibration", "percentile", "--percentile", "0"], "--percentile=0 is in (0, 100]"),
        (["--percentile", "99.9"], "--percentile is not used with --calibration mse; pass "
         "--calibration percentile with it, or drop it"),
        (["--epochs", "2"], "holds a loop with --epochs=4"),
        ([], "config.json: pass the --workdir of a training run"),
        ([], "no checkpoint"),
        # a flag another makes moot is refused, not silently unused
        (["--init", "scratch", "--criterion", "l1"],
         "--criterion is not used with --init scratch (its rounds start from random weights: "
         "only the pruned widths are kept); drop --criterion"),
        # over the teacher's floor, but under what one round of --step 0.5 reaches: the
        # teacher's own sizes (teacher_size), before any round
        (["--budget-kb", "10"], "error: --budget-kb 10 --budget-of weights: --step 0.5 and "
         "--max-rounds 1 prune to at most 0.500 of the teacher's channels, whose int8 "
         "weights weigh "),
    ],
    ids=["budget", "step", "drop", "alpha", "percentile", "percentile-moot", "other-loop",
         "not-a-run", "no-checkpoint", "criterion-scratch", "unreachable"],
)  # fmt: skip
def test_bad_input_is_one_error_line(teacher, tmp_path, capsys, extra, message):
    from hybridpar.tools import compress

    t = teacher[0]
    if "holds a loop" in message:
        t = tmp_path / "t"
        os.makedirs(t / "compress")
        for name in ("config.json", "summary.json"):
            (t / name).write_text((teacher[0] / name).read_text())
        os.symlink(teacher[0] / "checkpoints", t / "checkpoints")
        (t / "compress" / "settings.json").write_text(json.dumps(
            {"step": 0.5, "epochs": 4.0, "criterion": "l1", "calibration_batches": 2}))  # fmt: skip
    elif message.startswith("config.json") or message == "no checkpoint" or "--init" in extra:
        # not a run (the flags are checked before the workdir)
        t = tmp_path / "t"
        t.mkdir()
        if message == "no checkpoint" or "--init" in extra:
            (t / "config.json").write_text((teacher[0] / "config.json").read_text())
    argv = _compress(t)[3:] + extra
    with pytest.raises(SystemExit) as e:
        compress.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (teacher[0] / "compress").exists()  # the teacher the other tests copy
    if t.parent == tmp_path:
        assert not (t / "compress").exists() or "holds a loop" in message
        assert not (t / "compress_scratch").exists()
