"""Compiling for a pod without one: ``--target`` specs, and the TPU compiler (libtpu's
ahead-of-time path) on the tiny digits ResNet for a ``v5e`` topology of 8 chips.

* Target specs parse to Cloud TPU's slice shapes (v4/v5p count TensorCores, v5e/v6e chips),
  and a bad spec is one error saying what is accepted.
* The same program compiled for the TPU topology on ``data``, ``fsdp`` and ``data x model``
  meshes: per-chip memory from the TPU compiler (FSDP's parameters and optimizer state a
  fraction of data parallelism's), its collectives, FLOPs and a bound on the step time.
* A program over the chip's HBM is refused, naming its need, the capacity, and a batch the
  compiler accepts on that mesh.

libtpu comes with the ``tpu-aot`` extra, which the test extra installs; without it these
tests skip (and fail where ``CI`` is set).
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DIGITS, NO_LLVM_OPT, compile_tiny, main_here, tiny_digits

from hybridpar.config.cli import ACCELERATOR_FILES
from hybridpar.config.errors import ConfigError
from hybridpar.tools import targets

ROOT = Path(__file__).resolve().parents[1]
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU and not os.environ.get("CI"),
    reason='libtpu missing: pip install -e ".[tpu-aot]"',
)


@pytest.mark.parametrize(
    "spec,chips,shape,slices",
    [
        ("tpu:v5e-8", 8, (2, 4), 1),
        ("tpu:v5e-16", 16, (4, 4), 1),
        ("tpu:v6e-64", 64, (8, 8), 1),
        ("tpu:v5p-128", 64, (4, 4, 4), 1),  # 128 TensorCores
        ("tpu:v4-256", 128, (4, 4, 8), 1),
        ("tpu:v5p-8,slices=2", 4, (2, 2, 1), 2),  # 4 chips per slice
    ],
)
def test_targets_follow_cloud_tpu_names(spec, chips, shape, slices):
    t = targets.parse(spec)
    assert (t.devices_count, t.shape, t.slices) == (chips * slices, shape, slices)


@pytest.mark.parametrize(
    "spec,expect",
    [
        ("tpu:v9-8", "unknown TPU version 'v9'"),
        ("tpu:v5p-7", "multiple of 2"),
        ("tpu:v5e-12", "no v5e slice of 12 chips"),
        ("gpu:8", "is not a target"),
        ("cpu:0", "at least one device"),
    ],
)
def test_a_bad_target_says_what_is_accepted(spec, expect):
    with pytest.raises(ConfigError, match="tpu:CHIP-N|one of") as e:
        targets.parse(spec)
    assert expect in str(e.value)


@pytest.mark.parametrize(
    "spec,expect",
    [("tpu:v5e-8,slices=0", "slices=S is how many slices"), ("gpu:h100-0", "at least one GPU")],
)
def test_a_zero_count_says_at_least_one(spec, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        targets.parse(spec)
    assert "multiple of" not in str(e.value) and "up to" not in str(e.value)


@pytest.mark.parametrize(
    "recipe",
    ["resnet50_imagenet.py", "resnet50_imagenet_mlperf.py", "resnet50_imagenet_dawnbench.py",
     "resnet50_imagenet_ffcv.py"],
)  # fmt: skip
def test_the_imagenet_recipes_eval_batch_divides_every_power_of_two_pod(recipe):
    """``compile --config experiments/resnet50_imagenet_mlperf.py --target tpu:v5e-64`` was
    refused: eval_batch=1000 does not divide over 64 data-parallel devices (nor over any
    power of two from 16). Checked as the set-up checks it, up to the largest TPU target
    (4,096 chips), nothing compiled."""
    from hybridpar.config.schema import load_config
    from hybridpar.parallel.mesh import check_divides

    c = load_config(str(ROOT / "experiments" / recipe))
    for k in range(13):
        check_divides(c.eval_batch, 2**k, "--config.eval_batch=", f"data:{2**k}")


@pytest.mark.parametrize("spec", ["TPU:V5E-16", "tpu:v5e-16 ", " tpu:V5e-16\t"])
def test_a_target_is_read_without_case_or_surrounding_spaces(spec):
    """``tpu:V5E-16`` was refused; ``"tpu:v5e-16 "`` was taken, its space kept in the
    target the report and the --out file name. Both are tpu:v5e-16, named so."""
    t = targets.parse(spec)
    assert (t.spec, t.devices_count, t.shape) == ("tpu:v5e-16", 16, (4, 4))


@pytest.mark.parametrize(
    "stages,dp,kind,batch,size,flag",
    [
        # the stage string with that stage's batch (per device) replaced, the rest as it was
        ("10:32-32768", 1, "train", 32768, 32, "--config.stages=10:32-8485"),
        ("0.15:16-8@0.5,0.3:24-8~0.9", 8, "train", 64, 24,
         "--config.stages=0.15:16-8@0.5,0.3:24-5~0.9"),
        ("", 8, "train", 64, 16, "--config.global_batch=40"),
        ("10:32-32768", 1, "eval", 1000, 32, "--config.eval_batch=40"),
    ],
)  # fmt: skip
def test_the_batch_that_fits_hbm_is_said_as_a_flag_to_paste(stages, dp, kind, batch, size, flag):
    """The over-HBM error said "global_batch (or the stage's batch)=8485 compiles on this
    mesh" for cifar10_fast with --config.stages=10:32-32768 on gpu:h100-1: nothing to paste.
    Now the flag itself; with stages, the stage string with that stage's batch in it."""
    from hybridpar.tools.compile import batch_flag

    config = tiny_digits(mesh=f"data:{dp}", stages=stages)
    trial = {"--config.stages=10:32-8485": 8485}.get(flag, 40)
    assert batch_flag(config, dp, kind, batch, size, trial) == flag


