"""Data that lives on the device (``data.on_device=True``): sets that fit in accelerator memory,
held whole by every device and batched there, as airbench does on a GPU.

The set is decoded once into uint8 arrays (digits and synthetic are numpy already,
``arrays.py``; an ``images`` set is decoded with Pillow straight from its tars or folders and
cached beside the prepared data, ``PREPARED_DIR/on_device/``), then placed once, replicated, on
every device of the mesh. Each batch is made by a jitted pre-step:

* the epoch's order: the host path's own permutation from (seed, epoch) (``arrays.permutation``),
  placed once per epoch; the step's slice of it is taken inside the jit;
* a gather whose output is split over the data axes, so each device gathers only its own
  examples from its own copy (no collective: ``tests/test_on_device.py`` checks the HLO);
* the augmentation, per example, as two small matrix products (rows, then columns) that do
  the crop window and its bilinear resize to the stage's size, the translation and the flip.

Every random draw is made for the whole global batch from a key folded from (seed, epoch,
step), so the batch at (seed, epoch, step) is the same on any mesh and any number of
processes, and a resumed run reads exactly what the uninterrupted one did. Nothing here
imports TensorFlow.

Augmentation, as on the host: ``images``: a random-resized crop (area ``min_scale``..1 of the
image, aspect 3/4..4/3, ten tries then the centre 0.875; ``min_scale`` 1: the whole image)
resized to the stage's size, a translation by up to ``data.translate`` pixels
(reflect-padded), a horizontal flip. ``digits``, ``synthetic``: none, as their host path,
besides ``data.translate``; their sets are made at each size the run uses, as on the host.
Eval: every example once in order, the last batch padded and masked; ``images`` take the
centre ``eval_crop_ratio`` of the image, resized to ``data.image_size``.

An ``images`` set is stored at one square size, the largest the config trains or evaluates at
(``data.image_size`` and the stages'): an image of another size is resized (shorter side) and
centre-cropped to it; CIFAR-10's 32x32 images are kept as they are.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import os
import sys
import threading
import time
import warnings

import numpy as np

from hybridpar.config.errors import ClassCountError, ConfigError, DataError
from hybridpar.input import arrays

CACHE_FORMAT = "hybridpar-on-device-v2"  # v2: the counts of the data event, classes_from
CPU_LIMIT_MB = 1024  # per device, where the backend reports no memory (CPU)
_TAG_AUGMENT = 2  # folded into the seed's key first: independent of other uses of the seed
_ATTEMPTS = 10  # random-resized-crop tries before the centre crop, as the host pipeline
_FALLBACK_CROP = 0.875


# ---- Fitting on the device ------------------------------------------------------------------


def device_limit(limit_mb: float, device) -> tuple[int, str]:
    """The bytes of data one device may hold, and where that figure comes from."""
    if limit_mb > 0:
        return int(limit_mb * 2**20), "data.on_device_limit_mb"
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        pass
    if stats and stats.get("bytes_limit"):
        total = int(stats["bytes_limit"])
        return total // 4, f"a quarter of the {total / 2**30:.1f} GiB of {device.device_kind}"
    where = f"the default for a {device.platform} device, which reports no memory"
    return CPU_LIMIT_MB * 2**20, where


def check_fits(need: int, what: str, limit_mb: float, device) -> None:
    limit, why = device_limit(limit_mb, device)
    if need > limit:
        raise DataError(
            f"data.on_device=True: {what} take {need / 2**20:.1f} MiB on each device, more than "
            f"the {limit / 2**20:.1f} MiB allowed ({why}); set --config.data.on_device=False to "
            "read it from the host, or raise --config.data.on_device_limit_mb"
        )


def host_available() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable: free plus what the page
    cache gives back), less where a cgroup v2 limit leaves less; None where not known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_host_fits(need: int, what: str) -> None:
    """The set is decoded, loaded and placed from host memory: one that does not fit there is
    refused before it is decoded, as ``check_fits`` refuses one the device cannot hold
    (else the process swapped or was killed partway)."""
    available = host_available()
    if available is not None and need > available:
        raise DataError(
            f"data.on_device=True: {what} take {need / 2**20:.1f} MiB of host memory while they "
            f"are decoded and placed, more than the {available / 2**20:.1f} MiB available now; "
            "set --config.data.on_device=False to read it from the host, or free memory"
        )


# ---- The jitted pre-steps -------------------------------------------------------------------


def _reflect(i, n: int):
    """Indices outside 0..n-1 mirrored back without repeating the edge (tf.pad REFLECT)."""
    import jax.numpy as jnp

    i = jnp.abs(i)
    return jnp.where(i > n - 1, 2 * (n - 1) - i, i)


def _weights(start, length, j, out: int, size: int):
    """(B, out, size) bilinear weights: output index ``j`` (B, out) of the window
    [start, start + length) of a side of ``size`` pixels resized to ``out``, half-pixel
    centres and no antialiasing (as tf.image.resize); a window of ``out`` pixels at an
    integer offset is an exact copy."""
    import jax
    import jax.numpy as jnp

    start, end = start[:, None], (start + length - 1)[:, None]
    src = start + (j + 0.5) * (length[:, None] / out) - 0.5
    src = jnp.clip(src, start, end)
    lo = jnp.floor(src)
    frac = (src - lo)[..., None]
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, end.astype(jnp.int32))
    return jax.nn.one_hot(lo, size) * (1 - frac) + jax.nn.one_hot(hi, size) * frac


def _resample(x, wy, wx):
    """uint8 (B, S, S, C) -> uint8 (B, O, O, C): rows by ``wy``, columns by ``wx`` (B, O, S),
    rounded half up. HIGHEST: the GPU's default TF32 products would change pixel values."""
    import jax
    import jax.numpy as jnp

    hp = jax.lax.Precision.HIGHEST
    x = x.astype(jnp.float32)
    rows = jnp.einsum("bis,bsrc->birc", wy, x, precision=hp)
    out = jnp.einsum("bjr,birc->bijc", wx, rows, precision=hp)
    return jnp.clip(jnp.floor(out + 0.5), 0, 255).astype(jnp.uint8)


