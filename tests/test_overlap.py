"""comm.mode=overlap: each bucket's gradient psum issued from the backward pass.

Numerics: the overlap step on data:8 (tiny ResNet, float32, several buckets) must equal ONE
device computing the same thing (the same BatchNorm groups) within the parity check's
measured float32 spread (``helpers.assert_parity``), for each BatchNorm sync mode.
Negative control: the same check rejects the step with one bucket's psum not divided by
the device count (a sum, not a mean).

Structure: one all-reduce per bucket plus one for the loss and BatchNorm running averages.

comm.reduce_dtype=bfloat16: within the bound derived from bfloat16's precision (the
bucketed tests' derivation: (n + 1) u mean_i |g_i|) of the per-device gradients' mean
computed on one device; a float8 reduction breaks it.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BATCH,
    MEAN,
    NO_LLVM_OPT,
    STD,
    assert_parity,
    assert_rejected,
    build,
    compiled_step,
    lowered_step,
    place,
    random_state,
    reference,
    run,
    tiny_config,
)
from helpers import batches as host_batches

from hybridpar import ConfigError, shard_batch
from hybridpar.config.schema import validate
from hybridpar.models import ResNetTiny
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.parallel import overlap
from hybridpar.parallel.bucketed import bucket_plan, forward_params
from hybridpar.parallel.partitioning import path_str
from hybridpar.program.steps import normalize, scaled_loss_fn
from hybridpar.program.sync import BucketedSync, OverlapSync

SIZE, CLASSES = 16, 10
BUCKET_MB = 0.1  # several buckets for the tiny ResNet (0.7 MiB of parameters)


def _config(mesh="data:8", **overrides):
    return tiny_config(
        mesh,
        **{
            "comm.mode": "overlap",
            "comm.bucket_mb": BUCKET_MB,
            "label_smoothing": 0.1,
            **overrides,
        },
    )


def _plan():
    return bucket_plan(forward_params(ResNetTiny(num_classes=CLASSES), (1, SIZE, SIZE, 3)),
                       BUCKET_MB)  # fmt: skip


def _all_reduces(hlo: str) -> list[str]:
    return [ln for ln in hlo.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]


def _result_sizes(line: str) -> list[int]:
    """Element counts of an all-reduce's results: ``= (f32[10]{0}, f32[3]{0}) all-reduce(``."""
    lhs = re.split(r" all-reduce(-start)?\(", line)[0].split("=", 1)[1]
    return [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"\[([\d,]*)\]", lhs)
    ]


@functools.lru_cache(maxsize=None)
def _one_device(bn_sync, data_parallel=8):
    """The one-device reference run, its model holding the BatchNorm groups that a mesh of
    ``data_parallel`` devices over the data axes has."""
    single = build(tiny_config("data:1", **{"label_smoothing": 0.1}), jax.devices()[:1])
    groups = bn_groups_for(bn_sync, data_parallel)
    single = dataclasses.replace(single, model=single.model.clone(bn_groups=groups))
    start = random_state(single)
    step = compiled_step(single, start, NO_LLVM_OPT)
    return reference(single, start, host_batches(), step=step)


def _overlap_run(bn_sync, start, mesh="data:8"):
    program = build(_config(mesh, **{"model.bn_sync": bn_sync}))
    step = compiled_step(program, start, NO_LLVM_OPT)
    return run(step, program, start, host_batches()), step.as_text()


# --- numerics: overlap on data:8 == one device --------------------------------------------


@pytest.mark.parametrize("bn_sync", ["global", "local", "group:2"])
def test_overlap_equals_one_device(bn_sync):
    want = _one_device(bn_sync)
    got, hlo = _overlap_run(bn_sync, want.start)
    assert_parity(got, want)
    plan = _plan()
    assert len(plan) > 2
    if bn_sync == "local":
        # No BatchNorm psums: one psum per bucket, found by its size, and one of the loss
        # with the running averages (XLA may combine it with the first bucket's: one op).
        params = forward_params(ResNetTiny(num_classes=CLASSES), (1, SIZE, SIZE, 3))
        buckets = [sum(int(np.prod(_get(params, p).shape)) for p in b) for b in plan]
        stats = sum(np.size(x) for x in jax.tree.leaves(want.start.batch_stats))
        lines = _all_reduces(hlo)
        sizes = sorted(s for ln in lines for s in _result_sizes(ln))
        assert sizes == sorted(buckets + [1 + stats])
        assert len(plan) <= len(lines) <= len(plan) + 1


