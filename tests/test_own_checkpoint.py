"""docs/parallelism.md's recipes for one's own training loop: its training snippet runs as
written, and orbax saves the sharded state and restores it onto another mesh, each array
placed by ``infer_shardings``."""

import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

import hybridpar
from hybridpar import Rules, infer_shardings, make_mesh


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10, name="out")(nn.relu(nn.Dense(64, name="hidden")(x)))


DOCS = pathlib.Path(__file__).parent.parent / "docs" / "parallelism.md"


def test_the_docs_own_training_code_snippet_runs_as_written():
    text = DOCS.read_text()
    start = text.index("```python\n", text.index("## In your own training code")) + 10
    snippet = text[start : text.index("```\n", start)]
    ns = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and without a warning about its rules
        exec(compile(snippet, str(DOCS), "exec"), ns)
    assert ns["params"]["head"]["kernel"].sharding.spec == P(None, "model")
    assert ns["params"]["hidden"]["kernel"].sharding.spec == P(None, "model")  # logical "mlp"
    assert ns["opt_state"][0].mu["head"]["kernel"].sharding.spec == P(None, "model")
    # the first step's loss: the initial parameters' on the whole batch, on one device
    params = nn.meta.unbox(ns["init"](jax.random.key(0)))[0]
    logits = ns["model"].apply({"params": params}, ns["x_local"])
    want = optax.softmax_cross_entropy_with_integer_labels(logits, ns["y_local"]).mean()
    np.testing.assert_allclose(ns["loss"], want, rtol=1e-5)


def test_the_docs_checkpoint_snippet_runs_after_its_training_snippet(tmp_path):
    """The page's checkpoint snippet, run after its own training snippet, failed: its
    ``init`` returns boxed (logically named) values, so the target's tree (boxed) did not
    match infer_shardings' (unboxed). Planted bugs that fail it: ``abstract`` unboxed in
    neither place (the snippet as it was); the snippet's step count named ``step``, the
    training snippet's jitted step (it saved to ``step_<PjitFunction ...>``)."""
    text = DOCS.read_text()
    start = text.index("```python\n", text.index("## In your own training code")) + 10
    train = text[start : text.index("```\n", start)]
    start = text.index("```python\n", text.index("Checkpoints in your own loop")) + 10
    save = text[start : text.index("```\n", start)]
    ns = {}
    exec(compile(train, str(DOCS), "exec"), ns)
    trained = ns["params"]
    ns.update(workdir=str(tmp_path), steps_done=1)  # what the snippets leave to the loop
    exec(compile(save, str(DOCS), "exec"), ns)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]
    params, opt_state = ns["state"]
    assert params["hidden"]["kernel"].sharding.spec == P(None, "model")  # logical "mlp"
    assert opt_state[0].mu["head"]["kernel"].sharding.spec == P(None, "model")
    np.testing.assert_array_equal(params["head"]["kernel"], trained["head"]["kernel"])


def test_a_state_saved_on_one_mesh_restores_onto_another_where_the_rules_say(tmp_path):
    model, tx = MLP(), optax.adam(1e-3)

    def init(rng):
        params = model.init(rng, jnp.zeros((1, 32)))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def step(state):  # one update, so the optimizer's moments are not their zero init
        grads = jax.tree.map(jnp.ones_like, state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    abstract = jax.eval_shape(init, jax.random.key(0))
    fsdp = infer_shardings(abstract, hybridpar.FSDP, make_mesh("fsdp:8"), unmatched="ignore")
    state = jax.jit(step, out_shardings=fsdp)(jax.jit(init, out_shardings=fsdp)(jax.random.key(0)))
    assert state["params"]["hidden"]["kernel"].sharding.spec == P(None, "fsdp")

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step_1", state)
    checkpointer.wait_until_finished()

    # another mesh and other rules: the restore target carries the new placement
    rules = Rules(path=((r"hidden/kernel$", (None, "model")),))
    placed = infer_shardings(abstract, rules, make_mesh("data:2,model:4"), unmatched="ignore")
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placed
    )
    restored = checkpointer.restore(tmp_path / "step_1", target)

    for (path, got), want, where in zip(
        jax.tree_util.tree_leaves_with_path(restored),
        jax.tree.leaves(state),
        jax.tree.leaves(placed),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        assert got.sharding == where, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    moments = restored["opt_state"][0].mu["hidden"]["kernel"]
    assert moments.sharding.spec == P(None, "model") and np.abs(np.asarray(moments)).min() > 0
