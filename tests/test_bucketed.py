"""Bucketed gradient reduction (comm.mode=bucketed): the plan, numerics, and the HLO it gives.

Numerics: the bucketed step (shard_map, one psum per bucket) must equal the plain jitted
step (XLA's own all-reduces) on data:8 for the tiny ResNet in float32, from random
non-trivial initial values, in every array. The two sum the same numbers in another order
(per-device partial sums, then a psum), so they differ by float32 rounding only: the
tolerance is float32's measured spread (``helpers.assert_parity``). Negative control: the
same check rejects the bucketed step with one bucket's gradients dropped.

HLO: the ResNet-50 step on data:8 is compiled (never run) from abstract inputs; the
bucketed step must have exactly one all-reduce per bucket of the plan plus one for the loss
and BatchNorm running averages (XLA's own jitted step has about a hundred on CPU, a figure
of XLA's, not checked here: it would cost one more ResNet-50 compile).
"""

import functools
import pathlib
import re
from collections import Counter
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    NO_LLVM_OPT,
    assert_parity,
    assert_rejected,
    build,
    compiled_step,
    place,
    random_state,
    reference,
    run,
    step_with_tx,
    tiny_config,
    zero_grads,
)
from helpers import batches as host_batches
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import ConfigError, make_mesh, preset_rules, shard_batch
from hybridpar.config.schema import validate
from hybridpar.models import ResNet50, ResNetTiny
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.parallel.bucketed import (
    active_axes,
    bucket_plan,
    forward_params,
    reduce_in_buckets,
    to_varying,
)
from hybridpar.parallel.overlap import reduce_in_backward, reduce_in_backward_manual
from hybridpar.parallel.partitioning import batch_sharding, infer_shardings, path_str
from hybridpar.program.precision import LossScale, Policy
from hybridpar.program.state import abstract_like, make_init_fn
from hybridpar.program.steps import jit_train_step, make_train_step, normalize, scaled_loss_fn
from hybridpar.program.sync import BucketedSync, XlaSync, make_sync
from hybridpar.tools.comm_report import parse_collectives

BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 3
MEAN, STD = (127.5,) * 3, (64.0,) * 3
TINY_BUCKET_MB = 0.1  # several buckets for the tiny ResNet (its params take 0.7 MiB)
TOL = dict(rtol=1e-4, atol=1e-5)


def _program(mode, bn_sync, mesh="data:8", **overrides):
    config = tiny_config(
        mesh,
        **{
            "comm.mode": mode,
            "comm.bucket_mb": TINY_BUCKET_MB,
            "model.bn_sync": bn_sync,
            "label_smoothing": 0.1,
            **overrides,
        },
    )
    return config, build(config)


def _tiny_plan():
    """The tiny ResNet's buckets: the paths whose gradients each psum carries."""
    return bucket_plan(
        forward_params(ResNetTiny(num_classes=CLASSES), (1, SIZE, SIZE, 3)), TINY_BUCKET_MB
    )


@functools.lru_cache(maxsize=None)  # the dropped-bucket control reuses the "local" pair
def _pair(bn_sync, mesh="data:8", **overrides):
    """The xla step's reference run and the bucketed step's run from the same start."""
    _, xla = _program("xla", bn_sync, mesh, **overrides)
    config, bucketed = _program("bucketed", bn_sync, mesh, **overrides)
    start = random_state(xla)
    # Both without LLVM's optimisations (helpers.NO_LLVM_OPT: the same HLO, a third less
    # compile time; this file compiles ten tiny steps).
    want_step = compiled_step(xla, start, NO_LLVM_OPT)
    got_step = compiled_step(bucketed, start, NO_LLVM_OPT)
    want = reference(xla, start, host_batches(), step=want_step)
    got = run(got_step, bucketed, start, host_batches())
    return want, got, want_step.as_text(), got_step.as_text(), (config, bucketed)


def _all_reduces(hlo: str, kind: str = "all-reduce") -> list[str]:
    return [ln for ln in hlo.splitlines() if f" {kind}(" in ln or f" {kind}-start(" in ln]


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
    # the argument's own name first (a library caller passed it), then the config key
    with pytest.raises(ConfigError, match=r"^bucket_mb=0 \(comm\.bucket_mb in a config\)"):
        bucket_plan(params, 0)


