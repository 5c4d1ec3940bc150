"""Prepare image folders or tar archives (SPLIT/CLASS/FILE) once into the sharded format.

    python -m hybridpar.input.prepare SOURCE [SOURCE ...] --out DIR [--copies full,160]

The format (layout, record features, manifest.json) is defined in ``records.py``. Each pool
task writes one whole shard of every copy, deciding once per image whether it is kept, so
shard i of every copy holds the same examples in the same order. Shard files are written as
FILE.PID.tmp and renamed, then a small JSON sidecar per shard records its counts: a rerun of the
same command reuses finished shards, and an interrupted run never leaves a half shard.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import io
import json
import lzma
import math
import multiprocessing
import os
import posixpath
import re
import shutil
import signal
import stat
import statistics
import sys
import tarfile
import tempfile
import threading
import time
import warnings
import zlib
from multiprocessing import resource_tracker

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError, DataError
from hybridpar.config.formatting import byte_size
from hybridpar.input.records import (
    FORMAT,
    MANIFEST,
    OLD_FORMATS,
    copy_name,
    encode_example,
    load_manifest,
)

# Decided by content, not name; the name only tells images from junk such as README.txt.
IMAGE_EXTS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
ROTATED = "EXIF orientation"  # converted reasons that start so count as rotated
MAX_PIXELS = 200_000_000  # above this an image is more likely a decompression bomb than a photo
FULL_QUALITY = 95  # for full-copy images that had to be re-encoded: keep them near-lossless
LAYOUT = (
    "the SPLIT/CLASS/FILE layout (e.g. train/n01440764/n01440764_10026.JPEG), "
    "or CLASS/FILE with --split NAME"
)
# A run's config has no --split: its source is always the folder (or tar) above the splits.
RUN_LAYOUT = "the SPLIT/CLASS/FILE layout (e.g. train/n01440764/n01440764_10026.JPEG)"
# How to fix a source that is one split (CLASS/FILE): on prepare's command line, in a run.
SPLIT_FIX = "use --split NAME (e.g. --split train)"
RUN_FIX = "point data.source at the folder that holds train/ and val/"
TAR_EXTS = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")

# Files this process is part-way writing: what a stop that exits at once removes
# (``remove_partial_files``).
PARTIAL_FILES: set[str] = set()


def remove_partial_files() -> None:
    """Removes what a prepare in this process is part-way writing: a compressed tar's
    uncompressed staging copy in the output folder (as large as the data), and the shard
    being written where shards are written in this process (one worker). For a stop that
    ends the process with ``os._exit`` (the trainer's ``EarlyStop``), where the ``finally``
    blocks that remove them do not run. Safe in a signal handler (no lock; errors are
    ignored). Worker processes remove their own: they stop with their parent."""
    for path in list(PARTIAL_FILES):
        try:
            os.remove(path)
        except OSError:  # gone already
            pass


def _no_space(e: BaseException) -> bool:
    """A full disk or quota: an OSError, or TensorFlow's error for it (ResourceExhaustedError
    from a TFRecordWriter)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def _free(folder: str) -> str:
    try:
        return byte_size(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"


def _elsewhere(for_run: bool) -> str:
    """Where else to prepare, in the words of a run's config or of the command line."""
    if for_run:
        return "data.prepared_dir=DIR, or HYBRIDPAR_CACHE=DIR for the default cache"
    return "--out DIR"


# ---- listing sources ------------------------------------------------------------------------


def _hidden(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


# Files that are no images and need no mention (a README or a label file beside the images).
JUNK_EXTS = {".txt", ".csv", ".json", ".xml", ".md", ".html", ".log", ".ini", ".db", ".yaml"}
NESTED = "in a folder inside a class folder (only CLASS/FILE is read)"
AT_ROOT = "directly in the split folder, not in a class folder"


def _kind(parts: list[str], depth: int) -> str | None:
    """None for an image file to read; '' for junk ignored silently; else why a file that
    may be an image is ignored (listed in the manifest, counted in the data event)."""
    if len(parts) < depth - 1 or any(_hidden(p) for p in parts):
        return ""
    ext = os.path.splitext(parts[-1])[1].lower()
    if ext in JUNK_EXTS:
        return ""
    if len(parts) == depth - 1:  # beside the class folders: a CLASS/FILE source, often
        return AT_ROOT if ext in IMAGE_EXTS else ""
    if len(parts) > depth:
        return NESTED if ext in IMAGE_EXTS else ""
    return None if ext in IMAGE_EXTS else f"not an image name ({ext or 'no extension'})"


def _digest(lines) -> str:
    h = hashlib.sha1()
    for line in lines:
        h.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()[:16]


def _tar_fingerprint(path: str) -> dict:
    st = os.stat(path)
    return {"kind": "tar", "path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _tar_error(path: str, what: str) -> DataError:
    return DataError(
        f"tar archive {path!r} is {what}; copy or download it again (or extract it and pass "
        "the folder)"
    )


def _link_error(path: str, m, what: str) -> DataError:
    # tarfile cannot follow a link to a folder: its images would be lost and labels shift.
    link = "symbolic" if m.issym() else "hard"
    return DataError(
        f"tar archive {path!r} holds a {link} link {m.name!r} -> {m.linkname!r} where a "
        f"{what} folder belongs, and links inside a tar are not followed; extract the tar and "
        "pass the folder, or make the tar again with `tar -h` (--dereference)"
    )


def _list_tar(path: str, depth: int, staging_dir: str, staging: list, for_run=False):
    """Regular members as (parts, file, offset, size), read once here so workers can seek,
    the class folders seen (as parts), the members ignored (as (parts, why)) and the names
    of tars inside it. A truncated or corrupt archive is a DataError.

    A compressed tar cannot be seeked cheaply, so it is streamed once into an uncompressed
    staging file in --out (removed at the end) and indexed there instead.
    """
    size = os.path.getsize(path)
    try:
        tar, compressed = tarfile.open(path, "r:"), False
    except tarfile.ReadError:
        try:
            tar, compressed = tarfile.open(path, "r:*"), True
        except (tarfile.ReadError, EOFError, OSError, zlib.error, lzma.LZMAError):
            raise DataError(
                f"source {path!r} is neither a folder nor a tar archive (not a tar, nor a gzip, "
                "bzip2 or xz compressed one); pass a tar or a folder in the SPLIT/CLASS/FILE "
                "layout"
            ) from None
    entries, dirs, ignored, out_file, data_file = [], set(), [], None, path
    if compressed:
        data_file = os.path.join(staging_dir, f".staging-{len(staging)}-{os.path.basename(path)}")
        staging.append(data_file)
        PARTIAL_FILES.add(data_file)
        out_file = open(data_file, "wb")
    after, tars = "at its start", []
    try:
        with tar:
            while (m := tar.next()) is not None:
                tar.members = []  # tarfile keeps every header otherwise: too much for 1.28M files
                after = f"after member {m.name!r}"
                parts = [p for p in posixpath.normpath(m.name).split("/") if p not in ("", ".")]
                if m.isdir() and len(parts) == depth - 1 and not any(map(_hidden, parts)):
                    dirs.add(tuple(parts))
                if (m.issym() or m.islnk()) and 0 < len(parts) < depth:
                    if not any(map(_hidden, parts)):
                        raise _link_error(path, m, "class" if len(parts) == depth - 1 else "split")
                kind = _kind(parts, depth) if m.isreg() or m.issym() or m.islnk() else ""
                if m.isreg() and m.name.lower().endswith(TAR_EXTS):
                    tars.append(m.name)
                if kind is None and not m.isreg():  # the folder path follows links; not here
                    kind = f"{'symbolic' if m.issym() else 'hard'} link in a tar"
                if kind:
                    ignored.append((parts, kind))
                if kind is not None:
                    continue
                if out_file is None:
                    if m.offset_data + m.size > size:
                        raise _tar_error(
                            path,
                            f"truncated: member {m.name!r} needs bytes up to "
                            f"{m.offset_data + m.size:,} but the file has {size:,}",
                        )
                    entries.append((parts, data_file, m.offset_data, m.size))
                else:
                    entries.append((parts, data_file, out_file.tell(), m.size))
                    shutil.copyfileobj(tar.extractfile(m), out_file)
            end_at = tar.offset
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
        detail = " ".join(str(e).split())  # one line: the CLI prints one error line
        raise _tar_error(path, f"truncated or corrupt {after} ({detail})") from None
    except OSError as e:
        if out_file is not None and _no_space(e):
            written = out_file.tell()
            out_file.close()
            os.remove(data_file)  # before the free space is measured
            raise DataError(
                f"no space left on device in {staging_dir!r} for the uncompressed copy of "
                f"{path!r} that preparing reads ({byte_size(written)} written when it filled, "
                f"{_free(staging_dir)} free); free space there, prepare into another folder "
                f"({_elsewhere(for_run)}), or extract the tar and pass the folder"
            ) from None
        raise DataError(f"cannot read tar archive {path!r} ({e.strerror or e})") from None
    finally:
        if out_file is not None:
            out_file.close()
    if not compressed:
        # tarfile takes a file that stops at a member boundary (or inside a header) for the
        # end of the archive: a tar always ends with zero blocks, so look for them.
        with open(path, "rb") as f:
            f.seek(end_at)
            tail = f.read(tarfile.BLOCKSIZE)
        if len(tail) < tarfile.BLOCKSIZE or tail.count(0) != len(tail):
            raise _tar_error(
                path, f"truncated {after} (no end-of-archive marker at byte {end_at:,})"
            )
    return entries, dirs, ignored, tars


def _walk_split(root: str):
    """One split folder: files as (class, name, path, stat), class folder names, and the
    files ignored as (name, why), sorted."""
    try:
        with os.scandir(root) as it:
            entries = [(e.name, e.is_dir()) for e in it if not _hidden(e.name)]
    except OSError as e:
        raise DataError(f"cannot read source folder {root!r} ({e.strerror or e})") from None
    classes = sorted(name for name, is_dir in entries if is_dir)
    files, ignored = [], []
    for name in sorted(name for name, is_dir in entries if not is_dir):
        if _kind([name], 2) == AT_ROOT:
            ignored.append((name, AT_ROOT))
    for cls in classes:
        folder = os.path.join(root, cls)
        try:
            names = sorted(os.listdir(folder))
        except OSError as e:
            raise DataError(f"cannot read class folder {folder!r} ({e.strerror or e})") from None
        for name in names:
            kind = _kind([cls, name], 2)
            if kind == "":
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError as e:
                if not (isinstance(e, FileNotFoundError) and os.path.islink(path)):
                    raise DataError(f"cannot read {path!r} ({e.strerror or e})") from None
                st = os.lstat(path)  # a broken link: listed, then skipped as such when read
            file_like = stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                ignored += _nested(root, path)
            elif file_like and kind is None:
                files.append((cls, name, path, st))
            elif file_like:
                ignored.append((f"{cls}/{name}", kind))
    return files, classes, ignored


def _nested(root: str, folder: str) -> list:
    """The image files under a folder inside a class folder, as (name, why)."""
    out = []
    for top, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))
        for name in sorted(names):
            if _kind(["class", "folder", name], 2) == NESTED:
                out.append((os.path.relpath(os.path.join(top, name), root), NESTED))
    return out


def _folder_fingerprint(root: str, files, class_dirs) -> dict:
    """Names, sizes and modification times of a split's files, with one digest per class so
    that a change can be named (class added, files added, files changed). Empty class
    folders count: one added shifts the labels of the classes after it."""
    per_class: dict[str, list] = {c: [] for c in class_dirs}
    for cls, name, _, st in files:
        per_class.setdefault(cls, []).append(f"{name}\t{st.st_size}\t{st.st_mtime_ns}")
    classes = {c: [len(v), _digest(v)] for c, v in sorted(per_class.items())}
    return {"kind": "folder", "path": root, "files": len(files), "classes": classes}


def source_fingerprint(fingerprint: dict) -> dict:
    """The fingerprint the same source (tar, or split folder) has now; ConfigError if gone."""
    path = fingerprint["path"]
    if fingerprint["kind"] == "tar":
        return _tar_fingerprint(path)
    files, class_dirs, _ = _walk_split(path)
    return _folder_fingerprint(path, files, class_dirs)


def describe_change(old: dict | None, new: dict) -> str:
    """What differs between two fingerprints of one split, in words ('' when nothing)."""
    if old == new:
        return ""
    if not old or old.get("kind") != new["kind"] or old.get("path") != new["path"]:
        return f"it now comes from {new['path']!r}"
    if new["kind"] == "tar":
        what = (
            [f"size {old['size']:,} -> {new['size']:,} bytes"] if old["size"] != new["size"] else []
        )
        if old["mtime_ns"] != new["mtime_ns"]:
            what.append("modification time changed")
        return f"{new['path']!r} changed ({', '.join(what)})"
    what = []
    a, b = old["classes"], new["classes"]
    for c in sorted(set(a) | set(b)):
        if c not in a:
            what.append(f"class {c!r} added ({b[c][0]} files)")
        elif c not in b:
            what.append(f"class {c!r} removed")
        elif a[c][0] != b[c][0]:
            what.append(f"class {c!r}: {a[c][0]} -> {b[c][0]} files")
        elif a[c] != b[c]:
            what.append(f"class {c!r}: files changed (names, sizes or times)")
    shown = "; ".join(what[:5]) + (f"; and {len(what) - 5} more" if len(what) > 5 else "")
    return f"{new['path']!r} changed ({shown})"


def list_source(
    source: str, split: str | None = None, staging_dir=None, staging=None, for_run=False
):
    """``{split: listing}``, ``listing`` a dict of ``files`` (``[(name, class, file, offset,
    size), ...]`` sorted by name), ``class_dirs`` (every class folder, empty ones too),
    ``ignored`` (``[(name, why), ...]``: files that may be images but are not read: in a
    nested folder, of another extension, a link in a tar) and ``fingerprint`` (what
    ``describe_change`` compares).

    ``name`` is the path relative to the split folder; ``size`` -1 means the whole file.
    With ``split``, the source itself is one split (CLASS/FILE). A compressed tar is
    unpacked into a staging file in ``staging_dir`` (default: the temp dir), whose path is
    appended to ``staging``: the caller removes it when done.

    Image files directly in a split folder are ignored (``AT_ROOT``), and a split folder
    without an image file is left out: each is said on stderr, with the fix for a source
    that is itself one split (``for_run``: a run's config, else prepare's command line).
    """
    source = os.path.abspath(source)
    if not os.path.exists(source):
        raise DataError(f"source {source!r} does not exist")
    splits: dict[str, dict] = {}
    if os.path.isdir(source):
        if split:
            roots = {split: source}
        else:
            try:
                names = sorted(n for n in os.listdir(source) if not _hidden(n))
            except OSError as e:
                raise DataError(f"cannot read source {source!r} ({e.strerror or e})") from None
            roots = {n: os.path.join(source, n) for n in names}
            roots = {n: r for n, r in roots.items() if os.path.isdir(r)}
        for name, root in roots.items():
            files, classes, ignored = _walk_split(root)
            splits[name] = {
                "files": [(f"{c}/{n}", c, p, 0, -1) for c, n, p, _ in files],
                "class_dirs": classes,
                "ignored": ignored,
                "fingerprint": _folder_fingerprint(root, files, classes),
                "folder": root,
            }
    else:
        staging_dir = staging_dir or tempfile.gettempdir()
        entries, dirs, ignored, tars = _list_tar(
            source, 2 if split else 3, staging_dir, [] if staging is None else staging, for_run
        )
        fingerprint = _tar_fingerprint(source)
        by_split: dict[str, dict] = {}
        for parts, file, offset, size in entries:
            parts = [split, *parts] if split else parts
            name = f"{parts[1]}/{parts[2]}"  # a name repeated in a tar: the later member wins
            by_split.setdefault(parts[0], {})[name] = (name, parts[1], file, offset, size)
        skipped: dict[str, list] = {}
        for parts, why in ignored:
            parts = [split, *parts] if split else parts
            skipped.setdefault(parts[0], []).append(("/".join(parts[1:]), why))
        class_dirs: dict[str, set] = {}
        for parts in dirs:
            parts = [split, *parts] if split else list(parts)
            class_dirs.setdefault(parts[0], set()).add(parts[1])
        for name in sorted(set(by_split) | set(skipped)):
            files = by_split.get(name, {})
            classes = class_dirs.get(name, set()) | {f[1] for f in files.values()}
            splits[name] = {
                "files": [files[n] for n in sorted(files)],
                "class_dirs": sorted(classes),
                "ignored": sorted(skipped.get(name, [])),
                "fingerprint": fingerprint,
                "folder": f"{source}:{name}",
            }
        return _layout_check(source, split, splits, for_run, tars)
    return _layout_check(source, split, splits, for_run, None)


def _tars_in(folder: str) -> list[str]:
    """The tar files in a source folder and its split folders (relative paths): ImageNet's
    train tar unpacked once holds one tar per class."""
    found = []
    for top, dirs, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(top, n), folder)
                  for n in sorted(names) if n.lower().endswith(TAR_EXTS)]  # fmt: skip
        dirs[:] = sorted(d for d in dirs if not _hidden(d)) if top == folder else []
    return found


