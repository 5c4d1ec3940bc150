"""``python -m hybridpar.train ARGS``, then this process's device memory peak into a file.

    python bench/gpu/train_peak.py PEAK.json --config experiments/NAME.py --workdir DIR ...

The train CLI's own ``main`` in this process (nothing else changed), so that after it the
device's allocator statistics (``jax.devices()[0].memory_stats()``: ``peak_bytes_in_use``,
``bytes_limit``) can be read; a separate process could not see them. Written whether the
run ended well or not; ``{"stats": null}`` on a backend without statistics (CPU). The exit
status is the CLI's.
"""

from __future__ import annotations

import json
import os
import sys


def write_peak(path: str) -> None:
    jax = sys.modules.get("jax")
    rec = {"stats": None}
    if jax is not None:  # the CLI stopped before starting JAX: nothing to read
        try:
            dev = jax.devices()[0]
            stats = dev.memory_stats()
            rec = {
                "platform": dev.platform,
                "device_kind": dev.device_kind,
                "stats": {k: int(v) for k, v in (stats or {}).items()} or None,
            }
        except Exception as e:  # report, never mask the run's own exit status
            rec = {"stats": None, "error": f"{type(e).__name__}: {e}"}
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: train_peak.py PEAK.json TRAIN_ARGS...")
    out, argv = sys.argv[1], sys.argv[2:]
    from hybridpar.tools import train

    sys.argv = ["python -m hybridpar.train", *argv]
    try:
        train.main(argv)
    finally:
        write_peak(out)


if __name__ == "__main__":
    main()
