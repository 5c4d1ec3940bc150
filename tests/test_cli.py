"""``config.cli.parse``: what a tool needs of its command line, read once (the tools pass
their ``argv``, None from the console, straight through)."""

import os
import sys

import pytest
from helpers import DIGITS

from hybridpar.config import cli


def _parser():
    parser = cli.ArgumentParser("python -m hybridpar.example", "An example tool.")
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


TOOLS = ("comm_report", "compile", "compress", "evaluate", "plan", "prune", "quantize",
         "report", "train", "tune")  # fmt: skip


@pytest.mark.parametrize("tool", [*TOOLS, "simulate"])
def test_help_says_what_the_tool_does_in_plain_words(tool, capsys):
    """--help's line under the usage is the tool's summary for a user: not the module
    docstring's usage line in reST quotes (it was, cut at its first line), and it names
    what the tool does."""
    import importlib

    module = importlib.import_module(
        "hybridpar.simulate.cli" if tool == "simulate" else f"hybridpar.tools.{tool}"
    )
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    summary = out.split("\n\n")[1]  # usage, blank line, the summary
    assert "``" not in summary and not summary.startswith("python -m"), summary
    assert len(summary.split()) >= 6 and summary.rstrip().endswith((".", ")")), summary


def _help(tool, capsys) -> str:
    """``tool --help`` as printed, run in this process."""
    import importlib

    module = importlib.import_module({"simulate": "hybridpar.simulate.cli",
                                      "prepare": "hybridpar.input.prepare"}.get(
        tool, f"hybridpar.tools.{tool}"))  # fmt: skip
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    return out


def help_entries(text: str) -> dict[str, str]:
    """``{first flag or name: its help}`` of every entry of a --help's argument sections
    (an entry is a line indented two spaces; its help follows after two or more spaces, or
    on the lines indented deeper below it)."""
    entries, name = {}, None
    for section in text.split("\n\n"):
        lines = section.splitlines()
        if not lines or not lines[0].endswith("arguments:") and lines[0] != "options:":
            continue
        for line in lines[1:]:
            if line.startswith("  ") and not line.startswith("   "):
                invocation, _, said = line.strip().partition("  ")
                name = invocation.split(",")[0].split()[0]
                entries[name] = said.strip()
            else:
                entries[name] = (entries[name] + " " + line.strip()).strip()
    return entries


@pytest.mark.parametrize("tool", [*TOOLS, "simulate", "prepare"])
def test_every_option_has_a_help_and_is_in_the_usage(tool, capsys):
    """A flag with no help was a blank line in --help (prepare's --examples-per-shard and
    --workers, quantize's --weights, compress's --calibration-batches), and a usage written
    by hand (where it shows a flag as required) must not leave a flag out."""
    out = _help(tool, capsys)
    usage, entries = out.split("\n\n")[0], help_entries(out)
    assert "-h" in entries and len(entries) > 2, out
    assert not [k for k, v in entries.items() if not v], out
    flags = [k for k in entries if k.startswith("-")]
    assert not [f for f in flags if f not in usage.replace("\n", " ")], usage


@pytest.mark.parametrize("tool,required", [
    ("train", ["--config", "--workdir"]), ("evaluate", ["--workdir"]),
    ("quantize", ["--workdir"]), ("prune", ["--workdir", "--out", "--fraction"]),
    ("compress", ["--workdir", "--budget-kb"]), ("tune", ["--workdir"])])  # fmt: skip
def test_the_usage_shows_the_required_flags_as_required(tool, required, capsys):
    """``usage: ... [--workdir WORKDIR]`` said it was optional, and leaving it out is an
    error; train's usage left out --config, which it needs."""
    usage = _help(tool, capsys).split("\n\n")[0]
    for flag in required:
        assert f" {flag} " in usage and f"[{flag} " not in usage, (flag, usage)


