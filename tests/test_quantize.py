"""Int8 post-training quantization: ``hybridpar/program/int8.py`` and
``python -m hybridpar.quantize``.

* Folding BatchNorm into the convolutions leaves the float logits unchanged (basic and
  bottleneck blocks, small and strided stems), within float32 rounding; folding without the
  running mean is rejected by the same check.
* Per-channel int8 weights round-trip within half their channel's step; steps taken along
  the wrong axis (input channels) are rejected by the same check.
* On a tiny trained digits run: the command's float top-1 is the trainer's own final eval,
  int8 loses at most a few points, weights are ~4x smaller, the exported StableHLO model
  (loaded with JAX alone) gives the in-process int8 model's logits, and ``params.npz``
  holds what it ran with.
* A workdir without a checkpoint, a checkpoint of another config and an existing
  ``quantized/`` without ``--overwrite`` are ``error:`` lines.
* The report says how to feed the LiteRT file (its input and output as the file has them,
  the class names in label order; for an images run, pixels in words that make the eval
  pipeline's again);
  the StableHLO file is exported for CPU, GPU and TPU; a run still training is quantized
  with a ``warning:`` line naming its step; a killed quantize's leftovers are cleared and
  its old results never lost; Ctrl-C while it writes (even inside a gc callback) stops it
  with its line and 130, the old results kept; a signal during the move waits for its end;
  Ctrl-C while prune writes leaves no run.
"""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import DIGITS, TINY_DIGITS, config_args, main_here, random_variables, tiny_digits

from hybridpar.config.errors import ConfigError
from hybridpar.models.resnet import ResNet50, ResNetTiny
from hybridpar.program import int8
from hybridpar.runtime import run, run_config, signals, trained, trainer
from hybridpar.runtime.run import setup
from hybridpar.tools import quantize

EPS32 = float(np.finfo(np.float32).eps)
# The tiny run, long enough (66 steps) to be well above chance: an accuracy check on an
# untrained net would pass whatever int8 did to it.
LONGER = {"num_epochs": 1.5, "log_every_s": 5.0, "mesh": "data:1"}


# ---- BatchNorm folding -------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,size",
    [(ResNetTiny(num_classes=10), 16), (ResNet50(num_classes=10, num_filters=4), 32)],
    ids=["tiny-basic", "resnet50-bottleneck"],
)
def test_folding_keeps_float_logits(model, size):
    params, stats = random_variables(model, size)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, size, size, 3)), jnp.float32)
    apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
    want = np.asarray(apply({"params": params, "batch_stats": stats}, x))
    arch = int8.architecture(model, params)
    folded = int8.fold_batchnorm(arch, params, stats, model.bn_epsilon)
    forward = jax.jit(lambda lay, x: int8.float_forward(arch, lay, x))
    got = np.asarray(forward(folded, x))
    # Folding only reassociates float32 products ((x * W) * s vs x * (W * s)) and sums in
    # another order: each layer adds a few float32 roundings relative to its output. Over
    # the ~20 layers and 576-term sums here, 1000 roundings of the logits' scale bounds it
    # with a wide margin (measured: ~1e-7 of the scale, i.e. about one rounding).
    tol = 1000 * EPS32 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    # negative control: the running mean left out of the folded bias
    no_mean = jax.tree_util.tree_map_with_path(
        lambda path, a: np.zeros_like(a) if "mean" in jax.tree_util.keystr(path) else a, stats
    )
    broken = int8.fold_batchnorm(arch, params, no_mean, model.bn_epsilon)
    bad = np.asarray(forward(broken, x))
    assert np.abs(bad - want).max() > 100 * tol


def test_folding_uses_the_epsilon_where_variances_are_small():
    """Trained BatchNorm variances can be near epsilon (dead or nearly constant channels),
    where ``gamma / sqrt(var + eps)`` and ``gamma / sqrt(var)`` part: here every variance is
    in [1e-6, 1e-4] (eps 1e-5), with gammas scaled by ``sqrt(var + eps)`` so activations
    keep their size. Folding must match the float model; leaving epsilon out must not."""
    from flax import traverse_util

    model = ResNetTiny(num_classes=10)
    params, stats = random_variables(model, 16)
    flat_p, flat_s = traverse_util.flatten_dict(params), traverse_util.flatten_dict(stats)
    rng = np.random.default_rng(2)
    for key in [k for k in flat_s if k[-1] == "var"]:
        var = np.float32(10.0) ** rng.uniform(-6, -4, flat_s[key].shape).astype(np.float32)
        flat_s[key] = var
        scale = (*key[:-1], "scale")
        flat_p[scale] = flat_p[scale] * np.sqrt(var + np.float32(model.bn_epsilon))
    params, stats = traverse_util.unflatten_dict(flat_p), traverse_util.unflatten_dict(flat_s)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 16, 16, 3)), jnp.float32)
    want = np.asarray(model.apply({"params": params, "batch_stats": stats}, x, train=False))
    arch = int8.architecture(model, params)
    forward = jax.jit(lambda lay, x: int8.float_forward(arch, lay, x))
    got = np.asarray(forward(int8.fold_batchnorm(arch, params, stats, model.bn_epsilon), x))
    tol = 1000 * EPS32 * np.abs(want).max()  # as in test_folding_keeps_float_logits
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    # negative control: epsilon left out of the fold
    bad = np.asarray(forward(int8.fold_batchnorm(arch, params, stats, 0.0), x))
    assert np.abs(bad - want).max() > 100 * tol


