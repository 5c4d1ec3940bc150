"""Validation against published runs: the MoXing, fast.ai and Goyal et al. figures and the
MLPerf Training ResNet-50 runs on TPU pods that docs/scaling.md compares the model
with (`python -m hybridpar.simulate --validate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.config.hardware import GPUS, GPUS_PER_NODE, TPUS
from hybridpar.simulate.calibration import fit_eval_overhead
from hybridpar.simulate.compiled import compiled_steps
from hybridpar.simulate.hardware import PARAM_BYTES_PER_PARAM, Preset
from hybridpar.simulate.step import (
    Evaluation,
    Stage,
    eval_pass_s,
    get_preset,
    ideal_seconds,
    parse_stages,
    predict_step,
    time_to_train,
    with_calibrated_efficiency,
)
from hybridpar.simulate.workload import (
    IMAGENET_EVAL_IMAGES,
    IMAGENET_TRAIN_IMAGES,
    TRAIN_FLOPS_FACTOR,
    resnet50_workload,
)

# a prediction within 15% of the published figure passes
PASS_BAND = 0.15


def verdict(ratio: float) -> str:
    return "PASS" if 1.0 - PASS_BAND <= ratio <= 1.0 + PASS_BAND else "FAIL"


MOXING_STAGES = "20:128-224,38:224-224,40:288-128"
# fast.ai / DIU, 16 x p3.16xlarge (cybertronai/imagenet18, train.py `sixteen_machines`,
# "16:08 to 93.04"): 128 px (per-GPU batch 64 to epoch 6, then 128) to epoch 16; 224 px
# (batch 64 to 19, then 192) to 37; 288 px at batch 128 from 37. ASSUMPTION: the target
# was met after one epoch at 288 px (the LR reaches its final value at epoch 38).
FASTAI_STAGES = "6:128-64,16:128-128,19:224-64,37:224-192,38:288-128"

# What the calibrated cases add to the V100 preset: what a 2018 run spent besides the FLOPs
# (the calibrated rows of docs/scaling.md).
# - The per-GPU rate of the 2018 PyTorch stack: imagenet18's README logs 0.367 s per step
#   at 224 px and 224 images per GPU (610 img/s).
# - step_overhead_s: ASSUMPTION, 10 ms per step: ~2,000 eager kernel launches (forward,
#   backward and a per-parameter SGD update of ResNet-50's 161 arrays) at ~5 us each. It is
#   what makes the 128-px and small-batch stages run below the 224-px rate.
# - The input: hybridpar's tf.data pipeline measured on this project's 2-core machine
#   (bench/input_pipeline.py, 1 worker, the 1,000 imagenet-sample photos): images/s per
#   core from the reduced 160-px copy at 128 px, scaled by pixels to other sizes; 8 vCPUs
#   per V100 (a p3.16xlarge has 64 for its 8 GPUs).
V100_2018 = dict(
    reference_images_per_s=224 / 0.367,
    step_overhead_s=0.010,
    input_images_per_s_per_core=377.0,
    input_reference_size=128,
    cores_per_device=8.0,
)
# fast.ai evaluated after every epoch; its 4-machine (32-GPU) log shows ~3 s per pass, the
# 50,000 validation images at (ASSUMPTION) 224 px and 256 per GPU. MoXing evaluated off the
# training clock, on other machines: no evaluation is counted.
FASTAI_EVAL = Evaluation(every_epochs=1.0, image_size=224, per_device_batch=256)
FASTAI_EVAL_PASS = (32, 3.0)  # (GPUs, seconds per evaluation pass)


@dataclass(frozen=True)
class ValidationCase:
    run: str
    reported: str
    reported_value: float  # seconds, or an efficiency
    metric: str  # "time_s" or "efficiency"
    preset: str
    devices: int
    stages: str
    grad_dtype: str
    note: str = ""
    reference_images_per_s: float | None = None  # override the preset's calibration
    base_devices: int = 1  # efficiency measured against this many devices
    calibration: dict | None = None  # preset fields to replace before calibrating
    evaluation: Evaluation | None = None  # evaluation passes on the clock
    eval_pass: tuple[int, float] | None = None  # (devices, s): fits the per-pass overhead
    calibrated_on: tuple[str, ...] = ()  # OTHER_CALIBRATION_SOURCES its constants come from


VALIDATION_CASES = [
    ValidationCase(
        "MoXing 2018, 25 GbE",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-25gbe",
        128,
        MOXING_STAGES,
        "fp16",
    ),
    ValidationCase(
        "MoXing 2018, 100 GbE",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-100gbe",
        128,
        MOXING_STAGES,
        "fp16",
    ),
    ValidationCase(
        "fast.ai 2018, 25 GbE",
        "18 min (1,080 s) to 93%",
        1080.0,
        "time_s",
        "v100-25gbe",
        128,
        FASTAI_STAGES,
        "fp16",
    ),
    ValidationCase(
        "MoXing 2018, 25 GbE, V100 at 610 img/s",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-25gbe",
        128,
        MOXING_STAGES,
        "fp16",
        note="calibrated to the 2018 PyTorch step logged in imagenet18's README",
        reference_images_per_s=224 / 0.367,
        calibrated_on=("imagenet18 README, 4 machines",),
    ),
    ValidationCase(
        "fast.ai 2018, 25 GbE, V100 at 610 img/s",
        "18 min (1,080 s) to 93%",
        1080.0,
        "time_s",
        "v100-25gbe",
        128,
        FASTAI_STAGES,
        "fp16",
        note="calibrated to the 2018 PyTorch step logged in imagenet18's README",
        reference_images_per_s=224 / 0.367,
        calibrated_on=("imagenet18 README, 4 machines",),
    ),
    ValidationCase(
        "MoXing 2018, 25 GbE, calibrated",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-25gbe",
        128,
        MOXING_STAGES,
        "fp16",
        note="V100 at 610 img/s at 224 px, 10 ms per step, input measured here",
        calibration=V100_2018,
        calibrated_on=("imagenet18 README, 4 machines",),
    ),
    ValidationCase(
        "MoXing 2018, 100 GbE, calibrated",
        "628 s to 93% top-5",
        628.0,
        "time_s",
        "v100-100gbe",
        128,
        MOXING_STAGES,
        "fp16",
        note="as above",
        calibration=V100_2018,
        calibrated_on=("imagenet18 README, 4 machines",),
    ),
    ValidationCase(
        "fast.ai 2018, 25 GbE, calibrated",
        "18 min (1,080 s) to 93%",
        1080.0,
        "time_s",
        "v100-25gbe",
        128,
        FASTAI_STAGES,
        "fp16",
        note="as above, and an evaluation after every epoch (3 s each at 32 GPUs)",
        calibration=V100_2018,
        evaluation=FASTAI_EVAL,
        eval_pass=FASTAI_EVAL_PASS,
        calibrated_on=("imagenet18 README, 4 machines", "fast.ai 2018, 4 machines"),
    ),
    ValidationCase(
        "Goyal et al. 2017, 8 -> 256 P100",
        "~90% scaling efficiency",
        0.90,
        "efficiency",
        "p100-50gbe",
        256,
        "90:224-32",
        "fp32",
        base_devices=8,
        calibrated_on=("Goyal et al. 2017",),
    ),
    ValidationCase(
        "Goyal et al. 2017, 256 P100, 90 epochs",
        "~1 hour",
        3600.0,
        "time_s",
        "p100-50gbe",
        256,
        "90:224-32",
        "fp32",
        calibrated_on=("Goyal et al. 2017",),
    ),
]


@dataclass(frozen=True)
class MLPerfRun:
    """An MLPerf Training ResNet-50 result on a TPU pod, as its result log (mllog) states it:
    `chips` (the platform's TensorCores / 2), `global_batch_size`, `epochs` (the epoch_num
    of the last `eval_accuracy`, the one that reached 75.9% top-1) and `run_s` (run_start to
    run_stop, evaluation included). Of the five logs of a submission, the one with the
    median run time."""

    run: str
    source: str  # repository and path of the result log
    chip: str  # a key of hybridpar.config.hardware.TPUS (preset tpu-<chip>) or GPUS
    chips: int
    global_batch: int
    epochs: int
    run_s: float
    # the log's steady block of 4 epochs (median) and its first block, for where a miss lies
    block_s: float = 0.0
    first_block_s: float = 0.0
    first_block_epochs: float = 4.0
    eval_every_epochs: float = 4.0  # each log evaluates after every block of 4 epochs

    @property
    def per_chip_batch(self) -> int:
        return self.global_batch // self.chips

    def images_per_s_per_chip(self, seconds: float) -> float:
        return self.epochs * IMAGENET_TRAIN_IMAGES / seconds / self.chips


MLPERF_TPU_RUNS = [
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-32, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-32/resnet/result_2.txt",
        "v3",
        16,
        4096,
        60,
        2530.107,
        block_s=164.123,
        first_block_s=232.33,
    ),
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-128, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-128/resnet/result_2.txt",
        "v3",
        64,
        16384,
        64,
        673.189,
        block_s=40.97,
        first_block_s=58.39,
    ),
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-256, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-256/resnet/result_0.txt",
        "v3",
        128,
        32768,
        76,
        409.154,
        block_s=21.283,
        first_block_s=26.09,
    ),
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-512, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-512/resnet/result_4.txt",
        "v3",
        256,
        32768,
        72,
        226.14,
        block_s=12.338,
        first_block_s=15.98,
    ),
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-1024, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-1024/resnet/result_4.txt",
        "v3",
        512,
        32768,
        76,
        136.504,
        block_s=6.959,
        first_block_s=11.6,
    ),
    MLPerfRun(
        "MLPerf v0.6 Google, TPU v3-2048, TF",
        "mlcommons/training_results_v0.6 Google/results/tpu-v3-2048/resnet/result_0.txt",
        "v3",
        1024,
        32768,
        72,
        76.97,
        block_s=3.949,
        first_block_s=9.28,
    ),
    MLPerfRun(
        "MLPerf v0.7 Google, TPU v3-8192, JAX",
        "mlcommons/training_results_v0.7 Google/results/tpu-v3-8192-JAX/resnet/result_3.txt",
        "v3",
        4096,
        65536,
        92,
        28.243,
        block_s=1.138,
        first_block_s=3.23,
    ),
    MLPerfRun(
        "MLPerf v2.0 Google, TPU v4-8192, TF",
        "mlcommons/training_results_v2.0 Google/results/cloud-tpu-v4-8192-TF/resnet/result_4.txt",
        "v4",
        4096,
        32768,
        60,
        11.292,
        block_s=0.655,
        first_block_s=4.04,
    ),
    MLPerfRun(
        "MLPerf v2.0 Google, TPU v4-6912, TF",
        "mlcommons/training_results_v2.0 Google/results/cloud-tpu-v4-6912-TF/resnet/result_3.txt",
        "v4",
        3456,
        55296,
        80,
        13.795,
        block_s=0.630,
        first_block_s=3.58,
    ),
]


# --------------------------------------------------------------------------------------------
# Calibration: the published runs that set the TPU constants. None of them is checked against
# (the validation runs above are not used to set anything); `HELD_OUT` says so, and
# tests/test_simulate.py checks that the two sets do not meet.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationRun:
    """An MLPerf ResNet-50 result log read for its steady state and its start-up: the median
    of its blocks of 4 epochs (`block_s`, train and evaluation: each log evaluates after each
    block), the host's evaluation seconds inside a block where the log marks them
    (`block_eval_s`: eval_start to the next block_start; 0 where the log has no such marks
    and the evaluation runs on the device inside the loop), and its first block
    (`first_block_s` over `first_block_epochs`, from run_start). Of a submission's five logs
    the one with the median run time."""

    run: str
    source: str
    chip: str
    chips: int
    global_batch: int
    block_s: float
    first_block_s: float
    first_block_epochs: float
    block_eval_s: float = 0.0
    block_epochs: float = 4.0

    @property
    def per_chip_batch(self) -> int:
        return self.global_batch // self.chips

    def steps_per_block(self) -> float:
        return self.block_epochs * IMAGENET_TRAIN_IMAGES / self.global_batch

    def startup_s(self) -> float:
        """The first block's seconds beyond a steady block's rate over its epochs."""
        return self.first_block_s - self.first_block_epochs / self.block_epochs * self.block_s


# Figures read from the logs with bench/results/scaling_validation/mllog_blocks.py (its
# output: blocks.txt there); first_block_s counts the lead-in from run_start.
CALIBRATION_RUNS = [
    # v0.7 TF2.0 (Keras CTL) on 16 v3 chips, 256 per chip: blocks 159.9 s, of which 0.28 s
    # eval_start..eval_stop and 2.34 s eval_stop..next block_start; first block 3 epochs.
    CalibrationRun(
        "MLPerf v0.7 Google, TPU v3-32, TF2.0",
        "mlcommons/training_results_v0.7 Google/results/tpu-v3-32-TF2.0/resnet/result_2.txt",
        "v3",
        16,
        4096,
        block_s=159.926,
        first_block_s=284.59,
        first_block_epochs=3,
        block_eval_s=2.615,
    ),
    # v0.7 TF on 4,096 v3 chips, 16 per chip (the TF twin of the JAX run validated above:
    # same chips and batch, another program)
    CalibrationRun(
        "MLPerf v0.7 Google, TPU v3-8192, TF",
        "mlcommons/training_results_v0.7 Google/results/tpu-v3-8192-TF/resnet/result_4.txt",
        "v3",
        4096,
        65536,
        block_s=1.116,
        first_block_s=4.86,
        first_block_epochs=4,
    ),
    # v0.7 TF on 8 v4 chips, 256 per chip; its first block ends at epoch 3
    CalibrationRun(
        "MLPerf v0.7 Google, TPU v4-16, TF",
        "mlcommons/training_results_v0.7 Google/results/tpu-v4-16-TF/resnet/result_3.txt",
        "v4",
        8,
        2048,
        block_s=184.19,
        first_block_s=187.82,
        first_block_epochs=3,
    ),
    # v1.0 TF on 2,048 v4 chips, 16 per chip
    CalibrationRun(
        "MLPerf v1.0 Google, TPU v4-4096, TF",
        "mlcommons/training_results_v1.0 Google/results/tpu-v4-4096-TF/resnet/result_2.txt",
        "v4",
        2048,
        32768,
        block_s=1.089,
        first_block_s=1.90,
        first_block_epochs=4,
    ),
]

# NVIDIA's MXNet ResNet-50 on DGX H100 (MLPerf Training v3.0, NGC 23.04): one node, 400
# per GPU, and the largest, CoreWeave's 448 HGX H100 nodes (3,584 GPUs), 16 per GPU. Their
# logs mark the evaluation (eval_start..eval_stop).
CALIBRATION_RUNS += [
    # 9 blocks; first block epochs 1-3 (0.81 s of lead-in); evaluation 0.403 s a block
    CalibrationRun(
        "MLPerf v3.0 NVIDIA, 1 x DGX H100, MXNet",
        "mlcommons/training_results_v3.0 NVIDIA/results/dgxh100_ngc23.04_mxnet/resnet/result_0.txt",
        "h100",
        8,
        3200,
        block_s=91.881,
        first_block_s=81.04,
        first_block_epochs=3,
        block_eval_s=0.403,
    ),
    # 20 blocks; first block epoch 1 only (0.38 s of lead-in); evaluation 5 ms a block
    CalibrationRun(
        "MLPerf v3.0 CoreWeave, 448 x HGX H100, MXNet",
        "mlcommons/training_results_v3.0 NVIDIA_CoreWeave/results/"
        "coreweave_hgxh100_n448_ngc23.04_mxnet/resnet/result_2.txt",
        "h100",
        3584,
        57344,
        block_s=0.520,
        first_block_s=1.07,
        first_block_epochs=1,
        block_eval_s=0.005,
    ),
]

# What the 2017-2018 rows are calibrated on: published figures from other runs than the
# ones they are checked against, except Goyal et al.'s P100 rate (the same paper).
OTHER_CALIBRATION_SOURCES = {
    "imagenet18 README, 4 machines": "the V100 step of 0.367 s at 224 px, 224 per GPU",
    "fast.ai 2018, 4 machines": "3 s an evaluation pass on 32 GPUs",
    "Goyal et al. 2017": "backprop 120 ms at 32 images per P100 (the paper validated)",
}


# The overlap the GPU calibration runs are taken at: NCCL's bucketed all-reduce starting
# during the backward pass (TPU presets hide nothing whatever is asked: `max_overlap`).
CALIBRATION_OVERLAP = 0.8


def published_preset(chip: str) -> Preset:
    """The preset a published run's chip is modelled on, before the fit: `tpu-<chip>` for a
    TPU, the GPU's own preset with its HBM bandwidth, the per-parameter bytes and 8 GPUs a
    host (a DGX/HGX node) for a GPU."""
    if chip in TPUS:
        return get_preset(f"tpu-{chip}")
    return dataclasses.replace(
        get_preset(chip),
        hbm_bytes_per_s=GPUS[chip].hbm_bytes_per_s,
        param_bytes_per_param=PARAM_BYTES_PER_PARAM,
        chips_per_host=GPUS_PER_NODE,
    )


def published_workload(preset: Preset):
    """The analytic ResNet-50 as the published runs reduce it. TPU: XLA's all-reduce
    combiner fuses the float32 gradients into one buffer (compile's report on a
    data-parallel step: one combined all-reduce; the logs do not say the dtype). GPU: the
    preset's 16-bit gradients in 32 MB buckets (NCCL, overlapped)."""
    if preset.torus_dims:
        return dataclasses.replace(
            resnet50_workload(preset.grad_dtype, None), compiled_steps=compiled_steps()
        )
    return resnet50_workload(preset.grad_dtype, 32.0)


