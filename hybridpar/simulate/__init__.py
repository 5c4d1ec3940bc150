"""Scaling model: predicted step time, throughput, scaling efficiency and time to train.

    python -m hybridpar.simulate [--preset h100] [--devices 8,16,...,4096]
        [--comm-report FILE] [--per-device-batch 256] [--image-size 224]
        [--stages "20:128-224,38:224-224,40:288-128"] [--overlap 0.8] [--png out.png] [--json]

The model (plain Python, no JAX; every number is per training step of data-parallel weak
scaling, i.e. the per-device batch stays fixed while devices are added):

    compute   = step overhead + FLOPs per device per step / (peak FLOP/s * efficiency)
    param     = parameters * bytes per parameter / HBM bandwidth     (the optimizer's update)
    comm      = sum over collectives of count * cost(cheapest algorithm)   (alpha-beta model)
    exposed   = max(0, comm - min(overlap, max_overlap) * backward),  backward = 2/3 * compute;
                comm * (1 - hidden share) where a TPU or GPU compiler's comm report has one
    input     = images per device per step / (images/s per host core * cores per device)
    step      = max(compute + param + exposed, input, per-step floor)
    images/s  = global batch / step
    scaling efficiency = images/s(p) / (p * images/s(1))          (= compute / step <= 1)
    time to train = start-up + sum over curriculum stages of epochs * images per epoch /
                    images/s(stage) + evaluation passes (forward steps + a fixed cost each)

`efficiency` is the fraction of peak a single device reaches on a ResNet-50 step; each preset
calibrates it from a stated single-device images/s (`calibrate`). The collectives come either
from the built-in analytic ResNet-50 data-parallel description (one fused gradient all-reduce,
split into buckets) or from `python -m hybridpar.comm_report --json` (`--comm-report FILE`).

The step overhead, the input rate and the evaluation cost are 0 (not modelled) unless
calibrated (`calibration.py`: fitted to a run's metrics.jsonl or set from measurements).
The per-step floor (`hardware.STEP_FLOOR_S`, 1 ms, an assumption) is the least any step
takes.
What the model leaves out (see docs/scaling.md): stragglers and jitter, link contention
from other jobs, compilation and start-up.

FLOP convention: a multiply-add is 2 FLOPs, as in XLA's `cost_analysis` (so a comm_report
`flops` figure and the built-in ResNet-50 figure mean the same thing). The much-quoted
"4.1 GFLOPs" of a ResNet-50 forward pass at 224 px counts multiply-adds; in this convention it
is 8.2 GFLOP. Since `efficiency` is calibrated against a measured images/s, the convention
changes the reported fraction of peak, never a predicted time.

The package, one job a module (each imports only the ones above it):

    hardware.py    presets as data: peak FLOP/s, links, reference single-device rates
    workload.py    FLOPs and collectives of a step: analytic ResNet-50, or a comm_report
    cost.py        alpha-beta costs of ring, tree, hierarchical and torus (rings per side)
    step.py        calibrated presets, step time and efficiency, stages, time to train
    calibration.py step overhead and efficiency fitted to measured rates; evaluation cost
    validation.py  the published runs docs/scaling.md compares with; the MLPerf calibration
                   runs that set the TPU and H100 constants, kept apart from those checked
    plot.py, cli.py, __main__.py   the command line

Everything public is importable from here (`from hybridpar import simulate as sim`).
"""

from __future__ import annotations

from hybridpar.simulate.calibration import fit_eval_overhead, fit_rate, points_from_metrics
from hybridpar.simulate.cli import (
    BEYOND,
    DEFAULT_DEVICES,
    NOT_TRAINABLE,
    VALIDATION_FAILED,
    build_parser,
    format_rows,
    format_validation,
    main,
    parse_devices,
    simulate,
)
from hybridpar.simulate.compiled import (
    RESNET50_TRAIN_224,
    compiled_steps,
    interpolate,
    roofline_seconds,
)
from hybridpar.simulate.cost import (
    Topology,
    all_gather_time,
    allreduce_options,
    best_algorithm,
    collective_options,
    hierarchical_allreduce_time,
    members_per_node,
    nic_share_per_device,
    reduce_scatter_time,
    ring_allreduce_time,
    torus_allreduce_time,
    torus_shape,
    tree_allreduce_time,
)
from hybridpar.simulate.hardware import (
    ALIASES,
    GB,
    GBIT,
    STEP_FLOOR_S,
    TFLOPS,
    TPU_LARGEST_SLICE,
    UNCALIBRATED_PRESETS,
    US,
    Link,
    Preset,
    slice_preset,
)
from hybridpar.simulate.plot import write_png
from hybridpar.simulate.step import (
    MAX_CONVERGED_BATCH,
    PRESETS,
    PUBLISHED_CONVERGED_BATCHES,
    Evaluation,
    Stage,
    StepPrediction,
    TrainPrediction,
    beyond_converged_batch,
    calibrate,
    comm_time,
    compute_seconds,
    devices_problem,
    eval_pass_s,
    exposed_seconds,
    exposed_source,
    format_stages,
    get_preset,
    ideal_seconds,
    input_seconds,
    op_seconds,
    over_one_epoch,
    param_seconds,
    parse_stages,
    predict_step,
    stage_steps,
    startup_seconds,
    sync_comm_time,
    time_to_train,
    with_calibrated_efficiency,
)
from hybridpar.simulate.validation import (
    CALIBRATION_RUNS,
    EVERY_EPOCH,
    FASTAI_STAGES,
    MISSES,
    MLPERF_GPU_RUNS,
    MLPERF_TPU_RUNS,
    MOXING_STAGES,
    OTHER_CALIBRATION_SOURCES,
    PASS_BAND,
    V100_2018_LOGS,
    VALIDATION_CASES,
    WHAT_IF_CASES,
    CalibrationRun,
    EpochLog,
    MLPerfRun,
    ValidationCase,
    calibration_names,
    counted,
    fit_preset,
    fit_v100_2018,
    fitted_from,
    held_out_problems,
    published_preset,
    published_workload,
    run_mlperf_case,
    run_validation_case,
    validation_names,
    validation_table,
    verdict,
    what_if_table,
)
from hybridpar.simulate.workload import (
    BACKWARD_FRACTION,
    DIGITS_TRAIN_IMAGES,
    GRAD_BYTES,
    IMAGENET_EVAL_IMAGES,
    IMAGENET_TRAIN_IMAGES,
    RESNET50_FWD_FLOPS_224,
    RESNET50_PARAMS,
    TRAIN_FLOPS_FACTOR,
    Collective,
    Workload,
    bucket_sizes,
    group_stride,
    inner_size,
    load_comm_report,
    read_comm_report,
    report_epochs,
    report_eval,
    report_images_per_epoch,
    resnet50_workload,
    workload_from_report,
)

