"""Int8 post-training quantization of our ResNets, and its export for serving.

    arch = architecture(model, params)            # the blocks, from the model and its params
    layers = fold_batchnorm(arch, params, batch_stats, epsilon)   # float, BN folded in
    scales = calibrate(arch, layers, images)      # |input| range of every conv/dense, K batches
    q = quantize(layers, scales)                  # int8 kernels, per-channel + static scales
    logits = int8_forward(arch, q, images)        # int8 x int8 -> int32, rescaled to float
    export(arch, q, mean, std, image_shape, path); run = load_exported(path)

The network is written out here as plain functions of a flat ``{"stage1_block0/conv1":
{"kernel", "bias"}, ...}`` tree rather than through qwix (docs/compression.md says
why): BatchNorm in inference mode is a per-channel affine map after each
convolution, so it folds into that convolution's kernel (``W * s``) and a bias (``beta -
mean * s``), with ``s = gamma / sqrt(var + eps)``; what is left between the convolutions is
ReLU, the residual add, max-pooling and the mean-pool. Given ``output_ranges``,
``int8_forward`` also rounds every tensor a full-integer file holds in int8 (``points``:
the outputs before each residual add, the mean-pool's input, the logits) and adds each
block's int8 input in its residual, as the LiteRT file does (``hybridpar.tools.edge``);
without them those stay float32.

Quantization (symmetric, no zero points, as torchvision's and TFLite's int8 convs):

* weights: per output channel, ``step = max |W[..., c]| / 127``, ``q = round(W / step)``;
* activations: per tensor at the input of each conv and of the head, a static step from
  a range over the calibration batches (``calibrate``: their largest ``|x|``, a percentile
  of it, or the range of least squared error): ``range / 127`` for the stem's signed
  input; ``range / 255`` for every input after a ReLU (never below zero),
  stored as ``code - 128`` with ``x_zero = 128`` (torchvision's quint8 activations, in
  int8). Each layer runs ``int8 x int8 -> int32`` (``preferred_element_type``), adds back
  ``x_zero * sum(kernel)`` and rescales by ``x_step * w_step[c]`` before the folded bias.

``activations="none"`` keeps activations float (weights int8, dequantized in the layer): the
weight-only variant, to tell the two sources of error apart.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hybridpar.config.errors import ConfigError

QMAX = 127  # symmetric int8: -127..127 (-128 unused, so negation never overflows)
DIMS = ("NHWC", "HWIO", "NHWC")
# conv name -> the BatchNorm after it (models/resnet.py's names)
BN_OF = {
    "stem_conv": "stem_bn",
    "conv1": "bn1",
    "conv2": "bn2",
    "conv3": "bn3",
    "proj_conv": "proj_bn",
}


@dataclasses.dataclass(frozen=True)
class Block:
    name: str
    bottleneck: bool
    strides: int
    projects: bool


@dataclasses.dataclass(frozen=True)
class Arch:
    """What the forward pass needs besides the arrays: the stem and the blocks in order."""

    small_stem: bool
    blocks: tuple[Block, ...]


@dataclasses.dataclass(frozen=True)
class AirbenchArch:
    """models/airbench.py's net: the whitening conv, then ``blocks`` groups of
    ``conv1 -> max-pool -> bn1 -> GELU -> conv2 -> bn2 -> GELU``."""

    blocks: int


def architecture(model, params) -> Arch | AirbenchArch:
    """The blocks of a ``models.resnet.ResNet`` (or the airbench net) and its (unboxed)
    params."""
    from hybridpar.models.airbench import AirbenchNet
    from hybridpar.models.resnet import BottleneckResNetBlock, ResNet, ResNetBlock

    if isinstance(model, AirbenchNet):
        return AirbenchArch(
            sum(1 for k in params if k.startswith("block") and k.endswith("_conv1"))
        )
    if not isinstance(model, ResNet) or model.block_cls not in (
        ResNetBlock,
        BottleneckResNetBlock,
    ):
        raise ConfigError(
            f"quantize handles the ResNets of models/resnet.py and the airbench net, not "
            f"{type(model).__name__}"
        )
    blocks = []
    for i, n in enumerate(model.stage_sizes, start=1):
        for j in range(n):
            name = f"stage{i}_block{j}"
            blocks.append(
                Block(
                    name,
                    model.block_cls is BottleneckResNetBlock,
                    2 if i > 1 and j == 0 else 1,
                    "proj_conv" in params[name],
                )
            )
    return Arch(bool(model.small_stem), tuple(blocks))


def _bn_affine(p, s, epsilon):
    """A BatchNorm in inference mode as ``x * mul + add`` per channel."""
    gamma, beta = (np.asarray(p[k], np.float32) for k in ("scale", "bias"))
    mean, var = (np.asarray(s[k], np.float32) for k in ("mean", "var"))
    mul = gamma / np.sqrt(var + np.float32(epsilon))
    return mul, beta - mean * mul


def _fold_airbench(arch: AirbenchArch, params, batch_stats, epsilon: float) -> dict:
    """The whitening conv and the head as they are; each ``bn2`` folded into ``conv2``;
    each ``bn1`` comes after a max-pool, which a negative scale does not commute with, so it
    stays a float affine map of its own (``{"mul", "add"}``) and ``conv1`` gets a zero bias."""
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    layers = {k: {"kernel": f32(params[k]["kernel"]), "bias": f32(params[k]["bias"])}
              for k in ("whiten", "head")}  # fmt: skip
    for i in range(1, arch.blocks + 1):
        b = f"block{i}"
        w1 = f32(params[f"{b}_conv1"]["kernel"])
        layers[f"{b}_conv1"] = {"kernel": w1, "bias": np.zeros(w1.shape[-1], np.float32)}
        mul, add = _bn_affine(params[f"{b}_bn1"], batch_stats[f"{b}_bn1"], epsilon)
        layers[f"{b}_bn1"] = {"mul": mul, "add": add}
        mul, add = _bn_affine(params[f"{b}_bn2"], batch_stats[f"{b}_bn2"], epsilon)
        layers[f"{b}_conv2"] = {"kernel": f32(params[f"{b}_conv2"]["kernel"]) * mul, "bias": add}
    return layers


def fold_batchnorm(arch: Arch, params, batch_stats, epsilon: float) -> dict:
    """``{layer path: {"kernel", "bias"}}`` (float32) with each BatchNorm's running
    statistics, scale and bias folded into the convolution before it; the head as it is."""
    if isinstance(arch, AirbenchArch):
        return _fold_airbench(arch, params, batch_stats, epsilon)
    layers = {}
    for path in layer_paths(arch)[:-1]:
        *parent, conv = path.split("/")
        p = params[parent[0]] if parent else params
        s = batch_stats[parent[0]] if parent else batch_stats
        bn = BN_OF[conv]
        mul, add = _bn_affine(p[bn], s[bn], epsilon)
        layers[path] = {"kernel": np.asarray(p[conv]["kernel"], np.float32) * mul, "bias": add}
    head = params["head"]
    layers["head"] = {
        "kernel": np.asarray(head["kernel"], np.float32),
        "bias": np.asarray(head["bias"], np.float32),
    }
    return layers


def layer_paths(arch: Arch) -> list[str]:
    """Every conv and the head, in the order the forward pass runs them."""
    if isinstance(arch, AirbenchArch):
        convs = [f"block{i}_conv{j}" for i in range(1, arch.blocks + 1) for j in (1, 2)]
        return ["whiten", *convs, "head"]
    out = ["stem_conv"]
    for b in arch.blocks:
        convs = ("conv1", "conv2", "conv3") if b.bottleneck else ("conv1", "conv2")
        out += [f"{b.name}/{c}" for c in convs] + ([f"{b.name}/proj_conv"] if b.projects else [])
    return out + ["head"]


def _same(name, x):
    return x


def forward(arch: Arch, layer, x, point=_same):
    """The ResNet of ``models/resnet.py`` in inference mode, BatchNorm folded;
    ``layer(path, x, strides, pad)`` computes one conv (4-d ``x``) or the head (2-d);
    ``point(name, x)`` sees each tensor of ``points(arch)`` (and returns what goes on)."""
    if isinstance(arch, AirbenchArch):
        return _forward_airbench(arch, layer, x, point)
    relu = jax.nn.relu
    if arch.small_stem:
        x = relu(layer("stem_conv", x, 1, 1))
    else:
        x = relu(layer("stem_conv", x, 2, 3))
        x = lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
        )
    for b in arch.blocks:
        n, s = b.name, b.strides
        x = point(f"{n}/in", x)
        if b.bottleneck:
            y = relu(layer(f"{n}/conv1", x, 1, 0))
            y = relu(layer(f"{n}/conv2", y, s, 1))
            y = point(f"{n}/conv3:out", layer(f"{n}/conv3", y, 1, 0))
        else:
            y = relu(layer(f"{n}/conv1", x, s, 1))
            y = point(f"{n}/conv2:out", layer(f"{n}/conv2", y, 1, 1))
        r = point(f"{n}/proj_conv:out", layer(f"{n}/proj_conv", x, s, 0)) if b.projects else x
        x = relu(r + y)
    x = point("pre_pool", x)
    return point("logits", layer("head", jnp.mean(x, axis=(1, 2)), 1, 0))


AIRBENCH_SCALE = 9.0  # the airbench head's input is the global max / 9


def _forward_airbench(arch: AirbenchArch, layer, x, point=_same):
    """models/airbench.py's net in inference mode; ``layer`` also applies the unfolded
    ``bn1`` affine maps (``_apply``)."""
    gelu = functools.partial(jax.nn.gelu, approximate=False)
    x = gelu(point("whiten:out", layer("whiten", x, 1, 0)))
    for i in range(1, arch.blocks + 1):
        b = f"block{i}"
        y = point(f"{b}_conv1:out", layer(f"{b}_conv1", x, 1, 1))
        y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        x = gelu(point(f"{b}_bn1:out", layer(f"{b}_bn1", y, 1, 0)))
        x = gelu(point(f"{b}_conv2:out", layer(f"{b}_conv2", x, 1, 1)))
    return point("logits", layer("head", jnp.max(x, axis=(1, 2)) / AIRBENCH_SCALE, 1, 0))


def points(arch) -> list[str]:
    """The tensors a full-integer int8 file holds in int8 that the layers' own input steps
    do not cover (``output_ranges`` gives each its range): in a ResNet each block's last
    conv and projection outputs (before the residual add), the last block's output (before
    the mean-pool); in the airbench net each conv's output (before its max-pool or GELU)
    and each ``bn1``'s; then the logits. (A block's input, ``"{block}/in"``, is the int8
    tensor its conv1 reads: its residual adds those codes too, at conv1's own step.)"""
    out = []
    if isinstance(arch, AirbenchArch):
        out.append("whiten:out")
        for i in range(1, arch.blocks + 1):
            out += [f"block{i}_conv1:out", f"block{i}_bn1:out", f"block{i}_conv2:out"]
        return out + ["logits"]
    for b in arch.blocks:
        out.append(f"{b.name}/{'conv3' if b.bottleneck else 'conv2'}:out")
        if b.projects:
            out.append(f"{b.name}/proj_conv:out")
    return out + ["pre_pool", "logits"]


