"""The scaling model's command line: a table (or JSON) of predicted steps and times to train
over device counts, the validation table, the presets (`python -m hybridpar.simulate`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence

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
    exposed_source,
    format_stages,
    get_preset,
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
    report_images_per_epoch,
    resnet50_workload,
    workload_from_report,
)

DEFAULT_DEVICES = [2**k for k in range(3, 13)]  # 8 .. 4096
BEYOND = "beyond any published converged batch"
VALIDATION_FAILED = 1  # exit status of --validate with a case outside the band (2: bad input)


def parse_devices(text: str) -> list[int]:
    """ "8,16,32" or a doubling range "8..4096" (or a mix)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ".." in part:
            lo, hi = (int(x) for x in part.split(".."))
            if lo < 1 or hi < lo:
                raise ValueError(f"bad device range {part!r}")
            v = lo
            while v <= hi:
                out.append(v)
                v *= 2
        else:
            v = int(part)
            if v < 1:
                raise ValueError(f"device counts must be >= 1, got {v}")
            out.append(v)
    if not out:
        raise ValueError("no device counts given")
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
    train through `stages`. Device counts that the model-parallel size does not divide are
    skipped."""
    rows = []
    for p in devices:
        if p % workload.model_parallel:
            continue
        step = predict_step(workload, preset, p, per_device_batch, image_size, overlap, efficiency)
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
        row = dataclasses.asdict(step)
        row["time_to_train_s"] = tt.total_s
        row["eval_s"] = tt.eval_s
        row["stage_s"] = [secs for _, _, secs in tt.stages]
        row["stage_efficiency"] = [s.efficiency for _, s, _ in tt.stages]
        # ImageNet's epochs to the target are published only up to MAX_CONVERGED_BATCH
        row["beyond_converged_batch"] = images_per_epoch == IMAGENET_TRAIN_IMAGES and (
            beyond_converged_batch(stages, p, workload.model_parallel)
        )
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
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
            BEYOND if r.get("beyond_converged_batch") else duration(r["time_to_train_s"]),
        ]
        for r in rows
    ]
    out = table(body, header)
    if any(r.get("beyond_converged_batch") for r in rows):
        out += (
            f"\n{BEYOND}: a global batch over {MAX_CONVERGED_BATCH:,}, the largest published "
            "to reach ResNet-50's target on ImageNet; its epochs to the target are unknown"
        )
    return out


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
        f"per-step floor {preset.step_floor_s * 1e3:g} ms (ASSUMPTION unless set)"
    )


def exposed_from(workload: Workload, overlap: float) -> str:
    """What decides the exposed communication, for the table's title: the compiler's
    schedule where the comm report says what it hides, else the assumed overlap."""
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
        rate, sep, size = args.input_per_core.partition("@")
        if not sep or args.cores_per_device is None:
            raise ValueError(
                f"--input-per-core {args.input_per_core!r}: write IMAGES_PER_S@SIZE, e.g. "
                "400@128, with --cores-per-device"
            )
        changes.update(
            input_images_per_s_per_core=float(rate),
            input_reference_size=int(size),
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
        preset = with_calibrated_efficiency(preset, workload)
    if args.calibrate_from:
        points = points_from_metrics(args.calibrate_from, args.calibrate_devices)
        preset = fit_rate(points, preset, workload, f"fitted to {args.calibrate_from}")
    return preset


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridpar.simulate",
        description="Predict ResNet-50 step time, throughput, scaling efficiency and time to "
        "train on 8 to 4,096 devices (alpha-beta communication model).",
    )
    ap.add_argument(
        "--preset", default="h100", help=f"hardware: {', '.join(PRESETS)} (aliases: v100, p100)"
    )
    ap.add_argument(
        "--devices",
        default=None,
        help="comma list and/or doubling range, e.g. 8,16,32 or 8..4096 (default 8..4096)",
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
        type=int,
        default=None,
        help="images per device (per batch shard) per step (default 256, or the comm "
        "report's own batch)",
    )
    ap.add_argument(
        "--image-size",
        type=int,
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
        type=cli.finite_float,
        default=None,
        help="epochs when --stages is not given (default: the comm report's num_epochs; "
        "without a report 35)",
    )
    ap.add_argument(
        "--overlap",
        type=cli.finite_float,
        default=0.8,
        help="fraction of the backward pass that can hide communication "
        "(0.8: bucketed/fused reductions; 0: no overlap; not used with a --comm-report "
        "a TPU or GPU compiler scheduled)",
    )
    ap.add_argument(
        "--grad-dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16", "preset"],
        help="gradient dtype of the analytic ResNet-50 all-reduce (default fp32: "
        "hybridpar keeps float32 parameters, so their gradients are float32; "
        "'preset': the dtype the preset's reference recipe reduced)",
    )
    ap.add_argument(
        "--bucket-mb",
        type=cli.finite_float,
        default=32.0,
        help="analytic model: gradient buckets of at most this many MB (0: one fused buffer)",
    )
    ap.add_argument(
        "--efficiency",
        type=cli.finite_float,
        default=None,
        help="fraction of peak for a ResNet-50 step (default: the preset's calibrated value)",
    )
    ap.add_argument(
        "--calibrate",
        type=cli.finite_float,
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
        type=int,
        default=1,
        help="devices of the --calibrate-from run (its rates are per device; default 1)",
    )
    ap.add_argument(
        "--step-overhead-s",
        type=cli.finite_float,
        default=None,
        help="fixed seconds per step besides the FLOPs (default: the preset's, 0)",
    )
    ap.add_argument(
        "--step-floor-s",
        type=cli.finite_float,
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
        "--cores-per-device", type=cli.finite_float, default=None, help="host cores per device"
    )
    ap.add_argument(
        "--eval-every-epochs",
        type=cli.finite_float,
        default=0.0,
        help="an evaluation pass every E epochs on the clock (ImageNet's 50,000 images at "
        "224 px; default 0: none)",
    )
    ap.add_argument(
        "--eval-overhead-s",
        type=cli.finite_float,
        default=None,
        help="fixed seconds per evaluation pass",
    )
    ap.add_argument(
        "--images-per-epoch",
        type=int,
        default=None,
        help="training images per epoch (default: the comm report's data set, from its "
        "config; without a report ImageNet's 1,281,167)",
    )
    ap.add_argument(
        "--eval-s-per-epoch",
        type=cli.finite_float,
        default=0.0,
        help="fixed evaluation cost added per epoch (seconds)",
    )
    ap.add_argument("--png", default=None, help="also write a plot (needs matplotlib)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="print the validation table against published runs; exit status "
        f"{VALIDATION_FAILED} when any held-out case is outside {PASS_BAND:.0%}% (0 when all "
        "pass; rows calibrated on their own publication are shown, not counted)",
    )
    ap.add_argument("--list-presets", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except (ValueError, TypeError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
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
                f"{p.inter.bandwidth / GB:.4g}/{p.inter.per}",
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
        report = read_comm_report(args.comm_report)
        workload = workload_from_report(report)
        # by default simulate the step the report was compiled for
        if args.per_device_batch is None:
            args.per_device_batch = round(workload.reference_batch)
        if args.image_size is None:
            args.image_size = workload.reference_image_size
    else:
        grad_dtype = preset.grad_dtype if args.grad_dtype == "preset" else args.grad_dtype
        workload = resnet50_workload(grad_dtype, args.bucket_mb or None)
    if args.per_device_batch is None:
        args.per_device_batch = 256
    if args.image_size is None:
        args.image_size = 224
    preset = _calibrated(preset, workload, args)
    efficiency = args.efficiency
    if args.calibrate is not None:
        efficiency = calibrate(
            args.calibrate, args.image_size, args.per_device_batch, preset, workload
        )
    devices = parse_devices(args.devices) if args.devices else DEFAULT_DEVICES
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
        Evaluation(args.eval_every_epochs, per_device_batch=args.per_device_batch)
        if args.eval_every_epochs > 0
        else None,
    )
    eff = preset.efficiency if efficiency is None else efficiency
    title = (
        f"{preset.name}: {workload.name}; {args.per_device_batch}/device at "
        f"{args.image_size} px; {exposed_from(workload, args.overlap)}; efficiency "
        f"{eff:.3f} of {preset.peak_flops / TFLOPS:g} TFLOP/s"
    )
    if args.png:  # no matplotlib: an error line (ConfigError) before anything is printed
        write_png(rows, args.png, title)
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
                    "overlap": args.overlap,
                    "hidden_share": workload.hidden_share,
                    "exposed_from": exposed_source(workload.hidden_share, args.overlap),
                    "stages": format_stages(stages),
                    "stages_from": stages_from,
                    "images_per_epoch": images_per_epoch,
                    "images_per_epoch_from": images_from,
                    "eval_s_per_epoch": args.eval_s_per_epoch,
                    "png": args.png,
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
    print(format_rows(rows))
    print(legend(workload, preset, efficiency))
    if args.png:
        print(f"wrote {args.png}")
    return 0
