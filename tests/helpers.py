"""What the tests share: the one place that builds programs and steps for tests, the parity
check every "sharded equals one device" test uses, its negative controls, and the shared-data
lookup. No test imports from another test file; they import from here.

Porting note: ``build`` and ``step_with_tx`` are the only functions that call the library's
program/step builders. When the ``Program`` API changes, change those two.

The parity check (``reference`` + ``parity_failures``)
------------------------------------------------------
A sharded step sums in another order than one device (per-shard partial sums, then an
all-reduce), so float32 results differ by rounding. How much depends on the computation:
reduction sizes, the steps taken and how much BatchNorm and cancelling gradients amplify.
So the tolerance is measured on the computation itself, per array: the reference step is run
again from initial values nudged by ``NUDGE`` (a few float32 roundings), and the largest
distance of those runs from the reference, ``spread``, is how far rounding-size differences
carry. A result passes where ``|got - want| <= ROUNDING_FACTOR * spread + 2 float32
spacings of want`` (no float32 result can beat the last term).

That tolerance must be far below each array's own update (``want - start``), or the check
would not see the array's gradient: the check fails any array whose tolerance exceeds
``VISIBLE`` of its update. This is why the states start from ``random_state`` (non-zero
BatchNorm scales: with the zero-init last BN scale of each residual block no gradient reaches
the convolutions inside the block, and zero updates compare equal whatever the gradient).

Negative controls (``zero_grads``, ``roll_grads``) break one gradient with the optimizer's
state structure unchanged; the same check must reject them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta
from xla_flags import cpu_flags

from hybridpar import make_mesh, shard_batch
from hybridpar.config.curriculum import single_stage_plan
from hybridpar.config.schema import base_config
from hybridpar.parallel.partitioning import infer_shardings
from hybridpar.program.optim import decay_mask
from hybridpar.program.precision import LossScale, Policy
from hybridpar.program.program import build_program
from hybridpar.program.state import make_init_fn
from hybridpar.program.steps import jit_train_step, make_train_step

ROOT = Path(__file__).resolve().parents[1]
BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 3
MEAN, STD = (127.5,) * 3, (64.0,) * 3
LR = 0.1

# Tolerance = ROUNDING_FACTOR x the measured spread (see the module docstring). NUDGE: the
# nudge's relative size, 4 float32 roundings (a sharded step's sums round differently in
# many places, not once). Measured on an AMD EPYC, tiny ResNet, 3 steps, meshes data:8,
# fsdp:8, data:4,model:2, data:2,fsdp:2,model:2: the largest difference over any array is
# 0.27x its tolerance (about 1x the spread), while zeroing the gradients of the blocks'
# conv1/conv2 kernels puts 63 arrays 10x to 4000x beyond theirs.
ROUNDING_FACTOR = 4.0
NUDGE = 4 * 2.0**-24
# Every array's tolerance must be below this fraction of its update (else the check is blind).
VISIBLE = 0.02


# --- shared data ---------------------------------------------------------------------------

DATA = Path(os.environ.get("HYBRIDPAR_DATA", ROOT.parent / "shared" / "data"))


DIGITS = str(ROOT / "experiments" / "digits.py")
# The digits job shrunk to a few seconds (11 steps): 8 filters, 16 px, a quarter epoch at
# batch 32, a train line after every step. As ``--config.KEY=VALUE`` too: ``config_args``.
TINY_DIGITS = {
    "model.num_filters": 8,
    "data.image_size": 16,
    "global_batch": 32,
    "eval_batch": 120,
    "num_epochs": 0.25,
    "log_every_s": 0.0,
    "optim.warmup_epochs": 0.1,
}


def tiny_digits(mesh="data:4,model:2", **overrides):
    """``TINY_DIGITS`` on ``mesh``, with ``overrides`` (dotted keys) applied as the CLI would."""
    from hybridpar.config import cli

    c = cli.load(DIGITS)
    c.mesh = mesh
    cli.apply_overrides(c, [(k, str(v)) for k, v in {**TINY_DIGITS, **overrides}.items()])
    return c


def compile_tiny(target, mesh, **overrides) -> dict:
    """``compile_programs``' report of ``tiny_digits(mesh, **overrides)`` for ``target``."""
    from hybridpar.tools.compile import compile_programs

    return compile_programs(tiny_digits(mesh=mesh, **overrides), target)


