"""The tf.data pipeline over a prepared split (``hybridpar.input.records`` format).

``ImagePipeline`` yields host-local numpy batches with the same contract as
``hybridpar.input.arrays`` (``image`` uint8 NHWC, ``label`` int32, eval adds ``mask``
float32 1/0); ``hybridpar.parallel.partitioning.shard_batch`` (or ``prefetch_to_mesh`` in
``input/prefetch.py``) turns them into global arrays. The cache levels, from slowest to fastest:

1. prepared shards chosen by the current image size (``records.choose_copy``: a 128-px
   stage reads the reduced 160-px copy, decoding far fewer pixels);
2. RAM (``ram_cache=True``): the parsed, still-encoded records of each copy, kept for the
   life of the pipeline, so later epochs and curriculum stages do no file I/O;
3. ``input/prefetch.py``: the next N global batches already on the devices.

Per-host sharding: host ``p`` of ``P`` reads shard files ``p, p+P, ...`` (disjoint), shuffles
them with a seed from (seed, epoch, p), and crops each example with a stateless seed from
(seed, epoch, p, position in the epoch), so a given (seed, epoch, step) is always the same
batch: ``train_batches(..., start_step=k)`` resumes an epoch exactly. Every host knows every
host's example count from the manifest, so all agree on the number of steps.

The pre-shuffle order is fixed (files cycled round-robin, in order), so ``ram_cache`` does not
change any batch; the shuffle buffer does the mixing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from hybridpar.config.errors import ConfigError, DataError
from hybridpar.input import records
from hybridpar.input.transforms import eval_transform, train_transform

# The same process runs JAX on the GPUs: TensorFlow must not claim them (this fails, and is
# harmless, once TensorFlow has initialised its devices).
try:
    tf.config.set_visible_devices([], "GPU")
except (RuntimeError, ValueError):
    pass

# Batches each pipeline holds ready beyond the one being read (the devices' own prefetch,
# input/prefetch.py, holds more): enough to cover a batch's jitter, not an epoch's memory.
_PREFETCH_BATCHES = 2
_MAX_CYCLE = 64  # shard files read round-robin at once (each holds a read buffer)
_READ_BUFFER = 256 * 1024  # bytes per open shard file


def _stream_seed(*parts: int) -> int:
    """A non-negative int63 from integers (independent streams for independent tags)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & (2**63 - 1)


_TAG_SHUFFLE, _TAG_AUGMENT = 1, 2


def _read(filename):
    return tf.data.TFRecordDataset(filename, buffer_size=_READ_BUFFER)


def _parse(serialized):
    ex = tf.io.parse_single_example(serialized, records.feature_spec())
    return {"image": ex["image"], "label": tf.cast(ex["label"], tf.int32), "id": ex["id"]}


