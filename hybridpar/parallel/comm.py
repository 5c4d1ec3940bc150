"""XLA's collective combining and latency hiding, from the ``comm`` config section.

Under ``jax.jit`` XLA inserts the gradient collectives; its GPU and TPU backends then combine
small ones into larger ones (up to a byte threshold) and, with the latency-hiding scheduler,
start them asynchronously so they overlap the rest of the backward pass. Both are compiler
flags that XLA reads once, when the backend starts, so ``apply`` must run before anything
touches the devices (``jax.devices()``, ``make_mesh``, ``jax.distributed.initialize``):

    from hybridpar.parallel import comm
    comm.apply(config.comm)          # then make the mesh, compile, train

What goes where, by platform:

- ``gpu`` (CUDA or ROCm): ``XLA_FLAGS`` gets
  ``--xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes`` from
  ``comm.combine_threshold_mb`` (one value for all three; ``<= 0`` leaves XLA's defaults)
  and ``--xla_gpu_enable_latency_hiding_scheduler`` from ``comm.latency_hiding``. These
  flags are part of every jaxlib's XLA, so they are harmless on a CPU-only install.
- ``tpu``: ``LIBTPU_INIT_ARGS`` gets, on chips with SparseCores (``comm.sparsecore_offload``,
  ``TPU_SPARSECORE_ALL_REDUCE``), the flags that run the all-reduces there, beside the
  backward pass; and ``--xla_tpu_enable_latency_hiding_scheduler`` and,
  for ``comm.mode=bucketed`` or ``overlap`` with libtpu 0.0.42 or later, the flags of
  ``TPU_ASYNC_ALL_REDUCE``, all from ``comm.latency_hiding``. Without them libtpu compiles
  every all-reduce synchronous: nothing of the backward pass runs beside a gradient's
  reduction. With them, the buckets (on a small step libtpu's combiner may merge them with
  global BatchNorm's all-reduces, which keeps them synchronous; the NOTES give the flag that
  stops it) compile asynchronous where the schedule has work after them
  (``python -m hybridpar.compile --target tpu:...`` says which, and how much compute each
  overlaps); ``comm.mode=xla``'s all-reduces come at the end of the step, where they
  changed nothing.
  libtpu's combiner thresholds are not publicly documented; ``TPU_COMBINE_FLAGS_BEST_KNOWN``
  lists the names seen in public experiment notes, but they are NOT applied, since libtpu
  aborts at start-up on a flag it does not know (as XLA does on one in ``XLA_FLAGS``).
- ``cpu``: nothing. XLA's CPU backend has no combiner-threshold or latency-hiding flags
  (jaxlib 0.10.2 knows only the ``xla_gpu_*`` ones); what its pipeline combines it does on
  its own, with no knob (on 0.10.2 the data-parallel ResNet-50 gradient comes out as a few
  large all-reduces, beside one small all-reduce per BatchNorm layer for the global batch
  statistics; see ``python -m hybridpar.comm_report``). ``comm.mode=bucketed`` is the
  explicit, backend-independent way to set the fusion.

Flags already present in the environment win: ``apply`` only adds flags whose name is not
there yet, so ``XLA_FLAGS=--xla_gpu_all_reduce_combine_threshold_bytes=... python -m
hybridpar.train ...`` overrides the config for one run, and calling ``apply`` twice is harmless.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from hybridpar.config.errors import ConfigError

log = logging.getLogger(__name__)

# The environment variable that carries each platform's compiler flags.
ENV_VAR = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}

# Best-known libtpu names of the combiner thresholds (unverified; not applied, see above).
TPU_COMBINE_FLAGS_BEST_KNOWN = (
    "--xla_tpu_all_reduce_combine_threshold_bytes",
    "--xla_tpu_all_gather_combine_threshold_bytes",
    "--xla_tpu_reduce_scatter_combine_threshold_bytes",
)

# libtpu flags that let an all-reduce run asynchronously, each measured alone on libtpu 0.0.42
# (bench/results/overlap_tpu/NOTES.md): the first two only together make any bucket's
# all-reduce asynchronous; the third lets the compiler also carry them through the
# elementwise fusions after them. They cost HBM traffic, and comm.mode=xla's all-reduces,
# at the end of the step, stayed synchronous under them: so they are set for the bucketed
# and overlap modes only. Set from this libtpu release on (libtpu aborts on a flag it does
# not know).
TPU_ASYNC_ALL_REDUCE = (
    (0, 0, 42),
    (
        "--xla_enable_async_all_reduce",
        "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce",
        "--xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions",
    ),
)

# The libtpu flag that runs the all-reduces on the chip's SparseCores, beside the
# TensorCores' work. On tpu:v5p-128, the DAWNBench ResNet-50 224-px step under
# comm.mode=xla, it took the gradient all-reduces from synchronous at the end of the step to
# asynchronous beside the backward convolutions (bytes exposed 100% -> 1%, est. 82% hidden),
# for the same memory and HBM traffic (bench/results/overlap_tpu/NOTES.md). Of MaxText's
# SparseCore offload set, the other four flags changed nothing (each dropped in turn, on
# digits). v5e has no SparseCores (the flag changes nothing); on v6e it offloads a tiny
# step's all-reduce, but no real step there was measured. Set by comm.sparsecore_offload=auto
# on the chips listed, from this libtpu release on.
TPU_SPARSECORE_ALL_REDUCE = (
    (0, 0, 42),
    ("v5p",),
    ("--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",),
)

_GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def platform_name(platform: str) -> str:
    """"gpu", "tpu" or "cpu" for a jax platform or device name ("cuda", "rocm", ...)."""
    return _PLATFORM_ALIASES.get(platform.lower(), platform.lower())


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_platform() -> str:
    """The platform jax will start on ("gpu", "tpu" or "cpu"), without starting it.

    First the requested platforms (``jax.config.jax_platforms`` if jax is imported, which
    holds ``JAX_PLATFORMS`` as read at import or a later ``jax.config.update``; else the
    ``JAX_PLATFORMS`` variable): the first one listed is the default. Otherwise what is
    installed: libtpu -> "tpu", a CUDA/ROCm PJRT plugin -> "gpu", else "cpu". An installed
    plugin without its hardware means jax falls back to CPU; the flags set for it are then
    unused and harmless.
    """
    requested = None
    jax = sys.modules.get("jax")
    if jax is not None:
        requested = jax.config.jax_platforms
    if not requested:
        requested = os.environ.get("JAX_PLATFORMS", "")
    first = requested.split(",")[0].strip().lower() if requested else ""
    if first:
        return platform_name(first)
    if _has_module("libtpu"):
        return "tpu"
    if any(_has_module(p) for p in _GPU_PLUGINS):
        return "gpu"
    return "cpu"


def tpu_chip() -> str | None:
    """The TPU chip this process runs or compiles for ("v5p", "v5e", ...), from
    ``TPU_ACCELERATOR_TYPE`` (set on TPU VMs and GKE, and by ``targets.prepare``); None where
    it is not set."""
    kind = os.environ.get("TPU_ACCELERATOR_TYPE", "").strip().lower()
    name = kind.rsplit("-", 1)[0] if kind else ""
    return {"v5litepod": "v5e"}.get(name, name) or None


def sparsecore_offload(comm_cfg, chip: str | None) -> bool:
    """Whether the all-reduces go to the SparseCores (``comm.sparsecore_offload``): "on",
    "off", or "auto", on for the chips ``TPU_SPARSECORE_ALL_REDUCE`` lists."""
    mode = comm_cfg.get("sparsecore_offload", "auto")
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"comm.sparsecore_offload={mode!r} must be auto, on or off")
    return mode == "on" or (mode == "auto" and chip in TPU_SPARSECORE_ALL_REDUCE[1])


def _bool(v: bool) -> str:
    return "true" if v else "false"


def xla_flags(comm_cfg, platform: str, chip: str | None = None) -> list[str]:
    """The compiler flags the ``comm`` section asks for on ``platform`` and, for a TPU,
    ``chip`` ("v5p", ...; None: not known) (no side effects)."""
    mb = float(comm_cfg.combine_threshold_mb)
    if not isinstance(comm_cfg.latency_hiding, bool):
        raise ConfigError(f"comm.latency_hiding={comm_cfg.latency_hiding!r} must be True or False")
    platform = platform_name(platform)
    flags: list[str] = []
    if platform == "gpu":
        if mb > 0:
            nbytes = int(mb * 2**20)
            for kind in ("all_reduce", "all_gather", "reduce_scatter"):
                flags.append(f"--xla_gpu_{kind}_combine_threshold_bytes={nbytes}")
        flags.append(f"--xla_gpu_enable_latency_hiding_scheduler={_bool(comm_cfg.latency_hiding)}")
    elif platform == "tpu":
        on = _bool(comm_cfg.latency_hiding)
        flags.append(f"--xla_tpu_enable_latency_hiding_scheduler={on}")
        since, names = TPU_ASYNC_ALL_REDUCE
        # (comm.mode=auto is xla on TPU: program/sync.py AUTO_BY_PLATFORM)
        if comm_cfg.mode in ("bucketed", "overlap") and _release("libtpu", 3) >= since:
            flags += [f"{name}={on}" for name in names]
        since, _, offload = TPU_SPARSECORE_ALL_REDUCE
        if sparsecore_offload(comm_cfg, chip) and _release("libtpu", 3) >= since:
            flags += list(offload)
    # cpu (and anything else): XLA has no combiner or latency-hiding flags to set.
    return flags


# Compiler defects of a given jaxlib that a training run must step around, by platform: (the
# first jaxlib release it was seen on, the flag). XLA:GPU of jaxlib 0.11.2 (an H200, 2026-12)
# aborted compiling our ResNet-50 train step in its Triton GEMM fusion pass (a CHECK failure
# in triton_tiling_propagation.cc); cuBLAS GEMMs avoid it. Applied from that minor release on
# until a later one is checked without it; 0.10.x never showed it.
WORKAROUNDS = {"gpu": (((0, 11), "--xla_gpu_enable_triton_gemm=false"),)}


def installed_version(package: str) -> str | None:
    """An installed package's version, read from its metadata (no import); None where it is
    not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(package: str, parts: int) -> tuple[int, ...]:
    """An installed package's release as its first ``parts`` numbers; (0,) where it is not
    installed."""
    try:
        return tuple(int(p) for p in (installed_version(package) or "0").split(".")[:parts])
    except ValueError:
        return (0,)


