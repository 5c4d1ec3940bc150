"""The device cache level: global batches placed on the mesh ahead of the step that uses them.

A background thread pulls host-local numpy batches and turns them into global arrays
(``shard_batch``: host-to-device copies), so the copy of batch N+1 overlaps step N.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

from hybridpar.partitioning import shard_batch

_DONE = object()


def prefetch_to_mesh(batches: Iterable[dict], mesh, size: int = 2) -> Iterator[dict]:
    """Yields ``shard_batch(b, mesh)`` for each ``b``, keeping ``size`` batches in flight.

    ``size=0`` places each batch when it is asked for. An exception in the producer is
    raised in the consumer; stopping the consumer early stops the producer.
    """
    if size <= 0:
        for b in batches:
            yield shard_batch(b, mesh)
        return
    q: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def produce():
        try:
            for b in batches:
                item = shard_batch(b, mesh)
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)

    thread = threading.Thread(target=produce, name="prefetch_to_mesh", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while True:  # unblock a put() in progress so the thread sees `stop`
            try:
                q.get_nowait()
            except queue.Empty:
                break
