"""How the commands print what they print: byte sizes, durations, text tables, and how
they load matplotlib. One rule for each, so a size or a time reads the same in every tool.
No JAX.

    byte_size(3 * 2**20)            # "3.0 MiB"
    counted(6, "plan")              # "6 plans" ("1 plan")
    duration(5400)                  # "1.50 h"
    print(table(rows, header))      # right-aligned columns under a dashed rule
    plt = pyplot()                  # matplotlib's pyplot on the Agg backend, or a ConfigError
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.config.errors import ConfigError

KIB, MIB, GIB = 2**10, 2**20, 2**30
PLOT_EXTRA = 'pip install -e ".[plot]"'


def byte_size(n: float) -> str:
    """Bytes in binary units, the smallest in which the figure reads under 1024: ``"512 B"``,
    ``"9.0 KiB"``, ``"12.5 MiB"``, ``"1.50 GiB"`` (two decimals in GiB, where a tenth is a
    lot). A figure that rounds up to 1024 of a unit is written in the next one."""
    return _in_units(n, _BYTE_UNITS, 1024)


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless one: "1 plan", "6 plans"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def duration(s: float) -> str:
    """Seconds as a person reads them: ``"42.0 s"``, ``"12.5 min"``, ``"3.20 h"`` (each unit
    while it reads under 60 of it, as for bytes); from 1,000 h whole hours in groups of
    three digits, ``"61,111 h"``, not ``"61111.11 h"``."""
    if s >= 1000 * 3600:
        return f"{s / 3600:,.0f} h"
    return _in_units(s, _TIME_UNITS, 60)


_BYTE_UNITS = (("B", 1, 0), ("KiB", KIB, 1), ("MiB", MIB, 1), ("GiB", GIB, 2))
_TIME_UNITS = (("s", 1, 1), ("min", 60, 1), ("h", 3600, 2))


def _in_units(x: float, units, limit: int) -> str:
    for name, size, digits in units:
        value = round(x / size, digits)
        if abs(value) < limit or name == units[-1][0]:
            return f"{value:.{digits}f} {name}"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Cells right-aligned in columns two spaces apart, the header over a dashed rule;
    with no rows, the header alone."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: no display needed). matplotlib
    is optional: without it, a ConfigError that says how to install it (the commands print
    it as their ``error:`` line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"drawing a PNG needs matplotlib: {PLOT_EXTRA}") from None
    return plt
