"""Every test process sees 8 virtual CPU devices (set before JAX initialises)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests need 8 virtual CPU devices, got {jax.devices()}"
