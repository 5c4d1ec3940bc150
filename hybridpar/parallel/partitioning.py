"""Placement of every array on the mesh, decided by rules that are plain data.

A user's own training code needs three things from here, and they work on any pytree (Flax
linen variables or NNX state, optax state, plain dicts):

* ``Rules``: ordered ``(path_regex, spec)`` pairs (first match wins; a spec is a tuple with one
  entry per dimension: a mesh axis name, a tuple of names, or None), then a logical-axis table
  of ``(logical_name, mesh_axis)`` pairs (either table may be a dict, read in order) for
  leaves that carry logical names (``nn.with_logical_partitioning``, as t5x and MaxText
  models do; names from ``nn.with_partitioning`` and ``nnx.with_partitioning`` are mesh axes
  or names in that table), then an optional FSDP pass that shards the largest free dimension
  of every big-enough array over ``fsdp`` (big_vision's "fsdp" tactic; for an array the
  rules split, stacked on a dimension they split where that divides, see ``_fsdp``).
* ``infer_shardings(tree, rules, mesh)``: a tree of ``NamedSharding`` with the (unboxed)
  structure of ``tree``.
* ``shard_batch(batch, mesh)``: host-local numpy batches -> global arrays split over the data axes.

A rule that does not divide a dimension is an error naming the array path, its shape and the
axis (the FSDP pass instead picks a dimension that divides, or leaves the array replicated).
``infer_shardings`` warns about rules that place nothing (they match no array, likely a typo,
or earlier rules place all they match), about logical names that the logical table does not
map (those dimensions are replicated), about conv kernels split on both channel dimensions (a
layout XLA computes wrong gradients for) and about arrays the FSDP pass was for but could not
split (each device then holds them whole, and the warning says why), a mesh without an
``fsdp`` axis of several devices included.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import re
import warnings
from collections.abc import Mapping
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import meta
from flax.linen.spmd import LogicallyPartitioned
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar.config.errors import ConfigError
from hybridpar.config.parsing import check_rule_patterns
from hybridpar.parallel.mesh import axis_names, batch_axes, data_parallel_size

# One entry per dimension: None, an axis name, or a tuple of axis names.
Spec = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Rules:
    """Where arrays go. All fields are data, so configs can hold and print them: ``path``
    and ``logical`` are kept as tuples of pairs (a dict given for either, as its items)."""

    path: Sequence[tuple[str, Spec]] = ()  # (regex searched in "a/b/c" paths, spec)
    logical: Sequence[tuple[str, Any]] = ()  # (logical axis name, mesh axis / tuple / None)
    fsdp_min_size: int | None = None  # None: no FSDP pass; else shard arrays this large
    # logical pairs taken after every ``logical`` entry of a sum, wherever they stand in it
    # (a preset's mapping of hybridpar's models' names: a user's own entry wins)
    defaults: Sequence[tuple[str, Any]] = ()

    def __post_init__(self):
        # A dict maps as its pairs do (its items, in order: the first match still wins).
        object.__setattr__(self, "path", _pairs(self.path, "path"))
        object.__setattr__(self, "logical", _pairs(self.logical, "logical"))
        object.__setattr__(self, "defaults", _pairs(self.defaults, "defaults"))
        for entry in (*self.logical, *self.defaults):
            if not _is_logical_rule(entry):
                raise ConfigError(
                    f"Rules(logical=...): entry {entry!r} is not a (logical_name, mesh_axis) "
                    "pair (the axis a mesh axis name, a tuple of names, or None); write e.g. "
                    "logical=(('embed', None), ('mlp', 'model')) or {'mlp': 'model'}"
                )
        m = self.fsdp_min_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0):
            raise ConfigError(
                f"Rules(fsdp_min_size={m!r}): give an element count (an int >= 0, e.g. 1024), "
                "or None for no FSDP pass"
            )

    def __add__(self, other: "Rules | Sequence[tuple[str, Spec]]") -> "Rules":
        """Concatenates: ``self``'s path and logical rules take priority over ``other``'s
        (the first match wins). ``fsdp_min_size`` is not taken in that order: the sum has
        the smaller of the two (None only where both are), so adding ``FSDP`` never leaves
        an array whole that either side alone would split. To raise it, replace it on the
        sum: ``dataclasses.replace(mine + FSDP, fsdp_min_size=2**20)``. ``other`` may be a
        plain sequence of ``(path_regex, spec)`` pairs, as ``infer_shardings`` takes."""
        if not isinstance(other, Rules):
            other = Rules(path=other)
        mins = [m for m in (self.fsdp_min_size, other.fsdp_min_size) if m is not None]
        return Rules(
            tuple(self.path) + tuple(other.path),
            tuple(self.logical) + tuple(other.logical),
            min(mins) if mins else None,
            tuple(self.defaults) + tuple(other.defaults),
        )

    def __radd__(self, other: Sequence[tuple[str, Spec]]) -> "Rules":
        """``[(path_regex, spec), ...] + rules``: the pairs take priority."""
        return Rules(path=other) + self

    def axes(self) -> tuple[str, ...]:
        """The mesh axes these rules split arrays over (in their order, each once): those
        their specs name, and ``fsdp`` for an FSDP pass."""
        named = [a for _, spec in self.path for e in spec for a in axis_names(e)]
        named += [a for _, entry in self.logical for a in axis_names(entry)]
        named += ["fsdp"] * (self.fsdp_min_size is not None)
        return tuple(dict.fromkeys(named))


def _pairs(rules, field: str) -> tuple:
    """``Rules``' ``field`` as a tuple of pairs: a dict gives its items, in order."""
    if isinstance(rules, Mapping):
        return tuple(rules.items())
    if isinstance(rules, str):  # tuple("mlp") would be one rule per letter
        pair = "(r'head/kernel$', (None, 'model'))" if field == "path" else "('mlp', 'model')"
        raise ConfigError(
            f"Rules({field}={rules!r}): give a tuple of pairs or a dict, e.g. {field}=({pair},)"
        )
    return tuple(rules)