def _windows(key, n: int, size: int, min_scale: float):
    """Random-resized-crop windows (y0, x0, h, w), float32 (n,), over a size x size image."""
    import jax
    import jax.numpy as jnp

    full = jnp.full((n,), float(size), jnp.float32)
    if min_scale >= 1.0:
        return jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32), full, full
    k_area, k_ratio, k_y, k_x = jax.random.split(key, 4)
    area = size * size * jax.random.uniform(k_area, (n, _ATTEMPTS), minval=min_scale, maxval=1.0)
    log_r = jax.random.uniform(
        k_ratio, (n, _ATTEMPTS), minval=math.log(3 / 4), maxval=math.log(4 / 3)
    )
    w = jnp.round(jnp.sqrt(area * jnp.exp(log_r)))
    h = jnp.round(jnp.sqrt(area / jnp.exp(log_r)))
    ok = (w >= 1) & (h >= 1) & (w <= size) & (h <= size)
    first = jnp.argmax(ok, axis=1)[:, None]
    side = float(max(1, round(_FALLBACK_CROP * size)))
    found = ok.any(axis=1)
    h = jnp.where(found, jnp.take_along_axis(h, first, 1)[:, 0], side)
    w = jnp.where(found, jnp.take_along_axis(w, first, 1)[:, 0], side)
    y0 = jnp.floor(jax.random.uniform(k_y, (n,)) * (size - h + 1))
    x0 = jnp.floor(jax.random.uniform(k_x, (n,)) * (size - w + 1))
    return y0, x0, h, w


def train_maps(key, n: int, size: int, out: int, min_scale: float, flip: bool, translate: int):
    """The (rows, columns) weights of ``n`` augmented examples: crop window resized to
    ``out``, then shifted by up to ``translate`` px (reflect-padded), then maybe flipped."""
    import jax
    import jax.numpy as jnp

    k_crop, k_shift, k_flip = jax.random.split(key, 3)
    y0, x0, h, w = _windows(k_crop, n, size, min_scale)
    ry = rx = jnp.broadcast_to(jnp.arange(out), (n, out))
    if translate:
        shift = jax.random.randint(k_shift, (n, 2), 0, 2 * translate + 1) - translate
        ry = _reflect(ry + shift[:, :1], out)
        rx = _reflect(rx + shift[:, 1:], out)
    if flip:  # after the shift: output column i is the shifted image's column out-1-i
        rx = jnp.where(jax.random.bernoulli(k_flip, 0.5, (n,))[:, None], rx[:, ::-1], rx)
    return _weights(y0, h, ry, out, size), _weights(x0, w, rx, out, size)


def centre_weights(size: int, out: int, ratio: float) -> np.ndarray:
    """(out, size) weights of the centre crop of ``ratio`` x the side, resized to ``out``
    (the host pipeline's eval window: side rounded, offset (size - side + 1) // 2)."""
    side = min(max(int(round(ratio * size)), 1), size)
    start = (size - side + 1) // 2
    src = np.clip(start + (np.arange(out) + 0.5) * side / out - 0.5, start, start + side - 1)
    lo = np.floor(src).astype(int)
    hi = np.minimum(lo + 1, start + side - 1)
    frac = src - lo
    w = np.zeros((out, size), np.float32)
    w[np.arange(out), lo] += 1 - frac
    w[np.arange(out), hi] += frac
    return w