def fit_preset(chip: str, runs: Sequence[CalibrationRun] | None = None) -> Preset:
    """The preset of `chip` with its constants fitted to the calibration runs of that chip
    (two: one at a large per-chip batch, one at a small one):

    - per step, each run's steady block less its measured host evaluation, less the
      modelled per-parameter work and exposed all-reduce of its steps, over its steps (and
      a third of a step for each forward step of an evaluation run on the device), is
      batch per chip * FLOPs per image / (peak * efficiency) + fixed per step:
      two runs give `efficiency` and `step_overhead_s` (the exposed all-reduce depends on
      the backward pass it hides behind: the fit is repeated until it settles);
    - start-up, each run's first block beyond the steady rate, is
      startup_s + images per host / startup_images_per_s_per_host: two runs give both.
    """
    runs = [r for r in (CALIBRATION_RUNS if runs is None else runs) if r.chip == chip]
    if len(runs) != 2 or runs[0].per_chip_batch == runs[1].per_chip_batch:
        raise ValueError(f"{chip}: need two calibration runs at two batches per chip")
    start = published_preset(chip)
    workload = published_workload(start)
    fit = dataclasses.replace(start, step_overhead_s=0.0, efficiency=start.efficiency)
    for _ in range(20):
        xs, ys = [], []
        for r in runs:
            b = r.per_chip_batch
            step = predict_step(workload, fit, r.chips, b, 224, CALIBRATION_OVERLAP)
            steps = r.steps_per_block()
            ev_steps = 0 if r.block_eval_s else math.ceil(IMAGENET_EVAL_IMAGES / r.global_batch)
            train = r.block_s - r.block_eval_s - steps * (step.param_s + step.exposed_comm_s)
            xs.append(ideal_seconds(workload, fit, b, 224))  # seconds at efficiency 1
            ys.append(train / (steps + ev_steps / TRAIN_FLOPS_FACTOR))
        slope = (ys[0] - ys[1]) / (xs[0] - xs[1])
        fixed = ys[0] - slope * xs[0]
        if slope <= 0 or fixed < 0:
            raise ValueError(f"{chip}: the calibration runs give no physical fit")
        done = (
            abs(1.0 / slope - fit.efficiency) <= 1e-13 and abs(fixed - fit.step_overhead_s) <= 1e-15
        )
        fit = dataclasses.replace(fit, efficiency=1.0 / slope, step_overhead_s=fixed)
        if done:
            break
    hosts = [IMAGENET_TRAIN_IMAGES / math.ceil(r.chips / fit.chips_per_host) for r in runs]
    excess = [r.startup_s() for r in runs]
    per_image = (excess[0] - excess[1]) / (hosts[0] - hosts[1])
    startup = excess[0] - per_image * hosts[0]
    if per_image <= 0 or startup < 0:
        raise ValueError(f"{chip}: the calibration runs give no physical start-up")
    if min(slope * x + fixed for x in xs) / TRAIN_FLOPS_FACTOR < fit.step_floor_s:
        raise ValueError(f"{chip}: an evaluation step under the per-step floor")
    big = max(runs, key=lambda r: r.per_chip_batch)
    return dataclasses.replace(
        fit,
        startup_s=startup,
        startup_images_per_s_per_host=1.0 / per_image,
        reference_images_per_s=big.per_chip_batch / (slope * xs[0] + fixed),
        reference_batch=big.per_chip_batch,
        reference_note="fitted to " + " and ".join(r.run for r in runs),
    )


