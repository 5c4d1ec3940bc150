"""The run plan: the config read once at set-up into the figures everything after it reads.

* From set-up on (past the config's validation), the stage string is parsed once: set-up,
  the on-device data, the program, its schedules and the loop across a stage switch all
  read the plan.
* The plan's figures (data-parallel size, mesh axes, each stage's batches, steps per epoch
  and steps) are those the config, mesh and data give, on data:4,model:2 and on data:8.
* A stage that would train no step, and a crop scale on data that is never cropped, are
  refused up front, in one error line.
"""

from __future__ import annotations

import re

import pytest
from helpers import DIGITS, tiny_digits

from hybridpar.config import curriculum
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import byte_size
from hybridpar.config.schema import validate
from hybridpar.runtime import run as run_module
from hybridpar.runtime import trainer
from hybridpar.runtime.run import setup

TWO_STAGES = {"stages": "0.2:16-8,0.5:24-4", "num_epochs": 0.5}


def test_from_set_up_on_the_stage_string_is_parsed_once(tmp_path, monkeypatch):
    parsed, validating = [], [False]
    real_parse, real_validate = curriculum.read_stages, run_module.validate

    def read_stages(text):
        if not validating[0]:
            parsed.append(text)
        return real_parse(text)

    def validate(*args, **kwargs):  # before set-up: may parse the string for its checks
        validating[0] = True
        try:
            return real_validate(*args, **kwargs)
        finally:
            validating[0] = False

    monkeypatch.setattr(curriculum, "read_stages", read_stages)
    monkeypatch.setattr(run_module, "validate", validate)
    # on-device data (it stores every stage's size), the later stage compiled ahead
    short = {"stages": "0.1:16-8,0.15:24-4", "num_epochs": 0.15}  # 4 steps, then 4
    config = tiny_digits(**short, **{"data.on_device": True, "compile_ahead": "before"})
    run = setup(config, str(tmp_path))
    assert parsed == [config.stages]
    summary = trainer.train(run)
    assert summary["completed"] and summary["steps"] == run.plan.total_steps
    assert [(s["global_batch"], s["steps"]) for s in summary["stages"]] == [(32, 4), (16, 4)]
    assert parsed == [config.stages]  # and nothing after set-up parsed it again


# (mesh, data-parallel size, per stage: global batch, steps per epoch, steps).
# Steps per epoch: digits' 1,437 training examples // global batch; steps: the stage's
# epochs x that, rounded.
MESHES = [
    ("data:4,model:2", 4, [(32, 44, 9), (16, 89, 27)]),  # 0.2 x 44 = 8.8; 0.3 x 89 = 26.7
    ("data:8", 8, [(64, 22, 4), (32, 44, 13)]),  # 0.2 x 22 = 4.4; 0.3 x 44 = 13.2
]


@pytest.mark.parametrize("mesh, dp, want", MESHES, ids=[m[0] for m in MESHES])
def test_the_plan_holds_the_figures_the_config_mesh_and_data_give(mesh, dp, want):
    from hybridpar.parallel.mesh import data_parallel_size

    config = tiny_digits(mesh=mesh, **TWO_STAGES)
    run = setup(config, None)
    plan = run.plan
    assert run.program.plan is plan  # the program reads the run's plan, not its own
    assert plan.data_parallel == dp == data_parallel_size(run.mesh)
    got = [(s.stage.global_batch, s.steps_per_epoch, s.num_steps) for s in plan.stages]
    assert got == want
    assert [(s.stage.image_size, s.stage.per_device_batch) for s in plan.stages] == [
        (16, 8), (24, 4)]  # fmt: skip
    # the same as the stages and steps derived from the config, mesh and data on their own
    old = curriculum.plan_stages(
        curriculum.stages_from_config(config, data_parallel_size(run.mesh)), run.data.steps_for
    )
    assert plan.stages == old.stages
    assert f"x{dp} here" in curriculum.describe(plan)


