"""Class-sharded classifier heads (model.head = sharded | partial_fc) against the dense head.

On ``data:2,model:4`` the sharded heads' loss, gradients and top-k hits must equal the dense
head's on one device (float32), first for one dense layer on random features, then for whole
train and eval steps of the tiny ResNet built from a config. The compiled steps must move no
array with a dimension of the full class count: the logits are never gathered.

Tolerance as in tests/test_parity.py: the sharded heads sum exponentials and gradients in
another order (per-shard partial sums, then a psum), so float32 results differ by rounding.
"""

import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NO_LLVM_OPT
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import ConfigError, make_mesh, shard_batch
from hybridpar.config.curriculum import single_stage_plan
from hybridpar.config.schema import base_config, validate
from hybridpar.parallel.mesh import AXES, BATCH_AXES
from hybridpar.parallel.sharded_head import ShardedHead
from hybridpar.program.heads import make_head
from hybridpar.program.program import build_program
from hybridpar.program.state import init_sharded
from hybridpar.program.steps import DENSE, cross_entropy, normalize
from hybridpar.tools.comm_report import ANALYSIS_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
MESH = "data:2,model:4"
# No other dimension of the tiny ResNet step (batch 16, widths 8..64, 16 px) is 48, so a
# collective with a 48-wide dimension can only be moving full rows of logits (or of the
# head's kernel); 48 divides the 4 model shards and the 8 partial-FC shards.
B, E, C = 16, 32, 48
TOL = dict(rtol=1e-4, atol=1e-5)
HEADS = {  # as make_head builds them: the trunk's batch over all axes
    "sharded": lambda mesh: ShardedHead(mesh, ("model",), batch_axes=AXES),
    "partial_fc": lambda mesh: ShardedHead(mesh, AXES, batch_axes=AXES),
}
# And features split over the data axes only (a tensor-parallel trunk): nothing to gather.
UNIT_HEADS = {**HEADS, "sharded_data_only": lambda mesh: ShardedHead(mesh, ("model",))}


def _random_head(seed=0, ties=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, E)).astype(np.float32)
    params = {
        "kernel": rng.normal(size=(E, C)).astype(np.float32),
        "bias": rng.normal(size=(C,)).astype(np.float32),
    }
    if ties:  # every logit one of 3 values: top-k must break ties as lax.top_k does
        params = {"kernel": np.zeros((E, C), np.float32), "bias": rng.integers(0, 3, C) * 1.0}
    labels = rng.integers(0, C, (B,)).astype(np.int32)
    return x, params, labels


def _dense(x, params, labels, smoothing):
    logits = x @ params["kernel"] + params["bias"]
    return cross_entropy(logits, labels, smoothing).mean()


def _dense_hits(x, params, labels, k):
    _, top = jax.lax.top_k(x @ params["kernel"] + params["bias"], k)
    return jnp.any(top == labels[:, None], axis=-1)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("kind", sorted(UNIT_HEADS))
