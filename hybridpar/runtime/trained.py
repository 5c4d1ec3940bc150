"""A trained run read back: its config (the one its latest checkpoint holds), its program
and state on a mesh, and a new run's state started from its weights (``init_from``). The
tools that read a run (evaluate, quantize, prune, compress) and the trainer's
``init_from`` read it here.
"""

from __future__ import annotations

import json
import os

import jax

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import from_saved
from hybridpar.program import program
from hybridpar.runtime import checkpoint


def load_config(workdir: str, overrides=()):
    """The config of the run in ``workdir``, its latest checkpoint's (else its
    ``config.json``'s), with ``overrides`` applied: what the tools that read a run use
    without ``--config``. They run in one process, so ``distributed`` is off unless an
    override sets it."""
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"no {path}: pass the --workdir of a training run (python -m hybridpar.train "
            "writes its config there when it starts), or --config experiments/NAME.py"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read {path!r} ({e}): pass --config experiments/NAME.py"
        ) from None
    config = from_saved(saved, path)
    # the run's truth is its latest checkpoint's config (config.json may be edited by hand)
    held = checkpoint.run_config(workdir, config)
    if held is not None and held != saved:
        config = from_saved(held, f"the latest checkpoint in {workdir}")
    config.distributed = False
    config.lock()
    return cli.apply_overrides(config, overrides, path)


def read_trained(workdir: str, mesh, partitioning=None):
    """``(config, program, state)``: the run in ``workdir`` (``load_config``'s) and its
    latest checkpoint, read into its shardings on ``mesh`` (with ``partitioning``, another
    config's placement section: a teacher placed like its student)."""
    config = load_config(workdir)
    if partitioning is not None:
        with config.unlocked():
            config.partitioning = partitioning
    prog = program.build_program(config, mesh)
    return config, prog, checkpoint.latest_state(config, workdir, prog.abstract_state())


def start_from(path: str, state, prog):
    """``state`` (a new run's, at step 0) with the parameters and BatchNorm statistics of
    the run in ``path`` (``init_from``), read into this run's shardings; its shapes must be
    this model's."""
    _, _, src = read_trained(path, prog.mesh, prog.config.partitioning)
    for name in ("params", "batch_stats"):
        a, b = getattr(state, name), getattr(src, name)
        shapes = jax.tree.map(lambda x: x.shape, a), jax.tree.map(lambda x: x.shape, b)
        if jax.tree.structure(a) != jax.tree.structure(b) or shapes[0] != shapes[1]:
            raise ConfigError(
                f"init_from={path!r} holds a model of other shapes than this config's: give "
                f"this run the model keys of {path}/config.json (model.name, model.*_width*)"
            )
    return state.replace(params=src.params, batch_stats=src.batch_stats)
