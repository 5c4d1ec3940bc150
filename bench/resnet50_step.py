"""ResNet-50 train-step throughput: hybridpar vs a plain Flax step vs PyTorch, same machine.

    python bench/resnet50_step.py [--sizes 128,224] [--batch 16] [--dtypes float32,bfloat16]
        [--repeats 5] [--steps 1] [--impls hybridpar,flax,torch] [--torch-threads 1,2]
        [--variant NAME:KEY=VALUE[,KEY=VALUE]] [--set KEY=VALUE]

Candidates, all training ResNet-50 v1.5 (1000 classes, SGD + Nesterov, weight decay on
kernels, label smoothing 0.1, uint8 NHWC images normalised inside the step):

* ``hybridpar``: ``build_program`` on ``experiments/resnet50_imagenet.py`` with
  ``precision.compute`` set per row (parameters float32), the mesh from the config over the
  local devices, state from ``init_sharded`` (jit with out_shardings), the step compiled
  ahead of time with its shardings and the old state donated: the full feature set.
  ``--set KEY=VALUE`` changes its config; ``--variant`` adds a second hybridpar candidate
  with other settings (e.g. ``--variant bf16params:precision.params=bfloat16``).
* ``flax``: ``bench/flax_reference.py``, a Flax-ImageNet-example-style linen ResNet-50 and
  train step under a plain ``jax.jit`` (no hybridpar code; tests/test_bench_fairness.py
  shows it computes the same loss and update as hybridpar's step). It starts from the same
  parameter values as hybridpar (the two initialise identically anyway).
* ``torch/Nt``: the same network in PyTorch (written here; no torchvision needed),
  channels_last, eager, ``torch.autocast(bfloat16)`` for the bfloat16 rows, one row per
  thread count in ``--torch-threads`` (default 1 and all cores: on a shared machine
  OpenMP's spinning barriers can stall an all-core run for seconds when another job takes
  a core); ratios and MFU use the fastest row. Skipped with a note if torch is not
  installed (``pip install -e ".[bench]"``).

Timing: per image size, every candidate is compiled and run once plus ``--warmup`` steps
(untimed), then ``--repeats`` rounds, each timing ``--steps`` steps of every candidate in
turn (round-robin, so load drifting on the shared cores hits all alike); the median round
counts. One fixed batch, on the device before timing.

Roofline: each round also times a large matrix product (``--matmul-n``) per dtype in JAX
and in PyTorch; the device's peak for a dtype is the faster framework's median. FLOP/s
use the analytic model FLOPs: 3 x the forward pass's convolution and dense multiply-adds
x 2 (the usual MFU convention; BatchNorm, ReLU, pooling and the optimizer not counted).
XLA's own count for the compiled step (``cost_analysis()["flops"]``, which includes them)
is printed beside it. hybridpar's is higher than Flax's by about the same 0.3 GFLOP a step
whatever the batch (0.66 against 0.52 GF/img at batch 2, 0.48 against 0.44 at batch 8, 32 px,
CPU, 2026-12-06): per-step work on the 25.6M parameters (about 12 operations each, around
the update; not broken down further), not more work per image; at a
GPU's batch of 256 that is about 1 MFLOP an image.

Prints a table and ends with one key=value line: hybridpar / Flax reference ratios of
images/s first, then hybridpar / PyTorch, then hybridpar's fraction of the matmul peak (MFU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybridpar.config import cli
from hybridpar.simulate.cli import count

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import flax_reference

try:  # optional: the PyTorch rows
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

SHORT = {"float32": "f32", "bfloat16": "bf16"}
NUM_CLASSES = 1000


# ---- FLOPs -------------------------------------------------------------------------------
def resnet50_forward_flops(size: int, num_classes: int = NUM_CLASSES) -> float:
    """Forward FLOPs (2 x multiply-adds) of ResNet-50 v1.5's convolutions and head for one
    ``size`` x ``size`` image (symmetric padding as in models/resnet.py): 8.18 GFLOP at 224."""
    flops = 0.0

    def conv(h, cin, cout, k, s):
        nonlocal flops
        out = (h + 2 * ((k - 1) // 2) - k) // s + 1
        flops += 2.0 * out * out * k * k * cin * cout
        return out

    h = conv(size, 3, 64, 7, 2)
    h = (h + 2 - 3) // 2 + 1  # 3x3 max pool, stride 2, pad 1
    cin = 64
    for i, blocks in enumerate((3, 4, 6, 3)):
        f = 64 * 2**i
        for j in range(blocks):
            s = 2 if i > 0 and j == 0 else 1
            conv(h, cin, f, 1, 1)
            h2 = conv(h, f, f, 3, s)
            conv(h2, f, 4 * f, 1, 1)
            if s != 1 or cin != 4 * f:
                conv(h, cin, 4 * f, 1, s)
            h, cin = h2, 4 * f
    return flops + 2.0 * cin * num_classes


def train_flops(size: int) -> float:
    """Model FLOPs of one training example: forward + backward (2x forward)."""
    return 3.0 * resnet50_forward_flops(size)


def xla_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend may not report it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


# ---- Matmul peak -------------------------------------------------------------------------
class JaxMatmul:
    def __init__(self, dtype: str, n: int, device=None):
        dt = jnp.dtype(dtype)
        ka, kb = jax.random.split(jax.random.key(0))  # random: zeros run hot on some GPUs
        self.a = jax.device_put(jax.random.normal(ka, (n, n), dt), device)
        self.b = jax.device_put(jax.random.normal(kb, (n, n), dt), device)
        self.f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=dt))
        self.flop = 2.0 * n**3
        self.f(self.a, self.b).block_until_ready()

    def time(self) -> float:
        t0 = time.perf_counter()
        self.f(self.a, self.b).block_until_ready()
        return self.flop / (time.perf_counter() - t0)


class TorchMatmul:
    def __init__(self, dtype: str, n: int, device="cpu"):
        dt = getattr(torch, dtype)
        self.device = torch.device(device)
        self.a = torch.randn(n, n, device=self.device).to(dt)
        self.b = torch.randn(n, n, device=self.device).to(dt)
        self.flop = 2.0 * n**3
        self.time()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        torch.mm(self.a, self.b)
        self._sync()
        return self.flop / (time.perf_counter() - t0)


# ---- Candidates --------------------------------------------------------------------------
def hybridpar_program(dtype: str, size: int, batch: int, overrides=(), config_file=None):
    """``(config, mesh, program)``: the recipe with ``precision.compute=dtype`` at ``size``,
    through the train CLI's own override parser and set-up (no data)."""
    from hybridpar.runtime.run import setup

    cfg = cli.load(str(config_file or ROOT / "experiments" / "resnet50_imagenet.py"))
    cfg.precision.compute = dtype
    cfg.global_batch = cfg.eval_batch = batch
    cfg.data.image_size = size
    cli.apply_overrides(cfg, overrides, "--set")
    run = setup(cfg, with_data=False)
    return cfg, run.mesh, run.program