def test_loss_and_gradients_equal_the_dense_head_on_one_device(kind, smoothing):
    x, params, labels = _random_head()
    on_one = jax.device_put((x, params, labels), jax.devices()[0])
    want_loss, want_grads = jax.jit(jax.value_and_grad(_dense, argnums=(0, 1)), static_argnums=3)(
        *on_one, smoothing
    )
    mesh = make_mesh(MESH)
    head = UNIT_HEADS[kind](mesh)

    def loss(x, params, labels):
        return head(x, params, labels, label_smoothing=smoothing)["loss"].mean()

    # Inputs placed as in a step: batch over the data axes, classes over the head's axes.
    batch = NamedSharding(mesh, P(BATCH_AXES))
    placed = jax.device_put(
        (x, params, labels),
        (
            batch,
            {
                "kernel": NamedSharding(mesh, P(None, head.class_axes)),
                "bias": NamedSharding(mesh, P(head.class_axes)),
            },
            batch,
        ),
    )
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*placed)
    np.testing.assert_allclose(got_loss, want_loss, **TOL)
    names = ["features", "bias", "kernel"]  # leaves order: params sorted by key
    for name, g, w in zip(
        names, jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(g, w, **TOL, err_msg=name)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("kind", sorted(UNIT_HEADS))
def test_topk_hits_equal_the_dense_head(kind, ties):
    x, params, labels = _random_head(seed=1, ties=ties)
    head = UNIT_HEADS[kind](make_mesh(MESH))
    got = jax.jit(lambda *a: head(*a, topk=(1, 5)))(x, params, labels)
    for k in (1, 5):
        want = np.asarray(_dense_hits(x, params, labels, k))
        np.testing.assert_array_equal(np.asarray(got[f"top{k}"]), want, err_msg=f"top{k}")
    assert 0 < int(np.sum(got["top5"])) < B  # the check can tell hits from misses


# ---- Whole steps, built from a config as the training CLI builds them -------------------------


def _config(head, mesh):
    c = base_config()
    c.mesh = mesh
    c.model.update(name="resnet_tiny", num_filters=8, small_stem=True, head=head)
    c.data.update(image_size=16, num_classes=C)
    c.global_batch = c.eval_batch = B
    c.label_smoothing = 0.1
    c.optim.update(base_lr=0.5, weight_decay=1e-4)  # large enough that two steps move
    return c


def _batches(steps=2):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.integers(0, 256, (B, 16, 16, 3), np.uint8),
            "label": rng.integers(0, C, (B,), np.int32),
            "mask": np.ones((B,), np.float32),
        }
        for _ in range(steps)
    ]


PADDED = 3  # eval examples that are padding (mask 0), as in a last partial batch


