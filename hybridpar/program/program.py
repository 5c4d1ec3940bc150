"""From a config to the jitted train and eval steps, with nothing allocated.

``build_program`` does the model, optimizer, precision and placement part of a run, so the
training CLI and tools that only compile (``comm_report``, memory and scaling studies) build
the very same step. Shapes come from ``jax.eval_shape``; lowering uses abstract arrays.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np

from hybridpar.config.curriculum import StagePlan, plan_stages, stages_from_config
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import byte_size
from hybridpar.models import create_model
from hybridpar.models.batchnorm import bn_groups_for
from hybridpar.models.im2col import use_im2col
from hybridpar.parallel import partitioning
from hybridpar.parallel.mesh import check_divides, data_parallel_size
from hybridpar.program import compile_cache
from hybridpar.program.heads import Head, make_head
from hybridpar.program.optim import make_optimizer
from hybridpar.program.precision import LossScale, Policy, make_policy
from hybridpar.program.state import abstract_like, make_init_fn
from hybridpar.program.steps import jit_eval_step, jit_train_step, make_eval_step, make_train_step
from hybridpar.program.sync import make_sync


def rules_from_config(c, mesh, head: Head) -> partitioning.Rules:
    """The config's own rules first, then the head's (a sharded head's kernel must sit where
    its shard_map computes; the dense head has none), then the preset's."""
    own = partitioning.Rules(
        path=tuple(tuple(r) for r in c.rules), logical=tuple(tuple(r) for r in c.logical_rules)
    )
    rules = own + head.rules() + partitioning.preset_rules(c.preset, mesh)
    if c.fsdp_min_size >= 0:
        rules = dataclasses.replace(rules, fsdp_min_size=c.fsdp_min_size)
    return rules


def check_own_rules(c, abstract) -> None:
    """The config's own path rules that match no array are most likely typos: an error. Its
    logical names that no array carries get a warning (a model may not carry every name)."""
    message = partitioning.unmatched_rules(abstract, tuple(tuple(r) for r in c.rules))
    if message:
        raise ConfigError(f"partitioning.rules: {message}")
    message = partitioning.unmatched_rules(
        abstract, partitioning.Rules(logical=tuple(tuple(r) for r in c.logical_rules))
    )
    if message:
        warnings.warn(f"partitioning.logical_rules: {message}", UserWarning, stacklevel=2)


def check_batch_sizes(config, dp: int) -> None:
    """Every batch must split evenly over the ``dp`` data-parallel devices (data x fsdp) of
    the config's mesh; a curriculum's batches are per device, so they always do."""
    names = ("eval_batch",) if config.stages else ("global_batch", "eval_batch")
    for name in names:
        check_divides(config[name], dp, f"--config.{name}=", f"mesh {config.mesh!r}")


