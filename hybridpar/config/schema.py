"""The default config every experiment starts from, and its checks.

Experiment files (``experiments/NAME.py``) call ``base_config()`` and change what they need.
The CLI locks the config, so ``--config.KEY=VALUE`` with a misspelt KEY is an error.
It imports no JAX or Flax (``validate`` included): the names it checks (models, heads,
presets) are plain data here, so a tool can check a config before the backend starts.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re

import ml_collections

from hybridpar.config.errors import ConfigError
from hybridpar.config.parsing import check_logical_rules, check_rule_patterns, parse_bn_sync


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Mesh over all devices of all processes; "-1" fills. Axes: data, fsdp, model.
    c.mesh = "data:-1"
    # Where parameters go: a preset ("auto" follows the mesh: FSDP when fsdp > 1, the
    # data x model hybrid when model > 1), plus rules of our own that take priority:
    # rules = ((path_regex, spec), ...), logical_rules = ((logical_name, mesh_axis), ...).
    c.partitioning = ml_collections.ConfigDict(
        dict(preset="auto", rules=(), logical_rules=(), fsdp_min_size=-1)
    )  # -1: preset default

    c.model = ml_collections.ConfigDict(
        dict(
            name="resnet50",
            num_filters=64,
            zero_init_last_bn=True,
            bn_momentum=0.9,
            bn_epsilon=1e-5,
            small_stem=False,
            # BatchNorm statistics over: "global" (the whole global batch: what one device
            # computes; one all-reduce per BN layer per pass), "local" (each device's own
            # examples: no communication, as most DAWNBench/MLPerf GPU entries did), or
            # "group:N" (groups of N devices, as MLPerf's TPU entries did). See
            # models/batchnorm.py for the trade-off.
            bn_sync="global",
            # Classifier head (hybridpar/parallel/sharded_head.py): "dense" (the model's own layer,
            # placed by XLA), "sharded" (classes split over `model`, softmax cross-entropy
            # and top-k without gathering the logits) or "partial_fc" (classes split over
            # all devices, features all-gathered for the head only: the cheaper plan when
            # global_batch < num_classes / model size). Both run the trunk data parallel
            # over all devices, so both batches must divide the device count.
            head="dense",
            # 1x1 convolutions as matrix products (same parameters): 1.5-1.8x faster
            # ResNet-50 steps on XLA:CPU; False: nn.Conv.
            pointwise_dot=True,
            # Kernel gradients of convolutions (models/im2col.py): "im2col" (one matrix
            # product over patches: 2.2-2.4x faster airbench steps on XLA:CPU, 9x the
            # activation memory in the backward pass), "xla" (XLA's own), "auto" (im2col
            # on CPU, xla on GPU/TPU).
            conv_grad="auto",
            # ResNets' narrower widths, as hybridpar.prune writes them: the stem's output,
            # each stage's output (its residual stream) and each block's inner convs, in
            # block order. 0 / (): from num_filters.
            stem_width=0,
            stage_widths=(),
            block_widths=(),
        )
    )
    # A run workdir (or hybridpar.prune's output) whose latest checkpoint's parameters and
    # BatchNorm statistics a new run starts from, instead of a random init ("": none). Its
    # model must have this config's shapes; the optimizer starts afresh.
    c.init_from = ""
    # Knowledge distillation (hybridpar/runtime/distill.py): with teacher_workdir set, the loss is
    # (1 - alpha) x cross-entropy + alpha x temperature^2 x KL(teacher || student) on logits
    # at that temperature; the teacher (the run's latest checkpoint and the config it holds)
    # runs in the same step on the same mesh, in inference mode, without gradients. alpha 0.5
    # since 2026-12-06, where compress's students lost far less than with 0.9
    # (bench/results/compress_cifar10/NOTES.md, compress_digits/NOTES.md); runs saved before
    # hold 0.9.
    c.distill = ml_collections.ConfigDict(dict(teacher_workdir="", temperature=4.0, alpha=0.5))
    # Parameter / compute / logits dtypes. float16 compute turns on dynamic loss scaling
    # (its initial scale, and the finite steps in a row that double it; set without float16
    # compute, nothing reads them: set-up warns, unused_settings).
    c.precision = ml_collections.ConfigDict(
        dict(
            params="float32",
            compute="float32",
            output="float32",
            loss_scale_initial=2.0**15,
            loss_scale_period=2000,
        )
    )

    c.data = ml_collections.ConfigDict(
        dict(
            # "digits" (scikit-learn, in memory), "synthetic" (random, in memory), "images"
            # (prepared TFRecords: a tar or folder in SPLIT/CLASS/FILE layout), "tfds" (a
            # tensorflow-datasets dataset).
            name="synthetic",
            image_size=224,
            num_classes=1000,
            channels=3,
            # synthetic only: the nominal size of an epoch
            train_examples=4096,
            eval_examples=1024,
            # Normalisation on the device, in 0..255 pixel units (ImageNet statistics).
            mean=(123.675, 116.28, 103.53),
            std=(58.395, 57.12, 57.375),
            # images: tars or folders to prepare (comma-separated) and where the prepared
            # records live; an empty prepared_dir means ~/.cache/hybridpar/<source names>.
            source="",
            prepared_dir="",
            # Reduced copies to prepare besides the full one (longest side in px, comma-
            # separated, e.g. "160" as MoXing's 128-px stages used): the cache level on disk.
            reduced_copies="",
            reduced_quality=90,
            # tfds: dataset name (or builder directory), data_dir, and manual_dir for
            # datasets such as imagenet2012 that are built from downloaded tars.
            tfds_name="",
            tfds_data_dir="",
            tfds_manual_dir="",
            train_split="train",
            eval_split="test",
            # images: the class list (comma-separated names or a file, one name a line);
            # empty: the train split's class folders. Every split is labelled by this list.
            classes="",
            # images: let a train class have no usable example (else an error naming it).
            allow_empty_classes=False,
            # Train transform: random-resized crop (fused into JPEG decoding) and flip.
            min_scale=0.08,
            # images/tfds: then a random translation by up to this many pixels each way
            # (reflect-padded; airbench's CIFAR augmentation is flip + translate 2). 0: off.
            translate=0,
            # Decode JPEG crops at a reduced DCT scale (1/2, 1/4, 1/8) where the crop is that
            # many times the output size, at the image sizes where that can pay: up to a
            # quarter of the prepared copy's median shorter side (manifest.json; for tfds,
            # that of the split's first 256 images). Entropy decoding, which no scale skips,
            # is about two thirds of a full decode on the ImageNet sample,
            # and the 1/2 scale alone measured a wash at 128 px on ImageNet-sized photos
            # (input/pipeline.py, DCT_MIN_SIDE), so there the pipeline leaves it out. It
            # serves multi-megapixel photos, where 1/4-1/8 scales apply. False: never.
            dct_scaling=True,
            # Eval transform: centre crop of this fraction of the shorter side, resized.
            eval_crop_ratio=0.875,
            ram_cache=False,  # keep encoded bytes in RAM after the first epoch
            # Examples each epoch's shuffle holds (encoded), per process. A stage's input
            # holds up to three such buffers: the epoch being read and the next two, opened
            # ahead so that their buffers fill while it runs.
            shuffle_buffer=16384,
            prefetch=2,  # global batches placed on the devices ahead of the step
            threads=0,  # tf.data threads; 0: as many as cores
            # digits, synthetic, images: the whole set decoded once into uint8 arrays (images:
            # with Pillow, cached beside the prepared data), held by every device, and each
            # batch gathered, shuffled and augmented by a jitted step there
            # (input/on_device.py): no host pipeline and no TensorFlow in the process.
            on_device=False,
            # on_device: MiB of data each device may hold; 0: a quarter of the device's
            # memory (1024 where the backend reports none, as on CPU).
            on_device_limit_mb=0.0,
        )
    )
    c.global_batch = 256
    c.eval_batch = 256
    c.num_epochs = 1.0
    # Curriculum (hybridpar/config/curriculum.py): "" is one stage from the keys above; else
    # MoXing's "END_EPOCH:IMAGE_SIZE-BATCH_PER_DEVICE[@MIN_CROP_SCALE][~MOMENTUM],...", e.g.
    # "20:128-224@0.08~0.98,38:224-224" (a stage without @ uses data.min_scale; one without
    # ~ follows optim.momentum or its ramp, one with it holds that momentum in [0, 1) for the
    # whole stage, an injected hyperparameter like the ramp: no recompile; turning stage
    # momenta on or off changes the optimizer state's structure, as momentum_start does).
    c.stages = ""

    c.optim = ml_collections.ConfigDict(
        dict(
            name="sgd",
            base_lr=0.1,
            lr_batch_base=256,
            # How the LR follows the global batch: "linear" (x batch / lr_batch_base),
            # "sqrt" (LARS at very large batch) or "none".
            lr_batch_scaling="linear",
            momentum=0.9,
            # Momentum schedule: momentum_start >= 0 ramps momentum linearly from it to
            # `momentum` over the first momentum_ramp_epochs epochs (e.g. 0.98 -> 0.9 over
            # the warmup: momentum_start=0.98, momentum_ramp_epochs=warmup_epochs), then
            # holds it. A value in the optimizer state (optax.inject_hyperparams), so it
            # costs no recompile. -1: momentum is `momentum` throughout. Turning it on or off
            # changes the optimizer state's structure: a run cannot resume across that.
            # Parameters (a regex on paths such as "whiten/kernel") that never change: their
            # updates, weight decay included, are zero. "": none.
            frozen="",
            momentum_start=-1.0,
            momentum_ramp_epochs=0.0,
            nesterov=True,
            weight_decay=1e-4,
            # or "linear", "poly" (power 2, MLPerf's LARS), "constant", "exponential" (the LR
            # range test's: geometric from warmup_start_factor x the LR at epoch 0 up to the LR
            # at num_epochs; needs warmup_epochs=0)
            schedule="cosine",
            warmup_epochs=0.0,
            warmup_start_factor=0.0,
            end_lr_factor=0.0,
            lars_trust=0.001,
        )
    )
    c.label_smoothing = 0.0

    # Gradient communication (hybridpar/parallel/comm.py sets the XLA flags before the
    # backend starts).
    c.comm = ml_collections.ConfigDict(
        dict(
            # "auto": per platform and mesh, the mode whose compiled schedule hides the most
            # of the reduction for no more bytes than XLA's own (program/sync.py choose_mode:
            # overlap on GPU data-parallel meshes, xla elsewhere; the run's log says which).
            # "xla": XLA inserts and combines the collectives itself (under the flags below);
            # "bucketed": the data-parallel step reduces the gradients itself, in buckets of
            # at most bucket_mb MiB in reverse layer order (a gradient larger than that is a
            # bucket of its own), one psum per bucket (with fsdp > 1: one all-gather of the
            # parameters and one reduce-scatter per bucket).
            # "overlap": the same buckets, each reduced from inside the backward pass as soon
            # as its layers' gradients exist (any mesh: fsdp gathers in the forward pass and
            # reduce-scatters in the backward pass, bucket by bucket; a model axis is XLA's).
            mode="auto",
            # 4 MiB: on the GPU compiler ResNet-50's bfloat16 buckets of 4 MiB hid the most
            # (88%; 2 and 1 MiB less); larger ones leave the last layers' bucket exposed.
            # Only the bucketed and overlap modes read it (under "xla" set-up warns).
            bucket_mb=4.0,
            # The dtype the gradients are summed in across devices (every mode; under xla,
            # data-parallel meshes only):
            # "bfloat16" halves the bytes of float32 gradients (they come back as float32
            # for the optimizer); "float32": each gradient in its own dtype; "auto": the
            # bucketed and overlap modes sum in bfloat16 where the step computes in it (the
            # dtype XLA's own reduction of the kernels' gradients has), else float32.
            reduce_dtype="auto",
            # GPU: --xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes.
            # XLA's default is 30 MiB; 256 MiB is above the whole float32 gradient of a
            # ResNet-50 (~98 MiB), so data dependencies and the scheduler, not the size cap,
            # decide how far collectives combine: few large NCCL calls instead of one per
            # parameter (each call costs tens of microseconds of latency). <= 0: XLA's default.
            # TPU: libtpu's combiner flags are not public, so this is not applied there.
            # CPU: no such flags; XLA's CPU pipeline combines (or not) on its own.
            combine_threshold_mb=256.0,
            # GPU/TPU: XLA's latency-hiding scheduler, which moves async collectives to
            # overlap with the backward pass that follows them.
            latency_hiding=True,
            # TPU: run the all-reduces on the chip's SparseCores, beside the TensorCores'
            # backward pass (hybridpar/parallel/comm.py TPU_SPARSECORE_ALL_REDUCE): "auto"
            # on the chips where it was measured (v5p), "on", "off".
            sparsecore_offload="auto",
        )
    )

    # JAX's persistent compilation cache (hybridpar/program/compile_cache.py): "" off, "workdir"
    # WORKDIR/compile_cache, or a directory (shared by runs: a second run of the same
    # programs compiles nothing). Global to the process once on, hence off by default.
    c.compile_cache = ""
    # When the other stages' steps compile (hybridpar/runtime/trainer.py compile_all): "before" the
    # first step, or in a "background" thread while the first stage trains (a switch then
    # waits only if its step is not ready yet, and metrics.jsonl records that wait). "auto":
    # background on GPU/TPU, before on CPU, where the compiler takes cores from the steps.
    c.compile_ahead = "auto"
    c.eval_every_epochs = 1.0
    # Test-time augmentation: evaluate on each image and its mirror image, averaging the
    # logits (airbench's and fast.ai's TTA). Costs a second forward pass per eval batch.
    c.eval_flip = False
    c.log_every_s = 5.0
    # > 0: summary.json records the time to reach it (DAWNBench's way: wall clock from the
    # start, compilation and evaluation included; and without compilation).
    c.target_top1 = -1.0
    c.target_top5 = -1.0
    # True: the run ends (completed, with a checkpoint) at the first evaluation that reaches
    # every target set above, as a time-to-accuracy run does (DAWNBench stops the clock there).
    c.stop_at_target = False
    # A step with a non-finite loss or gradient is skipped (the parameters stay as they
    # were) and counted; this many in a row stop the run with an error naming the last
    # checkpoint. float16's loss scale may need ~15 in a row to back off from 2**15.
    c.max_nonfinite_steps = 20
    # True: join JAX's distributed runtime, one process per host (hybridpar/parallel/distributed.py:
    # JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or SLURM, TPU VM, k8s).
    c.distributed = False
    # How long the processes wait for each other to join before the run stops with an error.
    c.distributed_timeout_s = 300.0
    # How long JAX's distributed service waits for a silent process's heartbeat before it
    # stops the run (each other process: one error line, exit 1). Each process may set its own.
    c.distributed_heartbeat_s = 100.0
    # Checkpoints (hybridpar/runtime/checkpoint.py): train state and loop state every every_steps
    # steps and/or every_minutes minutes (0: off), at the last step and on SIGTERM/SIGINT;
    # the newest max_to_keep kept (0: all). async: written in the background while training
    # goes on (only the copy to host memory blocks). dir "": WORKDIR/checkpoints; a relative
    # dir is under WORKDIR.
    c.checkpoint = ml_collections.ConfigDict(
        {"every_steps": 0, "every_minutes": 10.0, "max_to_keep": 3, "async": True, "dir": ""}
    )
    # python -m hybridpar.tune (hybridpar/tools/tune.py): the LR range test and the search.
    c.tune = ml_collections.ConfigDict(
        dict(
            # lr: optim.base_lr rises geometrically from lr_min to lr_max over lr_epochs.
            lr_min=1e-4,
            lr_max=10.0,
            lr_epochs=1.0,
            # search: the keys and their ranges, comma-separated: KEY=LO..HI (uniform; an int
            # key draws ints), KEY=log:LO..HI (log-uniform) or KEY=A|B|C (one of).
            space="optim.base_lr=log:0.01..2,optim.weight_decay=log:1e-5..1e-3,"
            "optim.warmup_epochs=0..2,label_smoothing=0..0.2,optim.momentum=0.8..0.95,"
            "global_batch=64|128|256",
            # "top1": the last eval's top-1 at the budget (maximised); "time_to_target": the
            # wall time to target_top1 (minimised; a trial stops there, inf if never).
            objective="top1",
            # The trials' evaluations: median pruning compares trials at each of them.
            eval_every_epochs=1.0,
            startup_trials=5,  # TPE draws this many at random before it models
            prune_after_trials=3,  # median pruning starts once this many completed (not pruned)
            # ... and at a trial's evaluation after this many: the first ones say little (on
            # digits at epoch 1 every trial is at 10-30% top-1, the best of them included).
            prune_warmup_evals=1,
        )
    )
    return c


# ---- Registries: the names a config may use, as plain data -----------------------------------
# So that this schema imports no JAX or Flax. The code they name checks them against its
# own (tests/test_layers.py): models.MODELS, partitioning.PRESETS, heads.make_head.

MODEL_NAMES = (
    "airbench",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet_tiny",
    "wide_resnet50_2",
)
# Blocks per stage of each ResNet (what model.stage_widths / block_widths must match)
RESNET_STAGE_SIZES = {
    "resnet18": (2, 2, 2, 2),
    "resnet34": (3, 4, 6, 3),
    "resnet50": (3, 4, 6, 3),
    "resnet101": (3, 4, 23, 3),
    "resnet152": (3, 8, 36, 3),
    "resnet_tiny": (1, 1, 1, 1),
    "wide_resnet50_2": (3, 4, 6, 3),
}
HEADS = ("dense", "sharded", "partial_fc")
PARTITIONING_PRESETS = ("data", "fsdp", "hybrid", "tensor")
# airbench's smallest image: 10 px -> 9 after the 2x2 whitening -> 4 -> 2 -> 1 after the max-pools
AIRBENCH_MIN_IMAGE_SIZE = 10


# ---- The schema: every value checked before any device, data or file is touched ----------

DATA_NAMES = ("digits", "synthetic", "images", "tfds")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CHOICES = {
    "data.name": DATA_NAMES,
    "comm.mode": ("auto", "xla", "bucketed", "overlap"),
    "comm.reduce_dtype": ("auto", "float32", "bfloat16"),
    "comm.sparsecore_offload": ("auto", "on", "off"),
    "model.conv_grad": ("auto", "im2col", "xla"),
    "compile_ahead": ("auto", "background", "before"),
    "optim.name": ("sgd", "lars"),
    "optim.schedule": ("cosine", "linear", "poly", "constant", "exponential"),
    "optim.lr_batch_scaling": ("linear", "sqrt", "none"),
    "precision.compute": DTYPE_NAMES,
    "precision.params": DTYPE_NAMES,
    "precision.output": DTYPE_NAMES,
    "model.name": MODEL_NAMES,
    "model.head": HEADS,
    "partitioning.preset": ("auto", *PARTITIONING_PRESETS),
}
# key -> the interval its value must lie in, as (low, high, closed on the low side, closed on
# the high side); None: unbounded.
RANGES = {
    "data.image_size": (1, None, True, True),
    "data.num_classes": (2, None, True, True),  # one class: nothing to classify
    "global_batch": (1, None, True, True),
    "eval_batch": (1, None, True, True),
    "num_epochs": (0, None, False, True),
    "optim.base_lr": (0, None, False, True),
    "distill.temperature": (0, None, False, True),
    "distill.alpha": (0, 1, True, True),
    "model.stem_width": (0, None, True, True),
    "model.num_filters": (1, None, True, True),
    "model.bn_epsilon": (0, None, False, True),
    "model.bn_momentum": (0, 1, True, False),
    "optim.lr_batch_base": (0, None, False, True),
    "optim.momentum": (0, 1, True, False),
    "optim.momentum_ramp_epochs": (0, None, True, True),
    "optim.weight_decay": (0, None, True, True),
    "optim.warmup_epochs": (0, None, True, True),
    "optim.warmup_start_factor": (0, 1, True, True),
    "optim.end_lr_factor": (0, 1, True, True),
    "label_smoothing": (0, 1, True, False),
    "data.min_scale": (0, 1, False, True),
    "data.eval_crop_ratio": (0, 1, False, True),
    "data.prefetch": (0, None, True, True),
    "data.threads": (0, None, True, True),
    "data.on_device_limit_mb": (0, None, True, True),
    "comm.bucket_mb": (0, None, False, True),
    "eval_every_epochs": (0, None, True, True),
    "log_every_s": (0, None, True, True),
    "max_nonfinite_steps": (1, None, True, True),
    "distributed_timeout_s": (0, None, False, True),
    "distributed_heartbeat_s": (1, None, True, True),
    # below 1 the scale would rise on an overflow (it halves down to 1); above 2**126
    # (program.precision.MAX_LOSS_SCALE) its reciprocal flushes to zero, and float32 ends
    "precision.loss_scale_initial": (1, 2.0**126, True, True),
    "precision.loss_scale_period": (1, None, True, True),
}


def _interval(lo, hi, lo_closed, hi_closed) -> str:
    parts = [] if lo is None else [f"{'>=' if lo_closed else '>'} {lo}"]
    return " and ".join(parts + ([] if hi is None else [f"{'<=' if hi_closed else '<'} {hi}"]))


def _get(c, key: str):
    for part in key.split("."):
        c = c[part]
    return c


def config_value(c, key: str):
    """The value at dotted `key` of config `c`, the key a ``--config.KEY=VALUE`` names:
    ``config_value(c, "optim.base_lr")`` is ``c.optim.base_lr``; a ConfigDict for a key
    that names a group (``"optim"``). A key that is not there raises KeyError. For code
    outside this module that reads keys by name (tune's search space)."""
    return _get(c, key)


# The short names other tools use for the dtypes: spelling alone puts fp16 nearer float32
DTYPE_SHORT = {"fp16": "float16", "half": "float16", "f16": "float16", "bf16": "bfloat16",
               "fp32": "float32", "f32": "float32", "float": "float32"}  # fmt: skip


def _choice_error(key: str, value, valid) -> ConfigError:
    import difflib

    short = DTYPE_SHORT.get(str(value).lower())
    close = [short] if short in valid else []
    close = close or difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
    fix = f"--config.{key}={close[0]}" if close else f"--config.{key}={valid[0]}"
    return ConfigError(
        f"{key}={value!r} is not one of {', '.join(map(str, valid))}; use e.g. {fix}"
    )


def _check_finite(c, prefix: str = "") -> None:
    """Every float, alone or in a tuple, is a finite number: nan passes every range check
    (all its comparisons are false) and inf passes the open-ended ones."""
    for key, v in c.items():
        if hasattr(v, "items"):
            _check_finite(v, f"{prefix}{key}.")
            continue
        values = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in values):
            raise ConfigError(
                f"{prefix}{key}={v!r} is not a finite number; set --config.{prefix}{key}=... "
                "to a number (the defaults are in hybridpar/config/schema.py)"
            )