def _is_logical_rule(entry) -> bool:
    """A ``(logical_name, mesh_axis)`` pair: the axis a name, a tuple of names, or None."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str):
        return False
    axis = entry[1]
    if axis is None or isinstance(axis, str):
        return True
    return isinstance(axis, (tuple, list)) and all(isinstance(a, str) for a in axis)


# Presets. They name module paths of hybridpar.models (stable names, see models/resnet.py)
# and the logical axes the models annotate.
# The logical names hybridpar.models annotate, each replicated unless a rule before says
# otherwise (a preset comes last): mapped, so that a preset on hybridpar's models is no
# warning about names its table lacks.
MODEL_NAMES = tuple((n, None) for n in ("conv_h", "conv_w", "conv_in", "conv_out", "norm",
                                        "embed", "classes"))  # fmt: skip
DATA_PARALLEL = Rules(defaults=MODEL_NAMES)
FSDP = Rules(
    defaults=MODEL_NAMES, fsdp_min_size=2**10
)  # smaller arrays (BN vectors): one gather costs more than it saves
# Data x model hybrid: the classifier head is split along the classes, and the wide
# convolutions of the last two stages along their output channels; everything else is
# replicated over `model` and the batch is split over the data axes.
HYBRID = Rules(
    path=((r"stage[34]_block\d+/(conv\d|proj_conv)/kernel$", (None, None, None, "model")),),
    logical=(("classes", "model"),),
    defaults=MODEL_NAMES,
)
# Megatron-style tensor parallelism for the wide bottlenecks of the last two stages (their
# conv1 and conv2 are 73% of Wide-ResNet-50-2's weights): conv1 split over `model` along its
# output channels, conv2 along its input channels, so the activation between them stays
# split (no collective) and conv2's partial sums take one all-reduce over `model` forward
# (and the block input's gradient one backward). conv3, the projections and BatchNorm stay
# replicated. Activations shrink with depth while weights grow, so these stages are where
# splitting weights saves the most memory per byte communicated (docs/model_parallel.md).
# XLA's wrong strided-conv gradient (see _fsdp) needs a kernel split on both channel
# dimensions; this layout is checked against one device in tests/test_tensor_parallel.py.
TENSOR = Rules(
    path=(
        (r"stage[34]_block\d+/conv1/kernel$", (None, None, None, "model")),
        (r"stage[34]_block\d+/conv2/kernel$", (None, None, "model", None)),
    ),
    logical=(("classes", "model"),),
    defaults=MODEL_NAMES,
)
PRESETS = {"data": DATA_PARALLEL, "fsdp": FSDP, "hybrid": HYBRID, "tensor": TENSOR}


def preset_rules(name: str, mesh: Mesh) -> Rules:
    """A preset by name; ``auto`` combines the presets the mesh's axes call for."""
    if name == "auto":
        rules = Rules()
        if mesh.shape.get("model", 1) > 1:
            rules = rules + HYBRID
        if mesh.shape.get("fsdp", 1) > 1:
            rules = rules + FSDP
        return rules + DATA_PARALLEL  # (its names mapped, where neither came)
    if name not in PRESETS:
        raise ConfigError(
            f"unknown partitioning preset {name!r}; choose one of {sorted(PRESETS) + ['auto']}"
        )
    return PRESETS[name]


