"""JAX's persistent compilation cache for a run (``compile_cache`` in the config).

With it on, each compiled program (every stage's train step, the eval step) is written to
a directory keyed by the program, its shapes, the devices and the JAX/XLA versions, so a
restarted or repeated run loads what it compiled before instead of compiling again (on
XLA:CPU several seconds per ResNet-50 shape, far more on a pod). ``Program`` records for each
compilation whether it came from the cache (``cache_hit`` in the ``compile`` events).

The cache is JAX's, and global to the process: ``enable`` points it at one directory for
the rest of the process (a later ``enable`` with another directory moves it). Everything
in the process that compiles afterwards uses it, which is why it is off unless a config
asks for it. The directory must be trusted: JAX loads executables from it. A cache the user
turned on for JAX itself (``JAX_COMPILATION_CACHE_DIR``, as the test suite does) is used
and reported the same way.
"""

from __future__ import annotations

import contextlib
import os

_hits = 0  # persistent-cache hits in this process (JAX reports them as monitoring events)
_listening = False
_active: str | None = None


def _count(event: str, **kwargs) -> None:
    global _hits
    if event == "/jax/compilation_cache/cache_hits":
        _hits += 1


def resolve(setting: str, workdir: str | None) -> str | None:
    """The directory ``compile_cache`` names: ``""`` off, ``"workdir"`` WORKDIR/compile_cache
    (off for tools without a workdir), else the path itself."""
    if not setting:
        return None
    if setting == "workdir":
        return None if workdir is None else os.path.join(os.path.abspath(workdir), "compile_cache")
    return os.path.abspath(os.path.expanduser(setting))


def _listen() -> None:
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_listener(_count)
        _listening = True


def enable(path: str) -> None:
    """Every compilation from now on in this process reads and writes ``path``."""
    global _active
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    _listen()
    if path == _active:
        return
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, path):
        cc.reset_cache()  # JAX opens its cache once; another directory needs a fresh start
    cc.set_cache_dir(path)
    # Every program, however quick to compile: a curriculum's eval steps and small stages
    # take under JAX's default 1 s, and a restart should recompile none of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _active = path


def compile_only(devices) -> bool:
    """Whether ``devices`` (a mesh's) are described to a compiler rather than this process's
    own: a TPU topology's chips or GPUs compiled for ahead of time, on a machine without them.
    """
    import jax

    return devices.flat[0] not in jax.devices()  # (a run's mesh is always on these)


@contextlib.contextmanager
def bypassed():
    """No persistent cache for the compilations inside, whatever is on: what a compile-only
    client builds for devices it does not have cannot be read back from the cache (jax 0.10,
    libtpu: "PjRtCompiler must be constructed with a Client", a warning on every later
    compile, and a useless entry left on disk), and an executable loaded from it serializes
    without its functions. JAX decides once whether the cache is used: the flag takes
    effect only after a reset."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()


def active() -> str | None:
    """The cache directory compilations use now: ours, or one set for JAX itself."""
    import jax

    return _active or jax.config.jax_compilation_cache_dir


def hits() -> int:
    """How many compilations in this process so far were loaded from the cache (counted
    from the first call: call it before compiling)."""
    _listen()
    return _hits
