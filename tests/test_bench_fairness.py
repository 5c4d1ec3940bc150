"""The ResNet-50 bench compares like with like.

``bench/resnet50_step.py`` times its plain Flax reference step (``bench/flax_reference.py``,
no hybridpar code) against hybridpar's step (``build_program`` on
``experiments/resnet50_imagenet.py``). Here both take one and the same batch from one and
the same parameters and must give the same loss, the same updated parameters (SGD with
Nesterov momentum, weight decay, label smoothing, batch-scaled learning rate: two steps, so
the momentum buffer is used) and the same BatchNorm statistics; so the bench's ratio
measures speed alone. The initial parameters are random (not the zero-gamma init), so every
block's gradient is exercised; a second test checks that the two models also initialise
identically (same names, initialisers, zero-init last BN gamma) on a shallow variant.

float32, 32-px images and a batch of 4 on one device keep it fast (two ResNet-50 compiles).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from hybridpar import make_mesh, shard_batch
from hybridpar.config import load_config
from hybridpar.models.resnet import BottleneckResNetBlock, ResNet
from hybridpar.precision import LossScale
from hybridpar.program import build_program

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import flax_reference

SIZE, BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 4, 10, 3


def _random_like(abstract, rng, kind):
    """Host values for every array of an abstract tree, near a trained network's scales:
    He-scaled kernels, BN gammas around 1 (small on each block's last BN, which the zero
    init would make 0 and so block every gradient of the block on the first step), small
    betas and biases, running statistics near (0, 1). A random ResNet-50 with larger
    gammas amplifies float rounding so much that even one program compiled at two XLA
    optimisation levels disagrees after two steps."""

    def one(path, x):
        name = jax.tree_util.keystr(path)
        if kind == "batch_stats":
            v = rng.uniform(0.8, 1.2, x.shape) if "var" in name else rng.normal(0, 0.1, x.shape)
        elif "head" in name and "kernel" in name:
            v = rng.normal(0, 0.01, x.shape)
        elif len(x.shape) > 1:
            v = rng.normal(0, np.sqrt(2.0 / np.prod(x.shape[:-1])), x.shape)
        elif "scale" in name:
            v = rng.uniform(0.0, 0.2, x.shape) if "bn3" in name else rng.uniform(0.8, 1.2, x.shape)
        else:
            v = rng.normal(0, 0.02, x.shape)
        return np.asarray(v, x.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract)


def test_reference_and_hybridpar_compute_the_same_steps():
    cfg = load_config(str(ROOT / "experiments" / "resnet50_imagenet.py"))
    cfg.precision.compute = "float32"
    cfg.global_batch = cfg.eval_batch = BATCH
    cfg.data.image_size = SIZE
    cfg.optim.warmup_epochs = 0.0  # else the first step's learning rate is 0
    # Large enough that decaying the wrong arrays (or not at all) would change the update by
    # far more than the tolerance below (the recipe's 5e-5 would hide in it).
    cfg.optim.weight_decay = 1e-2
    cfg.num_epochs = float(EPOCHS)
    mesh = make_mesh("data:1", devices=jax.devices()[:1])
    program = build_program(cfg, mesh, (SIZE, SIZE, 3), STEPS_PER_EPOCH, EPOCHS * STEPS_PER_EPOCH)

    # One set of initial values for both (the same module names: the trees match as they are).
    rng = np.random.default_rng(0)
    abstract = meta.unbox(program.abstract)
    params0 = _random_like(abstract.params, rng, "params")
    stats0 = _random_like(abstract.batch_stats, rng, "batch_stats")
    hp = jax.device_put(
        abstract.replace(
            step=np.zeros((), np.int32),
            params=params0,
            batch_stats=stats0,
            opt_state=program.tx.init(params0),
            loss_scale=LossScale.create(False, period=cfg.precision.loss_scale_period),
        ),
        program.shardings,
    )
    ref, ref_step = flax_reference.make_reference(
        image_size=SIZE,
        batch=BATCH,
        dtype=jnp.float32,
        steps_per_epoch=STEPS_PER_EPOCH,
        variables={"params": params0, "batch_stats": stats0},
        **flax_reference.recipe_of(cfg),
    )
    assert jax.tree.structure(ref.params) == jax.tree.structure(hp.params)
    assert jax.tree.structure(ref.batch_stats) == jax.tree.structure(hp.batch_stats)

    ref_losses, hp_losses = [], []
    for _ in range(2):
        host = {
            "image": rng.integers(0, 256, (BATCH, SIZE, SIZE, 3), dtype=np.uint8),
            "label": rng.integers(0, cfg.data.num_classes, (BATCH,), dtype=np.int32),
        }
        ref, ref_m = ref_step(ref, jax.tree.map(jnp.asarray, host))
        hp, hp_m = program.train_jit(hp, shard_batch(host, mesh))
        ref_losses.append(float(ref_m["loss"]))
        hp_losses.append(float(hp_m["loss"]))
        assert float(ref_m["learning_rate"]) == pytest.approx(float(hp_m["lr"]), rel=1e-6)
        assert float(hp_m["lr"]) > 0

    np.testing.assert_allclose(ref_losses, hp_losses, rtol=1e-5)
    # The updates (new - initial) agree to 1e-3 of each array's largest update, plus a few
    # float32 spacings of the parameter (an update can be far below a parameter's ulp).
    ref_flat = jax.tree_util.tree_leaves_with_path(ref.params)
    for (path, r), h, p0 in zip(ref_flat, jax.tree.leaves(hp.params), jax.tree.leaves(params0)):
        dr, dh = np.asarray(r) - p0, np.asarray(h) - p0
        assert np.abs(dh).max() > 0, f"params{jax.tree_util.keystr(path)} did not change"
        tol = 1e-3 * np.abs(dh).max() + 4 * np.spacing(np.abs(p0))
        worst = (np.abs(dr - dh) / tol).max()
        assert worst <= 1, f"params{jax.tree_util.keystr(path)}: updates differ ({worst:.1f}x tol)"
    for r, h in zip(jax.tree.leaves(ref.batch_stats), jax.tree.leaves(hp.batch_stats)):
        np.testing.assert_allclose(np.asarray(r), np.asarray(h), rtol=1e-5, atol=1e-6)


def test_reference_initialises_like_hybridpar():
    """Same names and initialisers (He fan-out convs, N(0, 0.01) head, zero gamma on each
    block's last BN) give bit-identical variables from one key; shallow, to keep it quick."""
    kw = {"stage_sizes": [1, 1, 1, 1], "num_classes": 10, "num_filters": 8}
    ours = ResNet(block_cls=BottleneckResNetBlock, **kw)
    theirs = flax_reference.ResNet(block_cls=flax_reference.BottleneckResNetBlock, **kw)
    x = jnp.zeros((1, SIZE, SIZE, 3), jnp.float32)
    key = jax.random.key(1)

    def init(model):  # XLA's CPU backend optimises random-number code slowly: level 0
        lowered = jax.jit(lambda k: meta.unbox(model.init(k, x, train=False))).lower(key)
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(key)

    a, b = init(ours), init(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(
            np.asarray(u), np.asarray(v), err_msg=jax.tree_util.keystr(path)
        )
    zero_gammas = [
        k for k, blk in a["params"].items() if "block" in k and not blk["bn3"]["scale"].any()
    ]
    assert len(zero_gammas) == 4
