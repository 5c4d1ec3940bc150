"""The trainer on one GPU, end to end, in one call: bench/gpu/e2e.sh runs this.

    bash bench/gpu/e2e.sh [--budget-s 480] [--sections a,b,c,d] [--out FILE]   # the GPU machine
    bash bench/gpu/e2e.sh --smoke [--work DIR] [--out FILE]    # CPU, tiny shapes, 1-3 minutes
    bash bench/gpu/e2e.sh --prepare      # here, before a device call: data pack, compiled files

Everything trains through the train CLI (``python -m hybridpar.train``, in
``bench/gpu/train_peak.py`` so that the device's memory peak can be read after it) and is
read back from the runs' own records (``metrics.jsonl``, ``summary.json``):

(a) digits: the README's main job (``experiments/digits.py``) to its target: top-1, wall,
    compile, time to target. Logged every step (``log_every_s`` changes no program), so that
    (d) can compare losses step by step.
(b) CIFAR-10: ``experiments/cifar10_fast.py``'s ``gpu`` variant with
    ``data.on_device=True``, its fixed schedule, ``--cifar-runs`` times (seeds 0.., the
    later runs loading the first one's programs from a compile cache): the first eval at 94%
    test top-1 timed as DAWNBench times (from the start of the run: set-up, compilation and
    evaluation included) and without compilation; the final top-1 and the schedule's time on
    airbench's clock (its train steps and one evaluation). Beside it, as many runs of
    airbench's own ``airbench94.py`` (PyTorch; a peer carried in the ignored
    bench/gpu/peers/) on the same pixels: the tars decoded here with Pillow, checked against
    hybridpar's own on-device cache of them. The two sides' medians are compared over the
    same number of runs (fewer than asked where the budget cut one side short: the table and
    the result line say so). The tars travel as one pack of their unchanged JPEG bytes
    (bench/gpu/pack_cifar.py), rebuilt there byte for byte.
(c) ResNet-50: the DAWNBench recipe's three stages (128 px batch 224, 224 px 224, 288 px
    128; ``resnet50_imagenet_dawnbench.py:,1``) on synthetic data through the trainer, the
    first stage long enough for the later stages to compile in the background
    (``compile_ahead``): images/s per stage against bench/gpu/resnet50_gpu.py's step at the
    same size and batch (same recipe, same compile cache: the same programs), the gap at
    each stage switch beyond its steps, goodput, and the predicted memory against the peak.
(d) A compiled program: the digits job compiled here for ``gpu:h100-1`` / ``gpu:h200-1``
    (``--prepare``) and loaded there with ``train --compiled``; and the same compiled on the
    device by ``python -m hybridpar.compile --out`` and loaded: its losses against (a)'s,
    which compiled on the device, and each compile's per-GPU memory against the peak.

Each section is guarded (a failure is its error and the tail of its log, the others run),
and every run has a time cap from ``--budget-s`` (a run that reaches it gets SIGTERM, which
the trainer answers with a checkpoint and its records; what it reached is reported). The
result file is written again after each section (a kill leaves the sections done), ends
with one key=value line, ratios first (``failed=`` and ``skipped=`` name the sections that
failed or lacked an input), and with ``--copy-to`` (e2e.sh passes ``$OUT``) is copied
there with the runs' records and logs. Exit status: 0 where every section asked for ran
whole, 1 where one failed or lacked an input (the file still holds what ran), 2 for a
refusal before anything ran: an unknown section, an existing ``--out`` (``--overwrite``),
a ``--work`` folder holding files this script did not make (it clears only folders it made
and marked, and by default makes a new one in /tmp), or, without ``--smoke``, a machine
whose JAX backend is not a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / "bench" / "gpu"
PY = sys.executable
EXP = ROOT / "experiments"
sys.path.insert(0, str(GPU_DIR))
import pack_cifar  # noqa: E402  (JAX-free)

CIFAR_TARGET = 0.94

# ---- What each section runs: one place, so --prepare compiles exactly what the device loads --


def digits_args(smoke: bool) -> list[str]:
    args = ["--config", str(EXP / "digits.py"), "--config.log_every_s=0"]
    if smoke:  # a few steps of a narrower net: the path, not the accuracy
        args += ["--config.num_epochs=0.5", "--config.eval_every_epochs=0.5",
                 "--config.model.num_filters=4"]  # fmt: skip
    return args


def cifar_args(smoke: bool, prepared: Path, seed: int, cache: Path) -> list[str]:
    # the fixed schedule, as airbench94 runs its own: the first eval at the target is read
    # from the records, and the final top-1 is the schedule's
    args = [
        "--config", str(EXP / "cifar10_fast.py") + ":gpu",
        "--config.data.on_device=True",
        f"--config.seed={seed}",
        f"--config.compile_cache={cache}",
        f"--config.data.prepared_dir={prepared}",
        "--config.log_every_s=1",
    ]  # fmt: skip
    if smoke:
        args += ["--config.model.num_filters=8", "--config.stages=1:24-32@0.5,2:32-16",
                 "--config.num_epochs=2", "--config.eval_batch=100",
                 "--config.global_batch=32"]  # fmt: skip
    return args


# ResNet-50, DAWNBench stages: (size, per-GPU batch, min crop scale, steps). An epoch of the
# synthetic set is 10 steps at batch 224, so the first stage ends at epoch 200 and the LR
# warmup and momentum ramp keep about the recipe's shares of it (2 and 21 of 44 epochs: 1/20, 1/2).
RESNET_STAGES = ((128, 224, 0.08, 2000), (224, 224, 0.087, 200), (288, 128, 0.5, 170))
RESNET_SMOKE = ((32, 4, 0.08, 6), (40, 2, 0.5, 4))  # two stages: one switch to check
RESNET_EXAMPLES = {False: 2240, True: 16}


def resnet_overrides(smoke: bool) -> list[tuple[str, str]]:
    stages = RESNET_SMOKE if smoke else RESNET_STAGES
    n = RESNET_EXAMPLES[smoke]
    end, parts = 0.0, []
    for size, batch, scale, steps in stages:
        end += steps / (n // batch)
        parts.append(f"{end:g}:{size}-{batch}@{scale}")
    first = stages[0][3] / (n // stages[0][1])
    kv = [
        ("stages", ",".join(parts)),
        ("num_epochs", f"{end:g}"),
        ("data.train_examples", str(n)),
        ("data.eval_examples", str(8 if smoke else 1000)),
        ("eval_every_epochs", "1000000"),  # one eval, at the end
        ("optim.warmup_epochs", f"{first / 20:g}"),
        ("optim.momentum_ramp_epochs", f"{first / 2:g}"),
        ("data.on_device", "True"),
    ]
    if smoke:
        kv += [("model.name", "resnet_tiny"), ("model.num_filters", "4"),
               ("data.image_size", "40"), ("eval_batch", "8"), ("global_batch", "4")]  # fmt: skip
    return kv


RESNET_CONFIG = str(EXP / "resnet50_imagenet_dawnbench.py") + ":,1"


# ---- Processes, budget, records ----------------------------------------------------------


class Budget:
    def __init__(self, total_s: float, reserves: bool = True):
        self.t0, self.total, self.reserves = time.time(), total_s, reserves

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()

    def cap(self, want: float, reserve: float = 0.0) -> float:
        """At most ``want`` seconds, leaving ``reserve`` for what comes after (the GPU
        plan's; a smoke's runs only share its total)."""
        return max(0.0, min(want, self.left() - (reserve if self.reserves else 0.0)))


class Proc:
    def __init__(self, name, rc, wall_s, timed_out, log, cap=0.0):
        self.name, self.rc, self.wall_s, self.timed_out, self.log = name, rc, wall_s, timed_out, log
        self.cap = cap

    def tail(self, n: int = 12) -> list[str]:
        try:
            lines = Path(self.log).read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln[:300] for ln in lines if ln.strip()][-n:]

    def error_line(self) -> str:
        if self.timed_out:  # the cap is why it stopped, whatever it said on its way out
            return (f"hit its time cap of {self.cap:.0f}s (its share of --budget-s; "
                    "what it reached is above)")  # fmt: skip
        for ln in reversed(self.tail(60)):
            if ln.startswith("error:") or "Error" in ln.split(":")[0]:
                return ln
        return f"exit status {self.rc}"


def run(name: str, argv: list[str], work: Path, timeout: float, env: dict | None = None) -> Proc:
    """``argv`` with stdout and stderr in ``work/logs/name.log``, from ``work`` (outside the
    checkout, so ``import hybridpar`` finds the installed package). At ``timeout`` seconds
    SIGTERM (the trainer saves and writes its records), 60 s later SIGKILL."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    # JAX's own persistent cache (a test suite sets one) would turn compiles into loads:
    # compile times would not be measured, and on XLA:CPU an executable loaded from it and
    # written by `compile --out` fails to run when loaded. Only the step bench gets one.
    full = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    full.update(env or {})
    if timeout < 1:  # the budget has nothing left for it: starting it would only kill it
        log.write_text(f"$ {' '.join(argv)}\nnot started: no time left under --budget-s\n")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: not started, no time left", flush=True)
        return Proc(name, None, 0.0, True, log, timeout)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: up to {timeout:.0f}s", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        p = subprocess.Popen(argv, cwd=work, stdout=f, stderr=subprocess.STDOUT, env=full,
                             start_new_session=True)  # fmt: skip
        timed_out = False
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
    wall = time.time() - t0
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {rc} after {wall:.1f}s"
          + (" (time cap)" if timed_out else ""), flush=True)  # fmt: skip
    return Proc(name, rc, wall, timed_out, log, timeout)