def test_a_mesh_of_another_size_names_a_target_of_its_size():
    from hybridpar.tools.targets import target_hint

    hint = target_hint(targets.parse("tpu:v5e-4,slices=2"), "data:16")
    assert hint == "--target tpu:v5e-4,slices=2 is 8 chips; --target tpu:v5e-8,slices=2 has 16"
    assert target_hint(targets.parse("cpu:8"), "data:4,model:4").startswith("--target cpu:16")


def _program(name, batch, size, total, flops, coll):
    """One program's row of a compile report, with what the text report reads."""
    return dict(program=name, batch=batch, image_size=size, memory={"total": total, "temp": 0},
                flops=flops, bytes_accessed=1, collective_ops=1, collective_bytes=coll,
                async_collective_ops=0, bytes_exposed=coll, bytes_overlapped=0, ops_overlapped=0,
                ops_exposed=1, overlap=[], compile_s=1.0,
                max_images_per_s_per_chip=9.0)  # fmt: skip


def test_the_last_line_gives_the_largest_programs_figures():
    from hybridpar.tools.compile import format_report

    report = dict(
        mesh={"data": 8}, target_description="t", wall_s=1.0, slices=1, axes_across_slices=[],
        out=None, hbm_bytes_per_chip=None, target="cpu:8",
        programs=[_program("train", 32, 24, 100, 24e9, 240),
                  dict(_program("train", 32, 32, 200, 32e9, 320), bytes_hidden_est=64),
                  _program("eval", 64, 32, 150, 8e9, 80)],
    )  # fmt: skip
    line = format_report(report, "c.py").splitlines()[-1]
    last = dict(kv.split("=", 1) for kv in line.split())
    assert last["largest"] == "train:b32:32px"
    assert (last["flops_per_chip"], last["collective_bytes"], last["exposed_bytes"]) == (
        str(32e9), "320", "320")  # fmt: skip
    assert last["hidden_bytes_est"] == "64"


@pytest.mark.parametrize("rate", [9.0, None])
def test_the_bound_note_comes_only_with_a_bound(rate):
    from hybridpar.tools.compile import format_report

    report = dict(
        mesh={"data": 8}, target_description="t", wall_s=1.0, slices=1, axes_across_slices=[],
        out=None, hbm_bytes_per_chip=None, target="cpu:8",
        programs=[dict(_program("train", 32, 32, 200, 32e9, 320),
                       max_images_per_s_per_chip=rate),
                  dict(_program("eval", 64, 32, 150, 8e9, 80),
                       max_images_per_s_per_chip=None)],
    )  # fmt: skip
    text = format_report(report, "c.py")
    assert ("\nmax img/s/chip: " in text) == (rate is not None)


@pytest.mark.parametrize("kind", ["train", "eval"])
def test_every_programs_row_has_a_bound_where_it_has_a_step(kind):
    """The eval step's batch is its images a step, as the train step's: its row has the
    most images/s per chip beside its bound, not null and "-" in the table (planted: the
    rate for train rows only). The bound is the FLOPs at the chip's peak alone: XLA's bytes
    accessed, here 6 ms at v5e's HBM bandwidth, overstate the HBM traffic (whole measured
    steps take less), so they bound nothing and are reported beside it (planted: the longer
    of the two, as before, 2,667 img/s). A hand-written record, nothing compiled."""
    from hybridpar.tools.compile import program_row

    v5e = targets.parse("tpu:v5e-8")
    rec = {"compile_s": 1.0, "memory_per_device_bytes": {"total": 100, "temp": 0}}
    cost = {"flops": 197e9, "bytes_accessed": 6e-3 * v5e.chip.hbm_bytes_per_s}
    row = program_row(kind, 128, 32, rec, "HloModule m", cost, v5e)
    assert row["flops_bound_step_s"] == pytest.approx(1e-3)  # 1 ms at v5e's bfloat16 peak
    assert row["max_images_per_s_per_chip"] == 16000.0  # 128 / 8 chips / 1 ms
    assert row["bytes_accessed_s"] == pytest.approx(6e-3)
    cpu = program_row(kind, 128, 32, rec, "HloModule m", cost, targets.parse("cpu:8"))
    assert cpu["flops_bound_step_s"] is None and cpu["max_images_per_s_per_chip"] is None
    assert cpu["bytes_accessed_s"] is None