def validate(c: ml_collections.ConfigDict, sources: bool = True) -> None:
    """Checks every enum-like key, range and cross-key rule that needs no devices, and
    raises one ``ConfigError`` naming the key, the bad value, the valid ones and the fix.
    Mesh-dependent checks (batch divisibility, rules that must divide) come when the mesh
    is built. ``sources``: that the runs ``init_from`` and the teacher name are there."""
    for key, valid in CHOICES.items():
        if _get(c, key) not in valid:
            raise _choice_error(key, _get(c, key), valid)
    parse_bn_sync(c.model.bn_sync)  # "global", "local" or "group:N"; its error names them
    _check_finite(c)
    for key, (lo, hi, lo_closed, hi_closed) in RANGES.items():
        v = _get(c, key)
        below = lo is not None and (v < lo if lo_closed else v <= lo)
        above = hi is not None and (v > hi if hi_closed else v >= hi)
        if below or above:
            raise ConfigError(
                f"{key}={v!r} is out of range: it must be "
                f"{_interval(lo, hi, lo_closed, hi_closed)} (set --config.{key}=...)"
            )
    if c.data.channels not in (1, 3):
        raise ConfigError(f"data.channels={c.data.channels} must be 1 (grayscale) or 3 (RGB)")
    if len(c.data.mean) != c.data.channels or len(c.data.std) != c.data.channels:
        raise ConfigError(
            f"data.mean and data.std need {c.data.channels} entries "
            "(one per channel, data.channels)"
        )
    for key in ("data.mean", "data.std"):  # pixel statistics: finite numbers, std above 0
        v = _get(c, key)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                   and (key == "data.mean" or x > 0) for x in v):  # fmt: skip
            example = tuple(_get(base_config(), key))[: c.data.channels]
            raise ConfigError(
                f"{key}={tuple(v)!r} must be {c.data.channels} finite number(s)"
                f"{', each > 0' if key == 'data.std' else ''} (pixel statistics on the 0-255 "
                f"scale, one per channel), e.g. --config.{key}='{example}'"
            )
    if c.comm.reduce_dtype == "bfloat16" and c.model.head != "dense" and c.comm.mode != "overlap":
        # The explicit reduction (sync.XlaSync) runs the loss per device under shard_map
        # over the data axes, where a sharded head's own collectives are not set up.
        raise ConfigError(
            f"comm.reduce_dtype={c.comm.reduce_dtype!r} needs model.head=dense or comm.mode="
            f"overlap (comm.mode={c.comm.mode!r} with a {c.model.head!r} head reduces in "
            "float32); use --config.comm.mode=overlap or --config.comm.reduce_dtype=float32"
        )
    if c.model.head != "dense" and c.comm.mode not in ("xla", "auto", "overlap"):
        raise ConfigError(
            f"model.head={c.model.head!r} needs comm.mode=xla or overlap (comm.mode="
            f"{c.comm.mode!r} reduces replicated gradients itself); use --config.comm.mode=xla "
            "or model.head=dense"
        )
    for key in ("every_steps", "every_minutes", "max_to_keep"):
        if c.checkpoint[key] < 0:
            zero = "keep all" if key == "max_to_keep" else "off"
            raise ConfigError(
                f"checkpoint.{key}={c.checkpoint[key]!r} must be >= 0 (0: {zero}); "
                f"set --config.checkpoint.{key}=..."
            )
    o = c.optim
    if o.momentum_start != -1 and not 0 <= o.momentum_start < 1:
        raise ConfigError(
            f"optim.momentum_start={o.momentum_start!r} must be >= 0 and < 1 (a momentum), or "
            "-1 for no momentum schedule; set e.g. --config.optim.momentum_start=0.98"
        )
    if o.momentum_start >= 0 and o.momentum_ramp_epochs <= 0:
        raise ConfigError(
            f"optim.momentum_start={o.momentum_start!r} needs optim.momentum_ramp_epochs > 0 "
            "(the epochs over which momentum goes from momentum_start to optim.momentum); set "
            "e.g. --config.optim.momentum_ramp_epochs=2, or --config.optim.momentum_start=-1 "
            "for a constant momentum"
        )
    for key in ("target_top1", "target_top5"):
        if c[key] > 1:
            raise ConfigError(f"{key}={c[key]} is a fraction: use e.g. --config.{key}=0.93, not 93")
    if c.target_top5 > 0 and top5_says_nothing(c.data.num_classes):  # "reached" at step 0
        raise ConfigError(
            f"target_top5={c.target_top5} with data.num_classes={c.data.num_classes}: top-5 is "
            "1.0 by definition with 5 classes or fewer; set --config.target_top5=-1 (and a "
            "--config.target_top1=... instead)"
        )
    if c.data.on_device and c.data.name == "tfds":  # tfds reads through TensorFlow
        raise ConfigError(
            "data.on_device=True holds digits, synthetic or images sets, not data.name='tfds'; "
            "set --config.data.on_device=False, or point data.name=images at the image files"
        )
    translates = c.data.on_device or c.data.name in ("images", "tfds")
    if c.data.translate < 0 or (c.data.translate and not translates):
        raise ConfigError(
            f"data.translate={c.data.translate!r}: a number of pixels >= 0, and only for the "
            f"tf.data pipeline (data.name 'images' or 'tfds', not {c.data.name!r}) or "
            "data.on_device=True; set --config.data.translate=0"
        )
    # Digits are only resized (on the device also translated), never cropped: a crop scale
    # there would be said in the plan and the records and do nothing. The default every
    # config inherits passes, and synthetic data keeps its scales: it stands in for the
    # real data of a recipe (the ImageNet ones plan and compile on it).
    scale = c.data.min_scale
    if c.data.name == "digits" and scale < 1 and scale != base_config().data.min_scale:
        raise ConfigError(
            f"data.min_scale={scale!r}: data.name='digits' is never cropped (its images are "
            "only resized), so a minimum crop scale does nothing; drop --config.data.min_scale "
            "(or set it to 1), or use data.name=images for random-resized crops"
        )
    if o.schedule == "exponential" and (o.warmup_epochs > 0 or o.warmup_start_factor <= 0):
        raise ConfigError(
            "optim.schedule='exponential' rises from optim.warmup_start_factor x the LR to the "
            f"LR over the whole run: it needs warmup_start_factor > 0 (it is "
            f"{o.warmup_start_factor!r}) and warmup_epochs=0 (it is {o.warmup_epochs!r}); set "
            "e.g. --config.optim.warmup_start_factor=1e-4 --config.optim.warmup_epochs=0"
        )
    check_rule_patterns(c.partitioning.rules)
    check_logical_rules(c.partitioning.logical_rules)
    if c.optim.frozen:
        try:
            re.compile(c.optim.frozen)
        except re.error as e:
            raise ConfigError(f"optim.frozen={c.optim.frozen!r} is not a regex ({e})") from None
    if c.model.name == "airbench":
        from hybridpar.config.curriculum import parse_stages

        stages = parse_stages(c.stages) if c.stages else []
        sizes = [c.data.image_size] + [size for _, size, _, _ in stages]
        small = [x for x in sizes if x and x < AIRBENCH_MIN_IMAGE_SIZE]
        if small:
            raise ConfigError(
                f"image size {small[0]} is too small for model.name='airbench' (at least "
                f"{AIRBENCH_MIN_IMAGE_SIZE} px: a 2x2 convolution and three 2x max-pools); set "
                "--config.data.image_size or the --config.stages sizes to 10 or more"
            )
    _check_widths(c)
    _check_runs(c, sources)
    if c.stop_at_target and c.target_top1 <= 0 and c.target_top5 <= 0:
        raise ConfigError(
            "stop_at_target=True needs a target to stop at: set --config.target_top1=... "
            "or --config.target_top5=... (a fraction, e.g. 0.93)"
        )
    if c.stages:
        from hybridpar.config.curriculum import parse_stages

        # syntax, increasing epochs, scales and momenta in range; batches need the mesh
        stages = parse_stages(c.stages)
        last = stages[-1][0]
        if c.data.name == "digits":  # never cropped, as data.min_scale above
            parts = [p.strip() for p in c.stages.split(",") if p.strip()]
            for i, (part, (_, _, _, crop)) in enumerate(zip(parts, stages)):
                if crop is not None and crop < 1:
                    raise ConfigError(
                        f"stages={c.stages!r}: stage {i} ({part!r}) has a minimum crop scale "
                        f"of {crop:g}, but data.name='digits' is never cropped (its images "
                        "are only resized), so it does nothing; drop the @SCALE from the "
                        "stage, or use data.name=images for random-resized crops"
                    )
        # The run ends where its last stage does; a num_epochs that says otherwise would be
        # ignored without a word (schedules, summary and plots read the stages).
        if abs(c.num_epochs - last) > 1e-9 * max(1.0, last):
            raise ConfigError(
                f"num_epochs={c.num_epochs:g} but stages={c.stages!r} end at epoch {last:g}: "
                f"set --config.num_epochs={last:g}, or change the last stage's end epoch"
            )


