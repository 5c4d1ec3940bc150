"""hybridpar.shard_batch: host-local batches -> global arrays, and the checks on their leaves."""

import numpy as np
import pytest

from hybridpar.errors import ConfigError
from hybridpar.mesh import make_mesh
from hybridpar.partitioning import shard_batch


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("data:8")


def test_matching_leaves_become_global_arrays(mesh):
    batch = {"image": np.zeros((16, 4, 4, 3), np.uint8), "label": np.arange(16, dtype=np.int32)}
    out = shard_batch(batch, mesh)
    assert out["image"].shape == (16, 4, 4, 3) and out["label"].shape == (16,)
    np.testing.assert_array_equal(np.asarray(out["label"]), batch["label"])


@pytest.mark.parametrize(
    "labels, expect",
    [
        (np.arange(8, dtype=np.int32), r"'image': 16, 'label': 8"),  # both divide the mesh
        (np.arange(24, dtype=np.int32), r"'image': 16, 'label': 24"),
        (np.int32(3), r"'image': 16, 'label': a scalar"),
    ],
)
def test_leaves_of_different_lengths_are_refused_naming_them(mesh, labels, expect):
    batch = {"image": np.zeros((16, 4, 4, 3), np.uint8), "label": labels}
    with pytest.raises(ConfigError, match=expect):
        shard_batch(batch, mesh)


def test_nested_leaves_are_named_by_path(mesh):
    batch = {"x": {"a": np.zeros((8, 2)), "b": np.zeros((16, 2))}, "mask": np.ones(8)}
    with pytest.raises(ConfigError, match=r"'x/b': 16"):
        shard_batch(batch, mesh)
