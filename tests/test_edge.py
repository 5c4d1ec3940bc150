"""The LiteRT full-integer int8 export (``hybridpar/tools/edge.py``) on tiny random ResNets
(basic blocks with the small stem; bottleneck blocks with the strided stem and max-pool)
and a tiny random airbench net (GELUs, max-pools, unfolded BatchNorms, the global max / 9).

* The network given to the converter is ours: without its fake quants, it is
  ``int8.float_forward`` within float32 rounding.
* The file carries our quantization: in the LiteRT interpreter, each conv's and the head's
  weight tensor holds our int8 kernel with our per-channel steps as its scales, and its
  input tensor has our activation step as its scale and ``-x_zero`` as its zero point
  (LiteRT's int8 codes are ours minus 128 after a ReLU); every conv is an int8 op.
* The file runs in the interpreter, and its logits are our int8 forward's within the
  difference one activation step at the head's input makes, plus half a logits step (the
  logits are int8 in the file, float in ours); its top-1 is ours wherever ours leads by
  more than twice that.
* Negative control: the head's weight steps planted 25% off in what is converted: both
  checks fail.
* ``measure``: the file's size, its overhead over our weights and the agreement.
* ``compact``: the converter's tensors, quantization parameters and logits to the bit, in
  fewer bytes; ``width_bytes`` is what the file holds in its convs' tensors, and
  ``predict_bytes`` (from one file, of dummy ranges) never undershoots the real file at
  other widths, at most two slacks over it (negative control: no overhead, it undershoots).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from helpers import NO_LLVM_OPT, random_variables

from hybridpar.models.airbench import AirbenchNet
from hybridpar.models.resnet import BottleneckResNetBlock, ResNet, ResNetTiny
from hybridpar.program import int8
from hybridpar.program.steps import normalize
from hybridpar.tools import edge

SIZE = 16
MEAN, STD = (120.0, 110.0, 100.0), (60.0, 64.0, 70.0)  # a different map per channel
MODELS = {
    "basic-small-stem": ResNetTiny(num_classes=10, num_filters=4),
    "bottleneck-max-pool": ResNet(stage_sizes=[1, 1], block_cls=BottleneckResNetBlock,
                                  num_classes=10, num_filters=4, small_stem=False),
    "airbench": AirbenchNet(num_classes=10, num_filters=4),
}  # fmt: skip


def _images(seed, n):
    return np.random.default_rng(seed).integers(0, 256, (n, SIZE, SIZE, 3), np.uint8)


def _variables(model):
    """Random ones for the ResNets; the airbench net's own init (random BatchNorm statistics
    wash its input out: its logits barely depend on it, and no check could see a bug),
    compiled without LLVM's optimisations as ``init_sharded`` compiles the trainer's: with
    them XLA:CPU spends an order of magnitude longer on its random initialisers, as long as
    running them op by op."""
    if not isinstance(model, AirbenchNet):
        return random_variables(model, SIZE)
    x = jnp.zeros((1, SIZE, SIZE, 3), jnp.float32)
    init = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))
    v = jax.device_get(meta.unbox(init.lower(x).compile(NO_LLVM_OPT)(x)))
    return v["params"], v["batch_stats"]


def _quantized(model):
    params, stats = _variables(model)
    arch = int8.architecture(model, params)
    layers = int8.fold_batchnorm(arch, params, stats, model.bn_epsilon)
    calibration = [_images(1, 24), _images(2, 24)]
    to_float = jax.jit(lambda im: normalize(im, MEAN, STD, np.float32))
    q = int8.quantize(layers, int8.calibrate(arch, layers, map(to_float, calibration)))
    return arch, layers, q, calibration


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request):
    arch, layers, q, calibration = _quantized(MODELS[request.param])
    ranges = edge.extra_ranges(arch, q, MEAN, STD, calibration)
    blob = edge.convert(arch, q, MEAN, STD, (SIZE, SIZE, 3), ranges)
    ours = jax.jit(int8.serving_fn(arch, q, MEAN, STD))
    return arch, layers, q, calibration, ranges, blob, ours


def _dequantized(q):
    return {k: {**p, "kernel": int8.dequantize(p["kernel"], p["w_step"], -1)} if "kernel" in p
            else p for k, p in q.items()}  # fmt: skip


def _tflite_kernel(path, q):
    """Our int8 kernel as LiteRT lays out a conv's filter (out, kh, kw, in); the head is a
    1x1 conv in the file."""
    k = q[path]["kernel"]
    return k.T[:, None, None, :] if k.ndim == 2 else k.transpose(3, 0, 1, 2)


def quantization_mismatches(blob, arch, q) -> list[str]:
    """What in the file is not our quantization, one line per difference (none: ours)."""
    it = edge.interpreter(blob)
    convs = [op for op in it._get_ops_details() if op["op_name"] == "CONV_2D"]
    wrong = []
    if len(convs) != len(int8.layer_paths(arch)):
        wrong.append(f"{len(convs)} CONV_2D ops for {len(int8.layer_paths(arch))} layers")
    for path in int8.layer_paths(arch):
        p, want = q[path], _tflite_kernel(path, q)
        w_step, x_step = p["w_step"], p["x_step"]
        if path == "head" and isinstance(arch, int8.AirbenchArch):  # its input: max / 9
            w_step, x_step = w_step / edge.AIRBENCH_SCALE, x_step * edge.AIRBENCH_SCALE
        found = [op for op in convs if it.get_tensor(op["inputs"][1]).shape == want.shape
                 and np.array_equal(it.get_tensor(op["inputs"][1]), want)]  # fmt: skip
        if len(found) != 1:
            wrong.append(f"{path}: {len(found)} weight tensors hold its int8 kernel")
            continue
        op = found[0]
        if any(t is not np.int8 for t in (*op["operand_types"][:2], *op["result_types"])):
            wrong.append(f"{path}: not int8 ({op['operand_types']} -> {op['result_types']})")
        details = {d["index"]: d for d in it.get_tensor_details()}
        w = details[op["inputs"][1]]["quantization_parameters"]
        if not np.allclose(w["scales"], w_step, rtol=1e-6, atol=0):
            wrong.append(f"{path}: weight scales {w['scales'][:3]} vs ours {w_step[:3]}")
        if w["quantized_dimension"] != 0 or np.any(w["zero_points"] != 0):
            wrong.append(f"{path}: weights not symmetric per output channel")
        x = details[op["inputs"][0]]["quantization_parameters"]
        if not (len(x["scales"]) == 1 and np.isclose(x["scales"][0], x_step, rtol=1e-6)):
            wrong.append(f"{path}: input scale {x['scales']} vs ours {x_step}")
        if list(x["zero_points"]) != [-int(p["x_zero"])]:
            wrong.append(f"{path}: input zero point {x['zero_points']} vs ours {-p['x_zero']}")
    return wrong


def logit_bound(q, ranges) -> float:
    """How far the file's logits may be from ours: the head's input one step off on every
    feature (``x_step * max_c sum_i |W[i, c]|``) plus one step of the file's int8 logits
    (their rounding, and a code of fixed-point requantization). Both sides quantize the
    same tensors with the same steps elsewhere; where they part (fixed-point
    requantization, the file's extra int8 tensors before the residual adds, the GELUs and
    the pools) the global pool averages the differences to under a step of its output."""
    head = q["head"]
    w = int8.dequantize(head["kernel"], head["w_step"], -1)
    lo, hi, narrow = ranges["logits"]
    return float(head["x_step"] * np.abs(w).sum(0).max()) + (hi - lo) / (254 if narrow else 255)


def logit_excess(blob, ours, q, ranges, images):
    """``(largest |file - ours| / logit_bound, top-1 disagreements where ours leads by more
    than twice the bound)``: within 1 and 0 pass."""
    got, want = edge.runner(blob)(images), np.asarray(ours(images))
    bound = logit_bound(q, ranges)
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound
    flips = int(((got.argmax(-1) != want.argmax(-1)) & clear).sum())
    return float(np.abs(got - want).max() / bound), flips, int(clear.sum())


def test_the_tf_network_in_float_is_our_float_forward(exported):
    """What the converter is given, without its fake quants, is ``int8.float_forward`` of
    the dequantized kernels (padding, strides, the stem's max-pool, the residual adds),
    within float32 rounding."""
    import tensorflow as tf

    arch, _, q, _, _, _, _ = exported
    deq = _dequantized(q)
    fn = edge.network(tf, arch, deq, MEAN, STD, lambda name, x: x, fake=False)
    images = _images(3, 4)
    got = np.concatenate([fn(tf.constant(im[None].astype(np.float32))).numpy() for im in images])
    want = np.asarray(int8.float_forward(arch, deq, normalize(images, MEAN, STD, np.float32)))
    # a few float32 roundings of the logits' scale (measured: about one)
    tol = 100 * np.finfo(np.float32).eps * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_the_file_carries_our_quantization(exported):
    arch, _, q, _, _, blob, _ = exported
    assert quantization_mismatches(blob, arch, q) == []
    it = edge.interpreter(blob)
    inp, out = it.get_input_details()[0], it.get_output_details()[0]
    assert inp["dtype"] is np.uint8 and tuple(inp["shape"]) == (1, SIZE, SIZE, 3)
    assert inp["quantization"] == (1.0, 0)  # pixels as they come
    assert out["dtype"] is np.float32 and tuple(out["shape"]) == (1, 10)


def test_the_files_logits_are_our_int8_forwards(exported):
    """On the calibration images themselves: no tensor of either is clipped, so what
    differs is the file's arithmetic alone (a test image beyond the calibrated logits'
    range saturates in the file, not in ours)."""
    _, _, q, calibration, ranges, blob, ours = exported
    images = np.concatenate(calibration)
    excess, flips, clear = logit_excess(blob, ours, q, ranges, images)
    assert excess <= 1.0, excess
    assert flips == 0 and clear >= 10, (flips, clear)  # enough images with a clear lead


MAX_CODES = 3  # the kernels' rounding: XNNPACK and LiteRT's reference kernels part by as much
MEAN_CODES = 0.3


def logit_codes_apart(blob, arch, q, ranges, images, points=True):
    """``(largest |file - ours|, mean)`` in codes of the file's int8 logits, ours
    ``int8_forward`` with the file's extra points (``points``) or without them."""
    ours = jax.jit(int8.serving_fn(arch, q, MEAN, STD, ranges if points else None))
    got, want = edge.runner(blob)(images), np.asarray(ours(images))
    lo, hi, narrow = ranges["logits"]
    apart = np.abs(got - want) / ((hi - lo) / (254 if narrow else 255))
    return float(apart.max()), float(apart.mean())


