"""Checkpoints of a run: orbax's ``CheckpointManager`` with the run's items, and the checks
of the directory they go to.

``Checkpoints`` wraps orbax's ``CheckpointManager``: each step directory holds three items,
the train state (``StandardSave``: every process writes its own shards), the trainer's
``LoopState`` and the config (``JsonSave``, as plain JSON a person can read). orbax writes a
step into a temporary directory and renames it when complete, so a crash during a save
leaves the previous checkpoint as it was. Restoring takes the TARGET shardings (the new
program's ``abstract_state()``): each process reads only its own shards, in the new
layout, whatever layout they were saved in.

What a workdir's run is (its config, compared with a new command's) is
``hybridpar/runtime/run_config.py``; the stop signals, ``hybridpar/runtime/signals.py``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time

import jax

from hybridpar.config.errors import SaveFailed, WorkdirError
from hybridpar.parallel.partitioning import path_parts
from hybridpar.runtime.checkpoint_dirs import (  # noqa: F401 (read from here too)
    OWNER,
    checkpoint_dir,
    committed_steps,
    outside,
    owner_of,
)

ITEMS = ("state", "loop", "config")


def check_not_moved(workdir: str, directory: str) -> None:
    """The run's records in ``workdir`` show checkpoints committed in another directory than
    ``directory``, which holds none: an error, not a run trained again from step 0 beside
    them (``checkpoint.dir`` may change between commands of one run). The records name
    absolute paths: in a copy of a workdir they name the original's folder, so the advice
    is the copy's own folder where it has one, and never the original's unsaid."""
    from hybridpar.runtime import run_records

    if committed_steps(directory):
        return
    recs, _ = run_records.read_records(os.path.join(workdir, "metrics.jsonl"))
    saved = [r for r in recs if r.event == "checkpoint" and r.path]
    if not saved:
        return
    last = saved[-1]
    where = os.path.dirname(os.path.normpath(last.path))
    if where == os.path.normpath(directory):
        return
    head = (
        f"this run saved its checkpoints in {where} (the last at step {last.step}), but "
        f"checkpoint.dir now names {directory}, which holds none"
    )
    here = _copied_here(workdir, where)
    if here is not None and not _same(os.path.join(workdir, here), where):
        # a copy of the workdir, its checkpoints copied with it
        raise WorkdirError(
            f"{head}; this workdir holds its own copy of that folder: pass "
            f"--config.checkpoint.dir={here} (under --workdir) to go on from them"
        )
    owner = _run_folder(where)
    if owner is not None and not _same(owner, workdir):  # another run's: this is a copy
        raise WorkdirError(
            f"{head}; that folder is another run's, in {owner} (this workdir looks like a "
            f"copy of it): copy its checkpoints here (cp -r {where}/. {directory}/) to go on "
            "from them in this workdir, or use a new --workdir to start again; "
            f"--config.checkpoint.dir={where} would write into that other run's folder"
        )
    raise WorkdirError(f"{head}; pass --config.checkpoint.dir={where} to go on from them")


def _copied_here(workdir: str, where: str) -> str | None:
    """The path under ``workdir`` of the same last parts as ``where`` (``checkpoints``,
    ``a/checkpoints``, ...) that holds checkpoints, or None."""
    parts = os.path.normpath(where).strip(os.sep).split(os.sep)
    for n in range(1, len(parts)):
        tail = os.path.join(*parts[-n:])
        if committed_steps(os.path.join(workdir, tail)):
            return tail
    return None


def _run_folder(where: str) -> str | None:
    """The nearest folder above ``where`` holding a run's records (``metrics.jsonl``)."""
    path = os.path.normpath(where)
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        if os.path.isfile(os.path.join(path, "metrics.jsonl")):
            return path
    return None


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_owner(workdir: str, directory: str) -> None:
    """A ``checkpoint.dir`` outside ``workdir`` whose checkpoints are another run's, one
    whose workdir (``OWNER``) still exists, is an error: a copy of that workdir, or a new
    one, trained into them, and the retention deleted the other run's checkpoints. A folder
    with no owner recorded (checkpoints from before owners were, or written by hand) is left
    to the config check (``run_config.check_run``): the first run to resume there owns it."""
    if not outside(directory, workdir) or not committed_steps(directory):
        return
    owner = owner_of(directory)
    if owner is None or _same(owner, workdir) or not os.path.isdir(owner):
        return
    here = os.path.abspath(workdir)
    head = (
        f"checkpoint.dir {directory} holds the checkpoints of the run in workdir {owner}, not "
        f"of this one ({here}): go on with that run with --workdir {owner}, or"
    )
    if any(os.path.isfile(os.path.join(here, n)) for n in ("config.json", "metrics.jsonl")):
        own = os.path.join(here, "checkpoints")  # a copy of that run's workdir, most likely
        raise WorkdirError(
            f"{head}, to go on from them in this workdir, copy them into its own folder "
            f"(cp -r {directory}/. {own}/) and leave out --config.checkpoint.dir"
        )
    raise WorkdirError(
        f"{head} give this run a checkpoint.dir of its own (or leave out "
        f"--config.checkpoint.dir), with --config.init_from={owner} to start from that run's "
        "weights"
    )


