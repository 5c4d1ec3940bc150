"""The prepared on-disk format: sharded TFRecord files plus ``manifest.json``.

``python -m hybridpar.input.prepare`` writes it once; the pipeline reads it every epoch.

Layout::

    OUT/manifest.json
    OUT/SPLIT/COPY/SPLIT-COPY-00000-of-00008.tfrecord

``COPY`` is ``full`` (the original bytes, re-encoded only when they were not a clean RGB or
grayscale JPEG) or ``{max_side}px`` (a reduced copy: longest side at most ``max_side`` px,
re-encoded at ``quality``), MoXing's "training data compression" cache level. A reduced copy
serves the image sizes up to ``serves_up_to`` (= max_side / serve_ratio, so a 160-px copy
serves the 128-px stages), which keeps random-resized crops from upsampling much.

Each record is a ``tf.train.Example`` with ``image`` (JPEG bytes, upright: EXIF orientation
is applied when preparing), ``label`` (int64, index into the dataset's one class list),
``id`` (int64, the example's index in the split's sorted file list: unique, so tests can
check every example is read once) and ``name`` (the file's path relative to the split folder,
its bytes as on disk, which need not be UTF-8).

The class list is one per dataset: the train split's class folders (or a list given when
preparing), stored once at the top of the manifest (and repeated in each split entry); every
other split maps its folders into it by name, so a validation folder lacking a class keeps
the train split's labels. ``classes_from``: the split whose class folders the list is (null:
a given list), so a run asking for another list prepares again. ``fingerprint`` records the
source as it was prepared (a tar's size and modification time; a folder's file names, sizes
and times, digested per class), so a changed source is noticed
(``prepare.source_fingerprint`` / ``describe_change``). ``ignored``: files that may be images
but are not read (in a folder inside a class folder, another extension, a link in a tar).

``manifest.json``::

    {"format": "hybridpar-tfrecord-v2", "classes": ["airplane", ...], "classes_from": "train",
     "splits": {"train": {
        "source": "/data/train.tar", "classes": ["airplane", ...], "num_examples": 50000,
        "num_files": 50000,
        "fingerprint": {"kind": "tar", "path": "/data/train.tar", "size": 77240320,
                        "mtime_ns": 1764592320000000000},
        "skipped": [{"name": "cat/12.jpg", "reason": "truncated JPEG"}, ...],
        "converted": [{"name": "dog/3.jpg", "reason": "PNG content"}, ...],
        "rotated": 0, "empty_folders": [], "classes_without_examples": {},
        "ignored": [{"name": "dog/sub/4.jpg", "reason": "in a folder inside ..."}, ...],
        "copies": {"full": {"max_side": null, "quality": null, "serves_up_to": null,
                            "encoding": "jpeg", "median_short_side": 375,
                            "shards": [{"file": "train/full/train-full-00000-of-00049.tfrecord",
                                        "num_examples": 1024}, ...]},
                   "160px": {"max_side": 160, "quality": 90, "serves_up_to": 128,
                             "encoding": "jpeg", "shards": [...]}}}}}

``encoding`` ``"jpeg"``: every record of the copy is a JPEG that TensorFlow decodes (prepare
checks), so the pipeline skips the per-image format test; a copy without it (written by an
older hybridpar, or by hand) may hold PNG, GIF or BMP records, which decode more slowly.
``median_short_side``: the median of the images' shorter sides in this copy; the pipeline
decodes at reduced DCT scales only for image sizes up to a quarter of it (where they pay).

Shard ``i`` of every copy holds the same examples in the same order, so the copies are
interchangeable at any epoch.
"""

from __future__ import annotations

import json
import os

from hybridpar.config.errors import DataError

FORMAT = "hybridpar-tfrecord-v2"
# v1 numbered each split's own sorted class list, so labels could disagree between splits.
OLD_FORMATS = ("hybridpar-tfrecord-v1",)
MANIFEST = "manifest.json"


def feature_spec():
    import tensorflow as tf

    return {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.int64),
        "name": tf.io.FixedLenFeature([], tf.string, default_value=""),
    }


def encode_example(image: bytes, label: int, example_id: int, name: str) -> bytes:
    """One serialized ``tf.train.Example`` (used by prepare and by tests)."""
    import tensorflow as tf

    f = tf.train.Feature
    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "image": f(bytes_list=tf.train.BytesList(value=[image])),
                "label": f(int64_list=tf.train.Int64List(value=[label])),
                "id": f(int64_list=tf.train.Int64List(value=[example_id])),
                # a file name that is not UTF-8 keeps its own bytes (listing decodes names
                # with surrogateescape)
                "name": f(bytes_list=tf.train.BytesList(value=[os.fsencode(name)])),
            }
        )
    ).SerializeToString()


def copy_name(max_side: int | None) -> str:
    return "full" if max_side is None else f"{max_side}px"


def load_manifest(prepared_dir: str) -> dict:
    path = os.path.join(prepared_dir, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(
            f"no prepared data in {prepared_dir!r} (missing {MANIFEST}); prepare it once with "
            f"`python -m hybridpar.input.prepare SOURCE --out {prepared_dir}` where SOURCE is a "
            "tar or folder in the SPLIT/CLASS/FILE layout"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path} is unreadable or corrupt ({e}); delete it and run "
            "`python -m hybridpar.input.prepare` again (finished shards are kept)"
        ) from None
    if manifest.get("format") in OLD_FORMATS:
        raise DataError(
            f"{path} was written by an older hybridpar ({manifest['format']}: each split numbered "
            "its own classes, so labels could disagree between splits); prepare it again: give "
            "the sources as data.source (the run re-prepares them), or run "
            f"`python -m hybridpar.input.prepare SOURCE --out {prepared_dir}`"
        )
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def split_info(manifest: dict, split: str, prepared_dir: str) -> dict:
    splits = manifest.get("splits", {})
    if split not in splits:
        raise DataError(
            f"split {split!r} is not prepared in {prepared_dir!r}, which has {sorted(splits)}: "
            "name one of those (in a training config: data.train_split / data.eval_split), or "
            f"add the folder {split}/CLASS/FILE to a source and prepare it "
            f"(`python -m hybridpar.input.prepare SOURCE --out {prepared_dir}`)"
        )
    info = dict(splits[split])
    if manifest.get("classes"):  # one class list for the dataset (v2); every split indexes it
        info["classes"] = list(manifest["classes"])
    if info.get("num_examples", 0) == 0:
        raise DataError(
            f"split {split!r} in {prepared_dir!r} has no examples (source {info.get('source')!r} "
            "held no readable images in SPLIT/CLASS/FILE layout); check the source and prepare "
            "again"
        )
    return info


def choose_copy(info: dict, image_size: int) -> str:
    """The smallest copy that serves ``image_size``; ``full`` when none does."""
    best, best_side = "full", None
    for name, copy in info["copies"].items():
        up_to = copy.get("serves_up_to")
        if up_to is not None and image_size <= up_to:
            if best_side is None or copy["max_side"] < best_side:
                best, best_side = name, copy["max_side"]
    if best not in info["copies"]:
        raise DataError(
            f"no prepared copy serves image size {image_size} and there is no full-size copy; "
            "prepare again with the full copy (--copies full,...)"
        )
    return best