def _layout_check(source: str, split, splits: dict, for_run: bool, tars) -> dict:
    """``splits`` without the ones that hold no image file in CLASS/FILE layout, saying so
    on stderr, and what images lie directly in a split folder; a DataError if none is left.
    Where more images lie directly in split folders than in class folders, ``source`` is
    taken for one split in CLASS/FILE layout, and the fix to that is said. ``tars``: the tar
    members of a tar source (None: a folder, looked at here when no image is found)."""
    at_root = {n: sum(why == AT_ROOT for _, why in s["ignored"]) for n, s in splits.items()}
    in_classes = sum(len(s["files"]) for s in splits.values())
    one_split = not split and sum(at_root.values()) > in_classes
    fix = RUN_FIX if for_run else SPLIT_FIX
    found = {n: {k: v for k, v in s.items() if k != "folder"} for n, s in splits.items()
             if s["files"]}  # fmt: skip
    if not found and one_split:  # the error says it all: no note per folder before it
        raise DataError(
            f"no images found in {source!r} in {RUN_LAYOUT if for_run else LAYOUT}: its "
            "folders hold images directly, so it looks like one split (CLASS/FILE); "
            f"{fix}"
        )
    if one_split:  # one line, not two per folder (ImageNet's train as CLASS/FILE: 2,000)
        roots = [n for n in splits if at_root[n]]
        empty = sum(not s["files"] for s in splits.values())
        _note(
            f"is {source!r} itself one split? {sum(at_root.values())} image(s) lie directly in "
            f"{len(roots)} of its folders ({_names(roots, 3)}), not under a class folder, and "
            f"{empty} folder(s) without a class folder are left out; {fix}"
        )
    for name, listing in splits.items() if not one_split else ():
        if at_root[name]:
            _note(
                f"{at_root[name]} image(s) directly in split folder {listing['folder']!r} are "
                "not under a class folder"
            )
        if not listing["files"]:
            _note(f"split folder {listing['folder']!r} holds no image file in a class folder: "
                  "left out")  # fmt: skip
    if not found:
        layout = RUN_LAYOUT if for_run else LAYOUT
        tars = _tars_in(source) if tars is None else tars
        held = ""
        if tars:  # ImageNet's train tar holds one tar per class
            name = os.path.basename(tars[0])
            cls = next(name[: -len(e)] for e in TAR_EXTS if name.lower().endswith(e))
            held = (
                f"; it holds {len(tars)} tar file(s) ({_names(tars, 3)}), and a tar inside a "
                "source is not read: extract each class's tar into a folder SPLIT/CLASS/ (e.g. "
                f"mkdir -p train/{cls} && tar -xf {name} -C train/{cls}), or train on "
                "ImageNet's own tars with data.name=tfds and data.tfds_manual_dir"
            )
        raise DataError(f"no images found in {source!r}: expected {layout}{held}")
    for listing in found.values():
        listing["one_split"] = one_split
    return found


