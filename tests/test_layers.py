"""The package's layers, checked on its source: what may import what.

* The config schema (``hybridpar.config``) imports no JAX or Flax, validation included: its
  registries of names are plain data, checked here against the code they name.
* The parallel layer (mesh, partitioning, the sharded head, collectives, joining
  processes) imports nothing of the program layer (steps, train state, program, precision,
  gradient syncs, heads, run, trainer), directly or through another module: read from the
  source with ``ast``, so imports inside functions count too.
* No module imports itself through others (no import cycle, function-level imports
  included), and only the train command and tune import the trainer.
"""

import ast
import subprocess
import sys
from pathlib import Path

from hybridpar import config as schema

NO_JAX = """
import sys
from hybridpar import config
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
    from hybridpar import partitioning
    from hybridpar.heads import make_head
    from hybridpar.mesh import make_mesh
    from hybridpar.models import MODELS
    from hybridpar.sharded_head import ShardedHead
    from hybridpar.steps import DENSE

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
PACKAGE_DIRS = {"hybridpar.models": ROOT / "models", "hybridpar.input": ROOT / "input",
                "hybridpar": ROOT / "hybridpar"}  # pyproject.toml's package-dir  # fmt: skip
PARALLEL = ["mesh", "partitioning", "sharded_head", "comm", "distributed", "bucketed"]
PROGRAM = ["steps", "state", "program", "precision", "sync", "heads", "run", "trainer"]


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


def _imports(module: str) -> set[str]:
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
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # "from hybridpar import steps"
    return {m for m in out if _file(m) is not None}


def _reach(start: str) -> dict[str, str]:
    """Every hybridpar module ``start`` imports, directly or not: ``{module: importer}``."""
    seen, todo = {start: ""}, [start]
    while todo:
        m = todo.pop()
        for dep in _imports(m) - set(seen):
            seen[dep] = m
            todo.append(dep)
    return seen


def test_the_parallel_layer_imports_nothing_of_the_program_layer():
    assert "hybridpar.state" in _reach("hybridpar.sync")  # the reader finds imports at all
    bad = []
    for name in PARALLEL:
        reached = _reach(f"hybridpar.{name}")
        for upper in PROGRAM:
            m, chain = f"hybridpar.{upper}", []
            while m in reached and m:
                chain.append(m)
                m = reached[m]
            if chain:
                bad.append(" <- ".join(chain))
    assert not bad, bad


def test_only_the_train_command_and_tune_import_the_trainer():
    # every other tool builds its run with hybridpar.run; the loop is the train CLI's
    files = sorted((ROOT / "hybridpar").rglob("*.py"))
    modules = [
        "hybridpar." + ".".join(f.relative_to(ROOT / "hybridpar").with_suffix("").parts)
        for f in files
    ]
    importers = [
        m.removesuffix(".__init__")
        for m in modules
        if "hybridpar.trainer" in _imports(m.removesuffix(".__init__"))
    ]
    assert sorted(importers) == ["hybridpar.train", "hybridpar.tune"], importers


def _modules() -> list[str]:
    files = sorted((ROOT / "hybridpar").rglob("*.py"))
    names = ["hybridpar." + ".".join(f.relative_to(ROOT / "hybridpar").with_suffix("").parts)
             for f in files]  # fmt: skip
    return [m.removesuffix(".__init__") for m in names]


def test_no_module_imports_itself_through_others():
    """No import cycle between hybridpar's modules (inside functions too): each layer only
    looks down. A package's face (``hybridpar.models`` and its ``__init__``) is left out,
    as a name that only hands its modules on."""

    def deps(m: str) -> set[str]:
        return {d for d in _imports(m) if d != m and d not in ("hybridpar", m.rpartition(".")[0])}

    cycles = []
    for m in _modules():
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
