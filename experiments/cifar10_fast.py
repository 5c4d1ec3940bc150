"""CIFAR-10, fast: a small airbench-style network (models/airbench.py) with a curriculum.

    python -m hybridpar.train --config experiments/cifar10_fast.py --workdir runs/c10f
    python -m hybridpar.train --config experiments/cifar10_fast.py:cpu --workdir runs/c10c
    ... cifar10_fast.py:gpu,8 ...   # on 8 GPUs at one GPU's global batches

In the spirit of airbench (Keller Jordan's 94% in seconds on one A100) and Page's ResNet-9:
a 2x2 first layer whitened from the training images and frozen, flip + 2-px translate, label
smoothing 0.2, test-time flip, linear warmup then linear decay to 0; and our curriculum:
24-px images for the first 30-40% of the epochs, then 32 px (the 32-px step compiles in a
background thread while the 24-px stage trains on GPU/TPU, before the first step on CPU:
``compile_ahead=auto``). The LR is linear in each stage's batch (``optim.lr_batch_scaling``'s
default): ``gpu`` halves its batch at the switch, so its LR halves there too; ``cpu`` and
``edge`` keep one batch, and their LR is continuous across the switch. The 24-px stage
takes random-resized crops of half the image or more (``@0.5``), not the whole image: shrunk
to 24 px, a crop of about 71-100% of the side shows objects at 0.75-1.06x (0.88x on
average) the scale the 32-px test images show them at, where the whole image shows them at
0.75x (FixRes, Touvron et al. 2019: train at the scale you test at). ``gpu`` takes the small
images at twice the batch, for throughput; ``cpu`` keeps batch 512, since a CPU runs no
faster at a larger batch and fewer steps learned less per epoch.
Not here: airbench's lookahead EMA, multi-crop TTA and bias-only warmup of the first layer.

Arguments after ``:``: ``gpu`` (default: widths 128-256-256, 10 epochs, batch 1024 then 512
per device, target 94%) or ``cpu`` (sized for 2 cores, one device: widths 48-96-96,
8 epochs, target 85%) or ``edge`` (widths 25-50-50, the size ``compress`` prunes ``cpu``
to for 100 KB of int8 weights, trained from the start for 16 epochs, target 83%), then the
number of data-parallel devices to share those batches
(default 1). All are sized for one device and their stages' batches are per device: on 8
GPUs ``gpu`` trains at a global batch of 8,192 then 4,096, 6 and 12 steps an epoch (set-up
says so). ``gpu,8`` keeps one GPU's global batches on 8 (128 then 64 per GPU). Data: the
JPEG tars in $HYBRIDPAR_DATA (default ../shared/data), prepared on first use as
experiments/cifar10.py does.

Measured figures (``cpu``; ``gpu`` is not measured yet): single runs in
../bench/results/cifar10_fast/NOTES.md, time to 80% against the same model at 32 px
throughout in ../bench/results/curriculum_tta/README.md.
"""

import re
from pathlib import Path

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import load_config

VARIANTS = {
    # widths, epochs, stages (END:SIZE-BATCH_PER_DEVICE), target top-1
    "gpu": (128, 10.0, "4:24-1024@0.5,10:32-512", 0.94),
    "cpu": (48, 8.0, "3:24-512@0.5,8:32-512", 0.85),
    # edge-sized from the start: widths 25-50-50, 91,097 parameters, 93.9 KB of int8 weights
    # (what compress reaches by pruning the cpu teacher), trained alone for twice the epochs
    "edge": (25, 16.0, "6:24-512@0.5,16:32-512", 0.83),
}


def get_config(args: str = ""):
    variant, _, devices = args.partition(",")
    variant = variant or "gpu"
    if variant not in VARIANTS:
        raise ConfigError(f"cifar10_fast.py:{args}: the variant is one of {', '.join(VARIANTS)}")
    width, epochs, stages, target = VARIANTS[variant]
    batches = [int(b) for b in re.findall(r"-(\d+)", stages)]
    n = int(devices) if devices.isdecimal() else 0
    if devices and (n < 1 or any(b % n for b in batches)):
        raise ConfigError(
            f"cifar10_fast.py:{args}: the device count must divide the per-device batches "
            f"{' and '.join(map(str, batches))}: e.g. {variant},8 for 8 devices"
        )
    if n > 1:  # the same global batches, shared by n devices
        stages = re.sub(r"-(\d+)", lambda m: f"-{int(m[1]) // n}", stages)
    c = load_config(str(Path(__file__).with_name("cifar10.py")))
    c.model.update(name="airbench", num_filters=width)
    c.data.update(
        min_scale=1.0,  # no random-resized crop: the whole image, then a 2-px translation
        translate=2,
    )
    c.stages = stages
    c.num_epochs = epochs
    c.eval_batch = 1000
    c.optim.update(
        base_lr=0.2,  # per 256 images: 0.8 at 1,024
        weight_decay=5e-4,
        momentum=0.9,
        nesterov=True,
        warmup_epochs=1.0,
        schedule="linear",
        end_lr_factor=0.0,
        frozen=r"^whiten/kernel$",  # as the data set it
    )
    c.label_smoothing = 0.2
    c.eval_flip = True
    c.eval_every_epochs = 1.0
    c.target_top1 = target
    c.compile_cache = "workdir"
    return c