def test_help_states_the_defaults_and_compress_its_exit_status(capsys):
    """Flags whose help did not say their default (or that they have none), and compress's
    exit status 3 (docs/compression.md) missing from its --help."""
    compress = _help("compress", capsys)
    entries = help_entries(compress)
    assert "default 8" in entries["--max-rounds"], entries["--max-rounds"]
    assert "default 8" in entries["--calibration-batches"]
    assert "3 when" in compress.split("exit status:")[1].split("\n\n")[0], compress
    entries = help_entries(_help("tune", capsys))
    assert "no default" in entries["--trials"] and "no default" in entries["--budget-epochs"]
    entries = help_entries(_help("prepare", capsys))
    assert "default 1024" in entries["--examples-per-shard"], entries
    assert f"{os.cpu_count()} here" in entries["--workers"], entries


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


@pytest.mark.parametrize("flag", ["--poll-s=1", "--dead-after-s=10"])
def test_evaluate_refuses_a_wait_flag_without_watch(tmp_path, capsys, flag):
    """Without --watch nothing is waited for: the flag would be silently unused."""
    from hybridpar.tools import evaluate

    w = tmp_path / "w"
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--workdir", str(w), flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    name = flag.partition("=")[0]
    assert err[0] == f"error: {name} is not used without --watch (nothing is waited for); " \
        "pass --watch with it, or drop it", err  # fmt: skip
    assert not w.exists()


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


@pytest.mark.parametrize(
    "tool,extra",
    [("quantize", []), ("quantize", ["--config", DIGITS]), ("compress", ["--budget-kb", "100"]),
     ("compress", ["--budget-kb", "100", "--config", DIGITS]),
     ("prune", ["--out", "p", "--fraction", "0.5"])],
    ids=["quantize", "quantize-config", "compress", "compress-config", "prune"],
)  # fmt: skip
def test_a_workdir_that_is_a_file_is_said_to_be_one(tmp_path, capsys, monkeypatch, tool, extra):
    """A --workdir that names a file: one line saying so, not that the file's config.json
    cannot be read (Not a directory) and to pass a --config. Planted bug that fails it: the
    tools without their check of --workdir."""
    import importlib

    module = importlib.import_module(f"hybridpar.tools.{tool}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        module.main(["--workdir", "afile", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [
        "error: --workdir afile is a file, not a run's folder: pass the folder the training "
        "run wrote (the --workdir of python -m hybridpar.train)"
    ], err
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # nothing written


@pytest.mark.parametrize(
    "body,says",
    [
        ("def get_config():\n    return 5\n", "returned a int, not a config"),
        ("def get_config():\n    return {'mesh': 'data:1'}\n", "returned a dict, not a config"),
        ("def get_config():\n    raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("def get_config():\n    return 1 / 0\n", "ZeroDivisionError"),
    ],
    ids=["int", "dict", "raises", "divides-by-zero"],
)
def test_a_config_file_that_loads_but_misbehaves_is_one_error_line(tmp_path, capsys, body, says):
    """The config file is the user's code: whatever its get_config returns or raises is
    bad input, one ``error:`` line naming the file, not a traceback."""
    path = tmp_path / "mine.py"
    path.write_text(body)
    with pytest.raises(SystemExit) as e:
        cli.load(str(path))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert says in err[0] and "mine.py" in err[0], err


def test_a_runs_config_json_is_a_config_file(tmp_path, capsys):
    """``--config W/config.json`` (a run's record of its config, as prune's train command
    gives it): that run's config, key for key, overrides on top; one that does not read, or
    holds a key this version does not know, is one error line naming the file. Planted bug
    that fails it: a .json loaded as Python (a SyntaxError's line)."""
    from hybridpar.runtime import run_config

    mine = cli.load(DIGITS, [("optim.momentum", "0.8"), ("model.stage_widths", "(4, 8, 16, 32)")])
    path = tmp_path / "config.json"
    run_config.record_config(str(tmp_path), mine)
    again = cli.load(str(path), [("num_epochs", "2.0")])
    assert run_config.differences(run_config.config_dict(mine),
                                  run_config.config_dict(again)) == [("num_epochs", 15.0, 2.0)]
    for text, says in (("{not json", "does not read as a run's config.json"),
                       ("[1, 2]", "holds no JSON object"),
                       ('{"optim": {"mommentum": 0.8}}', "holds key 'optim.mommentum'")):
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            cli.load(str(path))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], err
        assert str(path) in err[0], err


