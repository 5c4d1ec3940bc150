"""bench/gpu/e2e.sh, the prepared GPU call, kept from rotting between GPU runs: its smoke on
CPU (every section, tiny shapes), its CIFAR-10 pack's round trip, and its own arithmetic."""

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

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


def fine(ctx):
    s = e2e.Section("b", "(b) fine")
    s.say("ran")
    s.ratios["ratio_x"] = 1.5
    return s


def fake_probe(platform="cpu", kind="cpu"):
    return lambda work: {"platform": platform, "kind": kind}


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """e2e.main in this process on fake sections and a fake probe (no JAX process): its
    scratch folders in tmp_path, its $OUT unset, the variables --smoke sets put back."""
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(e2e.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(e2e, "SECTIONS", {"b": fine})
    monkeypatch.setattr(e2e, "PROBE_FN", fake_probe())


def test_a_failing_section_leaves_the_others_and_says_so(tmp_path, monkeypatch, in_process):
    def broken(ctx):
        raise RuntimeError("boom in (a)")

    monkeypatch.setattr(e2e, "SECTIONS", {"a": broken, "b": fine})
    out = tmp_path / "r.txt"
    rc = e2e.main(["--smoke", "--sections", "a,b", "--jobs", "1", "--work", str(tmp_path / "w"),
                   "--out", str(out), "--copy-to", str(tmp_path / "copy")])  # fmt: skip
    text = out.read_text()
    assert "FAILED: RuntimeError: boom in (a)" in text and "\nran\n" in text
    last = text.strip().splitlines()[-1].split()
    assert last[0] == "ratio_x=1.5" and "failed=a" in last and "incomplete=1" not in last
    assert (tmp_path / "copy" / "r.txt").read_text() == text
    assert rc == 1  # the file holds what ran; the status says that not all of it did


def test_exit_status_is_1_where_a_section_lacks_its_input(tmp_path, monkeypatch, capsys,
                                                          in_process):  # fmt: skip
    """(b) without CIFAR-10 says so, names the fix and makes the exit status 1; the result
    file is written all the same. A run where every section ran exits 0."""
    monkeypatch.setattr(e2e, "SECTIONS", {"a": fine, "b": e2e.section_b})
    monkeypatch.setenv("HYBRIDPAR_DATA", str(tmp_path / "nowhere"))
    out = tmp_path / "r.txt"
    rc = e2e.main(["--smoke", "--sections", "a,b", "--out", str(out)])
    text = out.read_text()
    assert "SKIPPED: no CIFAR-10 tars in" in text and "set HYBRIDPAR_DATA" in text
    last = dict(kv.split("=", 1) for kv in text.strip().splitlines()[-1].split())
    assert last["skipped"] == "b" and last["failed"] == "none"
    assert rc == 1 and "(b) skipped: no CIFAR-10 tars" in capsys.readouterr().out
    assert e2e.main(["--smoke", "--sections", "a", "--out", str(tmp_path / "r2.txt")]) == 0


def test_a_run_at_its_time_cap_says_so(tmp_path):
    p = e2e.run("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, 1)
    assert p.timed_out and p.error_line().startswith("hit its time cap of 1s"), p.error_line()
    # a cap under a second (the budget spent): not started at all, and said the same way
    p = e2e.run("late", [sys.executable, "-c", "print('ran')"], tmp_path, 0.0)
    assert p.rc is None and "hit its time cap of 0s" in p.error_line()
    assert "not started" in (tmp_path / "logs" / "late.log").read_text()


def test_a_folder_of_the_users_is_never_cleared(tmp_path, capsys, in_process):
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "important.txt").write_text("keep me")
    out = tmp_path / "r.txt"
    rc = e2e.main(["--smoke", "--sections", "b", "--work", str(mine), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --work") and len(err.splitlines()) == 1, err
    assert [p.name for p in mine.iterdir()] == ["important.txt"] and not out.exists()
    # a folder this script made (its marker) is cleared and used again
    assert e2e.main(["--smoke", "--sections", "b", "--work", str(tmp_path / "w"),
                     "--out", str(out)]) == 0  # fmt: skip
    (tmp_path / "w" / "stale.txt").write_text("from the run before")
    assert e2e.main(["--smoke", "--sections", "b", "--work", str(tmp_path / "w"),
                     "--out", str(out), "--overwrite"]) == 0  # fmt: skip
    assert not (tmp_path / "w" / "stale.txt").exists()
    assert (tmp_path / "w" / e2e.MARKER).is_file()
    # by default a new folder each run: two at once never share one
    for _ in range(2):
        assert e2e.main(["--smoke", "--sections", "b"]) == 0
    made = sorted(tmp_path.glob("hybridpar-e2e-smoke-*"))
    assert len(made) == 2 and all((d / e2e.MARKER).is_file() for d in made)
    assert all(len(list(d.glob("e2e_cpu_*_smoke.txt"))) == 1 for d in made)


@pytest.mark.parametrize(
    "argv, probe, says",
    [
        (["--sections", "b", "--out", "{existing}"], "gpu",
         "--out {existing} exists: give a new file, or add --overwrite"),
        (["--sections", "b"], "cpu", "JAX's default backend here is cpu (cpu), not a GPU, and "
         "this call measures one: bash bench/gpu/e2e.sh --smoke"),
        (["--sections", "b,x"], "gpu", "--sections 'b,x': unknown x"),
        (["--smoke", "--sections", "b", "--cifar-runs", "0"], "cpu",
         "--cifar-runs 0: give 1 or more"),
    ],
)  # fmt: skip
def test_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, in_process, argv,
                                            probe, says):  # fmt: skip
    existing = tmp_path / "old.txt"
    existing.write_text("a result of this morning")
    kind = "NVIDIA H100 80GB HBM3" if probe == "gpu" else "cpu"
    monkeypatch.setattr(e2e, "PROBE_FN", fake_probe(probe, kind))
    monkeypatch.setattr(e2e, "ROOT", tmp_path / "checkout")  # a default --out lands there
    work = tmp_path / "work"
    work.mkdir()  # given and empty: it stays, empty
    argv = [a.format(existing=existing) for a in argv]
    rc = e2e.main([*argv, "--work", str(work)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: " + says.format(existing=existing)), err
    assert list(work.iterdir()) == [] and not (tmp_path / "checkout").exists()
    assert existing.read_text() == "a result of this morning"


def test_a_second_try_of_the_device_call_writes_a_file_of_its_own(tmp_path, monkeypatch,
                                                                 in_process):  # fmt: skip
    """The device call names no --out: the default name holds the time (and a number
    where even that is taken), so a retry on a machine that kept the first's file works;
    an --out given is replaced only with --overwrite."""
    monkeypatch.setattr(e2e, "PROBE_FN", fake_probe("gpu", "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(e2e, "ROOT", tmp_path / "checkout")
    for _ in range(2):
        assert e2e.main(["--sections", "b", "--copy-to", str(tmp_path / "OUT")]) == 0
    made = sorted((tmp_path / "checkout" / "bench" / "results" / "gpu").iterdir())
    assert len(made) == 2 and all(p.name.startswith("e2e_h100_") for p in made), made
    out = tmp_path / "r.txt"
    out.write_text("old")
    assert e2e.main(["--sections", "b", "--out", str(out), "--overwrite"]) == 0
    assert out.read_text().startswith("# bash bench/gpu/e2e.sh,")


def run_of_ours(train_s, top1, complete=True, to_target=None):
    return dict(train_s=train_s, final_top1=top1, complete=complete, to_target=to_target)


def theirs(t, acc):
    return dict(total_time_seconds=t, tta_val_acc=acc)


def test_cifar_comparison_is_over_the_same_number_of_runs_a_side():
    ours = [run_of_ours(10.0, 0.941), run_of_ours(12.0, 0.939), run_of_ours(11.0, 0.942)]
    ab = [theirs(3.0, 0.930), theirs(5.0, 0.931), theirs(4.0, 0.932)]  # (not ours: a swap shows)
    lines, figs, ratios = e2e.compare_cifar(ours, ab, 3)
    assert ratios == {"ratio_c10_train_vs_airbench": round(11.0 / 4.0, 3)}
    assert figs == {"compared_runs": 3} and not any("ONLY" in ln for ln in lines)
    assert "final top-1 0.9410 against 0.9310" in lines[-1]
    # one of ours complete (the budget stopped the next): against airbench's first run, and
    # the table and the result line say so
    ours[1]["complete"] = False
    lines, figs, ratios = e2e.compare_cifar(ours[:2], ab, 3)
    assert ratios == {"ratio_c10_train_vs_airbench": round(10.0 / 3.0, 3)}
    assert figs == {"compared_runs": 1}
    assert any(ln.startswith("ONLY 1 run(s) a side of the 3 asked") for ln in lines), lines
    # a run that never reached the target counts as slower than any
    assert e2e.median_time([3.0, None, 5.0]) == 5.0 and e2e.median_time([3.0, None]) == "none"


def test_cifar_section_runs_each_seed_and_counts_the_complete_ones(tmp_path, monkeypatch):
    """(b) on fake runs: seeds 0 and 1 train their schedule, seed 2 stops at its time cap:
    the medians are over the first two, the table says the third stopped; on a GPU run,
    airbench94 missing is an input the section lacks."""

    def fake_train(name, args, work, timeout, env=None):
        seed = int(name.removeprefix("b_cifar"))
        assert f"--config.seed={seed}" in args and "--config.stop_at_target=True" not in args
        top1 = 0.94 + seed / 1000
        reached = {"epoch": 10.0, "wall_s": 30.0 + seed, "wall_s_without_compile": 10.0 + seed}
        rec = {"metrics": [{"event": "eval", "epoch": 10.0, "top1": top1, "wall_s": 30.0}],
               "summary": {"completed": True, "final_eval": {"top1": top1},
                           "time_breakdown": {"train": 8.0 + seed, "eval": 1.0},
                           "time_to_target": {"top1": reached}, "compile_s": 20.0,
                           "wall_s": 31.0, "steps": 100, "total_steps": 100}}  # fmt: skip
        capped = seed == 2 or capped_from == 0
        rec["summary"]["completed"] = not capped
        return e2e.Proc(name, 0, 35.0, capped, tmp_path / "x.log", timeout), rec

    capped_from = 2
    monkeypatch.setattr(e2e, "train", fake_train)
    monkeypatch.setattr(e2e, "cifar_data", lambda ctx, s: tmp_path / "c10")
    monkeypatch.setattr(e2e, "decode_tars", lambda folder: {"train_label": [], "test_label": []})
    monkeypatch.setattr(e2e, "same_pixels", lambda decoded, prepared: "not checked")
    ctx = types.SimpleNamespace(smoke=False, work=tmp_path, budget=e2e.Budget(10_000),
                                cifar_runs=3, peers=tmp_path)  # fmt: skip
    s = e2e.section_b(ctx)
    text = "\n".join(s.lines)
    assert s.error is None and s.missing.startswith("airbench94: "), text
    assert s.figs["c10_runs"] == 2 and s.figs["c10_reached"] == "2/2", s.figs
    assert s.figs["c10_train_s"] == 9.5 and s.figs["c10_top1_final"] == 0.9405
    assert s.figs["c10_tta_no_compile_s"] == 10.5 and s.figs["c10_tta_dawnbench_s"] == 30.0
    assert "seed 2: hit its time cap" in text and "   2     stopped" in text, text
    capped_from = 0  # the first run capped: none complete, the section failed, said once
    s = e2e.section_b(ctx)
    assert s.error.startswith("no run of ours trained its whole schedule: hit its time cap")
    assert s.figs["c10_runs"] == 0 and "c10_train_s" not in s.figs


def test_prepare_without_the_cuda_plugin_skips_its_compiles_and_says_how(
    tmp_path, monkeypatch, capsys
):
    """--prepare where jax's CUDA plugin is missing: one line saying how to install it, no
    compile tried, exit 0; a missing bench/gpu/wheels/ is named with its fix, exit 1."""
    plugin = tmp_path / "aot" / "jax_cuda12_plugin"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert e2e.gpu_aot_missing(dict(env, PYTHONPATH=str(tmp_path / "aot"))) is None
    why = 'needs jax\'s CUDA plugin, not installed here: pip install -e ".[gpu-aot]"'
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        assert why in e2e.gpu_aot_missing(env)
    monkeypatch.setattr(e2e, "gpu_aot_missing", lambda env: why + " ... --gpu-aot-path DIR")
    monkeypatch.setattr(e2e, "ROOT", tmp_path / "checkout")
    monkeypatch.setattr(e2e, "GPU_DIR", tmp_path / "checkout" / "bench" / "gpu")
    monkeypatch.setattr(e2e.pack_cifar, "sizes", lambda: (1, [
        "bench/gpu/wheels:  0.00 MiB (absent)", "bench/gpu/data:  50.00 MiB"]))  # fmt: skip
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / e2e.pack_cifar.INDEX).write_text("")  # packed before
    argv = ["--prepare", "--pack", str(pack), "--peers", str(tmp_path), "--work",
            str(tmp_path / "w")]  # fmt: skip
    (tmp_path / "checkout" / "bench" / "gpu" / "wheels").mkdir(parents=True)
    assert e2e.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("compiled files: skipped: " + why) == 1 and "failed" not in out, out
    assert not (tmp_path / "checkout" / "bench" / "gpu" / "compiled").exists()
    (tmp_path / "checkout" / "bench" / "gpu" / "wheels").rmdir()
    assert e2e.main(argv) == 1
    out = capsys.readouterr().out
    assert "bench/gpu/wheels:  0.00 MiB MISSING: run bash bench/gpu/wheels.sh" in out, out


def test_e2e_takes_a_relative_python_and_names_a_missing_one():
    """``PYTHON=.venv/bin/python bash bench/gpu/e2e.sh``: the script checks the install from
    ``/``, where a relative path names nothing, and said 'hybridpar is not installed'. The
    path is the caller's, resolved first; one that is no executable is said as that.
    Planted bug that fails it: no resolution (the old line, rc 2)."""
    exe = Path(sys.executable)  # (a venv's: its folder names it, not a link elsewhere)
    relative = f"{exe.parent.name}/{exe.name}"
    script = str(ROOT / "bench" / "gpu" / "e2e.sh")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for python, rc, says in ((relative, 0, "usage: e2e.py"),
                             ("bin/nothing", 2, "error: PYTHON=bin/nothing is not an executable")):
        r = subprocess.run(["bash", script, "--help"], env=dict(env, PYTHON=python),
                           cwd=exe.parent.parent, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert r.returncode == rc and says in r.stdout, (r.stdout, r.stderr)


def test_e2e_smoke_runs_every_section(tmp_path):
    """The whole script on CPU: the train CLI for digits,
    CIFAR-10 on device-resident data from a packed and unpacked subset (two seeds), the
    ResNet stages against the step bench, the compile tool's file loaded; no section may
    fail or lack an input."""
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
    assert figs["failed"] == "none" and figs["skipped"] == "none", text
    assert figs["smoke"] == "1" and "incomplete" not in figs
    # (d): the executables the compile tool wrote give (a)'s losses at every step
    assert int(figs["loaded_device_steps"]) > 0
    assert figs["loaded_device_equal"] == figs["loaded_device_steps"], text
    # (b): the fixed schedule on two seeds, the final top-1 the median of both
    assert figs["c10_runs"] == "2" and "c10_top1_final" in figs, text
    # (b): airbench's pixels are hybridpar's own (its on-device cache), image for image
    assert "the same as hybridpar's? yes: all 400 images and labels" in text, text
    assert "torch is not installed here" in text or "airbench_s" in figs
    # (c): every stage timed in the trainer and in the step bench, which reused its programs
    assert {"resnet_ips_32", "step_ips_32", "resnet_ips_40", "switch_gap_steps_1"} <= set(figs)
    assert "0 new compile-cache files" in text, text
