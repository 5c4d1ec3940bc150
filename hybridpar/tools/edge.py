"""Our int8 nets (the ResNets, the airbench net) as a LiteRT (TensorFlow Lite) full-integer
int8 flatbuffer, and what it costs where an edge runtime runs it.

    figures = export(path, arch, q, layers, mean, std, image_shape, calibration_images,
                     eval_batches, int8_model, flops, weight_bytes)   # what the tools call
    # which is:
    ranges = extra_ranges(arch, q, mean, std, calibration_images)
    blob = convert(arch, q, mean, std, image_shape, ranges)      # our steps, int8 ops
    figures = measure(blob, batches, int8_model, flops, weight_bytes, image_shape)
    blob = convert_calibrated(arch, layers, mean, std, image_shape, calibration_images)

The network is written again in TensorFlow (``network``), batch 1, with a fake-quant node
at each of our quantization points, so that the converter (its quantization-aware mode)
turns each conv and the head (a 1x1 conv) into an int8 op with OUR scales: weights per
output channel at ``w_step`` (range ``+-127 w_step``, narrow), each conv/head input at its
``x_step`` (a signed input ``+-127 x_step`` narrow, zero point 0; every post-ReLU
input ``0..255 x_step``, which is LiteRT's zero point -128: our codes, which are shifted by
-128 too). The input is uint8 pixels (scale 1), normalised by a 1x1 depthwise conv
(weights ``1/std``, bias ``-mean/std``) into the first conv's step; the logits come out
float32. Airbench's unfolded BatchNorms are 1x1 depthwise convs too, its GELUs LiteRT's.

Full-integer needs a scale on every tensor; our layers' input steps leave some out
(``_extra_points``): in a ResNet the output of each block's last conv and of its
projection (before the residual add), the last block's output (before the mean-pool); in
airbench each conv's and BatchNorm's output; and the logits. Those get ranges from the
float network on the calibration images (``extra_ranges``, ``int8.output_ranges``: the
largest ``|x|``, symmetric int8 or 0..255 after a ReLU; a GELU's input only as far as its
consumer's range). ``int8.int8_forward`` with the same ranges quantizes there too (and adds
each block's int8 input in its residual, as the file does), so the file and ours are one
quantized network; what is left between their logits is the kernels' rounding (fixed-point
or float32 requantization, the int32 biases), at most a few codes of the int8 logits, as
much as LiteRT's own XNNPACK and reference kernels differ by on the same file (``measure``
reports the agreement).

``convert_calibrated``: the float network through the converter's own calibration (a
representative dataset, its own ranges everywhere), the comparison row.

TensorFlow is imported inside the functions: only quantize and compress reach this module,
and only when they write the file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time

import numpy as np

from hybridpar.program import int8

# TensorFlow's start-up banners (CPU features, oneDNN; TF 2.21 prints the latter before it
# reads the log level) are noise around the tools' own lines; the converter runs no oneDNN
# kernel, so turning them off changes no file.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

QMAX = int8.QMAX


# ---- the network in TensorFlow -----------------------------------------------------------


input_range = int8.input_range  # a layer's input codes as ``fake_quant`` takes them


def _fq_weights(tf, kernel, step):
    """Per-output-channel fake quant at our steps (last axis), narrow: -127..127."""
    w = tf.constant(int8.dequantize(kernel, step, -1))
    hi = tf.constant(QMAX * np.asarray(step, np.float32))
    return tf.quantization.fake_quant_with_min_max_vars_per_channel(
        w, -hi, hi, num_bits=8, narrow_range=True
    )


_extra_points = int8.points  # the tensors ours keeps in float that LiteRT must quantize
AIRBENCH_SCALE = int8.AIRBENCH_SCALE  # the airbench head's input is the global max / 9


def network(tf, arch, q, mean, std, observe, fake: bool):
    """A function of float32 pixels (1, H, W, C) -> logits. ``observe(name, x)`` is called on
    each extra point (``_extra_points``) and returns the tensor to go on with; ``fake``: the
    fake-quant nodes at our points (False: the float network, for ``extra_ranges`` and the
    converter's own calibration). ``q`` holds float ``"kernel"`` arrays when not ``fake``."""

    def fq(x, lo, hi, narrow):
        if not fake:
            return x
        return tf.quantization.fake_quant_with_min_max_vars(
            x, lo, hi, num_bits=8, narrow_range=narrow
        )

    def kernel(p):
        if fake:
            return _fq_weights(tf, p["kernel"], p["w_step"])
        return tf.constant(np.asarray(p["kernel"], np.float32))

    def conv(path, x, strides, pad, relu=False):
        p = q[path]
        w = kernel(p)
        k = p["kernel"].shape[0]
        if strides == 1 and 2 * pad == k - 1:
            padding = "SAME"  # TF's SAME pads (k-1)/2 each side at stride 1, as ours
        else:
            if pad:  # the code of 0.0 (the zero point), as int8_layer pads
                x = tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
            padding = "VALID"
        y = tf.nn.conv2d(x, w, strides, padding) + tf.constant(np.asarray(p["bias"], np.float32))
        return tf.nn.relu(y) if relu else y

    def into(path, x):  # the fake quant at ``path``'s input
        return fq(x, *input_range(q[path])) if fake else x

    def affine(x, mul, add):
        """``x * mul + add`` per channel as a 1x1 depthwise conv: one int8 op, its weights
        per channel (each ``mul`` is its channel's code 127)."""
        c = x.shape[-1]
        mul = np.broadcast_to(np.asarray(mul, np.float32).reshape(-1), (c,))
        add = np.broadcast_to(np.asarray(add, np.float32).reshape(-1), (c,))
        w = tf.constant(mul.reshape(1, 1, 1, c))
        if fake:
            hi = tf.constant(np.where(mul != 0, np.abs(mul), 1.0).astype(np.float32))
            w = tf.quantization.fake_quant_with_min_max_vars_per_channel(
                w, -hi, hi, num_bits=8, narrow_range=True
            )
        w = tf.reshape(w, (1, 1, c, 1))
        return tf.nn.depthwise_conv2d(x, w, (1, 1, 1, 1), "VALID") + tf.constant(add)

    def head(x, scale=1.0):
        """The head as a 1x1 conv (per-channel weights on a MatMul make the converter
        transpose them across their quantized axis, which it refuses) of ``x * scale``,
        the scale folded into the kernel and its steps (the same int8 codes)."""
        p = {**q["head"], "kernel": q["head"]["kernel"][None, None]}
        if fake:
            p["w_step"] = p["w_step"] * np.float32(scale)
        else:
            p["kernel"] = p["kernel"] * np.float32(scale)
        bias = tf.constant(np.asarray(p["bias"], np.float32))
        logits = tf.nn.conv2d(x, kernel(p), 1, "VALID") + bias
        return observe("logits", tf.reshape(logits, (-1, logits.shape[-1])))

    std32 = np.asarray(std, np.float32).reshape(-1)
    mean32 = np.asarray(mean, np.float32).reshape(-1)

    def resnet(x):
        x = into("stem_conv", x)
        first = f"{arch.blocks[0].name}/conv1"
        if arch.small_stem:
            x = into(first, conv("stem_conv", x, 1, 1, relu=True))
        else:
            x = into(first, conv("stem_conv", x, 2, 3, relu=True))
            # after a ReLU, padding with 0 is padding with -inf
            x = tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]])
            x = tf.nn.max_pool2d(x, 3, 2, "VALID")
        for i, b in enumerate(arch.blocks):
            n, s = b.name, b.strides
            if b.bottleneck:
                y = into(f"{n}/conv2", conv(f"{n}/conv1", x, 1, 0, relu=True))
                y = into(f"{n}/conv3", conv(f"{n}/conv2", y, s, 1, relu=True))
                y = observe(f"{n}/conv3:out", conv(f"{n}/conv3", y, 1, 0))
            else:
                y = into(f"{n}/conv2", conv(f"{n}/conv1", x, s, 1, relu=True))
                y = observe(f"{n}/conv2:out", conv(f"{n}/conv2", y, 1, 1))
            r = observe(f"{n}/proj_conv:out", conv(f"{n}/proj_conv", x, s, 0)) if b.projects else x
            x = tf.nn.relu(r + y)
            if i + 1 < len(arch.blocks):
                x = into(f"{arch.blocks[i + 1].name}/conv1", x)
            else:
                x = observe("pre_pool", x)
        return head(into("head", tf.reduce_mean(x, axis=(1, 2), keepdims=True)))

    def airbench(x):
        def gelu(x):
            return tf.nn.gelu(x, approximate=False)

        x = into("whiten", x)
        x = gelu(observe("whiten:out", conv("whiten", x, 1, 0)))
        for i in range(1, arch.blocks + 1):
            b = f"block{i}"
            y = observe(f"{b}_conv1:out", conv(f"{b}_conv1", into(f"{b}_conv1", x), 1, 1))
            y = tf.nn.max_pool2d(y, 2, 2, "VALID")
            y = observe(f"{b}_bn1:out", affine(y, q[f"{b}_bn1"]["mul"], q[f"{b}_bn1"]["add"]))
            x = into(f"{b}_conv2", gelu(y))
            x = gelu(observe(f"{b}_conv2:out", conv(f"{b}_conv2", x, 1, 1)))
        # The last block's output at 9 times the head's step: rounding is monotonic, so the
        # max of its codes is the code of max / 9 at the head's step, as ours (no extra
        # point); the 1/9 goes into the head's kernel and steps.
        if fake:
            lo, hi, narrow = input_range(q["head"])
            x = fq(x, AIRBENCH_SCALE * lo, AIRBENCH_SCALE * hi, narrow)
        return head(tf.reduce_max(x, axis=(1, 2), keepdims=True), 1 / AIRBENCH_SCALE)

    def fn(images):
        x = fq(images, 0.0, 255.0, False)  # uint8 pixels: scale 1
        x = affine(x, 1 / std32, -mean32 / std32)  # normalised, into the first conv's step
        return airbench(x) if isinstance(arch, int8.AirbenchArch) else resnet(x)

    return fn


