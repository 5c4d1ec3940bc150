"""The optional plot of `python -m hybridpar.simulate --png` (matplotlib is imported only
when asked: training never needs it)."""

from __future__ import annotations

import numpy as np

from hybridpar.config.formatting import pyplot


def write_png(rows: list[dict], path: str, title: str) -> None:
    """Images/s and scaling efficiency against devices. matplotlib is optional: without it,
    a ConfigError saying how to install it."""
    plt = pyplot()
    devs = np.array([r["devices"] for r in rows], dtype=float)
    ips = np.array([r["images_per_s"] for r in rows])
    eff = np.array([r["efficiency"] for r in rows])
    ideal = ips / eff  # devices x one device's images/s (efficiency = ips / ideal)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.loglog(devs, ips, "o-", label="predicted")
    a1.loglog(devs, ideal, "--", color="gray", label="devices x one device")
    a1.set_xlabel("devices")
    a1.set_ylabel("images/s")
    a1.legend()
    a1.grid(True, which="both", alpha=0.3)
    a2.semilogx(devs, eff, "o-")
    a2.set_ylim(0, 1.05)
    a2.set_xlabel("devices")
    a2.set_ylabel("scaling efficiency vs one device")
    a2.grid(True, which="both", alpha=0.3)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
