"""Every test process sees 8 virtual CPU devices and the suite's XLA flags (xla_flags.py), set
before JAX initialises."""

import atexit
import os
import shutil
import signal
import tempfile

from xla_flags import cpu_flags

# (xdist's workers inherit the flags the controller set: each is added once)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in cpu_flags(8).split() if f not in _flags])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the tpu-aot extra the suite installs) compiles for TPU topologies here: no cloud
# metadata server to ask, and no machine-wide lock, since several test processes load it.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# An XLA compilation cache for the session, used by this process and the subprocesses it
# starts (they inherit the variable): the suite builds the same small programs in many tests
# and CLI runs, and each compiles once. A fresh directory per session, removed at its end,
# so nothing stale is ever loaded; one per xdist worker (JAX writes entries in place, so two
# processes must not share one). Tests of the cache itself point it elsewhere by config.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ or "HYBRIDPAR_TESTS_XLA_CACHE" in os.environ:
    if "HYBRIDPAR_TESTS_XLA_CACHE" not in os.environ:  # the first process of the session
        os.environ["HYBRIDPAR_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="hybridpar-tests-xla-")
        atexit.register(shutil.rmtree, os.environ["HYBRIDPAR_TESTS_XLA_CACHE"], True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        os.environ["HYBRIDPAR_TESTS_XLA_CACHE"], os.environ.get("PYTEST_XDIST_WORKER", "main")
    )

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests need 8 virtual CPU devices, got {jax.devices()}"


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _stop_handlers_back():
    """Each test hands the stop signals' handlers back as it found them: the train command
    run in this process leaves SIGTERM with its ``EarlyStop`` after a run (by design: the
    process exits next), and a later test's handlers then handed signals back to that one
    (a failure that depended on which tests an xdist worker ran before)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in before.items():
        if h is not None and signal.getsignal(s) is not h:
            signal.signal(s, h)


@pytest.fixture(scope="session")
def cifar10_test_prepared(tmp_path_factory):
    """The shared CIFAR-10 test.tar prepared once, as ``train`` prepares it on first use
    (full copy only, quality 90, test as the train split): ``(tar, prepared_dir, manifest)``.
    test_prepare checks what it wrote; the CLI test trains from it, so the suite pays for
    preparing its 10,000 JPEGs once."""
    from helpers import require_shared_data

    from hybridpar.input.prepare import prepare

    tar = require_shared_data("cifar10-jpeg/test.tar") / "cifar10-jpeg" / "test.tar"
    out = tmp_path_factory.mktemp("cifar10_test_prepared")
    manifest = prepare([tar], out, workers=2, progress=False, train_split="test")
    return tar, out, manifest
