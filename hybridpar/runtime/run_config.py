"""The config record of a run, and the comparisons of a new command's config with it.

A workdir is a run (docs/running.md). ``check_run`` reads what it holds before anything is
built: the config its latest checkpoint holds (``config.json``, written at each start, where
there is no checkpoint yet) must match the new config, or the command is an error naming the
first differing key (``--allow-config-change`` overrides); a ``summary.json`` that says
completed means there is nothing left to do. ``record_config`` writes ``config.json``.
"""

from __future__ import annotations

import collections
import json
import os

import jax

from hybridpar.config.errors import WorkdirError
from hybridpar.runtime.checkpoint_dirs import checkpoint_dir, committed_steps, outside
from hybridpar.runtime.run_records import read_json, read_records, write_json

# Keys that may change between the segments of one run: they change neither the numbers
# nor what a checkpoint holds (how often to log and checkpoint, how long to wait for the
# other processes, where compiled programs are cached).
FREE_KEYS = (
    "log_every_s",
    "checkpoint.",
    "distributed_timeout_s",
    "distributed_heartbeat_s",
    "compile_cache",
)
# Keys that only place the computation or move data: a run resumes with other values (a
# checkpoint restores into the new shardings, the `resume` line names them), and the
# evaluator and quantize may set their own. The mesh with one proviso: the global batches
# must stay (``check_batches``). The one list for the trainer and the tools that read a run,
# but for ARITHMETIC_KEYS.
PLACEMENT_KEYS = (
    "mesh",
    "partitioning.",
    "comm.",
    "distributed",
    "eval_batch",
    "data.prefetch",
    "data.threads",
)
# Placement keys that change the arithmetic, not only its schedule: a resume refuses them
# as it refuses precision.compute (``resume_differences``); the evaluator and quantize, which
# sum no gradients, may still set their own. comm.reduce_dtype is the precision the
# gradients are summed in; the other comm.* keys choose how the same sums are scheduled.
ARITHMETIC_KEYS = ("comm.reduce_dtype",)


def key_names(keys) -> list[str]:
    """``keys`` as a person writes them: a prefix (``"comm."``) as ``comm.*``, and the
    ``ARITHMETIC_KEYS`` under it named as excepted (``comm.* but comm.reduce_dtype``)."""
    out = []
    for k in keys:
        if k.endswith("."):
            held = [a for a in ARITHMETIC_KEYS if a.startswith(k)]
            k += "*" + (f" but {', '.join(held)}" if held else "")
        out.append(k)
    return out


def resume_differences(saved: dict, new: dict) -> list[tuple[str, object, object]]:
    """The ``differences`` a resume refuses without ``--allow-config-change``: all but the
    placement keys, ``ARITHMETIC_KEYS`` among them kept, and but the keys nothing reads in
    either config (``schema.moot_keys``)."""
    moot = _moot_keys(saved) & _moot_keys(new)
    return [
        d
        for d in differences(saved, new)
        if (not d[0].startswith(PLACEMENT_KEYS) or d[0].startswith(ARITHMETIC_KEYS))
        and d[0] not in moot
    ]


def _moot_keys(d: dict) -> set[str]:
    """``schema.moot_keys`` of a saved config (none where one it needs is missing: a config
    from before the key existed is compared key by key)."""
    import ml_collections

    from hybridpar.config.schema import moot_keys

    try:
        return moot_keys(ml_collections.ConfigDict(d))
    except (AttributeError, KeyError):
        return set()


