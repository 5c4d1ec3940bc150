"""Data that lives on the device (input/on_device.py, ``data.on_device=True``).

* The batch at (seed, epoch, step) is the same on one device, data:8 and data:4,model:2
  (train with every augmentation and a curriculum stage's size and crop scale, and eval);
  its pre-step gathers each device's own examples with no collective.
* Same (seed, epoch, step), same batch; another step or epoch, another; every example once
  an epoch; a stream started mid-epoch (a resume) is the uninterrupted stream's tail.
* The augmentation does what it says: each output is its image shifted by at most
  ``translate`` pixels (reflect-padded) and flipped or not, both seen; a whole-image resize
  is the bilinear resize; the crops' draws change with the step; eval is unaugmented, every
  example once, the padding masked.
* digits: the same batches as the host path, so the same losses; stop + resume ends bitwise
  equal to the uninterrupted run; the CLI trains with TensorFlow blocked from importing.
* images: decoded once with Pillow into a cache beside the prepared data, reused, decoded
  again (with a line saying why) when the source changes; CIFAR-10's test.tar where the
  shared data is (and no TensorFlow in that process); a train class without a usable
  example is refused as prepare refuses it (unless data.allow_empty_classes).
* A set that does not fit is refused with one line naming its size, the limit and the fix.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY_DIGITS, CrashAt, config_args, cpu_env, require_shared_data, tiny_digits

from hybridpar import make_mesh, shard_batch
from hybridpar.config.errors import ConfigError, DataError
from hybridpar.config.schema import base_config, validate
from hybridpar.input import arrays, datasets, on_device
from hybridpar.runtime import checkpoint, trainer
from hybridpar.runtime.run import setup

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("data:1", "data:8", "data:4,model:2")
COLLECTIVES = r"all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all"


def mesh_of(spec):
    n = int(np.prod([int(p.split(":")[1]) for p in spec.split(",")]))
    return make_mesh(spec, devices=jax.devices()[:n])


def indexed(n=256, size=16, channels=1, seed=0):
    """Random images whose label is their index: a batch says which examples it holds."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (n, size, size, channels), np.uint8)
    return {"image": image, "label": np.arange(n, dtype=np.int32)}


def host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def stream(ds, epoch, start=0, steps=None, batch=32, size=16, scale=1.0):
    return [host(b) for b in ds.train_batches(epoch, start, steps, batch, size, scale)]


def augmenting(mesh, train=None, test=None, **kw):
    train = indexed() if train is None else train
    test = indexed(60, seed=1) if test is None else test
    kw = {"crop": True, "flip": True, "translate": 2, **kw}
    return on_device.DeviceSet(mesh, 3, {16: train}, test, **kw)


def test_the_batches_are_the_same_on_any_mesh_and_gathered_without_collectives():
    """A curriculum stage's batch (crop at scale 0.35, resized to 12 px, translate, flip)
    across an epoch's end, and eval."""
    got = {}
    for spec in MESHES:
        ds = augmenting(mesh_of(spec))
        got[spec] = stream(ds, 1, 2, 3, batch=64, size=12, scale=0.35)
        got[spec] += [host(b) for b in ds.eval_batches(40)]
        if spec != MESHES[0]:
            for a, b in zip(got[MESHES[0]], got[spec], strict=True):
                for k in a:
                    np.testing.assert_array_equal(a[k], b[k], err_msg=f"{spec} {k}")
            # each device gathers its own examples from its own copy: no collective at all
            t = ds.train[16]
            args = (t["image"], t["label"], ds.order(1, 64), np.int32(1), np.int32(2))
            hlo = ds.train_fn(64, 12, 0.35).lower(*args).compile().as_text()
            assert not re.search(COLLECTIVES, hlo), spec
            per_device = 64 // ds.mesh.shape["data"]
            # (XLA may fold the gather's unit slice dimension into it)
            assert re.search(rf"u8\[{per_device},(1,)?16,16,1\]\S* gather\(", hlo), spec


def test_same_position_same_batch_each_example_once_an_epoch_and_resume_mid_epoch():
    ds = augmenting(mesh_of("data:8"))
    epoch = stream(ds, 0)
    again = stream(augmenting(mesh_of("data:8")), 0)  # built afresh: nothing cached
    for a, b in zip(epoch, again, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    labels = np.concatenate([b["label"] for b in epoch])
    assert len(epoch) == 256 // 32 and sorted(labels) == list(range(256))
    assert not np.array_equal(labels, np.arange(256))  # shuffled
    images = [b["image"] for b in epoch]
    assert all(not np.array_equal(images[i], images[i + 1]) for i in range(len(images) - 1))
    nxt = np.concatenate([b["label"] for b in stream(ds, 1)])
    assert sorted(nxt) == list(range(256)) and not np.array_equal(nxt, labels)
    # From step 5 of epoch 0, into epoch 1: the tail of the uninterrupted stream.
    whole = epoch + stream(ds, 1)
    tail = stream(ds, 0, 5, 6)
    for a, b in zip(whole[5:11], tail, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def shifted_and_flipped(image, t):
    """Every image ``image`` can become by a shift of up to ``t`` px and a flip."""
    out = {}
    n = image.shape[0]
    padded = np.pad(image, ((t, t), (t, t), (0, 0)), mode="reflect")
    for dy in range(2 * t + 1):
        for dx in range(2 * t + 1):
            moved = padded[dy : dy + n, dx : dx + n]
            out[(dy - t, dx - t, False)] = moved
            out[(dy - t, dx - t, True)] = moved[:, ::-1]
    return out


def test_translate_and_flip_do_what_they_say_and_eval_is_plain():
    train, test = indexed(), indexed(60, seed=1)
    ds = augmenting(mesh_of("data:4,model:2"), train, test)
    seen = set()
    for b in stream(ds, 0, 0, 2, batch=64):
        for image, label in zip(b["image"], b["label"]):
            matches = [k for k, v in shifted_and_flipped(train["image"][label], 2).items()
                       if np.array_equal(v, image)]  # fmt: skip
            assert matches, f"example {label} is not a shift + flip of its image"
            seen.add(matches[0])
    assert {k[2] for k in seen} == {False, True}  # flipped and not
    assert len({k[:2] for k in seen}) > 10  # many of the 25 shifts
    # The whole image resized (min_scale 1, nothing else): the bilinear resize, rounded.
    plain = on_device.DeviceSet(mesh_of("data:8"), 3, {16: train}, test, crop=True)
    b = stream(plain, 0, 0, 1, size=12)[0]
    want = arrays.resize_bilinear(train["image"][b["label"], ..., 0].astype(np.float64), 12)
    diff = np.abs(np.floor(want + 0.5) - b["image"][..., 0])
    tie = np.abs(want - np.floor(want) - 0.5) < 1e-3  # float32 may round a .5 either way
    assert diff.max() <= 1 and not (diff > 0)[~tie].any()
    # Eval: each test example once, in order, as it is; the padding masked.
    evals = [host(b) for b in ds.eval_batches(40)]
    mask = np.concatenate([b["mask"] for b in evals]).astype(bool)
    assert len(mask) == 80 and mask.sum() == 60 and not mask[60:].any()
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in evals])[mask], test["image"])
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in evals])[mask], test["label"])


def test_the_crop_draws_change_with_the_step_and_the_epoch():
    """One image repeated: batches can differ only by their augmentation, so a key that
    left out the step or the epoch would repeat a batch."""
    one = {k: np.repeat(v[:1], 256, axis=0) for k, v in indexed().items()}
    ds = augmenting(mesh_of("data:8"), one)
    batches = stream(ds, 0, 0, 3, size=12, scale=0.35) + stream(ds, 1, 0, 1, size=12, scale=0.35)
    images = [b["image"] for b in batches]
    for i in range(len(images)):
        for j in range(i):
            assert not np.array_equal(images[i], images[j]), (i, j)
    # within a batch too: each example draws its own crop
    assert len({x.tobytes() for x in images[0]}) > 16


def test_shard_batch_passes_a_batch_on_the_mesh_through_and_moves_one_from_another():
    ds = augmenting(mesh_of("data:8"))
    batch = next(ds.train_batches(0, 0, 1, 32, 16, 1.0))
    same = shard_batch(batch, make_mesh("data:8"))
    assert all(same[k] is batch[k] for k in batch)
    other = make_mesh("data:4,model:2")
    moved = shard_batch(batch, other)
    for k in batch:
        np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(batch[k]))
        assert moved[k].sharding.mesh == other


def test_a_jax_make_mesh_of_explicit_axes_gives_the_same_batches():
    """``jax.make_mesh``'s default axes are Explicit, where a sharding constraint is refused:
    a script's mesh gets the batches ``make_mesh``'s gives, placed on its own mesh."""
    want = augmenting(mesh_of("data:8"))
    explicit = jax.make_mesh((4, 2), ("data", "model"))
    got = augmenting(explicit)
    seen = [stream(ds, 0, 0, 1, size=12, scale=0.35) + [host(b) for b in ds.eval_batches(40)]
            for ds in (want, got)]  # fmt: skip
    for a, b in zip(*seen, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert next(got.eval_batches(40))["image"].sharding.mesh == explicit


SHORT_LABELS = {**indexed(), "label": np.arange(100)}
NO_CHANNEL = {**indexed(), "image": indexed()["image"][..., 0]}


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"train": indexed()}, TypeError, r"train \{size: .*got train as a dict with keys \['im"),
        ({"train": {16: SHORT_LABELS}}, DataError, "at 16 px has 256 images and 100 labels; pass"),
        ({"test": SHORT_LABELS}, DataError, "the test set has 256 images and 100 labels"),
        ({"train": {16: NO_CHANNEL}}, DataError, r"shape \(256, 16, 16\); pass them as \(N, s"),
        ({"batch": 30}, ConfigError, "train batch of 30 does not divide over the 8 .*e.g. a .* 24"),
        ({"eval_batch": 30}, ConfigError, "a global eval batch of 30 does not divide over the 8"),
    ],
)
def test_a_set_or_batch_in_the_wrong_form_is_refused_in_one_line(change, error, match):
    """Sets as a script may pass them: one clear error, not numpy's or JAX's, before any
    batch is made (of 256 images and 100 labels, only 100 examples were used)."""
    args = {"train": {16: indexed()}, "test": indexed(60), **change}
    with pytest.raises(error, match=match):
        ds = on_device.DeviceSet(mesh_of("data:8"), 3, args["train"], args["test"])
        if "batch" in change:
            next(ds.train_batches(0, 0, 1, change["batch"], 16, 1.0))
        next(ds.eval_batches(change.get("eval_batch", 40)))


# ---- digits through the trainer ---------------------------------------------------------------


def records(workdir, event):
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def final_state(run, workdir):
    saver = checkpoint.Checkpoints(checkpoint.checkpoint_dir(run.config, str(workdir)))
    _, state, _, _ = saver.restore(run.program.abstract_state())
    saver.close()
    return state


ON = {"data.on_device": True, "checkpoint.every_steps": 3}
TINY_DIGITS_ON = {**TINY_DIGITS, "data.on_device": True}


def test_digits_on_device_trains_as_the_host_path_and_resumes_bitwise(tmp_path):
    """The digits batches on the device are the host path's, so the losses are the same to
    the bit; a crash after step 5 resumes from step 3 to the uninterrupted run's state."""
    host_run = trainer.train(setup(tiny_digits(**{"checkpoint.every_steps": 3}),
                                   str(tmp_path / "host")))  # fmt: skip
    run = setup(tiny_digits(**ON), str(tmp_path / "full"))
    full = trainer.train(run)
    assert full["completed"] and host_run["completed"]
    losses = [r["loss"] for r in records(tmp_path / "full", "train")]
    assert losses == [r["loss"] for r in records(tmp_path / "host", "train")]
    assert len(losses) == run.plan.total_steps

    crash = dataclasses.replace(run, workdir=str(tmp_path / "crash"))
    with pytest.raises(RuntimeError, match="crash at step 5"):
        trainer.train(crash, hooks=[CrashAt(5)])
    resumed = trainer.train(dataclasses.replace(crash))
    assert resumed["completed"] and resumed["resumed_from"] == 3
    a, b = final_state(run, tmp_path / "full"), final_state(run, tmp_path / "crash")
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 50
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    after = [r["loss"] for r in records(tmp_path / "crash", "train")][-(len(losses) - 3) :]
    assert after == losses[3:]