class _NoTrainMLP(nn.Module):
    """A user's model: no ``train`` argument, layers named against alphabetical order."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(4, name="zz_first")(x))
        return nn.Dense(2, name="aa_last")(nn.relu(nn.Dense(4, name="mid")(x)))


def test_forward_params_passes_only_the_callers_arguments_and_keeps_forward_order():
    model = _NoTrainMLP()
    params = forward_params(model, (1, 3))  # no train argument added for the model
    assert list(params) == ["zz_first", "mid", "aa_last"]
    # jit/eval_shape sort dict keys: a plan from their params would go alphabetically.
    traced = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 3))))["params"]
    assert list(traced) == ["aa_last", "mid", "zz_first"]
    assert bucket_plan(params, 1)[0][0] == ("aa_last", "bias")  # last layer first


@pytest.mark.parametrize(
    "reduce", [reduce_in_buckets, reduce_in_backward, reduce_in_backward_manual]
)
def test_a_plan_that_does_not_cover_the_tree_names_the_paths(reduce):
    tree = {"a": {"kernel": np.zeros(2)}, "b": {"kernel": np.zeros(2)}}
    plan = [[("a", "kernel"), ("c", "kernel")]]  # made from another tree
    expect = r"missing from the plan: 'b/kernel'; in the plan but not the \w+: 'c/kernel'"
    with pytest.raises(ConfigError, match=expect):
        reduce(tree, plan, ("data",), 1)


def _mlp_problem():
    """A user's own MLP on data:8: ``(model, mesh, x, y, params, loss_fn)``."""
    model, mesh = _NoTrainMLP(), make_mesh("data:8")
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 3).astype(np.float32), rs.randint(0, 2, 16)
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return model, mesh, x, y, params, loss_fn


def _mlp_grads(axes, varying=True, check_vma=True):
    """The docs' snippet (docs/communication.md) on data:8 with a user's own MLP: the
    bucketed mean of the per-device gradients, and the same gradient on one device."""
    model, mesh, x, y, params, loss_fn = _mlp_problem()

    plan = bucket_plan(forward_params(model, (1, 3)), 1e-4)  # several buckets

    def per_device(params, x, y):
        if varying:
            params = jax.tree.map(lambda p: to_varying(p, axes), params)
        return reduce_in_buckets(jax.grad(loss_fn)(params, x, y), plan, axes)

    step = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axes), P(axes)),
                         out_specs=P(), check_vma=check_vma)  # fmt: skip
    return jax.jit(step)(params, x, y), jax.grad(loss_fn)(params, x, y)


@pytest.mark.parametrize(
    "axes, varying, check_vma",
    [
        (("data",), True, True),
        ("data", True, True),  # one axis name, not the axes "d", "a", "t", "a"
        (("data",), False, False),  # no type checks: jax.grad summed nothing, nothing to refuse
    ],
)
def test_reduce_in_buckets_of_a_users_mlp_equals_one_device(axes, varying, check_vma):
    got, want = _mlp_grads(axes, varying, check_vma)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_reduce_in_buckets_refuses_gradients_jax_already_summed():
    # Without to_varying, jax.grad sums each replicated parameter's gradient over data
    # itself; a second psum would make them 8 times too large.
    with pytest.raises(ConfigError, match=r"not varying over \('data',\).*to_varying"):
        _mlp_grads(("data",), varying=False)


def test_active_axes_names_only_the_axes_the_mesh_has():
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    assert active_axes(one) == ("data",)  # not fsdp, which shard_map would refuse
    assert active_axes(make_mesh("data:1", devices=jax.devices()[:1])) == ("data", "fsdp")
    assert active_axes(make_mesh("data:4,model:2")) == ("data",)


COMM_DOCS = pathlib.Path(__file__).parent.parent / "docs" / "communication.md"


def test_the_docs_own_code_snippets_run_as_written_and_equal_one_device(capsys):
    """docs/communication.md's bucketed snippet, then its overlap one, on data:8 with a
    user's MLP: the overlap step's gradient is the one-device gradient. Planted bug that
    fails it: the snippet wrapping the parameters before ``jax.grad``, not inside it."""
    text = COMM_DOCS.read_text()
    at, snippets = text.index("In your own code, the bucketed reduction"), []
    for _ in range(2):  # the bucketed snippet, then the overlap one
        start = text.index("```python\n", at) + 10
        at = text.index("```\n", start)
        snippets.append(text[start:at])
    model, mesh, x, y, params, loss_fn = _mlp_problem()

    ns = dict(jax=jax, P=P, mesh=mesh, model=model, params=params, x=x, y=y, loss_fn=loss_fn)
    for snippet in snippets:
        exec(compile(snippet, str(COMM_DOCS), "exec"), ns)
    assert "all-reduce" in capsys.readouterr().out  # the bucketed snippet's collectives
    want = jax.grad(loss_fn)(params, x, y)
    for g, w in zip(jax.tree.leaves(ns["grads"]), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 2, rngs=rngs)])  # an int key in the State

    def __call__(self, x):
        return self.layers[0](nnx.relu(self.a(x)))