def workaround_flags(platform: str, jaxlib_version: tuple[int, ...] | None = None) -> list[str]:
    """The flags ``WORKAROUNDS`` asks for on ``platform`` with this jaxlib (no side effects)."""
    version = _release("jaxlib", 2) if jaxlib_version is None else tuple(jaxlib_version)
    platform = platform_name(platform)
    return [flag for since, flag in WORKAROUNDS.get(platform, ()) if version >= since]


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def apply(comm_cfg, platform: str | None = None, chip: str | None = None) -> list[str]:
    """Adds the ``comm`` flags for ``platform`` (default: ``detect_platform()``) and, on a
    TPU, ``chip`` (default: ``tpu_chip()``), and the installed jaxlib's
    ``workaround_flags``, to the environment variable its backend reads, before the backend
    starts. Returns the flags added (those whose name the variable did not hold already)."""
    platform = detect_platform() if platform is None else platform
    flags = xla_flags(comm_cfg, platform, chip or tpu_chip()) + workaround_flags(platform)
    var = ENV_VAR.get(platform_name(platform))
    if not flags or var is None:
        return []
    current = os.environ.get(var, "")
    present = {_flag_name(f) for f in current.split()}
    added = [f for f in flags if _flag_name(f) not in present]
    if added:
        os.environ[var] = " ".join([current, *added]).strip()
    bridge = sys.modules.get("jax._src.xla_bridge")
    if added and bridge is not None and bridge.backends_are_initialized():
        log.warning(
            "comm: the jax backend has already started, so %s will not take effect in this "
            "process; call hybridpar.parallel.comm.apply before the first use of the devices",
            " ".join(added),
        )
    return added
