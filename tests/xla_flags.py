"""The XLA flags of every test process and of the subprocesses the tests start. No JAX
import here: conftest reads this before JAX starts."""

# XLA:CPU's older (LLVM IR) fusion emitters instead of the MLIR ones: the suite is mostly
# compiles of small programs, which this makes markedly faster. The shardings and
# collectives the tests check are the same either way; the fusions may differ.
FAST_CPU_COMPILE = "--xla_cpu_use_fusion_emitters=false"


def cpu_flags(devices: int, extra: str = "") -> str:
    """XLA_FLAGS for a test process with ``devices`` virtual CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_CPU_COMPILE} {extra}".strip()
