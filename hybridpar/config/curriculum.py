"""Training stages: image size, batch, crop scale and momentum by epoch, and where each stage's
steps lie.

A run is one or more stages. With ``config.stages`` empty there is one stage, from
``num_epochs``, ``data.image_size``, ``global_batch`` and ``data.min_scale``. Otherwise
``config.stages`` is MoXing's notation, ``END:SIZE-BATCH[,END:SIZE-BATCH...]``: the stage
runs until epoch END at SIZE px with BATCH examples per data-parallel device (so the same
string means the same thing on 8 or 1,024 devices), e.g. ``20:128-224,38:224-224,40:288-128``.
A stage may add its own minimum crop scale after ``@`` (MoXing used 0.08, 0.087 and 0.5):
``20:128-224@0.08,38:224-224@0.087,40:288-128@0.5``; without it, ``data.min_scale``.
A stage may also set its momentum after ``~`` (after ``@SCALE`` where both are given), in
[0, 1): ``20:128-224@0.08~0.98,38:224-224~0.95,40:288-128@0.5``. Momentum is then that
value, held for the whole stage; a stage without ``~`` follows the run's own momentum
(``optim.momentum``, or its ramp from ``optim.momentum_start``). ``~`` is a delimiter like
``@``, not a letter: it cannot be read as part of the number before it (``@1e-3m0.9``), and
either suffix can stand alone (``38:224-224~0.95``). The optimizer takes the value as an
injected hyperparameter (``hybridpar/program/optim.py``), so a stage's momentum costs no recompile.

``plan_stages`` turns stages into steps once the data size is known: each stage runs whole
epochs of the full steps an epoch holds at its global batch (the input drops the last partial
batch) and a fractional end epoch ends the stage part-way through an epoch. The learning
rate and other schedules are functions of the epoch reached (``StagePlan.epoch_at``), not
of a step count under one batch, so they stay right when the batch changes. The plan also
keeps the mesh's figures it was made for (data-parallel size, axis sizes): a run's set-up
builds it once and everything after reads it. Nothing here
touches JAX's devices; ``epoch_at`` works on NumPy and traced JAX integers alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable

import numpy as np

from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import duration

_NUMBER = r"\d*\.?\d+(?:[eE]-?\d+)?"
_STAGE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*:\s*(\d+)\s*-\s*(\d+)\s*(?:@\s*(" + _NUMBER + r"))?\s*"
    r"(?:~\s*([-+]?" + _NUMBER + r"))?\s*$"  # a sign, so "~-0.5" says what is wrong with it
)
_FORM = "END_EPOCH:IMAGE_SIZE-BATCH_PER_DEVICE[@MIN_CROP_SCALE][~MOMENTUM]"
_EXAMPLE = "--config.stages=20:128-224@0.08~0.98,38:224-224,40:288-128@0.5~0.9"


@dataclasses.dataclass(frozen=True)
class Stage:
    end_epoch: float
    image_size: int
    global_batch: int
    min_scale: float
    momentum: float | None = None  # None: the run's momentum (optim.momentum or its ramp)
    per_device_batch: int | None = None  # config.stages' batch; None: global_batch's stage
    # whether the input crops at min_scale: image files do; digits and synthetic data are
    # only resized, so the plan's line does not name a scale that does nothing
    cropped: bool = True


@dataclasses.dataclass(frozen=True)
class PlannedStage:
    index: int
    stage: Stage
    start_epoch: float
    start_step: int  # global step at which the stage begins
    num_steps: int
    steps_per_epoch: int
    # the examples an epoch reads from (None: unknown, or a nominal epoch): the full steps
    # leave the last partial batch's out
    num_examples: int | None = None

    @property
    def end_step(self) -> int:
        return self.start_step + self.num_steps


def parse_stages(text: str) -> list[tuple[float, int, int, float | None]]:
    """``"20:128-224,38:224-224@0.5"`` -> ``[(20.0, 128, 224, None), (38.0, 224, 224, 0.5)]``
    (end epoch, image size, per-device batch, minimum crop scale or None for
    ``data.min_scale``). Epochs must increase; sizes and batches be positive; a scale in
    (0, 1]. A stage's ``~MOMENTUM`` is checked here too, but returned by
    ``stage_momenta`` (these tuples keep their four fields for the callers that unpack them)."""
    return [t[:4] for t in read_stages(text)]


def stage_momenta(text: str) -> list[float | None]:
    """Each stage's ``~MOMENTUM``, or None where it has none: ``"20:128-224~0.98,38:224-224"``
    -> ``[0.98, None]``. Errors as ``parse_stages``."""
    return [t[4] for t in read_stages(text)]


def read_stages(text: str) -> list[tuple[float, int, int, float | None, float | None]]:
    """The one parser of the stage string, every reader above goes through it: each
    stage's ``(end epoch, image size, per-device batch, min crop scale or None, momentum
    or None)``. A run's set-up calls it once (``stages_from_config``); its plan carries
    the result on."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _STAGE.match(part)
        if not m:
            hint = ""
            if "~" in part and "@" in part.split("~", 1)[1]:
                hint = " (@MIN_CROP_SCALE comes before ~MOMENTUM)"
            raise ConfigError(
                f"stages={text!r}: {part!r} is not {_FORM}{hint}; write e.g. {_EXAMPLE}"
            )
        end, size, batch = float(m[1]), int(m[2]), int(m[3])
        scale = None if m[4] is None else float(m[4])
        momentum = None if m[5] is None else float(m[5])
        if size <= 0 or batch <= 0 or end <= 0:
            raise ConfigError(f"stages={text!r}: {part!r} needs an epoch, size and batch > 0")
        if scale is not None and not 0 < scale <= 1:
            raise ConfigError(
                f"stages={text!r}: {part!r} has a minimum crop scale of {scale:g}; it is a "
                "fraction of the image's area in (0, 1], e.g. @0.35"
            )
        if momentum is not None and not 0 <= momentum < 1:
            raise ConfigError(
                f"stages={text!r}: {part!r} has a momentum of {momentum:g}; it must be >= 0 "
                f"and < 1, e.g. {part.split('~')[0].strip()}~0.9 (or no ~ for optim.momentum)"
            )
        if out and end <= out[-1][0]:
            raise ConfigError(
                f"stages={text!r}: end epochs must increase, but {part!r} ends at epoch "
                f"{end:g}, not after the previous stage's {out[-1][0]:g}"
            )
        out.append((end, size, batch, scale, momentum))
    if not out:
        raise ConfigError(f"stages={text!r} names no stage; leave it empty for one stage")
    return out


