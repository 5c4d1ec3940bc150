"""The per-step floor of the scaling model (``hybridpar.simulate.hardware.STEP_FLOOR_S``): how
long the host takes to dispatch one jitted train step over a train state of ResNet-50's
number of arrays, when the step itself computes next to nothing. The floor wanted is an
accelerator host's: the step runs on the machine's accelerator where it has one, else on the
CPU (``cli.cpu_when_no_accelerator``); ``JAX_PLATFORMS`` picks another. The last line names
the device it ran on.

    python bench/step_floor.py [--arrays 428] [--steps 200] [--repeats 5]

428 arrays: ResNet-50's 161 parameters, their 161 momentum buffers and 106 BatchNorm
statistics. Prints each repeat's microseconds per step, then ``floor_us=`` (the fastest).
A count under 1: one ``error:`` line, exit code 2. Measured figures:
``bench/results/step_floor/NOTES.md``.
"""

import argparse
import time

from hybridpar.config import cli  # JAX-free: a bad flag is refused before JAX loads


def positive_int(text: str) -> int:
    """``type=`` of the counts: a whole number >= 1 (0 steps or repeats time nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


SUMMARY = (
    "The scaling model's per-step floor: how long the host takes to dispatch one jitted train "
    "step over ResNet-50's number of arrays when the step computes next to nothing. Runs on "
    "the machine's accelerator, or the CPU where it has none (JAX_PLATFORMS picks another)."
)
p = cli.ArgumentParser("python bench/step_floor.py", SUMMARY, takes_config=False)
p.add_argument("--arrays", type=positive_int, default=161 + 161 + 106,
               help="arrays in the train state (ResNet-50's: 428)")  # fmt: skip
p.add_argument("--steps", type=positive_int, default=200, help="steps per repeat")
p.add_argument("--repeats", type=positive_int, default=5, help="timed repeats (the fastest)")
args = p.parse_args()

# The accelerator where there is one (a GPU or TPU host's floor is the one wanted); the CPU,
# without libtpu's warnings, where there is none.
cli.cpu_when_no_accelerator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

state = [jnp.zeros((4,), jnp.float32) for _ in range(args.arrays)]
batch = jnp.zeros((8, 4), jnp.float32)


@jax.jit
def step(state, batch):
    s = batch.sum()
    return [x + s for x in state], s


state, s = step(state, batch)
s.block_until_ready()
times = []
for _ in range(args.repeats):
    t = time.perf_counter()
    for _ in range(args.steps):
        state, s = step(state, batch)  # dispatched asynchronously, as a training loop does
    s.block_until_ready()
    times.append((time.perf_counter() - t) / args.steps * 1e6)
    print(f"{times[-1]:.0f} us per step")
print(f"floor_us={min(times):.0f} arrays={args.arrays} device={jax.devices()[0].platform}")
