"""One trainer per workdir: an exclusive ``flock`` on ``WORKDIR/.lock`` for the trainer's life.

    lock = workdir_lock.acquire(workdir)   # run.setup; a WorkdirError names the holder
    ...
    lock.release()                         # the end of trainer.train (or a failed set-up)
    workdir_lock.held(workdir)             # the evaluator: is a trainer alive there?

The evaluator takes the same kind of lock on its own records, ``WORKDIR/evaluator/.lock``
(``role="evaluator"``): one evaluator per run, as one trainer, since both would append the
same ``evaluator/metrics.jsonl``.

The file holds the holder's host, pid and start time as JSON, for the error a second trainer
prints; the lock itself is the kernel's, not the file's content: the OS releases it when
the holder exits in any way (kill -9 included), so a dead run never leaves a stale lock,
whatever the file still says. A clean release removes the file (while still holding the
lock; ``acquire`` checks that the file it locked is still the one at the path, so a
process that opened it before the removal cannot lock a file nobody else sees).

Several processes of one run (``config.distributed``) each lock their own file
(``.lock`` for process 0, ``.lock.N`` for process N), so a second job on the same workdir
is refused in every process, while the processes of one job never wait on each other.

What is guaranteed: on a local file system, two trainers on one workdir, started at any
moment, never both hold it. On shared and network file systems it depends on the file
system: NFSv4 and NFSv3 with a working lock manager (``nlockmgr``) emulate ``flock`` with
POSIX byte-range locks, which hold across clients; NFS mounted with ``nolock`` or
``local_lock=all``/``flock`` keeps the lock on one client only (two machines both get it);
Lustre without ``-o flock`` refuses the call (``ENOSYS``/``EOPNOTSUPP``), and with
``-o localflock`` it is local to each client. Where ``flock`` is refused, the trainer runs
with a warning and without the lock; where it is local-only, nothing tells: start one
trainer per workdir yourself there. The evaluator only probes (a shared lock, released at
once), and takes no write lock on the trainer's files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from hybridpar.config.errors import WorkdirError

NAME = ".lock"
# A probe (``held``) holds a shared lock for microseconds: a trainer that meets one retries
# for this long before it counts as another trainer's lock.
RETRY_S = 2.0
UNSUPPORTED = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


def path(workdir: str, process: int = 0) -> str:
    return os.path.join(workdir, NAME if process == 0 else f"{NAME}.{process}")


def holder(lock_path: str) -> dict:
    """What the lock file says about its holder (empty if unreadable or not yet written)."""
    try:
        with open(lock_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class Lock:
    def __init__(self, fd: int | None, lock_path: str):
        self.fd, self.path = fd, lock_path

    def release(self) -> None:
        """Removes the file and unlocks; a second call does nothing."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)  # while locked: see the module's docstring
        except OSError:
            pass
        os.close(self.fd)  # closes the lock with it
        self.fd = None

    def __del__(self):  # a Run dropped without train(): the lock goes with it
        self.release()


def acquire(
    workdir: str, process: int = 0, retry_s: float = RETRY_S, role: str = "trainer"
) -> Lock:
    """An exclusive lock on ``workdir``'s lock file, or a ``WorkdirError`` naming its holder
    (another ``role``: a key of ``ADVICE``) and how to go on. Writes nothing in ``workdir``
    unless it gets the lock."""
    lock_path = path(workdir, process)
    deadline = time.monotonic() + retry_s
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in UNSUPPORTED:
                print(f"warning: this file system does not lock {lock_path} ({e.strerror}); "
                      "make sure no other trainer runs on this workdir", flush=True)  # fmt: skip
                return Lock(None, lock_path)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise WorkdirError(refusal(workdir, lock_path, role)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # removed by its last holder after we opened it: lock the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "time": time.time()}  # fmt: skip
        os.write(fd, json.dumps(info).encode())
        return Lock(fd, lock_path)


# What to do when another process of that role holds the lock.
ADVICE = {
    "trainer": "wait for it to finish, stop it (SIGTERM saves a checkpoint) and run this "
    "command again to resume, or pass another --workdir",
    "evaluator": "wait for it to finish, or stop it (Ctrl-C) and run this command again: it "
    "goes on from the records",
    "compress": "wait for it to finish, or stop it (Ctrl-C) and run this command again: it "
    "goes on from the rounds done",
}


def refusal(workdir: str, lock_path: str, role: str = "trainer") -> str:
    h = holder(lock_path)
    who = (
        f"pid {h.get('pid')} on host {h.get('host')}, since {h.get('since')}"
        if h
        else "a process that has not written its name yet"
    )
    what = "workdir" if role == "trainer" else "directory"
    return (
        f"{what} {workdir!r} is in use by another {role} ({who}; lock {lock_path}): " + ADVICE[role]
    )


def held(workdir: str, process: int = 0) -> bool:
    """Whether a live process holds ``workdir``'s lock. Non-destructive: a shared lock,
    released at once (the trainer retries past such a probe); creates no file."""
    try:
        fd = os.open(path(workdir, process), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # unlocks
    return False
