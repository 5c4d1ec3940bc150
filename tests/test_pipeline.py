"""The tf.data pipeline over prepared TFRecords (input/pipeline.py, input/transforms.py).

The prepared directory is written here with ``records.encode_example`` and a hand-written
manifest (not by ``prepare``), so these tests pin the reader to the format in records.py.
"""

import io
import json
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from hybridpar.config.errors import ConfigError, DataError
from hybridpar.input import records
from hybridpar.input import transforms as T
from hybridpar.input.pipeline import ImagePipeline
from hybridpar.input.prefetch import chain_ahead, prefetch_to_mesh
from hybridpar.parallel.mesh import make_mesh
from hybridpar.parallel.partitioning import batch_sharding

SHARD_SIZES = [24, 25, 26, 25, 27, 23, 25, 25]  # uneven, so hosts hold different counts
N = sum(SHARD_SIZES)
NUM_CLASSES = 10
PNG_ID, GRAY_ID = 5, 17


def _encode(array, fmt="JPEG"):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _image(rng, h, w):
    """A smooth random-coloured picture (a 4x4 colour grid upsampled), so crops differ."""
    small = rng.integers(0, 256, (4, 4, 3), np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR))


def _write_prepared(root):
    rng = np.random.default_rng(0)
    split = "train"
    copies = {
        "full": {"max_side": None, "quality": None, "serves_up_to": None, "shards": []},
        "64px": {"max_side": 64, "quality": 90, "serves_up_to": 51, "shards": []},
    }
    writers, ex_id = {}, 0
    for s, size in enumerate(SHARD_SIZES):
        for copy in copies:
            rel = f"{split}/{copy}/{split}-{copy}-{s:05d}-of-{len(SHARD_SIZES):05d}.tfrecord"
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            writers[copy] = tf.io.TFRecordWriter(os.path.join(root, rel))
            copies[copy]["shards"].append({"file": rel, "num_examples": size})
        for _ in range(size):
            label = ex_id % NUM_CLASSES
            h, w = (int(v) for v in rng.integers(20, 97, 2))
            img = _image(rng, h, w)
            if ex_id == GRAY_ID:
                img = img[..., 0]
            full = _encode(img, "PNG" if ex_id == PNG_ID else "JPEG")
            small = Image.fromarray(img)
            small.thumbnail((64, 64))
            name = f"c{label}/{ex_id}.jpg"
            writers["full"].write(records.encode_example(full, label, ex_id, name))
            writers["64px"].write(
                records.encode_example(_encode(np.asarray(small)), label, ex_id, name)
            )
            ex_id += 1
        for wr in writers.values():
            wr.close()
    manifest = {
        "format": records.FORMAT,
        "splits": {
            split: {
                "source": "synthetic",
                "classes": [f"c{i}" for i in range(NUM_CLASSES)],
                "num_examples": N,
                "skipped": [{"name": "c0/bad.jpg", "reason": "truncated JPEG"}],
                "converted": [],
                "copies": copies,
            }
        },
    }
    with open(os.path.join(root, records.MANIFEST), "w") as f:
        json.dump(manifest, f)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("prepared"))
    _write_prepared(root)
    return root


def _epoch(pipe, epoch=0, **kw):
    kw = {"image_size": 32, "global_batch": 16, **kw}
    return list(pipe.train_batches(epoch, **kw))


def _same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_shapes_dtypes_and_training_order(prepared):
    pipe = ImagePipeline(prepared, "train", process_index=0, process_count=1)
    assert (pipe.num_examples, pipe.num_classes, pipe.skipped, pipe.converted) == (N, 10, 1, 0)
    assert pipe.steps_per_epoch(16) == N // 16
    for size in (32, 64):
        batches = _epoch(pipe, image_size=size)
        assert len(batches) == N // 16
        for b in batches:
            assert set(b) == {"image", "label"}
            assert b["image"].shape == (16, size, size, 3) and b["image"].dtype == np.uint8
            assert b["label"].shape == (16,) and b["label"].dtype == np.int32
        # The batches follow examples(epoch), the epoch's training order.
        order = list(pipe.examples(0))[: len(batches) * 16]
        np.testing.assert_array_equal(
            np.concatenate([b["label"] for b in batches]), [label for _, label in order]
        )
    assert [i % NUM_CLASSES for i, _ in order] == [label for _, label in order]