def top5_says_nothing(num_classes: int) -> bool:
    """With 5 classes or fewer every class is among the top 5: top-5 is 1 by construction,
    a figure to leave out where it is said, and a target reached at step 0."""
    return num_classes <= 5


def eval_split_of(data) -> str:
    """The split a run evaluates on (``config.data``): ``eval_split`` where the data source
    has splits to choose from (``images``, ``tfds``); the built-in sets' test split."""
    return data.eval_split if data.name in ("images", "tfds") else "test"


def unused_settings(c) -> list[str]:
    """What ``c`` sets that nothing reads, where it differs from ``base_config()``'s default
    (a recipe that inherits the default says nothing): one sentence each, for set-up's
    warnings. Warned, not refused: the tools that make variants of a config (plan's modes
    and dtypes, tune's trials) leave a user's setting unread in some of them, and runs
    saved before ``comm.bucket_mb``'s default became 4 hold 32 under ``xla``.
    ``comm.mode=auto`` may resolve to a bucketing mode (program/sync.py choose_mode), so
    only an explicit ``xla`` makes ``bucket_mb`` moot."""
    default, out, moot = base_config(), [], moot_keys(c)
    if "comm.bucket_mb" in moot and c.comm.bucket_mb != default.comm.bucket_mb:
        out.append(
            f"comm.bucket_mb={c.comm.bucket_mb!r} does nothing: comm.mode='xla' never buckets "
            "(XLA places and combines the gradients' all-reduces itself); drop "
            "--config.comm.bucket_mb, or use --config.comm.mode=bucketed or overlap"
        )
    if "global_batch" in moot and c.global_batch != default.global_batch:
        out.append(
            f"global_batch={c.global_batch!r} does nothing: config.stages ({c.stages!r}) sets "
            "each stage's batch per data-parallel device; drop --config.global_batch, or "
            "change the batches in --config.stages"
        )
    for name, keys in DATA_KEYS_OF.items():
        for key in keys:
            if f"data.{key}" in moot and c.data[key]:
                out.append(
                    f"data.{key}={c.data[key]!r} does nothing: it is read only with "
                    f"data.name={name!r}, and this run trains on data.name={c.data.name!r}; "
                    f"set --config.data.name={name} to train on it, or drop data.{key}"
                )
    for key in ("loss_scale_initial", "loss_scale_period"):
        if f"precision.{key}" in moot and c.precision[key] != default.precision[key]:
            out.append(
                f"precision.{key}={c.precision[key]!r} does nothing: only float16 compute "
                f"scales its loss (precision.compute={c.precision.compute!r}); drop "
                f"--config.precision.{key}, or set --config.precision.compute=float16"
            )
    return out