# ---- weight round trip -------------------------------------------------------------------


def roundtrip_excess(w, q, step, axis):
    """The largest ``|dequantize(q) - w|`` in units of half the true per-output-channel
    step (``max |w[..., c]| / 127``): <= 1 passes."""
    got = int8.dequantize(q, step, axis)
    true_step = np.abs(w).max(axis=tuple(range(w.ndim - 1))) / int8.QMAX
    # one float32 rounding of |w| on top of the half step (w / step * step rounds)
    allowed = true_step / 2 + 2 * np.spacing(np.abs(w).astype(np.float32))
    return float((np.abs(got - w) / allowed).max())


def test_weight_roundtrip_within_half_a_step():
    rng = np.random.default_rng(0)
    # channel ranges spread over 4 decades, as folded BN scales make them
    w = (rng.normal(size=(3, 3, 16, 32)) * np.logspace(-3, 1, 32)).astype(np.float32)
    q, step = int8.quantize_per_channel(w, -1)
    assert q.dtype == np.int8 and step.shape == (32,) and np.abs(q).max() == int8.QMAX
    assert roundtrip_excess(w, q, step, -1) <= 1
    # negative control: steps per input channel (the wrong axis)
    q_bad, step_bad = int8.quantize_per_channel(w, -2)
    assert roundtrip_excess(w, q_bad, step_bad, -2) > 1


@pytest.mark.parametrize("unsigned", [True, False], ids=["shifted", "symmetric"])
def test_int8_layer_is_exact_on_representable_values(unsigned):
    """A padded 3x3 conv whose input and kernel are exactly representable (integer codes
    times their steps) must give the float conv's result up to float32 rounding: the int8
    arithmetic itself adds no error. Padding the codes with 0 instead of the code of 0.0 on
    a shifted input is rejected (its border pixels lose 128 x the kernel's sum)."""
    rng = np.random.default_rng(0)
    x_step, w_step = np.float32(0.05), np.logspace(-2, 0, 8).astype(np.float32)
    codes = (
        rng.integers(0, 256, (2, 6, 6, 4)) if unsigned else rng.integers(-127, 128, (2, 6, 6, 4))
    )
    x = (codes * x_step).astype(np.float32)
    kernel = rng.integers(-127, 128, (3, 3, 4, 8)).astype(np.int8)
    kernel[0, 0, 0] = 127  # each channel's largest code: its step is w_step
    w = kernel.astype(np.float32) * w_step
    bias = rng.normal(size=8).astype(np.float32)
    ranges = {"l": {"min": float(x.min()), "max_abs": float(np.abs(x).max())}}
    p = int8.quantize({"l": {"kernel": w, "bias": bias}}, ranges)["l"]
    assert int(p["x_zero"]) == (128 if unsigned else 0)
    p["x_step"] = x_step  # the codes' own step (calibration would pick max/255 or max/127)
    np.testing.assert_array_equal(p["kernel"], kernel)
    conv = jax.lax.conv_general_dilated  # the float conv, padded by 1
    layout = ("NHWC", "HWIO", "NHWC")
    want = np.asarray(conv(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=layout)) + bias
    got = np.asarray(int8.int8_layer(p, jnp.asarray(x), 1, 1))
    # exact int32 sums; the float reference rounds its 36-term sums
    tol = 64 * EPS32 * (np.abs(x).max() * np.abs(w).sum((0, 1, 2)).max() + np.abs(bias).max())
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    if unsigned:  # negative control: padded with code 0 (= 128 steps) at the border
        bad = np.asarray(int8.int8_layer(p, jnp.asarray(x), 1, 1, pad_code=False))
        assert np.abs(bad - want).max() > 100 * tol


# ---- activation ranges -------------------------------------------------------------------


def _quantization_error(x, clip, levels):
    step = clip / levels
    return float(np.mean((x - np.minimum(np.round(x / step), levels) * step) ** 2))


def test_clipped_ranges_cut_the_error_of_rare_large_inputs():
    """Post-ReLU activations with a heavy tail (|Student t|, 3 degrees of freedom): the
    percentile range is the sample's percentile (to a bin), and the mse range clips the
    tail, with less squared quantization error than the largest |x|, than the percentile's
    and than ranges a little above and below it."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_t(3, size=200_000)).astype(np.float32)
    top, levels = float(x.max()), 2 * int8.QMAX + 1
    counts = np.bincount(np.minimum((x / top * int8.BINS).astype(int), int8.BINS - 1),
                         minlength=int8.BINS)  # fmt: skip
    p99 = int8.clip_range(counts, top, levels, "percentile", 99.9)
    assert abs(p99 - np.percentile(x, 99.9)) <= 2 * top / int8.BINS  # its bin's upper edge
    mse = int8.clip_range(counts, top, levels, "mse", 0)
    assert quantize.CALIBRATIONS == int8.CALIBRATIONS  # the CLI's choices (it keeps JAX out)
    assert mse < 0.9 * top  # clips the tail
    best = _quantization_error(x, mse, levels)
    assert best < 0.9 * _quantization_error(x, top, levels)  # max |x|: coarser steps
    assert best < _quantization_error(x, p99, levels)  # clips too much of the tail
    assert best < _quantization_error(x, 0.8 * mse, levels)
    assert best < _quantization_error(x, min(top, 1.2 * mse), levels)


@pytest.mark.parametrize("output", ["bfloat16", "float32"])
def test_the_float_model_is_the_eval_steps(output):
    """quantize's float model gives the eval step's logits: with precision.output=bfloat16
    the eval step rounds them to bfloat16 (where ties appear) before its top-1, and the
    float model did not, so its float top-1 differed from the trainer's and the
    evaluator's on such a run."""
    from hybridpar.program.precision import make_policy
    from hybridpar.program.steps import DENSE, normalize

    model = ResNetTiny(num_classes=10, num_filters=4)
    params, stats = random_variables(model, 16)
    variables = {"params": params, "batch_stats": stats}
    policy = make_policy(output=output)
    mean, std = (120.0, 110.0, 100.0), (60.0, 64.0, 70.0)
    images = np.random.default_rng(3).integers(0, 256, (6, 16, 16, 3), np.uint8)
    got = jax.jit(quantize.evaluated(model, variables, policy, mean, std))(images)
    def eval_logits(images):  # as steps.make_eval_step computes them
        x = normalize(images, mean, std, policy.compute_dtype)
        labels = jnp.zeros(len(images), jnp.int32)
        return DENSE.apply(model, variables, x, labels, train=False, policy=policy)[0]["logits"]

    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(eval_logits)(images)))