def test_determinism_epochs_and_exact_resume(prepared):
    a = ImagePipeline(prepared, "train", seed=3, process_index=0, process_count=1)
    b = ImagePipeline(prepared, "train", seed=3, process_index=0, process_count=1)
    e0 = _epoch(a, 0)
    assert _same(e0, _epoch(b, 0))
    e1 = _epoch(a, 1)
    assert not np.array_equal(e0[0]["image"], e1[0]["image"])
    assert [i for i, _ in a.examples(0)] != [i for i, _ in a.examples(1)]
    # Resuming at step k gives batches k.. of the uninterrupted epoch.
    assert _same(_epoch(b, 0, start_step=5), e0[5:])
    assert _epoch(b, 0, start_step=len(e0)) == []


def test_two_hosts_read_disjoint_examples(prepared):
    hosts = [ImagePipeline(prepared, "train", process_index=p, process_count=2) for p in (0, 1)]
    assert set(hosts[0].files("full")).isdisjoint(hosts[1].files("full"))
    assert hosts[0].steps_per_epoch(16) == hosts[1].steps_per_epoch(16)
    assert hosts[0].eval_steps(16) == hosts[1].eval_steps(16)
    for epoch in (0, 1):
        ids = [[i for i, _ in h.examples(epoch)] for h in hosts]
        assert set(ids[0]).isdisjoint(ids[1])
        assert sorted(ids[0] + ids[1]) == list(range(N))
    steps = hosts[0].steps_per_epoch(16)
    assert steps == min(hosts[0].host_counts) // 8
    batches = [_epoch(h, 0) for h in hosts]
    assert all(len(b) == steps and b[0]["image"].shape[0] == 8 for b in batches)