GELU_FLOOR = -4.0  # |GELU(x)| < 1.3e-4 below it


def gelu_inputs(arch) -> dict:
    """``{point before a GELU: (the layer that reads the GELU's output, its scale)}``
    (airbench; the last block's output reaches the head through the max / 9)."""
    if not isinstance(arch, AirbenchArch):
        return {}
    n = arch.blocks
    out = {"whiten:out": ("block1_conv1", 1.0)}
    for i in range(1, n + 1):
        out[f"block{i}_bn1:out"] = (f"block{i}_conv2", 1.0)
        last = ("head", AIRBENCH_SCALE)
        out[f"block{i}_conv2:out"] = (f"block{i + 1}_conv1", 1.0) if i < n else last
    return out


def input_range(p: dict) -> tuple[float, float, bool]:
    """``(min, max, narrow_range)`` of a layer's input codes as a fake quant takes them."""
    step, zero = float(p["x_step"]), int(p["x_zero"])
    if zero:
        return 0.0, 255 * step, False  # post-ReLU: codes 0..255 (LiteRT's zero point -128)
    return -QMAX * step, QMAX * step, True


def output_ranges(arch, q: dict, batches) -> dict:
    """``{point: (min, max, narrow)}`` of each of ``points(arch)``: the largest ``|x|`` of
    the float network of ``q``'s dequantized kernels over ``batches`` (normalised float
    images), symmetric int8 (``narrow``) or ``0..max`` (255 steps) where never below zero.
    A GELU's input only as far as its consumer clips: up to the consumer's range (GELU(x) ~ x
    above it) and down to ``GELU_FLOOR`` (GELU(x) ~ 0 below it)."""
    deq = {k: {**p, "kernel": dequantize(p["kernel"], p["w_step"], -1)} if "kernel" in p
           else p for k, p in q.items()}  # fmt: skip

    def seen_in(lay, x):
        seen = {}

        def point(name, h):
            if not name.endswith("/in"):
                seen[name] = (jnp.min(h), jnp.max(jnp.abs(h)))
            return h

        forward(arch, lambda path, h, s, pad: _apply(lay[path], h, s, pad, _float_layer), x,
                point)  # fmt: skip
        return seen

    fn = jax.jit(seen_in)
    seen = {}
    for x in batches:
        for k, (lo, hi) in jax.device_get(fn(deq, x)).items():
            a, b = seen.get(k, (0.0, 0.0))
            seen[k] = (min(a, float(lo)), max(b, float(hi)))
    out = {}
    for name in points(arch):
        lo, hi = seen[name]
        hi = hi if hi > 0 else 1.0
        out[name] = (0.0, hi, False) if lo >= 0 else (-hi, hi, True)
    for name, (consumer, scale) in gelu_inputs(arch).items():
        lo, hi = seen[name]
        top = scale * input_range(q[consumer])[1]
        out[name] = (max(lo, GELU_FLOOR), max(min(hi, top), 1e-6), False)
    return out