@pytest.mark.parametrize("reduce", ["reduce_in_buckets", "reduce_in_backward"])
def test_a_plan_of_nnx_state_reduces_its_gradients_as_lax_pmean(reduce):
    """An NNX State's paths as infer_shardings takes them (no ``value`` of its Variables),
    in bucket_plan and the reductions alike. Planted bug that fails it: the reductions
    flattening the Variables (paths ``a/bias/value``: the plan does not cover them)."""
    graphdef, params = nnx.split(_NnxNet(nnx.Rngs(0)), nnx.Param)
    mesh, axes = make_mesh("data:8"), ("data",)
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 3).astype(np.float32), rs.randint(0, 2, 16)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    plan = bucket_plan(params, 1e-5)  # a bucket per array
    assert sorted(p for b in plan for p in b) == [
        ("a", "bias"), ("a", "kernel"), ("layers", "0", "bias"), ("layers", "0", "kernel")
    ]  # fmt: skip

    def varying(params):
        return jax.tree.map(lambda p: to_varying(p, axes), params)

    def bucketed(params, x, y):
        if reduce == "reduce_in_buckets":
            return reduce_in_buckets(jax.grad(loss_fn)(varying(params), x, y), plan, axes)
        return jax.grad(lambda p: loss_fn(reduce_in_backward(p, plan, axes), x, y))(params)

    def pmean(params, x, y):
        return lax.pmean(jax.grad(loss_fn)(varying(params), x, y), axes)

    def run(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P(axes), P(axes)),
                                     out_specs=P()))(params, x, y)  # fmt: skip

    got, want = run(bucketed), run(pmean)
    assert isinstance(got["a"]["kernel"], nnx.Param)  # the State's structure, Variables kept
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8)


def _reduced_as_pmean(reduce, params, loss_fn, plan):
    """``reduce``'s mean of the per-device gradients of ``loss_fn`` on data:8 (a batch of
    16 rows of 4), ``lax.pmean``'s of the whole tree, and the one-device gradient."""
    mesh, axes = make_mesh("data:8"), ("data",)
    x = np.random.RandomState(0).randn(16, 4).astype(np.float32)

    def varying(params):
        return jax.tree.map(lambda p: to_varying(p, axes), params)

    def bucketed(params, x):
        if reduce == "reduce_in_buckets":
            return reduce_in_buckets(jax.grad(loss_fn)(varying(params), x), plan, axes)
        return jax.grad(lambda p: loss_fn(reduce_in_backward(p, plan, axes), x))(params)

    def pmean(params, x):
        return lax.pmean(jax.grad(loss_fn)(varying(params), x), axes)

    def run(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P(axes)),
                                     out_specs=P()))(params, x)  # fmt: skip

    return run(bucketed), run(pmean), jax.grad(loss_fn)(params, x)


def _assert_same_trees(*trees):
    structure = jax.tree.structure(trees[0])
    for t in trees[1:]:
        assert jax.tree.structure(t) == structure
        for g, w in zip(jax.tree.leaves(trees[0]), jax.tree.leaves(t), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduce", ["reduce_in_buckets", "reduce_in_backward"])
def test_a_plan_of_lists_and_tuples_goes_in_forward_order_and_reduces_as_lax_pmean(reduce):
    """A plain pytree with a list of layers and a tuple: planned in forward order (list
    and tuple by index), reduced to ``lax.pmean`` of the whole tree and the one-device
    gradient. Planted bug that fails it: ``bucket_plan`` walking into dicts only (a list
    taken as one leaf: AttributeError 'list' object has no attribute 'dtype')."""
    rs = np.random.RandomState(1)
    params = {
        "layers": [{"w": jnp.asarray(rs.randn(4, 4), jnp.float32)} for _ in range(2)],
        "pair": (jnp.asarray(rs.randn(4), jnp.float32), jnp.asarray(rs.randn(4), jnp.float32)),
        "out": jnp.asarray(rs.randn(4), jnp.float32),
    }

    def loss_fn(p, x):
        for layer in p["layers"]:
            x = jnp.tanh(x @ layer["w"])
        return jnp.mean((x * p["pair"][0] + p["pair"][1]) @ p["out"])

    plan = bucket_plan(params, 1e-5)  # a bucket per array
    assert [p for b in plan for p in b] == [
        ("out",), ("pair", "1"), ("pair", "0"), ("layers", "1", "w"), ("layers", "0", "w")
    ]  # fmt: skip
    _assert_same_trees(*_reduced_as_pmean(reduce, params, loss_fn, plan))


@pytest.mark.parametrize("reduce", ["reduce_in_buckets", "reduce_in_backward"])
def test_a_key_holding_a_slash_is_one_key(reduce):
    """A dict key with a ``/`` in it is one path part, in the plan and the reductions.
    Planted bug that fails it: the reductions' paths read from ``path_str`` split at ``/``
    (``a/b`` then both missing from the plan and in it but not the gradients)."""
    params = {"a/b": {"w": jnp.full((4,), 0.5)}, "c": jnp.arange(4.0)}

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x * p["a/b"]["w"]) @ p["c"])

    plan = bucket_plan(params, 1)
    assert plan == [[("c",), ("a/b", "w")]]
    _assert_same_trees(*_reduced_as_pmean(reduce, params, loss_fn, plan))