def path_parts(path) -> tuple[str, ...]:
    """A jax key path's names, ``("params", "stage1_block0", "conv1", "kernel")``: each
    key's ``key``, ``name`` or ``idx`` (also how an orbax checkpoint's metadata names them)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return tuple(parts)


def path_str(path) -> str:
    """A jax key path as ``"params/stage1_block0/conv1/kernel"``."""
    return "/".join(path_parts(path))


def is_box(x) -> bool:
    """Leaves that wrap an array: linen's axis boxes and NNX Variables (whose pytree path
    would otherwise end in ``/value`` and miss rules such as ``kernel$``)."""
    return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def unbox_leaf(x):
    if isinstance(x, nnx.Variable):
        return x.get_value()
    return x.unbox() if isinstance(x, meta.AxisMetadata) else x


def rebox_leaf(x, value):
    """``value`` in ``x``'s box (the inverse of ``unbox_leaf``), as it was if ``x`` was none."""
    if isinstance(x, nnx.Variable):
        return x.replace(value)
    return x.replace_boxed(value) if isinstance(x, meta.AxisMetadata) else value


def _axes_named(axes: tuple) -> str:
    """``axis 'model'``, or ``axes ('data', 'model')`` for a dimension split over several."""
    return f"axis {axes[0]!r}" if len(axes) == 1 else f"axes {axes}"


# Why a path rule's spec can be longer than an array it matches, and what to do.
_FEWER_DIMS = (
    "; the regex also matches arrays of fewer dimensions than those its spec is for, such as "
    "an optimizer's factored statistics under the parameter's path (Adafactor's v_row, "
    "v_col, v): put a rule of their own before it, e.g. (r'(^|/)v(_row|_col)?/', ()) to "
    "replicate them, or place the parameters alone, infer_shardings(params, rules, mesh), "
    "and the optimizer state with a call of its own"
)


def _check(spec: Spec, shape, mesh: Mesh, where: str, why: str, fewer_dims: str = "") -> tuple:
    if isinstance(spec, str):  # tuple("model") would be one entry per letter
        raise ConfigError(
            f"{where}: spec {spec!r} is a string ({why}); a spec is a tuple with one entry per "
            f"dimension, e.g. ({spec!r},) or (None, {spec!r})"
        )
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise ConfigError(
            f"{where}: spec {spec} has {len(spec)} entries but the array has "
            f"shape {tuple(shape)} ({why}){fewer_dims}"
        )
    spec = spec + (None,) * (len(shape) - len(spec))
    for dim, (entry, size) in enumerate(zip(spec, shape)):
        axes = axis_names(entry)
        for a in axes:
            if a not in mesh.shape:
                raise ConfigError(
                    f"{where}: spec {spec} names mesh axis {a!r}, not one of "
                    f"{tuple(mesh.axis_names)} ({why})"
                )
        n = math.prod(mesh.shape[a] for a in axes)
        if size % n:
            raise ConfigError(
                f"{where} with shape {tuple(shape)}: dimension {dim} (size {size}) does not "
                f"divide mesh {_axes_named(axes)} (size {n}) ({why}); change the rule or "
                f"the mesh so the size divides"
            )
    named = [a for e in spec for a in axis_names(e)]
    twice = sorted({a for a in named if named.count(a) > 1})
    if twice:
        raise ConfigError(
            f"{where}: spec {spec} names mesh axis {twice[0]!r} more than once ({why}); a mesh "
            "axis can split one dimension of an array only"
        )
    return spec


def _fsdp(spec: tuple, shape, mesh: Mesh, min_size: int) -> tuple:
    """Adds ``fsdp`` to one dimension of an array that is big enough.

    An array the rules already split (say output channels over ``model``) gets ``fsdp``
    stacked on a dimension they split, ``("model", "fsdp")``, where that divides: gathering
    over ``fsdp`` then gives back exactly the model-parallel layout (the class-sharded head's
    step, ``sync._head_layout``, needs its kernel split over the classes first). Where it
    does not divide, a 2-D or 3-D array takes ``fsdp`` on a free dimension as below. A 4-D
    (conv, HWIO) kernel does not: ``fsdp`` on a second dimension (input channels) makes XLA's
    SPMD partitioner (jax 0.10.2, Shardy and GSPMD alike) compute a wrong input gradient for
    strided convolutions; ``tests/test_parity.py`` pins that bug. Other arrays get ``fsdp``
    on their largest dimension that it divides.
    """
    n = mesh.shape.get("fsdp", 1)
    used = {a for e in spec for a in axis_names(e)}
    if n == 1 or "fsdp" in used or math.prod(shape) < min_size:
        return spec
    split = [d for d in range(len(shape)) if spec[d] is not None]
    for d in reversed(split):
        axes = axis_names(spec[d]) + ("fsdp",)
        if shape[d] % math.prod(mesh.shape[a] for a in axes) == 0:
            return spec[:d] + (axes,) + spec[d + 1 :]
    if split and len(shape) == 4:
        return spec
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % n == 0]
    if not free:
        return spec
    d = max(free, key=lambda i: (shape[i], i))
    return spec[:d] + ("fsdp",) + spec[d + 1 :]