def fake_quant(x, lo, hi, narrow):
    """``x`` through TensorFlow's ``fake_quant_with_min_max_vars`` (8 bits): the range
    nudged so that 0.0 is a code, clipped, rounded half up to its 255 (``narrow``: 254)
    steps: the values the file's int8 tensor of that range holds."""
    qmin, qmax = (np.float32(1), np.float32(255)) if narrow else (np.float32(0), np.float32(255))
    lo, hi = np.float32(lo), np.float32(hi)
    scale = (hi - lo) / (qmax - qmin)
    zero = np.clip(np.floor(qmin - lo / scale + np.float32(0.5)), qmin, qmax)
    nlo, nhi = (qmin - zero) * scale, (qmax - zero) * scale
    inv = np.float32(1) / scale  # as TensorFlow's kernel: times the inverse, not divided
    return jnp.floor((jnp.clip(x, nlo, nhi) - nlo) * inv + np.float32(0.5)) * scale + nlo


def _apply(p: dict, h, strides, pad, linear):
    """``linear(p, h, strides, pad)``, or a BatchNorm left as a float affine map."""
    if "mul" in p:
        return h * p["mul"] + p["add"]
    return linear(p, h, strides, pad)


def _float_layer(p, h, strides, pad):
    return _linear(h, p["kernel"], strides, pad) + p["bias"]


