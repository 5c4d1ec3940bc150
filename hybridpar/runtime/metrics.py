"""Writes a run's records: ``metrics.jsonl`` (the events of ``run_records``), TensorBoard
events and ``summary.json``.

Only process 0 writes; the others keep the same calls so the training loop has no branches.
"""

from __future__ import annotations

import math
import os
import time

import jax

from hybridpar.runtime import run_records


class MetricsWriter:
    def __init__(self, workdir: str, start_time: float | None = None):
        self.workdir = workdir
        self.start = time.time() if start_time is None else start_time
        self.active = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if self.active:
            path = os.path.join(workdir, "metrics.jsonl")
            self._jsonl = open(path, "a", buffering=1)
            if _ends_mid_line(path):
                # A writer killed mid-line (SIGKILL, power loss) left a partial record: end
                # it, so it stays one line that readers skip instead of swallowing the
                # resumed run's first record.
                self._jsonl.write("\n")
            from tensorboardX import SummaryWriter  # lazy: only the writing process needs it

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def wall_s(self) -> float:
        return time.time() - self.start

    def write(self, event: str, step: int, epoch: float, **values) -> dict:
        """One ``event`` line (its fields as ``run_records`` declares them; ``wall_s`` in
        ``values`` stands in for this run's clock); returns the line's object."""
        stamp = {} if "wall_s" in values else {"wall_s": round(self.wall_s(), 3)}
        rec = run_records.make(event, step=step, epoch=epoch, **values, **stamp)
        if self.active:
            self._jsonl.write(run_records.to_line(rec))
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{event}/{k}", v, int(step))
        return run_records.to_dict(rec)

    def summary(self, values: dict) -> None:
        if self.active:
            run_records.write_json(os.path.join(self.workdir, "summary.json"), values)

    def close(self) -> None:
        if self.active:
            self._jsonl.close()
            self._tb.close()


def _ends_mid_line(path: str) -> bool:
    """Whether the file at ``path`` is non-empty and its last byte is not a newline."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
