"""What a compile-only tool compiles for: ``--target cpu:8`` (virtual CPU devices, the
default) or ``--target tpu:v5e-16[,slices=N]``: the TPU compiler itself, through libtpu's
ahead-of-time path, on a machine with no TPU.

    target = parse("tpu:v5p-128")   # a Target: chip, chips, topology, slices
    prepare(target)                 # the environment, before JAX starts
    devices = target.devices()      # the topology's devices, for a mesh

A TPU target's devices are descriptions of the chips of that topology (jax's
``topologies.get_topology_desc``): a mesh can be laid on them and a program compiled for
them (``lower().compile()``, with ``memory_analysis()`` and ``cost_analysis()`` from the
TPU compiler), but nothing can run on them. The names follow Cloud TPU's accelerator
types: ``v5e-N`` and ``v6e-N`` count chips, ``v4-N`` and ``v5p-N`` count TensorCores (two
per chip), so ``v5p-128`` is 64 chips (a 4x4x4 cube).

The chips' figures (peak, HBM, links) are the accelerator table's
(``hybridpar.config.hardware``), which the planner and the scaling model read too; v3 is in
it for the scaling model only (no slice shapes here: not a compile target).

``--target gpu:h100-16`` (also ``h200``, ``a100``; N GPUs, 8 to a node) does the same with
XLA's GPU compiler, through the CUDA plugin's deviceless path (``pip install -e
".[gpu-aot]"``, about 0.2 GB, no CUDA driver needed): the devices are described by a
``target_config`` (what the compiler would read from the GPU: streaming multiprocessors,
shared memory, clock, compute capability), nodes of 8 GPUs joined by NVLink within a node.
The GPU compiler gives memory and the scheduled program (its collectives asynchronous),
but no FLOP count, and does not autotune without a device: kernel choices may differ from
a compile on the GPU itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

from hybridpar.config import hardware
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import GIB
from hybridpar.config.hardware import GPUS_PER_NODE, Chip
from hybridpar.parallel import comm

CHIPS = hardware.TPUS  # the TPU chips, by version
# What XLA's GPU compiler reads from a device (its gpu_device_info), per GPU: the name the
# driver reports, compute capability, streaming multiprocessors, boost clock (GHz), shared
# memory per SM and per block (opt-in), L2 cache, FP32 units per SM: from NVIDIA's
# architecture whitepapers (Hopper: H100 and H200 share the GH100 die; Ampere: GA100).
_GPU_DEVICE = {
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 233472, 232448, 50 * 2**20, 128),
    "h200": ("NVIDIA H200", (9, 0), 132, 1.98, 233472, 232448, 50 * 2**20, 128),
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 167936, 166912, 40 * 2**20, 64),
}
# the GPU targets: the accelerator table's GPUs that have a device description above
GPUS = {name: hardware.GPUS[name] for name in _GPU_DEVICE}
GPU_EXTRA = 'pip install -e ".[gpu-aot]"'
# The slice shapes Cloud TPU offers, by chip count: (x, y) for 2D tori, (x, y, z) for 3D.
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
              128: (8, 16), 256: (16, 16)}  # fmt: skip
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
              128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
              2048: (8, 16, 16), 4096: (16, 16, 16)}  # fmt: skip
TPU_EXTRA = 'pip install -e ".[tpu-aot]"'


@dataclasses.dataclass(frozen=True)
class Target:
    platform: str  # "cpu" or "tpu"
    devices_count: int  # every device of every slice
    chip: Chip | None = None
    shape: tuple = ()  # one slice's chips per torus dimension
    slices: int = 1
    spec: str = ""

    @property
    def topology_name(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    def compiler_options(self) -> dict:
        """XLA options every compile for this target needs: for a GPU, no Triton GEMM
        fusion, whose pass aborts the process (a failed CHECK, not an exception) on our
        convolutional steps in the GPU compiler of this jax; cuBLAS does those GEMMs."""
        return {"xla_gpu_enable_triton_gemm": False} if self.platform == "gpu" else {}

    def devices(self):
        """The devices to lay the mesh on: None for ``cpu:N`` (the process's own, which
        ``prepare`` made N) and for this machine's own devices (no chip named), else the TPU
        topology's or the described GPUs'."""
        if self.platform == "cpu" or self.chip is None:
            return None
        from jax.experimental import topologies

        if self.platform == "gpu":
            nodes, per_node = self.shape
            try:
                topo = topologies.get_topology_desc(
                    platform="cuda",
                    target_config=gpu_target_config(self.chip.name),
                    topology=f"1x{nodes}x{per_node}",
                )
            except Exception as e:  # the plugin's own message says what it did not accept
                raise ConfigError(
                    f"the CUDA plugin did not describe --target {self.spec}: "
                    f"{str(e).splitlines()[0]}"
                ) from None
            return topo.devices

        per_host = tuple(min(2, s) for s in self.shape) + (1,) * (3 - len(self.shape))
        try:
            topo = topologies.get_topology_desc(
                platform="tpu",
                topology_name=self.topology_name,
                chip_config_name=self.chip.chip_config,
                chips_per_host_bounds=per_host,
                num_slices=self.slices,
            )
        except Exception as e:  # libtpu's own message says what it did not accept
            raise ConfigError(
                f"libtpu did not describe --target {self.spec} (topology "
                f"{self.topology_name}, {self.slices} slice(s)): {str(e).splitlines()[0]}"
            ) from None
        return topo.devices

    def describe(self) -> str:
        if self.chip is None:
            return f"{self.devices_count} {self.platform} devices"
        c = self.chip
        if self.platform == "gpu":
            nodes = self.shape[0]
            return (
                f"GPU {c.name.upper()} x{self.devices_count} ({nodes} node(s) of "
                f"{self.shape[1]}): {c.hbm_bytes / 1e9:.0f} GB HBM and "
                f"{c.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 each (the GPU compiler, ahead of "
                "time: nothing runs)"
            )
        slices = f" x {self.slices} slices over DCN" if self.slices > 1 else ""
        return (
            f"TPU {c.name} {self.topology_name}{slices}: {self.devices_count} chips, "
            f"{c.hbm_bytes / GIB:.0f} GiB HBM and {c.peak_bf16_flops / 1e12:.0f} TFLOP/s "
            "bf16 each (the TPU compiler, ahead of time: nothing runs)"
        )


def parse(spec: str) -> Target:
    """``cpu:N`` or ``tpu:CHIP-N[,slices=S]`` (CHIP one of ``CHIPS``), or one error saying
    what is accepted. Read without case or surrounding spaces (``TPU:V5E-16 `` is
    ``tpu:v5e-16``), and the target keeps that form, as reports and files name it."""
    spec = spec.strip().lower()
    fix = (
        "use --target cpu:N (N virtual CPU devices), tpu:CHIP-N[,slices=S] with CHIP one of "
        f"{', '.join(n for n, c in CHIPS.items() if c.chip_config)}, e.g. tpu:v5e-16 or "
        f"tpu:v5p-128,slices=2, or gpu:GPU-N with GPU one of {', '.join(GPUS)}, e.g. gpu:h100-16"
    )
    m = re.fullmatch(r"cpu:(\d+)", spec)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ConfigError(f"--target {spec}: at least one device; {fix}")
        return Target("cpu", n, spec=spec)
    m = re.fullmatch(r"gpu:(\w+?)-(\d+)", spec)
    if m:
        return _parse_gpu(spec, m.group(1), int(m.group(2)), fix)
    m = re.fullmatch(r"tpu:(v\w+?)-(\d+)(?:,slices=(\d+))?", spec)
    if not m:
        raise ConfigError(f"--target {spec!r} is not a target; {fix}")
    name, count, slices = m.group(1), int(m.group(2)), int(m.group(3) or 1)
    if name not in CHIPS:
        raise ConfigError(f"--target {spec}: unknown TPU version {name!r}; {fix}")
    if not CHIPS[name].chip_config:
        raise ConfigError(
            f"--target {spec}: TPU {name} is in the chip table for the scaling model only "
            f"(python -m hybridpar.simulate --preset tpu-{name}); {fix}"
        )
    chip = CHIPS[name]
    if slices < 1:
        raise ConfigError(
            f"--target {spec}: slices=S is how many slices are joined over DCN, at least 1 "
            f"(or leave it out for one), e.g. tpu:{name}-{count},slices=2"
        )
    if count % chip.cores_per_chip:
        raise ConfigError(
            f"--target {spec}: {name}-N counts TensorCores ({chip.cores_per_chip} per chip), "
            f"so N must be a multiple of {chip.cores_per_chip}; {fix}"
        )
    chips = count // chip.cores_per_chip
    shapes = _SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D
    if chips not in shapes:
        sizes = ", ".join(f"{name}-{n * chip.cores_per_chip}" for n in shapes)
        raise ConfigError(f"--target {spec}: no {name} slice of {chips} chips; one of {sizes}")
    return Target("tpu", chips * slices, chip, shapes[chips], slices, spec)


def _parse_gpu(spec: str, name: str, count: int, fix: str) -> Target:
    if name not in GPUS:
        raise ConfigError(f"--target {spec}: unknown GPU {name!r}; {fix}")
    if count < 1:
        raise ConfigError(f"--target {spec}: at least one GPU, e.g. gpu:{name}-8")
    if count > GPUS_PER_NODE and count % GPUS_PER_NODE:
        raise ConfigError(
            f"--target {spec}: N GPUs fill nodes of {GPUS_PER_NODE}: use up to "
            f"{GPUS_PER_NODE} or a multiple of it"
        )
    per_node = min(count, GPUS_PER_NODE)
    return Target("gpu", count, GPUS[name], (count // per_node, per_node), 1, spec)


def have_cuda_plugin() -> bool:
    """jax's CUDA plugin is installed (the ``gpu-aot`` extra's CUDA 12 one, or CUDA 13's,
    which the lent GPU machines' image has)."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


