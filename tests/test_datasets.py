"""The training data set under a memory budget (bundle.data.datasets.cached_dataset, the ``cache_gb`` key)."""

from __future__ import annotations

import numpy as np
import pytest
from bundle.configs import bundle_parser
from bundle.data.datasets import cached_dataset, item_bytes
from bundle.data.synthetic import generate_synthetic_2d
from monai.transforms import Compose, MapTransform, RandomizableTransform

ITEM_FLOATS = 1000  # the deterministic head leaves a 4000-byte array per item


class _Expand(MapTransform):
    """Deterministic: ``x`` (an index) becomes a float32 array of ITEM_FLOATS copies; counts its calls."""

    def __init__(self) -> None:
        super().__init__(keys="x")
        self.calls = 0

    def __call__(self, data: dict) -> dict:
        self.calls += 1
        return {**data, "x": np.full(ITEM_FLOATS, float(data["x"]), np.float32)}


class _RandOffset(RandomizableTransform):
    """Random: adds an offset in [0, 0.5) to ``x``, kept as ``offset``."""

    def __call__(self, data: dict) -> dict:
        offset = self.R.uniform(0.0, 0.5)
        return {**data, "x": data["x"] + offset, "offset": offset}


def test_small_budget_caches_what_fits_and_yields_every_item():
    expand = _Expand()
    items = [{"x": i} for i in range(5)]
    budget = 2.5 * ITEM_FLOATS * 4 / 2**30  # two and a half items
    dataset = cached_dataset(items, Compose([expand, _RandOffset()]), cache_gb=budget, num_workers=0)
    assert dataset.cache_num == 2 and len(dataset) == 5
    assert expand.calls == 3  # the first item measured, then the two cached
    for _ in range(2):
        for i in range(5):
            out = dataset[i]
            np.testing.assert_allclose(out["x"], np.full(ITEM_FLOATS, i + out["offset"], np.float32), rtol=1e-6)
            assert 0.0 <= out["offset"] < 0.5
    assert expand.calls == 3 + 2 * 3  # the three items beyond the budget transformed whole at each draw


def test_zero_budget_caches_nothing():
    dataset = cached_dataset([{"x": i} for i in range(3)], Compose([_Expand(), _RandOffset()]), cache_gb=0)
    assert dataset.cache_num == 0
    outs = [dataset[i] for i in range(3)]
    assert [float(out["x"][0] - out["offset"]) for out in outs] == pytest.approx([0, 1, 2])


def test_item_bytes():
    import torch
    from monai.data import MetaTensor

    image = MetaTensor(torch.zeros(1, 8, 8), affine=torch.eye(3, dtype=torch.float64))
    assert item_bytes([{"image": image, "w": np.zeros(5, np.float64)}, "name", 3]) == 256 + 72 + 40


def test_default_caches_a_hundred_image_set(tmp_path):
    """The default ``cache_gb`` keeps 100 training images all in memory, as ``cache_rate`` 1 did (the cached form is
    on the network grid: the original size does not matter)."""
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=0, n_test=0, size=(64, 64))
    parser = bundle_parser("configs/train.yaml", datalist=str(datalist), output_dir=str(tmp_path / "out"))
    items = parser.get_parsed_content("train#dataset#data")
    parser["train"]["dataset"]["data"] = [dict(items[i % 2]) for i in range(100)]
    dataset = parser.get_parsed_content("train#dataset", instantiate=True)
    assert dataset.cache_num == len(dataset) == 100
    assert dataset[99]["image"].shape == (1, *parser["image_size"])


@pytest.mark.parametrize("value", [-1, "8GB", True, float("nan"), None])
def test_bad_budget_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"cache_gb: expected a finite number >= 0, got"):
        cached_dataset([{"x": 0}], Compose([_Expand(), _RandOffset()]), cache_gb=value)


def test_the_heap_is_trimmed_after_each_cached_item(monkeypatch):
    """glibc keeps an item's full-resolution temporaries resident once its small result lies among them: the cache
    gives the free pages back after each item it computes."""
    import bundle.data.datasets as datasets

    trims = []
    monkeypatch.setattr(datasets, "release_free_memory", lambda: trims.append(1))
    dataset = cached_dataset([{"x": i} for i in range(4)], Compose([_Expand(), _RandOffset()]), cache_gb=1)
    assert dataset.cache_num == 4 and len(trims) == 1 + 4  # the measured first item, then the four cached