def check_shared_steps(arch, q) -> None:
    """A projection reads the same tensor as its block's first conv: LiteRT holds one scale
    per tensor, so their input steps must be one (calibrated on the same tensor, they are)."""
    for b in getattr(arch, "blocks", ()) if isinstance(arch, int8.Arch) else ():
        if b.projects:
            a, p = q[f"{b.name}/conv1"], q[f"{b.name}/proj_conv"]
            if not np.isclose(float(a["x_step"]), float(p["x_step"]), rtol=1e-6):
                raise ValueError(f"{b.name}: conv1 and proj_conv inputs have different steps")


def extra_ranges(arch, q, mean, std, image_batches) -> dict:
    """``int8.output_ranges`` over ``image_batches`` (uint8): the file's and our int8
    forward's ranges of the extra points (``_extra_points``) are one."""
    from hybridpar.program.steps import normalize

    return int8.output_ranges(
        arch, q, (normalize(np.asarray(x), mean, std, np.float32) for x in image_batches)
    )


@contextlib.contextmanager
def native_log_held():
    """The converter's and the runtime's own log lines, held: TensorFlow Lite's C++ code
    writes them to file descriptor 2, past Python's ``sys.stderr`` ("Ignored
    output_format", "Created TensorFlow Lite XNNPACK delegate", a deprecation notice), several
    for every file made or run. They are shown only if the block raises, before the error."""
    sys.stderr.flush()
    saved, failed = os.dup(2), True
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))


