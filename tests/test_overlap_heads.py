"""comm.mode=overlap with a class-sharded head (model.head = sharded | partial_fc).

The step is manual over every mesh axis: the trunk data parallel over all devices, its
gradient buckets averaged over all of them from the backward pass, a trunk weight split
over ``model`` or ``fsdp`` gathered in the forward rule and reduce-scattered in the backward
rule, the head's kernel reduced only over the axes it is replicated on (none for
partial_fc; a ``model`` axis of one device, which the sharded head names, stays one of
the step's axes). Numerics: three steps equal one device running the dense head (the same
BatchNorm groups) within the parity check's measured float32 spread
(``helpers.assert_parity``); the loss and the eval step's top-k sums equal the xla mode's.
Negative controls: the same check rejects the partial-FC kernel's gradient averaged over
the devices (as a replicated weight's would be), the sharded head's kernel gradient left
unreduced, and one trunk bucket summed, not averaged.

comm.reduce_dtype=bfloat16 (all axes manual: XLA:CPU compiles it, unlike a model axis left
to the compiler): the partial-FC kernel's gradient, which no collective touches, is the
float32 step's to the bit; the trunk's buckets are summed in bfloat16.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MEAN,
    NO_LLVM_OPT,
    STD,
    assert_parity,
    assert_rejected,
    build,
    compiled_step,
    place,
    random_state,
    reference,
    run,
    tiny_config,
)
from helpers import batches as host_batches

from hybridpar import ConfigError, shard_batch
from hybridpar.config.schema import validate
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.parallel.partitioning import path_str
from hybridpar.program import sync as sync_module
from hybridpar.program.steps import normalize, scaled_loss_fn
from hybridpar.program.sync import OverlapSync

CLASSES = 16  # divides the 8 partial-FC shards
BUCKET_MB = 0.1  # several buckets for the tiny ResNet


def _config(mesh, head, bn_sync, **overrides):
    return tiny_config(mesh, **{"model.head": head, "model.bn_sync": bn_sync,
                                "data.num_classes": CLASSES, "label_smoothing": 0.1,
                                "comm.bucket_mb": BUCKET_MB, **overrides})  # fmt: skip


def _batches():
    return host_batches(classes=CLASSES)


@functools.lru_cache(maxsize=None)
def _one_device(bn_sync, data_parallel):
    """One device, the dense head, the BatchNorm groups of ``data_parallel`` devices."""
    single = build(_config("data:1", "dense", "global"), jax.devices()[:1])
    groups = bn_groups_for(bn_sync, data_parallel)
    single = dataclasses.replace(single, model=single.model.clone(bn_groups=groups))
    start = random_state(single)
    return reference(single, start, _batches(), step=compiled_step(single, start, NO_LLVM_OPT))


def _overlap_program(mesh, head, bn_sync, **sync_kw):
    """The run's program in the overlap mode (``sync_kw``: its sync made with those)."""
    program = build(_config(mesh, head, bn_sync, **{"comm.mode": "overlap"}))
    assert isinstance(program.sync, OverlapSync) and program.sync.head == head
    if not sync_kw:
        return program
    sync = OverlapSync(program.mesh, BUCKET_MB, bn_sync, program.shardings, head=head,
                       **sync_kw)  # fmt: skip
    return dataclasses.replace(program, sync=sync)


def _run(program, start):
    return run(compiled_step(program, start, NO_LLVM_OPT), program, start, _batches())


CASES = [
    ("data:4,model:2", "sharded", "global", 4),
    ("data:8", "partial_fc", "local", 8),
    ("data:2,fsdp:2,model:2", "partial_fc", "group:2", 4),
    ("data:2,fsdp:2,model:2", "sharded", "local", 4),
    # the classes over a model axis of one device: still one of the step's manual axes
    ("data:8", "sharded", "group:2", 8),
]


@pytest.mark.parametrize("mesh,head,bn_sync,dp", CASES)
def test_overlap_with_a_sharded_head_equals_one_device(mesh, head, bn_sync, dp):
    want = _one_device(bn_sync, dp)
    program = _overlap_program(mesh, head, bn_sync)
    got = _run(program, want.start)
    assert_parity(got, want)


@pytest.mark.parametrize("mesh,head,bn_sync,dp", [CASES[1], CASES[0]])
def test_rejects_a_mean_over_every_device(mesh, head, bn_sync, dp):
    """Each device's loss is its head group's, so the gradients' sum over the devices is
    divided by the number of groups (1 for partial_fc, 4 for sharded here), not by the
    device count as a data-parallel mean would: that divisor is rejected, the head's kernel
    among the arrays named."""
    want = _one_device(bn_sync, dp)
    program = _overlap_program(mesh, head, bn_sync)
    assert program.sync.n < program.sync.n_all == 8
    program.sync.n = program.sync.n_all
    assert_rejected(_run(program, want.start), want, re.escape("['head']['kernel']"))


