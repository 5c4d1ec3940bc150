"""Wide-ResNet-50-2 (torchvision's wide_resnet50_2: 68.9M parameters) on ImageNet-sized
synthetic images, for tensor parallelism of its wide layers.

``--config.partitioning.preset=tensor`` with a ``model`` axis splits the bottleneck convs of
stages 3 and 4 Megatron-style (conv1 over output channels, conv2 over input channels; see
``hybridpar/partitioning.py``). ``:STAGES`` (e.g. ``:1234``) applies the same split to the
blocks of those stages instead. ``docs/model_parallel.md`` compares these with pure data
parallelism through ``python -m hybridpar.comm_report``:

    python -m hybridpar.comm_report --config experiments/wide_resnet50_2.py --devices 8 \\
        --config.mesh=data:2,model:4 --config.partitioning.preset=tensor
"""

from hybridpar.config import base_config


def get_config(tensor_stages: str = ""):
    c = base_config()
    c.model.update(name="wide_resnet50_2")
    c.precision.update(compute="bfloat16")
    c.data.update(
        name="synthetic",
        image_size=224,
        num_classes=1000,
        train_examples=1_281_167,
        eval_examples=50_000,
    )
    c.global_batch = 256
    c.eval_batch = 256
    c.num_epochs = 35.0
    c.optim.update(base_lr=0.1, weight_decay=5e-5, warmup_epochs=5.0)
    c.label_smoothing = 0.1
    if tensor_stages:  # the tensor preset's split, on these stages' blocks
        blocks = rf"stage[{tensor_stages}]_block\d+"
        c.partitioning.preset = "tensor"
        c.partitioning.rules = (
            (rf"{blocks}/conv1/kernel$", (None, None, None, "model")),
            (rf"{blocks}/conv2/kernel$", (None, None, "model", None)),
        )
    return c
