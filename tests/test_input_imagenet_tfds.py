"""ImageNet through tensorflow-datasets' ``imagenet2012`` builder, from a manual_dir in the
real archive layout, made of a few shared sample photos. Nothing is
downloaded: the builder reads ILSVRC2012_img_train.tar (one tar per synset inside) and
ILSVRC2012_img_val.tar (flat ILSVRC2012_val_NNNNNNNN.JPEG files, labelled by the list tfds
ships), as it would read the real 147 GB.
"""

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HYBRIDPAR_DATA", ROOT.parent / "shared" / "data"))
TRAIN_SYNSETS = ["n01440764", "n01443537", "n01484850", "n01491361"]  # the first four classes
NUM_VAL = 3


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def manual_dir(tmp_path_factory):
    tar_path = DATA / "imagenet-sample" / "train.tar"
    if not tar_path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"shared data not found at {tar_path} and CI is set (set HYBRIDPAR_DATA)")
        pytest.skip(f"shared data not found at {tar_path} (set HYBRIDPAR_DATA)")
    tfds = pytest.importorskip("tensorflow_datasets")
    from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

    labels = Path(imagenet_common.label_names_file()).read_text().split()
    val_path = tfds.core.tfds_path("datasets/imagenet2012/validation_labels.txt")
    val_synsets = Path(val_path).read_text().split()[:NUM_VAL]  # the labels of val 1..3
    photos = {}
    with tarfile.open(tar_path) as tar:
        for m in tar:
            synset = m.name.split("/")[1] if m.isreg() else None
            if synset in TRAIN_SYNSETS or synset in val_synsets:
                photos[synset] = (os.path.basename(m.name), tar.extractfile(m).read())
    root = tmp_path_factory.mktemp("imagenet_manual")
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w") as train:
        for synset in TRAIN_SYNSETS:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as t:
                _add(t, photos[synset][0], photos[synset][1])
            _add(train, f"{synset}.tar", inner.getvalue())
    with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as val:
        for i, synset in enumerate(val_synsets):
            _add(val, f"ILSVRC2012_val_{i + 1:08d}.JPEG", photos[synset][1])
    return root, labels, val_synsets


@pytest.fixture(scope="module")
def built(manual_dir, tmp_path_factory):
    from hybridpar.config.errors import ConfigError
    from hybridpar.input.tfds_source import TfdsPipeline

    root, labels, val_synsets = manual_dir
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    try:
        train = TfdsPipeline(
            "imagenet2012",
            "train",
            data_dir=data_dir,
            manual_dir=str(root),
            process_index=0,
            process_count=1,
        )
    except ConfigError as e:
        if "could not be opened" in str(e) and not os.environ.get("CI"):
            pytest.skip(f"tfds's imagenet2012 builder cannot be used offline here: {e}")
        raise
    return train, data_dir, root, labels, val_synsets


def test_imagenet2012_builds_from_the_manual_dir_and_reads_like_prepared_data(built):
    from hybridpar.input.tfds_source import TfdsPipeline

    train, data_dir, root, labels, val_synsets = built
    assert train.num_classes == 1000 and train.num_examples == len(TRAIN_SYNSETS)
    got = sorted(label for _, label in train.examples(0))
    assert got == sorted(labels.index(s) for s in TRAIN_SYNSETS)
    batches = list(train.train_batches(0, image_size=64, global_batch=2))
    assert len(batches) == 2 and batches[0]["image"].shape == (2, 64, 64, 3)
    assert np.mean([b["image"].std() for b in batches]) > 10  # real photos decoded
    # The median shorter side (which gates reduced-scale decoding) is that of the training
    # photos, read here from the manual_dir's tar of tars.
    from PIL import Image

    sides = []
    with tarfile.open(root / "ILSVRC2012_img_train.tar") as outer:
        for m in outer.getmembers():
            with tarfile.open(fileobj=outer.extractfile(m)) as inner:
                for photo in inner.getmembers():
                    sides.append(min(Image.open(inner.extractfile(photo)).size))
    assert len(sides) == len(TRAIN_SYNSETS)
    assert train.info["copies"]["full"]["median_short_side"] == int(np.median(sides))
    # The validation split is labelled by tfds's list; the built dataset is reused as is.
    val = TfdsPipeline(
        "imagenet2012", "validation", data_dir=data_dir, process_index=0, process_count=1
    )
    assert val.num_examples == NUM_VAL
    (batch,) = val.eval_batches(image_size=64, global_batch=NUM_VAL + 1)
    assert batch["mask"].tolist() == [1.0] * NUM_VAL + [0.0]
    real = sorted(batch["label"][:NUM_VAL].tolist())
    assert real == sorted(labels.index(s) for s in val_synsets)


def test_experiment_points_at_imagenet_with_one_override(manual_dir, tmp_path):
    from hybridpar.config.schema import load_config

    root, _, _ = manual_dir
    c = load_config(f"{ROOT}/experiments/resnet50_imagenet.py:{root}")
    assert (c.data.name, c.data.tfds_name, c.data.tfds_manual_dir) == (
        "tfds",
        "imagenet2012",
        str(root),
    )
    assert (c.data.train_split, c.data.eval_split, c.data.num_classes) == (
        "train",
        "validation",
        1000,
    )
    folders = tmp_path / "imagenet"
    for split in ("train", "val"):
        (folders / split / "n01440764").mkdir(parents=True)
    c = load_config(f"{ROOT}/experiments/resnet50_imagenet.py:{folders}")
    assert (c.data.name, c.data.source, c.data.eval_split) == ("images", str(folders), "val")
    c = load_config(f"{ROOT}/experiments/resnet50_imagenet.py")
    assert c.data.name == "synthetic"  # without a path: speed and memory runs, as before
