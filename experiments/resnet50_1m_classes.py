"""ResNet-50 with 1M classes: a classifier head that pure data parallelism cannot hold.

The head alone is 2048 x 1M = 2.05G parameters: 8.2 GB in float32, as much again for the
momentum and for the gradient, plus logits of batch x 1M. ``data:-1`` replicates all of it on
every device. Here the head is partial-FC (``model.head=partial_fc``, see
``hybridpar/parallel/sharded_head.py``): its classes are split over all devices, the features are
all-gathered over the data axes for the head only, and the trunk stays data parallel.
Softmax cross-entropy and top-k never gather the logits.

Images and labels are synthetic (data.name="synthetic"): enough to measure memory,
communication and speed. The compile-only report, on 64 virtual CPU devices (a few minutes):

    python -m hybridpar.comm_report --config experiments/resnet50_1m_classes.py --devices 64
    ... --config.mesh=data:8,model:8 --config.model.head=sharded   # classes over model only

``:N`` sets the class count (``experiments/resnet50_1m_classes.py:100352``); the head needs
it to be a multiple of its shards (all devices for partial_fc, ``model`` for sharded).
1,000,000 = 2^6 x 5^6 splits over up to 64 devices; pad it (1,000,448 = 1954 x 512) for more.
"""

from pathlib import Path

from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import load_config


def get_config(num_classes: str = "1000000"):
    if not (num_classes.isascii() and num_classes.isdigit() and int(num_classes) >= 2):
        raise ConfigError(
            f"resnet50_1m_classes.py:{num_classes}: {num_classes!r} is not a class count; pass "
            "a whole number of 2 or more (e.g. :100352), or nothing for 1,000,000"
        )
    # The ResNet-50 ImageNet recipe (synthetic ImageNet-sized epochs), with the big head.
    c = load_config(str(Path(__file__).with_name("resnet50_imagenet.py")))
    c.model.update(head="partial_fc")
    c.data.update(num_classes=int(num_classes), eval_examples=50_176)
    c.eval_batch = 1024  # a multiple of every power-of-two data axis up to 1024
    c.target_top1 = -1.0  # synthetic labels: no accuracy to reach
    return c