# ---- the command on a tiny trained run ---------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny digits run trained in-process, then quantized with the command's ``run``."""
    w = tmp_path_factory.mktemp("quantize") / "w"
    one = jax.devices()[:1]  # one device: the train step compiles faster than on a mesh
    summary = trainer.train(setup(tiny_digits(**LONGER), str(w), devices=one))
    # as the command does without --config: the run's own config, from its config.json
    config = trained.load_config(str(w))
    assert run_config.config_dict(config) == run_config.config_dict(tiny_digits(**LONGER))
    args = quantize_args(str(w))
    quantize.check_args(args, config)
    stale = w / f"quantized.tmp-{_dead_pid()}"  # a killed quantize's: cleared at the start
    stale.mkdir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = quantize.run(
            config, str(w), calibration_batches=4, repeats=1, latency_batches=(1,), devices=one
        )
    print(out.getvalue())
    (w.parent / "quantize.out").write_text(out.getvalue())  # its lines, for the tests
    assert not stale.exists()
    return w, summary, report


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def quantize_args(workdir):
    import argparse

    return argparse.Namespace(workdir=workdir, calibration_batches=4, repeats=1, overwrite=False,
                              calibration=None, percentile=None, activations="int8")  # fmt: skip


def test_int8_accuracy_and_size(quantized):
    w, summary, report = quantized
    ev = report["eval"]
    n = ev["float"]["examples"]
    # the float model as the command evaluates it is the trainer's (one device vs 8: only
    # a tie in the logits could move one example)
    assert abs(ev["float"]["top1"] - summary["final_eval"]["top1"]) <= 1 / n
    assert ev["float"]["top1"] > 0.3  # trained: far above chance (0.1)
    assert report["top1_drop_points"] <= 3.0, report["eval"]
    assert report["top1_agreement"] >= 0.9, report["top1_agreement"]
    assert 3.5 < report["ratio"] < 4.0, report["ratio"]
    files = {"params.npz", "model.jax_exported", "model.tflite", "report.json"}
    assert set(os.listdir(w / "quantized")) == files
    lite = report["litert"]  # the LiteRT file: its runtime's top-1 is int8's, nearly
    assert lite["file_bytes"] == os.path.getsize(w / "quantized" / "model.tflite")
    assert lite["top1_ours"] == ev["int8"]["top1"] and lite["examples"] == n
    assert lite["agreement"] >= 0.97 and abs(lite["top1"] - lite["top1_ours"]) <= 0.02, lite
    assert lite["calibrated"]["agreement"] >= 0.9, lite  # the converter's own ranges


def test_top5_is_left_out_where_it_is_1_by_construction():
    """With 5 classes or fewer top-5 is 1 by construction: the table's column and the last
    line's top5_drop said nothing (1.0000, 0.00); now '-' and no top5_drop (report.json
    keeps the numbers). Planted bug that fails it: the figures said for any classes."""
    from hybridpar.tools.quantize import last_line, table

    report = {"eval": {n: {"top1": 0.75, "top5": 1.0} for n in ("float", "int8")},
              "latency_ms": {"float_batch1_ms": 1.0, "int8_batch1_ms": 2.0},
              "weight_bytes_float": 400, "weight_bytes_int8": 100, "top1_drop_points": 0.0,
              "top5_drop_points": 0.0, "ratio": 4.0, "top1_agreement": 1.0,
              "logit_error": 0.01}  # fmt: skip
    assert table(report, 3)[1] == "float     0.7500       -           400       1.000"
    assert table(report, 6)[1] == "float     0.7500  1.0000           400       1.000"
    assert "top5_drop" not in last_line(report, 3)
    assert "top1_int8=0.7500 top5_drop=0.00 weight" in last_line(report, 6)