def test_the_report_calls_the_flops_a_bound_and_the_bytes_none():
    """compile printed "roofline img/s/chip" from the longer of the FLOPs at peak and XLA's
    bytes accessed at HBM bandwidth, "real steps are slower": for ResNet-50 on tpu:v5e-64
    the bytes' 38 ms against the FLOPs' 6.2 ms, though that count overstates the traffic.
    Now the column is the FLOPs' bound, and the bytes' time is said as what it is."""
    from hybridpar.tools.compile import format_report

    train = dict(_program("train", 3264, 224, 200, 1228e9, 320), max_images_per_s_per_chip=8199.7,
                 flops_bound_step_s=6.22e-3, bytes_accessed_s=38.0e-3)  # fmt: skip
    report = dict(
        mesh={"data": 64}, target_description="t", wall_s=1.0, slices=1, axes_across_slices=[],
        out=None, hbm_bytes_per_chip=2**34, target="tpu:v5e-64", programs=[train],
    )
    lines = format_report(report, "c.py").splitlines()
    assert lines[4].endswith("max img/s/chip") and lines[5].endswith(" 8199.7")
    assert "a bound no step beats" in "\n".join(lines) and "real steps" not in "\n".join(lines)
    assert (
        "  XLA's bytes accessed at HBM bandwidth would take 38 ms a step (train b3264 224px; "
        "its FLOPs 6.22 ms): no bound, that count is more than the HBM traffic "
        "(docs/scaling.md)"
    ) in lines
    assert "max_images_per_s_per_chip=8199.7" in lines[-1]


def test_the_write_line_comes_after_the_whole_report_and_says_what_it_replaces():
    """The line "writing the N programs to FILE" came before the HBM and roofline notes: the
    report is whole first, then the write line, then the key=value line."""
    from hybridpar.tools.compile import format_report

    report = dict(
        mesh={"data": 8}, target_description="t", wall_s=1.0, slices=1, axes_across_slices=[],
        out="F", replacing=True, hbm_bytes_per_chip=2**34, target="tpu:v5e-8",
        programs=[_program("train", 32, 32, 200, 32e9, 320),
                  _program("eval", 64, 32, 150, 8e9, 80)],
    )  # fmt: skip
    lines = format_report(report, "c.py").splitlines()
    assert lines[-2] == "writing the 2 programs to F (replacing the file there)"
    assert lines[-3].startswith("max img/s/chip: ") and lines[-4].startswith("  (HBM per chip: ")
    assert lines[-1].startswith("memory_per_chip_bytes=")
    lines = format_report(dict(report, replacing=False), "c.py").splitlines()
    assert lines[-2] == "writing the 2 programs to F"


@pytest.fixture(scope="module")
def v5e_8():
    target = targets.parse("tpu:v5e-8")
    targets.prepare(target)
    return target


@needs_libtpu
def test_the_tpu_compiler_reports_per_chip_memory_collectives_and_flops(v5e_8):
    reports = {m: compile_tiny(v5e_8, m) for m in ("data:8", "fsdp:8", "data:4,model:2")}
    for mesh, rep in reports.items():
        assert "TPU v5e" in rep["target_description"] and rep["hbm_bytes_per_chip"] == 16 * 2**30
        assert (rep["device_platform"], rep["device_kind"]) == ("tpu", "TPU v5 lite")
        train, evals = rep["programs"]
        assert (train["program"], evals["program"]) == ("train", "eval")
        for r in (train, evals):
            assert 0 < r["memory"]["total"] < 16 * 2**30, (mesh, r["memory"])
            assert r["flops"] > 0 and r["bytes_accessed"] > 0
        # gradients cross the chips in every layout; the bound is finite
        assert train["collective_ops"] > 0 and train["collective_bytes"] > 0, mesh
        assert train["max_images_per_s_per_chip"] > 0
    # FSDP shards parameters and optimizer state over the 8 chips: the train step's
    # arguments (the state, plus this chip's share of the batch) are a fraction of data
    # parallelism's, where every chip holds all of it; the model axis halves some kernels.
    # the TPU compiler overlaps FSDP's weight gathers with compute (async collective fusions)
    fsdp_train = reports["fsdp:8"]["programs"][0]
    assert fsdp_train["async_collective_ops"] > 0
    # ... and the scheduled HLO says what with: convolutions between those gathers' start
    # and done; data parallelism's all-reduces are synchronous, every byte exposed.
    for r in (rep["programs"][0] for rep in reports.values()):
        assert r["bytes_overlapped"] + r["bytes_exposed"] == r["collective_bytes"]
        assert len(r["overlap"]) == r["collective_ops"]
    hidden = [e for e in fsdp_train["overlap"] if not e["exposed"]]
    assert hidden and all(e["async"] and e["kind"] == "all-gather" for e in hidden)
    assert any("convolution" in e["overlaps"] and e["flops"] > 0 for e in hidden)
    assert fsdp_train["bytes_overlapped"] == sum(e["bytes"] for e in hidden)
    dp_train = reports["data:8"]["programs"][0]
    assert dp_train["bytes_exposed"] == dp_train["collective_bytes"]
    assert not any(e["async"] for e in dp_train["overlap"])
    args = {m: r["programs"][0]["memory"]["arguments"] for m, r in reports.items()}
    assert args["fsdp:8"] < 0.5 * args["data:8"]
    assert args["data:4,model:2"] < args["data:8"]