def test_our_int8_forward_quantizes_where_the_file_does(exported):
    """With the file's ranges, ``int8_forward`` is the file's quantized network: every
    tensor the file holds in int8 (the outputs before each residual add or GELU, the
    mean-pool's input, the logits) ours rounds and clips at the same range, and a block's
    residual adds the int8 codes its conv1 reads. What is left is the kernels' rounding, a
    few codes of the int8 logits (on the test images of the digits job the same as between
    LiteRT's own two CPU kernel sets). Negative control: without those points (the float
    tensors ours kept before), the logits are further apart than that."""
    arch, _, q, calibration, ranges, blob, _ = exported
    images = np.concatenate([*calibration, _images(5, 24)])  # beyond the ranges too
    most, mean = logit_codes_apart(blob, arch, q, ranges, images)
    # measured: at most 1-2 codes, 0.01-0.18 on average
    assert most <= MAX_CODES and mean <= MEAN_CODES, (most, mean)
    before = logit_codes_apart(blob, arch, q, ranges, images, points=False)
    assert before[1] > MEAN_CODES, before  # measured: 0.53-1.07 (at most 2.5-5)


def test_a_wrong_weight_step_is_caught(exported):
    """The negative control: the head's steps 25% larger in what is converted (its int8
    codes the same), as a converter that re-derived the scales its own way would make them."""
    arch, _, q, calibration, ranges, _, ours = exported
    path = "head"
    planted = {**q, path: {**q[path], "w_step": q[path]["w_step"] * np.float32(1.25)}}
    blob = edge.convert(arch, planted, MEAN, STD, (SIZE, SIZE, 3), ranges)
    wrong = quantization_mismatches(blob, arch, q)
    assert wrong and all(path in w for w in wrong), wrong
    excess, _, _ = logit_excess(blob, ours, q, ranges, np.concatenate(calibration))
    assert excess > 1.0, excess