def _linear(x, kernel, strides, pad, out_type=None):
    if x.ndim == 2:
        return jnp.dot(x, kernel, preferred_element_type=out_type)
    return lax.conv_general_dilated(
        x,
        kernel,
        (strides, strides),
        ((pad, pad), (pad, pad)),
        dimension_numbers=DIMS,
        preferred_element_type=out_type,
    )


def float_forward(arch: Arch, layers: dict, x):
    """Logits of the folded float network (``x``: normalised images, NHWC)."""

    return forward(arch, lambda path, h, s, pad: _apply(layers[path], h, s, pad, _float_layer), x)


def input_ranges(arch: Arch, layers: dict, x) -> dict:
    """``{layer path: (min, max |input|)}`` of one batch through the folded float network."""
    seen = {}

    def layer(path, h, strides, pad):
        if "kernel" in layers[path]:
            seen[path] = (jnp.min(h), jnp.max(jnp.abs(h)))
        return _apply(layers[path], h, strides, pad, _float_layer)

    forward(arch, layer, x)
    return seen


CALIBRATIONS = ("max", "percentile", "mse")  # how each activation's clipping range is picked
BINS = 2048  # the |input| histogram each layer's range is picked from (percentile, mse)


def input_histograms(arch: Arch, layers: dict, x, tops: dict) -> dict:
    """``{layer path: counts}``: one batch's ``|input|`` of each layer in ``BINS`` equal
    bins over ``[0, tops[path]]`` (values above the top land in the last bin)."""
    seen = {}

    def layer(path, h, strides, pad):
        if "kernel" in layers[path]:
            top = jnp.maximum(tops[path], jnp.finfo(jnp.float32).tiny)
            idx = jnp.clip(jnp.floor(jnp.abs(h) / top * BINS), 0, BINS - 1).astype(jnp.int32)
            seen[path] = jnp.bincount(idx.ravel(), length=BINS)
        return _apply(layers[path], h, strides, pad, _float_layer)

    forward(arch, layer, x)
    return seen