# ---- one shard (runs in a worker process) ---------------------------------------------------


def read_listed(handles: dict, file: str, offset: int, size: int) -> bytes:
    """The bytes of one listed image: a file whole (``size`` < 0), or a tar member's at
    ``offset``, through ``handles`` (one open handle per archive, kept by the caller)."""
    if size < 0:
        with open(file, "rb") as f:
            return f.read()
    if file not in handles:  # one handle per archive per task, not one per member
        handles[file] = open(file, "rb")
    handles[file].seek(offset)
    return handles[file].read(size)


def read_error(file: str, e: OSError) -> str:
    """Why a listed file could not be read (both paths skip it with this reason)."""
    if os.path.islink(file) and not os.path.exists(file):
        return "broken symbolic link"
    return f"unreadable file ({e.strerror or e})"


def _jpeg(img, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def decode(data: bytes):
    """The one rule both paths keep or skip a file by (prepare here, ``data.on_device`` in
    ``on_device.py``): ``(image, reason, None)``, the image upright and RGB (a clean RGB or
    grey JPEG: PIL's own image, as it is) and ``reason`` why it had to be converted (None:
    it did not); or ``(None, None, why skipped)``. Reasons must not vary between runs (the
    manifest is compared)."""
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
        if "truncated" in str(e).lower():  # PIL says "Truncated File Read" and "truncated"
            return None, None, "truncated image"
        return None, None, f"undecodable ({type(e).__name__}: {str(e)[:200]})"
    # TF's decoders ignore EXIF orientation, so a photo taken sideways would train sideways:
    # turn the pixels upright here and store them without the tag.
    orientation = _orientation(img)
    clean = img.format == "JPEG" and img.mode in ("RGB", "L")
    if clean and orientation == 1:
        return img, None, None
    reasons = []
    if not clean:
        reasons.append(f"{img.mode} JPEG" if img.format == "JPEG" else f"{img.format} content")
    if orientation != 1:
        from PIL import ImageOps

        img = ImageOps.exif_transpose(img)
        reasons.append(f"{ROTATED} {orientation} applied")
    if img.mode.startswith("I;16"):
        # 16-bit grey: PIL's convert clips the samples at 255 (a white image). Keep the high
        # byte, as PIL itself reads 16-bit RGB.
        import numpy as np

        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8), "L")
        reasons.append("16-bit samples scaled to 8 bits")
    elif img.mode in ("I", "F"):  # 32-bit samples: no range to scale from
        return None, None, f"{img.mode} mode: 32-bit samples; convert the file to 8 bits"
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")  # transparent pixels become white, not whatever RGB is there
        img = Image.new("RGB", img.size, (255, 255, 255))
        img.paste(rgba, mask=rgba.getchannel("A"))
    else:
        img = img.convert("RGB")
    return img, "; ".join(reasons), None


def _check(data: bytes):
    """(image, full-copy bytes, reason): ``decode``'s rule, plus TF's: the training pipeline
    decodes with TF, which fails on a few JPEGs PIL accepts (those are re-encoded)."""
    img, reason, skip = decode(data)
    if img is None:
        return None, None, skip
    if reason is None:
        if _tf_decodes(data):
            return img, data, None
        img, reason = img.convert("RGB"), "JPEG that TF cannot decode"
    return img, _jpeg(img, FULL_QUALITY), reason


