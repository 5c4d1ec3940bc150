"""The compiler workarounds ``comm.apply`` adds for the installed jaxlib, and how a user's
own flag wins over them."""

import os

from hybridpar.config.schema import base_config
from hybridpar.parallel import comm

TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"


def test_triton_gemm_workaround_follows_the_jaxlib_version():
    # Seen on 0.11.2: from 0.11 on a GPU run gets it; 0.10 and other platforms do not.
    assert comm.workaround_flags("gpu", (0, 11)) == [TRITON_OFF]
    assert comm.workaround_flags("cuda", (0, 12)) == [TRITON_OFF]
    assert comm.workaround_flags("gpu", (0, 10)) == []
    assert comm.workaround_flags("tpu", (0, 11)) == []
    assert comm.workaround_flags("cpu", (0, 11)) == []
    # the installed one is read without importing jax: this suite pins jax 0.10
    assert comm._jaxlib_version()[:2] == (0, 10)


def test_apply_adds_the_workaround_unless_the_user_set_that_flag(monkeypatch):
    c = base_config().comm
    monkeypatch.setattr(comm, "_jaxlib_version", lambda: (0, 11))
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    assert TRITON_OFF in comm.apply(c, "gpu")
    assert TRITON_OFF in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert TRITON_OFF not in comm.apply(c, "gpu")  # the user's own choice wins
    assert "--xla_gpu_enable_triton_gemm=true" in os.environ["XLA_FLAGS"].split()
    assert TRITON_OFF not in os.environ["XLA_FLAGS"].split()
    monkeypatch.setattr(comm, "_jaxlib_version", lambda: (0, 10))
    monkeypatch.setenv("XLA_FLAGS", "")
    assert TRITON_OFF not in comm.apply(c, "gpu")
