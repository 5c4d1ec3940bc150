"""``python -m hybridpar.quantize --workdir W [--config experiments/NAME.py]
[--calibration-batches K] [--calibration max|percentile|mse] [--percentile P]
[--weights int8] [--activations int8|none] [--overwrite]``.

Int8 post-training quantization of a trained run: reads ``W``'s latest checkpoint
(read-only), folds BatchNorm into the convolutions, quantizes the weights per output channel
and (``--activations int8``) the input of every conv and of the head with static scales
calibrated on K training batches (each tensor's range: the largest ``|x|``, a percentile of
it, or the range of least squared error), and the other tensors a full-integer file holds in
int8 (``int8.output_ranges``, their largest ``|x|``; the int8 model rounds them as the file
does), evaluates the float and the int8 model on the
whole eval split, times both on this CPU at batch 1 and 64 (side by side, median of
repeats), and writes ``W/quantized/``: ``params.npz`` (int8 kernels, their per-channel
steps, folded biases, activation steps), ``model.jax_exported`` (the int8 model as
serialized StableHLO, see ``hybridpar.program.int8.load_exported``), ``model.tflite`` (the
same steps as a LiteRT full-integer int8 file, ``hybridpar.tools.edge``: its size, top-1,
agreement with int8 and one-thread latency in the report; its input, the eval split and
the class names in label order in ``litert_input``)
and ``report.json``. The last line printed is ``top1_drop=... top1_float=... top1_int8=...
...`` (the drop in points). A run whose training has not finished is quantized with a
``warning:`` line (the report's ``unfinished``). The
arithmetic is ``hybridpar/program/int8.py``. A bad workdir or config is one ``error:`` line (exit
code 2).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import top5_says_nothing
from hybridpar.runtime import signals, trained

OUT = "quantized"
CALIBRATIONS = ("max", "percentile", "mse")  # hybridpar.program.int8's (which imports JAX)
LATENCY_BATCHES = (1, 64)


def check_args(args, config) -> None:
    """Everything that needs no device and no data: the flags, the workdir, its run's
    config, a checkpoint to read and where the results go."""
    if args.calibration_batches is not None and args.calibration_batches < 1:
        cli.fail(f"--calibration-batches={args.calibration_batches} must be >= 1, e.g. 8")
    if args.percentile is not None and not 0 < args.percentile <= 100:
        cli.fail(f"--percentile={args.percentile:g} is in (0, 100], e.g. 99.99")
    if args.repeats < 1:
        cli.fail(f"--repeats={args.repeats} must be >= 1, e.g. 5")
    # flags another makes moot: refused, never silently unused
    if args.activations == "none":
        given = [f for f in ("--calibration", "--calibration-batches", "--percentile")
                 if getattr(args, f[2:].replace("-", "_")) is not None]  # fmt: skip
        if given:
            cli.fail(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not used with "
                     "--activations none (weight-only int8 calibrates no activation ranges); "
                     f"drop {'it' if len(given) == 1 else 'them'}")  # fmt: skip
    calibration = args.calibration or "mse"
    if args.percentile is not None and calibration != "percentile":
        cli.fail(f"--percentile is not used with --calibration {calibration}"
                 f"{'' if args.calibration else ' (the default)'}; pass --calibration "
                 "percentile with it, or drop it")  # fmt: skip
    if config.distributed:  # every process would write W/quantized/ and time the same CPU
        cli.fail("quantize runs in one process: pass --config.distributed=False")
    why = "quantize reads a trained run's latest checkpoint"
    check_trained_run(config, args.workdir, "training", why)
    out = os.path.join(args.workdir, OUT)
    clear_stale(out)  # a killed quantize's leftovers (its old results moved back, if that)
    if os.path.exists(out) and not args.overwrite:
        raise ConfigError(
            f"{out} exists (an earlier quantization): pass --overwrite to replace it, or move "
            "it away first"
        )


def check_trained_run(config, workdir: str, run: str, needs: str) -> None:
    """``workdir`` holds a run of ``config`` (the evaluator's rule: only where and how fast
    it runs may differ from the run's config) and a checkpoint, else the ``ConfigError`` that
    says so; ``run`` and ``needs`` word it for the tool (``compress`` checks the same)."""
    from hybridpar.runtime import checkpoint, evaluator

    if not evaluator.check_run_of(config, workdir):
        raise ConfigError(
            f"{workdir!r} has no config.json: pass the --workdir of a {run} run "
            "(python -m hybridpar.train writes it there)"
        )
    ckpt = checkpoint.checkpoint_dir(config, workdir)
    if not checkpoint.committed_steps(ckpt):
        state = trained.unfinished(workdir)
        if state is not None and state["held"]:  # its trainer has not saved one yet
            raise ConfigError(
                f"no checkpoint in {ckpt} yet: the run in {workdir!r} {state['why']}; {needs}: "
                "run this command again once it has saved one"
            )
        raise ConfigError(
            f"no checkpoint in {ckpt}: {needs}; train it first (python -m hybridpar.train with "
            "the same --config and --workdir)"
        )


def check_workdir(workdir: str) -> None:
    """``--workdir`` names a folder where it names anything (a missing one is each tool's
    own error): a file there was read as a run's folder, and its error named the file's
    ``config.json`` and asked for a --config."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        cli.fail(f"--workdir {workdir} is a file, not a run's folder: pass the folder the "
                 "training run wrote (the --workdir of python -m hybridpar.train)")  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def clear_stale(out: str) -> None:
    """What a killed quantize left beside ``out`` (``move_into_place``'s): its half-written
    ``OUT.tmp-PID``, removed, and ``OUT.old-PID`` (the old results, moved aside just before
    the kill), moved back where ``out`` is missing, else removed. Only those of a process
    that is gone: a live one is still writing its own."""
    parent, base = os.path.split(os.path.abspath(out))
    if not os.path.isdir(parent):
        return
    for name in sorted(os.listdir(parent)):
        for kind in (".tmp-", ".old-"):
            pid = name[len(base + kind) :] if name.startswith(base + kind) else ""
            if not pid.isdigit() or alive(int(pid)):
                continue
            path = os.path.join(parent, name)
            if kind == ".old-" and not os.path.exists(out):
                os.rename(path, out)
            else:
                shutil.rmtree(path, ignore_errors=True)


