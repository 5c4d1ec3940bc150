"""The scaling model's command line: a table (or JSON) of predicted steps and times to train
over device counts, the validation table, the presets (`python -m hybridpar.simulate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from hybridpar.config import cli
from hybridpar.config.formatting import duration, table
from hybridpar.simulate.calibration import fit_rate, points_from_metrics
from hybridpar.simulate.hardware import GB, TFLOPS, Preset
from hybridpar.simulate.plot import write_png
from hybridpar.simulate.step import (
    MAX_CONVERGED_BATCH,
    PRESETS,
    Evaluation,
    Stage,
    beyond_converged_batch,
    calibrate,
    devices_problem,
    exposed_source,
    format_stages,
    get_preset,
    no_step_stage,
    over_one_epoch,
    parse_stages,
    predict_step,
    time_to_train,
    with_calibrated_efficiency,
)
from hybridpar.simulate.validation import PASS_BAND, counted, validation_table, what_if_table
from hybridpar.simulate.workload import (
    IMAGENET_TRAIN_IMAGES,
    Workload,
    read_comm_report,
    report_epochs,
    report_eval,
    report_images_per_epoch,
    resnet50_workload,
    workload_from_report,
)

DEFAULT_DEVICES = [2**k for k in range(3, 13)]  # 8 .. 4096
BEYOND = "beyond any published converged batch"
NOT_TRAINABLE = "not trainable"
VALIDATION_FAILED = 1  # exit status of --validate with a case outside the band (2: bad input)
PLOT_FORMATS = (".png", ".pdf", ".svg")  # --png's, each a format matplotlib always writes


# what "per device" means in the batch flags, the title's "/device" and the legend, as in
# config.stages: the global batch over the batch-shard devices (data x fsdp)
PER_DEVICE = "images per batch-shard device, the global batch / (data x fsdp) devices"
DEVICES_FORM = "a comma list and/or doubling range of counts >= 1, e.g. 8,16,32 or 8..4096"


def parse_devices(text: str) -> list[int]:
    """ "8,16,32" or a doubling range "8..4096" (or a mix)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dots, hi = part.partition("..")
        try:
            lo = int(lo)
            hi = int(hi) if dots else lo
        except ValueError:
            raise ValueError(f"bad device count {part!r}: write {DEVICES_FORM}") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"bad device count {part!r}: write {DEVICES_FORM}")
        v = lo
        while v <= hi:
            out.append(v)
            v *= 2
        if out[-1] != hi:  # 8..100 ran 8..64 unsaid: a doubling range ends on a doubling
            raise ValueError(
                f"{part!r} does not end on a doubling of {lo}: write e.g. {lo}..{out[-1]} or "
                f"{lo}..{out[-1] * 2}, or a comma list such as {lo},{hi}"
            )
    if not out:
        raise ValueError(f"no device counts given: write {DEVICES_FORM}")
    return out


def simulate(
    workload: Workload,
    preset: Preset,
    devices: Iterable[int],
    per_device_batch: int,
    image_size: int,
    stages: Sequence[Stage],
    overlap: float = 0.8,
    efficiency: float | None = None,
    images_per_epoch: int = IMAGENET_TRAIN_IMAGES,
    eval_s_per_epoch: float = 0.0,
    evaluation: Evaluation | None = None,
) -> list[dict]:
    """One row per device count: the step at (per_device_batch, image_size) and the time to
    train through `stages`. Device counts that the model-parallel size or the comm report's
    fixed axes (`Workload.devices_multiple`) do not divide, and counts the preset does not
    model (`devices_problem`), are skipped. A count where a stage's global batch is more
    than one epoch gets no time to train (the trainer takes no step there): `over_one_epoch`
    is that batch, the times None; so does one where a stage rounds to no step (the trainer
    refuses it): `no_step` is the trainer's error (`no_step_stage`). One past the largest
    global batch published to reach ImageNet's target (`beyond_converged_batch`) has unknown
    epochs, so its times are None."""
    rows = []
    for p in devices:
        if p % workload.model_parallel or p % workload.devices_multiple:
            continue
        if devices_problem(preset, p, workload):
            continue
        step = predict_step(workload, preset, p, per_device_batch, image_size, overlap, efficiency)
        row = dataclasses.asdict(step)
        row["over_one_epoch"] = over_one_epoch(stages, p, images_per_epoch, workload.model_parallel)
        row["no_step"] = no_step_stage(stages, p, images_per_epoch, workload.model_parallel)
        if row["over_one_epoch"] is not None or row["no_step"] is not None:
            row.update(time_to_train_s=None, eval_s=None, stage_s=None, stage_efficiency=None)
            row["beyond_converged_batch"] = False
            rows.append(row)
            continue
        tt = time_to_train(
            workload,
            preset,
            p,
            stages,
            images_per_epoch,
            overlap,
            efficiency,
            eval_s_per_epoch,
            evaluation,
        )
        row["time_to_train_s"] = tt.total_s
        row["eval_s"] = tt.eval_s
        row["stage_s"] = [secs for _, _, secs in tt.stages]
        row["stage_efficiency"] = [s.efficiency for _, s, _ in tt.stages]
        # ImageNet's epochs to the target are published only up to MAX_CONVERGED_BATCH
        row["beyond_converged_batch"] = images_per_epoch == IMAGENET_TRAIN_IMAGES and (
            beyond_converged_batch(stages, p, workload.model_parallel)
        )
        if row["beyond_converged_batch"]:  # the epochs are unknown, so are the times
            row.update(time_to_train_s=None, eval_s=None, stage_s=None)
        rows.append(row)
    return rows