def _orientation(img) -> int:
    """The EXIF orientation (1..8; 1 is upright), 1 where the tag is absent or nonsense."""
    try:
        value = int(img.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block is not worth skipping a readable photo for
        return 1
    return value if 1 <= value <= 8 else 1


def _tf_decodes(data: bytes) -> bool:
    import tensorflow as tf

    try:
        tf.io.decode_jpeg(data)
        return True
    except tf.errors.OpError:
        return False


def _reduced_size(size: tuple[int, int], max_side: int | None) -> tuple[int, int]:
    """(w, h) of an image of ``size`` in the copy of longest side ``max_side`` (None: full)."""
    w, h = size
    if max_side is None or max(w, h) <= max_side:
        return w, h
    scale = max_side / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def _reduce(img, full: bytes, max_side: int, quality: int) -> bytes:
    from PIL import Image

    size = _reduced_size(img.size, max_side)
    if size == img.size:
        return full  # already small enough: re-encoding would only lose quality
    return _jpeg(img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0), quality)


def init_worker():
    """A prepare pool worker's set-up (the pool's ``initializer``): quiet TensorFlow, Ctrl-C
    left to the parent, and a stop that removes the shard being written and ends the
    worker, also when the parent dies."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF only writes records here: no logs
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    # The parent owns Ctrl-C (it stops the pool and says how to resume): no traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A stop (the pool's terminate, or the parent's death) removes the shard being written,
    # in a thread of its own that waits for SIGTERM. Not a Python handler: that runs in the
    # main thread only, and where the kernel gave the signal to another thread (TF's, or
    # OpenBLAS's) while the main thread waited for its next task, the worker never ran it
    # and the pool's terminate waited for it forever. SIGTERM is blocked here and so in every
    # thread started after this; one started before it with SIGTERM open (a worker not
    # started by ``start_pool``) that takes it ends the process by the default action.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_stop_on_sigterm, name="hybridpar-stop", daemon=True).start()
    if sys.platform.startswith("linux"):
        # Die with the parent: after a SIGKILL or the trainer's os._exit a worker went on
        # writing after the folder's lock was free, into the shards of the next run.
        import ctypes

        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
            os._exit(1)


def start_pool(workers: int):
    """prepare's pool of ``workers`` processes, spawned (they must not inherit JAX's or TF's
    threads) and born with SIGTERM blocked, so that in each of their threads, OpenBLAS's from
    numpy's import too, a stop reaches only the thread that waits for it (``init_worker``)."""
    # first: the resource tracker's start (at a process's first pool) unblocks SIGTERM
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return multiprocessing.get_context("spawn").Pool(workers, initializer=init_worker)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _stop_on_sigterm():
    signal.sigwait({signal.SIGTERM})
    # (a shard the main thread opens meanwhile is left: the next prepare removes it)
    remove_partial_files()
    os._exit(128 + signal.SIGTERM)


def _remove_stale_temps(tasks: list[dict]) -> None:
    """Removes the temporary files of the shards to write that a run killed with SIGKILL
    left (``FILE.PID.tmp``, or an older ``FILE.tmp``; its workers could not remove them):
    one listing per folder (a glob per shard in each worker listed ImageNet's folders of
    ~1,000 shards ~2,000 times). Under the folder's lock: no other prepare writes there."""
    names: dict[str, set] = collections.defaultdict(set)
    for task in tasks:
        for f in task["files"].values():
            path = os.path.join(task["out"], f)
            names[os.path.dirname(path)].add(os.path.basename(path))
    for folder, shards in names.items():
        try:
            entries = os.listdir(folder)
        except FileNotFoundError:
            continue
        for e in entries:
            base = e[: -len(".tmp")] if e.endswith(".tmp") else None
            if base is not None and (base in shards or base.rsplit(".", 1)[0] in shards):
                try:
                    os.remove(os.path.join(folder, e))
                except FileNotFoundError:  # a worker of the stopped run, ending now, did
                    pass


def write_shard(task: dict):
    """One pool task: shard i of every copy, each written under a temporary name and renamed
    into place, then its sidecar (the pool's workers call it; a test stops one inside it)."""
    finals = {c: os.path.join(task["out"], f) for c, f in task["files"].items()}
    # Each writer's own temporary name: a worker of a stopped run may still be ending.
    temps = {c: f"{path}.{os.getpid()}.tmp" for c, path in finals.items()}
    for path in finals.values():
        os.makedirs(os.path.dirname(path), exist_ok=True)
    PARTIAL_FILES.update(temps.values())
    try:
        sidecar = _write_records(task, temps)
        for c, path in finals.items():
            os.replace(temps[c], path)
    except BaseException as e:
        for path in temps.values():
            if os.path.exists(path):
                os.remove(path)
        if _no_space(e) and not isinstance(e, OSError):  # TF's: picklable, one kind for all
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), task["out"]) from None
        raise
    finally:
        PARTIAL_FILES.difference_update(temps.values())
    _write_json(task["sidecar"], sidecar)  # last: its presence means the shard is complete
    return task["index"], sidecar


def _write_records(task: dict, temps: dict) -> dict:
    """Writes one shard of every copy into ``temps`` and returns its sidecar."""
    import tensorflow as tf
    from PIL import Image

    writers = {c: tf.io.TFRecordWriter(path) for c, path in temps.items()}
    skipped, converted, count, handles, quality = [], [], 0, {}, task["quality"]
    short_sides = {c: [] for c, _ in task["copies"]}  # per copy: each image's shorter side
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, MAX_PIXELS  # _check guards it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL warns about odd but readable files (EXIF, ...)
            for ex_id, name, label, file, offset, size in task["items"]:
                try:
                    img, full, reason = _check(read_listed(handles, file, offset, size))
                except OSError as e:
                    img, full, reason = None, None, read_error(file, e)
                if img is None:
                    skipped.append({"name": name, "reason": reason})
                    continue
                if reason:
                    converted.append({"name": name, "reason": reason})
                for c, max_side in task["copies"]:
                    data = full if max_side is None else _reduce(img, full, max_side, quality)
                    writers[c].write(encode_example(data, label, ex_id, name))
                    short_sides[c].append(min(_reduced_size(img.size, max_side)))
                count += 1
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit  # this may be the caller's process (one shard)
        for w in writers.values():
            w.close()
        for f in handles.values():
            f.close()
    sidecar = {"config": task["config"], "num_examples": count}
    return sidecar | {"skipped": skipped, "converted": converted, "short_sides": short_sides}


# ---- the whole run ----------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# Arguments of a preparation: a different value for an existing split is refused (mixing
# shards of two preparations would be silently wrong). The other keys of a shard's config
# describe the source data: when they differ the split is out of date and is prepared again.
ARG_KEYS = ("source", "copies", "quality", "examples_per_shard", "seed")


def _plan(out, split, source, listing, classes, copies, quality, eps, seed):
    """Shard tasks of one split and the sidecars of shards already finished."""
    import numpy as np

    files = listing["files"]
    names = [copy_name(c) for c in copies]
    n = len(files)
    label = {c: i for i, c in enumerate(classes)}
    has_reduced = any(c is not None for c in copies)
    config = {"source": source, "copies": names, "quality": quality if has_reduced else None}
    config.update(examples_per_shard=eps, seed=seed, num_files=n)
    # Labels index the dataset's class list, and the bytes come from the source as it is now.
    config.update(classes=_digest(classes), fingerprint=fingerprint_digest(listing["fingerprint"]))
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
    plan.update(fingerprint=listing["fingerprint"], class_dirs=listing["class_dirs"])
    plan["ignored"] = [{"name": n, "reason": why} for n, why in listing["ignored"]]
    plan["file_counts"] = collections.Counter(f[1] for f in files)
    return plan | {"shards": shards, "tasks": tasks, "done": done}


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def fingerprint_digest(fingerprint: dict) -> str:
    """A short digest of a listing's ``fingerprint`` (names, sizes and times of the files; a
    tar's size and time): equal for the same files, whatever order the dict was built in."""
    return _digest([_canon(fingerprint)])