def test_measure_reports_the_file(exported):
    arch, _, q, _, _, blob, ours = exported
    labels = np.asarray(ours(_images(4, 8))).argmax(-1)
    batch = {"image": _images(4, 8), "label": labels, "mask": np.ones(8, np.float32)}
    batch["mask"][-1] = 0  # padding: not counted
    weight_bytes = int8.tree_bytes(q)
    m = edge.measure(blob, [batch], ours, 10**6, weight_bytes, (SIZE, SIZE, 3), repeats=5)
    assert m["file_bytes"] == len(blob) and m["overhead_bytes"] == len(blob) - weight_bytes
    assert m["examples"] == 7 and m["top1_ours"] == 1.0  # ours' own predictions as labels
    assert m["agreement"] == m["top1"]
    assert m["latency_ms"] > 0 and 0 < m["efficiency"]
    assert m["ms_at_1tflops"] == pytest.approx(1e6 / (1e12 * m["efficiency"]) * 1e3, rel=1e-9)


def test_making_and_running_a_file_prints_nothing_unless_it_fails(exported, capfd):
    """The converter's and the runtime's C++ log lines ("Ignored output_format", the XNNPACK
    delegate) and the converter's deprecation notice reached the terminal past sys.stderr,
    several for every file quantize or a compress round made: held now, and shown only with
    the error of a block that fails."""
    arch, _, q, calibration, ranges, _, _ = exported
    capfd.readouterr()
    blob = edge.convert(arch, q, MEAN, STD, (SIZE, SIZE, 3), ranges, small=False)
    edge.runner(blob)(calibration[0][:2])
    assert capfd.readouterr() == ("", "")
    with pytest.raises(ValueError, match="planted"), edge.native_log_held():
        os.write(2, b"a native line\n")
        raise ValueError("planted")
    assert capfd.readouterr().err == "a native line\n"