def test_exported_model_equals_in_process(quantized):
    w, _, _ = quantized
    # made on CPU for every platform JAX lowers here without its devices: a GPU or TPU
    # host runs it too (without platforms=, the export is for this CPU alone)
    with open(w / "quantized" / "model.jax_exported", "rb") as f:
        assert jax.export.deserialize(bytearray(f.read())).platforms == ("cpu", "cuda", "tpu")
    c = tiny_digits(**LONGER)
    with np.load(w / "quantized" / "params.npz") as f:
        q = int8.unflat(f)
    assert q["stage1_block0/conv1"]["kernel"].dtype == np.int8
    # the architecture from the model code; the exported file needs none of it
    program = setup(c, None, with_data=False, devices=jax.devices()[:1]).program
    params = meta.unbox(program.abstract.params)
    arch = int8.architecture(program.model, params)
    # the exported model quantizes where the LiteRT file does, at the report's ranges
    report = json.loads((w / "quantized" / "report.json").read_text())
    ranges = {k: tuple(v) for k, v in report["output_ranges"].items()}
    assert set(ranges) == set(int8.points(arch)), ranges
    in_process = jax.jit(int8.serving_fn(arch, q, c.data.mean, c.data.std, ranges))
    served = int8.load_exported(str(w / "quantized" / "model.jax_exported"))
    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 1), np.uint8)
    want, got = np.asarray(in_process(images)), np.asarray(served(images))
    assert got.shape == (5, 10) and got.dtype == np.float32
    # the same int32 sums; only the float rescale may be fused differently by XLA
    tol = 16 * EPS32 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # static scales: an image's logits do not depend on the rest of its batch (dynamic,
    # per-batch activation ranges would make them)
    np.testing.assert_allclose(np.asarray(served(images[:1])), got[:1], rtol=0, atol=tol)
    # the arithmetic is integer: every convolution and the head's product take int8
    # operands and accumulate in int32, none is float (in each platform's lowering)
    with open(w / "quantized" / "model.jax_exported", "rb") as f:
        text = jax.export.deserialize(bytearray(f.read())).mlir_module()
    convs = re.findall(r"stablehlo\.(?:convolution|dot_general)\b.*", text)
    assert len(convs) == 3 * len(int8.layer_paths(arch)), len(convs)
    assert all(re.search(r"xi8>, tensor<[^>]*xi8>\) -> tensor<[^>]*xi32>", c) for c in convs), convs


def test_the_report_says_how_to_feed_the_litert_file(quantized):
    """``litert_input``: the file's input (NHWC uint8 pixels, batch 1) and output (float32
    logits) as the interpreter reads them, the class names in label order (digits': 0..9),
    a batch resized as it says runs, and the lines: a progress line before the timing and
    the conversion, no warning."""
    from ai_edge_litert.interpreter import Interpreter

    w, _, report = quantized
    spec = report["litert_input"]
    it = Interpreter(model_path=str(w / "quantized" / "model.tflite"))
    inp, out = it.get_input_details()[0], it.get_output_details()[0]
    assert spec["layout"] == "NHWC" and spec["shape"] == [1, 16, 16, 1] == list(inp["shape"])
    assert spec["dtype"] == "uint8" == np.dtype(inp["dtype"]).name
    assert spec["output"] == {"shape": [1, 10], "dtype": "float32", "what": "logits"}
    assert list(out["shape"]) == [1, 10] and np.dtype(out["dtype"]).name == "float32"
    assert "0..255" in spec["pixels"] and "bilinear" in spec["pixels"], spec
    assert "360 images" in spec["eval_split"], spec
    assert spec["classes"] == [str(i) for i in range(10)], spec
    images = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 1), np.uint8)
    one = []
    it.allocate_tensors()
    for image in images:
        it.set_tensor(inp["index"], image[None])
        it.invoke()
        one.append(it.get_tensor(out["index"])[0].copy())
    it.resize_tensor_input(inp["index"], [3, 16, 16, 1])
    it.allocate_tensors()
    it.set_tensor(inp["index"], images)
    it.invoke()
    batch = it.get_tensor(out["index"])
    assert batch.shape == (3, 10) and (batch.argmax(-1) == np.argmax(one, -1)).all()
    lines = (w.parent / "quantize.out").read_text().splitlines()
    timing = [i for i, x in enumerate(lines) if x.startswith("timing float and int8 at batch 1")]
    table = [i for i, x in enumerate(lines) if x.startswith("float ")]
    assert timing and table and timing[0] < table[0], lines
    assert report["unfinished"] is None and not any(x.startswith("warning:") for x in lines)