def _auto(mesh):
    """``mesh`` with every axis Auto, the mesh of a pre-step's sharding constraints: they name
    only Auto axes, and ``_jit`` runs a pre-step with the axes of ``mesh`` made Auto."""
    from jax.sharding import AxisType

    if AxisType.Explicit not in mesh.axis_types:  # the trainer's meshes: used as they are
        return mesh
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _jit(make, mesh, out):
    """``make`` jitted, its outputs placed as ``out`` on ``mesh``; on a mesh with Explicit
    axes (``jax.make_mesh``'s default) run with them made Auto (``_auto``)."""
    import jax
    from jax.sharding import AxisType

    if AxisType.Explicit in mesh.axis_types:
        make = jax.sharding.auto_axes(make, out_sharding=out)
    return jax.jit(make, out_shardings=out)


def augment_key(seed: int, epoch, step):
    import jax

    key = jax.random.fold_in(jax.random.key(seed), _TAG_AUGMENT)
    return jax.random.fold_in(jax.random.fold_in(key, epoch), step)


# ---- The data set on the mesh ---------------------------------------------------------------


SETS_FORM = ("train {size: {'image': uint8 (N, size, size, C), 'label': int (N,)}}, one set per "
             "stored image size (e.g. {16: train}), and test one such set")  # fmt: skip


def _check_sets(train, test) -> None:
    """``DeviceSet``'s ``train`` and ``test`` in its form (``SETS_FORM``), one label per
    image: of mismatched lengths, only the shorter's examples would be batched."""

    def is_set(t) -> bool:
        return hasattr(t, "keys") and {"image", "label"} <= set(t.keys())

    def given(t) -> str:
        keys = f" with keys {sorted(map(str, t.keys()))}" if hasattr(t, "keys") else ""
        return f"{type(t).__name__}{keys}"

    sized = hasattr(train, "items") and len(train) > 0
    if not sized or not all(isinstance(s, (int, np.integer)) and is_set(t)
                            for s, t in train.items()):  # fmt: skip
        raise TypeError(f"DeviceSet takes {SETS_FORM}; got train as a {given(train)}")
    if not is_set(test):
        raise TypeError(f"DeviceSet takes {SETS_FORM}; got test as a {given(test)}")
    sets = {f"train set at {s} px": t for s, t in train.items()} | {"test set": test}
    for name, t in sets.items():
        if np.ndim(t["image"]) != 4:
            raise DataError(
                f"DeviceSet: the {name} has images of shape {np.shape(t['image'])}; pass them "
                "as (N, size, size, C), e.g. images[..., None] for grayscale"
            )
        images, labels = len(t["image"]), len(t["label"])
        if images != labels:
            raise DataError(
                f"DeviceSet: the {name} has {images} images and {labels} labels; pass one "
                "label per image"
            )
    counts = {s: len(t["label"]) for s, t in train.items()}
    if len(set(counts.values())) > 1:
        raise DataError(
            f"DeviceSet: the train sets hold different numbers of examples ({counts}, by "
            "size); store the same examples at each size"
        )