def gpu_target_config(name: str) -> str:
    """The ``target_config`` text (XLA's GpuTargetConfigProto) describing one GPU, for a
    compile without it. The CUDA and cuDNN versions are those the CUDA plugin of this jax
    requires at least."""
    kind, (major, minor), sms, clock, smem_sm, smem_block, l2, fpus = _GPU_DEVICE[name]
    chip = GPUS[name]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_sm}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: {smem_block}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{kind}"
"""


# libtpu 0.0.42.1 overflows a thread's stack compiling the digits job for tpu:v6e-8
# (SIGSEGV, "STACK OVERFLOW", whatever the flags) unless the process starts with no stack
# limit: 8 MiB to 1 GiB crash alike, and raising the limit in a running process does not
# help; started unlimited, it compiled in all tries but one (the crash is not deterministic).
STACK_RAISED = "HYBRIDPAR_STACK_RAISED"  # set in the command started again: once only


def unlimited_stack_for_tpu(argv: list[str]) -> None:
    """Starts this command again with no stack limit where ``argv``'s ``--target`` is a
    ``tpu:`` one and the hard limit allows it (``ulimit -s unlimited``'s effect; see above);
    else does nothing. Called by the compile tools' commands (``argv`` from the command
    line), before anything else: the command is run again from its start (a script that
    calls their ``main()`` with no arguments too)."""
    import resource
    import sys

    given = [b for a, b in zip(argv, argv[1:]) if a == "--target"]
    given += [a.split("=", 1)[1] for a in argv if a.startswith("--target=")]
    # (a script read from stdin cannot be run again: its input is spent)
    if os.environ.get(STACK_RAISED) or sys.orig_argv[1:2] == ["-"]:
        return
    if not any(t.startswith("tpu:") for t in given):
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if soft == resource.RLIM_INFINITY or hard != resource.RLIM_INFINITY:
        return
    resource.setrlimit(resource.RLIMIT_STACK, (resource.RLIM_INFINITY, hard))
    os.environ[STACK_RAISED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def prepare(target: Target, comm_cfg=None) -> None:
    """The environment a target needs, set before JAX starts: N virtual CPU devices, or
    libtpu's compiler on a host without a TPU (JAX's CPU backend for the process itself; no
    cloud metadata query; no machine-wide libtpu lock, so two tools can compile at once).
    With ``comm_cfg`` (a config's ``comm``), also the compiler flags a run on the target
    would get from it (``comm.apply`` for the target's platform), so a program compiled for
    the target is scheduled as the run's would be."""
    _platform_environment(target)
    if comm_cfg is not None:
        comm.apply(comm_cfg, target.platform, target.chip.name if target.chip else None)


def _platform_environment(target: Target) -> None:
    if target.platform == "cpu":
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
        kept.append(f"--xla_force_host_platform_device_count={target.devices_count}")
        os.environ["XLA_FLAGS"] = " ".join(kept)
        os.environ["JAX_PLATFORMS"] = "cpu"  # on a GPU machine too: cpu:N means the CPU's
        return
    if target.platform == "gpu":
        if not have_cuda_plugin():
            raise ConfigError(
                f"--target {target.spec} compiles with XLA's GPU compiler, which comes with "
                f"jax's CUDA plugin: install it with {GPU_EXTRA} (about 0.2 GB; no GPU or "
                "CUDA driver needed)"
            )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the process's own arrays stay on CPU
        return
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(
            f"--target {target.spec} compiles with the TPU compiler, which comes with libtpu: "
            f"install it with {TPU_EXTRA} (about 0.7 GB; no TPU needed)"
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # What a TPU VM's metadata would say; without them libtpu prints warnings about a
    # host it cannot find (the topology it compiles for is the one passed explicitly).
    cloud_name = "v5litepod" if target.chip.name == "v5e" else target.chip.name
    per_slice = target.devices_count // target.slices * target.chip.cores_per_chip
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{cloud_name}-{per_slice}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def flops_bound_s(target: Target, flops: float | None) -> float | None:
    """A lower bound on one step's time on one chip: the compiler's FLOP count at the chip's
    bfloat16 peak (no step is faster; memory traffic, collectives, launch and input not
    counted). None without chip figures (CPU) or without a FLOP count (the GPU compiler
    gives none ahead of time)."""
    if target.chip is None or not flops:
        return None
    return flops / target.chip.peak_bf16_flops


def bytes_accessed_s(target: Target, bytes_accessed: float | None) -> float | None:
    """The compiler's bytes-accessed count at the chip's HBM bandwidth: not a bound, as that
    count is more than the step's HBM traffic (it includes what the chip's on-chip memory
    serves: measured whole steps take less, docs/scaling.md). None without chip figures or
    without the count."""
    if target.chip is None or not bytes_accessed:
        return None
    return bytes_accessed / target.chip.hbm_bytes_per_s


def roofline_step_s(target: Target, flops: float, bytes_accessed: float) -> float | None:
    """The longer of ``flops_bound_s`` and ``bytes_accessed_s``: an estimate that ranks
    plans (``plan --target``), not a bound, as the bytes term overstates the memory traffic
    (collectives, launch and input not counted). None without chip figures (CPU) or without
    a FLOP count (the GPU compiler gives none ahead of time)."""
    compute = flops_bound_s(target, flops)
    if compute is None:
        return None
    return max(compute, bytes_accessed_s(target, bytes_accessed) or 0.0)


def target_hint(target: Target, mesh: str) -> str:
    """What a compile for the mesh's device count names as its target: a like target of
    that size where one exists (the same chip and slices)."""
    import math

    want = math.prod(int(n) for n in re.findall(r":\s*(\d+)", mesh))
    if target.platform == "cpu":
        return f"--target cpu:{want} compiles for {want} virtual CPU devices"
    unit = "chips" if target.platform == "tpu" else "GPUs"
    here = f"--target {target.spec} is {target.devices_count} {unit}"
    if target.platform == "tpu":
        per_slice = want // target.slices * target.chip.cores_per_chip
        slices = f",slices={target.slices}" if target.slices > 1 else ""
        spec = f"tpu:{target.chip.name}-{per_slice}{slices}"
    else:
        spec = f"gpu:{target.chip.name}-{want}"
    try:
        fits = want % target.slices == 0 and parse(spec).devices_count == want
    except ConfigError:
        fits = False
    return f"{here}; --target {spec} has {want}" if fits else here