def test_a_recipes_device_count_is_a_decimal_number(capsys):
    """``cifar10_fast.py:cpu,2`` shares the batches over 2 devices; a count str.isdigit
    takes but int() does not ("²") is the recipe's own error line."""
    import pathlib

    recipe = str(pathlib.Path(DIGITS).with_name("cifar10_fast.py"))
    assert cli.load(f"{recipe}:cpu,2").stages == "3:24-256@0.5,8:32-256"
    with pytest.raises(SystemExit) as e:
        cli.load(f"{recipe}:cpu,\u00b2")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "device count" in err[0], err


@pytest.mark.parametrize(
    "override,says",
    [
        (("model.num_filters", "0"), "model.num_filters=0 is out of range: it must be >= 1"),
        (("model.bn_epsilon", "-1.0"), "model.bn_epsilon=-1.0 is out of range: it must be > 0"),
        (("model.bn_momentum", "1.0"), "model.bn_momentum=1.0 is out of range"),
        (("data.std", "(0,)"), "data.std=(0,) must be 1 finite number(s), each > 0"),
        (("data.mean", "('a',)"), "data.mean=('a',) must be 1 finite number(s)"),
        # one class trained to "top-1 1.0"; digits' top-5 target met at step 0 with 5 classes
        (("data.num_classes", "1"), "data.num_classes=1 is out of range: it must be >= 2"),
        (("data.num_classes", "5"), "target_top5=0.99 with data.num_classes=5: top-5 is 1.0"),
    ],
    ids=["filters", "epsilon", "bn-momentum", "std", "mean", "one-class", "top5-of-5"],
)
def test_model_and_pixel_keys_out_of_their_meaning_are_refused_up_front(override, says):
    """Keys that failed only inside the model or the input (a division by zero in im2col, a
    string in the normalisation, a step of non-finite losses that named no key): checked
    with the config, one error line naming the key."""
    from hybridpar.config.errors import ConfigError
    from hybridpar.config.schema import validate

    with pytest.raises(ConfigError) as e:
        validate(cli.load(DIGITS, [override]))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("rules", ["(('x',),)", "(('embed', 3),)", "('embed',)"])
def test_logical_rules_that_are_not_pairs_are_refused_with_the_config(rules):
    from hybridpar.config.errors import ConfigError
    from hybridpar.config.schema import validate

    with pytest.raises(ConfigError, match="is not a .logical_name, mesh_axis. pair"):
        validate(cli.load(DIGITS, [("partitioning.logical_rules", rules)]))
    # the control: a name to an axis, to several, or to none
    ok = "(('embed', 'fsdp'), ('mlp', ('data', 'model')), ('vocab', None))"
    validate(cli.load(DIGITS, [("partitioning.logical_rules", ok)]))


def test_ctrl_c_in_a_tool_is_one_line_and_exit_130(capsys):
    """A Ctrl-C that reaches ``cli.main`` (quantize, prune: no signal handling of their own)
    is one line, with what the tool says it left, and the shell's 130, not a traceback.
    Planted bug that fails it: ``main`` without its ``except KeyboardInterrupt``."""

    def stopped():
        raise KeyboardInterrupt

    assert _exit_code(cli.main, stopped, stopped="nothing written") == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stopped (Ctrl-C): nothing written"], err
    assert _exit_code(cli.main, stopped) == 130  # a tool that says nothing of what it left
    assert capsys.readouterr().err == "stopped (Ctrl-C)\n"


def _exit_code(fn, *args, **kw):
    """``fn``'s exit code, or ``"KeyboardInterrupt"`` where it let one through (which
    pytest would otherwise take for the user's, and stop the whole run). ``os._exit`` (a
    stop's exit, without the exit handlers) is stood in for by a ``SystemExit``."""

    def exit_now(code):
        raise SystemExit(code)

    real, os._exit = os._exit, exit_now
    try:
        fn(*args, **kw)
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    finally:
        os._exit = real
    return 0


