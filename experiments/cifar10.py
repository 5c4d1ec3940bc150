"""CIFAR-10 from the JPEG tars in $HYBRIDPAR_DATA (default ../shared/data beside the checkout).

The first run prepares train.tar and test.tar into TFRecords (once, cached under
data.prepared_dir or ~/.cache/hybridpar/), then trains a small ResNet through the tf.data
pipeline: random-resized crop fused into JPEG decoding, flip, images shipped as uint8 and
normalised on the devices.
"""

import os
from pathlib import Path

from hybridpar.config.schema import base_config

DATA = Path(
    os.environ.get("HYBRIDPAR_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


def get_config():
    c = base_config()
    c.model.update(name="resnet_tiny", num_filters=32, small_stem=True)
    src = DATA / "cifar10-jpeg"
    c.data.update(
        name="images",
        source=f"{src / 'train.tar'},{src / 'test.tar'}",
        image_size=32,
        num_classes=10,
        channels=3,
        # CIFAR-10 statistics in 0..255 units.
        mean=(125.3, 123.0, 113.9),
        std=(63.0, 62.1, 66.7),
        min_scale=0.35,  # 32-px images: the ImageNet 0.08 crops would be a few pixels
        eval_crop_ratio=1.0,  # evaluate the whole 32x32 image
        ram_cache=True,  # 50k tiny JPEGs: ~80 MB
    )
    c.global_batch = 256
    c.eval_batch = 512
    c.num_epochs = 10.0
    c.optim.update(base_lr=0.4, weight_decay=5e-4, warmup_epochs=1.0)
    c.label_smoothing = 0.1
    c.eval_every_epochs = 1.0
    c.target_top1 = 0.9
    return c
