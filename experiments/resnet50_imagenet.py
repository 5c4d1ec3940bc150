"""ResNet-50 on ImageNet, the DAWNBench/MLPerf recipe at one image size.

Until the input pipeline lands this runs on synthetic images (data.name="synthetic"), which
is enough to measure speed, memory and sharding. Recipe: global batch 1024, SGD + Nesterov,
LR 0.1 per 256 images with 5 warmup epochs and cosine decay, label smoothing 0.1, weight
decay 5e-5 off BatchNorm, zero-init last BN gamma (Goyal et al. 2017; MLPerf ResNet).
Mixed precision: bfloat16 compute, float32 parameters.
"""

from hybridpar.config import base_config


def get_config():
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
    c.global_batch = 1024
    c.eval_batch = 1000
    c.num_epochs = 35.0
    c.optim.update(base_lr=0.1, weight_decay=5e-5, warmup_epochs=5.0)
    c.label_smoothing = 0.1
    c.eval_every_epochs = 5.0
    c.target_top1 = 0.759
    return c