@pytest.mark.parametrize("written", [False, True], ids=["while-working", "after-writing"])
@pytest.mark.parametrize("tool", ["quantize", "prune"])
def test_ctrl_c_in_quantize_and_prune_says_what_was_written(tmp_path, monkeypatch, capsys,
                                                            tool, written):  # fmt: skip
    """Both write their files beside the output and move them in whole, so a Ctrl-C while
    they work leaves nothing, and the line says so; one after the move (their last lines)
    says the output was written. Their work is stood in for by a stop, before or after
    its output appears."""
    import importlib

    from hybridpar.runtime import trained

    module = importlib.import_module(f"hybridpar.tools.{tool}")
    w, pruned = tmp_path / "w", tmp_path / "p"
    out = pruned if tool == "prune" else w / "quantized"

    def stopped(*a, **k):
        if written:
            out.mkdir(parents=True)
            (out / "report.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(trained, "load_config", lambda *a: None)
    monkeypatch.setattr(module, "check_args", lambda *a: None, raising=False)  # quantize's
    monkeypatch.setattr(module, "prune_run" if tool == "prune" else "run", stopped)
    argv = ["--workdir", str(w)]
    argv += ["--out", str(pruned), "--fraction", "0.5"] if tool == "prune" else []
    assert _exit_code(module.main, argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    said = f"{out} was written whole before the stop" if written else "nothing written"
    assert err == [f"stopped (Ctrl-C): {said}"], err


def test_a_closed_stdout_ends_a_tool_quietly(tmp_path):
    """``python -m hybridpar.report RUN | head -3`` (and the evaluator's) was a
    BrokenPipeError traceback: now no word on stderr and exit code 1, Python's own for it
    (the signal module's note on SIGPIPE). Planted bug that fails it: no ``except
    BrokenPipeError`` in ``cli.main``."""
    import subprocess

    code = "from hybridpar.config import cli\ncli.main(lambda: [print(i) for i in range(10**6)])\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout.readline() == "0\n"
    p.stdout.close()  # as head does after its lines
    err = p.stderr.read()
    assert p.wait(timeout=60) == 1 and err == "", err


def test_run_as_its_console_script_the_usage_names_that_script(monkeypatch, capsys):
    """``hybridpar-evaluate --help`` showed ``usage: python -m hybridpar.evaluate``."""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/hybridpar-evaluate", "--help"])
    assert _parser().format_usage().startswith("usage: hybridpar-evaluate ")
    monkeypatch.setattr(sys, "argv", ["/src/hybridpar/evaluate.py", "--help"])  # python -m
    assert _parser().format_usage().startswith("usage: python -m hybridpar.example ")


def test_the_same_command_says_the_environment_the_run_depends_on(monkeypatch):
    """A resume line printed without the XLA_FLAGS of a virtual mesh ran, pasted, on one
    device. The variables are the ones the process started with (planted: none said)."""
    import shlex
    import sys

    from hybridpar.config import cli

    monkeypatch.setattr(cli, "START_ENV", {"XLA_FLAGS": "--a=1 --b=2", "HYBRIDPAR_DATA": "/d"})
    want = shlex.join([sys.executable, "-m", "hybridpar.train", "--workdir", "w x"])
    assert cli.same_command("hybridpar.train", ["--workdir", "w x"]) == (
        f"XLA_FLAGS='--a=1 --b=2' HYBRIDPAR_DATA=/d {want}")  # fmt: skip
    assert set(cli.START_ENV) <= set(cli.COMMAND_ENV)


def test_a_processs_same_command_names_its_place_in_a_multi_process_run():
    """A stopped 2-process run printed its resume line without the JAX_* variables: pasted,
    it was 'error: --config.distributed=True but JAX_COORDINATOR_ADDRESS, ... are not set'.
    Each process's line names them, its own JAX_PROCESS_ID among them (planted: the
    variables left out of COMMAND_ENV fails it)."""
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", ""), "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_LOCAL_DEVICE_IDS": "0,1"}
    code = "from hybridpar.config import cli; print(cli.same_command('hybridpar.train', []))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 "
                               "JAX_PROCESS_ID=1 JAX_LOCAL_DEVICE_IDS=0,1 "), r.stdout
