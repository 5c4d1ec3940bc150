"""``python -m hybridpar.plan --config experiments/NAME.py --devices N [--hardware PRESET]
[--memory-gib G] [--config.KEY=VALUE ...] [--json]``: the mesh, head, BatchNorm sync,
communication and batch that fit and train fastest on a pod, found by compiling.

Each candidate plan is the config with a few keys changed (``mesh``, ``model.head``,
``model.bn_sync``, ``comm.mode`` and ``comm.bucket_mb``, ``global_batch``,
``precision.compute``). Each is compiled ahead of time on N virtual CPU devices by
``hybridpar.tools.comm_report.report`` (nothing allocated), which gives its per-device memory,
collectives and FLOPs; ``hybridpar.simulate`` turns those into a step time and a time to
train on the hardware preset. Plans that need more than the memory limit are dropped; the
rest are ranked by predicted time to train; plans that tie there (held at the per-step
floor) by the step before the floor and exposed communication, then memory.

The candidates are the product of the value lists below (``--meshes``, ``--heads``, ...),
less the combinations the config rules out before compiling (a sharded head needs a
``model`` axis that divides the classes, partial-FC all devices; bucketed communication
needs ``model`` = 1 and the dense head; it and the overlap mode need more than one
data-parallel device). The plans closest to the config (fewest keys
changed) are compiled first, up to ``--max-plans``.

The global batch stays the config's unless ``--per-device-batch`` lists others: the batch is
part of the recipe (its learning rate and epochs were tuned for it), and the scaling model
predicts time per epoch, not how many epochs a larger batch needs.

Compiles run in ``--jobs`` worker processes (each one JAX process on N virtual devices;
compiling a large model on many devices takes GiBs of host memory per process). Each result
is cached under ``--cache-dir`` by the content of its config, N, the JAX version and
hybridpar's source, so a second call with the same config compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

from hybridpar.config import cli
from hybridpar.config.curriculum import parse_stages
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import GIB, MIB, byte_size, counted, duration, table
from hybridpar.config.schema import HEADS
from hybridpar.runtime.comm_report_schema import CommReport, stage_flop_loops
from hybridpar.runtime.run_records import write_json
from hybridpar.tools.comm_report import (
    check_virtual_devices,
    link_preset,
    target_of,
    use_virtual_cpu_devices,
)

# Nothing above imports JAX: the virtual device count is set before the backend starts.

BN_SYNCS = ("global", "local")
DEFAULT_OVERLAP = 0.8  # --overlap's


# ---- Candidates -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan: the values of the keys the planner varies."""

    mesh: tuple  # ((axis, size), ...) for data, fsdp, model
    head: str
    bn_sync: str
    comm: str  # "auto", "xla", "bucketed:MB" or "overlap:MB"
    # images per data-parallel device (data x fsdp: the batch shards), as config.stages
    # counts them; None: the config's stages set the batches (no global_batch override)
    per_device_batch: int | None
    compute: str  # precision.compute

    @property
    def mesh_spec(self) -> str:
        return ",".join(f"{a}:{n}" for a, n in self.mesh if n > 1) or "data:1"

    @property
    def data_parallel(self) -> int:
        shape = dict(self.mesh)
        return shape["data"] * shape["fsdp"]

    def overrides(self) -> dict[str, str]:
        """The ``--config.KEY=VALUE`` pairs that make the config this plan."""
        mode, _, mb = self.comm.partition(":")
        out = {
            "mesh": self.mesh_spec,
            "model.head": self.head,
            "model.bn_sync": self.bn_sync,
            "comm.mode": mode,
            "precision.compute": self.compute,
        }
        if self.per_device_batch is not None:
            out["global_batch"] = str(self.per_device_batch * self.data_parallel)
        if mb:
            out["comm.bucket_mb"] = mb
        return out

    def label(self) -> str:
        b = "stages" if self.per_device_batch is None else self.per_device_batch
        return f"{self.mesh_spec} {self.head} bn={self.bn_sync} {self.comm} b={b}"