def sizes_training_ignores(c, keys) -> list[str]:
    """Of ``keys`` (the ``--config.KEY`` overrides of a training command), ``data.
    train_examples`` and ``data.eval_examples`` where the run trains on a real set: there
    they size only the plans of the tools that compile without data (a recipe's ImageNet
    figures), and the run takes its splits' own sizes. One sentence each, for a warning:
    ``--config.data.eval_examples=1000`` on images evaluated every image, without a word.
    A recipe's own value is not the user's and says nothing."""
    d = c.data
    if d.name == "synthetic":
        return []
    train = f"split {d.train_split!r}" if d.name != "digits" else "part of digits"
    eval_ = f"split {d.eval_split!r}" if d.name in ("images", "tfds") else "part of digits"
    what = {
        "train_examples": f"an epoch is every example of the train {train}",
        "eval_examples": f"the evaluation reads every example of the eval {eval_}",
    }
    out = []
    for key in dict.fromkeys(k for k in keys if k in ("data.train_examples", "data.eval_examples")):
        name = key.split(".")[1]
        out.append(
            f"{key}={d[name]!r} does nothing in training on data.name={d.name!r}: "
            f"{what[name]}; it sizes only synthetic data and the plans of the tools that "
            f"compile without data (compile, plan, simulate); drop --config.{key}"
        )
    return out


