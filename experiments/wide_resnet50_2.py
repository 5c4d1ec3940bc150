"""Wide-ResNet-50-2 (torchvision's wide_resnet50_2: 68.9M parameters) on ImageNet-sized
synthetic images, for tensor parallelism of its wide layers.

``--config.partitioning.preset=tensor`` with a ``model`` axis splits the bottleneck convs of
stages 3 and 4 Megatron-style (conv1 over output channels, conv2 over input channels; see
``hybridpar/parallel/partitioning.py``). ``:STAGES`` (e.g. ``:1234``) applies the same split to the
blocks of those stages instead. ``docs/model_parallel.md`` compares these with pure data
parallelism through ``python -m hybridpar.comm_report``:

    python -m hybridpar.comm_report --config experiments/wide_resnet50_2.py --devices 8 \\
        --config.mesh=data:2,model:4 --config.partitioning.preset=tensor
"""

from pathlib import Path

from hybridpar.config.schema import load_config


def get_config(tensor_stages: str = ""):
    # The ResNet-50 ImageNet recipe, with the wide model and a batch a wide model fits.
    c = load_config(str(Path(__file__).with_name("resnet50_imagenet.py")))
    c.model.update(name="wide_resnet50_2")
    c.global_batch = 256
    c.eval_batch = 256
    c.target_top1 = -1.0  # ResNet-50's target is not this model's
    if tensor_stages:  # the tensor preset's split, on these stages' blocks
        blocks = rf"stage[{tensor_stages}]_block\d+"
        c.partitioning.preset = "tensor"
        c.partitioning.rules = (
            (rf"{blocks}/conv1/kernel$", (None, None, None, "model")),
            (rf"{blocks}/conv2/kernel$", (None, None, "model", None)),
        )
    return c