def mesh_factorisations(devices: int, max_model: int = 8) -> list[tuple]:
    """Every (data, fsdp, model) with data * fsdp * model = devices and model <= max_model
    (``model`` stays inside a host of 8), data-parallel first."""
    out = []
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    for m in divisors:
        if m > max_model:
            continue
        for f in divisors:
            if (devices // m) % f == 0:
                out.append((("data", devices // m // f), ("fsdp", f), ("model", m)))
    out.sort(key=lambda s: (s[2][1], s[1][1]))
    return out


def _rule_out(c: Candidate, devices: int, num_classes: int, slices: int = 1) -> str | None:
    """Why the config would reject `c` on `slices` slices (None: it may compile)."""
    shape = dict(c.mesh)
    model = shape["model"]
    if shape["data"] % slices:  # as the mesh's set-up refuses it (parallel.mesh)
        return (f"only the data axis crosses the {slices} slices, so data must be a multiple "
                f"of {slices}")  # fmt: skip
    if c.comm.startswith(("bucketed", "overlap")) and shape["data"] * shape["fsdp"] == 1:
        return "bucketed and overlap communication need more than one data-parallel device"
    # on a one-device model axis the sharded head trains, but does the dense head's work:
    # not a plan of its own (the dense one is)
    if c.head == "sharded" and (model == 1 or num_classes % model):
        return "the sharded head needs a model axis > 1 that divides the classes"
    if c.head == "partial_fc" and num_classes % devices:
        return "partial_fc needs the classes to divide over all devices"
    if c.comm.startswith("bucketed") and (model > 1 or c.head != "dense"):
        return "bucketed communication needs model=1 and the dense head"
    return None


def _comm_of(config) -> str:
    mode = config.comm.mode
    return mode if mode in ("xla", "auto") else f"{mode}:{config.comm.bucket_mb:g}"


def _resolved(c: Candidate, config, platform: str) -> Candidate:
    """An ``auto`` plan as the run would resolve it on ``platform`` (``sync.choose_mode``),
    so its label and overrides name the mode it compiles."""
    if c.comm != "auto":
        return c
    from hybridpar.program.sync import choose_mode

    plan_config = copy.deepcopy(config)
    cli.apply_overrides(plan_config, [("model.head", c.head), ("precision.compute", c.compute)])
    shape = dict(c.mesh)
    mode, _ = choose_mode(plan_config, platform, shape, shape["data"] * shape["fsdp"])
    comm = mode if mode == "xla" else f"{mode}:{config.comm.bucket_mb:g}"
    return dataclasses.replace(c, comm=comm)


def _config_batch(c: Candidate, config) -> Candidate:
    """A plan at the config's own global batch (``per_device_batch`` None) as that batch
    over its data-parallel devices; with stages it stays None (the stages set the batches)."""
    if c.per_device_batch is not None or config.stages:
        return c
    return dataclasses.replace(c, per_device_batch=config.global_batch // c.data_parallel)


def batch_rule_out(c: Candidate, config) -> str | None:
    """Why `c`'s set-up would refuse the config's batches (None: it would not): each must
    divide over the mesh's data-parallel devices (data x fsdp), as ``mesh.check_divides``
    says it where the run checks them (``program.check_batch_sizes``): the eval batch, and
    the config's global batch where `c` and the stages do not set the batch."""
    from hybridpar.parallel.mesh import check_divides

    own = c.per_device_batch is None and not config.stages  # the config's global batch
    for name in ("global_batch", "eval_batch") if own else ("eval_batch",):
        try:
            check_divides(config[name], c.data_parallel, f"--config.{name}=", "its mesh")
        except ConfigError as e:
            return str(e)
    return None


def candidates(
    config, devices: int, choices: dict, platform: str = "cpu", slices: int = 1
) -> tuple[list[Candidate], int, Counter]:
    """The valid plans of the product of `choices`, closest to the config first; how many
    the product had; and how many of it were ruled out, by reason (``_rule_out``'s and
    ``batch_rule_out``'s words; "the same plan as another" where ``auto`` or the config's
    batch made a plan listed already). ``platform``: the devices' (a mesh error's hint
    depends on it); ``slices``: a TPU target's. A ``per_device_batch`` of None is the
    config's own global batch on every mesh."""
    from hybridpar.parallel.mesh import parse_mesh_spec

    base = Candidate(
        mesh=tuple(parse_mesh_spec(config.mesh, devices, platform).items()),
        head=config.model.head,
        bn_sync=config.model.bn_sync,
        comm=_comm_of(config),
        per_device_batch=None,
        compute=config.precision.compute,
    )
    base = _config_batch(_resolved(base, config, platform), config)
    axes = [f.name for f in dataclasses.fields(Candidate)]
    grid = list(itertools.product(*(choices[a] for a in axes)))
    out, seen, ruled = [], set(), Counter()
    for values in grid:
        c = _resolved(Candidate(*values), config, platform)
        reason = _rule_out(c, devices, config.data.num_classes, slices) or batch_rule_out(
            c, config)  # fmt: skip
        c = _config_batch(c, config)
        if reason is not None:
            ruled[reason] += 1
        elif c in seen:  # auto may resolve to a plan listed already
            ruled["the same plan as another"] += 1
        else:
            seen.add(c)
            out.append(c)

    def value(c, a):  # a batch is the global batch it makes: the same on every mesh
        return c.overrides().get("global_batch") if a == "per_device_batch" else getattr(c, a)

    def distance(c):
        return sum(value(c, a) != value(base, a) for a in axes)

    out.sort(key=distance)  # stable: within a distance, the order of the value lists
    return out, len(grid), ruled


def ruled_out_words(ruled: Counter) -> str:
    """``ruled``'s counts and reasons, most first: "4 (the sharded head needs ...), 2 (...)"."""
    return ", ".join(f"{n} ({reason})" for reason, n in ruled.most_common())


def _choices(config, devices: int, args, platform: str = "cpu") -> dict:
    """The value list of each axis: the flags', else the defaults around the config's."""
    from hybridpar.parallel.mesh import parse_mesh_spec

    def listed(flag, text, example):
        """The flag's comma-separated values; None where it is not given. Given but empty
        (``--heads ""``) is refused: the default in its place would not be what was asked."""
        if text is None:
            return None
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            cli.fail(f"{flag} {text!r}: no values given; list them comma-separated, e.g. "
                     f"{flag} {example}, or drop {flag} for the default")  # fmt: skip
        return values

    mesh = None
    if args.meshes is not None and not args.meshes.split():
        cli.fail(f"--meshes {args.meshes!r}: no meshes given; list them space-separated, "
                 "e.g. --meshes 'data:-1 fsdp:-1', or drop --meshes for every "
                 "factorisation")  # fmt: skip
    if args.meshes:  # space-separated: a mesh spec has commas of its own
        try:
            mesh = [
                tuple(parse_mesh_spec(s, devices, platform).items()) for s in args.meshes.split()
            ]
        except ConfigError as e:
            wanted = re.search(r"needs (\d+) devices but", str(e))
            if wanted:  # the mesh error's hints name the train CLI's flags; these are plan's
                cli.fail(
                    f"--meshes {args.meshes!r}: a mesh there needs {wanted.group(1)} devices "
                    f"but --devices is {devices}; make its sizes multiply to {devices} (e.g. "
                    f"data:-1), or plan for {wanted.group(1)} devices with --devices "
                    f"{wanted.group(1)}"
                )
            cli.fail(f"--meshes {args.meshes!r}: {e}")
    comms = listed("--comm", args.comm, "xla,overlap:4")
    for c in comms or ():
        mode, _, mb = c.partition(":")
        if mode not in ("auto", "xla", "bucketed", "overlap") or (
            mode in ("bucketed", "overlap")) != bool(mb):  # fmt: skip
            cli.fail(f"--comm {c!r}: write auto, xla, bucketed:MB or overlap:MB, e.g. "
                     "--comm xla,overlap:4")  # fmt: skip
        if mb:  # else each plan's override fails in its compile, under --config.comm.bucket_mb
            try:
                size = float(mb)
            except ValueError:
                size = math.nan
            if not (math.isfinite(size) and size > 0):
                cli.fail(f"--comm {c!r}: the bucket size MB after {mode}: is a positive "
                         "number of MiB, e.g. --comm xla,overlap:4")  # fmt: skip
    batches = listed("--per-device-batch", args.per_device_batch, "4,8")
    if batches and config.stages:
        cli.fail(
            f"--per-device-batch: the config's stages ({config.stages!r}) set each stage's "
            "batch per data-parallel device and a run with stages does not use global_batch; "
            "plan other batches by changing the stages (--config.stages=...), or drop "
            "--per-device-batch"
        )
    try:
        batch = [int(b) for b in batches] if batches else [None]  # None: the config's
    except ValueError:
        cli.fail(f"--per-device-batch {args.per_device_batch!r}: comma-separated integers")
    if batches and min(batch) < 1:
        cli.fail(f"--per-device-batch {args.per_device_batch!r}: batches are >= 1")
    base_comm = _comm_of(config)
    # auto is xla or overlap by the target's platform and each plan's mesh
    others = ("xla",) if base_comm != "auto" else ()
    default_comm = [base_comm] + [
        c for c in (*others, f"bucketed:{config.comm.bucket_mb:g}") if c != base_comm
    ]

    def first(value, values):
        return [value] + [v for v in values if v != value]

    heads = listed("--heads", args.heads, "dense,sharded")
    bn_syncs = listed("--bn-sync", args.bn_sync, "global,local")
    computes = listed("--precision", args.precision, "float32,bfloat16")
    return {
        "mesh": mesh or mesh_factorisations(devices),
        "head": heads or first(config.model.head, HEADS),
        "bn_sync": bn_syncs or first(config.model.bn_sync, BN_SYNCS),
        "comm": comms or default_comm,
        "per_device_batch": batch,
        "compute": computes or [config.precision.compute],
    }


def check_rule_axes(config) -> None:
    """Every mesh axis a partitioning rule names is one of the mesh's (``mesh.AXES``, the
    same on every plan): an error shared by every plan is one line before any worker
    starts, in the words of the set-up's own check, not the same verdict from every plan's
    set-up after it. A path rule must match an array, so each one's spec is applied; a
    logical rule applies where a model carries its name, and one whose name no array
    carries does nothing (the set-up's warning): its axis is checked too, a typo either way."""
    from hybridpar.parallel.mesh import AXES, axis_names

    def named(spec):
        for entry in spec if isinstance(spec, (tuple, list)) else (spec,):
            yield from axis_names(entry)

    for pattern, spec in config.partitioning.rules:
        for a in named(spec):
            if a is not None and a not in AXES:
                cli.fail(f"partitioning rule ({pattern!r}, {spec}): spec {spec} names mesh "
                         f"axis {a!r}, not one of {AXES}")  # fmt: skip
    for name, axis in config.partitioning.logical_rules:
        for a in named(axis):
            if a is not None and a not in AXES:
                cli.fail(f"partitioning.logical_rules entry ({name!r}, {axis!r}) names mesh "
                         f"axis {a!r}, not one of {AXES}: map {name!r} to one of them, or to "
                         "None to replicate it (or drop the entry if no array carries the "
                         "name)")  # fmt: skip


def _check_values(config, choices: dict, validate) -> None:
    """Each listed head, BN sync and dtype is one the config accepts: a typo is one error
    line now, not a failed compile per plan."""
    for flag, key, values in (
        ("--heads", "model.head", choices["head"]),
        ("--bn-sync", "model.bn_sync", choices["bn_sync"]),
        ("--precision", "precision.compute", choices["compute"]),
    ):
        for v in values:
            c = copy.deepcopy(config)
            cli.apply_overrides(c, [(key, v), ("comm.mode", "xla")])
            try:
                validate(c)
            except ConfigError as e:
                cli.fail(f"{flag} {v!r}: {e}")


# ---- Compiling (in worker processes) and the cache ---------------------------------------------


def compile_one(config_path: str, overrides: list[tuple[str, str]]) -> dict:
    """Worker: the plan's comm_report as a dict, or {"error": ...} if the config rejects it,
    with ``warnings``: the Python warnings its set-up and compile raised, each once and on
    one line, for plan to say in its own voice (``warning_lines``) rather than as Python's
    file:line and source dump among the progress lines."""
    with warnings.catch_warnings(record=True) as caught:
        rep = _compile_one(config_path, overrides)
    said = [" ".join(str(w.message).split()) for w in caught]
    return dict(rep, warnings=list(dict.fromkeys(said))) if said else rep


def _compile_one(config_path: str, overrides: list[tuple[str, str]]) -> dict:
    """``compile_one``'s report. For a target, a fresh process per plan (``compile_all``):
    this plan's own ``comm`` flags go into the compiler's environment before JAX starts
    here, as its run would get them (an overlap plan's asynchronous all-reduces, an xla
    plan's none)."""
    from hybridpar.parallel import comm
    from hybridpar.tools import targets

    config = cli.load(config_path, overrides)
    spec = os.environ.get("HYBRIDPAR_PLAN_TARGET")
    target = targets.parse(spec) if spec else None
    if target is not None:
        comm.apply(config.comm, target.platform, target.chip.name if target.chip else None)
    from hybridpar.tools.comm_report import report  # JAX starts here

    try:
        if target is not None:  # the target's compiler, on its devices (the environment is set)
            return report(config, target=target).to_dict()
        return report(config, virtual_devices=int(os.environ["HYBRIDPAR_PLAN_DEVICES"])).to_dict()
    except ConfigError as e:  # comm_report's hint about --devices means nothing here
        # the config rules the plan out (its set-up's checks, e.g. a parameter the mesh
        # axis does not divide): as fixed as a compiled report, so it is cached like one
        message = " ".join(str(e).split(" (comm_report: --devices")[0].split())
        return {"error": message, "ruled_out": True}


def stdout_to_stderr() -> None:
    """A worker's initializer: what a plan's set-up prints (the trainer's warnings go to
    stdout) goes to stderr with the progress lines, as the worker shares plan's stdout,
    which holds the report alone (``--json``: one object)."""
    sys.stdout = sys.stderr


def warning_lines(c: Candidate, rep: dict, seen: set) -> list[str]:
    """A ``warning:`` line for each of a plan's warnings (``compile_one``) not yet said for
    its mesh (the plans on one mesh share their set-up's); ``rep`` is left as it is."""
    lines = []
    for message in rep.get("warnings", []):
        if (c.mesh_spec, message) not in seen:
            seen.add((c.mesh_spec, message))
            lines.append(f"warning: {c.mesh_spec}: {message}")
    return lines


def without_warnings(rep: dict) -> dict:
    """A plan's report as the ranking reads it: its warnings are said (``warning_lines``),
    not part of the report (``CommReport`` has no such key)."""
    return {k: v for k, v in rep.items() if k != "warnings"}


def source_hash() -> str:
    """The source of the code that builds the compiled step (hybridpar and its models; not
    the input pipeline, which a compile without data never runs, nor the scaling model and
    this planner, which only read the result): a change to it invalidates the cache."""
    import importlib.util

    h = hashlib.sha256()
    for pkg in ("hybridpar", "hybridpar.models"):
        for root in importlib.util.find_spec(pkg).submodule_search_locations:
            for p in sorted(Path(root).rglob("*.py")):
                rel = p.relative_to(root).as_posix()
                if pkg == "hybridpar" and (rel.startswith("simulate/") or rel.endswith("plan.py")):
                    continue
                h.update(f"{pkg}/{rel}".encode() + p.read_bytes())
    return h.hexdigest()[:16]


def cache_key(config, devices: int, source: str) -> str:
    from hybridpar.parallel.comm import installed_version

    versions = {n: installed_version(n) for n in ("jax", "jaxlib", "libtpu")}
    payload = json.dumps(
        {
            "config": json.loads(config.to_json()),
            "devices": devices,
            "target": os.environ.get("HYBRIDPAR_PLAN_TARGET"),  # None: virtual CPU devices
            "source": source,
            # flags that change what XLA compiles (the user's; the plan's own comm flags
            # follow from its config), each once; the device count is `devices`
            "xla_flags": sorted(
                {f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")}  # fmt: skip
            ),
            "libtpu_init_args": sorted(os.environ.get("LIBTPU_INIT_ARGS", "").split()),
            **versions,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def cached_report(path: Path, log) -> dict | None:
    """A cached plan's report, or None (with a line saying so) where the file does not read
    back as one: a cache is only a shortcut, so that plan is compiled again."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        report = None
    if not isinstance(report, dict):
        log(f"plan: {path} is not a cached plan (damaged?): compiling that plan again")
        return None
    return report


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridpar" / "plan"


def compile_plans(config_path, config, base_overrides, plans, devices, jobs, cache_dir, log):
    """{plan: report dict (or {"error"})}, each from the cache or compiled in `jobs`
    processes; a report carries ``from_cache``."""
    source = source_hash()
    results, todo, seen, warned = {}, [], set(), []
    for c in plans:
        plan_config = copy.deepcopy(config)
        cli.apply_overrides(plan_config, list(c.overrides().items()))
        path = cache_dir / f"{cache_key(plan_config, devices, source)}.json" if cache_dir else None
        cached = cached_report(path, log) if path is not None and path.exists() else None
        if cached is not None:
            warned += warning_lines(c, cached, seen)  # said again: the plan's as compiled
            results[c] = dict(without_warnings(cached), from_cache=True)
        else:
            todo.append((c, path))
    if results:
        log(f"plan: {len(results)} of {counted(len(plans), 'plan')} from the cache in {cache_dir}")
        for line in warned:
            log(line)
    if not todo:
        return results
    where = os.environ.get("HYBRIDPAR_PLAN_TARGET") or f"{devices} virtual CPU devices"
    log(f"plan: compiling {counted(len(todo), 'plan')} for {where}, {jobs} at a time")
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # a fresh JAX per worker, never forked
    # for a target, a fresh worker per plan: each plan's comm flags are set before its JAX
    fresh = 1 if os.environ.get("HYBRIDPAR_PLAN_TARGET") else None
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=context, initializer=stdout_to_stderr, max_tasks_per_child=fresh
    ) as pool:
        futures = {
            pool.submit(
                compile_one, config_path, base_overrides + list(c.overrides().items())
            ): (c, path)
            for c, path in todo
        }
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            c, path = futures[fut]
            try:
                rep = fut.result()
            except Exception as e:  # a worker that died (host memory): that plan fails
                rep = {"error": f"the compile failed: {type(e).__name__}: {e}"}
            lines = warning_lines(c, rep, seen)
            what = rep.get("error") or (
                f"{byte_size(rep['memory_per_device_bytes'])}/device, "
                f"{byte_size(rep['total_bytes'])} collectives, "
                f"compiled in {rep['compile_s']:.0f} s"
            )
            elapsed = time.perf_counter() - start
            log(f"plan: [{done}/{len(todo)}] {c.label()}: {what} ({elapsed:.0f} s)")
            for line in lines:
                log(line)
            if path is not None and ("error" not in rep or rep.get("ruled_out")):
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(str(path), rep, indent=None)  # its warnings kept with it
            results[c] = dict(without_warnings(rep), from_cache=False)
    return results


# ---- Prediction and ranking ----------------------------------------------------------------


def stages_of(config, per_batch_shard: int):
    """The run's curriculum as the scaling model's stages (batches per batch shard)."""
    from hybridpar import simulate as sim
    from hybridpar.config.curriculum import parse_stages

    if config.stages:
        return [sim.Stage(end, size, batch) for end, size, batch, _ in parse_stages(config.stages)]
    return [sim.Stage(config.num_epochs, config.data.image_size, per_batch_shard)]


def predict(
    config, rep: dict, preset, devices: int, overlap: float, images_per_epoch: int
) -> dict:
    """Step and time to train of one compiled plan on `preset`; an epoch of
    `images_per_epoch` images (``images_per_epoch_of``)."""
    from hybridpar import simulate as sim

    report = CommReport.from_dict({k: v for k, v in rep.items() if k != "from_cache"})
    workload = sim.workload_from_report(report)
    b = round(workload.reference_batch)
    step = sim.predict_step(workload, preset, devices, b, workload.reference_image_size, overlap)
    # the evaluation passes the config runs on the clock, at its eval batch per batch shard
    evaluation = sim.Evaluation(config.eval_every_epochs, **sim.report_eval(report, b))
    train = sim.time_to_train(
        workload,
        preset,
        devices,
        stages_of(config, b),
        images_per_epoch,
        overlap,
        evaluation=evaluation,
    )
    return {
        "predicted_step_s": step.step_s,
        "predicted_images_per_s": step.images_per_s,
        "predicted_scaling_efficiency": step.efficiency,
        "predicted_exposed_comm_s": step.exposed_comm_s,
        "predicted_floor_s": step.parts()["floor"],  # what the floor adds to the step
        "predicted_time_to_train_s": train.total_s,
        "predicted_eval_s": train.eval_s,
    }


def images_per_epoch_of(config, flag: int | None = None) -> int:
    """An epoch's images: ``--images-per-epoch`` where given, else a built-in set's own size
    (digits' split) or synthetic data's ``data.train_examples``. Data read from files has
    the size of its files, which a compile without the data never sees (its
    ``data.train_examples`` is only nominal): a ``ConfigError``, as ``simulate
    --comm-report`` refuses it, not a time to train off by the files' size."""
    from hybridpar.runtime.executables import data_size

    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--images-per-epoch={flag} must be >= 1")
        return flag
    size = data_size(config)
    if size is not None:
        return size
    if config.data.name == "synthetic":
        return config.data.train_examples
    raise ConfigError(
        f"the time to train needs the images in an epoch, and the config's data "
        f"(data.name={config.data.name!r}) is read from files, whose size a compile does not "
        "see; pass --images-per-epoch N (e.g. 50000 for CIFAR-10's train split)"
    )


def preset_slices(preset, devices: int) -> int:
    """The slices `devices` chips of a TPU `preset` take (its largest slice each), 1 on a
    GPU's: only data crosses them (``_rule_out``), as simulate prices them."""
    if preset.torus_dims and devices > preset.devices_per_node:
        return devices // preset.devices_per_node
    return 1


# plan --target's compute a step, in its text and JSON: no bound (the bytes term is not)
COMPUTE_WORDS = (
    "the longer of the TPU compiler's FLOPs at the chip's peak and its bytes accessed at HBM "
    "bandwidth (a pessimistic heuristic, no bound: XLA's byte count is more than the HBM "
    "traffic)"
)


def predict_on_target(
    config, rep: dict, target, devices: int, overlap: float, images_per_epoch: int
) -> dict:
    """Step and time to train of one plan compiled for a TPU ``target``, from the TPU
    compiler's own counts: its compute, the longer of the FLOPs at the chip's peak and the
    bytes accessed at its HBM bandwidth (``COMPUTE_WORDS``, ``targets.roofline_step_s``),
    plus the collectives less what is hidden behind compute,
    and never less than the scaling model's per-step floor
    (``simulate.hardware.STEP_FLOOR_S``). The collectives are priced as ``simulate`` prices
    them (``simulate.comm_time``: each group's collective on the links it crosses, rings
    along a slice's ICI torus and DCN between slices, ``comm_report.link_preset``); hidden:
    the collective seconds the compiler's schedule hides by estimate, each collective's
    overlapped compute against that same price (``seconds_hidden_est``), where the report
    has it; in a report from before it, the share of the bytes hidden (``bytes_hidden_est``),
    else none (``simulate.exposed_seconds``: a TPU preset hides nothing). Evaluation and
    input not counted: an estimate for ranking plans, not a prediction of a run. The longer
    of the two, unfitted: against the measured steps the FLOPs at peak fall short and the
    bytes run over (docs/scaling.md has the figures), so this compute is pessimistic, a
    heuristic for ranking plans."""
    from hybridpar import simulate as sim
    from hybridpar.simulate.hardware import STEP_FLOOR_S
    from hybridpar.tools import targets

    compute = targets.roofline_step_s(target, rep["flops"], rep.get("bytes_accessed")) or 0.0
    preset = link_preset(target)
    report = CommReport.from_dict({k: v for k, v in rep.items() if k != "from_cache"})
    workload = sim.workload_from_report(report)
    comm, _ = sim.comm_time(workload, preset, devices)
    if report.seconds_hidden_est is not None:  # at the price comm takes, collective by one
        exposed = max(0.0, comm - report.seconds_hidden_est)
    else:
        exposed = sim.exposed_seconds(workload, preset, devices, comm, compute, overlap)
    exposed_from = sim.exposed_source(workload.hidden_share, overlap, preset.max_overlap)
    step = max(compute + exposed, STEP_FLOOR_S)
    images = rep["global_batch"] / step  # the compiled step's (a stage's, with stages)
    return {
        "predicted_step_s": step,
        "predicted_images_per_s": images,
        "predicted_scaling_efficiency": compute / step,
        "predicted_exposed_comm_s": exposed,
        "exposed_from": exposed_from,
        "predicted_floor_s": step - compute - exposed,  # what the floor adds to the step
        "predicted_time_to_train_s": config.num_epochs * images_per_epoch / images,
        "predicted_eval_s": None,
        "estimate": f"{COMPUTE_WORDS}, plus collectives priced on ICI within a slice and DCN "
        f"between slices, less those hidden ({exposed_from}), at least the per-step floor",
    }


def calibration_points(metrics_path: str, devices: int) -> list[tuple[int, float, float]]:
    """The measured points of ``--calibrate-from`` (``simulate.points_from_metrics``), read
    before anything compiles: a missing or unusable file is one error line, not one after
    every plan compiled."""
    from hybridpar import simulate as sim

    try:
        points = sim.points_from_metrics(metrics_path, devices)
    except (OSError, ValueError, KeyError, TypeError) as e:
        hint = "" if "metrics.jsonl" in str(e) else "; pass a run's metrics.jsonl"
        cli.fail(f"--calibrate-from {metrics_path}: {e}{hint}")
    for size, batch, rate in points:  # what fit_rate refuses, said now
        if size <= 0 or batch <= 0 or rate <= 0:
            cli.fail(
                f"--calibrate-from {metrics_path}: a train line of image size {size}, "
                f"{batch:g} images per device and {rate:g} img/s is not a measured rate; pass "
                "a run's metrics.jsonl"
            )
    return points


def _calibrated(preset, results: dict, plans: list, points: list, metrics_path: str):
    """`preset` fitted to a run's measured rates (`points`, ``calibration_points``), taken
    to be of the closest compiled plan to the config (`plans` closest first) without a model
    axis: its FLOPs per image."""
    from hybridpar import simulate as sim

    ok = [c for c in plans if "error" not in results[c]]
    reports = [results[c] for c in ok if dict(c.mesh)["model"] == 1] or [results[c] for c in ok]
    if not reports:
        return preset
    rep = CommReport.from_dict({k: v for k, v in reports[0].items() if k != "from_cache"})
    try:  # the one check that needs a compiled plan: the rates against its FLOPs
        return sim.fit_rate(points, preset, sim.workload_from_report(rep), metrics_path)
    except ValueError as e:
        cli.fail(f"--calibrate-from {metrics_path}: {e}")


def usable_cache_dir(args) -> Path | None:
    """``--cache-dir`` (or the default) made and written to once, after the other input
    checks (a refused call leaves no directory) and before anything compiles: a file in its
    place or a read-only one is one error line, not a traceback after every plan compiled.
    None with ``--no-cache``."""
    if args.no_cache:
        return None
    path = Path(args.cache_dir or default_cache_dir()).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        why = "is a file, not a directory" if path.is_file() else (e.strerror or str(e))
        cli.fail(
            f"--cache-dir {path}: {why}; pass a writable directory, e.g. --cache-dir "
            "/tmp/hybridpar-plan, or --no-cache"
        )
    return path


def plan_rows(
    config, results: dict, devices: int, preset, limit_bytes: int, overlap: float,
    images_per_epoch: int, target=None,
):  # fmt: skip
    """(ranked plans that fit, plans that do not fit, plans that failed), each a dict.
    ``target``: a TPU target, whose estimate (``predict_on_target``) replaces the preset's.
    ``images_per_epoch``: ``images_per_epoch_of``'s. With stages, a plan's memory is its
    largest stage's (``memory_stage``), what the run must hold."""
    fits, too_big, failed = [], [], []
    for c, rep in results.items():
        row = {
            "plan": c.label(),
            "overrides": c.overrides(),
            "per_device_batch": c.per_device_batch,
            "from_cache": rep.get("from_cache", False),
        }
        if "error" in rep:
            failed.append(dict(row, error=rep["error"], ruled_out=rep.get("ruled_out", False)))
            continue
        row.update(
            memory_per_device_bytes=rep["memory_per_device_bytes"],
            collective_bytes=rep["total_bytes"],
            collective_ops=rep["total_ops"],
            flops_per_device=rep["flops"],
            compile_s=rep["compile_s"],
            compiled_for=f"{rep['devices']['platform']} ({rep['devices']['kind']})",
            memory_stage=rep.get("stage"),
            flop_loops=stage_flop_loops(rep.get("stage_programs"), rep.get("stage")),
        )
        try:
            if target is not None:
                row.update(predict_on_target(config, rep, target, devices, overlap,
                                             images_per_epoch))  # fmt: skip
            else:
                row.update(predict(config, rep, preset, devices, overlap, images_per_epoch))
        except ConfigError as e:  # the trainer's refusal at this plan's batches (a stage of
            # no step, simulate.time_to_train): ruled out, as by the set-up's own checks
            failed.append(dict(row, error=str(e), ruled_out=True))
            continue
        (fits if rep["memory_per_device_bytes"] <= limit_bytes else too_big).append(row)
    fits.sort(key=rank_key)
    too_big.sort(key=lambda r: r["memory_per_device_bytes"])
    return fits, too_big, failed


def short_flops_mark(row: dict) -> str:
    """The table's mark after a plan's time to train: ``+`` where its FLOP count is short
    (``flop_loops``), ``?`` where its report does not say."""
    loops = row.get("flop_loops")
    return "?" if loops is None else "+" if loops else ""


def no_fit_words(too_big: list, failed: list, limit: int, target) -> str:
    """The error when no plan fits: the smallest plan's need, whose compiler counted it
    (XLA:CPU's, on virtual CPU devices, overstates a TPU's or GPU's: docs/compiling.md),
    and the plans the config ruled out when set up, counted, with the first one's reason
    and fix: raising the limit alone may not be the fix."""
    s = too_big[0]
    words = (
        f"no plan fits in {byte_size(limit)} per device: the smallest, {s['plan']}, needs "
        f"{byte_size(s['memory_per_device_bytes'])}"
    )
    if target is None:  # compiled on virtual CPU devices
        words += (
            " (XLA:CPU's count, which overstates a TPU's or GPU's: about 2x with bfloat16 "
            "compute, docs/compiling.md)"
        )
    ruled = [r for r in failed if r.get("ruled_out")]
    if ruled:
        words += (
            f"; {counted(len(ruled), 'other plan')} {'was' if len(ruled) == 1 else 'were'} "
            f"ruled out by the config when set up, the first: {ruled[0]['plan']}: "
            f"{ruled[0]['error']}"
        )
    return (
        words + "; raise --memory-gib, add devices, or try other plans (--meshes, --heads, "
        "--per-device-batch)"
    )


def rank_key(row: dict) -> tuple:
    """Plans rank by predicted time to train; plans that tie there (a small step held at the
    per-step floor) by the step before the floor, then exposed communication, then memory:
    on a faster device the floor lifts first from the plan that communicates least."""
    busy = row["predicted_step_s"] - row["predicted_floor_s"]
    return (
        row["predicted_time_to_train_s"],
        busy,
        row["predicted_exposed_comm_s"],
        row["memory_per_device_bytes"],
    )


def floor_tie(fits: list) -> int:
    """How many of the ranked plans tie with the first at the per-step floor (0: no tie)."""
    if not fits or fits[0]["predicted_floor_s"] <= 0:
        return 0
    first = fits[0]["predicted_time_to_train_s"]
    tied = [r for r in fits if r["predicted_time_to_train_s"] == first]
    return len(tied) if len(tied) > 1 else 0


def format_table(fits, too_big, failed, limit_bytes, stage_batches: str = "") -> str:
    """The ranked table; ``stage_batches``: the stages' batches per data-parallel device
    (e.g. ``1024,512``), shown for plans whose stages set the batch."""
    header = ["rank", "mesh", "head", "bn_sync", "comm", "batch/dp-dev", "compute",
              "memory/dev", "collectives MiB (ops)", "img/s", "time to train"]  # fmt: skip
    rows = []
    for rank, r in enumerate(fits + too_big, 1):
        o = r["overrides"]
        comm = o["comm.mode"] + (f":{o['comm.bucket_mb']}" if "comm.bucket_mb" in o else "")
        batch = r["per_device_batch"]
        rows.append([
            str(rank) if r in fits else "-", o["mesh"], o["model.head"], o["model.bn_sync"],
            comm, stage_batches if batch is None else str(batch), o["precision.compute"],
            byte_size(r["memory_per_device_bytes"]) + ("" if r in fits else " (too big)"),
            f"{r['collective_bytes'] / MIB:,.1f} ({r['collective_ops']})",
            f"{r['predicted_images_per_s']:,.0f}",
            duration(r["predicted_time_to_train_s"]) + short_flops_mark(r),
        ])  # fmt: skip
    marks = {short_flops_mark(r) for r in fits + too_big}
    out = [table(rows, header)]
    if "+" in marks:  # such a plan would rank on compute it was not charged for
        out.append(
            "time to train +: the plan's step runs convolutions or dots in loops (flop_loops "
            "in --json; on an fsdp mesh, the TPU compiler's windowed einsums), whose bodies "
            "XLA's FLOP count takes once: its compute is undercounted, so its time and its "
            "rank are optimistic"
        )
    if "?" in marks:
        out.append(
            "time to train ?: the plan's report does not say whether its step runs compute in "
            "loops (flop_loops null in --json), so its FLOP count may be short"
        )
    out += [
        f"{'ruled out' if r.get('ruled_out') else 'failed'}: {r['plan']}: {r['error']}"
        for r in failed
    ]
    return "\n".join(out)


def legend(target, preset, devices: int, calibrated_from: str | None) -> str:
    """Which of the table's figures are compiled and which modelled (and from what)."""
    from hybridpar.simulate.hardware import STEP_FLOOR_S

    floor = f"at least {STEP_FLOOR_S * 1e3:g} ms a step (the per-step floor, an ASSUMPTION)"
    if target is not None:
        return (
            f"compiled (the TPU compiler, {target.spec}): memory/dev, collectives. modelled: "
            f"img/s and time to train, {COMPUTE_WORDS}, plus its collectives as python -m "
            "hybridpar.simulate prices them (ICI within a slice, DCN between slices) less the "
            f"share its schedule hides (an estimate), {floor}; no input or evaluation cost: "
            "an estimate for ranking plans, not a prediction of a run"
        )
    rate = f"measured ({calibrated_from})" if calibrated_from else preset.reference_note
    return (
        f"compiled (XLA:CPU on {devices} virtual devices): memory/dev, collectives. modelled "
        f"(python -m hybridpar.simulate, {preset.name}): img/s and time to train, from the "
        f"compiled FLOPs and collectives, the device's rate {rate}, {floor}"
    )


def estimate_used(target, hardware, overlap: float, rows: list, devices: int) -> dict:
    """The JSON's record of what the estimate used: the scaling model's preset (its name,
    efficiency, per-step overhead and calibration) and ``--overlap``; for a TPU target none
    of them (the compiler's counts on the chip, its links and the compiler's schedule
    replace them; where
    a report has no schedule figures its TPU preset hides nothing: ``exposed_from``), and
    the estimate in words."""
    if target is None:  # no overlap where the preset hides nothing (a TPU's), as simulate
        return {"hardware": hardware.name, "efficiency": hardware.efficiency,
                "step_overhead_s": hardware.step_overhead_s,
                "calibration": hardware.reference_note,
                "overlap": overlap if hardware.max_overlap > 0 else None}  # fmt: skip
    return {"hardware": None, "efficiency": None, "step_overhead_s": None, "calibration": None,
            "overlap": None, "estimate": legend(target, None, devices, None)}  # fmt: skip


# ---- The command line ------------------------------------------------------------------------


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        "python -m hybridpar.plan",
        (
            "Find the mesh, head, BatchNorm sync, communication and batch that fit a pod and "
            "train fastest, by compiling each candidate."
        ),
    )
    p.add_argument(
        "--devices",
        type=int,
        help="plan for N devices (compiled on N virtual CPU devices)",
    )
    p.add_argument(
        "--target",
        help="plan for a TPU slice with the TPU compiler (no TPU needed), e.g. tpu:v5p-256: "
        "memory is the chip's, plans ranked by the compiler's FLOPs and bytes on the chip",
    )
    p.add_argument(
        "--hardware",
        help="scaling-model preset (python -m hybridpar.simulate --list-presets; default h100)",
    )
    p.add_argument(
        "--memory-gib",
        type=cli.finite_float,
        help="per-device memory limit (default: the preset's)",
    )
    p.add_argument(
        "--meshes",
        help="meshes to try, space-separated, e.g. 'data:64 fsdp:64 data:8,model:8' "
        "(default: every data x fsdp x model factorisation with model <= 8)",
    )
    p.add_argument("--heads", help="dense,sharded,partial_fc (default: all three)")
    p.add_argument("--bn-sync", help="global,local (default: both)")
    p.add_argument(
        "--comm",
        help="auto, xla, bucketed:MB, overlap:MB, comma-separated "
        "(default: the config's, xla unless it is auto, and bucketed at "
        "comm.bucket_mb)",
    )
    p.add_argument(
        "--per-device-batch",
        help="images per data-parallel device (data x fsdp, as config.stages counts them) to "
        "try; the global batch is this times the mesh's data x fsdp (default: the config's "
        "global batch on every mesh; refused for a config with stages)",
    )
    p.add_argument(
        "--images-per-epoch",
        type=int,
        help="training images per epoch, for the time to train (default: digits' split, or "
        "synthetic data's data.train_examples; data read from files needs it)",
    )
    p.add_argument("--precision", help="precision.compute values to try (default: the config's)")
    p.add_argument(
        "--max-plans",
        type=int,
        default=24,
        help="compile at most this many, closest to the config first (default 24)",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="compiles at a time, one process each (default 1)"
    )
    p.add_argument(
        "--overlap",
        type=cli.finite_float,
        help="scaling model's overlap of communication with the backward pass, in [0, 1] "
        f"(default {DEFAULT_OVERLAP:g}; not used with --target tpu:..., whose compiler's "
        "schedule says what is hidden, nor with a TPU --hardware preset, which hides nothing)",
    )
    p.add_argument(
        "--calibrate-from",
        metavar="METRICS_JSONL",
        help="fit the preset's per-step overhead and efficiency to a run of this model "
        "(python -m hybridpar.simulate --calibrate-from; docs/scaling.md)",
    )
    p.add_argument(
        "--calibrate-devices", type=int, help="devices of that run (default 1)"
    )
    p.add_argument(
        "--cache-dir", help=f"where compiled results are kept (default {default_cache_dir()})"
    )
    p.add_argument("--no-cache", action="store_true", help="compile everything, keep nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p  # fmt: skip


def main(argv=None) -> None:
    if argv is None:  # the command itself (a TPU target's compile needs it: see there)
        from hybridpar.tools import targets

        targets.unlimited_stack_for_tpu(sys.argv[1:])
    # XLA's C++ warnings (the SPMD partitioner's, one per compile) kept off the terminal
    # among the progress lines unless the user set the level; its errors still come
    # through. Set before JAX starts (its own default is 1), the workers inherit it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hybridpar import simulate as sim

    args, config = cli.parse(build_parser(), argv)
    target = target_of(args.target, args.devices, gpu=False)
    # flags another makes moot: refused, never silently unused
    if args.calibrate_devices is not None and not args.calibrate_from:
        cli.fail("--calibrate-devices says how many devices the --calibrate-from run had; "
                 "pass --calibrate-from RUN/metrics.jsonl with it, or drop it")  # fmt: skip
    if args.cache_dir == "":  # else the default, silently
        cli.fail("--cache-dir '' names no directory: pass one, e.g. --cache-dir "
                 "/tmp/hybridpar-plan, or drop --cache-dir for the default")  # fmt: skip
    if args.no_cache and args.cache_dir is not None:
        cli.fail(f"--cache-dir {args.cache_dir} is not used with --no-cache, which keeps "
                 "nothing; drop one of them")  # fmt: skip
    tpu = target is not None and target.platform == "tpu"
    # the scaling model's settings: None where not given (their defaults are set below)
    for flag, value in (("--hardware", args.hardware), ("--calibrate-from", args.calibrate_from),
                        ("--overlap", args.overlap)):  # fmt: skip
        if tpu and value is not None:
            cli.fail(f"{flag} is not used with --target {args.target} (the TPU compiler's "
                     "figures for the chip replace the scaling model); drop it")  # fmt: skip
    args.hardware = args.hardware or "h100"
    overlap_given = args.overlap is not None
    args.overlap = DEFAULT_OVERLAP if args.overlap is None else args.overlap
    args.calibrate_devices = 1 if args.calibrate_devices is None else args.calibrate_devices
    if target is not None:
        args.devices = target.devices_count
        if target.platform == "gpu":  # its ranking needs the compiler's FLOPs
            cli.fail(
                f"--target {args.target}: the GPU compiler gives no FLOP count ahead of time, "
                f"so plans cannot be ranked for it; python -m hybridpar.compile --target "
                f"{args.target} gives a plan's memory and collectives"
            )
        if target.platform == "cpu":
            target = None
    if tpu:  # its collectives are priced on ICI within a slice and DCN between them
        try:
            link_preset(target)
        except ValueError as e:
            cli.fail(f"--target {args.target}: {e}; plan one slice, e.g. --target "
                     f"{args.target.split(',')[0]}")  # fmt: skip
    if args.devices is None:
        cli.fail("pass --devices N (virtual CPU devices) or --target tpu:CHIP-N")
    n = args.devices
    for flag, value in (
        ("--devices", n),
        ("--max-plans", args.max_plans),
        ("--jobs", args.jobs),
        ("--calibrate-devices", args.calibrate_devices),
    ):
        if value < 1:
            cli.fail(f"{flag}={value}: must be >= 1")
    if target is None:  # compiled on N virtual CPU devices (a cpu:N target's checked above)
        check_virtual_devices(n, f"--devices={n}", gpu=False)
    # Every flag is checked before the first compile: a mistake is one line now, not a
    # traceback after minutes of compiling.
    if not 0.0 <= args.overlap <= 1.0:
        cli.fail(
            f"--overlap={args.overlap:g}: the share of the backward pass that hides "
            "communication is in [0, 1], e.g. --overlap 0.8"
        )
    points = None
    if args.calibrate_from:
        points = calibration_points(args.calibrate_from, args.calibrate_devices)
    try:
        preset = sim.get_preset(args.hardware)
    except ValueError as e:
        cli.fail(f"--hardware: {e}")
    if target is None:  # what simulate refuses on this preset, refused here too
        if overlap_given and preset.max_overlap <= 0:
            cli.fail(f"--overlap is not used with --hardware {args.hardware}: the TPU compiler "
                     "leaves its collectives synchronous, so the model hides none of them "
                     "(exposed = comm); drop --overlap")  # fmt: skip
        problem = sim.devices_problem(preset, n)
        if problem:
            cli.fail(f"--devices {n}: {problem}")
    default_gib = target.chip.hbm_bytes / GIB if target else preset.memory_gib
    limit_gib = default_gib if args.memory_gib is None else args.memory_gib
    if limit_gib <= 0:
        cli.fail(f"--memory-gib={limit_gib:g} must be positive")
    if target is not None:  # before anything below starts JAX (workers inherit it)
        from hybridpar.tools import targets

        try:  # each plan's own comm flags: in its worker (compile_one)
            targets.prepare(target)
        except ConfigError as e:
            cli.fail(str(e))
        os.environ["HYBRIDPAR_PLAN_TARGET"] = target.spec
    else:
        use_virtual_cpu_devices(n)  # with comm_report's ANALYSIS_XLA_FLAGS
        os.environ.pop("HYBRIDPAR_PLAN_TARGET", None)
    os.environ["HYBRIDPAR_PLAN_DEVICES"] = str(n)
    config_path, base_overrides = args.config_path, args.config_overrides

    def log(message):  # progress on stderr, so --json's stdout stays one object
        print(message, file=sys.stderr, flush=True)

    def run():
        from hybridpar.config.schema import validate

        validate(config)  # every value checked before a device or a worker starts
        check_rule_axes(config)  # as every plan's set-up would, once, not once per worker
        images_per_epoch = images_per_epoch_of(config, args.images_per_epoch)
        platform = target.platform if target is not None else "cpu"
        choices = _choices(config, n, args, platform)
        _check_values(config, choices, validate)
        slices = target.slices if target is not None else preset_slices(preset, n)
        plans, product, excluded = candidates(config, n, choices, platform, slices)
        if not plans:
            fix = "widen --meshes/--heads/--comm"
            if any(r.startswith("--config.global_batch=") for r in excluded):
                fix += (", set --config.global_batch to a multiple of a mesh's data x fsdp, or "
                        "pass --per-device-batch")  # fmt: skip
            cli.fail(
                f"no candidate plan is valid for {n} devices with these choices "
                f"({counted(product, 'combination')}, ruled out: {ruled_out_words(excluded)}); "
                + fix
            )
        cache_dir = usable_cache_dir(args)  # made only once every input is checked
        kept = plans[: args.max_plans]
        log(
            f"plan: {counted(product, 'combination')}, {len(plans)} valid"
            + (f" (ruled out: {ruled_out_words(excluded)})" if excluded else "")
            + f"; the {len(kept)} closest to the config {'is' if len(kept) == 1 else 'are'} "
            f"planned (--max-plans {args.max_plans})"
        )
        results = compile_plans(
            config_path, config, base_overrides, kept, n, args.jobs, cache_dir, log
        )
        limit = int(limit_gib * GIB)
        hardware = preset
        if args.calibrate_from:
            hardware = _calibrated(preset, results, kept, points, args.calibrate_from)
        fits, too_big, failed = plan_rows(
            config, results, n, hardware, limit, args.overlap, images_per_epoch, target
        )
        if not fits:
            if too_big:
                cli.fail(no_fit_words(too_big, failed, limit, target))
            first = failed[0]
            cli.fail(f"every plan failed to compile; the first: {first['plan']}: {first['error']}")
        best = fits[0]
        winning = " ".join(f"--config.{k}={v}" for k, v in best["overrides"].items())
        cached = sum(r["from_cache"] for r in fits + too_big + failed)
        ruled = sum(r["ruled_out"] for r in failed)
        if args.json:
            print(json.dumps({
                "devices": n, "memory_limit_bytes": limit,
                "target": target.spec if target else None,
                **estimate_used(target, hardware, args.overlap, fits + too_big, n),
                "images_per_epoch": images_per_epoch,
                "combinations": product, "valid": len(plans),
                "ruled_out_by_reason": dict(excluded.most_common()),
                # planned = compiled this call (or ruled out by its set-up) + from the cache
                "planned": len(kept), "compiled": len(kept) - cached, "from_cache": cached,
                "cache_dir": str(cache_dir) if cache_dir else None,
                "tied_at_floor": floor_tie(fits), "plans": fits, "too_big": too_big,
                "failed": failed, "winning_overrides": winning,
            }))  # fmt: skip
            return
        on = target.describe() if target else f"{preset.name} ({preset.description})"
        print(
            f"plan: {config_path} on {n} device{'s' if n > 1 else ''}, {on}, "
            f"{byte_size(limit)} per device; {counted(len(fits), 'plan')} "
            f"{'fits' if len(fits) == 1 else 'fit'}, {len(too_big)} "
            f"{'does' if len(too_big) == 1 else 'do'} not"
            + (f", {ruled} ruled out by the config when set up" if ruled else "")
            + (f", {len(failed) - ruled} failed" if len(failed) > ruled else "")
            + (f"; {cached} of {len(kept)} from the cache ({cache_dir})" if cached else "")
        )
        stages = parse_stages(config.stages) if config.stages else []
        stage_batches = ",".join(str(b) for _, _, b, _ in stages)
        print(format_table(fits, too_big, failed, limit, stage_batches))
        print(legend(target, hardware, n, args.calibrate_from))
        print(
            f"batch/dp-dev: images per data-parallel device (data x fsdp), as config.stages "
            f"counts them; an epoch is {images_per_epoch:,} images"
            + (
                "; with stages, memory/dev and collectives are the train step of the stage "
                "needing the most memory"
                if config.stages else ""
            )
        )
        tied = floor_tie(fits)
        if tied:
            print(
                f"the top {tied} plans tie at the per-step floor: among them the ranking is by "
                "the step before the floor (exposed communication), then memory"
            )
        short_flops_note = {
            "": "",
            "+": " (optimistic: its FLOP count is short, time to train +)",
            "?": " (its FLOP count may be short, time to train ?)",
        }
        print(
            f"\nbest: {best['plan']}: {byte_size(best['memory_per_device_bytes'])}/device, "
            f"predicted {best['predicted_images_per_s']:,.0f} img/s, "
            f"{duration(best['predicted_time_to_train_s'])} to train"
            + short_flops_note[short_flops_mark(best)]
        )
        print(f"winning overrides: {winning}")

    cli.main(run)


if __name__ == "__main__":
    main()