def _changed(out: str, split: str, old: dict, config: dict) -> list[str]:
    """How this run's arguments differ from the ones an existing split was prepared with."""
    n_old = len(next(iter(old["copies"].values()))["shards"])
    prev = _load_json(os.path.join(out, split, f"{split}-00000-of-{n_old:05d}.json")) or {}
    prev = prev.get("config") or {"source": old.get("source"), "copies": list(old["copies"])}
    return [
        f"{k} {prev[k]!r} -> {config[k]!r}"
        for k in ARG_KEYS
        if prev.get(k, config[k]) != config[k] and None not in (prev[k], config[k])
    ]


def count_rotated(converted: list) -> int:
    return sum(ROTATED in x["reason"] for x in converted)


def class_change(old: list, new: list) -> str:
    if old == new:
        return ""
    added, removed = [c for c in new if c not in old], [c for c in old if c not in new]
    what = [f"added {', '.join(map(repr, added[:5]))}"] if added else []
    what += [f"removed {', '.join(map(repr, removed[:5]))}"] if removed else []
    return f"the class list changed ({'; '.join(what) or 'reordered'})"


def _usable(plan: dict) -> dict:
    """Usable examples per class of a processed split (its files minus the skipped ones)."""
    counts = collections.Counter(plan["file_counts"])
    for s in plan["done"].values():
        counts.subtract(x["name"].split("/")[0] for x in s["skipped"])
    return counts


def classes_without_examples(classes, class_dirs, files: dict, usable: dict) -> dict:
    """{class: why} for the classes of the list with no usable example in a split (both
    paths report and check these): ``files`` and ``usable`` count each class's files and
    the ones kept."""
    why = {}
    for c in classes:
        if usable.get(c, 0) > 0:
            continue
        if c not in class_dirs:
            why[c] = "no folder"
        elif not files.get(c):
            why[c] = "empty folder"
        else:
            why[c] = f"all {files[c]} files skipped"
    return why


def _entry(plan: dict, copies, quality: int, serve_ratio: float) -> dict:
    sidecars = [plan["done"][i] for i in range(len(plan["shards"]))]
    entry = {"source": plan["source"], "classes": plan["classes"]}
    entry["fingerprint"] = plan["fingerprint"]
    entry["num_files"] = plan["n"]
    entry["num_examples"] = sum(s["num_examples"] for s in sidecars)
    for key in ("skipped", "converted"):
        entry[key] = sorted((x for s in sidecars for x in s[key]), key=lambda x: x["name"])
    entry["rotated"] = count_rotated(entry["converted"])
    entry["ignored"] = plan["ignored"]
    entry["empty_folders"] = [c for c in plan["class_dirs"] if not plan["file_counts"].get(c)]
    entry["classes_without_examples"] = classes_without_examples(
        plan["classes"], plan["class_dirs"], plan["file_counts"], _usable(plan)
    )
    entry["copies"] = {}
    for c in copies:
        name = copy_name(c)
        entry["copies"][name] = {
            "max_side": c,
            "quality": None if c is None else quality,
            "serves_up_to": None if c is None else math.floor(c / serve_ratio + 1e-9),
            "encoding": "jpeg",  # every record: _check keeps only JPEG that TF decodes
            "shards": [
                {"file": f[name], "num_examples": s["num_examples"]}
                for f, s in zip(plan["shards"], sidecars)
            ],
        }
        # Shards written by an older hybridpar (reused on resume) did not record sides.
        if all("short_sides" in s for s in sidecars):
            sides = [v for s in sidecars for v in s["short_sides"][name]]
            entry["copies"][name]["median_short_side"] = int(statistics.median(sides or [0]))
    return entry


def _summary(out: str, entry: dict, plan: dict, processed: int, seconds: float) -> str:
    sizes = []
    for name, copy in entry["copies"].items():
        size = sum(os.path.getsize(os.path.join(out, s["file"])) for s in copy["shards"])
        sizes.append(f"{name} {size / 1e6:.1f} MB")
    skipped = len(entry["skipped"])
    listed = f" (listed in {os.path.join(out, MANIFEST)})" if skipped else ""
    took = f"{seconds:.1f} s, {processed / max(seconds, 1e-9):.0f} images/s" if processed else ""
    return (
        f"{plan['split']}: {entry['num_examples']} examples in {len(plan['shards'])} shards "
        f"({len(plan['shards']) - len(plan['tasks'])} reused) from {plan['source']}; "
        f"{skipped} skipped{listed}, {len(entry['converted'])} converted "
        f"({entry['rotated']} rotated upright by EXIF); "
        f"{', '.join(sizes)}; "
        f"{took or 'reused'}"
    )


def class_notes(split: str, empty_folders, without_examples: dict) -> None:
    """The lines said of a split's class folders that gave no example (prepared here, or
    decoded for the device): the empty ones, and those whose files were all skipped."""
    if empty_folders:
        _note(f"{split}: empty class folder(s) {_names(empty_folders)}")
    if without_examples:
        listed = ", ".join(f"{c!r} ({w})" for c, w in list(without_examples.items())[:10])
        _note(f"{split}: no usable example of class(es) {listed}")


def _names(items, limit=10) -> str:
    items = list(items)
    text = ", ".join(map(repr, items[:limit]))
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def parse_classes(text) -> list[str] | None:
    """A class list from config or the command line: None/'' (from the train split), a
    comma-separated list, or the path of a text file with one class name per line."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, (list, tuple)):
        names = [str(c).strip() for c in text]
    elif os.path.isfile(text):
        try:
            with open(text, encoding="utf-8-sig") as f:  # a BOM (Excel, Notepad) is no name
                names = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise DataError(f"cannot read the class list {text!r} ({e.strerror})") from None
    else:
        names = [c.strip() for c in text.split(",")]
    dup = sorted({c for c in names if names.count(c) > 1})
    if not all(names) or dup:
        raise DataError(
            f"the class list must name each class once and none empty (repeated: {dup}); "
            "give comma-separated names or a file with one name per line"
        )
    return names


GIVEN = "the given class list"


def _choose_classes(listed, manifest, train_split, classes, out, fix=SPLIT_FIX):
    """The dataset's one class list, the message naming where it came from, and the split
    whose class folders it is (None: a given list)."""
    if classes is not None:
        return list(classes), GIVEN, None
    if train_split in listed:
        origin = f"train split {train_split!r}"
        return list(listed[train_split][1]["class_dirs"]), origin, train_split
    if manifest.get("classes"):
        origin = f"the class list already in {out!r}"
        return list(manifest["classes"]), origin, labels_from(manifest, train_split)
    one_split = one_split_error(listed, train_split, fix)
    if one_split:
        raise one_split
    raise DataError(
        f"no class list to label {_names(sorted(listed))} with: the sources hold no train "
        f"split {train_split!r} and {out!r} has none from an earlier run. Prepare the train "
        "split first or together with them, name the split that defines the classes "
        "(--train-split NAME, data.train_split), or list the classes (--classes, data.classes)"
    )


def one_split_error(listed, split: str, fix: str) -> DataError | None:
    """The error where ``split`` is missing because a source is itself one split (CLASS/FILE:
    its folders hold images directly); None where no source looks so."""
    one_split = sorted({src for src, listing in listed.values() if listing.get("one_split")})
    if not one_split:
        return None
    return DataError(
        f"no split {split!r} in {_names(one_split)}: its folders hold images directly, so it "
        f"looks like one split in CLASS/FILE layout; {fix}"
    )


def labels_from(record: dict, train_split: str) -> str | None:
    """The split whose class folders are the class list of a manifest or an on-device
    cache's record; None: a given list. A manifest from before ``classes_from`` was
    recorded: a list in folder order is taken for ``train_split``'s folders."""
    if "classes_from" in record:
        return record["classes_from"]
    have = record.get("classes") or []
    return train_split if have == sorted(have) else None


