"""A trained run read back: its config (the one its latest checkpoint holds), its program
and variables on a mesh (``TrainedRun``), and a new run's state started from its weights
(``init_from``). The one reader of a run: the tools (evaluate, quantize, prune, compress),
the distillation teacher and the trainer's ``init_from`` read it here.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import Mesh

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import from_saved, validate
from hybridpar.parallel.mesh import data_parallel_size, make_mesh
from hybridpar.parallel.partitioning import batch_sharding, replicated
from hybridpar.program.program import build_program
from hybridpar.program.steps import FlipAveraged, logits_in, normalize
from hybridpar.runtime import checkpoint, checkpoint_dirs, run_config, run_records


def load_config(workdir: str, overrides=(), caller: str | None = None):
    """The config of the run in ``workdir``, its latest checkpoint's (else its
    ``config.json``'s), with ``overrides`` applied: what the tools that read a run use
    without ``--config``. They run in one process, so ``distributed`` is off unless an
    override sets it. ``caller``: the library call that reads the run (``TrainedRun``),
    whose arguments the errors name in place of the tools' flags."""
    path = os.path.join(workdir, "config.json")
    made = "python -m hybridpar.train writes its config there when it starts"
    if caller:  # a library call: its arguments, not the tools' flags
        missing = unread = (
            f"give {caller} the workdir of a training run ({made}), or its config as config= "
            "(e.g. hybridpar.config.schema.load_config('experiments/NAME.py'))"
        )
    else:
        missing = f"pass the --workdir of a training run ({made}), or --config experiments/NAME.py"
        unread = "pass --config experiments/NAME.py"
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no {path}: {missing}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path!r} ({e}): {unread}") from None
    config = from_saved(saved, path)
    # the run's truth is its latest checkpoint's config (config.json may be edited by hand)
    held = run_config.of_workdir(workdir, config)
    if held is not None and held != saved:
        config = from_saved(held, f"the latest checkpoint in {workdir}")
    config.distributed = False
    config.lock()
    return cli.apply_overrides(config, overrides, path)


