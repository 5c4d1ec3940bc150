"""A tensorflow-datasets dataset through the same pipeline as prepared records.

``TfdsPipeline(name, split, ...)`` reads an already built tfds dataset (by name and
``data_dir``, or a builder directory), or builds it from manually downloaded files
(``manual_dir``, as ``imagenet2012`` needs; nothing is downloaded). Images stay encoded
(``tfds.decode.SkipDecoding``) so the train transform can fuse the crop into JPEG decoding.
Each process reads its own even slice of the split (``tfds.even_splits``).
"""

from __future__ import annotations

import os
import statistics

import tensorflow as tf
import tensorflow_datasets as tfds

from hybridpar.config.errors import ConfigError
from hybridpar.input.pipeline import ImagePipeline

_SIDE_SAMPLE = 256  # images whose shorter sides estimate the split's median


def _builder(name: str, data_dir: str | None, manual_dir: str | None):
    try:
        if os.path.isdir(name):  # a builder directory written by tfds
            return tfds.builder_from_directory(name)
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises many types for unknown names or broken dirs
        raise ConfigError(
            f"tfds dataset {name!r} could not be opened ({type(e).__name__}: {e}); check "
            "data.tfds_name and data.tfds_data_dir"
        ) from None
    if not builder.is_prepared():
        if not manual_dir:
            raise ConfigError(
                f"tfds dataset {name!r} is not built in {builder.data_dir!r} and nothing may be "
                "downloaded here: build it once elsewhere, or set data.tfds_manual_dir to the "
                "downloaded files (e.g. the imagenet2012 tars) to build it from them"
            )
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir)
        )
    return builder


class TfdsPipeline(ImagePipeline):
    """``ImagePipeline`` whose records come from a tfds split instead of prepared shards."""

    def __init__(self, name: str, split: str, *, data_dir=None, manual_dir=None, **kwargs):
        self.builder = _builder(name, data_dir, manual_dir)
        info = self.builder.info
        if split not in info.splits:
            raise ConfigError(
                f"tfds dataset {name!r} has no split {split!r}; it has {sorted(info.splits)}"
            )
        for key in ("image", "label"):
            if key not in info.features:
                raise ConfigError(
                    f"tfds dataset {name!r} has no {key!r} feature; image "
                    "classification datasets have 'image' and 'label'"
                )
        super().__init__(name, split, **kwargs)

    def _load_layout(self, name: str, split: str) -> None:
        # Each process reads one even slice of the split; the slices' sizes are exact.
        info = self.builder.info
        self.host_splits = tfds.even_splits(split, n=self.process_count)
        self.host_counts = [info.splits[s].num_examples for s in self.host_splits]
        self.classes = list(info.features["label"].names)
        self.num_examples = sum(self.host_counts)
        self.skipped = self.converted = self.rotated = 0
        median = self._median_short_side(split)
        full = {"max_side": None, "serves_up_to": None, "median_short_side": median}
        self.info = {"copies": {"full": full}}

    def _median_short_side(self, split: str) -> int | None:
        """The median shorter side of the split's first ``_SIDE_SAMPLE`` images (headers
        only for JPEG; the same images on every host, so all hosts decode alike), standing
        in for the figure prepare records for its copies: the pipeline decodes at reduced
        DCT scales only where it is at least ``DCT_MIN_SIDE`` x the image size. None
        (reduced scales allowed) for a split with no examples."""
        ds = self.builder.as_dataset(
            split=split,
            decoders={"image": tfds.decode.SkipDecoding()},
            shuffle_files=False,
        ).take(_SIDE_SAMPLE)

        def short_side(ex):
            data = ex["image"]
            shape = tf.cond(
                tf.io.is_jpeg(data),
                lambda: tf.image.extract_jpeg_shape(data),
                lambda: tf.shape(tf.io.decode_image(data, expand_animations=False)),
            )
            return tf.minimum(shape[0], shape[1])

        sides = [int(x) for x in ds.map(short_side).as_numpy_iterator()]
        return int(statistics.median(sides)) if sides else None

    def _records(self, copy: str, ordered: bool, cache: bool = True) -> tf.data.Dataset:
        cache = cache and self.ram_cache
        if cache and copy in self._caches:
            return self._caches[copy]
        ds = self.builder.as_dataset(
            split=self.host_splits[self.process_index],
            decoders={"image": tfds.decode.SkipDecoding()},
            shuffle_files=False,
            read_config=tfds.ReadConfig(interleave_cycle_length=1 if ordered else 16),
        )
        ds = ds.enumerate().map(
            lambda i, ex: {"image": ex["image"], "label": tf.cast(ex["label"], tf.int32), "id": i},
            num_parallel_calls=self.parallelism,
            deterministic=True,
        )
        if cache:
            ds = ds.cache()
            self._caches[copy] = ds
        return ds