def move_into_place(tmp: str, out: str) -> None:
    """``tmp`` (complete) becomes ``out``; an existing ``out`` is moved aside first and only
    then removed, so a kill at any moment leaves the old results or the new ones
    (``clear_stale`` puts the old back after a kill between the two renames). The command's
    SIGINT / SIGTERM waits for the end of the move."""
    old = f"{out}.old-{os.getpid()}"
    with signals.whole():
        if os.path.exists(out):
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if os.path.exists(old) and not os.path.exists(out):
                os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)


def temp_of(out: str) -> str:
    """Where ``run`` writes the files before it moves them to ``out``."""
    return f"{out}.tmp-{os.getpid()}"


def litert_input(config, classes: list[str] | None, examples: int | None = None,
                 decoding: dict | None = None) -> dict:  # fmt: skip
    """How to feed ``model.tflite`` (the report's ``litert_input``): its input and output
    tensors, what the pixels are, the split the top-1 figures are measured on (``examples``
    images) and ``classes``, the class names in label order (output ``i`` is
    ``classes[i]``; None where the data has none). ``decoding``: ``eval_decoding``'s."""
    d = config.data
    return {
        "layout": "NHWC",
        "shape": [1, d.image_size, d.image_size, d.channels],
        "dtype": "uint8",
        "pixels": f"raw pixels 0..255, not normalised (data.mean/std are inside the file): "
        f"{eval_pixels(config, decoding)}",
        "output": {"shape": [1, int(d.num_classes)], "dtype": "float32", "what": "logits"},
        "classes": classes,
        "batch": "1; another with interpreter.resize_tensor_input(index, [n, H, W, C]) "
        "then allocate_tensors()",
        "eval_split": eval_split_text(config, examples),
    }


