"""Overhead of the data x model hybrid mesh: train-step time on ``data:4,model:2`` (8 virtual
CPU devices) versus one device, same model, optimizer, global batch and float32.

    python3 bench/mesh_overhead.py [--batch 64] [--repeats 7] [--steps 10] [--mesh data:4,model:2]

Prints a table, then one line of key=value figures (ratio first). Timings on shared machines
are noisy, so both meshes run in one process, interleaved, and we compare medians. A bad
flag (a count under 1, a mesh that does not fit the 8 devices, a batch that does not split
over the mesh's data-parallel devices): one ``error:`` line, exit code 2, before anything
compiles.
"""

import os
import statistics
import time
from pathlib import Path

from hybridpar.config import cli  # JAX-free: a bad flag is refused before JAX loads
from hybridpar.config.errors import ConfigError
from hybridpar.simulate.cli import count

DEVICES = 8  # virtual CPU devices
DIGITS = str(Path(__file__).resolve().parents[1] / "experiments" / "digits.py")
SUMMARY = (
    "Train-step time of a data x model hybrid mesh (default data:4,model:2 over 8 virtual "
    "CPU devices) against one device: same model, optimizer, global batch and float32."
)


def parse_args(argv=None):
    p = cli.ArgumentParser("python bench/mesh_overhead.py", SUMMARY, takes_config=False)
    p.add_argument("--batch", type=count("a global batch", "64"), default=64,
                   help="global batch (both meshes)")  # fmt: skip
    p.add_argument("--repeats", type=count("a number of timed blocks", "7"), default=7,
                   help="timed blocks per mesh (median over them)")  # fmt: skip
    p.add_argument("--steps", type=count("a number of steps", "10"), default=10,
                   help="train steps per timed block")  # fmt: skip
    p.add_argument("--image-size", type=count("an image side in px", "32"), default=32)
    p.add_argument("--channels", type=count("a number of channels", "1"), default=1)
    p.add_argument("--mesh", default="data:4,model:2", help="the hybrid mesh (over all devices)")
    return p.parse_args(argv)


def check_mesh(args, devices: int, platform: str) -> None:
    """``--mesh`` must fit the devices and ``--batch`` split over its data-parallel devices:
    one ``error:`` line naming the flag now, not a traceback after the first compile."""
    from hybridpar.parallel.mesh import check_divides, parse_mesh_spec

    example = "data:4,model:2" if devices == DEVICES else "data:-1"
    try:
        sizes = parse_mesh_spec(args.mesh, devices, platform)
    except ConfigError as e:
        # the first clause says what is wrong; the rest names the trainer's flags, not ours
        cli.fail(f"--mesh {args.mesh}: {str(e).split(';')[0]}; give axes whose sizes multiply "
                 f"to the {devices} devices here, e.g. --mesh {example}")  # fmt: skip
    try:
        check_divides(args.batch, sizes["data"] * sizes["fsdp"], "--batch ", f"--mesh {args.mesh}")
    except ConfigError as e:
        cli.fail(str(e))


def digits_program(args, mesh: str, devices=None):
    """The default main job's model and optimizer (experiments/digits.py), in float32, on
    ``mesh``, through the train CLI's own set-up (no data)."""
    from hybridpar.runtime.run import setup

    cfg = cli.load(DIGITS)
    cfg.mesh, cfg.global_batch, cfg.eval_batch = mesh, args.batch, args.batch
    cfg.data.update(image_size=args.image_size, channels=args.channels)
    cfg.data.mean, cfg.data.std = (
        (cfg.data.mean[0],) * args.channels,
        (cfg.data.std[0],) * args.channels,
    )
    cfg.data.train_examples = 20 * args.batch  # a nominal schedule: 20 steps per epoch
    return setup(cfg, with_data=False, devices=devices).program


def main(argv=None):
    args = parse_args(argv)
    # 8 virtual CPU devices; must be set before JAX initialises (appended: ours wins).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the virtual devices are CPU devices

    import jax
    import numpy as np

    from hybridpar import shard_batch
    from hybridpar.program.state import init_sharded

    check_mesh(args, jax.device_count(), jax.devices()[0].platform)
    shape = (args.image_size, args.image_size, args.channels)

    # One fixed random batch, made once on the host.
    rng = np.random.default_rng(0)
    host_batch = {
        "image": rng.integers(0, 256, (args.batch, *shape), dtype=np.uint8),
        "label": rng.integers(0, 10, (args.batch,), dtype=np.int32),
    }

    runs = {}
    for name, program in (
        ("single", digits_program(args, "data:1", jax.devices()[:1])),
        ("hybrid", digits_program(args, args.mesh)),
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
            f"{name + ' ' + spec:<22} {r['mesh'].size:>7} {med[name]:>10.2f} "
            f"{min(r['times']):>8.2f} {max(r['times']):>8.2f} "
            f"{args.batch / med[name] * 1e3:>9.1f} {r['compile_s']:>9.1f} "
            f"{float(r['metrics']['loss']):>9.4f}"
        )  # same steps, same data: losses should agree
    print(
        f"ratio_hybrid_vs_single={med['hybrid'] / med['single']:.3f} hybrid_ms={med['hybrid']:.2f} "
        f"single_ms={med['single']:.2f} batch={args.batch} mesh={args.mesh} "
        f"devices={runs['hybrid']['mesh'].size} repeats={args.repeats} steps={args.steps} "
        f"cpu_cores={os.cpu_count()}"
    )


if __name__ == "__main__":
    cli.main(main)  # a ConfigError from the set-up: one error: line