class JaxStep:
    """A jitted ``(state, batch) -> (state, metrics)`` with its state and one fixed batch."""

    def __init__(self, name, dtype, size, batch, fn, state, compiled=None):
        self.name, self.dtype, self.size, self.batch_size = name, dtype, size, batch
        self.fn, self.state = fn, state
        self.xla_flops = xla_flops(compiled) if compiled is not None else None
        self.metrics = None
        self.note = ""

    def run(self, steps: int):
        state = self.state
        for _ in range(steps):
            state, self.metrics = self.fn(state, self.batch)  # donated: keep the new one
        jax.block_until_ready(state)
        self.state = state

    def loss(self) -> float:
        return float(self.metrics["loss"])


def host_batch(batch: int, size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8),
        "label": rng.integers(0, NUM_CLASSES, (batch,), dtype=np.int32),
    }


def make_hybridpar(name, dtype, size, batch, overrides, state0, host):
    """hybridpar's step; ``state0`` (a dict holding the state, or empty) is filled by the
    first call with ``init_sharded``'s state, which later candidates copy (the parameters
    do not depend on the image size or the compute dtype unless ``precision.params`` does)."""
    from hybridpar.parallel.partitioning import shard_batch
    from hybridpar.program.state import init_sharded

    cfg, mesh, program = hybridpar_program(dtype, size, batch, overrides)
    key = (cfg.precision.params, str(program.shardings))
    if key not in state0:
        state0[key] = init_sharded(program.init, program.shardings, jax.random.key(cfg.seed))
    state = jax.tree.map(jnp.copy, state0[key])
    compiled = program.train_step(batch, size)
    step = JaxStep(name, dtype, size, batch, compiled, state, compiled)
    step.batch = shard_batch(host, mesh)
    step.cfg, step.program = cfg, program
    return step