FITTED_FIELDS = ("efficiency", "step_overhead_s", "startup_s", "startup_images_per_s_per_host")


def fitted_from() -> dict[tuple[str, str], tuple[str, ...]]:
    """Which published runs set each fitted constant: (preset, field) -> run names, the runs
    `fit_preset` reads."""
    chips = sorted({r.chip for r in CALIBRATION_RUNS})
    return {
        (published_preset(chip).name, field): tuple(
            r.run for r in CALIBRATION_RUNS if r.chip == chip
        )
        for chip in chips
        for field in FITTED_FIELDS
    }


def held_out(run: str, calibrated_on: Sequence[str]) -> bool:
    """Whether a validated run is held out from what set its constants: no calibration
    source is the run itself or the same publication (its name begins the run's)."""
    return not any(run == src or run.startswith(src) for src in calibrated_on)


def calibration_names() -> set[str]:
    return {r.run for r in CALIBRATION_RUNS} | set(OTHER_CALIBRATION_SOURCES)


def validation_names() -> set[str]:
    return {c.run for c in VALIDATION_CASES} | {c.run for c in MLPERF_TPU_RUNS + MLPERF_GPU_RUNS}


# NVIDIA's MXNet ResNet-50 on DGX H100 nodes, the runs between one node and the largest
# (v3.0) and the next round's one- and 8-node runs (v3.1, NGC 23.09: the same recipe and
# sizes as a calibration run and a validation run, newer software). The first block is 3
# epochs (1-3) at one node and 8, 2 at 64 nodes, 4 at 96.
MLPERF_GPU_RUNS = [
    MLPerfRun(
        "MLPerf v3.0 NVIDIA, 8 x DGX H100, MXNet",
        "mlcommons/training_results_v3.0 NVIDIA/results/dgxh100_n8_ngc23.04_mxnet/resnet/"
        "result_1.txt",
        "h100",
        64,
        3200,
        35,
        159.890,
        block_s=17.448,
        first_block_s=20.30,
        first_block_epochs=3,
    ),
    MLPerfRun(
        "MLPerf v3.0 NVIDIA, 64 x DGX H100, MXNet",
        "mlcommons/training_results_v3.0 NVIDIA/results/dgxh100_n64_ngc23.04_mxnet/resnet/"
        "result_3.txt",
        "h100",
        512,
        20480,
        50,
        29.898,
        block_s=2.311,
        first_block_s=2.19,
        first_block_epochs=2,
    ),
    MLPerfRun(
        "MLPerf v3.0 NVIDIA, 96 x DGX H100, MXNet",
        "mlcommons/training_results_v3.0 NVIDIA/results/dgxh100_n96_ngc23.04_mxnet/resnet/"
        "result_1.txt",
        "h100",
        768,
        32256,
        56,
        22.162,
        block_s=1.513,
        first_block_s=2.50,
        first_block_epochs=4,
    ),
    MLPerfRun(
        "MLPerf v3.1 NVIDIA, 1 x DGX H100 (Eos), MXNet",
        "mlcommons/training_results_v3.1 NVIDIA/results/eos_ngc23.09_mxnet/resnet/result_3.txt",
        "h100",
        8,
        3200,
        35,
        811.322,
        block_s=91.245,
        first_block_s=81.32,
        first_block_epochs=3,
    ),
    MLPerfRun(
        "MLPerf v3.1 NVIDIA, 8 x DGX H100 (Eos), MXNet",
        "mlcommons/training_results_v3.1 NVIDIA/results/eos_n8_ngc23.09_mxnet/resnet/result_1.txt",
        "h100",
        64,
        3200,
        35,
        149.656,
        block_s=16.183,
        first_block_s=20.20,
        first_block_epochs=3,
    ),
]


