"""Query sampling weights (bundle.transforms.sampling): power and threshold modes, fallback, SamplingWeightd."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from bundle.transforms.entropy import EntropyMapd
from bundle.transforms.sampling import SamplingWeightd, sampling_weights
from monai.data import MetaTensor


def entropy_map(seed: int, shape: tuple[int, ...] = (1, 12, 15)) -> np.ndarray:
    """Non-negative entropies in bits with a block of exact zeros (flat background)."""
    h = np.random.default_rng(seed).uniform(0, 6.5, shape)
    h[..., :3, :4] = 0.0
    return h


@pytest.mark.parametrize("gamma", [0.3, 1.0, 2.5])
def test_power_mode_matches_numpy(gamma):
    h = entropy_map(0)
    got = sampling_weights(torch.from_numpy(h), gamma=gamma)
    expected = h**gamma / (h**gamma).sum()
    assert got.dtype == torch.float32 and got.shape == h.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-9)
    assert abs(float(got.double().sum()) - 1) < 1e-6
    assert torch.count_nonzero(got[..., :3, :4]) == 0  # H = 0 gets no weight for gamma > 0


def test_gamma_zero_gives_uniform_weights():
    h = entropy_map(1)
    got = sampling_weights(h, gamma=0.0)
    np.testing.assert_allclose(got.numpy(), np.full(h.shape, 1 / h.size), rtol=1e-6)


@pytest.mark.parametrize("d", [0.5, 3.0, 6.0])
def test_threshold_mode_matches_numpy(d):
    h = entropy_map(2)
    got = sampling_weights(h, mode="threshold", threshold=d)
    indicator = (h >= d).astype(np.float64)
    np.testing.assert_allclose(got.numpy(), indicator / indicator.sum(), rtol=1e-6)


def test_all_zero_weights_fall_back_to_uniform_with_warning():
    flat = np.zeros((1, 6, 7))
    with pytest.warns(UserWarning, match="every weight is 0.*uniform"):
        got = sampling_weights(flat)
    np.testing.assert_allclose(got.numpy(), np.full(flat.shape, 1 / 42), rtol=1e-6)
    with pytest.warns(UserWarning, match="uniform"):
        got = sampling_weights(entropy_map(3), mode="threshold", threshold=100.0)
    assert torch.allclose(got, torch.full_like(got, 1 / got.numel()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampling_weights(entropy_map(3))  # a normal map does not warn


@pytest.mark.parametrize(
    "values, kwargs, match",
    [
        (np.array([[0.5, -0.1]]), {}, "negative"),
        (np.array([[0.5, np.nan]]), {}, "NaN"),
        (np.array([[0.5, np.inf]]), {}, "infinite"),
        (np.array([[0.5, 1.0]]), {"mode": "threshold"}, "threshold"),
        (np.array([[0.5, 1.0]]), {"mode": "softmax"}, "mode"),
        (np.array([[0.5, 1.0]]), {"gamma": -1.0}, "gamma"),
        (np.zeros((0, 3)), {}, "empty"),
    ],
)
def test_bad_input_raises(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling_weights(values, **kwargs)


def test_sampling_weightd_keeps_meta_and_default_key():
    h = torch.from_numpy(entropy_map(4, (1, 5, 6, 7))).float()
    affine = torch.diag(torch.tensor([0.8, 0.8, 2.0, 1.0], dtype=torch.float64))
    out = SamplingWeightd(keys="image_entropy")({"image_entropy": MetaTensor(h, affine=affine, meta={"id": "ct1"})})
    weights = out["image_entropy_weight"]
    assert isinstance(weights, MetaTensor) and weights.shape == (1, 5, 6, 7) and weights.dtype == torch.float32
    assert torch.equal(weights.affine, affine) and weights.meta["id"] == "ct1"
    np.testing.assert_allclose(weights.numpy(), sampling_weights(h).numpy(), rtol=1e-7)


def test_sampling_weightd_threshold_and_errors():
    h = entropy_map(5)
    out = SamplingWeightd(keys="e", mode="threshold", threshold=2.0, output_keys="w")({"e": h})
    indicator = (h >= 2.0).astype(np.float64)
    np.testing.assert_allclose(out["w"].numpy(), indicator / indicator.sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="threshold"):
        SamplingWeightd(keys="e", mode="threshold")
    with pytest.raises(ValueError, match="mode"):
        SamplingWeightd(keys="e", mode="linear")
    with pytest.raises(ValueError, match=r"'e'.*1 channel.*\(2, 12, 15\)"):
        SamplingWeightd(keys="e")({"e": np.concatenate([h, h])})
    with pytest.raises(KeyError, match="e"):
        SamplingWeightd(keys="e")({"x": h})
    assert SamplingWeightd(keys="e", allow_missing_keys=True)({"x": 1}) == {"x": 1}


def test_entropy_then_weights_pipeline_on_constant_and_structured_images():
    rng = np.random.default_rng(6)
    image = np.full((1, 40, 40), 20, dtype=np.uint8)
    image[0, 10:30, 10:30] = rng.integers(0, 256, (20, 20))  # information only in the centre
    chain = lambda d: SamplingWeightd(keys="image_entropy")(EntropyMapd(keys="image", window=5)(d))  # noqa: E731
    weights = chain({"image": image})["image_entropy_weight"]
    assert abs(float(weights.sum()) - 1) < 1e-5
    touched = np.zeros((40, 40), dtype=bool)
    touched[8:32, 8:32] = True  # windows (offsets -2 .. 2) that reach the random block
    assert (weights[0].numpy()[touched] > 0).all() and (weights[0].numpy()[~touched] == 0).all()
    assert float(weights[0, 12:28, 12:28].mean()) > float(weights[0, 8:10, 8:32].mean())
    with pytest.warns(UserWarning, match="uniform"):
        weights = chain({"image": np.full((1, 9, 9), 5, dtype=np.uint8)})["image_entropy_weight"]
    np.testing.assert_allclose(weights.numpy(), np.full((1, 9, 9), 1 / 81), rtol=1e-6)
