"""In-memory data sets and their batching: scikit-learn's digits and synthetic images.

Both need no download. Batches are host-local numpy dicts (``image`` uint8 NHWC, ``label``
int32, and ``mask`` for eval); ``hybridpar.shard_batch`` turns them into global arrays.
Every process computes the same global permutation from (seed, epoch) and takes its own
contiguous slice of each global batch, so hosts read disjoint examples and a given seed
and step always give the same batch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterator

import numpy as np

from hybridpar.config.errors import ConfigError, DataError


def resize_bilinear(images: np.ndarray, size: int) -> np.ndarray:
    """(N, h, w) float -> (N, size, size) by bilinear interpolation: half-pixel centres, no
    antialiasing (as ``tf.image.resize``)."""
    n, h, w = images.shape

    def grid(src, dst):
        x = (np.arange(dst) + 0.5) * src / dst - 0.5
        x = np.clip(x, 0, src - 1)
        lo = np.floor(x).astype(int)
        hi = np.minimum(lo + 1, src - 1)
        return lo, hi, x - lo

    y0, y1, fy = grid(h, size)
    x0, x1, fx = grid(w, size)
    rows = images[:, y0] * (1 - fy)[None, :, None] + images[:, y1] * fy[None, :, None]
    return rows[:, :, x0] * (1 - fx) + rows[:, :, x1] * fx


# The digits split: scikit-learn 1.9's train_test_split(test_size=0.2, random_state=0,
# stratify=labels) over the 1,797 examples, its index order kept (the train order is the
# permutation a seed's shuffles start from). Saved, not recomputed: importing scikit-learn to
# split costs every run a second, and a frozen split cannot move under an upgrade.
DIGITS_SPLIT = Path(__file__).with_name("digits_split.npz")
DIGITS_CLASSES = 10  # the digits 0-9


def digits_file() -> Path:
    """scikit-learn's bundled digits file, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    where = spec and spec.submodule_search_locations
    path = where and Path(where[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path or not path.is_file():
        raise DataError(
            "data.name=digits reads scikit-learn's bundled digits (datasets/data/digits.csv.gz), "
            f"not found{f' at {path}' if path else ''}: pip install scikit-learn"
        )
    return path


def check_digits_config(d) -> None:
    """The ``data`` section asks for what digits is: grayscale, 10 classes (host and
    on-device paths alike)."""
    if d.channels != 1:
        raise ConfigError("data.name=digits is grayscale: set data.channels=1")
    if d.num_classes != DIGITS_CLASSES:  # else labels past the logits train unsaid
        raise ConfigError(
            f"data.num_classes={d.num_classes} but digits has {DIGITS_CLASSES} classes "
            f"(0-9): set --config.data.num_classes={DIGITS_CLASSES}"
        )


def load_digits(image_size: int):
    """scikit-learn's 1,797 handwritten 8x8 digits (shipped with the package), upsampled.

    Returns ``(train, test)`` dicts with ``image`` uint8 (N, S, S, 1) in 0..255 and ``label``.
    The split is a fixed seeded, class-stratified permutation (``DIGITS_SPLIT``), so runs
    are comparable.
    """
    raw = np.loadtxt(digits_file(), delimiter=",")  # 64 pixels in 0..16, then the label
    images = resize_bilinear(raw[:, :-1].reshape(-1, 8, 8).astype(np.float32) * (255.0 / 16.0),
                             image_size)  # fmt: skip
    images = np.clip(np.round(images), 0, 255).astype(np.uint8)[..., None]
    labels = raw[:, -1].astype(np.int32)
    with np.load(DIGITS_SPLIT) as split:
        parts = [{"image": images[split[k]], "label": labels[split[k]]} for k in ("train", "test")]
    return parts[0], parts[1]


def synthetic(num: int, image_size: int, num_classes: int, seed: int = 0, channels: int = 3):
    """Random uint8 images and labels: for speed and memory runs before real data exists."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (num, image_size, image_size, channels), np.uint8),
        "label": rng.integers(0, num_classes, (num,), np.int32),
    }


def _host_slice(global_batch: int, process_index: int, process_count: int) -> slice:
    if global_batch % process_count:
        raise ConfigError(
            f"global batch {global_batch} does not divide over {process_count} "
            "processes; make it a multiple of the process count"
        )
    per = global_batch // process_count
    return slice(process_index * per, (process_index + 1) * per)


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """An epoch's order of ``n`` examples, from (seed, epoch) alone: the same on every host
    and for the on-device input (``on_device.py``), which takes the same batches."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_batches(
    data: dict,
    global_batch: int,
    seed: int,
    epoch: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict]:
    """One epoch of shuffled host-local batches; the last partial global batch is dropped."""
    n = len(data["label"])
    if n < global_batch:
        raise DataError(
            f"the training set has {n} examples, fewer than one global batch of "
            f"{global_batch}; lower global_batch"
        )
    perm = permutation(n, seed, epoch)
    mine = _host_slice(global_batch, process_index, process_count)
    for b in range(n // global_batch):
        idx = perm[b * global_batch : (b + 1) * global_batch][mine]
        yield {k: v[idx] for k, v in data.items()}


def eval_batches(
    data: dict, global_batch: int, process_index: int = 0, process_count: int = 1
) -> Iterator[dict]:
    """Every example exactly once, in order; the last batch is padded and masked out."""
    n = len(data["label"])
    mine = _host_slice(global_batch, process_index, process_count)
    for start in range(0, n, global_batch):
        idx = np.arange(start, start + global_batch)
        mask = idx < n
        idx = np.where(mask, idx, 0)[mine]
        batch = {k: v[idx] for k, v in data.items()}
        batch["mask"] = mask[mine].astype(np.float32)
        yield batch


def steps_per_epoch(data: dict, global_batch: int) -> int:
    return len(data["label"]) // global_batch
