"""``config.cli.parse``: what a tool needs of its command line, read once (the tools pass
their ``argv``, None from the console, straight through)."""

import sys

import pytest
from helpers import DIGITS

from hybridpar.config import cli


def _parser():
    parser = cli.ArgumentParser("python -m hybridpar.example")
    parser.add_argument("--workdir")
    return parser


@pytest.mark.parametrize("from_console", [True, False], ids=["sys.argv", "argv"])
def test_parse_gives_the_config_path_overrides_and_argv(monkeypatch, from_console):
    argv = ["--config", DIGITS, "--workdir", "w", "--config.optim.base_lr=0.3"]
    monkeypatch.setattr(sys, "argv", ["prog", *(argv if from_console else ["--workdir", "x"])])
    args, config = cli.parse(_parser(), None if from_console else tuple(argv))
    assert args.workdir == "w" and config.optim.base_lr == 0.3
    assert args.config_path == DIGITS
    assert args.config_overrides == [("optim.base_lr", "0.3")]
    assert args.argv == argv  # a list, as the tools repeat it in a command line


def test_parse_from_a_run_keeps_the_overrides_without_a_config(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "--workdir", "w", "--config.optim.base_lr=0.3"])
    args, config = cli.parse(_parser(), from_run=True)
    assert config is None and args.config_path is None
    assert args.config_overrides == [("optim.base_lr", "0.3")]


def test_no_number_flag_takes_nan_or_inf():
    """Every float flag of every tool is ``cli.finite_float``: ``float`` takes nan and inf,
    which fail far from the flag (``evaluate --dead-after-s=inf`` waited for ever). Read
    from the sources, so a new tool's flag is held to it too."""
    import pathlib
    import re

    root = pathlib.Path(cli.__file__).parents[1]
    bare = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\btype=float\b", line)]  # fmt: skip
    assert not bare, bare


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_evaluate_refuses_a_dead_time_that_is_not_finite(tmp_path, capsys, value):
    from hybridpar.tools import evaluate

    with pytest.raises(SystemExit) as e:
        evaluate.main(["--workdir", str(tmp_path), f"--dead-after-s={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "--dead-after-s" in err[0], err


@pytest.mark.parametrize("config", [["--config", DIGITS], ["--config.model.num_filters=8"]],
                         ids=["file", "override"])  # fmt: skip
def test_tools_that_read_their_runs_config_refuse_and_do_not_advertise_config(
    tmp_path, capsys, config
):
    """prune reads the run's own config: a --config there would be silently not the config
    pruned, so it is an error; its --help and report's do not offer --config."""
    from hybridpar.tools import prune, report

    with pytest.raises(SystemExit) as e:
        prune.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "p"), "--fraction",
                    "0.5", *config])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "drop --config" in err[0], err
    for tool in (prune, report):
        with pytest.raises(SystemExit):
            tool.main(["--help"])
        assert "--config.KEY" not in capsys.readouterr().out, tool
    with pytest.raises(SystemExit):
        evaluate_help = __import__("hybridpar.tools.evaluate", fromlist=["main"]).main
        evaluate_help(["--help"])
    assert "--config.KEY" in capsys.readouterr().out  # the control: a tool that takes one
