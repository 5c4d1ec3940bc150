"""One entry point from the ``data`` config section to host-local batches.

``make_data(config, process_index, process_count)`` returns a ``Data``: train batches per
epoch, eval batches, steps per epoch and facts for the run's records. The kinds:

* ``digits``, ``synthetic``: in memory (``arrays.py``), no download, no TensorFlow.
* ``images``: tars or folders in the SPLIT/CLASS/FILE layout, prepared once into TFRecords
  (``prepare.py``) and read by the tf.data pipeline (``pipeline.py``).
* ``tfds``: a tensorflow-datasets dataset, read by the same pipeline.

With ``data.on_device`` (digits, synthetic, images), ``on_device.py`` holds the whole set on
every device and its batches are global arrays already on the mesh, made by a jitted step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
from typing import Callable, Iterator

from hybridpar.config.errors import ClassCountError, ConfigError, DataError
from hybridpar.input import arrays


@dataclasses.dataclass
class Data:
    # (epoch, start_step=0, *, steps=None, global_batch=, image_size=, min_scale=) -> host
    # batches: ``steps`` of them from that position on, into the next epochs (None: to the
    # end of the epoch); the other keywords are a curriculum stage's (default: the config's)
    train_batches: Callable[..., Iterator[dict]]
    eval_batches: Callable[[], Iterator[dict]]  # at data.image_size, every example once
    steps_per_epoch: int  # at the config's global_batch
    num_eval: int
    image_shape: tuple[int, int, int]
    info: dict  # recorded as the run's "data" event
    # global batch -> full steps in an epoch at that batch (for a curriculum's stage plan)
    steps_for: Callable[[int], int] | None = None


@dataclasses.dataclass(frozen=True)
class EpochSteps:
    """``Data.steps_for`` of a set read whole each epoch: global batch -> the full steps an
    epoch of ``num_examples`` holds. The last partial batch is left out (fixed shapes); the
    plan's description (``curriculum.describe``) says how many examples that leaves out."""

    steps: Callable[[int], int]
    num_examples: int

    def __call__(self, global_batch: int) -> int:
        return self.steps(global_batch)


def make_data(c, pi: int, pc: int, mesh=None, stage_sizes: list[int] | None = None) -> Data:
    """``mesh``: the run's, where the on-device set is placed (None: ``c.mesh`` over every
    device); the host pipelines only slice by process. ``stage_sizes``: the image sizes of
    the run's planned stages, at which an on-device set is stored (None: read from
    ``c.stages``)."""
    d = c.data
    shape = (d.image_size, d.image_size, d.channels)
    if d.on_device:  # global batches made on the devices: no process slices, no TensorFlow
        from hybridpar.input import on_device

        return on_device.make_data(c, mesh, stage_sizes)
    if d.name in ("digits", "synthetic"):
        return _in_memory(c, pi, pc, shape)
    if d.name in ("images", "tfds"):
        if d.channels != 3:
            raise ConfigError(f"data.name={d.name} decodes RGB images: set data.channels=3")
        return _pipeline(c, pi, pc, shape, stage_sizes)
    raise ConfigError(f"data.name={d.name!r}: use 'digits', 'synthetic', 'images' or 'tfds'")


