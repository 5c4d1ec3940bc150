"""The fast CIFAR recipe's pieces: the airbench-style network (models/airbench.py) and its
whitening layer set from the data, test-time flip (``eval_flip``), the translate
augmentation (``data.translate``), and all of them through the trainer with the whitening
kernel frozen (``optim.frozen``)."""

import io
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import random_like, tiny_digits
from PIL import Image

from hybridpar.models.airbench import WHITEN_EPS, AirbenchNet, patches_2x2, whitening_kernel
from hybridpar.program.precision import make_policy
from hybridpar.program.steps import cross_entropy, make_eval_step, normalize
from hybridpar.runtime import trainer
from hybridpar.runtime.run import setup


def _images(n=64, size=12, channels=3, seed=0):
    """Images whose pixels correlate along the width (and across channels) far more than
    along the height: their 2x2-patch covariance is far from the identity, and not
    symmetric under swapping height and width."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, size, size + 1, channels))
    x = a[:, :, 1:] + 0.9 * a[:, :, :-1]
    return jnp.asarray(x @ rng.normal(size=(channels, channels)), jnp.float32)


def _conv(x, kernel):
    return jax.lax.conv_general_dilated(
        x, kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _whitened(x, kernel) -> np.ndarray:
    """How far the covariance of ``kernel``'s responses on ``x`` is from what whitening
    gives (``diag(lambda / (lambda + eps))`` for the eigenvalues of the patch covariance,
    the negated filters anti-correlated): the largest absolute difference."""
    y = np.asarray(_conv(x, kernel), np.float64).reshape(-1, kernel.shape[-1])
    cov = y.T @ y / y.shape[0]
    p = np.asarray(patches_2x2(x), np.float64)
    lam = np.linalg.eigvalsh(p.T @ p / p.shape[0])[::-1]
    d = np.diag(lam / (lam + WHITEN_EPS))
    return np.abs(cov - np.block([[d, -d], [-d, d]])).max()


def test_the_whitening_kernel_whitens_2x2_patches_as_a_convolution():
    x = _images()
    kernel = whitening_kernel(x)
    assert kernel.shape == (2, 2, 3, 24)
    # float32 responses of ~8,000 patches, filters scaled up to 1/sqrt(eps) = 45: 1e-3
    assert _whitened(x, kernel) < 1e-3
    # Negative controls: the same numbers laid out for the wrong axes do not whiten.
    assert _whitened(x, jnp.transpose(kernel, (1, 0, 2, 3))) > 0.05  # height and width
    flat = kernel.reshape(12, 24)
    wrong = flat.reshape(3, 2, 2, 24).transpose(1, 2, 0, 3)  # (c, kh, kw) order read as ours
    assert _whitened(x, wrong) > 0.05


@pytest.mark.parametrize("size", [10, 24, 32])
def test_airbench_takes_any_size_from_10_px_and_returns_logits_or_features(size):
    model = AirbenchNet(num_classes=10, num_filters=8)
    x = jnp.zeros((2, size, size, 3))
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    params = meta.unbox(variables["params"])
    assert set(params) == {"whiten", "head"} | {
        f"block{i}_{layer}" for i in (1, 2, 3) for layer in ("conv1", "bn1", "conv2", "bn2")
    }
    assert params["whiten"]["kernel"].shape == (2, 2, 3, 24)
    logits = jax.eval_shape(lambda v: model.apply(v, x, train=False), variables)
    feats = jax.eval_shape(
        lambda v: model.apply(v, x, train=False, return_features=True), variables
    )
    assert logits.shape == (2, 10) and feats.shape == (2, 16)


class _State(NamedTuple):  # what the eval step reads of a TrainState
    params: dict
    batch_stats: dict


def test_eval_flip_averages_the_logits_of_each_image_and_its_mirror():
    model = AirbenchNet(num_classes=10, num_filters=8)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 16, 16, 3), np.uint8)
    labels = rng.integers(0, 10, (6,), np.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))
    abstract = meta.unbox(abstract)
    params = random_like(abstract["params"], rng, "params")
    # a head 30x the init's: logits of a few units, so the mirror images change the result
    params["head"]["kernel"] = params["head"]["kernel"] * 30
    state = _State(params, random_like(abstract["batch_stats"], rng, "batch_stats"))
    batch = {"image": images, "label": labels, "mask": np.ones(6, np.int32)}
    kw = dict(mean=(127.5,) * 3, std=(64.0,) * 3)
    policy = make_policy("float32")
    sums = {
        flip: jax.jit(make_eval_step(model, policy, flip=flip, **kw))(state, batch)
        for flip in (True, False)
    }
    # by hand: the model on the normalised images and on their mirror images, averaged
    x = normalize(images, kw["mean"], kw["std"], jnp.float32)
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    apply = jax.jit(lambda x: model.apply(variables, x, train=False))
    logits = (apply(x) + apply(x[:, :, ::-1])) / 2
    np.testing.assert_allclose(
        sums[True]["loss_sum"], np.sum(cross_entropy(logits, labels)), rtol=1e-5
    )
    assert float(sums[True]["top1_sum"]) == float(np.sum(np.argmax(logits, -1) == labels))
    # the control: these images are not symmetric, so the flip changes the result
    assert abs(float(sums[True]["loss_sum"]) - float(sums[False]["loss_sum"])) > 0.01


def test_translate_shifts_the_image_by_at_most_t_pixels_each_way():
    import tensorflow as tf

    from hybridpar.input.transforms import train_transform

    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")  # lossless: pixels compare exactly
    data = tf.constant(buf.getvalue())
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)), mode="reflect")

    def transform(translate):  # the whole image (area 1, aspect 1), no flip; traced once
        return tf.function(lambda seed: train_transform(data, seed, 32, min_scale=1.0,
                           ratio=(1.0, 1.0), flip=False, translate=translate))  # fmt: skip

    still, shifted = transform(0), transform(2)

    def out(seed, fn):
        return fn(tf.constant([seed, 7], tf.int64)).numpy()

    np.testing.assert_array_equal(out(0, still), image)
    offsets = set()
    for seed in range(16):
        got = out(seed, shifted)
        found = [(dy, dx) for dy in range(5) for dx in range(5)
                 if np.array_equal(got, padded[dy : dy + 32, dx : dx + 32])]  # fmt: skip
        assert len(found) == 1, seed  # a window of the padded image, and only one
        offsets |= set(found)
    assert len(offsets) >= 5  # it moves, in both directions


class KeepParams:
    """A hook that keeps the whitening layer's parameters at every step (host copies)."""

    def __init__(self):
        self.at = {}

    def __call__(self, loop, state, metrics, stage):
        self.at[loop.step] = jax.device_get(state.params["whiten"])


def test_airbench_trains_with_its_whitening_set_from_the_data_and_frozen(tmp_path):
    config = tiny_digits(**{"model.name": "airbench", "optim.frozen": "^whiten/kernel$",
                            "eval_flip": True})  # fmt: skip
    run = setup(config, str(tmp_path))
    keep = KeepParams()
    summary = trainer.train(run, hooks=[keep])
    assert summary["completed"] and summary["final_eval"]["examples"] == 360
    first, last = keep.at[1], keep.at[summary["steps"]]
    np.testing.assert_array_equal(first["kernel"], last["kernel"])  # frozen
    assert np.abs(last["bias"]).max() > 0  # the bias trains (it starts at 0)
    # and it is the data's whitening: it whitens the epoch's first images it was set from
    st = run.plan.stages[0].stage
    batches = run.data.train_batches(0, global_batch=st.global_batch, image_size=st.image_size)
    host = np.concatenate([b["image"] for b in batches])
    x = normalize(host, config.data.mean, config.data.std, jnp.float32)
    assert _whitened(x, jnp.asarray(last["kernel"])) < 1e-3