def make_flax(dtype, size, batch, cfg, variables, host):
    """The plain Flax step with the recipe's hyperparameters (taken from hybridpar's config
    so both train the same thing) and the given initial variables."""
    state, step_fn = flax_reference.make_reference(
        image_size=size,
        batch=batch,
        dtype=jnp.dtype(dtype),
        steps_per_epoch=max(cfg.data.train_examples // batch, 1),
        variables=variables,
        **flax_reference.recipe_of(cfg),
    )
    dev_batch = jax.tree.map(jnp.asarray, host)
    compiled = step_fn.lower(state, dev_batch).compile()
    step = JaxStep("flax", dtype, size, batch, compiled, state, compiled)
    step.batch = dev_batch
    return step


def torch_resnet50(num_classes: int = NUM_CLASSES):
    """ResNet-50 v1.5 in PyTorch, as torchvision builds it (zero-init last BN gamma)."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, f, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, f, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(f)
            self.conv2 = nn.Conv2d(f, f, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(f)
            self.conv3 = nn.Conv2d(f, 4 * f, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(4 * f)
            nn.init.zeros_(self.bn3.weight)
            self.relu = nn.ReLU(inplace=True)
            self.proj = None
            if stride != 1 or cin != 4 * f:
                self.proj = nn.Sequential(
                    nn.Conv2d(cin, 4 * f, 1, stride, bias=False), nn.BatchNorm2d(4 * f)
                )

        def forward(self, x):
            r = x if self.proj is None else self.proj(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + r)

    layers = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, blocks in enumerate((3, 4, 6, 3)):
        f = 64 * 2**i
        for j in range(blocks):
            layers.append(Bottleneck(cin, f, 2 if i > 0 and j == 0 else 1))
            cin = 4 * f
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    nn.init.normal_(model[-1].weight, 0.0, 0.01)
    nn.init.zeros_(model[-1].bias)
    return model


class TorchStep:
    """PyTorch train step: channels_last, autocast(bfloat16) for the bf16 rows; eager, or
    with ``compiled`` the model through ``torch.compile`` (TorchInductor), the stronger peer."""

    def __init__(
        self, dtype, size, batch, host, *, lr, weight_decay, label_smoothing, device, threads=None,
        compiled=False,
    ):
        self.name, self.dtype, self.size, self.batch_size = "torch", dtype, size, batch
        self.threads = threads
        if threads:
            self.name = f"torch/{threads}t"
        self.device = torch.device(device)
        self.model = torch_resnet50().to(self.device, memory_format=torch.channels_last)
        if compiled:  # compiled at the first step, which the timing counts as set-up
            self.model = torch.compile(self.model)
            self.name = "torch.compile"
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        rest = [p for p in self.model.parameters() if p.ndim <= 1]
        self.opt = torch.optim.SGD(
            [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}],
            lr=lr,
            momentum=0.9,
            nesterov=True,
        )
        # NHWC uint8 viewed as NCHW: channels_last strides already.
        self.images = torch.from_numpy(host["image"]).to(self.device).permute(0, 3, 1, 2)
        self.labels = torch.from_numpy(host["label"]).long().to(self.device)
        mean = torch.tensor(flax_reference.IMAGENET_MEAN, device=self.device)
        std = torch.tensor(flax_reference.IMAGENET_STD, device=self.device)
        self.mean, self.std = mean.view(1, 3, 1, 1), std.view(1, 3, 1, 1)
        self.smoothing = label_smoothing
        self.autocast = dtype == "bfloat16"
        self.xla_flops = None
        self._loss = None
        self.note = ""

    @classmethod
    def from_config(cls, cfg, dtype, size, batch, host, *, device, threads=None, compiled=False):
        """The step with hybridpar's recipe from ``cfg`` (its defaults where ``cfg`` is None:
        no hybridpar candidate was built)."""
        return cls(
            dtype,
            size,
            batch,
            host,
            lr=cfg.optim.base_lr * batch / 256 if cfg else 0.1,
            weight_decay=cfg.optim.weight_decay if cfg else 5e-5,
            label_smoothing=cfg.label_smoothing if cfg else 0.1,
            device=device,
            threads=threads,
            compiled=compiled,
        )

    def _step(self):
        x = (self.images.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.float(), self.labels, label_smoothing=self.smoothing
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss

    def run(self, steps: int):
        if self.threads:
            torch.set_num_threads(self.threads)
        for _ in range(steps):
            self._loss = self._step().detach()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def loss(self) -> float:
        return float(self._loss)


# ---- Main --------------------------------------------------------------------------------
def time_interleaved(cands, setup_s, peak_fns, peak_samples, args) -> dict:
    """Median images/s of each candidate, ``{id(c): rate}``, timed round-robin.

    Each candidate first runs one step (compiling anything left; its time is added to
    ``setup_s[id(c)]``) and ``args.warmup`` untimed steps; then ``args.repeats`` rounds time
    ``args.steps`` steps of every candidate in turn (so load drifting on shared cores hits
    all alike) and, in each round, every matmul of ``peak_fns`` (into ``peak_samples``).
    """
    for c in cands:
        t0 = time.perf_counter()
        c.run(1)
        setup_s[id(c)] += time.perf_counter() - t0
        c.run(args.warmup)
    times = {id(c): [] for c in cands}
    for _ in range(args.repeats):
        for c in cands:
            t0 = time.perf_counter()
            c.run(args.steps)
            times[id(c)].append((time.perf_counter() - t0) / args.steps)
        for k, f in peak_fns.items():
            peak_samples[k].append(f.time())
    return {id(c): args.batch / statistics.median(times[id(c)]) for c in cands}


IMPLS = ("hybridpar", "flax", "torch")


def counts(meaning: str, example: str):
    """``type=`` of a comma-separated list of whole numbers >= 1 (``count`` for each)."""
    one = count(meaning, example)

    def parse(text: str) -> list[int]:
        values = [one(t.strip()) for t in text.split(",") if t.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} names none; e.g. {example}")
        return values

    return parse


def parse_args(argv=None):
    p = cli.ArgumentParser("python bench/resnet50_step.py", __doc__.splitlines()[0],
                           takes_config=False)  # fmt: skip
    p.add_argument("--sizes", type=counts("an image side in px", "128,224"), default="128,224",
                   help="image sizes (px), comma-separated")  # fmt: skip
    p.add_argument("--batch", type=count("a global batch", "16"), default=16,
                   help="global batch of every candidate")  # fmt: skip
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes")
    p.add_argument("--repeats", type=count("a number of rounds", "5"), default=5,
                   help="timed rounds (median over them)")  # fmt: skip
    p.add_argument("--steps", type=count("a number of steps", "1"), default=1,
                   help="train steps per candidate per round")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--impls", default="hybridpar,flax,torch",
                   help=f"candidates to run, comma-separated, of {','.join(IMPLS)}")  # fmt: skip
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="hybridpar config override (e.g. precision.params=bfloat16); repeatable",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="an extra hybridpar candidate with these overrides; repeatable",
    )
    p.add_argument("--matmul-n", type=count("a matrix side", "2048"), default=2048,
                   help="matrix size for the peak")  # fmt: skip
    p.add_argument(
        "--torch-threads",
        type=counts("a number of threads", "1,2"),
        default=",".join(sorted({"1", str(os.cpu_count())})),
        help="PyTorch thread counts, one row each; ratios use the fastest. On a shared "
        "machine OpenMP's spinning barriers can stall all-core runs when another job takes "
        "a core, so one thread is measured too",
    )
    args = p.parse_args(argv)
    if args.warmup < 0:
        cli.fail(f"--warmup {args.warmup} must be >= 0 (0: none after the first), e.g. --warmup 1")
    unknown = [i for i in args.impls.split(",") if i.strip() and i.strip() not in IMPLS]
    if unknown:  # an unknown name would be skipped unsaid
        cli.fail(f"--impls: {','.join(unknown)} is not one of {','.join(IMPLS)}; "
                 "e.g. --impls hybridpar,flax")  # fmt: skip
    return args


def _pairs(text: str):
    out = []
    for kv in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = kv.partition("=")
        if not sep:
            cli.fail(
                f"--set/--variant: {kv!r} is not KEY=VALUE; e.g. --set precision.params=bfloat16"
            )
        out.append((k.strip(), v.strip()))
    return out


def main(argv=None):
    args = parse_args(argv)
    sizes = args.sizes
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    impls = [s.strip() for s in args.impls.split(",")]
    base = _pairs(",".join(args.set))
    variants = [("hybridpar", base)] if "hybridpar" in impls else []
    for v in args.variant:
        name, _, rest = v.partition(":")
        variants.append((name, base + _pairs(rest)))
    use_torch = "torch" in impls and torch is not None
    notes = []
    if "torch" in impls and torch is None:
        notes.append("PyTorch rows skipped: torch is not installed (pip install -e '.[bench]')")
    torch_threads = sorted(set(args.torch_threads))
    if use_torch:
        torch.set_num_threads(max(torch_threads))
    if "flax" in impls and not variants:
        cli.fail(
            "--impls flax takes its recipe from hybridpar's config: add hybridpar or a "
            "--variant, e.g. --impls hybridpar,flax"
        )

    # Matmul peaks, timed in every round with the steps, under the same load.
    peaks_fns = {("jax", d): JaxMatmul(d, args.matmul_n) for d in dtypes}
    if use_torch:
        peaks_fns.update({("torch", d): TorchMatmul(d, args.matmul_n) for d in dtypes})
    peak_samples = {k: [] for k in peaks_fns}

    results = []  # (name, dtype, size, median images/s, xla flops/img, loss, compile s)
    state0: dict = {}
    for size in sizes:
        host = host_batch(args.batch, size)
        cands, compile_s = [], {}
        for dtype in dtypes:
            for name, overrides in variants:
                t0 = time.perf_counter()
                c = make_hybridpar(name, dtype, size, args.batch, overrides, state0, host)
                cands.append(c)
                compile_s[id(c)] = time.perf_counter() - t0
            if "flax" in impls:
                first = next(c for c in cands if (c.name, c.dtype) == (variants[0][0], dtype))
                t0 = time.perf_counter()
                variables = {
                    "params": jax.tree.map(jnp.copy, first.state.params),
                    "batch_stats": jax.tree.map(jnp.copy, first.state.batch_stats),
                }
                c = make_flax(dtype, size, args.batch, first.cfg, variables, host)
                cands.append(c)
                compile_s[id(c)] = time.perf_counter() - t0
            for threads in torch_threads if use_torch else ():
                cfg = cands[0].cfg if variants else None
                c = TorchStep.from_config(
                    cfg, dtype, size, args.batch, host, device="cpu", threads=threads
                )
                cands.append(c)
                compile_s[id(c)] = 0.0
        rates = time_interleaved(cands, compile_s, peaks_fns, peak_samples, args)
        for c in cands:
            ips = rates[id(c)]
            per_img = c.xla_flops / args.batch if c.xla_flops else None
            results.append((c.name, c.dtype, size, ips, per_img, c.loss(), compile_s[id(c)]))
        del cands

    peak_by = {k: statistics.median(v) for k, v in peak_samples.items()}
    peak = {d: max(v for (fw, dd), v in peak_by.items() if dd == d) for d in dtypes}

    print(
        f"CPU cores (os.cpu_count()): {os.cpu_count()}; devices: {jax.device_count()} "
        f"{jax.devices()[0].platform}; batch {args.batch}; {args.repeats} rounds x "
        f"{args.steps} steps per candidate; jax {jax.__version__}"
        + (f"; torch {torch.__version__}" if use_torch else "")
        + (f"; XLA_FLAGS={os.environ['XLA_FLAGS']!r}" if os.environ.get("XLA_FLAGS") else "")
    )
    print(
        "matmul peak (median, "
        f"{args.matmul_n}^3): "
        + ", ".join(f"{fw} {d} {v / 1e9:.0f} GFLOP/s" for (fw, d), v in peak_by.items())
        + "; device peak per dtype = the faster framework"
    )
    print(
        "model FLOPs per image (3 x forward conv+dense, analytic): "
        + ", ".join(f"{s} px {train_flops(s) / 1e9:.2f} G" for s in sizes)
    )
    for n in notes:
        print(n)
    print(
        f"{'impl':<12} {'dtype':<9} {'size':>4} {'images/s':>9} {'GFLOP/s':>8} "
        f"{'of peak':>7} {'XLA GF/img':>10} {'compile s':>9} {'last loss':>9}"
    )
    ips = {}
    for name, dtype, size, rate, per_img, loss, cs in results:
        gf = rate * train_flops(size) / 1e9
        frac = gf * 1e9 / peak[dtype]
        ips[(name, dtype, size)] = (rate, frac)
        if name.startswith("torch") and rate > ips.get(("torch", dtype, size), (0.0,))[0]:
            ips[("torch", dtype, size)] = (rate, frac)  # the fastest thread count
        xla = f"{per_img / 1e9:10.2f}" if per_img else f"{'-':>10}"
        print(
            f"{name:<12} {dtype:<9} {size:>4} {rate:>9.2f} {gf:>8.1f} {frac:>7.3f} {xla} "
            f"{cs:>9.1f} {loss:>9.4f}"
        )

    print(
        "last loss: hybridpar and flax start from the same parameters and train on the same "
        "batch (their float32 losses agree); torch starts from its own initialisation"
    )
    if use_torch and len(torch_threads) > 1:
        print("torch: ratios and MFU below use the faster of its thread counts")
    # Last line: ratios first (hybridpar / Flax, then / PyTorch), then MFU.
    figs = []
    hp = variants[0][0] if variants else None
    combos = [(s, d) for s in sizes for d in dtypes]
    for other, label in (("flax", "flax"), ("torch", "torch")):
        for s, d in combos:
            if hp and (hp, d, s) in ips and (other, d, s) in ips:
                figs.append(
                    f"ratio_vs_{label}_{s}_{SHORT.get(d, d)}="
                    f"{ips[(hp, d, s)][0] / ips[(other, d, s)][0]:.3f}"
                )
    for name, _ in variants[1:]:
        for s, d in combos:
            figs.append(
                f"ratio_{name}_vs_{hp}_{s}_{SHORT.get(d, d)}="
                f"{ips[(name, d, s)][0] / ips[(hp, d, s)][0]:.3f}"
            )
    for name in [hp] + (["flax"] if "flax" in impls else []) + (["torch"] if use_torch else []):
        for s, d in combos:
            if name and (name, d, s) in ips:
                figs.append(f"mfu_{name}_{s}_{SHORT.get(d, d)}={ips[(name, d, s)][1]:.3f}")
    for s, d in combos:
        if hp and (hp, d, s) in ips:
            figs.append(f"{hp}_ips_{s}_{SHORT.get(d, d)}={ips[(hp, d, s)][0]:.2f}")
    figs += [f"peak_{SHORT.get(d, d)}_gflops={peak[d] / 1e9:.0f}" for d in dtypes]
    figs += [
        f"batch={args.batch}",
        f"repeats={args.repeats}",
        f"steps={args.steps}",
        f"cpu_cores={os.cpu_count()}",
    ]
    print(" ".join(figs))


if __name__ == "__main__":
    cli.main(main)  # a bad --set is one error: line
