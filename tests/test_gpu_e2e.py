"""bench/gpu/e2e.sh, the prepared GPU call, kept from rotting between GPU runs: its smoke on
CPU (every section, tiny shapes), its CIFAR-10 pack's round trip, and its own arithmetic."""

import hashlib
import io
import os
import subprocess
import sys
import tarfile

import pytest
from helpers import NO_LLVM_OPT_FLAG, ROOT, require_shared_data
from xla_flags import FAST_CPU_COMPILE

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import e2e  # noqa: E402
import pack_cifar  # noqa: E402


def gnu_tar(path, files: dict, mtime=1577836800):
    """A tar laid out as the shared ones: GNU format, a folder entry before its files."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        folders = sorted({os.path.dirname(n) for n in files} | {n.split("/")[0] for n in files})
        for d in folders:
            info = tarfile.TarInfo(d + "/")
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
            tf.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tf.addfile(info, io.BytesIO(data))


def members(path) -> dict:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pack_round_trip_is_byte_identical_and_refuses_a_damaged_pack(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = __import__("random").Random(0)
    for split, n in (("train", 12), ("test", 5)):
        files = {f"{split}/{c}/{i:04d}.jpg": rng.randbytes(rng.randrange(1, 3000))
                 for c in ("cat", "dog") for i in range(n)}  # fmt: skip
        gnu_tar(src / f"{split}.tar", files)
    (src / "SHA256SUMS").write_text(
        "".join(f"{sha256(src / t)}  {t}\n" for t in pack_cifar.TARS)
    )
    pack_cifar.pack(src, tmp_path / "pack")
    checked = pack_cifar.unpack(tmp_path / "pack", tmp_path / "out")
    for t in pack_cifar.TARS:  # the whole tar, headers and padding included
        assert sha256(tmp_path / "out" / t) == sha256(src / t)
        assert "byte-identical" in checked[t]
    # negative control: one byte of one image changed in the pack is refused, by name
    blob = bytearray((tmp_path / "pack" / pack_cifar.PACK).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (tmp_path / "pack" / pack_cifar.PACK).write_bytes(bytes(blob))
    with pytest.raises(pack_cifar.PackError, match=r"\.jpg .*does not match its hash"):
        pack_cifar.unpack(tmp_path / "pack", tmp_path / "out2")
    # ... and a source tar that is not the one SHA256SUMS names is not packed
    (src / "SHA256SUMS").write_text(f"{'0' * 64}  train.tar\n")
    with pytest.raises(pack_cifar.PackError, match="SHA256SUMS"):
        pack_cifar.pack(src, tmp_path / "pack3")


def test_pack_subset_of_the_shared_tars_keeps_every_image(tmp_path):
    data = require_shared_data("cifar10-jpeg/test.tar") / "cifar10-jpeg"
    pack_cifar.pack(data, tmp_path / "pack", per_class=3, tars=("test.tar",))
    pack_cifar.unpack(tmp_path / "pack", tmp_path / "out")
    got, full = members(tmp_path / "out" / "test.tar"), members(data / "test.tar")
    assert len(got) == 30 and len({n.split("/")[1] for n in got}) == 10
    assert all(full[n] == b for n, b in got.items())


def test_switch_gap_and_rates_from_records():
    """Stage 0 at 0.1 s a step (batch 4), a 2 s wait at the switch, stage 1 at 0.05 s a
    step (batch 2): the gap is the time between the two stages' lines less the steps in it."""
    rec = {"metrics": [
        {"event": "stage", "step": 0, "wall_s": 10.0, "stage": 0, "image_size": 128,
         "global_batch": 4, "steps": 30},
        {"event": "train", "step": 10, "wall_s": 12.0, "stage": 0, "images_per_s": 20.0},
        {"event": "train", "step": 20, "wall_s": 13.0, "stage": 0, "images_per_s": 40.0},
        {"event": "train", "step": 30, "wall_s": 14.0, "stage": 0, "images_per_s": 40.0},
        {"event": "compile", "program": "train", "batch": 2, "image_size": 224,
         "compile_s": 9.0, "background": True, "wait_s": 2.0},
        {"event": "stage", "step": 30, "wall_s": 16.0, "stage": 1, "image_size": 224,
         "global_batch": 2, "steps": 20},
        {"event": "train", "step": 35, "wall_s": 17.0, "stage": 1, "images_per_s": 10.0},
        {"event": "train", "step": 50, "wall_s": 17.75, "stage": 1, "images_per_s": 40.0},
    ]}  # fmt: skip
    s0, s1 = e2e.stage_rates(rec)
    assert s0["rate"] == pytest.approx(40.0) and s0["gap"] is None
    assert s1["rate"] == pytest.approx(40.0) and s1["step_s"] == pytest.approx(0.05)
    assert s1["gap"] == pytest.approx((17.0 - 14.0) - 5 * 0.05)
    assert s1["wait_s"] == 2.0 and s1["background"] is True