def run_mlperf_case(case: MLPerfRun, overlap: float = 0.8) -> dict:
    """Predict one TPU pod run: the model's ResNet-50 (fp32 gradients, one fused buffer) on
    its chip's preset with the constants fitted to the calibration runs (`fit_preset`), at
    the run's per-chip batch for its epochs, with an evaluation pass every 4 epochs
    (ASSUMPTION: at the train batch per chip) and the start-up."""
    preset = fit_preset(case.chip)
    workload = published_workload(preset)
    b = case.per_chip_batch
    ev = Evaluation(case.eval_every_epochs, image_size=224, per_device_batch=b)

    def predict(ov):
        stages = [Stage(case.epochs, 224, b)]
        return time_to_train(workload, preset, case.chips, stages, overlap=ov, evaluation=ev)

    tt, tt0 = predict(overlap), predict(0.0)
    step = tt.stages[-1][1]
    steps_per_block = case.eval_every_epochs * IMAGENET_TRAIN_IMAGES / case.global_batch
    eval_pass = eval_pass_s(workload, preset, case.chips, ev)
    published = case.images_per_s_per_chip(case.run_s)
    predicted = case.images_per_s_per_chip(tt.total_s)
    return {
        "run": case.run,
        "reported": f"{published:,.0f} img/s/chip ({case.run_s:g} s)",
        "reported_value": published,
        "predicted": predicted,
        "predicted_no_overlap": case.images_per_s_per_chip(tt0.total_s),
        "ratio": predicted / published,
        "verdict": verdict(predicted / published),
        "metric": "images_per_s_per_chip",
        "published_s": case.run_s,
        "predicted_s": tt.total_s,
        "parts": tt.parts(),
        "preset": preset.name,
        "peak_flops": preset.peak_flops,
        "efficiency_of_peak": preset.efficiency,
        "reference_images_per_s": preset.reference_images_per_s,
        "devices": case.chips,
        "global_batch": case.global_batch,
        "epochs": case.epochs,
        "stages": f"{case.epochs}:224-{b}",
        "grad_dtype": preset.grad_dtype,
        "algorithm": tt.stages[-1][1].algorithms,
        "source": case.source,
        "overlap": overlap,
        "note": "",
        "calibrated_on": fitted_from()[(preset.name, "efficiency")],
        "held_out": held_out(case.run, fitted_from()[(preset.name, "efficiency")]),
        "published_block_s": case.block_s,
        "predicted_block_s": steps_per_block * step.step_s + eval_pass,
        "published_startup_s": case.first_block_s
        - case.first_block_epochs / case.eval_every_epochs * case.block_s,
        "predicted_startup_s": tt.startup_s,
    }


