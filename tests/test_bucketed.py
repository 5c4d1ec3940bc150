"""Bucketed gradient reduction (comm.mode=bucketed): the plan, numerics, and the HLO it gives.

Numerics: the bucketed step (shard_map, one psum per bucket) must equal the plain jitted
step (XLA's own all-reduces) on data:8 for the tiny ResNet in float32. The two sum the same
numbers in another order (per-device partial sums, then a psum), so they differ by float32
rounding only; rtol 1e-4 / atol 1e-5 as in tests/test_parity.py (see its docstring).

HLO: the ResNet-50 step on data:8 is compiled (never run) from abstract inputs; the
bucketed step must have exactly one all-reduce per bucket of the plan plus one for the loss
and BatchNorm running averages, while the plain jitted step has about a hundred on CPU.
"""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_parity import _batches, tiny_tx

from hybridpar import ConfigError, make_mesh, preset_rules, shard_batch
from hybridpar.bucketed import bucket_plan, forward_params, make_bucketed_train_step
from hybridpar.models import ResNet50, ResNetTiny
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.partitioning import Rules, batch_sharding, infer_shardings
from hybridpar.precision import LossScale, Policy
from hybridpar.state import abstract_like, create_sharded_state, make_init_fn
from hybridpar.steps import jit_train_step, make_train_step

BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 3
MEAN, STD = (127.5,) * 3, (64.0,) * 3
TINY_BUCKET_MB = 0.1  # several buckets for the tiny ResNet (its params take 0.7 MiB)
TOL = dict(rtol=1e-4, atol=1e-5)


def _train(mode, bn_sync, policy=Policy(), loss_scale=None, steps=STEPS, mesh="data:8", rules=None):
    mesh = make_mesh(mesh)
    # The xla step gets the model the config would build for it (bn_groups from bn_sync);
    # the bucketed step reconfigures the same model's BatchNorm for shard_map.
    model = ResNetTiny(
        num_classes=CLASSES,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        bn_groups=bn_groups_for(bn_sync, 8),
    )
    tx = tiny_tx()
    loss_scale = loss_scale or LossScale.create(dynamic=False)
    init = make_init_fn(model, tx, (1, SIZE, SIZE, 3), loss_scale)
    rules = rules or preset_rules("auto", mesh)
    state, shardings, _ = create_sharded_state(init, rules, mesh, jax.random.key(0))
    kw = dict(mean=MEAN, std=STD, label_smoothing=0.1)
    if mode == "xla":
        fn = make_train_step(model, tx, policy, lambda s: 0.1, **kw)
    else:
        fn = make_bucketed_train_step(
            model,
            tx,
            policy,
            lambda s: 0.1,
            mesh=mesh,
            bucket_mb=TINY_BUCKET_MB,
            bn_sync=bn_sync,
            shardings=shardings,
            **kw,
        )
    step = jit_train_step(fn, shardings, mesh, {"image": 4, "label": 1})
    batches = [shard_batch(b, mesh) for b in _batches()[:steps]]
    compiled = step.lower(state, batches[0]).compile()
    metrics = []
    for b in batches:
        state, m = compiled(state, b)
        metrics.append(m)
    return {
        "state": jax.device_get(state),
        "metrics": jax.device_get(metrics),
        "hlo": compiled.as_text(),
        "step": fn,
    }


def _all_reduces(hlo: str, kind: str = "all-reduce") -> list[str]:
    return [ln for ln in hlo.splitlines() if f" {kind}(" in ln or f" {kind}-start(" in ln]


def _assert_same(got, want):
    np.testing.assert_allclose(
        [m["loss"] for m in got["metrics"]], [m["loss"] for m in want["metrics"]], **TOL
    )
    for part in ("params", "batch_stats"):
        flat_got = jax.tree_util.tree_flatten_with_path(getattr(got["state"], part))[0]
        flat_want = jax.tree.leaves(getattr(want["state"], part))
        assert len(flat_got) == len(flat_want)
        for (path, g), w in zip(flat_got, flat_want):
            np.testing.assert_allclose(g, w, **TOL, err_msg=f"{part} {jax.tree_util.keystr(path)}")