class TrainedRun:
    """The run in ``workdir`` read back on ``mesh``: ``config`` (its latest checkpoint's,
    ``load_config``'s, unless given), ``program`` and ``model``, and its variables (the
    latest checkpoint's parameters and BatchNorm statistics, at ``step``) read on first use;
    ``logits(images)``, the model's output as the eval step computes it. It only reads
    (safe beside the run's trainer still saving and deleting checkpoints).
    ``partitioning``: another config's placement section, so the variables sit where that
    run's would (a teacher or ``init_from`` placed like its student). ``program``: one
    already built of ``config`` on ``mesh`` (``run.setup``'s), else one is built. ``mesh``:
    a ``jax.sharding.Mesh`` or a spec ``make_mesh`` takes (``"data:-1"``)."""

    def __init__(self, workdir: str, mesh, partitioning=None, config=None, program=None):
        if isinstance(mesh, str):
            mesh = make_mesh(mesh)
        elif not isinstance(mesh, Mesh):
            raise TypeError(
                f"TrainedRun takes a jax.sharding.Mesh or a mesh spec such as 'data:-1' as its "
                f"mesh, got {type(mesh).__name__}"
            )
        # a call of the library's own (the teacher, init_from) gives the config it read
        caller = "TrainedRun" if config is None else None
        config = load_config(workdir, caller=caller) if config is None else config
        if partitioning is not None:
            with config.unlocked():
                config.partitioning = partitioning
        # the program relies on a checked config: the schema is where names are checked
        validate(config, sources=False)
        self.workdir, self.config = workdir, config
        try:
            self.program = program or build_program(config, mesh)
        except ConfigError as e:
            if caller is None:
                raise
            # the config's placement on this mesh: the call's mesh and partitioning=
            raise ConfigError(
                f"{e} (TrainedRun: pass a mesh on which it divides, or partitioning=, a "
                "placement section such as hybridpar.runtime.trained.load_config(workdir)"
                ".partitioning with preset='data')"
            ) from None
        self.model = self.program.model
        s, a = self.program.shardings, self.program.abstract_state()
        self.shardings = {"params": s.params, "batch_stats": s.batch_stats}
        self.abstract = {"params": a.params, "batch_stats": a.batch_stats}
        self.step = None  # the checkpoint's, once read
        self._variables = None
        self._logits_fn = None  # compiled on the first call of logits

    def variables(self) -> dict:
        """``{"params", "batch_stats"}`` of the latest checkpoint, in ``shardings`` (the
        optimizer state is read but not kept)."""
        if self._variables is None:
            directory = checkpoint.checkpoint_dir(self.config, self.workdir)
            saver = checkpoint.Checkpoints(directory, read_only=True)
            try:
                restored = saver.restore(self.program.abstract_state())
            finally:
                saver.close()
            if restored is None:
                raise ConfigError(f"no checkpoint in {directory}: train {self.workdir} first")
            self.step, state = int(restored[0]), restored[1]
            self._variables = {"params": state.params, "batch_stats": state.batch_stats}
        return self._variables

    def logits(self, images) -> np.ndarray:
        """The model's logits, float32 ``(N, classes)`` on the host, for ``images``: uint8 or
        float pixels in 0..255, ``(N, H, W, C)`` at the run's image size
        (``config.data.image_size``; another is refused, not resized), any N. As the eval
        step computes them: normalised with ``config.data.mean``/``std`` (the model takes
        normalised pixels), in the compute dtype, inference mode, averaged with the mirror
        images where the run evaluates with ``eval_flip``. Split over the mesh's data-parallel
        devices, padded to a multiple of their count. One process: ``load_config`` turns
        ``distributed`` off."""
        images, size, c = np.asarray(images), self.config.data.image_size, self.program.channels
        if images.shape[1:] != (size, size, c):  # another size would give wrong logits
            other_size = images.ndim == 4 and images.shape[-1] == c
            raise ConfigError(
                f"logits takes images (N, {size}, {size}, {c}) (the run's data.image_size and "
                f"channels), got {images.shape}"
                + (f"; resize them to {size}x{size} first" if other_size else "")
            )
        n, ways = len(images), data_parallel_size(self.program.mesh)
        padded = np.concatenate([images, np.zeros((-n % ways, *images.shape[1:]), images.dtype)])
        if self._logits_fn is None:
            model = FlipAveraged(self.model) if self.config.eval_flip else self.model
            d, policy = self.config.data, self.program.policy

            def fn(variables, x):
                x = normalize(x, tuple(d.mean), tuple(d.std), policy.compute_dtype)
                return logits_in(policy, model.apply(variables, x, train=False)).astype(jnp.float32)

            mesh = self.program.mesh
            self._logits_fn = jax.jit(
                fn,
                in_shardings=(self.shardings, batch_sharding(mesh, 4)),
                out_shardings=replicated(mesh),
            )
        return np.asarray(self._logits_fn(self.variables(), padded))[:n]

    def host_variables(self) -> tuple:
        """``(params, batch_stats)`` unboxed, as host arrays: what the compression tools
        rewrite."""
        v = self.variables()
        return jax.device_get(meta.unbox(v["params"])), jax.device_get(meta.unbox(v["batch_stats"]))


def check_classes(workdir: str, info: dict) -> None:
    """The data a tool opened to read the run in ``workdir`` with (``info``: its ``Data``'s)
    has the classes that run trained on, in the same label order (its records' last ``data``
    line), else the ``WorkdirError`` that names the labels that moved: a class folder renamed
    or added since moves labels, and the checkpoint's outputs would be scored against (or
    distilled into) labels of another meaning. A run without such a record (another source,
    a pruned run) is not checked, nor a ``workdir`` that is no folder (its reader says so)."""
    if not os.path.isdir(workdir):
        return
    recs, _ = run_records.read_records(os.path.join(workdir, "metrics.jsonl"))
    run_records.check_same_classes(run_records.last_data(recs), info, None, workdir)


