"""Overhead of the data x model hybrid mesh: train-step time on ``data:4,model:2`` (8 virtual
CPU devices) versus one device, same model, optimizer, global batch and float32.

    python3 bench/mesh_overhead.py [--batch 64] [--repeats 7] [--steps 10] [--mesh data:4,model:2]

Prints a table, then one line of key=value figures (ratio first). Timings on shared machines
are noisy, so both meshes run in one process, interleaved, and we compare medians.
"""

import os

# 8 virtual CPU devices; must be set before JAX initialises (appended: ours wins).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the virtual devices are CPU devices

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hybridpar import shard_batch
from hybridpar.config import cli  # noqa: E402
from hybridpar.program.state import init_sharded  # noqa: E402
from hybridpar.runtime.run import setup  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--batch", type=int, default=64, help="global batch (both meshes)")
p.add_argument("--repeats", type=int, default=7, help="timed blocks per mesh (median over them)")
p.add_argument("--steps", type=int, default=10, help="train steps per timed block")
p.add_argument("--image-size", type=int, default=32)
p.add_argument("--channels", type=int, default=1)
p.add_argument("--mesh", default="data:4,model:2", help="the hybrid mesh (over all devices)")
args = p.parse_args()
shape = (args.image_size, args.image_size, args.channels)
DIGITS = str(Path(__file__).resolve().parents[1] / "experiments" / "digits.py")


def digits_program(mesh: str, devices=None):
    """The default main job's model and optimizer (experiments/digits.py), in float32, on
    ``mesh``, through the train CLI's own set-up (no data)."""
    cfg = cli.load(DIGITS)
    cfg.mesh, cfg.global_batch, cfg.eval_batch = mesh, args.batch, args.batch
    cfg.data.update(image_size=args.image_size, channels=args.channels)
    cfg.data.mean, cfg.data.std = (
        (cfg.data.mean[0],) * args.channels,
        (cfg.data.std[0],) * args.channels,
    )
    cfg.data.train_examples = 20 * args.batch  # a nominal schedule: 20 steps per epoch
    return setup(cfg, with_data=False, devices=devices).program


# One fixed random batch, made once on the host.
rng = np.random.default_rng(0)
host_batch = {
    "image": rng.integers(0, 256, (args.batch, *shape), dtype=np.uint8),
    "label": rng.integers(0, 10, (args.batch,), dtype=np.int32),
}

runs = {}
for name, program in (
    ("single", digits_program("data:1", jax.devices()[:1])),
    ("hybrid", digits_program(args.mesh)),
):
    mesh = program.mesh
    # Same seed on both meshes, so both start from the same parameters.
    state = init_sharded(program.init, program.shardings, jax.random.key(0))
    t0 = time.perf_counter()
    train = program.train_step(args.batch, args.image_size)
    # Sharded once, before timing: host-to-device transfer is not part of what we measure.
    batch = shard_batch(host_batch, mesh)
    state, metrics = jax.block_until_ready(train(state, batch))  # compile + first step
    compile_s = time.perf_counter() - t0
    for _ in range(3):  # warm-up steps, untimed
        state, metrics = train(state, batch)
    jax.block_until_ready(state)
    runs[name] = dict(
        mesh=mesh,
        state=state,
        train=train,
        batch=batch,
        times=[],
        compile_s=compile_s,
        metrics=metrics,
    )

# Interleaved blocks, so drifting load on the shared cores hits both meshes alike.
for _ in range(args.repeats):
    for r in runs.values():
        state, train, batch = r["state"], r["train"], r["batch"]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = train(state, batch)  # old state is donated: keep the new one
        jax.block_until_ready(state)
        r["times"].append((time.perf_counter() - t0) / args.steps * 1e3)
        r["state"], r["metrics"] = state, metrics

print(
    f"CPU cores (os.cpu_count()): {os.cpu_count()}; devices: {jax.device_count()} "
    f"{jax.devices()[0].platform}; batch {args.batch}; image {shape}; "
    f"{args.repeats} x {args.steps} steps per mesh"
)
print(
    f"{'mesh':<22} {'devices':>7} {'median ms':>10} {'min ms':>8} {'max ms':>8} "
    f"{'images/s':>9} {'compile s':>9} {'last loss':>9}"
)
med = {}
for name, r in runs.items():
    spec = ",".join(f"{a}:{n}" for a, n in r["mesh"].shape.items() if n > 1) or "data:1"
    med[name] = statistics.median(r["times"])
    print(
        f"{name + ' ' + spec:<22} {r['mesh'].size:>7} {med[name]:>10.2f} {min(r['times']):>8.2f} "
        f"{max(r['times']):>8.2f} {args.batch / med[name] * 1e3:>9.1f} {r['compile_s']:>9.1f} "
        f"{float(r['metrics']['loss']):>9.4f}"
    )  # same steps, same data: losses should agree
print(
    f"ratio_hybrid_vs_single={med['hybrid'] / med['single']:.3f} hybrid_ms={med['hybrid']:.2f} "
    f"single_ms={med['single']:.2f} batch={args.batch} mesh={args.mesh} "
    f"devices={runs['hybrid']['mesh'].size} repeats={args.repeats} steps={args.steps} "
    f"cpu_cores={os.cpu_count()}"
)