# --- the plan ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet50_params():
    return forward_params(ResNet50(num_classes=1000), (1, 64, 64, 3))


def _nbytes(leaf):
    return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _forward_paths(tree, prefix=()):
    out = []
    for k, v in tree.items():
        out += _forward_paths(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)]
    return out


@pytest.mark.parametrize("bucket_mb", [32, 4, 0.5])
def test_bucket_plan_resnet50(resnet50_params, bucket_mb):
    params = resnet50_params
    plan = bucket_plan(params, bucket_mb)
    flat = [p for bucket in plan for p in bucket]
    forward = _forward_paths(params)
    assert len(forward) == 161  # conv kernels, BN scales and biases, head kernel and bias
    # Every parameter exactly once, in reverse forward order: head first, stem last.
    assert flat == forward[::-1]
    assert flat[0] == ("head", "bias") and flat[1] == ("head", "kernel")
    assert flat[-1] == ("stem_conv", "kernel") and plan[-1][-1] == ("stem_conv", "kernel")
    limit = bucket_mb * 2**20
    for i, bucket in enumerate(plan):
        size = sum(_nbytes(_get(params, p)) for p in bucket)
        assert size <= limit or len(bucket) == 1, (i, size)
        if i + 1 < len(plan):  # greedy: the next gradient would not have fitted
            nxt = _nbytes(_get(params, plan[i + 1][0]))
            assert size + nxt > limit
    if bucket_mb == 32:
        assert len(plan) == 4  # 97.5 MiB of float32 parameters


def test_bucket_plan_big_tensor_alone_and_forward_order():
    # forward_params keeps init's order, which jax.eval_shape's sorted dicts would lose.
    params = forward_params(ResNetTiny(num_classes=CLASSES), (1, SIZE, SIZE, 3))
    assert list(params) == [
        "stem_conv",
        "stem_bn",
        "stage1_block0",
        "stage2_block0",
        "stage3_block0",
        "stage4_block0",
        "head",
    ]
    big = ("stage4_block0", "conv2", "kernel")  # 3x3x64x64 float32 = 0.14 MiB
    plan = bucket_plan(params, 0.1)
    assert [big] in plan
    assert all(len(b) == 1 for b in plan if any(_nbytes(_get(params, p)) > 0.1 * 2**20 for p in b))
    with pytest.raises(ConfigError, match="bucket_mb"):
        bucket_plan(params, 0)


def test_rejects_model_parallel_meshes_and_params_split_over_data():
    kw = dict(mean=MEAN, std=STD, bucket_mb=32, bn_sync="global")
    model = ResNetTiny(num_classes=CLASSES)
    with pytest.raises(ConfigError, match="comm.mode=xla"):
        make_bucketed_train_step(
            model, tiny_tx(), Policy(), None, mesh=make_mesh("data:4,model:2"), **kw
        )
    mesh = make_mesh("data:8")
    params = forward_params(model, (1, SIZE, SIZE, 3))
    on_data = jax.tree.map(lambda x: NamedSharding(mesh, P("data")), params)
    shardings = SimpleNamespace(params=on_data, batch_stats={})
    with pytest.raises(ConfigError, match="split over 'data'"):
        make_bucketed_train_step(
            model, tiny_tx(), Policy(), None, mesh=mesh, shardings=shardings, **kw
        )
    with pytest.raises(ConfigError, match="bn_sync"):
        make_bucketed_train_step(
            model,
            tiny_tx(),
            Policy(),
            None,
            mesh=make_mesh("data:8"),
            **{**kw, "bn_sync": "group:3"},
        )


# --- numerics: bucketed == xla on data:8 -------------------------------------------------


