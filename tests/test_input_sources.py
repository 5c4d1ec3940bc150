"""Preparing sources a user would bring: labels across splits, changed sources, bad archives,
EXIF orientation and the counts of the run's ``data`` event; the tf.data and on-device paths
keep, skip, count and label the same files alike.

Every source here is a few tiny synthetic JPEGs; prepare runs in this process (workers=1),
and one test starts the training CLI to see a truncated tar end in an ``error:`` line.
"""

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import cpu_env
from PIL import Image

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config
from hybridpar.input import datasets, records
from hybridpar.input.pipeline import ImagePipeline
from hybridpar.input.prepare import main as prepare_main
from hybridpar.input.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
ONE = {"workers": 1, "progress": False, "examples_per_shard": 4}


def _jpeg(w=24, h=16, seed=0, exif=None):
    """A smooth picture (a random 3x3 colour grid, upsampled): JPEG keeps it nearly exact."""
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (3, 3, 3), np.uint8))
    img = grid.resize((w, h), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, **({"exif": exif} if exif else {}))
    return buf.getvalue()


def _tree(root, files):
    """``files``: {relative path: bytes, or None for an empty folder}."""
    for rel, data in files.items():
        path = Path(root) / rel
        if data is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return Path(root)


def _labels(out, split):
    """{file name: label} of a prepared split, read back through the pipeline's files."""
    import tensorflow as tf

    pipe = ImagePipeline(str(out), split, process_index=0, process_count=1)
    got = {}
    for f in pipe.files("full"):
        for r in tf.data.TFRecordDataset(f):
            ex = tf.io.parse_single_example(r, records.feature_spec())
            got[ex["name"].numpy().decode()] = int(ex["label"])
    return got


# ---- item 1: one class list, from the train split ---------------------------------------------


def test_validation_folder_missing_a_class_keeps_the_train_labels(tmp_path):
    src = _tree(
        tmp_path / "src",
        {
            "train/ant/1.jpg": _jpeg(seed=1),
            "train/bee/1.jpg": _jpeg(seed=2),
            "train/cow/1.jpg": _jpeg(seed=3),
            "val/ant/1.jpg": _jpeg(seed=4),
            "val/cow/1.jpg": _jpeg(seed=5),  # no bee: per-split numbering made cow 1 here
        },
    )
    manifest = prepare([src], tmp_path / "out", **ONE)
    assert manifest["classes"] == ["ant", "bee", "cow"]
    assert _labels(tmp_path / "out", "train") == {"ant/1.jpg": 0, "bee/1.jpg": 1, "cow/1.jpg": 2}
    assert _labels(tmp_path / "out", "val") == {"ant/1.jpg": 0, "cow/1.jpg": 2}
    val = ImagePipeline(str(tmp_path / "out"), "val", process_index=0, process_count=1)
    assert val.num_classes == 3 and val.classes == ["ant", "bee", "cow"]
    assert manifest["splits"]["val"]["classes_without_examples"] == {"bee": "no folder"}


def test_a_class_the_train_split_lacks_is_an_error_naming_it(tmp_path):
    src = _tree(
        tmp_path / "src",
        {"train/ant/1.jpg": _jpeg(), "val/ant/1.jpg": _jpeg(), "val/yak/1.jpg": _jpeg()},
    )
    with pytest.raises(ConfigError, match=r"split 'val'.*'yak'.*train split 'train' lacks"):
        prepare([src], tmp_path / "out", **ONE)
    # A given class list labels every split, including one prepared on its own later.
    prepare([src / "val"], tmp_path / "o2", split="val", classes="yak,ant", **ONE)
    assert _labels(tmp_path / "o2", "val") == {"ant/1.jpg": 1, "yak/1.jpg": 0}


def test_train_class_without_usable_examples_is_an_error_unless_allowed(tmp_path, capsys):
    src = _tree(
        tmp_path / "src",
        {
            "train/ant/1.jpg": _jpeg(),
            "train/bee/broken.jpg": b"not a jpeg at all",  # every bee is undecodable
            "val/ant/1.jpg": _jpeg(),
            "val/empty": None,  # an empty class folder outside the list: mentioned
        },
    )
    with pytest.raises(ConfigError, match=r"class\(es\) 'bee' \(all 1 files skipped\)"):
        prepare([src], tmp_path / "out", **ONE)
    manifest = prepare([src], tmp_path / "out", allow_empty_classes=True, **ONE)
    assert manifest["classes"] == ["ant", "bee"]  # from the train split only
    assert manifest["splits"]["train"]["classes_without_examples"] == {"bee": "all 1 files skipped"}
    assert manifest["splits"]["val"]["empty_folders"] == ["empty"]
    err = capsys.readouterr().err
    assert "val: empty class folder(s) 'empty'" in err
    assert "train: no usable example of class(es) 'bee'" in err
    _tree(src, {"train/cow": None})  # an empty class folder in the train split: an error
    with pytest.raises(ConfigError, match=r"'cow' \(empty folder\)"):
        prepare([src], tmp_path / "o2", **ONE)