def _convert(tf, fn, image_shape, representative=None, small: bool = True) -> bytes:
    """The converter's flatbuffer of ``fn``, through ``compact`` when ``small``."""
    spec = tf.TensorSpec((1, *image_shape), tf.float32)
    concrete = tf.function(fn, input_signature=[spec]).get_concrete_function()
    with native_log_held():  # (from_concrete_functions logs a deprecation notice)
        converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete])
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        # the converter's version and options as a metadata entry: nothing a runtime reads
        converter.exclude_conversion_metadata = small
        converter.inference_input_type = tf.uint8  # camera pixels as they come
        if representative is not None:
            converter.representative_dataset = representative
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        # else the fake quants make every tensor int8; TFLITE_BUILTINS_INT8 would ask for a
        # representative dataset (TF 2.21 checks for one before it sees the fake quants)
        blob = converter.convert()
    return compact(blob) if small else blob


# ---- the file's size ---------------------------------------------------------------------


def _builder(size: int):
    import flatbuffers

    class Builder(flatbuffers.Builder):
        """Writes each all-zero int64 vector of a length of 2 or more once (the zero points
        of the per-channel weight and bias tensors, symmetric, so all 0: one vector per
        channel count, each tensor's offset pointing at it) and every byte vector (a buffer's data)
        16-aligned, as the schema's ``force_align: 16`` asks (the object API's numpy path
        aligns it to 1)."""

        def __init__(self, size):
            super().__init__(size)
            self.zeros = {}

        def CreateNumpyVector(self, x):
            shared = x.dtype == np.int64 and x.size >= 2 and not x.any()
            if shared and x.size in self.zeros:
                return self.zeros[x.size]
            if x.dtype == np.uint8:
                self.StartVector(1, x.size, 16)
                self.head -= x.size
                self.Bytes[self.head : self.head + x.size] = x.tobytes()
                self.vectorNumElems = x.size
                offset = self.EndVector()
            else:
                offset = super().CreateNumpyVector(x)
            if shared:
                self.zeros[x.size] = offset
            return offset

    return Builder(size)