def class_list_stale(record: dict, want: list | None, train_split: str) -> str:
    """Why the labels of ``record`` (a manifest, or an on-device cache's record) do not serve
    a run asking for the class list ``want`` (None: ``train_split``'s class folders); ''
    when they do. Labels follow the list's order, so any other list is stale."""
    have = record.get("classes") or []
    if want is not None:
        if have == want:
            return ""
        return f"data.classes differs: {class_change(have, want)}"
    source = labels_from(record, train_split)
    if source == train_split:
        return ""
    was = "a given class list" if source is None else f"the class folders of split {source!r}"
    return (
        f"its labels follow {was} ({_names(have)}) and data.classes is unset now, which means "
        f"the class folders of train split {train_split!r}"
    )


def check_splits(listed, classes, origin, train_split, allow_empty):
    """Errors before any work: a class that the class list lacks; a train class without
    files (unless allowed). All of them, in one error: fixing one at a time and running
    again to find the next costs a listing each time."""
    problems = []
    known = set(classes)
    if origin == GIVEN:
        fix = "or add them to the class list (--classes, data.classes)"
    else:
        fix = (f"add them to train split {train_split!r}, or list every class (--classes, "
               "data.classes)")  # fmt: skip
    for name, (source, listing) in sorted(listed.items()):
        extra = sorted({f[1] for f in listing["files"]} - known)
        if extra:
            problems.append(
                f"split {name!r} of {source!r} has class folder(s) {_names(extra)} that "
                f"{origin} lacks, so they have no label; remove or rename them, {fix}"
            )
    if train_split in listed and not allow_empty:
        source, listing = listed[train_split]
        files = collections.Counter(f[1] for f in listing["files"])
        empty = classes_without_examples(classes, listing["class_dirs"], files, files)
        if empty:
            problems.append(str(empty_classes_error(train_split, source, empty)))
    if len(problems) == 1:
        raise DataError(problems[0])
    if problems:
        listed_ = " ".join(f"({i}) {p.rstrip('.')}." for i, p in enumerate(problems, 1))
        raise DataError(f"{len(problems)} problems in the sources: {listed_}")


def empty_classes_error(split, source, why: dict) -> DataError:
    """The error of a train split with a class of the list that has no usable example."""
    listed = ", ".join(f"{c!r} ({w})" for c, w in list(why.items())[:10])
    more = f" and {len(why) - 10} more" if len(why) > 10 else ""
    return DataError(
        f"train split {split!r} of {source!r} has no usable example of class(es) {listed}{more}: "
        "the model would keep a label it never sees. Add images, remove the class, or allow "
        "it (--allow-empty-classes, data.allow_empty_classes=True)"
    )


def missing_split_error(key: str, split: str, sources: list, have: list) -> DataError:
    """``data.KEY`` names a split that ``sources`` (split names ``have``) lack; a folder of
    that name without an image file (empty class folders) is said to be empty."""
    empty = [os.path.join(s, split) for s in sources if os.path.isdir(os.path.join(s, split))]
    if empty:
        return DataError(
            f"data.{key}={split!r}: the folder {empty[0]!r} holds no image file in CLASS/FILE "
            f"layout; add images to it, or set --config.data.{key} to one of {sorted(have)}"
        )
    return DataError(
        f"data.{key}={split!r} is not a split of {', '.join(sources)} (it has {sorted(have)}): "
        f"set --config.data.{key} to one of those, or add a folder {split}/CLASS/FILE to the "
        "source"
    )


def ignored_note(split: str, ignored: list, where: str) -> str:
    """One line on the files of a split that may be images but were not read."""
    why = collections.Counter(x["reason"] for x in ignored)
    kinds = "; ".join(f"{n} {r}" for r, n in sorted(why.items()))
    return f"{split}: {len(ignored)} file(s) not read ({kinds}); listed in {where}"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def check_out(out: str, sources, key: str = "--out") -> None:
    """Refuses an output folder that is a source folder, lies inside one or holds one: its
    shards would be listed as the source's images, and a split prepared again replaces its
    shards there. A tar's folder may hold the output (the tar itself is never written)."""
    where = os.path.realpath(out)
    for s in sources:
        src = os.path.realpath(s)
        if not os.path.isdir(src):
            continue
        common = os.path.commonpath([where, src])
        if common not in (where, src):
            continue
        how = "is" if where == src else "is inside" if common == src else "holds"
        raise ConfigError(
            f"{key} {out!r} {how} the source folder {s!r}: the prepared shards must not mix "
            f"with your images; choose a folder outside it (e.g. {src.rstrip(os.sep)}-prepared)"
        )


# What prepare writes in a split's folder: shard files per copy and a sidecar per shard
# (each also as FILE.PID.tmp while written, FILE.tmp by an older hybridpar). Nothing else
# there is removed.
def _written_by_prepare(split: str, rel: str) -> bool:
    parts = rel.split(os.sep)
    tag, temp = r"\d{5}-of-\d{5}", r"(\.\d+\.tmp|\.tmp)?"
    if len(parts) == 1:
        return re.fullmatch(rf"{re.escape(split)}-{tag}\.json{temp}", parts[0]) is not None
    if len(parts) == 2:
        pattern = rf"{re.escape(split)}-{re.escape(parts[0])}-{tag}\.tfrecord{temp}"
        return re.fullmatch(pattern, parts[1]) is not None
    return False