def config_dict(config) -> dict:
    """The config as plain JSON values (tuples become lists), as ``config.json`` holds it."""
    return json.loads(config.to_json())


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def differences(saved: dict, new: dict, free=()) -> list[tuple[str, object, object]]:
    """``(key, saved value, new value)`` for every key that differs, in the config's order;
    a key one side lacks has the value ``"<missing>"`` there. ``FREE_KEYS`` and ``free``
    (keys, or prefixes ending in ".") are left out, and so is a key the saved config lacks
    whose new value is its default: a key added to ``base_config`` since that run started,
    set as the run had it (without the key)."""
    from hybridpar.config.schema import base_config

    a, b = flatten(saved), flatten(new)
    defaults = flatten(config_dict(base_config()))
    free = (*FREE_KEYS, *free)
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        if key.startswith(free):
            continue
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        old, now = a.get(key, "<missing>"), b.get(key, "<missing>")
        if old != now:
            out.append((key, old, now))
    return out


def another_config(workdir: str, diff: list, what: str = "workdir") -> str:
    """The start of the error for a workdir (or ``what`` else) whose run has another config:
    its first difference (``differences``) and how many more."""
    key, old, new = diff[0]
    more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
    return f"{what} {workdir!r} holds a run of another config: {key} was {old!r}, now {new!r}{more}"