def _zero_points(lengths) -> int:
    """The bytes of the zero-point vectors of per-channel tensors of these channel counts:
    one shared vector per count of 2 or more, one of its own for each of 1 (the builder
    shares no vector of length 1: activations' zero points are those, and which of them are
    0 depends on the calibration), each 8 bytes an entry and a 4-byte length."""
    lengths = [int(n) for n in lengths]
    return sum(8 * n + 4 for n in {n for n in lengths if n >= 2}) + 12 * lengths.count(1)


def width_bytes(q, channels: int) -> int:
    """The bytes of ``q``'s file that depend on its layers' widths: each int8 op's (every
    conv, the head, airbench's BatchNorms and the input's normalisation over the image's
    ``channels``) int8 weights, int32 biases, the float32 scales of both (one per output
    channel each) and their zero points (``_zero_points``). The rest of the file
    (``size_model``'s overhead) is the same at every width but for alignment."""
    total, lengths = 13 * channels, [channels, channels]  # the normalisation
    for p in q.values():
        if "kernel" in p:
            size, out = np.size(p["kernel"]), np.shape(p["kernel"])[-1]
        elif "mul" in p:  # a per-channel affine map: a 1x1 depthwise conv
            size = out = np.size(p["mul"])
        else:
            continue
        total += size + 3 * 4 * out
        lengths += [out, out]
    return int(total + _zero_points(lengths))


def _parse(blob: bytes):
    from tensorflow.lite.python import schema_py_generated as schema

    return schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(blob, 0))


def width_bytes_in(blob: bytes) -> int:
    """``width_bytes`` as the file has them: its int8 convs' weight and bias tensors, each
    counted once (the converter may give two ops one constant)."""
    from tensorflow.lite.python import schema_py_generated as schema

    model = _parse(blob)
    convs = {schema.BuiltinOperator.CONV_2D, schema.BuiltinOperator.DEPTHWISE_CONV_2D}
    total, lengths = 0, []
    for g in model.subgraphs:
        tensors = set()
        for op in g.operators:
            if model.operatorCodes[op.opcodeIndex].builtinCode in convs:
                tensors.update(int(i) for i in op.inputs[1:3] if i >= 0)
        for i in sorted(tensors):
            t = g.tensors[i]
            data = model.buffers[t.buffer].data
            scales = t.quantization.scale
            total += (0 if data is None else len(data)) + 4 * len(scales)
            lengths.append(len(scales))
    return int(total + _zero_points(lengths))