class _TokenNet(nn.Module):
    """Token ids in: ``nn.Embed`` refuses a float input."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(16, 4, name="zz_embed")(tokens).mean(1)
        return nn.Dense(2, name="aa_head")(x)


def test_forward_params_of_a_model_taking_token_ids():
    """``forward_params(..., dtype=jnp.int32)`` inits a model on integer input, in forward
    order. Planted bug that fails it: the dummy input always float32 (Flax: 'Input type
    must be an integer or unsigned integer')."""
    params = forward_params(_TokenNet(), (1, 8), dtype=jnp.int32)
    assert list(params) == ["zz_embed", "aa_head"]
    assert params["zz_embed"]["embedding"].shape == (16, 4)
    assert bucket_plan(params, 1)[0][-1] == ("zz_embed", "embedding")  # first layer last


@pytest.mark.parametrize(
    "reduce", [reduce_in_buckets, reduce_in_backward, reduce_in_backward_manual]
)
def test_an_axis_no_shard_map_binds_is_a_config_error(reduce):
    # JAX's own errors: a NameError "unbound axis name: dta", an AssertionError, or
    # "pvary should be called under jax.shard_map".
    tree, plan = {"a": {"kernel": jnp.ones((4, 2))}}, [[("a", "kernel")]]
    with pytest.raises(ConfigError, match=r"'dta' is not one of the axes of the jax.shard_map"
                       r" it runs in, \('data', 'fsdp', 'model'\).*active_axes"):  # fmt: skip
        jax.shard_map(lambda t: reduce(t, plan, ("dta",), 8), mesh=make_mesh("data:8"),
                      in_specs=P(), out_specs=P())(tree)  # fmt: skip
    with pytest.raises(ConfigError, match=r"over \('data',\), and here it runs outside any"):
        reduce(tree, plan, ("data",), 8)


def test_a_bucket_of_several_gradients_never_passes_bucket_mb_a_larger_one_is_alone():
    """The contract the docs give: a bucket holds at most ``bucket_mb`` MiB, filled up to
    the limit itself, except a gradient larger than that, alone in its bucket. Planted bug
    that fails it: the bucket closed after the gradient that takes it over the limit (each
    bucket then over it by one array)."""
    quarter = 2**18 // 4  # float32 elements in a quarter MiB

    def params(*quarters):  # forward order: l0 first
        return {f"l{i}": {"kernel": jax.ShapeDtypeStruct((n * quarter,), jnp.float32)}
                for i, n in enumerate(quarters)}  # fmt: skip

    plan = bucket_plan(params(4, 4, 4, 12, 20, 4), 2)  # MiB: 1, 1, 1, 3, 5, 1
    assert plan == [[("l5", "kernel")], [("l4", "kernel")], [("l3", "kernel")],
                    [("l2", "kernel"), ("l1", "kernel")], [("l0", "kernel")]]  # fmt: skip
    plan = bucket_plan(params(1, 2, 3, 2), 1)  # MiB: 0.25, 0.5, 0.75, 0.5
    assert plan == [[("l3", "kernel")], [("l2", "kernel")], [("l1", "kernel"), ("l0", "kernel")]]


def test_rejects_model_parallel_meshes_and_params_split_over_data():
    config = tiny_config("data:8", **{"comm.mode": "bucketed", "comm.bucket_mb": 32})
    with pytest.raises(ConfigError, match="comm.mode=xla"):
        make_sync(config, make_mesh("data:4,model:2"), None)
    mesh = make_mesh("data:8")
    params = forward_params(ResNetTiny(num_classes=CLASSES), (1, SIZE, SIZE, 3))
    on_data = jax.tree.map(lambda x: NamedSharding(mesh, P("data")), params)
    shardings = SimpleNamespace(params=on_data, batch_stats={})
    with pytest.raises(ConfigError, match="split over 'data'"):
        make_sync(config, mesh, shardings)
    config.model.bn_sync = "group:3"
    with pytest.raises(ConfigError, match="bn_sync"):
        make_sync(config, mesh, None)


def test_fsdp_dims_reads_a_spec_entry_as_mesh_axis_names_does():
    """A spec entry of several axes as a list (a spec a user's sharding carries unnormalised)
    named no axis: ``fsdp_dims`` took the list as one name and missed its fsdp (planted: its
    own 'one name or several' in place of ``mesh.axis_names``)."""
    from hybridpar.parallel.bucketed import fsdp_dims

    specs = {"w": SimpleNamespace(spec=(None, ["fsdp", "model"])), "b": P("fsdp"), "s": P()}
    assert fsdp_dims(specs) == {("w",): 1, ("b",): 0}
    # the parameter first (a library caller has no config), then the config key
    with pytest.raises(ConfigError, match=r"^parameter 'w' is split over 'data' .*"
                       r"\(comm\.mode=bucketed in a config\)"):  # fmt: skip
        fsdp_dims({"w": SimpleNamespace(spec=(["data", "fsdp"],))})


# --- numerics: bucketed == xla on data:8 -------------------------------------------------


@pytest.mark.parametrize("bn_sync", ["global", "local", "group:2"])
def test_bucketed_equals_xla(bn_sync):
    want, got, want_hlo, got_hlo, _ = _pair(bn_sync)
    assert_parity(got, want)
    # One psum per bucket plus one for the loss and BN running averages.
    plan = _tiny_plan()
    assert len(plan) > 2
    n_xla, n_got = len(_all_reduces(want_hlo)), len(_all_reduces(got_hlo))
    print(f"tiny {bn_sync}: xla {n_xla} all-reduces, bucketed {n_got}")
    if bn_sync == "local":
        assert n_got == len(plan) + 1


def test_rejects_a_dropped_bucket():
    """Negative control: the bucketed step with one bucket's gradients zeroed (as if its
    psum were lost) fails the same check against the xla step."""
    want, _, _, _, (config, bucketed) = _pair("local")
    plan = _tiny_plan()
    bucket = plan[len(plan) // 2]
    pattern = "^(" + "|".join(re.escape("/".join(p)) for p in bucket) + ")$"
    broken = step_with_tx(bucketed, config, zero_grads(bucketed.tx, pattern))
    broken = compiled_step(bucketed, want.start, NO_LLVM_OPT, step=broken)
    got = run(broken, bucketed, want.start, host_batches())
    assert_rejected(got, want, re.escape(bucket[0][0]))


# data:2 x fsdp:4, the general case: gradients reduce-scattered over fsdp and all-reduced
# over data (fsdp:8 alone is its special case of one data group, not compiled as well).
@pytest.mark.parametrize("mesh", ["data:2,fsdp:4"])
def test_bucketed_fsdp_equals_xla(mesh):
    # Split every array of >= 64 elements (most of the tiny ResNet, BN vectors included):
    # the bucketed step gathers those parameters and reduce-scatters their gradients.
    want, got, want_hlo, got_hlo, _ = _pair("global", mesh, **{"partitioning.fsdp_min_size": 64})
    assert_parity(got, want)
    scatters = _all_reduces(got_hlo, "reduce-scatter")
    plan = _tiny_plan()
    print(f"tiny {mesh}: {len(plan)} buckets, {len(scatters)} reduce-scatters")
    assert len(scatters) == len(plan)  # every bucket holds split parameters here
    assert not _all_reduces(want_hlo, "reduce-scatter")  # XLA's own step: all-reduces


def test_bucketed_float16_loss_scale_skips_overflow():
    # A scale of 2**40 overflows float16 activations' gradients: the step must be skipped.
    overrides = {"precision.compute": "float16", "precision.loss_scale_initial": 2.0**40}
    _, program = _program("bucketed", "local", **overrides)
    start = random_state(program)
    assert float(start.loss_scale.scale) == 2.0**40
    state = place(start, program.shardings)
    step = compiled_step(program, start, NO_LLVM_OPT)
    new, m = step(state, shard_batch(host_batches(steps=1)[0], program.mesh))
    new = jax.device_get(new)
    assert not bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0**40
    assert float(new.loss_scale.scale) == 2.0**39
    assert int(new.step) == 1
    for g, w in zip(jax.tree.leaves(new.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(g, w)


# --- HLO: ResNet-50 on data:8, compiled only --------------------------------------------


def _resnet50_hlo(mesh="data:8"):
    """The bucketed ResNet-50 step's compiled HLO: the model as a config with bn_sync=local
    builds it (8 BN groups), reconfigured for shard_map by the step."""
    mesh = make_mesh(mesh)
    model = ResNet50(num_classes=1000, bn_groups=bn_groups_for("local", 8))
    tx = optax.sgd(0.1, momentum=0.9)
    image = (64, 64, 3)
    init = make_init_fn(model, tx, (1, *image), LossScale.create(dynamic=False))
    abstract = jax.eval_shape(init, jax.random.key(0))
    shardings = infer_shardings(abstract, preset_rules("auto", mesh), mesh)
    sync = BucketedSync(mesh, 32, "local", shardings)
    fn = make_train_step(model, tx, Policy(), lambda s: 0.1, mean=MEAN, std=STD, sync=sync)
    step = jit_train_step(fn, shardings, mesh, {"image": 4, "label": 1})
    batch = {
        "image": jax.ShapeDtypeStruct((16, *image), np.uint8, sharding=batch_sharding(mesh, 4)),
        "label": jax.ShapeDtypeStruct((16,), np.int32, sharding=batch_sharding(mesh, 1)),
    }
    # Only the HLO is read: LLVM's optimisations (a large part of the compile) change none of it.
    lowered = step.lower(abstract_like(abstract, shardings), batch)
    hlo = lowered.compile(NO_LLVM_OPT).as_text()
    return hlo, abstract


def _result_sizes(line: str, kind: str = "all-reduce") -> list[int]:
    """Element counts of an all-reduce's results: ``= (f32[10]{0}, f32[3]{0}) all-reduce(``."""
    lhs = re.split(rf" {kind}(-start)?\(", line)[0].split("=", 1)[1]
    return [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"\[([\d,]*)\]", lhs)
    ]


def test_resnet50_bucketed_local_all_reduce_count(resnet50_params):
    hlo, abstract = _resnet50_hlo()
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
    # of the small replicated ones); one more all-gather for the split BN statistics, one
    # all-reduce for the loss and BN running averages, and one of a single boolean: whether
    # every (split) gradient is finite, for the skip of a non-finite step.
    hlo, abstract = _resnet50_hlo("fsdp:8")
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
    assert len(reduces) <= len(plan) + 2
    # (XLA's own fsdp step gathers each array on its own, > 50 all-gathers: not compiled here
    # any more, a second ResNet-50 compile for a figure docs/model_parallel.md has.)


# --- comm.reduce_dtype=bfloat16: the buckets summed in bfloat16 -------------------------
#
# Tolerance, derived from bfloat16's precision rather than measured: bfloat16 keeps 8
# significant bits, so rounding a value to it moves it by at most u = 2^-8 of its size.
# A bucket's element is mean_i g_i over the n = 8 devices. Each g_i is rounded once when
# the bucket is cast (<= u |g_i|); a ring reduce in bfloat16 (GPU, TPU) rounds each of its
# n - 1 partial sums, each <= sum_i |g_i|; the CPU sums in float32 and rounds the sum once.
# So the mean is off by at most n u A, A = mean_i |g_i| (the cancelling per-device
# gradients, not the small mean, set the size of the error); the check allows (n + 1) u A,
# one rounding more for the float32 reference's own rounding (2^-24-sized, far below).
# Checked against the mean of the per-device gradients computed on one device (bn_sync
# local: each device's gradient is exactly its own slice's).

U_BF16 = 2.0**-8


def _reduced_grads(program, start, reduce_dtype, sync=None):
    """The gradients a bucketed data:8 step reduces (the mean over devices), per path;
    ``sync``: another sync's (``XlaSync``) instead."""
    sync = sync or BucketedSync(
        program.mesh, TINY_BUCKET_MB, "local", program.shardings, reduce_dtype
    )

    def loss_fn_for(m, stats, images, labels, scale):
        return scaled_loss_fn(m, stats, images, labels, scale, 0.1)

    def grads(state, images, labels):
        return sync.gradients(program.model, state, images, labels, loss_fn_for)[0]

    batch = shard_batch(host_batches(steps=1)[0], program.mesh)
    images = normalize(batch["image"], MEAN, STD, np.float32)
    state = place(start, program.shardings)
    out = jax.jit(grads)(state, images, batch["label"])
    return sync, {path_str(kp): np.asarray(g) for kp, g in jax.tree.leaves_with_path(out)}


def _per_device_grads(program, start, sync, n=8):
    """Each device's gradient, on ONE device: the local-BN model on its slice of the batch."""
    local = sync.local_model(program.model)
    batch = host_batches(steps=1)[0]
    images = normalize(batch["image"], MEAN, STD, np.float32)
    per = BATCH // n

    @jax.jit
    def grad(params, images, labels):
        loss_fn = scaled_loss_fn(local, start.batch_stats, images, labels, 1.0, 0.1)
        return jax.grad(loss_fn, has_aux=True)(params)[0]

    out = [
        grad(start.params, images[i * per : (i + 1) * per], batch["label"][i * per : (i + 1) * per])
        for i in range(n)
    ]
    return {
        path_str(kp): np.stack([np.asarray(jax.tree.leaves(o)[j], np.float64) for o in out])
        for j, (kp, _) in enumerate(jax.tree.leaves_with_path(out[0]))
    }


def _excess(got: dict, per_device: dict, u: float, n: int = 8) -> dict:
    """``{path: max |got - mean_i g_i| / ((n + 1) u A)}``: above 1 fails the check."""
    out = {}
    for path, g in per_device.items():
        tol = (n + 1) * u * np.abs(g).mean(0)
        want = g.mean(0)
        tol = np.maximum(tol, 2 * np.spacing(np.abs(want).astype(np.float32)))
        out[path] = float((np.abs(got[path] - want) / tol).max())
    return out


@functools.lru_cache(maxsize=None)
def _reduce_dtype_setup():
    _, program = _program("bucketed", "local")
    start = random_state(program)
    sync, want32 = _reduced_grads(program, start, "float32")
    return program, start, want32, _per_device_grads(program, start, sync)


def test_bfloat16_reduce_within_bfloat16_rounding_of_one_device():
    program, start, got32, per_device = _reduce_dtype_setup()
    _, got16 = _reduced_grads(program, start, "bfloat16")
    # float32 buckets: the one-device mean to float32 rounding (far inside the bound).
    assert max(_excess(got32, per_device, 2.0**-20).values()) <= 1
    # bfloat16 buckets: within the derived bound, of the one device and of float32.
    excess = _excess(got16, per_device, U_BF16)
    print("bfloat16 reduce, worst |error| / bound:", max(excess.values()))
    assert max(excess.values()) <= 1, excess
    # ... and summed in bfloat16 indeed: every element a bfloat16 value (the mean of 8 is an
    # exact division of a bfloat16 sum), which float32 buckets are not.
    for g16, g32 in ((got16[p], got32[p]) for p in got16):
        assert g16.dtype == np.float32
        np.testing.assert_array_equal(g16, g16.astype(jnp.bfloat16).astype(np.float32))
    assert any(np.any(g != g.astype(jnp.bfloat16).astype(np.float32)) for g in got32.values())


@pytest.mark.parametrize("broken", ["float8_e4m3fn", "dropped bucket"])
def test_bfloat16_bound_rejects_a_coarser_reduce_or_a_dropped_bucket(broken):
    """Negative controls: the same bound rejects buckets summed in float8 (u = 2^-4) and
    a bucketed bfloat16 reduction with one bucket's gradients zeroed."""
    program, start, _, per_device = _reduce_dtype_setup()
    if broken == "dropped bucket":
        _, got = _reduced_grads(program, start, "bfloat16")
        bucket = _tiny_plan()[len(_tiny_plan()) // 2]
        for p in bucket:
            got["/".join(p)] = np.zeros_like(got["/".join(p)])
    else:
        _, got = _reduced_grads(program, start, broken)
    excess = _excess(got, per_device, U_BF16)
    print(broken, sorted(excess.items(), key=lambda kv: -kv[1])[:3])
    assert max(excess.values()) > 1


@functools.lru_cache(maxsize=None)
def _collectives(mesh, reduce_dtype):
    """The tiny bucketed step's collectives as ``comm_report`` tables them (its parser)."""
    overrides = {"comm.reduce_dtype": reduce_dtype, "partitioning.fsdp_min_size": 64}
    _, program = _program("bucketed", "local", mesh, **overrides)
    hlo = compiled_step(program, random_state(program), NO_LLVM_OPT).as_text()
    return program, parse_collectives(hlo)


@pytest.mark.parametrize("mesh", ["data:8", "data:2,fsdp:4"])
def test_bfloat16_reduce_halves_the_gradient_bytes(mesh):
    """The all-reduce / reduce-scatter bytes of the gradient buckets with bfloat16 are half
    those with float32; the collectives both programs share byte for byte (the float32
    loss and BatchNorm psum, the parameters' all-gathers) are the only others."""
    program, rows32 = _collectives(mesh, "float32")
    _, rows16 = _collectives(mesh, "bfloat16")
    grads = {}
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        ops32, ops16 = (
            Counter({(r["bytes"], r["groups"]): r["count"] for r in rows if r["kind"] == kind})
            for rows in (rows32, rows16)
        )
        same = ops32 & ops16
        total = [sum(b * n for (b, _), n in (ops - same).items()) for ops in (ops32, ops16)]
        print(f"{mesh} {kind}: float32 {total[0]} B, bfloat16 {total[1]} B, shared {dict(same)}")
        assert total[0] == 2 * total[1]
        grads[kind] = total[0]
    if mesh == "data:8":
        stats = sum(x.size for x in jax.tree.leaves(program.abstract.batch_stats))
        params = sum(x.size for x in jax.tree.leaves(program.abstract.params))
        # All the gradients once, and only the loss with the running averages shared.
        assert grads["all-reduce"] == 4 * params
        assert [r["bytes"] for r in rows16 if r["kind"] == "all-reduce"].count(4 + 4 * stats)
    else:
        assert grads["reduce-scatter"] > 0 and grads["all-gather"] == 0


def test_reduce_dtype_is_checked():
    for mode in ("bucketed", "xla"):
        validate(tiny_config(**{"comm.mode": mode, "comm.reduce_dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match="comm.reduce_dtype='float16' is not one of"):
        validate(tiny_config(**{"comm.mode": "bucketed", "comm.reduce_dtype": "float16"}))
    with pytest.raises(ConfigError, match="needs model.head=dense"):
        validate(tiny_config(**{"comm.reduce_dtype": "bfloat16", "model.head": "sharded"}))
    # comm.mode=xla reduces explicitly on data-parallel meshes only
    with pytest.raises(ConfigError, match="needs a mesh over data only .*model=2"):
        build(tiny_config("data:4,model:2", **{"comm.reduce_dtype": "bfloat16"})).train_jit


# --- comm.reduce_dtype=bfloat16 under comm.mode=xla: the reduction made explicit -----------
#
# The same bound and one-device reference as the bucketed step's above: XlaSync with a
# reduce dtype computes each device's gradient under shard_map and sums them in one psum.


def _xla_reduced(reduce_dtype):
    _, program, start, _ = _xla_reduce_setup()
    sync = XlaSync(program.mesh, reduce_dtype, "local")
    return _reduced_grads(program, start, reduce_dtype, sync)[1]


@functools.lru_cache(maxsize=None)
def _xla_reduce_setup():
    config, program = _program("xla", "local")
    _, start, _, per_device = _reduce_dtype_setup()  # the same parameters, one device's grads
    return config, program, start, per_device


def test_xla_mode_bfloat16_reduce_within_bfloat16_rounding_of_one_device():
    *_, per_device = _xla_reduce_setup()
    got32, got16 = _xla_reduced("float32"), _xla_reduced("bfloat16")
    excess = _excess(got16, per_device, U_BF16)
    print("xla mode, bfloat16 reduce, worst |error| / bound:", max(excess.values()))
    assert max(excess.values()) <= 1, excess
    # summed in bfloat16 (every element a bfloat16 value), handed on in float32; XLA's own
    # float32 reduction (the plain step) is not
    for g in got16.values():
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, g.astype(jnp.bfloat16).astype(np.float32))
    assert any(np.any(g != g.astype(jnp.bfloat16).astype(np.float32)) for g in got32.values())


def test_xla_mode_bound_rejects_a_coarser_reduce():
    """Negative control: the same bound rejects the gradients summed in float8."""
    *_, per_device = _xla_reduce_setup()
    assert max(_excess(_xla_reduced("float8_e4m3fn"), per_device, U_BF16).values()) > 1


def test_xla_mode_bfloat16_reduce_halves_the_gradient_bytes():
    """The data:8 xla step's all-reduces: float32 reduces every gradient at 4 bytes, the
    bfloat16 step at 2, in one all-reduce of its own; the loss and BatchNorm statistics
    (4 + 4 x statistics bytes) are float32 in both."""
    totals = {}
    for rd in ("float32", "bfloat16"):
        _, program = _program("xla", "local", **{"comm.reduce_dtype": rd})
        rows = parse_collectives(
            compiled_step(program, random_state(program), NO_LLVM_OPT).as_text()
        )
        totals[rd] = sum(r["total_bytes"] for r in rows if r["kind"] == "all-reduce")
        print(rd, [(r["count"], r["bytes"]) for r in rows])
    params = sum(x.size for x in jax.tree.leaves(program.abstract.params))
    stats = sum(x.size for x in jax.tree.leaves(program.abstract.batch_stats))
    shared = 4 + 4 * stats
    assert totals["float32"] == 4 * params + shared
    assert totals["bfloat16"] == 2 * params + shared
    assert [r["bytes"] for r in rows if r["kind"] == "all-reduce"].count(2 * params) == 1


@jax.custom_vjp
def _bf16_cotangent(p):
    return p


_bf16_cotangent.defvjp(
    lambda p: (p, None), lambda _, ct: (ct.astype(jnp.bfloat16).astype(ct.dtype),)
)


@pytest.mark.parametrize("rounded", [False, True])
def test_under_jit_a_cotangent_cast_lands_after_the_gradient_all_reduce(rounded):
    """Why comm.mode=xla reduces explicitly for reduce_dtype: a custom VJP that rounds each
    parameter's cotangent to bfloat16 is compiled after the all-reduce the SPMD partitioner
    put at the weight-gradient dot, which stays float32 (if XLA ever moves the cast before
    the reduction, the bytes halve here and the cast would do)."""
    mesh = make_mesh("data:8")
    w = {"a": jnp.ones((16, 32)), "b": jnp.ones((32, 4))}

    def loss(w, x):
        w = jax.tree.map(_bf16_cotangent, w) if rounded else w
        return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"]) ** 2)

    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    step = jax.jit(jax.grad(loss), in_shardings=shardings, out_shardings=shardings[0])
    rows = parse_collectives(step.lower(w, jnp.ones((64, 16))).compile().as_text())
    assert [(r["kind"], r["total_bytes"]) for r in rows] == [("all-reduce", 4 * (16 * 32 + 32 * 4))]


# --- a user's own model (no BatchNorm sync fields) ---------------------------------------


class _UserNet(nn.Module):
    """A user's Flax model, without hybridpar.models' BatchNorm sync fields."""

    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        if self.batch_norm:
            x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(CLASSES)(nn.relu(x))


def _user_state(model):
    init = make_init_fn(model, optax.sgd(0.1), (1, SIZE, SIZE, 3), LossScale.create(False))
    return init(jax.random.key(0))


@pytest.mark.parametrize("bn_sync", ["global", "local"])
def test_a_model_without_batchnorm_needs_no_sync_fields(bn_sync):
    model = _UserNet()
    state = _user_state(model)
    batch = host_batches(steps=1)[0]
    images = normalize(batch["image"], MEAN, STD, np.float32)

    def loss_fn_for(model, stats, images, labels, scale):
        return scaled_loss_fn(model, stats, images, labels, scale, 0.0)

    want = jax.grad(loss_fn_for(model, {}, images, batch["label"], 1.0), has_aux=True)(
        state.params
    )[0]
    sync = BucketedSync(make_mesh("data:8"), TINY_BUCKET_MB, bn_sync)
    assert sync.local_model(model) is model
    placed = shard_batch(batch, sync.mesh)
    got = jax.jit(lambda s, x, y: sync.gradients(model, s, x, y, loss_fn_for)[0])(
        state, normalize(placed["image"], MEAN, STD, np.float32), placed["label"]
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_a_model_with_batchnorm_but_no_sync_fields_is_refused_where_it_needs_syncing():
    model = _UserNet(batch_norm=True)
    stats = _user_state(model).batch_stats
    mesh = make_mesh("data:8")
    with pytest.raises(ConfigError, match=r"bn_sync='global' over 8 devices.*_UserNet has "
                       r"BatchNorm statistics.*model.bn_sync=local"):  # fmt: skip
        BucketedSync(mesh, TINY_BUCKET_MB, "global").local_model(model, stats)
    # each device's own statistics are what bn_sync=local asks for
    assert BucketedSync(mesh, TINY_BUCKET_MB, "local").local_model(model, stats) is model