def train_time(s: float) -> str:
    """``duration``, but under a second in milliseconds: a tiny run's time to train on many
    devices is not "0.0 s"."""
    ms = round(s * 1e3, 1)
    return f"{ms:.1f} ms" if ms < 1000 else duration(s)


def format_rows(rows: list[dict], images_per_epoch: int | None = None) -> str:
    header = [
        "devices",
        "nodes",
        "algorithm",
        "step ms",
        "compute ms",
        "exposed ms",
        "comm ms",
        "images/s",
        "efficiency",
        "time to train",
    ]
    body = [
        [
            str(r["devices"]),
            str(r["nodes"]),
            r["algorithms"],
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['compute_s'] * 1e3:.1f}",
            f"{r['exposed_comm_s'] * 1e3:.1f}",
            f"{r['comm_s'] * 1e3:.1f}",
            f"{r['images_per_s']:,.0f}",
            f"{r['efficiency']:.3f}",
            time_cell(r),
        ]
        for r in rows
    ]
    out = table(body, header)
    if any(r.get("over_one_epoch") for r in rows):
        epoch = f"{images_per_epoch:,} images" if images_per_epoch else "its images"
        out += (
            f"\n{NOT_TRAINABLE}: a stage's global batch is more than one epoch ({epoch}); the "
            "trainer runs full batches only, so it takes no step: fewer devices or a smaller "
            "per-device batch"
        )
    short = next((r for r in rows if r.get("no_step")), None)
    if short is not None:  # the trainer's own error, at the first count that has it
        out += f"\n{NOT_TRAINABLE} (0 steps): on {short['devices']} devices, {short['no_step']}"
    if any(r.get("beyond_converged_batch") for r in rows):
        out += (
            f"\n{BEYOND}: a global batch over {MAX_CONVERGED_BATCH:,}, the largest published "
            "to reach ResNet-50's target on ImageNet; its epochs to the target are unknown"
        )
    return out


def time_cell(r: dict) -> str:
    """The time-to-train column of one row: a time, or why there is none."""
    if r.get("over_one_epoch"):
        return f"{NOT_TRAINABLE} (batch {r['over_one_epoch']:,})"
    if r.get("no_step"):
        return f"{NOT_TRAINABLE} (0 steps)"
    if r.get("beyond_converged_batch"):
        return BEYOND
    return train_time(r["time_to_train_s"])


def legend(workload: Workload, preset: Preset, efficiency: float | None) -> str:
    """Which of the table's inputs are measured, compiled or assumed: every column is
    modelled from them."""
    if workload.compiled_by:
        work = f"FLOPs and collectives compiled by {workload.compiled_by} (a comm report)"
    else:
        work = "FLOPs and collectives of the analytic ResNet-50 (counted, not compiled)"
    rate = "set by --calibrate/--efficiency" if efficiency is not None else preset.reference_note
    return (
        f"every column modelled: {work}; the device's rate {rate}; links from public figures; "
        f"per-step floor {preset.step_floor_s * 1e3:g} ms (ASSUMPTION unless set); "
        f"/device: {PER_DEVICE}" + slices_note(preset)
    )


def slices_note(preset: Preset) -> str:
    """A TPU preset's assumption about pods larger than one slice, for the legend."""
    if not preset.torus_dims:
        return ""
    size = f"{preset.devices_per_node:,}"
    if preset.max_devices:
        return (
            f"; nodes: slices; one slice of at most {size} chips (the chip table has no DCN "
            "bandwidth, so no count beyond it is modelled)"
        )
    dcn = preset.inter_link()
    return (
        f"; nodes: slices of at most {size} chips on ICI (its largest slice), joined over DCN "
        f"at {dcn.bandwidth / GB:.3g} GB/s per chip beyond it (ASSUMPTION: only data "
        f"crosses slices, each chip's share of the hosts' NICs, {dcn.latency * 1e6:g} us a "
        "message step)"
    )


def exposed_from(workload: Workload, overlap: float, preset: Preset | None = None) -> str:
    """What decides the exposed communication, for the table's title: the compiler's
    schedule where the comm report says what it hides, else nothing hidden on a preset
    that hides nothing (a TPU's), else the assumed overlap."""
    if workload.hidden_share is None and preset is not None and preset.max_overlap <= 0:
        return f"no overlap: {preset.name} hides no communication (exposed = comm)"
    if workload.hidden_share is None:
        return f"overlap {overlap:g}"
    return (
        f"exposed comm from the compiler's schedule ({workload.hidden_share:.0%} of the "
        f"collective bytes hidden, est.; overlap {overlap:g} not used)"
    )


def _fmt_validated(r: dict, v: float) -> str:
    if r["metric"] == "efficiency":
        return f"{v:.3f}"
    if r["metric"] == "images_per_s_per_chip":
        return f"{v:,.0f} img/s/chip"
    return f"{v:.0f} s"


def _main_table(results: list[dict], with_held_out: bool = True) -> str:
    ov = results[0]["overlap"] if results else 0.8
    header = [
        "run",
        "published (measured)",
        f"predicted (overlap {ov:g})",
        "ratio",
        f"within {PASS_BAND:.0%}",
        "algorithm",
        "predicted (overlap 0)",
        "ratio",
    ]
    if with_held_out:
        header.append("held out (counted)")
    body = [
        [
            r["run"],
            r["reported"],
            _fmt_validated(r, r["predicted"]),
            f"{r['ratio']:.2f}",
            r["verdict"],
            r["algorithm"],
            _fmt_validated(r, r["predicted_no_overlap"]),
            f"{r['predicted_no_overlap'] / r['reported_value']:.2f}",
            *(["yes" if r["held_out"] else "NO (not counted)"] if with_held_out else []),
        ]
        for r in results
    ]
    return table(body, header)