def test_a_failing_section_leaves_the_others_and_says_so(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom in (a)")

    def fine(ctx):
        s = e2e.Section("b", "(b) fine")
        s.say("ran")
        s.ratios["ratio_x"] = 1.5
        return s

    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):  # --smoke sets them in this process
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.setattr(e2e, "SECTIONS", {"a": broken, "b": fine})
    monkeypatch.setattr(e2e, "PROBE_FN", lambda work: {"platform": "cpu", "kind": "cpu"})
    out = tmp_path / "r.txt"
    e2e.main(["--smoke", "--sections", "a,b", "--jobs", "1", "--work", str(tmp_path / "w"),
              "--out", str(out), "--copy-to", str(tmp_path / "copy")])  # fmt: skip
    text = out.read_text()
    assert "FAILED: RuntimeError: boom in (a)" in text and "\nran\n" in text
    last = text.strip().splitlines()[-1].split()
    assert last[0] == "ratio_x=1.5" and "failed=a" in last and "incomplete=1" not in last
    assert (tmp_path / "copy" / "r.txt").read_text() == text


def test_e2e_smoke_runs_every_section(tmp_path):
    """The whole script on CPU (about 1.5 minutes on 2 cores): the train CLI for digits,
    CIFAR-10 on device-resident data from a packed and unpacked subset, the ResNet stages
    against the step bench, the compile tool's file loaded; no section may fail."""
    require_shared_data("cifar10-jpeg/train.tar", "cifar10-jpeg/test.tar")
    out = tmp_path / "e2e.txt"
    drop = ("OUT", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")  # e2e measures compiles
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # Every process of the smoke compiles without LLVM's optimisations (a large part of a
    # CPU compile, most of the smoke's time): a smoke's figures say nothing about speed, and
    # every run, compile and cached program in it gets the same flag.
    env["XLA_FLAGS"] = f"{NO_LLVM_OPT_FLAG} {FAST_CPU_COMPILE}"
    env["PYTHON"] = sys.executable  # the suite's Python, whichever python3 is on PATH
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "e2e.sh"), "--smoke", "--work",
         str(tmp_path / "work"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    for title in ("== (a) digits", "== (b) CIFAR-10", "== (c) ResNet-50", "== (d) a compiled"):
        assert title in text, text
    figs = dict(kv.split("=", 1) for kv in text.strip().splitlines()[-1].split())
    assert next(iter(figs)).startswith("ratio_"), figs
    assert figs["failed"] == "none", text
    assert figs["smoke"] == "1" and "incomplete" not in figs
    # (d): the executables the compile tool wrote give (a)'s losses at every step
    assert int(figs["loaded_device_steps"]) > 0
    assert figs["loaded_device_equal"] == figs["loaded_device_steps"], text
    # (b): airbench's pixels are hybridpar's own (its on-device cache), image for image
    assert "the same as hybridpar's? yes: all 400 images and labels" in text, text
    assert "torch is not installed here" in text or "airbench_s" in figs
    # (c): every stage timed in the trainer and in the step bench, which reused its programs
    assert {"resnet_ips_32", "step_ips_32", "resnet_ips_40", "switch_gap_steps_1"} <= set(figs)
    assert "0 new compile-cache files" in text, text