def test_eval_every_example_once_over_two_hosts(prepared):
    seen, total_mask = [], 0.0
    for p in (0, 1):
        pipe = ImagePipeline(prepared, "train", process_index=p, process_count=2)
        batches = list(pipe.eval_batches(image_size=32, global_batch=16, with_ids=True))
        assert len(batches) == pipe.eval_steps(16) == -(-max(pipe.host_counts) // 8)
        for b in batches:
            assert b["image"].shape == (8, 32, 32, 3) and b["image"].dtype == np.uint8
            assert b["label"].dtype == np.int32 and b["mask"].dtype == np.float32
            real = b["mask"] == 1
            assert set(np.unique(b["mask"])) <= {0.0, 1.0}
            np.testing.assert_array_equal(b["label"][real], b["id"][real] % NUM_CLASSES)
            assert not b["image"][~real].any() and not b["label"][~real].any()
            assert (b["id"][~real] == -1).all()
            seen += b["id"][real].tolist()
            total_mask += b["mask"].sum()
        # The ids of this host, in file order.
        mine = [s for s in range(len(SHARD_SIZES)) if s % 2 == p]
        starts = np.cumsum([0] + SHARD_SIZES)
        expect = [i for s in mine for i in range(starts[s], starts[s + 1])]
        assert seen[-len(expect) :] == expect
    assert total_mask == N and sorted(seen) == list(range(N))


def test_image_size_chooses_copy(prepared, tmp_path):
    pipe = ImagePipeline(prepared, "train", process_index=0, process_count=1)
    assert pipe.copy_for(32) == pipe.copy_for(51) == "64px"
    assert pipe.copy_for(52) == pipe.copy_for(224) == "full"
    # Without the full copy's files, small stages still run and large ones cannot.
    root = str(tmp_path / "p")
    shutil.copytree(prepared, root)
    shutil.rmtree(os.path.join(root, "train", "full"))
    pipe = ImagePipeline(root, "train", process_index=0, process_count=1)
    assert len(_epoch(pipe, image_size=32)) == N // 16
    assert len(list(pipe.eval_batches(image_size=48, global_batch=16))) == -(-N // 16)
    with pytest.raises(DataError, match="train-full-00000-of-.* is gone: the prepared copy"):
        next(pipe.train_batches(0, image_size=64, global_batch=16))


def test_ram_cache_same_batches_and_kept_across_epochs(prepared, tmp_path):
    root = str(tmp_path / "p")
    shutil.copytree(prepared, root)
    plain = ImagePipeline(prepared, "train", process_index=0, process_count=1)
    cached = ImagePipeline(root, "train", process_index=0, process_count=1, ram_cache=True)
    # Stop pulling right after the last batch: the cache must be complete all the same.
    it = cached.train_batches(0, image_size=32, global_batch=16)
    first = [next(it) for _ in range(cached.steps_per_epoch(16))]
    assert _same(first, _epoch(plain, 0))
    shutil.rmtree(os.path.join(root, "train"))  # later epochs read RAM only
    assert _same(
        _epoch(cached, 1, global_batch=8, min_scale=0.5),
        _epoch(plain, 1, global_batch=8, min_scale=0.5),
    )
    assert _same(_epoch(cached, 2, start_step=4), _epoch(plain, 2, start_step=4))


def test_one_pipeline_across_epochs_gives_each_epochs_own_batches(prepared, tmp_path):
    """``steps`` past the epoch's end: one tf.data pipeline over several epochs (as the
    trainer reads a stage), batch for batch the epochs read one by one."""
    root = str(tmp_path / "p")
    shutil.copytree(prepared, root)
    plain = ImagePipeline(prepared, "train", seed=2, process_index=0, process_count=1)
    cached = ImagePipeline(root, "train", seed=2, process_index=0, process_count=1, ram_cache=True)
    spe = plain.steps_per_epoch(16)
    one_by_one = _epoch(plain, 3, start_step=5)
    for epoch in range(4, 9):
        one_by_one += _epoch(plain, epoch)
    one_by_one += _epoch(plain, 9)[:2]
    steps = 6 * spe - 5 + 2
    assert _same(_epoch(plain, 3, start_step=5, steps=steps), one_by_one)
    # With the RAM cache: the files are read by the first epoch (and the next ones, opened
    # ahead while it runs); the epochs opened after that read RAM only.
    it = cached.train_batches(3, image_size=32, global_batch=16, start_step=5, steps=steps)
    spanned = [next(it) for _ in range(spe - 5 + 1)]
    shutil.rmtree(os.path.join(root, "train"))
    assert _same(spanned + list(it), one_by_one)
    assert _epoch(plain, 0, steps=0) == []
    with pytest.raises(ConfigError, match="steps -1"):
        plain.train_dataset(0, image_size=32, global_batch=16, steps=-1)


def test_decoding_skips_the_format_test_and_dct_branches_only_where_they_cannot_matter(
    prepared, tmp_path
):
    """``encoding: jpeg`` (which prepare writes) drops the per-image format test; a copy
    whose median shorter side (or else longest side) is under 4x the size drops the DCT-scale
    branches. The batches stay the same, and a copy without the fields (this hand-made one
    holds a PNG record) keeps the format test."""
    pipe = ImagePipeline(prepared, "train", process_index=0, process_count=1)
    assert pipe.decoding_for("full", 16) == {"jpeg_only": False, "dct_scaling": True}
    assert pipe.decoding_for("64px", 16) == {"jpeg_only": False, "dct_scaling": True}  # 64 >= 4x16
    assert pipe.decoding_for("64px", 17)["dct_scaling"] is False
    nodct = ImagePipeline(prepared, "train", process_index=0, process_count=1, dct_scaling=False)
    assert nodct.decoding_for("full", 16)["dct_scaling"] is False
    # The 64-px copy is all JPEG: marked so, it reads the same batches without the test.
    root = str(tmp_path / "p")
    shutil.copytree(prepared, root)
    path = os.path.join(root, records.MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["splits"]["train"]["copies"]["64px"]["encoding"] = "jpeg"
    manifest["splits"]["train"]["copies"]["full"]["median_short_side"] = 100
    with open(path, "w") as f:
        json.dump(manifest, f)
    marked = ImagePipeline(root, "train", process_index=0, process_count=1)
    assert marked.decoding_for("64px", 40) == {"jpeg_only": True, "dct_scaling": False}
    assert marked.decoding_for("full", 40) == {"jpeg_only": False, "dct_scaling": False}
    assert marked.decoding_for("full", 25)["dct_scaling"] is True  # 4 x 25 <= the median 100
    assert marked.decoding_for("full", 26)["dct_scaling"] is False
    kw = {"image_size": 40, "global_batch": 16}
    assert _same(_epoch(marked, 1, **kw), _epoch(pipe, 1, **kw))
    assert _same(
        list(marked.eval_batches(image_size=40, global_batch=16)),
        list(pipe.eval_batches(image_size=40, global_batch=16)),
    )


def test_transforms_fused_and_fallback_decoders():
    rng = np.random.default_rng(1)
    img = _image(rng, 75, 120)
    fn = tf.function(lambda b, s: T.train_transform(b, s, 40))
    for data in (_encode(img), _encode(img, "PNG"), _encode(img[..., 0])):
        x = fn(tf.constant(data), tf.constant([4, 2], tf.int32)).numpy()
        assert x.shape == (40, 40, 3) and x.dtype == np.uint8
        np.testing.assert_array_equal(x, fn(tf.constant(data), tf.constant([4, 2], tf.int32)))
        assert not np.array_equal(x, fn(tf.constant(data), tf.constant([4, 3], tf.int32)))
        e = T.eval_transform(tf.constant(data), 40).numpy()
        assert e.shape == (40, 40, 3) and e.dtype == np.uint8
    gray = T.train_transform(tf.constant(_encode(img[..., 0])), tf.constant([1, 1]), 16).numpy()
    np.testing.assert_array_equal(gray[..., 0], gray[..., 2])
    # Centre crop: a picture black on the left half and white on the right stays symmetric.
    half = np.zeros((100, 200, 3), np.uint8)
    half[:, 100:] = 255
    for data in (_encode(half), _encode(half, "PNG")):
        e = T.eval_transform(tf.constant(data), 32).numpy().astype(float)
        assert e[:, :15].max() < 30 and e[:, 17:].min() > 225
        assert np.abs(e[:, ::-1] - (255 - e)).max() <= 8


def test_config_errors(prepared, tmp_path):
    with pytest.raises(ConfigError, match="hybridpar.input.prepare"):
        ImagePipeline(str(tmp_path / "missing"), "train", process_index=0, process_count=1)
    with pytest.raises(ConfigError, match="not prepared"):
        ImagePipeline(prepared, "validation", process_index=0, process_count=1)
    pipe = ImagePipeline(prepared, "train", process_index=1, process_count=2)
    with pytest.raises(ConfigError, match="divide"):
        pipe.steps_per_epoch(15)
    with pytest.raises(ConfigError, match="divide"):
        pipe.train_batches(0, image_size=32, global_batch=15)
    with pytest.raises(ConfigError, match="larger than"):
        pipe.train_batches(0, image_size=32, global_batch=400)
    with pytest.raises(ConfigError, match="shard files"):
        ImagePipeline(prepared, "train", process_index=0, process_count=9)


def test_chain_ahead_opens_the_next_input_while_the_one_before_is_read():
    """An epoch's or stage's input is opened (and its first batch read) while the one before
    it is consumed, not after its last item: a sequential chain never sets ``opened[1]``
    while input 0 is still being read, and the wait below times out."""
    opened = [threading.Event() for _ in range(3)]

    def opener(i):
        def open_input():
            opened[i].set()
            return iter(range(10 * i, 10 * i + 3))

        return open_input

    stream = chain_ahead(opener(i) for i in range(3))
    assert next(stream) == 0
    assert opened[1].wait(timeout=20), "input 1 was not opened while input 0 was read"
    assert not opened[2].is_set(), "only the next input is opened ahead"
    assert [0, *stream] == [0, 1, 2, 10, 11, 12, 20, 21, 22]


def test_chain_ahead_skips_empty_inputs_and_raises_an_openers_error_in_order():
    def broken():
        raise RuntimeError("opener broke")

    stream = chain_ahead([lambda: iter([1, 2]), lambda: iter([]), broken])
    assert [next(stream), next(stream)] == [1, 2]
    with pytest.raises(RuntimeError, match="opener broke"):
        next(stream)


def test_prefetch_to_mesh(prepared):
    mesh = make_mesh("data:8")
    pipe = ImagePipeline(prepared, "train")  # process index/count from JAX
    assert (pipe.process_index, pipe.process_count) == (0, 1)
    expect = _epoch(pipe, 0)[:4]
    got = list(prefetch_to_mesh(iter(expect), mesh, size=2))
    assert len(got) == 4
    for g, e in zip(got, expect):
        for k in ("image", "label"):
            assert isinstance(g[k], jax.Array)
            assert g[k].sharding.is_equivalent_to(batch_sharding(mesh, e[k].ndim), e[k].ndim)
            np.testing.assert_array_equal(np.asarray(g[k]), e[k])
    # Errors in the producer reach the consumer; stopping early stops the producer.

    def broken():
        yield expect[0]
        raise RuntimeError("reader broke")

    with pytest.raises(RuntimeError, match="reader broke"):
        list(prefetch_to_mesh(broken(), mesh))
    # An endless source: a producer that kept going after close() would keep pulling.
    pulled = []

    def endless():
        while True:
            pulled.append(len(pulled))
            yield expect[0]

    gen = prefetch_to_mesh(endless(), mesh, size=1)
    next(gen)
    gen.close()
    producers = [t for t in threading.enumerate() if t.name == "prefetch_to_mesh"]
    for t in producers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in producers), "the producer outlived close()"
    stopped_at = len(pulled)
    # one batch handed out, one in the queue, one waiting to be put, one being placed
    assert stopped_at <= 4, f"the producer pulled {stopped_at} batches for one consumed"
    time.sleep(0.3)
    assert len(pulled) == stopped_at


def test_importing_the_pipeline_logs_nothing():
    """TensorFlow's start-up banners (oneDNN, CPU features) are not a training run's output:
    a bad-input run would show them above its one error line."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    proc = subprocess.run(
        [sys.executable, "-c", "import hybridpar.input.pipeline"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr
