"""Input throughput: our tf.data train transform vs a plain PIL loader, on real ImageNet photos.

    python bench/input_pipeline.py [--images 2000] [--repeats 3] [--workers 2]

Data: ``$HYBRIDPAR_DATA/imagenet-sample/train.tar`` (1,000 real ImageNet photos, median
500x375), prepared once into a temp dir with the full copy and reduced copies of longest side
160 (serves 128 px) and 280 (serves 224 px). Each measurement decodes ``--images`` images
(the 1,000 repeated; tf.data reads the whole epochs that hold them as one pipeline, as the
trainer reads a curriculum stage) at 128 and 224 px on all cores:

* ``tfdata/full``: random-resized crop fused into JPEG decoding, from the original bytes;
* ``tfdata/full+dct``: the same with reduced-scale decoding of large crops forced on (the
  pipeline leaves it out on these photos, whose median shorter side of 374 px is under 4 x
  128): this row against the one above says what it would gain here;
* ``tfdata/reduced``: the same from the reduced copy (MoXing's "data compression" level);
* ``pil``: the reference a user would write: decode the whole image with PIL, random-resized
  crop, resize (bilinear), flip, in a multiprocessing pool of the same number of processes.

* ``bare``: the decoder's own limit: ``decode_and_crop_jpeg`` (full scale) + bilinear resize
  of the same kind of random crops, one thread, no tf.data (one graph loop over the encoded
  bytes, in a spawned process with TF's thread pools at 1): what one core can do at most
  without reduced-scale decoding. Per core, ``tfdata/full`` is compared with it.

Loaders run interleaved, the bare decoder in the same rounds (so a slow spell of this
shared machine slows both sides), median of repeats. The last line starts with the ratios: the full
copy per core vs PIL per core at 128 px (target >= 2) and vs the bare decoder at 224 px
(target >= 0.9), then the best ratios over both copies.

Then, for the full copy alone, where its time goes: the seconds from opening its input to
the first batch, and the rate after it (``full_steady_per_core_vs_bare_224``). The trainer
opens one input per curriculum stage (and the next while the one before is read).

A count under 1 or missing data: one ``error:`` line, exit code 2, before the data is prepared.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import random
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridpar.config import cli
from hybridpar.simulate.cli import count

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HYBRIDPAR_DATA", ROOT.parent / "shared" / "data"))
# Assumed, not measured here: MLPerf's 8 x H200 ResNet-50 result is about 7,700 images/s
# per GPU at 224 px (hybridpar/simulate/hardware.py, the h200 preset); at 128 px a step
# costs about (128/224)^2 of the FLOPs, so about 3x that rate.
GPU_RATE = {224: 7700, 128: 7700 * 3}
BATCH = 50  # per tf.data batch in every measurement


def pil_sample(args):
    """Decode the whole image, random-resized crop (torchvision's sampling), resize, flip."""
    from PIL import Image

    path, size, seed = args
    rng = random.Random(seed)
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        area = w * h
        for _ in range(10):
            target = area * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
                break
        else:  # centre crop, as torchvision falls back
            cw = ch = min(w, h)
            x, y = (w - cw) // 2, (h - ch) // 2
        im = im.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(im, np.uint8).shape


def time_pil(pool, paths, size, n, epoch):
    jobs = [(paths[i % len(paths)], size, epoch * n + i) for i in range(n)]
    t0 = time.perf_counter()
    for _ in pool.imap_unordered(pil_sample, jobs, chunksize=16):
        pass
    return n / (time.perf_counter() - t0)


_BARE: dict = {}  # the bare decoder's process: its records, crop windows and traced loops


def bare_init(prepared, sizes):
    """Sets up the bare decoder in its own (spawned) process, TF's thread pools at 1: the
    encoded records, the train transform's random-resized crops (drawn here, outside the
    timing) and, per size, one traced graph loop over them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from hybridpar.input import transforms as T
    from hybridpar.input.pipeline import ImagePipeline

    pipe = ImagePipeline(prepared, "train", process_index=0, process_count=1)
    recs = list(pipe._records("full", ordered=True, cache=False).as_numpy_iterator())
    data = tf.constant([r["image"] for r in recs])
    ids = tf.range(len(recs), dtype=tf.int64)

    @tf.function
    def windows():
        def one(x):
            shape = tf.image.extract_jpeg_shape(x[0])
            seed = tf.stack([tf.constant(7, tf.int64), x[1]])
            return tf.stack(T.random_window(shape, seed, 0.08, 1.0, (3 / 4, 4 / 3)))

        return tf.map_fn(one, (data, ids), fn_output_signature=tf.int32)

    win = windows()
    for size in sizes:

        @tf.function
        def bare(size=size):
            def one(x):
                image = tf.image.decode_and_crop_jpeg(x[0], x[1], channels=3)
                return T._resize_uint8(image, size)

            spec = tf.TensorSpec([size, size, 3], tf.uint8)
            return tf.map_fn(one, (data, win), fn_output_signature=spec, parallel_iterations=1)

        bare()  # traced and warm
        _BARE[size] = bare
    _BARE["n"] = len(recs)


def bare_rate(size):
    """Images/s of one pass of the bare decoder at ``size`` (in the ``bare_init`` process)."""
    t0 = time.perf_counter()
    _BARE[size]()
    return _BARE["n"] / (time.perf_counter() - t0)


def time_tfdata(pipe, size, n, copy, batch=BATCH):
    """Images/s over the epochs that hold ``n`` images, read as the trainer reads a stage:
    one pipeline across them (``train_batches(..., steps=)``), every epoch read to its end.
    The timing starts when the input is asked for, so it includes opening it."""
    per_epoch = pipe.steps_per_epoch(batch) * batch
    steps = max(1, math.ceil(n / per_epoch)) * pipe.steps_per_epoch(batch)
    t0 = time.perf_counter()
    batches = pipe.train_batches(0, image_size=size, global_batch=batch, copy=copy, steps=steps)
    done = sum(len(b["label"]) for b in batches)
    return done / (time.perf_counter() - t0)


def time_open(pipe, size, epochs, batch=BATCH):
    """(seconds to an input's first batch, images/s after it): what opening an input of one
    epoch costs (graph build, function instantiation, the shuffle buffer's fill, the first
    batch) and the rate once it runs, batches handed over as numpy as the trainer takes
    them. Median over ``epochs`` epochs, each opened alone (nothing overlaps)."""
    opens, rates = [], []
    for e in range(1, epochs + 1):
        t0 = time.perf_counter()
        ds = pipe.train_dataset(e, image_size=size, global_batch=batch, copy="full")
        it = ds.as_numpy_iterator()
        next(it)
        t1 = time.perf_counter()
        done = sum(len(b["label"]) for b in it)
        opens.append(t1 - t0)
        rates.append(done / (time.perf_counter() - t1))
    return statistics.median(opens), statistics.median(rates)


def main(argv=None):
    p = cli.ArgumentParser("python bench/input_pipeline.py", __doc__.splitlines()[0],
                           takes_config=False)  # fmt: skip
    p.add_argument("--images", type=count("a number of images", "2000"), default=2000,
                   help="images per measurement")  # fmt: skip
    p.add_argument("--repeats", type=count("a number of repeats", "3"), default=3)
    p.add_argument("--workers", type=count("a number of cores", "2"), default=os.cpu_count(),
                   help="cores to use")  # fmt: skip
    args = p.parse_args(argv)
    tar = DATA / "imagenet-sample" / "train.tar"
    if not tar.is_file():  # before the minutes of preparing it
        cli.fail(f"{tar} not found; set HYBRIDPAR_DATA to the shared data folder")

    from hybridpar.input.pipeline import ImagePipeline
    from hybridpar.input.prepare import prepare

    tmp = Path(tempfile.mkdtemp(prefix="bench_input_"))
    with tarfile.open(tar) as t:  # the PIL loader reads the original files from disk
        t.extractall(tmp / "files", filter="data")
    paths = sorted(str(f) for f in (tmp / "files").rglob("*") if f.is_file())
    t0 = time.perf_counter()
    prepare(
        [str(tar)],
        str(tmp / "prepared"),
        copies=(None, 160, 280),
        workers=args.workers,
        examples_per_shard=128,
        progress=False,
    )
    prep_s = time.perf_counter() - t0
    common = dict(seed=0, process_index=0, process_count=1, ram_cache=True, threads=args.workers)
    pipe = ImagePipeline(str(tmp / "prepared"), "train", **common)
    pipe_dct = ImagePipeline(str(tmp / "prepared"), "train", **common)
    pipe_dct.DCT_MIN_SIDE = 0  # reduced-scale decoding of large crops at every size
    sizes = {"full": pipe.copy_for(10_000)}
    print(
        f"{len(paths)} photos; prepared in {prep_s:.1f}s (copies {sorted(pipe.info['copies'])}); "
        f"{args.workers} workers on {os.cpu_count()} cores; {args.images} images x "
        f"{args.repeats} repeats per cell; RAM cache on (file reads excluded for both loaders: "
        "the OS caches the originals too)"
    )

    names = ("tfdata/full", "tfdata/full+dct", "tfdata/reduced", "pil")
    loaders = [(s, name) for s in (128, 224) for name in names]
    rates = {k: [] for k in loaders}
    ctx = mp.get_context("spawn")
    bare_pool = ctx.Pool(1, bare_init, (str(tmp / "prepared"), (128, 224)))
    bare_runs = {128: [], 224: []}
    with ctx.Pool(args.workers) as pool, bare_pool:
        for s in (128, 224):  # warm-up: caches filled, graphs traced, pools started
            bare_pool.apply(bare_rate, (s,))
            time_tfdata(pipe, s, 200, "full")
            time_tfdata(pipe_dct, s, 200, "full")
            time_tfdata(pipe, s, 200, pipe.copy_for(s))
            time_pil(pool, paths, s, 64, 0)
        for r in range(args.repeats):
            for s, name in loaders:
                if name == "pil":
                    rate = time_pil(pool, paths, s, args.images, r + 1)
                else:
                    copy = pipe.copy_for(s) if name == "tfdata/reduced" else "full"
                    p = pipe_dct if name == "tfdata/full+dct" else pipe
                    rate = time_tfdata(p, s, args.images, copy)
                rates[(s, name)].append(rate)
            for s in (128, 224):  # the bare decoder alone, in the same rounds (idle pools)
                bare_runs[s].append(bare_pool.apply(bare_rate, (s,)))

        # Where the full copy's time goes: opening each epoch, then the steady rate.
        opened = {s: time_open(pipe, s, args.repeats) for s in (128, 224)}
    bare = {s: statistics.median(r) for s, r in bare_runs.items()}

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{'size':>4}  {'loader':<15} {'copy':<6} {'img/s':>8} {'img/s/core':>10} "
        f"{'vs pil':>6} {'cores/GPU':>9}"
    )
    for s, name in loaders:
        copy = "orig" if name == "pil" else sizes["full"]
        copy = pipe.copy_for(s) if name == "tfdata/reduced" else copy
        per_core = med[(s, name)] / args.workers
        print(
            f"{s:>4}  {name:<15} {copy:<6} {med[(s, name)]:>8.0f} {per_core:>10.0f} "
            f"{med[(s, name)] / med[(s, 'pil')]:>6.2f} {GPU_RATE[s] / per_core:>9.0f}"
        )
    for s in (128, 224):
        print(
            f"{s:>4}  {'bare decoder':<15} {'full':<6} {bare[s]:>8.0f} {bare[s]:>10.0f} "
            f"{bare[s] / (med[(s, 'pil')] / args.workers):>6.2f} {GPU_RATE[s] / bare[s]:>9.0f}"
            "   (one thread)"
        )
    per_epoch = pipe.steps_per_epoch(BATCH) * BATCH
    for s in (128, 224):
        open_s, steady = opened[s]
        print(
            f"{s:>4}  tfdata/full: opening an input of one {per_epoch}-image epoch takes "
            f"{open_s:.2f} s to its first batch, then {steady:.0f} img/s "
            f"({steady / args.workers:.0f} per core, "
            f"{steady / args.workers / bare[s]:.2f}x the bare decoder)"
        )
    full_vs_pil_128 = med[(128, "tfdata/full")] / med[(128, "pil")]  # same cores: per core too
    full_vs_bare_224 = med[(224, "tfdata/full")] / args.workers / bare[224]
    best128 = max(med[(128, n)] for n in ("tfdata/full", "tfdata/reduced")) / med[(128, "pil")]
    best224 = max(med[(224, n)] for n in ("tfdata/full", "tfdata/reduced")) / med[(224, "pil")]
    print(
        f"(cores/GPU: an assumed {GPU_RATE[224]} img/s per GPU at 224 px and "
        f"{GPU_RATE[128]} at 128 px, ResNet-50 on an H200 as in MLPerf; not measured here)"
    )
    print(
        f"full_vs_pil_128={full_vs_pil_128:.2f} full_per_core_vs_bare_224={full_vs_bare_224:.2f} "
        f"best_ratio_128={best128:.2f} best_ratio_224={best224:.2f} "
        f"tfdata_reduced_128={med[(128, 'tfdata/reduced')]:.0f} "
        f"tfdata_full_128={med[(128, 'tfdata/full')]:.0f} "
        f"tfdata_full_dct_128={med[(128, 'tfdata/full+dct')]:.0f} "
        f"pil_128={med[(128, 'pil')]:.0f} "
        f"tfdata_reduced_224={med[(224, 'tfdata/reduced')]:.0f} "
        f"tfdata_full_224={med[(224, 'tfdata/full')]:.0f} "
        f"tfdata_full_dct_224={med[(224, 'tfdata/full+dct')]:.0f} "
        f"pil_224={med[(224, 'pil')]:.0f} "
        f"bare_decode_128={bare[128]:.0f} bare_decode_224={bare[224]:.0f} "
        f"full_steady_per_core_vs_bare_224={opened[224][1] / args.workers / bare[224]:.2f} "
        f"epoch_open_s_224={opened[224][0]:.2f} "
        f"workers={args.workers} images={args.images} repeats={args.repeats}"
    )


if __name__ == "__main__":
    main()