def run_validation_case(case: ValidationCase, overlap: float = 0.8, bucket_mb=32.0) -> dict:
    """Predict one published figure; `predicted_no_overlap` repeats it with overlap 0."""
    out = _validation_prediction(case, overlap, bucket_mb)
    out["predicted_no_overlap"] = _validation_prediction(case, 0.0, bucket_mb)["predicted"]
    out["overlap"] = overlap
    return out


def _validation_prediction(case: ValidationCase, overlap: float, bucket_mb) -> dict:
    preset = get_preset(case.preset)
    workload = resnet50_workload(case.grad_dtype, bucket_mb)
    if case.reference_images_per_s is not None:
        preset = dataclasses.replace(preset, reference_images_per_s=case.reference_images_per_s)
        preset = with_calibrated_efficiency(preset)
    if case.calibration is not None:
        preset = with_calibrated_efficiency(dataclasses.replace(preset, **case.calibration))
    if case.eval_pass is not None:
        preset = fit_eval_overhead(
            case.eval_pass[1], workload, preset, case.eval_pass[0], case.evaluation
        )
    stages = parse_stages(case.stages)
    if case.metric == "efficiency":
        st = stages[0]
        hi = predict_step(
            workload, preset, case.devices, st.per_device_batch, st.image_size, overlap
        )
        lo = predict_step(
            workload, preset, case.base_devices, st.per_device_batch, st.image_size, overlap
        )
        predicted = hi.images_per_s / (case.devices / case.base_devices * lo.images_per_s)
        detail = hi
        parts = hi.parts()  # one step on case.devices
    else:
        tt = time_to_train(
            workload, preset, case.devices, stages, overlap=overlap, evaluation=case.evaluation
        )
        predicted = tt.total_s
        detail = tt.stages[-1][1]
        parts = tt.parts()
    return {
        "run": case.run,
        "reported": case.reported,
        "reported_value": case.reported_value,
        "predicted": predicted,
        "ratio": predicted / case.reported_value,
        "verdict": verdict(predicted / case.reported_value),
        "parts": parts,
        "metric": case.metric,
        "preset": preset.name,
        "efficiency_of_peak": preset.efficiency,
        "reference_images_per_s": preset.reference_images_per_s,
        "devices": case.devices,
        "stages": case.stages,
        "grad_dtype": case.grad_dtype,
        "algorithm": detail.algorithms,
        "note": case.note,
        "calibrated_on": case.calibrated_on,
        "held_out": held_out(case.run, case.calibrated_on),
    }