def _eval_batch(program, config, state):
    """An eval batch with hits and padding: the first half labelled with the trained
    model's own top-1 class (computed here, on the host's device, with the dense layer), the
    rest random, the last PADDED masked out. So top-1 sums are >= B/2, not 0 vs 0, and
    padded examples must not count."""
    batch = dict(_batches()[0])
    host = jax.device_get({"params": state.params, "batch_stats": state.batch_stats})
    images = normalize(batch["image"], config.data.mean, config.data.std, jnp.float32)
    # jitted: one compile, where op by op every layer's ops compiled on their own
    logits = np.asarray(jax.jit(partial(program.model.apply, train=False))(host, images))
    batch["label"] = batch["label"].copy()
    batch["label"][: B // 2] = logits[: B // 2].argmax(-1)
    batch["mask"] = np.ones((B,), np.float32)
    batch["mask"][-PADDED:] = 0.0
    return batch


def _run(head, mesh_spec, devices=None):
    config = _config(head, mesh_spec)
    mesh = make_mesh(mesh_spec, devices)
    program = build_program(config, mesh, single_stage_plan(10, 10, config.global_batch))
    state = init_sharded(program.init, program.shardings, jax.random.key(0))
    # without LLVM's optimisations, dense and sharded alike (helpers.NO_LLVM_OPT: the same
    # HLO, a third less compile time)
    train = program.lower_train(B).compile(NO_LLVM_OPT)
    evaluate = program.lower_eval(B).compile(NO_LLVM_OPT)
    losses = []
    for b in _batches():
        state, metrics = train(state, shard_batch({k: b[k] for k in ("image", "label")}, mesh))
        losses.append(metrics["loss"])
    sums = evaluate(state, shard_batch(_eval_batch(program, config, state), mesh))
    return {
        "program": program,
        "state": state,
        "losses": np.asarray(jax.device_get(losses)),
        "eval": jax.device_get(sums),
        "hlo": train.as_text() + evaluate.as_text(),
    }


@pytest.fixture(scope="module")
def dense_one_device():
    return _run("dense", "data:1", jax.devices()[:1])


@pytest.fixture(scope="module", params=sorted(HEADS))
def sharded_run(request):
    return request.param, _run(request.param, MESH)


def test_train_and_eval_steps_equal_the_dense_head_on_one_device(sharded_run, dense_one_device):
    kind, got = sharded_run
    want = dense_one_device
    np.testing.assert_allclose(got["losses"], want["losses"], **TOL)
    assert want["losses"][1] != pytest.approx(want["losses"][0])  # the step did train
    for part in ("params", "batch_stats"):
        flat_got = jax.tree_util.tree_flatten_with_path(
            jax.device_get(getattr(got["state"], part))
        )[0]
        flat_want = jax.tree.leaves(jax.device_get(getattr(want["state"], part)))
        assert len(flat_got) == len(flat_want)
        for (path, g), w in zip(flat_got, flat_want, strict=True):
            np.testing.assert_allclose(g, w, **TOL, err_msg=f"{part} {jax.tree_util.keystr(path)}")
    for key in ("count", "top1_sum", "top5_sum"):
        assert float(got["eval"][key]) == float(want["eval"][key]), key
    assert float(want["eval"]["count"]) == B - PADDED  # the padding is not counted
    assert B // 2 <= float(want["eval"]["top1_sum"]) < B - PADDED  # hits and misses
    np.testing.assert_allclose(got["eval"]["loss_sum"], want["eval"]["loss_sum"], **TOL)
    # The kernel (and its momentum) live where the head computes: classes over its axes.
    kernel = got["state"].params["head"]["kernel"]
    axes = ("model",) if kind == "sharded" else ("data", "model")  # fsdp:1 left out
    assert kernel.sharding.spec[1] in (axes, axes[0])
    shards = 4 if kind == "sharded" else 8
    assert {s.data.shape for s in kernel.addressable_shards} == {(kernel.shape[0], C // shards)}


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s"
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def class_wide_collectives(hlo: str, num_classes: int) -> list[str]:
    """Collectives of an optimized HLO text whose result has a dimension of ``num_classes``:
    the ones that would move whole rows of logits (or of the head's kernel)."""
    hits = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if m is None:
            continue
        dims = [
            int(d)
            for shape in re.findall(r"\[([\d,]*)\]", m.group(1))
            for d in shape.split(",")
            if d
        ]
        if num_classes in dims:
            hits.append(line.strip()[:200])
    return hits


def test_compiled_steps_never_gather_the_logits(sharded_run):
    kind, got = sharded_run
    assert "all-reduce" in got["hlo"] and "all-gather" in got["hlo"]  # we do read collectives
    assert class_wide_collectives(got["hlo"], C) == [], kind


def test_the_logits_check_can_fail():
    """The same detector on a step that does gather the logits (the dense head's logits
    forced to full rows on data:2,model:4) must find the gather."""
    mesh = make_mesh(MESH)
    x, params, _ = _random_head()

    def gathered(x, params):
        logits = x @ params["kernel"]
        return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(BATCH_AXES, None)))

    placed = jax.device_put(
        (x, params),
        (
            NamedSharding(mesh, P(BATCH_AXES)),
            {"kernel": NamedSharding(mesh, P(None, "model")), "bias": NamedSharding(mesh, P())},
        ),
    )
    hlo = jax.jit(gathered).lower(*placed).compile().as_text()
    found = class_wide_collectives(hlo, C)
    assert found and "all-gather" in found[0], hlo[-3000:]


# ---- ResNet-50 with 1M classes on 64 virtual devices, compile only ----------------------------


def test_1m_classes_data8_model8_needs_a_quarter_of_data64s_memory():
    """The sharded head's memory claim, from the compiled steps' memory_analysis (nothing is
    allocated): data:8,model:8 with the sharded head needs at most a quarter of the
    per-device memory of data:64 with the dense head. The 1M-class recipe with its trunk
    shrunk to the tiny ResNet (16 filters: 128 features, a 128 x 1M head of 0.5 GB): the
    head is what the two placements differ in, and two ResNet-50 compiles on 64 devices
    would take minutes (docs/model_parallel.md has the ResNet-50 figures)."""
    code = (
        "import json\n"
        "from hybridpar.tools.comm_report import report\n"
        "from hybridpar.config.schema import load_config\n"
        "out = {}\n"
        "for mesh, head in (('data:64', 'dense'), ('data:8,model:8', 'sharded')):\n"
        "    c = load_config('experiments/resnet50_1m_classes.py')\n"
        "    c.mesh, c.model.head = mesh, head\n"
        "    c.model.name, c.model.num_filters, c.data.image_size = 'resnet_tiny', 16, 32\n"
        "    out[mesh] = report(c, 64).memory_per_device_bytes\n"
        "print(json.dumps(out))\n"
    )
    # compile-only: LLVM's optimisations (skipped) change no memory figure
    flags = " ".join(["--xla_force_host_platform_device_count=64", *ANALYSIS_XLA_FLAGS])
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    memory = json.loads(r.stdout.strip().splitlines()[-1])
    assert memory["data:8,model:8"] <= memory["data:64"] / 4, memory
    head = 128 * 1_000_000 * 4
    assert memory["data:64"] > 3 * head  # the replicated head, its gradient and momentum


# ---- Config errors --------------------------------------------------------------------------


def test_classes_that_do_not_divide_the_shards_say_how_to_fix():
    c = _config("partial_fc", MESH)
    c.data.num_classes = 100
    with pytest.raises(
        ConfigError, match=r"num_classes=100 over data:2 x model:4 \(8 shards\).*num_classes=104"
    ):
        make_head(c, make_mesh(MESH))
    c.model.head = "sharded"
    assert make_head(c, make_mesh(MESH)).num_shards == 4  # 100 classes split 4 ways: fine
    c.data.num_classes = 102
    with pytest.raises(ConfigError, match="102 is not a multiple of 4.*model.head=dense"):
        make_head(c, make_mesh(MESH))


def test_unknown_head_and_bucketed_mode_are_config_errors():
    # checked once, by the schema, before any head is made (run.setup validates first)
    c = _config("softmax", MESH)
    with pytest.raises(ConfigError, match="model.head='softmax' is not one of dense, sharded, "
                       "partial_fc; use e.g. --config.model.head=dense"):  # fmt: skip
        validate(c)
    c.model.head = "sharded"
    c.comm.mode = "bucketed"
    with pytest.raises(ConfigError, match="needs comm.mode=xla"):
        validate(c)
    c.model.head = "dense"
    validate(c)
    assert make_head(c, make_mesh(MESH)) is DENSE


def test_batches_must_split_over_all_devices():
    c = _config("sharded", MESH)
    c.eval_batch = 12  # divides data:2, not the 8 devices the trunk is split over
    with pytest.raises(ConfigError, match="eval_batch=12 must be a multiple of 8.*eval_batch=8"):
        make_head(c, make_mesh(MESH))


# ---- ShardedHead in a user's own code ---------------------------------------------------------


def _user_mesh():
    """A mesh of the user's own, without an fsdp axis (Auto axes: sharding propagated)."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_default_batch_axes_are_the_data_axes_the_mesh_has():
    x, params, labels = _random_head()
    head = ShardedHead(_user_mesh(), ("model",))
    assert head.batch_axes == ("data",)
    got = jax.jit(lambda *a: head(*a, label_smoothing=0.1)["loss"].mean())(x, params, labels)
    np.testing.assert_allclose(got, _dense(x, params, labels, 0.1), **TOL)


def test_a_string_class_axes_is_one_axis():
    mesh = make_mesh(MESH)
    head = ShardedHead(mesh, "model")
    assert head.class_axes == ("model",) and head.num_shards == 4
    assert head == ShardedHead(mesh, ("model",))
    x, params, labels = _random_head()
    got = jax.jit(lambda *a: head(*a)["loss"].mean())(x, params, labels)
    np.testing.assert_allclose(got, _dense(x, params, labels, 0.0), **TOL)


def test_axes_missing_from_the_mesh_are_config_errors_naming_the_mesh_axes():
    with pytest.raises(ConfigError, match=r"class_axes=\('tensor',\).*\('data', 'model'\)"):
        ShardedHead(_user_mesh(), ("tensor",))
    with pytest.raises(ConfigError, match=r"batch_axes=\('data', 'fsdp'\): \('fsdp',\)"):
        ShardedHead(_user_mesh(), ("model",), batch_axes=BATCH_AXES)


def test_a_class_count_that_does_not_divide_the_shards_names_the_count_to_pad_to():
    x, _, labels = _random_head()
    params = {"kernel": np.zeros((E, 10), np.float32), "bias": np.zeros((10,), np.float32)}
    head = ShardedHead(make_mesh(MESH), ("model",))
    with pytest.raises(ConfigError, match=r"10 classes over model:4 \(4 shards\).*num_classes=12"):
        jax.jit(lambda *a: head(*a))(x, params, labels)


class _Net(nn.Module):
    """A user's model: features from return_features=True, its classifier named head_name."""

    head_name: str = "head"
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train=False, return_features=False):
        x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(nn.Dense(E)(x)))
        return x if return_features else nn.Dense(C, name=self.head_name)(x)


