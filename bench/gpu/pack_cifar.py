"""CIFAR-10's JPEG tars as one file that fits a device call, and back, every image unchanged.

    python bench/gpu/pack_cifar.py pack   [--src DIR] [--out bench/gpu/data] [--per-class N]
    python bench/gpu/pack_cifar.py unpack [--pack bench/gpu/data] --dest DIR
    python bench/gpu/pack_cifar.py sizes  [--carry PATH ...]

The lent GPU machine takes at most 64 MiB of files with a command, and the tars
(train.tar 77 MB, test.tar 15 MB) are mostly tar headers and padding around some 53 MiB of
JPEG bytes. ``pack`` writes each regular member's bytes unchanged, one after another, into
``cifar10.pack`` and what a tar needs besides (names, offsets, sizes, modes, times, a
per-file hash, each source tar's sha256) into ``cifar10.index.json.gz``. ``unpack`` writes
the same SPLIT/CLASS/FILE tars again, checking every file's hash first (a damaged pack is
refused, naming the file); from a whole tar (no ``--per-class``) the rebuilt tar is checked
against the source tar's sha256 as well (GNU format, as the shared tars are).
``--per-class N``: the first N images of each class of each split (a smoke test's subset).

``sizes``: what a device call would carry: the files git sends (tracked, and untracked
ones it does not ignore) plus the ``--carry`` paths, against the 64 MiB limit (exit 1 over).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORMAT = "hybridpar-cifar-pack-1"
PACK, INDEX = "cifar10.pack", "cifar10.index.json.gz"
TARS = ("train.tar", "test.tar")
LIMIT = 64 * 2**20  # what one device call may send
HASH_HEX = 16  # 64 bits of sha256 per file: enough to catch damage, small in the index
CARRY = ("bench/gpu/wheels", "bench/gpu/data", "bench/gpu/peers", "bench/gpu/compiled")


class PackError(Exception):
    pass


def default_src() -> Path:
    return Path(os.environ.get("HYBRIDPAR_DATA", ROOT.parent / "shared" / "data")) / "cifar10-jpeg"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:HASH_HEX]


# tar header fields that must be the same for every member (kept once per tar): the shared
# tars have one owner and no user names; another tar is refused rather than rebuilt wrongly
COMMON = ("uid", "gid", "uname", "gname", "linkname", "devmajor", "devminor")


def pack(src: Path, out: Path, per_class: int = 0, tars=TARS) -> dict:
    """Writes ``out/cifar10.pack`` and ``out/cifar10.index.json.gz``; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    sums = {}
    if (src / "SHA256SUMS").is_file():
        for line in (src / "SHA256SUMS").read_text().splitlines():
            if line.strip():
                digest, name = line.split()
                sums[name.lstrip("*")] = digest
    index = {"format": FORMAT, "per_class": per_class, "tars": []}
    offset = 0
    tmp = out / (PACK + ".tmp")
    with open(tmp, "wb") as blob:
        for name in tars:
            path = src / name
            digest = sha256_file(path)
            if name in sums and sums[name] != digest:
                raise PackError(f"{path}: sha256 {digest} is not SHA256SUMS' {sums[name]}")
            members, common, taken = [], None, {}
            with tarfile.open(path) as tf:
                for m in tf:
                    info = {k: getattr(m, k) for k in COMMON}
                    if common is None:
                        common = info
                    elif info != common:
                        raise PackError(f"{path}: {m.name} has other owner fields than the rest")
                    if m.isdir():
                        members.append([m.name, "d", m.mode, m.mtime])
                        continue
                    if not m.isfile():
                        raise PackError(f"{path}: {m.name} is neither a file nor a folder")
                    cls = os.path.dirname(m.name)
                    if per_class and taken.get(cls, 0) >= per_class:
                        continue
                    taken[cls] = taken.get(cls, 0) + 1
                    data = tf.extractfile(m).read()
                    blob.write(data)
                    members.append(
                        [m.name, "f", m.mode, m.mtime, offset, len(data), file_hash(data)]
                    )
                    offset += len(data)
            index["tars"].append(
                {"name": name, "sha256": digest, "common": common or {}, "members": members}
            )
    os.replace(tmp, out / PACK)
    index["pack_bytes"] = offset
    index["pack_sha256"] = sha256_file(out / PACK)
    with gzip.open(out / (INDEX + ".tmp"), "wt") as f:
        json.dump(index, f, separators=(",", ":"))
    os.replace(out / (INDEX + ".tmp"), out / INDEX)
    return index


