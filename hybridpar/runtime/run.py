"""A run built and inspected: everything before the first step, shared by every tool.

    run = setup(config, workdir)   # config -> mesh and rules -> data -> program (shardings)

``setup`` is the one set-up sequence every tool shares (the train CLI, the evaluator,
comm_report, compile, quantize, tune, the benches): check the config, set XLA's flags before
the backend starts, build the mesh, check the batches against it, open the data (optional:
compile-only tools skip it), plan the stages in steps and build the program. Beside it: the
evaluation pass (``evaluate``), the per-device memory report and process-0 logging. The
loop that trains a run is ``hybridpar/runtime/trainer.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time

import jax

from hybridpar.config.curriculum import (
    PlannedStage,
    Stage,
    StagePlan,
    check_every_stage_trains,
    plan_stages,
    stages_from_config,
)
from hybridpar.config.errors import ClassCountError
from hybridpar.config.schema import eval_split_of, top5_says_nothing, unused_settings, validate
from hybridpar.parallel import comm, distributed
from hybridpar.parallel.mesh import data_parallel_size, make_mesh
from hybridpar.parallel.partitioning import PRESETS
from hybridpar.program import compile_cache
from hybridpar.program.program import (
    Program,
    build_program,
    check_batch_sizes,
    memory_of,
    nominal_steps,
)
from hybridpar.runtime import (
    checkpoint,
    checkpoint_dirs,
    executables,
    run_config,
    run_records,
    signals,
    workdir_lock,
)
from hybridpar.runtime.distill import make_teacher
from hybridpar.runtime.metrics import MetricsWriter


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


# ---- Set-up ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    config: object
    workdir: str | None
    mesh: object
    program: Program
    plan: StagePlan
    data: object | None  # hybridpar.input.datasets.Data; None for compile-only tools
    start_time: float
    xla_flags: list  # the comm section's flags this process set (yours in XLA_FLAGS win)
    finished: dict | None = None  # the summary of the workdir's run, if it completed
    lock: workdir_lock.Lock | None = None  # the workdir's, held until train() ends
    init_from: object | None = None  # trained.init_source: the run a new state starts from


def check_workdir(workdir: str) -> None:
    checkpoint.ensure_writable(workdir, "workdir", "pass a --workdir you can write to")


def setup(config, workdir: str | None = None, *, for_training: bool = True, **kwargs) -> Run:
    """``_setup``, which leaves no empty directory behind when it stops on a mistake found
    after the directory checks (a mesh larger than the devices, data that does not match
    the config): the workdir, checkpoint and compile-cache directories it created are
    removed again while still empty."""
    validate(config, sources=for_training)  # first: the paths below come from the config
    made = [] if workdir is None else missing_dirs(workdir)
    for path in (
        workdir and checkpoint.checkpoint_dir(config, workdir),
        compile_cache.resolve(config.compile_cache, workdir),
    ):
        made += missing_dirs(path) if path else []
    locks = []  # the workdir lock _setup took: released here if it then fails
    try:
        return _setup(config, workdir, locks=locks, for_training=for_training, **kwargs)
    except BaseException:
        for lock in locks:
            lock.release()
        remove_made(made)
        raise


def _setup(
    config,
    workdir: str | None = None,
    *,
    with_data: bool = True,
    devices=None,
    allow_config_change: bool = False,
    locks: list | None = None,
    compiled: str | None = None,
    recompile: bool = False,
    for_training: bool = True,
    tune_folder: str | None = None,
    reads: str | None = None,
) -> Run:
    """Everything before the first step, in the order data flows; every check that needs no
    device comes first (``validate``, in ``setup``, then what the workdir holds), so a bad
    value stops before data or devices are touched (in a distributed run, after the processes
    joined and compared their configs). ``devices``: the mesh's devices (default: all).
    ``allow_config_change``: resume a workdir's run with a config that differs from its own.
    ``compiled``: a file of executables (``hybridpar.compile --out``) the steps load instead
    of compiling; one that does not fit the run is an error, or with ``recompile`` a warning.
    ``tune_folder``: the kind of tune folder (``run_config.tune_files``) the caller sets a
    run up in, its own (tune lr's test): any other kind is refused as not a run's folder.
    ``for_training``: False for tools that never train (the evaluator, quantize): a run's
    ``init_from`` and distillation teacher need not be there any more. ``reads``: the workdir
    of the trained run a tool reads the checkpoints of (the evaluator, quantize): the data
    must have the classes that run trained on, as for a distillation teacher's run."""
    start = time.time()
    finished = held = None
    if config.distributed:
        # Joined first and the configs compared, before the workdir's checks: a process
        # with other overrides stopped alone in check_run, and the others waited for it
        # until distributed_timeout_s, then blamed joining. Now every process names the key.
        flags = comm.apply(config.comm)  # XLA's collective flags: before the backend starts
        distributed.initialize(config)
        if workdir is not None:
            check_workdir(workdir)  # the folder process 0 writes its check file into
        run_config.check_processes_agree(config, workdir, allow_config_change)
    if workdir is not None:
        ckpt = checkpoint.checkpoint_dir(config, workdir)
        if os.path.isdir(workdir):
            run_config.check_not_tune(workdir, tune_folder)  # tune's: no run of ours in it
            # moved checkpoints first: without them check_run would compare with config.json
            checkpoint.check_not_moved(workdir, ckpt)
        # a workdir not made yet too, where checkpoint.dir lies outside it and may hold a
        # run (its config compared); a file, or a path through one: check_workdir says so
        if os.path.isdir(workdir) or (
            not os.path.lexists(workdir) and checkpoint_dirs.outside(ckpt, workdir)
        ):
            checkpoint.check_owner(workdir, ckpt)  # first: another run's, whatever its config
            finished = run_config.check_run(workdir, config, allow_config_change)
        check_workdir(workdir)
        checkpoint.check_dir(ckpt)
        with_data = with_data and finished is None  # nothing to train: no data to open
        held = run_config.held_config(ckpt) if finished is None else None
        if held is not None:  # a stop in set-up says the run resumes there, not from 0
            signals.note_resume(held[0], ckpt)
    if not config.distributed:
        flags = comm.apply(config.comm)  # XLA's collective flags: before the backend starts
    if for_training and finished is None:
        warn_schedule(config)
        for unused in unused_settings(config):  # not an error: see its docstring
            log(f"warning: {unused}")
        warn_splits(config)
    lock = None
    if workdir is not None:  # one trainer per workdir; each process its own lock file
        lock = workdir_lock.acquire(workdir, jax.process_index() if config.distributed else 0)
        if locks is not None:
            locks.append(lock)
    cache_dir = compile_cache.resolve(config.compile_cache, workdir)
    if cache_dir is not None:  # checked now; enabled once the --compiled file is (below)
        fix = 'pass --config.compile_cache=DIR you can write, or ""'
        checkpoint.ensure_writable(cache_dir, "compile cache directory", fix)

    # ---- Mesh and placement rules ----
    mesh = make_mesh(config.mesh, devices=devices)
    if for_training and finished is None:
        for moot in moot_on_mesh(config, mesh):
            log(f"warning: {moot}")
    # The config read once into the plan's figures: everything after reads them from the
    # plan (run.plan, program.plan), never from config.stages or the mesh again.
    dp = data_parallel_size(mesh)
    check_batch_sizes(config, dp)
    stages = stages_from_config(config, dp)
    if workdir is not None and not allow_config_change:  # resumed on another mesh?
        run_config.check_batches(workdir, config, stages, dp)

    # ---- Data: host-local batches, and so the steps each stage runs ----
    data, steps_for = None, nominal_steps(config)  # compile-only: the nominal split
    if with_data:
        # the runs whose checkpoints meet this data: their outputs are labels of their classes
        trained_runs = [reads] if reads else []
        if for_training and config.distill.teacher_workdir:
            trained_runs.append(config.distill.teacher_workdir)
        # a resume's checkpoint learned the classes of the run's last start
        resumes = (workdir, held[0], ckpt) if for_training and held is not None else None
        data = open_data(config, mesh, stages, trained_runs, resumes)
        steps_for = data.steps_for
    plan = plan_stages(stages, steps_for, data_parallel=dp)
    if data is not None:
        check_every_stage_trains(plan)

    # ---- Model, optimizer, precision and shardings (nothing allocated yet) ----
    teacher = make_teacher(config, mesh) if for_training else None
    program = build_program(config, mesh, plan, teacher)
    source = None  # checked here, before anything is written, where a new state needs it
    if for_training and finished is None and config.init_from and workdir is not None:
        if not checkpoint.committed_steps(ckpt):
            from hybridpar.runtime.trained import init_source

            source = init_source(config.init_from, program)
    if compiled and finished is None:  # a finished run runs no step
        executables.load(compiled, program, recompile)
    # Only now, the --compiled file checked: the set-up above compiles a few small programs
    # (a random key's seed, ...) that the cache would keep, and a refused file must leave
    # the workdir as it was. Still before the steps' first compilation: each is cached.
    if cache_dir is not None:
        compile_cache.enable(cache_dir)
    if for_training and finished is None and workdir is not None:  # accepted: it writes there
        checkpoint.claim(workdir, ckpt)
    return Run(config, workdir, mesh, program, program.plan, data, start, flags, finished, lock,
               source)  # fmt: skip


def moot_on_mesh(config, mesh) -> list[str]:
    """What ``config`` asks for that ``mesh`` leaves with nothing to do: one sentence each,
    for set-up's warnings (a run there trains, as the default would)."""
    sizes = dict(mesh.shape)
    where = ",".join(f"{a}:{n}" for a, n in sizes.items())
    out = []
    if config.model.head == "sharded" and sizes.get("model", 1) == 1:
        out.append(
            f"model.head='sharded' splits the classes over the model axis, which has one "
            f"device on mesh {where}: it does the dense head's work; add a model axis, e.g. "
            "--config.mesh=data:-1,model:2, or use --config.model.head=dense"
        )
    preset = PRESETS.get(config.partitioning.preset)  # "auto" follows the mesh: never moot
    axis = next((a for a in preset.axes() if sizes.get(a, 1) == 1), None) if preset else None
    if axis:
        out.append(
            f"partitioning.preset={config.partitioning.preset!r} splits parameters over the "
            f"{axis} axis, which has one device on mesh {where}: it places them as 'data' "
            f"does; add a {axis} axis, e.g. --config.mesh=data:-1,{axis}:2, or drop "
            "--config.partitioning.preset"
        )
    if config.partitioning.fsdp_min_size >= 0 and sizes.get("fsdp", 1) == 1 and axis != "fsdp":
        out.append(
            f"partitioning.fsdp_min_size={config.partitioning.fsdp_min_size} splits large "
            f"arrays over the fsdp axis, which has one device on mesh {where}: nothing is "
            "split; add an fsdp axis, e.g. --config.mesh=data:-1,fsdp:2, or drop "
            "--config.partitioning.fsdp_min_size"
        )
    if config.comm.mode in ("bucketed", "overlap") and data_parallel_size(mesh) == 1:
        out.append(
            f"comm.mode={config.comm.mode!r} reduces gradients across data-parallel devices, "
            f"and mesh {where} has one: there is nothing to reduce; drop --config.comm.mode"
        )
    return out


def open_data(config, mesh, stages: list[Stage], trained_runs=(), resumes=None):
    """The run's ``datasets.Data``; an on-device set is stored at the image sizes of
    ``stages`` (the plan's), not those of the config's stage string read again.
    ``trained_runs``: the workdirs of trained runs whose checkpoints read this data (the
    one a tool reads, a distillation teacher): it must have the classes each trained on
    (``trained.check_classes``). ``resumes``: (workdir, step, checkpoint dir) of the
    checkpoint a resume restores. A class folder added or removed since either is said as
    that, first, not as a data.num_classes to set: the checkpoint has the old count (the
    trainer checks a renamed one, whose count is the same, once the data is open)."""
    from hybridpar.input.datasets import make_data  # TensorFlow only where data is read
    from hybridpar.input.prepare import remove_partial_files
    from hybridpar.runtime import trained

    sizes = sorted({s.image_size for s in stages})
    # A stop before the first step ends the process at once (EarlyStop): a first-use
    # prepare's staging copy (as large as a compressed tar's data) goes with it.
    forget = signals.on_early_stop(remove_partial_files)
    try:
        data = make_data(config, jax.process_index(), jax.process_count(), mesh, sizes)
    except ClassCountError as e:
        for workdir in trained_runs:  # its count was the run's: its classes changed since
            trained.check_classes(workdir, {"classes": e.classes})
        if resumes is not None:
            workdir, step, ckpt = resumes
            recs, _ = run_records.read_records(os.path.join(workdir, "metrics.jsonl"))
            run_records.check_same_classes(run_records.last_data(recs), {"classes": e.classes},
                                           step, ckpt)  # fmt: skip
        raise
    finally:
        forget()
    for workdir in trained_runs:
        trained.check_classes(workdir, data.info)
    return data


def warn_schedule(config) -> None:
    """A warmup as long as the run or longer is cut to the run (``schedules.lr_factor``): the
    LR only rises. A warning, not an error: a recipe shortened for a smoke test or a timing
    (``--config.num_epochs=0.1``) does that on purpose."""
    o, epochs = config.optim, config.num_epochs
    if o.warmup_epochs > 0 and o.warmup_epochs >= epochs:
        log(
            f"warning: optim.warmup_epochs={o.warmup_epochs:g} is not shorter than the run "
            f"(num_epochs={epochs:g}): the LR rises for the whole run, reaches optim.base_lr "
            f"only at its last step and never decays; set e.g. "
            f"--config.optim.warmup_epochs={epochs / 10:.3g} (or more num_epochs)"
        )


def warn_splits(config) -> None:
    """An evaluation on images the run trains on reports a top-1 that is no held-out
    accuracy (a copied recipe with ``data.train_split=test`` did, without a word). A
    warning, not an error: a memorisation check may do it on purpose."""
    d = config.data
    if d.name in ("images", "tfds") and splits_overlap(d.train_split, d.eval_split):
        log(
            f"warning: data.train_split={d.train_split!r} and data.eval_split="
            f"{d.eval_split!r} share images: the evaluation sees training images, so its "
            "top-1 is not a held-out accuracy; set --config.data.eval_split to a split the "
            "run does not train on"
        )


def splits_overlap(a: str, b: str) -> bool:
    """Whether splits ``a`` and ``b`` share examples, as far as their names tell: the same
    name, or in tfds' syntax (``train``, ``train[:90%]``, ``train[100:200]``, ``a+b``) one
    split whole in one and any part of it in the other, or slices of one split in the same
    unit that intersect. Slices that cannot be compared so (negative, mixed units) count as
    apart."""
    if a.strip() == b.strip():
        return True
    return any(_parts_overlap(p, q) for p in _split_parts(a) for q in _split_parts(b))


def _split_parts(split: str) -> list[tuple[str, str | None]]:
    """``(name, slice text or None)`` of each ``+``-joined part of a split that reads so."""
    parts = [re.fullmatch(r"\s*([^\[\]]+?)\s*(?:\[([^\]]*)\])?\s*", p) for p in split.split("+")]
    return [m.groups() for m in parts if m]


def _parts_overlap(p: tuple, q: tuple) -> bool:
    if p[0] != q[0]:
        return False
    if p[1] is None or q[1] is None:  # one of them is the whole split
        return True
    a, b = _interval(p[1]), _interval(q[1])
    if a is None or b is None or (None not in (a[2], b[2]) and a[2] != b[2]):
        return False  # not comparable from the strings
    return max(a[0], b[0]) < min(a[1], b[1])


def _interval(text: str) -> tuple | None:
    """A slice ``LO:HI`` (``%`` on either: percent) as ``(lo, hi, unit)``, the unit ``"%"``,
    ``""`` (examples) or None (neither end given); None where it reads otherwise."""
    m = re.fullmatch(r"\s*(\d*)\s*(%?)\s*:\s*(\d*)\s*(%?)\s*", text)
    if m is None:
        return None
    lo, lo_unit, hi, hi_unit = m.groups()
    units = {u for n, u in ((lo, lo_unit), (hi, hi_unit)) if n}
    if len(units) > 1:
        return None
    return int(lo or 0), int(hi) if hi else math.inf, units.pop() if units else None


def missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, the deepest first."""
    out, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def remove_made(dirs, files=()) -> None:
    """Undo what a command wrote before it refused its input: ``files`` it wrote, then the
    folders it made (``missing_dirs``), the deepest first, each only while empty."""
    for path in files:
        with contextlib.suppress(OSError):  # another process's removal came first
            os.remove(path)
    for path in sorted(set(dirs), key=len, reverse=True):
        with contextlib.suppress(OSError):  # not empty: something else is there now
            os.rmdir(path)


def memory_line(compiled) -> tuple[str, dict]:
    """``(text, memory_of(compiled))``: one device's memory for a compiled train step."""
    mem = memory_of(compiled)
    return f"per-device memory of the train step: {memory_text(mem)}", mem


def memory_text(mem: dict) -> str:
    if not mem:
        return "not reported by this backend"
    mib = {k: v / 2**20 for k, v in mem.items()}
    parts = (
        "arguments {arguments:.1f}, outputs {outputs:.1f}, temp {temp:.1f}, "
        "donated/aliased {aliased:.1f}".format(**mib)
    )
    if "peak" in mem:  # memory_of: the parts' sum fell short of the compiler's peak
        total = mib["arguments"] + mib["outputs"] + mib["temp"] - mib["aliased"]
        return f"{mib['peak']:.1f} MiB, the compiler's peak (the parts sum to {total:.1f}: {parts})"
    return "{total:.1f} MiB ({parts})".format(total=mib["total"], parts=parts)


def program_name(rec: dict) -> str:
    return f"{rec['program']} step (batch {rec['batch']}, {rec['image_size']} px)"


def memory_report(records: list) -> tuple[str, dict]:
    """The pre-flight memory line over every compiled program (each stage's train step and
    the eval step): the largest named first, since that is what must fit, then the others.
    Returns ``(text, the largest's memory)``."""
    known = [r for r in records if r.get("memory_per_device_bytes")]
    if not known:
        return "per-device memory: not reported by this backend", {}
    known.sort(key=lambda r: r["memory_per_device_bytes"]["total"], reverse=True)
    largest, *rest = known
    mem = largest["memory_per_device_bytes"]
    text = f"per-device memory, largest of {len(known)} programs: {program_name(largest)} "
    text += memory_text(mem)
    if rest:
        others = ", ".join(
            f"{program_name(r)} {r['memory_per_device_bytes']['total'] / 2**20:.1f} MiB"
            for r in rest
        )
        text += f"; then {others}"
    return text, dict(mem, program=program_name(largest))


# ---- Evaluation ---------------------------------------------------------------------------------


def eval_line(rec: dict, num_classes: int) -> str:
    """An eval record as the log says it; top-5 left out where it is 1 by construction
    (``top5_says_nothing``: 5 classes or fewer)."""
    top5 = "" if top5_says_nothing(num_classes) else f"  top5 {rec['top5']:.4f}"
    return (
        f"eval  step {rec['step']:>6}  epoch {rec['epoch']:6.2f}  loss {rec['loss']:.4f}  "
        f"top1 {rec['top1']:.4f}{top5}  ({rec['examples']} examples)"
    )


def eval_pass(run: Run, state, step: int, writer: MetricsWriter) -> dict:
    """One pass over the whole eval split at ``data.image_size`` (padded batches, every
    example once), written as an ``eval`` event: the trainer's in-loop and final evaluations
    and the evaluator's, of each checkpoint, are this."""
    from hybridpar.input.prefetch import prefetch_to_mesh

    c = run.config
    eval_step = run.program.eval_step(c.eval_batch, c.data.image_size)
    sums = None
    for batch in prefetch_to_mesh(run.data.eval_batches(), run.mesh, c.data.prefetch):
        out = eval_step(state, batch)
        sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
    sums = jax.device_get(sums)
    n = float(sums["count"])
    if round(n) != run.data.num_eval:
        raise AssertionError(f"eval counted {n} examples, expected {run.data.num_eval}")
    epoch = run.plan.epoch_at(step)
    rec = writer.write(
        "eval",
        step,
        epoch,
        split=eval_split_of(c.data),
        loss=float(sums["loss_sum"]) / n,
        top1=float(sums["top1_sum"]) / n,
        top5=float(sums["top5_sum"]) / n,
        examples=int(n),
    )
    log(eval_line(rec, c.data.num_classes))
    return rec


@dataclasses.dataclass
class LoopState:
    """Everything a resumed run needs besides the train state: where the loop is (step,
    stage, data position as epoch and step within it), what it has seen, and the eval and
    time-to-target bookkeeping. Plain values, so a checkpoint can hold it as JSON."""

    step: int = 0
    stage: int = 0
    epoch: int = 0  # the epoch the next batch comes from
    step_in_epoch: int = 0  # and its index in that epoch (at the stage's batch)
    samples_seen: int = 0
    seed: int = 0  # the data order is a function of (seed, epoch, step)
    last_eval: dict | None = None
    best_eval: dict | None = None
    time_to_target: dict | None = None  # {"top1": {...}, "top5": {...}} once reached
    compile_s: float = 0.0  # compilation time of every segment so far
    train_time_s: float = 0.0  # time in steps, evaluation excluded (for images/s)
    train_images: int = 0
    skipped_steps: int = 0  # steps with a non-finite loss or gradient, which changed nothing
    wall_s: float = 0.0  # the run's wall time at the last checkpoint (continued on resume)
    time_parts: dict = dataclasses.field(default_factory=dict)  # trainer.Clock's, at wall_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopState":
        return cls(**d)

    def enter(self, stage: PlannedStage) -> None:
        """Move the data position to where ``stage`` begins (unless already inside it)."""
        if self.step == stage.start_step:
            self.stage = stage.index
            self.epoch, self.step_in_epoch = start_position(stage)

    def advance(self, stage: PlannedStage) -> None:
        self.step += 1
        self.samples_seen += stage.stage.global_batch
        self.step_in_epoch += 1
        if self.step_in_epoch == stage.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0


def start_position(stage: PlannedStage) -> tuple[int, int]:
    """``(epoch, step in that epoch)`` where ``stage`` begins."""
    epoch = math.floor(stage.start_epoch + 1e-9)
    return epoch, int(round((stage.start_epoch - epoch) * stage.steps_per_epoch))


def programs_of(run) -> list[tuple[str, int, int]]:
    """``(program, global batch, image size)`` of every program a run compiles: each
    stage's train step, then the eval step; each once (the compile tool's and comm_report's)."""
    c = run.config
    wanted = [("train", s.stage.global_batch, s.stage.image_size) for s in run.plan.stages]
    wanted.append(("eval", c.eval_batch, c.data.image_size))
    return list(dict.fromkeys(wanted))


def check_epoch(run) -> None:
    """A stage whose global batch is more than one epoch of the training split, or that
    rounds to no step, is the trainer's error (``plan_stages`` and
    ``check_every_stage_trains``, from the data's steps per epoch; synthetic data's
    ``DataError`` at its first batch); the same error here, before minutes of compiling,
    where the split's size is known without the data (digits' own, synthetic's
    ``data.train_examples``). Elsewhere ``data.train_examples`` is only nominal: a folder
    of images may hold far more than its default, so nothing is checked."""
    n = executables.data_size(run.config)
    if n is None and run.config.data.name != "synthetic":
        return
    n = n or run.config.data.train_examples
    check_every_stage_trains(plan_stages([s.stage for s in run.plan.stages], lambda b: n // b))