def _noise_jpeg(w, h, seed) -> bytes:
    """A JPEG of random pixels: a crop or a resize other than the pipeline's shows in
    every pixel."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_the_litert_input_of_an_images_run_makes_its_eval_pixels_again(tmp_path):
    """For data.name=images, ``litert_input`` names the eval split and its images, the
    class names in label order, and pixels in words that make the eval pipeline's again,
    exactly: the centre crop at data.eval_crop_ratio, decoded alone at full scale (these
    images are too small for DCT scaling), a bilinear resize without antialiasing, rounded
    half up. A whole-image resize (what "as its eval pipeline makes them" left a user to
    try) does not make them, nor does the square cut from the whole image decoded (the
    tall image's chroma differs near its edges). Planted bug that fails it: the words of
    before."""
    import tensorflow as tf

    from hybridpar.config.schema import base_config
    from hybridpar.input import datasets
    from hybridpar.input.prepare import prepare

    src, val = tmp_path / "src", []
    for i, (w, h) in enumerate([(40, 30), (30, 52), (37, 37)]):  # wide, tall, square
        for split in ("train", "val"):
            path = src / split / ("ant", "bee")[i % 2] / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_noise_jpeg(w, h, i))
        val.append(path.read_bytes())
    prepare([src], tmp_path / "out", workers=1, progress=False)  # in this process
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"),
                  num_classes=2, image_size=16, eval_split="val")  # fmt: skip
    c.data.eval_crop_ratio = 0.875
    c.global_batch = c.eval_batch = 3
    data = datasets.make_data(c, 0, 1)
    spec = quantize.litert_input(c, quantize.class_names(c, data.info), data.num_eval,
                                 quantize.eval_decoding(c))  # fmt: skip
    assert spec["classes"] == ["ant", "bee"], spec
    assert spec["eval_split"] == f"split 'val' (data.eval_split) of data.source={str(src)!r}: " \
        "3 images", spec  # fmt: skip
    pixels = spec["pixels"]
    for words in ("its centred square of side round(0.875 x its shorter side)",
                  "top-left corner at ((h - side + 1) // 2, (w - side + 1) // 2)",
                  "decoded as RGB at full scale, the square alone (tf.image.decode_and_crop_jpeg",
                  "resized to 16x16 as tf.image.resize(method='bilinear', antialias=False)",
                  "then floor(x + 0.5) as uint8"):  # fmt: skip
        assert words in pixels, pixels

    def as_said(data, how="square"):  # the words, step by step
        h, w = tf.image.extract_jpeg_shape(data).numpy()[:2]
        side = round(0.875 * min(h, w))
        top, left = (h - side + 1) // 2, (w - side + 1) // 2
        if how == "square":
            x = tf.image.decode_and_crop_jpeg(data, [top, left, side, side], channels=3)
        else:
            x = tf.io.decode_jpeg(data, channels=3).numpy()
            x = x if how == "whole" else x[top : top + side, left : left + side]
        x = tf.image.resize(x, [16, 16], method="bilinear", antialias=False).numpy()
        return np.floor(x + 0.5).astype(np.uint8).tobytes()

    (batch,) = list(data.eval_batches())
    got = sorted(x.tobytes() for x in batch["image"])
    assert got == sorted(as_said(v) for v in val)
    assert not {as_said(v, "whole") for v in val} & set(got)
    assert sorted(as_said(v, "cut") for v in val) != got


def _fake_run(path, summary=None, steps=("66",)):
    path.mkdir()
    for step in steps:
        (path / "checkpoints" / step).mkdir(parents=True)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
        (path / "metrics.jsonl").write_text("")
    return path


def test_an_unfinished_run_is_told_apart(tmp_path):
    """``unfinished``: a run another process holds (still training), one without a
    summary, one stopped early; not a finished one, nor a pruned one (step 0 by design)."""
    from hybridpar.runtime import workdir_lock

    done = {"completed": True, "steps": 66, "total_steps": 66}
    assert trained.unfinished(str(_fake_run(tmp_path / "done", done))) is None
    # done, then resumed with more epochs from step 66 and killed: the summary is the first
    # start's (planted bug that fails it: any summary.json taken as the run's end)
    again = _fake_run(tmp_path / "again", done)
    resume = {"event": "resume", "step": 66, "epoch": 6.0, "wall_s": 30.0, "from_step": 66}
    (again / "metrics.jsonl").write_text(json.dumps(resume) + "\n")
    assert trained.unfinished(str(again)) == {
        "why": "was resumed and its last start did not end (its summary.json is an earlier "
        "start's)", "held": False}  # fmt: skip
    stopped = _fake_run(tmp_path / "stopped", {"completed": False, "steps": 12, "total_steps": 66})
    assert trained.unfinished(str(stopped)) == {
        "why": "stopped at step 12 of 66", "held": False, "total_steps": 66}  # fmt: skip
    none = trained.unfinished(str(_fake_run(tmp_path / "none")))
    assert none == {"why": "has no summary.json (its training has not ended)", "held": False}
    held = _fake_run(tmp_path / "held", done)
    lock = workdir_lock.acquire(str(held))
    try:
        state = trained.unfinished(str(held))
    finally:
        lock.release()
    assert state["held"] and state["why"].startswith(f"is still training (pid {os.getpid()} ")
    pruned = _fake_run(tmp_path / "pruned", steps=("0",))  # as prune writes one
    (pruned / "pruned.json").write_text("{}")
    assert trained.unfinished(str(pruned)) is None
    (pruned / "pruned.json").unlink()  # one pruned before pruned.json: a lone step 0
    assert trained.unfinished(str(pruned)) is None


def test_a_run_still_training_is_quantized_with_a_warning(quantized, tmp_path, capsys):
    """Another process holds the run's lock: the ``warning:`` line names the checkpoint's
    step and the run's steps, and the report records it."""
    from hybridpar.runtime import workdir_lock

    w = tmp_path / "w"
    shutil.copytree(quantized[0], w, ignore=shutil.ignore_patterns("quantized"))
    lock = workdir_lock.acquire(str(w))
    try:
        report = quantize.run(trained.load_config(str(w)), str(w), calibration_batches=1,
                              repeats=1, latency_batches=(1,), devices=jax.devices()[:1],
                              litert_calibrated=False)  # fmt: skip
    finally:
        lock.release()
    lines = capsys.readouterr().out.splitlines()
    warnings = [x for x in lines if x.startswith("warning:")]
    assert len(warnings) == 1, lines
    assert f"is still training (pid {os.getpid()} " in warnings[0], warnings
    assert "quantizing its checkpoint at step 66 of the run's 66 steps" in warnings[0], warnings
    assert report["unfinished"]["held"] and report["unfinished"]["step"] == 66, report


def test_a_killed_quantize_loses_no_results(tmp_path, monkeypatch):
    """The old results are moved aside before the new ones move in: a kill between the two
    leaves them (put back by the next start), and a dead process's half-written folder goes
    while a live one's stays."""
    out = tmp_path / "quantized"
    out.mkdir()
    (out / "report.json").write_text("old")
    tmp = tmp_path / "quantized.tmp-1"
    tmp.mkdir()
    (tmp / "report.json").write_text("new")
    rename = os.rename

    def killed(src, dst):  # the kill comes as the new results move in
        if str(src) == str(tmp):
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        quantize.move_into_place(str(tmp), str(out))
    monkeypatch.setattr(os, "rename", rename)
    assert (out / "report.json").read_text() == "old"
    quantize.move_into_place(str(tmp), str(out))
    assert (out / "report.json").read_text() == "new" and os.listdir(tmp_path) == ["quantized"]
    # what a kill -9 leaves: the old results aside (out gone), a dead one's tmp; a live one's
    dead, live = _dead_pid(), os.getppid()
    rename(out, tmp_path / f"quantized.old-{dead}")
    for pid in (dead, live):
        (tmp_path / f"quantized.tmp-{pid}").mkdir()
    quantize.clear_stale(str(out))
    assert sorted(os.listdir(tmp_path)) == ["quantized", f"quantized.tmp-{live}"]
    assert (out / "report.json").read_text() == "new"


class _Exited(SystemExit):
    """What the fake ``os._exit`` raises (main_here reads its code)."""


def _fake_exit(monkeypatch, where):
    """``os._exit`` recording ``(code, the files in where)`` and raising ``_Exited``: where it
    is called inside a gc callback the exception is dropped, so the step that sent the
    signal raises it again (``_signal_in_gc``) as the real one would never return."""
    exits = []

    def fake(code):
        exits.append((code, sorted(os.listdir(where))))
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", fake)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: None)  # the dropped exception
    return exits


def _signal_in_gc(sig, exits):
    """``sig`` sent inside a gc callback, as to the user's quantize (JAX's
    ``_xla_gc_callback``): a KeyboardInterrupt raised there is dropped."""
    import gc

    def callback(phase, info):
        if phase == "start":
            gc.callbacks.remove(callback)
            signal.raise_signal(sig)  # its Python handler runs here, in the callback

    gc.callbacks.append(callback)
    gc.collect()
    if exits:
        raise _Exited(exits[0][0])


def _files(d):
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def test_ctrl_c_while_writing_keeps_the_old_results(quantized, tmp_path, monkeypatch, capsys):
    """The user's stop: Ctrl-C in the middle of writing the new files, landing inside a gc
    callback, stops the command at once: ``stopped (Ctrl-C): nothing written``, exit 130, the
    half-written folder gone and the old results as they were. Planted bug that fails it:
    Python's default handler (its KeyboardInterrupt is dropped there, and the command went
    on to replace them and exit 0)."""
    before = signal.getsignal(signal.SIGINT)  # (another test in this worker may have set it)
    w = tmp_path / "w"
    shutil.copytree(quantized[0], w)
    old = _files(w / "quantized")
    exits = _fake_exit(monkeypatch, w)
    export, handlers = int8.export, []

    def export_then_stop(*a, **k):  # the second of the files written
        export(*a, **k)
        handlers.extend(map(signal.getsignal, (signal.SIGINT, signal.SIGTERM)))
        _signal_in_gc(signal.SIGINT, exits)

    monkeypatch.setattr(int8, "export", export_then_stop)
    args = ["--workdir", str(w), "--overwrite", "--calibration", "max",
            "--calibration-batches", "1", "--repeats", "1", "--config.mesh=data:-1"]  # fmt: skip
    code, _, err = main_here(quantize.main, args, capsys)
    assert code == 130 and err.splitlines()[-1] == "stopped (Ctrl-C): nothing written", err
    assert exits == [(130, sorted(os.listdir(w)))] and "quantized" in exits[0][1], exits
    assert not any(".tmp-" in f for f in exits[0][1]), exits  # removed before the exit
    assert _files(w / "quantized") == old
    assert isinstance(handlers[0], signals.StopWriting) and handlers[1] is handlers[0]  # SIGTERM's
    assert signal.getsignal(signal.SIGINT) is before  # handed back


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_during_the_move_waits_for_its_end(tmp_path, monkeypatch, capsys, sig):
    """A signal between the two renames (the old results moved aside, the new not yet in)
    is acted on after the move: the new results in place, nothing beside them, and the line
    says so; exit 128 + the signal. Planted bug that fails it: the move not waited for (the
    stop leaves no ``quantized/``)."""
    out, tmp = tmp_path / "quantized", tmp_path / "quantized.tmp-1"
    for d, text in ((out, "old"), (tmp, "new")):
        d.mkdir()
        (d / "report.json").write_text(text)
    exits = _fake_exit(monkeypatch, tmp_path)
    rename = os.rename

    def stop_between(src, dst):
        if str(src) == str(tmp):
            signal.raise_signal(sig)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", stop_between)
    said = lambda: (out / "report.json").read_text() if out.exists() else "none"  # noqa: E731
    with signals.StopWriting(str(tmp), said), pytest.raises(_Exited):
        quantize.move_into_place(str(tmp), str(out))
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert capsys.readouterr().err == f"stopped ({name}): new\n"
    assert exits == [(128 + sig, ["quantized"])] and _files(out) == {"report.json": b"new"}


def test_ctrl_c_while_pruning_writes_nothing(quantized, tmp_path, monkeypatch, capsys):
    """``prune``'s run, stopped by Ctrl-C inside a gc callback while it is written: one
    line, exit 130, no ``--out`` and no half-written folder. Planted bug that fails it:
    Python's default handler (the pruned run written anyway, exit 0)."""
    from hybridpar.tools import prune

    before = signal.getsignal(signal.SIGINT)
    out = tmp_path / "p"
    exits = _fake_exit(monkeypatch, tmp_path)
    record = run_config.record_config

    def record_then_stop(*a, **k):  # the first file of the pruned run
        record(*a, **k)
        _signal_in_gc(signal.SIGINT, exits)

    monkeypatch.setattr(run_config, "record_config", record_then_stop)
    code, _, err = main_here(prune.main, ["--workdir", str(quantized[0]), "--out", str(out),
                                          "--fraction", "0.5"], capsys)  # fmt: skip
    assert code == 130 and err.splitlines()[-1] == "stopped (Ctrl-C): nothing written", err
    assert exits == [(130, [])], exits
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("method", ["max", "percentile"])
def test_each_calibration_quantizes_the_run(quantized, tmp_path, method):
    """The command's ranges over the same batches: ``max`` each tensor's largest |x|;
    ``percentile`` and ``mse`` (the default, the fixture's) from a histogram pass, within it
    and below it somewhere; the model stays accurate, and the saved steps are the ranges'."""
    w, _, default = quantized
    one = jax.devices()[:1]
    report = quantize.run(trained.load_config(str(w)), str(w), calibration_batches=4,
                          calibration=method, percentile=99.9, repeats=1,
                          latency_batches=(1,), devices=one, litert_calibrated=False,
                          out=str(tmp_path / method))  # fmt: skip
    assert report["calibration"] == method and default["calibration"] == "mse"
    ranges, mse = report["activation_ranges"], default["activation_ranges"]
    assert ranges.keys() == mse.keys()
    for k, r in ranges.items():  # the same batches: the same min and max |x|
        assert r["max_abs"] == mse[k]["max_abs"]
        assert 0 < mse[k]["clip"] <= r["max_abs"]
        assert r["clip"] == r["max_abs"] if method == "max" else 0 < r["clip"] <= r["max_abs"]
    assert any(r["clip"] < r["max_abs"] for r in mse.values()), mse
    if method != "max":
        assert any(r["clip"] < r["max_abs"] for r in ranges.values()), ranges
    assert report["top1_drop_points"] <= 5.0, report["eval"]  # a barely trained net
    with np.load(tmp_path / method / "params.npz") as f:  # the clipped steps are the saved ones
        q = int8.unflat(f)
    r = ranges["stage1_block0/conv1"]
    assert float(q["stage1_block0/conv1"]["x_step"]) == pytest.approx(r["clip"] / 255, rel=1e-6)


def test_weight_only_says_it_calibrates_nothing_and_writes_no_litert_file(quantized, tmp_path):
    """``--activations none``: no line of a calibration it does not do, nor of a LiteRT file
    it does not write. Planted bug that fails it: the lines of int8 activations
    (``calibrated (mse) on 0 batches``, ``writing the StableHLO and LiteRT files``)."""
    w, _, _ = quantized
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = quantize.run(trained.load_config(str(w)), str(w), activations="none",
                              repeats=1, latency_batches=(1,), devices=jax.devices()[:1],
                              out=str(tmp_path / "q"), litert_calibrated=False)  # fmt: skip
    lines = out.getvalue()
    assert report["activations"] == "none" and "model.tflite" not in report["files"]
    assert "calibrated (" not in lines and "LiteRT files" not in lines, lines
    assert "weight-only int8 (float activations, no calibration)" in lines, lines
    assert "then writing the StableHLO file ..." in lines, lines


def test_existing_output_needs_overwrite(quantized):
    w, _, _ = quantized
    with pytest.raises(ConfigError, match="--overwrite"):
        quantize.check_args(quantize_args(str(w)), tiny_digits(**LONGER))
    args = quantize_args(str(w))
    args.overwrite = True
    quantize.check_args(args, tiny_digits(**LONGER))  # no error: asked to replace it


def _cli(capsys, *args, config=("--config", DIGITS)):
    """The command's exit code and stderr, called in this process: each error here comes
    before any device is used, so a fresh JAX in a subprocess would add nothing."""
    code, _, err = main_here(quantize.main, [*config, *args], capsys)
    return code, err


def _assert_error(p, *words):
    code, err = p
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--activations", "none", "--calibration", "max"],
         "--calibration is not used with --activations none (weight-only int8 calibrates no "
         "activation ranges); drop it"),
        (["--activations", "none", "--calibration-batches", "4", "--percentile", "99"],
         "--calibration-batches, --percentile are not used with --activations none"),
        (["--percentile", "99.9"], "--percentile is not used with --calibration mse (the "
         "default); pass --calibration percentile with it, or drop it"),
        (["--calibration", "max", "--percentile", "99.9"],
         "--percentile is not used with --calibration max; pass --calibration percentile"),
        # the control: where the flags are used, the check lets them through
        (["--calibration", "percentile", "--percentile", "99.9"], "no workdir"),
        (["--activations", "none"], "no workdir"),
    ],
)  # fmt: skip
def test_a_flag_another_makes_moot_is_one_error_line(tmp_path, capsys, extra, says):
    """A flag the quantization would not use is refused, not silently unused."""
    w = tmp_path / "w"
    with pytest.raises(SystemExit) as e:
        quantize.main(["--config", DIGITS, "--workdir", str(w), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert says in err[0], err
    assert not w.exists()


def test_missing_checkpoint_is_an_error(quantized, tmp_path, capsys):
    w, _, _ = quantized
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    shutil.copy(w / "config.json", empty / "config.json")
    p = _cli(
        capsys,
        "--workdir",
        str(empty),
        *config_args({**TINY_DIGITS, **LONGER}),
        "--config.mesh=data:4,model:2",
    )
    _assert_error(p, "no checkpoint")
    # a run still training that has saved none yet: said so, and to wait for its first
    # (planted bug that fails it: "train it first", to a run that is training)
    from hybridpar.runtime import workdir_lock

    lock = workdir_lock.acquire(str(empty))
    try:
        p = _cli(capsys, "--workdir", str(empty), *config_args({**TINY_DIGITS, **LONGER}),
                 "--config.mesh=data:4,model:2")  # fmt: skip
    finally:
        lock.release()
    _assert_error(p, "no checkpoint in", "yet: the run in", "is still training (pid",
                  "run this command again once it has saved one")  # fmt: skip


def test_checkpoint_of_another_config_is_an_error(quantized, capsys):
    w, _, _ = quantized
    tiny = {**TINY_DIGITS, **LONGER, "model.num_filters": 16}
    p = _cli(capsys, "--workdir", str(w), *config_args(tiny), "--config.mesh=data:4,model:2")
    _assert_error(p, "another config", "num_filters")


def test_cli_without_config_takes_the_runs_config_json(quantized, capsys):
    w, _, _ = quantized
    # the run's config read back and matched: it stops only at the existing output
    _assert_error(_cli(capsys, "--workdir", str(w), config=()), "exists", "--overwrite")
    # overrides apply on top of it, and still have to agree with the run
    p = _cli(capsys, "--workdir", str(w), "--config.model.num_filters=16", config=())
    _assert_error(p, "another config", "num_filters was 8, now 16")
    _assert_error(_cli(capsys, "--workdir", str(w / "nope"), config=()), "config.json")
    _assert_error(_cli(capsys, "--workdir", str(w), "--percentile", "0", config=()),
                  "--percentile=0")


# ---- the airbench net --------------------------------------------------------------------


def test_airbench_folding_keeps_float_logits():
    """The airbench net's ``bn1`` follows a max-pool: kept as a float affine map, the folded
    network is the float one even where a BatchNorm scale is negative; folded into
    ``conv1`` before the pool (as in a ResNet) it is not."""
    from hybridpar.models.airbench import AirbenchNet

    model = AirbenchNet(num_classes=10, num_filters=8)
    params, stats = random_variables(model, 16)
    rng = np.random.default_rng(3)
    for i in (1, 2, 3):  # some negative scales: max-pool does not commute with them
        bn = params[f"block{i}_bn1"]
        bn["scale"] = bn["scale"] * rng.choice([-1.0, 1.0], bn["scale"].shape)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 16, 16, 3)), jnp.float32)
    want = np.asarray(model.apply({"params": params, "batch_stats": stats}, x, train=False))
    arch = int8.architecture(model, params)
    assert isinstance(arch, int8.AirbenchArch) and arch.blocks == 3
    layers = int8.fold_batchnorm(arch, params, stats, model.bn_epsilon)
    forward = jax.jit(lambda lay, x: int8.float_forward(arch, lay, x))
    got = np.asarray(forward(layers, x))
    tol = 1000 * EPS32 * np.abs(want).max()  # as in test_folding_keeps_float_logits
    assert np.abs(got - want).max() <= tol, (np.abs(got - want).max(), tol)
    # negative control: bn1 folded into conv1, before the max-pool
    naive = dict(layers)
    for i in (1, 2, 3):
        bn, conv = layers[f"block{i}_bn1"], layers[f"block{i}_conv1"]
        naive[f"block{i}_conv1"] = {"kernel": conv["kernel"] * bn["mul"], "bias": bn["add"]}
        naive[f"block{i}_bn1"] = {"mul": np.ones_like(bn["mul"]), "add": np.zeros_like(bn["add"])}
    assert np.abs(np.asarray(forward(naive, x)) - want).max() > 100 * tol