def _remove_split(out: str, split: str) -> None:
    """Removes the shards and sidecars of a prepared split, and its folders where that
    leaves them empty: never a file prepare did not write (a user's, or a source's). Its
    caller has checked that no run reads the folder (``check_no_readers``)."""
    root = os.path.join(out, split)
    for top, dirs, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(top, name)
            if _written_by_prepare(split, os.path.relpath(path, root)):
                os.remove(path)
        try:
            os.rmdir(top)
        except OSError:  # holds something else: kept
            pass


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
    train_split="train",
    classes=None,
    allow_empty_classes=False,
    needed=None,
    for_run=False,
) -> dict:
    """Prepare every split found in ``sources`` into ``out``; returns the merged manifest.

    ``copies``: max sides of the copies to write, None meaning the full-size copy.
    ``split``: each source is itself that one split (CLASS/FILE). ``progress``: a bar and a
    summary per split on stderr. Rerunning with the same arguments reuses finished shards;
    a split whose source changed since (files, sizes, times) is prepared again, saying so.

    Labels: one class list for the whole dataset, ``classes`` (names, a comma-separated
    string or a file; see ``parse_classes``) or else the class folders of ``train_split``
    (or the list ``out`` already has). Every split maps its folders into it by name; a
    folder outside the list is an error, and so is a train class with no usable example
    unless ``allow_empty_classes``.

    ``needed``: ``{config key: split}`` that must be in the sources (or already in ``out``),
    checked before any work. ``for_run``: a run prepares (its errors name config keys, not
    this command's options). ``out`` may not be, lie in, or hold a source folder.
    """
    from functools import partial

    from tqdm import tqdm

    progress_bar = partial(tqdm, file=sys.stderr, disable=not progress)

    copies, workers = tuple(copies), workers or os.cpu_count() or 1
    names = [copy_name(c) for c in copies]
    if not copies or len(set(names)) != len(names):
        raise DataError(f"copies must be distinct and not empty, got {names}")
    if any(c is not None and (not isinstance(c, int) or c < 1) for c in copies):
        raise DataError(f"a reduced copy's max side must be a positive integer, got {copies}")
    if not 1 <= quality <= 100 or serve_ratio <= 0 or examples_per_shard < 1 or workers < 1:
        raise DataError(
            "need 1 <= quality <= 100, serve_ratio > 0, examples_per_shard >= 1 and workers >= 1"
        )
    classes = parse_classes(classes)
    for s in sources:
        if not os.path.exists(s):
            raise DataError(f"source {os.path.abspath(s)!r} does not exist")
    check_out(out, sources, "data.prepared_dir" if for_run else "--out")
    out = os.path.abspath(out)
    made = out  # the topmost folder this call makes (None: out was there)
    while not os.path.exists(os.path.dirname(made)):
        made = os.path.dirname(made)
    made = None if os.path.exists(out) else made
    try:
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise DataError(f"cannot write to --out {out!r} ({e.strerror}); choose a writable folder")
    # One preparer per folder at a time, from before its manifest is read: a second one (a
    # trainer at its first use of the data, or this command run twice) waits, then finds the
    # shards finished and reuses them.
    lock = FolderLock(out)
    staging, pool = [], None
    try:
        path = os.path.join(out, MANIFEST)
        manifest = _existing_manifest(out)
        listed = {}
        for source in sources:
            for name, listing in list_source(source, split, out, staging, for_run).items():
                if name in listed:
                    raise DataError(
                        f"split {name!r} is in both {listed[name][0]!r} and "
                        f"{source!r}; prepare them into different --out folders"
                    )
                listed[name] = (os.path.abspath(source), listing)
        fix = RUN_FIX if for_run else SPLIT_FIX
        for key, name in (needed or {}).items():  # before any split is prepared
            if name not in listed and name not in manifest["splits"]:
                paths = [os.path.abspath(s) for s in sources]
                raise one_split_error(listed, name, fix) or missing_split_error(
                    key, name, paths, listed
                )
        classes, origin, classes_from = _choose_classes(
            listed, manifest, train_split, classes, out, fix
        )
        relabel = class_change(manifest.get("classes") or classes, classes)
        left = sorted(set(manifest["splits"]) - set(listed))
        if relabel and left:
            raise DataError(
                f"{relabel} since {out!r} was prepared, and its split(s) {_names(left)} carry the "
                "old labels: prepare all splits together (every source in one command), or "
                "into a new --out"
            )
        check_splits(listed, classes, origin, train_split, allow_empty_classes)
        plans = []
        for name in sorted(listed):
            args = (out, name, *listed[name], classes, copies, quality, examples_per_shard, seed)
            plan = _plan(*args)
            # An entry whose folder was deleted is stale: preparing it again is what was asked.
            old = manifest["splits"].get(name) if os.path.isdir(os.path.join(out, name)) else None
            diff = _changed(out, name, old, plan["config"]) if old else []
            if diff:  # mixing shards of two different preparations would be silently wrong
                raise DataError(
                    f"{out!r} already holds split {name!r} prepared with other arguments "
                    f"({'; '.join(diff)}); use a new --out or delete the old one "
                    f"(rm -r {os.path.join(out, name)})"
                )
            why = old and (describe_change(old.get("fingerprint"), plan["fingerprint"]) or relabel)
            if why:
                check_no_readers(out, for_run)  # before saying it is prepared again
                _note(f"split {name!r} in {out!r} is out of date: {why}; preparing it again")
                _remove_split(out, name)  # no shard of the old copy may remain
                plan = _plan(*args)
            plans.append(plan)
        # Shards written over (a manifest of an older format, a sidecar of other arguments)
        # would change under a run reading them, as removed ones would.
        if any(os.path.exists(os.path.join(out, f)) for p in plans for t in p["tasks"]
               for f in t["files"].values()):  # fmt: skip
            check_no_readers(out, for_run)

        _remove_stale_temps([t for p in plans for t in p["tasks"]])
        pending = sum(len(p["tasks"]) for p in plans)
        if workers > 1 and pending > 1:  # spawn: workers must not inherit JAX/TF threads
            pool = start_pool(min(workers, pending))
        manifest["classes"], manifest["classes_from"] = classes, classes_from
        try:
            for plan in plans:
                t0, processed = time.time(), sum(len(t["items"]) for t in plan["tasks"])
                skipped = sum(len(s["skipped"]) for s in plan["done"].values())
                sizes = {t["index"]: len(t["items"]) for t in plan["tasks"]}
                run = pool.imap_unordered if pool else map
                # closed also when stopped: its last line before the line that says so
                with progress_bar(total=plan["n"], initial=plan["n"] - processed, unit="img",
                                  desc=plan["split"]) as bar:  # fmt: skip
                    bar.set_postfix(skipped=skipped)
                    for i, sidecar in run(write_shard, plan["tasks"]):
                        plan["done"][i] = sidecar
                        skipped += len(sidecar["skipped"])
                        bar.set_postfix(skipped=skipped, refresh=False)
                        bar.update(sizes[i])
                entry = _entry(plan, copies, quality, serve_ratio)
                empty = entry["classes_without_examples"]
                if plan["split"] == train_split and empty and not allow_empty_classes:
                    # the shards are kept
                    raise empty_classes_error(plan["split"], plan["source"], empty)
                manifest["splits"][plan["split"]] = entry
                _write_json(path, manifest)  # after each split: a later failure keeps this one
                if progress:
                    summary = _summary(out, entry, plan, processed, time.time() - t0)
                    print(summary, file=sys.stderr)
                if entry["ignored"]:
                    _note(ignored_note(plan["split"], entry["ignored"], path))
                class_notes(plan["split"], entry["empty_folders"], empty)
        except OSError as e:
            if not _no_space(e):
                raise
            if pool is not None:  # its workers remove their part-written shards first
                pool.terminate()
                pool.join()
            n, need = _left(plans)
            need = f"the {n:,} image(s) left need about {byte_size(need)} more, " if n else ""
            raise DataError(
                f"no space left on device in {out!r} ({need}{_free(out)} free); free space "
                f"there, or prepare into another folder ({_elsewhere(for_run)})"
            ) from None
    except BaseException:
        failed = True
        raise
    else:
        failed = False
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for f in staging:
            if os.path.exists(f):
                os.remove(f)
            PARTIAL_FILES.discard(f)
        lock.release()
        if failed and made:  # a first run that failed: leave no empty folder it made
            _remove_made(out, made)
    return manifest