def loop_metadata(workdir, step) -> Path:
    """The file of a checkpoint's loop state (orbax's JSON item) under ``workdir``."""
    return next((Path(workdir) / "checkpoints" / str(step) / "loop").glob("*metadata*"))


def saved_loop(workdir, step) -> dict:
    """The loop state a checkpoint holds, read as a file."""
    return json.loads(loop_metadata(workdir, step).read_text())


def config_args(values: dict) -> list[str]:
    """``{"a.b": 1}`` -> ``["--config.a.b=1"]``."""
    return [f"--config.{k}={v}" for k, v in values.items()]


def run_compile_tool(module: str, args, timeout=300) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in a subprocess: a fresh JAX, so the tool sets its own
    virtual device count (``--devices``); this process's XLA_FLAGS and JAX_PLATFORMS are not
    passed on. Compile-only, as the planner compiles: memory and collectives are fixed
    before LLVM, whose optimisations this skips (a large part of a ResNet-50 compile)."""
    from hybridpar.tools.comm_report import ANALYSIS_XLA_FLAGS

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = " ".join(ANALYSIS_XLA_FLAGS)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def main_here(main, argv, capture, monkeypatch=None, put_back=()) -> tuple[int, str, str]:
    """A tool's ``main(argv)`` in this process, as ``python -m`` would run it where the run
    needs no signal, fresh JAX or compiler flags of its own (a Python and JAX start
    fewer): ``(exit code, stdout, stderr)``, 0 where ``main`` returned. ``capture``: pytest's
    capsys, or capfd where what C++ writes counts; ``put_back``: environment variables the
    tool sets, restored after the test (``monkeypatch``)."""
    for name in put_back:
        monkeypatch.setenv(name, os.environ.get(name, ""))
    capture.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capture.readouterr()
    return code, out.out, out.err


def cpu_env(devices: int = 8, xla_flags: str = "") -> dict:
    """This environment with ``devices`` virtual CPU devices, for a CLI subprocess."""
    return dict(os.environ, XLA_FLAGS=cpu_flags(devices, xla_flags), JAX_PLATFORMS="cpu")


def signal_at(cmd, env, after_step, sig, log):
    """Runs ``cmd`` (a trainer logging its steps), sends ``sig`` once its output shows
    ``after_step``; ``(process, stdout)``, stderr in the file ``log``."""

    def reached(line: str) -> bool:
        return line.startswith("train step") and int(line.split()[2].split("/")[0]) >= after_step

    return signal_on(cmd, env, reached, sig, log)


def signal_on(cmd, env, when, sig, log):
    """Runs ``cmd``, sends ``sig`` at the first line of its output for which ``when(line)``;
    ``(process, stdout)``, stderr in the file ``log``."""
    with open(log, "w") as stderr:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=stderr, text=True)  # fmt: skip
        seen = []
        try:
            for line in p.stdout:
                seen.append(line)
                if when(line):
                    p.send_signal(sig)
                    break
            out, _ = p.communicate(timeout=300)
        finally:
            p.kill()
    return p, "".join(seen) + out


def require_shared_data(*relative: str) -> Path:
    """The shared data folder (``$HYBRIDPAR_DATA``, default ``../shared/data``), after
    checking that each ``relative`` path exists in it. Missing: the test skips with the
    reason, except where ``CI`` is set, where it fails (a CI clone without the data must not
    pass with its real-data tests skipped)."""
    missing = [r for r in relative if not (DATA / r).exists()]
    if not DATA.is_dir() or missing:
        reason = f"shared data not found: {missing or [str(DATA)]} in {DATA} (set HYBRIDPAR_DATA)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {reason}")
        pytest.skip(reason)
    return DATA


def free_port() -> int:
    """A TCP port free on loopback now (for a coordinator the test starts next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_module(name: str):
    """``bench/NAME.py`` imported by path (bench/ is not a package; no sys.path changes)."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


# --- batches and programs --------------------------------------------------------------------


def batches(steps=STEPS, batch=BATCH, size=SIZE, classes=CLASSES, seed=0) -> list[dict]:
    """The same random host batches for every test that compares two runs."""
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 256, (batch, size, size, 3), np.uint8),
            "label": rng.integers(0, classes, (batch,), np.int32),
        }
        for _ in range(steps)
    ]


def tiny_config(mesh="data:8", **overrides):
    """The tiny ResNet (widths 8..64, 16-px images, 10 classes) with SGD at a constant LR."""
    c = base_config()
    c.mesh = mesh
    c.model.name, c.model.num_filters, c.model.small_stem = "resnet_tiny", 8, True
    c.data.image_size, c.data.num_classes = SIZE, CLASSES
    c.data.mean, c.data.std = MEAN, STD
    c.global_batch = c.eval_batch = BATCH
    c.optim.base_lr, c.optim.lr_batch_base, c.optim.schedule = LR, BATCH, "constant"
    for key, value in overrides.items():  # "model.bn_sync": "local", ...
        node = c
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return c


def build(config, devices=None, steps_per_epoch=10, total_steps=100):
    """``build_program`` for a test config on ``config.mesh`` (over ``devices``); the
    schedule counts ``total_steps`` steps of ``steps_per_epoch`` per epoch."""
    mesh = make_mesh(config.mesh, devices)
    plan = single_stage_plan(steps_per_epoch, total_steps, config.global_batch)
    return build_program(config, mesh, plan)


def step_with_tx(program, config, tx):
    """The program's jitted train step with its optimizer replaced by ``tx`` (same state
    structure): the Program builds its steps from its fields, so replacing one is how the
    negative controls break one gradient without library hooks."""
    del config  # the program holds it
    return dataclasses.replace(program, tx=tx).train_jit


def tiny_tx(lr=LR, weight_decay=1e-4):
    """SGD with Nesterov momentum and weight decay on kernels, as the configs build it."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.sgd(lr, momentum=0.9, nesterov=True),
    )


