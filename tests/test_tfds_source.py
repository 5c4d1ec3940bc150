"""tfds datasets through the same pipeline: a locally built dummy dataset (no download)."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from hybridpar.config.errors import ConfigError
from hybridpar.input.tfds_source import TfdsPipeline


class DistinctDigits(tfds.core.GeneratorBasedBuilder):
    """20 train + 20 test grayscale PNGs, each one grey level of its own (tfds' DummyMnist
    repeats one image, so it could not show which host read which example)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = {
            "image": tfds.features.Image(shape=(28, 28, 1)),
            "label": tfds.features.ClassLabel(num_classes=10),
        }
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0), "test": self._generate_examples(100)}

    def _generate_examples(self, offset):
        for i in range(20):
            yield i, {"image": np.full((28, 28, 1), offset + 5 * i, np.uint8), "label": i % 10}


@pytest.fixture(scope="module")
def builder_dir(tmp_path_factory):
    b = DistinctDigits(data_dir=str(tmp_path_factory.mktemp("tfds")))
    b.download_and_prepare()  # generated locally, nothing downloaded
    return b.data_dir


def test_hosts_split_the_data_and_batches_are_rgb_uint8(builder_dir):
    hosts = [TfdsPipeline(builder_dir, "train", process_index=i, process_count=2) for i in (0, 1)]
    assert [h.host_examples for h in hosts] == [10, 10]
    assert hosts[0].num_classes == 10 and hosts[0].num_examples == 20
    assert hosts[0].steps_per_epoch(8) == hosts[1].steps_per_epoch(8) == 2
    batches = list(hosts[0].train_batches(0, image_size=24, global_batch=8))
    assert len(batches) == 2
    assert batches[0]["image"].shape == (4, 24, 24, 3) and batches[0]["image"].dtype == np.uint8
    again = list(hosts[0].train_batches(0, image_size=24, global_batch=8))
    np.testing.assert_array_equal(batches[1]["image"], again[1]["image"])
    ids = [i for h in hosts for i, _ in h.examples(0)]
    assert len(ids) == 10 + 10
    # each host enumerates its own slice from 0; labels over both hosts cover the split
    evals = [list(h.eval_batches(image_size=24, global_batch=16)) for h in hosts]
    assert sum(float(b["mask"].sum()) for e in evals for b in e) == 20
    # The hosts read different examples, which together are the whole split: two hosts
    # reading the same slice would pass the counts above but not this.
    seen = [_images(e) for e in evals]
    one = TfdsPipeline(builder_dir, "train", process_index=0, process_count=1)
    everything = _images(list(one.eval_batches(image_size=24, global_batch=16)))
    assert len(everything) == 20, "the dummy images must be distinct for this check"
    assert not seen[0] & seen[1], "two hosts read the same examples"
    assert seen[0] | seen[1] == everything


def test_dct_scaling_follows_the_sampled_median_side(builder_dir):
    """Without prepare's recorded median, the pipeline estimates it from the split's first
    images (28 x 28 PNGs here) and allows reduced DCT scales only up to a quarter of it."""
    pipe = TfdsPipeline(builder_dir, "train", process_index=0, process_count=1)
    assert pipe.info["copies"]["full"]["median_short_side"] == 28
    assert pipe.decoding_for("full", 7)["dct_scaling"] is True
    assert pipe.decoding_for("full", 8)["dct_scaling"] is False


def _images(batches) -> set[bytes]:
    """The distinct real (unpadded) images of a host's eval batches, as bytes."""
    return {img.tobytes() for b in batches for img, m in zip(b["image"], b["mask"]) if m}


def test_unbuilt_dataset_says_how_to_build_it(tmp_path):
    with pytest.raises(ConfigError, match="nothing may be downloaded"):
        TfdsPipeline("mnist", "train", data_dir=str(tmp_path), process_index=0, process_count=1)
    with pytest.raises(ConfigError, match="has no split"):
        b = tfds.testing.DummyMnist(data_dir=str(tmp_path))
        b.download_and_prepare()
        TfdsPipeline(b.data_dir, "validation", process_index=0, process_count=1)
