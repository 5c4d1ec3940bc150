"""Prepare image folders or tar archives (SPLIT/CLASS/FILE) once into the sharded format.

    python -m hybridpar.input.prepare SOURCE [SOURCE ...] --out DIR [--copies full,160]

The format (layout, record features, manifest.json) is defined in ``records.py``. Each pool
task writes one whole shard of every copy, deciding once per image whether it is kept, so
shard i of every copy holds the same examples in the same order. Shard files are written as
FILE.tmp and renamed, then a small JSON sidecar per shard records its counts: a rerun of the
same command reuses finished shards, and an interrupted run never leaves a half shard.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing
import os
import posixpath
import shutil
import sys
import tarfile
import tempfile
import time
import warnings

from hybridpar.errors import ConfigError
from hybridpar.input.records import FORMAT, MANIFEST, copy_name, encode_example, load_manifest

# Decided by content, not name; the name only tells images from junk such as README.txt.
IMAGE_EXTS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
MAX_PIXELS = 200_000_000  # above this an image is more likely a decompression bomb than a photo
FULL_QUALITY = 95  # for full-copy images that had to be re-encoded: keep them near-lossless
LAYOUT = (
    "the SPLIT/CLASS/FILE layout (e.g. train/n01440764/n01440764_10026.JPEG), "
    "or CLASS/FILE with --split NAME"
)


# ---- listing sources ------------------------------------------------------------------------


def _wanted(parts: list[str], depth: int) -> bool:
    if len(parts) != depth or any(p.startswith(".") or p == "__MACOSX" for p in parts):
        return False
    return os.path.splitext(parts[-1])[1].lower() in IMAGE_EXTS


def _list_tar(path: str, depth: int, staging_dir: str, staging: list) -> list:
    """Regular members as (parts, file, offset, size), read once here so workers can seek.

    A compressed tar cannot be seeked cheaply, so it is streamed once into an uncompressed
    staging file in --out (removed at the end) and indexed there instead.
    """
    try:
        tar, compressed = tarfile.open(path, "r:"), False
    except tarfile.ReadError:
        try:
            tar, compressed = tarfile.open(path, "r:*"), True
        except (tarfile.ReadError, EOFError, OSError) as e:
            raise ConfigError(f"source {path!r} is neither a folder nor a tar archive ({e})")
    entries, out_file, data_file = [], None, path
    if compressed:
        data_file = os.path.join(staging_dir, f".staging-{len(staging)}-{os.path.basename(path)}")
        staging.append(data_file)
        out_file = open(data_file, "wb")
    with tar:
        while (m := tar.next()) is not None:
            tar.members = []  # tarfile keeps every header otherwise: too much for 1.28M files
            parts = [p for p in posixpath.normpath(m.name).split("/") if p not in ("", ".")]
            if not m.isreg() or not _wanted(parts, depth):
                continue
            if out_file is None:
                entries.append((parts, data_file, m.offset_data, m.size))
            else:
                entries.append((parts, data_file, out_file.tell(), m.size))
                shutil.copyfileobj(tar.extractfile(m), out_file)
    if out_file is not None:
        out_file.close()
    return entries


def list_source(source: str, split: str | None = None, staging_dir=None, staging=None):
    """``{split: [(name, class, file, offset, size), ...]}``, each list sorted by name.

    ``name`` is the path relative to the split folder; ``size`` -1 means the whole file.
    With ``split``, the source itself is one split (CLASS/FILE). A compressed tar is
    unpacked into a staging file in ``staging_dir`` (default: the temp dir), whose path is
    appended to ``staging``: the caller removes it when done.
    """
    source = os.path.abspath(source)
    if not os.path.exists(source):
        raise ConfigError(f"source {source!r} does not exist")
    depth = 2 if split else 3
    if os.path.isdir(source):
        entries = []
        for root, dirs, files in os.walk(source, followlinks=True):
            rel = os.path.relpath(root, source)
            parts = [] if rel == "." else rel.split(os.sep)
            deeper = len(parts) < depth - 1  # below class folders nothing is read
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if deeper else []
            if len(parts) == depth - 1:
                entries += [(parts + [f], os.path.join(root, f), 0, -1) for f in files]
        entries = [e for e in entries if _wanted(e[0], depth)]
    else:
        staging_dir = staging_dir or tempfile.gettempdir()
        entries = _list_tar(source, depth, staging_dir, [] if staging is None else staging)
    splits: dict[str, dict] = {}
    for parts, file, offset, size in entries:
        parts = [split, *parts] if split else parts
        name = f"{parts[1]}/{parts[2]}"  # a name repeated in a tar: the later member wins
        splits.setdefault(parts[0], {})[name] = (name, parts[1], file, offset, size)
    if not splits:
        raise ConfigError(f"no images found in {source!r}: expected {LAYOUT}")
    return {s: [files[n] for n in sorted(files)] for s, files in splits.items()}


# ---- one shard (runs in a worker process) ---------------------------------------------------


def _read(handles: dict, file: str, offset: int, size: int) -> bytes:
    if size < 0:
        with open(file, "rb") as f:
            return f.read()
    if file not in handles:  # one handle per archive per task, not one per member
        handles[file] = open(file, "rb")
    handles[file].seek(offset)
    return handles[file].read(size)


def _jpeg(img, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _check(data: bytes):
    """(image, full-copy bytes, reason): reason says why it was converted, or why skipped
    when image is None. Reasons must not vary between runs (the manifest is compared)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        return None, None, "empty file"
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            return None, None, f"over {MAX_PIXELS:,} pixels (decompression bomb guard)"
        img.load()  # decodes everything, so truncated data fails here, not in training
    except UnidentifiedImageError:
        return None, None, "not an image (unknown format)"
    except Image.DecompressionBombError:
        return None, None, f"over {MAX_PIXELS:,} pixels (decompression bomb guard)"
    except Exception as e:  # PIL raises many types for corrupt data
        if "truncated" in str(e):
            return None, None, "truncated image"
        return None, None, f"undecodable ({type(e).__name__}: {str(e)[:200]})"
    if img.format == "JPEG" and img.mode in ("RGB", "L"):
        # The training pipeline decodes with TF, which fails on a few files PIL accepts: ask it.
        if _tf_decodes(data):
            return img, data, None
        reason = "JPEG that TF cannot decode"
    else:
        reason = f"{img.mode} JPEG" if img.format == "JPEG" else f"{img.format} content"
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")  # transparent pixels become white, not whatever RGB is there
        img = Image.new("RGB", img.size, (255, 255, 255))
        img.paste(rgba, mask=rgba.getchannel("A"))
    else:
        img = img.convert("RGB")
    return img, _jpeg(img, FULL_QUALITY), reason


