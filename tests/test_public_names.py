"""Tests use the package's public names only, so a refactor of internals breaks no test of
behaviour. Read from the tests' source with ``ast``: a private name (one leading underscore,
not a dunder) of a hybridpar module is an error where a test

* imports it (``from hybridpar.input.datasets import _x``),
* reads it off a name imported from hybridpar (``datasets._x``, ``hybridpar.input.datasets._x``),
* reads a private attribute the package itself defines off any object (``pipe._decoding``:
  an instance's method, found by the name the package's source defines), or
* names it in a string to ``setattr``/``getattr``/``monkeypatch`` (``(comm, "_x")``,
  ``"hybridpar.parallel.comm._x"``).

``ALLOWED`` lists the exceptions, each with its reason.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = (ROOT / "hybridpar", ROOT / "models", ROOT / "input")

# {(test file, "base._name"): why}: none; a test that needs an internal makes it public
ALLOWED: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_privates() -> set[str]:
    """Every private name the package's source defines: functions, classes, methods,
    module-level or class-level assignments, and ``self._x`` attributes."""
    out = set()
    for folder in SOURCE_DIRS:
        for f in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                out.add(n.id)
                            elif isinstance(n, ast.Attribute):
                                out.add(n.attr)
    return {n for n in out if _private(n)}


def private_uses(source: str, privates: set[str]) -> list[tuple[int, str]]:
    """``(line, "base._name")`` for each use of a hybridpar private name in ``source``."""
    tree = ast.parse(source)
    imported = set()  # local names bound to something imported from hybridpar
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "hybridpar":
                    imported.add(a.asname or "hybridpar")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridpar"):
            for a in node.names:
                imported.add(a.asname or a.name)
                if _private(a.name):
                    found.append((node.lineno, f"{node.module}.{a.name}"))

    def base_name(expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if base_name(node.value) in imported or node.attr in privates:
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"hybridpar(\.\w+)*\.(_\w+)", node.value):
                last = node.value.rpartition(".")[2]
                if _private(last):
                    found.append((node.lineno, node.value))
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            obj, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if _private(name.value) and (base_name(obj) in imported or name.value in privates):
                    found.append((node.lineno, f"{ast.unparse(obj)}.{name.value}"))
    return sorted(set(found))


def test_tests_use_only_public_names():
    privates = package_privates()
    bad, used = [], set()
    for f in sorted((ROOT / "tests").glob("*.py")):
        if f.name == Path(__file__).name:  # its planted examples below
            continue
        for line, text in private_uses(f.read_text(), privates):
            if (f.name, text) in ALLOWED:
                used.add((f.name, text))
            else:
                bad.append(f"{f.name}:{line}: {text}")
    assert not bad, "tests use private names:\n" + "\n".join(bad)
    assert used == set(ALLOWED), f"stale ALLOWED entries: {set(ALLOWED) - used}"


PLANTED = """
import hybridpar.input.datasets
import hybridpar.parallel.comm as c
from hybridpar.input import datasets as d, transforms
from hybridpar.tools.plan import _bytes
from hybridpar.input.pipeline import ImagePipeline
d._secret(1)
hybridpar.input.datasets._secret
ImagePipeline._hidden
pipe._known_private_method("full", 16)
monkeypatch.setattr(c, "_version", lambda: 1)
monkeypatch.setattr("hybridpar.parallel.comm._version", lambda: 1)
getattr(transforms, "_window")
"""

CLEAN = """
import os
import numpy as np
from hybridpar.input import datasets
datasets.prepare(1)
datasets.__name__
os._exit
np.random._bit_generator
fig._suptitle.get_text()
update._cache_size()
monkeypatch.setattr(datasets, "prepare", None)
monkeypatch.setattr(os, "_exit", None)
x = "hybridpar.input.datasets"
"""


@pytest.mark.parametrize(
    "source, want",
    [
        (PLANTED, [
            (5, "hybridpar.tools.plan._bytes"), (7, "d._secret"),
            (8, "hybridpar.input.datasets._secret"), (9, "ImagePipeline._hidden"),
            (10, "pipe._known_private_method"), (11, "c._version"),
            (12, "hybridpar.parallel.comm._version"), (13, "transforms._window"),
        ]),
        (CLEAN, []),
    ],
)  # fmt: skip
def test_the_check_sees_each_way_of_using_a_private_name(source, want):
    assert private_uses(source, {"_known_private_method"}) == want


def test_the_package_privates_are_read_from_the_source():
    # a module function, a method, a class attribute and an instance attribute
    privates = package_privates()
    assert {"_check_prepared", "_records", "_MAX_CYCLE", "_caches"} <= privates
    assert all(_private(n) for n in privates)


def test_every_exported_name_resolves_and_a_trained_run_is_one():
    """``hybridpar``'s names, imported on first use, each name something; ``TrainedRun``
    among them (docs/evaluation.md shows it)."""
    import hybridpar
    from hybridpar.runtime.trained import TrainedRun

    assert all(getattr(hybridpar, name) is not None for name in hybridpar.__all__)
    assert "TrainedRun" in hybridpar.__all__ and hybridpar.TrainedRun is TrainedRun