class ImagePipeline:
    """Train and eval batches of one prepared split, for this host."""

    # Reduced-scale decoding only for copies whose median shorter side is at least this
    # many times the image size, so that a typical large crop can take the 1/4 scale. The
    # 1/2 scale alone does not pay: entropy decoding, which no scale skips, is two thirds of
    # a decode on the ImageNet sample and a whole 1/2-scale decode is only a little faster;
    # at 128 px on the sample (median shorter side 2.9 x 128) the DCT branches ran at about
    # the rate without them. bench/input_pipeline.py sets it to 0 on one pipeline to measure
    # them.
    DCT_MIN_SIDE = 4

    def __init__(
        self,
        prepared_dir: str,
        split: str,
        *,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        ram_cache: bool = False,
        shuffle_buffer: int = 16384,
        eval_crop_ratio: float = 0.875,
        threads: int | None = None,
        translate: int = 0,
        dct_scaling: bool = True,
    ):
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ConfigError(
                f"process_index {process_index} is not in 0..{process_count - 1} (process_count)"
            )
        self.prepared_dir = prepared_dir
        self.split = split
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.ram_cache = bool(ram_cache)
        self.shuffle_buffer = int(shuffle_buffer)
        self.eval_crop_ratio = float(eval_crop_ratio)
        self.threads = threads
        # Elements decoded at once: one per thread. A fixed number rather than tf.data's
        # autotuning, which starts every new iterator (each epoch and stage is one) at low
        # parallelism and, measured on 2 cores, left a whole 1,000-image epoch on one core
        # about one time in three, at about half the rate. With it off, every epoch ran at
        # full rate.
        self.parallelism = int(threads) if threads else len(os.sched_getaffinity(0))
        self.translate = int(translate)  # train transform: shift by up to this many pixels
        # Reduced-scale JPEG decoding of large crops (transforms.dct_ratio); config.py's
        # data.dct_scaling says what it gains.
        self.dct_scaling = bool(dct_scaling)

        self._load_layout(prepared_dir, split)
        self.num_classes = len(self.classes)
        self.host_examples = self.host_counts[self.process_index]
        self._caches: dict[tuple[str, str], tf.data.Dataset] = {}
        self._fns: dict[tuple, object] = {}  # traced transforms, reused by every epoch

    # ---- layout ------------------------------------------------------------------------

    def _load_layout(self, prepared_dir: str, split: str) -> None:
        """Classes, example counts and each host's share, from the manifest."""
        manifest = records.load_manifest(prepared_dir)
        self.info = records.split_info(manifest, split, prepared_dir)
        self.classes = list(self.info["classes"])
        self.num_examples = int(self.info["num_examples"])
        self.skipped = len(self.info.get("skipped", []))
        self.converted = len(self.info.get("converted", []))
        self.rotated = int(self.info.get("rotated", 0))

        copies = self.info.get("copies") or {}
        if not copies:
            raise ConfigError(
                f"split {split!r} in {prepared_dir!r} lists no copies in its manifest; "
                "prepare it again with `python -m hybridpar.input.prepare`"
            )
        # Every copy holds the same examples in the same shard layout (records.py), so the
        # per-host counts are the same whichever copy an epoch reads; check that they are.
        counts = {name: [int(s["num_examples"]) for s in c["shards"]] for name, c in copies.items()}
        ref_name = "full" if "full" in counts else min(counts)
        ref = counts[ref_name]
        for name, c in counts.items():
            if c != ref:
                raise ConfigError(
                    f"copies {ref_name!r} and {name!r} of split {split!r} in {prepared_dir!r} "
                    "have different shard layouts; prepare the split again"
                )
        if len(ref) < self.process_count:
            raise ConfigError(
                f"split {split!r} in {prepared_dir!r} has {len(ref)} shard files but there are "
                f"{self.process_count} processes; every process needs at least one file: "
                "prepare it again into a new --out with a smaller --examples-per-shard"
            )
        self.host_counts = [sum(ref[p :: self.process_count]) for p in range(self.process_count)]

    def copy_for(self, image_size: int) -> str:
        """The prepared copy that serves ``image_size`` (smallest reduced one, else ``full``)."""
        return records.choose_copy(self.info, int(image_size))

    def files(self, copy: str) -> list[str]:
        """This host's shard files of ``copy``: ``shards[process_index::process_count]``."""
        shards = self.info["copies"][copy]["shards"]
        return [
            os.path.join(self.prepared_dir, s["file"])
            for s in shards[self.process_index :: self.process_count]
        ]

    def _per_host(self, global_batch: int) -> int:
        global_batch = int(global_batch)
        if global_batch < 1 or global_batch % self.process_count:
            raise ConfigError(
                f"global batch {global_batch} does not divide over {self.process_count} "
                "processes; make it a positive multiple of the process count"
            )
        return global_batch // self.process_count

    def steps_per_epoch(self, global_batch: int) -> int:
        """Full global batches per epoch: the same on every host (the smallest host decides)."""
        per = self._per_host(global_batch)
        return min(n // per for n in self.host_counts)

    def eval_steps(self, global_batch: int) -> int:
        """Batches that cover every host's examples (the largest host decides; padded)."""
        per = self._per_host(global_batch)
        return max(math.ceil(n / per) for n in self.host_counts)

    # ---- datasets ----------------------------------------------------------------------

    def _options(self) -> tf.data.Options:
        opts = tf.data.Options()
        opts.deterministic = True
        opts.autotune.enabled = False  # fixed parallelism and buffers: see __init__
        if self.threads:
            opts.threading.private_threadpool_size = int(self.threads)
            opts.threading.max_intra_op_parallelism = 1
        return opts

    def _records(self, copy: str, ordered: bool, cache: bool = True) -> tf.data.Dataset:
        """Parsed records (encoded image bytes) of this host's files of ``copy``.

        ``ordered``: file after file (eval); else files cycled round-robin (train).
        With ``ram_cache`` the dataset is built once per (copy, order) and kept, so its
        in-memory cache outlives epochs and curriculum changes.
        """
        cache = cache and self.ram_cache
        key = (copy, "ordered" if ordered else "cycled")
        if cache and key in self._caches:
            return self._caches[key]
        files = self.files(copy)
        ds = tf.data.Dataset.from_tensor_slices(files)
        # tf.data allows no more parallel reads than files in the cycle.
        cycle = 1 if ordered else min(len(files), _MAX_CYCLE)
        ds = ds.interleave(
            _read,
            cycle_length=cycle,
            block_length=1,
            num_parallel_calls=min(self.parallelism, cycle),
            deterministic=True,
        )
        ds = ds.map(_parse, num_parallel_calls=self.parallelism, deterministic=True)
        if cache:
            ds = ds.cache()
            self._caches[key] = ds
        return ds

    def _shuffle(self, records: tf.data.Dataset, seed) -> tf.data.Dataset:
        """(position, record) pairs of ``records`` in the order of a shuffle seeded ``seed``
        (a Python int or an int64 tensor: the same seed gives the same order either way)."""
        buffer = max(1, min(self.shuffle_buffer, self.host_examples))
        return records.shuffle(buffer, seed=seed, reshuffle_each_iteration=False).enumerate()

    def _epoch_order(self, copy: str, epoch: int, cache: bool = True) -> tf.data.Dataset:
        """(position, record) pairs in this host's training order of ``epoch``."""
        shuffle_seed = _stream_seed(self.seed, epoch, self.process_index, _TAG_SHUFFLE)
        return self._shuffle(self._records(copy, ordered=False, cache=cache), shuffle_seed)

    def train_dataset(
        self,
        epoch: int,
        *,
        image_size: int,
        global_batch: int,
        min_scale: float = 0.08,
        start_step: int = 0,
        steps: int | None = None,
        copy: str | None = None,
    ) -> tf.data.Dataset:
        """The ``tf.data.Dataset`` behind ``train_batches``: ``steps`` batches from step
        ``start_step`` of ``epoch`` on, into the epochs after it (None: to the end of
        ``epoch``).

        One pipeline for all of them: each epoch's shuffle is opened inside it (ahead, while
        the epoch before it is read) rather than as a new pipeline, which waits before its
        first batch (graph build, function instantiation, the first batches in flight
        again), a noticeable part of a 1,000-image epoch. Every batch is the one that
        ``train_batches(its epoch, its step)`` alone gives.

        ``copy`` forces a prepared copy (e.g. ``"full"`` to measure what the reduced copy
        saves); by default the smallest copy that serves ``image_size``.
        """
        per = self._per_host(global_batch)
        spe = self.steps_per_epoch(global_batch)
        if spe == 0:
            raise ConfigError(
                f"global batch {global_batch} ({per} per host) is larger than the "
                f"{min(self.host_counts)} training examples of the smallest host; lower it"
            )
        if not 0 <= start_step <= spe:
            raise ConfigError(f"start_step {start_step} is not in 0..{spe} (steps per epoch)")
        steps = spe - start_step if steps is None else int(steps)
        if steps < 0:
            raise ConfigError(f"steps {steps} is negative")
        # Per epoch read: its shuffle seed, crop key and the positions [begin, end) it gives.
        # Positions (hence crop seeds) are those of an uninterrupted epoch, so resuming at
        # start_step gives the same batches.
        parts, e, first, left = [], int(epoch), int(start_step), steps
        while left > 0 or not parts:
            n = min(spe - first, left)
            parts.append(
                (
                    _stream_seed(self.seed, e, self.process_index, _TAG_SHUFFLE),
                    _stream_seed(self.seed, e, self.process_index, _TAG_AUGMENT),
                    first * per,
                    (first + n) * per,
                )
            )
            e, first, left = e + 1, 0, left - n
        copy = copy or self.copy_for(image_size)
        plan = [tf.constant(column, tf.int64) for column in zip(*parts)]
        return self._stage_fn(copy, int(image_size), per, float(min_scale))(*plan)

    def _stage_fn(self, copy: str, image_size: int, per: int, min_scale: float):
        """``train_dataset``'s pipeline as a ``tf.function`` of its plan (per epoch read: shuffle
        seed, crop key, begin, end), traced once per (copy, size, batch, scale) and kept:
        building it in Python each time an input was opened cost many times what calling
        the traced function does, and delayed the first batch."""
        key = ("stage", copy, image_size, per, min_scale)
        if key in self._fns:
            return self._fns[key]
        records = self._records(copy, ordered=False)
        crop = self._train_fn(image_size, min_scale, copy)

        def epoch_part(shuffle_seed, key, begin, end):
            ds = self._shuffle(records, shuffle_seed).skip(begin)  # skipped before decoding
            if self.ram_cache:
                # A filter still reads the input to its end, which completes the RAM cache.
                ds = ds.filter(lambda pos, ex: pos < end)
            else:
                ds = ds.take(end - begin)
            # The epoch's crop key goes with each element by zip, not a map: a map is one more
            # function call per element (15 us of the pipeline's 60 us per image, 2 cores).
            return tf.data.Dataset.zip(tf.data.Dataset.from_tensors(key).repeat(), ds)

        def transform(key, element):
            pos, ex = element
            return {"image": crop(ex["image"], tf.stack([key, pos])), "label": ex["label"]}

        def build(*plan):
            # One epoch after the other (cycle_length 1, in order), but unlike flat_map each
            # next epoch is opened ahead in the background: its shuffle buffer fills (16,384
            # records read from disk without the RAM cache) while the one before it is read.
            ds = tf.data.Dataset.from_tensor_slices(plan).interleave(
                epoch_part, cycle_length=1, num_parallel_calls=1, deterministic=True
            )
            ds = ds.map(transform, num_parallel_calls=self.parallelism, deterministic=True)
            ds = ds.batch(per, drop_remainder=True)
            return ds.prefetch(_PREFETCH_BATCHES).with_options(self._options())

        # Traced here, not on a first call: TF warns of "retracing" once five closures of
        # this one function have been traced on their first calls (five stage shapes).
        spec = [tf.TensorSpec([None], tf.int64)] * 4
        self._fns[key] = tf.function(build).get_concrete_function(*spec)
        return self._fns[key]

    def decoding_for(self, copy: str, image_size: int) -> dict:
        """How ``copy``'s records decode at ``image_size``: the keywords the transforms get
        (as ``copy_for`` names the copy). ``jpeg_only`` where prepare wrote them all as JPEG
        that TF decodes (no format test per image), and ``dct_scaling`` only where it can pay:
        where the copy's median shorter side is at least ``DCT_MIN_SIDE`` x ``image_size``
        or, for copies prepared without that figure, where its longest side is. Each time an
        input is opened the four-way DCT branch costs a function instantiation."""
        entry = self.info["copies"][copy]
        side = entry.get("median_short_side", entry.get("max_side"))
        return {
            "jpeg_only": entry.get("encoding") == "jpeg",
            "dct_scaling": self.dct_scaling
            and (side is None or side >= self.DCT_MIN_SIDE * image_size),
        }

    def _train_fn(self, image_size: int, min_scale: float, copy: str):
        """The train transform for ``copy``, as a ``tf.function`` traced once per (size,
        scale, decoding) and kept: tracing it (four DCT-scale branches) took longer than
        decoding a 1,000-image epoch's first batches, and every epoch and stage used to
        trace it again."""
        decoding = self.decoding_for(copy, image_size)
        key = ("train", image_size, min_scale, *decoding.values())
        if key not in self._fns:
            spec = (tf.TensorSpec([], tf.string), tf.TensorSpec([2], tf.int64))
            self._fns[key] = tf.function(
                lambda data, seed: train_transform(
                    data,
                    seed,
                    image_size,
                    min_scale=min_scale,
                    translate=self.translate,
                    **decoding,
                ),
                input_signature=spec,
            )
        return self._fns[key]

    def train_batches(self, epoch: int, **kwargs) -> Iterator[dict]:
        """Host-local batches ``start_step..steps_per_epoch-1`` of ``epoch``:
        ``{"image": uint8 [B, S, S, 3], "label": int32 [B]}``, B = global_batch // processes.
        Keyword arguments as for ``train_dataset``.

        Image size, batch and crop scale may differ from call to call (curriculum stages).
        """
        return _drain_ahead(self.train_dataset(epoch, **kwargs), self.gone)

    def eval_dataset(
        self, *, image_size: int, global_batch: int, with_ids: bool = False
    ) -> tf.data.Dataset:
        """The ``tf.data.Dataset`` behind ``eval_batches``."""
        per = self._per_host(global_batch)
        steps = self.eval_steps(global_batch)
        image_size = int(image_size)
        crop_ratio = self.eval_crop_ratio
        copy = self.copy_for(image_size)
        ds = self._records(copy, ordered=True)
        decoding = self.decoding_for(copy, image_size)

        def transform(ex):
            out = {
                "image": eval_transform(ex["image"], image_size, crop_ratio, **decoding),
                "label": ex["label"],
                "mask": tf.constant(1.0, tf.float32),
            }
            if with_ids:
                out["id"] = ex["id"]
            return out

        ds = ds.map(transform, num_parallel_calls=self.parallelism, deterministic=True)
        pad = steps * per - self.host_examples
        if pad:
            blank = {
                "image": tf.zeros([image_size, image_size, 3], tf.uint8),
                "label": tf.constant(0, tf.int32),
                "mask": tf.constant(0.0, tf.float32),
            }
            if with_ids:
                blank["id"] = tf.constant(-1, tf.int64)
            ds = ds.concatenate(tf.data.Dataset.from_tensors(blank).repeat(pad))
        ds = ds.batch(per, drop_remainder=True)
        return ds.prefetch(_PREFETCH_BATCHES).with_options(self._options())

    def eval_batches(
        self, *, image_size: int, global_batch: int, with_ids: bool = False
    ) -> Iterator[dict]:
        """Exactly ``eval_steps`` host-local batches: every example of this host's files once,
        in file order, then padding (zero image, label 0, ``mask`` 0).

        ``with_ids`` adds ``id`` (int64, -1 for padding), for checks.
        """
        ds = self.eval_dataset(image_size=image_size, global_batch=global_batch, with_ids=with_ids)
        return _drain_ahead(ds, self.gone)

    def gone(self, e: Exception) -> DataError:
        """A shard file that went missing while the run read it (removed by hand, or the
        folder prepared again without waiting for the run's reader lock), from tf.data's
        NotFoundError: one error line naming it, where a traceback ended the run. The
        trainer still writes its summary and keeps its checkpoints."""
        copies = self.info["copies"]
        missing = [f for c in copies for f in self.files(c) if not os.path.exists(f)]
        name = missing[0] if missing else " ".join(str(e).split())[:300]
        return DataError(
            f"{name} is gone: the prepared copy in {self.prepared_dir} changed under the run "
            "(removed, or prepared again, while it read it); once the prepared data is back "
            "(put the file back, or prepare the folder again), the same command resumes from "
            "the run's last checkpoint"
        )

    def examples(self, epoch: int) -> Iterator[tuple[int, int]]:
        """This host's ``(id, label)`` pairs in the training order of ``epoch`` (no decoding).

        All of this host's examples; an epoch trains on the first
        ``steps_per_epoch(global_batch) * per_host_batch`` of them.
        """
        # The smallest copy (fewest bytes to read): every copy has the same order.
        ds = self._epoch_order(self.copy_for(0), epoch, cache=False)
        ds = ds.map(lambda pos, ex: (ex["id"], ex["label"]), num_parallel_calls=self.parallelism)
        ds = ds.prefetch(_PREFETCH_BATCHES).with_options(self._options())
        for i, label in ds.as_numpy_iterator():
            yield int(i), int(label)


def _drain_ahead(ds: tf.data.Dataset, gone=None) -> Iterator[dict]:
    """Yields ``ds``'s batches as numpy, reading one batch ahead: the input is at its end when
    the last batch is handed out, so a RAM cache is complete even if the consumer stops
    pulling right after the last batch. ``gone``: a file missing (``tf.errors.NotFoundError``)
    -> the exception raised instead (``ImagePipeline.gone``)."""
    it = ds.as_numpy_iterator()

    def pull():
        try:
            return next(it, None)
        except tf.errors.NotFoundError as e:
            if gone is None:
                raise
            raise gone(e) from None

    prev = pull()
    while prev is not None:
        cur = pull()
        if "label" in prev:
            prev["label"] = prev["label"].astype(np.int32, copy=False)
        yield prev
        prev = cur