def test_apply_without_params_head_says_what_the_model_must_provide():
    x, _, labels = _random_head()
    model = _Net(head_name="classifier")
    variables = model.init(jax.random.key(0), x)
    head = ShardedHead(make_mesh(MESH), ("model",))
    with pytest.raises(ConfigError, match=r"params\['head'\].*'classifier'.*return_features"):
        head.apply(model, variables, x, labels, train=False)


class _NoFeatures(nn.Module):
    """A model whose __call__ has no return_features: the head cannot get its features."""

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(C, name="head")(nn.relu(nn.Dense(E)(x)))


def test_apply_on_a_model_without_return_features_names_the_model_and_what_it_needs():
    x, _, labels = _random_head()
    model = _NoFeatures()
    variables = model.init(jax.random.key(0), x)
    head = ShardedHead(make_mesh(MESH), ("model",))
    with pytest.raises(ConfigError, match=r"_NoFeatures.__call__ takes no return_features"):
        head.apply(model, variables, x, labels, train=False)


def test_apply_passes_rngs_to_the_model():
    x, _, labels = _random_head()
    model = _Net(dropout=0.5)
    variables = model.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}
    head = ShardedHead(make_mesh(MESH), ("model",))
    out, _ = head.apply(model, variables, x, labels, train=True, rngs=rngs)
    features = model.apply(variables, x, train=True, rngs=rngs, return_features=True)
    want = _dense(features, variables["params"]["head"], labels, 0.0)
    np.testing.assert_allclose(out["loss"].mean(), want, **TOL)
    no_dropout = model.apply(variables, x, train=False, return_features=True)
    assert _dense(no_dropout, variables["params"]["head"], labels, 0.0) != pytest.approx(want)