@dataclasses.dataclass
class HandBuilt:
    """A step built by hand for a model no config names (e.g. a tiny wide ResNet): the
    fields of a program that ``random_state`` and ``run`` use."""

    model: object
    tx: object
    mesh: object
    shardings: object
    init: object
    abstract: object
    train_jit: object


def hand_built(model, mesh, rules, tx=None, policy=None):
    """The train step of ``model`` placed by ``rules`` on ``mesh`` (SGD at LR by default)."""
    tx = tx or tiny_tx()
    policy = policy or Policy()
    init = make_init_fn(model, tx, (1, SIZE, SIZE, 3), LossScale.create(dynamic=False))
    abstract = jax.eval_shape(init, jax.random.key(0))
    shardings = infer_shardings(abstract, rules, mesh)
    fn = make_train_step(model, tx, policy, lambda s: LR, mean=MEAN, std=STD)
    step = jit_train_step(fn, shardings, mesh, {"image": 4, "label": 1})
    return HandBuilt(model, tx, mesh, shardings, init, abstract, step)


# --- initial states ----------------------------------------------------------------------


def random_like(abstract, rng, kind):
    """Host values for every array of an abstract tree, near a trained network's scales:
    He-scaled kernels, BN gammas around 1 (small, but not zero, on a bottleneck's last BN,
    which the zero init would make 0 and so block every gradient inside the block), small
    betas and biases, running statistics near (0, 1). Larger gammas amplify float rounding
    through a deep network so much that one program at two XLA optimisation levels
    disagrees after two steps."""

    def one(path, x):
        name = jax.tree_util.keystr(path)
        if kind == "batch_stats":
            v = rng.uniform(0.8, 1.2, x.shape) if "var" in name else rng.normal(0, 0.1, x.shape)
        elif "head" in name and "kernel" in name:
            v = rng.normal(0, 0.01, x.shape)
        elif len(x.shape) > 1:
            v = rng.normal(0, np.sqrt(2.0 / np.prod(x.shape[:-1])), x.shape)
        elif "scale" in name:
            v = rng.uniform(0.0, 0.2, x.shape) if "bn3" in name else rng.uniform(0.8, 1.2, x.shape)
        else:
            v = rng.normal(0, 0.02, x.shape)
        return np.asarray(v, x.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract)


def random_variables(model, size, seed=0):
    """``(params, batch_stats)``: ``random_like`` host values for ``model`` on
    ``size``x``size`` RGB images."""
    x = jnp.zeros((1, size, size, 3), jnp.float32)
    abstract = meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False)))
    rng = np.random.default_rng(seed)
    return random_like(abstract["params"], rng, "params"), random_like(
        abstract["batch_stats"], rng, "batch_stats"
    )


