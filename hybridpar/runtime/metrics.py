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
    def __init__(
        self, workdir: str, start_time: float | None = None, purge_step: int | None = None
    ):
        """``purge_step``: the first step this start records again (a resumed one's steps
        after its checkpoint; 0 for a start again without one): TensorBoard drops the points
        an earlier start wrote from that step on."""
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
            # tensorboardX's event file itself, flushed with each line: its SummaryWriter's
            # thread flushes every 120 s (a kill lost that much, and TensorBoard lagged as
            # long), and its flush() does not wait for that thread to write the last events
            # (lazy: only the writing process needs tensorboardX)
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import SessionLog

            os.makedirs(os.path.join(workdir, "tb"), exist_ok=True)
            self._tb = EventsWriter(os.path.join(workdir, "tb", "events"))
            if purge_step is not None:  # what SummaryWriter(purge_step=...) writes
                self._tb_event(purge_step, session_log=SessionLog(status=SessionLog.START))

    def wall_s(self) -> float:
        return time.time() - self.start

    def write(self, event: str, step: int, epoch: float, **values) -> dict:
        """One ``event`` line (its fields as ``run_records`` declares them; ``wall_s`` in
        ``values`` stands in for this run's clock); returns the line's object."""
        stamp = {} if "wall_s" in values else {"wall_s": round(self.wall_s(), 3)}
        rec = run_records.make(event, step=step, epoch=epoch, **values, **stamp)
        if self.active:
            self._jsonl.write(run_records.to_line(rec))
            from tensorboardX.summary import scalar

            for tag, v in scalars(event, values).items():
                self._tb_event(int(step), summary=scalar(tag, v))
            self._tb.flush()
        return run_records.to_dict(rec)

    def _tb_event(self, step: int, **what) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._tb.write_event(Event(wall_time=time.time(), step=step, **what))

    def summary(self, values: dict) -> None:
        if self.active:
            run_records.write_json(os.path.join(self.workdir, "summary.json"), values)

    def close(self) -> None:
        if self.active:
            self._jsonl.close()
            self._tb.close()


def scalars(event: str, values: dict) -> dict:
    """TensorBoard's ``{tag: value}`` for an ``event`` line: its finite numbers. A compile
    line's go under its program's tag (``compile/train_batch32_size8/compile_s``): a run
    compiles several programs at the same step, which one tag would mix up."""
    group = event
    if event == "compile":
        group = f"compile/{values['program']}_batch{values['batch']}_size{values['image_size']}"
        values = {k: v for k, v in values.items() if k not in ("batch", "image_size")}
    return {
        f"{group}/{k}": v
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _ends_mid_line(path: str) -> bool:
    """Whether the file at ``path`` is non-empty and its last byte is not a newline."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