def validation_table(overlap: float = 0.8) -> list[dict]:
    return [run_validation_case(c, overlap) for c in VALIDATION_CASES] + [
        run_mlperf_case(c, overlap) for c in MLPERF_TPU_RUNS + MLPERF_GPU_RUNS
    ]


def held_out_problems() -> list[str]:
    """What breaks the held-out discipline: a run both in calibration and in validation (by
    name or by log), a fitted constant set by a run that is not a calibration run, or a
    validated row that says it is held out while a calibration source is its own
    publication."""
    bad = []
    both = calibration_names() & validation_names()
    bad += [f"{name}: both calibration and validation" for name in sorted(both)]
    logs = {r.source for r in CALIBRATION_RUNS}
    logs &= {c.source for c in MLPERF_TPU_RUNS + MLPERF_GPU_RUNS}
    bad += [f"{log}: a calibration log is validated" for log in sorted(logs)]
    for key, runs in fitted_from().items():
        if not runs:
            bad.append(f"{key}: fitted from no run")
        bad += [
            f"{key}: fitted from {r}, not a calibration run"
            for r in runs
            if r not in calibration_names() or r in validation_names()
        ]
    for c in VALIDATION_CASES:
        bad += [
            f"{c.run}: calibrated on {s}, not a calibration source"
            for s in c.calibrated_on
            if s not in calibration_names()
        ]
    return bad