# What the pixels of the built-in data sets are (input/arrays.py) and the split top-1 is on
PIXELS = {
    "digits": "scikit-learn's 8x8 digits (0..16) times 255/16, resized bilinearly with "
    "half-pixel centres (tf.image.resize's, no antialiasing), rounded and clipped to uint8 "
    "(input/arrays.py load_digits); nearest-neighbour upsampling is another input",
}
SPLITS = {
    "digits": "the test split of load_digits: 20% of the 1,797 images, class-stratified, "
    "train_test_split(random_state=0), 360 images",
}


def eval_pixels(config, decoding: dict | None = None) -> str:
    """The eval pipeline's pixels for ``config.data`` in words exact enough to make them
    again: for image files, the centre crop (``data.eval_crop_ratio``) and the resize
    (input/transforms.py ``eval_transform``; input/on_device.py with ``data.on_device``)."""
    d, s = config.data, config.data.image_size
    if d.name in PIXELS:
        return PIXELS[d.name]
    if d.name == "synthetic":
        return f"random uint8 images (data.name='synthetic'): no real input, {s}x{s}"
    square = (f"its centred square of side round({d.eval_crop_ratio:g} x its shorter side) "
              "(data.eval_crop_ratio; top-left corner at ((h - side + 1) // 2, "
              "(w - side + 1) // 2))")  # fmt: skip
    resize = (f"resized to {s}x{s} as tf.image.resize(method='bilinear', antialias=False) "
              "does (half-pixel centres, no antialiasing), then floor(x + 0.5) as uint8 "
              "(rounded half up)")  # fmt: skip
    if d.on_device:  # images: decoded once with Pillow at one stored size
        from hybridpar.input.on_device import image_sizes

        t = max(image_sizes(config))
        return (f"each image file decoded with Pillow as RGB (upright by its EXIF "
                f"orientation); unless it is {t}x{t}, its shorter side resized to {t} px with "
                f"Pillow's BILINEAR filter (which antialiases a shrink; the longer side "
                f"round(side x {t} / shorter)) and the centred {t}x{t} square kept (left "
                f"(w - {t}) // 2, top (h - {t}) // 2); of that, {square}, {resize} "
                "(input/on_device.py decode_image, centre_weights)")  # fmt: skip
    stored = ("as tensorflow-datasets stores it" if d.name == "tfds" else
              "as prepare stored it (the file's own JPEG bytes; another format, a CMYK JPEG or "
              "one turned upright by its EXIF orientation re-encoded as JPEG)")  # fmt: skip
    if decoding and decoding["copy"] != "full":
        stored += f", in its reduced copy of longest side {decoding['max_side']} px"
    elif decoding is None and d.name == "images" and d.reduced_copies:
        stored += (f", in the smallest copy of data.reduced_copies={d.reduced_copies!r} that "
                   f"serves {s} px, if one does")  # fmt: skip
    scale = "at full scale"
    if d.dct_scaling and (decoding is None or decoding["dct"]):
        where = "" if decoding else f" and the copy's median shorter side at least 4 x {s} px"
        scale = (f"at 1/2, 1/4 or 1/8 scale where the square is at least 2, 4 or 8 x {s} px "
                 f"on a side{where} (libjpeg's DCT scaling, data.dct_scaling), else at full "
                 "scale")  # fmt: skip
    decode = (f"decoded as RGB {scale}, the square alone (tf.image.decode_and_crop_jpeg; not "
              "the whole image decoded, then cropped, which differs near the square's edges; "
              "a file that is not a JPEG is)")  # fmt: skip
    return f"each image {stored}: {square}, {decode}, {resize} (input/transforms.py eval_transform)"