@dataclasses.dataclass
class Program:
    """What a run compiles, for any (batch, image size): the model, optimizer, precision and
    placement, and the train and eval steps built from them. Steps are compiled ahead of
    time per (batch, image size) and cached, so a curriculum's stages each compile once and
    a stage that comes back costs nothing. The steps are built from the fields, so
    ``dataclasses.replace(program, tx=other)`` is a program with other steps (the tests'
    negative controls use that)."""

    config: Any
    mesh: Any
    rules: partitioning.Rules
    policy: Policy
    model: Any
    tx: Any
    schedule: Callable  # step -> learning rate (over the run's stages)
    plan: StagePlan
    head: Head  # steps.DENSE (the model's own classifier) or a ShardedHead
    init: Callable  # rng -> boxed TrainState
    abstract: Any  # boxed abstract TrainState (logical names kept, for the placement table)
    shardings: Any  # NamedSharding tree of the (unboxed) TrainState
    channels: int
    teacher: Any = None  # a distill.Teacher (distill.teacher_workdir), or None
    # the gradient sync (sync.make_sync), made with the program: a mesh it cannot run on is
    # an error at set-up, before the run writes anything to its workdir
    sync: Any = None
    # (kind, batch, image size) -> compiled step; and one record per compilation
    _compiled: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    compiles: list = dataclasses.field(default_factory=list, init=False, repr=False)
    # (kind, batch, image size) -> future of (compiled, record), from compile_in_background
    _pending: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    _compiler: Any = dataclasses.field(default=None, init=False, repr=False)
    # key -> when a step first waited for its background compile (``wait_compiled``)
    _waiting_since: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    # XLA options for every compile of this program; the compile-only tools set a
    # target's own (targets.Target.compiler_options), a training run sets none
    compiler_options: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The first stage's image shape (the one the parameters were initialised with)."""
        size = self.plan.stages[0].stage.image_size or self.config.data.image_size
        return (size, size, self.channels)

    def abstract_state(self):
        return abstract_like(self.abstract, self.shardings)

    def abstract_batch(self, n: int, image_size: int | None = None, keys=("image", "label")):
        size = image_size or self.image_shape[0]
        specs = {
            "image": ((n, size, size, self.channels), np.uint8),
            "label": ((n,), np.int32),
            "mask": ((n,), np.float32),
        }
        return {
            k: jax.ShapeDtypeStruct(
                specs[k][0],
                specs[k][1],
                sharding=partitioning.batch_sharding(self.mesh, len(specs[k][0])),
            )
            for k in keys
        }

    @functools.cached_property
    def train_jit(self):
        """The jitted ``(state, batch) -> (state, metrics)``, old state donated."""
        extra = () if self.teacher is None else (self.teacher.shardings,)
        return jit_train_step(
            self._train_step_fn(), self.shardings, self.mesh, {"image": 4, "label": 1}, extra
        )

    @functools.cached_property
    def eval_jit(self):
        """The jitted ``(state, batch) -> sums`` of loss, top-1/5 hits and real examples."""
        step = make_eval_step(self.model, self.policy, head=self.head,
                              flip=self.config.eval_flip, **self._input_kw)  # fmt: skip
        return jit_eval_step(step, self.shardings, self.mesh, {"image": 4, "label": 1, "mask": 1})

    @property
    def _input_kw(self) -> dict:
        """What the train and eval steps both take from the config: normalisation and the
        loss's label smoothing."""
        d = self.config.data
        return {
            "mean": tuple(d.mean),
            "std": tuple(d.std),
            "label_smoothing": self.config.label_smoothing,
        }

    def _train_step_fn(self):
        return make_train_step(
            self.model,
            self.tx,
            self.policy,
            self.schedule,
            head=self.head,
            sync=self.sync,
            teacher=self.teacher,
            **self._input_kw,
        )

    def data_init(self, state, batches, images: int = 5000):
        """``state`` with the parameters the model sets from training data (``data_init``:
        airbench's whitening kernel), from the first host batches of ``batches`` until
        ``images`` images (global) are in; as it is for other models. Computed on the
        global arrays, so every process gets the same values."""
        if not hasattr(self.model, "data_init"):
            return state
        from hybridpar.program.steps import normalize

        chunks, seen = [], 0
        for host in batches:
            chunks.append(partitioning.shard_batch({"image": host["image"]}, self.mesh)["image"])
            seen += chunks[-1].shape[0]
            if seen >= images:
                break
        d = self.config.data

        def init(params, *chunks):
            x = jax.numpy.concatenate([normalize(c, d.mean, d.std, np.float32) for c in chunks])
            return self.model.data_init(params, x)

        params = jax.jit(init, out_shardings=self.shardings.params)(state.params, *chunks)
        return state.replace(params=params)

    def lower_train(self, global_batch: int, image_size: int | None = None):
        extra = () if self.teacher is None else (self.teacher.abstract,)
        return self.train_jit.lower(
            self.abstract_state(), self.abstract_batch(global_batch, image_size), *extra
        )

    def lower_eval(self, eval_batch: int, image_size: int | None = None):
        batch = self.abstract_batch(eval_batch, image_size, ("image", "label", "mask"))
        return self.eval_jit.lower(self.abstract_state(), batch)

    def train_step(self, global_batch: int, image_size: int | None = None):
        """The train step compiled for this batch and size (cached)."""
        step = self._compile("train", global_batch, image_size or self.image_shape[0])
        return step if self.teacher is None else self.teacher.bind(step)

    def eval_step(self, eval_batch: int, image_size: int | None = None):
        """The eval step compiled for this batch and size (cached)."""
        return self._compile("eval", eval_batch, image_size or self.image_shape[0])

    def compile_in_background(self, programs) -> None:
        """Starts compiling ``programs`` (``(kind, batch, image size)`` tuples, in order) in
        one background thread; ``train_step``/``eval_step`` then wait for theirs, and their
        record says how long (``wait_s``: the stall on the critical path). One thread: XLA's
        compile releases the GIL, so it runs beside the steps; concurrent lower+compile
        calls have hit JAX bugs (jax-ml/jax#11788, #16978, #32354), so one at a time, and
        the trainer starts it only once its main thread has compiled its own steps."""
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, "hybridpar-compile")
        for kind, batch, size in programs:
            key = (kind, batch, size or self.image_shape[0])
            if key not in self._compiled and key not in self._pending:
                self._pending[key] = self._compiler.submit(self._build, *key)

    @property
    def compiling(self) -> int:
        """How many programs are queued or compiling in the background."""
        return len(self._pending)

    def wait_compiled(self, timeout: float, kind: str, batch: int,
                      image_size: int | None = None) -> bool:  # fmt: skip
        """Waits up to ``timeout`` seconds for this step's background compile; False while
        it still runs. True where none is pending: ``train_step``/``eval_step`` then wait
        for no background compile (they compile on the call where nothing compiled it)."""
        key = (kind, batch, image_size or self.image_shape[0])
        future = self._pending.get(key)
        if future is None:
            return True
        self._waiting_since.setdefault(key, time.time())  # the stall starts at the first wait
        return future in concurrent.futures.wait([future], timeout).done

    def stop_background(self) -> None:
        """Drops the background compilations not yet started (a stopping run needs none).
        One already compiling runs on: the interpreter's exit waits for it (the executor's
        thread is joined there), but nothing in the run does."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler, self._pending, self._waiting_since = None, {}, {}

    def compiled_programs(self) -> dict:
        """``{(kind, batch, image size): compiled}``: every step compiled (or loaded) so far,
        in order (``hybridpar.runtime.executables`` writes them to a file)."""
        return dict(self._compiled)

    def forget(self, key: tuple) -> None:
        """Drops the compiled step for ``key`` (one that cannot run: the next call compiles
        it again)."""
        self._compiled.pop(key, None)

    def preload(self, key: tuple, compiled, load_s: float, source: str) -> None:
        """``compiled`` (an executable loaded from ``source``) as the step for ``key``
        (kind, batch, image size): that step then compiles nothing."""
        self._compiled[key] = compiled
        kind, batch, size = key
        check_fits(self, kind, batch, size, memory_of(compiled))
        self.compiles.append({
            "program": kind,
            "batch": batch,
            "image_size": size,
            "compile_s": round(load_s, 3),  # the load is what this start spent on it
            "cache_hit": False,
            "loaded_from": source,
            "memory_per_device_bytes": memory_of(compiled),
        })  # fmt: skip

    def _build(self, kind: str, batch: int, size: int):
        t0, hits = time.time(), compile_cache.hits()
        lower = self.lower_train if kind == "train" else self.lower_eval
        no_cache = compile_cache.compile_only(self.mesh.devices)
        with compile_cache.bypassed() if no_cache else contextlib.nullcontext():
            compiled = lower(batch, size).compile(self.compiler_options or None)
        memory = memory_of(compiled)
        check_fits(self, kind, batch, size, memory)  # here, not at its first step (or OOM)
        record = {
            "program": kind,
            "batch": batch,
            "image_size": size,
            "compile_s": round(time.time() - t0, 3),
            # loaded from the persistent cache (compile_cache) instead of compiled
            "cache_hit": compile_cache.hits() > hits,
            "memory_per_device_bytes": memory,
        }
        return compiled, record

    def _compile(self, kind: str, batch: int, size: int):
        key = (kind, batch, size)
        if key not in self._compiled:
            future = self._pending.pop(key, None)
            if future is None:
                compiled, record = self._build(*key)
            else:
                # from the first wait_compiled: the trainer polls it (to save on a signal
                # meanwhile) and takes the step once it is done, so the wait came before
                t0 = self._waiting_since.pop(key, time.time())
                compiled, record = future.result()
                record.update(background=True, wait_s=round(time.time() - t0, 3))
            self._compiled[key] = compiled
            self.compiles.append(record)
        return self._compiled[key]


def memory_of(compiled) -> dict:
    """One device's memory for a compiled program, in bytes, by XLA's ``memory_analysis``:
    arguments, outputs, temporaries, what is donated (aliased) and the total; ``{}`` where
    the backend does not report it.

    The total is at least the compiler's own peak, kept as ``peak`` where it is larger: the
    TPU compiler can report no temporaries (``temp`` 0) for a step whose peak is several
    times its arguments (the tiny digits step on ``tpu:v5e-8``, ``data:4,model:2``), so the
    parts' sum would understate it. The CPU's peak leaves temporaries out: the sum stands."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = dict(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        temp=m.temp_size_in_bytes,
        aliased=m.alias_size_in_bytes,
    )
    out["total"] = out["arguments"] + out["outputs"] + out["temp"] - out["aliased"]
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    if peak > out["total"]:
        out["peak"] = out["total"] = peak
    return out


