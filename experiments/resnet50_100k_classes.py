"""ResNet-50 with 100k classes: ``resnet50_1m_classes.py`` with a smaller head (partial-FC).

100,352 = 100k rounded up to a multiple of 512, so that any power-of-two mesh up to 512
devices splits the classes evenly (Megatron pads its vocabulary the same way); with real data
the extra classes are never labelled and their logits only add to the softmax's denominator.
The head is 2048 x 100,352 = 206M parameters (822 MB in float32).
"""

from pathlib import Path

from hybridpar.config.schema import load_config


def get_config():
    return load_config(f"{Path(__file__).with_name('resnet50_1m_classes.py')}:100352")