@pytest.mark.parametrize("bn_sync", ["global", "local", "group:2"])
def test_bucketed_equals_xla(bn_sync):
    want = _train("xla", bn_sync)
    got = _train("bucketed", bn_sync)
    _assert_same(got, want)
    losses = [m["loss"] for m in want["metrics"]]
    assert losses[-1] != pytest.approx(losses[0])  # the steps did train
    # One psum per bucket plus one for the loss and BN running averages.
    plan = got["step"].plan_for((SIZE, SIZE, 3))
    assert len(plan) > 2
    n_xla, n_got = len(_all_reduces(want["hlo"])), len(_all_reduces(got["hlo"]))
    print(f"tiny {bn_sync}: xla {n_xla} all-reduces, bucketed {n_got}, {len(plan)} buckets")
    if bn_sync == "local":
        assert n_got == len(plan) + 1


@pytest.mark.parametrize("mesh", ["fsdp:8", "data:2,fsdp:4"])
def test_bucketed_fsdp_equals_xla(mesh):
    # Split every array of >= 64 elements (most of the tiny ResNet, BN vectors included):
    # the bucketed step gathers those parameters and reduce-scatters their gradients.
    rules = Rules(fsdp_min_size=64)
    want = _train("xla", "global", mesh=mesh, rules=rules)
    got = _train("bucketed", "global", mesh=mesh, rules=rules)
    _assert_same(got, want)
    plan = got["step"].plan_for((SIZE, SIZE, 3))
    scatters = _all_reduces(got["hlo"], "reduce-scatter")
    print(f"tiny {mesh}: {len(plan)} buckets, {len(scatters)} reduce-scatters")
    assert len(scatters) == len(plan)  # every bucket holds split parameters here
    assert not _all_reduces(want["hlo"], "reduce-scatter")  # XLA's own step: all-reduces


def test_bucketed_float16_loss_scale_skips_overflow():
    policy = Policy(compute_dtype=jnp.float16)
    # A scale of 2**40 overflows float16 activations' gradients: the step must be skipped.
    got = _train("bucketed", "local", policy, LossScale.create(True, initial=2.0**40), steps=1)
    m = got["metrics"][0]
    assert not bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0**40
    assert float(got["state"].loss_scale.scale) == 2.0**39
    assert int(got["state"].step) == 1
    init = jax.device_get(_fresh_params(policy))
    for g, w in zip(jax.tree.leaves(got["state"].params), jax.tree.leaves(init)):
        np.testing.assert_array_equal(g, w)


def _fresh_params(policy):
    mesh = make_mesh("data:8")
    model = ResNetTiny(num_classes=CLASSES, dtype=policy.compute_dtype)
    init = make_init_fn(model, tiny_tx(), (1, SIZE, SIZE, 3), LossScale.create(dynamic=False))
    state, _, _ = create_sharded_state(init, preset_rules("auto", mesh), mesh, jax.random.key(0))
    return state.params


# --- HLO: ResNet-50 on data:8, compiled only --------------------------------------------


def _resnet50_hlo(mode, mesh="data:8"):
    mesh = make_mesh(mesh)
    # xla: the plain jitted step with global BN. bucketed: the model as a config with
    # bn_sync=local builds it (8 BN groups), reconfigured for shard_map by the step.
    groups = 1 if mode == "xla" else bn_groups_for("local", 8)
    model = ResNet50(num_classes=1000, bn_groups=groups)
    tx = optax.sgd(0.1, momentum=0.9)
    image = (64, 64, 3)
    init = make_init_fn(model, tx, (1, *image), LossScale.create(dynamic=False))
    abstract = jax.eval_shape(init, jax.random.key(0))
    shardings = infer_shardings(abstract, preset_rules("auto", mesh), mesh)
    kw = dict(mean=MEAN, std=STD)
    if mode == "xla":
        fn = make_train_step(model, tx, Policy(), lambda s: 0.1, **kw)
    else:
        fn = make_bucketed_train_step(
            model,
            tx,
            Policy(),
            lambda s: 0.1,
            mesh=mesh,
            bucket_mb=32,
            bn_sync="local",
            shardings=shardings,
            **kw,
        )
    step = jit_train_step(fn, shardings, mesh, {"image": 4, "label": 1})
    batch = {
        "image": jax.ShapeDtypeStruct((16, *image), np.uint8, sharding=batch_sharding(mesh, 4)),
        "label": jax.ShapeDtypeStruct((16,), np.int32, sharding=batch_sharding(mesh, 1)),
    }
    hlo = step.lower(abstract_like(abstract, shardings), batch).compile().as_text()
    return hlo, abstract


