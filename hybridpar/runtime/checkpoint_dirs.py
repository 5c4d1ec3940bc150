"""Where a run's checkpoints are, and which steps there are committed, from the files alone.

JAX-free: the supervising parent of a distributed run, the config checks that come before
the backend starts, and the tools that only ask whether a run has a checkpoint read these.
orbax writes a step into a temporary folder and renames it to the step's number once it is
complete, so a folder named by a number alone is a committed step.
"""

from __future__ import annotations

import os


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