def moot_keys(c) -> set[str]:
    """The keys nothing reads in ``c``, whatever their values: ``unused_settings`` says those
    set to other than the default, and a resume lets them differ (a recipe that resets one,
    as dawnbench its global_batch under its stages, changes no run)."""
    out = set()
    if c.comm.mode == "xla":
        out.add("comm.bucket_mb")
    if c.stages:
        out.add("global_batch")
    for name, keys in DATA_KEYS_OF.items():
        if c.data.name != name:
            out |= {f"data.{key}" for key in keys}
    if c.precision.compute != "float16":
        out |= {"precision.loss_scale_initial", "precision.loss_scale_period"}
    return out


# The data keys only one data.name reads: set under another, the run trains on that name's
# data, not on what the key points at (a recipe's smoke test on synthetic data does that on
# purpose, so it is said, not refused).
DATA_KEYS_OF = {
    "images": ("source", "prepared_dir", "reduced_copies", "classes"),
    "tfds": ("tfds_name", "tfds_data_dir", "tfds_manual_dir"),
}


def _check_widths(c) -> None:
    """``model.stage_widths`` / ``block_widths``: one positive width per stage / block of a
    ResNet (per block of the airbench net)."""
    m = c.model
    if not (m.stem_width or m.stage_widths or m.block_widths):
        return
    sizes = RESNET_STAGE_SIZES.get(m.name)
    if m.name == "airbench" and not m.stem_width:
        sizes = (1, 1, 1)  # three blocks: conv2 outputs as stage widths, conv1 as block widths
    if sizes is None:
        raise ConfigError(
            f"model.stem_width, stage_widths and block_widths are for the ResNets (airbench: "
            f"stage_widths and block_widths), not model.name={m.name!r}: set them to 0 and ()"
        )
    for key, n in (("stage_widths", len(sizes)), ("block_widths", sum(sizes))):
        v = m[key]
        if v and (len(v) != n or not all(isinstance(w, int) and w > 0 for w in v)):
            raise ConfigError(
                f"model.{key}={v!r}: {m.name} needs {n} positive ints (one per "
                f"{key.split('_')[0]}), or () for the defaults"
            )