def _result_sizes(line: str, kind: str = "all-reduce") -> list[int]:
    """Element counts of an all-reduce's results: ``= (f32[10]{0}, f32[3]{0}) all-reduce(``."""
    lhs = re.split(rf" {kind}(-start)?\(", line)[0].split("=", 1)[1]
    return [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"\[([\d,]*)\]", lhs)
    ]


def test_resnet50_bucketed_local_all_reduce_count(resnet50_params):
    hlo, abstract = _resnet50_hlo("bucketed")
    params = resnet50_params
    plan = bucket_plan(params, 32)
    bucket_sizes = sorted(sum(int(np.prod(_get(params, p).shape)) for p in b) for b in plan)
    stats = sum(x.size for x in jax.tree.leaves(abstract.batch_stats))
    lines = _all_reduces(hlo)
    sizes = sorted(s for ln in lines for s in _result_sizes(ln))
    print(f"bucketed+local ResNet-50 data:8: {len(lines)} all-reduces, buckets {bucket_sizes}")
    # len(plan) gradient buckets (4 at 32 MiB), each found by its size, and the loss with
    # the BN running averages in one more; nothing else.
    assert len(plan) == 4
    assert sizes == sorted(bucket_sizes + [1 + stats])
    assert len(lines) == len(plan) + 1 <= 8


def test_resnet50_bucketed_fsdp_collectives(resnet50_params):
    # fsdp:8 with the FSDP preset (arrays >= 1024 elements split): per bucket ONE all-gather
    # of its split parameters and ONE reduce-scatter of their gradients (plus one all-reduce
    # of the small replicated ones); one more all-gather for the split BN statistics and one
    # all-reduce for the loss and BN running averages.
    hlo, abstract = _resnet50_hlo("bucketed", "fsdp:8")
    plan = bucket_plan(resnet50_params, 32)
    split = [
        sum(
            int(np.prod(_get(resnet50_params, p).shape))
            for p in b
            if int(np.prod(_get(resnet50_params, p).shape)) >= 1024
        )
        for b in plan
    ]
    scatters = _all_reduces(hlo, "reduce-scatter")
    gathers = _all_reduces(hlo, "all-gather")
    reduces = _all_reduces(hlo, "all-reduce")
    print(
        f"bucketed fsdp:8: {len(scatters)} reduce-scatters, {len(gathers)} all-gathers, "
        f"{len(reduces)} all-reduces, {len(plan)} buckets"
    )
    assert len(plan) == 4 and all(split)
    # Each reduce-scatter's result is this device's eighth of its bucket's split gradients.
    got = sorted(s for ln in scatters for s in _result_sizes(ln, "reduce-scatter"))
    assert got == sorted(n // 8 for n in split)
    assert len(gathers) == len(plan) + 1
    assert len(reduces) <= len(plan) + 1
    xla_hlo, _ = _resnet50_hlo("xla", "fsdp:8")
    assert len(_all_reduces(xla_hlo, "all-gather")) > 50  # XLA's own: one per array


def test_resnet50_xla_step_has_many_all_reduces():
    hlo, _ = _resnet50_hlo("xla")
    n = len(_all_reduces(hlo))
    print(f"xla global ResNet-50 data:8: {n} all-reduces")
    assert n > 50