def _in_memory(c, pi, pc, shape) -> Data:
    d = c.data
    if d.name == "digits":
        arrays.check_digits_config(d)
        train, test = arrays.load_digits(d.image_size)
        spe = arrays.steps_per_epoch(train, c.global_batch)
        steps_for = EpochSteps(
            functools.partial(arrays.steps_per_epoch, train), len(train["label"])
        )
    else:  # a pool of random images stands in for an epoch of train_examples
        pool = min(d.train_examples, 4 * c.global_batch)
        train = arrays.synthetic(pool, d.image_size, d.num_classes, c.seed, d.channels)
        test = arrays.synthetic(
            min(d.eval_examples, 2 * c.eval_batch),
            d.image_size,
            d.num_classes,
            c.seed + 1,
            d.channels,
        )
        spe = max(d.train_examples // c.global_batch, 1)

        def steps_for(batch):
            return max(d.train_examples // batch, 1)

    pools = {(d.image_size, c.global_batch): train}

    def train_batches(epoch, start_step=0, *, steps=None, global_batch=None, **kw):
        per_epoch = steps_for(global_batch or c.global_batch)
        left = per_epoch - start_step if steps is None else steps
        while left > 0:  # epoch after epoch, as the tf.data pipeline spans them
            n = min(per_epoch - start_step, left)
            yield from itertools.islice(
                epoch_batches(epoch, start_step, global_batch=global_batch, **kw), n
            )
            epoch, start_step, left = epoch + 1, 0, left - n

    def epoch_batches(epoch, start_step=0, *, global_batch=None, image_size=None, **_):
        batch, size = global_batch or c.global_batch, image_size or d.image_size
        key = (size, batch)
        if key not in pools:  # a stage at another size or batch: the examples resized
            pools[key] = (
                arrays.load_digits(size)[0]
                if d.name == "digits"
                else arrays.synthetic(
                    min(d.train_examples, 4 * batch), size, d.num_classes, c.seed, d.channels
                )
            )
        examples = pools[key]
        steps = steps_for(batch)
        done, cycle = 0, 0
        while done < steps:  # the synthetic pool is cycled to make a nominal epoch
            for b in arrays.train_batches(examples, batch, c.seed, epoch * 1000 + cycle, pi, pc):
                if done == steps:
                    return
                if done >= start_step:
                    yield b
                done += 1
            cycle += 1

    return Data(
        train_batches,
        lambda: arrays.eval_batches(test, c.eval_batch, pi, pc),
        spe,
        len(test["label"]),
        shape,
        {
            "source": d.name,
            "train_examples": len(train["label"]),
            "eval_examples": len(test["label"]),
        },
        steps_for,
    )


def cache_root() -> str:
    """The folder of the default caches: ``$HYBRIDPAR_CACHE`` (``~`` expanded: a literal
    ``~`` made a folder named ``~`` in the working directory), else ``~/.cache/hybridpar``
    (also where it is set but empty); absolute, so a later ``cd`` does not move it."""
    root = os.environ.get("HYBRIDPAR_CACHE") or os.path.join("~", ".cache", "hybridpar")
    return os.path.abspath(os.path.expanduser(root))


def default_prepared_dir(sources: list[str]) -> str:
    """``cache_root()/<names>-<hash of the absolute paths>``: one cache per source set."""
    key = hashlib.sha1("\n".join(os.path.abspath(s) for s in sources).encode()).hexdigest()[:10]
    names = "-".join(os.path.basename(s.rstrip("/")).split(".")[0] for s in sources)[:60]
    return os.path.join(cache_root(), f"{names}-{key}")


def cache_fix(d) -> str:
    """For ``prepare.FolderLock``'s error where the prepared data goes to the default cache
    (no data.prepared_dir): where its path came from (HYBRIDPAR_CACHE), not prepare's
    ``--out``, which the run was not given ('' with a data.prepared_dir: --out's words)."""
    if d.prepared_dir:
        return ""
    env = os.environ.get("HYBRIDPAR_CACHE")
    came = f"HYBRIDPAR_CACHE={env!r}" if env else "the default (HYBRIDPAR_CACHE unset)"
    return (
        f"the prepared data goes to the cache in {cache_root()}, from {came}; point "
        "HYBRIDPAR_CACHE (or --config.data.prepared_dir) at a folder you can write"
    )


def data_paths(d) -> tuple[list[str], str]:
    """The ``data`` section's sources and prepared folder (``~`` expanded; the default cache
    where ``prepared_dir`` is unset; '' where neither is set): read here only. An empty
    split name is refused here, on both paths: it would name the source's own folder."""
    if not d.train_split.strip():
        raise ConfigError("data.train_split is empty: set --config.data.train_split=train "
                          "(the split folder to train on)")  # fmt: skip
    if not d.eval_split.strip():  # the trainer evaluates after the last step in any case
        raise ConfigError(
            "data.eval_split is empty, but a run needs an eval split (it evaluates after its "
            "last step, also with eval_every_epochs=0); with only train/, move some images "
            "of each class to val/CLASS/ beside train/ (or into another folder's val/CLASS/, "
            "added as --config.data.source=PATH,OTHER) and set --config.data.eval_split=val"
        )
    sources = [os.path.expanduser(s.strip()) for s in d.source.split(",") if s.strip()]
    prepared = os.path.expanduser(d.prepared_dir) if d.prepared_dir else ""
    return sources, prepared or (default_prepared_dir(sources) if sources else "")


def _pipeline(c, pi, pc, shape, stage_sizes=None) -> Data:
    from hybridpar.input.pipeline import ImagePipeline

    d = c.data
    common = dict(
        seed=c.seed,
        process_index=pi,
        process_count=pc,
        ram_cache=d.ram_cache,
        shuffle_buffer=d.shuffle_buffer,
        eval_crop_ratio=d.eval_crop_ratio,
        threads=d.threads or None,
        translate=d.translate,
        dct_scaling=d.dct_scaling,
    )
    if d.name == "images":
        prepared = ensure_prepared(d, hold=True)
        train = ImagePipeline(prepared, d.train_split, **common)
        test = ImagePipeline(prepared, d.eval_split, **common)
    else:
        from hybridpar.input.tfds_source import TfdsPipeline

        kw = dict(data_dir=d.tfds_data_dir or None, manual_dir=d.tfds_manual_dir or None)
        train = TfdsPipeline(d.tfds_name, d.train_split, **kw, **common)
        test = TfdsPipeline(d.tfds_name, d.eval_split, **kw, **common)
    if train.num_classes != d.num_classes:
        raise ClassCountError(
            f"the data has {train.num_classes} classes but data.num_classes={d.num_classes}; "
            f"set --config.data.num_classes={train.num_classes}",
            train.classes,
        )
    spe = train.steps_per_epoch(c.global_batch)
    if spe == 0:
        raise DataError(
            f"split {d.train_split!r} has {train.num_examples} examples, fewer than one global "
            f"batch of {c.global_batch} per epoch; lower global_batch"
        )

    def train_batches(
        epoch, start_step=0, *, steps=None, global_batch=None, image_size=None, min_scale=None
    ):
        return train.train_batches(
            epoch,
            image_size=image_size or d.image_size,
            global_batch=global_batch or c.global_batch,
            min_scale=d.min_scale if min_scale is None else min_scale,
            start_step=start_step,
            steps=steps,
        )

    def eval_batches():
        return test.eval_batches(image_size=d.image_size, global_batch=c.eval_batch)

    info = {
        "source": d.source or d.tfds_name,
        "train_split": d.train_split,
        "eval_split": d.eval_split,
        "train_examples": train.num_examples,
        "eval_examples": test.num_examples,
        "num_classes": train.num_classes,
        "classes": list(train.classes),  # the label -> name mapping, kept with the run
    }
    entries = {}
    for split, pipe in ((d.train_split, train), (d.eval_split, test)):
        entries[split] = pipe.info if d.name == "images" else {"num_examples": pipe.num_examples}
    info.update(split_counts(entries))
    if d.name == "images":
        info["train_fingerprint"] = files_digest(train.info)
        if pi == 0:
            print(classes_line(train.classes), flush=True)
            from hybridpar.input.on_device import image_sizes

            full = train.info.get("copies", {}).get("full", {})
            said = upsampling_line(full.get("median_short_side"), image_sizes(c, stage_sizes))
            if said:
                print(said, flush=True)
    steps_for = EpochSteps(train.steps_per_epoch, train.num_examples)
    return Data(train_batches, eval_batches, spe, test.num_examples, shape, info, steps_for)


def upsampling_line(median_side: int | None, sizes: list[int]) -> str | None:
    """A warning where the largest image size is at least twice the training images' median
    shorter side (prepare's ``median_short_side``): every image is upsampled that much, which
    costs time and adds no detail. None where it is not, or the side is not known."""
    if not median_side or max(sizes) < 2 * median_side:
        return None
    top = max(sizes)
    return (
        f"warning: image size {top} px is {top / median_side:.1f}x the training images' median "
        f"shorter side ({median_side} px): each is upsampled that much, which costs time and "
        f"adds no detail; a size near {median_side} px (data.image_size, or the stages') "
        "learns from the same pixels in less time"
    )


def split_counts(entries: dict) -> dict:
    """The ``data`` event's counts, on both paths: per split (each split once, also when the
    eval split is the train split), from ``{split: its manifest entry}`` (or an on-device
    cache's record, which has the same keys), and totals over those."""
    splits = {}
    for name, e in entries.items():
        splits[name] = {
            "examples": int(e.get("num_examples", 0)),
            "skipped": len(e.get("skipped", [])),
            "converted": len(e.get("converted", [])),
            "rotated": int(e.get("rotated", 0)),
            "ignored": len(e.get("ignored", [])),
            "empty_folders": list(e.get("empty_folders", [])),
            "classes_without_examples": sorted(e.get("classes_without_examples", {})),
        }
    keys = ("skipped", "converted", "rotated", "ignored")
    totals = {k: sum(s[k] for s in splits.values()) for k in keys}
    return totals | {"splits": splits}


def classes_line(classes) -> str:
    """Which class folder became which label, said at set-up (else only in the records)."""
    shown = ", ".join(f"{i} {c}" for i, c in enumerate(classes[:10]))
    more = f", ... ({len(classes)} classes)" if len(classes) > 10 else ""
    return f"classes (label order): {shown}{more}"


def files_digest(entry: dict) -> str | None:
    """A short digest of the files a split was read from (a manifest entry's or an on-device
    cache record's ``fingerprint``: names, sizes and times; a tar's size and time), so that
    a resume can tell other files of the same count; not the path, which a move changes.
    None without a fingerprint."""
    from hybridpar.input import prepare as prep

    fp = entry.get("fingerprint")
    if not fp:
        return None
    return prep.fingerprint_digest({k: v for k, v in fp.items() if k != "path"})


# The runs of this process that read a prepared folder (``ensure_prepared(hold=True)``): their
# reader locks, held until the process ends (a Data has no close; the exit, an os._exit too,
# releases a flock), so a prepare of the folder elsewhere refuses to pull its shards away.
READING: list = []


def ensure_prepared(d, hold: bool = False) -> str:
    """The prepared directory of the ``data`` config section ``d`` (``data.name=images``),
    preparing the sources first if they are not yet, or again if they changed since; with
    only ``prepared_dir``, a changed source is an error. Safe to call from several processes
    at once (one prepares, the others wait), and what ``make_data`` calls, so calling it
    first (say, once before a multi-host launch) prepares the data the run then reuses.
    ``hold``: this process reads the folder from here on: it takes the folder's reader lock
    (``prepare.hold_readers``) for the life of the process, before the prepare lock is given
    back, so no prepare of it gets in between the check and the run's reads."""
    sources, prepared = data_paths(d)
    if not prepared:
        raise ConfigError(
            "data.name=images needs data.source (tars or folders in SPLIT/CLASS/FILE layout) "
            "or data.prepared_dir (the output of `python -m hybridpar.input.prepare`)"
        )
    wanted = [d.train_split] + ([d.eval_split] if d.eval_split != d.train_split else [])
    for s in sources:  # before a lock or a folder is made for them in the cache
        if not os.path.exists(s):
            # a config file's default source stays set beside a prepared_dir given alone
            alone = (
                f", or --config.data.source= (empty) to train from data.prepared_dir="
                f"{d.prepared_dir!r} alone"
                if d.prepared_dir
                else ""
            )
            raise DataError(
                f"data.source {os.path.abspath(s)!r} does not exist; set --config.data.source="
                "PATH[,PATH] to your tars or folders (the experiments' defaults are under "
                f"$HYBRIDPAR_DATA){alone}"
            )
    if sources:
        from hybridpar.input import prepare as prep

        prep.check_out(prepared, sources, "data.prepared_dir")  # before its lock is made
        # Several processes of a run (one per GPU of a host) reach this at once: one
        # prepares, the others wait and then find it prepared (the check is under the lock
        # too), instead of all writing the same shards.
        new = not os.path.exists(prepared)
        try:
            with prep.FolderLock(prepared, cache_fix(d)):
                _check_prepared(d, prepared, sources, wanted)
                if hold:
                    READING.append(prep.hold_readers(prepared))
                return prepared
        except ConfigError:
            if new:  # a first use that failed (a wrong source): leave no empty cache behind
                prep.remove_if_unused(prepared)
            raise
    if not hold:
        return _check_prepared(d, prepared, sources, wanted)
    from hybridpar.input import prepare as prep

    readers = prep.hold_readers(prepared)  # a prepared folder alone (maybe read-only): before
    try:  # it is checked and read
        _check_prepared(d, prepared, sources, wanted)
    except BaseException:
        readers.release()
        raise
    READING.append(readers)
    return prepared


def _check_prepared(d, prepared: str, sources: list[str], wanted: list[str]) -> str:
    from hybridpar.input import prepare as prep
    from hybridpar.input import records

    manifest, stale = None, ""
    if os.path.isfile(os.path.join(prepared, records.MANIFEST)):
        try:
            manifest = records.load_manifest(prepared)
        except ConfigError:
            if not sources:
                raise
    if sources:
        classes = prep.parse_classes(d.classes)
        stale = _stale(manifest, wanted, sources) if manifest else "not prepared yet"
        if not stale:  # labels follow the class list: another list needs other labels
            stale = prep.class_list_stale(manifest, classes, d.train_split)
        if stale:
            copies = (None,) + tuple(int(x) for x in str(d.reduced_copies).split(",") if x.strip())
            print(
                f"preparing {', '.join(sources)} into {prepared} ({stale}; later runs reuse it)",
                flush=True,
            )
            manifest = prep.prepare(
                sources,
                prepared,
                copies=copies,
                quality=d.reduced_quality,
                train_split=d.train_split,
                classes=classes,
                allow_empty_classes=d.allow_empty_classes,
                needed={"train_split": d.train_split, "eval_split": d.eval_split},
                for_run=True,
            )
    elif manifest:
        for split in wanted:
            entry = manifest["splits"].get(split) or {}
            fp = entry.get("fingerprint")
            if fp and os.path.exists(fp["path"]):  # a moved or remote source cannot be checked
                change = prep.describe_change(fp, prep.source_fingerprint(fp))
                if change:
                    raise DataError(
                        f"split {split!r} in data.prepared_dir={prepared!r} is out of date: "
                        f"{change} since it was prepared; set data.source={entry['source']!r} "
                        "to prepare it again (or run `python -m hybridpar.input.prepare`)"
                    )
    if manifest and sources:
        for key, split in (("train_split", d.train_split), ("eval_split", d.eval_split)):
            if split not in manifest["splits"]:
                paths = [os.path.abspath(s) for s in sources]
                raise prep.missing_split_error(key, split, paths, manifest["splits"])
    if manifest and not (sources and stale):  # reused as it was: say which copy
        have = manifest["splits"]
        counts = ", ".join(f"{s} {have[s]['num_examples']:,}" for s in wanted if s in have)
        print(f"reusing the prepared copy in {prepared} ({counts} examples)", flush=True)
    return prepared


def _stale(manifest: dict, splits: list[str], sources: list[str]) -> str:
    """Why the prepared copy cannot serve ``splits`` of ``sources`` as they are now ('' if
    it can): a split missing, prepared from elsewhere, or a source changed since."""
    from hybridpar.input import prepare as prep

    have = manifest["splits"]
    missing = [s for s in splits if s not in have]
    if missing:
        return f"split(s) {missing} not prepared yet"
    paths = {os.path.abspath(s) for s in sources}
    for split in splits:
        entry = have[split]
        fp = entry.get("fingerprint")
        if entry.get("source") not in paths or not fp:
            return f"split {split!r} was prepared from {entry.get('source')!r}"
        try:
            change = prep.describe_change(fp, prep.source_fingerprint(fp))
        except ConfigError as e:
            return f"its source cannot be checked ({e})"
        if change:  # prepare says what changed, split by split
            return "its source changed"
    return ""