def _check_runs(c, sources: bool) -> None:
    """``init_from`` and ``distill.teacher_workdir`` name runs (with ``sources``; a tool that
    never trains reads neither): a directory with the config.json the trainer (or
    hybridpar.prune) writes there."""
    for key, path in (("init_from", c.init_from), ("distill.teacher_workdir",
                                                     c.distill.teacher_workdir)):  # fmt: skip
        if sources and path and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"{key}={path!r} is not a run: no config.json there; pass the --workdir of "
                "a training run (or the --out of python -m hybridpar.prune)"
            )
    if c.distill.teacher_workdir and (c.model.head != "dense"
                                      or c.comm.mode not in ("xla", "auto")):
        raise ConfigError(
            "distillation needs the model's own head and XLA's gradient sync: set "
            "--config.model.head=dense and --config.comm.mode=xla"
        )


def load_config(path: str) -> ml_collections.ConfigDict:
    """``experiments/NAME.py[:ARGS]`` -> its ``get_config(ARGS)``, as the CLI would load it;
    a run's ``config.json`` -> that run's config (``from_saved``): its exact settings, where
    its own file with the defaults of today may have moved on (prune's train command)."""
    if path.endswith(".json"):
        return saved_config(path)
    file, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("_hybridpar_experiment", file)
    if spec is None:
        raise ConfigError(f"config file {file!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(
            f"{file} defines no get_config(): a config file returns its config from "
            "get_config(), as experiments/digits.py does"
        )
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)  # fmt: skip
    takes = [p for p in inspect.signature(get_config).parameters.values() if p.kind in positional]
    if arg and not takes:  # ":ARGS" goes to get_config, which takes none
        raise ConfigError(
            f"{path!r}: {file}'s get_config() takes no argument, so ':{arg}' cannot be "
            f"passed to it; drop ':{arg}' (configs that take one, e.g. "
            "experiments/cifar10_fast.py:cpu, say so in their docstring)"
        )
    return get_config(arg) if arg else get_config()