def read_index(pack_dir: Path) -> dict:
    try:
        with gzip.open(pack_dir / INDEX, "rt") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise PackError(f"{pack_dir / INDEX}: not a pack index ({e})") from None
    if index.get("format") != FORMAT:
        raise PackError(f"{pack_dir / INDEX}: format {index.get('format')!r}, not {FORMAT}")
    return index


def unpack(pack_dir: Path, dest: Path) -> dict:
    """Rebuilds the tars into ``dest``, every file checked; returns ``{tar: how checked}``.
    Raises ``PackError`` naming the first damaged file (nothing half-written is left)."""
    index = read_index(pack_dir)
    blob_path = pack_dir / PACK
    if not blob_path.is_file() or blob_path.stat().st_size != index["pack_bytes"]:
        raise PackError(f"{blob_path}: missing or not {index['pack_bytes']} bytes")
    dest.mkdir(parents=True, exist_ok=True)
    checked = {}
    with open(blob_path, "rb") as blob:
        for t in index["tars"]:
            buf = io.BytesIO()
            files = 0
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as out:
                for entry in t["members"]:
                    name, kind, mode, mtime = entry[:4]
                    info = tarfile.TarInfo(name)
                    info.mode, info.mtime = mode, mtime
                    for k, v in t["common"].items():
                        setattr(info, k, v)
                    if kind == "d":
                        info.type = tarfile.DIRTYPE
                        out.addfile(info)
                        continue
                    offset, size, want = entry[4:7]
                    blob.seek(offset)
                    data = blob.read(size)
                    if len(data) != size or file_hash(data) != want:
                        raise PackError(
                            f"{blob_path}: {name} (bytes {offset}..{offset + size}) does not "
                            "match its hash in the index: the pack is damaged; pack it again"
                        )
                    info.size = size
                    out.addfile(info, io.BytesIO(data))
                    files += 1
            raw = buf.getvalue()
            whole = not index.get("per_class")
            if whole and hashlib.sha256(raw).hexdigest() != t["sha256"]:
                raise PackError(
                    f"{t['name']}: rebuilt, its sha256 is not the source tar's {t['sha256']}"
                )
            tmp = dest / (t["name"] + ".tmp")
            tmp.write_bytes(raw)
            os.replace(tmp, dest / t["name"])
            checked[t["name"]] = (
                f"{files} files, each hash checked"
                + (", the tar byte-identical to the source (sha256)" if whole else " (a subset)")
            )
    return checked


def tree_bytes() -> int:
    """Bytes of the files a device call sends from the checkout: tracked, and untracked but
    not ignored (as git lists them), that exist now."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    total = 0
    for name in set(out.decode().split("\0")):
        p = ROOT / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def sizes(carry=CARRY) -> tuple[int, list[str]]:
    """``(total bytes, lines)``: the checkout and each carried path, against ``LIMIT``."""
    tree = tree_bytes()
    lines = [f"checkout (git's tracked + untracked, not ignored): {tree / 2**20:8.2f} MiB"]
    total = tree
    for c in carry:
        p = ROOT / c
        n = path_bytes(p) if p.exists() else 0
        total += n
        lines.append(f"{c + ':':<52}{n / 2**20:8.2f} MiB" + ("" if p.exists() else " (absent)"))
    verdict = "fits" if total <= LIMIT else "OVER"
    lines.append(f"total {total / 2**20:.2f} MiB of {LIMIT / 2**20:.0f} MiB: {verdict}")
    return total, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--src", type=Path, default=None, help="folder of train.tar and test.tar")
    a.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu" / "data")
    a.add_argument("--per-class", type=int, default=0, help="first N images per class (0: all)")
    a.add_argument("--tars", default=",".join(TARS))
    b = sub.add_parser("unpack")
    b.add_argument("--pack", type=Path, default=ROOT / "bench" / "gpu" / "data")
    b.add_argument("--dest", type=Path, required=True)
    s = sub.add_parser("sizes")
    s.add_argument("--carry", nargs="*", default=list(CARRY))
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            src = args.src or default_src()
            idx = pack(src, args.out, args.per_class, tuple(args.tars.split(",")))
            files = sum(len([m for m in t["members"] if m[1] == "f"]) for t in idx["tars"])
            print(f"packed {files} files, {idx['pack_bytes'] / 2**20:.2f} MiB, from {src} "
                  f"into {args.out}")  # fmt: skip
            total, lines = sizes()
            print("\n".join(lines))
            return 0 if total <= LIMIT else 1
        if args.cmd == "unpack":
            for name, how in unpack(args.pack, args.dest).items():
                print(f"{args.dest / name}: {how}")
            return 0
        total, lines = sizes(args.carry)
        print("\n".join(lines))
        return 0 if total <= LIMIT else 1
    except (PackError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
