"""Reading ahead: global batches placed on the mesh ahead of the step that uses them, and the
next epoch's or stage's input opened while the one before it is still being read.

``prefetch_to_mesh``: a background thread pulls host-local numpy batches and turns them into
global arrays (``shard_batch``: host-to-device copies), so the copy of batch N+1 overlaps
step N. ``chain_ahead``: one stream over several inputs (the trainer's: one per curriculum
stage), each opened and its first item read in the background while the one before it is
consumed.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator

from hybridpar.parallel.partitioning import shard_batch

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


def _in_background(fn: Callable):
    """Starts ``fn()`` in a daemon thread (a stopped run does not wait for it at exit);
    returns a function that waits for its result, or raises its exception."""
    box: dict = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # raised where the result is asked for
            box["error"] = e

    thread = threading.Thread(target=work, name="chain_ahead", daemon=True)
    thread.start()

    def result():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result


def chain_ahead(openers: Iterable[Callable[[], Iterable]]) -> Iterator:
    """The items of ``opener()`` for each opener in turn, as one stream; each next opener is
    called, and its first item read, in a background thread as soon as the one before it
    starts being consumed.

    Why: opening an epoch's or a stage's tf.data input is slow before its first batch (the
    shuffle buffer fills; a stage that starts mid-epoch skips that epoch's first records;
    a new image size is a new pipeline): seconds per switch for CIFAR-10 on 2 CPU cores.
    ``prefetch_to_mesh`` only reads a few batches ahead, which a fast step uses up in well
    under a second, so the switch stalled the run. Opening ahead hides it behind a whole
    epoch or stage."""

    def open_first(opener):
        items = iter(opener())
        return next(items, _DONE), items

    openers = iter(openers)
    upcoming = next(openers, None)
    pending = _in_background(lambda o=upcoming: open_first(o)) if upcoming else None
    while pending is not None:
        first, items = pending()
        upcoming = next(openers, None)
        pending = _in_background(lambda o=upcoming: open_first(o)) if upcoming else None
        if first is not _DONE:
            yield first
            yield from items
