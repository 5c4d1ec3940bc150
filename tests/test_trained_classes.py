"""The tools that read a trained run refuse data whose classes changed since it trained.

A user trained on own images (SPLIT/CLASS folders; labels are the sorted class names), then
renamed folder ``cat`` to ``Cat``: the labels moved, and evaluate reported a wrong top-1
(exit 0, written into the run's records), quantize replaced a good ``quantized/`` with it,
and compress distilled on the new labels against a teacher of the old ones. Only the
trainer's resume compared the classes. Now the evaluator, quantize and a distillation
teacher's run compare the data's classes with the run's last ``data`` record: one
``error:`` line naming the labels that moved, exit 2, nothing written. A class folder added
is said as that, not as a data.num_classes to set (which only led to a config mismatch).

One tiny images run (3 classes of a few JPEGs, on-device data, 2 steps) is trained once for
the module; each test renames or adds a class folder and puts it back after.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import main_here, tiny_digits
from PIL import Image

from hybridpar.config.errors import WorkdirError
from hybridpar.runtime import trainer
from hybridpar.runtime.run import setup
from hybridpar.tools import compress, evaluate, quantize

CLASSES = ("bee", "cat", "dog")


def image_set(root: Path, classes=CLASSES, n=4) -> Path:
    """train/CLASS and val/CLASS, ``n`` small JPEGs each."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (16, 16, 3), np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.jpg")
    return root


def images_run_config(root: Path):
    c = tiny_digits(
        "data:8",
        **{"data.name": "images", "data.source": str(root / "src"),
           "data.prepared_dir": str(root / "prep"), "data.eval_split": "val",
           "data.num_classes": len(CLASSES), "data.channels": 3, "data.on_device": True,
           "global_batch": 8, "eval_batch": 8, "num_epochs": 1.0, "target_top1": -1.0,
           "target_top5": -1.0},
    )  # fmt: skip
    c.data.mean, c.data.std = (127.5,) * 3, (64.0,) * 3
    return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(root, workdir)``: the run trained on ``root/src`` (labels 0 bee, 1 cat, 2 dog)."""
    root = tmp_path_factory.mktemp("classes")
    image_set(root / "src")
    workdir = root / "run"
    assert trainer.train(setup(images_run_config(root), str(workdir)))["completed"]
    return root, workdir


# (what is done to the class folders, the labels the error names)
CHANGES = {
    "renamed": (
        lambda src: [(src / s / "cat").rename(src / s / "Cat") for s in ("train", "val")],
        "label 0: 'bee' -> 'Cat'; label 1: 'cat' -> 'bee'",
    ),
    "added": (
        lambda src: image_set(src, ("Ant",), 2),
        "3 -> 4 classes; label 0: 'bee' -> 'Ant'; label 1: 'cat' -> 'bee'; label 2: 'dog' -> 'cat'",
    ),
}


@pytest.fixture(params=sorted(CHANGES))
def changed(request, trained):
    """The trained run's source with a class folder renamed or added, put back after:
    ``(root, workdir, the labels the error names)``."""
    root, workdir = trained
    src = root / "src"
    keep = root / "src.kept"
    shutil.copytree(src, keep)
    change, moved = CHANGES[request.param]
    change(src)
    try:
        yield root, workdir, moved
    finally:
        shutil.rmtree(src)
        keep.rename(src)


def refusal(workdir: Path, moved: str) -> str:
    return (
        f"error: the classes changed since run {str(workdir)!r} trained ({moved}): its "
        "checkpoint learned the old labels; restore the class folders as they were, or train "
        "the new classes in a new --workdir"
    )


def written(workdir: Path) -> dict:
    """What the run's folder holds, file by file (its records' bytes)."""
    return {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tool, args", [(evaluate, []), (quantize, []),
                                        (compress, ["--budget-kb", "1000"])],
                         ids=["evaluate", "quantize", "compress"])  # fmt: skip
def test_a_tool_that_reads_the_run_refuses_data_of_other_classes(tool, args, changed, capsys):
    """evaluate, quantize and compress on the run's data with a class folder renamed (cat
    -> Cat: label 0 is now 'Cat') or added (Ant: every label moves, and the count): one
    error line naming the labels that moved, exit 2, nothing written in the run (no
    evaluator/, quantized/ or compress/ folder). Planted bugs that fail it: no check at
    set-up (evaluate printed the new order and a wrong top-1, exit 0); the count refusal
    first (an added folder said 'set --config.data.num_classes=4'); compress's loop folder
    kept after the refusal (its settings.json and round 0's log)."""
    root, workdir, moved = changed
    before = written(workdir)
    code, out, err = main_here(tool.main, ["--workdir", str(workdir), *args], capsys)
    assert code == 2, (out, err)
    # (stderr also has the data's decoding progress)
    assert [x for x in err.splitlines() if x.startswith("error")] == [refusal(workdir, moved)]
    assert err.rstrip().endswith(refusal(workdir, moved)) and "Traceback" not in err, err
    assert written(workdir) == before
    assert not any((workdir / d).exists() for d in ("evaluator", "quantized", "compress"))


def test_a_distillation_teacher_of_other_classes_is_refused_at_set_up(changed, tmp_path):
    """A run distilled from the trained run (compress's rounds are such runs) on data whose
    classes moved: the teacher's logits are in its old labels, and compress distilled a
    round on the new ones (top1_drop=-10.63, exit 0). Refused at set-up, the student's
    workdir not made. Planted bug that fails it: the teacher's run not checked."""
    root, teacher, moved = changed
    c = images_run_config(root)
    c.distill.teacher_workdir = str(teacher)
    with pytest.raises(WorkdirError) as e:
        setup(c, str(tmp_path / "student"))
    assert f"error: {e.value}" == refusal(teacher, moved)
    assert not (tmp_path / "student").exists()


def test_the_classes_the_run_trained_on_pass(trained, tmp_path):
    """The same classes: a student of the run sets up (the check compares names, not the
    data's folder or its files)."""
    root, teacher = trained
    c = images_run_config(root)
    c.distill.teacher_workdir = str(teacher)
    run = setup(c, str(tmp_path / "student"))
    assert run.data.info["classes"] == list(CLASSES)
    run.lock.release()


def test_a_resume_on_data_with_a_class_added_names_the_labels_that_moved(changed, tmp_path):
    """The trainer's own resume (the run resumed with more epochs) on data whose classes
    moved: an added folder was said as 'the data has 4 classes but data.num_classes=3; set
    --config.data.num_classes=4', which only led to a config mismatch with the checkpoint.
    Now both changes name the labels that moved, as a change since the run's last start;
    nothing written in the run. Planted bug that fails it: the resume not checked where the
    count differs (the old line)."""
    root, trained_workdir, moved = changed
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    before = written(workdir)
    c = images_run_config(root)
    c.num_epochs = 2.0
    run = None
    with pytest.raises(WorkdirError) as e:
        run = setup(c, str(workdir), allow_config_change=True)
        trainer.train(run)  # a renamed folder (same count) is the trainer's check
    if run is not None:
        run.lock.release()
    assert str(e.value).startswith(f"the classes changed since the run's last start ({moved})")
    assert f"in {workdir / 'checkpoints'} learned the old labels" in str(e.value)
    assert written(workdir) == before
