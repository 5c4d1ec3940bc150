"""The package's layers, checked on its source: what may import what.

* The config schema (``hybridpar.config.schema``) imports no JAX or Flax, validation
  included: its registries of names are plain data, checked here against the code they name.
* The layers are the folders (``LAYERS``, lowest first: config, parallel, models, input,
  program, runtime, tools): a module imports only its own layer and those below, read from
  the source with ``ast``, so imports inside functions count too. Nothing outside tools/
  imports a tool, and the partitioning API imports neither the schema nor ml_collections.
* No module imports itself through others (no import cycle, function-level imports
  included), and only the train command and tune import the trainer.
"""

import ast
import functools
import subprocess
import sys
import tomllib
from pathlib import Path

from hybridpar.config import schema

NO_JAX = """
import sys
from hybridpar.config import schema as config
c = config.base_config()
config.validate(c)
c.model.name, c.data.image_size, c.num_epochs = "airbench", 32, 2.0
c.stages, c.partitioning.rules = "1:16-64,2:32-64", ((r"head/kernel$", (None, "model")),)
config.validate(c)
print(sorted({m.split(".")[0] for m in sys.modules} & {"jax", "flax", "optax", "tensorflow"}))
"""


def test_the_config_schema_imports_no_jax_or_flax():
    out = subprocess.run([sys.executable, "-c", NO_JAX], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_schema_registries_name_what_the_code_has():
    from hybridpar.models import MODELS
    from hybridpar.parallel import partitioning
    from hybridpar.parallel.mesh import make_mesh
    from hybridpar.parallel.sharded_head import ShardedHead
    from hybridpar.program.heads import make_head
    from hybridpar.program.steps import DENSE

    assert schema.MODEL_NAMES == tuple(sorted(MODELS))
    sizes = {k: getattr(v, "keywords", {}).get("stage_sizes") for k, v in MODELS.items()}
    assert schema.RESNET_STAGE_SIZES == {k: tuple(v) for k, v in sizes.items() if v}
    assert sorted(schema.PARTITIONING_PRESETS) == sorted(partitioning.PRESETS)
    c, mesh = schema.base_config(), make_mesh("data:2,model:4")
    c.global_batch = c.eval_batch = 64
    made = []
    for name in schema.HEADS:
        c.model.head = name
        made.append(make_head(c, mesh))
    assert made[0] is DENSE and all(isinstance(h, ShardedHead) for h in made[1:])


ROOT = Path(__file__).resolve().parents[1]
# where each package's source is: pyproject.toml's own mapping, the longest prefix first
_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
PACKAGE_DIRS = {k: ROOT / v for k, v in sorted(_DIRS.items(), key=lambda kv: -len(kv[0]))}
# The layers, lowest first, as the folders name them: a module imports its own layer and
# those below it, never one above (function-level imports included). The scaling model
# (hybridpar.simulate) is a tool's library; the package's face (hybridpar/__init__.py) and
# the command entry points (hybridpar/NAME.py for python -m hybridpar.NAME) sit on top.
LAYERS = ("config", "parallel", "models", "input", "program", "runtime", "tools", "top")


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    if parts[1] == "simulate":
        return "tools"
    return parts[1] if parts[1] in LAYERS else "top"


def _file(module: str) -> Path | None:
    """The source file of a ``hybridpar`` module, or None for another package's."""
    for package, folder in PACKAGE_DIRS.items():  # the longest prefix first
        if module == package or module.startswith(package + "."):
            base = folder.joinpath(*module[len(package) :].split(".")[1:])
            for f in (base.with_suffix(".py"), base / "__init__.py"):
                if f.exists():
                    return f
            return None
    return None


@functools.cache  # the cycle check asks for each module's imports many times
def _imports(module: str) -> frozenset[str]:
    """The hybridpar modules ``module``'s source imports, anywhere in the file."""
    path = _file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = {f"{base}.{a.name}" for a in node.names}  # "from hybridpar import simulate"
            out |= names
            if any(_file(n) is None for n in names):  # a name of the module itself
                out.add(base)
    return frozenset(m for m in out if _file(m) is not None)


def _reach(start: str) -> dict[str, str]:
    """Every hybridpar module ``start`` imports, directly or not: ``{module: importer}``."""
    seen, todo = {start: ""}, [start]
    while todo:
        m = todo.pop()
        for dep in _imports(m) - set(seen):
            seen[dep] = m
            todo.append(dep)
    return seen


def test_each_layer_imports_only_itself_and_the_layers_below():
    assert "hybridpar.program.state" in _reach("hybridpar.program.sync")  # imports are seen
    assert layer("hybridpar.tools.plan") == "tools" and layer("hybridpar.models.resnet") == "models"
    bad = []
    for m in _modules():
        for d in sorted(_imports(m)):
            if LAYERS.index(layer(d)) > LAYERS.index(layer(m)):
                bad.append(f"{m} ({layer(m)}) imports {d} ({layer(d)})")
    assert not bad, bad


def _is_tool(module: str) -> bool:
    return module == "hybridpar.tools" or module.startswith("hybridpar.tools.")


def test_nothing_outside_tools_imports_a_tool():
    """A tool is a command: only other tools and the command entry points (hybridpar/NAME.py,
    for python -m hybridpar.NAME) import one. The scaling model (hybridpar.simulate) sits in
    the tools layer but is a library below them: it imports no tool either."""
    assert "hybridpar.tools.plan" in _imports("hybridpar.plan")  # an entry point's is seen
    bad = [
        f"{m} imports {d}"
        for m in _modules()
        if not _is_tool(m) and not (layer(m) == "top" and m.count(".") == 1)
        for d in sorted(_imports(m))
        if _is_tool(d)
    ]
    assert not bad, bad


API = """
import sys
import hybridpar
hybridpar.make_mesh, hybridpar.infer_shardings, hybridpar.shard_batch, hybridpar.Rules
hybridpar.ShardedHead, hybridpar.preset_rules
print(sorted({m.split(".")[0] for m in sys.modules} & {"ml_collections", "tensorflow"}),
      "hybridpar.config.schema" in sys.modules)
"""


def test_the_partitioning_api_imports_no_config_schema():
    """What users import into their own code pulls in neither the config schema nor
    ml_collections (nor TensorFlow): read from the source, and seen in a fresh process."""
    for m in ("hybridpar.parallel.partitioning", "hybridpar.parallel.mesh",
              "hybridpar.parallel.sharded_head"):  # fmt: skip
        reached = _reach(m)
        assert "hybridpar.config.schema" not in reached, (m, reached)
    out = subprocess.run([sys.executable, "-c", API], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] False"


def test_only_the_train_command_and_tune_import_the_trainer():
    # every other tool builds its run with hybridpar.runtime.run; the loop is the train CLI's
    files = sorted((ROOT / "hybridpar").rglob("*.py"))
    modules = [
        "hybridpar." + ".".join(f.relative_to(ROOT / "hybridpar").with_suffix("").parts)
        for f in files
    ]
    importers = [
        m.removesuffix(".__init__")
        for m in modules
        if "hybridpar.runtime.trainer" in _imports(m.removesuffix(".__init__"))
    ]
    assert sorted(importers) == ["hybridpar.tools.train", "hybridpar.tools.tune"], importers


def _modules(packages=None) -> list[str]:
    """Every module of ``packages`` (default: every package pyproject.toml maps: hybridpar,
    its models and input)."""
    names = set()
    for package, folder in PACKAGE_DIRS.items():
        if packages is not None and package not in packages:
            continue
        for f in folder.rglob("*.py"):
            names.add(".".join([package, *f.relative_to(folder).with_suffix("").parts]))
    return sorted(m.removesuffix(".__init__") for m in names if _file(m.removesuffix(".__init__")))


def test_no_module_imports_itself_through_others():
    """No import cycle between hybridpar's modules (inside functions too): each layer only
    looks down. A package's face (``hybridpar.models`` and its ``__init__``) is left out,
    as a name that only hands its modules on."""

    def deps(m: str) -> set[str]:
        return {d for d in _imports(m) if d != m and d not in ("hybridpar", m.rpartition(".")[0])}

    cycles = []
    for m in _modules(["hybridpar"]):
        for d in deps(m):
            if m in _reach_through(d, deps):
                cycles.append(f"{m} -> {d} -> ... -> {m}")
    assert not cycles, cycles


def _reach_through(start: str, deps) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for d in deps(todo.pop()) - seen:
            seen.add(d)
            todo.append(d)
    return seen
