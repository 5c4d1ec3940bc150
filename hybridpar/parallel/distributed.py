"""Joining JAX's distributed runtime (``--config.distributed=True``): one process per host.

    from hybridpar.parallel import distributed
    distributed.initialize(config)   # before anything starts the backend (run.setup)

Where the processes learn about each other, in this order:

- By hand (any machines, loopback included): ``JAX_COORDINATOR_ADDRESS=HOST:PORT`` (process
  0's host; process 0 starts the coordinator on PORT), ``JAX_NUM_PROCESSES=N`` and
  ``JAX_PROCESS_ID=0..N-1``, the same address and count in every process; optionally
  ``JAX_LOCAL_DEVICE_IDS=0,1,...`` (the GPUs this process drives). JAX itself reads only
  the address and the device ids, so we read all four and check them before anything
  starts.
- Otherwise JAX detects the cluster (``jax._src.clusters``): SLURM (``srun``: the first node
  of the step is the coordinator), Open MPI (``mpirun``), Cloud TPU VMs and GKE TPU slices,
  and Kubernetes Indexed Jobs / JobSets (needs the ``kubernetes`` package). Some of the
  variables set above still win over what is detected (all three: detection is off).
  ``experiments/launch/`` has a recipe for each.

Failures become one ``ConfigError`` naming the fix: bad values and a taken coordinator port
before JAX is called, nothing set and no cluster detected after. JAX aborts the whole
process (a C++ fatal log, exit 134) when the processes do not all meet within its timeout,
which no ``except`` can catch, so a watchdog gives up first: after
``distributed_timeout_s`` it prints one ``error:`` line saying what did not answer and
exits with code 2, as the CLI does for a ``ConfigError``.

Once joined, a process that goes silent for ``distributed_heartbeat_s`` (JAX's
``heartbeat_timeout_seconds``; process 0's value decides, so every process must set the
same one) makes JAX abort every other process from C++ as well; the
train command's supervising parent (``hybridpar/runtime/supervise.py``) turns that into one
``error:`` line. Then ``run_config.check_processes_agree`` checks that every process runs
one config, sees one workdir and counts the same processes.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading

from hybridpar.config.errors import ConfigError

VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
HOW = (
    "set JAX_COORDINATOR_ADDRESS=HOST:PORT (process 0's host), JAX_NUM_PROCESSES=N and "
    "JAX_PROCESS_ID=0..N-1 in every process, or start the processes under SLURM (srun), "
    "Open MPI (mpirun), a Cloud TPU VM or a Kubernetes JobSet (see experiments/launch/)"
)
# JAX's own deadline is this much later than ours, so our watchdog speaks first.
GRACE_S = 30


def from_env(environ) -> dict:
    """The ``jax.distributed.initialize`` arguments the variables give (empty: unset, left
    to JAX's cluster detection). Pure: no JAX, no network. A bad value is a ``ConfigError``."""
    kw = {}
    address = environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"JAX_COORDINATOR_ADDRESS={address!r} must be HOST:PORT, e.g. 10.0.0.1:1234 "
                "(process 0's host and a free port on it)"
            )
        kw["coordinator_address"] = address
    for var, key, low in (("JAX_NUM_PROCESSES", "num_processes", 1),
                          ("JAX_PROCESS_ID", "process_id", 0)):  # fmt: skip
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        if not raw.isdigit() or int(raw) < low:
            raise ConfigError(f"{var}={raw!r} must be an integer >= {low}")
        kw[key] = int(raw)
    n, i = kw.get("num_processes"), kw.get("process_id")
    if n is not None and i is not None and i >= n:
        raise ConfigError(
            f"JAX_PROCESS_ID={i} is not below JAX_NUM_PROCESSES={n}: number the processes "
            f"0..{n - 1}"
        )
    ids = environ.get("JAX_LOCAL_DEVICE_IDS", "").strip()
    if ids:
        parts = [p.strip() for p in ids.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"JAX_LOCAL_DEVICE_IDS={ids!r} must be device numbers separated by commas, "
                "e.g. 0,1,2,3 (or unset: all of this host's devices)"
            )
        kw["local_device_ids"] = [int(p) for p in parts]
    return kw


def forgotten(environ) -> str | None:
    """With ``--config.distributed`` off: what is wrong where the variables describe several
    processes (``None``: nothing). Such a process trained alone on all the data, and its
    peers in the same workdir were kept out only by the workdir lock, which is per host on
    some shared file systems. Pure: no JAX."""
    raw = environ.get("JAX_NUM_PROCESSES", "").strip()
    if not raw.isdigit() or int(raw) < 2:
        return None
    named = [v for v in VARIABLES if environ.get(v, "").strip()]
    return (
        f"{', '.join(f'{v}={environ[v].strip()}' for v in named)} "
        f"{'is' if len(named) == 1 else 'are'} set but --config.distributed is off: this "
        "process would train alone, on all the data; pass --config.distributed=True on every "
        "process, or unset them to train in one process"
    )


