"""Reduced-scale JPEG decoding (DCT scale 1/2, 1/4, 1/8) against the full decode, on real
ImageNet photos from the shared sample.

The crop window is drawn from the original size either way, so with the same seed both
decodes crop the same region: the check is paired, sample by sample. Its yardstick comes
from the pictures themselves: the same output shifted by one pixel. A reduced decode that
is further from the full one than that has cropped the wrong place; the negative control (a
window whose offsets are not scaled) shows the check catches exactly that.
"""

import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from hybridpar.input import transforms as T

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HYBRIDPAR_DATA", ROOT.parent / "shared" / "data"))
SIZE, MIN_SCALE, SEEDS = 64, 0.25, 3  # most crops of 500x375 photos are >= 2x 64 px


@pytest.fixture(scope="module")
def photos():
    tar_path = DATA / "imagenet-sample" / "train.tar"
    if not tar_path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"shared data not found at {tar_path} and CI is set (set HYBRIDPAR_DATA)")
        pytest.skip(f"shared data not found at {tar_path} (set HYBRIDPAR_DATA)")
    out = []
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar if m.isreg()]
        for m in members[::25]:  # 40 photos of 40 classes, grayscale and odd sizes among them
            out.append(tar.extractfile(m).read())
    return out


def _pairs(photos):
    """Full-scale and reduced outputs for every (photo, seed), and the DCT ratio used."""

    @tf.function
    def both(data, seed):
        full = T.train_transform(data, seed, SIZE, min_scale=MIN_SCALE, dct_scaling=False)
        reduced = T.train_transform(data, seed, SIZE, min_scale=MIN_SCALE, dct_scaling=True)
        box_seed = tf.random.experimental.stateless_split(seed, num=2)[0]
        shape = tf.image.extract_jpeg_shape(data)
        _, _, h, w = T.random_window(shape, box_seed, MIN_SCALE, 1.0, (3 / 4, 4 / 3))
        return full, reduced, T.dct_ratio(h, w, SIZE)

    full, reduced, ratio = [], [], []
    for i, data in enumerate(photos):
        for j in range(SEEDS):
            f, r, k = both(tf.constant(data), tf.constant([i, j], tf.int64))
            full.append(f.numpy())
            reduced.append(r.numpy())
            ratio.append(T.DCT_RATIOS[int(k)])
    return np.array(full, float), np.array(reduced, float), np.array(ratio)


def _check(full, reduced, ratio):
    scaled = ratio > 1
    assert scaled.mean() > 0.5 and (ratio >= 4).any()  # the reduced paths are exercised
    np.testing.assert_array_equal(full[~scaled], reduced[~scaled])  # ratio 1: the same op
    f, r = full[scaled], reduced[scaled]
    paired = np.abs(f - r).mean(axis=(1, 2, 3))
    shifted = np.abs(f[:, 1:, 1:] - f[:, :-1, :-1]).mean(axis=(1, 2, 3))
    # Same region: the paired difference is well under what a one-pixel shift makes.
    assert np.median(paired) < 0.6 * np.median(shifted), (
        f"median {np.median(paired):.1f} vs {np.median(shifted):.1f} for a one-pixel shift"
    )
    # Same brightness: libjpeg's scaled IDCT measured +0.8 of 255 levels on these photos
    # (the random crop does not move it); a wrong region would move it by its own variance.
    bias = (r - f).mean(axis=(1, 2, 3))
    assert abs(bias.mean()) < 1.5, bias.mean()
    # Same contrast, slightly smoother: the scaled IDCT is a low-pass filter, and bilinear
    # subsampling of the full decode keeps some aliasing (measured ratio 0.96).
    contrast = np.median(r.std(axis=(1, 2, 3)) / f.std(axis=(1, 2, 3)))
    assert 0.9 < contrast < 1.02, contrast


def test_reduced_scale_decoding_keeps_the_augmentation(photos):
    _check(*_pairs(photos))


def test_negative_control_unscaled_offsets_are_caught(photos, monkeypatch):
    """A bug that crops the scaled image at offsets in full-size pixels (clipped to fit)."""
    right = T.decode_crop_jpeg

    def broken(data, shape, window, image_size):
        oy, ox, h, w = window
        if image_size is None:
            return right(data, shape, window, None)
        k = T.dct_ratio(h, w, image_size)

        def at(r):
            def decode():
                hs, ws = (shape[0] + r - 1) // r, (shape[1] + r - 1) // r
                hh, ww = tf.maximum(h // r, 1), tf.maximum(w // r, 1)
                y0, x0 = tf.minimum(oy, hs - hh), tf.minimum(ox, ws - ww)
                crop = tf.stack([y0, x0, hh, ww])
                return tf.image.decode_and_crop_jpeg(data, crop, channels=3, ratio=r)

            return decode

        return tf.switch_case(k, [at(r) for r in T.DCT_RATIOS])

    monkeypatch.setattr(T, "decode_crop_jpeg", broken)
    with pytest.raises(AssertionError, match="median"):  # caught by the paired check itself
        _check(*_pairs(photos))