def device_memory_limit(devices) -> int | None:
    """The most memory a program may use on one of ``devices`` (a mesh's), in bytes: the
    smallest ``bytes_limit`` JAX's allocator reports among this process's devices; None
    where none is reported (XLA:CPU) or the devices are only compiled for (their compiler,
    or ``hybridpar.compile``'s check, says what fits there)."""
    if compile_cache.compile_only(devices):
        return None
    limits = []
    for d in devices.flat:
        if d.process_index != jax.process_index():  # another process's: no stats here
            continue
        try:
            stats = d.memory_stats()
        except (RuntimeError, NotImplementedError):  # a backend without allocator stats
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def check_fits(program: Program, kind: str, batch: int, size: int, memory: dict) -> None:
    """A compiled step that needs more memory per device (``memory_of``'s total) than a
    device has (``device_memory_limit``) is refused, naming the stage it runs: compiled
    ahead (``compile_ahead``), that is before the first step, not an out-of-memory error
    hours in, when the stage is reached."""
    need = memory.get("total", 0)
    limit = device_memory_limit(program.mesh.devices)
    if limit is None or need <= limit:
        return
    c = program.config
    if kind == "eval":
        what = f"the eval step (eval_batch={batch}, {size} px)"
        fix = "lower --config.eval_batch"
    else:
        stages = [s for s in program.plan.stages
                  if (s.stage.global_batch, s.stage.image_size or c.data.image_size)
                  == (batch, size)]  # fmt: skip
        s = stages[0] if stages else None
        if s is None:  # a batch a tool tries that no stage runs
            what = f"the train step (global batch {batch}, {size} px)"
        else:
            per = s.stage.per_device_batch
            what = (f"stage {s.index} (epochs {s.start_epoch:g}-{s.stage.end_epoch:g}, {size} "
                    f"px, global batch {batch}" + (f", {per} a device" if per else "") + ")")
        fix = ("lower that stage's image size or batch in --config.stages" if c.stages
               else "lower --config.global_batch or --config.data.image_size")  # fmt: skip
    raise ConfigError(
        f"{what} needs {byte_size(need)} per device (XLA's count of its arguments, outputs "
        f"and temporaries) but a device here has {byte_size(limit)} (JAX's bytes_limit): "
        f"{fix}, or shard the state over more devices (e.g. --config.mesh=fsdp:-1)"
    )


