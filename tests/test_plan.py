"""The planner (``python -m hybridpar.plan``) on 8 virtual devices with the tiny digits model:
it ranks the plans it compiled, its pick compiles again to the same memory and fits the
limit, a limit below every plan is one ``error:`` line naming the smallest plan's need, and
a second call comes from the cache. One planning run compiles (six plans, in two worker
processes); every other call reads its cache."""

import importlib.util
import json
import os

import pytest
from helpers import DIGITS, ROOT, config_args, main_here, run_compile_tool

from hybridpar.config import cli
from hybridpar.config.formatting import GIB, byte_size
from hybridpar.tools import plan

# The tiny digits model (8 filters, 16 px, batch 32 = 4 per device), so that each plan
# compiles quickly.
TINY = {"model.num_filters": 8, "data.image_size": 16, "global_batch": 32}
ARGS = ["--config", DIGITS, *config_args(TINY), "--devices", "8", "--max-plans", "6"]


def _plan(args, cache_dir, timeout=600):
    return run_compile_tool("hybridpar.plan", [*args, "--cache-dir", str(cache_dir)], timeout)


def _plan_here(args, cache_dir, capsys, monkeypatch) -> tuple[int, str, str]:
    """The CLI in this process, for calls that compile nothing (from the cache, or an error
    before compiling): (exit code, stdout, stderr). The variables it sets are put back."""
    env = ("XLA_FLAGS", "JAX_PLATFORMS", "HYBRIDPAR_PLAN_DEVICES")
    argv = [*args, "--cache-dir", str(cache_dir)]
    return main_here(plan.main, argv, capsys, monkeypatch, env)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The one planning run that compiles: (its JSON, its stderr, the cache dir)."""
    cache = tmp_path_factory.mktemp("plan_cache")
    r = _plan([*ARGS, "--jobs", "2", "--json"], cache)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr, cache


def test_ranks_at_least_six_plans_best_first(first):
    out, stderr, _ = first
    plans = out["plans"]
    assert len(plans) >= 6 and out["compiled"] == 6 and not out["failed"]
    assert out["planned"] == 6 and out["from_cache"] == 0
    assert "compiling 6 plans" in stderr and stderr.count("plan: [") == 6  # progress lines
    # every combination not planned is counted under its reason, on stderr and in the JSON
    ruled = out["ruled_out_by_reason"]
    assert ruled and sum(ruled.values()) == out["combinations"] - out["valid"]
    assert all(f"{n} ({reason})" in stderr for reason, n in ruled.items())
    times = [p["predicted_time_to_train_s"] for p in plans]
    assert times == sorted(times)
    labels = {p["plan"] for p in plans}
    assert len(labels) == len(plans)  # six different plans, not one six times
    for p in plans:
        assert p["memory_per_device_bytes"] > 0 and p["collective_bytes"] > 0
        assert p["predicted_images_per_s"] > 0 and p["from_cache"] is False
        assert p["overrides"]["global_batch"] == "32"  # the batch stays the recipe's
        assert p["memory_per_device_bytes"] <= out["memory_limit_bytes"]
    assert out["winning_overrides"] == " ".join(
        f"--config.{k}={v}" for k, v in plans[0]["overrides"].items()
    )


def test_the_pick_under_a_limit_compiles_and_fits(first, capsys, monkeypatch):
    """A limit between the plans' needs (from the cache): the bigger ones are dropped, and
    the pick, compiled again here from its overrides alone, needs what the planner said and
    fits the limit."""
    from hybridpar.tools.comm_report import report

    out, _, cache = first
    needs = sorted(p["memory_per_device_bytes"] for p in out["plans"])
    assert needs[0] < needs[-1], "the plans should differ in memory"
    limit = (needs[0] + needs[-1]) / 2
    code, stdout, stderr = _plan_here(
        [*ARGS, "--memory-gib", repr(limit / GIB), "--json"], cache, capsys, monkeypatch
    )
    assert code == 0, stderr[-3000:]
    limited = json.loads(stdout.strip().splitlines()[-1])
    # nothing compiled this call (it said "compiled": 6 beside "from_cache": 6)
    assert (limited["planned"], limited["compiled"], limited["from_cache"]) == (6, 0, 6)
    assert limited["plans"] and limited["too_big"]
    assert all(p["memory_per_device_bytes"] <= limit for p in limited["plans"])
    assert all(p["memory_per_device_bytes"] > limit for p in limited["too_big"])
    best = limited["plans"][0]
    config = cli.load(DIGITS, [*((k, str(v)) for k, v in TINY.items()), *best["overrides"].items()])
    rep = report(config)  # this process's 8 devices
    assert rep.memory_per_device_bytes == best["memory_per_device_bytes"] <= limit
    assert rep.total_bytes == best["collective_bytes"]


def test_one_plan_is_said_in_the_singular(first, capsys, monkeypatch):
    """One plan from the cache: "1 plan fits, 0 do not", not "1 plans fit"."""
    _, _, cache = first
    code, stdout, stderr = _plan_here([*ARGS, "--max-plans", "1"], cache, capsys, monkeypatch)
    assert code == 0, stderr[-3000:]
    assert "; 1 plan fits, 0 do not; 1 of 1 from the cache" in stdout
    assert "the 1 closest to the config is planned" in stderr
    assert "1 of 1 plan from the cache" in stderr


def test_a_limit_below_every_plan_is_one_error_naming_the_smallest(first, capsys, monkeypatch):
    out, _, cache = first
    smallest = min(out["plans"], key=lambda p: p["memory_per_device_bytes"])
    limit_gib = smallest["memory_per_device_bytes"] / 2 / GIB
    code, stdout, stderr = _plan_here(
        [*ARGS, "--memory-gib", repr(limit_gib)], cache, capsys, monkeypatch
    )
    assert code == 2 and stdout == ""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr
    assert smallest["plan"] in errors[0]
    assert f"needs {byte_size(smallest['memory_per_device_bytes'])}" in errors[0]


def test_a_second_call_comes_from_the_cache(first):
    """A new process (as a user's second call), the table this time."""
    out, _, cache = first
    r = _plan(ARGS, cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiling" not in r.stderr and "6 of 6 plans from the cache" in r.stderr
    assert "6 of 6 from the cache" in r.stdout and "winning overrides: " in r.stdout
    assert out["winning_overrides"] in r.stdout  # the same pick as the compiled run
    # under the table: what is compiled, what modelled
    assert "compiled (XLA:CPU on 8 virtual devices): memory/dev, collectives. modelled" in r.stdout
    # the cache holds one file per compiled plan
    assert len(list(cache.glob("*.json"))) == 6


def test_calibration_from_a_run_changes_the_prediction(first, tmp_path, capsys, monkeypatch):
    """A metrics.jsonl of this model at two batches (4 and 16 images per device, 8 devices,
    a step of 20 ms + 1 ms per image) calibrates the preset: the fitted overhead is the
    20 ms, and the predicted rates follow the run's instead of the H100's."""
    out, _, cache = first
    lines = []
    for per_device in (4, 16):
        rate = 8 * per_device / (0.020 + 0.001 * per_device)
        line = {"event": "train", "image_size": 16, "global_batch": 8 * per_device}
        lines += [dict(line, images_per_s=rate)] * 3
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = [*ARGS, "--json", "--calibrate-from", str(path), "--calibrate-devices", "8"]
    code, stdout, stderr = _plan_here(args, cache, capsys, monkeypatch)
    assert code == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["step_overhead_s"] == pytest.approx(0.020, rel=1e-6)
    assert str(path) in got["calibration"]
    assert got["from_cache"] == 6
    # the config's own plan (data:8, what the run ran) predicts the run's rate at its batch
    # of 4 per device (its few small collectives hide behind the backward pass)
    own = next(p for p in got["plans"] if p["plan"] == "data:8 dense bn=global xla b=4")
    assert own["predicted_images_per_s"] == pytest.approx(8 * 4 / (0.020 + 0.001 * 4), rel=0.01)
    assert max(p["predicted_images_per_s"] for p in got["plans"]) < min(
        p["predicted_images_per_s"] for p in out["plans"]
    )  # far below the uncalibrated H100 figures


def test_cache_key_follows_config_devices_source_and_compiler_flags(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    config = cli.load(DIGITS)
    key = plan.cache_key(config, 8, "src")
    assert key == plan.cache_key(cli.load(DIGITS), 8, "src")
    assert key != plan.cache_key(config, 16, "src")
    assert key != plan.cache_key(config, 8, "other source")
    # the user's TPU compiler flags change what a --target tpu plan compiles to
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_jf_crs_combiner_threshold_count=1")
    assert key != plan.cache_key(config, 8, "src")
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    # XLA_FLAGS as a set: a flag passed twice (a shell that added it again) is the same
    # compile; one more flag is another
    flags = os.environ.get("XLA_FLAGS", "")
    with_flag = plan.cache_key(config, 8, "src")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_enable_fast_math=false {flags}")
    assert plan.cache_key(config, 8, "src") != with_flag
    with_flag = plan.cache_key(config, 8, "src")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_enable_fast_math=false {flags} "
                                    "--xla_cpu_enable_fast_math=false")  # fmt: skip
    assert plan.cache_key(config, 8, "src") == with_flag
    config.model.bn_sync = "local"
    assert key != plan.cache_key(config, 8, "src")


@pytest.mark.parametrize("mode", ["xla", "overlap"])
def test_a_target_plan_compiles_with_its_own_comm_flags(monkeypatch, mode):
    """On a TPU target each plan's worker sets that plan's comm flags before its JAX starts:
    an overlap plan gets the asynchronous all-reduce flags its run would, an xla plan none,
    whatever the base config said (the report itself stood in for, reading the flags)."""
    from hybridpar.parallel import comm
    from hybridpar.tools import comm_report

    class Report:  # what the compiler's environment held when the plan compiled
        def to_dict(self):
            return {"flags": os.environ["LIBTPU_INIT_ARGS"]}

    monkeypatch.setattr(comm_report, "report", lambda config, **kw: Report())
    monkeypatch.setenv("HYBRIDPAR_PLAN_TARGET", "tpu:v5e-8")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_user_flag=1")
    out = plan.compile_one(DIGITS, [("comm.mode", mode), ("mesh", "data:8")])
    flags = out["flags"].split()
    assert "--xla_user_flag=1" in flags  # the user's own stay
    names = {f.split("=")[0] for f in flags}
    _, async_names = comm.TPU_ASYNC_ALL_REDUCE
    if mode == "overlap":
        assert set(async_names) <= names, flags
    else:
        assert not set(async_names) & names, flags


def test_candidates_respect_the_rules():
    meshes = plan.mesh_factorisations(8)
    assert len(meshes) == 10 and all(d * f * m == 8 for (_, d), (_, f), (_, m) in meshes)
    assert len({m for m in meshes}) == 10
    config = cli.load(DIGITS, [(k, str(v)) for k, v in TINY.items()])
    choices = {
        "mesh": meshes,
        "head": list(plan.HEADS),
        "bn_sync": ["global"],
        "comm": ["xla", "bucketed:32", "overlap:4"],
        "per_device_batch": [4],
        "compute": ["float32"],
    }
    found, product, ruled = plan.candidates(config, 8, choices)
    assert product == 10 * 3 * 3
    # every combination is a plan or ruled out with its reason, counted (plan's stderr line)
    assert len(found) + sum(ruled.values()) == product
    assert ruled["partial_fc needs the classes to divide over all devices"] > 0
    assert ruled["bucketed communication needs model=1 and the dense head"] > 0
    for c in found:
        model = dict(c.mesh)["model"]
        assert c.head != "sharded" or (model > 1 and 10 % model == 0)
        assert c.head != "partial_fc"  # 10 classes do not split over 8 devices
        assert c.comm != "bucketed:32" or (model == 1 and c.head == "dense")
    # the overlap mode runs on model axes and with the sharded head
    assert any(c.comm == "overlap:4" and c.head == "sharded" for c in found)
    assert found[0].overrides()["mesh"] == "data:8"  # the config's own plan first
    assert {c.overrides()["model.head"] for c in found} == {"dense", "sharded"}


def test_meshes_the_slices_or_the_batch_rule_out_are_counted_not_compiled():
    """On 2 slices only the data axis crosses them, so fsdp:16 is ruled out (its set-up
    refused it in a worker per plan); the config's global batch of 24 divides over the
    data x fsdp of data:8,model:2 and data:2,fsdp:4,model:2 (8 each) but not of data:16,
    which alone is ruled out (it refused every mesh: 24 does not divide over 16 devices).
    Each is counted under its reason; a batch the flags set is every mesh's own."""
    config = cli.load(DIGITS, [*((k, str(v)) for k, v in TINY.items()), ("global_batch", "24")])
    meshes = [
        (("data", 16), ("fsdp", 1), ("model", 1)),
        (("data", 1), ("fsdp", 16), ("model", 1)),
        (("data", 8), ("fsdp", 1), ("model", 2)),
        (("data", 2), ("fsdp", 4), ("model", 2)),
    ]
    choices = {"mesh": meshes, "head": ["dense"], "bn_sync": ["global"], "comm": ["xla"],
               "per_device_batch": [None], "compute": ["float32"]}  # fmt: skip
    found, product, ruled = plan.candidates(config, 16, choices, slices=2)
    assert [c.mesh_spec for c in found] == ["data:8,model:2", "data:2,fsdp:4,model:2"]
    assert [c.overrides()["global_batch"] for c in found] == ["24", "24"]
    assert ruled == {
        "only the data axis crosses the 2 slices, so data must be a multiple of 2": 1,
        "--config.global_batch=24 does not divide over the 16 data-parallel devices of its "
        "mesh (data x fsdp); use a multiple of 16, e.g. --config.global_batch=16": 1,
    }
    found, _, ruled = plan.candidates(config, 16, dict(choices, per_device_batch=[3]))
    assert len(found) == 4 and not ruled  # one slice, each mesh's own batch
    # the eval batch too, as the set-up checks it (it was found in a worker per plan)
    config.eval_batch = 24
    found, _, ruled = plan.candidates(config, 16, dict(choices, per_device_batch=[3]))
    assert [c.mesh_spec for c in found] == ["data:8,model:2", "data:2,fsdp:4,model:2"]
    assert list(ruled.items()) == [(
        "--config.eval_batch=24 does not divide over the 16 data-parallel devices of its mesh "
        "(data x fsdp); use a multiple of 16, e.g. --config.eval_batch=16", 2)]  # fmt: skip


def test_meshes_the_slices_rule_out_are_one_error_line_before_any_worker(capsys, monkeypatch):
    """plan --target tpu:v5e-16,slices=2 --meshes fsdp:32 started a worker per plan, each
    refused by its set-up (only the data axis crosses slices): now one error line, counted
    by reason, before anything compiles (TPU's environment not needed: nothing starts)."""
    from hybridpar.tools import targets

    monkeypatch.setattr(targets, "prepare", lambda target: None)
    monkeypatch.delenv("HYBRIDPAR_PLAN_TARGET", raising=False)
    args = ["--config", DIGITS, *config_args(TINY), "--target", "tpu:v5e-16,slices=2",
            "--meshes", "fsdp:32", "--no-cache"]  # fmt: skip
    code, stdout, stderr = _plan_refusing_to_compile(args, monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1, stderr
    assert lines[0].startswith("error: no candidate plan is valid for 32 devices")
    assert "(only the data axis crosses the 2 slices, so data must be a multiple of 2)" in lines[0]


def test_a_tpu_presets_slices_rule_out_meshes_as_a_targets_do(capsys, monkeypatch):
    """plan --hardware tpu-v5e --devices 512 is two of v5e's 256-chip slices, as simulate
    prices it: only data crosses them, so fsdp:512 is ruled out before any worker, as on
    --target tpu:v5e-256,slices=2 (planted: one slice, its fsdp groups priced over DCN)."""
    args = ["--config", DIGITS, *config_args(TINY), "--hardware", "tpu-v5e", "--devices",
            "512", "--meshes", "fsdp:512", "--no-cache"]  # fmt: skip
    code, stdout, stderr = _plan_refusing_to_compile(args, monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1, stderr
    assert "(only the data axis crosses the 2 slices, so data must be a multiple of 2)" in lines[0]


def test_a_batch_some_meshes_take_is_planned_on_those(tmp_path, capsys, monkeypatch):
    """global_batch=20 does not divide over 8 devices, but over data:4,model:2's 4
    data-parallel devices it does: plan compiles that mesh's plans (it refused them all:
    "global_batch=20 does not divide over 8 devices"), and is one error line, naming the
    reason and its fixes, only where no mesh takes the batch."""
    batch = ["--config.global_batch=20", "--heads", "dense", "--comm", "xla"]
    args = [*ARGS, *batch, "--meshes", "data:8 data:4,model:2", "--cache-dir", str(tmp_path)]
    with pytest.raises(_Compiled):
        _plan_refusing_to_compile(args, monkeypatch, capsys)
    assert "2 (--config.global_batch=20 does not divide over the 8 data-parallel devices" in (
        capsys.readouterr().err)  # fmt: skip
    args = [*ARGS, *batch, "--meshes", "data:8 fsdp:8", "--cache-dir", str(tmp_path)]
    code, stdout, stderr = _plan_refusing_to_compile(args, monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1, stderr
    assert (
        "ruled out: 4 (--config.global_batch=20 does not divide over the 8 data-parallel "
        "devices of its mesh (data x fsdp); use a multiple of 8" in lines[0]
    )
    assert "set --config.global_batch to a multiple" in lines[0]
    assert "--per-device-batch" in lines[0]


def test_no_plan_fits_names_what_the_config_ruled_out_and_whose_count_it_is():
    """The probe's case: 20 of 21 plans ruled out by their set-up (an eval_batch of 1,000
    that divides over no data-parallel size but 8), the last over the limit: the error
    blamed the memory alone. It now counts the ruled-out plans with the first one's
    reason and fix, and says the need is XLA:CPU's (virtual CPU devices), not for a TPU
    target's compiler."""
    from hybridpar.tools import targets

    too_big = [{"plan": "data:8,model:8 dense", "memory_per_device_bytes": 27 * GIB}]
    why = (
        "eval_batch=1000 does not divide over the 64 data-parallel devices of mesh 'data:64' "
        "(data x fsdp); use a multiple of 64, e.g. --config.eval_batch=960"
    )
    failed = [{"plan": f"plan {i}", "error": why, "ruled_out": True} for i in range(20)]
    failed.append({"plan": "broken", "error": "the compile failed", "ruled_out": False})
    words = plan.no_fit_words(too_big, failed, 16 * GIB, None)
    assert words.startswith("no plan fits in 16.00 GiB per device: the smallest, data:8,model:8 "
                            "dense, needs 27.00 GiB (XLA:CPU's count")  # fmt: skip
    assert f"20 other plans were ruled out by the config when set up, the first: plan 0: {why}" in (
        words)  # fmt: skip
    assert "--config.eval_batch=960" in words and "raise --memory-gib" in words
    tpu = plan.no_fit_words(too_big, failed[:1], 16 * GIB, targets.parse("tpu:v5e-8"))
    assert "XLA:CPU" not in tpu and "1 other plan was ruled out" in tpu
    assert "ruled out" not in plan.no_fit_words(too_big, failed[-1:], 16 * GIB, None)


def test_one_data_parallel_device_is_offered_no_bucketed_or_overlap_mode():
    """With one device there is no gradient to reduce: the bucketed and overlap modes are
    ruled out, not compiled (their all-reduce over a group of one device moves nothing)."""
    config = cli.load(DIGITS, [(k, str(v)) for k, v in TINY.items()])
    choices = {
        "mesh": plan.mesh_factorisations(1),
        "head": ["dense"],
        "bn_sync": ["global"],
        "comm": ["xla", "bucketed:4", "overlap:4"],
        "per_device_batch": [32],
        "compute": ["float32"],
    }
    found, product, ruled = plan.candidates(config, 1, choices)
    assert product == 3 and [c.comm for c in found] == ["xla"]
    assert ruled == {"bucketed and overlap communication need more than one data-parallel "
                     "device": 2}  # fmt: skip


@pytest.mark.parametrize("platform, want", [("gpu", "overlap:4"), ("cpu", "xla")])
def test_auto_plans_name_the_mode_the_run_would_get(platform, want):
    """comm.mode=auto resolved per plan as the run would (sync.choose_mode): the overlap
    mode for a GPU mesh over data only, xla with a model axis; a plan listed twice once."""
    config = cli.load(DIGITS, [(k, str(v)) for k, v in TINY.items()])
    choices = {
        "mesh": [(("data", 8), ("fsdp", 1), ("model", 1)), (("data", 4), ("fsdp", 1),
                                                              ("model", 2))],
        "head": ["dense"],
        "bn_sync": ["global"],
        "comm": ["auto", "xla"],
        "per_device_batch": [4],
        "compute": ["float32"],
    }  # fmt: skip
    found, _, ruled = plan.candidates(config, 8, choices, platform)
    assert [c.comm for c in found if c.mesh_spec == "data:8"][0] == want
    assert [c.comm for c in found if c.mesh_spec == "data:4,model:2"] == ["xla"]  # once
    assert ruled["the same plan as another"] == (2 if want == "xla" else 1)
    assert found[0].overrides()["comm.mode"] == want.split(":")[0]


@pytest.mark.parametrize(
    "extra, says",
    [
        # plan's own flags in the hint, not the train CLI's --config.mesh or XLA_FLAGS
        (
            ["--meshes", "data:3"],
            "--meshes 'data:3': a mesh there needs 3 devices but --devices is 8; make its "
            "sizes multiply to 8 (e.g. data:-1), or plan for 3 devices with --devices 3",
        ),
        # only the flag that is wrong is named
        (["--devices", "0"], "error: --devices=0: must be >= 1"),
        (["--jobs", "0"], "error: --jobs=0: must be >= 1"),
        (["--hardware", "nope"], "unknown preset 'nope'"),
        (["--comm", "bucketed"], "write auto, xla, bucketed:MB or overlap:MB"),
        (["--comm", "overlap"], "write auto, xla, bucketed:MB or overlap:MB"),
        (["--memory-gib", "0"], "must be positive"),
        (["--memory-gib", "nan"], "--memory-gib: 'nan' is not a finite number"),
        (["--heads", "dense,shardedd"], "--heads 'shardedd'"),
        (["--target", "gpu:h100-8"], "the GPU compiler gives no FLOP count ahead of time"),
        (["--target", "tpu:v5e-16"], "--devices=8 but --target tpu:v5e-16 has 16 devices"),
        # a flag another makes moot is refused, not silently unused
        (["--calibrate-devices", "8"], "pass --calibrate-from RUN/metrics.jsonl with it"),
        (["--target", "tpu:v5e-8", "--hardware", "a100"], "--hardware is not used with --target"),
        (["--target", "tpu:v5e-8", "--calibrate-from", "m.jsonl"], "--calibrate-from is not used"),
        # no DCN figure for v6e: traffic between its slices cannot be priced
        (["--target", "tpu:v6e-4,slices=2"], "no DCN bandwidth in the chip table"),
        # given, even at the default's value: the TPU compiler's schedule replaces it
        (["--target", "tpu:v5e-8", "--overlap", "0.8"], "--overlap is not used with --target"),
    ],
)
def test_bad_flags_are_one_error_line(tmp_path, capsys, monkeypatch, extra, says):
    code, stdout, stderr = _plan_here([*ARGS, *extra], tmp_path / "cache", capsys, monkeypatch)
    assert code == 2 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], stderr
    assert "XLA_FLAGS" not in lines[0] and "--config.mesh" not in lines[0]
    assert not list(tmp_path.iterdir())  # nothing compiled, nothing cached, no cache dir made


def _tpu_report(rows, mesh, kind="TPU v5 lite", **figures) -> dict:
    """A comm report as ``comm_report --target tpu:... --json`` writes it (the keys plan
    reads), for collective rows ``(kind, count, bytes per op, group size, groups text)``."""
    import math

    rows = [{"kind": k, "count": n, "bytes": b, "total_bytes": n * b, "groups": groups,
             "group_size": size, "async": False} for k, n, b, size, groups in rows]  # fmt: skip
    total = sum(r["total_bytes"] for r in rows)
    by_kind = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"count": 0, "bytes": 0})
        k["count"], k["bytes"] = k["count"] + r["count"], k["bytes"] + r["total_bytes"]
    devices = math.prod(mesh.values())
    report = {
        "collectives": rows, "by_kind": by_kind, "total_bytes": total,
        "total_ops": sum(r["count"] for r in rows), "flops": 1e6, "bytes_accessed": 1e4,
        "memory_per_device_bytes": 1000, "memory": {"total": 1000}, "mesh": mesh,
        "devices": {"count": devices, "platform": "tpu", "kind": kind, "virtual": False},
        "xla_flags_applied": [], "global_batch": 8 * devices, "image_shape": [32, 32, 1],
        "compile_s": 1.0, "config": {}, "bytes_exposed": total, "bytes_hidden_est": 0,
    }  # fmt: skip
    return dict(report, **figures)


def _tiny_on_a_pod():
    """A toy step as the TPU compiler might count it, on a 4,096-chip v5p pod."""
    from types import SimpleNamespace

    from hybridpar.tools import targets

    config = SimpleNamespace(
        global_batch=4096 * 8,
        num_epochs=1,
        data=SimpleNamespace(name="images", train_examples=1_281_167),
    )
    rep = _tpu_report([], {"data": 4096, "fsdp": 1, "model": 1}, kind="TPU v5")
    return config, rep, targets.parse("tpu:v5p-8192")


def test_a_tiny_step_on_a_pod_is_bounded_by_the_floor():
    """A toy network's roofline is nanoseconds a step; the estimate is held at the per-step
    floor, so at most (images per chip) / floor per chip."""
    from hybridpar.simulate.hardware import STEP_FLOOR_S

    config, rep, target = _tiny_on_a_pod()
    p = plan.predict_on_target(config, rep, target, target.devices_count, 0.8, 1_281_167)
    assert STEP_FLOOR_S > 0 and p["predicted_step_s"] >= STEP_FLOOR_S
    assert p["predicted_images_per_s"] / target.devices_count <= 8 / STEP_FLOOR_S
    assert p["predicted_floor_s"] > 0.99 * STEP_FLOOR_S  # the floor is what the step is
    assert p["predicted_exposed_comm_s"] < 1e-6
    assert "floor" in plan.legend(target, None, target.devices_count, None)


# The probe's data:16 step of the digits job on tpu:v5e-16: the gradient's all-reduce and
# 18 small ones (BatchNorm's), as its comm report lists them
_DATA16 = [("all-reduce", 1, 1_230_380, 16, "mesh[16] over axis 0"),
           ("all-reduce", 18, 1024, 16, "mesh[16,1,1] over axis 0,1,2")]  # fmt: skip


def test_a_target_plans_collectives_are_priced_as_simulate_prices_them():
    """plan --target tpu:v5e-16 priced the probe's data:16 step at its bytes over the chip's
    two-way ICI (3.1 us), ~160x below simulate's 0.5 ms for the same report: now it is
    simulate's figure (rings along the 4x4 torus, 2 us a hop). On two slices of 8
    (tpu:v5e-8,slices=2) the data groups span the slices: each reduce-scatters on its
    slice's torus and all-reduces its shard over DCN (v5e: 3.125 GB/s a chip, 25 us a
    step), by hand below; a model-axis group stays in its slice, priced as on one
    (planted: total bytes / ICI)."""
    from types import SimpleNamespace

    from hybridpar import simulate as sim
    from hybridpar.runtime.comm_report_schema import CommReport
    from hybridpar.tools import targets

    config = SimpleNamespace(num_epochs=15)
    rep = _tpu_report(_DATA16, {"data": 16, "fsdp": 1, "model": 1})
    one = targets.parse("tpu:v5e-16")
    got = plan.predict_on_target(config, rep, one, 16, 0.8, 1437)
    # By hand, as simulate's v5e preset states the chip: 16 chips a 4x4 torus, a ring
    # along each side in turn (reduce-scatter, then all-gather back) at its 400 GB/s ICI
    # over the 2 dimensions (200 GB/s a ring), 2 us a hop; the second side holds a 1/4
    b, a = 400e9 / 2, 2e-6

    def on_4x4(n):
        return 2 * ((4 - 1) * a + 3 / 4 * n / b + (4 - 1) * a + 3 / 4 * (n / 4) / b)

    want = on_4x4(1_230_380) + 18 * on_4x4(1024)  # 0.52 ms
    assert got["predicted_exposed_comm_s"] == pytest.approx(want, rel=1e-12)
    assert want > 100 * rep["total_bytes"] / one.chip.ici_bytes_per_s  # the old price
    workload = sim.workload_from_report(CommReport.from_dict(rep))
    v5e = sim.get_preset("tpu-v5e")
    assert sim.predict_step(workload, v5e, 16, 4, 32).exposed_comm_s == pytest.approx(want)
    two = targets.parse("tpu:v5e-8,slices=2")
    split = plan.predict_on_target(config, rep, two, 16, 0.8, 1437)["predicted_exposed_comm_s"]

    def by_hand(n):  # 8 chips a slice (a 2x4 torus) and 2 slices over DCN
        shard, dcn = n / 8, 25e9 / 8  # v5e's DCN: 25 Gb/s a chip, in bytes/s
        across = min(2 * 25e-6 + shard / dcn, 2 * 25e-6 + 2 * shard / dcn)  # ring or tree
        on_2x4 = 2 * ((2 - 1) * a + 1 / 2 * n / b + (4 - 1) * a + 3 / 4 * (n / 2) / b)
        return on_2x4 + across

    assert split == pytest.approx(by_hand(1_230_380) + 18 * by_hand(1024), rel=1e-12)
    assert split > 2 * want
    model = _tpu_report([("all-reduce", 3, 65536, 2, "[8,2]<=[16]")],
                        {"data": 8, "fsdp": 1, "model": 2})  # fmt: skip
    on_one, on_two = (plan.predict_on_target(config, model, t, 16, 0.8, 1437) for t in (one, two))
    assert on_one["predicted_exposed_comm_s"] == on_two["predicted_exposed_comm_s"] > 0


def test_plans_tied_at_the_floor_rank_by_communication_then_memory():
    """The probe's case: every plan held at the 1 ms floor, so the same time to train. The
    plan that communicates least ranks first, not the one with the least memory, and the
    tie is counted (the table says so)."""

    def row(name, exposed, memory, step=0.001, floor=None):
        busy = 0.0002 + exposed
        return {
            "plan": name,
            "predicted_step_s": step,
            "predicted_exposed_comm_s": exposed,
            "predicted_floor_s": step - busy if floor is None else floor,
            "predicted_time_to_train_s": 100 * step,
            "memory_per_device_bytes": memory,
        }

    fsdp = row("fsdp:8", exposed=0.00081, memory=10)
    data = row("data:8", exposed=0.000018, memory=13)
    slow = row("model:8", exposed=0.0001, memory=5, step=0.002, floor=0.0)
    fits = sorted([fsdp, slow, data], key=plan.rank_key)
    assert [r["plan"] for r in fits] == ["data:8", "fsdp:8", "model:8"]
    assert plan.floor_tie(fits) == 2
    # not at the floor: no tie said, even at equal times
    assert plan.floor_tie([dict(r, predicted_floor_s=0.0) for r in fits]) == 0


def test_a_target_plan_takes_its_exposed_comm_from_the_compilers_schedule():
    """A plan compiled for a TPU whose report says what its schedule hides: exposed comm =
    comm x (1 - hidden / collective bytes), whatever the overlap (all hidden: 0 at overlap
    0; none hidden: all of comm at overlap 1), and the row says so. A report without the
    figures (cached before them) hides nothing, as simulate's TPU presets: the TPU
    compiler leaves its collectives synchronous (it was an assumed overlap of 0.8)."""
    from types import SimpleNamespace

    from hybridpar import simulate as sim
    from hybridpar.tools import targets

    config, target = SimpleNamespace(num_epochs=1), targets.parse("tpu:v5e-8")
    total = 1e9  # collective bytes: seconds on the links against a small roofline
    rows = [("all-reduce", 1, total, 8, "mesh[8] over axis 0")]
    rep = _tpu_report(rows, {"data": 8, "fsdp": 1, "model": 1}, flops=1e10, bytes_accessed=1e6)
    b, a = 400e9 / 2, 2e-6  # by hand: a 2x4 torus of v5e, 200 GB/s a ring, 2 us a hop
    comm = 2 * ((2 - 1) * a + 1 / 2 * total / b + (4 - 1) * a + 3 / 4 * (total / 2) / b)
    assert sim.best_algorithm("all-reduce", total, 8, sim.get_preset("tpu-v5e"))[1] == (
        pytest.approx(comm))  # fmt: skip

    def exposed(overlap, **figures):
        p = plan.predict_on_target(config, dict(rep, **figures), target, 8, overlap, 1_281_167)
        return p["predicted_exposed_comm_s"], p["exposed_from"]

    assert exposed(0.0, bytes_hidden_est=total) == (0.0, "compiler schedule")
    assert exposed(1.0, bytes_hidden_est=0) == (pytest.approx(comm), "compiler schedule")
    assert exposed(0.8, bytes_hidden_est=total / 4)[0] == pytest.approx(0.75 * comm)
    # the seconds hidden, each collective's compute against the price comm takes (DCN's on
    # several slices), in place of the bytes' share, judged against one way of ICI
    assert exposed(0.8, bytes_hidden_est=total, seconds_hidden_est=comm / 4) == (
        pytest.approx(0.75 * comm), "compiler schedule")  # fmt: skip
    assert exposed(0.8, bytes_hidden_est=0, seconds_hidden_est=2 * comm)[0] == 0.0
    for overlap in (0.8, 1.0):
        for old in ({"bytes_hidden_est": None}, {}):
            cached = {k: v for k, v in rep.items() if k not in ("bytes_hidden_est",
                                                              "bytes_exposed")}  # fmt: skip
            p = plan.predict_on_target(config, dict(cached, **old), target, 8, overlap, 1437)
            assert p["predicted_exposed_comm_s"] == pytest.approx(comm)
            assert p["exposed_from"].startswith("none hidden")


def test_v3_is_in_the_chip_table_but_not_a_compile_target():
    from hybridpar.config.errors import ConfigError
    from hybridpar.tools import targets

    assert targets.CHIPS["v3"].peak_bf16_flops == 123e12
    with pytest.raises(ConfigError, match="scaling model only"):
        targets.parse("tpu:v3-8")


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None and not os.environ.get("CI"),
    reason='libtpu missing: pip install -e ".[tpu-aot]"',
)
def test_a_tpu_plans_memory_is_at_least_the_compilers_peak(monkeypatch):
    """On tpu:v5e-8 the TPU compiler reports no temporaries for the tiny data:4,model:2
    step, yet gives its peak as several times its arguments: the plan's memory/dev (what a
    plan worker reads) is that peak, not the 1.3 MiB of arguments and outputs."""
    from hybridpar.runtime.run import setup
    from hybridpar.tools import targets

    target = targets.parse("tpu:v5e-8")
    targets.prepare(target)
    monkeypatch.setenv("HYBRIDPAR_PLAN_TARGET", target.spec)
    overrides = [(k, str(v)) for k, v in {**TINY, "mesh": "data:4,model:2"}.items()]
    rep = plan.compile_one(DIGITS, overrides)
    # the same step compiled here: the compiler's own memory analysis
    run = setup(cli.load(DIGITS, overrides), with_data=False, devices=target.devices())
    run.program.compiler_options = target.compiler_options()
    stats = run.program.train_step(32, 16).memory_analysis()
    mem = rep["memory"]
    assert mem["temp"] == stats.temp_size_in_bytes  # read as the compiler reports it
    parts = mem["arguments"] + mem["outputs"] + mem["temp"] - mem["aliased"]
    assert stats.peak_memory_in_bytes > 2 * parts  # the case: a peak the parts miss
    assert rep["memory_per_device_bytes"] == stats.peak_memory_in_bytes
    assert mem.get("peak") == stats.peak_memory_in_bytes  # kept beside the parts


def test_time_to_train_counts_a_built_in_sets_own_epoch():
    """digits' epoch is its 1,437-image split, not the config's nominal train_examples
    (4,096), which plan's predicted time to train used to take."""
    from hybridpar.config.schema import load_config

    config = load_config(DIGITS)
    assert config.data.train_examples != 1437
    assert plan.images_per_epoch_of(config) == 1437
    config.data.name = "synthetic"
    assert plan.images_per_epoch_of(config) == config.data.train_examples


def test_data_read_from_files_needs_images_per_epoch():
    """cifar10_fast's images are read from files: its nominal data.train_examples (4,096)
    made the time to train ~12x short. Without --images-per-epoch it is an error, as
    simulate --comm-report's; with it, that count (planted: the nominal count returned)."""
    from hybridpar.config.errors import ConfigError
    from hybridpar.config.schema import load_config

    config = load_config(str(ROOT / "experiments" / "cifar10_fast.py"))
    assert config.data.name == "images"
    with pytest.raises(ConfigError, match="read from files.*pass --images-per-epoch N"):
        plan.images_per_epoch_of(config)
    assert plan.images_per_epoch_of(config, 50_000) == 50_000
    with pytest.raises(ConfigError, match="--images-per-epoch=0 must be >= 1"):
        plan.images_per_epoch_of(config, 0)


def test_a_per_device_batch_is_per_data_parallel_device():
    """As config.stages counts it: a plan's batch per data-parallel device (data x fsdp),
    so 8 on data:4,model:2 is a global batch of 32, not 8 x 8 devices; without
    --per-device-batch every mesh keeps the config's global batch (32), each at its own
    batch per data-parallel device (planted: global = batch x devices)."""
    config = cli.load(DIGITS, [(k, str(v)) for k, v in TINY.items()])
    hybrid = (("data", 4), ("fsdp", 1), ("model", 2))
    choices = {"mesh": [(("data", 8), ("fsdp", 1), ("model", 1)), hybrid],
               "head": ["dense"], "bn_sync": ["global"], "comm": ["xla"],
               "per_device_batch": [8], "compute": ["float32"]}  # fmt: skip
    found, _, _ = plan.candidates(config, 8, choices)
    assert {c.mesh_spec: c.overrides()["global_batch"] for c in found} == {
        "data:8": "64", "data:4,model:2": "32"}  # fmt: skip
    found, _, _ = plan.candidates(config, 8, dict(choices, per_device_batch=[None]))
    assert {c.mesh_spec: (c.per_device_batch, c.overrides()["global_batch"]) for c in found} == {
        "data:8": (4, "32"), "data:4,model:2": (8, "32")}  # fmt: skip
    assert found[0].mesh_spec == "data:8"  # the config's own plan first: no batch change
    table = plan.format_table([], [], [], 0)
    assert "batch/dp-dev" in table and "batch/dev " not in table
    # --help says images, as the docs do (it said "batches per data-parallel device")
    assert "--per-device-batch PER_DEVICE_BATCH images per data-parallel device" in " ".join(
        plan.build_parser().format_help().split()
    )


def test_a_config_with_stages_plans_its_stages_batches():
    """With stages the run takes each stage's batch per data-parallel device and never
    global_batch: a plan overrides no global_batch (planted: the override kept), and
    --per-device-batch is refused (below, with the other flags)."""
    config = cli.load(DIGITS, [*((k, str(v)) for k, v in TINY.items()),
                               ("stages", "1:8-4,2:16-8"), ("num_epochs", "2")])  # fmt: skip
    choices = {"mesh": [(("data", 8), ("fsdp", 1), ("model", 1))], "head": ["dense"],
               "bn_sync": ["global"], "comm": ["xla"], "per_device_batch": [None],
               "compute": ["float32"]}  # fmt: skip
    found, _, _ = plan.candidates(config, 8, choices)
    assert len(found) == 1 and found[0].per_device_batch is None
    assert "global_batch" not in found[0].overrides() and found[0].label().endswith("b=stages")


def test_a_stages_plan_checks_the_largest_stages_memory(tmp_path, monkeypatch):
    """The plan's memory is its largest stage's train step (stage 1 here: 16 px at 8 a
    device, twice stage 0's batch at twice its size), the figure the limit is held to;
    compiled in one worker (planted: comm_report compiling config.global_batch's step)."""
    monkeypatch.setenv("HYBRIDPAR_PLAN_DEVICES", "8")
    overrides = [*((k, str(v)) for k, v in TINY.items()), ("stages", "1:8-4,2:16-8"),
                 ("num_epochs", "2")]  # fmt: skip
    config = cli.load(DIGITS, overrides)
    c = plan.Candidate((("data", 8), ("fsdp", 1), ("model", 1)), "dense", "global", "xla",
                       None, "float32")  # fmt: skip
    rep = plan.compile_plans(DIGITS, config, overrides, [c], 8, 1, tmp_path, lambda s: None)[c]
    assert "error" not in rep, rep
    programs = rep["stage_programs"]
    assert [(p["global_batch"], p["image_size"]) for p in programs] == [(32, 8), (64, 16)]
    assert rep["stage"] == 1 and rep["global_batch"] == 64
    big = max(p["memory_per_device_bytes"] for p in programs)
    assert rep["memory_per_device_bytes"] == big > programs[0]["memory_per_device_bytes"]
    fits, too_big, _ = plan.plan_rows(config, {c: rep}, 8, _preset(), big - 1, 0.8, 1437)
    assert not fits and too_big[0]["memory_stage"] == 1  # held to the largest stage's need
    # a stage that rounds to no step on 1,437 images (0.01 epochs of 22 steps at 64): the
    # trainer refuses it, so the plan is ruled out with the trainer's error, not ranked
    short = cli.load(DIGITS, [*overrides[:-2], ("stages", "1:8-4,1.01:16-8"),
                              ("num_epochs", "1.01")])  # fmt: skip
    fits, too_big, failed = plan.plan_rows(short, {c: rep}, 8, _preset(), 2**40, 0.8, 1437)
    assert not fits and not too_big and failed[0]["ruled_out"], failed
    assert "stage 1 (epochs 1-1.01, 22 steps an epoch at global batch 64) rounds to 0 steps" in (
        failed[0]["error"])  # fmt: skip


def _preset():
    from hybridpar import simulate

    return simulate.get_preset("h100")


def test_a_batch_over_an_epoch_is_ruled_out_with_the_reason(tmp_path, monkeypatch):
    """512 a device on data:8 is a global batch of 4,096, more than digits' 1,437-image
    epoch: the plan is ruled out, saying so, not ranked first at 0 s to train (planted:
    comm_report without the epoch check)."""
    monkeypatch.setenv("HYBRIDPAR_PLAN_DEVICES", "8")
    config = cli.load(DIGITS, [(k, str(v)) for k, v in TINY.items()])
    c = plan.Candidate((("data", 8), ("fsdp", 1), ("model", 1)), "dense", "global", "xla", 512,
                       "float32")  # fmt: skip
    results = plan.compile_plans(DIGITS, config, [], [c], 8, 1, None, lambda s: None)
    assert results[c].get("ruled_out"), results[c]
    assert "more than one epoch" in results[c]["error"]
    fits, too_big, failed = plan.plan_rows(config, results, 8, _preset(), 2**40, 0.8, 1437)
    assert not fits and not too_big and failed[0]["ruled_out"]
    assert "ruled out: " in plan.format_table(fits, too_big, failed, 2**40)


def test_a_target_plans_json_records_what_its_estimate_used():
    """For a TPU target the estimate is the chip's roofline, its links and the compiler's
    schedule: the JSON records no preset (h100), efficiency, calibration or overlap it did
    not use, nor the overlap where a report had no schedule figures (a TPU hides nothing
    then), (planted: the preset's)."""
    from hybridpar.tools import targets

    target, preset = targets.parse("tpu:v5e-8"), _preset()
    unused = ("hardware", "efficiency", "step_overhead_s", "calibration", "overlap")
    for said in ("compiler schedule", "none hidden (a TPU preset: ...)"):
        used = plan.estimate_used(target, preset, 0.8, [{"exposed_from": said}], 8)
        assert {k: used[k] for k in unused} == dict.fromkeys(unused)
        assert "TPU compiler" in used["estimate"] and "DCN between slices" in used["estimate"]
    on_cpu = plan.estimate_used(None, preset, 0.8, [], 8)
    assert on_cpu["hardware"] == "h100" and on_cpu["overlap"] == 0.8
    # a TPU preset hides nothing: no overlap recorded, as simulate's JSON (it said 0.8)
    from hybridpar import simulate

    tpu = plan.estimate_used(None, simulate.get_preset("tpu-v5e"), 0.8, [], 8)
    assert tpu["hardware"] == "tpu-v5e" and tpu["overlap"] is None


def test_a_target_plans_compute_is_the_longer_of_flops_and_bytes_said_as_a_heuristic():
    """plan --target's compute a step is the longer of the FLOPs at peak and the bytes
    accessed at HBM bandwidth (what docs/scaling.md's measured steps support for ranking),
    and its table and JSON say so: a pessimistic heuristic, no bound, not the 'roofline' or
    'upper bound' they said (XLA's bytes are more than the HBM traffic; planted: the old
    words)."""
    from types import SimpleNamespace

    from hybridpar.tools import targets

    target = targets.parse("tpu:v5e-8")
    chip = target.chip
    rep = _tpu_report([], {"data": 8, "fsdp": 1, "model": 1}, flops=1e10, bytes_accessed=1e9)
    got = plan.predict_on_target(SimpleNamespace(num_epochs=1), rep, target, 8, 0.8, 1437)
    compute = got["predicted_scaling_efficiency"] * got["predicted_step_s"]
    assert 1e9 / chip.hbm_bytes_per_s > 10 * 1e10 / chip.peak_bf16_flops  # the bytes' longer
    assert compute == pytest.approx(1e9 / chip.hbm_bytes_per_s, rel=1e-9)
    said = [got["estimate"], plan.legend(target, None, 8, None),
            plan.estimate_used(target, _preset(), 0.8, [got], 8)["estimate"]]  # fmt: skip
    for text in said:
        assert "the longer of the TPU compiler's FLOPs at the chip's peak and its bytes" in text
        assert "pessimistic heuristic, no bound" in text
        assert "roofline" not in text and "upper bound" not in text


def _looped_rows(loops_by_mesh: dict):
    """plan_rows of one fake TPU report per mesh whose step runs ``loops`` loops of compute
    (``flop_loops`` in its stage's ``stage_programs`` row; ``...``: a row without it)."""
    from types import SimpleNamespace

    from hybridpar.tools import targets

    target, results = targets.parse("tpu:v5e-16"), {}
    for mesh, loops in loops_by_mesh.items():
        shape = {"data": 1, "fsdp": 1, "model": 1, **dict([mesh])}
        row = {"stages": [0], "flops": 1e6}
        programs = [row if loops is ... else dict(row, flop_loops=loops)]
        rep = _tpu_report(_DATA16, shape, stage=0, stage_programs=programs)
        c = plan.Candidate(tuple(shape.items()), "dense", "global", "xla", 4, "float32")
        results[c] = rep
    config = SimpleNamespace(num_epochs=15)
    return plan.plan_rows(config, results, 16, None, 2**40, 0.8, 1437, target)


def test_a_plan_whose_flops_are_short_is_marked_not_ranked_silently():
    """XLA counts a loop's body once: the fsdp:16 step's windowed-einsum loops made its FLOP
    count short (256 M against data:16's 468 M), so its time to train is too. Such a plan is
    marked (time to train +, flop_loops in the JSON) with a line saying its rank is
    optimistic; a report that does not say (no flop_loops) is unknown, marked ?, not taken
    as none (planted: no mark; a missing count read as 0)."""
    fits, too_big, _ = _looped_rows({("fsdp", 16): 12, ("data", 16): 0, ("model", 16): ...})
    by_mesh = {r["overrides"]["mesh"]: r for r in fits + too_big}
    assert {m: r["flop_loops"] for m, r in by_mesh.items()} == {
        "fsdp:16": 12, "data:16": 0, "model:16": None}  # fmt: skip
    lines = plan.format_table(fits, too_big, [], 2**40).splitlines()
    rows = {line.split()[1]: line for line in lines[2:5]}  # under the header and its rule
    assert rows["fsdp:16"].rstrip().endswith("+") and rows["model:16"].rstrip().endswith("?")
    assert rows["data:16"].rstrip()[-1] not in "+?"
    assert any(line.startswith("time to train +:") and "rank are optimistic" in line
               for line in lines)  # fmt: skip
    assert any(line.startswith("time to train ?:") for line in lines)
    # no plan with loops, none unknown: no mark and no note
    fits, too_big, _ = _looped_rows({("data", 16): 0})
    table = plan.format_table(fits, too_big, [], 2**40)
    assert table.splitlines()[-1].rstrip()[-1] not in "+?" and "time to train +" not in table


def test_memory_of_is_at_least_the_compilers_peak_for_every_tool():
    """program.memory_of (the compile tool's and the train pre-flight's figure, as well as
    plan's) takes the compiler's peak where the parts sum to less, and says so."""
    import types

    from hybridpar.program.program import memory_of
    from hybridpar.runtime.run import memory_text

    def compiled(temp, peak):
        stats = types.SimpleNamespace(argument_size_in_bytes=2**20, output_size_in_bytes=2**20,
                                      temp_size_in_bytes=temp, alias_size_in_bytes=2**20,
                                      peak_memory_in_bytes=peak)  # fmt: skip
        return types.SimpleNamespace(memory_analysis=lambda: stats)

    tpu = memory_of(compiled(0, 8 * 2**20))  # no temporaries reported, a peak of 8 MiB
    assert tpu["total"] == tpu["peak"] == 8 * 2**20
    assert memory_text(tpu).startswith("8.0 MiB, the compiler's peak (the parts sum to 1.0")
    cpu = memory_of(compiled(3 * 2**20, 2**20))  # a peak without temporaries: the sum stands
    assert cpu["total"] == 4 * 2**20 and "peak" not in cpu
    assert memory_text(cpu).startswith("4.0 MiB (arguments 1.0")


class _Compiled(Exception):
    """Raised by the stand-ins for the compile entry points: a call got as far as compiling."""


def _plan_refusing_to_compile(args, monkeypatch, capsys) -> tuple[int, str, str]:
    """``plan.main(args)`` in this process with every compile entry point (``compile_plans``,
    ``compile_one``, ``comm_report.report``) raising ``_Compiled``: (code, stdout, stderr)."""
    from hybridpar.tools import comm_report

    def compiled(*args, **kwargs):
        raise _Compiled

    for module, name in ((plan, "compile_plans"), (plan, "compile_one"), (comm_report, "report")):
        monkeypatch.setattr(module, name, compiled)
    env = ("XLA_FLAGS", "JAX_PLATFORMS", "HYBRIDPAR_PLAN_DEVICES")
    return main_here(plan.main, args, capsys, monkeypatch, env)


def _metrics_file(path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


_TRAIN = {"event": "train", "image_size": 16, "global_batch": 32, "images_per_s": 1000.0}


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--overlap", "3"], ["--overlap=3", "[0, 1]"]),
        (["--overlap", "-0.5"], ["--overlap=-0.5", "[0, 1]"]),
        (["--cache-dir", "{file}"], ["--cache-dir", "is a file", "--no-cache"]),
        (["--cache-dir", "{file}/sub"], ["--cache-dir", "--no-cache"]),
        (["--calibrate-from", "{tmp}/missing.jsonl"], ["--calibrate-from", "no such file"]),
        (["--calibrate-from", "{no_train}"], ["--calibrate-from", "no train lines"]),
        (["--calibrate-from", "{bad_rate}"], ["--calibrate-from", "not a measured rate"]),
        (["--calibrate-devices", "0", "--calibrate-from", "{tmp}/m.jsonl"],
         ["--calibrate-devices=0", ">= 1"]),  # fmt: skip
        (["--comm", "bucketed:abc"], ["--comm 'bucketed:abc'", "--comm xla,overlap:4"]),
        (["--comm", "xla,overlap:0"], ["--comm 'overlap:0'", "--comm xla,overlap:4"]),
        (["--comm", "overlap:inf"], ["--comm 'overlap:inf'", "--comm xla,overlap:4"]),
        (["--comm", "xla,bucketed:-4"], ["--comm 'bucketed:-4'", "--comm xla,overlap:4"]),
        (["--devices", "100000"], ["--devices=100000", "at most 4096", "--target tpu:"]),
        (["--devices", "4097"], ["--devices=4097", "at most 4096", "--target tpu:"]),
        # with stages a run never uses global_batch: a batch plan would change nothing
        (["--config.stages=1:8-4,2:16-8", "--config.num_epochs=2", "--per-device-batch", "4,8"],
         ["--per-device-batch", "stages", "--config.stages"]),  # fmt: skip
        (["--images-per-epoch", "0"], ["--images-per-epoch=0", ">= 1"]),
        # what simulate refuses on a TPU preset (it priced these, DCN at ICI speed)
        (["--hardware", "tpu-v6e", "--devices", "512"], ["--devices 512", "no DCN bandwidth"]),
        (["--hardware", "tpu-v5e", "--devices", "384"], ["--devices 384", "e.g. 256 or 512"]),
        (["--hardware", "tpu-v5e", "--overlap", "0.5"], ["--overlap", "hides none", "drop"]),
        # a list given empty: was every factorisation (22 plans compiled), every head, ...
        (["--meshes", ""], ["--meshes '': no meshes given", "e.g. --meshes 'data:-1 fsdp:-1'"]),
        (["--heads", ""], ["--heads '': no values given", "e.g. --heads dense,sharded"]),
        (["--comm", ","], ["--comm ',': no values given", "e.g. --comm xla,overlap:4"]),
        # --no-cache keeps nothing: a --cache-dir beside it was silently unused
        (["--no-cache"], ["--cache-dir", "is not used with --no-cache"]),
        (["--cache-dir", ""], ["--cache-dir '' names no directory"]),
        # one combination, said in the singular
        (["--meshes", "data:8", "--heads", "sharded", "--bn-sync", "global", "--comm", "xla"],
         ["(1 combination, ruled out: 1 (the sharded head"]),  # fmt: skip
        # every plan's set-up would refuse it: one line, not a worker per plan first
        (["--config.partitioning.rules=((r'head/kernel$', (None, 'bogus')),)"],
         ["names mesh axis 'bogus'", "('data', 'fsdp', 'model')"]),  # fmt: skip
        # a logical rule's axis likewise (every plan's set-up refused it, one by one)
        (["--config.partitioning.logical_rules=(('classes', 'bogus'),)"],
         ["partitioning.logical_rules", "names mesh axis 'bogus'", "('data', 'fsdp', 'model')"]),
    ],
)
def test_bad_flags_are_refused_before_anything_compiles(tmp_path, capsys, monkeypatch, extra, says):
    """Each is one ``error:`` line naming the flag, exit 2, before a progress line or a
    compile: not a traceback or an error after every plan compiled."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    paths = {
        "tmp": str(tmp_path),
        "file": str(afile),
        "no_train": _metrics_file(tmp_path / "eval.jsonl", [{"event": "eval", "top1": 0.5}]),
        "bad_rate": _metrics_file(tmp_path / "neg.jsonl", [dict(_TRAIN, images_per_s=-5.0)]),
    }
    cache = tmp_path / "cache"
    args = [*ARGS, "--cache-dir", str(cache), *(a.format(**paths) for a in extra)]
    code, stdout, stderr = _plan_refusing_to_compile(args, monkeypatch, capsys)
    assert code == 2 and stdout == "", stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr  # no "plan:" line first
    assert all(s in lines[0] for s in says), lines[0]
    assert not cache.exists()  # not even made (it was, before the config's checks)


def test_good_flags_get_as_far_as_compiling(tmp_path, capsys, monkeypatch):
    """The control: at the limits the checks allow (overlap 1, 4,096 is the bound, a usable
    calibration file and cache dir), plan reaches its compile entry point, so the refusals
    above are the checks' and the stand-in is on the path that compiles."""
    metrics = _metrics_file(tmp_path / "metrics.jsonl", [_TRAIN] * 3)
    cache = tmp_path / "new" / "cache"
    args = [*ARGS, "--overlap", "1", "--comm", "xla,overlap:0.5", "--calibrate-from", metrics,
            "--calibrate-devices", "8", "--cache-dir", str(cache)]  # fmt: skip
    with pytest.raises(_Compiled):
        _plan_refusing_to_compile(args, monkeypatch, capsys)
    assert cache.is_dir()  # made before compiling
    assert plan.calibration_points(metrics, 8) == [(16, 4.0, 125.0)]
    from hybridpar.tools import comm_report

    comm_report.check_virtual_devices(4096, "--devices=4096")  # the bound itself passes