def held_config(directory: str) -> tuple[int, dict] | None:
    """``(step, config)`` of the newest checkpoint in ``directory`` whose config reads back,
    or None. Read as a file (orbax's JSON item), without JAX: ``check_run`` comes before
    the backend may start. Only committed steps are named by their number alone."""
    for step in reversed(committed_steps(directory)):
        try:
            with open(os.path.join(directory, str(step), "config", "metadata")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and saved:
            return step, saved
    return None


def of_workdir(workdir: str, config) -> dict | None:
    """The config of the run in ``workdir``: the one its latest checkpoint holds, which is
    what a resume continues; ``config.json`` (a file anyone may edit) only where there is no
    checkpoint yet."""
    held = held_config(checkpoint_dir(config, workdir))
    if held:
        return held[1]
    path = os.path.join(workdir, "config.json")
    return read_json(path)  # JSON but no object, too, is its error


# What a workdir may hold, as tune names it: a run of the trainer, or tune's own study or
# range test (hybridpar/tools/tune.py). ``tune_files`` tells the last two by their files.
KINDS = {"train": "a training run", "lr": "an LR range test", "search": "a search study"}
# Written by tune lr before its test is set up: a test stopped before its lr_range.json (in
# its set-up, or while it trains) is a test to resume, not a run to train on.
LR_TEST_MARK = "tune_lr.json"


def tune_files(workdir: str) -> str | None:
    """``"search"`` where ``workdir`` holds a tune search's study (``study.db``), ``"lr"``
    where it holds an LR range test (``lr_range.json``, or ``LR_TEST_MARK`` while it is not
    finished), else None (a range test from before the mark is a run, told by its config:
    tune's ``held_kind``)."""
    if os.path.exists(os.path.join(workdir, "study.db")):
        return "search"
    if any(os.path.isfile(os.path.join(workdir, n)) for n in ("lr_range.json", LR_TEST_MARK)):
        return "lr"
    return None


def check_not_tune(workdir: str, expected: str | None = None) -> None:
    """A tune study's or range test's folder is not a run to train in: training there put a
    run's files beside the study's (its folder has no config.json, so nothing else refused
    it), or went on from a stopped test's checkpoint (with --allow-config-change, which the
    config error advised), so that tune lr then found a training run there. ``expected``:
    the kind tune itself sets up there (``"lr"``: its range test resumed), let by."""
    held = tune_files(workdir)
    if held is None or held == expected:
        return
    if held == "lr" and not os.path.isfile(os.path.join(workdir, "lr_range.json")):
        try:  # the mark names the command that resumes the test
            mark = read_json(os.path.join(workdir, LR_TEST_MARK))
        except WorkdirError:
            mark = None
        command = mark.get("command") if isinstance(mark, dict) else None
        raise WorkdirError(
            f"workdir {workdir!r} holds a stopped LR range test ({LR_TEST_MARK}), not a "
            f"training run: train does not run in it; resume it with "
            f"`{command or 'python -m hybridpar.tune lr --config ...'}` or use a new --workdir"
        )
    what, hint = {
        "search": ("tune search's study.db", "each trial's own run is in trials/NNN there"),
        "lr": ("tune lr's lr_range.json", "the same tune lr command shows its result again"),
    }[held]
    raise WorkdirError(
        f"workdir {workdir!r} holds {KINDS[held]} ({what}), not a training run: train does "
        f"not run in it; use a new --workdir ({hint})"
    )


def check_run(workdir: str, config, allow_config_change: bool = False) -> dict | None:
    """What ``workdir`` holds: raises if it is a run of another config (``of_workdir``,
    unless allowed); returns its summary if that run completed, else None (a new run or one
    to resume)."""
    saved = of_workdir(workdir, config)
    if saved is not None and not allow_config_change:
        diff = resume_differences(saved, config_dict(config))
        if diff:
            said, fix = another_config(workdir, diff), "use a new --workdir"
            if not os.path.isfile(os.path.join(workdir, "config.json")):
                # no run of its own (new, or empty): the run is checkpoint.dir's
                ckpt = checkpoint_dir(config, workdir)
                said = another_config(ckpt, diff, "checkpoint.dir")
                if outside(ckpt, workdir):
                    fix = ("give this run a checkpoint.dir of its own (or leave out "
                           "--config.checkpoint.dir)")  # fmt: skip
            raise WorkdirError(
                f"{said}; {fix}, or pass "
                f"--allow-config-change{' on every process' if config.distributed else ''} "
                "to continue that run with this config (only "
                f"{', '.join(key_names(FREE_KEYS + PLACEMENT_KEYS))} may change without it)"
            )
    summary = read_json(os.path.join(workdir, "summary.json"))
    if summary is not None and saved is None:  # a run writes config.json long before it
        raise WorkdirError(
            f"{workdir!r} holds a summary.json but no run (no config.json, no checkpoint): "
            "it is not a hybridpar run's, and training there would overwrite it; use a new "
            "--workdir"
        )
    if summary is not None and summary.get("completed"):
        if saved is None or not differences(saved, config_dict(config), free=PLACEMENT_KEYS):
            return summary
        # the config changed on purpose (more epochs, say): train on from the last step
    return None


def check_batches(workdir: str, config, stages: list, data_parallel: int) -> None:
    """A run resumed on another mesh must train the steps it would have: with
    ``config.stages`` the batches are per data-parallel device, so a mesh of another data x
    fsdp size changes every stage's global batch; and BatchNorm statistics over each
    device's or group's examples (``model.bn_sync`` not global) change with that size too.
    Checked against the last ``stage`` line of the run's ``metrics.jsonl`` (none: no step
    trained yet, any mesh will do)."""
    records, _ = read_records(os.path.join(workdir, "metrics.jsonl"))
    last = next((r for r in reversed(records) if r.event == "stage"), None)
    if last is None or last.stage >= len(stages):
        return  # another number of stages: a change check_run has refused or allowed
    new = stages[last.stage].global_batch
    fix = f"use a mesh with {last.data_parallel or 'its'} data-parallel devices (data x fsdp)"
    if new != last.global_batch:
        raise WorkdirError(
            f"workdir {workdir!r} holds a run that trained stage {last.stage} at global "
            f"batch {last.global_batch}; on mesh {config.mesh!r} ({data_parallel} "
            f"data-parallel devices) config.stages gives it {new}, as its batches are per "
            f"data-parallel device: {fix}, or scale the stages' per-device batches to keep "
            "the global ones (with --allow-config-change)"
        )
    old = last.data_parallel
    if config.model.bn_sync != "global" and old is not None and old != data_parallel:
        raise WorkdirError(
            f"workdir {workdir!r} holds a run trained on {old} data-parallel devices with "
            f"model.bn_sync={config.model.bn_sync!r} (BatchNorm statistics over each device's "
            f"or group's examples); mesh {config.mesh!r} has {data_parallel}, which changes "
            f"those statistics: {fix}, or pass --allow-config-change to train on with "
            "the new statistics"
        )


def record_config(workdir: str, config, held: tuple[int, dict] | None = None) -> list[str]:
    """Writes ``config.json`` (``write_config``); returns the keys that differ (allowed by
    the caller) from the config of the checkpoint resumed, ``held`` as ``(step, config)``,
    or without one from the ``config.json`` it replaces. A ``config.json`` that says
    otherwise than ``held`` is named in a warning. Resumed with a changed config, the file
    is left as it is for the caller to write at its first checkpoint (``write_config``): a
    start stopped before one leaves the run's checkpoints without the change, and so
    ``config.json``."""
    path = os.path.join(workdir, "config.json")
    new = config_dict(config)
    saved = read_json(path)
    base = held[1] if held is not None else saved
    changed = [] if base is None else [k for k, _, _ in differences(base, new)]
    later = held is not None and bool(changed)
    if held is not None and saved is not None and jax.process_index() == 0:
        edited = resume_differences(held[1], saved)
        if edited:
            key, ckpt, file = edited[0]
            more = f" (and {len(edited) - 1} more)" if len(edited) > 1 else ""
            when = " from this start's first checkpoint on" if later else " now"
            print(
                f"warning: {path} says {key}={file!r}{more}, but the checkpoint of step "
                f"{held[0]} this run resumes from holds {key}={ckpt!r}: the checkpoint's "
                "config is the run's (compared with this command's); config.json holds "
                f"this command's config{when}",
                flush=True,
            )
    if not later:
        write_config(workdir, config)
    return changed


def write_config(workdir: str, config) -> None:
    """``config.json`` (process 0, atomically), unless it already holds ``config``."""
    path = os.path.join(workdir, "config.json")
    new = config_dict(config)
    if jax.process_index() == 0 and read_json(path) != new:
        write_json(path, new)


# Keys each process of one run may set for itself: they change no collective and no file.
# Not distributed_heartbeat_s: the coordinator's (process 0's) value is how long a silent
# process lives on, so process 1's own shortened nothing there; one value for the run.
PER_PROCESS_KEYS = ("log_every_s", "distributed_timeout_s", "compile_cache")
SHARED_CHECK = ".hybridpar_shared_check"  # process 0's file every process must see


def check_processes_agree(config, workdir: str | None, allow_config_change: bool = False) -> None:
    """Every process of a multi-process run counts the processes that joined
    (``JAX_NUM_PROCESSES``, where set), runs process 0's config with the same
    ``--allow-config-change``, in the folder process 0 writes. A process started with another
    count trained on unnoticed; one with other overrides trained another computation in the
    same collectives (another LR: wrong losses; another batch: a hang at the end), or, on a
    resume, stopped alone at the workdir's config while the others waited; a workdir that is
    not one shared folder hung in the first checkpoint. One ``ConfigError`` in every process
    instead: its own differences in the process that has them, which processes differ in
    the others."""
    if jax.process_count() == 1:
        return
    import secrets

    import numpy as np
    from jax.experimental import multihost_utils as mh

    from hybridpar.config.errors import ConfigError

    # Before the first collective: JAX's (broadcast, allgather) reshape the devices into
    # processes x local devices, a bare ValueError where the counts differ. Every process
    # knows every device's process, so each says this with no collective.
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        said = ", ".join(f"{counts[i]} in process {i}" for i in sorted(counts))
        raise ConfigError(
            f"the processes of the run drive different numbers of devices ({said}): give "
            "every process the same number (as many on every host; pick them with "
            "JAX_LOCAL_DEVICE_IDS=0,1,... or CUDA_VISIBLE_DEVICES)"
        )
    first, me = jax.process_index() == 0, jax.process_index()
    text = np.frombuffer(json.dumps(config_dict(config)).encode(), np.uint8)
    size = int(mh.broadcast_one_to_all(np.int32(text.size)))
    theirs = mh.broadcast_one_to_all(text if first else np.zeros(size, np.uint8))
    a, b = flatten(json.loads(bytes(np.asarray(theirs)))), flatten(config_dict(config))
    diff = [
        (k, a.get(k, "<missing>"), b.get(k, "<missing>"))
        for k in list(a) + [k for k in b if k not in a]
        if not k.startswith(PER_PROCESS_KEYS) and a.get(k, "<missing>") != b.get(k, "<missing>")
    ]
    sees = True
    if workdir is not None:
        path = os.path.join(workdir, SHARED_CHECK)
        token = int(mh.broadcast_one_to_all(np.uint32(secrets.randbits(31) if first else 0)))
        if first:
            with open(path, "w") as f:
                f.write(str(token))
        mh.sync_global_devices("hybridpar: shared workdir check written")
        if not first:
            try:
                with open(path) as f:
                    sees = f.read() == str(token)
            except OSError:
                sees = False
    counted = os.environ.get("JAX_NUM_PROCESSES", "").strip()  # distributed.from_env checked it
    counted = int(counted) if counted.isdigit() else 0  # 0: unset (a detected cluster's)
    # Which key differs first, as an index into process 0's keys (-1: none, -2: a key
    # process 0 lacks), so that process 0's error can name it too.
    keys = list(a)
    first_key = -1 if not diff else keys.index(diff[0][0]) if diff[0][0] in a else -2
    mine = [bool(diff), sees, counted, allow_config_change, first_key]
    rows = np.asarray(mh.process_allgather(np.array(mine, np.int32)))
    if workdir is not None:
        mh.sync_global_devices("hybridpar: shared workdir check read")
        if first:
            os.remove(os.path.join(workdir, SHARED_CHECK))
    n = jax.process_count()
    wrong = np.flatnonzero((rows[:, 2] != 0) & (rows[:, 2] != n))
    if wrong.size:
        said = ", ".join(f"JAX_NUM_PROCESSES={rows[i, 2]} in process {i}" for i in wrong)
        raise ConfigError(
            f"{n} processes joined the run, but {said}: set JAX_NUM_PROCESSES={n} in every "
            f"process (or start all the processes it names)"
        )
    if rows[:, 3].min() != rows[:, 3].max():
        given = ", ".join(str(i) for i in np.flatnonzero(rows[:, 3]))
        raise ConfigError(
            f"--allow-config-change is passed to process(es) {given} but not to every other "
            "process: pass it on every process or on none (the same command everywhere)"
        )
    same = "start every process with the same command (the same --config and overrides)"
    if diff:
        key, there, here = diff[0]
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        raise ConfigError(
            f"process {me} runs another config than process 0: {key} is {here!r} here, "
            f"{there!r} in process 0{more}; {same}"
        )
    if rows[:, 0].any():
        others = np.flatnonzero(rows[:, 0])
        said = []
        for i in others:
            k = int(rows[i, 4])
            said.append(f"process {i}: {keys[k]} (here {a[keys[k]]!r})" if k >= 0 else
                        f"process {i}: a key this config lacks")
        raise ConfigError(
            f"process(es) {', '.join(str(i) for i in others)} run another config than process "
            f"0 ({'; '.join(said)}); {same}"
        )
    if not rows[:, 1].all():
        blind = ", ".join(str(i) for i in np.flatnonzero(rows[:, 1] == 0))
        # only process 0's own --workdir is process 0's folder: elsewhere, say whose it is
        where = (f"--workdir={workdir}" if me == 0 else
                 f"its --workdir (process {me}, this one, was given --workdir={workdir})")
        raise ConfigError(
            f"process(es) {blind} do not see the files process 0 writes in {where}: every "
            "process must name the same folder, on a file system all hosts share (the "
            "checkpoints are written by every process, into one folder)"
        )