SPLIT_KINDS = ["compute", "param", "fixed", "comm", "input", "eval", "startup", "size change"]
SPLIT_KINDS += ["floor"]


def _split_table(results: list[dict]) -> str:
    split = []
    for r in results:
        if r["metric"] == "efficiency":  # one step on the larger device count, in ms
            cells = [f"{r['parts'].get(k, 0.0) * 1e3:.1f} ms" for k in SPLIT_KINDS]
            total = f"{sum(r['parts'].values()) * 1e3:.1f} ms/step"
        else:
            cells = [f"{r['parts'].get(k, 0.0):.1f} s" for k in SPLIT_KINDS]
            total = f"{sum(r['parts'].values()):.1f} s"
            if r["metric"] == "images_per_s_per_chip":
                total += f" (published {r['published_s']:g} s)"
        split.append([r["run"], *cells, total])
    split_header = ["where the prediction goes", "compute", "per-parameter", "fixed per step"]
    split_header += ["comm (exposed)", "input", "eval", "start-up", "size change"]
    split_header += ["per-step floor", "predicted"]
    return table(split, split_header)


def format_validation(results: list[dict], what_if: list[dict] | None = None) -> str:
    """The validation table (published figures are measured, predictions modelled), then
    where each prediction's seconds go, the logs' own blocks, the what-if rows (not
    validated, not counted), what set the constants and the sources."""
    pods = [r for r in results if r.get("published_block_s")]
    steady = [
        [
            r["run"],
            f"{r['published_block_s']:.3f} s",
            f"{r['predicted_block_s']:.3f} s",
            f"{r['predicted_block_s'] / r['published_block_s']:.2f}",
            f"{r['published_startup_s']:.2f} s",
            f"{r['predicted_startup_s']:.2f} s",
        ]
        for r in pods
    ]
    steady_header = ["in the logs' own blocks", "4 epochs (log)", "4 epochs (model)", "ratio"]
    steady_header += ["start-up (log)", "start-up (model)"]
    sources = [f"{r['run']}: {r['source']}" for r in results if r.get("source")]
    misses = [f"  {r['run']}: {r['miss']}" for r in results if r.get("miss")]
    extra = []
    if what_if:
        extra = [
            "what-if (not validated, not counted): other inputs than the calibrated ones",
            _main_table(what_if, with_held_out=False),
            "",
            _split_table(what_if),
            "",
        ]
    return "\n".join(
        [
            _main_table(results),
            "",
            _split_table(results),
            "",
            *([table(steady, steady_header), ""] if steady else []),
            *extra,
            "published: measured by the runs' authors (the MLPerf figures from their result "
            "logs, the DAWNBench ones from their entries' logs); predicted: modelled (compute "
            "at the fitted fraction of peak, on a TPU the compiler's FLOPs at the run's batch "
            "per chip, the per-parameter work over HBM bandwidth, a fixed cost per step, the "
            "all-reduce as rings along the torus sides (alpha-beta), evaluation, input, "
            "start-up and changes of image size where calibrated, the per-step floor an "
            "assumption)",
            *(["what is missing where a held-out case misses:", *misses] if misses else []),
            *held_out_lines(results),
            *sources,
        ]
    )


def held_out_lines(results: list[dict]) -> list[str]:
    """Which published runs set the constants (calibration) and which only check them
    (validation), as --validate says it."""
    from hybridpar.simulate.validation import CALIBRATION_RUNS, OTHER_CALIBRATION_SOURCES

    lines = ["calibration (set the constants; not checked against):"]
    lines += [f"  {r.run}: {r.source}" for r in CALIBRATION_RUNS]
    lines += [f"  {k}: {v}" for k, v in OTHER_CALIBRATION_SOURCES.items()]
    kept = counted(results)
    lines.append(
        f"validation (only checked): {len(kept)} of {len(results)} cases held out and counted"
    )
    lines += [
        f"  NOT held out, not counted: {r['run']} (calibrated on {', '.join(r['calibrated_on'])})"
        for r in results
        if not r["held_out"]
    ]
    return lines


def _calibrated(preset: Preset, workload: Workload, args) -> Preset:
    """The preset with what the calibration flags measured or set."""
    changes = {}
    if args.step_overhead_s is not None:
        changes["step_overhead_s"] = args.step_overhead_s
    if args.input_per_core is not None:
        rate, size = input_per_core(args.input_per_core)
        changes.update(
            input_images_per_s_per_core=rate,
            input_reference_size=size,
            cores_per_device=args.cores_per_device,
        )
    if args.eval_overhead_s is not None:
        changes["eval_overhead_s"] = args.eval_overhead_s
    if args.step_floor_s is not None:
        changes["step_floor_s"] = args.step_floor_s
    if any(v < 0 for v in changes.values()):
        raise ValueError(f"calibration values must be >= 0, got {changes}")
    preset = dataclasses.replace(preset, **changes)
    if "step_overhead_s" in changes:  # the reference rate now includes the overhead
        try:
            preset = with_calibrated_efficiency(preset, workload)
            above_peak(
                preset.efficiency,
                "the preset's reference rate with this overhead",
                "give a smaller overhead, e.g. 0.004",
            )
        except ValueError as e:
            raise ValueError(f"--step-overhead-s {args.step_overhead_s:g}: {e}") from None
    if args.calibrate_from:
        try:
            points = points_from_metrics(args.calibrate_from, args.calibrate_devices or 1)
            preset = fit_rate(points, preset, workload, f"fitted to {args.calibrate_from}")
            above_peak(
                preset.efficiency,
                "the fitted rate",
                "is --preset the run's device and --calibrate-devices its device count?",
            )
        except (ValueError, OSError) as e:
            raise ValueError(f"--calibrate-from: {e}") from None
    return preset