def init_source(path: str, prog) -> TrainedRun:
    """The run in ``path`` (``init_from``), placed like ``prog``'s state; its shapes must be
    ``prog``'s model's, checked before any weight is read (the trainer asks in set-up, so a
    mismatch leaves no directory behind)."""
    # its config given: the errors name the config's keys, not TrainedRun's arguments
    src = TrainedRun(path, prog.mesh, prog.config.partitioning, config=load_config(path))
    a = prog.abstract_state()
    for name in ("params", "batch_stats"):
        ours, theirs = getattr(a, name), src.abstract[name]
        shapes = jax.tree.map(lambda x: x.shape, ours), jax.tree.map(lambda x: x.shape, theirs)
        if jax.tree.structure(ours) != jax.tree.structure(theirs) or shapes[0] != shapes[1]:
            raise ConfigError(
                f"init_from={path!r} holds a model of other shapes than this config's: give "
                f"this run the model keys of {path}/config.json (model.name, model.*_width*)"
            )
    return src


def start_from(source, state, prog):
    """``state`` (a new run's, at step 0) with the parameters and BatchNorm statistics of
    ``source``: an ``init_source`` or the path of a run, read into this run's shardings."""
    src = source if isinstance(source, TrainedRun) else init_source(source, prog)
    v = src.variables()
    return state.replace(params=v["params"], batch_stats=v["batch_stats"])


# ---- Whether a run is a finished one: read by quantize, prune and compress ----------------

# What a pruned run holds beside its config and checkpoint: where it was pruned from and how,
# so that tools tell it from a run whose training has not ended
PRUNED_RECORD = "pruned.json"


def is_pruned(workdir: str) -> bool:
    """Whether ``workdir`` is a run ``prune`` wrote (a step-0 model, not a training run):
    its ``PRUNED_RECORD``; one pruned before that record, a lone step-0 checkpoint without the
    trainer's records (metrics.jsonl, summary.json)."""
    if os.path.exists(os.path.join(workdir, PRUNED_RECORD)):
        return True
    ckpt = os.path.join(workdir, "checkpoints")
    records = ("metrics.jsonl", "summary.json")  # what a trainer writes
    trainer = any(os.path.exists(os.path.join(workdir, n)) for n in records)
    return not trainer and checkpoint_dirs.committed_steps(ckpt) == [0]


def unfinished(workdir: str) -> dict | None:
    """Why the run in ``workdir`` is not a finished training run, or None: ``{"why": ...,
    "held": ...}``, ``held`` whether a live process holds its lock (a trainer still
    training), else its summary.json is missing (its training has not ended) or says it
    stopped before its last step. A pruned run (``is_pruned``: at step 0 by design)
    is None. compress refuses such a teacher; quantize and prune warn."""
    from hybridpar.runtime import workdir_lock

    if workdir_lock.held(workdir):
        h = workdir_lock.holder(workdir_lock.path(workdir))
        who = f" (pid {h.get('pid')} on host {h.get('host')} holds its lock)" if h else ""
        return {"why": f"is still training{who}", "held": True}
    if is_pruned(workdir):
        return None
    summary = run_records.read_json(os.path.join(workdir, "summary.json"))
    if summary is None:
        return {"why": "has no summary.json (its training has not ended)", "held": False}
    # an earlier start's (a finished run resumed with more epochs, then killed): not its end
    recs, _ = run_records.read_records(os.path.join(workdir, "metrics.jsonl"))
    if not run_records.latest_summary(summary, run_records.latest_start(recs)):
        return {"why": "was resumed and its last start did not end (its summary.json is an "
                "earlier start's)", "held": False}  # fmt: skip
    if not summary.get("completed"):
        total = summary.get("total_steps")
        return {"why": f"stopped at step {summary.get('steps')} of {total}", "held": False,
                "total_steps": total}  # fmt: skip
    return None


def warn_unfinished(workdir: str, state: dict, step: int, total: int | None, what: str) -> None:
    """The ``warning:`` line for an unfinished run (``unfinished``'s ``state``) whose
    checkpoint at ``step`` of its ``total`` steps (None: unknown) a tool reads (``what``:
    its verb)."""
    of = f" of the run's {total} steps" if total else ""
    print(f"warning: the run in {workdir!r} {state['why']}: {what} its checkpoint at step "
          f"{step}{of}, not a finished model", flush=True)  # fmt: skip