# The meshes beyond data parallelism: FSDP (each bucket gathered in the forward pass and
# reduce-scattered in the backward pass) and a model axis left to the compiler. The BatchNorm
# modes differ so that each collective path is taken somewhere.
OTHER_MESHES = [
    ("data:2,fsdp:4", "local", 8),
    ("fsdp:8", "global", 8),
    ("data:4,model:2", "global", 4),
    ("data:2,fsdp:2,model:2", "local", 4),
]


@pytest.mark.parametrize("mesh,bn_sync,dp", OTHER_MESHES)
def test_overlap_on_fsdp_and_model_meshes_equals_one_device(mesh, bn_sync, dp):
    want = _one_device(bn_sync, dp)
    got, hlo = _overlap_run(bn_sync, want.start, mesh)
    assert_parity(got, want)
    if "fsdp" in mesh:
        # ZeRO-3's order per bucket: one gather forward, one reduce-scatter backward, for
        # each bucket holding parameters the rules split over fsdp (none merged, none per
        # parameter).
        sync = build(_config(mesh, **{"model.bn_sync": bn_sync})).sync
        split = [b for b in _plan() if any(p in sync.param_dims for p in b)]
        assert len(split) >= 2
        kinds = [ln for ln in hlo.splitlines() if " reduce-scatter(" in ln]
        assert len(kinds) == len(split)
        gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln]
        if "model" not in mesh:  # the compiler adds gathers of its own over a model axis
            assert len(gathers) == len(split)


@pytest.mark.parametrize("mode,cls", [("overlap", OverlapSync), ("bucketed", BucketedSync)])
def test_fsdp_gathers_kernels_in_the_compute_dtype_to_the_same_values(mode, cls):
    """bfloat16 compute: the split kernels are gathered in bfloat16 (half the bytes), and
    since every layer casts its kernel to bfloat16 anyway the step is the one with float32
    gathers, to the bit (the bucketed mode's gather is before jax.grad: the gradient of the
    narrowed kernel, widened, is the float32 one's). Negative control: float8 changes it."""
    mode_of = {"comm.mode": mode}
    config = _config("data:2,fsdp:4", **{"model.bn_sync": "local",
                                         "precision.compute": "bfloat16", **mode_of})  # fmt: skip
    program = build(config)
    assert type(program.sync) is cls and program.sync.gather_dtype == jnp.bfloat16
    wider = _config("data:2,fsdp:4", **{"precision.params": "bfloat16", **mode_of})
    assert build(wider).sync.gather_dtype is None  # a wider gather would only add bytes
    start = random_state(program)

    def one_step(gather_dtype):
        sync = cls(program.mesh, BUCKET_MB, "local", program.shardings,
                   gather_dtype=gather_dtype)  # fmt: skip
        p = dataclasses.replace(program, sync=sync)
        got = run(compiled_step(p, start, NO_LLVM_OPT), p, start, host_batches(steps=1))
        got = jax.tree.leaves((got.state, got.losses))
        gathers = [ln for ln in lowered_step(p, start).as_text().splitlines()
                   if "all_gather" in ln]  # fmt: skip
        return got, gathers

    narrow, gathers = one_step("bfloat16")
    wide, wide_gathers = one_step(None)
    # one bfloat16 gather per bucket holding split kernels (the tiny ResNet's split
    # parameters are all kernels), none in float32
    assert len(gathers) == len(wide_gathers) >= 2
    assert all("xbf16>" in ln for ln in gathers), gathers
    assert not any("xbf16>" in ln for ln in wide_gathers)
    for a, b in zip(narrow, wide, strict=True):
        np.testing.assert_array_equal(a, b)
    fp8, _ = one_step("float8_e4m3fn")
    assert any(not np.array_equal(a, b) for a, b in zip(fp8, wide))