def widths(m) -> dict:
    """A pruned ResNet's width options (model.stem_width, ...), only those set: the other
    models take none."""
    keys = ("stem_width", "stage_widths", "block_widths")
    return {k: m[k] for k in keys if m[k]}


def nominal_steps(config) -> Callable[[int], int]:
    """Full steps an epoch holds at a global batch, from the config's nominal
    ``data.train_examples``: the plan of a run that compiles without opening its data."""
    return lambda batch: max(config.data.train_examples // batch, 1)


def build_program(config, mesh, plan: StagePlan | None = None, teacher=None) -> Program:
    """The run's program on ``mesh``. ``plan``: the run's plan (``run.setup`` makes it once,
    from the data size); None for callers on their own (a trained run read back, a teacher),
    which get the config's stages on ``mesh`` over its nominal ``data.train_examples``. A
    plan made by hand without the data-parallel size (``single_stage_plan``) gets it here.
    ``teacher``: a distilled run's ``distill.Teacher``, whose forward pass its train step
    runs (``run.setup`` makes it; a program without one evaluates, prunes or serves as a
    teacher itself)."""
    if plan is None or plan.data_parallel is None:
        dp = data_parallel_size(mesh)
        if plan is None:
            plan = plan_stages(stages_from_config(config, dp), nominal_steps(config),
                               data_parallel=dp)  # fmt: skip
        else:
            plan = dataclasses.replace(plan, data_parallel=dp)
    head = make_head(config, mesh)
    rules = rules_from_config(config.partitioning, mesh, head)
    p = config.precision
    policy = make_policy(p.compute, p.params, p.output)
    m = config.model
    model = create_model(
        m.name,
        num_classes=config.data.num_classes,
        num_filters=m.num_filters,
        zero_init_last_bn=m.zero_init_last_bn,
        bn_momentum=m.bn_momentum,
        bn_epsilon=m.bn_epsilon,
        small_stem=m.small_stem,
        pointwise_dot=m.pointwise_dot,
        # the devices the program is for (a TPU or GPU compiled here), not this process's backend
        im2col_grad=use_im2col(m.conv_grad, mesh.devices.flat[0].platform),
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        bn_groups=bn_groups_for(m.bn_sync, plan.data_parallel),
        **widths(m),
    )
    tx, schedule = make_optimizer(config.optim, plan)
    loss_scale = LossScale.create(
        policy.needs_loss_scale, p.loss_scale_initial, p.loss_scale_period
    )
    size = plan.stages[0].stage.image_size or config.data.image_size
    init = make_init_fn(model, tx, (1, size, size, config.data.channels), loss_scale)
    abstract = jax.eval_shape(init, jax.random.key(config.seed))
    check_own_rules(config.partitioning, abstract)
    # The presets' and the head's rules may match nothing on a small model (no stage 4), and
    # a moot FSDP pass is said at set-up (run.moot_on_mesh), in the config's words.
    shardings = partitioning.infer_shardings(
        abstract, rules, mesh, unmatched="ignore", moot_fsdp="ignore"
    )
    return Program(
        config,
        mesh,
        rules,
        policy,
        model,
        tx,
        schedule,
        plan,
        head,
        init,
        abstract,
        shardings,
        config.data.channels,
        teacher,
        make_sync(config, mesh, shardings, plan.data_parallel),
    )