NO_TENSORFLOW = (
    "import sys; sys.modules['tensorflow'] = None; "  # an import of it fails
    "from hybridpar.tools import train; {call}; "
    "del sys.modules['tensorflow']; "
    "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; print('NO_TENSORFLOW')"
)


def test_the_cli_trains_digits_on_device_without_tensorflow(tmp_path):
    argv = ["--config", str(ROOT / "experiments" / "digits.py"), "--workdir", str(tmp_path),
            "--config.mesh=data:4,model:2", *config_args(TINY_DIGITS_ON)]  # fmt: skip
    code = NO_TENSORFLOW.format(call=f"train.main({argv!r})")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(8),
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and "NO_TENSORFLOW" in r.stdout, r.stderr[-3000:]
    assert "data on the devices" in r.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["final_eval"]["examples"] == 360


# ---- images: the Pillow cache ------------------------------------------------------------------


def image_folder(root: Path, n=6, size=(24, 20)):
    """SPLIT/CLASS/FILE with 2 classes of ``n`` small JPEG and PNG images (not square)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), np.uint8)
                ext = "png" if i % 2 else "jpg"
                Image.fromarray(pixels).save(root / split / cls / f"{i}.{ext}")
    return root


def images_config(tmp_path, source, **kw):
    c = base_config()
    c.mesh = "data:8"
    c.data.update(name="images", source=str(source), prepared_dir=str(tmp_path / "prep"))
    c.data.update(image_size=16, num_classes=2, on_device=True, min_scale=0.5, translate=1)
    c.data.update(**kw)
    c.global_batch, c.eval_batch = 8, 8
    validate(c)
    return c


def test_images_are_decoded_once_reused_and_decoded_again_when_the_source_changes(tmp_path, capsys):
    source = image_folder(tmp_path / "src")
    c = images_config(tmp_path, source)
    data = datasets.make_data(c, 0, 1)
    out = capsys.readouterr().out
    assert out.count("decoding split") == 2 and "not decoded yet" in out
    assert "reusing" not in out  # (a fresh decode is no reuse: planted, it said both)
    cache = tmp_path / "prep" / "on_device"
    assert sorted(p.name for p in cache.glob("*px.*")) == [
        "test-16px.json", "test-16px.npz", "train-16px.json", "train-16px.npz"]  # fmt: skip
    assert data.info["train_examples"] == data.info["eval_examples"] == 12
    first = [host(b) for b in data.train_batches(0)]
    assert first[0]["image"].shape == (8, 16, 16, 3)  # 24x20 resized and centre-cropped

    again = datasets.make_data(c, 0, 1)
    out = capsys.readouterr().out
    assert "decoding" not in out
    # the reuse said, as the tf.data path says its own (planted: no line fails it)
    assert [x for x in out.splitlines() if x.startswith("reusing")] == [
        f"reusing the decoded copy {cache / f'{s}-16px.npz'} (12 examples of split {s!r})"
        for s in ("train", "test")], out  # fmt: skip
    for a, b in zip(first, [host(b) for b in again.train_batches(0)], strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])

    from PIL import Image

    Image.new("RGB", (20, 20)).save(source / "train" / "dog" / "new.png")
    changed = datasets.make_data(c, 0, 1)
    out = capsys.readouterr().out
    assert out.count("decoding split") == 1 and "'train'" in out and "files" in out, out
    assert changed.info["train_examples"] == 13 and changed.info["eval_examples"] == 12


def test_a_train_class_without_examples_is_refused_on_device_as_when_prepared(tmp_path):
    """The rule and the message of prepare (the tf.data path): an empty train class folder,
    a class whose every file is skipped, or a listed class with no folder is an error unless
    data.allow_empty_classes; then it trains, and the data event says which."""
    source = image_folder(tmp_path / "src")
    (source / "train" / "horse").mkdir()
    message = (
        r"train split 'train' of .* has no usable example of class\(es\) 'horse' "
        r"\(empty folder\).*data.allow_empty_classes"
    )
    with pytest.raises(DataError, match=message):
        datasets.make_data(images_config(tmp_path, source, num_classes=3), 0, 1)
    (source / "train" / "horse" / "1.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"'horse' \(all 1 files skipped\)"):
        datasets.make_data(images_config(tmp_path, source, num_classes=3), 0, 1)
    c = images_config(tmp_path, source, num_classes=4, classes="cat,dog,horse,yak")
    with pytest.raises(DataError, match=r"class\(es\) 'yak' \(no folder\)"):  # before decoding
        datasets.make_data(c, 0, 1)
    c.data.allow_empty_classes = True
    info = datasets.make_data(c, 0, 1).info
    assert info["train_examples"] == 12 and info["classes"] == ["cat", "dog", "horse", "yak"]
    train = info["splits"]["train"]
    assert train["classes_without_examples"] == ["horse", "yak"] and train["skipped"] == 1
    assert info["splits"]["test"]["classes_without_examples"] == ["horse", "yak"]


def test_cifar10_test_tar_on_device_in_a_process_without_tensorflow(tmp_path):
    """test.tar (10,000 JPEGs) as both splits: decoded with Pillow in a process where
    TensorFlow cannot be imported, every test image once in eval, the labels all 10."""
    data = require_shared_data("cifar10-jpeg/test.tar")
    tar = data / "cifar10-jpeg" / "test.tar"
    call = (
        "from hybridpar.config.schema import base_config; from hybridpar.input import datasets; "
        "import numpy as np; c = base_config(); c.mesh = 'data:8'; "
        f"c.data.update(name='images', source={str(tar)!r}, prepared_dir={str(tmp_path)!r}, "
        "train_split='test', image_size=32, num_classes=10, on_device=True, min_scale=1.0, "
        "translate=2, eval_crop_ratio=1.0); c.global_batch = 512; c.eval_batch = 1000; "
        "d = datasets.make_data(c, 0, 1); b = next(iter(d.train_batches(0))); "
        "e = [np.asarray(x['mask']) for x in d.eval_batches()]; "
        "assert b['image'].shape == (512, 32, 32, 3) and b['image'].dtype == np.uint8; "
        "assert sorted(set(np.asarray(b['label']).tolist())) == list(range(10)); "
        "assert sum(m.sum() for m in e) == 10000 and d.steps_per_epoch == 19"
    )
    code = NO_TENSORFLOW.format(call=call)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(8),
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and "NO_TENSORFLOW" in r.stdout, r.stderr[-3000:]
    meta = json.loads((tmp_path / "on_device" / "test-32px.json").read_text())
    assert meta["num_examples"] == 10000 and meta["fingerprint"]["kind"] == "tar"


# ---- refusals ----------------------------------------------------------------------------------


def test_a_set_that_does_not_fit_is_refused_in_one_line(tmp_path):
    c = tiny_digits(**{"data.on_device": True, "data.on_device_limit_mb": 0.1})
    with pytest.raises(DataError) as e:
        datasets.make_data(c, 0, 1)
    msg = str(e.value)
    assert "\n" not in msg and "0.4 MiB on each device" in msg and "0.1 MiB allowed" in msg
    assert "data.on_device=False" in msg
    # images: refused from the file count, before anything is decoded
    source = image_folder(tmp_path / "src")
    with pytest.raises(DataError, match=r"12 train images, 12 test images at 16x16"):
        datasets.make_data(images_config(tmp_path, source, on_device_limit_mb=0.001), 0, 1)
    assert not list((tmp_path / "prep" / "on_device").glob("*.npz"))
    c = base_config()
    c.data.update(name="tfds", on_device=True)
    with pytest.raises(ConfigError, match="data.on_device=False"):
        validate(c)


def test_the_default_limit_on_cpu_is_the_documented_one():
    limit, why = on_device.device_limit(0.0, jax.devices()[0])
    assert limit == on_device.CPU_LIMIT_MB * 2**20 and "reports no memory" in why
    assert on_device.device_limit(64, jax.devices()[0]) == (64 * 2**20, "data.on_device_limit_mb")


def test_decoding_shows_progress_and_says_what_it_skipped_and_converted(tmp_path, capsys):
    """prepare's bar and summary line per split, on the on-device path too."""
    source = image_folder(tmp_path / "src")
    (source / "train" / "cat" / "broken.jpg").write_bytes(b"not an image")
    datasets.make_data(images_config(tmp_path, source), 0, 1)
    err = capsys.readouterr().err
    assert "train: 12 examples from " in err and "test: 12 examples from " in err, err
    assert "; 1 skipped, 6 converted (0 rotated upright by EXIF); " in err  # 6 PNGs
    assert "; 0 skipped, 6 converted " in err
    assert "13/13 [" in err and "12/12 [" in err  # the progress bars, done


