"""Device meshes from a one-line spec such as ``"data:4,model:2"``.

Every mesh has the three axes ``data``, ``fsdp`` and ``model`` (in that order; axes the spec
leaves out have size 1), so rules and steps can name any axis on any mesh. ``model`` is the
innermost axis: ``jax.make_mesh`` lays devices out so that the innermost axes are the
closest devices (same host, same NVLink/ICI island), which is where the chatty
model-parallel collectives belong. The data axes then span hosts.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from hybridpar.config.errors import ConfigError

AXES = ("data", "fsdp", "model")


class MeshSpecError(ConfigError):
    """A mesh spec that does not read, or does not fit the devices (``parse_mesh_spec``):
    a caller that took the spec from elsewhere (the evaluator: the run's) can say so."""
# Batch dimensions are split over every data-parallel axis: FSDP is data parallel too.
BATCH_AXES = ("data", "fsdp")


def axes_with_devices(mesh, axes) -> tuple[str, ...]:
    """The axes of ``axes`` over more than one device of ``mesh``, in order.

    Code that names mesh axes in collectives or shard_map specs uses only these: JAX and
    XLA keep a collective over a size-1 axis as one-device all-reduces (XLA:CPU does not
    remove them).
    """
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def parse_mesh_spec(spec: str, num_devices: int, platform: str = "cpu") -> dict[str, int]:
    """``"data:4,model:2"`` -> ``{"data": 4, "fsdp": 1, "model": 2}``; ``-1`` fills the rest.
    ``platform``: the devices', for the hint when the count is wrong."""
    sizes: dict[str, int] = {}
    fill = None
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, size = part.partition(":")
        name = name.strip()
        if not sep or name not in AXES:
            raise MeshSpecError(
                f"mesh spec {spec!r}: {part!r} is not AXIS:SIZE with AXIS one of {AXES}; "
                "write it like 'data:4,model:2' (-1 means the rest of the devices)"
            )
        if name in sizes or name == fill:
            raise MeshSpecError(f"mesh spec {spec!r} names axis {name!r} twice")
        try:
            n = int(size)
        except ValueError:
            raise MeshSpecError(
                f"mesh spec {spec!r}: size {size!r} of axis {name!r} is not an integer"
            ) from None
        if n == -1:
            if fill is not None:
                raise MeshSpecError(f"mesh spec {spec!r}: only one axis may be -1")
            fill = name
        elif n < 1:
            raise MeshSpecError(
                f"mesh spec {spec!r}: axis {name!r} has size {n}; sizes are >= 1 or -1"
            )
        else:
            sizes[name] = n
    known = math.prod(sizes.values())
    if fill is not None:
        if num_devices % known:
            raise MeshSpecError(
                f"mesh spec {spec!r}: the fixed axes ({known} devices) do not divide the "
                f"{num_devices} devices, so -1 cannot fill the rest"
            )
        sizes[fill] = num_devices // known
    total = math.prod(sizes.values())
    if total != num_devices:
        # virtual devices are a CPU-only remedy: a TPU or GPU count is the hardware's
        where = (
            f" (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={total})"
            if platform == "cpu"
            else ""
        )
        raise MeshSpecError(
            f"mesh spec {spec!r} needs {total} devices but {num_devices} are available; "
            f"make the sizes multiply to {num_devices} (e.g. 'data:-1', on the command line "
            f"--config.mesh=data:-1), or run on "
            f"{total} devices{where}"
        )
    return {axis: sizes.get(axis, 1) for axis in AXES}


def make_mesh(spec: str | dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``("data", "fsdp", "model")`` from a spec string or dict.

    ``devices`` defaults to all devices of all processes. Axes are ``AxisType.Auto`` so XLA's
    partitioner propagates shardings through the model (we constrain only inputs, parameters
    and outputs).
    """
    if not isinstance(spec, (str, dict)):
        raise ConfigError(
            f"make_mesh({spec!r}): the spec must be a string such as 'data:4,model:2' "
            "('data:-1': all devices) or a dict such as {'data': 4, 'model': 2}, "
            f"not {type(spec).__name__}"
        )
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ConfigError(f"make_mesh({spec!r}, devices=[]): the device list is empty")
    if isinstance(spec, dict):
        spec = ",".join(f"{k}:{v}" for k, v in spec.items())
    if not spec.strip():
        raise ConfigError(
            f"mesh spec {spec!r} is empty; write it like 'data:4,model:2' "
            "('data:-1': all devices on the data axis)"
        )
    sizes = parse_mesh_spec(spec, len(devices), devices[0].platform)
    shape = tuple(sizes[a] for a in AXES)
    if jax.process_count() > 1 and sizes["model"] > 1 and jax.local_device_count() % sizes["model"]:
        raise ConfigError(
            f"mesh {spec!r}: model axis of size {sizes['model']} does not divide the "
            f"{jax.local_device_count()} devices of one host; model-parallel groups must stay "
            "inside a host (fast links), so choose a model size that divides the devices per host"
        )
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        return _multi_slice_mesh(spec, sizes, slices, devices)
    try:
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                             devices=devices)  # fmt: skip
    except NotImplementedError as e:  # a TPU torus that these sizes cannot tile
        raise ConfigError(_torus_hint(spec, sizes, devices, e)) from None


def _torus_sides(devices) -> tuple[int, ...]:
    """The sides of the devices' physical grid (TPU ``coords``); () where they have none."""
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    if not coords or not coords[0]:
        return ()
    sides = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    per_chip = len(devices) // math.prod(sides)  # cores of one chip, where a chip has several
    return tuple(n for n in (*sides, per_chip) if n > 1)


def _torus_hint(spec: str, sizes: dict, devices, error) -> str:
    """One line for a mesh jax cannot lay on the TPU torus: what fits, and an example."""
    sides = _torus_sides(devices)
    if not sides:
        return f"mesh {spec!r} cannot be laid on these devices: {str(error).split('. ')[0]}"
    fits = sorted({math.prod(c) for r in range(len(sides) + 1)
                   for c in itertools.combinations(sides, r)})  # fmt: skip
    bad = [a for a in AXES if sizes[a] not in fits]
    example = ",".join(
        f"{a}:{min(fits, key=lambda f: (abs(math.log(f / sizes[a])), f))}"
        for a in AXES if a != "data" and sizes[a] > 1
    )  # fmt: skip
    example = "data:-1" + ("," + example if example else "")
    grid = "x".join(map(str, sides))
    return (
        f"mesh {spec!r} does not tile the {len(devices)} devices' {grid} torus: each axis size "
        f"must be a product of some of its sides ({', '.join(map(str, fits))}), and "
        f"{', '.join(f'{a}={sizes[a]}' for a in bad)} {'is' if len(bad) == 1 else 'are'} "
        f"not; use e.g. --config.mesh={example}"
    )


def _multi_slice_mesh(spec: str, sizes: dict, slices: int, devices) -> Mesh:
    """Devices of several slices (TPU pods joined over the data-centre network, DCN): only
    ``data`` crosses the slices, as data parallelism needs one gradient reduction per step
    over the slow links, while ``fsdp`` and ``model`` gather and reduce within a layer and
    stay on a slice's fast interconnect (ICI); MaxText splits its ``dcn_*`` and ``ici_*``
    axes the same way."""
    from jax.experimental import mesh_utils

    if sizes["data"] % slices:
        raise ConfigError(
            f"mesh {spec!r} on {slices} slices: only the data axis crosses slices (fsdp and "
            f"model stay within one, on its fast links), so data={sizes['data']} must be a "
            f"multiple of {slices}, e.g. --config.mesh=data:{slices},fsdp:-1"
        )
    ici = (sizes["data"] // slices, sizes["fsdp"], sizes["model"])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices, 1, 1), devices=devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axes_across_slices(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which devices of different slices meet (their traffic goes over
    DCN); empty on one slice or on devices without slices."""
    import numpy as np

    index = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
    return tuple(a for i, a in enumerate(mesh.axis_names) if (np.diff(index, axis=i) != 0).any())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes ``mesh`` has, in ``BATCH_AXES`` order.

    Any mesh over the axes ``data``, ``fsdp`` and ``model`` works, ``jax.make_mesh((4, 2),
    ("data", "model"))`` included: an axis it lacks counts as size 1. Other names are refused,
    since a batch split over an axis we do not know would silently not be split.
    """
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ConfigError(
            f"mesh axes {tuple(mesh.axis_names)}: {tuple(unknown)} not among {AXES}; hybridpar "
            f"splits the batch over {BATCH_AXES} and models over 'model', so name the mesh "
            "axes from those, e.g. jax.make_mesh((4, 2), ('data', 'model'))"
        )
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def axis_names(entry) -> tuple[str, ...]:
    """A spec entry's mesh axes as a tuple: None names none, a string one ("data" is one
    axis, not "d", "a", ...), a tuple or list several."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axes_size(axes) -> int:
    """The devices over ``axes`` (one mesh axis or several), inside a shard_map over them."""
    from jax import lax

    return math.prod(lax.axis_size(a) for a in axis_names(axes))


def check_divides(batch: int, ways: int, setting: str, where: str) -> None:
    """A batch must split evenly over the ``ways`` data-parallel devices (data x fsdp) of
    the mesh ``where`` names: else one ConfigError with the nearest multiple, as the user
    sets it (``setting`` + the number: ``"--config.global_batch="``, ``"--batch "``)."""
    if batch % ways:
        raise ConfigError(
            f"{setting}{batch} does not divide over the {ways} data-parallel devices of "
            f"{where} (data x fsdp); use a multiple of {ways}, e.g. "
            f"{setting}{max(ways, batch // ways * ways)}"
        )


def data_parallel_size(mesh: Mesh | str) -> int:
    """How many ways the batch is split: the product of the data-parallel axes, of a mesh
    or of the spec that names one (``"data:4,model:2"``; only a spec with -1 needs the
    device count, which starts JAX's backend but allocates nothing)."""
    if isinstance(mesh, str):
        sizes = [p.partition(":")[2].strip() for p in mesh.split(",") if p.strip()]
        if "-1" in sizes:
            devices = jax.device_count()
        else:  # parse_mesh_spec says what is wrong with a bad size
            devices = math.prod(int(n) for n in sizes if n.isdigit())
        sizes = parse_mesh_spec(mesh, devices)
        return math.prod(sizes[a] for a in BATCH_AXES)
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def describe_mesh(mesh: Mesh) -> str:
    axes = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    kind = mesh.devices.flat[0].platform
    return (
        f"mesh: {axes} ({mesh.size} {kind} devices, {jax.process_count()} process(es); "
        f"batch split {data_parallel_size(mesh)} ways)"
    )