def eval_decoding(config) -> dict | None:
    """How the host pipeline reads a ``data.name=images`` eval split at data.image_size:
    ``{"copy", "max_side", "dct"}``, the prepared copy, its longest side and whether its
    JPEGs decode at reduced DCT scales (the pipeline's own rule, on its manifest); None for
    other data, or where the prepared folder cannot be read."""
    d = config.data
    if d.name != "images" or d.on_device:
        return None
    from hybridpar.config.errors import Error
    from hybridpar.input.datasets import data_paths
    from hybridpar.input.pipeline import ImagePipeline

    try:
        pipe = ImagePipeline(data_paths(d)[1], d.eval_split, process_index=0, process_count=1,
                             dct_scaling=d.dct_scaling)  # fmt: skip
        copy = pipe.copy_for(d.image_size)
    except (OSError, Error):
        return None
    return {"copy": copy, "max_side": pipe.info["copies"][copy].get("max_side"),
            "dct": pipe.decoding_for(copy, d.image_size)["dct_scaling"]}  # fmt: skip


def eval_split_text(config, examples: int | None) -> str:
    """The split the top-1 figures are on: its name, where it is, its images."""
    d = config.data
    if d.name in SPLITS:
        return SPLITS[d.name]
    n = f": {examples} images" if examples else ""
    if d.name == "images":
        where = f"data.source={d.source!r}" if d.source else f"data.prepared_dir={d.prepared_dir!r}"
        return f"split {d.eval_split!r} (data.eval_split) of {where}{n}"
    if d.name == "tfds":
        return f"split {d.eval_split!r} (data.eval_split) of tfds {d.tfds_name!r}{n}"
    return f"random images (data.name={d.name!r}), no split{n}"


def class_names(config, info: dict) -> list[str] | None:
    """The class names in label order: the data's own (an images or tfds set's, which the
    run's data record holds too), digits' 0..9, None where the data names none."""
    if info.get("classes"):
        return [str(c) for c in info["classes"]]
    if config.data.name == "digits":
        return [str(i) for i in range(int(config.data.num_classes))]
    return None


def median_ms(fn, x, repeats: int) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(fn(x))  # compiled and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def flops_per_image(arch, layers: dict, shape) -> int:
    """XLA's count of floating-point operations of the folded float network on one image."""
    import jax
    import numpy as np

    from hybridpar.program import int8

    x = jax.ShapeDtypeStruct((1, *shape), np.float32)
    lowered = jax.jit(lambda lay, x: int8.float_forward(arch, lay, x)).lower(layers, x)
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return int(cost["flops"])


def compare(fns: dict, batches) -> tuple[dict, dict]:
    """Each of ``fns`` (name -> uint8 images -> logits; the first is the reference) over the
    same masked host batches: ``({name: {top1, top5, examples}}, {agreement, logit_error})``,
    the agreement and the logits' relative L2 error (``|int8 - float| / |float|`` over the
    whole split) of the second against the first."""
    import jax
    import numpy as np

    names = list(fns)
    hits = {n: [0.0, 0.0] for n in names}
    count = same = err2 = ref2 = 0.0
    for b in batches:
        mask = np.asarray(b["mask"], np.float64)
        label = np.asarray(b["label"])[:, None]
        logits = {n: np.asarray(jax.device_get(fns[n](b["image"])), np.float64) for n in names}
        for n in names:
            # stable: of tied logits (the int8 logits tie often) the first class, as argmax
            # and the LiteRT file's reader take it
            top5 = np.argsort(-logits[n], axis=-1, kind="stable")[:, :5]
            hits[n][0] += float(((top5[:, :1] == label).any(-1) * mask).sum())
            hits[n][1] += float(((top5 == label).any(-1) * mask).sum())
        ref, other = logits[names[0]], logits[names[1]]
        same += float(((ref.argmax(-1) == other.argmax(-1)) * mask).sum())
        err2 += float((((other - ref) ** 2).sum(-1) * mask).sum())
        ref2 += float(((ref**2).sum(-1) * mask).sum())
        count += float(mask.sum())
    evals = {
        n: {"top1": h1 / count, "top5": h5 / count, "examples": int(count)}
        for n, (h1, h5) in hits.items()
    }
    return evals, {"agreement": same / count, "logit_error": float(np.sqrt(err2 / ref2))}