__all__ = [
    "MAX_CONVERGED_BATCH",
    "PUBLISHED_CONVERGED_BATCHES",
    "beyond_converged_batch",
    "BEYOND",
    "NOT_TRAINABLE",
    "ALIASES",
    "BACKWARD_FRACTION",
    "CALIBRATION_RUNS",
    "DEFAULT_DEVICES",
    "DIGITS_TRAIN_IMAGES",
    "FASTAI_STAGES",
    "GB",
    "GBIT",
    "GRAD_BYTES",
    "IMAGENET_EVAL_IMAGES",
    "IMAGENET_TRAIN_IMAGES",
    "MLPERF_TPU_RUNS",
    "MOXING_STAGES",
    "OTHER_CALIBRATION_SOURCES",
    "PASS_BAND",
    "PRESETS",
    "RESNET50_FWD_FLOPS_224",
    "RESNET50_PARAMS",
    "STEP_FLOOR_S",
    "TFLOPS",
    "TRAIN_FLOPS_FACTOR",
    "UNCALIBRATED_PRESETS",
    "US",
    "VALIDATION_CASES",
    "WHAT_IF_CASES",
    "MISSES",
    "V100_2018_LOGS",
    "EVERY_EPOCH",
    "EpochLog",
    "counted",
    "fit_v100_2018",
    "what_if_table",
    "VALIDATION_FAILED",
    "CalibrationRun",
    "Collective",
    "Evaluation",
    "Link",
    "MLPerfRun",
    "Preset",
    "Stage",
    "StepPrediction",
    "Topology",
    "TrainPrediction",
    "ValidationCase",
    "Workload",
    "all_gather_time",
    "allreduce_options",
    "best_algorithm",
    "bucket_sizes",
    "build_parser",
    "calibrate",
    "calibration_names",
    "collective_options",
    "comm_time",
    "compute_seconds",
    "sync_comm_time",
    "devices_problem",
    "op_seconds",
    "exposed_seconds",
    "exposed_source",
    "slice_preset",
    "TPU_LARGEST_SLICE",
    "compiled_steps",
    "ideal_seconds",
    "interpolate",
    "roofline_seconds",
    "RESNET50_TRAIN_224",
    "eval_pass_s",
    "fit_eval_overhead",
    "fit_rate",
    "fit_preset",
    "published_preset",
    "published_workload",
    "MLPERF_GPU_RUNS",
    "fitted_from",
    "format_rows",
    "format_stages",
    "format_validation",
    "get_preset",
    "group_stride",
    "held_out_problems",
    "hierarchical_allreduce_time",
    "inner_size",
    "input_seconds",
    "load_comm_report",
    "main",
    "members_per_node",
    "nic_share_per_device",
    "over_one_epoch",
    "param_seconds",
    "parse_devices",
    "parse_stages",
    "points_from_metrics",
    "predict_step",
    "read_comm_report",
    "reduce_scatter_time",
    "report_epochs",
    "report_eval",
    "report_images_per_epoch",
    "resnet50_workload",
    "ring_allreduce_time",
    "run_mlperf_case",
    "run_validation_case",
    "simulate",
    "stage_steps",
    "startup_seconds",
    "time_to_train",
    "torus_allreduce_time",
    "torus_shape",
    "tree_allreduce_time",
    "validation_names",
    "validation_table",
    "verdict",
    "with_calibrated_efficiency",
    "workload_from_report",
    "write_png",
]