def _left_whole_by_fsdp(spec: tuple, shape, mesh: Mesh, rules: Rules) -> str | None:
    """Why an array the FSDP pass was meant for (big enough, an fsdp axis) stays whole over
    ``fsdp`` (``_fsdp`` found no dimension for it); None where it does not."""
    m, n = rules.fsdp_min_size, mesh.shape.get("fsdp", 1)
    if m is None or n == 1 or not shape or math.prod(shape) < m:
        return None
    if "fsdp" in {a for e in spec for a in axis_names(e)}:
        return None
    if all(e is None for e in spec):
        return f"fsdp={n} divides none of their dimensions"
    stacked = "no dimension the rules split divides by its axes times fsdp"
    if len(shape) == 4:
        return (
            f"{stacked}, and a 4-D kernel the rules split takes fsdp only on a dimension they "
            "split (on another, such as its input channels, XLA computes a wrong strided-conv "
            "gradient)"
        )
    if all(e is not None for e in spec):
        return f"{stacked}, and they leave no dimension free"
    return f"{stacked}, and fsdp={n} divides none of the dimensions they leave free"


def _table(rules: Rules, defaults: bool = True) -> dict:
    """The logical table: name -> mesh axes. ``defaults`` (hybridpar's models' names) only
    for linen's logical boxes: a mesh-axis annotation naming one is still an error."""
    table = {}
    for name, axis in (*rules.logical, *(rules.defaults if defaults else ())):  # first wins
        table.setdefault(name, axis)
    return table


def _annotation(leaf):
    """The mesh-axis names an ``nn.Partitioned`` or an NNX Variable (``nnx.with_partitioning``)
    carries, else None. Linen's logical boxes are handled apart: their names are logical only."""
    if isinstance(leaf, LogicallyPartitioned):
        return None
    if isinstance(leaf, meta.Partitioned):
        return tuple(leaf.names)
    if isinstance(leaf, nnx.Variable):
        names = leaf.get_metadata().get("out_sharding")
        return None if names is None else tuple(names)
    return None


def _mesh_names(names, table: dict, mesh: Mesh, where: str) -> tuple:
    """An annotation's names as mesh axes: a name in the logical table maps through it, a mesh
    axis stays as it is."""
    spec = []
    for entry in names:
        axes = []
        for name in axis_names(entry):
            if name in table:
                axes += axis_names(table[name])
            elif name in mesh.shape:
                axes.append(name)
            else:
                raise ConfigError(
                    f"{where}: its sharding annotation {tuple(names)} names {name!r}, which is "
                    f"neither a mesh axis {tuple(mesh.axis_names)} nor a logical name of the "
                    f"rules; add ({name!r}, None) to the logical rules to replicate that "
                    f"dimension, or ({name!r}, 'model') to split it, or fix the annotation"
                )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return tuple(spec)


def _spec(path: str, shape, rules: Rules, mesh: Mesh, logical_names=None, axis_names=None):
    check_rule_patterns(rules.path)
    where = f"array {path!r}"
    spec = None
    for pattern, rule_spec in rules.path:
        if re.search(pattern, path):
            spec = _check(rule_spec, shape, mesh, where, f"rule {pattern!r}", _FEWER_DIMS)
            break
    if spec is None and logical_names is not None:  # a name the table lacks: _unmapped
        mapped = tuple(_table(rules).get(name) for name in logical_names)
        spec = _check(
            mapped, shape, mesh, where, f"logical axes {tuple(logical_names)} and the logical rules"
        )
    if spec is None and axis_names is not None:
        mapped = _mesh_names(axis_names, _table(rules, defaults=False), mesh, where)
        spec = _check(mapped, shape, mesh, where, f"its sharding annotation {axis_names}")
    if spec is None:
        spec = (None,) * len(shape)
    if rules.fsdp_min_size is not None:
        spec = _fsdp(spec, shape, mesh, rules.fsdp_min_size)
    return spec


def _unmapped(path: str, logical_names, rules: Rules) -> list:
    """The logical names of an array that no path rule places which the logical table does
    not map (the array is replicated along them as if they were mapped to None)."""
    if any(re.search(pattern, path) for pattern, _ in rules.path):
        return []
    table = _table(rules)
    return [n for e in logical_names for n in axis_names(e) if n not in table]