def table(report: dict, num_classes: int) -> list[str]:
    """The float and int8 figures side by side; top-5 '-' where it is 1 by construction
    (``top5_says_nothing``)."""
    batches = sorted({int(k.split("_batch")[1][:-3]) for k in report["latency_ms"]})
    lines = [f"{'':8}{'top1':>8}{'top5':>8}{'weight bytes':>14}"
             + "".join(f"{f'batch {b} ms':>12}" for b in batches)]  # fmt: skip
    for name in ("float", "int8"):
        e, ms = report["eval"][name], report["latency_ms"]
        top5 = f"{'-':>8}" if top5_says_nothing(num_classes) else f"{e['top5']:8.4f}"
        lines.append(f"{name:8}{e['top1']:8.4f}{top5}{report[f'weight_bytes_{name}']:14d}"
                     + "".join(f"{ms[f'{name}_batch{b}_ms']:12.3f}" for b in batches))  # fmt: skip
    return lines


def last_line(report: dict, num_classes: int) -> str:
    """``top1_drop=...`` first, then the rest of the figures, as key=value (no
    ``top5_drop`` where top-5 is 1 by construction: ``top5_says_nothing``)."""
    ev, ms = report["eval"], report["latency_ms"]
    batches = sorted({int(k.split("_batch")[1][:-3]) for k in ms})
    figures = {
        "top1_drop": f"{report['top1_drop_points']:.2f}",
        "top1_float": f"{ev['float']['top1']:.4f}",
        "top1_int8": f"{ev['int8']['top1']:.4f}",
        "top5_drop": f"{report['top5_drop_points']:.2f}",
        "weight_bytes_float": report["weight_bytes_float"],
        "weight_bytes_int8": report["weight_bytes_int8"],
        "ratio": f"{report['ratio']:.2f}",
        "agreement": f"{report['top1_agreement']:.4f}",
        "logit_error": f"{report['logit_error']:.4f}",
    }
    if top5_says_nothing(num_classes):
        del figures["top5_drop"]
    for b in batches:  # float ms / int8 ms: above 1, int8 is faster
        f, q = ms[f"float_batch{b}_ms"], ms[f"int8_batch{b}_ms"]
        figures[f"speedup_b{b}"] = f"{f / q:.2f}"
        figures[f"ms_b{b}_float"], figures[f"ms_b{b}_int8"] = f"{f:.3f}", f"{q:.3f}"
    lite = report.get("litert", {})
    if "file_kb" in lite:  # the LiteRT file's: size, top-1, agreement with int8, latency
        figures["file_kb"] = f"{lite['file_kb']:.1f}"
        figures["top1_litert"] = f"{lite['top1']:.4f}"
        figures["agreement_litert"] = f"{lite['agreement']:.4f}"
        figures["latency_ms"] = f"{lite['latency_ms']:.3f}"
        figures["ms_1tflops"] = f"{lite['ms_at_1tflops']:.4f}"
    return " ".join(f"{k}={v}" for k, v in figures.items())


def evaluated(model, variables, policy, mean, std):
    """``images (uint8) -> float32 logits`` of the trained model as the trainer evaluates
    it: the policy's compute dtype in, the logits in its output dtype (``precision.output``:
    bfloat16 logits tie where float32 ones do not, and a tie breaks one way in both)."""
    import numpy as np

    from hybridpar.program.steps import logits_in, normalize

    def apply(images):
        x = normalize(images, mean, std, policy.compute_dtype)
        return logits_in(policy, model.apply(variables, x, train=False)).astype(np.float32)

    return apply