def test_one_k_is_a_topk_of_one():
    """``topk=5`` is ``topk=(5,)`` (an int was iterated: TypeError); traced, not compiled."""
    x, params, labels = _random_head()
    head = ShardedHead(make_mesh(MESH), ("model",))
    out = jax.eval_shape(lambda *a: head(*a, topk=5), x, params, labels)
    assert sorted(out) == ["loss", "top5"] and out["top5"].shape == (B,)
    model = _Net()
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    out, _ = jax.eval_shape(
        lambda v: head.apply(model, v, x, labels, train=False, topk=5), variables
    )
    assert sorted(out) == ["loss", "top5"]


@pytest.mark.parametrize("name", ["sharded_cross_entropy", "sharded_topk_hits"])
def test_the_per_device_functions_outside_shard_map_say_where_they_run(name):
    """Called on whole logits, outside a shard_map over the class axis: one error naming the
    axis and ShardedHead, not JAX's unbound-axis NameError from deep in a psum."""
    import hybridpar

    x, params, labels = _random_head()
    logits = x @ params["kernel"] + params["bias"]
    with pytest.raises(ConfigError, match=rf"{name} runs inside a jax.shard_map over the axis "
                       r"'model'.*ShardedHead\(mesh, 'model'\)"):  # fmt: skip
        getattr(hybridpar, name)(logits, labels, 1 if "topk" in name else 0.0, "model")


def test_on_explicit_axes_unplaced_inputs_give_the_dense_loss_and_gradients():
    # jax.make_mesh's default axes are Explicit: shard_map there takes only placed inputs.
    x, params, labels = _random_head()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    head = ShardedHead(mesh, ("model",))

    def loss(x, params, labels):
        return head(x, params, labels, label_smoothing=0.1)["loss"].mean()

    got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params, labels)
    want, want_grads = jax.value_and_grad(_dense, argnums=(0, 1))(x, params, labels, 0.1)
    np.testing.assert_allclose(got, want, **TOL)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_a_batch_that_does_not_split_over_the_batch_axes_is_a_config_error():
    x, params, labels = _random_head()
    head = ShardedHead(_user_mesh(), ("model",), batch_axes=("data", "model"))
    with pytest.raises(
        ConfigError, match=r"batch of 12 features .* data:2 x model:4.*multiple of 8"
    ):
        jax.jit(lambda *a: head(*a))(x[:12], params, labels[:12])
    with pytest.raises(ConfigError, match=r"8 features and 16 labels"):
        jax.jit(lambda *a: head(*a))(x[:8], params, labels)