def clip_range(counts, top: float, levels: int, method: str, percentile: float) -> float:
    """The clipping range of one tensor from its ``|x|`` histogram (``BINS`` bins over
    ``[0, top]``): the ``percentile``-th percentile of ``|x|``, or (``mse``) the range among
    the bins' upper edges whose quantization (``levels`` steps over ``[0, range]``, values
    above it clipped) has the least squared error over the histogram."""
    counts = np.asarray(counts, np.float64)
    edges = np.linspace(0.0, top, BINS + 1)[1:]  # each bin's upper edge
    if method == "percentile":
        cdf = np.cumsum(counts) / max(counts.sum(), 1.0)
        return float(edges[min(int(np.searchsorted(cdf, percentile / 100.0)), BINS - 1)])
    centers = edges - top / (2 * BINS)
    candidates = edges[BINS // 64 - 1 :: BINS // 256]  # 1/64 of the top and up, 253 of them
    step = candidates[:, None] / levels
    rounded = np.minimum(np.round(centers[None, :] / step), levels) * step  # clipped above
    error = (counts[None, :] * (centers[None, :] - rounded) ** 2).sum(axis=1)
    return float(candidates[int(np.argmin(error))])


def activation_codes(r: dict, unsigned: bool = True) -> tuple[int, int]:
    """``(x_zero, levels)`` of an input with calibrated range ``r``: one never seen below
    zero (with ``unsigned``) uses 0..255 shifted by 128, others the symmetric -127..127
    (``levels`` steps on each side of zero)."""
    if unsigned and r["min"] >= 0:
        return 128, 2 * QMAX + 1
    return 0, QMAX


def calibrate(arch: Arch, layers: dict, batches, method: str = "max", percentile: float = 99.99,
              unsigned: bool = True) -> dict:  # fmt: skip
    """Static activation ranges: ``{path: {"min", "max_abs", "clip"}}`` of each layer's input
    over ``batches`` (normalised float images): its smallest value, its largest ``|x|`` and
    the range its int8 steps span, which is ``max_abs`` (``method="max"``), a ``percentile``
    of ``|x|``, or the squared-error-minimizing range (``"mse"``): both need a second pass
    over the batches, which clips the rare large inputs to resolve the common ones finer.
    ``unsigned`` as ``quantize``'s, for the levels the error is counted in."""
    if method not in CALIBRATIONS:
        raise ConfigError(f"calibration {method!r} is not one of {', '.join(CALIBRATIONS)}")
    batches = list(batches)
    fn = jax.jit(lambda lay, x: input_ranges(arch, lay, x))
    ranges = None
    for x in batches:
        r = {k: (float(lo), float(hi)) for k, (lo, hi) in jax.device_get(fn(layers, x)).items()}
        ranges = r if ranges is None else {
            k: (min(ranges[k][0], lo), max(ranges[k][1], hi)) for k, (lo, hi) in r.items()
        }  # fmt: skip
    if ranges is None:
        raise ConfigError("no calibration batches: pass --calibration-batches K with K >= 1")
    out = {k: {"min": lo, "max_abs": hi, "clip": hi} for k, (lo, hi) in ranges.items()}
    if method == "max":
        return out
    tops = {k: np.float32(hi) for k, (_, hi) in ranges.items()}
    hist_fn = jax.jit(lambda lay, x, t: input_histograms(arch, lay, x, t))
    counts = {}
    for x in batches:
        for k, c in jax.device_get(hist_fn(layers, x, tops)).items():
            counts[k] = counts.get(k, 0) + np.asarray(c, np.int64)
    for k, r in out.items():
        if r["max_abs"] > 0:
            _, levels = activation_codes(r, unsigned)
            r["clip"] = clip_range(counts[k], r["max_abs"], levels, method, percentile)
    return out


def quantize_per_channel(w, axis: int = -1):
    """Symmetric int8 with one step per index of ``axis`` (the output channel: -1 for HWIO
    conv kernels and (in, out) dense kernels). Returns ``(int8 array, float32 steps)``, the
    steps of shape ``w.shape[axis]``; an all-zero channel gets step 1."""
    w = np.asarray(w, np.float32)
    axis = axis % w.ndim
    others = tuple(a for a in range(w.ndim) if a != axis)
    amax = np.max(np.abs(w), axis=others)
    step = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / step.reshape(shape)), -QMAX, QMAX).astype(np.int8)
    return q, step