def _left(plans) -> tuple[int, int]:
    """The images of the shards not written yet, and about how many bytes their files are
    (from up to 1,000 of them: a folder's sizes cost a stat each)."""
    items = [x for p in plans for t in p["tasks"] if t["index"] not in p["done"]
             for x in t["items"]]  # fmt: skip
    sizes = []
    for *_, file, _, size in items[:: max(1, len(items) // 1000)]:
        try:
            sizes.append(size if size >= 0 else os.path.getsize(file))
        except OSError:  # gone since it was listed
            pass
    return len(items), int(statistics.mean(sizes) * len(items)) if sizes else 0


def _remove_made(out: str, made: str) -> None:
    """Removes ``out`` where it holds nothing but the lock, and the empty folders above it
    up to ``made`` (the topmost one prepare made): never a folder that was there before."""
    remove_if_unused(out)
    folder = out
    while folder != made and not os.path.exists(folder):
        folder = os.path.dirname(folder)
        try:
            os.rmdir(folder)
        except OSError:  # holds something: kept
            return


def _existing_manifest(out: str) -> dict:
    """``out``'s manifest, or an empty one (none yet, or one of an older format)."""
    path = os.path.join(out, MANIFEST)
    if os.path.exists(path):
        old_format = _load_json(path) or {}
        if old_format.get("format") not in OLD_FORMATS:
            return load_manifest(out)
        _note(
            f"{out!r} was prepared by an older hybridpar ({old_format['format']}: each split "
            "numbered its own classes); preparing again"
        )
    return {"format": FORMAT, "splits": {}}


class FolderLock:
    """An exclusive ``flock`` on ``out``/.prepare.lock until ``release`` (or the ``with``
    block's end): two processes preparing one folder would delete and write the same shards.
    A second one says once that it waits, then goes on when the first is done. Taken again by
    the thread that holds it (the trainer's first-use check holds it around ``prepare``), it
    holds nothing more."""

    _held = threading.local()  # the folders this thread holds

    def __init__(self, out: str, unwritable: str = ""):
        """``unwritable``: where the folder's path came from and how to point it elsewhere,
        for the error where it cannot be written (default: prepare's --out)."""
        import fcntl

        self.key, self.file = os.path.realpath(out), None
        folders = self._held.__dict__.setdefault("folders", set())
        if self.key in folders:
            return
        path = os.path.join(out, ".prepare.lock")
        try:
            os.makedirs(out, exist_ok=True)
            self.file = open(path, "a")
        except OSError as e:
            fix = unwritable or (
                "the prepared data goes beside it; point --out (data.prepared_dir) at a folder "
                "you can write"
            )
            raise DataError(f"cannot write {e.filename or path} ({e.strerror}): {fix}") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _note(f"waiting: another process is preparing {out}")
            fcntl.flock(self.file, fcntl.LOCK_EX)
        folders.add(self.key)

    def release(self) -> None:
        if self.file is not None:
            self._held.folders.discard(self.key)
            self.file.close()  # unlocks
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


READERS = ".readers.lock"


class _Readers:
    """A shared ``flock`` on ``folder``/.readers.lock, one open file per folder in this
    process (a second ``hold_readers`` of one folder counts up, ``release`` counts down)."""

    _held: dict = {}  # realpath -> [file, count]
    _mutex = threading.Lock()

    def __init__(self, key: str | None):
        self.key = key

    def release(self) -> None:
        with self._mutex:
            key, self.key = self.key, None
            held = self._held.get(key) if key else None
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                del self._held[key]
                held[0].close()  # unlocks


def hold_readers(folder: str) -> _Readers:
    """Says that a training run reads the prepared ``folder`` until ``.release()``: a shared
    ``flock`` on ``folder``/.readers.lock (made if missing), which ``check_no_readers`` tests
    before prepare removes or rewrites a split there. The process's exit releases it too (an
    ``os._exit`` as well). A read-only folder without the file: nothing is held (nothing can
    prepare there either)."""
    import fcntl

    key = os.path.realpath(folder)
    with _Readers._mutex:
        held = _Readers._held.get(key)
        if held is None:
            path = os.path.join(folder, READERS)
            try:
                f = open(path, "a")
            except OSError:
                try:
                    f = open(path)  # a read-only folder where the file exists: flock works
                except OSError:
                    return _Readers(None)
            fcntl.flock(f, fcntl.LOCK_SH)  # waits only while a check holds it (an instant)
            held = _Readers._held[key] = [f, 0]
        held[1] += 1
    return _Readers(key)


def check_no_readers(folder: str, for_run: bool = False) -> None:
    """A ConfigError where another process holds ``hold_readers(folder)``: removing or
    rewriting shards there would pull them from under a running training run (or another
    tool reading the data: the evaluator). ``for_run``: a run prepares (its fix names the
    config's keys, not --out)."""
    import fcntl

    key = os.path.realpath(folder)
    with _Readers._mutex:
        held = _Readers._held.get(key)
        if held is not None:
            # This process reads it too: a second open file would conflict with our own lock,
            # so convert ours to exclusive and back (it succeeds only if no one else shares it).
            f = held[0]
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                busy = False
            except BlockingIOError:
                busy = True
            fcntl.flock(f, fcntl.LOCK_SH)  # back (a failed conversion may have dropped it)
        else:
            try:
                f = open(os.path.join(folder, READERS))
            except OSError:  # no file: never read by a run
                return
            with f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    busy = False
                except BlockingIOError:
                    busy = True
    if busy:
        raise ConfigError(
            f"{folder} is being read by another process (a training run, or a tool reading "
            "its data such as the evaluator; its shards would be removed under it); stop it "
            f"first, or prepare into another folder ({_elsewhere(for_run)})"
        )


def remove_if_unused(folder: str, parent: bool = False) -> None:
    """Removes ``folder`` where it holds nothing but the lock (a first use that failed),
    and with ``parent`` its parent folder where that is left empty."""
    try:
        if os.listdir(folder) == [".prepare.lock"]:
            os.remove(os.path.join(folder, ".prepare.lock"))
            os.rmdir(folder)
        if parent and not os.listdir(os.path.dirname(folder)):
            os.rmdir(os.path.dirname(folder))
    except OSError:  # another process uses it now
        pass


def _parse_copies(text: str):
    copies = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "full":
            copies.append(None)
        elif part.removesuffix("px").isdigit() and int(part.removesuffix("px")) > 0:
            copies.append(int(part.removesuffix("px")))
        else:
            raise DataError(f"--copies takes 'full' and max sides like 160, got {part!r}")
    return tuple(copies)


def main(argv=None) -> int:
    p = cli.ArgumentParser(
        "python -m hybridpar.input.prepare",
        (
            "Prepare image folders or tar archives (SPLIT/CLASS/FILE) once into the sharded "
            "format that data.prepared_dir reads. A rerun of the same command reuses the "
            "finished shards, so an interrupted run resumes."
        ),
        takes_config=False,
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="tar or folder: SPLIT/CLASS/FILE")
    p.add_argument("--out", required=True, help="output folder (shared by all splits)")
    p.add_argument("--copies", default="full", help="e.g. full,160: full size and a 160-px copy")
    p.add_argument("--quality", type=int, help="JPEG quality of reduced copies (default 90)")
    p.add_argument(
        "--serve-ratio",
        type=cli.finite_float,
        help="a reduced copy serves image sizes up to its side / ratio (default 1.25)",
    )
    p.add_argument(
        "--examples-per-shard",
        type=int,
        default=1024,
        help="examples in each shard file (default %(default)s); a rerun into the same --out "
        "must give the same",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count(),
        help="processes that write shards at once (default: one per CPU core, %(default)s here)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle into shards")
    p.add_argument("--split", help="SOURCE is itself one split (CLASS/FILE) with this name")
    p.add_argument(
        "--train-split", default="train", help="the split whose class folders are the classes"
    )
    p.add_argument(
        "--classes", help="the class list instead: comma-separated, or a file, one name a line"
    )
    p.add_argument(
        "--allow-empty-classes",
        action="store_true",
        help="let a train class have no usable example (an error otherwise)",
    )
    args = vars(p.parse_args(argv))  # the options are named like prepare()'s arguments
    from hybridpar.config.cli import taken

    stops = {s: signal.signal(s, _stop) for s in taken((signal.SIGTERM, signal.SIGHUP))}
    try:
        raw = args.pop("copies")
        copies = _parse_copies(raw)
        # a full-size copy is never re-encoded and serves every size: these would be unused
        for key in ("quality", "serve_ratio"):
            if args[key] is None:
                del args[key]  # prepare()'s default
            elif all(c is None for c in copies):
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{flag} is only used by reduced copies, and --copies {raw} "
                                  "makes none; pass e.g. --copies full,160 with it, or drop "
                                  "it")  # fmt: skip
        prepare(args.pop("sources"), args.pop("out"), copies, **args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = e.args[0] if isinstance(e, _Stopped) else signal.SIGINT
        name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        print(f"interrupted{name}: run the same command again to resume", file=sys.stderr)
        return 128 + signum
    finally:
        for s, handler in stops.items():
            signal.signal(s, handler)
    return 0


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, taken as Ctrl-C is: the finally blocks run (the pool stopped, a
    compressed tar's staging copy removed), and the line says how to resume."""


def _stop(signum, frame):
    from hybridpar.config.cli import leave_hung_up_terminal

    for s in (signal.SIGTERM, signal.SIGHUP):  # a second one ends it at once, as a 2nd Ctrl-C
        if signal.getsignal(s) is _stop:
            signal.signal(s, signal.SIG_DFL)
    leave_hung_up_terminal(signum)
    raise _Stopped(signum)


if __name__ == "__main__":
    sys.exit(main())