def train(name: str, args: list[str], work: Path, timeout: float, env=None) -> tuple[Proc, dict]:
    """The train CLI on ``work/name``; returns the process and its records."""
    wd = work / name
    peak = work / f"{name}.peak.json"
    argv = [PY, str(GPU_DIR / "train_peak.py"), str(peak), *args, "--workdir", str(wd)]
    p = run(name, argv, work, timeout, env)
    return p, records(wd, peak)


def records(wd: Path, peak: Path | None = None) -> dict:
    out = {"metrics": [], "summary": None, "peak": None}
    try:
        for line in (wd / "metrics.jsonl").read_text().splitlines():
            try:
                out["metrics"].append(json.loads(line))
            except ValueError:  # a line cut by a kill
                pass
    except OSError:
        pass
    for key, path in (("summary", wd / "summary.json"), ("peak", peak)):
        try:
            out[key] = json.loads(Path(path).read_text()) if path else None
        except (OSError, ValueError):
            pass
    return out


def events(rec: dict, kind: str) -> list[dict]:
    return [m for m in rec["metrics"] if m.get("event") == kind]


def peak_bytes(rec: dict) -> int | None:
    stats = (rec.get("peak") or {}).get("stats") or {}
    return stats.get("peak_bytes_in_use")


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def step_losses(rec: dict) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in events(rec, "train") if m.get("loss") is not None}


def compare_losses(a: dict, b: dict) -> tuple[int, int, float]:
    """``(steps compared, steps bitwise equal, max |difference|)`` over the common steps."""
    common = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in common]
    return len(common), sum(d == 0 for d in diffs), max(diffs) if diffs else float("nan")


class Section:
    def __init__(self, key: str, title: str):
        self.key, self.title = key, title
        self.lines: list[str] = []
        self.figs: dict[str, object] = {}
        self.ratios: dict[str, float] = {}
        self.error: str | None = None
        self.missing: str | None = None  # skipped for want of an input: the run is incomplete

    def say(self, text: str = "") -> None:
        self.lines.append(text)

    def skip(self, text: str) -> None:
        """An input this section needs is not here: ``text`` says which and how to get it."""
        self.missing = self.missing or text
        self.say(f"SKIPPED: {text}")

    def fail(self, text: str, proc: Proc | None = None) -> None:
        self.error = self.error or text
        self.say(f"FAILED: {text}")
        if proc is not None:
            self.say(f"  last lines of {proc.log}:")
            self.lines += [f"    {ln}" for ln in proc.tail()]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


# ---- (a) digits ------------------------------------------------------------------------------


def section_a(ctx) -> Section:
    s = Section("a", "(a) digits: the README's main job (experiments/digits.py) to its target")
    p, rec = train("a_digits", digits_args(ctx.smoke), ctx.work, ctx.budget.cap(120, 330))
    ctx.runs["a"] = rec
    summ = rec["summary"]
    if summ is None:
        s.fail(p.error_line(), p)
        return s
    ev = summ.get("final_eval") or {}
    tt = (summ.get("time_to_target") or {}).get("top1")
    s.say("python -m hybridpar.train --config experiments/digits.py --workdir DIR "
          "--config.log_every_s=0" + (" (+ smoke: 0.5 epoch, 4 filters)" if ctx.smoke else ""))
    s.say(f"{'top-1':>7} {'top-5':>7} {'wall s':>7} {'compile s':>9} {'to 97% s':>9} "
          f"{'w/o compile':>11} {'goodput':>7} {'img/s':>8} {'peak':>12}")  # fmt: skip
    s.say(f"{ev.get('top1', float('nan')):>7.4f} {ev.get('top5', float('nan')):>7.4f} "
          f"{summ['wall_s']:>7.1f} {summ['compile_s']:>9.1f} "
          f"{fmt(tt['wall_s']) if tt else '-':>9} "
          f"{fmt(tt['wall_s_without_compile']) if tt else '-':>11} "
          f"{summ.get('goodput') or 0:>7.2f} {summ.get('train_images_per_s') or 0:>8.0f} "
          f"{mib(peak_bytes(rec)):>12}")  # fmt: skip
    s.say("where the time went: " + ", ".join(
        f"{k} {v:.1f}s" for k, v in summ.get("time_breakdown", {}).items() if v))  # fmt: skip
    s.figs.update(digits_top1=round(ev.get("top1", float("nan")), 4),
                  digits_wall_s=summ["wall_s"], digits_compile_s=summ["compile_s"],
                  digits_to_target_s=(tt or {}).get("wall_s", "none"),
                  digits_process_s=round(p.wall_s, 1))  # fmt: skip
    if p.rc != 0 or p.timed_out:
        s.fail(p.error_line(), p)
    return s


# ---- (d) a compiled program ---------------------------------------------------------------


PREPARED_GPUS = ("h100", "h200")  # --prepare compiles the digits job for these


def gpu_name(kind: str) -> str | None:
    k = kind.lower()
    for name in ("h200", "h100", "a100"):
        if name in k:
            return name
    return None


def compiled_total(report: dict) -> int | None:
    """The compile tool's largest program's per-device total (its ``--json`` report)."""
    rows = report.get("programs") or []
    totals = [r["memory"].get("total", 0) for r in rows if r.get("memory")]
    return max(totals) if totals else None