# (extra overrides, the plan's mesh, its rejected axis): the preset's logical rule for the
# classes on model:4; the config's own logical rule, the same way (its own path rules too)
RULED_OUT = [
    ({}, (("data", 2), ("fsdp", 1), ("model", 4)), "model"),
    ({"partitioning.preset": "data", "partitioning.logical_rules": "(('classes', 'fsdp'),)"},
     (("data", 2), ("fsdp", 4), ("model", 1)), "fsdp"),
]  # fmt: skip


@pytest.mark.parametrize("extra, mesh, axis", RULED_OUT, ids=["preset", "logical_rules"])
def test_a_plan_the_rules_rule_out_is_cached_and_not_set_up_again(
    tmp_path, monkeypatch, extra, mesh, axis
):
    """data:2,model:4 with the dense head: its 10-class bias does not divide the model axis
    (the hybrid preset's logical rule puts the classes there; a config's own logical rule
    on fsdp:4 likewise). The set-up says so before compiling; the verdict is cached like a
    report, so a second call neither compiles nor sets it up again."""
    monkeypatch.setenv("HYBRIDPAR_PLAN_DEVICES", "8")  # the worker's 8 devices (XLA_FLAGS)
    overrides = [(k, str(v)) for k, v in {**TINY, **extra}.items()]  # the worker's too
    config = cli.load(DIGITS, overrides)
    c = plan.Candidate(mesh, "dense", "global", "xla", 4, "float32")
    said = []
    first = plan.compile_plans(DIGITS, config, overrides, [c], 8, 1, tmp_path, said.append)
    assert first[c].get("ruled_out"), first[c]
    assert f"does not divide mesh axis '{axis}'" in first[c]["error"]
    assert any("compiling 1 plan for" in s for s in said)  # (it said "1 plans")
    said.clear()
    again = plan.compile_plans(DIGITS, config, overrides, [c], 8, 1, tmp_path, said.append)
    assert again[c]["from_cache"] and again[c]["error"] == first[c]["error"]
    assert not any("compiling" in s for s in said), said