def random_state(program, seed=0):
    """Host train state of ``program`` with random (non-trivial) parameters and BatchNorm
    statistics, the optimizer state initialised for them."""
    abstract = meta.unbox(program.abstract)
    rng = np.random.default_rng(seed)
    params = random_like(abstract.params, rng, "params")
    stats = random_like(abstract.batch_stats, rng, "batch_stats")
    # The init's loss scale alone (XLA drops the model's init from this jit: fast).
    loss_scale = jax.jit(lambda r: meta.unbox(program.init(r)).loss_scale)(jax.random.key(0))
    return abstract.replace(
        step=np.zeros((), np.int32),
        params=params,
        batch_stats=stats,
        opt_state=jax.device_get(program.tx.init(params)),
        loss_scale=jax.device_get(loss_scale),
    )


def place(host_tree, shardings):
    """Host arrays onto their shardings (also across processes: each process builds only
    its own shards, from the same host values)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i]),
        host_tree,
        shardings,
    )


# --- running and comparing ------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    state: object  # host TrainState after the steps
    losses: np.ndarray
    device_state: object = None  # the same, as the step left it on the devices
    batch: int = BATCH  # examples a loss is the mean of


def run(step, program, start, host_batches) -> Run:
    """``step`` (jitted, donating) from host state ``start`` over ``host_batches``."""
    state = place(start, program.shardings)
    losses = []
    for b in host_batches:
        state, m = step(state, shard_batch(b, program.mesh))
        losses.append(m["loss"])
    losses = np.asarray(jax.device_get(losses), np.float64)
    return Run(jax.device_get(state), losses, state, len(host_batches[0]["label"]))


# Compiler options for a test's own compiles of steps it compares but does not time: LLVM's
# optimisations are a large part of a tiny ResNet step's compile and change
# no HLO, so no sharding or collective; its results differ from the optimised program's by
# float32 rounding (1-2 ulp after 3 steps), which a parity check measures in its reference
# anyway. Compile both sides of a comparison with the same options.
NO_LLVM_OPT = {"xla_backend_optimization_level": 0}
# The same as an XLA_FLAGS entry, for tests that start the trainer in a subprocess.
NO_LLVM_OPT_FLAG = "".join(f"--{k}={v}" for k, v in NO_LLVM_OPT.items())


def compiled_step(program, start, compiler_options=None, step=None):
    """The program's train step (or ``step``, a jitted step of the same signature) compiled
    ahead of time for ``start`` and BATCH-sized batches (``.as_text()`` gives its HLO)."""
    return lowered_step(program, start, step).compile(compiler_options)


def lowered_step(program, start, step=None):
    """``compiled_step`` before XLA's passes: ``.as_text()`` gives the StableHLO, with the
    dtypes JAX asked for (XLA:CPU widens 16-bit collectives when it compiles)."""
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
        start,
        program.shardings,
    )
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        shard_batch(batches(steps=1)[0], program.mesh),
    )
    return (step or program.train_jit).lower(state, batch)


@dataclasses.dataclass
class Reference:
    start: object  # host TrainState the runs started from
    want: Run
    spreads: list  # runs from nudged starts


def _nudged(start, seed):
    rng = np.random.default_rng(seed)

    def nudge(x):
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            return x
        return (x * (1 + NUDGE * rng.uniform(-1, 1, x.shape))).astype(x.dtype)

    return start.replace(
        params=jax.tree.map(nudge, start.params),
        batch_stats=jax.tree.map(nudge, start.batch_stats),
    )


def reference(program, start, host_batches, step=None, nudges=2) -> Reference:
    """The reference run (``step``, default the program's) and its float32 spread."""
    step = step or program.train_jit
    want = run(step, program, start, host_batches)
    spreads = [run(step, program, _nudged(start, 100 + i), host_batches) for i in range(nudges)]
    return Reference(start, want, spreads)


def _named_leaves(state):
    out = []
    for part in ("params", "batch_stats"):
        for path, x in jax.tree_util.tree_leaves_with_path(getattr(state, part)):
            out.append((part + jax.tree_util.keystr(path), np.asarray(x, np.float64)))
    return out


def _tolerance(want, spreads):
    spread = max(np.abs(s - want).max() for s in spreads)
    floor = 2 * np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return ROUNDING_FACTOR * spread + floor


def parity_failures(got: Run, ref: Reference) -> list[str]:
    """What differs between ``got`` and the reference beyond float32 rounding (empty: the
    same computation), and any array whose update the check could not see."""
    failures = []
    want_l = ref.want.losses
    tol = _tolerance(want_l, [s.losses for s in ref.spreads])
    # A loss is a mean over the batch, which a sharded step sums in another order (on each
    # device, then across them): up to a rounding per example. The nudged references do
    # not show it: their losses round to the same float32 (seen: tiny ResNet, data:8
    # partial-FC, 6 roundings where the nudges gave 0 and the floor 2).
    tol = np.maximum(tol, ref.want.batch * np.spacing(np.abs(want_l).astype(np.float32)))
    if np.any(np.abs(got.losses - want_l) > tol):
        failures.append(f"losses {got.losses} != {want_l} (tol {tol.max():.1e})")
    if not np.abs(want_l[-1] - want_l[0]) > 10 * tol.max():
        failures.append(f"the losses did not move: {want_l}")
    names = [n for n, _ in _named_leaves(ref.want.state)]
    zipped = zip(
        names,
        (x for _, x in _named_leaves(got.state)),
        (x for _, x in _named_leaves(ref.want.state)),
        (x for _, x in _named_leaves(ref.start)),
        zip(*[[x for _, x in _named_leaves(s.state)] for s in ref.spreads]),
        strict=True,
    )
    for name, g, w, s0, spreads in zipped:
        if g.shape != w.shape:
            failures.append(f"{name}: shape {g.shape} != {w.shape}")
            continue
        tol = _tolerance(w, spreads)
        update = np.abs(w - s0).max()
        if not tol.max() <= VISIBLE * update:
            failures.append(
                f"{name}: tolerance {tol.max():.1e} is not below {VISIBLE:.0%} of its update "
                f"{update:.1e} (the check cannot see this array)"
            )
        excess = (np.abs(g - w) / tol).max()
        if excess > 1:
            failures.append(f"{name}: differs by {excess:.1f}x its tolerance")
    return failures


def assert_parity(got: Run, ref: Reference):
    failures = parity_failures(got, ref)
    assert not failures, "not the reference's computation:\n  " + "\n  ".join(failures)


def assert_rejected(got: Run, ref: Reference, must_name: str | None = None):
    """The negative control: the parity check rejects ``got``; ``must_name`` (a regex) must
    match at least one of the arrays it names."""
    failures = parity_failures(got, ref)
    assert failures, "the parity check accepted a deliberately broken step"
    if must_name:
        assert any(re.search(must_name, f) for f in failures), failures


# --- broken optimizers: one gradient wrong, the optimizer state unchanged -------------------


def _path_str(path) -> str:
    """``('stage1_block0', 'conv1', 'kernel')``-like key path -> ``stage1_block0/conv1/kernel``."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _mutate(tx, change):
    """``tx`` with ``change(path_str, grad)`` applied to each gradient before it."""

    def update(grads, state, params=None):
        grads = jax.tree_util.tree_map_with_path(lambda p, g: change(_path_str(p), g), grads)
        return tx.update(grads, state, params)

    return optax.GradientTransformation(tx.init, update)


def zero_grads(tx, pattern: str):
    """``tx`` with the gradients of every parameter whose path (``a/b/kernel``) matches the
    regex ``pattern`` zeroed (a lost or dropped gradient, a dropped bucket)."""
    rx = re.compile(pattern)
    return _mutate(tx, lambda p, g: jnp.zeros_like(g) if rx.search(p) else g)


def roll_grads(tx, pattern: str, axis: int, shards: int):
    """``tx`` with the matching gradients rolled by one shard of ``shards`` along ``axis``:
    each device's block of that gradient lands on its neighbour (a permuted shard)."""
    rx = re.compile(pattern)

    def change(p, g):
        if not rx.search(p):
            return g
        return jnp.roll(g, g.shape[axis] // shards, axis=axis)

    return _mutate(tx, change)


class CrashAt:
    """A hook that raises after step ``k``: what a crash (or kill -9) leaves, less the kill."""

    def __init__(self, k):
        self.k = k

    def __call__(self, loop, state, metrics, stage):
        if loop.step == self.k:
            raise RuntimeError(f"crash at step {self.k}")