@needs_libtpu
def test_a_program_compiled_here_for_a_tpu_has_the_tpus_conv_gradients(v5e_8):
    """``model.conv_grad=auto`` goes by the devices a program is for, not this process's CPU
    backend: a TPU (or GPU) program compiled here computes kernel gradients as that chip's
    compiler does, not in XLA:CPU's im2col form (which changed the memory and collectives
    such a compile reports). Planted bug that fails it: the platform left out."""
    from hybridpar.runtime.run import setup

    tpu = setup(tiny_digits(mesh="data:8"), with_data=False, devices=v5e_8.devices())
    cpu = setup(tiny_digits(mesh="data:8"), with_data=False)
    assert (tpu.program.model.im2col_grad, cpu.program.model.im2col_grad) == (False, True)


@needs_libtpu
def test_a_tpu_compile_leaves_the_persistent_cache_alone(v5e_8):
    """JAX's persistent cache is on in this process (conftest, as a user's
    JAX_COMPILATION_CACHE_DIR would be), and a compile-only client cannot read back what it
    would write there: the second compile for the TPU warned "Error reading persistent
    compilation cache entry" for each program and compiled again. So compiles for a
    described device skip the cache: nothing written, nothing warned; and the cache still
    takes this process's own programs afterwards."""
    import warnings

    import jax
    import jax.numpy as jnp

    cache = jax.config.jax_compilation_cache_dir
    assert cache, "the suite runs with JAX's persistent cache on (conftest)"

    def entries():
        return sorted(p for p in Path(cache).rglob("*") if p.is_file())

    before = entries()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compile_tiny(v5e_8, "data:8", **{"data.num_classes": 11})  # a program new here
    assert not [w for w in caught if "compilation cache" in str(w.message)], caught
    assert entries() == before
    was = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # the control: a program of this process's own CPU devices is written
        jax.jit(lambda x: jnp.sin(x) * 3.25 - 1.5).lower(jnp.ones((7, 13))).compile()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", was)
    assert len(entries()) > len(before)


@needs_libtpu
def test_the_tpu_compiler_reduces_xla_modes_gradients_in_bfloat16(v5e_8):
    """comm.reduce_dtype=bfloat16 under comm.mode=xla, as the TPU compiler places it: the
    gradients cross the chips in one all-reduce of 2 bytes a parameter, where the float32
    step's all-reduces carry 4; the rest (loss, BatchNorm statistics) is float32 in both."""
    import jax

    from hybridpar.runtime.run import setup

    train = {}
    for rd in ("float32", "bfloat16"):
        train[rd] = compile_tiny(v5e_8, "data:8", **{"comm.reduce_dtype": rd})["programs"][0]
    run = setup(tiny_digits(mesh="data:8"), with_data=False, devices=v5e_8.devices())
    params = sum(x.size for x in jax.tree.leaves(run.program.abstract.params))
    bf16 = [r for r in train["bfloat16"]["collectives"] if r["kind"] == "all-reduce"]
    assert [r["bytes"] for r in bf16].count(2 * params) == 1
    f32 = sum(
        r["total_bytes"] for r in train["float32"]["collectives"] if r["kind"] == "all-reduce"
    )
    assert f32 >= 4 * params  # every gradient at float32 width (a few beside BN statistics)
    # the whole step's bytes about halve
    assert train["bfloat16"]["collective_bytes"] < 0.55 * train["float32"]["collective_bytes"]


@needs_libtpu
def test_a_mesh_over_the_chips_hbm_is_refused_with_the_plan_that_fits(v5e_8):
    # A 40M-class head on the tiny trunk: 2.6e9 parameters, replicated on data:8 with their
    # gradients and momentum (~38 GiB per chip by the TPU compiler's count, against a
    # v5e's 16 GiB); sharded over the 8 chips (fsdp:8) they fit.
    with pytest.raises(ConfigError) as e:
        compile_tiny(v5e_8, "data:8", **{"data.num_classes": 40_000_000})
    msg = str(e.value)
    assert "the train step (batch 32, 16 px) needs" in msg and "15.75 GiB are available" in msg
    # the plan that fits, compiled by the TPU compiler on fsdp:8 to say so: under the 16 GiB
    fits = msg.split("--config.mesh=fsdp:-1 compiles it (")[1]
    assert float(fits.split(" GiB per chip")[0]) < 16


@needs_libtpu
def test_a_mesh_the_torus_cannot_tile_is_an_error_naming_one_that_can():
    """jax.make_mesh raises NotImplementedError (a traceback) for axis sizes that are not
    products of the torus' sides; the mesh builder says which sizes fit instead."""
    from hybridpar import make_mesh

    devices = targets.parse("tpu:v5p-128").devices()  # 64 chips, a 4x4x4 torus
    with pytest.raises(ConfigError) as e:
        make_mesh("data:8,fsdp:8", devices)
    assert str(e.value) == (
        "mesh 'data:8,fsdp:8' does not tile the 64 devices' 4x4x4 torus: each axis size must "
        "be a product of some of its sides (1, 4, 16, 64), and data=8, fsdp=8 are not; use "
        "e.g. --config.mesh=data:-1,fsdp:4")  # fmt: skip
    assert make_mesh("data:-1,fsdp:4", devices).shape["data"] == 16  # the example fits


