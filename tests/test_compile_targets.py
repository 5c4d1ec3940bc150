"""Compiling for a pod without one: ``--target`` specs, and the TPU compiler (libtpu's
ahead-of-time path) on the tiny digits ResNet for a ``v5e`` topology of 8 chips.

* Target specs parse to Cloud TPU's slice shapes (v4/v5p count TensorCores, v5e/v6e chips),
  and a bad spec is one error saying what is accepted.
* The same program compiled for the TPU topology on ``data``, ``fsdp`` and ``data x model``
  meshes: per-chip memory from the TPU compiler (FSDP's parameters and optimizer state a
  fraction of data parallelism's), its collectives, FLOPs and a roofline bound.
* A program over the chip's HBM is refused, naming its need, the capacity, and a batch the
  compiler accepts on that mesh.

libtpu comes with the ``tpu-aot`` extra, which the test extra installs; without it these
tests skip (and fail where ``CI`` is set).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DIGITS, tiny_digits

from hybridpar import targets
from hybridpar.errors import ConfigError

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


@pytest.fixture(scope="module")
def v5e_8():
    target = targets.parse("tpu:v5e-8")
    targets.prepare(target)
    return target


def _report(target, mesh, **overrides):
    from hybridpar.compile import compile_programs

    return compile_programs(tiny_digits(mesh=mesh, **overrides), target)


@needs_libtpu
def test_the_tpu_compiler_reports_per_chip_memory_collectives_and_flops(v5e_8):
    reports = {m: _report(v5e_8, m) for m in ("data:8", "fsdp:8", "data:4,model:2")}
    for mesh, rep in reports.items():
        assert "TPU v5e" in rep["target_description"] and rep["hbm_bytes_per_chip"] == 16 * 2**30
        assert (rep["device_platform"], rep["device_kind"]) == ("tpu", "TPU v5 lite")
        train, evals = rep["programs"]
        assert (train["program"], evals["program"]) == ("train", "eval")
        for r in (train, evals):
            assert r["fits"] and 0 < r["memory"]["total"] < 16 * 2**30, (mesh, r["memory"])
            assert r["flops"] > 0 and r["bytes_accessed"] > 0
        # gradients cross the chips in every layout; the roofline bound is finite
        assert train["collective_ops"] > 0 and train["collective_bytes"] > 0, mesh
        assert train["roofline_images_per_s_per_chip"] > 0
    # FSDP shards parameters and optimizer state over the 8 chips: the train step's
    # arguments (the state, plus this chip's share of the batch) are a fraction of data
    # parallelism's, where every chip holds all of it; the model axis halves some kernels.
    args = {m: r["programs"][0]["memory"]["arguments"] for m, r in reports.items()}
    assert args["fsdp:8"] < 0.5 * args["data:8"]
    assert args["data:4,model:2"] < args["data:8"]


@needs_libtpu
def test_a_mesh_over_the_chips_hbm_is_refused_with_the_plan_that_fits(v5e_8):
    # A 40M-class head on the tiny trunk: 2.6e9 parameters, replicated on data:8 with their
    # gradients and momentum (~38 GiB per chip by the TPU compiler's count, against a
    # v5e's 16 GiB); sharded over the 8 chips (fsdp:8) they fit.
    with pytest.raises(ConfigError) as e:
        _report(v5e_8, "data:8", **{"data.num_classes": 40_000_000})
    msg = str(e.value)
    assert "the train step (batch 32, 16 px) needs" in msg and "15.75 GiB are available" in msg
    # the plan that fits, compiled by the TPU compiler on fsdp:8 to say so: under the 16 GiB
    fits = msg.split("--config.mesh=fsdp:-1 compiles it (")[1]
    assert float(fits.split(" GiB per chip")[0]) < 16


def test_compile_cli_bad_target_is_one_error_line():
    r = subprocess.run(
        [sys.executable, "-m", "hybridpar.compile", "--config", DIGITS, "--target", "tpu:v9-8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: --target tpu:v9-8: unknown TPU")
    assert "Traceback" not in r.stderr