def _unmapped_message(found: list, rules: Rules) -> str:
    """The warning for ``(path, unmapped names)`` pairs: which, and how to map them."""
    names = list(dict.fromkeys(n for _, ns in found for n in ns))
    arrays = "1 array carries" if len(found) == 1 else f"{len(found)} arrays carry"
    example = ", ".join(f"{n!r}: None" for n in names[:3])
    return (
        f"{shortlist([p for p, _ in found])}: {arrays} logical name(s) {shortlist(names)} "
        "that the rules' logical table does not map, so those dimensions are replicated"
        + (" (the FSDP pass aside)" if rules.fsdp_min_size is not None else "")
        + ". Map each name, e.g. rules + Rules(logical={" + example + "}): None replicates "
        "without this warning, a mesh axis such as 'model' splits"
    )


def infer_spec(
    path: str,
    shape,
    rules: Rules | Sequence[tuple[str, Spec]],
    mesh: Mesh,
    logical_names=None,
    axis_names=None,
) -> P:
    """The ``PartitionSpec`` of one array: the first path rule that matches; else the array's
    own names (``logical_names`` of a linen logical box map through the logical table;
    ``axis_names`` of ``nn.Partitioned`` or ``nnx.with_partitioning`` are mesh axes or names
    in that table); else replicated. The FSDP pass then stacks on top. ``rules``: a
    ``Rules``, or a plain sequence of ``(regex, spec)`` path rules (as ``infer_shardings``).
    A logical name the table does not map is warned about, as ``infer_shardings`` does."""
    if not isinstance(rules, Rules):
        rules = Rules(path=rules)
    gaps = [] if logical_names is None else _unmapped(path, logical_names, rules)
    if gaps:
        warnings.warn(_unmapped_message([(path, gaps)], rules), UserWarning, stacklevel=2)
    return P(*_spec(path, shape, rules, mesh, logical_names, axis_names))


def _splits_both_channels(spec: tuple, mesh: Mesh) -> bool:
    """A 4-D (conv, HWIO) layout split on both input and output channels."""

    def split(entry):
        return math.prod(mesh.shape[a] for a in axis_names(entry)) > 1

    return len(spec) == 4 and split(spec[2]) and split(spec[3])


def shortlist(names: list, n: int = 4) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def unmatched_rules(tree, rules: Rules | Sequence[tuple[str, Spec]]) -> str:
    """A message naming the path rules that match no array of ``tree``, those whose arrays
    earlier rules all place first (naming those rules), and the logical names of ``rules``
    that no array carries (but those mapped to None); ``""`` when there are none."""
    if not isinstance(rules, Rules):
        rules = Rules(path=rules)
    check_rule_patterns(rules.path)
    paths, carried = [], set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        paths.append(path_str(path))
        if isinstance(leaf, LogicallyPartitioned):
            carried.update(a for e in leaf.names for a in axis_names(e))
        elif _annotation(leaf) is not None:
            carried.update(a for e in _annotation(leaf) for a in axis_names(e))
    problems = []
    patterns = [pattern for pattern, _ in rules.path]
    # The rule that places each path: the first that matches it.
    first = {p: next((q for q in patterns if re.search(q, p)), None) for p in paths}
    for i, pattern in enumerate(patterns):
        matched = [p for p in paths if re.search(pattern, p)]
        if not matched:
            if pattern in patterns[:i]:
                continue  # named once, as the rule that matches nothing
            if not paths:
                problems.append(f"path rule {pattern!r} matches no array (the tree has none)")
                continue
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0)
            problems.append(
                f"path rule {pattern!r} matches no array (closest paths: {shortlist(close)}; this "
                f"tree's paths look like {paths[0]!r}, see "
                "hybridpar.parallel.partitioning.path_str and sharding_table)"
            )
        elif pattern in patterns[:i]:
            problems.append(
                f"path rule {pattern!r} is given more than once; the first places all it "
                "matches (the first match wins), so drop the others"
            )
        elif all(first[p] != pattern for p in matched):
            earlier = list(dict.fromkeys(first[p] for p in matched))
            problems.append(
                f"path rule {pattern!r} matches {shortlist(matched, 3)} but places none of them: "
                f"the earlier rule(s) {shortlist(earlier, 3)} match them first (the first match "
                "wins); put it before them, or drop it"
            )
    # a name mapped to None on no array changes nothing (the presets map hybridpar's
    # models' names so, for any tree): only one meant to split is a likely typo
    names = list(dict.fromkeys(n for n, axis in rules.logical if axis is not None
                               and n not in carried))  # fmt: skip
    if names:
        problems.append(
            f"logical name(s) {shortlist(names)} on no array (the arrays carry "
            f"{shortlist(sorted(carried), 8) or 'none'}; logical names come from "
            "nn.with_logical_partitioning or nnx.with_partitioning)"
        )
    return "; ".join(problems)


