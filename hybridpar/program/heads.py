"""The classifier head: the seam between a model's trunk and its loss.

A head runs the model and turns its output into the per-example loss (and top-k hits),
and names where its own parameters must sit (``rules``). ``steps.DenseHead`` is the model's
own classifier (``steps.DENSE``, the default); ``sharded_head.ShardedHead`` splits the
classes over devices and never gathers the logits. ``make_head`` picks one from the config.
"""

from __future__ import annotations

from typing import Protocol

from hybridpar.config.errors import ConfigError
from hybridpar.parallel.mesh import AXES, BATCH_AXES, axes_with_devices
from hybridpar.parallel.partitioning import Rules
from hybridpar.parallel.sharded_head import ShardedHead, class_axes
from hybridpar.program.steps import DENSE


class Head(Protocol):
    def rules(self) -> Rules:
        """Placement rules for the head's parameters, before the preset's (none: placed
        like any layer)."""
        ...

    def apply(
        self, model, variables, images, labels, *, train, label_smoothing=0.0, topk=(), policy=None
    ) -> tuple[dict, dict]:
        """``({"loss": (B,), "top{k}": (B,) bool for k in topk}, new model variables)``;
        ``train``: the model in train mode (its BatchNorm statistics in the variables)."""
        ...


def make_head(config, mesh) -> Head:
    """The head ``config.model.head`` names: ``steps.DENSE`` (the model's own classifier,
    the default wherever no head is given) or a ``ShardedHead``. ``config`` is a validated
    one (``schema.validate``: the head's name and its comm.mode rule are checked there);
    what needs the mesh is checked here."""
    kind = config.model.head
    if kind == "dense":
        return DENSE
    # The trunk is data parallel over every device (its batch split over all axes), so no
    # device computes an example twice; only the head uses the model axis as such.
    batch = axes_with_devices(mesh, AXES) or BATCH_AXES
    for name in ("global_batch", "eval_batch"):
        if config[name] % mesh.size:
            raise ConfigError(
                f"model.head={kind!r} runs the trunk data parallel over all {mesh.size} devices, "
                f"so {name}={config[name]} must be a multiple of {mesh.size}: use e.g. "
                f"--config.{name}={max(mesh.size, config[name] // mesh.size * mesh.size)}, "
                "or model.head=dense"
            )
    head = ShardedHead(mesh, class_axes(kind, mesh), batch)
    n, c = head.num_shards, config.data.num_classes
    if c % n:
        over = " x ".join(f"{a}:{mesh.shape[a]}" for a in head.class_axes if mesh.shape[a] > 1)
        other = ", model.head=sharded (classes over model only)" if kind == "partial_fc" else ""
        raise ConfigError(
            f"model.head={kind!r} splits data.num_classes={c} over {over} ({n} shards), and {c} "
            f"is not a multiple of {n}: pad the classes to --config.data.num_classes="
            f"{-(-c // n) * n} (classes no label uses), use a mesh whose "
            f"{' x '.join(head.class_axes)} size divides {c}{other}, or model.head=dense"
        )
    return head