def test_decoding_holds_the_set_once_in_host_memory(tmp_path, monkeypatch):
    """The decoded images went into a list and then an np.stack of it: twice the set in host
    memory (4,000 images at 128 px: 188 MiB of arrays, 439 MiB peak). Now each image goes
    into one array made up front. Measured from the decode's start to its save, with a
    stand-in for Pillow (fast; each image a new array, as Pillow's). Planted bug that fails
    it: the list and np.stack back."""
    import tracemalloc

    for split, n in (("train", 1500), ("test", 4)):
        for cls in ("cat", "dog"):
            (tmp_path / "src" / split / cls).mkdir(parents=True)
            for i in range(n):
                (tmp_path / "src" / split / cls / f"{i}.jpg").write_bytes(b"a photo")
    decode, save, held = on_device.decode_split, np.savez, []

    def decoding(*args):
        tracemalloc.start()
        held.append(tracemalloc.get_traced_memory()[0])
        try:
            return decode(*args)
        finally:
            tracemalloc.stop()

    def saving(path, **arrays):
        held[-1] = tracemalloc.get_traced_memory()[1] - held[-1]  # the peak, from the start
        return save(path, **arrays)

    monkeypatch.setattr(on_device, "decode_split", decoding)
    monkeypatch.setattr(on_device.np, "savez", saving)
    monkeypatch.setattr(
        on_device,
        "decode_image",
        lambda data, size: (np.full((size, size, 3), 7, np.uint8), None, None),
    )
    datasets.make_data(images_config(tmp_path, tmp_path / "src", image_size=32), 0, 1)
    images = 3000 * 32 * 32 * 3
    assert held[0] < 1.5 * images, held[0] / images  # twice and more before