def above_peak(efficiency: float, what: str, fix: str) -> None:
    """A calibration that makes the device faster than its peak FLOP rate is bad input."""
    if efficiency > 1:
        raise ValueError(
            f"{what} would need {efficiency:.3g} times the device's peak FLOP rate; {fix}"
        )


def modelled_counts(counts, workload: Workload, preset: Preset, unit: int) -> list[int]:
    """The counts of `counts` that hold the comm report's mesh (multiples of `unit`, its
    axes that keep their size) and that the preset models (`devices_problem`)."""
    return [p for p in counts if not p % unit and not devices_problem(preset, p, workload)]


def count_hint(workload: Workload, preset: Preset, unit: int) -> str:
    """The end of a fix to pass multiples of `unit`: a few the preset models, or why none."""
    ok = modelled_counts([unit << k for k in range(13)], workload, preset, unit)
    if ok:
        return f"e.g. --devices {','.join(map(str, ok[:4]))}"
    why = devices_problem(preset, unit, workload)
    return f"none of which {preset.name} models ({why}); try another --preset"


def check_devices(text: str, devices: list[int], workload: Workload, preset: Preset, unit: int):
    """Every count of ``--devices`` can hold the comm report's mesh (a multiple of its axes
    that keep their size, `unit`) and is one the preset models (`devices_problem`); else a
    ValueError naming the count and counts that work."""
    bad = [p for p in devices if p % unit]
    if bad and workload.devices_multiple > 1:
        raise ValueError(
            f"--devices {text}: {bad[0]} devices cannot hold the comm report's mesh "
            f"{workload.mesh}, whose axes other than data keep their {workload.devices_multiple} "
            f"devices as data grows; pass multiples of {unit} (the smallest: {unit}), "
            + count_hint(workload, preset, unit)
        )
    if bad:  # the model axis alone
        raise ValueError(
            f"--devices {text}: {bad[0]} is not a multiple of the comm report's model-parallel "
            f"size {unit}; pass multiples of {unit}, " + count_hint(workload, preset, unit)
        )
    for p in devices:
        problem = devices_problem(preset, p, workload)
        if problem:
            raise ValueError(f"--devices {text}: {problem}")


def _stages(args, report) -> tuple[list[Stage], str]:
    """The stages to train through, and where they come from: the flags, else the comm
    report's own run, else 35 epochs."""
    if args.stages:
        return parse_stages(args.stages), "--stages"
    if args.epochs is not None:
        return [Stage(args.epochs, args.image_size, args.per_device_batch)], "--epochs"
    if report is None:
        return [Stage(35.0, args.image_size, args.per_device_batch)], "35 epochs, the default"
    epochs, said = report_epochs(report)
    if epochs is None:
        raise ValueError(f"--comm-report {args.comm_report}: {said}; pass --epochs E")
    if isinstance(epochs, str):  # the run's curriculum, batches per batch shard
        from hybridpar.config.curriculum import parse_stages as parse_curriculum

        return [Stage(e, size, b) for e, size, b, _ in parse_curriculum(epochs)], said
    return [Stage(epochs, args.image_size, args.per_device_batch)], said


def _evaluation(args, report) -> Evaluation | None:
    """The evaluation passes --eval-every-epochs asks for: the comm report's own (its eval
    split, image size and eval batch) where it has a config, else ImageNet's 50,000 images
    at 224 px."""
    if args.eval_every_epochs <= 0:
        return None
    own = report_eval(report, args.per_device_batch) if report is not None else None
    if own is None:
        return Evaluation(args.eval_every_epochs, per_device_batch=args.per_device_batch)
    return Evaluation(args.eval_every_epochs, **own)


def _images_per_epoch(args, report) -> tuple[int, str]:
    """Training images per epoch, and where that comes from: the flag, else the comm
    report's data set, else ImageNet's."""
    if args.images_per_epoch is not None:
        if args.images_per_epoch < 1:
            raise ValueError(f"--images-per-epoch={args.images_per_epoch} must be >= 1")
        return args.images_per_epoch, "--images-per-epoch"
    if report is None:
        return IMAGENET_TRAIN_IMAGES, "ImageNet's train split, the default"
    n, said = report_images_per_epoch(report)
    if n is None:
        raise ValueError(
            f"--comm-report {args.comm_report}: {said}; pass --images-per-epoch N, its "
            "training images (ImageNet's train split: 1281167)"
        )
    return n, said