@pytest.mark.parametrize(
    "text,epochs,want",
    [
        ("3:24-512@0.5,8:32-512", 16.0, "6:24-512@0.5,16:32-512"),
        ("20:128-224@0.08~0.98, 38:224-224,40:288-128@0.5", 20.0,
         "10:128-224@0.08~0.98,19:224-224,20:288-128@0.5"),
        ("8:32-512", 1 / 3, None),  # one stage: it ends at the run's end, to the digit
    ],
    ids=["double", "halve", "one-stage"],
)  # fmt: skip
def test_stretched_stages_keep_the_curriculum_and_end_at_the_epochs(text, epochs, want):
    """``stretch_stages``: every end epoch scaled so the last is ``epochs`` (what a run of
    another length needs: the config requires the last stage to end at num_epochs), each
    stage's size, batch, scale and momentum as they were."""
    out = curriculum.stretch_stages(text, epochs)
    if want is not None:
        assert out == want
    old, new = curriculum.read_stages(text), curriculum.read_stages(out)
    assert new[-1][0] == pytest.approx(epochs, rel=1e-11)
    assert [s[1:] for s in new] == [s[1:] for s in old]
    assert [n[0] / o[0] for n, o in zip(new, old)] == pytest.approx(
        [epochs / old[-1][0]] * len(old)
    )


