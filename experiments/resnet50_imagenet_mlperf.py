"""ResNet-50 on ImageNet, MLPerf Training's closed-division recipe: LARS at a large batch, to
75.9% top-1.

    python -m hybridpar.train --config experiments/resnet50_imagenet_mlperf.py:/data/imagenet

Arguments after ``:``: where ImageNet is (as ``resnet50_imagenet.py``; empty: synthetic
images), then the global batch (default 3264, with about 37 epochs; MLPerf's entries needed
about 35 epochs at 3.2k, 56 at 32k). LARS (``optax.lars``, trust coefficient 0.001, weight
decay 5e-5 off BatchNorm and biases), peak LR 10.5 at 3264 scaled by the square root of the
batch elsewhere, polynomial (power 2) decay after a linear warmup, label smoothing 0.1,
bfloat16 compute, one image size (224) throughout. As MLPerf's rules allow, every program is
compiled before the first step (and kept in WORKDIR/compile_cache); summary.json reports the
time to target with and without compilation.
"""

from pathlib import Path

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import load_config

BASE_BATCH, BASE_LR = 3264, 10.5


def get_config(args: str = ""):
    where, _, batch = args.partition(",")
    if batch and not (batch.isascii() and batch.isdigit() and int(batch) > 0):
        raise ConfigError(
            f"resnet50_imagenet_mlperf.py:{args}: {batch!r} is not a global batch; pass "
            f"WHERE,BATCH with BATCH a positive whole number (e.g. {where},{BASE_BATCH}), or "
            "WHERE alone"
        )
    c = load_config(str(Path(__file__).with_name("resnet50_imagenet.py")) + f":{where}")
    c.global_batch = int(batch or BASE_BATCH)
    c.num_epochs = 37.0 if c.global_batch <= 4096 else 56.0
    c.optim.update(
        name="lars",
        base_lr=BASE_LR,
        lr_batch_base=BASE_BATCH,
        lr_batch_scaling="sqrt",
        weight_decay=5e-5,
        lars_trust=0.001,
        schedule="poly",
        warmup_epochs=2.0 if c.global_batch <= 4096 else 5.0,
        end_lr_factor=1e-4,
    )
    c.label_smoothing = 0.1
    c.eval_every_epochs = 4.0
    c.target_top1 = 0.759
    c.compile_cache = "workdir"
    return c