def number(meaning: str, example: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """`type=` of a float flag: a finite number (`cli.finite_float`) for which `ok` holds,
    else an error that says what the flag takes and a good value."""

    def parse(text: str) -> float:
        try:
            value = cli.finite_float(text)
        except argparse.ArgumentTypeError:
            value = math.nan
        if not ok(value):  # nan fails every comparison
            raise argparse.ArgumentTypeError(f"{text!r} is not {meaning}; e.g. {example}")
        return value

    return parse


def count(meaning: str, example: str) -> Callable[[str], int]:
    """`type=` of an integer flag: a whole number >= 1, else an error that says what the
    flag takes and a good value (a count of 0 divides by zero deep in the model)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not {meaning} >= 1; e.g. {example}")
        return value

    return parse


MIN_BUCKET_MB = 0.001  # smaller buckets are millions of list entries, not a what-if
MAX_EPOCHS = 1e6  # with MIN_EVAL_EVERY: at most 1e9 evaluation passes, a finite count
MIN_EVAL_EVERY = 0.001
SECONDS = "a number of seconds >= 0"


def input_per_core(text: str) -> tuple[float, int]:
    """--input-per-core IMAGES_PER_S@SIZE -> (images/s of one core, image size in px)."""
    rate, sep, size = text.partition("@")
    try:
        value = (float(rate), int(size)) if sep else None
    except ValueError:
        value = None
    if value is None or not (math.isfinite(value[0]) and value[0] > 0 and value[1] >= 1):
        raise ValueError(
            f"--input-per-core {text!r}: write IMAGES_PER_S@SIZE, a rate > 0 at an image "
            "size in px, e.g. 400@128, with --cores-per-device"
        )
    return value


# The preset of the chip a comm report's target names (its devices' kind, as the compiler
# gives it: "TPU v5 lite", "NVIDIA H200"); more specific names first.
CHIP_PRESETS = (
    ("v6 lite", "tpu-v6e"), ("v6e", "tpu-v6e"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"),
    ("v5p", "tpu-v5p"), ("v5", "tpu-v5p"), ("v4", "tpu-v4"), ("v3", "tpu-v3"),
    ("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v100", "v100"), ("p100", "p100"),
)  # fmt: skip


def warn_other_chip(devices: dict, preset: str, path: str) -> None:
    """A report compiled for one accelerator (``--target``) modelled on another's figures
    (``--preset``, h100 by default) was said only by the table's header. Virtual CPU
    devices' reports name no chip: any preset models them."""
    if devices.get("platform") not in ("tpu", "gpu", "cuda"):
        return
    kind = str(devices.get("kind", "")).lower()
    chip = next((p for k, p in CHIP_PRESETS if k in kind), None)
    # a chip's presets share its name's start (a100, a100-40gb; v100-25gbe, v100-100gbe)
    if chip is None or preset == chip or preset.startswith(chip + "-"):
        return
    fits = [p for p in PRESETS if p == chip or p.startswith(chip + "-")]
    print(f"warning: --comm-report {path} was compiled for {devices.get('kind')} and is "
          f"modelled on --preset {preset}'s chips and links; pass --preset "
          f"{' or '.join(fits)} to model the chips it was compiled for",
          file=sys.stderr)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(
        "python -m hybridpar.simulate",
        "Predict ResNet-50 step time, throughput, scaling efficiency and time to train on 8 "
        "to 4,096 devices\n(alpha-beta communication model).",
        takes_config=False,
    )
    ap.add_argument(
        "--preset", default="h100", help=f"hardware: {', '.join(PRESETS)} (aliases: v100, p100)"
    )
    ap.add_argument(
        "--devices",
        default=None,
        help="comma list and/or doubling range, e.g. 8,16,32 or 8..4096 (default 8..4096, "
        "less the counts a --comm-report's mesh or a TPU preset cannot take); 8..64 is "
        "8,16,32,64: a range's end is its start doubled",
    )
    ap.add_argument(
        "--comm-report",
        default=None,
        metavar="FILE",
        help="take FLOPs and collectives from `hybridpar.comm_report --json` (compiled for "
        "a TPU or GPU: the share of the collectives its schedule leaves exposed is exposed, "
        "whatever --overlap)",
    )
    ap.add_argument(
        "--per-device-batch",
        type=count("a whole number of images per device", "256"),
        default=None,
        help="images per device per step, that is per batch-shard device: the global batch / "
        "(data x fsdp) devices, as in config.stages (default 256, or the comm report's own "
        "batch)",
    )
    ap.add_argument(
        "--image-size",
        type=count("an image side in px, a whole number", "224"),
        default=None,
        help="image side in px (default 224, or the comm report's own size)",
    )
    ap.add_argument(
        "--stages",
        default=None,
        help="curriculum END_EPOCH:IMAGE_SIZE-PER_GPU_BATCH,... (default: the comm "
        "report's own stages, else --epochs at --image-size/--per-device-batch)",
    )
    ap.add_argument(
        "--epochs",
        type=number(
            f"a number of epochs in (0, {MAX_EPOCHS:g}]", "35", lambda v: 0 < v <= MAX_EPOCHS
        ),
        default=None,
        help="epochs when --stages is not given (default: the comm report's num_epochs; "
        "without a report 35)",
    )
    ap.add_argument(
        "--overlap",
        type=number("a fraction in [0, 1]", "0.8", lambda v: 0 <= v <= 1),
        default=0.8,
        help="fraction of the backward pass that can hide communication "
        "(0.8: bucketed/fused reductions; 0: no overlap; not used with a --comm-report "
        "a TPU or GPU compiler scheduled; refused with a TPU preset, which hides nothing)",
    )
    ap.add_argument(
        "--grad-dtype",
        default=None,
        choices=["fp32", "bf16", "fp16", "preset"],
        help="gradient dtype of the analytic ResNet-50 all-reduce (default fp32: "
        "hybridpar keeps float32 parameters, so their gradients are float32; "
        "'preset': the dtype the preset's reference recipe reduced)",
    )
    ap.add_argument(
        "--bucket-mb",
        type=number(
            f"0 (one fused buffer) or a bucket of at least {MIN_BUCKET_MB:g} MB",
            "32",
            lambda v: v == 0 or v >= MIN_BUCKET_MB,
        ),
        default=None,
        help="analytic model: gradient buckets of at most this many MB (default 32; 0: one "
        "fused buffer)",
    )
    ap.add_argument(
        "--efficiency",
        type=number("a fraction of peak in (0, 1]", "0.4", lambda v: 0 < v <= 1),
        default=None,
        help="fraction of peak for a ResNet-50 step (default: the preset's calibrated value)",
    )
    ap.add_argument(
        "--calibrate",
        type=number("a measured rate in images/s > 0", "2500", lambda v: v > 0),
        default=None,
        metavar="IMAGES_PER_S",
        help="calibrate efficiency from a measured single-device rate at "
        "--image-size and --per-device-batch",
    )
    ap.add_argument(
        "--calibrate-from",
        default=None,
        metavar="METRICS_JSONL",
        help="fit the per-step overhead and efficiency to a run's train lines (several "
        "image sizes or batches: a curriculum run; see --calibrate-devices)",
    )
    ap.add_argument(
        "--calibrate-devices",
        type=count("a whole number of devices", "8"),
        default=None,
        help="devices of the --calibrate-from run (its rates are per device; default 1)",
    )
    ap.add_argument(
        "--step-overhead-s",
        type=number(SECONDS, "0.004", lambda v: v >= 0),
        default=None,
        help="fixed seconds per step besides the FLOPs (default: the preset's, 0)",
    )
    ap.add_argument(
        "--step-floor-s",
        type=number(SECONDS, "0.001", lambda v: v >= 0),
        default=None,
        help="the least a step takes, which it cannot go below however small (default: the "
        "preset's, 0.001; 0: none)",
    )
    ap.add_argument(
        "--input-per-core",
        default=None,
        metavar="IMAGES_PER_S@SIZE",
        help="decode + augment rate of one host core at SIZE px, e.g. 400@128 "
        "(bench/input_pipeline.py measures it); needs --cores-per-device",
    )
    ap.add_argument(
        "--cores-per-device",
        type=number("a number of host cores > 0", "4", lambda v: v > 0),
        default=None,
        help="host cores per device (with --input-per-core)",
    )
    ap.add_argument(
        "--eval-every-epochs",
        type=number(
            f"0 (none) or a number of epochs >= {MIN_EVAL_EVERY:g}",
            "1",
            lambda v: v == 0 or v >= MIN_EVAL_EVERY,
        ),
        default=0.0,
        help="an evaluation pass every E epochs on the clock (the comm report's eval split, "
        "else ImageNet's 50,000 images at 224 px; default 0: none)",
    )
    ap.add_argument(
        "--eval-overhead-s",
        type=number(SECONDS, "2", lambda v: v >= 0),
        default=None,
        help="fixed seconds per evaluation pass (with --eval-every-epochs)",
    )
    ap.add_argument(
        "--images-per-epoch",
        type=count("a whole number of images", "1281167"),
        default=None,
        help="training images per epoch (default: the comm report's data set, from its "
        "config; without a report ImageNet's 1,281,167)",
    )
    ap.add_argument(
        "--eval-s-per-epoch",
        type=number(SECONDS, "10", lambda v: v >= 0),
        default=0.0,
        help="fixed evaluation cost added per epoch (seconds)",
    )
    ap.add_argument(
        "--png",
        default=None,
        help="also write a plot: .png, .pdf or .svg (needs matplotlib); a file there already "
        "is refused unless --overwrite",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --png FILE")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="print the validation table against published runs; exit status "
        f"{VALIDATION_FAILED} when any held-out case is outside {PASS_BAND:.0%}% (0 when all "
        "pass; rows calibrated on their own publication are shown, not counted)",
    )
    ap.add_argument(
        "--list-presets",
        action="store_true",
        help="print the hardware presets (peak FLOP/s, dtype, calibrated efficiency, reference "
        "rate, links) and exit; with --json, all of their data",
    )
    return ap


def check_args(args, given: set[str]) -> None:
    """Every flag's value that argparse's types cannot check alone, before any work: a
    ValueError naming the flag and what it takes. ``given``: the dests of the flags on the
    command line (`parse_args`)."""
    # flags that only change what another flag turns on: alone they would do nothing
    for flag, other, example in (
        ("--cores-per-device", "--input-per-core", "400@128"),
        ("--eval-overhead-s", "--eval-every-epochs", "1"),
        ("--calibrate-devices", "--calibrate-from", "RUN/metrics.jsonl"),
    ):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not getattr(args, other[2:].replace("-", "_")):
            raise ValueError(f"{flag} needs {other}, e.g. {other} {example} {flag} {value:g}")
    # flags another flag makes moot: refused, never silently unused
    for flag, on, uses in (
        ("--list-presets", args.list_presets, {"list_presets", "json"}),
        ("--validate", args.validate, {"validate", "json", "overlap"}),
    ):
        moot = [k for k in vars(args) if k in given and k not in uses]
        if on and moot:
            names = ", ".join("--" + k.replace("_", "-") for k in moot)
            raise ValueError(f"{flag} takes no {names}; drop {'it' if len(moot) == 1 else 'them'}")
    try:
        hides = get_preset(args.preset).max_overlap
    except ValueError:  # --preset's own error, below
        hides = 1.0
    if "overlap" in given and not args.validate and hides <= 0:
        raise ValueError(
            f"--overlap is not used with --preset {args.preset}: the TPU compiler leaves its "
            "collectives synchronous, so the model hides none of them (exposed = comm); drop "
            "--overlap"
        )
    report, stages = args.comm_report and "--comm-report", args.stages and "--stages"
    for flag, value, other, why in (
        ("--grad-dtype", args.grad_dtype, report, "its compiled collectives have their dtype"),
        ("--bucket-mb", args.bucket_mb, report, "its compiled collectives have their sizes"),
        ("--epochs", args.epochs, stages, "the last stage's end epoch is how long"),
    ):
        if value is not None and other:
            raise ValueError(f"{flag} is not used with {other} ({why}); drop {flag}")
    if args.input_per_core is not None:
        input_per_core(args.input_per_core)
        if args.cores_per_device is None:
            raise ValueError(f"--input-per-core {args.input_per_core!r} needs --cores-per-device")
    for flag, value, parse in (
        ("--preset", args.preset, get_preset),
        ("--devices", args.devices, parse_devices),
        ("--stages", args.stages, parse_stages),
    ):
        if value is not None:
            try:
                parse(value)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    if args.stages is not None and parse_stages(args.stages)[-1].end_epoch > MAX_EPOCHS:
        raise ValueError(f"--stages {args.stages!r}: end epochs go to {MAX_EPOCHS:g} at most")
    if args.png and os.path.isdir(args.png):
        raise ValueError(f"--png {args.png} is a folder: name a file in it, e.g. "
                         f"{os.path.join(args.png, 'scaling.png')}")  # fmt: skip
    if args.png and not os.path.isdir(os.path.dirname(args.png) or "."):
        raise ValueError(f"--png {args.png!r}: no such directory; write it to an existing one")
    if args.overwrite and not args.png:
        raise ValueError("--overwrite needs --png, the file it lets replace; drop --overwrite")
    if args.png and os.path.exists(args.png) and not args.overwrite:
        written = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(args.png)))
        raise ValueError(f"--png {args.png} exists (written {written}): pass --overwrite to "
                         "replace it, or name another file")  # fmt: skip
    if args.png and os.path.splitext(args.png)[1].lower() not in PLOT_FORMATS:
        # matplotlib picks the format by the extension: refused here, before the table
        raise ValueError(f"--png {args.png!r}: the plot's format is its extension, one of "
                         f"{', '.join(PLOT_FORMATS)}; name it e.g. scaling.png")  # fmt: skip
    if args.png:
        check_png(args.png)