@pytest.mark.parametrize(
    "target,expect",
    [
        ("tpu:v9-8", "error: --target tpu:v9-8: unknown TPU"),
        # over the bound: refused before the config's batches are checked
        ("cpu:4097", "error: --target cpu:4097: at most 4096 virtual CPU devices"),
    ],
)
def test_compile_cli_bad_target_is_one_error_line(target, expect):
    r = subprocess.run(
        [sys.executable, "-m", "hybridpar.compile", "--config", DIGITS, "--target", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith(expect), r.stderr
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "extra, expect",
    [
        # as simulate's --overwrite without --png: was a whole compile that wrote nothing
        (["--overwrite"], "error: --overwrite needs --out, the file it lets replace"),
        # an empty name was taken for no --out: compiled, then wrote nothing
        (["--out", ""], "error: --out '' names no file: pass the file"),
        (["--out", "", "--overwrite"], "error: --out '' names no file: pass the file"),
    ],
)
def test_compile_cli_flags_that_would_do_nothing_are_one_error_line(
    monkeypatch, capsys, extra, expect
):
    from hybridpar.tools import compile as tool

    def never(*a, **k):
        raise AssertionError("compiled before refusing the flags")

    monkeypatch.setattr(tool, "compile_programs", never)
    args = ["--config", DIGITS, "--target", "cpu:8", *extra]
    code, out, err = main_here(tool.main, args, capsys)
    assert code == 2 and out == "" and err.startswith(expect), err
    assert len(err.splitlines()) == 1


# ---- serialized executables: compile once, load in the run --------------------------------

DIGITS_TRAIN = 1437  # scikit-learn's digits: the 80% the digits job trains on


def _losses(workdir):
    import json

    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    return [r["loss"] for r in recs if r["event"] == "train"], [
        r for r in recs if r["event"] == "compile"
    ]


def test_a_run_loads_its_compiled_programs_and_trains_the_same_steps(
    tmp_path, capsys, monkeypatch
):
    """``compile --out`` (here for the 8 CPU devices) writes every program; a run given the
    file compiles nothing and trains step for step as a run that compiled them itself. The
    run that compiled them itself comes first, so the compile would find every program in
    JAX's persistent cache (the suite's is on): a program loaded from there serialized
    without its functions, and the loading run failed at its first step."""
    import jax

    assert jax.config.jax_compilation_cache_dir  # conftest's: the case needs a cache
    # Both compiles (the run's, the compile tool's) without LLVM's optimisations
    # (helpers.NO_LLVM_OPT, a large part of each compile): the same options, so the same programs
    # and the same steps; and every program written to the cache however quick its
    # compile, so the compile tool surely finds each there.
    monkeypatch.setattr(targets.Target, "compiler_options", lambda self: dict(NO_LLVM_OPT))
    min_s = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        _run_then_load(tmp_path, capsys)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)


def _run_then_load(tmp_path, capsys):
    from hybridpar.runtime import trainer
    from hybridpar.runtime.run import setup
    from hybridpar.tools.compile import compile_programs

    config = tiny_digits(mesh="data:4,model:2", stages="0.15:16-8,0.3:24-8", num_epochs=0.3)
    own = setup(config, str(tmp_path / "own"))
    own.program.compiler_options = NO_LLVM_OPT
    assert trainer.train(own)["completed"]
    out = str(tmp_path / "programs.bin")
    # without the data the plan (and so the LR schedule in the steps) comes from the data's
    # size: digits' is known, so the same config compiles a file that fits, with no flag
    report = compile_programs(config, targets.parse("cpu:8"), out=out)
    assert len(report["programs"]) == 3  # both stages' train steps and the eval step
    # the CPU run's own form, which comm_report --devices does not compile: said
    assert report["kernel_gradients"].startswith(
        "kernel gradients in the im2col form (model.conv_grad=auto on XLA:CPU)"
    )

    loaded = setup(config, str(tmp_path / "loaded"), compiled=out)
    assert len(loaded.program.compiles) == 3
    capsys.readouterr()
    assert trainer.train(loaded)["completed"]
    said = capsys.readouterr().out
    assert f"loaded 3 programs from {out} in " in said and "compiled " not in said
    (got, compiles), (want, _) = _losses(tmp_path / "loaded"), _losses(tmp_path / "own")
    assert len(got) == loaded.plan.total_steps and got == want
    assert len(compiles) == 3 and all(c["loaded_from"] == out for c in compiles)
    # the same command once more: finished, nothing to load (the data unread, its plan was
    # the nominal one, and the file was refused as another run's)
    assert setup(config, str(tmp_path / "loaded"), compiled=out).finished


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"mesh": "data:8"}, "mesh was {'data': 4, 'fsdp': 1, 'model': 2}"),
        # the config's first differing key, as a workdir of another config names it
        ({"optim.base_lr": 0.5}, "optim.base_lr was 0.4 when compiled (--target cpu:8), now 0.5"),
        ({"data.train_examples": 480}, "plan was [[0, 11, 44]] when compiled"),
    ],
)
def test_a_file_for_another_run_is_refused_or_recompiled(tmp_path, change, expect):
    from hybridpar.runtime.run import setup
    from hybridpar.tools.compile import compile_programs

    out = str(tmp_path / "programs.bin")
    common = {"mesh": "data:4,model:2", "data.train_examples": DIGITS_TRAIN}
    compile_programs(tiny_digits(**common), targets.parse("cpu:8"), out=out)
    config = tiny_digits(**{**common, **change})
    with pytest.raises(ConfigError, match="does not fit this run") as e:
        setup(config, with_data=False, compiled=out)
    assert expect in str(e.value) and "--recompile" in str(e.value)
    run = setup(config, with_data=False, compiled=out, recompile=True)
    assert run.program.compiles == []  # nothing loaded: the steps will compile here