def size_model(blob: bytes) -> dict:
    """What a file of this network's architecture weighs at other widths, from this one
    (``compact``'s): ``overhead``, its bytes beyond ``width_bytes`` (which no width
    changes), and ``slack``, the most the alignment padding can add at another width: up to
    15 bytes before each 16-aligned buffer and the root, 4 before each int64 vector (every
    other item keeps the 4-byte alignment it starts at). ``predict_bytes``: at most
    ``len(file) + 2 * slack``, never under it."""
    model = _parse(blob)
    buffers = sum(1 for b in model.buffers if b.data is not None and len(b.data))
    quantized = [t.quantization for g in model.subgraphs for t in g.tensors]
    vectors = sum(1 for x in quantized if x is not None and x.zeroPoint is not None)
    slack = 15 * (buffers + 1) + 4 * vectors
    return {"overhead": len(blob) - width_bytes_in(blob), "slack": slack}


def predict_bytes(q, channels: int, model: dict) -> int:
    """The most ``q``'s file can weigh (``size_model``'s ``model``, of the same network at
    any width)."""
    return width_bytes(q, channels) + model["overhead"] + model["slack"]


def dummy_ranges(arch) -> dict:
    """``extra_ranges``' keys with a range each: a file of the right size without images
    (the ranges change values in it, not its size)."""
    return {name: (-1.0, 1.0, True) for name in _extra_points(arch)}


