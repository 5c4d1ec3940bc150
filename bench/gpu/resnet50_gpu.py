"""ResNet-50 training throughput on one GPU: hybridpar bfloat16 vs PyTorch AMP channels_last.

    python3 bench/gpu/resnet50_gpu.py [--quick | --smoke] [--sizes 128,224] [--batch 256]
        [--batches 224,224 (one per size)] [--config experiments/NAME.py[:ARGS]]

For a single-H200 machine with jax, flax, optax and torch but no TensorFlow (nothing here
imports it: hybridpar.program.program does not). Synthetic data placed on the device before timing.
Rows:

* ``hybridpar``: ``build_program`` on ``experiments/resnet50_imagenet.py`` (bfloat16
  compute, float32 parameters, SGD + Nesterov, label smoothing, sharded state, donation,
  the ``comm`` section's XLA GPU flags), compiled ahead of time;
* ``torch``: the same ResNet-50 v1.5 in eager PyTorch, channels_last,
  ``torch.autocast(bfloat16)``, cudnn.benchmark on;
* ``torch.compile``: the same step with the model through ``torch.compile`` (TorchInductor,
  default mode), the stronger peer: eager PyTorch leaves kernel fusion on the table
  (``--no-torch-compile`` leaves it out; its compile time is the first step's).

Interleaved rounds of ``--steps`` steps per candidate, median round; MFU against the
measured bfloat16 matmul peak (``--matmul-n`` square product, the faster of JAX and
PyTorch), with model FLOPs = 3 x the forward convolutions and head (analytic, as in
bench/resnet50_step.py). For scale: MLPerf's 8 x H200 result is about 7,700 images/s per
GPU (224 px, bfloat16/fp16, DALI input, tuned kernels).

The ``last loss`` column only shows that each trains: hybridpar runs the recipe's schedule,
whose 5-epoch warmup from LR 0 (about 25,000 steps at batch 256) leaves its loss near ln(1000)
= 6.9 after these few steps, while the torch step runs at the peak LR from its first step
and fits the one synthetic batch. The work per step, which is what is timed, is the same.

``--quick`` (128 and 224 px, few steps) finishes in under 5 minutes on an H200;
``--smoke`` (32 px, batch 2, one step) only checks that everything runs, on any device
(CPU included). Prints a table and one key=value line, ratios first.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# JAX and PyTorch share the GPU in this process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _ml_collections_shim():
    """A minimal stand-in for ml_collections.ConfigDict (attribute access, update), enough
    for hybridpar.config.schema, where ml_collections is not installed (the H200 image)."""

    class ConfigDict(dict):
        def __init__(self, d=None, **kw):
            super().__init__()
            for k, v in {**(d or {}), **kw}.items():
                self[k] = ConfigDict(v) if isinstance(v, dict) else v

        def __getattr__(self, k):
            try:
                return self[k]
            except KeyError:
                raise AttributeError(k) from None

        def __setattr__(self, k, v):
            self[k] = v

        def update(self, *a, **kw):
            for k, v in dict(*a, **kw).items():
                self[k] = v

    mod = types.ModuleType("ml_collections")
    mod.ConfigDict = ConfigDict
    return mod


def ensure_hybridpar_importable():
    """Import hybridpar from this checkout without installing it: ``models/`` is mapped to
    ``hybridpar.models`` by the package's install (setuptools package-dir); do the same here.
    """
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ml_collections  # noqa: F401
    except ImportError:
        sys.modules["ml_collections"] = _ml_collections_shim()
    import hybridpar

    try:
        import hybridpar.models
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "hybridpar.models",
            ROOT / "models" / "__init__.py",
            submodule_search_locations=[str(ROOT / "models")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["hybridpar.models"] = mod
        spec.loader.exec_module(mod)
        hybridpar.models = mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, for a quick check")
    p.add_argument("--smoke", action="store_true", help="32 px, batch 2, 1 step: runs anywhere")
    p.add_argument("--sizes", default="128,224")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", default="",
                   help="a global batch per size, comma-separated (default: --batch for all)")
    p.add_argument("--config", default="",
                   help="hybridpar's experiment config FILE[:ARGS] (default: resnet50_imagenet.py)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of both candidates")
    p.add_argument("--steps", type=int, default=20, help="steps per candidate per round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                   help="leave out the torch.compile row (eager PyTorch only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="hybridpar config override, repeatable")  # fmt: skip
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.repeats, a.warmup = 10, 3, 3
    if a.smoke:
        a.sizes, a.batch, a.steps, a.repeats, a.warmup, a.matmul_n = "32", 2, 1, 1, 0, 256
        a.batches = ""
    return a


def batch_per_size(args, sizes):
    """``{size: global batch}``: ``--batches`` aligned with ``--sizes``, else ``--batch``."""
    if not args.batches:
        return {s: args.batch for s in sizes}
    batches = [int(b) for b in args.batches.split(",")]
    if len(batches) != len(sizes):
        sys.exit(f"error: --batches has {len(batches)} values for {len(sizes)} --sizes")
    return dict(zip(sizes, batches))


def main(argv=None):
    args = parse_args(argv)
    ensure_hybridpar_importable()
    from hybridpar.config.schema import base_config
    from hybridpar.parallel import comm

    comm.apply(base_config().comm)  # XLA GPU collective/scheduler flags, before jax starts

    import jax
    import resnet50_step as rs

    torch = None if args.no_torch else rs.torch
    tdev = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    if torch is not None:
        torch.backends.cudnn.benchmark = True
    dev = jax.devices()[0]
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = batch_per_size(args, sizes)
    overrides = [tuple(kv.split("=", 1)) for kv in args.set]
    if args.config:  # make_hybridpar takes the recipe's file from here
        config_file = args.config
        rs_program = rs.hybridpar_program
        rs.hybridpar_program = lambda *a, **k: rs_program(*a, config_file=config_file, **k)

    mm = {"jax": rs.JaxMatmul(args.dtype, args.matmul_n)}
    if torch is not None:
        mm["torch"] = rs.TorchMatmul(args.dtype, args.matmul_n, tdev)
    mm_samples = {k: [] for k in mm}

    rows, state0 = [], {}
    for size in sizes:
        batch = batches[size]
        host = rs.host_batch(batch, size)
        cands, setup = [], {}
        t0 = time.perf_counter()
        c = rs.make_hybridpar("hybridpar", args.dtype, size, batch, overrides, state0, host)
        cands.append(c)
        setup[id(c)] = time.perf_counter() - t0
        if torch is not None:
            cfg = c.cfg
            for compiled in (False, True) if args.torch_compile else (False,):
                c = rs.TorchStep.from_config(cfg, args.dtype, size, batch, host, device=tdev,
                                             compiled=compiled)  # fmt: skip
                cands.append(c)
                setup[id(c)] = 0.0
        size_args = argparse.Namespace(**{**vars(args), "batch": batch})
        rates = rs.time_interleaved(cands, setup, mm, mm_samples, size_args)
        for c in cands:
            rows.append((c.name, size, batch, rates[id(c)], setup[id(c)], c.loss()))
        del cands

    peaks = {k: statistics.median(v) for k, v in mm_samples.items()}
    peak = max(peaks.values())
    gpu = torch.cuda.get_device_name() if tdev == "cuda" else dev.device_kind
    print(
        f"device: {gpu} ({dev.platform}); jax {jax.__version__}"
        + (f", torch {torch.__version__} on {tdev}" if torch is not None else ", no torch")
        + f"; batch {args.batches or args.batch}; {args.dtype}; "
        + f"{args.repeats} rounds x {args.steps} steps"
        + (f"; config {args.config}" if args.config else "")
    )
    print(
        f"{args.dtype} matmul peak ({args.matmul_n}^3, median): "
        + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in peaks.items())
    )
    print(f"{'impl':<13} {'size':>4} {'batch':>5} {'images/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'compile s':>9} {'last loss':>9}")  # fmt: skip
    ips = {}
    for name, size, batch, rate, setup_s, loss in rows:
        tf = rate * rs.train_flops(size) / 1e12
        ips[(name, size)] = (rate, tf * 1e12 / peak)
        print(
            f"{name:<13} {size:>4} {batch:>5} {rate:>9.1f} {tf:>8.1f} {tf * 1e12 / peak:>6.3f} "
            f"{setup_s:>9.1f} {loss:>9.4f}"
        )
    print("(MLPerf 8 x H200, per GPU, 224 px: about 7,700 images/s)")
    figs = [
        f"ratio_vs_torch_{s}={ips[('hybridpar', s)][0] / ips[('torch', s)][0]:.3f}"
        for s in sizes
        if ("torch", s) in ips
    ]
    figs += [
        f"ratio_vs_torch_compile_{s}="
        f"{ips[('hybridpar', s)][0] / ips[('torch.compile', s)][0]:.3f}"
        for s in sizes
        if ("torch.compile", s) in ips
    ]
    figs += [f"mfu_hybridpar_{s}={ips[('hybridpar', s)][1]:.3f}" for s in sizes]
    figs += [f"mfu_torch_{s}={ips[('torch', s)][1]:.3f}" for s in sizes if ("torch", s) in ips]
    figs += [f"hybridpar_ips_{s}={ips[('hybridpar', s)][0]:.1f}" for s in sizes]
    figs += [f"torch_ips_{s}={ips[('torch', s)][0]:.1f}" for s in sizes if ("torch", s) in ips]
    figs += [f"torch_compile_ips_{s}={ips[('torch.compile', s)][0]:.1f}" for s in sizes
             if ("torch.compile", s) in ips]  # fmt: skip
    figs += [
        f"peak_tflops={peak / 1e12:.1f}",
        f"batch={args.batches or args.batch}",
        f"dtype={args.dtype}",
        f"device={dev.platform}",
    ]
    print(" ".join(figs))


if __name__ == "__main__":
    main()