def test_every_layout_problem_found_before_reading_is_in_one_error_line(tmp_path, capsys):
    """A val class the train split lacks and an empty train class: prepare said only the
    first, and the second after that was fixed. Planted bug that fails it: the first
    problem raised alone."""
    src = _tree(
        tmp_path / "src",
        {"train/ant/1.jpg": _jpeg(), "train/cow": None, "val/yak/1.jpg": _jpeg()},
    )
    assert prepare_main([str(src), "--out", str(tmp_path / "o"), "--workers", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 2 problems in the sources: (1) "), lines
    assert "'yak'" in lines[0] and "(2) train split 'train'" in lines[0]
    assert "'cow' (empty folder)" in lines[0]


# ---- item 2: a changed source is prepared again, or refused -----------------------------------


def test_changed_folder_is_prepared_again_saying_what_changed(tmp_path, capsys):
    """A run that prepares a changed split again says what changed once (it was said twice:
    in the run's "preparing" line and prepare's own). Planted bug that fails it: the run's
    line repeats the reason."""
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    out = tmp_path / "out"
    prepare([src], out, **ONE)
    assert prepare([src], out, **ONE)["splits"]["train"]["num_examples"] == 2
    assert "out of date" not in capsys.readouterr().err  # unchanged: reused silently
    _tree(src, {"train/bee/2.jpg": _jpeg(seed=7), "train/cow/1.jpg": _jpeg(seed=8)})
    manifest = prepare([src], out, **ONE)
    err = capsys.readouterr().err
    assert "split 'train'" in err and "out of date" in err
    assert "class 'bee': 1 -> 2 files" in err and "class 'cow' added (1 files)" in err
    assert manifest["classes"] == ["ant", "bee", "cow"]
    assert _labels(out, "train") == {"ant/1.jpg": 0, "bee/1.jpg": 1, "bee/2.jpg": 1, "cow/1.jpg": 2}
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "o2"))
    c.data.eval_split = "train"
    datasets.ensure_prepared(c.data)
    _tree(src, {"train/ant/2.jpg": _jpeg(seed=9)})
    capsys.readouterr()
    datasets.ensure_prepared(c.data)
    said = capsys.readouterr()
    assert said.out.count("class 'ant': 1 -> 2 files") + said.err.count("'ant': 1 -> 2") == 1
    assert "(its source changed; later runs reuse it)" in said.out, said


def test_a_missing_source_is_one_error_and_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    """With data.prepared_dir set, the error also says how to train from it alone (a config
    file's default source was left set). Planted bug that fails it: that clause left out."""
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    c = base_config()
    c.data.update(name="images", source=str(tmp_path / "nowhere" / "train.tar"))
    with pytest.raises(ConfigError, match=r"data.source '.*nowhere/train.tar' does not exist; set"):
        datasets.ensure_prepared(c.data)
    assert not (tmp_path / "cache").exists()  # no lock or empty folder left for it
    # a config file's default source beside a prepared_dir given alone: the way out is said
    c.data.prepared_dir = str(tmp_path / "prepared")
    with pytest.raises(ConfigError) as e:
        datasets.ensure_prepared(c.data)
    assert str(e.value).endswith(
        f"or --config.data.source= (empty) to train from data.prepared_dir="
        f"{str(tmp_path / 'prepared')!r} alone"
    ), e.value


def test_changed_tar_is_refused_with_only_prepared_dir_and_reprepared_with_source(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    tar = tmp_path / "data.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src / "train", arcname="train")
    c = base_config()
    c.data.update(name="images", prepared_dir=str(tmp_path / "out"), eval_split="train")
    c.data.source = str(tar)
    assert datasets.ensure_prepared(c.data) == str(tmp_path / "out")
    _tree(src, {"train/bee/2.jpg": _jpeg(seed=3)})
    with tarfile.open(tar, "w") as t:  # the same name, rewritten with one more image
        t.add(src / "train", arcname="train")
    os.utime(tar, ns=(1, 1))  # a distinct mtime even on coarse-clock file systems
    c.data.source = ""
    with pytest.raises(
        ConfigError, match=r"out of date: .*data.tar' changed \(modification time.*data.source"
    ):
        datasets.ensure_prepared(c.data)
    c.data.source = str(tar)
    datasets.ensure_prepared(c.data)
    assert records.load_manifest(str(tmp_path / "out"))["splits"]["train"]["num_examples"] == 3


def test_an_empty_class_folder_added_makes_the_prepared_folder_out_of_date(tmp_path):
    # An empty class folder takes a label and shifts every class after it.
    src = _tree(tmp_path / "src", {"train/bee/1.jpg": _jpeg(), "train/cow/1.jpg": _jpeg(seed=1)})
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="train")
    datasets.ensure_prepared(c.data)
    _tree(src, {"train/ant": None})
    c.data.source = ""
    with pytest.raises(ConfigError, match=r"out of date: .*class 'ant' added \(0 files\)"):
        datasets.ensure_prepared(c.data)


def test_processes_preparing_at_once_prepare_once(tmp_path, monkeypatch, capsys):
    """The processes of a run (one per GPU of a host) reach the first-use prepare together:
    one prepares, the others wait for it (a file lock) and then reuse its copy."""
    import threading
    import time

    from hybridpar.input import prepare as prep

    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg(seed=1)})
    calls, real = [], prep.prepare

    def slow_prepare(*args, **kwargs):  # holds the lock long enough for the other to queue
        calls.append(1)
        time.sleep(0.5)
        return real(*args, **{**kwargs, **ONE})

    monkeypatch.setattr(prep, "prepare", slow_prepare)
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="train", reduced_copies="")
    results, errors = [], []

    def run():
        try:
            results.append(datasets.ensure_prepared(c.data))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert not errors and results == [str(tmp_path / "out")] * 2
    assert len(calls) == 1, "both prepared the same copy"
    said = capsys.readouterr()  # stdout or stderr (prepare's notes moved to stderr)
    assert "waiting: another process is preparing" in said.out + said.err
    assert records.load_manifest(str(tmp_path / "out"))["splits"]["train"]["num_examples"] == 2


# ---- item 3: bad input, exact counts, EXIF, messages ------------------------------------------