def dequantize(q, step, axis: int = -1):
    shape = [1] * np.ndim(q)
    shape[axis % np.ndim(q)] = -1
    return np.asarray(q, np.float32) * np.asarray(step, np.float32).reshape(shape)


def quantize(layers: dict, ranges: dict | None, unsigned: bool = True) -> dict:
    """``{path: {"kernel": int8, "w_step": (out,), "bias": (out,), "x_step": (),
    "x_zero": ()}}``; with ``ranges`` None, no ``x_step`` (activations stay float).

    An input never seen below zero (every one after a ReLU: all but the stem's) uses the
    whole int8 range for ``0..max`` (``unsigned``): ``q = round(x / step) - 128`` with
    ``step = max / 255`` and ``x_zero = 128``, twice the resolution of the symmetric
    ``-127..127`` (``x_zero = 0``), as torchvision's quint8 activations."""
    q = {}
    for path, p in layers.items():
        if "kernel" not in p:  # a float affine map (an unfolded BatchNorm)
            q[path] = {k: np.asarray(v, np.float32) for k, v in p.items()}
            continue
        kernel, w_step = quantize_per_channel(p["kernel"], -1)
        q[path] = {"kernel": kernel, "w_step": w_step, "bias": np.asarray(p["bias"], np.float32)}
        if ranges is not None:
            r = ranges[path]
            zero, levels = activation_codes(r, unsigned)
            top = r.get("clip", r["max_abs"])  # the calibrated range (max_abs for "max")
            q[path]["x_step"] = np.float32(top / levels if top > 0 else 1.0)
            q[path]["x_zero"] = np.int32(zero)
    return q


def quantize_activation(x, step, zero=0):
    """int8 codes of ``x``: ``round(x / step)`` in ``-127..127`` (``zero`` 0) or in
    ``0..255`` shifted down by ``zero`` = 128."""
    lo = jnp.where(zero > 0, 0, -QMAX)
    hi = jnp.where(zero > 0, 2 * QMAX + 1, QMAX)
    return (jnp.clip(jnp.round(x / step), lo, hi) - zero).astype(jnp.int8)