def last_json(path: Path) -> dict | None:
    for line in reversed(Path(path).read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def section_d(ctx) -> Section:
    s = Section("d", "(d) a compiled program: compiled ahead, loaded with train --compiled")
    base = step_losses(ctx.runs.get("a") or {"metrics": []})
    a_peak = peak_bytes(ctx.runs.get("a") or {})
    rows = []  # (what, loaded?, steps, equal, max diff, predicted, peak)
    # d1: compiled here (another machine, no GPU) for this GPU
    name = gpu_name(ctx.device.get("kind", "")) if ctx.device.get("platform") == "gpu" else None
    here = GPU_DIR / "compiled" / f"digits_{name}.bin" if name else None
    here_report = here.with_suffix(".json") if here else None
    here_pred = None
    if here_report is not None and here_report.is_file():
        here_pred = compiled_total(json.loads(here_report.read_text()))
    if here is None:
        s.say("compiled here for a GPU: skipped, this device is "
              f"{ctx.device.get('kind')} ({ctx.device.get('platform')}), not an H100/H200/A100")
        s.figs["loaded_here"] = "skipped"
    elif not here.is_file():
        why = (f"no {here.relative_to(ROOT)}: bash bench/gpu/e2e.sh --prepare writes it "
               "where jax's CUDA plugin is installed (the gpu-aot extra, or --gpu-aot-path "
               "DIR)")  # fmt: skip
        if name in PREPARED_GPUS and not ctx.smoke:  # prepare makes it: its absence is a gap
            s.skip(f"compiled here for a GPU: {why}")
        else:
            s.say(f"compiled here for a GPU: skipped, {why}")
        s.figs["loaded_here"] = "skipped"
    else:
        p, rec = train("d_here", digits_args(ctx.smoke) + ["--compiled", str(here)], ctx.work,
                       ctx.budget.cap(90, 300))  # fmt: skip
        meta = json.loads(here_report.read_text()) if here_report.is_file() else {}
        s.say(f"compiled here: {here.relative_to(ROOT)} (--target {meta.get('target')}, "
              f"by jax {meta.get('jax', '?')} on a machine without a GPU)")
        if p.rc != 0:
            s.say(f"  refused or failed: {p.error_line()}")
            s.figs["loaded_here"] = "refused"
        else:
            loaded = [c for c in events(rec, "compile") if c.get("loaded_from")]
            n, eq, md = compare_losses(base, step_losses(rec))
            rows.append(("compiled here", len(loaded), n, eq, md, here_pred, peak_bytes(rec)))
            s.figs.update(loaded_here="loaded", loaded_here_max_loss_diff=md)
    # d2: compiled on this machine, loaded by a second process. The compile tool first; where
    # it fails here, the same through compile_for.py (its notes say why), so that loading is
    # still checked.
    out = ctx.work / "d_device.bin"
    cargs = digits_args(ctx.smoke)
    tries = [("python -m hybridpar.compile --out FILE (this machine's devices)",
              [PY, "-m", "hybridpar.compile", *cargs, "--out", str(out), "--overwrite",
               "--json"])]
    if name:
        tries.append((f"the compile tool, --target gpu:{name}-1 (described, CUDA 13 plugin)",
                      [PY, str(GPU_DIR / "compile_for.py"), "aot", *cargs, "--target",
                       f"gpu:{name}-1", "--out", str(out), "--overwrite", "--json"]))
        tries.append(("the trainer's set-up on this GPU + executables.save (compile_for.py)",
                      [PY, str(GPU_DIR / "compile_for.py"), "device", *cargs, "--out",
                       str(out)]))  # fmt: skip
    report, how = None, None
    for i, (what, argv) in enumerate(tries):
        p = run(f"d_compile{i}", argv, ctx.work, ctx.budget.cap(120, 300))
        report = last_json(p.log) if p.rc == 0 else None
        if report is not None and out.is_file():
            how = what
            break
        s.say(f"compiled on this machine by {what}: FAILED: {p.error_line()}")
        s.figs[f"d_compile{i}"] = "failed"
        report = None
    if report is None:
        s.fail("no way of compiling a file here worked", None)
    else:
        dev_pred = compiled_total(report)
        s.say(f"compiled on this machine by {how}: {len(report.get('programs', []))} programs "
              f"in {report.get('wall_s')} s, largest {report.get('largest')}")
        p2, rec = train("d_device", cargs + ["--compiled", str(out)], ctx.work,
                        ctx.budget.cap(120, 300))  # fmt: skip
        if rec["summary"] is None or p2.rc != 0:
            s.fail(f"train --compiled: {p2.error_line()}", p2)
        else:
            loaded = [c for c in events(rec, "compile") if c.get("loaded_from")]
            n, eq, md = compare_losses(base, step_losses(rec))
            rows.append(("compiled on device", len(loaded), n, eq, md, dev_pred, peak_bytes(rec)))
            s.figs.update(loaded_device_steps=n, loaded_device_equal=eq,
                          loaded_device_max_loss_diff=md)  # fmt: skip
            ev_a = ((ctx.runs.get("a") or {}).get("summary") or {}).get("final_eval") or {}
            ev_d = rec["summary"].get("final_eval") or {}
            s.say(f"final eval: (a) compiled by the trainer top-1 {ev_a.get('top1')}, loss "
                  f"{ev_a.get('loss')}; loaded top-1 {ev_d.get('top1')}, loss {ev_d.get('loss')}")
    if rows:
        s.say(f"{'executables':<20} {'loaded':>6} {'steps':>6} {'equal':>6} {'max |dloss|':>11} "
              f"{'predicted':>12} {'peak':>12} {'pred/peak':>9}")  # fmt: skip
        for what, nl, n, eq, md, pred, peak in rows:
            ratio = pred / peak if pred and peak else None
            s.say(f"{what:<20} {nl:>6} {n:>6} {eq:>6} {md:>11.3g} {mib(pred):>12} "
                  f"{mib(peak):>12} {fmt(ratio) if ratio else '-':>9}")  # fmt: skip
        s.say("(losses against (a), the same job compiled by the trainer on this device; "
              "'loaded': programs taken from the file, none compiled)")
    # memory: each prediction of the digits train step against (a)'s measured peak
    preds = {"here (gpu AOT, no device)": here_pred}
    if report is not None:
        preds["compile tool on device"] = compiled_total(report)
    a_sum = (ctx.runs.get("a") or {}).get("summary") or {}
    preds["trainer's own compile"] = (a_sum.get("memory_per_device_bytes") or {}).get("total")
    s.say(f"memory per device, predicted against (a)'s measured peak ({mib(a_peak)}; "
          "peak_bytes_in_use of the device's allocator, which also holds the data, the eval "
          "step and the autotuner's buffers):")
    for what, pred in preds.items():
        r = pred / a_peak if pred and a_peak else None
        s.say(f"  {what:<28} {mib(pred):>12}  pred/peak {fmt(r) if r else '-'}")
        key = {"here (gpu AOT, no device)": "here", "compile tool on device": "device",
               "trainer's own compile": "trainer"}[what]  # fmt: skip
        if r:
            s.ratios[f"ratio_mem_pred_{key}_vs_peak_digits"] = round(r, 3)
    return s


# ---- (b) CIFAR-10 --------------------------------------------------------------------------


def cifar_data(ctx, s: Section) -> Path | None:
    """The folder holding train.tar and test.tar for this run: rebuilt from the pack (the
    device), or a subset packed and rebuilt here (the smoke), or the shared tars."""
    dest = ctx.work / "data" / "cifar10-jpeg"
    pack_dir = ctx.pack_dir
    src = pack_cifar.default_src()
    tars_fix = "set HYBRIDPAR_DATA to the folder holding cifar10-jpeg/train.tar and test.tar"
    if ctx.smoke:
        if not (src / "test.tar").is_file():
            s.skip(f"no CIFAR-10 tars in {src}: {tars_fix}")
            return None
        pack_dir = ctx.work / "pack"
        idx = pack_cifar.pack(src, pack_dir, per_class=ctx.per_class)
        s.say(f"smoke: packed the first {ctx.per_class} images per class of each split "
              f"({idx['pack_bytes'] / 2**10:.0f} KiB) from {src}")
    if (pack_dir / pack_cifar.INDEX).is_file():
        t0 = time.time()
        checked = pack_cifar.unpack(pack_dir, dest)
        s.say(f"data: {pack_dir}'s pack unpacked in {time.time() - t0:.1f}s: "
              + "; ".join(f"{k}: {v}" for k, v in checked.items()))
        return dest
    if (src / "train.tar").is_file():
        s.say(f"data: the tars in {src} (no pack in {pack_dir})")
        return src
    s.skip(f"no CIFAR-10 pack in {pack_dir} and no tars in {src}: run bash bench/gpu/e2e.sh "
           f"--prepare where the tars are and carry bench/gpu/data, or {tars_fix}")  # fmt: skip
    return None


def decode_tars(folder: Path) -> dict:
    """Every image of train.tar and test.tar decoded with Pillow (RGB, as stored: CIFAR-10's
    32x32), labels by sorted class folder: what airbench's loader is given."""
    import numpy as np
    from PIL import Image

    out, classes = {}, None
    for split in ("train", "test"):
        with tarfile.open(folder / f"{split}.tar") as tf:
            items = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
        if classes is None:
            classes = sorted({n.split("/")[1] for n, _ in items})

        def dec(item):
            return np.asarray(Image.open(io.BytesIO(item[1])).convert("RGB"), np.uint8)

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            images = list(pool.map(dec, items, chunksize=256))
        out[f"{split}_image"] = np.stack(images)
        out[f"{split}_label"] = np.asarray([classes.index(n.split("/")[1]) for n, _ in items],
                                           np.int64)  # fmt: skip
    out["classes"] = np.asarray(classes)
    return out


def same_pixels(decoded: dict, prepared: Path) -> str:
    """Whether hybridpar's on-device cache (PREPARED/on_device/SPLIT-32px.npz) holds the
    same images with the same labels as ``decoded`` (compared as sorted per-image hashes,
    so the order does not matter)."""
    import numpy as np

    found = {}
    for split in ("train", "test"):
        path = prepared / "on_device" / f"{split}-32px.npz"
        if not path.is_file():
            return f"not checked: no {path} (hybridpar's on-device cache)"
        with np.load(path) as z:
            found[split] = (z["image"], z["label"])

    def digest(images, labels):
        return sorted(hashlib.sha1(im.tobytes() + int(lb).to_bytes(2, "little")).digest()
                      for im, lb in zip(images, labels))  # fmt: skip

    for split, (im, lb) in found.items():
        mine = (decoded[f"{split}_image"], decoded[f"{split}_label"])
        if im.shape != mine[0].shape or digest(im, lb) != digest(*mine):
            return f"NO: {split} differs from hybridpar's on-device cache"
    n = sum(len(v[1]) for v in found.values())
    return f"yes: all {n} images and labels equal hybridpar's on-device cache"


def cifar_run(seed: int, p: Proc, rec: dict) -> dict:
    """One of our CIFAR-10 runs as (b) compares it: the fixed schedule's final top-1 and its
    time on airbench's clock (train steps and one eval, what airbench94's own clock holds),
    and its first eval at the target, on DAWNBench's clock (from the start) and without
    compilation. ``complete``: it trained its whole schedule."""
    summ = rec["summary"] or {}
    evals = events(rec, "eval")
    tb = summ.get("time_breakdown") or {}
    n_eval = max(1, len(evals))
    return dict(
        seed=seed, evals=evals, tb=tb, process_s=p.wall_s,
        complete=bool(summ.get("completed")) and p.rc == 0 and not p.timed_out,
        final_top1=(summ.get("final_eval") or {}).get("top1"),
        train_s=tb.get("train", 0) + tb.get("input_wait", 0) + tb.get("eval", 0) / n_eval,
        to_target=(summ.get("time_to_target") or {}).get("top1"),
        compile_s=summ.get("compile_s"), wall_s=summ.get("wall_s"),
        steps=summ.get("steps"), total_steps=summ.get("total_steps"),
        img_s=summ.get("train_images_per_s"),
    )  # fmt: skip


def median_time(values) -> float | str:
    """The median of times where ``None`` (never reached) counts as longer than any."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return "none" if m == math.inf else round(m, 2)


def compare_cifar(ours: list[dict], theirs: list[dict], want: int):
    """(b)'s verdict, like with like: each side's fixed schedule over the same number of
    runs, the medians of its time on airbench's clock and of its final top-1 (airbench94's
    TTA top-1). ``ours``: cifar_run's (the complete ones count); ``theirs``: airbench_peer.py's
    runs. Returns ``(lines, figures, ratios)``."""
    mine = [r for r in ours if r["complete"]]
    n = min(len(mine), len(theirs))
    if n == 0:
        return [f"no comparison: {len(mine)} complete run(s) of ours, {len(theirs)} of "
                "airbench94's"], {"compared_runs": 0}, {}  # fmt: skip
    t_ours = statistics.median(r["train_s"] for r in mine[:n])
    a_ours = statistics.median(r["final_top1"] for r in mine[:n])
    t_ab = statistics.median(r["total_time_seconds"] for r in theirs[:n])
    a_ab = statistics.median(r["tta_val_acc"] for r in theirs[:n])
    lines = [f"{'fixed schedules, medians':<28} {'runs':>4} {'clock s':>8} {'final top-1':>11}",
             f"{'hybridpar (seeds 0..)':<28} {n:>4} {t_ours:>8.2f} {a_ours:>11.4f}",
             f"{'airbench94':<28} {n:>4} {t_ab:>8.2f} {a_ab:>11.4f}"]  # fmt: skip
    if n < want:
        lines.append(f"ONLY {n} run(s) a side of the {want} asked (--cifar-runs): {len(mine)} "
                     f"of ours and {len(theirs)} of airbench94's finished within the budget; "
                     f"medians over the first {n} of each")  # fmt: skip
    lines.append(f"hybridpar / airbench94 on airbench's clock: {t_ours / t_ab:.2f}x the time, "
                 f"final top-1 {a_ours:.4f} against {a_ab:.4f} ({n} run(s) a side)")  # fmt: skip
    return lines, {"compared_runs": n}, {"ratio_c10_train_vs_airbench": round(t_ours / t_ab, 3)}


def section_b(ctx) -> Section:
    s = Section("b", f"(b) CIFAR-10 to {CIFAR_TARGET:.0%}: cifar10_fast.py:gpu on device-resident "
                "data, beside airbench94 (PyTorch) on the same pixels, the same number of "
                "runs a side")  # fmt: skip
    data = cifar_data(ctx, s)
    if data is None:
        s.figs["c10"] = "skipped"
        return s
    prepared = ctx.work / "prepared_c10"
    cache = ctx.work / "cc_cifar"  # the later runs load the first one's programs
    env = {"HYBRIDPAR_DATA": str(data.parent)}
    s.say("python -m hybridpar.train --config experiments/cifar10_fast.py:gpu "
          "--config.data.on_device=True --config.seed=I --config.compile_cache=DIR"
          + (" (+ smoke: 8 filters, 2 epochs of a subset)" if ctx.smoke else "")
          + f": the fixed schedule, seeds 0..{ctx.cifar_runs - 1}, one compile cache")  # fmt: skip
    ours, estimate = [], 0.0
    for i in range(ctx.cifar_runs):
        cap = ctx.budget.cap(210, 190)  # leaves a minute for airbench and two for (c)
        if i and cap < estimate:
            s.say(f"hybridpar: stopped after {i} run(s): the next (about {estimate:.0f}s) "
                  f"does not fit the {cap:.0f}s the budget leaves it")  # fmt: skip
            break
        p, rec = train(f"b_cifar{i}", cifar_args(ctx.smoke, prepared, i, cache), ctx.work,
                       cap, env)  # fmt: skip
        if rec["summary"] is None or (p.rc != 0 and not p.timed_out):
            s.fail(f"seed {i}: {p.error_line()}", p)
            break
        r = cifar_run(i, p, rec)
        ours.append(r)
        if not r["complete"]:
            s.say(f"seed {i}: {p.error_line()} after {r['steps']}/{r['total_steps']} steps")
            break
        # the next loads the compiled programs: about this run less its compilation
        estimate = p.wall_s - (r["compile_s"] or 0) + 15 if i == 0 else p.wall_s
    if ours:
        s.say(f"{'seed':>4} {'final top-1':>11} {'first eval>=' + format(CIFAR_TARGET, '.0%'):>15} "
              f"{'from start s':>12} {'w/o compile':>11} {'clock s':>8} {'compile s':>9} "
              f"{'process s':>9}")  # fmt: skip
        for r in ours:
            tt = r["to_target"]
            s.say(f"{r['seed']:>4} {fmt(r['final_top1']) if r['complete'] else 'stopped':>11} "
                  f"{'epoch ' + format(tt['epoch'], '.2f') if tt else 'not reached':>15} "
                  f"{fmt(tt['wall_s']) if tt else '-':>12} "
                  f"{fmt(tt['wall_s_without_compile']) if tt else '-':>11} "
                  f"{r['train_s']:>8.2f} {fmt(r['compile_s']):>9} "
                  f"{r['process_s']:>9.1f}")  # fmt: skip
        s.say("(final top-1: the last eval of the fixed schedule, flip TTA; first eval at the "
              "target: DAWNBench's clock from the start, compilation and evals included, then "
              "without compilation; clock: airbench's, the schedule's train steps and one eval; "
              "seeds after 0 load seed 0's programs from the compile cache)")  # fmt: skip
        for r in ours:
            s.say(f"seed {r['seed']} evals (epoch top-1): "
                  + ", ".join(f"{e['epoch']:.2f} {e['top1']:.4f}" for e in r["evals"]))  # fmt: skip
        s.say("seed 0, where the time went: "
              + ", ".join(f"{k} {v:.1f}s" for k, v in ours[0]["tb"].items() if v))  # fmt: skip
        done = [r for r in ours if r["complete"]]
        first = ours[0]["to_target"]
        s.figs.update(
            c10_runs=len(done),
            c10_reached=f"{sum(bool(r['to_target']) for r in done)}/{len(done)}",
            c10_tta_dawnbench_s=first["wall_s"] if first else "none",  # seed 0: compiles
            c10_compile_s=ours[0]["compile_s"], c10_setup_s=ours[0]["tb"].get("setup"),
            c10_img_s=ours[0]["img_s"],
        )  # fmt: skip
        if done:
            s.figs.update(
                c10_tta_no_compile_s=median_time(
                    (r["to_target"] or {}).get("wall_s_without_compile") for r in done
                ),
                c10_train_s=round(statistics.median(r["train_s"] for r in done), 2),
                c10_top1_final=round(statistics.median(r["final_top1"] for r in done), 4),
            )
        else:
            s.fail(f"no run of ours trained its whole schedule: {p.error_line()}")
    # airbench94 on the same pixels
    t0 = time.time()
    decoded = decode_tars(data)
    s.say(f"airbench's pixels: {len(decoded['train_label'])} + {len(decoded['test_label'])} "
          f"images decoded here with Pillow in {time.time() - t0:.1f}s; the same as hybridpar's? "
          + same_pixels(decoded, prepared))
    peer = ctx.peers / "airbench94.py"
    import importlib.util

    def without(why: str) -> Section:  # a gap on a GPU; expected in a smoke (no CUDA there)
        if ctx.smoke:
            s.say(f"airbench94: skipped, {why}")
        else:
            s.skip(f"airbench94: {why}")
        s.figs["airbench"] = "skipped"
        return s

    if importlib.util.find_spec("torch") is None:
        return without("torch is not installed here")
    if not peer.is_file():
        return without(f"no {peer} (bash bench/gpu/e2e.sh --prepare says where it comes from)")
    import numpy as np

    npz = ctx.work / "cifar10_uint8.npz"
    np.savez(npz, **decoded)
    out = ctx.work / "airbench.json"
    cap = ctx.budget.cap(120, 130)
    p = run("b_airbench", [PY, str(GPU_DIR / "airbench_peer.py"), "--peer", str(peer),
                           "--npz", str(npz), "--work", str(ctx.work / "airbench"),
                           "--runs", str(ctx.cifar_runs), "--budget-s", str(cap - 10),
                           "--json", str(out)], ctx.work, cap)  # fmt: skip
    try:
        ab = json.loads(out.read_text())
    except (OSError, ValueError):
        s.fail(f"airbench94: {p.error_line()}", p)
        return s
    runs = ab.get("runs", [])
    s.say(f"airbench94 (legacy/airbench94.py, torch {ab.get('torch')}, {ab.get('device', '-')}): "
          f"warmup run {ab.get('warmup_wall_s', '-')}s (random labels, cuDNN autotuning); "
          + (ab.get("note") or f"{len(runs)} timed runs"))
    if not runs:
        return without(ab.get("note") or "no timed run")
    s.say(f"{'run':>4} {'TTA top-1':>9} {'its clock s':>11} {'wall s':>7}")
    for i, r in enumerate(runs):
        s.say(f"{i:>4} {r['tta_val_acc']:>9.4f} {r['total_time_seconds']:>11.2f} "
              f"{r['wall_s']:>7.1f}")  # fmt: skip
    s.figs.update(airbench_s=round(statistics.median(r["total_time_seconds"] for r in runs), 3),
                  airbench_top1=round(statistics.median(r["tta_val_acc"] for r in runs), 4),
                  airbench_runs=len(runs))  # fmt: skip
    lines, figs, ratios = compare_cifar(ours, runs, ctx.cifar_runs)
    s.lines += lines
    s.figs.update(figs)
    s.ratios.update(ratios)
    return s


# ---- (c) ResNet-50 stages ------------------------------------------------------------------


def stage_rates(rec: dict) -> list[dict]:
    """Per stage: its lines' images and seconds (the first line after a switch left out:
    it holds the switch), the steady step time, and the gap at its switch."""
    trains, stages = events(rec, "train"), events(rec, "stage")
    compiles = [c for c in events(rec, "compile") if c.get("program") == "train"]
    out = []
    for i, st in enumerate(stages):
        lines = [t for t in trains if t.get("stage") == st["stage"] and t["step"] > st["step"]]
        batch = st["global_batch"]
        prev_step = st["step"]
        rows = []
        for t in lines:
            steps = t["step"] - prev_step
            prev_step = t["step"]
            if steps > 0 and t.get("images_per_s"):
                rows.append((steps, steps * batch / t["images_per_s"], t))
        steady = rows[1:] or rows
        n = sum(r[0] for r in steady)
        secs = sum(r[1] for r in steady)
        rate = n * batch / secs if secs else None
        step_s = batch / rate if rate else None
        gap = None
        if i > 0 and rows and step_s:
            before = [t for t in trains if t["step"] <= st["step"]]
            if before:
                first = rows[0]
                gap = (first[2]["wall_s"] - before[-1]["wall_s"]) - first[0] * step_s
        comp = next((c for c in compiles if c["batch"] == batch
                     and c["image_size"] == st["image_size"]), {})  # fmt: skip
        out.append(dict(stage=st["stage"], size=st["image_size"], batch=batch,
                        steps=st.get("steps"), rate=rate, step_s=step_s, gap=gap,
                        background=comp.get("background"), wait_s=comp.get("wait_s"),
                        compile_s=comp.get("compile_s"),
                        cache_hit=comp.get("cache_hit")))  # fmt: skip
    return out


def parse_step_bench(path: Path) -> dict[int, float]:
    rates = {}
    for ln in Path(path).read_text(errors="replace").splitlines():
        parts = ln.split()
        if len(parts) >= 4 and parts[0] == "hybridpar" and parts[1].isdigit():
            rates[int(parts[1])] = float(parts[3])
    return rates


def section_c(ctx) -> Section:
    s = Section("c", "(c) ResNet-50, the DAWNBench recipe's stages on synthetic data through "
                "the trainer, against bench/gpu/resnet50_gpu.py's step")
    kv = resnet_overrides(ctx.smoke)
    cache = ctx.work / "cc_resnet"
    args = ["--config", RESNET_CONFIG, *[f"--config.{k}={v}" for k, v in kv],
            f"--config.compile_cache={cache}", "--config.log_every_s=1"]  # fmt: skip
    s.say("python -m hybridpar.train --config experiments/resnet50_imagenet_dawnbench.py:,1 "
          + " ".join(f"--config.{k}={v}" for k, v in kv))
    p, rec = train("c_resnet", args, ctx.work, ctx.budget.cap(200, 60))
    summ = rec["summary"]
    if summ is None:
        s.fail(p.error_line(), p)
        return s
    per = stage_rates(rec)
    if p.rc != 0 or p.timed_out:
        s.fail(p.error_line(), p)
    # the step bench: the same recipe and overrides, the trainer's compile cache
    sizes = ",".join(str(r["size"]) for r in per)
    batches = ",".join(str(r["batch"]) for r in per)
    steps = ["--steps", "1", "--repeats", "1", "--warmup", "0", "--matmul-n", "256"] \
        if ctx.smoke else ["--steps", "20", "--repeats", "3", "--warmup", "3"]
    before = len(list(cache.rglob("*"))) if cache.exists() else 0
    bench = run("c_step_bench", [PY, str(GPU_DIR / "resnet50_gpu.py"), "--no-torch",
                                 "--config", RESNET_CONFIG, "--sizes", sizes, "--batches", batches,
                                 *steps, *[f"--set={k}={v}" for k, v in kv]],
                ctx.work, ctx.budget.cap(150),
                {"JAX_COMPILATION_CACHE_DIR": str(cache)})  # fmt: skip
    step = parse_step_bench(bench.log) if bench.rc == 0 else {}
    if bench.rc != 0:
        s.fail(f"step bench: {bench.error_line()}", bench)
    new = (len(list(cache.rglob("*"))) if cache.exists() else 0) - before
    s.say(f"{'stage':>5} {'size':>4} {'batch':>5} {'steps':>5} {'trainer img/s':>13} "
          f"{'step img/s':>10} {'ratio':>6} {'switch gap s':>12} {'in steps':>8} "
          f"{'compile s':>9} {'bg wait s':>9}")  # fmt: skip
    productive = 0.0
    for r in per:
        st = step.get(r["size"])
        ratio = r["rate"] / st if r["rate"] and st else None
        gap_steps = r["gap"] / r["step_s"] if r["gap"] is not None and r["step_s"] else None
        s.say(f"{r['stage']:>5} {r['size']:>4} {r['batch']:>5} {r['steps'] or 0:>5} "
              f"{fmt(r['rate']) if r['rate'] else '-':>13} {fmt(st) if st else '-':>10} "
              f"{fmt(ratio) if ratio else '-':>6} "
              f"{fmt(r['gap']) if r['gap'] is not None else '-':>12} "
              f"{fmt(gap_steps) if gap_steps is not None else '-':>8} "
              f"{fmt(r['compile_s']) if r['compile_s'] is not None else '-':>9} "
              f"{fmt(r['wait_s']) if r['wait_s'] is not None else '-':>9}")  # fmt: skip
        if ratio:
            s.ratios[f"ratio_trainer_vs_step_{r['size']}"] = round(ratio, 3)
        if gap_steps is not None:
            s.ratios[f"switch_gap_steps_{r['stage']}"] = round(gap_steps, 2)
            s.figs[f"switch_gap_s_{r['stage']}"] = round(r["gap"], 3)
        if r["rate"]:
            s.figs[f"resnet_ips_{r['size']}"] = round(r["rate"], 1)
            productive += (r["steps"] or 0) * r["step_s"]
        if st:
            s.figs[f"step_ips_{r['size']}"] = round(st, 1)
    s.say("(trainer img/s: its train lines in each stage but the first, which holds the "
          "switch; switch gap: from the last line of the stage before to the first of this "
          "one, less the steps between at this stage's steady step time; bg wait: how long "
          "the switch waited for its background compile)")
    s.say(f"step bench: the same recipe, sizes and batches, a fixed batch on the device; "
          f"{new} new compile-cache files after it (0: it loaded the trainer's programs)")
    wall = summ["wall_s"]
    tb = summ.get("time_breakdown", {})
    s.say("where the time went: " + ", ".join(f"{k} {v:.1f}s" for k, v in tb.items() if v))
    good = summ.get("goodput")
    s.say(f"goodput: train steps over the wall time {good}; productive step time (each "
          f"stage's steps at its steady step time) over the wall {productive / wall:.3f}"
          if wall else "goodput: -")
    s.figs.update(resnet_goodput=good,
                  resnet_productive=round(productive / wall, 3) if wall else None,
                  resnet_wall_s=wall, resnet_compile_s=summ["compile_s"])  # fmt: skip
    pred = (summ.get("memory_per_device_bytes") or {}).get("total")
    peak = peak_bytes(rec)
    here = None
    name = gpu_name(ctx.device.get("kind", ""))
    rep = GPU_DIR / "compiled" / f"resnet_{name}.json" if name else None
    if rep is not None and rep.is_file() and not ctx.smoke:
        here = compiled_total(json.loads(rep.read_text()))
    s.say(f"memory per device: measured peak {mib(peak)}; the trainer's compile predicted "
          f"{mib(pred)} (largest program)" + (f", the compile tool here (gpu AOT) {mib(here)}"
                                              if here else ""))  # fmt: skip
    if pred and peak:
        s.ratios["ratio_mem_pred_trainer_vs_peak_resnet"] = round(pred / peak, 3)
    if here and peak:
        s.ratios["ratio_mem_pred_here_vs_peak_resnet"] = round(here / peak, 3)
    return s


# ---- The device, the file -------------------------------------------------------------------


PROBE = r"""
import json, importlib.metadata as md
import jax
d = jax.devices()[0]
def v(p):
    try: return md.version(p)
    except md.PackageNotFoundError: return None