def _truncated_tar(tmp_path):
    src = _tree(tmp_path / "src", {f"train/ant/{i}.jpg": _jpeg(seed=i) for i in range(4)})
    with tarfile.open(tmp_path / "full.tar", "w") as t:
        t.add(src / "train", arcname="train")
    data = (tmp_path / "full.tar").read_bytes()
    cuts = {}
    for name, cut in [("mid", len(data) // 2), ("boundary", 512 * 3)]:
        cuts[name] = tmp_path / f"{name}.tar"
        cuts[name].write_bytes(data[:cut])
    return cuts


def test_truncated_tar_is_a_config_error_naming_the_file(tmp_path):
    cuts = _truncated_tar(tmp_path)
    for name, path in cuts.items():
        with pytest.raises(ConfigError, match=rf"{name}.tar' is truncated") as e:
            prepare([path], tmp_path / f"out-{name}", **ONE)
        assert "\n" not in str(e.value)
    gz = tmp_path / "x.tar.gz"
    with tarfile.open(gz, "w:gz") as t:
        t.add(tmp_path / "src" / "train", arcname="train")
    gz.write_bytes(gz.read_bytes()[:-40])
    with pytest.raises(ConfigError, match=r"x.tar.gz' is truncated or corrupt"):
        prepare([gz], tmp_path / "out-gz", **ONE)


def test_truncated_tar_is_one_error_line_in_prepare_and_in_train(tmp_path, capsys):
    path = _truncated_tar(tmp_path)["mid"]
    assert prepare_main([str(path), "--out", str(tmp_path / "o"), "--workers", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mid.tar" in lines[0]
    r = subprocess.run(
        [sys.executable, "-m", "hybridpar.train", "--config", "experiments/cifar10.py"]
        + ["--workdir", str(tmp_path / "w"), f"--config.data.source={path}"]
        + [f"--config.data.prepared_dir={tmp_path / 'p'}", "--config.mesh=data:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=cpu_env(1),
        check=False,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "mid.tar' is truncated" in last


def test_data_event_counts_are_per_split_and_exact(tmp_path):
    src = _tree(
        tmp_path / "src",
        {
            "train/ant/1.jpg": _jpeg(),
            "train/ant/2.jpg": b"",  # skipped
            "train/bee/1.jpg": _jpeg(),
            "train/bee/2.jpg": _jpeg(),
            "val/ant/1.jpg": b"junk",  # skipped
            "val/bee/1.jpg": _jpeg(),
        },
    )
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(num_classes=2, image_size=16, eval_split="train")
    c.global_batch = c.eval_batch = 1
    info = datasets.make_data(c, 0, 1).info  # eval split = train split: counted once
    assert (info["skipped"], info["converted"], info["train_examples"]) == (1, 0, 3)
    assert info["splits"] == {
        "train": {
            "examples": 3,
            "skipped": 1,
            "converted": 0,
            "rotated": 0,
            "ignored": 0,
            "empty_folders": [],
            "classes_without_examples": [],
        }
    }
    c.data.eval_split = "val"
    info = datasets.make_data(c, 0, 1).info
    assert info["skipped"] == 2 and {k: v["skipped"] for k, v in info["splits"].items()} == {
        "train": 1,
        "val": 1,
    }
    json.dumps(info)  # the data event is one JSON line


def test_set_up_says_the_label_of_each_class_and_which_prepared_copy_it_reuses(tmp_path, capsys):
    """Which folder became which label was only in metrics.jsonl and manifest.json, and a
    reused prepared copy was not named. Planted bug that fails it: neither line said."""
    names = [f"c{i:02d}" for i in range(12)]
    src = _tree(tmp_path / "src", {f"{s}/{c}/1.jpg": _jpeg() for s in ("train", "val")
                                   for c in names})  # fmt: skip
    _make_data(src, tmp_path / "out", False, num_classes=12)
    out = capsys.readouterr().out
    assert "classes (label order): 0 c00, 1 c01, 2 c02" in out
    assert "9 c09, ... (12 classes)" in out and "c10" not in out
    assert "reusing" not in out  # prepared just now
    _make_data(src, tmp_path / "out", False, num_classes=12)
    out = capsys.readouterr().out
    assert f"reusing the prepared copy in {tmp_path / 'out'} (train 12, val 12 examples)" in out
    assert datasets.classes_line(["ant", "bee"]) == "classes (label order): 0 ant, 1 bee"
    assert "upsampled" not in out  # 16 px images at 16 px


def test_set_up_warns_when_every_image_is_upsampled_twice_or_more(tmp_path, capsys):
    """Own images of 50 px trained at 224 px upsampled each 4.5x without a word (time spent,
    no detail gained). Planted bug that fails it: no line."""
    src = _tree(tmp_path / "src", {f"train/{c}/{i}.jpg": _jpeg(24, 16, seed=i)
                                   for c in ("a", "b") for i in range(2)})  # fmt: skip
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(num_classes=2, image_size=32, eval_split="train")
    c.global_batch = c.eval_batch = 2
    datasets.make_data(c, 0, 1)
    assert ("warning: image size 32 px is 2.0x the training images' median shorter side "
            "(16 px): each is upsampled that much") in capsys.readouterr().out  # fmt: skip
    assert datasets.upsampling_line(16, [16, 31]) is None  # under 2x: said nothing
    assert datasets.upsampling_line(None, [224]) is None  # a copy prepared before the figure


def test_missing_eval_split_says_to_set_eval_split_or_add_the_folder(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="validation")
    with pytest.raises(ConfigError) as e:
        datasets.ensure_prepared(c.data)
    msg = str(e.value)
    assert "data.eval_split='validation'" in msg and "--config.data.eval_split" in msg
    assert "validation/CLASS/FILE" in msg and "prepare" not in msg.split("(it has")[1]


def test_exif_orientation_is_applied_and_counted(tmp_path):
    import tensorflow as tf

    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, to be shown rotated 90 degrees clockwise
    raw = _jpeg(40, 20, seed=9, exif=exif.tobytes())
    src = _tree(tmp_path / "src", {"train/ant/r.jpg": raw, "train/ant/plain.jpg": _jpeg()})
    manifest = prepare([src], tmp_path / "out", **ONE)
    info = manifest["splits"]["train"]
    assert info["rotated"] == 1
    assert info["converted"] == [{"name": "ant/r.jpg", "reason": "EXIF orientation 6 applied"}]
    pipe = ImagePipeline(str(tmp_path / "out"), "train", process_index=0, process_count=1)
    for r in tf.data.TFRecordDataset(pipe.files("full")):
        ex = tf.io.parse_single_example(r, records.feature_spec())
        if ex["name"].numpy() == b"ant/r.jpg":
            stored = tf.io.decode_jpeg(ex["image"]).numpy()
    upright = np.asarray(Image.open(io.BytesIO(raw)).transpose(Image.Transpose.ROTATE_270))
    assert stored.shape == (40, 20, 3) == upright.shape  # portrait now, as a viewer shows it
    error = np.abs(stored.astype(int) - upright).mean()
    wrong = np.abs(stored.astype(int) - upright[::-1, ::-1]).mean()  # rotated the other way
    assert error < 3 and wrong > 4 * error  # the same pixels, re-encoded


def test_evaluation_reads_the_eval_split_and_training_the_train_split(tmp_path):
    """Split by content, not by count alone: the val folder holds only bee pictures, and
    different ones, so eval batches drawn from the train split (or train batches from val)
    show up in the labels and in the pixels."""
    train = {f"train/ant/{i}.jpg": _jpeg(seed=i) for i in range(3)}
    train["train/bee/0.jpg"] = _jpeg(seed=3)
    val = {f"val/bee/{i}.jpg": _jpeg(seed=10 + i) for i in range(2)}
    src = _tree(tmp_path / "src", {**train, **val})
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(num_classes=2, image_size=16, eval_split="val", min_scale=1.0, translate=0)
    c.global_batch, c.eval_batch = 4, 4
    data = datasets.make_data(c, 0, 1)
    assert data.num_eval == 2
    (batch,) = list(data.eval_batches())
    real = batch["mask"] > 0
    assert real.sum() == 2 and set(batch["label"][real]) == {1}  # val's bees only
    (train_batch,) = list(data.train_batches(0))
    assert sorted(train_batch["label"]) == [0, 0, 0, 1]

    def means(images):
        return sorted(np.round(images.reshape(len(images), -1).mean(1)))

    # val's pictures, not train's bee: the same center crop of val read on its own
    own = ImagePipeline(str(tmp_path / "out"), "val", process_index=0, process_count=1)
    (want,) = list(own.eval_batches(image_size=16, global_batch=4))
    assert means(batch["image"][real]) == means(want["image"][want["mask"] > 0])


def test_a_run_holds_the_prepared_folders_reader_lock_while_it_reads(tmp_path):
    """Preparing a folder again while a run read it deleted the shards under the run: a run
    now holds the folder's reader lock (``prepare.hold_readers``, which prepare tests before
    it removes a split) for the life of its process, from data.source and from a prepared
    folder alone. Planted bug that fails it: ``_pipeline`` calling ``ensure_prepared``
    without ``hold``."""
    import fcntl

    src = _tree(tmp_path / "src", {f"{s}/ant/{i}.jpg": _jpeg(seed=i) for s in ("train", "val")
                                   for i in range(2)})  # fmt: skip
    out = tmp_path / "out"
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(out), eval_split="val")
    c.data.update(num_classes=1, image_size=16)
    c.global_batch = c.eval_batch = 2
    for source in (str(src), ""):  # the first use prepares; then the folder alone
        c.data.source = source
        held = len(datasets.READING)
        datasets.make_data(c, 0, 1)
        try:
            with open(out / ".readers.lock") as f:  # as another process's prepare tests it
                with pytest.raises(BlockingIOError):
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            while len(datasets.READING) > held:
                datasets.READING.pop().release()


def test_a_shard_removed_under_a_run_is_one_error_naming_it(tmp_path):
    """A shard deleted while a run reads the prepared copy ended the run in tf.data's
    NotFoundError traceback: now a ``DataError`` (one ``error:`` line; the trainer keeps its
    checkpoints) naming the file and how to resume, on the train and the eval path. Planted
    bug that fails it: ``_drain_ahead`` without its NotFoundError clause."""
    src = _tree(tmp_path / "src", {f"train/ant/{i}.jpg": _jpeg(seed=i) for i in range(8)})
    out = tmp_path / "out"
    prepare([src], out, **ONE)
    pipe = ImagePipeline(str(out), "train", process_index=0, process_count=1)
    shard = pipe.files("full")[1]
    os.remove(shard)
    for batches in (pipe.train_batches(0, image_size=16, global_batch=4),
                    pipe.eval_batches(image_size=16, global_batch=4)):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            list(batches)
        assert str(e.value).startswith(
            f"{shard} is gone: the prepared copy in {out} changed under the run"
        ), e.value
        assert "the same command resumes from the run's last checkpoint" in str(e.value)


# ---- both paths (tf.data and data.on_device) keep, skip, count and label alike -----------------


@pytest.mark.parametrize("on_device", [False, True])
def test_an_empty_eval_split_says_one_is_needed_and_how_to_make_it(tmp_path, on_device):
    """A set with only train/ and --config.data.eval_split= (the trainer evaluates after
    the last step in any case): the empty name was taken for the source's own folder
    ("the folder '.../src/' holds no image file"). Planted bug that fails it: no check of
    the empty name."""
    import jax

    from hybridpar import make_mesh

    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="", on_device=on_device, num_classes=2, image_size=16)
    with pytest.raises(ConfigError) as e:
        datasets.make_data(c, 0, 1, mesh=make_mesh("data:1", devices=jax.devices()[:1]))
    msg = str(e.value)
    assert msg.startswith("data.eval_split is empty, but a run needs an eval split"), msg
    assert "val/CLASS/" in msg and "--config.data.eval_split=val" in msg
    assert not (tmp_path / "out").exists()  # refused before anything is prepared


def _image_bytes(img, fmt):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _make_data(src, prepared_dir, on_device, **data):
    """``datasets.make_data`` of a tiny images run on 2 of the devices."""
    import jax

    from hybridpar import make_mesh

    c = base_config()
    c.mesh = "data:2"
    c.data.update(name="images", source=str(src), prepared_dir=str(prepared_dir))
    c.data.update(image_size=16, eval_split="val", on_device=on_device, **data)
    c.global_batch = c.eval_batch = 2
    return datasets.make_data(c, 0, 1, mesh=make_mesh("data:2", devices=jax.devices()[:2]))


def _both_paths(tmp_path, src, **data):
    """The ``data`` event's facts of the tf.data path and of the on-device one, read from
    one source into one prepared folder."""
    got = [_make_data(src, tmp_path / "out", on, **data).info for on in (False, True)]
    return tuple(got)


def test_both_paths_keep_skip_count_and_ignore_the_same_files(tmp_path):
    """One decode rule (a 32-bit TIFF and an empty file skipped for the same reasons, a PNG
    and an EXIF-rotated photo converted), one set of counts in the data event, one list of
    files not read, and a file name that is not UTF-8 trains on both paths."""
    exif = Image.Exif()
    exif[0x0112] = 6
    src = _tree(
        tmp_path / "src",
        {
            "train/ant/1.jpg": _jpeg(seed=1),
            "train/ant/empty.jpg": b"",
            "train/ant/f32.tif": _image_bytes(Image.new("F", (8, 8), 0.5), "TIFF"),
            "train/ant/p.png": _image_bytes(Image.new("RGB", (20, 16), "red"), "PNG"),
            "train/ant/sub/n.jpg": _jpeg(seed=2),  # a nested folder: not read, listed
            "train/ant/x.heic": b"heic",  # an image under another extension: listed
            "train/ant/notes.txt": b"junk",  # not an image: ignored silently
            "train/bee/1.jpg": _jpeg(seed=3),
            "train/bee/r.jpg": _jpeg(40, 20, seed=4, exif=exif.tobytes()),
            "val/ant/1.jpg": _jpeg(seed=5),  # no bee folder in val
        },
    )
    latin = os.path.join(os.fsencode(src / "train" / "bee"), b"caf\xe9.jpg")  # Latin-1 name
    with open(latin, "wb") as f:
        f.write(_jpeg(seed=6))
    tf_info, od_info = _both_paths(tmp_path, src, num_classes=2)
    keys = ("classes", "train_examples", "eval_examples", "skipped", "converted", "rotated")
    keys += ("ignored", "splits")
    assert {k: od_info.get(k) for k in keys} == {k: tf_info[k] for k in keys}
    assert tf_info["classes"] == ["ant", "bee"] and tf_info["train_examples"] == 5
    assert tf_info["splits"] == {
        "train": {"examples": 5, "skipped": 2, "converted": 2, "rotated": 1, "ignored": 2,
                  "empty_folders": [], "classes_without_examples": []},
        "val": {"examples": 1, "skipped": 0, "converted": 0, "rotated": 0, "ignored": 0,
                "empty_folders": [], "classes_without_examples": ["bee"]},
    }  # fmt: skip
    manifest = records.load_manifest(str(tmp_path / "out"))["splits"]["train"]
    cached = json.loads((tmp_path / "out" / "on_device" / "train-16px.json").read_text())
    for key in ("skipped", "converted", "ignored"):
        assert cached[key] == manifest[key], key
    assert [x["reason"] for x in manifest["skipped"]] == [
        "empty file", "F mode: 32-bit samples; convert the file to 8 bits"]  # fmt: skip
    assert manifest["ignored"] == [
        {"name": "ant/sub/n.jpg", "reason": "in a folder inside a class folder (only "
         "CLASS/FILE is read)"},
        {"name": "ant/x.heic", "reason": "not an image name (.heic)"},
    ]  # fmt: skip
    import tensorflow as tf

    pipe = ImagePipeline(str(tmp_path / "out"), "train", process_index=0, process_count=1)
    names = [tf.io.parse_single_example(r, records.feature_spec())["name"].numpy()
             for f in pipe.files("full") for r in tf.data.TFRecordDataset(f)]  # fmt: skip
    assert b"bee/caf\xe9.jpg" in names  # the name's own bytes


def test_both_paths_record_a_digest_of_the_train_files_that_a_swap_changes(tmp_path):
    """Images swapped between starts (the same count, other files): the trainer compared
    only counts and resumed with no word. Both paths record one digest of the train files
    (the trainer compares it), which a swap changes and a moved source keeps. Planted bug
    that fails it: no digest recorded."""
    files = {"train/ant/1.jpg": _jpeg(seed=1), "train/bee/1.jpg": _jpeg(seed=2)}
    src = _tree(tmp_path / "src", files | {"val/ant/1.jpg": _jpeg(seed=3)})
    tf_info, od_info = _both_paths(tmp_path, src, num_classes=2)
    assert tf_info["train_fingerprint"] and od_info["train_fingerprint"] == tf_info[
        "train_fingerprint"]  # fmt: skip
    os.rename(src, tmp_path / "moved")  # the same files elsewhere: the same digest
    moved = _make_data(tmp_path / "moved", tmp_path / "out2", False, num_classes=2).info
    assert moved["train_fingerprint"] == tf_info["train_fingerprint"]
    (tmp_path / "moved" / "train" / "bee" / "1.jpg").write_bytes(_jpeg(30, 20, seed=4))
    for on in (False, True):
        info = _make_data(tmp_path / "moved", tmp_path / "out2", on, num_classes=2).info
        assert info["train_examples"] == 2
        assert info["train_fingerprint"] not in (None, tf_info["train_fingerprint"])


def test_a_class_list_dropped_or_changed_labels_both_paths_anew(tmp_path, capsys, monkeypatch):
    """The class list the config asks for is part of what prepared data and the on-device
    cache serve: data.classes=dog,cat,airplane, then unset (the train split's folders:
    airplane,cat,dog), then a superset, then unset again: each run labels by its own list,
    says why it prepares or decodes again, and records the list in its data event."""
    from hybridpar.input import prepare as prep

    # Each of the four prepares in this process: a pool would start (and import TensorFlow
    # in) a worker process per core every time, most of this test's time for 6 images.
    real = prep.prepare
    monkeypatch.setattr(prep, "prepare", lambda *a, **kw: real(*a, **{**kw, "workers": 1}))
    names = ("airplane", "cat", "dog")
    files = {f"{s}/{c}/1.jpg": _jpeg(seed=i) for i, c in enumerate(names) for s in ("train", "val")}
    src = _tree(tmp_path / "src", files)
    for classes, why in [
        ("dog,cat,airplane", "not prepared yet"),
        ("", "data.classes is unset now"),
        ("airplane,cat,dog,horse", "data.classes differs: the class list changed (added 'horse')"),
        ("", "data.classes is unset now"),
    ]:
        n = len(classes.split(",")) if classes else 3
        tf_info, od_info = _both_paths(
            tmp_path, src, num_classes=n, classes=classes, allow_empty_classes=True
        )
        want = classes.split(",") if classes else list(names)
        assert tf_info["classes"] == od_info["classes"] == want
        out = capsys.readouterr().out
        assert why in out.split("decoding split")[0], out  # the tf.data path's line
        assert out.count("decoding split") == 2, out  # the on-device cache: both splits


def test_an_empty_eval_folder_is_said_empty_and_a_wrong_source_leaves_no_cache(
    tmp_path, monkeypatch
):
    src = _tree(
        tmp_path / "src",
        {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg(), "val/ant": None},
    )
    for on in (False, True):
        with pytest.raises(ConfigError, match=r"data.eval_split='val': the folder '.*src/val' "
                           r"holds no image file in CLASS/FILE layout; add images"):  # fmt: skip
            _make_data(src, tmp_path / "out", on, num_classes=2)
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "data.tar").write_text("not a tar")
    for on in (False, True):
        with pytest.raises(ConfigError, match="neither a folder nor a tar"):
            _make_data(tmp_path / "data.tar", "", on, num_classes=2)
        assert not list((tmp_path / "cache").glob("*")), on  # no lock or empty folder left


# ---- a run's data paths: the source's own folder, one split as a source, ~, the plan --------


def test_a_run_refuses_a_prepared_dir_in_its_source_before_writing_there(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "val/ant/1.jpg": _jpeg()})
    before = sorted(p for p in src.rglob("*"))
    for prepared in (src, src / "prep"):
        c = base_config()
        c.data.update(name="images", source=str(src), prepared_dir=str(prepared))
        c.data.update(eval_split="val", num_classes=1)
        with pytest.raises(ConfigError, match=r"data.prepared_dir '.*' is (inside )?the source"):
            datasets.ensure_prepared(c.data)
        c.data.on_device = True
        with pytest.raises(ConfigError, match=r"data.prepared_dir '.*' is (inside )?the source"):
            datasets.make_data(c, 0, 1)
    assert sorted(p for p in src.rglob("*")) == before  # not even a lock file


def test_split_folders_as_sources_say_to_point_at_the_folder_above_them(tmp_path, capsys):
    """data.source=/x/train,/x/val: the training path has no --split to suggest."""
    src = _tree(tmp_path / "x", {"train/ant/1.jpg": _jpeg(), "val/ant/1.jpg": _jpeg()})
    for on_device in (False, True):
        c = base_config()
        c.data.update(name="images", source=f"{src / 'train'},{src / 'val'}")
        c.data.update(prepared_dir=str(tmp_path / "prep"), eval_split="val", num_classes=1)
        c.data.on_device = on_device
        with pytest.raises(ConfigError) as e:
            datasets.make_data(c, 0, 1)
        msg = str(e.value)
        assert "point data.source at the folder that holds train/ and val/" in msg, msg
        assert "--split" not in msg
        assert "--split" not in capsys.readouterr().err
    # prepare's command line keeps its own fix
    assert prepare_main([str(src / "train"), "--out", str(tmp_path / "o"), "--workers", "1"]) == 2
    assert "use --split NAME" in capsys.readouterr().err


def test_a_missing_eval_split_is_found_before_any_split_is_prepared(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="validation", num_classes=2)
    with pytest.raises(ConfigError, match=r"data.eval_split='validation' is not a split"):
        datasets.ensure_prepared(c.data)
    assert not (tmp_path / "out" / "train").exists()
    assert not (tmp_path / "out" / records.MANIFEST).exists()


def test_a_source_and_prepared_dir_under_home_may_start_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg()})
    c = base_config()
    c.data.update(name="images", source="~/src", prepared_dir="~/out", eval_split="train")
    assert datasets.ensure_prepared(c.data) == str(tmp_path / "out")
    assert (tmp_path / "out" / records.MANIFEST).exists()


