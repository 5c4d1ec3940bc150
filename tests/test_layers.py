"""The package's layers, checked on its source: what may import what.

* The config schema (``hybridpar.config``) imports no JAX or Flax, validation included: its
  registries of names are plain data, checked here against the code they name.
"""

import subprocess
import sys

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
    assert sorted(schema.PARTITIONING_PRESETS) == sorted(partitioning.PRESETS)
    c, mesh = schema.base_config(), make_mesh("data:2,model:4")
    c.global_batch = c.eval_batch = 64
    made = []
    for name in schema.HEADS:
        c.model.head = name
        made.append(make_head(c, mesh))
    assert made[0] is DENSE and all(isinstance(h, ShardedHead) for h in made[1:])
