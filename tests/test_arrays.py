"""Tests for hybridpar.input.arrays: the digits data set and host-local batching."""

import numpy as np
import pytest

from hybridpar.config.errors import ConfigError
from hybridpar.input.arrays import eval_batches, load_digits, steps_per_epoch, train_batches


@pytest.fixture(scope="module")
def digits():
    return load_digits(32)


def indexed(n, size=2):
    """A tiny data set whose labels are the example indices, so batches can be traced back."""
    return {
        "image": np.arange(n, dtype=np.uint8)[:, None, None, None]
        * np.ones((1, size, size, 1), np.uint8),
        "label": np.arange(n, dtype=np.int32),
    }


# ----------------------------------------------------------------------------- digits


def test_load_digits_shapes_and_dtypes(digits):
    train, test = digits
    assert train["image"].shape == (1437, 32, 32, 1)
    assert test["image"].shape == (360, 32, 32, 1)
    assert train["label"].shape == (1437,) and test["label"].shape == (360,)
    assert train["image"].dtype == np.uint8 and test["image"].dtype == np.uint8
    assert train["image"].max() > 200  # scaled to 0..255, not left at 0..16
    for split in (train, test):
        assert split["label"].min() == 0 and split["label"].max() == 9
        assert set(np.unique(split["label"])) == set(range(10))


def test_load_digits_same_split_twice(digits):
    train, test = digits
    train2, test2 = load_digits(32)
    for a, b in ((train, train2), (test, test2)):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


def test_load_digits_is_scikit_learns_images_and_split(digits):
    """The frozen split is the one scikit-learn's stratified train_test_split makes (seed 0,
    a fifth for test, its order kept), over scikit-learn's own images, read without
    importing scikit-learn in the run's process."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    from hybridpar.input.arrays import resize_bilinear

    d = sk_digits()
    images = resize_bilinear(d.images.astype(np.float32) * (255.0 / 16.0), 32)
    images = np.clip(np.round(images), 0, 255).astype(np.uint8)[..., None]
    want = train_test_split(images, d.target.astype(np.int32), test_size=0.2, random_state=0,
                            stratify=d.target)  # fmt: skip
    train, test = digits
    for got, expected in zip((train["image"], test["image"], train["label"], test["label"]), want):
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == expected.dtype
    code = ("import sys; from hybridpar.input.arrays import load_digits; load_digits(8); "
            "sys.exit('sklearn' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_load_digits_other_size():
    train, _ = load_digits(8)
    assert train["image"].shape == (1437, 8, 8, 1)


# ----------------------------------------------------------------------------- train batches


def test_train_batches_deterministic_per_seed_and_epoch(digits):
    train, _ = digits
    a = list(train_batches(train, 128, seed=3, epoch=1))
    b = list(train_batches(train, 128, seed=3, epoch=1))
    assert len(a) == len(b) == 1437 // 128 == steps_per_epoch(train, 128)
    for x, y in zip(a, b):
        assert x["image"].shape == (128, 32, 32, 1)
        np.testing.assert_array_equal(x["image"], y["image"])
        np.testing.assert_array_equal(x["label"], y["label"])


def test_train_batches_order_changes_with_epoch_and_seed():
    data = indexed(64)
    e0 = np.concatenate([b["label"] for b in train_batches(data, 16, seed=0, epoch=0)])
    e1 = np.concatenate([b["label"] for b in train_batches(data, 16, seed=0, epoch=1)])
    s1 = np.concatenate([b["label"] for b in train_batches(data, 16, seed=1, epoch=0)])
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, s1)
    # each epoch is a permutation (16 divides 64: nothing dropped), and shuffled
    np.testing.assert_array_equal(np.sort(e0), np.arange(64))
    np.testing.assert_array_equal(np.sort(e1), np.arange(64))
    assert not np.array_equal(e0, np.arange(64))


def test_train_batches_drop_last_partial_batch():
    data = indexed(50)
    batches = list(train_batches(data, 16, seed=0, epoch=0))
    assert len(batches) == 3
    seen = np.concatenate([b["label"] for b in batches])
    assert len(np.unique(seen)) == 48


def test_train_batches_two_hosts_disjoint_and_complete():
    data = indexed(40)
    full = list(train_batches(data, 8, seed=5, epoch=2))
    h0 = list(train_batches(data, 8, seed=5, epoch=2, process_index=0, process_count=2))
    h1 = list(train_batches(data, 8, seed=5, epoch=2, process_index=1, process_count=2))
    assert len(full) == len(h0) == len(h1) == 5
    for g, a, b in zip(full, h0, h1):
        assert a["label"].shape == b["label"].shape == (4,)
        assert not set(a["label"]) & set(b["label"])
        # host 0 then host 1 make the global batch
        np.testing.assert_array_equal(np.concatenate([a["label"], b["label"]]), g["label"])
        np.testing.assert_array_equal(np.concatenate([a["image"], b["image"]]), g["image"])


def test_train_batches_too_small_training_set():
    with pytest.raises(ConfigError, match="global_batch"):
        next(iter(train_batches(indexed(10), 16, seed=0, epoch=0)))


def test_train_batches_global_batch_not_divisible_by_hosts():
    with pytest.raises(ConfigError, match="process"):
        next(iter(train_batches(indexed(30), 9, seed=0, epoch=0, process_count=2)))


# ----------------------------------------------------------------------------- eval batches


@pytest.mark.parametrize("n,batch", [(10, 4), (12, 4), (3, 8), (360, 64)])
def test_eval_batches_every_example_once(n, batch):
    data = indexed(n)
    batches = list(eval_batches(data, batch))
    assert len(batches) == -(-n // batch)
    for b in batches:
        assert b["label"].shape == (batch,) and b["mask"].shape == (batch,)
        assert b["image"].shape == (batch, 2, 2, 1)
        assert b["mask"].dtype == np.float32
    masks = np.concatenate([b["mask"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    assert masks.sum() == n
    np.testing.assert_array_equal(labels[masks == 1], np.arange(n))  # in order, once each
    assert np.all(masks[n:] == 0)  # the padding of the last batch is masked out


@pytest.mark.parametrize("n,batch", [(10, 4), (13, 8), (360, 64)])
def test_eval_batches_two_hosts(n, batch):
    data = indexed(n)
    h0 = list(eval_batches(data, batch, process_index=0, process_count=2))
    h1 = list(eval_batches(data, batch, process_index=1, process_count=2))
    assert len(h0) == len(h1) == -(-n // batch)  # every host runs the same number of steps
    seen = []
    total = 0.0
    for a, b in zip(h0, h1):
        assert a["label"].shape == b["label"].shape == (batch // 2,)
        for x in (a, b):
            total += x["mask"].sum()
            seen.extend(x["label"][x["mask"] == 1].tolist())
    assert total == n
    assert sorted(seen) == list(range(n))
    assert len(seen) == len(set(seen))


def test_eval_batches_digits_test_split(digits):
    _, test = digits
    masks = [b["mask"] for b in eval_batches(test, 64)]
    assert sum(m.sum() for m in masks) == 360
    assert len(masks) == 6
