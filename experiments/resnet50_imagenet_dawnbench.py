"""ResNet-50 on ImageNet with MoXing's DAWNBench schedule (Huawei, 2018: 93.01% top-5 after
43 epochs, 10:28 on 16 x 8 V100).

    python -m hybridpar.train --config experiments/resnet50_imagenet_dawnbench.py:/data/imagenet
    ... resnet50_imagenet_dawnbench.py:/data/imagenet,8     # on exactly 8 GPUs

Arguments after ``:``: where ImageNet is (as ``resnet50_imagenet.py``; empty: synthetic
images), then, optionally, the number of devices the run is meant for: it sets
``mesh=data:N``, so a start on another count is an error instead of a run at another global
batch and peak LR (without it, the data axis takes every device). The stages are
MoXing's DAWNBench submission's (21 epochs at 128 px, 21 at 224 px, 2 at 288 px, at global
batches of 28,672 and 16,384), in our notation: 128 px until epoch 21 (batch 224 per
GPU, crops down to 8% of the image), 224 px until 42 (224 per GPU, 8.7%), 288 px until 44
(128 per GPU, 50%); its log reached 93% top-5 during the first 288-px epoch. The
batch is per data-parallel device, so the same string runs on any device count; the LR
follows the global batch linearly from MoXing's peak of 8.5 at 128 x 224 images (0.0759 per
256). Fewer GPUs than 128 take more steps per epoch at the same per-GPU batch, so the peak
LR is lower and the warmup shorter in steps; what MoXing tuned is the 128-GPU case.

Also as MoXing: Nesterov SGD, weight decay 1e-4 off BatchNorm, momentum 0.98 -> 0.9 (over
the first stage; the write-up gives the range, not the shape), linear warmup then cosine to
0.05/8.5 of the peak, label smoothing 0.1, and, where ImageNet is folders or tars of
train/ and val/ (prepared into TFRecords), a 160-px copy of it prepared beside the full one
for the 128-px stage (``data.reduced_copies``; tensorflow-datasets' copy and synthetic
images have none). No stage switch waits for the compiler: the first stage's step and the
eval step compile before the first step and the later stages' in a background thread while
the first trains (``compile_ahead=auto`` on GPU/TPU; on CPU, or with
``--config.compile_ahead=before``, all before the first step); the compiled programs are
kept in WORKDIR/compile_cache. MoXing trained in float16 with a loss scale of 1024:
``--config.precision.compute=float16 --config.precision.loss_scale_initial=1024``; the
default here is bfloat16, which needs no scaling. DAWNBench's target: 93% top-5.
"""

from pathlib import Path

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import base_config, load_config

STAGES = "21:128-224@0.08,42:224-224@0.087,44:288-128@0.5"
PEAK_LR, PEAK_BATCH = 8.5, 128 * 224  # MoXing's LR at its 128-px global batch


def get_config(args: str = ""):
    where, _, gpus = args.partition(",")
    if gpus and not (gpus.isascii() and gpus.isdigit() and int(gpus) > 0):
        raise ConfigError(
            f"resnet50_imagenet_dawnbench.py:{args}: {gpus!r} is not a device count; pass "
            "WHERE,N with N the devices the run is meant for (e.g. ,8), or WHERE alone"
        )
    c = load_config(str(Path(__file__).with_name("resnet50_imagenet.py")) + f":{where}")
    if gpus:  # the batches are per device: the count sets the global batch and the LR
        c.mesh = f"data:{int(gpus)}"
    c.stages = STAGES
    # the stages set every batch: resnet50_imagenet.py's global_batch back to the default,
    # which set-up does not warn about as a setting that does nothing
    c.global_batch = base_config().global_batch
    c.num_epochs = 44.0  # the stages' last end epoch (summary and plots)
    c.data.image_size = 224  # evaluation size
    if c.data.name == "images":  # only this source prepares copies
        c.data.reduced_copies = "160"
    c.optim.update(
        base_lr=PEAK_LR * 256 / PEAK_BATCH,
        lr_batch_scaling="linear",
        nesterov=True,
        weight_decay=1e-4,
        schedule="cosine",
        warmup_epochs=2.0,
        warmup_start_factor=0.1,
        end_lr_factor=0.05 / PEAK_LR,
        momentum=0.9,
        momentum_start=0.98,
        momentum_ramp_epochs=21.0,
    )
    c.label_smoothing = 0.1
    c.eval_every_epochs = 1.0  # DAWNBench reads the first epoch at the target
    c.target_top1 = -1.0
    c.target_top5 = 0.93
    c.compile_cache = "workdir"
    return c