def run(config, workdir: str, *, calibration_batches=8, calibration="mse", percentile=99.99,
        activations="int8", overwrite=False, repeats=5, latency_batches=LATENCY_BATCHES,
        devices=None, out=None, litert_calibrated=True) -> dict:  # fmt: skip
    """Quantizes ``workdir``'s latest checkpoint; returns the report (also in
    ``W/quantized/report.json``). Arguments are checked by ``check_args``. ``devices``: the
    mesh's, for reading the checkpoint (default: all); the rest runs on the first. ``out``:
    where the files go instead of ``W/quantized`` (hybridpar.compress's rounds).
    ``litert_calibrated``: also convert with the converter's own calibration, for the
    report's comparison row (not kept)."""
    import itertools

    import jax
    import numpy as np

    from hybridpar.program import int8
    from hybridpar.program.steps import normalize
    from hybridpar.runtime.run import log, setup

    out = out or os.path.join(workdir, OUT)
    clear_stale(out)
    state = trained.unfinished(workdir)
    # reads: the data must have the classes the run trained on
    r = setup(config, None, devices=devices, for_training=False, reads=workdir)
    src = trained.TrainedRun(workdir, r.mesh, config=config, program=r.program)
    params, stats = src.host_variables()
    step, model, d = src.step, r.program.model, config.data
    mean, std = tuple(d.mean), tuple(d.std)
    log(f"read the checkpoint at step {step}")
    if state is not None:
        state = {**state, "step": int(step), "total_steps": int(r.plan.total_steps)}
        trained.warn_unfinished(workdir, state, step, r.plan.total_steps, "quantizing")

    # ---- Fold, calibrate, quantize (one device, plain jit: nothing here is sharded) ----
    device = r.mesh.devices.flat[0]
    arch = int8.architecture(model, params)
    layers = int8.fold_batchnorm(arch, params, stats, model.bn_epsilon)
    with jax.default_device(device):
        t0 = time.time()
        to_float = jax.jit(lambda im: normalize(im, mean, std, np.float32))
        ranges, used, images = None, 0, []
        if activations == "int8":  # training batches: the first K of epoch 0
            images = [
                b["image"] for b in itertools.islice(r.data.train_batches(0), calibration_batches)
            ]
            used = len(images)
            ranges = int8.calibrate(arch, layers, map(to_float, images), calibration, percentile)
            if used < calibration_batches:
                log(f"calibrated on {used} batches (a whole epoch), not "
                            f"{calibration_batches}")  # fmt: skip
        q = int8.quantize(layers, ranges)
        # the tensors a full-integer file holds in int8 beyond the layers' inputs: int8_model
        # quantizes them at the file's ranges, so the two are one quantized network (left
        # float, the file's top-1 parted from ours by more than its kernels' rounding)
        outputs = None
        if activations == "int8":
            outputs = int8.output_ranges(arch, q, map(to_float, images))
        calibrate_s = time.time() - t0
        variables = {"params": params, "batch_stats": stats}
        float_model = jax.jit(evaluated(model, variables, r.program.policy, mean, std))
        int8_model = jax.jit(int8.serving_fn(arch, q, mean, std, outputs))

        # ---- The eval split, float and int8 ----
        t0 = time.time()
        models = {"float": float_model, "int8": int8_model}
        evals, agree = compare(models, r.data.eval_batches())
        for name, e in evals.items():
            if e["examples"] != r.data.num_eval:
                raise AssertionError(f"{name}: {e['examples']} examples, not {r.data.num_eval}")
        eval_s = time.time() - t0
        if activations == "int8":
            log(f"calibrated ({calibration}) on {used} batches in {calibrate_s:.1f}s; float "
                f"and int8 evaluated in {eval_s:.1f}s")  # fmt: skip
        else:  # weight-only: the activations stay float, there is nothing to calibrate
            log(f"weight-only int8 (float activations, no calibration); float and int8 "
                f"evaluated in {eval_s:.1f}s")  # fmt: skip

        # ---- CPU latency, side by side ----
        shape = (d.image_size, d.image_size, d.channels)  # the eval size (a curriculum ends there)
        batches = ", ".join(map(str, latency_batches))
        # a full-integer LiteRT file needs int8 activations: weight-only writes none
        files = ("the StableHLO and LiteRT files (the conversion takes a while)"
                 if activations == "int8" else "the StableHLO file")  # fmt: skip
        log(f"timing float and int8 at batch {batches}, then writing {files} ...")
        latency = {}
        t0 = time.time()
        for b in latency_batches:
            x = np.random.default_rng(0).integers(0, 256, (b, *shape), np.uint8)
            x = jax.device_put(x, device)
            for _ in range(2):  # interleaved rounds, so drift on a shared machine hits both
                for name, fn in (("float", float_model), ("int8", int8_model)):
                    ms = median_ms(fn, x, repeats)
                    key = f"{name}_batch{b}_ms"
                    latency[key] = min(latency.get(key, ms), ms)
        latency_s = time.time() - t0

    # ---- Files: written beside, then moved into place ----
    tmp = temp_of(out)
    os.makedirs(tmp)
    try:
        np.savez(os.path.join(tmp, "params.npz"), **int8.flat(q))
        int8.export(arch, q, mean, std, shape, os.path.join(tmp, "model.jax_exported"), outputs)
        float_bytes = int8.tree_bytes(params)
        int8_bytes = int8.tree_bytes(q)
        flops = flops_per_image(arch, layers, shape)
        from hybridpar.tools import edge  # imports TensorFlow: only here

        with jax.default_device(device):  # the LiteRT file, against int8_model
            litert = edge.export(os.path.join(tmp, "model.tflite"), arch, q, layers, mean, std,
                                 shape, images, r.data.eval_batches, int8_model, flops,
                                 int8_bytes, calibrated=litert_calibrated,
                                 ranges=outputs)  # fmt: skip
        f1, q1 = evals["float"]["top1"], evals["int8"]["top1"]
        f5, q5 = evals["float"]["top5"], evals["int8"]["top5"]
        report = {
            "workdir": os.path.abspath(workdir),
            "step": int(step),
            # the run had not finished (still training, stopped early): None when it had
            "unfinished": state,
            "weights": "int8",
            "activations": activations,
            "calibration_batches": used,
            "calibration": calibration if activations == "int8" else None,
            "percentile": percentile if calibration == "percentile" else None,
            "calibration_s": round(calibrate_s, 3),
            "eval": evals,
            "top1_drop_points": round(100 * (f1 - q1), 4),
            "top5_drop_points": round(100 * (f5 - q5), 4),
            "top1_agreement": round(agree["agreement"], 6),
            "logit_error": round(agree["logit_error"], 6),
            # float: every trained parameter (kernels, BN scales and biases, head); int8: the
            # int8 kernels, their float32 steps, the folded float32 biases and activation steps
            "weight_bytes_float": float_bytes,
            "weight_bytes_int8": int8_bytes,
            "ratio": round(float_bytes / int8_bytes, 3),
            "params": int(sum(np.size(x) for x in jax.tree.leaves(params))),
            "flops_per_image": flops,
            "latency_ms": {k: round(v, 3) for k, v in latency.items()},
            "latency_repeats": repeats,
            "latency_s": round(latency_s, 3),
            "device": str(device.device_kind),
            "activation_ranges": ranges,
            # (min, max, narrow) of the other int8 tensors, the file's and int8_model's
            "output_ranges": outputs,
            # the LiteRT int8 file: size, top-1 against int8, one-thread latency
            "litert": litert,
            # how to feed model.tflite: its input and output, the pixels, the eval split,
            # the class names in label order
            "litert_input": litert_input(
                config, class_names(config, r.data.info), r.data.num_eval, eval_decoding(config)
            ),
            "files": ["params.npz", "model.jax_exported", "report.json"]
            + ([] if "skipped" in litert else ["model.tflite"]),
        }
        with open(os.path.join(tmp, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
        if os.path.exists(out) and not overwrite:
            raise ConfigError(f"{out} appeared while quantizing: pass --overwrite to replace it")
        move_into_place(tmp, out)
    except BaseException:  # nothing half-written left beside the results
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    # ---- The report ----
    for line in table(report, config.data.num_classes):
        log(line)
    log(edge.summary(litert))
    log(f"wrote {out}/ ({', '.join(report['files'])})")
    print(last_line(report, config.data.num_classes), flush=True)
    return report


def main(argv=None) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.quantize",
        (
            "Quantize a trained run to int8 (weights per channel, activations with calibrated "
            "scales): its top-1 and latency beside the float model's, and a LiteRT file."
        ),
        # by hand: --workdir is required, but a missing one is our error line, not argparse's
        usage="%(prog)s [-h] --workdir WORKDIR\n"
        "       [--calibration-batches CALIBRATION_BATCHES] [--calibration {max,percentile,mse}]\n"
        "       [--percentile PERCENTILE] [--weights {int8}] [--activations {int8,none}]\n"
        "       [--overwrite] [--repeats REPEATS]",
    )
    parser.add_argument("--workdir", help="the training run's workdir")
    parser.add_argument(
        "--calibration-batches",
        type=int,
        help="training batches that set the static activation scales (default 8)",
    )
    parser.add_argument(
        "--calibration",
        choices=CALIBRATIONS,
        help="each activation's range: mse, the range of least squared quantization error "
        "(default), max |x| over the batches, or a --percentile of |x|",
    )
    parser.add_argument(
        "--percentile",
        type=cli.finite_float,
        help="for --calibration percentile: the percentile of |x| (default 99.99)",
    )
    parser.add_argument("--weights", choices=("int8",), default="int8",
                        help="the weights' type: int8, one step per output channel, BatchNorm "
                             "folded in (the default and only choice)")  # fmt: skip
    parser.add_argument(
        "--activations",
        choices=("int8", "none"),
        default="int8",
        help="int8: static per-tensor scales (default); none: weight-only, float activations",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing WORKDIR/quantized/"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls per latency figure (median)"
    )
    args, config = cli.parse(parser, argv, from_run=True)
    if not args.workdir:
        cli.fail("pass --workdir DIR (the training run's)")
    check_workdir(args.workdir)

    def go():
        # without --config: the run's own, its latest checkpoint's
        c = config or trained.load_config(args.workdir, args.config_overrides)
        check_args(args, c)  # before any device or data is touched
        # a flag not given: run()'s default
        given = {k: getattr(args, k) for k in ("calibration_batches", "calibration", "percentile")}
        run(
            c,
            args.workdir,
            **{k: v for k, v in given.items() if v is not None},
            activations=args.activations,
            overwrite=args.overwrite,
            repeats=args.repeats,
        )

    # run() writes its files beside W/quantized and moves them in whole, just before its
    # report lines: a stop before that leaves nothing new (an earlier W/quantized/ as it was)
    report = os.path.join(args.workdir, OUT, "report.json")
    before = file_identity(report)

    def stopped() -> str:
        if file_identity(report) != before:
            return f"{os.path.dirname(report)} was written whole before the stop"
        return "nothing written"

    # SIGINT / SIGTERM: stop at once, the half-written folder removed (a KeyboardInterrupt
    # inside JAX or a gc callback was dropped, and the old results replaced)
    with signals.StopWriting(temp_of(os.path.join(args.workdir, OUT)), stopped):
        cli.main(go, stopped)


def file_identity(path: str) -> tuple[int, int] | None:
    """``path``'s inode and modification time (None where it is missing): another once a
    quantize has moved its new folder in."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


if __name__ == "__main__":
    main()
