"""The one way sizes, durations and tables print (``hybridpar.config.formatting``), and the
one accelerator table (``hybridpar.config.hardware``) the compile targets, the planner and
the scaling model's presets all read."""

import sys

import pytest

from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import GIB, KIB, MIB, byte_size, duration, pyplot, table
from hybridpar.config.hardware import GPUS, TPUS


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (KIB, "1.0 KiB"),
        (1000 * KIB, "1000.0 KiB"),
        (MIB - 1, "1.0 MiB"),  # would read 1024.0 KiB: the next unit
        (1.5 * MIB, "1.5 MiB"),
        (GIB / 2, "512.0 MiB"),
        (GIB - 1, "1.00 GiB"),
        (15.75 * GIB, "15.75 GiB"),
        (3 * 1024 * GIB, "3072.00 GiB"),  # the largest unit has no limit
    ],
)
def test_byte_size_takes_the_smallest_unit_that_reads_under_1024(n, text):
    assert byte_size(n) == text


@pytest.mark.parametrize(
    "s,text",
    [
        (0, "0.0 s"),
        (42, "42.0 s"),
        (59.94, "59.9 s"),
        (59.96, "1.0 min"),  # would read 60.0 s
        (750, "12.5 min"),
        (3599.9, "1.00 h"),
        (5400, "1.50 h"),
        (100 * 3600, "100.00 h"),
        (999.99 * 3600, "999.99 h"),
        (2.2e8, "61,111 h"),  # a run of num_epochs=1e9: whole hours, grouped
    ],
)
def test_duration_takes_the_smallest_unit_that_reads_under_60(s, text):
    assert duration(s) == text


def test_table_right_aligns_columns_under_a_dashed_rule():
    assert table([["a", "bbb"], ["cc", "d"]], ["x", "yy"]).splitlines() == [
        " x   yy",
        "--  ---",
        " a  bbb",
        "cc    d",
    ]
    assert table([], ["x", "yy"]).splitlines() == ["x  yy", "-  --"]  # no rows: the header


def test_pyplot_is_on_agg_or_one_error_naming_the_install(monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    assert pyplot() is sys.modules["matplotlib.pyplot"]
    assert matplotlib.get_backend().lower() == "agg"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(ConfigError, match=r'needs matplotlib: pip install -e "\.\[plot\]"'):
        pyplot()


def test_the_plot_extra_is_the_one_that_carries_matplotlib():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    plot = extras["project"]["optional-dependencies"]["plot"]
    assert any(d.startswith("matplotlib") for d in plot), plot


def test_targets_and_presets_read_one_hardware_table():
    """Every chip the compile targets know has a scaling-model preset with the same peak,
    memory and links, all of them the accelerator table's; "a100" is one A100 everywhere
    (the 80 GB one the GPU compiler is described as), the 40 GB one a second entry."""
    from hybridpar import simulate as sim
    from hybridpar.tools import targets

    presets = {p.chip: p for p in sim.PRESETS.values() if p.chip}
    known = {**targets.CHIPS, **targets.GPUS}
    assert set(known) <= set(presets) and set(presets) == set(TPUS) | set(GPUS)
    for name, preset in presets.items():
        chip = TPUS.get(name) or GPUS[name]
        if name in known:
            assert known[name] is chip, name
        assert preset.peak_flops == chip.peak_bf16_flops, name
        assert preset.memory_gib * GIB == pytest.approx(chip.hbm_bytes), name
        assert preset.intra.bandwidth == pytest.approx(chip.ici_bytes_per_s / 2), name
        if name in GPUS:  # between nodes: one NIC per GPU
            assert preset.inter.bandwidth == pytest.approx(chip.dcn_bytes_per_s), name
    assert presets["a100"].memory_gib * GIB == pytest.approx(80e9)
    assert "A100-SXM4-80GB" in targets.gpu_target_config("a100")
    assert "device_memory_size: 80000000000" in targets.gpu_target_config("a100")
    assert presets["a100-40gb"].memory_gib * GIB == pytest.approx(40e9)