def test_apply_on_explicit_axes_gives_the_dense_loss():
    x, _, labels = _random_head()
    model = _Net()
    variables = model.init(jax.random.key(0), x)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    head = ShardedHead(mesh, ("model",))
    out, _ = jax.jit(lambda v, x, y: head.apply(model, v, x, y, train=False))(variables, x, labels)
    features = model.apply(variables, x, return_features=True)
    want = _dense(features, variables["params"]["head"], labels, 0.0)
    np.testing.assert_allclose(out["loss"].mean(), want, **TOL)


@pytest.mark.parametrize(
    "mesh_spec, batch_axes, classes",
    [
        ("data:4,model:2", ("model", "data"), ("model",)),
        ("data:2,fsdp:2,model:2", ("model", "data", "fsdp"), ("model", "fsdp")),
    ],
)
def test_per_example_outputs_are_in_the_batch_order_whatever_the_batch_axes_order(
    mesh_spec, batch_axes, classes
):
    # The gathered axes are not the innermost batch axes here: a gather group's examples are
    # not one block of the batch, yet out[i] must be example i's, as on one device.
    x, params, labels = _random_head(seed=2)
    head = ShardedHead(make_mesh(mesh_spec), classes, batch_axes=batch_axes)

    def loss(x, params):
        out = head(x, params, labels, label_smoothing=0.1, topk=(1, 5))
        return out["loss"].mean(), out

    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)
    want = cross_entropy(x @ params["kernel"] + params["bias"], labels, 0.1)
    np.testing.assert_allclose(got["loss"], want, **TOL)
    for k in (1, 5):
        want_hits = np.asarray(_dense_hits(x, params, labels, k))
        np.testing.assert_array_equal(np.asarray(got[f"top{k}"]), want_hits, err_msg=f"top{k}")
    assert 0 < int(np.sum(got["top5"])) < B  # hits and misses: the order shows
    want_grads = jax.grad(_dense, argnums=(0, 1))(x, params, labels, 0.1)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bias": np.zeros((C + 4,), np.float32)}, r"bias \(52,\).*bias must be \(C,\) = \(48,\)"),
        ({"kernel": np.zeros((E, C, 1), np.float32)}, r"kernel \(32, 48, 1\).*must be 2-D"),
        ({"x": np.zeros((B, E + 1), np.float32)}, r"features \(16, 33\).*\(B, E\) = \(B, 32\)"),
        ({"labels": np.zeros((B,), np.float32)}, r"labels \(16,\) float32.*integer class ids"),
        ({"labels": np.zeros((B, C), np.int32)}, r"labels \(16, 48\) int32.*not one-hot"),
    ],
)
def test_inputs_of_the_wrong_shape_or_type_name_what_was_passed_and_what_is_expected(
    change, message
):
    x, params, labels = _random_head()
    x = change.get("x", x)
    labels = change.get("labels", labels)
    params = {k: change.get(k, v) for k, v in params.items()}
    head = ShardedHead(make_mesh(MESH), ("model",))
    with pytest.raises(ConfigError, match=message):
        jax.jit(lambda *a: head(*a))(x, params, labels)


@pytest.mark.parametrize(
    "params, have", [({"w": 0, "bias": 0}, r"\['bias', 'w'\]"), ((0, 0), "tuple")]
)
def test_params_without_kernel_and_bias_are_a_config_error(params, have):
    """Planted bug that fails it: ``params["kernel"]`` read unchecked (a bare KeyError)."""
    x, _, labels = _random_head()
    head = ShardedHead(make_mesh(MESH), ("model",))
    with pytest.raises(ConfigError, match=r"params must be the head's \{'kernel': .*not " + have):
        head(x, params, labels)