@pytest.mark.parametrize("mesh,head,bn_sync,dp", [CASES[1], CASES[0]])
def test_a_head_kernel_reduced_where_the_head_says_not_is_refused(mesh, head, bn_sync, dp):
    """partial_fc's kernel gradient averaged over the devices (as a replicated weight's), or
    sharded's left unreduced over the data axes it is replicated on: shard_map's types catch
    either when the step is traced (the backward rule's result would not be split as the
    kernel is)."""
    program = _overlap_program(mesh, head, bn_sync)
    wrong = () if head == "sharded" else program.sync.axes
    program.sync.sums = {p: wrong for p in program.sync.sums}
    with pytest.raises(ValueError, match="manual axis types do not match"):
        compiled_step(program, _one_device(bn_sync, dp).start, NO_LLVM_OPT)


def test_rejects_a_trunk_bucket_summed_not_averaged(monkeypatch):
    """One bucket (a model- and fsdp-split kernel's) divided by 1, not by the 4 head groups:
    the check names its arrays."""
    mesh, head, bn_sync, dp = CASES[3]
    want = _one_device(bn_sync, dp)
    program = _overlap_program(mesh, head, bn_sync)
    target = ("stage4_block0", "conv2", "kernel")
    assert target in program.sync.splits  # gathered forward, reduce-scattered backward
    bucket = next(b for b in program.sync.plan_for(program.model, (16, 16, 3)) if target in b)
    real = sync_module.reduce_in_backward_manual
    calls = []

    def broken(params, plan, axes, n, *args):  # that bucket's leaves from a sum over all
        calls.append(1)
        right, summed = real(params, plan, axes, n, *args), real(params, plan, axes, 1, *args)
        return jax.tree_util.tree_map_with_path(
            lambda kp, a, b: b if tuple(path_str(kp).split("/")) in bucket else a,
            right, summed)  # fmt: skip

    monkeypatch.setattr(sync_module, "reduce_in_backward_manual", broken)
    got = _run(program, want.start)
    assert calls
    assert_rejected(got, want, "|".join(re.escape("".join(f"['{k}']" for k in p))
                                        for p in bucket))  # fmt: skip


@pytest.mark.parametrize("mesh,head,bn_sync,dp", [CASES[2], CASES[4]])
def test_loss_and_topk_equal_the_xla_modes(mesh, head, bn_sync, dp):
    """The same program under comm.mode=xla and overlap, from the same start: the losses
    of three steps and the eval step's sums on the trained states agree."""
    start = _one_device(bn_sync, dp).start
    xla = build(_config(mesh, head, bn_sync, **{"comm.mode": "xla"}))
    ours = _overlap_program(mesh, head, bn_sync)
    runs = [_run(p, start) for p in (xla, ours)]
    np.testing.assert_allclose(runs[1].losses, runs[0].losses, rtol=1e-5)
    batch = dict(_batches()[0], mask=np.ones(len(_batches()[0]["label"]), np.float32))
    sums = [jax.device_get(xla.eval_jit(r.device_state, shard_batch(batch, xla.mesh)))
            for r in runs]  # fmt: skip
    for key in ("count", "top1_sum", "top5_sum"):
        assert float(sums[1][key]) == float(sums[0][key]), key
    assert 0 < float(sums[0]["top5_sum"]) < float(sums[0]["count"])  # hits and misses
    np.testing.assert_allclose(sums[1]["loss_sum"], sums[0]["loss_sum"], rtol=1e-5)