def test_keys_only_the_host_reads_leave_a_compiled_file_valid(tmp_path):
    """When to evaluate and stop, the tuner's settings, and a distillation loss without a
    teacher change no program: a file compiled before such a default changed still loads.
    The loss with a teacher does change the step, and so its hash. Planted bugs that fail
    it: every key hashed; the distillation keys left out with a teacher too."""
    from hybridpar.runtime import executables
    from hybridpar.runtime.run import setup
    from hybridpar.tools.compile import compile_programs

    out = str(tmp_path / "programs.bin")
    common = {"mesh": "data:4,model:2", "data.train_examples": DIGITS_TRAIN}
    compile_programs(tiny_digits(**common), targets.parse("cpu:8"), out=out)
    host_only = {
        "tune.lr_max": 3.0,
        "target_top1": 0.5,
        "stop_at_target": True,
        "eval_every_epochs": 0.5,
        "distill.alpha": 0.7,
        "distill.temperature": 2.0,
    }
    run = setup(tiny_digits(**common, **host_only), with_data=False, compiled=out)
    assert run.program.compiles and all(c["loaded_from"] == out for c in run.program.compiles)

    teacher = {**common, "distill.teacher_workdir": str(tmp_path / "teacher")}
    hashes = {executables.config_hash(tiny_digits(**teacher, **{"distill.alpha": a}))
              for a in (0.5, 0.7)}  # fmt: skip
    assert len(hashes) == 2


# What a file records, each compared on load: a field left out of the comparison would let
# a program for another device, config or compiler run.
# The placement: a file compiled before hybridpar's rules placed the same config otherwise
# was taken, and the first step failed with JAX's traceback (its shardings disagreed).
HEADER_FIELDS = ("format", "platform", "device_kind", "devices", "mesh", "config_hash",
                 "config", "placement", "plan", "jax", "jaxlib")  # fmt: skip


def test_every_field_of_a_files_header_is_checked(tmp_path):
    import pickle

    from hybridpar.runtime import executables
    from hybridpar.runtime.run import setup
    from hybridpar.tools.compile import compile_programs

    out = tmp_path / "programs.bin"
    compile_programs(tiny_digits(), targets.parse("cpu:8"), out=str(out))
    saved = pickle.loads(out.read_bytes())

    def program():  # the run's, planned without reading the data
        config = tiny_digits(**{"data.train_examples": DIGITS_TRAIN})
        return setup(config, with_data=False).program

    assert executables.load(str(out), program()) == 2  # as written, it fits
    for field in HEADER_FIELDS:
        changed = {**saved["header"], field: "changed"}
        if field == "config":  # one key of it: named as the trainer names a workdir's
            changed[field] = {**saved["header"]["config"], "seed": -1}
        (tmp_path / field).write_bytes(pickle.dumps({**saved, "header": changed}))
        with pytest.raises(ConfigError, match="does not fit this run") as e:
            executables.load(str(tmp_path / field), program())
        want = "seed was -1" if field == "config" else f"{field} was 'changed'"
        assert want in str(e.value), (field, str(e.value))
    # the compilers' versions, compared where the run has one (not libtpu on a CPU run)
    here = executables.describe(program())
    for field in ("libtpu", "cuda_plugin"):
        now = {**here, field: "1.0"}
        header = {**now, "format": executables.FORMAT, field: "0.9"}
        assert executables.mismatches(header, now) == [(field, "0.9", "1.0")]
        assert executables.mismatches({**header, field: "0.9"}, {**now, field: None}) == []