def int8_layer(p: dict, h, strides: int, pad: int, pad_code: bool = True):
    """One quantized conv (4-d ``h``) or dense layer (2-d) of ``int8_forward``.
    ``pad_code=False`` pads the int8 codes with 0 instead of the code of 0.0: wrong for a
    shifted input (its border windows lose ``x_zero * kernel``); for the tests' negative
    control."""
    if "x_step" not in p:
        w = p["kernel"].astype(jnp.float32) * p["w_step"]
        return _linear(h, w, strides, pad) + p["bias"]
    zero, kernel = p["x_zero"], p["kernel"]
    hq = quantize_activation(h, p["x_step"], zero)
    if h.ndim == 4 and pad:
        code0 = (-zero).astype(jnp.int8) if pad_code else jnp.int8(0)
        hq = jnp.pad(hq, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=code0)
    acc = _linear(hq, kernel, strides, 0, jnp.int32)
    acc = acc + zero * jnp.sum(kernel.astype(jnp.int32), axis=tuple(range(kernel.ndim - 1)))
    return acc.astype(jnp.float32) * (p["x_step"] * p["w_step"]) + p["bias"]


def int8_forward(arch: Arch, q: dict, x, ranges: dict | None = None):
    """Logits of the quantized network (``x``: normalised float images). Each layer: its
    input quantized with its static step, ``int8 x int8 -> int32``, rescaled by ``x_step *
    w_step``, plus the float bias. A shifted input (``x_zero`` 128) is padded with the code
    of 0.0 (``-x_zero``), so that every window's shift is the same ``x_zero * sum(kernel)``,
    added back in int32. Without ``x_step``: float input times the dequantized kernel
    (weight-only).

    ``ranges`` (``output_ranges``'): also every tensor a full-integer file holds in int8 at
    that range, and each block's residual adds the codes its conv1 reads, not the float
    input: the same quantized network as the LiteRT file (``hybridpar.tools.edge``), which
    then differs from this one by its kernels' rounding alone. Without them (None) those
    tensors stay float32."""
    if ranges is None:
        point = _same
    else:

        def point(name, h):
            if name.endswith("/in"):  # the codes the block's conv1 reads
                p = q[name[: -len("in")] + "conv1"]
                return fake_quant(h, *input_range(p)) if "x_step" in p else h
            return fake_quant(h, *ranges[name])

    layer = lambda path, h, s, pad: _apply(q[path], h, s, pad, int8_layer)  # noqa: E731
    return forward(arch, layer, x, point)


# ---- sizes, files, export ----------------------------------------------------------------


def tree_bytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def flat(q: dict) -> dict:
    """``{"stage1_block0/conv1/kernel": array, ...}`` (for ``np.savez``)."""
    return {f"{path}/{k}": np.asarray(v) for path, p in q.items() for k, v in p.items()}


def unflat(arrays) -> dict:
    q = {}
    for key in arrays:
        path, _, k = key.rpartition("/")
        q.setdefault(path, {})[k] = np.asarray(arrays[key])
    return q


def serving_fn(arch: Arch, q: dict, mean, std, ranges: dict | None = None):
    """uint8 images (batch, H, W, C) -> float32 logits, the arrays held as constants
    (``ranges``: ``int8_forward``'s)."""
    from hybridpar.program.steps import normalize  # the trainer's own (pure jnp: exports as it is)

    consts = jax.tree.map(jnp.asarray, q)

    def serve(images):
        return int8_forward(arch, consts, normalize(images, mean, std, jnp.float32), ranges)

    return serve


# Where the exported file runs: JAX lowers for each without its devices, so a file made on a
# CPU also runs on a GPU or TPU (without platforms=, only where it was made).
PLATFORMS = ("cpu", "cuda", "tpu")


def export(arch: Arch, q: dict, mean, std, image_shape, path: str,
           ranges: dict | None = None, platforms=PLATFORMS) -> None:  # fmt: skip
    """The quantized network, its arrays included, as serialized StableHLO
    (``jax.export``), for any batch size and each of ``platforms``:
    ``load_exported(path)(images)``."""
    (b,) = jax.export.symbolic_shape("batch")
    spec = jax.ShapeDtypeStruct((b, *image_shape), jnp.uint8)
    fn = jax.jit(serving_fn(arch, q, mean, std, ranges))
    exported = jax.export.export(fn, platforms=platforms)(spec)
    with open(path, "wb") as f:
        f.write(exported.serialize())


def load_exported(path: str):
    """The exported network as a function of uint8 images (batch, H, W, C) -> logits. Needs
    only JAX: no hybridpar model code runs."""
    with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    return exported.call