@pytest.mark.parametrize(
    "env, root",
    [
        ("~/hpc", "home/hpc"),
        ("", "home/.cache/hybridpar"),
        ("rel", "cwd/rel"),
        (None, "home/.cache/hybridpar"),
    ],
)
def test_the_cache_from_hybridpar_cache_is_absolute_with_its_tilde_expanded(
    tmp_path, monkeypatch, env, root
):
    """HYBRIDPAR_CACHE='~/hpc' (quoted: the shell left the ~) made a folder named '~' in the
    working directory, and an empty one a relative path. Planted bug that fails it:
    ``cache_root`` without its expanduser and abspath (or ``or`` back to a default)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    if env is None:
        monkeypatch.delenv("HYBRIDPAR_CACHE", raising=False)
    else:
        monkeypatch.setenv("HYBRIDPAR_CACHE", env)
    got = datasets.default_prepared_dir([str(tmp_path / "src")])
    assert os.path.dirname(got) == str(tmp_path / root), got


@pytest.mark.parametrize("on_device", [False, True])
def test_a_cache_that_cannot_be_written_names_hybridpar_cache(tmp_path, monkeypatch, on_device):
    """The default cache's folder unwritable (here a file stands where it goes): the error
    named only prepare's --out (data.prepared_dir), where the path came from HYBRIDPAR_CACHE.
    Planted bug that fails it: FolderLock without ``cache_fix``."""
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "val/ant/1.jpg": _jpeg()})
    (tmp_path / "cache").write_text("a file")
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    c = base_config()
    c.data.update(name="images", source=str(src), eval_split="val", num_classes=1)
    c.data.on_device = on_device
    with pytest.raises(ConfigError) as e:
        datasets.make_data(c, 0, 1)
    assert (
        f"from HYBRIDPAR_CACHE={str(tmp_path / 'cache')!r}; point HYBRIDPAR_CACHE (or "
        "--config.data.prepared_dir) at a folder you can write" in str(e.value)
    ), e.value


def test_the_plan_line_says_how_many_examples_an_epoch_leaves_out(tmp_path):
    """Full batches only: 5 examples at batch 2 read 4 an epoch, and the plan says so."""
    from hybridpar.config.curriculum import describe, plan_stages, stages_from_config

    files = {f"train/{c}/{i}.jpg": _jpeg(seed=i) for c in ("ant", "bee") for i in range(3)}
    files.pop("train/bee/2.jpg")
    src = _tree(tmp_path / "src", files)
    c = base_config()
    c.data.update(name="images", source=str(src), prepared_dir=str(tmp_path / "out"))
    c.data.update(eval_split="train", num_classes=2, image_size=16)
    c.global_batch, c.eval_batch, c.num_epochs = 2, 2, 1
    for on_device in (False, True):
        c.data.on_device = on_device
        data = datasets.make_data(c, 0, 1)
        line = describe(plan_stages(stages_from_config(c, 1), data.steps_for))
        assert "2 steps (2/epoch)" in line, line
        assert "4 of 5 examples per epoch (full batches only): a different 1 left out" in line
    c.global_batch = 5
    line = describe(plan_stages(stages_from_config(c, 1), data.steps_for))
    assert "examples per epoch" not in line, line  # every example read


# ---- links, class lists and leftovers a user's folders bring ----------------------------------


def _tar_of(path, src, *names):
    """A plain tar of ``names`` under ``src``, links stored as links (as `tar cf` does)."""
    with tarfile.open(path, "w") as t:
        for name in names:
            t.add(src / name, arcname=name)
    return path


@pytest.mark.parametrize("where", ["train/fish", "val"])
def test_a_linked_class_or_split_folder_in_a_tar_is_one_error_naming_it(tmp_path, capsys, where):
    """tarfile cannot follow a link: the folder's images would be dropped and the labels
    shift. One error line names the link and the fix; nothing is left in --out."""
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg(seed=1),
                                   "elsewhere/x/1.jpg": _jpeg(seed=2)})  # fmt: skip
    (src / where).parent.mkdir(parents=True, exist_ok=True)
    (src / where).symlink_to(src / "elsewhere" / ("x" if "/" in where else ""))
    tar = _tar_of(tmp_path / "ds.tar", src, "train", *(["val"] if where == "val" else []))
    out = tmp_path / "made" / "out"
    assert prepare_main([str(tar), "--out", str(out), "--workers", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"symbolic link '{where}'" in lines[0] and "tar -h" in lines[0]
    assert not (tmp_path / "made").exists()  # prepare made it, and removes it again


def test_a_hard_link_member_at_class_depth_is_refused_too(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg()})
    tar = _tar_of(tmp_path / "ds.tar", src, "train")
    with tarfile.open(tar, "a") as t:
        link = tarfile.TarInfo("train/bee")
        link.type, link.linkname = tarfile.LNKTYPE, "train/ant"
        t.addfile(link)
    (tmp_path / "out").mkdir()  # the user's folder: kept after the error
    with pytest.raises(ConfigError, match=r"hard link 'train/bee'.*--dereference"):
        prepare([tar], tmp_path / "out", **ONE)
    assert (tmp_path / "out").is_dir()


def test_a_broken_symbolic_link_is_skipped_and_listed_on_both_paths(tmp_path):
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "train/bee/1.jpg": _jpeg(seed=1),
                                   "val/ant/1.jpg": _jpeg(seed=2)})  # fmt: skip
    (src / "train" / "ant" / "dead.jpg").symlink_to(tmp_path / "gone.jpg")
    tf_info, od_info = _both_paths(tmp_path, src, num_classes=2)
    for info in (tf_info, od_info):
        assert info["train_examples"] == 2 and info["splits"]["train"]["skipped"] == 1
    manifest = records.load_manifest(str(tmp_path / "out"))["splits"]["train"]
    cached = json.loads((tmp_path / "out" / "on_device" / "train-16px.json").read_text())
    dead = [{"name": "ant/dead.jpg", "reason": "broken symbolic link"}]
    assert manifest["skipped"] == cached["skipped"] == dead


def test_a_val_class_missing_from_train_is_refused_on_device_before_any_decode(tmp_path):
    """prepare's check and message, before a split is decoded (not after train's decode)."""
    src = _tree(tmp_path / "src", {"train/ant/1.jpg": _jpeg(), "val/ant/1.jpg": _jpeg(seed=1),
                                   "val/yak/1.jpg": _jpeg(seed=2)})  # fmt: skip
    for on in (False, True):
        with pytest.raises(ConfigError, match=r"split 'val' .*'yak' that train split 'train'"):
            _make_data(src, tmp_path / "out", on, num_classes=1)
    assert not list((tmp_path / "out").glob("on_device/*.npz"))  # nothing decoded


def test_a_class_list_file_with_a_bom_and_the_fix_of_a_folder_it_lacks(tmp_path):
    """A list saved by Excel or Notepad starts with a UTF-8 BOM; a folder the list lacks
    is fixed in the list (or, without one, in the split that defines the classes)."""
    (tmp_path / "classes.txt").write_text("ant\nbee\n", encoding="utf-8-sig")
    src = _tree(tmp_path / "src", {"trn/ant/1.jpg": _jpeg(), "trn/bee/1.jpg": _jpeg(seed=1),
                                   "val/yak/1.jpg": _jpeg(seed=2)})  # fmt: skip
    classes = str(tmp_path / "classes.txt")
    with pytest.raises(ConfigError) as e:
        prepare([src], tmp_path / "out", classes=classes, **ONE)
    assert "'yak' that the given class list lacks" in str(e.value)  # 'ant' is known
    assert "add them to the class list" in str(e.value) and "train split" not in str(e.value)
    with pytest.raises(ConfigError, match=r"'yak' .*add them to train split 'trn'"):
        prepare([src], tmp_path / "out", train_split="trn", **ONE)
    (src / "val" / "yak").rename(src / "val" / "bee")
    manifest = prepare([src], tmp_path / "out", classes=classes, **ONE)
    assert manifest["classes"] == ["ant", "bee"]


@pytest.mark.parametrize(
    "name, train, test, warned",
    [
        ("images", "test", "test", True),
        ("images", "train", "test", False),
        ("tfds", "train", "train[:10%]", True),  # the whole split holds the slice
        ("tfds", "train[:50%]", "train[40%:]", True),
        ("tfds", "train[:90%]", "train[90%:]", False),  # the usual held-out slice
        ("tfds", "train[:900]", "train[900:]", False),
        ("tfds", "train+validation", "validation", True),
        ("tfds", "train[:900]", "train[50%:]", False),  # another unit: not told
    ],
)
def test_set_up_warns_when_the_eval_split_holds_training_images(name, train, test, warned, capsys):
    """cifar10_fast with --config.data.train_split=test trained on the test images and
    reported its top-1 as the test accuracy, without a word. Set-up now says so in a warning
    line, where the splits' names tell that they share images (tfds' slices too). Planted
    bug that fails it: set-up not calling warn_splits."""
    import jax
    from helpers import tiny_digits

    from hybridpar.runtime.run import setup

    config = tiny_digits("data:1", **{"data.name": name, "data.train_split": train,
                                      "data.eval_split": test})  # fmt: skip
    setup(config, with_data=False, devices=jax.devices()[:1])
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert said == ([f"warning: data.train_split={train!r} and data.eval_split={test!r} share "
                     "images: the evaluation sees training images, so its top-1 is not a "
                     "held-out accuracy; set --config.data.eval_split to a split the run does "
                     "not train on"] if warned else []), said  # fmt: skip


def test_the_eval_line_leaves_out_top5_where_it_is_1_by_construction():
    """An own set of 3 classes printed 'top5 1.0000' at every eval: with 5 classes or fewer
    every class is in the top 5 (planted: the column kept). The rule is one helper, which
    the eval line and validate's refusal of a top-5 target (reached at step 0) both read
    (planted: the boundary moved in it)."""
    from hybridpar.config.schema import validate
    from hybridpar.runtime.run import eval_line

    rec = {"step": 40, "epoch": 2.0, "loss": 0.5, "top1": 0.75, "top5": 1.0, "examples": 60}
    assert eval_line(rec, 5) == (
        "eval  step     40  epoch   2.00  loss 0.5000  top1 0.7500  (60 examples)")  # fmt: skip
    assert "  top1 0.7500  top5 1.0000  (60 examples)" in eval_line(rec, 6)
    c = base_config()
    c.data.update(name="synthetic", num_classes=5)
    c.target_top5 = 0.9
    with pytest.raises(ConfigError, match="top-5 is 1.0 by definition with 5 classes or fewer"):
        validate(c)
    c.data.num_classes = 6
    validate(c)