def compact(blob: bytes) -> bytes:
    """The same model in fewer bytes (the interpreter computes the same, and reads the same
    quantization parameters, on every tensor): the converter's names of the inner tensors
    dropped (the graph's input and output keep theirs), every tensor without data pointing
    at buffer 0 (the schema's empty buffer) instead of an empty buffer of its own, and the
    zero-point vectors shared (``_builder``). The int64 zero points and the bias tensors'
    scales stay: the schema has no narrower zero point, the interpreter reads one per scale,
    and its XNNPACK delegate checks each bias's scales (a file without them runs off it,
    slower and with other logits)."""
    model = _parse(blob)
    for g in model.subgraphs:
        ends = {*np.ravel(g.inputs), *np.ravel(g.outputs)}
        for i, t in enumerate(g.tensors):
            if i not in ends:
                t.name = None

    def empty(b):
        return (b.data is None or len(b.data) == 0) and not b.offset

    if model.buffers and empty(model.buffers[0]):
        buffers, index = [model.buffers[0]], {}

        def moved(i):
            if empty(model.buffers[i]):
                return 0
            if i not in index:
                index[i] = len(buffers)
                buffers.append(model.buffers[i])
            return index[i]

        for g in model.subgraphs:
            for t in g.tensors:
                t.buffer = moved(t.buffer)
        for m in model.metadata or []:
            m.buffer = moved(m.buffer)
        if model.metadataBuffer is not None:
            model.metadataBuffer = [moved(i) for i in model.metadataBuffer]
        model.buffers = buffers
    builder = _builder(len(blob) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def convert(arch, q, mean, std, image_shape, ranges: dict, small: bool = True) -> bytes:
    """The LiteRT flatbuffer of the quantized network ``q`` (``int8.quantize``'s, with
    activation steps), at our steps; ``ranges``: ``extra_ranges``'. uint8 images (1, H, W,
    C) in, float32 logits out, int8 ops between. ``small``: through ``compact`` (False: as
    the converter writes it)."""
    import tensorflow as tf

    if any("kernel" in p and "x_step" not in p for p in q.values()):
        raise ValueError("the LiteRT export needs int8 activations (--activations int8)")
    check_shared_steps(arch, q)

    def observe(name, x):
        return tf.quantization.fake_quant_with_min_max_vars(
            x, *ranges[name][:2], num_bits=8, narrow_range=ranges[name][2]
        )

    fn = network(tf, arch, q, mean, std, observe, fake=True)
    return _convert(tf, fn, image_shape, small=small)


def convert_calibrated(arch, layers, mean, std, image_shape, image_batches) -> bytes:
    """The folded float network (``layers``) through the converter's own full-integer
    calibration on ``image_batches`` (uint8): its ranges and weight scales, not ours."""
    import tensorflow as tf

    fn = network(tf, arch, layers, mean, std, lambda name, x: x, fake=False)

    def representative():
        for images in image_batches:
            for image in np.asarray(images, np.float32):
                yield [image[None]]

    return _convert(tf, fn, image_shape, representative)


# ---- running it --------------------------------------------------------------------------


def interpreter(blob: bytes, num_threads: int = 1):
    """The LiteRT interpreter on ``blob``, tensors allocated."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:  # TensorFlow's own copy of the same runtime
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    with native_log_held():
        it = Interpreter(model_content=blob, num_threads=num_threads)
        it.allocate_tensors()
    return it


def runner(blob: bytes, num_threads: int = 1):
    """``run(images uint8 (n, H, W, C)) -> float32 logits (n, classes)``, one image per
    call of the interpreter (the file's batch is 1)."""
    it = interpreter(blob, num_threads)
    inp, out = it.get_input_details()[0], it.get_output_details()[0]

    def run(images):
        images = np.asarray(images)
        logits = []
        for image in images:
            it.set_tensor(inp["index"], image[None].astype(inp["dtype"]))
            it.invoke()
            logits.append(np.array(it.get_tensor(out["index"])[0], np.float32))
        return np.stack(logits)

    return run


def latency_ms(blob: bytes, image_shape, repeats: int = 200, warmup: int = 20) -> float:
    """Median ms of one invoke at batch 1 on one thread, after ``warmup`` invokes."""
    it = interpreter(blob, num_threads=1)
    inp = it.get_input_details()[0]
    x = np.random.default_rng(0).integers(0, 256, (1, *image_shape)).astype(inp["dtype"])
    it.set_tensor(inp["index"], x)
    for _ in range(warmup):
        it.invoke()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        it.invoke()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


MATMUL = (64, 1024, 1024)  # (m, k, n): a dense int8 product large enough to reach the kernels' rate


@functools.cache
def matmul_flops_per_s(repeats: int = 30) -> float:
    """This CPU's one-thread rate on an int8 ``(m, k) x (k, n)`` product in the same runtime
    and op as the model's convs (a 1x1 CONV_2D over ``m`` pixels; 2 m k n FLOPs per invoke,
    median of ``repeats``): what the runtime's kernels reach on a dense product, the
    reference of ``measure``'s efficiency."""
    import tensorflow as tf

    m, k, n = MATMUL
    side = int(round(m**0.5))
    w = np.random.default_rng(0).uniform(-1, 1, (1, 1, k, n)).astype(np.float32)
    codes, step = int8.quantize_per_channel(w, -1)

    def fn(x):
        x = tf.quantization.fake_quant_with_min_max_vars(x, 0.0, 255.0)
        y = tf.nn.conv2d(x, _fq_weights(tf, codes, step), 1, "VALID")
        return tf.quantization.fake_quant_with_min_max_vars(y, -1e4, 1e4, narrow_range=True)

    blob = _convert(tf, fn, (side, side, k))
    ms = latency_ms(blob, (side, side, k), repeats=repeats, warmup=5)
    return 2 * side * side * k * n / (ms * 1e-3)


def measure(blob: bytes, batches, ours, flops: int, weight_bytes: int, image_shape,
            repeats: int = 200) -> dict:  # fmt: skip
    """The file in the LiteRT interpreter against our int8 forward: ``batches`` (dicts of
    uint8 ``image``, ``label``, ``mask``, as ``compare`` takes them), ``ours`` (images ->
    logits), ``flops`` per image (float count, a multiply-add is 2), ``weight_bytes`` (our
    int8 weights, steps and biases)."""
    run = runner(blob)
    count = hits = hits_ours = same = gap = 0.0
    for b in batches:
        mask = np.asarray(b["mask"], np.float64)
        label = np.asarray(b["label"])
        keep = mask > 0
        images = np.asarray(b["image"])
        got = run(images[keep])
        want = np.asarray(ours(images))[keep]
        gap = max(gap, float(np.abs(got - want).max(initial=0.0)))
        got, want = got.argmax(-1), want.argmax(-1)
        hits += float((got == label[keep]).sum())
        hits_ours += float((want == label[keep]).sum())
        same += float((got == want).sum())
        count += float(keep.sum())
    ms = latency_ms(blob, image_shape, repeats)
    rate = flops / (ms * 1e-3)  # this model's measured FLOP/s on one thread
    # Efficiency: the model's rate over the same runtime's one-thread rate on a large dense
    # int8 product, the best its kernels do on this CPU (a spec sheet's peak is unknown in
    # a VM and no int8 kernel reaches it). A 1 TFLOPS device at the same fraction of its
    # peak takes flops / (1e12 * efficiency) per image; latency * (CPU rate / 1e12) would
    # credit the device with this CPU's overheads scaled down with its speed.
    peak = matmul_flops_per_s()
    efficiency = rate / peak
    return {
        "file_bytes": len(blob),
        "file_kb": round(len(blob) / 1000, 1),
        "overhead_bytes": len(blob) - int(weight_bytes),
        "top1": hits / count,
        "top1_ours": hits_ours / count,
        "agreement": same / count,
        "logit_gap": gap,  # the largest |file - ours| of any logit
        "examples": int(count),
        "latency_ms": round(ms, 4),
        "latency_repeats": repeats,
        "flops_per_image": int(flops),
        "flops_per_s": rate,
        "matmul_flops_per_s": peak,
        "efficiency": efficiency,
        "ms_at_1tflops": flops / (1e12 * efficiency) * 1e3,
    }


def export(path: str, arch, q, layers, mean, std, image_shape, calibration_images, batches,
           ours, flops: int, weight_bytes: int, calibrated: bool = True,
           repeats: int = 200, ranges: dict | None = None) -> dict:  # fmt: skip
    """Writes the LiteRT file of ``q`` at our steps to ``path`` and returns ``measure``'s
    figures, with (``calibrated``) the converter's own calibration's beside them under
    ``"calibrated"`` (file size, top-1, agreement with ours, latency; its file is not kept).
    ``batches()``: a fresh iterator of the eval batches; ``calibration_images``: the uint8
    batches ``q``'s activation steps were calibrated on; ``ranges``: the extra points'
    (``int8.output_ranges``', those ``ours`` quantizes at), else computed from them. Float
    activations (weight-only int8) have no full-integer file: then nothing is written and
    it returns ``{"skipped": why}``."""
    if any("kernel" in p and "x_step" not in p for p in q.values()):
        return {"skipped": "full-integer LiteRT needs int8 activations (--activations int8)"}
    calibration_images = [np.asarray(x) for x in calibration_images]
    t0 = time.time()
    if ranges is None:
        ranges = extra_ranges(arch, q, mean, std, calibration_images)
    blob = convert(arch, q, mean, std, image_shape, ranges)
    convert_s = time.time() - t0
    with open(path, "wb") as f:
        f.write(blob)
    figures = measure(blob, batches(), ours, flops, weight_bytes, image_shape, repeats)
    figures["convert_s"] = round(convert_s, 2)
    if calibrated:
        other = convert_calibrated(arch, layers, mean, std, image_shape, calibration_images)
        m = measure(other, batches(), ours, flops, weight_bytes, image_shape, repeats)
        figures["calibrated"] = {k: m[k] for k in ("file_kb", "top1", "agreement", "latency_ms")}
    return figures


def summary(figures: dict) -> str:
    """One line of ``export``'s figures for the tools' logs."""
    if "skipped" in figures:
        return f"LiteRT: not written ({figures['skipped']})"
    f = figures
    line = (
        f"LiteRT int8 model.tflite: {f['file_kb']:.1f} KB ({f['overhead_bytes']} bytes over "
        f"the int8 weights); top-1 {f['top1']:.4f} (our int8 {f['top1_ours']:.4f}, agreement "
        f"{f['agreement']:.4f}, logits at most {f['logit_gap']:.3f} apart); "
        f"{f['latency_ms']:.3f} ms/image at batch 1 on one thread "
        f"({f['flops_per_image'] / 1e6:.2f} MFLOPs, {f['efficiency']:.3f} of this CPU's int8 "
        f"matmul rate): ~{f['ms_at_1tflops']:.4f} ms on a 1 TFLOPS device"
    )
    if "calibrated" in f:
        c = f["calibrated"]
        line += (f"; the converter's own calibration: {c['file_kb']:.1f} KB, top-1 "
                 f"{c['top1']:.4f}, agreement {c['agreement']:.4f}")  # fmt: skip
    return line