def _tf_decodes(data: bytes) -> bool:
    import tensorflow as tf

    try:
        tf.io.decode_jpeg(data)
        return True
    except tf.errors.OpError:
        return False


def _reduce(img, full: bytes, max_side: int, quality: int) -> bytes:
    from PIL import Image

    w, h = img.size
    if max(w, h) <= max_side:
        return full  # already small enough: re-encoding would only lose quality
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return _jpeg(img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0), quality)


def _init_worker():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF only writes records here: no logs
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def _write_shard(task: dict):
    import tensorflow as tf
    from PIL import Image

    finals = {c: os.path.join(task["out"], f) for c, f in task["files"].items()}
    for path in finals.values():
        os.makedirs(os.path.dirname(path), exist_ok=True)
    writers = {c: tf.io.TFRecordWriter(path + ".tmp") for c, path in finals.items()}
    skipped, converted, count, handles, quality = [], [], 0, {}, task["quality"]
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, MAX_PIXELS  # _check guards it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL warns about odd but readable files (EXIF, ...)
            for ex_id, name, label, file, offset, size in task["items"]:
                try:
                    img, full, reason = _check(_read(handles, file, offset, size))
                except OSError as e:
                    img, full, reason = None, None, f"unreadable file ({e.strerror})"
                if img is None:
                    skipped.append({"name": name, "reason": reason})
                    continue
                if reason:
                    converted.append({"name": name, "reason": reason})
                for c, max_side in task["copies"]:
                    data = full if max_side is None else _reduce(img, full, max_side, quality)
                    writers[c].write(encode_example(data, label, ex_id, name))
                count += 1
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit  # this may be the caller's process (one shard)
        for w in writers.values():
            w.close()
        for f in handles.values():
            f.close()
    for path in finals.values():
        os.replace(path + ".tmp", path)
    sidecar = {"config": task["config"], "num_examples": count}
    sidecar.update(skipped=skipped, converted=converted)
    _write_json(task["sidecar"], sidecar)  # last: its presence means the shard is complete
    return task["index"], sidecar