def test_a_damaged_cache_file_is_compiled_again_not_a_traceback(tmp_path):
    """The cache is a shortcut: a file cut short (a full disk, a kill) or not a report is
    one line and that plan compiled again, not a JSON traceback after the other plans."""
    said = []
    for text in ('{"memory_per_device_bytes": 1', "[1, 2]", ""):
        path = tmp_path / "k.json"
        path.write_text(text)
        assert plan.cached_report(path, said.append) is None
    assert len(said) == 3 and all("compiling that plan again" in s for s in said)
    path.write_text(json.dumps({"total_bytes": 5}))
    assert plan.cached_report(path, said.append) == {"total_bytes": 5} and len(said) == 3


def test_a_plans_warnings_are_one_line_each_in_plans_voice(tmp_path, monkeypatch):
    """A worker's Python warnings (the set-up's fsdp warning) come back with its report,
    each once and on one line, and plan says each once per mesh as ``warning: MESH: ...``,
    from the cache too: not Python's ``file.py:449: UserWarning`` and source line among the
    progress lines (planted: compile_one without catching them)."""
    import warnings

    from hybridpar.tools import comm_report

    class Report:
        def to_dict(self):
            return {"total_bytes": 5}

    def report(config, **kwargs):  # a stand-in: the compile's warning, twice, no compile
        # (two lines and two texts: Python's own filter would drop a repeat of one line)
        warnings.warn("2 arrays stay whole\n  on every device", UserWarning, stacklevel=1)
        warnings.warn("2 arrays stay whole on every device", UserWarning, stacklevel=1)
        return Report()

    monkeypatch.setattr(comm_report, "report", report)
    monkeypatch.setenv("HYBRIDPAR_PLAN_DEVICES", "8")
    rep = plan.compile_one(DIGITS, [("mesh", "fsdp:4,model:2")])
    assert rep == {"total_bytes": 5, "warnings": ["2 arrays stay whole on every device"]}
    # two plans on the mesh, both from the cache: said once, and not left in the results
    config = cli.load(DIGITS, [])
    plans = [plan.Candidate((("data", 1), ("fsdp", 4), ("model", 2)), head, "global", "xla",
                            16, "float32") for head in ("dense", "sharded")]  # fmt: skip
    for c in plans:
        plan_config = cli.load(DIGITS, list(c.overrides().items()))
        key = plan.cache_key(plan_config, 8, plan.source_hash())
        (tmp_path / f"{key}.json").write_text(json.dumps(rep))
    said = []
    results = plan.compile_plans(DIGITS, config, [], plans, 8, 1, tmp_path, said.append)
    assert [s for s in said if s.startswith("warning")] == [
        "warning: fsdp:4,model:2: 2 arrays stay whole on every device"
    ]
    assert all(r == {"total_bytes": 5, "from_cache": True} for r in results.values()), results