def claim(workdir: str, directory: str) -> None:
    """Records ``workdir`` as the owner of ``directory`` (``check_owner``), where that lies
    outside it (process 0, once set-up accepted the run); a recorded owner that is gone (a
    workdir moved with mv) is taken over, with a line that says so."""
    if not outside(directory, workdir) or jax.process_index() != 0:
        return
    owner, here = owner_of(directory), os.path.abspath(workdir)
    if owner is not None and _same(owner, here):
        return
    # (an owner still there had no checkpoints here: check_owner let it by)
    if owner is not None and not os.path.isdir(owner):
        print(
            f"checkpoint.dir {directory} held the checkpoints of the run in workdir {owner}, "
            f"which is gone (moved?): this run, in {here}, takes them over",
            flush=True,
        )
    from hybridpar.runtime.run_records import write_json

    write_json(os.path.join(directory, OWNER), {"workdir": here})


def ensure_writable(path: str, what: str, fix: str) -> None:
    """``path`` exists and this process can write there, or one error naming ``fix``."""
    if os.path.exists(path) and not os.path.isdir(path):  # makedirs would say "File exists"
        raise WorkdirError(f"{what} {path!r} is a file, not a folder; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
        # Named by host and pid, not jax.process_index(): that would start the backend
        # before comm's XLA flags and jax.distributed.initialize, which must come first.
        probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"{what} {path!r} is not writable ({e.strerror}); {fix}") from None


def check_dir(path: str) -> None:
    """An unwritable checkpoint directory is an error before training, not after an epoch."""
    ensure_writable(
        path,
        "checkpoint directory",
        "pass --config.checkpoint.dir=DIR where you can write (default WORKDIR/checkpoints)",
    )


def directory_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # deleted under us (retention): not part of this checkpoint
                pass
    return total


_single_writer = False  # orbax's array handler replaced (once per process)
_quiet = False  # the filters of quiet_background_failures installed (once per process)


def _from_orbax(record: logging.LogRecord) -> bool:
    """An error record that orbax logged, or one whose exception passed through orbax."""
    if record.levelno < logging.ERROR:
        return False
    where = [record.pathname]
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        where.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(f"{os.sep}orbax{os.sep}" in w for w in where)


def _closed_loop(unraisable) -> bool:
    """tensorstore's callback for a write that ended after orbax closed the event loop that
    awaited it (the loop's coroutine failed first): raised in a C++ thread, reported as
    unraisable, with no object."""
    e = unraisable.exc_value
    return (
        unraisable.object is None
        and isinstance(e, RuntimeError)
        and str(e) == "Event loop is closed"
    )