def check_port_free(address: str, environ=os.environ) -> None:
    """On process 0: the coordinator's port must be free (JAX binds every interface on it,
    or on ``JAX_COORDINATOR_BIND_ADDRESS``); taken, JAX would fail with a bare 'Failed to
    start RPC server'. Usually a run still alive, or another job on the host."""
    port = int(environ.get("JAX_COORDINATOR_BIND_ADDRESS", address).rpartition(":")[2])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                # as gRPC does: a closed connection's TIME_WAIT does not hold the port
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
            return
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"port {port} of JAX_COORDINATOR_ADDRESS={address} is in use on this host "
                    "(process 0 starts the coordinator there): stop what holds it (an earlier "
                    "run?) or pick another free port for every process"
                ) from None
            # no IPv6 on this host: try IPv4; anything else: let JAX try and report


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def timeout_message(kw: dict, timeout_s: float, reached: bool = False) -> str:
    """What the watchdog says when the processes did not all meet in time. ``reached``: the
    coordinator answered this process at some point (process 0 may have given up since)."""
    address, n = kw.get("coordinator_address"), kw.get("num_processes")
    more = f"or raise --config.distributed_timeout_s (now {timeout_s:g})"
    if address is None:
        return (
            f"jax.distributed.initialize did not finish within {timeout_s:g} s "
            f"(cluster detection, or the other processes did not start): {HOW}; {more}"
        )
    if kw.get("process_id") != 0 and not reached and not _answers(address):
        return (
            f"nothing answered at the coordinator JAX_COORDINATOR_ADDRESS={address} within "
            f"{timeout_s:g} s: start process 0 (JAX_PROCESS_ID=0) on that host, check the host "
            f"name, port and firewall, {more}"
        )
    count = f"all {n} processes (JAX_PROCESS_ID=0..{n - 1})" if n else "every process"
    count += ", each with its own id,"  # two with one id: the second never joins
    gone = ""
    if kw.get("process_id") != 0 and reached and not _answers(address):
        # a run started again on the port of one whose process 0 still waited: its
        # process 0 finds the port in use, and this process joins the old coordinator,
        # which then stops
        gone = (
            " (the coordinator this process reached has gone since: process 0 gave up, its "
            "own error names why, or it was an earlier run's process 0, still waiting on "
            "that port when this run started, and this run's process 0 found the port in "
            "use; then stop every process of both runs)"
        )
    return (
        f"not every process joined the coordinator at {address} within {timeout_s:g} s"
        f"{gone}: start {count} with the same JAX_COORDINATOR_ADDRESS and "
        f"JAX_NUM_PROCESSES, {more}"
    )


def _give_up(kw: dict, timeout_s: float, reached: threading.Event) -> None:
    # The main thread is blocked inside JAX's C++ connect: no exception can reach it, so
    # the CLI's contract (one ``error:`` line, exit 2) is kept from here.
    message = timeout_message(kw, timeout_s, reached.is_set())
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def _watch_coordinator(address: str, reached: threading.Event, done: threading.Event) -> None:
    """Sets ``reached`` once the coordinator answers: at the timeout, process 0 may have
    given up on a missing third process and gone, and is then not the one to blame."""
    while not done.is_set() and not _answers(address):
        done.wait(1.0)
    if not done.is_set():
        reached.set()


def initialize(config) -> None:
    """Joins JAX's distributed runtime as ``from_env`` and JAX's cluster detection say, with
    gloo collectives on CPU; every failure is one ``ConfigError`` (or, past the timeout,
    one ``error:`` line and exit 2). Must run before the backend starts. A runtime this
    process joined already (the caller's own code) is left as it is."""
    import jax

    if jax.distributed.is_initialized():
        return
    kw = from_env(os.environ)
    if kw.get("process_id") == 0 and "coordinator_address" in kw:
        check_port_free(kw["coordinator_address"])
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # Cross-process collectives of the CPU backend (it has none without them); read
        # when the backend starts. The default of jax 0.10, but not of older releases.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if all(os.environ.get(v, "").strip() for v in VARIABLES):
        kw["cluster_detection_method"] = "deactivate"  # set by hand: exactly these, no guessing
    timeout_s = config.distributed_timeout_s
    reached, done = threading.Event(), threading.Event()
    if kw.get("process_id", 0) != 0 and "coordinator_address" in kw:
        args = (kw["coordinator_address"], reached, done)
        threading.Thread(target=_watch_coordinator, args=args, daemon=True).start()
    watchdog = threading.Timer(timeout_s, _give_up, (kw, timeout_s, reached))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            **kw,
            initialization_timeout=int(timeout_s) + GRACE_S,
            heartbeat_timeout_seconds=max(1, round(config.distributed_heartbeat_s)),
        )
    except ValueError as e:  # what neither the variables nor a detected cluster gave
        missing = [v for v in VARIABLES if not os.environ.get(v, "").strip()]
        if "defined" in str(e) and missing:
            raise ConfigError(
                f"--config.distributed=True but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set and no cluster (SLURM, Open "
                f"MPI, Cloud TPU, Kubernetes) was detected: {HOW}"
            ) from None
        raise ConfigError(f"jax.distributed.initialize: {e}; {HOW}") from None
    except (TypeError, RuntimeError) as e:  # cluster detection, the backend already started
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        raise ConfigError(f"--config.distributed=True could not start ({msg}); {HOW}") from None
    finally:
        watchdog.cancel()
        done.set()
