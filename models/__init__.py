"""Image classification models and a name registry."""

from .airbench import AirbenchNet
from .resnet import (
    BottleneckResNetBlock,
    ResNet,
    ResNet18,
    ResNet34,
    ResNet50,
    ResNet101,
    ResNet152,
    ResNetBlock,
    ResNetTiny,
    WideResNet50_2,
)

MODELS = {
    "airbench": AirbenchNet,
    "resnet18": ResNet18,
    "resnet34": ResNet34,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "resnet152": ResNet152,
    "resnet_tiny": ResNetTiny,
    "wide_resnet50_2": WideResNet50_2,
}


def create_model(name: str, **kwargs):
    """Builds the registered model ``name`` with ``kwargs`` (e.g. num_classes, dtype)."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    return MODELS[name](**kwargs)


__all__ = [
    "AirbenchNet",
    "BottleneckResNetBlock",
    "MODELS",
    "ResNet",
    "ResNet18",
    "ResNet34",
    "ResNet50",
    "ResNet101",
    "ResNet152",
    "ResNetBlock",
    "ResNetTiny",
    "WideResNet50_2",
    "create_model",
]