# ---- the whole run ----------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _plan(out, split, source, files, copies, quality, eps, seed):
    """Shard tasks of one split and the sidecars of shards already finished."""
    import numpy as np

    names = [copy_name(c) for c in copies]
    n, classes = len(files), sorted({f[1] for f in files})
    label = {c: i for i, c in enumerate(classes)}
    has_reduced = any(c is not None for c in copies)
    config = {"source": source, "copies": names, "quality": quality if has_reduced else None}
    config.update(examples_per_shard=eps, seed=seed, num_files=n)
    order = np.random.default_rng(seed).permutation(n)  # shards mix classes
    num_shards = math.ceil(n / eps)
    shards, tasks, done = [], [], {}
    for i in range(num_shards):
        tag = f"{i:05d}-of-{num_shards:05d}"
        shard_files = {c: f"{split}/{c}/{split}-{c}-{tag}.tfrecord" for c in names}
        sidecar = os.path.join(out, split, f"{split}-{tag}.json")
        ids = [int(j) for j in order[i * eps : (i + 1) * eps]]
        shards.append(shard_files)
        old = _load_json(sidecar)
        finished = all(os.path.exists(os.path.join(out, f)) for f in shard_files.values())
        if finished and old and old.get("config") == config:
            done[i] = old
            continue
        items = [(j, files[j][0], label[files[j][1]], *files[j][2:]) for j in ids]
        task = {"index": i, "out": out, "files": shard_files, "sidecar": sidecar}
        task.update(items=items, copies=list(zip(names, copies)), quality=quality, config=config)
        tasks.append(task)
    plan = {"split": split, "source": source, "classes": classes, "config": config, "n": n}
    return plan | {"shards": shards, "tasks": tasks, "done": done}


def _changed(out: str, split: str, old: dict, config: dict) -> list[str]:
    """How this run's arguments differ from the ones an existing split was prepared with."""
    n_old = len(next(iter(old["copies"].values()))["shards"])
    prev = _load_json(os.path.join(out, split, f"{split}-00000-of-{n_old:05d}.json")) or {}
    prev = prev.get("config") or {"source": old.get("source"), "copies": list(old["copies"])}
    return [
        f"{k} {prev[k]!r} -> {config[k]!r}"
        for k in config
        if prev.get(k, config[k]) != config[k] and None not in (prev[k], config[k])
    ]


def _entry(plan: dict, copies, quality: int, serve_ratio: float) -> dict:
    sidecars = [plan["done"][i] for i in range(len(plan["shards"]))]
    entry = {"source": plan["source"], "classes": plan["classes"]}
    entry["num_examples"] = sum(s["num_examples"] for s in sidecars)
    for key in ("skipped", "converted"):
        entry[key] = sorted((x for s in sidecars for x in s[key]), key=lambda x: x["name"])
    entry["copies"] = {}
    for c in copies:
        name = copy_name(c)
        entry["copies"][name] = {
            "max_side": c,
            "quality": None if c is None else quality,
            "serves_up_to": None if c is None else math.floor(c / serve_ratio + 1e-9),
            "shards": [
                {"file": f[name], "num_examples": s["num_examples"]}
                for f, s in zip(plan["shards"], sidecars)
            ],
        }
    return entry


def _summary(out: str, entry: dict, plan: dict, processed: int, seconds: float) -> str:
    sizes = []
    for name, copy in entry["copies"].items():
        size = sum(os.path.getsize(os.path.join(out, s["file"])) for s in copy["shards"])
        sizes.append(f"{name} {size / 1e6:.1f} MB")
    return (
        f"{plan['split']}: {entry['num_examples']} examples in {len(plan['shards'])} shards "
        f"({len(plan['shards']) - len(plan['tasks'])} reused) from {plan['source']}; "
        f"{len(entry['skipped'])} skipped, {len(entry['converted'])} converted; "
        f"{', '.join(sizes)}; "
        f"{seconds:.1f} s, {processed / max(seconds, 1e-9):.0f} images/s"
    )