def _same_tensors(a, b) -> list[str]:
    """Where two files' tensors differ in what the interpreter reads (type, shape, data,
    quantization parameters), one line per tensor (none: the same)."""
    ia, ib = edge.interpreter(a), edge.interpreter(b)
    da, db = ia.get_tensor_details(), ib.get_tensor_details()
    if len(da) != len(db):
        return [f"{len(da)} tensors vs {len(db)}"]
    wrong = []
    for x, y in zip(da, db):
        qx, qy = x["quantization_parameters"], y["quantization_parameters"]
        same = (x["dtype"] == y["dtype"] and np.array_equal(x["shape"], y["shape"])
                and all(np.array_equal(qx[k], qy[k]) for k in qx))  # fmt: skip
        if same and x["dtype"] != np.float32 and x["index"] not in _activations(ia):
            same = np.array_equal(ia.get_tensor(x["index"]), ib.get_tensor(y["index"]))
        if not same:
            wrong.append(f"tensor {x['index']} ({x['name']!r})")
    return wrong


def _activations(it) -> set:
    """The input and what the ops write: their contents are not the file's."""
    written = {int(i) for op in it._get_ops_details() for i in op["outputs"]}
    return written | {d["index"] for d in it.get_input_details()}


def test_the_compacted_file_is_the_converters_in_fewer_bytes(exported):
    """``compact``: every tensor's type, shape, constant data and quantization parameters
    as the converter wrote them, the same logits to the bit, fewer bytes; the inner tensors'
    names gone, the input's and output's kept."""
    arch, _, q, calibration, ranges, blob, _ = exported
    raw = edge.convert(arch, q, MEAN, STD, (SIZE, SIZE, 3), ranges, small=False)
    assert len(blob) < len(raw) - 1000, (len(blob), len(raw))
    assert _same_tensors(raw, blob) == []
    images = np.concatenate(calibration)
    np.testing.assert_array_equal(edge.runner(blob)(images), edge.runner(raw)(images))
    it = edge.interpreter(blob)
    names = {d["index"]: d["name"] for d in it.get_tensor_details()}
    ends = {it.get_input_details()[0]["index"], it.get_output_details()[0]["index"]}
    assert all(names[i] for i in ends) and not any(n for i, n in names.items() if i not in ends)


def test_width_bytes_are_the_files(exported):
    """What ``width_bytes`` computes from our layers is what the file holds in its int8
    convs' weight and bias tensors (the airbench net's initial BatchNorms are alike, and the
    converter stores their equal maps once: less)."""
    arch, _, q, _, _, blob, _ = exported
    want = edge.width_bytes(q, 3)
    if isinstance(arch, int8.AirbenchArch):
        assert 0 < edge.width_bytes_in(blob) <= want
    else:
        assert edge.width_bytes_in(blob) == want


WIDTHS = (1, 6)  # num_filters: one channel in every layer, and wider than the fixture's (4)


def test_predicted_bytes_never_undershoot_the_file(exported, request):
    """``predict_bytes`` from one file of the network (``dummy_ranges``, as compress makes
    it; at the fixture's width) at every width: never under the real file (calibrated
    ranges; the fixture's own file at its width), at most two ``slack`` over it. Negative
    control: the overhead left out, it undershoots."""
    model = MODELS[request.node.callspec.params["exported"]]
    arch, _, q, _, _, blob, _ = exported
    files = {model.num_filters: (arch, q, blob)}
    for width in WIDTHS:
        arch_w, _, q_w, calibration = _quantized(model.clone(num_filters=width))
        ranges = edge.extra_ranges(arch_w, q_w, MEAN, STD, calibration)
        blob_w = edge.convert(arch_w, q_w, MEAN, STD, (SIZE, SIZE, 3), ranges)
        files[width] = (arch_w, q_w, blob_w)
    size = edge.size_model(edge.convert(arch, q, MEAN, STD, (SIZE, SIZE, 3),
                                        edge.dummy_ranges(arch)))  # fmt: skip
    assert 0 < size["slack"] < size["overhead"]
    for width, (_, q_w, file) in files.items():
        over = edge.predict_bytes(q_w, 3, size) - len(file)
        assert 0 <= over <= 2 * size["slack"], (width, over, size)
        planted = {**size, "overhead": 0}  # what the weights alone would predict
        assert edge.predict_bytes(q_w, 3, planted) < len(file), width