class DeviceSet:
    """Train sets (one per stored size) and the eval set, replicated on every device of
    ``mesh`` (Auto or Explicit axes), and the pre-steps that batch them. ``train``: {size:
    {"image", "label"}} (uint8 NHWC, int32), ``test`` one such set, one label per image (else
    ``_check_sets`` refuses them); ``nominal``: examples in an epoch (the synthetic pool is
    cycled to make one, as on the host); ``crop``/``flip``/``translate``: the train
    augmentation."""

    def __init__(self, mesh, seed: int, train: dict, test: dict, *, nominal: int | None = None,
                 cycled: bool = False, crop: bool = False, flip: bool = False, translate: int = 0,
                 eval_size: int | None = None, eval_crop_ratio: float = 1.0):  # fmt: skip
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        _check_sets(train, test)
        self.mesh, self.seed = mesh, int(seed)
        self.crop, self.flip, self.translate = crop, flip, int(translate)
        self.cycled = cycled
        rep = NamedSharding(mesh, P())
        self.replicated = rep
        self.train = {
            s: {k: jax.device_put(np.asarray(v), rep) for k, v in t.items()}
            for s, t in train.items()
        }
        same = [s for s, t in train.items() if t is test]  # eval split = train split: once
        self.test = (
            self.train[same[0]]
            if same
            else {k: jax.device_put(np.asarray(v), rep) for k, v in test.items()}
        )
        self.n_train = len(next(iter(train.values()))["label"])
        self.n_test = len(test["label"])
        self.nominal = nominal or self.n_train
        self.test_size = int(test["image"].shape[1])
        self.eval_size = eval_size or self.test_size
        self.eval_crop_ratio = float(eval_crop_ratio)
        self._lock = threading.Lock()
        self._fns: dict = {}
        self._orders: dict = {}

    def _check_batch(self, global_batch: int, what: str) -> None:
        """As ``shard_batch``: a batch splits evenly over the data-parallel devices."""
        from hybridpar.parallel.mesh import check_divides, data_parallel_size

        ways = data_parallel_size(self.mesh)
        check_divides(global_batch, ways, f"a global {what} batch of ", "the mesh")

    # ---- train ----

    def steps_for(self, global_batch: int) -> int:
        return self.nominal // global_batch

    def stored(self, size: int) -> int:
        """The stored train set a stage at ``size`` reads: its own size, else the largest."""
        return size if size in self.train else max(self.train)

    def order(self, epoch: int, global_batch: int):
        """The epoch's example order (its steps' worth), replicated on the devices: the host
        path's permutation from (seed, epoch); for digits and synthetic from (seed, epoch *
        1000 + cycle), the pool cycled to fill a nominal epoch, as their host path does."""
        import jax

        key = (epoch, global_batch)
        with self._lock:
            if key in self._orders:
                return self._orders[key]
        n, need = self.n_train, self.steps_for(global_batch) * global_batch
        per_cycle = (n // global_batch) * global_batch
        parts, cycle = [], 0
        while sum(map(len, parts)) < need:
            tag = epoch * 1000 + cycle if self.cycled else epoch
            parts.append(arrays.permutation(n, self.seed, tag)[:per_cycle])
            cycle += 1
        order = jax.device_put(np.concatenate(parts)[:need].astype(np.int32), self.replicated)
        with self._lock:
            if len(self._orders) >= 4:  # this epoch's and the next, at a stage's batch or two
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return order

    def train_fn(self, global_batch: int, size: int, min_scale: float):
        """The jitted ``(images, labels, order, epoch, step) -> batch`` of one stage."""
        self._check_batch(global_batch, "train")
        key = ("train", global_batch, size, float(min_scale))
        with self._lock:
            if key in self._fns:
                return self._fns[key]
        from jax import lax

        from hybridpar.parallel.partitioning import batch_sharding

        mesh, b, stored = self.mesh, global_batch, self.stored(size)
        inner = _auto(mesh)
        scale = float(min_scale) if self.crop else 1.0
        plain = scale >= 1.0 and size == stored and not (self.flip or self.translate)
        seed, flip, translate = self.seed, self.flip, self.translate

        def make(images, labels, order, epoch, step):
            idx = lax.dynamic_slice_in_dim(order, step * b, b)
            idx = lax.with_sharding_constraint(idx, batch_sharding(inner, 1))
            x, y = images[idx], labels[idx]
            if not plain:
                key = augment_key(seed, epoch, step)
                wy, wx = train_maps(key, b, stored, size, scale, flip, translate)
                x = _resample(x, wy, wx)
            return {"image": x, "label": y}

        out = {"image": batch_sharding(mesh, 4), "label": batch_sharding(mesh, 1)}
        fn = _jit(make, mesh, out)
        with self._lock:
            self._fns[key] = fn
        return fn

    def train_batches(self, epoch: int, start_step: int, steps: int | None, global_batch: int,
                      size: int, min_scale: float):  # fmt: skip
        """Global batches from (epoch, start_step) on, ``steps`` of them into the next
        epochs (None: to the end of the epoch)."""
        per = self.steps_for(global_batch)
        if per == 0 or global_batch > self.n_train:
            raise DataError(
                f"the training set has {self.n_train} examples, fewer than one global batch "
                f"of {global_batch}; lower global_batch"
            )
        fn = self.train_fn(global_batch, size, min_scale)
        data = self.train[self.stored(size)]
        left = per - start_step if steps is None else steps
        while left > 0:
            n = min(per - start_step, left)
            order = self.order(epoch, global_batch)
            for step in range(start_step, start_step + n):
                yield fn(data["image"], data["label"], order, np.int32(epoch), np.int32(step))
            epoch, start_step, left = epoch + 1, 0, left - n

    # ---- eval ----

    def eval_fn(self, global_batch: int):
        self._check_batch(global_batch, "eval")
        key = ("eval", global_batch)
        with self._lock:
            if key in self._fns:
                return self._fns[key]
        import jax.numpy as jnp
        from jax import lax

        from hybridpar.parallel.partitioning import batch_sharding

        mesh, b, n = self.mesh, global_batch, self.n_test
        inner = _auto(mesh)
        size, out, ratio = self.test_size, self.eval_size, self.eval_crop_ratio
        w = None
        if out != size or int(round(ratio * size)) < size:
            w = centre_weights(size, out, ratio)

        def make(images, labels, start):
            idx = start + jnp.arange(b, dtype=jnp.int32)
            mask = idx < n
            idx = lax.with_sharding_constraint(jnp.where(mask, idx, 0), batch_sharding(inner, 1))
            x, y = images[idx], labels[idx]
            if w is not None:
                ww = jnp.broadcast_to(jnp.asarray(w), (b, *w.shape))
                x = _resample(x, ww, ww)
            return {"image": x, "label": y, "mask": mask.astype(jnp.float32)}

        out_sh = {"image": batch_sharding(mesh, 4), "label": batch_sharding(mesh, 1),
                  "mask": batch_sharding(mesh, 1)}  # fmt: skip
        fn = _jit(make, mesh, out_sh)
        with self._lock:
            self._fns[key] = fn
        return fn

    def eval_batches(self, global_batch: int):
        fn = self.eval_fn(global_batch)
        for start in range(0, self.n_test, global_batch):
            yield fn(self.test["image"], self.test["label"], np.int32(start))


# ---- From the config ------------------------------------------------------------------------


def image_sizes(c, stage_sizes: list[int] | None = None) -> list[int]:
    """Every image size the config trains or evaluates at: data.image_size and the stages'
    (``stage_sizes``, the run plan's; None: read from ``c.stages``)."""
    if stage_sizes is None:
        from hybridpar.config.curriculum import parse_stages

        stage_sizes = [size for _, size, _, _ in parse_stages(c.stages)] if c.stages else []
    return sorted({c.data.image_size, *stage_sizes})


def make_data(c, mesh=None, stage_sizes: list[int] | None = None):
    """The ``Data`` (``datasets.Data``) of ``c`` held on the devices of ``mesh`` (the run's;
    None: ``c.mesh`` over every device, as the run's set-up makes it), stored at
    ``image_sizes(c, stage_sizes)``: the run's set-up passes its stages' sizes."""
    import jax

    from hybridpar.input.datasets import Data, EpochSteps
    from hybridpar.parallel.mesh import make_mesh

    d = c.data
    mesh = make_mesh(c.mesh) if mesh is None else mesh
    sizes = image_sizes(c, stage_sizes)
    kw: dict = {"translate": d.translate}
    info: dict = {"source": d.name}
    if d.name == "digits":
        arrays.check_digits_config(d)
        train = {s: arrays.load_digits(s)[0] for s in sizes}
        test = arrays.load_digits(d.image_size)[1]
        kw.update(cycled=True)  # the host path's seeds, so the same batches
    elif d.name == "synthetic":  # a pool of random images stands in for an epoch, as on the host
        pool = min(d.train_examples, 4 * c.global_batch)
        train = {s: arrays.synthetic(pool, s, d.num_classes, c.seed, d.channels) for s in sizes}
        n = min(d.eval_examples, 2 * c.eval_batch)
        test = arrays.synthetic(n, d.image_size, d.num_classes, c.seed + 1, d.channels)
        kw.update(nominal=d.train_examples, cycled=True)
    elif d.name == "images":
        if d.channels != 3:
            raise ConfigError("data.name=images decodes RGB images: set data.channels=3")
        train, test, info = _images(c, max(sizes), mesh)
        kw.update(crop=True, flip=True, eval_size=d.image_size, eval_crop_ratio=d.eval_crop_ratio)
    else:
        raise ConfigError(
            f"data.on_device=True holds digits, synthetic or images sets, not data.name="
            f"{d.name!r}; set --config.data.on_device=False"
        )
    if d.name != "images":
        check_fits(_nbytes(train, test), f"the {d.name} arrays", d.on_device_limit_mb,
                   mesh.devices.flat[0])  # fmt: skip
    n_train = len(next(iter(train.values()))["label"])
    if n_train < c.global_batch:
        raise DataError(
            f"the training set has {n_train} examples, fewer than one global batch of "
            f"{c.global_batch}; lower global_batch"
        )
    ds = DeviceSet(mesh, c.seed, train, test, **kw)

    def train_batches(epoch, start_step=0, *, steps=None, global_batch=None, image_size=None,
                      min_scale=None):  # fmt: skip
        return ds.train_batches(
            epoch,
            start_step,
            steps,
            global_batch or c.global_batch,
            image_size or d.image_size,
            d.min_scale if min_scale is None else min_scale,
        )

    # the data event's schema (run_records.Data) has no on-device fields: said on stdout
    info = info | {"train_examples": ds.n_train, "eval_examples": ds.n_test}
    if jax.process_index() == 0:
        stored = ", ".join(f"{s}px" for s in sorted(train))
        print(f"data on the devices: {_nbytes(train, test) / 2**20:.1f} MiB on each (the "
              f"train split at {stored} and the eval split), batched and augmented there",
              flush=True)  # fmt: skip
    shape = (d.image_size, d.image_size, d.channels)
    # digits and images: every example once an epoch (a synthetic epoch cycles its pool)
    steps_for = ds.steps_for if d.name == "synthetic" else EpochSteps(ds.steps_for, ds.n_train)
    return Data(
        train_batches,
        lambda: ds.eval_batches(c.eval_batch),
        ds.steps_for(c.global_batch),
        ds.n_test,
        shape,
        info,
        steps_for,
    )


def _nbytes(train: dict, test: dict) -> int:
    sets = [*train.values()] + ([] if any(t is test for t in train.values()) else [test])
    return sum(np.asarray(v).nbytes for t in sets for v in t.values())


# ---- images: decoded once with Pillow, cached beside the prepared data -----------------------


def _images(c, size: int, mesh):
    """``(train, test, info)`` of an ``images`` set stored at ``size`` px, from the cache in
    PREPARED_DIR/on_device when it matches the sources as they are now, else decoded."""
    from hybridpar.input import prepare as prep
    from hybridpar.input.datasets import (
        cache_fix,
        classes_line,
        data_paths,
        files_digest,
        split_counts,
    )

    d = c.data
    sources, prepared = data_paths(d)
    sources = [os.path.abspath(s) for s in sources]
    if not sources:
        raise ConfigError(
            "data.on_device=True decodes an images set from its tars or folders: set "
            "data.source (data.prepared_dir alone holds TFRecords, read with TensorFlow)"
        )
    prep.check_out(prepared, sources, "data.prepared_dir")  # before its lock is made
    folder = os.path.join(prepared, "on_device")
    splits = list(dict.fromkeys([d.train_split, d.eval_split]))
    parent = os.path.dirname(folder)
    new, new_parent = not os.path.exists(folder), not os.path.exists(parent)
    try:
        with prep.FolderLock(folder, cache_fix(d)):
            staging: list = []
            try:
                out = _load_or_decode(c, size, mesh, sources, folder, splits, staging)
            finally:
                for f in staging:
                    if os.path.exists(f):
                        os.remove(f)
    except ConfigError:
        if new:  # a first use that failed (a wrong source): leave no empty cache behind
            prep.remove_if_unused(folder, parent=new_parent)
        raise
    (train, tm), (test, em) = out[d.train_split], out[d.eval_split]
    if len(tm["classes"]) != d.num_classes:
        raise ClassCountError(
            f"the data has {len(tm['classes'])} classes but data.num_classes={d.num_classes}; "
            f"set --config.data.num_classes={len(tm['classes'])}",
            tm["classes"],
        )
    info = {
        "source": d.source,
        "train_split": d.train_split,
        "eval_split": d.eval_split,
        "num_classes": len(tm["classes"]),
        "classes": list(tm["classes"]),  # the label -> name mapping, kept with the run
    }
    info.update(split_counts({d.train_split: tm, d.eval_split: em}))
    info["train_fingerprint"] = files_digest(tm)
    print(classes_line(tm["classes"]), flush=True)
    return {size: train}, test, info


def cache_paths(folder: str, split: str, size: int) -> tuple[str, str]:
    base = os.path.join(folder, f"{split}-{size}px")
    return base + ".npz", base + ".json"


def _cached(folder: str, split: str, size: int, sources: list[str], classes) -> tuple:
    """``(meta, '')`` where the cache of ``split`` serves these sources as they are now (and
    ``classes``, when given), else ``(None, why not)``."""
    from hybridpar.input import prepare as prep

    arrays_path, meta_path = cache_paths(folder, split, size)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None, "not decoded yet"
    if not os.path.exists(arrays_path):
        return None, "not decoded yet"
    if meta.get("format") != CACHE_FORMAT:
        return None, f"it was decoded by an older hybridpar ({meta.get('format')})"
    if meta.get("source") not in sources:
        return None, f"it was decoded from {meta.get('source')!r}"
    try:
        fingerprint = meta["fingerprint"]
        change = prep.describe_change(fingerprint, prep.source_fingerprint(fingerprint))
    except (ConfigError, OSError) as e:
        return None, f"its source cannot be checked ({e})"
    if change:
        return None, f"the source changed since it was decoded: {change}"
    if classes is not None and meta["classes"] != list(classes):
        return None, prep.class_change(meta["classes"], list(classes))
    return meta, ""


def _load_or_decode(c, size, mesh, sources, folder, splits, staging) -> dict:
    from hybridpar.input import prepare as prep

    d = c.data
    classes = given = prep.parse_classes(d.classes)
    if classes is None:  # the train split's class folders, from its cache if that is current
        meta, _ = _cached(folder, d.train_split, size, sources, None)
        if meta and not prep.class_list_stale(meta, None, d.train_split):
            classes = meta["classes"]
    state = {s: _cached(folder, s, size, sources, classes) for s in splits}
    listed = {}
    if classes is None or any(why for _, why in state.values()):
        os.makedirs(folder, exist_ok=True)
        for source in sources:
            for name, listing in prep.list_source(source, None, folder, staging, True).items():
                if name in listed:
                    raise DataError(
                        f"split {name!r} is in both {listed[name][0]!r} and {source!r}; "
                        "keep each split in one source"
                    )
                listed[name] = (source, listing)
        if classes is None:
            if d.train_split not in listed:
                raise prep.one_split_error(
                    listed, d.train_split, prep.RUN_FIX
                ) or prep.missing_split_error("train_split", d.train_split, sources, listed)
            classes = list(listed[d.train_split][1]["class_dirs"])
            state = {s: _cached(folder, s, size, sources, classes) for s in splits}
    counts = {}
    for split, (meta, why) in state.items():
        if not why:
            counts[split] = meta["num_examples"]
        elif split in listed:
            counts[split] = len(listed[split][1]["files"])
        else:
            key = "train_split" if split == d.train_split else "eval_split"
            raise prep.one_split_error(listed, split, prep.RUN_FIX) or prep.missing_split_error(
                key, split, sources, listed
            )
    per_image = size * size * 3 + 4
    need = sum(counts.values()) * per_image
    what = ", ".join(f"{n} {s} images" for s, n in counts.items()) + f" at {size}x{size}"
    check_fits(need, what, d.on_device_limit_mb, mesh.devices.flat[0])
    check_host_fits(need, what)
    # prepare's checks, before any split is decoded: a class folder the list lacks (in any
    # split to decode), and a train class with no file (empty or missing folders).
    origin = prep.GIVEN if given is not None else f"train split {d.train_split!r}"
    to_decode = {s: listed[s] for s, (_, why) in state.items() if why}
    prep.check_splits(to_decode, classes, origin, d.train_split, d.allow_empty_classes)
    out = {}
    for split, (meta, why) in state.items():
        arrays_path, meta_path = cache_paths(folder, split, size)
        if why:
            source, listing = listed[split]
            print(f"decoding split {split!r} of {source} with Pillow into {arrays_path} ({why}; "
                  "later runs reuse it)", flush=True)  # fmt: skip
            origin = None if given is not None else d.train_split
            t0 = time.time()
            meta = decode_split(listing, classes, origin, size, arrays_path, meta_path, source,
                                 split)  # fmt: skip
            print(_summary(split, meta, arrays_path, time.time() - t0), file=sys.stderr,
                  flush=True)  # fmt: skip
            if meta["ignored"]:
                print(prep.ignored_note(split, meta["ignored"], meta_path), flush=True)
            prep.class_notes(split, meta["empty_folders"], meta["classes_without_examples"])
        elif _process_index() == 0:  # said as the tf.data path says its reuse
            print(f"reusing the decoded copy {arrays_path} ({meta['num_examples']} examples of "
                  f"split {split!r})", flush=True)  # fmt: skip
        # The same rule as prepare's: a train class without a usable example is an error.
        empty = meta["classes_without_examples"]
        if split == d.train_split and empty and not d.allow_empty_classes:
            raise prep.empty_classes_error(split, meta["source"], empty)
        with np.load(arrays_path) as z:
            out[split] = ({"image": z["image"], "label": z["label"]}, meta)
    return out


def _process_index() -> int:
    import jax  # (this module's callers import it; the module itself stays light)

    return jax.process_index()


def decode_image(data: bytes, size: int):
    """Encoded bytes -> ``(uint8 (size, size, 3), converted, None)`` or ``(None, None, why
    skipped)``: prepare's ``decode`` (the same files kept, skipped and converted, for the same
    reasons), then resized (shorter side) and centre-cropped. ``converted``: why the file was
    not a clean JPEG (None: it was)."""
    from PIL import Image

    from hybridpar.input.prepare import decode

    img, reason, skip = decode(data)
    if img is None:
        return None, None, skip
    img = img.convert("RGB")  # a grey JPEG
    w, h = img.size
    if (w, h) != (size, size):
        scale = size / min(w, h)
        w, h = max(size, round(w * scale)), max(size, round(h * scale))
        # Pillow's bilinear filter antialiases a shrink and tf.data's resize does not: the two
        # paths' pixels differ (docs/data.md), only their accuracy should agree.
        img = img.resize((w, h), Image.Resampling.BILINEAR)
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
    return np.asarray(img, np.uint8), reason, None


def _summary(split: str, meta: dict, arrays_path: str, seconds: float) -> str:
    """The line said after a split is decoded: prepare's summary (``prepare._summary``)."""
    return (
        f"{split}: {meta['num_examples']} examples from {meta['source']}; "
        f"{len(meta['skipped'])} skipped, {len(meta['converted'])} converted "
        f"({meta['rotated']} rotated upright by EXIF); "
        f"{os.path.getsize(arrays_path) / 1e6:.1f} MB at {meta['size']}px; "
        f"{seconds:.1f} s, {meta['num_files'] / max(seconds, 1e-9):.0f} images/s"
    )


def decode_split(listing, classes, classes_from, size, arrays_path, meta_path, source,
                  split="") -> dict:  # fmt: skip
    """Decodes a split into ``arrays_path`` and writes its record (``meta_path``): the keys
    of a manifest's split entry that the data event counts (``datasets.split_counts``).
    A progress bar on stderr, as prepare's."""
    from PIL import Image
    from tqdm import tqdm

    from hybridpar.input import prepare as prep

    label = {name: i for i, name in enumerate(classes)}
    files = listing["files"]
    extra = sorted({f[1] for f in files} - set(label))
    if extra:
        raise DataError(
            f"{source!r} has class folder(s) {extra[:10]} that the class list lacks, so they "
            "have no label; remove or rename them, or list every class (data.classes)"
        )

    # Each image goes straight into its file's row of one array made up front (a list of
    # them and its np.stack held the set twice); skipped files' rows are closed up in order.
    images = np.empty((len(files), size, size, 3), np.uint8)

    def chunk(start):
        handles, out = {}, []
        try:
            for row, (_, _, file, offset, n) in enumerate(files[start : start + step], start):
                try:
                    img, reason, skip = decode_image(
                        prep.read_listed(handles, file, offset, n), size
                    )
                except OSError as e:
                    img, reason, skip = None, None, prep.read_error(file, e)
                if img is not None:
                    images[row] = img
                out.append((img is not None, reason, skip))
        finally:
            for f in handles.values():
                f.close()
        return out

    step = 256
    workers = max(1, len(os.sched_getaffinity(0)))
    bar = tqdm(total=len(files), unit="img", desc=split, file=sys.stderr)
    # prepare's pixel limit (PIL's own is lower) and its silence on odd but readable files
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, prep.MAX_PIXELS
    keep, skipped, converted = [], [], []
    try:
        with warnings.catch_warnings(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
            warnings.simplefilter("ignore")
            i = 0
            for part in pool.map(chunk, range(0, len(files), step)):  # decoded without the GIL
                for ok, reason, skip in part:
                    if ok:
                        if len(keep) != i:  # up into a skipped file's row (a finished part's)
                            images[len(keep)] = images[i]
                        keep.append(i)
                    else:
                        skipped.append({"name": files[i][0], "reason": skip})
                    if reason:
                        converted.append({"name": files[i][0], "reason": reason})
                    i += 1
                bar.set_postfix(skipped=len(skipped), refresh=False)
                bar.update(len(part))
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit
        bar.close()
    images = images[: len(keep)]  # a view: no copy
    labels = np.asarray([label[files[i][1]] for i in keep], np.int32)
    counts = collections.Counter(f[1] for f in files)
    usable = collections.Counter(files[i][1] for i in keep)
    meta = {
        "format": CACHE_FORMAT,
        "source": source,
        "fingerprint": listing["fingerprint"],
        "classes": list(classes),
        "classes_from": classes_from,
        "size": size,
        "num_files": len(files),
        "num_examples": len(keep),
        "skipped": skipped,
        "converted": converted,
        "rotated": prep.count_rotated(converted),
        "ignored": [{"name": n, "reason": why} for n, why in listing["ignored"]],
        "empty_folders": [c for c in listing["class_dirs"] if not counts[c]],
        "classes_without_examples": prep.classes_without_examples(
            classes, listing["class_dirs"], counts, usable
        ),
    }
    temps = (arrays_path + ".tmp.npz", meta_path + ".tmp")
    try:
        if os.path.exists(meta_path):  # the old record first: it must not vouch for new arrays
            os.remove(meta_path)
        np.savez(temps[0], image=images, label=labels)
        os.replace(temps[0], arrays_path)
        with open(temps[1], "w") as f:
            json.dump(meta, f)
        os.replace(temps[1], meta_path)  # last: the arrays are complete before it
    except OSError as e:  # a disk full: one line, and no partial file left behind
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)
        folder = os.path.dirname(arrays_path)
        raise DataError(
            f"cannot write the decoded set into {folder} ({e.strerror}): it takes "
            f"{images.nbytes / 2**20:.1f} MiB there; free that much, or point "
            "--config.data.prepared_dir at a disk with room (or set --config.data.on_device="
            "False to read the set from the host)"
        ) from None
    return meta