def infer_shardings(
    tree,
    rules: Rules | Sequence[tuple[str, Spec]],
    mesh: Mesh,
    unmatched: str = "warn",
    moot_fsdp: str = "warn",
):
    """A tree of ``NamedSharding`` for ``tree``'s arrays (or ShapeDtypeStructs).

    ``tree`` may hold Flax boxed leaves (``LogicallyPartitioned``, ``Partitioned``): their
    names are used and the result has the unboxed structure. An NNX ``Variable`` gets one
    sharding (a valid ``out_shardings`` prefix for its State); its ``nnx.with_partitioning``
    names are used as ``nn.Partitioned``'s are. Path rules go first for every leaf, and the
    FSDP pass stacks on top. ``rules`` may be a ``Rules`` or a plain sequence of
    ``(path_regex, spec)`` pairs.

    ``unmatched="warn"`` warns about rules that place nothing (``unmatched_rules``: they
    match no array, or earlier rules place all they match), and about logical names on
    arrays that the logical table does not map (no path rule placing the array): those
    dimensions are replicated, as for a name mapped to None, which is silent; pass
    ``"ignore"`` for a part of a tree (optimizer state, batch statistics) that some rules
    are not meant for.
    ``moot_fsdp="warn"`` warns about an FSDP pass on a mesh whose ``fsdp`` axis is missing or
    has one device (it splits nothing there); pass ``"ignore"`` for rules applied on any mesh
    (the trainer's presets, which it warns about itself). A conv kernel split on both channel
    dimensions, and arrays an ``fsdp`` axis of several devices divides in no dimension, are
    always warned about.
    """
    for name, value in (("unmatched", unmatched), ("moot_fsdp", moot_fsdp)):
        if value not in ("warn", "ignore"):
            raise ValueError(f"{name}={value!r}; use 'warn' or 'ignore'")
    if not isinstance(rules, Rules):
        rules = Rules(path=rules)
    both_channels, whole, big, unmapped = [], [], [], []

    def one(path, leaf):
        p = path_str(path)
        shape = np.shape(unbox_leaf(leaf))
        if rules.fsdp_min_size is not None and shape and math.prod(shape) >= rules.fsdp_min_size:
            big.append(p)  # an array the FSDP pass is for
        if isinstance(leaf, LogicallyPartitioned):  # logical names: map through the table
            spec = _spec(p, shape, rules, mesh, logical_names=leaf.names)
            gaps = _unmapped(p, leaf.names, rules)
            if gaps:
                unmapped.append((p, gaps))
        else:
            spec = _spec(p, shape, rules, mesh, axis_names=_annotation(leaf))
        if _splits_both_channels(spec, mesh):
            both_channels.append(p)
        reason = _left_whole_by_fsdp(spec, shape, mesh, rules)
        if reason:
            whole.append((p, math.prod(shape) * _dtype(unbox_leaf(leaf)).itemsize, reason))
        return NamedSharding(mesh, P(*spec))

    shardings = jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_box)
    if moot_fsdp == "warn" and mesh.shape.get("fsdp", 1) == 1 and big:
        # Not an error: the run is still correct, as with DATA_PARALLEL.
        axis = "has one device" if "fsdp" in mesh.shape else "is missing"
        axes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
        arrays = "1 array" if len(big) == 1 else f"{len(big)} arrays"
        warnings.warn(
            f"{shortlist(big)}: {arrays} of at least fsdp_min_size={rules.fsdp_min_size} "
            "elements stay whole on every device, as the FSDP pass (hybridpar.FSDP's) splits "
            f"over the fsdp axis, which {axis} on mesh {axes}. Use a mesh with an fsdp axis, "
            "e.g. make_mesh('data:2,fsdp:4'), or fsdp_min_size=None (as "
            "hybridpar.DATA_PARALLEL) to leave them whole without this warning",
            UserWarning,
            stacklevel=2,
        )
    if both_channels:
        # We cannot see a kernel's strides, so this is a warning, not an error.
        warnings.warn(
            f"{shortlist(both_channels)}: a 4-D kernel split on both its input-channel and its "
            "output-channel dimension; XLA's SPMD partitioner computes a wrong input gradient "
            "for a strided convolution with such a kernel (tests/test_parity.py pins the bug). "
            "Put the second axis on the output-channel dimension instead, e.g. "
            "(None, None, None, ('model', 'fsdp')), as the FSDP pass does",
            UserWarning,
            stacklevel=2,
        )
    if whole:
        # Not an error: the run is still correct, only each device holds these in full.
        size = sum(b for _, b, _ in whole)
        size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
        arrays = "1 array" if len(whole) == 1 else f"{len(whole)} arrays"
        reasons = {}  # each reason with the arrays it is true of
        for p, _, reason in whole:
            reasons.setdefault(reason, []).append(p)
        why = ": " + "; ".join(f"{shortlist(ps)}, as {r}" for r, ps in reasons.items())
        if len(reasons) == 1:
            why = f", as {next(iter(reasons))}"
        warnings.warn(
            f"{shortlist([p for p, _, _ in whole])}: {arrays} of at least "
            f"fsdp_min_size={rules.fsdp_min_size} elements ({size}) stay whole on every device "
            f"of the fsdp axis{why}. Use an fsdp size that divides them, or raise "
            "fsdp_min_size above their sizes to leave them whole without this warning",
            UserWarning,
            stacklevel=2,
        )
    if unmatched == "warn":
        message = unmatched_rules(tree, rules)
        if message:
            warnings.warn(
                f"partitioning rules that place nothing: {message}", UserWarning, stacklevel=2
            )
        if unmapped:  # the converse: names no rule places (a missing or misspelt table key)
            warnings.warn(_unmapped_message(unmapped, rules), UserWarning, stacklevel=2)
    return shardings


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) dimension split over the data-parallel axes, the rest replicated.

    Works on any mesh ``batch_axes`` accepts, with Auto or Explicit axes."""
    return NamedSharding(mesh, P(batch_axes(mesh) or None, *([None] * (ndim - 1))))


def shard_batch(batch, mesh: Mesh, *, check_hosts: bool = False):
    """Host-local numpy arrays -> global ``jax.Array``s split over the data axes.

    Each process passes its own slice of the global batch; the global batch is the
    concatenation in process order. Every host's batch must be the same size (drop or pad
    an uneven last batch): each host builds the global shape from its own, and hosts that
    disagree abort or hang in the first collective. ``check_hosts=True`` (on several
    processes) compares every leaf's shape and dtype across the hosts first and raises
    ``ConfigError`` naming the leaf and each process's shape; it costs a host sync per
    call, so pass it while developing, not in a training loop. Works on any pytree of arrays,
    all of whose leaves must hold the same number of examples (leading dimension): an image
    batch and a label batch of different lengths would otherwise pair the wrong examples, or
    train on padding, without an error.

    A batch of global arrays already placed on a mesh (every leaf a ``jax.Array`` with a
    ``NamedSharding``: the on-device input's) is returned untouched where each leaf is split
    over the data axes of ``mesh`` as above, else moved there.
    """
    n_local = data_parallel_size(mesh) // jax.process_count()  # checks the mesh's axes first
    if check_hosts and jax.process_count() > 1:
        # Before any error of one host's own: a host that raised would leave the others
        # waiting in this collective.
        _check_same_on_hosts(batch)
    # A list of numbers would be flattened into one scalar leaf per number.
    for path, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_number_list)[0]:
        if _is_number_list(x):
            raise ConfigError(
                f"batch leaf {path_str(path)!r} is a Python {type(x).__name__} of numbers; "
                "pass a numpy array instead, e.g. np.asarray(labels)"
            )
    placed = _placed(batch, mesh)
    if placed is not None:
        return placed
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    # (on one process a global leaf's length is this host's: mixing is harmless there)
    is_global = {path_str(p): _is_global(x) for p, x in leaves} if jax.process_count() > 1 else {}
    if len(set(is_global.values())) > 1:
        # A global leaf has the global length, a host-local one this host's: never equal.
        raise ConfigError(
            "batch mixes global jax.Arrays (leaves "
            f"{shortlist([n for n, g in is_global.items() if g])}) with host-local arrays "
            f"({shortlist([n for n, g in is_global.items() if not g])}); pass all leaves the "
            "same way: all host-local (numpy), or all global arrays from shard_batch"
        )
    lengths = {}
    for path, x in leaves:
        shape = np.shape(x)
        lengths[path_str(path)] = shape[0] if shape else None
    if len(set(lengths.values())) > 1:
        listed = ", ".join(
            f"{name!r}: {'a scalar' if n is None else n}" for name, n in lengths.items()
        )
        raise ConfigError(
            f"batch leaves have different leading (example) dimensions on this host ({listed}); "
            "every leaf of a batch must hold the same examples, e.g. one label per image"
        )

    def one(path, x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % max(n_local, 1):
            size = f"leading size {x.shape[0]}" if x.ndim else "no leading size (a scalar)"
            raise ConfigError(
                f"batch array {path_str(path)!r} has {size} on this host, "
                f"which does not divide the {max(n_local, 1)} data-parallel shards of this host; "
                "make the per-host batch a multiple of the data axes (data x fsdp) per host"
            )
        sharding = batch_sharding(mesh, x.ndim)
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree_util.tree_map_with_path(one, batch)


def _dtype(x) -> np.dtype:
    """An array's (or ShapeDtypeStruct's) dtype; a Python number's as numpy would make it."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _is_global(x) -> bool:
    return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)