def prepare(
    sources,
    out,
    copies=(None,),
    quality=90,
    serve_ratio=1.25,
    examples_per_shard=1024,
    workers=None,
    seed=0,
    split=None,
    progress=True,
) -> dict:
    """Prepare every split found in ``sources`` into ``out``; returns the merged manifest.

    ``copies``: max sides of the copies to write, None meaning the full-size copy.
    ``split``: each source is itself that one split (CLASS/FILE). ``progress``: a bar and a
    summary per split on stderr. Rerunning with the same arguments reuses finished shards.
    """
    from functools import partial

    from tqdm import tqdm

    progress_bar = partial(tqdm, file=sys.stderr, disable=not progress)

    copies, workers = tuple(copies), workers or os.cpu_count() or 1
    names = [copy_name(c) for c in copies]
    if not copies or len(set(names)) != len(names):
        raise ConfigError(f"copies must be distinct and not empty, got {names}")
    if any(c is not None and (not isinstance(c, int) or c < 1) for c in copies):
        raise ConfigError(f"a reduced copy's max side must be a positive integer, got {copies}")
    if not 1 <= quality <= 100 or serve_ratio <= 0 or examples_per_shard < 1 or workers < 1:
        raise ConfigError(
            "need 1 <= quality <= 100, serve_ratio > 0, examples_per_shard >= 1 and workers >= 1"
        )
    for s in sources:
        if not os.path.exists(s):
            raise ConfigError(f"source {os.path.abspath(s)!r} does not exist")
    out = os.path.abspath(out)
    try:
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ConfigError(f"cannot write to --out {out!r} ({e.strerror}); choose a writable folder")
    path = os.path.join(out, MANIFEST)
    manifest = load_manifest(out) if os.path.exists(path) else {"format": FORMAT, "splits": {}}

    staging, pool = [], None
    try:
        listed = {}
        for source in sources:
            for name, files in list_source(source, split, out, staging).items():
                if name in listed:
                    raise ConfigError(
                        f"split {name!r} is in both {listed[name][0]!r} and "
                        f"{source!r}; prepare them into different --out folders"
                    )
                listed[name] = (os.path.abspath(source), files)
        plans = []
        for name in sorted(listed):
            plan = _plan(out, name, *listed[name], copies, quality, examples_per_shard, seed)
            # An entry whose folder was deleted is stale: preparing it again is what was asked.
            old = manifest["splits"].get(name) if os.path.isdir(os.path.join(out, name)) else None
            diff = _changed(out, name, old, plan["config"]) if old else []
            if diff:  # mixing shards of two different preparations would be silently wrong
                raise ConfigError(
                    f"{out!r} already holds split {name!r} prepared with other arguments "
                    f"({'; '.join(diff)}); use a new --out or delete the old one "
                    f"(rm -r {os.path.join(out, name)})"
                )
            plans.append(plan)

        pending = sum(len(p["tasks"]) for p in plans)
        if workers > 1 and pending > 1:  # spawn: workers must not inherit JAX/TF threads
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(min(workers, pending), initializer=_init_worker)
        for plan in plans:
            t0, processed = time.time(), sum(len(t["items"]) for t in plan["tasks"])
            skipped = sum(len(s["skipped"]) for s in plan["done"].values())
            bar = progress_bar(
                total=plan["n"], initial=plan["n"] - processed, unit="img", desc=plan["split"]
            )
            bar.set_postfix(skipped=skipped)
            sizes = {t["index"]: len(t["items"]) for t in plan["tasks"]}
            run = pool.imap_unordered if pool else map
            for i, sidecar in run(_write_shard, plan["tasks"]):
                plan["done"][i] = sidecar
                skipped += len(sidecar["skipped"])
                bar.set_postfix(skipped=skipped, refresh=False)
                bar.update(sizes[i])
            bar.close()
            entry = _entry(plan, copies, quality, serve_ratio)
            manifest["splits"][plan["split"]] = entry
            _write_json(path, manifest)  # after each split, so a later failure keeps this one
            if progress:
                summary = _summary(out, entry, plan, processed, time.time() - t0)
                print(summary, file=sys.stderr)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for f in staging:
            if os.path.exists(f):
                os.remove(f)
    return manifest


def _parse_copies(text: str):
    copies = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "full":
            copies.append(None)
        elif part.removesuffix("px").isdigit() and int(part.removesuffix("px")) > 0:
            copies.append(int(part.removesuffix("px")))
        else:
            raise ConfigError(f"--copies takes 'full' and max sides like 160, got {part!r}")
    return tuple(copies)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hybridpar.input.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="tar or folder: SPLIT/CLASS/FILE")
    p.add_argument("--out", required=True, help="output folder (shared by all splits)")
    p.add_argument("--copies", default="full", help="e.g. full,160: full size and a 160-px copy")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of reduced copies")
    p.add_argument("--serve-ratio", type=float, default=1.25, help="serves up to side / ratio")
    p.add_argument("--examples-per-shard", type=int, default=1024)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle into shards")
    p.add_argument("--split", help="SOURCE is itself one split (CLASS/FILE) with this name")
    args = vars(p.parse_args(argv))  # the options are named like prepare()'s arguments
    try:
        copies = _parse_copies(args.pop("copies"))
        prepare(args.pop("sources"), args.pop("out"), copies, **args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