def test_a_disk_full_while_caching_the_decoded_set_is_one_error_and_leaves_nothing(
    tmp_path, monkeypatch
):
    """np.savez's OSError (errno 28) was a traceback and left train-16px.npz.tmp.npz
    behind. Planted bug that fails it: the write without its OSError clause."""
    import errno

    def full(path, **arrays):
        with open(path, "wb") as f:
            f.write(b"PK partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(on_device.np, "savez", full)
    source = image_folder(tmp_path / "src")
    with pytest.raises(DataError) as e:
        datasets.make_data(images_config(tmp_path, source), 0, 1)
    folder = tmp_path / "prep" / "on_device"
    assert str(e.value).startswith(
        f"cannot write the decoded set into {folder} (No space left on device): it takes "
    ), e.value
    assert "point --config.data.prepared_dir at a disk with room" in str(e.value)
    assert not (tmp_path / "prep").exists()  # no partial file; the folders made were removed


def test_a_set_the_host_memory_cannot_hold_is_refused_before_it_is_decoded(
    tmp_path, monkeypatch, capsys
):
    """The set is decoded, loaded and placed from host memory: one larger than what is
    available is refused with its size, as one the device cannot hold, before any decode.
    Planted bug that fails it: ``check_host_fits`` not called."""
    monkeypatch.setattr(on_device, "host_available", lambda: 2**19)
    source = image_folder(tmp_path / "src", n=20)  # 80 images at 64 px: 0.94 MiB
    c = images_config(tmp_path, source, image_size=64)
    with pytest.raises(DataError) as e:
        datasets.make_data(c, 0, 1)
    assert str(e.value) == (
        "data.on_device=True: 40 train images, 40 test images at 64x64 take 0.9 MiB of host "
        "memory while they are decoded and placed, more than the 0.5 MiB available now; set "
        "--config.data.on_device=False to read it from the host, or free memory"
    ), e.value
    assert "decoding" not in capsys.readouterr().out