def two_stage_plan(batches=(64, 32), ends=(2.0, 3.0)):
    """Digits' 1,408 full-batch examples an epoch: 22 steps at 64, 44 at 32."""
    stages = [curriculum.Stage(end, 16, b, 0.08) for end, b in zip(ends, batches)]
    return curriculum.plan_stages(stages, lambda b: 1408 // b)


def test_samples_before_counts_each_stage_batch_for_its_steps():
    plan = two_stage_plan()
    assert [s.num_steps for s in plan.stages] == [44, 44]
    assert plan.samples_before(0) == 0
    assert plan.samples_before(44) == 44 * 64
    assert plan.samples_before(50) == 44 * 64 + 6 * 32
    assert plan.samples_before(10**6) == 44 * 64 + 44 * 32


def test_a_resume_must_not_replan_the_steps_a_checkpoint_trained(tmp_path):
    """A checkpoint at step 44 that trained 2 epochs at batch 64: a config whose plan puts
    another number of examples before step 44 (batch 32 from the start) would train epochs
    again, and one that ends before step 44 has nothing to train: both refused. A batch
    changed from the checkpoint's epoch on (a later stage), a longer run, and data that
    changed size (its own warning) go on."""
    from hybridpar.config.errors import WorkdirError
    from hybridpar.runtime.run import LoopState

    loop = LoopState(step=44, epoch=2, samples_seen=44 * 64)
    where = str(tmp_path)
    trainer.check_resumed_plan(two_stage_plan(), loop, 44, None, where)
    trainer.check_resumed_plan(two_stage_plan((64, 64), (2.0, 5.0)), loop, 44, None, where)
    with pytest.raises(WorkdirError, match=r"trained 2,816 examples .*puts 1,408 \(epoch 1\)"):
        trainer.check_resumed_plan(two_stage_plan((32, 32)), loop, 44, None, where)
    with pytest.raises(WorkdirError, match="past this config's last step, 22 "):
        trainer.check_resumed_plan(two_stage_plan((64, 64), (0.5, 1.0)), loop, 44, None, where)
    trainer.check_resumed_plan(two_stage_plan((32, 32)), loop, 44, [1437, 2875], where)


def test_a_resume_that_moves_the_learning_rate_says_from_what_to_what():
    """``lr_change``: a finished 3-epoch cosine run resumed with num_epochs=5 restarts at a
    higher LR (the decay had reached 0): both values; the same schedule: None."""
    import types

    from hybridpar.config.schema import base_config
    from hybridpar.program import optim
    from hybridpar.runtime.run import LoopState
    from hybridpar.runtime.run_config import config_dict

    def config(epochs):
        c = base_config()
        c.num_epochs, c.global_batch, c.optim.warmup_epochs = epochs, 64, 0.0
        return c

    def run_of(c):
        plan = curriculum.plan_stages(curriculum.stages_from_config(c, 8), lambda b: 1408 // b,
                                      data_parallel=8)  # fmt: skip
        return types.SimpleNamespace(
            plan=plan,
            data=types.SimpleNamespace(steps_for=lambda b: 1408 // b),
            program=types.SimpleNamespace(schedule=optim.make_schedule(c.optim, plan)),
        )

    held, loop = config_dict(config(3.0)), LoopState(step=66, epoch=3, samples_seen=66 * 64)
    before, now = trainer.lr_change(run_of(config(5.0)), held, loop, 66)
    assert before == pytest.approx(0.0, abs=1e-9)  # the 3-epoch cosine's end
    assert now == pytest.approx(float(run_of(config(5.0)).program.schedule(66))) and now > 1e-3
    assert trainer.lr_change(run_of(config(3.0)), held, loop, 66) is None
    # the warning names the keys that moved it, not every changed one
    warning = trainer.lr_change_warning((0.0, 0.05), 66, ["mesh", "num_epochs", "eval_batch"])
    assert "(mesh, num_epochs changed its schedule)" in warning
    assert "(seed changed its schedule)" in trainer.lr_change_warning((0.0, 0.05), 66, ["seed"])
    # without stages the mesh changes no batch, so no LR: not blamed (planted: blamed)
    warning = trainer.lr_change_warning((0.0, 0.05), 66, ["mesh", "num_epochs"], stages=False)
    assert "(num_epochs changed its schedule)" in warning


def _stage(end, batch):
    return curriculum.Stage(end, 16, batch, 1.0)


@pytest.mark.parametrize(
    "ends, batch, examples, where",
    [
        ((1.0, 1.001, 3.0), 16, 1437, "stage 1 (epochs 1-1.001, 89 steps an epoch at global "
         "batch 16)"),
        ((0.5, 0.505, 0.7), 64, 1437, "stage 1 (epochs 0.5-0.505, 22 steps an epoch at "
         "global batch 64)"),
        ((40.0, 40.00005), 256, 1_281_167, "stage 1 (epochs 40-40.00005, 5004 steps an epoch"),
    ],
    ids=["digits-probe", "half-step-short", "imagenet-last"],
)  # fmt: skip
def test_a_later_stage_that_rounds_to_no_step_is_refused_with_the_end_that_gives_it_one(
    ends, batch, examples, where
):
    """A stage whose epochs round to 0 steps would compile its step for nothing, never
    train at its size and shift every epoch after it (the probe: a last stage-0 step at
    epoch 1.001, a 3-epoch run summed as 3.001): refused, naming the stage, its epochs, its
    steps per epoch and the first end epoch that gives it a step, which then does."""

    def steps(global_batch):  # the data's full steps an epoch
        return examples // global_batch

    planned = curriculum.plan_stages([_stage(end, batch) for end in ends], steps)
    with pytest.raises(ConfigError) as e:
        curriculum.check_every_stage_trains(planned)
    msg = str(e.value)
    assert msg.startswith(where) and "rounds to 0 steps" in msg and "or drop it" in msg, msg
    end = float(re.search(r"end it at epoch ([0-9.]+) or later", msg)[1])
    fixed = [ends[0], end, *ends[2:]]
    plan = curriculum.plan_stages([_stage(x, batch) for x in fixed], steps)
    curriculum.check_every_stage_trains(plan)
    assert plan.stages[1].num_steps == 1
    # the first stage still takes at least one step: a very short run trains
    assert curriculum.plan_stages([_stage(1e-6, batch)], steps).stages[0].num_steps == 1


@pytest.mark.parametrize(
    "overrides, expect",
    [
        ({"stages": "0.1:16-8@0.5,0.2:24-4"}, "stage 0 ('0.1:16-8@0.5') has a minimum crop "
         "scale of 0.5, but data.name='digits' is never cropped"),
        ({"stages": "0.1:16-8,0.2:24-4@0.35~0.9"}, "stage 1 ('0.2:24-4@0.35~0.9') has a "
         "minimum crop scale of 0.35"),
        ({"data.min_scale": 0.5}, "data.min_scale=0.5: data.name='digits' is never cropped"),
    ],
    ids=["stage", "later-stage", "data.min_scale"],
)  # fmt: skip
def test_a_crop_scale_on_digits_which_are_never_cropped_is_refused(overrides, expect):
    """Digits are only resized, never cropped: a crop scale there would be in the plan line
    and the stage records and do nothing. Refused like data.translate where it cannot
    apply; a scale of 1 (the whole image), the inherited default and synthetic data (the
    stand-in of a recipe's real data: the ImageNet recipes plan on it) pass."""
    epochs = {"num_epochs": 0.2} if "stages" in overrides else {}
    with pytest.raises(ConfigError, match=re.escape(expect)):
        validate(tiny_digits(**overrides, **epochs))
    validate(tiny_digits(stages="0.1:16-8@1,0.2:24-4", num_epochs=0.2))
    validate(tiny_digits(**{"data.min_scale": 1.0}))
    validate(tiny_digits())  # data.min_scale's default, which every config inherits
    validate(tiny_digits(**{"data.name": "synthetic"}, **overrides, **epochs))


@pytest.mark.parametrize(
    "name, cropped", [("digits", False), ("synthetic", False), ("images", True), ("tfds", True)]
)
def test_the_plan_line_names_a_crop_scale_only_where_the_input_crops(name, cropped):
    """Digits and synthetic data are only resized (on the host and on the devices): the
    plan's line names no crop scale for them, where it would do nothing; image files are
    cropped, at each stage's scale. The stage keeps its scale either way (the records')."""
    for overrides in ({}, {"stages": "0.1:16-8,0.2:24-4@0.5", "num_epochs": 0.2}):
        config = tiny_digits(**overrides)
        config.data.name = name  # only the stages are made: no data is read
        stages = curriculum.stages_from_config(config, 4)
        text = curriculum.describe(curriculum.plan_stages(stages, lambda b: 1437 // b))
        lines = [line for line in text.splitlines() if line.startswith("stage ")]
        assert len(lines) == len(stages)
        assert all(("min crop scale" in line) == cropped for line in lines), text
        assert stages[0].min_scale == config.data.min_scale
    if cropped:
        assert "min crop scale 0.5" in lines[1]


def test_the_train_cli_refuses_a_stage_of_no_step_of_its_data_in_one_line(tmp_path, capfd):
    """Checked on the plan of the run's own data (1,437 digits), in set-up: one error line,
    no workdir left. (The compile tools plan on a config's nominal data.train_examples, on
    which a short stage may round to nothing that has steps on the real data: not there.)
    The train command's ``main`` in this process: a refusal needs no fresh JAX."""
    from hybridpar.tools import train

    args = ["--config.stages=1:16-32~0.8,1.001:24-16,3:32-8", "--config.num_epochs=3"]
    expect = ("error: stage 1 (epochs 1-1.001, 11 steps an epoch at global batch 128) rounds "
              "to 0 steps: end it at epoch 1.1 or later")  # fmt: skip
    workdir = tmp_path / "w"
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--config", DIGITS, "--workdir", str(workdir), *args])
    err = capfd.readouterr().err  # with what C++ writes to the file descriptor
    assert e.value.code == 2, err[-2000:]
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(expect), err
    assert not workdir.exists()


def test_a_stage_that_needs_more_memory_than_a_device_has_is_refused_before_the_first_step(
    tmp_path, monkeypatch
):
    """A stage whose compiled train step needs more memory per device than the device has
    (JAX's ``bytes_limit``; faked here at 256 MiB, XLA:CPU reports none) is one error naming
    the stage, its size and batch, both figures and the fix, when the stages are compiled
    ahead (``compile_ahead=before``): no step trained, not an out-of-memory error when the
    stage is reached. The first stage and the eval step (a few MiB) fit the limit, so the
    check is on each program's own figure. Planted bug that fails it: no check after a
    compile (the run trains)."""
    from hybridpar.program import program as program_module
    from hybridpar.runtime import run_records

    config = tiny_digits(stages="0.1:16-8,0.2:256-8", num_epochs=0.2, compile_ahead="before")
    workdir = tmp_path / "w"
    run = setup(config, str(workdir))
    assert program_module.device_memory_limit(run.mesh.devices) is None  # CPU: none, no check
    monkeypatch.setattr(program_module, "device_memory_limit", lambda devices: 2**28)
    with pytest.raises(ConfigError) as e:
        trainer.train(run)
    msg = str(e.value)
    assert re.match(r"stage 1 \(epochs 0.1-0.2, 256 px, global batch 32, 8 a device\) "
                    r"needs [\d.]+ MiB per device", msg), msg  # fmt: skip
    assert f"a device here has {byte_size(2**28)}" in msg and "--config.stages" in msg, msg
    records, _ = run_records.read_records(str(workdir / "metrics.jsonl"))
    events = [r.event for r in records]
    assert "data" in events and "train" not in events, events  # refused before the first step
