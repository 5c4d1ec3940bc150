"""ResNet-50 on ImageNet, the DAWNBench/MLPerf recipe at one image size.

    python -m hybridpar.train --config experiments/resnet50_imagenet.py:/data/imagenet ...

The one argument after ``:`` says where ImageNet is:

* a folder holding ``ILSVRC2012_img_train.tar`` and ``ILSVRC2012_img_val.tar`` (the files
  image-net.org hands out): tensorflow-datasets' ``imagenet2012`` builds from them once
  (``data.tfds_manual_dir``; the built copy goes to ``data.tfds_data_dir``, by default
  ``~/tensorflow_datasets``), splits ``train`` and ``validation``;
* a folder holding ``train/`` and ``val/`` in the CLASS/FILE layout (synset folders, as
  most ImageNet copies are unpacked), or tars of them: prepared once into TFRecords
  (``data.source``), splits ``train`` and ``val``.

Without it the run uses synthetic images (data.name="synthetic"), which is enough to
measure speed, memory and sharding. Recipe: global batch 1024, SGD + Nesterov, LR 0.1 per
256 images with 5 warmup epochs and cosine decay, label smoothing 0.1, weight decay 5e-5
off BatchNorm, zero-init last BN gamma (Goyal et al. 2017; MLPerf ResNet).
Mixed precision: bfloat16 compute, float32 parameters.
"""

import os

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config

ARCHIVES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")


def _imagenet(c, where: str) -> None:
    """Points ``c.data`` at the ImageNet in ``where`` (see the module docstring)."""
    where = os.path.abspath(os.path.expanduser(where))
    if any(os.path.isfile(os.path.join(where, a)) for a in ARCHIVES):
        c.data.update(name="tfds", tfds_name="imagenet2012", tfds_manual_dir=where)
        c.data.update(train_split="train", eval_split="validation")
        return
    splits = [s for s in ("train", "val") if os.path.exists(os.path.join(where, s))]
    tars = [s for s in ("train.tar", "val.tar") if os.path.isfile(os.path.join(where, s))]
    if splits == ["train", "val"]:
        c.data.update(name="images", source=where)
    elif tars == ["train.tar", "val.tar"]:
        c.data.update(name="images", source=",".join(os.path.join(where, t) for t in tars))
    else:
        raise ConfigError(
            f"no ImageNet found in {where!r}: expected {ARCHIVES[0]} and {ARCHIVES[1]} (the "
            "image-net.org files), or folders train/ and val/ (or train.tar and val.tar) in "
            "the CLASS/FILE layout"
        )
    c.data.update(train_split="train", eval_split="val")


def get_config(where: str = ""):
    c = base_config()
    c.model.update(name="resnet50")
    c.precision.update(compute="bfloat16")
    c.data.update(
        name="synthetic",
        image_size=224,
        num_classes=1000,
        train_examples=1_281_167,
        eval_examples=50_000,
    )
    if where:
        _imagenet(c, where)
    c.global_batch = 1024
    # a multiple of every power-of-two data axis up to 4,096 devices (1,000 divided none
    # from 16 up): the 50,000 validation images are 13 batches, the last padded and masked
    c.eval_batch = 4096
    c.num_epochs = 35.0
    c.optim.update(base_lr=0.1, weight_decay=5e-5, warmup_epochs=5.0)
    c.label_smoothing = 0.1
    c.eval_every_epochs = 5.0
    c.target_top1 = 0.759
    return c