stats = d.memory_stats() or {}
print(json.dumps({"platform": d.platform, "kind": d.device_kind, "count": jax.device_count(),
  "jax": jax.__version__, "jaxlib": v("jaxlib"),
  "cuda_plugin": v("jax-cuda13-plugin") or v("jax-cuda12-plugin"), "torch": v("torch"),
  "bytes_limit": stats.get("bytes_limit")}))
"""


def probe(work: Path) -> dict:
    p = run("probe", [PY, "-c", PROBE], work, 120)
    dev = last_json(p.log) or {"platform": "?", "kind": "?"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)  # fmt: skip
        dev["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        dev["nvidia_smi"] = None
    return dev


PROBE_FN = probe  # a test replaces it (no JAX process)


MARKER = ".hybridpar-e2e"  # in each scratch folder this script makes: only those are cleared


class Context:
    def __init__(self, args):
        self.smoke = args.smoke
        self.work = Path(args.work).resolve()
        self.budget = Budget(args.budget_s, reserves=not args.smoke)
        self.pack_dir = Path(args.pack).resolve()
        self.peers = Path(args.peers).resolve()
        self.per_class = args.per_class
        self.cifar_runs = args.cifar_runs
        self.runs: dict = {}
        self.device: dict = {}


def gaps(sections: list[Section]) -> tuple[list[str], list[str]]:
    """The sections that failed, and those skipped (in part) for want of an input."""
    return [s.key for s in sections if s.error], [s.key for s in sections if s.missing]


def write_result(path: Path, header: list[str], sections: list[Section], ctx, done: bool):
    ratios, figs = {}, {}
    for s in sections:
        ratios.update(s.ratios)
        figs.update(s.figs)
    failed, skipped = gaps(sections)
    dev = ctx.device
    figs.update(device=(dev.get("kind") or "?").replace(" ", "_"), jax=dev.get("jax"),
                smoke=int(ctx.smoke), failed=",".join(failed) or "none",
                skipped=",".join(skipped) or "none",
                wall_s=round(ctx.budget.elapsed(), 1))  # fmt: skip
    if not done:
        figs["incomplete"] = 1
    body = list(header)
    for s in sections:
        body += ["", f"== {s.title} ==", *s.lines]
    body += ["", " ".join(f"{k}={fmt(v)}" for k, v in {**ratios, **figs}.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text("\n".join(body) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def copy_out(dest: Path, result: Path, work: Path) -> None:
    """The result and the runs' records and logs (no checkpoints, no caches) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(result, dest / result.name)
    with tarfile.open(dest / "e2e_records.tar.gz", "w:gz") as tf:
        for p in sorted(work.rglob("*")):
            rel = p.relative_to(work)
            keep = p.name in ("metrics.jsonl", "summary.json", "config.json") or (
                p.suffix in (".log", ".json") and len(rel.parts) <= 2 and p.stat().st_size < 2**22)
            if p.is_file() and keep and "checkpoints" not in rel.parts \
                    and "compile_cache" not in rel.parts and not rel.parts[0].startswith("cc_"):
                tf.add(p, arcname=str(rel))


