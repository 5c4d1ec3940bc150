"""``comm.mode=auto`` (the default) and ``comm.reduce_dtype=auto``: which gradient sync a run
gets on each platform and mesh, and that the run says so.

The choice is a table of measured compiler schedules (``sync.AUTO_BY_PLATFORM``): the overlap
mode on GPU meshes over data only, xla on TPU and CPU, and xla wherever the overlap mode is
ruled out or was not seen to win (one data-parallel device, a model or fsdp axis, a sharded
head, distillation, float16 compute). The GPU compile of the choice is in tests/test_compile_gpu.py
(it needs the CUDA plugin).
"""

import jax.numpy as jnp
import pytest
from helpers import tiny_config

from hybridpar import make_mesh
from hybridpar.parallel import comm
from hybridpar.program.sync import (
    BucketedSync,
    OverlapSync,
    XlaSync,
    choose_mode,
    make_sync,
    reduce_dtype_for,
)


def _config(**overrides):
    return tiny_config("data:8", **overrides)


@pytest.mark.parametrize(
    "platform,shape,dp,overrides,want",
    [
        ("gpu", {"data": 8}, 8, {}, "overlap"),
        ("cuda", {"data": 8}, 8, {}, "overlap"),  # jax's device platform name
        ("gpu", {"data": 2, "fsdp": 4}, 8, {}, "xla"),
        ("tpu", {"data": 8}, 8, {}, "xla"),
        ("cpu", {"data": 8}, 8, {}, "xla"),
        ("gpu", {"data": 1}, 1, {}, "xla"),  # nothing to reduce
        ("gpu", {"data": 4, "model": 2}, 4, {}, "xla"),
        ("gpu", {"data": 8}, 8, {"model.head": "partial_fc"}, "xla"),
        ("gpu", {"data": 8}, 8, {"precision.compute": "float16"}, "xla"),
        ("gpu", {"data": 8}, 8, {"distill.teacher_workdir": "/teacher"}, "xla"),
        ("tpu", {"data": 8}, 8, {"comm.mode": "overlap"}, "overlap"),  # the user's choice
        ("gpu", {"data": 8}, 8, {"comm.mode": "bucketed"}, "bucketed"),
    ],
)
def test_auto_chooses_per_platform_and_mesh(platform, shape, dp, overrides, want):
    mode, why = choose_mode(_config(**overrides), platform, shape, dp)
    assert mode == want
    assert why.startswith("auto: ") == ("comm.mode" not in overrides)


def test_the_tpu_reason_holds_on_every_tpu():
    """auto is xla on every TPU; only v5p's SparseCore offload hides XLA's all-reduces, so
    the reason leads with what holds on every chip and gives the offload as v5p's."""
    mode, why = choose_mode(_config(), "tpu", {"data": 8}, 8)
    assert mode == "xla" and "on v5p the SparseCore offload" in why
    assert why.index("overlap mode") < why.index("SparseCore")


@pytest.mark.parametrize(
    "mode,compute,shape,reduce,want",
    [
        ("overlap", "bfloat16", {"data": 8}, "auto", "bfloat16"),
        ("bucketed", "bfloat16", {"data": 2, "fsdp": 4}, "auto", "bfloat16"),
        ("overlap", "float32", {"data": 8}, "auto", "float32"),
        ("overlap", "bfloat16", {"data": 4, "model": 2}, "auto", "float32"),
        ("xla", "bfloat16", {"data": 8}, "auto", "float32"),  # XLA sums as it computes
        ("overlap", "bfloat16", {"data": 8}, "float32", "float32"),  # the user's choice
        ("xla", "float32", {"data": 8}, "bfloat16", "bfloat16"),
    ],
)
def test_auto_reduce_dtype_follows_the_compute_where_buckets_are_ours(mode, compute, shape,
                                                                      reduce, want):  # fmt: skip
    c = _config(**{"precision.compute": compute, "comm.reduce_dtype": reduce})
    assert reduce_dtype_for(c, mode, shape) == want


def test_the_default_on_cpu_devices_is_xla_and_says_why():
    sync = make_sync(_config(), make_mesh("data:8"), None)
    assert type(sync) is XlaSync and sync.reduce_dtype is None
    assert sync.choice.startswith("gradient sync: xla (auto: XLA:CPU")


def test_explicit_modes_sum_a_bfloat16_step_in_bfloat16():
    mesh = make_mesh("data:8")
    bf16 = {"precision.compute": "bfloat16"}
    sync = make_sync(_config(**bf16, **{"comm.mode": "overlap"}), mesh, None)
    assert type(sync) is OverlapSync and sync.reduce_dtype == jnp.bfloat16
    assert sync.choice == "gradient sync: overlap, 4 MiB buckets summed in bfloat16 (comm.mode)"
    sync = make_sync(_config(**{"comm.mode": "bucketed"}), mesh, None)  # float32 compute
    assert type(sync) is BucketedSync and sync.reduce_dtype is None


def test_auto_sets_no_async_all_reduce_flags_on_tpu():
    """libtpu's async all-reduce flags cost HBM traffic; auto is xla on TPU, so it gets
    xla's flags, and an explicit overlap mode gets them."""
    c = _config().comm
    assert comm.xla_flags(c, "tpu") == ["--xla_tpu_enable_latency_hiding_scheduler=true"]
    assert comm.platform_name("CUDA") == "gpu" and comm.platform_name("rocm") == "gpu"
