"""The one reader of a trained run (``runtime.trained.TrainedRun``) as the distillation
teacher, prune and ``init_from`` use it, and the teacher's own checks.

The run here is written, not trained: ``prune.write_run`` of weights drawn from another seed
than the config's, so a reader that built a fresh model instead of reading the checkpoint
would be seen."""

import json

import jax
import numpy as np
import pytest
from flax.core import meta
from helpers import tiny_digits

from hybridpar.config.errors import ConfigError
from hybridpar.parallel.mesh import make_mesh
from hybridpar.program import program
from hybridpar.program.state import init_sharded
from hybridpar.runtime import distill, run, trained
from hybridpar.tools import prune

CHECKPOINT_LR, EDITED_LR = 0.1, 0.7


def _mesh():
    return make_mesh("data:1", devices=jax.devices()[:1])


def _host(variables):
    return jax.device_get(meta.unbox(variables))


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same_tree = jax.tree.structure(a) == jax.tree.structure(b)
    return same_tree and all(np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``(workdir, {"params", "batch_stats"})``: a run at step 0 whose config.json was edited
    by hand afterwards (the checkpoint's config is the run's)."""
    w = tmp_path_factory.mktemp("distill") / "run"
    c = tiny_digits(mesh="data:1", **{"optim.base_lr": CHECKPOINT_LR})
    mesh = _mesh()
    prog = program.build_program(c, mesh)
    state = init_sharded(prog.init, prog.shardings, jax.random.key(c.seed + 7))
    params = _host(state.params)
    stats = jax.tree.map(lambda x: x + 0.25, _host(state.batch_stats))  # not init's 0 and 1
    prune.write_run(c, params, stats, str(w), mesh)
    saved = json.loads((w / "config.json").read_text())
    saved["optim"]["base_lr"] = EDITED_LR
    (w / "config.json").write_text(json.dumps(saved))
    return w, {"params": params, "batch_stats": stats}


def _student(teacher_dir, **overrides):
    c = tiny_digits(mesh="data:1", **overrides)
    c.distill.teacher_workdir = str(teacher_dir)
    return c


def test_the_teacher_prune_and_init_from_read_the_same_run(written, tmp_path):
    w, want = written
    mesh = _mesh()
    run = trained.TrainedRun(str(w), mesh)
    assert run.config.optim.base_lr == CHECKPOINT_LR  # the checkpoint's config, not the json
    assert run.step is None  # nothing read before it is asked for
    assert _same(run.host_variables(), (want["params"], want["batch_stats"]))
    assert run.step == 0  # the checkpoint's (write_run's)

    teacher = distill.Teacher(_student(w, **{"partitioning.preset": "fsdp"}), mesh)
    assert teacher.config.optim.base_lr == CHECKPOINT_LR
    assert _same(_host(teacher.variables()), want)
    assert teacher.variables() is teacher.variables()  # read once
    # placed like the student's parameters: the student's placement section
    assert teacher.config.partitioning.preset == "fsdp" != run.config.partitioning.preset

    out = tmp_path / "kept"  # prune keeping every channel: the run as prune read it
    prune.prune_run(str(w), str(out), 1.0, mesh=mesh)
    copy = trained.TrainedRun(str(out), mesh)
    assert copy.config.optim.base_lr == CHECKPOINT_LR
    assert _same(copy.host_variables(), (want["params"], want["batch_stats"]))

    student = program.build_program(_student(w), mesh)
    fresh = init_sharded(student.init, student.shardings, jax.random.key(0))
    started = trained.start_from(str(w), fresh, student)
    assert _same(_host({"params": started.params, "batch_stats": started.batch_stats}), want)


def test_init_from_is_read_in_set_up_and_other_shapes_leave_no_directory(written, tmp_path):
    """A new run's ``init_from`` is checked in set-up, before any weight is read: one of
    other widths is an error there, and the workdir it would have made is not left behind
    (the check in the trainer's start left an empty ``checkpoints/``)."""
    w, _ = written
    one = jax.devices()[:1]
    other = tiny_digits(mesh="data:1", **{"model.num_filters": 16, "init_from": str(w)})
    with pytest.raises(ConfigError, match="holds a model of other shapes"):
        run.setup(other, str(tmp_path / "wider"), devices=one)
    assert not (tmp_path / "wider").exists()
    same = tiny_digits(mesh="data:1", init_from=str(w))
    r = run.setup(same, str(tmp_path / "same"), devices=one)
    try:
        assert isinstance(r.init_from, trained.TrainedRun) and r.init_from.step is None
    finally:
        r.lock.release()


def test_a_teacher_of_other_normalisation_or_classes_is_refused(written):
    w, _ = written
    with pytest.raises(ConfigError, match="normalises its images with other data.mean"):
        distill.Teacher(_student(w, **{"data.mean": (9.0,)}), _mesh())
    with pytest.raises(ConfigError, match=f"the teacher in {w} has 10 classes, this run 12"):
        distill.Teacher(_student(w, **{"data.num_classes": 12}), _mesh())


def test_a_teacher_that_is_not_a_trained_run_is_refused(written, tmp_path):
    w, _ = written
    with pytest.raises(ConfigError, match="config.json: pass the --workdir of a training run"):
        distill.Teacher(_student(tmp_path), _mesh())
    (tmp_path / "config.json").write_text((w / "config.json").read_text())
    teacher = distill.Teacher(_student(tmp_path), _mesh())  # the checkpoint: on first use
    with pytest.raises(ConfigError, match=f"no checkpoint in {tmp_path}"):
        teacher.variables()


def test_trained_run_in_a_script_takes_a_mesh_spec_and_its_errors_name_its_arguments(
    written, tmp_path
):
    """``TrainedRun`` called from a script: a mesh spec as ``make_mesh`` takes it; its errors
    name its arguments (``partitioning=``), where the tools' name their flags (the teacher's,
    above and here). Nothing is compiled: every refusal comes before."""
    w, _ = written
    run = trained.TrainedRun(str(w), "data:-1")
    assert run.program.mesh.shape["data"] == 8
    with pytest.raises(TypeError, match="a jax.sharding.Mesh or a mesh spec such as 'data:-1'"):
        trained.TrainedRun(str(w), 8)
    with pytest.raises(ConfigError, match="config.json: give TrainedRun the workdir of a training"):
        trained.TrainedRun(str(tmp_path), "data:-1")
    # the digits head's 10 classes on model:4: the mesh, or partitioning=
    with pytest.raises(ConfigError, match=r"mesh axis 'model' .*\(TrainedRun: pass a mesh on which "
                       r"it divides, or partitioning=, .*with preset='data'\)"):  # fmt: skip
        trained.TrainedRun(str(w), "data:2,model:4")
    placement = trained.load_config(str(w)).partitioning
    placement.preset = "data"
    trained.TrainedRun(str(w), "data:2,model:4", partitioning=placement)
    with pytest.raises(ConfigError, match="mesh axis 'model'") as e:
        distill.Teacher(_student(w), make_mesh("data:2,model:4"))
    assert "TrainedRun" not in str(e.value)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((3, 8, 8, 1), r"got \(3, 8, 8, 1\); resize them to 16x16 first"),  # 4.7% top-1
        ((3, 32, 32, 1), r"got \(3, 32, 32, 1\); resize them to 16x16 first"),
        ((3, 16, 16), r"got \(3, 16, 16\)$"),
    ],
)
def test_trained_run_logits_refuse_images_of_another_size(written, shape, match):
    """Refused before anything is compiled or read: a convolutional model takes any size,
    and gave logits of no use (at 8 px, 4.7% top-1 for 74% at the run's 16 px)."""
    w, _ = written
    run = trained.TrainedRun(str(w), _mesh())
    with pytest.raises(ConfigError, match=r"logits takes images \(N, 16, 16, 1\) \(the run's data"
                       rf".image_size and channels\), {match}"):  # fmt: skip
        run.logits(np.zeros(shape, np.uint8))
    assert run.step is None
