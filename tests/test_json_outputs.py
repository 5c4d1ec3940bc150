"""Every tool's ``--json`` prints one JSON object on stdout and nothing else, also where the
run's set-up warns (a warmup as long as a shortened run: the trainer's warning, printed on
stdout as its log is): the warning goes to stderr instead. One subprocess per tool, on the
tiny digits model."""

import json

import pytest
from helpers import DIGITS, config_args, run_compile_tool

# 8 filters, 16 px, batch 32: a quick compile. One epoch with digits' warmup of one epoch:
# the set-up warns.
TINY = {
    "model.num_filters": 8,
    "data.image_size": 16,
    "global_batch": 32,
    "num_epochs": 1,
}
WARNING = "warning: optim.warmup_epochs=1 is not shorter than the run"

TOOLS = {
    "hybridpar.comm_report": ["--devices", "8"],
    "hybridpar.compile": ["--target", "cpu:8"],
    "hybridpar.plan": [
        "--devices", "8", "--meshes", "data:8", "--heads", "dense", "--bn-sync", "local",
        "--comm", "xla", "--jobs", "1", "--no-cache",
    ],  # fmt: skip
}


@pytest.mark.parametrize("module", list(TOOLS))
def test_json_stdout_is_one_object_and_the_warning_is_on_stderr(module):
    r = run_compile_tool(module, ["--config", DIGITS, *config_args(TINY), *TOOLS[module],
                                  "--json"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert isinstance(json.loads(r.stdout), dict), r.stdout[:500]
    assert WARNING in r.stderr