def test_float16_loss_scale_skips_overflow():
    mesh, head, bn_sync, _ = CASES[0]
    overrides = {"precision.compute": "float16", "precision.loss_scale_initial": 2.0**40}
    program = build(_config(mesh, head, bn_sync, **overrides))
    sync = OverlapSync(program.mesh, BUCKET_MB, bn_sync, program.shardings, head=head)
    program = dataclasses.replace(program, sync=sync)
    start = random_state(program)
    step = compiled_step(program, start, NO_LLVM_OPT)
    new, m = step(place(start, program.shardings), shard_batch(_batches()[0], program.mesh))
    new = jax.device_get(new)
    assert not bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0**40
    assert float(new.loss_scale.scale) == 2.0**39 and int(new.step) == 1
    for g, w in zip(jax.tree.leaves(new.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(g, w)


def _gradients(program, start, reduce_dtype):
    """One step's reduced gradients from ``sync.gradients`` (float32 model)."""
    head, bn_sync = program.config.model.head, program.config.model.bn_sync
    sync = OverlapSync(program.mesh, BUCKET_MB, bn_sync, program.shardings, reduce_dtype,
                       head=head)  # fmt: skip

    def loss_fn_for(m, stats, images, labels, scale):
        return scaled_loss_fn(m, stats, images, labels, scale, 0.1, program.head)

    batch = shard_batch(_batches()[0], program.mesh)
    images = normalize(batch["image"], MEAN, STD, np.float32)
    step = jax.jit(lambda s, i, lab: sync.gradients(program.model, s, i, lab, loss_fn_for)[0])
    out = step(place(start, program.shardings), images, batch["label"])
    return {jax.tree_util.keystr(kp): np.asarray(g) for kp, g in jax.tree.leaves_with_path(out)}


def _trunk_excess(got, want):
    """max over the trunk's arrays of |got - want| / (9 u max|want|), u = 2^-8: bfloat16's
    rounding of 8 summands, loosely (no per-device magnitudes here); above 1 breaks it."""
    bound = {k: 9 * 2.0**-8 * np.abs(w).max() for k, w in want.items()}
    return max(float((np.abs(got[k] - want[k]) / bound[k]).max())
               for k in want if not k.startswith("['head']"))  # fmt: skip


def test_bfloat16_reduce_rounds_the_trunk_only():
    mesh, head, bn_sync, _ = CASES[1]
    program = build(_config(mesh, head, bn_sync))
    start = random_state(program)
    f32, bf16 = (_gradients(program, start, r) for r in ("float32", "bfloat16"))
    for name, g in bf16.items():
        assert g.dtype == np.float32
        if name.startswith("['head']"):  # owned: no collective, no rounding
            np.testing.assert_array_equal(g, f32[name], err_msg=name)
        else:  # summed in bfloat16 (and divided by 1: partial-FC's head groups are one)
            np.testing.assert_array_equal(g, g.astype(jnp.bfloat16).astype(np.float32))
    assert any(not np.array_equal(bf16[k], f32[k]) for k in f32)  # the trunk was rounded
    assert _trunk_excess(bf16, f32) <= 1
    # the bound can fail: a float8 reduction breaks it
    assert _trunk_excess(_gradients(program, start, "float8_e4m3fn"), f32) > 1


def test_the_config_accepts_the_overlap_mode_with_a_sharded_head():
    for head in ("sharded", "partial_fc"):
        for reduce_dtype in ("float32", "bfloat16"):
            validate(_config("data:4,model:2", head, "global", **{
                "comm.mode": "overlap", "comm.reduce_dtype": reduce_dtype}))  # fmt: skip
    with pytest.raises(ConfigError, match="needs comm.mode=xla or overlap"):
        validate(_config("data:8", "sharded", "global", **{"comm.mode": "bucketed"}))
    with pytest.raises(ConfigError, match="use --config.comm.mode=overlap"):
        validate(_config("data:8", "sharded", "global", **{"comm.mode": "xla",
                                                            "comm.reduce_dtype": "bfloat16"}))


def test_a_head_kernel_split_over_fsdp_on_its_features_equals_one_device():
    """10 classes do not divide model x fsdp (4): the FSDP pass splits the sharded head's
    kernel over fsdp on its features (``P('fsdp', 'model')``, whole over fsdp before),
    and the overlap step gathers that block as it does a trunk weight's. It refused to
    build ('not over ('model',) first'); planted back (every block checked), it does."""
    from jax.sharding import PartitionSpec as P

    over = {"data.num_classes": 10, "model.num_filters": 32}  # a head over fsdp_min_size
    single = build(_config("data:1", "dense", "global", **over), jax.devices()[:1])
    groups = bn_groups_for("local", 4)
    single = dataclasses.replace(single, model=single.model.clone(bn_groups=groups))
    start = random_state(single)
    batches = host_batches(classes=10)
    want = reference(single, start, batches, step=compiled_step(single, start, NO_LLVM_OPT))
    program = build(_config("data:2,fsdp:2,model:2", "sharded", "local",
                            **{"comm.mode": "overlap", **over}))  # fmt: skip
    assert program.shardings.params["head"]["kernel"].spec == P("fsdp", "model")
    got = run(compiled_step(program, want.start, NO_LLVM_OPT), program, want.start, batches)
    assert_parity(got, want)
