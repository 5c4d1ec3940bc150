"""Compiled programs saved to a file and loaded by the run instead of compiling.

    save(path, program, target)      # python -m hybridpar.compile ... --out FILE
    load(path, program, recompile)   # python -m hybridpar.train ... --compiled FILE

``save`` writes every program a ``Program`` has compiled (JAX's ``serialize_executable``)
with what they were compiled for: the devices (platform, kind, count), the mesh, a hash of
the config (the keys that may change between a run's segments left out: they change no
program) and the config itself, a hash of the state's placement (the arrays' shardings the
programs take: the same config placed otherwise by another hybridpar's rules would be
refused at the first step), and the JAX, jaxlib and libtpu versions. ``load`` checks each
of those against the run it is loading into; a mismatch is one error naming it (a config by
its first differing key, as a workdir's is named; ``recompile=True`` warns and
compiles instead), since an executable for another mesh, config or compiler would run
another computation or none. On a match the run's steps are the loaded executables and
compile nothing: on a pod, minutes of the clock saved at every start and restart.

The file is a pickle (executables and their argument trees): load only files you made.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time

from hybridpar.config.errors import ConfigError
from hybridpar.parallel import comm
from hybridpar.runtime import run_config

FORMAT = 2  # 2: the placement's hash in the header


# data.train_examples reaches the programs only through the plan, which is compared itself:
# a compile without the data may set it to the data's count and still fit the run's config.
# The rest only the host reads (when to evaluate and stop, the tuner's settings), so a
# default changed there leaves compiled files valid.
NOT_HASHED = (
    *run_config.FREE_KEYS,
    "data.train_examples",
    "tune.",
    "target_top1",
    "target_top5",
    "stop_at_target",
    "eval_every_epochs",
    "compile_ahead",
)
# the distillation loss is in the train step only with a teacher
DISTILL_LOSS = ("distill.alpha", "distill.temperature")


def not_hashed(config) -> tuple[str, ...]:
    """The keys (or prefixes ending in ".") no compiled program of ``config`` depends on."""
    return NOT_HASHED if config.distill.teacher_workdir else (*NOT_HASHED, *DISTILL_LOSS)


def config_hash(config) -> str:
    """sha256 of the config's keys that can change a compiled program (``not_hashed`` out)."""
    flat = run_config.flatten(run_config.config_dict(config))
    free = not_hashed(config)
    kept = {k: v for k, v in sorted(flat.items()) if not k.startswith(free)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def config_differences(saved: dict, config) -> list[tuple[str, object, object]]:
    """``(key, when compiled, now)`` for each key ``config_hash`` covers that differs from
    the config a file was compiled with, in the config's order."""
    return run_config.differences(saved, run_config.config_dict(config), free=not_hashed(config))


def data_size(config) -> int | None:
    """The training examples of a built-in data set whose size is known without reading
    it (scikit-learn's digits: its fixed split), else None: a compile without the data then
    plans from it as the run will from the data."""
    if config.data.name != "digits":
        return None
    from hybridpar.input import arrays

    return len(arrays.load_digits(8)[0]["label"])  # the split does not depend on the size


def describe(program) -> dict:
    """What a program's executables are compiled for, as ``save`` records and ``load``
    compares."""
    device = program.mesh.devices.flat[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": int(program.mesh.size),
        "mesh": {k: int(v) for k, v in program.mesh.shape.items()},
        "config_hash": config_hash(program.config),
        "placement": placement_hash(program),
        # the steps' schedules are functions of the plan (steps per stage and epoch), which
        # a compile without data takes from data.train_examples
        "plan": [[s.start_step, s.num_steps, s.steps_per_epoch] for s in program.plan.stages],
        "jax": comm.installed_version("jax"),
        "jaxlib": comm.installed_version("jaxlib"),
        "libtpu": comm.installed_version("libtpu") if device.platform == "tpu" else None,
        "cuda_plugin": comm.installed_version("jax-cuda12-plugin")
        if device.platform == "gpu"
        else None,
    }


def placement_hash(program) -> str:
    """A hash of every state array's path and sharding spec, as the programs take them."""
    import jax

    from hybridpar.parallel.partitioning import path_str

    leaves = jax.tree_util.tree_flatten_with_path(program.shardings)[0]
    specs = [(path_str(kp), str(getattr(s, "spec", s))) for kp, s in leaves]
    return hashlib.sha256(repr(specs).encode()).hexdigest()[:16]


def _tmp_name(path: str) -> str:
    """Where ``path`` is written before its rename: a name of this process's, so that no
    file of the user's (a ``path.tmp`` of their own) is truncated or removed."""
    return f"{path}.tmp-{os.getpid()}"


def check_out(path: str) -> None:
    """``path`` can be written (a file of this process's own name beside it created and
    removed), or one error: checked before compiling, which takes minutes for a large model."""
    if os.path.isdir(path):
        example = os.path.join(path, "programs.bin")  # (one slash after "dir/" too)
        raise ConfigError(f"--out {path} is a folder: name a file in it, e.g. {example}")
    tmp = _tmp_name(path)
    try:
        with open(tmp, "xb"):
            pass
        os.remove(tmp)
    except OSError as e:
        raise ConfigError(
            f"--out {path}: cannot write there ({e.strerror}); name a file in a folder that "
            "exists and that you can write"
        ) from None


def save(path: str, program, target: str) -> dict:
    """Writes every compiled program of ``program`` to ``path``; returns the file's header.
    A failed write (a full disk) is one error and leaves neither ``path`` nor its ``.tmp``."""
    from jax.experimental.serialize_executable import serialize

    cached = [r for r in program.compiles if r.get("cache_hit")]
    if cached:  # see compile.compile_programs: such a file fails at the loading run's step
        raise ConfigError(
            f"{len(cached)} of the programs came from JAX's persistent compilation cache, "
            "which does not serialize whole: compile them with the cache off "
            "(jax.config.update('jax_enable_compilation_cache', False)) and save again"
        )
    header = {"format": FORMAT, "target": target, **describe(program), "programs": []}
    # the config itself, so a refusal names the key that differs, not just the hash
    header["config"] = run_config.config_dict(program.config)
    # the compiler flags they were compiled under (comm.apply's and the user's): they shape
    # the schedule, so a reader can tell how; not compared on load, since a compiled program
    # runs as it was compiled whatever the loading process's flags
    flags = {var: os.environ.get(var) for var in comm.ENV_VAR.values()}
    header["compiler_flags"] = {var: v for var, v in flags.items() if v}
    entries = []
    for (kind, batch, size), compiled in program.compiled_programs().items():
        payload, in_tree, out_tree = serialize(compiled)
        entries.append(((kind, batch, size), payload, in_tree, out_tree))
        header["programs"].append({"program": kind, "batch": batch, "image_size": size})
    tmp = _tmp_name(path)
    try:
        with open(tmp, "xb") as f:
            pickle.dump({"header": header, "entries": entries}, f)
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(
            f"--out {path}: the compiled programs were not written ({e.strerror}); free "
            "space there or name another --out, and compile again"
        ) from None
    return header


def mismatches(header: dict, here: dict, config=None) -> list[tuple[str, object, object]]:
    """``(field, when compiled, here)`` for each field of ``describe`` (and the format)
    where a file's ``header`` and this run differ, the format first. Where the header holds
    the config, the run's (``config``) is compared key by key, each differing key named;
    else by the hash. A version this run lacks (no libtpu on a CPU run) is not compared:
    the platform already differs."""
    wrong = [] if header.get("format") == FORMAT else [("format", header.get("format"), FORMAT)]
    for k, v in here.items():
        keys = []
        if k == "config_hash" and config is not None and isinstance(header.get("config"), dict):
            keys = config_differences(header["config"], config)
        if keys:
            wrong.extend(keys)
        elif header.get(k) != v and not (k in ("libtpu", "cuda_plugin") and v is None):
            wrong.append((k, header.get(k), v))
    return wrong


def load(path: str, program, recompile: bool = False) -> int:
    """Puts the executables of ``path`` into ``program`` (its steps then compile nothing);
    returns how many. A file for other devices, mesh, config or versions is an error, or
    with ``recompile`` a warning and nothing loaded."""
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        header, entries = saved["header"], saved["entries"]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--compiled {path}: not a file of compiled programs ({type(e).__name__}: {e}); "
            "write one with python -m hybridpar.compile --config ... --target ... --out FILE"
        ) from None
    wrong = mismatches(header, describe(program), program.config)
    if wrong:
        key, was, now = wrong[0]
        what = f"{key} was {was!r} when compiled (--target {header.get('target')}), now {now!r}"
        if key == "placement":
            what += (" (the state's shardings: the config places its arrays otherwise than "
                     "when compiled, e.g. after a hybridpar upgrade changed a preset)")  # fmt: skip
        if key == "plan":  # [start step, steps, steps per epoch] per stage
            what += (
                " ([first step, steps, steps per epoch] per stage: a compile without the "
                "data plans from data.train_examples; give the compile "
                "--config.data.train_examples=<this data's training examples>)"
            )
        others = ", ".join(k for k, _, _ in wrong[1:])
        more = f" (and {others} differ{'s' if len(wrong) == 2 else ''})" if others else ""
        if not recompile:
            raise ConfigError(
                f"--compiled {path} does not fit this run: {what}{more}; compile it again "
                "for this run (python -m hybridpar.compile with the same config and "
                "--target), or pass --recompile to compile here instead"
            )
        print(f"warning: --compiled {path} does not fit this run: {what}{more}; "
              "compiling here instead (--recompile)", flush=True)  # fmt: skip
        return 0
    from jax.experimental.serialize_executable import deserialize_and_load

    for key, payload, in_tree, out_tree in entries:
        t0 = time.time()
        compiled = deserialize_and_load(payload, in_tree, out_tree)
        program.preload(key, compiled, load_s=time.time() - t0, source=path)
    return len(entries)
