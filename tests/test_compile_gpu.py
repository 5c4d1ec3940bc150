"""Compiling for GPUs without one: ``--target gpu:h100-N`` through the CUDA plugin's
deviceless path, on the tiny digits ResNet.

* GPU target specs fill nodes of 8; a bad spec is one error saying what is accepted.
* The program compiled for 8 described H100s: per-GPU memory from the GPU compiler, the
  devices as a real H100 names itself (what a serialized program is checked against), and
  the gradient all-reduces asynchronous (start/done pairs), as XLA schedules them on GPUs.
* A program over the GPU's memory is refused with the plan that fits (the GPU compiler does
  not check memory itself: the tool does); the comparison itself is tested without the plugin.
* On a machine without accelerators the tools start JAX on the CPU without first starting
  the installed plugins (whose failed start prints a traceback).

The CUDA plugin comes with the ``gpu-aot`` extra, which the test extra leaves out (installed,
it logs to stderr in every process that starts JAX without CUDA); without it these tests skip.
"""

import glob
import os
import subprocess
import sys

import pytest
from helpers import compile_tiny

from hybridpar.config.cli import ACCELERATOR_FILES
from hybridpar.config.errors import ConfigError
from hybridpar.tools import targets

HAVE_PLUGIN = targets.have_cuda_plugin()
needs_plugin = pytest.mark.skipif(
    not HAVE_PLUGIN,
    reason='the CUDA plugin is missing: pip install -e ".[gpu-aot]"',
)


@pytest.mark.parametrize(
    "spec,gpus,shape",
    [
        ("gpu:h100-8", 8, (1, 8)),
        ("gpu:h200-32", 32, (4, 8)),
        ("gpu:a100-2", 2, (1, 2)),
    ],  # fmt: skip
)
def test_gpu_targets_fill_nodes_of_eight(spec, gpus, shape):
    t = targets.parse(spec)
    assert (t.platform, t.devices_count, t.shape) == ("gpu", gpus, shape)
    assert t.compiler_options() == {"xla_gpu_enable_triton_gemm": False}


@pytest.mark.parametrize(
    "spec,expect", [("gpu:h100-12", "nodes of 8"), ("gpu:x100-8", "unknown GPU 'x100'")]
)
def test_a_bad_gpu_target_says_what_is_accepted(spec, expect):
    with pytest.raises(ConfigError, match=expect):
        targets.parse(spec)


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_the_gpu_memory_check_compares_bytes_with_the_capacity(name):
    """The check the GPU compiler leaves to the tool, without the plugin: a program's
    per-GPU bytes against the GPU's bytes (80 GB on an H100: 74.51 GiB), refused from one
    byte over."""
    from hybridpar.tools.compile import OverHbm, hbm_shortfall, over_capacity

    t = targets.parse(f"gpu:{name}-8")
    cap = {"h100": 80e9, "h200": 141e9, "a100": 80e9}[name]
    assert t.chip.hbm_bytes == cap
    assert over_capacity({"total": int(cap)}, t) is None
    assert over_capacity({"total": int(cap) + 1}, t) == (int(cap) + 1, cap)
    # the error the tool raises reads back as (need, capacity), as the TPU compiler's does
    assert hbm_shortfall(OverHbm(*over_capacity({"total": 2 * int(cap)}, t))) == (2 * cap, cap)


def test_this_machines_own_gpus_are_a_target_without_a_chip(monkeypatch):
    """compile without --target on a GPU machine: the process's own devices (no topology
    to describe) and no datasheet capacity (the GPU's own runtime checks memory); it used
    to unpack a shape and read a chip that such a target does not have. The CUDA 13 plugin
    (the lent GPU image's) counts as the plugin too."""
    import importlib.util

    from hybridpar.tools.compile import over_capacity

    own = targets.Target("gpu", 1)
    assert own.devices() is None
    assert over_capacity({"total": 10**15}, own) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name in ("jax_plugins", "jax_plugins.xla_cuda13") else None))  # fmt: skip
    assert targets.have_cuda_plugin()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name == "jax_plugins" else None))  # fmt: skip
    assert not targets.have_cuda_plugin()
    monkeypatch.setattr(importlib.util, "find_spec", real)


@pytest.fixture(scope="module")
def h100_8():
    target = targets.parse("gpu:h100-8")
    targets.prepare(target)
    return target


@needs_plugin
def test_the_gpu_compiler_reports_memory_and_async_all_reduces(h100_8):
    rep = compile_tiny(h100_8, "data:4,model:2")
    assert (rep["device_platform"], rep["device_kind"]) == ("gpu", "NVIDIA H100 80GB HBM3")
    assert "GPU H100 x8" in rep["target_description"]
    train, evals = rep["programs"]
    for r in (train, evals):
        assert 0 < r["memory"]["total"] < 80e9
        assert r["flops"] is None and r["max_images_per_s_per_chip"] is None
    # every gradient all-reduce is a start/done pair, left to overlap with compute
    assert train["collective_ops"] > 0
    assert train["async_collective_ops"] == train["collective_ops"]
    # each byte overlapped or exposed, as comm_report's schedule line counts them
    assert train["bytes_overlapped"] + train["bytes_exposed"] == train["collective_bytes"]


@needs_plugin
def test_the_default_on_gpus_reduces_in_the_backward_pass(h100_8):
    """comm.mode=auto on 8 GPUs, data parallel: the overlap mode, its bucket all-reduces
    asynchronous beside the backward pass (tests/test_comm_auto.py has the rule)."""
    rep = compile_tiny(h100_8, "data:8", **{"comm.bucket_mb": 0.1})
    assert rep["gradient_sync"].startswith("gradient sync: overlap, 0.1 MiB buckets")
    train = rep["programs"][0]
    assert train["collective_ops"] > 2  # several buckets, not one all-reduce at the end
    assert train["async_collective_ops"] == train["collective_ops"]


@needs_plugin
def test_a_program_over_the_gpus_memory_is_refused_with_the_plan_that_fits(h100_8):
    # A 150M-class head on the tiny trunk: ~9.6e9 parameters, replicated on data:8 with their
    # gradients and momentum (over 100 GB per GPU against an H100's 80); over 8 GPUs, 1/8.
    with pytest.raises(ConfigError) as e:
        compile_tiny(h100_8, "data:8", **{"data.num_classes": 150_000_000})
    msg = str(e.value)
    assert "the train step (batch 32, 16 px) needs" in msg and "74.51 GiB are available" in msg
    assert "(the GPU compiler's count)" in msg
    fits = msg.split("--config.mesh=fsdp:-1 compiles it (")[1]
    assert float(fits.split(" GiB per chip")[0]) < 74.51


@needs_plugin
@pytest.mark.skipif(
    any(map(glob.glob, ACCELERATOR_FILES)), reason="this machine has an accelerator"
)
def test_the_tools_start_jax_without_the_plugins_traceback_on_a_cpu_machine():
    # with the CUDA plugin installed, JAX's own start-up prints its failed initialisation
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = (
        "import jax; from hybridpar.config import cli; "
        "cli.main(lambda: print(jax.default_backend()))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "cpu", r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Unable to load CUDA" not in r.stderr