@pytest.mark.parametrize("mesh,bn_sync,dp", [("data:8", "local", 8), *OTHER_MESHES[::2]])
def test_rejects_a_bucket_summed_not_averaged(monkeypatch, mesh, bn_sync, dp):
    """Negative control: one bucket's reduction left undivided (n = 1: dp times its
    gradient), whole or reduce-scattered, fails the same check, naming that bucket's arrays."""
    want = _one_device(bn_sync, dp)
    bucket = _plan()[len(_plan()) // 2]
    real = overlap.reduce_bucket

    def broken(leaves, dims, axes, n, *args):
        ranks = [np.ndim(_get(want.start.params, p)) for p in bucket]
        hit = [x.ndim for x in leaves] == ranks  # this bucket (shards have the same rank)
        return real(leaves, dims, axes, 1 if hit else n, *args)

    monkeypatch.setattr(overlap, "reduce_bucket", broken)
    got, _ = _overlap_run(bn_sync, want.start, mesh)
    assert_rejected(got, want, re.escape("".join(f"['{k}']" for k in bucket[0])))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# --- the loss scale: a non-finite step is skipped -----------------------------------------


@pytest.mark.parametrize("mesh", ["data:8", "data:2,fsdp:4", "data:4,model:2"])
def test_overlap_float16_loss_scale_skips_overflow(mesh):
    overrides = {"precision.compute": "float16", "precision.loss_scale_initial": 2.0**40}
    program = build(_config(mesh, **{"model.bn_sync": "local", **overrides}))
    start = random_state(program)
    state = place(start, program.shardings)
    step = compiled_step(program, start, NO_LLVM_OPT)
    new, m = step(state, shard_batch(host_batches(steps=1)[0], program.mesh))
    new = jax.device_get(new)
    assert not bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0**40
    assert float(new.loss_scale.scale) == 2.0**39 and int(new.step) == 1
    for g, w in zip(jax.tree.leaves(new.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(g, w)


# --- comm.reduce_dtype=bfloat16 -----------------------------------------------------------

U_BF16 = 2.0**-8


@functools.lru_cache(maxsize=None)
def _reduce_setup():
    program = build(_config(**{"model.bn_sync": "local"}))
    start = random_state(program)
    batch = host_batches(steps=1)[0]
    images = normalize(batch["image"], MEAN, STD, np.float32)
    local = OverlapSync(program.mesh, BUCKET_MB, "local").local_model(program.model)
    per = BATCH // 8

    @jax.jit
    def grad(params, images, labels):
        loss_fn = scaled_loss_fn(local, start.batch_stats, images, labels, 1.0, 0.1)
        return jax.grad(loss_fn, has_aux=True)(params)[0]

    outs = [grad(start.params, images[i * per : (i + 1) * per],
                 batch["label"][i * per : (i + 1) * per]) for i in range(8)]  # fmt: skip
    per_device = {
        path_str(kp): np.stack([np.asarray(jax.tree.leaves(o)[j], np.float64) for o in outs])
        for j, (kp, _) in enumerate(jax.tree.leaves_with_path(outs[0]))
    }
    return program, start, per_device


def _reduced(reduce_dtype):
    program, start, _ = _reduce_setup()
    sync = OverlapSync(program.mesh, BUCKET_MB, "local", program.shardings, reduce_dtype)

    def loss_fn_for(m, stats, images, labels, scale):
        return scaled_loss_fn(m, stats, images, labels, scale, 0.1)

    batch = shard_batch(host_batches(steps=1)[0], program.mesh)
    images = normalize(batch["image"], MEAN, STD, np.float32)
    out = jax.jit(lambda s, i, lab: sync.gradients(program.model, s, i, lab, loss_fn_for)[0])(
        place(start, program.shardings), images, batch["label"]
    )
    return {path_str(kp): np.asarray(g) for kp, g in jax.tree.leaves_with_path(out)}


def _worst_excess(got, n=8):
    """max over arrays of |got - mean_i g_i| / ((n + 1) u A): above 1 breaks the bound."""
    _, _, per_device = _reduce_setup()
    worst = 0.0
    for path, g in per_device.items():
        want = g.mean(0)
        tol = np.maximum((n + 1) * U_BF16 * np.abs(g).mean(0),
                         2 * np.spacing(np.abs(want).astype(np.float32)))  # fmt: skip
        worst = max(worst, float((np.abs(got[path] - want) / tol).max()))
    return worst


def test_bfloat16_reduce_within_bfloat16_rounding_of_one_device():
    got = _reduced("bfloat16")
    assert _worst_excess(got) <= 1
    for g in got.values():  # summed in bfloat16 indeed, handed on in float32
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, g.astype(jnp.bfloat16).astype(np.float32))


def test_bfloat16_bound_rejects_a_float8_reduce():
    assert _worst_excess(_reduced("float8_e4m3fn")) > 1


# --- the config accepts every mesh -------------------------------------------------------


@pytest.mark.parametrize(
    "mesh", ["data:8", "data:-1", "data:8,fsdp:1,model:1", "data:4,model:2", "fsdp:8"]
)
def test_every_mesh_is_accepted(mesh):
    validate(_config(mesh))
    validate(_config(mesh, **{"comm.reduce_dtype": "bfloat16"}))


def test_a_bfloat16_reduce_beside_a_model_axis_is_refused_on_cpu_not_aborted():
    """XLA:CPU aborts the whole process compiling this step; the sync says so first."""
    with pytest.raises(ConfigError, match=r"does not compile on CPU devices .*"
                       r"comm.reduce_dtype=float32"):  # fmt: skip
        build(_config("data:4,model:2", **{"comm.reduce_dtype": "bfloat16"}))


# --- the compile report on the TPU compiler's asynchronous all-reduces -------------------
#
# Abridged from the overlap step compiled for tpu:v5e-8 with libtpu's async collective
# fusion: each bucket's all-reduce starts in one fusion, is cloned into an
# async_collective_fusion beside a convolution and ends in a third. Inside a shard_map every
# collective has channel_id=1; the clones of one bucket share a chain_id instead.
# A scheduled module's start: the reduction its all-reduces apply.
HLO_HEADER = """
HloModule jit_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""
TPU_CHAINS_HLO = HLO_HEADER + "".join(
    f"""
%start_{i} (p0: f32[{n}]) -> (f32[{n}], u32[]) {{
  %p0 = f32[{n}]{{0}} parameter(0)
  %all-reduce.{i}0 = f32[{n}]{{0}} all-reduce(%p0), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add, frontend_attributes={{chain_id="{i}"}}
  ROOT %custom-call.{i}0 = (f32[{n}]{{0}}, u32[]) custom-call(%all-reduce.{i}0), custom_call_target="AsyncCollectiveStart"
}}

%async_collective_fusion.{i} (p0: f32[{n}], p1: f32[32,64], p2: f32[64,16]) -> (f32[32,16], f32[{n}]) {{
  %p1 = f32[32,64]{{1,0}} parameter(1)
  %p2 = f32[64,16]{{1,0}} parameter(2)
  %dot.{i} = f32[32,16]{{1,0}} dot(%p1, %p2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %p0 = f32[{n}]{{0}} parameter(0)
  %all-reduce.{i}1 = f32[{n}]{{0}} all-reduce(%p0), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add, frontend_attributes={{chain_id="{i}"}}
  ROOT %tuple.{i} = (f32[32,16]{{1,0}}, f32[{n}]{{0}}) tuple(%dot.{i}, %all-reduce.{i}1)
}}

%done_{i} (p0: f32[{n}], p1: (f32[32,16], f32[{n}])) -> f32[{n}] {{
  %p0 = f32[{n}]{{0}} parameter(0)
  %all-reduce.{i}2 = f32[{n}]{{0}} all-reduce(%p0), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add, frontend_attributes={{chain_id="{i}"}}
  ROOT %custom-call.{i}2 = f32[{n}]{{0}} custom-call(%p0, %all-reduce.{i}2), custom_call_target="AsyncCollectiveDone"
}}
"""  # noqa: E501
    for i, n in ((1, 16), (2, 32))
) + """
ENTRY %main (a: f32[16], b: f32[32], m: f32[32,64], n: f32[64,16]) -> (f32[16], f32[32]) {
  %a = f32[16]{0} parameter(0)
  %b = f32[32]{0} parameter(1)
  %m = f32[32,64]{1,0} parameter(2)
  %n = f32[64,16]{1,0} parameter(3)
""" + "".join(
    f"""  %s{i} = (f32[{n}]{{0}}, u32[]) fusion(%{x}), kind=kCustom, calls=%start_{i}
  %g{i} = f32[{n}]{{0}} get-tuple-element(%s{i}), index=0
  %f{i} = (f32[32,16]{{1,0}}, f32[{n}]{{0}}) fusion(%g{i}, %m, %n), kind=kOutput, calls=%async_collective_fusion.{i}
  %d{i} = f32[{n}]{{0}} fusion(%g{i}, %f{i}), kind=kCustom, calls=%done_{i}
"""  # noqa: E501
    for i, n, x in ((1, 16, "a"), (2, 32, "b"))
) + """  ROOT %out = (f32[16]{0}, f32[32]{0}) tuple(%d1, %d2)
}
"""


def test_the_report_tells_apart_async_all_reduces_sharing_a_channel_id():
    """Two buckets' all-reduces, each in its own chain of fusions, are two async
    collectives that overlap their dot (not one, as a report keyed by channel id saw)."""
    from hybridpar.tools.comm_report import overlap_totals, parse_collectives, parse_overlap

    rows = parse_collectives(TPU_CHAINS_HLO)
    assert sorted((r["bytes"], r["count"], r["async"]) for r in rows) == [
        (64, 1, True),
        (128, 1, True),
    ]
    events = parse_overlap(TPU_CHAINS_HLO)
    assert [(e["bytes"], e["async"], e["overlaps"]) for e in events] == [
        (64, True, {"dot": 1}),
        (128, True, {"dot": 1}),
    ]
    assert overlap_totals(events)["bytes_exposed"] == 0


def test_hidden_estimate_weighs_the_compute_between_against_the_links_time():
    """Each chain overlaps one dot of 2 x 32 x 16 x 64 FLOPs. At a peak that makes the dot
    1 us, an all-reduce of 1 us on the links is hidden whole, one of 2 us half; an exposed
    collective hides nothing (the links' time is simulate's price: tests/test_plan.py)."""
    from hybridpar.tools.comm_report import hidden_estimate, parse_overlap

    first = parse_overlap(TPU_CHAINS_HLO)[0]
    assert first["group_size"] == 8 and first["flops"] == 2 * 32 * 16 * 64
    peak = 2 * 32 * 16 * 64 / 1e-6
    whole = hidden_estimate(first, peak, 1e-6)
    assert whole["compute_s"] == pytest.approx(1e-6)
    assert whole["collective_s"] == pytest.approx(1e-6) and whole["bytes_hidden"] == 64
    half = hidden_estimate(first, peak, 2e-6)
    assert half["bytes_hidden"] == 32 and half["seconds_hidden"] == pytest.approx(1e-6)
    assert hidden_estimate(dict(first, exposed=True), peak, 1e-6)["bytes_hidden"] == 0


GPU_LIBRARY_CALLS_HLO = HLO_HEADER + """
ENTRY %main (g: f32[1024], x: f32[8,8,8,4], w: f32[16,3,3,4], dy: f32[8,8,8,16], a: f32[32,64], b: f32[64,16]) -> f32[1024] {
  %g = f32[1024]{0} parameter(0)
  %x = f32[8,8,8,4]{3,2,1,0} parameter(1)
  %w = f32[16,3,3,4]{3,2,1,0} parameter(2)
  %dy = f32[8,8,8,16]{3,2,1,0} parameter(3)
  %a = f32[32,64]{1,0} parameter(4)
  %b = f32[64,16]{1,0} parameter(5)
  %all-reduce-start = f32[1024]{0} all-reduce-start(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %fwd = (f32[8,8,8,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %bwi = (f32[8,8,8,4]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %bwf = (f32[16,3,3,4]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %mm = (f32[32,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %all-reduce-done = f32[1024]{0} all-reduce-done(%all-reduce-start)
}
"""  # noqa: E501


def test_the_gpu_compilers_library_calls_count_as_the_compute_beside_a_collective():
    """XLA:GPU's convolutions and matrix products are cuDNN and cuBLAS calls, whose FLOPs the
    compiler does not count: each of the three 3x3 convolutions (forward, input and kernel
    gradients, 8 x 8 x 8 x 16 outputs of 3 x 3 x 4 multiply-adds in the forward's terms) and
    the 32 x 64 @ 64 x 16 product count from their shapes."""
    from hybridpar.tools.comm_report import parse_overlap

    (e,) = parse_overlap(GPU_LIBRARY_CALLS_HLO)
    assert e["async"] and not e["exposed"] and e["compute_ops"] == 4
    conv = 2 * (8 * 8 * 8 * 16) * (3 * 3 * 4)
    assert e["flops"] == 3 * conv + 2 * 32 * 16 * 64