def _check_same_on_hosts(batch) -> None:
    """Raises ConfigError where the processes' batches differ in a leaf's shape or dtype.

    Every process must call this at the same point: it gathers each host's description
    (two small all-gathers, a host sync)."""
    from jax.experimental import multihost_utils

    mine = []
    for p, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_number_list)[0]:
        mine.append([path_str(p), list(np.shape(x)), str(_dtype(x))])
    data = np.frombuffer(json.dumps(mine).encode(), np.uint8)
    # The descriptions' lengths differ between hosts: gather them first, then pad to the longest.
    lengths = multihost_utils.process_allgather(np.int32(data.size))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[: data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    hosts = [
        {name: (tuple(shape), dtype) for name, shape, dtype in json.loads(bytes(row[:n]))}
        for row, n in zip(np.asarray(gathered), np.asarray(lengths))
    ]
    names = list(dict.fromkeys(name for host in hosts for name in host))
    differ = [name for name in names if len({host.get(name) for host in hosts}) > 1]
    if differ:

        def seen(host, name):
            if name not in host:
                return "no such leaf"
            shape, dtype = host[name]
            return f"{shape} {dtype}"

        lines = "; ".join(
            f"{name!r}: "
            + ", ".join(f"process {i} {seen(host, name)}" for i, host in enumerate(hosts))
            for name in differ[:3]
        )
        raise ConfigError(
            f"batch leaves differ between processes ({lines}); every host's batch must be "
            "the same size and dtype: drop or pad the uneven last batch"
        )


def _placed(batch, mesh: Mesh):
    """``batch`` on ``mesh``'s batch sharding when all its leaves are global arrays on a mesh
    (untouched where they are there already); None for host-local data."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves or not all(_is_global(x) for _, x in leaves):
        return None
    lengths = {path_str(p): (x.shape[:1] or (None,))[0] for p, x in leaves}
    if len(set(lengths.values())) > 1 or None in lengths.values():
        raise ConfigError(
            f"batch leaves have different leading (example) dimensions ({lengths}); every leaf "
            "of a batch must hold the same examples, e.g. one label per image"
        )

    n = data_parallel_size(mesh)
    for name, size in lengths.items():
        if size % n:
            raise ConfigError(
                f"batch array {name!r} has leading size {size}, which does not divide the {n} "
                "data-parallel shards of the mesh; make the global batch a multiple of the data "
                "axes (data x fsdp)"
            )

    def one(x):
        target = batch_sharding(mesh, x.ndim)
        if x.sharding.is_equivalent_to(target, x.ndim):
            return x
        return jax.device_put(x, target)

    return jax.tree.map(one, batch)


def _is_number_list(x) -> bool:
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(isinstance(e, numbers.Number) or _is_number_list(e) for e in x)
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def sharding_table(shardings, tree, max_rows: int = 24) -> str:
    """A short table of how parameter groups are placed: one row per distinct (spec, group).

    Groups are the path with block indices and the params / optimizer-state prefix dropped
    (``stage3_block*/conv2/kernel`` counts the kernels and their momentum), so a ResNet-50
    prints in a couple of dozen lines.
    """
    rows: dict[tuple[str, str], list] = {}
    flat_s = jax.tree_util.tree_flatten_with_path(shardings)[0]
    flat_t = jax.tree_util.tree_leaves(tree, is_leaf=is_box)
    for (path, s), leaf in zip(flat_s, flat_t):
        leaf = unbox_leaf(leaf)
        # A parameter and its optimizer buffers (same name under opt_state) share a row.
        group = re.sub(r"_block\d+", "_block*", path_str(path))
        group = re.sub(
            r"^(params|opt_state/(\w+/)*?(trace|mu|nu)|opt_state/\d+(/\d+)*)/", "", group
        )
        key = (group, str(s.spec))
        nbytes = math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
        per_dev = (
            nbytes // math.prod(s.mesh.shape[a] for e in s.spec for a in axis_names(e))
            if s.spec
            else nbytes
        )
        r = rows.setdefault(key, [0, 0, 0])
        r[0] += 1
        r[1] += nbytes
        r[2] += per_dev
    lines = [f"{'arrays':>6} {'MiB total':>10} {'MiB/device':>10}  spec  group"]
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][1])
    for (group, spec), (n, b, d) in ordered[:max_rows]:
        lines.append(f"{n:>6} {b / 2**20:>10.2f} {d / 2**20:>10.2f}  {spec}  {group}")
    if len(ordered) > max_rows:
        rest = ordered[max_rows:]
        lines.append(
            f"{sum(r[0] for _, r in rest):>6} {sum(r[1] for _, r in rest) / 2**20:>10.2f} "
            f"{sum(r[2] for _, r in rest) / 2**20:>10.2f}  ...  ({len(rest)} more groups)"
        )
    total = sum(r[1] for r in rows.values())
    dev = sum(r[2] for r in rows.values())
    lines.append(
        f"{sum(r[0] for r in rows.values()):>6} {total / 2**20:>10.2f} {dev / 2**20:>10.2f}  total"
    )
    return "\n".join(lines)