def stretch_stages(text: str, epochs: float) -> str:
    """``text`` with every end epoch scaled so that the last stage ends at ``epochs`` (the same
    curriculum over a longer or shorter run; sizes, batches, scales and momenta unchanged):
    ``stretch_stages("3:24-512@0.5,8:32-512", 16)`` -> ``"6:24-512@0.5,16:32-512"``."""
    ends = [t[0] for t in read_stages(text)]
    factor = epochs / ends[-1]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return ",".join(
        f"{end * factor:.12g}:{p.split(':', 1)[1].strip()}" for end, p in zip(ends, parts)
    )


def stages_from_config(config, data_parallel_size: int) -> list[Stage]:
    """The run's stages; with ``config.stages`` empty, the one stage the flat keys give."""
    d = config.data
    cropped = d.name in ("images", "tfds")  # the input pipelines that read min_scale
    if not config.stages:
        return [
            Stage(float(config.num_epochs), d.image_size, config.global_batch, d.min_scale,
                  cropped=cropped)  # fmt: skip
        ]
    return [
        Stage(
            end,
            size,
            per_device * data_parallel_size,
            d.min_scale if scale is None else scale,
            momentum,
            per_device,
            cropped,
        )
        for end, size, per_device, scale, momentum in read_stages(config.stages)
    ]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The run's plan: the config read once at set-up (``run.setup``), for everything after
    it (the program, its optimizer schedules, the input, the loop, the tools) to read
    instead of deriving it again. ``stages``: each stage in steps. ``data_parallel``: how
    many ways the run's mesh splits each batch (data x fsdp), None in a plan made without a
    mesh (``single_stage_plan``, a schedule's tests). Each stage's steps per epoch are the
    data's (the config's nominal ``data.train_examples`` for tools that compile without
    data)."""

    stages: tuple[PlannedStage, ...]
    data_parallel: int | None = None

    @property
    def total_steps(self) -> int:
        return self.stages[-1].end_step

    @property
    def num_epochs(self) -> float:
        return self.stages[-1].stage.end_epoch

    @functools.cached_property
    def _epoch_table(self) -> tuple[list, list]:
        """``(steps, epochs)`` at every stage boundary: ``epoch_at`` interpolates in it."""
        last = self.stages[-1]
        xs = [s.start_step for s in self.stages] + [self.total_steps]
        ys = [s.start_epoch for s in self.stages]
        return xs, ys + [last.start_epoch + last.num_steps / last.steps_per_epoch]

    def epoch_at(self, step):
        """Epochs completed after ``step`` steps: piecewise linear in the step, exact at
        stage boundaries. ``step`` may be a traced JAX integer (used inside the train step)."""
        xs, ys = self._epoch_table  # built once: the loop asks after every step
        if isinstance(step, (int, np.integer, float)):
            return float(np.interp(step, xs, ys))
        import jax.numpy as jnp  # traced: the schedule inside the step

        return jnp.interp(
            jnp.asarray(step, jnp.float32),
            jnp.asarray(xs, jnp.float32),
            jnp.asarray(ys, jnp.float32),
        )

    def stage_index_at(self, step):
        """The index of the stage that runs ``step`` (0-based: the step's own update), traced
        or not; past the last stage, the last."""
        bounds = [s.end_step for s in self.stages[:-1]]
        if isinstance(step, (int, np.integer)):
            return int(np.searchsorted(bounds, step, side="right"))
        import jax.numpy as jnp

        return jnp.searchsorted(jnp.asarray(bounds, jnp.int32), step, side="right")

    def samples_before(self, step: int) -> int:
        """Examples the plan trains in its first ``step`` steps (each stage's batch times
        its steps among them): a resumed checkpoint's ``samples_seen`` must equal it."""
        return sum(
            s.stage.global_batch * min(max(step - s.start_step, 0), s.num_steps)
            for s in self.stages
        )

    def batch_at(self, step):
        """The global batch of the stage that runs ``step`` (traced or not)."""
        batches = [s.stage.global_batch for s in self.stages]
        i = self.stage_index_at(step)
        if isinstance(i, int):
            return batches[i]
        import jax.numpy as jnp

        return jnp.asarray(batches, jnp.float32)[i]


# The most steps a run may plan: 200x ResNet-50's 90 ImageNet epochs at batch 256 (450,000
# steps), and far below the int32 step counter's 2**31. More is a typo (num_epochs=1e9),
# refused up front rather than noticed in an ETA of years.
MAX_STEPS = 10**8


def plan_stages(
    stages: list[Stage],
    steps_per_epoch: Callable[[int], int],
    *,
    data_parallel: int | None = None,
) -> StagePlan:
    """Steps of each stage, given the data's full steps per epoch at a global batch; the
    plan also keeps the data-parallel size the stages were made for (``stages_from_config``).
    A stage runs its epochs x steps per epoch, rounded; the first at least one step (a
    very short run still trains), a later one maybe none (``check_every_stage_trains``)."""
    planned, step, start = [], 0, 0.0
    num_examples = getattr(steps_per_epoch, "num_examples", None)  # input.datasets.EpochSteps
    for i, st in enumerate(stages):
        spe = steps_per_epoch(st.global_batch)
        if spe == 0:
            size = f" ({num_examples:,} examples)" if num_examples else ""
            raise ConfigError(
                f"stage {i}'s global batch of {st.global_batch} is more than one epoch of the "
                f"training split{size}: lower the batch (--config.global_batch, or the "
                "stage's batch per data-parallel device in --config.stages)"
            )
        steps = max(int(round((st.end_epoch - start) * spe)), 1 if i == 0 else 0)
        planned.append(PlannedStage(i, st, start, step, steps, spe, num_examples))
        step, start = step + steps, st.end_epoch
    if step > MAX_STEPS:
        raise ConfigError(
            f"the run would take {step:,} steps to epoch {start:g} ({spe:,} per epoch at "
            f"global batch {st.global_batch}), more than {MAX_STEPS:,}: at 10 ms a step "
            f"{duration(step / 100)}; lower --config.num_epochs (or the stages' end epochs)"
        )
    return StagePlan(tuple(planned), data_parallel)


def check_every_stage_trains(plan: StagePlan) -> None:
    """A stage that rounds to no step would compile its step for nothing, never train at its
    size and shift every epoch after it: an error naming the end epoch that gives it one.
    For a plan of the run's own data (the trainer's set-up): on a config's nominal
    ``data.train_examples`` (the compile tools') a short stage may have steps on the real
    data that it has none on the nominal."""
    for ps in plan.stages:
        if ps.num_steps == 0:
            st, spe = ps.stage, ps.steps_per_epoch
            raise ConfigError(
                f"stage {ps.index} (epochs {ps.start_epoch:.12g}-{st.end_epoch:.12g}, {spe} "
                f"steps an epoch at global batch {st.global_batch}) rounds to 0 steps: end it "
                f"at epoch {_one_step_end(ps.start_epoch, spe):.12g} or later to give it a "
                "step, or drop it"
            )


def _one_step_end(start: float, steps_per_epoch: int) -> float:
    """The shortest decimal end epoch after ``start`` from which ``plan_stages`` gives a
    stage one step: just past half a step's epochs (the steps are rounded), rounded up at
    the first decimal digit that gives one step, so the number said is one that works."""
    def steps(end):
        return int(round((end - start) * steps_per_epoch))

    half = start + 0.5 / steps_per_epoch
    for digits in range(13):
        unit = 10.0**-digits
        for end in (math.ceil(half / unit) * unit, (math.ceil(half / unit) + 1) * unit):
            if steps(end) == 1:
                return round(end, digits)
    return start + 1 / steps_per_epoch


def single_stage_plan(steps_per_epoch: int, total_steps: int, global_batch: int) -> StagePlan:
    """One stage of ``total_steps`` steps: for tools that compile a step without data."""
    stage = Stage(total_steps / steps_per_epoch, 0, global_batch, 0.0)
    return StagePlan((PlannedStage(0, stage, 0.0, 0, total_steps, steps_per_epoch),))


def describe(plan: StagePlan) -> str:
    """One line per stage; first, where config.stages' batches are multiplied by more than
    one data-parallel device, a line saying so and the global batches they become (a recipe
    sized for one device otherwise takes N times its batch, N times fewer steps, unnoticed)."""
    lines = []
    per = [s.stage for s in plan.stages if s.stage.per_device_batch]
    dp = (plan.data_parallel or per[0].global_batch // per[0].per_device_batch) if per else 1
    if dp > 1:
        lines.append(
            f"config.stages gives batches per data-parallel device: x{dp} here, so global "
            f"batches {', '.join(str(st.global_batch) for st in per)} "
            f"({', '.join(str(st.per_device_batch) for st in per)} a device); to keep the "
            f"global batches of one device, divide the stages' batches by {dp}"
        )
    for s in plan.stages:
        st = s.stage
        lines.append(
            f"stage {s.index}: epochs {s.start_epoch:g}-{st.end_epoch:g}, {st.image_size} px, "
            f"global batch {st.global_batch}, {s.num_steps} steps ({s.steps_per_epoch}/epoch)"
            + (f", min crop scale {st.min_scale:g}" if st.cropped else "")
            + ("" if st.momentum is None else f", momentum {st.momentum:g}")
            + _left_out(s.num_examples, s.steps_per_epoch * st.global_batch)
        )
    return "\n".join(lines)


def _left_out(num_examples: int | None, read: int) -> str:
    """'; 64 of 75 examples per epoch, ...' where an epoch's full batches leave examples
    out ('' where they read all, or the count is unknown)."""
    if not num_examples or read >= num_examples:
        return ""
    return (
        f"; {read} of {num_examples} examples per epoch (full batches only): a different "
        f"{num_examples - read} left out each epoch"
    )


__all__ = [
    "PlannedStage",
    "Stage",
    "StagePlan",
    "describe",
    "parse_stages",
    "plan_stages",
    "read_stages",
    "single_stage_plan",
    "stage_momenta",
    "stages_from_config",
]
