"""Default main job: scikit-learn's handwritten digits (shipped with the package, no download).

1,797 real 8x8 digits upsampled to 32x32, a fixed seeded 80/20 split (1,437 train, 360 test),
a small ResNet. Reaches >= 97% test top-1 in about a minute on 2 CPU cores.
"""

from hybridpar.config.schema import base_config


def get_config():
    c = base_config()
    c.mesh = "data:-1"
    c.model.update(name="resnet_tiny", num_filters=16, small_stem=True)
    c.data.update(
        name="digits",
        image_size=32,
        num_classes=10,
        channels=1,
        mean=(0.3 * 255,),
        std=(0.4 * 255,),
    )
    c.global_batch = 64
    c.eval_batch = 128
    c.num_epochs = 15.0
    c.optim.update(base_lr=0.4, weight_decay=5e-4, warmup_epochs=1.0)
    c.label_smoothing = 0.1
    c.eval_every_epochs = 3.0
    c.target_top1 = 0.97
    c.target_top5 = 0.99
    # python -m hybridpar.tune: a range test of 4 epochs (88 steps) and the search's ranges
    # around the values above (batches that divide 8 devices, as the tests run it).
    c.tune.lr_epochs = 4.0
    c.tune.space = (
        "optim.base_lr=log:0.05..2,optim.weight_decay=log:1e-5..1e-3,optim.warmup_epochs=0..1.5,"
        "label_smoothing=0..0.2,optim.momentum=0.8..0.95,global_batch=32|64|128"
    )
    return c
