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