def _orbax_read_left(unraisable) -> bool:
    """An orbax read coroutine gathered with one that failed first (a step the trainer's
    retention deleted while a reader read it), closed unawaited, raising its own error as
    it closes: reported as unraisable, with TensorStore's whole spec. The read's failure
    reaches its caller through the coroutine that failed first."""
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _tensorstore_read_left(record: logging.LogRecord) -> bool:
    """asyncio's report of a TensorStore read that failed beside one that failed first (a
    step deleted under a reader): orbax raised the first, so the others' errors were never
    retrieved. Raised in C++ (no Python frame), with TensorStore's status code first."""
    e = record.exc_info[1] if record.exc_info else None
    return (
        str(record.msg).startswith("Future exception was never retrieved")
        and e is not None
        and e.__traceback__ is None
        and re.match(r"[A-Z_]+: ", str(e)) is not None
    )


def _read_only_notice(record: logging.LogRecord) -> bool:
    """orbax's warning that a manager opened read-only is read-only: what we asked for, and
    a reader's user would take it for a permission problem; and its warning, as it lists the
    steps, that a step has no metadata file: one the trainer's retention is deleting (orbax
    writes that file with every step)."""
    return record.msg in ("Given directory is read only=%s", "Metadata file does not exist: %s")


def quiet_background_failures() -> None:
    """A save that fails (a full disk) fails in orbax's background threads, which report it
    themselves: an ERROR log with a traceback per thread, asyncio's "exception was never
    retrieved" for each write gathered with the failed one, and tensorstore's callbacks into
    the event loop orbax closed on the first error: dozens of tracebacks. ``Checkpoints``
    reports the failure once, as ``SaveFailed`` (the CLI's one ``error:`` line), so these
    are dropped. So are the left-overs of a read that failed, a step deleted under a reader
    (``_orbax_read_left``, ``_tensorstore_read_left``): the reader reports the failure, or
    reads the step after it; and orbax's notices to a reader (``_read_only_notice``). Other
    records and hooks are left as they were."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    drop = (_from_orbax, _read_only_notice, _tensorstore_read_left)
    keep = lambda record: not any(f(record) for f in drop)  # noqa: E731
    logging.getLogger("absl").addFilter(keep)  # orbax logs through absl
    logging.getLogger("asyncio").addFilter(keep)  # the loops' default exception handler
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (_closed_loop(unraisable) or _orbax_read_left(unraisable)):
            previous(unraisable)

    sys.unraisablehook = hook


def read_error(e: Exception) -> str:
    """A failed read in a warning: the exception's type and its message's first line, at most
    200 characters. Orbax's read error goes on with TensorStore's whole spec (a pybind repr),
    which says nothing to a user."""
    lines = str(e).strip().splitlines()
    text = lines[0].split(" See full TensorStore details")[0] if lines else ""
    return f"{type(e).__name__}: {text[:197] + '...' if len(text) > 200 else text}"


def nonfinite_leaves(tree) -> list[str]:
    """The paths of the floating-point arrays in ``tree`` holding a NaN or an infinity. A
    train state never does: the trainer skips a non-finite step's update."""
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    floats = [(p, x) for p, x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])([x for _, x in floats])
    return [jax.tree_util.keystr(p) for (p, _), ok in zip(floats, finite, strict=True) if not ok]


# Reads of a listing or a checkpoint that a running trainer's retention overtook, retried
# before giving up (each retry reads the newest step again)
_RETRIES = 20


def _listing(list_steps):
    """``list_steps()``, again when it fails with FileNotFoundError: orbax's listing reads
    each step folder's metadata, and a step the trainer's retention deletes meanwhile fails
    it. A reader beside a running trainer meets that often; the next listing does not hold
    the deleted step."""
    for attempt in range(_RETRIES):
        try:
            return list_steps()
        except FileNotFoundError:
            if attempt == _RETRIES - 1:
                raise
            time.sleep(0.05)


