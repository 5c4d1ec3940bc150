"""The one command-line parser of every hybridpar tool: ``--config FILE[:ARGS]`` and
``--config.KEY=VALUE`` overrides, plus each tool's own flags.

    parser = cli.ArgumentParser("python -m hybridpar.train", "Train a model from a config.")
    parser.add_argument("--workdir", required=True)
    args, config = cli.parse(parser)          # or cli.parse(parser, argv)
    # args.config_path, args.config_overrides: what --config and --config.KEY=VALUE said

The override syntax is ml_collections ``config_flags``' (the config is locked, so a
misspelt key is an error, and a value takes the type of the key it replaces), but the parser
is ours, for three reasons: every tool (train, evaluate, comm_report, the benches, and report
and plan to come) shares it with one set of ``error:`` messages; it needs no absl, so the
benches run where only jax, flax and optax are installed (the GPU image, with
``bench/gpu``'s stand-in for ml_collections); and nothing here imports JAX, so a tool can
still set device counts and XLA flags after parsing.

Every mistake is one ``error:`` line on stderr and exit code 2 (``fail``); ``main`` runs a
tool's function and turns an ``errors.Error`` from anywhere below into the same.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import glob
import logging
import math
import os
import signal
import stat
import sys
from typing import Callable, Sequence

from hybridpar.config.errors import ConfigError, Error

CONFIG_HELP = (
    "--config FILE[:ARGS]   experiment config (a Python file with get_config()), e.g. "
    "experiments/digits.py\n  --config.KEY=VALUE     override one key, e.g. "
    "--config.mesh=data:4,model:2 (repeatable; keys in hybridpar/config/schema.py)"
)


def fail(message: str, code: int = 2, at_once: bool = False) -> None:
    """One ``error:`` line and exit code 2: the contract for every bad input. ``at_once``:
    without the interpreter's exit handlers (see ``errors.PeerLost``)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    if at_once:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> None:
    """Exits with ``code`` without the interpreter's exit handlers (which would join XLA's
    or a compile's threads), after what was printed is out."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, RuntimeError, ValueError):  # its reader gone (a closed pipe), inside
            pass  # a print to it (a signal handler's exit), or closed
    os._exit(code)


def finite_float(text: str) -> float:
    """``type=`` of every float flag: a number, not nan or inf (``float`` takes both, and
    they fail far from the flag, in a traceback or 20 steps later)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give a number")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse with our error contract (one ``error:`` line, exit 2, no usage dump).
    ``summary``: what the tool does, for a user (``--help``'s first line under the usage; the
    module's docstring is for whoever reads the code)."""

    def __init__(self, prog: str, summary: str, *, takes_config: bool = True, **kw):
        script = os.path.basename(sys.argv[0])
        if script.startswith("hybridpar-"):  # run as its console script (pyproject.toml)
            prog = script
        super().__init__(
            prog=prog,
            description=summary,
            # a tool that reads no config (its runs' own) does not advertise --config
            epilog=CONFIG_HELP if takes_config else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
            **kw,
        )

    def error(self, message):  # argparse's own errors: missing or unknown flags
        fail(f"{message} (see {self.prog} --help)")


def split_config_args(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """``argv`` -> (config path, [(key, raw value)], the other arguments)."""
    path, overrides, rest = None, [], []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--config" or a.startswith("--config=") or a.startswith("--config."):
            name, eq, value = a.partition("=")
            if not eq:  # "--config X" / "--config.KEY X"
                if i + 1 >= len(args):
                    fail(f"{a} needs a value")
                value, i = args[i + 1], i + 1
            if name == "--config":
                if path is not None and value != path:  # a second file would win unsaid
                    fail(
                        f"--config given twice ({path} and {value}): pass one config file, "
                        "and change its keys with --config.KEY=VALUE"
                    )
                path = value
            else:
                overrides.append((name[len("--config.") :], value))
        else:
            rest.append(a)
        i += 1
    return path, overrides, rest


def config_keys(config, prefix: str = "") -> list[str]:
    """Every dotted key of ``config`` (sections included), for "did you mean"."""
    keys = []
    for k, v in config.items():
        keys.append(prefix + k)
        if hasattr(v, "items"):
            keys.extend(config_keys(v, prefix + k + "."))
    return keys


def _parse_value(key: str, raw: str, current):
    """``raw`` as the type of the value it replaces (config_flags' rule)."""
    try:
        if isinstance(current, bool):
            low = raw.strip().lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, str):
            return raw
        if isinstance(current, (tuple, list)):
            value = ast.literal_eval(raw)
            if isinstance(value, list):
                value = tuple(value)
            if not isinstance(value, tuple):
                value = (value,)
            return value
    except (ValueError, SyntaxError):
        kind = type(current).__name__
        example = {"tuple": "(1, 2)", "bool": "True", "int": "8", "float": "0.1"}.get(kind, "")
        fail(
            f"--config.{key}={raw!r}: {key} takes a{'n' if kind[0] in 'aeiou' else ''} {kind}"
            + (f", e.g. --config.{key}={example}" if example else "")
        )
    try:  # a key whose default is None: a Python literal, or else the text itself
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


# What other training codebases call some of our keys (Flax's examples, big_vision, timm),
# so "did you mean" finds ours from theirs.
KNOWN_AS = {
    "learning_rate": "optim.base_lr",
    "lr": "optim.base_lr",
    "base_learning_rate": "optim.base_lr",
    "batch_size": "global_batch",
    "epochs": "num_epochs",
    "total_epochs": "num_epochs",
    "wd": "optim.weight_decay",
    "optimizer": "optim.name",
    "model_name": "model.name",
    "dataset": "data.name",
}


def suggest(key: str, keys) -> list[str]:
    """Up to three keys of ``keys`` that ``key`` may have meant, the likeliest first: by how
    close the dotted key is, or its last part to a key's last part or ``KNOWN_AS`` name, so a
    key in the wrong section or under another codebase's name is found too."""

    def close(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    leaf = key.rsplit(".", 1)[-1]
    sections = {k.rpartition(".")[0] for k in keys}
    keys = [k for k in keys if k not in sections]  # a section is not set itself
    aliases: dict[str, list[str]] = {}
    for alias, k in KNOWN_AS.items():
        aliases.setdefault(k, []).append(alias)
    score = {
        k: max(
            [close(key, k), close(leaf, k.rsplit(".", 1)[-1])]
            + [close(leaf, a) for a in aliases.get(k, [])]
        )  # fmt: skip
        for k in keys
    }
    best = sorted((k for k in score if score[k] >= 0.6), key=lambda k: (-score[k], k))
    return best[:3]


def apply_overrides(config, overrides: Sequence[tuple[str, str]], source: str = "the config"):
    """Sets each ``(dotted key, raw value)`` on ``config`` (a ConfigDict or any nested
    mapping); an unknown key is an error that suggests the closest ones."""
    keys = set(config_keys(config))
    for key, raw in overrides:
        if key not in keys:
            close = suggest(key, keys)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            fail(
                f"no config key {key!r}{hint} (keys are set as --config.KEY=VALUE; see "
                f"{source} and hybridpar/config/schema.py for the valid ones)"
            )
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        if hasattr(node[leaf], "items"):
            fail(f"--config.{key} is a section; set its keys, e.g. --config.{key}.KEY=VALUE")
        value = _parse_value(key, raw, node[leaf])
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:  # ConfigDict's type safety
            fail(f"--config.{key}={raw!r}: {' '.join(str(e).split())}")
    return config


def load(path: str | None, overrides=()):
    """The config ``path`` names, with ``overrides`` applied and keys locked."""
    from hybridpar.config.schema import load_config

    if not path:
        fail("pass --config experiments/NAME.py")
    try:
        config = load_config(path)
    except ConfigError as e:
        fail(f"could not load the config file: {e}")
    except Exception as e:  # the file is the user's code: whatever it raises is their input
        fail(f"could not load the config file {path!r}: {type(e).__name__}: {e}")
    import ml_collections

    if not isinstance(config, ml_collections.ConfigDict):
        fail(
            f"the config file {path!r}: get_config() returned a {type(config).__name__}, not "
            "a config: return hybridpar.config.schema.base_config() with your changes, as "
            "experiments/digits.py does"
        )
    if hasattr(config, "lock"):  # (bench/gpu's stand-in for ml_collections has no lock)
        config.lock()  # no new keys: a misspelt one is an error, not a silent new field
    return apply_overrides(config, overrides, path.partition(":")[0])


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    *,
    config=True,
    from_run=False,
):
    """``(args, config)`` from ``argv`` (default ``sys.argv[1:]``); ``config=False`` makes
    ``--config`` optional (None when absent). ``from_run``: without ``--config`` the config
    is the run's (``runtime.trained.load_config``, by the tool once it knows the workdir).
    Besides the tool's own flags, ``args`` holds what the command line said of the config:
    ``config_path`` (``--config``'s value, or None), ``config_overrides`` (the
    ``(key, raw value)`` pairs) and ``argv`` (the arguments read, for a command to repeat)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        sys.exit(0)
    path, overrides, rest = split_config_args(argv)
    args = parser.parse_args(rest)
    args.config_path, args.config_overrides, args.argv = path, overrides, argv
    if path is None and (from_run or not config):
        if overrides and not from_run:
            fail("--config.KEY overrides need --config FILE")
        return args, None
    return args, load(path, overrides)


# The device files of the accelerators JAX runs on: NVIDIA GPUs, a TPU VM's chips (v4 and
# v5e as accel, v5p and v6e through vfio), AMD GPUs.
ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


# The environment a run depends on (its devices, its data, a multi-process run's place in
# it: each process's own id): said before a command that must be given again the same (a
# resume), as the process found it, before a tool adds XLA flags of its own.
COMMAND_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "HYBRIDPAR_DATA",
               "HYBRIDPAR_CACHE", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS",
               "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")  # fmt: skip
START_ENV = {k: os.environ[k] for k in COMMAND_ENV if os.environ.get(k)}


def same_command(module: str, argv: Sequence[str]) -> str:
    """``python -m module argv`` as this process was started, with the variables of
    ``COMMAND_ENV`` it was given: without them a resume pasted in another shell ran on other
    devices (a virtual mesh's XLA_FLAGS left out: one device)."""
    import shlex

    env = [f"{k}={shlex.quote(v)}" for k, v in START_ENV.items()]
    return " ".join([*env, shlex.join([sys.executable, "-m", module, *argv])])


def cpu_when_no_accelerator() -> None:
    """JAX's CPU backend on a machine with no accelerator, unless ``JAX_PLATFORMS`` says
    otherwise: else JAX first starts every installed accelerator plugin (the compile-only
    extras bring libtpu and the CUDA plugin), which print warnings and a traceback before it
    falls back to the CPU."""
    if "JAX_PLATFORMS" not in os.environ and not any(map(glob.glob, ACCELERATOR_FILES)):
        os.environ["JAX_PLATFORMS"] = "cpu"  # for processes this one starts
        if "jax" in sys.modules:  # jax read the environment when it was imported
            sys.modules["jax"].config.update("jax_platforms", "cpu")


STOPPED = 130  # 128 + SIGINT: a shell's exit status for a command stopped by Ctrl-C
# A tool whose stdout was closed (``| head``): Python's own exit status for it (the signal
# module's note on SIGPIPE), and no traceback.
CLOSED_STDOUT = 1


def main(fn: Callable[[], object], stopped: str | Callable[[], str] = "") -> None:
    """Runs a tool's ``fn``; an ``errors.Error`` anywhere below is one ``error:`` line. A
    Ctrl-C that reaches here (a tool without its own signal handling: the trainer, compress,
    tune, quantize, prune and evaluate have theirs) is one line, ``stopped (Ctrl-C)`` and
    ``stopped`` (what the tool left, where it knows: the tools differ; a function, asked
    then), and exit code 130, not a traceback. A closed stdout (``| head``) ends the tool
    quietly, exit code 1 (what the tool wrote to files before the print that met it is
    there)."""
    # jax logs at INFO that it found no TPU: noise on every CPU and GPU machine.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    cpu_when_no_accelerator()
    try:
        fn()
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit
    except BrokenPipeError:
        # the reader is gone: what is left to print goes nowhere, quietly (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        exit_now(CLOSED_STDOUT)
    except Error as e:
        fail(str(e), getattr(e, "exit_code", 2), getattr(e, "exit_at_once", False))
    except KeyboardInterrupt:
        said = stopped() if callable(stopped) else stopped
        print("stopped (Ctrl-C)" + (f": {said}" if said else ""), file=sys.stderr, flush=True)
        # without the exit handlers: stopped mid-computation, XLA's threads made the
        # interpreter's shutdown crash now and then (exit 139 after this line)
        exit_now(STOPPED)


# ---- Signals and the terminal (every command's; runtime/signals.py and prepare use them) ----


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the stops every command handles


def taken(signals=SIGNALS) -> tuple:
    """Of ``signals``, those a handler here takes: all but a SIGHUP that is ignored (started
    under ``nohup``, which says to go on when the terminal goes)."""
    return tuple(s for s in signals
                 if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN)  # fmt: skip


def leave_hung_up_terminal(signum: int) -> None:
    """On SIGHUP: stdout and stderr that are a terminal that hung up (a character device
    that no longer answers as a terminal) point to /dev/null, so the lines still to come
    (the stop's, the run's) do not fail with EIO. A live terminal, a file or a pipe stays."""
    if signum != signal.SIGHUP:
        return
    for fd in (1, 2):
        try:
            if not stat.S_ISCHR(os.fstat(fd).st_mode) or os.isatty(fd):
                continue
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:  # closed
            continue
        os.dup2(null, fd)
        os.close(null)
