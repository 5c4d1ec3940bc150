"""Where a run's checkpoints are, and which steps there are committed, from the files alone.

JAX-free: the supervising parent of a distributed run, the config checks that come before
the backend starts, and the tools that only ask whether a run has a checkpoint read these.
orbax writes a step into a temporary folder and renames it to the step's number once it is
complete, so a folder named by a number alone is a committed step.
"""

from __future__ import annotations

import json
import os

# In a checkpoint.dir outside the workdir: the workdir of the run that writes there, so that
# a copy of that workdir (or a new one) naming the same folder is not a second writer in it
OWNER = "owner.json"


def checkpoint_dir(config, workdir: str) -> str:
    """``checkpoint.dir``, a relative one under ``workdir`` (not the current directory: a
    resume, the evaluator or quantize started elsewhere must find the same checkpoints)."""
    where = os.path.expanduser(config.checkpoint.dir or "checkpoints")
    return os.path.abspath(os.path.join(workdir, where))


def committed_steps(directory: str) -> list[int]:
    """The committed steps in ``directory``, oldest first; none where it does not exist."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def outside(directory: str, workdir: str) -> bool:
    """Whether checkpoint directory ``directory`` lies outside ``workdir`` (by their paths: a
    folder inside it, the default, travels with a copy of the workdir)."""
    top = os.path.abspath(workdir)
    return os.path.commonpath([os.path.abspath(directory), top]) != top


def owner_of(directory: str) -> str | None:
    """The workdir ``OWNER`` in ``directory`` names, or None (none recorded, or unreadable:
    checkpoints from before owners were recorded, or written by hand)."""
    try:
        with open(os.path.join(directory, OWNER)) as f:
            owner = json.load(f).get("workdir")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) and owner else None


def escapes(config) -> bool:
    """Whether ``config``'s checkpoint.dir lies outside any workdir (absolute, or up out of
    it): the tools that run the trainer in folders of their own (tune's trials, compress's
    rounds) would all save there."""
    return outside(checkpoint_dir(config, "w"), "w")