# A save of several processes fails in its collectives where a peer is gone: no disk to fix.
PEER_GONE = re.compile(r"Gloo|Connection (closed|reset) by peer|NCCL|heartbeat", re.IGNORECASE)


def save_failure_advice(msg: str) -> str:
    """What to do about a failed save, by its error: a lost peer, or the directory."""
    if PEER_GONE.search(msg):
        return ("another process of the run has probably stopped (the save's collective "
                "lost its peer); start every process again with the same command")  # fmt: skip
    return "free space or fix the directory, then run the same command"


class Checkpoints:
    """orbax's ``CheckpointManager`` over ``directory``, with the run's three items.

    ``save`` returns after the blocking part (the copy of the state to host memory); the
    write goes on in the background when ``async_save``. ``finished()`` hands back, once,
    each save that has since been committed, with its blocking and total seconds and size
    on disk: the ``checkpoint`` events. We decide when to save (steps, minutes, preemption),
    so orbax's own interval is 1 and each save is forced. ``read_only``: for a reader beside
    a running trainer (the evaluator): nothing saved, deleted or created, and the trainer's
    save in flight (a temporary directory) left alone."""

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        import orbax.checkpoint as ocp

        global _single_writer
        quiet_background_failures()
        if jax.process_count() == 1 and not _single_writer:
            _single_writer = True
            # orbax splits a replicated array's write over its replicas, with one sliced
            # copy per replica and shape, each compiled on the first save. Worth it where
            # replicas are on different hosts;
            # in one process it only costs, so one replica writes each shard.
            absl = logging.getLogger("absl")
            level = absl.level
            absl.setLevel(logging.ERROR)  # its warning that we override is no news to a user
            try:
                ocp.type_handlers.register_type_handler(
                    jax.Array,
                    ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                    override=True,
                )
            finally:
                absl.setLevel(level)
        self.ocp, self.directory, self.read_only = ocp, directory, read_only
        self._committed_at = None  # set by orbax's thread when an async save is final
        if read_only:
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                save_interval_steps=0,
                max_to_keep=None,
                create=False,
                cleanup_tmp_directories=False,
                enable_async_checkpointing=False,
            )
        else:
            options = ocp.CheckpointManagerOptions(
                save_interval_steps=1,
                max_to_keep=max_to_keep or None,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # a save cut short by a crash leaves a tmp dir
                async_options=(
                    ocp.AsyncOptions(post_finalization_callback=self._committed)
                    if async_save
                    else None
                ),
            )
        self.manager = _listing(
            lambda: ocp.CheckpointManager(directory, item_names=ITEMS, options=options)
        )
        self._pending = None  # (step, start time, blocking seconds) of the save in flight
        self._done: list[dict] = []

    def _committed(self) -> None:
        self._committed_at = time.time()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def committed_steps(self) -> list[int]:
        """The steps on disk now, oldest first (read again: another process may have saved
        or deleted some). orbax lists only committed steps, never a save in flight."""
        return sorted(self._steps_now())

    def _steps_now(self) -> list[int]:
        """The committed steps on disk now, newest first (the manager reloaded)."""

        def listed():
            self.manager.reload()
            return sorted(self.manager.all_steps(), reverse=True)

        return _listing(listed)

    def save(self, step: int, state, loop: dict, config: dict) -> float:
        """Saves at ``step``; returns the seconds it blocked the loop."""
        self._collect(wait=True)  # one save in flight at a time (orbax waits for it anyway)
        args = self.ocp.args
        t0 = time.time()
        self._committed_at = None
        try:
            self.manager.save(
                step,
                args=args.Composite(
                    state=args.StandardSave(state),
                    loop=args.JsonSave(loop),
                    config=args.JsonSave(config),
                ),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 - a full disk, a permission, a name in the way
            raise self._failed(step, e) from None
        blocking = time.time() - t0
        self._pending = (step, t0, blocking)
        self._collect(wait=False)
        return blocking

    def _collect(self, wait: bool) -> None:
        if self._pending is None or (not wait and self.manager.is_saving_in_progress()):
            return
        step, t0, blocking = self._pending
        try:
            self.manager.wait_until_finished()  # at once if done; raises if the write failed
        except Exception as e:  # noqa: BLE001
            self._pending = None
            raise self._failed(step, e) from None
        end = self._committed_at or time.time()
        self._pending = None
        path = os.path.join(self.directory, str(step))
        self._done.append(
            dict(
                step=step,
                blocking_s=round(blocking, 4),
                total_s=round(max(end - t0, blocking), 4),
                bytes=directory_bytes(path),
                path=path,
            )
        )

    def _failed(self, step: int, e: Exception) -> SaveFailed:
        self.manager.reload()  # what is on disk now: the failed step is not a checkpoint
        good = [x for x in self.manager.all_steps() if x != step]
        last = f"the last complete one is step {max(good)}" if good else "there is none before it"
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        # tensorstore puts the OS's reason (a full disk) at the end of a long message
        code = re.search(r"os_error_code='(\d+)'", msg)
        msg = (f"{os.strerror(int(code[1]))}: " if code else "") + msg
        advice = save_failure_advice(msg)  # from the whole message: its cause may come late
        msg = msg if len(msg) <= 300 else msg[:297] + "..."
        return SaveFailed(
            f"checkpoint {step} could not be written to {self.directory} ({msg}); {last}, "
            f"left as it was; {advice}"
        )

    def finished(self, wait: bool = False) -> list[dict]:
        """The saves committed since the last call (``wait``: after the one in flight)."""
        self._collect(wait)
        done, self._done = self._done, []
        return done

    def restore(self, abstract_state, step: int | None = None):
        """``(step, state, loop dict, config dict)`` from the newest checkpoint that reads
        back whole, or None when there is none. A newest one that does not read back (cut
        short, corrupted) is skipped with a warning, the one before it used. If none reads
        back, that is an error, not a new run from step 0 beside them: every checkpoint
        failing alike means the state no longer fits them (another optimizer, say). With
        ``step``: that checkpoint, or orbax's error if it does not read back.

        A reader beside a running trainer (the evaluator, ``TrainedRun``) sees steps come and
        go: the trainer's retention deletes the oldest after each save. A read that fails
        while the listing changed (the step deleted, or a newer one committed) says nothing
        about that step: the newest is read again, from a new listing, up to ``_RETRIES``
        times. Only a step that fails with the listing as it was is unreadable."""
        if step is not None:
            return self._read(step, abstract_state)
        steps, unreadable, first, overtaken = self._steps_now(), [], None, 0
        while True:
            left = [s for s in steps if s not in unreadable]
            if not left:
                break
            newest = left[0]
            try:
                got = self._read(newest, abstract_state)
            except Exception as e:  # noqa: BLE001 - any failure to read means: try the older
                now = self._steps_now()
                if now != steps:  # deleted under us, or a newer one came: read the newest
                    overtaken += 1
                    if overtaken > _RETRIES:
                        raise WorkdirError(
                            f"the checkpoints in {self.directory} were deleted while being "
                            f"read, {overtaken} times over: the run's trainer deletes them as "
                            "fast as it saves them; try again, or keep more (the trainer's "
                            "--config.checkpoint.max_to_keep)"
                        ) from None
                    steps = now
                    continue
                other = self._other_state(newest, abstract_state)
                if other:  # intact, but of another state: no corruption to warn of
                    raise WorkdirError(
                        f"checkpoint {newest} in {self.directory} holds another train state "
                        f"than this run's ({other}); the config changed what the state holds "
                        "(optimizer, model, momentum schedule): start a new --workdir, or "
                        "move the checkpoints away to start this one over"
                    ) from None
                unreadable.append(newest)
                first = first or read_error(e)
                if jax.process_index() == 0:
                    print(
                        f"warning: checkpoint {newest} in {self.directory} does not read back "
                        f"({read_error(e)}); trying the one before it",
                        flush=True,
                    )
                continue
            self._set_aside(unreadable)
            return got
        if unreadable:
            raise WorkdirError(
                f"none of the {len(unreadable)} checkpoint(s) in {self.directory} (steps "
                f"{', '.join(map(str, sorted(unreadable)))}) reads back into this run's train "
                f"state (newest: {first}); if the config changed what the state holds "
                "(optimizer, model, momentum schedule), start a new --workdir, or move the "
                "checkpoints away to start this one over"
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Moves checkpoints that do not read back out of the way, into ``DIR.unreadable/``
        (kept, not deleted): left in place, the newest of them stayed orbax's latest step, so
        the run never saved that step again, and a completed run's last checkpoint was the
        unreadable one. A reader beside the run (``read_only``) leaves them be."""
        if not steps or self.read_only:
            return
        from jax.experimental import multihost_utils

        several = jax.process_count() > 1
        if several:  # every process has finished reading before one moves the folders
            multihost_utils.sync_global_devices("hybridpar: set aside unreadable checkpoints")
        aside = self.directory.rstrip(os.sep) + ".unreadable"
        if jax.process_index() == 0:
            os.makedirs(aside, exist_ok=True)
            for step in steps:
                target, n = os.path.join(aside, str(step)), 1
                while os.path.exists(target):  # one set aside before at this step: keep both
                    n += 1
                    target = os.path.join(aside, f"{step}-{n}")
                os.rename(os.path.join(self.directory, str(step)), target)
            print(
                f"moved checkpoint(s) {', '.join(map(str, sorted(steps)))} that do not read "
                f"back to {aside}/; the run saves those steps again",
                flush=True,
            )
        if several:
            multihost_utils.sync_global_devices("hybridpar: unreadable checkpoints set aside")
        self.manager.reload()

    def _other_state(self, step: int, abstract_state) -> str | None:
        """How the train state checkpoint ``step`` holds differs from ``abstract_state``, by
        its metadata (the arrays' paths and shapes): the first array missing on one side or
        of another shape; None where they match, or the metadata does not read (corrupted:
        a read's failure that says nothing of the config)."""
        try:
            tree = self.ocp.tree.to_flat_dict(self.manager.item_metadata(step)["state"].tree)
            saved = {k: getattr(v, "shape", None) for k, v in tree.items()}
        except Exception:  # noqa: BLE001 - any failure: not a readable tree to compare
            return None
        leaves = jax.tree_util.tree_leaves_with_path(abstract_state)
        ours = {path_parts(p): x.shape for p, x in leaves}
        for key in [*ours, *saved]:
            name = "/".join(key)
            if key not in saved:
                return f"no {name} there"
            if key not in ours:
                return f"{name} there, none here"
            if saved[key] is not None and tuple(saved[key]) != tuple(ours[key]):
                return f"{name} of shape {tuple(saved[key])} there, {tuple(ours[key])} here"
        return None

    def _read(self, step: int, abstract_state):
        args = self.ocp.args
        out = self.manager.restore(
            step,
            args=args.Composite(
                state=args.StandardRestore(abstract_state),
                loop=args.JsonRestore(),
                config=args.JsonRestore(),
            ),
        )
        bad = nonfinite_leaves(out["state"])
        if bad:  # corrupted bytes that still decompress: the step after would diverge
            raise ValueError(f"non-finite values in {', '.join(bad[:3])}")
        return step, out["state"], dict(out["loop"]), dict(out["config"])

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception:  # noqa: BLE001 - a failed save: reported by save/finished already
            pass