def check_png(path: str) -> None:
    """--png's file can be written (a file of this process's own name beside it created and
    removed), or one error: checked before the work, not after it."""
    probe = f"{path}.tmp-{os.getpid()}"
    try:
        with open(probe, "xb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(cannot_write(path, e)) from None


def cannot_write(path: str, e: OSError) -> str:
    """The error of a --png that cannot be written, in words, with the fix."""
    return (
        f"--png {path}: cannot write there ({e.strerror or e}); name a file in a folder that "
        "exists and that you can write"
    )


UNSET = object()  # a flag's default while parse_args tells the given flags from the others


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None):
    """``ap``'s arguments, and the dests of the flags on the command line whatever their
    value: `--validate --preset h100` gives --preset though h100 is its default."""
    defaults = vars(ap.parse_args([]))
    ap.set_defaults(**dict.fromkeys(defaults, UNSET))
    args = ap.parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not UNSET}
    for k, v in defaults.items():
        if k not in given:
            setattr(args, k, v)
    return args, given


def main(argv: Sequence[str] | None = None) -> int:
    args, given = parse_args(build_parser(), argv)
    try:
        check_args(args, given)
        return _main(args)
    except (ValueError, TypeError, KeyError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.list_presets:
        rows = [
            [
                p.name,
                f"{p.peak_flops / TFLOPS:g}",
                p.dtype,
                f"{p.efficiency:.3f}",
                f"{p.reference_images_per_s:,.0f}",
                str(p.devices_per_node),
                f"{p.intra.bandwidth / GB:.4g}",
                f"{p.inter.bandwidth / GB:.4g}/{p.inter.per}" if p.inter else "-",
            ]
            for p in PRESETS.values()
        ]
        hdr = [
            "preset",
            "peak TFLOP/s",
            "dtype",
            "eff",
            "ref img/s",
            "per node",
            "intra GB/s",
            "inter GB/s",
        ]
        if args.json:
            print(json.dumps({k: dataclasses.asdict(v) for k, v in PRESETS.items()}))
        else:
            print(table(rows, hdr))
        return 0
    if args.validate:
        results = validation_table(args.overlap)
        what_if = what_if_table(args.overlap)
        cases = counted(results)
        failed = sum(r["verdict"] != "PASS" for r in cases)
        code = VALIDATION_FAILED if failed or not cases else 0
        if args.json:
            out = {"validation": results, "what_if": what_if, "counted": len(cases)}
            print(json.dumps({**out, "failed": failed, "exit_status": code}))
        else:
            print(format_validation(results, what_if))
            print(
                f"validation: {len(cases) - failed} of {len(cases)} held-out cases within "
                f"{PASS_BAND:.0%}, {failed} outside ({len(results) - len(cases)} not held "
                "out, not counted): " + (f"FAIL (exit status {code})" if code else "PASS")
            )
        return code

    preset = get_preset(args.preset)
    report = None
    if args.comm_report:
        try:
            report = read_comm_report(args.comm_report)
            workload = workload_from_report(report)
            warn_other_chip(report.devices, preset.name, args.comm_report)
        except OSError as e:
            raise ValueError(
                f"--comm-report {args.comm_report}: cannot read it ({e.strerror or e}); name "
                "the file `python -m hybridpar.comm_report --config ... --json > FILE` wrote"
            ) from None
        except ValueError as e:
            raise ValueError(f"--comm-report: {e}") from None
        # by default simulate the step the report was compiled for
        if args.per_device_batch is None:
            args.per_device_batch = round(workload.reference_batch)
        if args.image_size is None:
            args.image_size = workload.reference_image_size
    else:
        grad_dtype = args.grad_dtype or "fp32"
        grad_dtype = preset.grad_dtype if grad_dtype == "preset" else grad_dtype
        bucket_mb = 32.0 if args.bucket_mb is None else args.bucket_mb
        workload = resnet50_workload(grad_dtype, bucket_mb or None)
    if args.per_device_batch is None:
        args.per_device_batch = 256
    if args.image_size is None:
        args.image_size = 224
    preset = _calibrated(preset, workload, args)
    efficiency = args.efficiency
    if args.calibrate is not None:
        try:
            efficiency = calibrate(
                args.calibrate, args.image_size, args.per_device_batch, preset, workload
            )
            above_peak(
                efficiency,
                f"{args.calibrate:g} images/s",
                "give one device's measured rate at --image-size and --per-device-batch",
            )
        except ValueError as e:
            raise ValueError(f"--calibrate: {e}") from None
    devices = parse_devices(args.devices) if args.devices is not None else DEFAULT_DEVICES
    m = workload.model_parallel
    unit = math.lcm(m, workload.devices_multiple)
    if args.devices is not None:  # each count asked for is modelled, or one error line
        check_devices(args.devices, devices, workload, preset, unit)
    if not modelled_counts(devices, workload, preset, unit):  # simulate() skips each one
        raise ValueError(
            f"--devices {args.devices or '8..4096 (the default)'}: no count both holds the "
            f"comm report's mesh {workload.mesh or 'data'} (a multiple of {unit} devices) and "
            f"is one {preset.name} models; pass multiples of {unit}, "
            + count_hint(workload, preset, unit)
        )
    stages, stages_from = _stages(args, report)
    images_per_epoch, images_from = _images_per_epoch(args, report)
    rows = simulate(
        workload,
        preset,
        devices,
        args.per_device_batch,
        args.image_size,
        stages,
        args.overlap,
        efficiency,
        images_per_epoch,
        args.eval_s_per_epoch,
        _evaluation(args, report),
    )
    if all(r["over_one_epoch"] or r["no_step"] for r in rows):  # nothing but refusals
        r = rows[0]
        if r["no_step"]:
            raise ValueError(f"on {r['devices']} devices, {r['no_step']}")
        raise ValueError(
            f"a global batch of {r['over_one_epoch']:,} ({r['over_one_epoch'] * m // r['devices']}"
            f"/device x {r['devices'] // m} batch-shard devices) is more than one epoch of "
            f"{images_per_epoch:,} images ({images_from}): the trainer runs full batches only, "
            "so it takes no step; lower --per-device-batch (or the stages' batches) or "
            "--devices, or raise --images-per-epoch"
        )
    eff = preset.efficiency if efficiency is None else efficiency
    title = (
        f"{preset.name}: {workload.name}; {args.per_device_batch}/device at "
        f"{args.image_size} px; {exposed_from(workload, args.overlap, preset)}; efficiency "
        f"{eff:.3f} of {preset.peak_flops / TFLOPS:g} TFLOP/s"
    )
    replaced = bool(args.png) and os.path.exists(args.png)  # only with --overwrite
    if args.png:  # no matplotlib: an error line (ConfigError) before anything is printed
        try:
            write_png(rows, args.png, title)
        except OSError as e:  # checked before the work, but a disk can still fill
            raise ValueError(cannot_write(args.png, e)) from None
    exposed = exposed_source(workload.hidden_share, args.overlap, preset.max_overlap)
    if args.json:
        print(
            json.dumps(
                {
                    "preset": dataclasses.asdict(preset),
                    "efficiency": eff,
                    "workload": {
                        "name": workload.name,
                        "source": workload.source,
                        "flops_per_image": workload.flops_per_image,
                        "reference_image_size": workload.reference_image_size,
                        "model_parallel": workload.model_parallel,
                        "gradient_bytes": workload.gradient_bytes(),
                        "collectives": [dataclasses.asdict(c) for c in workload.collectives],
                    },
                    "per_device_batch": args.per_device_batch,
                    "image_size": args.image_size,
                    # None where it is not used: the compiler's schedule, or nothing hidden
                    "overlap": args.overlap if exposed.startswith("assumed") else None,
                    "hidden_share": workload.hidden_share,
                    "exposed_from": exposed,
                    "stages": format_stages(stages),
                    "stages_from": stages_from,
                    "images_per_epoch": images_per_epoch,
                    "images_per_epoch_from": images_from,
                    "eval_s_per_epoch": args.eval_s_per_epoch,
                    "png": args.png,
                    "png_replaced": replaced,
                    "rows": rows,
                }
            )
        )
        return 0
    print(title)
    print(
        f"time to train: {format_stages(stages)} (END_EPOCH:SIZE-BATCH, {stages_from}), "
        f"{images_per_epoch:,} images/epoch ({images_from})"
        + (f", eval {args.eval_s_per_epoch:g} s/epoch" if args.eval_s_per_epoch else "")
    )
    step = (args.per_device_batch, args.image_size)
    if any((st.per_device_batch, st.image_size) != step for st in stages):
        # the columns of one step would be read as the curriculum's speed
        print(f"step ms to efficiency: one step at {step[0]}/device, {step[1]} px "
              "(--per-device-batch, --image-size), not the stages'; the time to train runs "
              "each stage's own steps")  # fmt: skip
    print(format_rows(rows, images_per_epoch))
    print(legend(workload, preset, efficiency))
    if args.png:
        print(f"wrote {args.png}" + (" (replaced the file there, --overwrite)" if replaced else ""))
    return 0