def test_out_is_checked_before_anything_compiles(tmp_path, monkeypatch):
    from hybridpar.runtime import run
    from hybridpar.tools import compile as tool

    def never(*a, **k):
        raise AssertionError("set up (to compile) before checking --out")

    monkeypatch.setattr(run, "setup", never)
    (tmp_path / "a_file").write_text("")
    for out, expect in [(tmp_path / "a_file" / "programs.bin", "cannot write there"),
                        (tmp_path / "no" / "programs.bin", "No such file"),
                        (tmp_path, "is a folder"),
                        # one slash, also after a folder given as "dir/"
                        (f"{tmp_path}/", re.escape(f"e.g. {tmp_path}/programs.bin") + "$")]:
        with pytest.raises(ConfigError, match=expect):
            tool.compile_programs(tiny_digits(), targets.parse("cpu:8"), out=str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no .tmp left
    with pytest.raises(AssertionError, match="before checking"):  # a good --out: set up
        tool.compile_programs(tiny_digits(), targets.parse("cpu:8"), out=str(tmp_path / "p"))


def test_a_batch_over_one_epoch_is_refused_before_compiling():
    """The trainer refuses a global batch over one epoch of the training split (digits'
    1,437 images); compile planned from max(1437 // batch, 1) steps and compiled it
    (global_batch=131072 for tpu:v5e-8: 70 s). Now the trainer's error, before any program
    starts compiling."""
    from hybridpar.tools.compile import compile_programs

    said = []
    # the key to lower, named (the split's size is not known to a compile)
    over = (r"stage 0's global batch of 1440 is more than one epoch of the training split: "
            r"lower the batch \(--config.global_batch")  # fmt: skip
    with pytest.raises(ConfigError, match=over):
        compile_programs(tiny_digits(global_batch=1440), targets.parse("cpu:8"), say=said.append)
    assert said == []


def test_compile_says_each_program_as_it_starts_and_keeps_an_existing_out(tmp_path):
    """``compile`` printed nothing until every program was compiled (minutes for ResNet-50
    on a TPU target): a line as each starts, on stderr under --json (stdout stays one JSON
    object). An existing --out FILE was replaced silently: refused without --overwrite (as
    quantize's), before compiling; with it, replaced, and the report says so."""
    import json

    from helpers import TINY_DIGITS, config_args, run_compile_tool

    out = tmp_path / "programs.bin"
    out.write_text("an earlier compile")
    args = ["--config", DIGITS, *config_args({**TINY_DIGITS, "mesh": "data:8"}),
            "--target", "cpu:8", "--json", "--out", str(out)]  # fmt: skip
    r = run_compile_tool("hybridpar.compile", args)
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    err = r.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} exists (written "), err
    assert "pass --overwrite to replace it" in err[0]
    assert out.read_text() == "an earlier compile"

    r = run_compile_tool("hybridpar.compile", [*args, "--overwrite"])
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["out"] == str(out) and report["replacing"] is True
    said = [line for line in r.stderr.splitlines() if line.startswith("compil")]
    assert said[0::2] == [
        "compiling train b32 16px (1/2) ...", "compiling eval b120 16px (2/2) ..."]  # fmt: skip
    # and as each ends, its time (a ResNet-50 program's is minutes)
    assert [re.sub(r"in \d+\.\d s$", "in S s", line) for line in said[1::2]] == [
        "compiled train b32 16px in S s", "compiled eval b120 16px in S s"]  # fmt: skip
    assert out.read_bytes() != b"an earlier compile"


def test_a_failed_write_comes_after_the_report_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from hybridpar.runtime import executables
    from hybridpar.tools.compile import compile_programs

    events = []

    def full_disk(obj, f):
        events.append("write")
        f.write(b"part of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(executables.pickle, "dump", full_disk)
    out = tmp_path / "programs.bin"
    with pytest.raises(ConfigError, match="were not written .No space left on device"):
        compile_programs(tiny_digits(), targets.parse("cpu:8"), out=str(out),
                         show=lambda report: events.append(len(report["programs"])))  # fmt: skip
    assert events == [2, "write"]  # the report (2 programs) is out before the write fails
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .tmp


@needs_libtpu
def test_compile_cli_writes_tpu_programs_that_a_cpu_run_refuses(tmp_path):
    """As a user runs it: the tiny digits job compiled for tpu:v5e-8 with --out, its table
    and last line; the file then given to a training run on this machine's CPUs is one
    error naming the platform it was compiled for (it cannot run here). The buckets reduced
    from the backward pass, under the libtpu flags the config's comm section sets: some of
    the gradient's all-reduces compile asynchronous, and the file says under which flags."""
    import pickle

    from helpers import TINY_DIGITS, config_args

    out = tmp_path / "programs.bin"
    overlap = {"comm.mode": "overlap", "comm.bucket_mb": 0.1, "model.bn_sync": "local"}
    args = ["--config", DIGITS, *config_args({**TINY_DIGITS, "mesh": "data:8", **overlap})]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "hybridpar.compile", *args, "--target", "tpu:v5e-8"]
    mine = tmp_path / "programs.bin.tmp"  # the user's own file of that name: left as it is
    mine.write_text("mine")
    r = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert mine.read_text() == "mine" and len(list(tmp_path.iterdir())) == 2
    assert (
        "for TPU v5e v5e:2x4: 8 chips" in r.stdout
        and f"writing the 2 programs to {out}" in r.stdout
    )
    assert out.exists()
    last = dict(
        kv.split("=", 1) for kv in r.stdout.strip().splitlines()[-1].split(" ") if "=" in kv
    )
    assert last["target"] == "tpu:v5e-8" and int(last["memory_per_chip_bytes"]) > 0
    assert 0 < int(last["exposed_bytes"]) < int(last["collective_bytes"])
    flags = pickle.loads(out.read_bytes())["header"]["compiler_flags"]["LIBTPU_INIT_ARGS"]
    assert "--xla_enable_async_all_reduce=true" in flags.split()
    r = subprocess.run([sys.executable, "-m", "hybridpar.train", *args, "--workdir",
                        str(tmp_path / "run"), "--compiled", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --compiled") and "platform was 'tpu'" in r.stderr


@needs_libtpu
def test_plan_for_a_tpu_target_ranks_plans_compiled_by_the_tpu_compiler(
    tmp_path, monkeypatch, capsys
):
    import json

    from helpers import TINY_DIGITS, config_args

    from hybridpar.tools import plan

    args = ["--config", DIGITS, *config_args(TINY_DIGITS), "--target", "tpu:v5e-8"]
    args += ["--meshes", "data:8 fsdp:8", "--heads", "dense", "--bn-sync", "global"]
    args += ["--comm", "xla", "--cache-dir", str(tmp_path), "--json"]
    # The CLI in this process: for a target every plan compiles in a fresh worker process
    # of its own, so this one compiles nothing. The variables it sets are put back.
    env = ("XLA_FLAGS", "JAX_PLATFORMS", "HYBRIDPAR_PLAN_DEVICES", "HYBRIDPAR_PLAN_TARGET")
    code, said, err = main_here(plan.main, args, capsys, monkeypatch, env)
    assert code == 0, err[-2000:]
    out = json.loads(said.strip().splitlines()[-1])
    assert out["target"] == "tpu:v5e-8" and out["memory_limit_bytes"] == 16 * 2**30
    plans = out["plans"]
    assert {p["overrides"]["mesh"] for p in plans} == {"data:8", "fsdp:8"}
    for p in plans:
        assert p["compiled_for"] == "tpu (TPU v5 lite)" and 0 < p["memory_per_device_bytes"]
        assert p["predicted_images_per_s"] > 0 and "heuristic" in p["estimate"]
    steps = [p["predicted_time_to_train_s"] for p in plans]
    assert steps == sorted(steps)  # ranked by the estimate


@needs_libtpu
def test_on_several_slices_only_the_data_axis_crosses_them():
    """tpu:v5e-4,slices=2: 8 chips in two slices joined over DCN. The data axis is laid
    across the slices and fsdp/model within one (their collectives run every layer, on the
    fast links); a mesh whose data axis cannot span the slices is one error saying so."""
    target = targets.parse("tpu:v5e-4,slices=2")
    targets.prepare(target)
    rep = compile_tiny(target, "data:2,fsdp:4")
    assert rep["slices"] == 2 and rep["axes_across_slices"] == ["data"]
    assert all(0 < r["memory"]["total"] < 16 * 2**30 for r in rep["programs"])
    with pytest.raises(ConfigError, match="data=1 must be a multiple of 2"):
        compile_tiny(target, "fsdp:8")


@needs_libtpu
@pytest.mark.skipif(
    any(map(glob.glob, ACCELERATOR_FILES)), reason="this machine has an accelerator"
)
def test_the_tools_start_jax_on_the_cpu_without_libtpus_warnings():
    # with libtpu installed and JAX_PLATFORMS unset, JAX's start-up tries the TPU first and
    # libtpu prints its failed initialisation (a host it cannot find) before the CPU
    unset = ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    code = (
        "import jax; from hybridpar.config import cli; "
        "cli.main(lambda: print(jax.default_backend()))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "cpu", r.stderr[-2000:]
    assert "TPU" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_checking_an_out_file_leaves_the_users_files_alone(tmp_path):
    """``--out F`` is checked before compiling by writing a file beside it: one of this
    process's own name, never ``F.tmp``, which may be the user's."""
    from hybridpar.config.errors import ConfigError
    from hybridpar.runtime import executables

    mine = tmp_path / "prog.bin.tmp"
    mine.write_text("mine")
    executables.check_out(str(tmp_path / "prog.bin"))
    assert mine.read_text() == "mine" and sorted(tmp_path.iterdir()) == [mine]
    with pytest.raises(ConfigError, match="cannot write there"):
        executables.check_out(str(tmp_path / "no" / "prog.bin"))


def test_a_tpu_targets_command_starts_again_with_no_stack_limit():
    """libtpu 0.0.42.1 crashed (SIGSEGV, a thread's stack overflow) compiling the digits job
    for tpu:v6e-8 unless the process started under ``ulimit -s unlimited``; the compile
    tools' commands start again so (``targets.unlimited_stack_for_tpu``), once. Shown here
    on a process under an 8 MiB limit: with a tpu: target it runs again unlimited, its
    first lines once; without one it runs as it is. Planted bug that fails it: the call
    returning at once. (The crash itself takes a 75 s compile: checked by hand, see the
    function's comment.)"""
    code = (
        "import resource, sys\n"
        "print('start', flush=True)\n"
        "from hybridpar.tools import targets\n"
        "targets.unlimited_stack_for_tpu(sys.argv[1:])\n"
        "print(resource.getrlimit(resource.RLIMIT_STACK)[0] == resource.RLIM_INFINITY)\n"
    )
    import resource

    if resource.getrlimit(resource.RLIMIT_STACK)[1] != resource.RLIM_INFINITY:
        pytest.skip("the hard stack limit is set here: the tools leave the limit as it is")
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDPAR_STACK_RAISED"}
    limited = "import resource, os, sys; resource.setrlimit(resource.RLIMIT_STACK, " \
              "(8 << 20, resource.RLIM_INFINITY)); os.execv(sys.executable, sys.argv[1:])"
    for args, says in ((["--target", "tpu:v6e-8"], ["start", "start", "True"]),
                       (["--target=tpu:v5e-16"], ["start", "start", "True"]),
                       # not a target's: a path holding 'tpu:' (planted: any 'tpu:' fails it)
                       (["--config.data.dir=/mnt/tpu:x", "--target", "cpu:8"],
                        ["start", "False"])):  # fmt: skip
        r = subprocess.run([sys.executable, "-c", limited, sys.executable, "-c", code, *args],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0 and r.stdout.split() == says, (r.stdout, r.stderr)