# ---- --prepare: what the device call carries ------------------------------------------------


def gpu_aot_missing(env: dict) -> str | None:
    """Why --prepare cannot compile for a GPU here (None: it can): XLA's GPU compiler comes
    with jax's CUDA plugin (the gpu-aot extra), looked for as ``env`` would import it."""
    find = ("import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in "
            "('jax_cuda12_plugin', 'jax_cuda13_plugin')))")  # fmt: skip
    if subprocess.run([PY, "-c", find], env=env, cwd="/").returncode == 0:
        return None
    import importlib.metadata as md

    v = md.version("jax")
    return (f"compiling for gpu:{PREPARED_GPUS[0]}-1 and gpu:{PREPARED_GPUS[1]}-1 needs jax's "
            "CUDA plugin, not installed here: pip install -e \".[gpu-aot]\", or pip install "
            f"--no-deps --target DIR jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} and "
            "--gpu-aot-path DIR; without the files (d) skips loading a program compiled "
            "here")  # fmt: skip


def prepare(args) -> int:
    """Here, before a device call: the CIFAR-10 pack, the compiled digits files (and the
    compile tool's ResNet-50 memory report) for gpu:h100-1 and gpu:h200-1 where jax's CUDA
    plugin is installed, and the sizes. Exit 1 where a part failed or the call would lack
    bench/gpu/wheels or go over its size."""
    rc = 0
    out = GPU_DIR / "compiled"
    if not (Path(args.pack) / pack_cifar.INDEX).is_file():
        print("packing CIFAR-10 ...", flush=True)
        src = pack_cifar.default_src()
        try:
            idx = pack_cifar.pack(src, Path(args.pack))
            print(f"  {idx['pack_bytes'] / 2**20:.2f} MiB from {src} into {args.pack}")
        except (pack_cifar.PackError, OSError) as e:
            print(f"  failed: {e} (set HYBRIDPAR_DATA to the folder holding cifar10-jpeg/)")
            rc = 1
    peer = Path(args.peers) / "airbench94.py"
    if not peer.is_file():
        print(f"note: no {peer}: copy legacy/airbench94.py of github.com/KellerJordan/"
              f"cifar10-airbench there (and its LICENSE); it stays out of git")
    env = dict(os.environ)
    if args.gpu_aot_path:  # the CUDA plugin in a folder of its own, off the shared venv
        env["PYTHONPATH"] = args.gpu_aot_path + os.pathsep + env.get("PYTHONPATH", "")
    work = Path(args.work or tempfile.mkdtemp(prefix="hybridpar-e2e-prepare-")).resolve()
    work.mkdir(parents=True, exist_ok=True)  # only the compiles' working folder: kept as is
    aot_missing = gpu_aot_missing(env)
    if aot_missing:
        print(f"compiled files: skipped: {aot_missing}")
    else:
        out.mkdir(exist_ok=True)
    for gpu in PREPARED_GPUS if aot_missing is None else ():
        target = f"gpu:{gpu}-1"
        jobs = [(f"digits_{gpu}", digits_args(False), True),
                (f"resnet_{gpu}", ["--config", RESNET_CONFIG,
                                   *[f"--config.{k}={v}" for k, v in resnet_overrides(False)]],
                 False)]  # fmt: skip
        for name, cargs, keep in jobs:
            binf = out / f"{name}.bin"
            cmd = [PY, "-m", "hybridpar.compile", *cargs, "--target", target, "--json"]
            if keep:
                cmd += ["--out", str(binf), "--overwrite"]  # a prepare made again
            print(f"compiling {name} for {target} ...", flush=True)
            p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
            rep = None
            for line in reversed(p.stdout.splitlines()):
                if line.startswith("{"):
                    rep = json.loads(line)
                    break
            if p.returncode != 0 or rep is None:
                print(f"  failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
                rc = 1
                continue
            import importlib.metadata as md

            rep["jax"] = md.version("jax")
            rep.pop("programs_hlo", None)
            for r in rep.get("programs", []):  # the memory is what (c)/(d) read; keep it small
                r.pop("collectives", None)
                r.pop("overlap", None)
            (out / f"{name}.json").write_text(json.dumps(rep))
            print(f"  largest {rep.get('largest')}: "
                  f"{compiled_total(rep) / 2**20:.1f} MiB per GPU" + (f"; {binf}" if keep else ""))
    total, lines = pack_cifar.sizes()
    wheels = "bench/gpu/wheels"
    if not (ROOT / wheels).is_dir():  # the device call cannot install hybridpar without it
        fix = "MISSING: run bash bench/gpu/wheels.sh where pip reaches PyPI"
        lines = [ln.replace("(absent)", fix) if ln.startswith(wheels) else ln for ln in lines]
        rc = 1
    print("\n".join(lines))
    return rc if total <= pack_cifar.LIMIT else 1


# ---- main -------------------------------------------------------------------------------------

SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


def refuse(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


def work_refusal(work: Path) -> str | None:
    """Why ``--work`` cannot be the scratch folder (None: it can). The run clears its
    scratch folder: one that holds files and no MARKER is not ours to clear."""
    if work.exists() and not work.is_dir():
        return f"--work {work} is a file: give a folder, or leave --work out (a new one in /tmp)"
    if work.is_dir() and any(work.iterdir()) and not (work / MARKER).is_file():
        return (f"--work {work} holds files and is not a scratch folder of this script (no "
                f"{MARKER} in it), and a run clears its scratch folder: give a new or empty "
                "folder, e.g. --work /tmp/my-e2e, or leave --work out (a new one in "
                "/tmp)")  # fmt: skip
    return None


def make_work(work: Path | None, smoke: bool) -> Path:
    """The scratch folder, marked as ours: a new one in /tmp (``work`` None: two runs at once
    never share one), or ``work`` emptied (work_refusal found it empty, absent or ours)."""
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="hybridpar-e2e-smoke-" if smoke else "hybridpar-e2e-"))
    elif (work / MARKER).is_file():
        shutil.rmtree(work)  # an earlier run's scratch folder
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("a scratch folder of bench/gpu/e2e.py: a run with --work here "
                               "clears it\n")  # fmt: skip
    return work.resolve()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few steps")
    p.add_argument("--prepare", action="store_true", help="here: pack, compile, sizes")
    p.add_argument("--sections", default="a,d,b,c", help="which, in this order")
    p.add_argument("--budget-s", type=float, default=None, help="480 (GPU), 240 (--smoke)")
    p.add_argument("--work", default=None,
                   help="scratch folder, cleared (default: a new one in /tmp); one that holds "
                        "files this script did not make is refused")  # fmt: skip
    p.add_argument("--out", default=None,
                   help="result file (default bench/results/gpu/e2e_GPU_DATE_TIME.txt; with "
                        "--smoke, in the scratch folder); an existing one needs "
                        "--overwrite")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--copy-to", default=os.environ.get("OUT") or None,
                   help="also copy the result and records here (default $OUT)")
    p.add_argument("--pack", default=str(GPU_DIR / "data"))
    p.add_argument("--peers", default=str(GPU_DIR / "peers"))
    p.add_argument("--per-class", type=int, default=20, help="--smoke: CIFAR images per class")
    p.add_argument("--cifar-runs", type=int, default=None,
                   help="(b): runs a side, ours (seeds 0..) and airbench94's, medians "
                        "compared (default 3; 2 with --smoke)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=None,
                   help="sections at once: 1 on a GPU (timings), 3 with --smoke ((d) after (a))")
    p.add_argument("--gpu-aot-path", default=os.environ.get("HYBRIDPAR_GPU_AOT_PATH", ""),
                   help="--prepare: a folder holding jax's CUDA plugin (pip install --target)")
    args = p.parse_args(argv)
    if args.prepare:
        return prepare(args)
    # every refusal before anything is written or run
    funcs = SECTIONS
    keys = [k.strip() for k in args.sections.split(",") if k.strip()]
    bad = [k for k in keys if k not in funcs]
    if bad or not keys:
        return refuse(f"--sections {args.sections!r}: unknown {','.join(bad) or 'empty'}; "
                      "give some of a, b, c, d, e.g. --sections a,d")  # fmt: skip
    if args.cifar_runs is None:
        args.cifar_runs = 2 if args.smoke else 3
    if args.cifar_runs < 1:
        return refuse(f"--cifar-runs {args.cifar_runs}: give 1 or more, e.g. --cifar-runs 3")
    if args.out and Path(args.out).exists() and not args.overwrite:
        return refuse(f"--out {args.out} exists: give a new file, or add --overwrite to "
                      "replace it")  # fmt: skip
    work = Path(args.work).resolve() if args.work else None
    why = work_refusal(work) if work else None
    if why:
        return refuse(why)
    if args.budget_s is None:
        args.budget_s = 240.0 if args.smoke else 480.0
    if args.smoke:  # one device, as the GPU machine has (the test suite asks for 8 CPUs)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
        os.environ["XLA_FLAGS"] = " ".join(flags)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    existed = work is not None and work.is_dir()
    args.work = str(make_work(work, args.smoke))
    ctx = Context(args)
    print(f"scratch folder: {ctx.work}", flush=True)
    ctx.device = PROBE_FN(ctx.work)
    dev = ctx.device
    name = gpu_name(dev.get("kind", "")) or dev.get("platform", "dev")
    now = datetime.datetime.now(datetime.timezone.utc)
    # a smoke's figures are not results: its file stays in the scratch folder. The time in
    # the name (and a number where even that is taken): a second try of the same call, on a
    # machine that kept the first's file, writes a file of its own
    folder = ctx.work if args.smoke else ROOT / "bench" / "results" / "gpu"
    stem = f"e2e_{name}_{now:%Y-%m-%d_%H%M%S}" + ("_smoke" if args.smoke else "")
    out = Path(args.out) if args.out else folder / f"{stem}.txt"
    n = 1
    while not args.out and out.exists():
        n += 1
        out = folder / f"{stem}_{n}.txt"
    if not args.smoke and dev.get("platform") != "gpu":
        why = (f"JAX's default backend here is {dev.get('platform')} ({dev.get('kind')}), "
               "not a GPU, and this call measures one: bash bench/gpu/e2e.sh --smoke checks "
               "the script on CPU with tiny shapes")  # fmt: skip
        if dev.get("platform") == "?":
            said = Proc("probe", None, 0, False, ctx.work / "logs" / "probe.log").tail(1)
            why = f"JAX did not start here: {said[0] if said else 'no output'}"
        shutil.rmtree(ctx.work)  # what this run wrote; a folder given that was there stays
        if existed:
            ctx.work.mkdir()
        return refuse(why)
    stamp = now.strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"# bash bench/gpu/e2e.sh{' --smoke' if args.smoke else ''}, {stamp}: "
        f"{dev.get('count')} x {dev.get('kind')} ({dev.get('platform')}); jax {dev.get('jax')} "
        f"(jaxlib {dev.get('jaxlib')}, CUDA plugin {dev.get('cuda_plugin')}), torch "
        f"{dev.get('torch')}; nvidia-smi: {dev.get('nvidia_smi')}",
        f"# budget {args.budget_s:g}s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        "each run through the train CLI, read back from its metrics.jsonl and summary.json",
    ]
    if args.smoke:
        header.append("# SMOKE: CPU, tiny shapes, a few steps: these figures say the script "
                      "works, nothing about speed or accuracy")
    done: dict[str, Section] = {}
    lock = __import__("threading").Lock()

    def one(key: str) -> None:
        if ctx.budget.left() < 20:
            s = Section(key, f"({key}) not run")
            s.fail(f"the budget of {args.budget_s:g}s (--budget-s) is spent")
        else:
            try:
                s = funcs[key](ctx)
            except Exception as e:  # one section's bug must not cost the others
                s = Section(key, f"({key}) failed")
                s.fail(f"{type(e).__name__}: {e}")
                s.lines += ["  " + ln for ln in traceback.format_exc().splitlines()[-8:]]
        with lock:
            done[key] = s
            write_result(out, header, [done[k] for k in keys if k in done], ctx, done=False)
            if args.copy_to:
                copy_out(Path(args.copy_to), out, ctx.work)

    # (d) compares with (a)'s run, so it goes after it in the same group
    groups = [[k for k in keys if k in ("a", "d")]] + [[k] for k in keys if k not in ("a", "d")]
    groups = [g for g in groups if g]
    jobs = args.jobs or (3 if args.smoke else 1)
    if jobs <= 1:
        for key in keys:
            one(key)
    else:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for f in [pool.submit(lambda g=g: [one(k) for k in g]) for g in groups]:
                f.result()
    sections = [done[k] for k in keys]
    write_result(out, header, sections, ctx, done=True)
    if args.copy_to:
        copy_out(Path(args.copy_to), out, ctx.work)
    print(out.read_text())
    print(f"result: {out}")
    # the file holds what ran; the exit status says whether all that was asked for did
    for s in sections:
        if s.error:
            print(f"({s.key}) failed: {s.error}")
        if s.missing:
            print(f"({s.key}) skipped: {s.missing}")
    return 1 if any(gaps(sections)) else 0


if __name__ == "__main__":
    sys.exit(main())