def saved_config(path: str) -> ml_collections.ConfigDict:
    """The config a run wrote to ``path`` (its ``config.json``)."""
    import json

    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config file {path!r} does not read as a run's config.json ({e})")
    if not isinstance(saved, dict):
        raise ConfigError(f"config file {path!r} holds no JSON object: pass a run's config.json")
    return from_saved(saved, path)


def from_saved(saved: dict, where: str = "config.json") -> ml_collections.ConfigDict:
    """A run's config back from its ``config.json`` (``base_config()`` with the saved values;
    JSON's lists become tuples again), for the tools that read a run without its config file.
    A key this version does not know is an error: that run needs its own config file."""

    def update(node, values: dict, prefix: str) -> None:
        for k, v in values.items():
            if k not in node:
                raise ConfigError(
                    f"{where} holds key {prefix + k!r}, which this hybridpar does not know: pass "
                    "the run's --config experiments/NAME.py"
                )
            if hasattr(node[k], "items"):
                update(node[k], v, f"{prefix}{k}.")
            else:
                node[k] = tuples(v)

    def tuples(v):
        return tuple(map(tuples, v)) if isinstance(v, list) else v

    c = base_config()
    try:
        update(c, saved, "")
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a value of another type
        raise ConfigError(f"{where} does not read back as a config ({e}): pass --config") from None
    return c