def test_a_plans_warnings_are_read_not_taken_from_its_report(tmp_path, monkeypatch):
    """Saying a plan's warnings leaves its report as it is (they were popped from it and
    put back for the cache): a compiled plan's results have none (the ranking's report has
    no such key), its cache file keeps them, and a second call says them from there
    (planted: warning_lines popping them). Compiled by a stand-in in a thread, no JAX."""
    import concurrent.futures

    rep = {"memory_per_device_bytes": 1, "total_bytes": 5, "compile_s": 1.0,
           "warnings": ["2 arrays stay whole on every device"]}  # fmt: skip
    c = plan.Candidate((("data", 1), ("fsdp", 8), ("model", 1)), "dense", "global", "xla", 4,
                       "float32")  # fmt: skip
    assert plan.warning_lines(c, rep, set()) == [
        "warning: fsdp:8: 2 arrays stay whole on every device"]  # fmt: skip
    assert rep["warnings"] == ["2 arrays stay whole on every device"]  # left in the report
    monkeypatch.setattr(plan, "compile_one", lambda path, overrides: dict(rep))

    def threads(jobs, **kwargs):  # the workers' pool, as threads of this process
        return concurrent.futures.ThreadPoolExecutor(jobs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", threads)
    monkeypatch.setenv("HYBRIDPAR_PLAN_DEVICES", "8")
    config = cli.load(DIGITS, [])
    for from_cache in (False, True):
        said = []
        results = plan.compile_plans(DIGITS, config, [], [c], 8, 1, tmp_path, said.append)
        want = {k: v for k, v in rep.items() if k != "warnings"}
        assert results[c] == dict(want, from_cache=from_cache)
        assert "warning: fsdp:8: 2 arrays stay whole on every device" in said
        (cached,) = tmp_path.glob("*.json")
        assert json.loads(cached.read_text()) == rep  # the cache keeps them


# plan's main up to its compiles in a fresh Python, as `python -m hybridpar.plan` starts:
# what the workers would inherit (JAX sets the level to 1 when it starts, unless set)
_LOG_LEVEL_AT_COMPILE = f"""
import os, sys
from hybridpar.tools import plan
def compile_plans(*args, **kwargs):
    print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
    sys.exit(0)
plan.compile_plans = compile_plans
plan.main({[*ARGS, "--no-cache"]!r})
"""


@pytest.mark.parametrize("user, want", [(None, "2"), ("0", "0")], ids=["default", "user's"])
def test_xlas_cpp_warnings_stay_off_the_terminal_unless_asked(user, want):
    """The workers compile with XLA's C++ log level at 2 (errors only; the SPMD
    partitioner's warning line per compile is noise among plan's progress lines), set
    before JAX starts so they inherit it, unless the user set TF_CPP_MIN_LOG_LEVEL
    (planted: JAX's default of 1, which lets the warnings through). A Python of its own:
    in this one JAX has started."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if user is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = user
    r = subprocess.run([sys.executable, "-c", _LOG_LEVEL_AT_COMPILE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [want], r.stdout