def test_airbench_run_quantizes(tmp_path):
    """A tiny airbench digits run (the whitening layer set from the data) quantizes: int8
    keeps nearly every image's top-1 class and the export runs."""
    w = tmp_path / "airbench"
    one = jax.devices()[:1]
    config = tiny_digits(**{**LONGER, "model.name": "airbench", "optim.frozen": "whiten/kernel"})
    summary = trainer.train(run.setup(config, str(w), devices=one))
    # without the converter's own calibration (a second LiteRT conversion): nothing here
    # reads it; test_int8_accuracy_and_size checks it
    report = quantize.run(config, str(w), calibration_batches=4, repeats=1,
                          latency_batches=(1,), devices=one, litert_calibrated=False)  # fmt: skip
    ev = report["eval"]
    assert ev["float"]["top1"] > 0.3, summary["final_eval"]  # well above chance (0.1)
    assert report["top1_agreement"] >= 0.95 and report["logit_error"] < 0.1, report
    assert abs(ev["float"]["top1"] - ev["int8"]["top1"]) <= 0.05
    served = int8.load_exported(str(w / "quantized" / "model.jax_exported"))
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 1), np.uint8)
    assert np.asarray(served(images)).shape == (2, 10)
    lite = report["litert"]  # the LiteRT file of the airbench net too (its GELUs, max / 9)
    assert os.path.exists(w / "quantized" / "model.tflite") and "model.tflite" in report["files"]
    assert lite["top1_ours"] == ev["int8"]["top1"] and lite["agreement"] >= 0.9, lite
