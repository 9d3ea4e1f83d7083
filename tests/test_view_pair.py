"""RandViewPaird: exact query correspondence in rotated/scaled crops, sampling ∝ rho, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle.networks.features import sample_features
from bundle.transforms.view_pair import RandViewPaird
from monai.data import MetaTensor
from monai.transforms import Lambdad, MapTransform, RandScaleIntensityd
from scipy.stats import chi2


def _coordinate_image(spatial: tuple[int, ...]) -> torch.Tensor:
    """One channel per axis whose value is that axis' coordinate (a linear field, exact under bilinear resampling)."""
    axes = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in spatial], indexing="ij")
    return torch.stack(axes)


def _interior_weights(spatial: tuple[int, ...], border: int = 2) -> torch.Tensor:
    """Positive weights away from the image border (where zero padding would break linearity)."""
    w = torch.zeros(1, *spatial)
    w[(slice(None),) + (slice(border, -border),) * len(spatial)] = torch.rand(*(n - 2 * border for n in spatial)) + 0.1
    return w


def _value_at(image: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Bilinear/trilinear values (N, C) of a (C, *spatial) image at (N, D) points (an independent sampler)."""
    return sample_features(image[None], points[None], image.shape[1:])[0]


def _linear_part(query: torch.Tensor, crop_query: torch.Tensor) -> np.ndarray:
    """Least-squares linear map L with crop_query - mean = L (query - mean)."""
    q = (query - query.mean(0)).double().numpy()
    p = (crop_query - crop_query.mean(0)).double().numpy()
    return np.linalg.lstsq(q, p, rcond=None)[0].T


@pytest.mark.parametrize(
    "spatial, crop, rotate, scale",
    [((96, 80), (40, 48), 25.0, 0.2), ((40, 36, 32), (20, 24, 16), (15.0, 10.0, 20.0), 0.1)],
)
def test_crop_at_crop_query_equals_image_at_query(spatial, crop, rotate, scale):
    torch.manual_seed(0)
    image = _coordinate_image(spatial)
    weights = _interior_weights(spatial)
    t = RandViewPaird(crop_size=crop, num_queries=24, rotate_range=rotate, scale_range=scale).set_random_state(3)
    max_angle = 0.0
    for _ in range(12):
        out = t({"image": image, "image_weight": weights})
        query, crop_query = out["query"], out["crop_query"]
        # the crop's value at crop_query is the image coordinate of query: exact correspondence, every axis
        torch.testing.assert_close(_value_at(out["crop"], crop_query), query, atol=2e-4, rtol=0)
        torch.testing.assert_close(_value_at(image, query), query, atol=1e-5, rtol=0)
        # queries are pixel centres of the image, inside the crop by the margin
        assert torch.equal(query, query.round())
        assert (crop_query >= 4 - 1e-4).all() and (crop_query <= torch.tensor(crop) - 5 + 1e-4).all()
        # the mapping is a real rotation + zoom within the ranges
        linear = _linear_part(query, crop_query)
        zoom = abs(np.linalg.det(linear)) ** (1 / len(spatial))
        assert 1 - scale - 1e-3 <= zoom <= 1 + scale + 1e-3
        rotation = linear / zoom
        np.testing.assert_allclose(rotation @ rotation.T, np.eye(len(spatial)), atol=1e-4)
        max_angle = max(max_angle, np.degrees(np.arccos(np.clip((np.trace(rotation) - (len(spatial) - 2)) / 2, -1, 1))))
    assert max_angle > 5.0  # rotations were actually applied


def test_without_augmentation_the_crop_is_an_exact_slice():
    torch.manual_seed(1)
    image = torch.rand(2, 50, 70)
    weights = torch.zeros(1, 50, 70)
    weights[:, 4:-4, 4:-4] = 1.0  # anchors at least `margin` from the border: the box fits inside the image
    t = RandViewPaird(crop_size=(32, 24), num_queries=8, prob=0.0).set_random_state(5)
    for _ in range(10):
        out = t({"image": image, "image_weight": weights})
        start = out["query"] - out["crop_query"]
        assert torch.equal(start, start[:1].expand_as(start)) and torch.equal(start, start.round())
        x, y = start[0].long().tolist()
        assert 0 <= x <= 50 - 32 and 0 <= y <= 70 - 24
        # a copy up to the float32 rounding of the sampling grid
        torch.testing.assert_close(out["crop"], image[:, x : x + 32, y : y + 24], atol=2e-5, rtol=0)


def test_crop_larger_than_image_is_padded_implicitly():
    image = _coordinate_image((20, 26)) + 1.0  # values >= 1, so zero padding is recognisable
    t = RandViewPaird(weight_key=None, crop_size=(32, 32), num_queries=16, rotate_range=0.0).set_random_state(2)
    for _ in range(5):
        out = t({"image": image})
        assert out["image"].shape == (2, 20, 26)  # the whole image keeps its grid
        torch.testing.assert_close(_value_at(out["crop"], out["crop_query"]), out["query"] + 1.0, atol=1e-4, rtol=0)
        x, y = (out["query"][0] - out["crop_query"][0]).long().tolist()
        assert -12 <= x <= 0 and -6 <= y <= 0  # the box covers the whole image
        inside = out["crop"][:, -x : -x + 20, -y : -y + 26]
        torch.testing.assert_close(inside, image, atol=1e-4, rtol=0)
        assert out["crop"].abs().sum() - inside.abs().sum() < 1e-3  # zeros around the image


def test_queries_never_drawn_where_weight_is_zero():
    spatial = (64, 64)
    weights = torch.ones(1, *spatial)
    weights[:, :32] = 0.0  # x < 32 is forbidden
    t = RandViewPaird(crop_size=(32, 32), num_queries=16, rotate_range=20.0, scale_range=0.1).set_random_state(0)
    queries = torch.cat([t({"image": torch.rand(1, *spatial), "image_weight": weights})["query"] for _ in range(60)])
    assert (queries[:, 0] >= 32).all()
    assert queries[:, 0].min() <= 34 and queries[:, 0].max() >= 61  # yet the allowed half is covered


def _quadrant_counts(points: torch.Tensor, half: int) -> np.ndarray:
    quadrant = (points[:, 0] >= half).long() * 2 + (points[:, 1] >= half).long()
    return np.bincount(quadrant.numpy(), minlength=4)


def test_query_frequencies_follow_the_weights():
    size, half = 24, 12
    weights = torch.ones(1, size, size)
    weights[:, :half, half:] = 2.0
    weights[:, half:, :half] = 3.0
    weights[:, half:, half:] = 4.0
    expected = np.array([1, 2, 3, 4]) / 10
    # a crop equal to the image: every query is drawn from the whole weight map
    t = RandViewPaird(crop_size=(size, size), num_queries=16, rotate_range=0.0, margin=0).set_random_state(7)
    queries = torch.cat(
        [t({"image": torch.zeros(1, size, size), "image_weight": weights})["query"] for _ in range(200)]
    )
    counts = _quadrant_counts(queries, half)
    statistic = ((counts - expected * counts.sum()) ** 2 / (expected * counts.sum())).sum()
    assert statistic < chi2.ppf(0.999, df=3), (counts, statistic)
    # the anchor (first query) follows the weights also for a small rotated crop in a larger image
    big = torch.nn.functional.interpolate(weights[None], scale_factor=4, mode="nearest")[0]
    t = RandViewPaird(crop_size=(32, 32), num_queries=1, rotate_range=15.0).set_random_state(8)
    anchors = torch.cat([t({"image": torch.zeros(1, 96, 96), "image_weight": big})["query"] for _ in range(600)])
    counts = _quadrant_counts(anchors, 48)
    statistic = ((counts - expected * counts.sum()) ** 2 / (expected * counts.sum())).sum()
    assert statistic < chi2.ppf(0.999, df=3), (counts, statistic)


def test_set_random_state_makes_it_deterministic():
    image = torch.rand(1, 48, 48)
    weights = torch.rand(1, 48, 48)

    def run(seed):
        t = RandViewPaird(
            crop_size=(24, 24),
            num_queries=8,
            scale_range=0.1,
            crop_intensity_transform=RandScaleIntensityd(keys="image", factors=0.5, prob=1.0),
        ).set_random_state(seed)
        return [t({"image": image, "image_weight": weights}) for _ in range(3)]

    first, again, other = run(11), run(11), run(12)
    for a, b in zip(first, again):
        for key in ("crop", "query", "crop_query"):
            assert torch.equal(a[key], b[key])
    assert not all(torch.equal(a["crop_query"], c["crop_query"]) for a, c in zip(first, other))


class _AddEntropy(MapTransform):
    """Adds the cropped IIE map to the image: shows what the crop transform receives."""

    def __call__(self, data):
        d = dict(data)
        d["image"] = d["image"] + d["entropy"]
        return d


def test_intensity_transforms_act_on_their_own_view_and_receive_the_entropy_crop():
    spatial = (60, 52)
    image = _coordinate_image(spatial)[:1]
    entropy = 0.5 * _coordinate_image(spatial)[1:] + 3.0  # a different linear field
    weights = _interior_weights(spatial)
    data = {"image": image, "image_weight": weights, "entropy": entropy, "landmarks": [[1.0, 2.0]]}
    kwargs = dict(crop_size=(32, 32), num_queries=16, rotate_range=20.0, entropy_key="entropy")
    plain = RandViewPaird(**kwargs).set_random_state(4)(data)
    out = RandViewPaird(
        **kwargs,
        crop_intensity_transform=_AddEntropy(keys="image"),
        image_intensity_transform=Lambdad(keys="image", func=lambda x: 2 * x),
    ).set_random_state(4)(data)
    assert torch.equal(out["query"], plain["query"]) and torch.equal(out["crop_query"], plain["crop_query"])
    # the crop got the entropy map cut with the same geometry, at the same anatomical point
    expected = _value_at(image, out["query"]) + _value_at(entropy, out["query"])
    torch.testing.assert_close(_value_at(out["crop"], out["crop_query"]), expected, atol=2e-4, rtol=0)
    # the whole image went through its own transform only; the crop is not doubled
    torch.testing.assert_close(out["image"], 2 * image)
    torch.testing.assert_close(plain["image"], image)
    assert torch.equal(out["entropy"], entropy) and out["landmarks"] == [[1.0, 2.0]]


def test_shapes_and_dtypes():
    image = MetaTensor(torch.rand(3, 40, 44, dtype=torch.float64))
    out = RandViewPaird(crop_size=(16, 20), num_queries=5, weight_key=None).set_random_state(0)(
        {"image": image, "id": 7}
    )
    assert out["image"] is image and out["id"] == 7
    assert type(out["crop"]) is torch.Tensor and out["crop"].shape == (3, 16, 20) and out["crop"].dtype == torch.float32
    for key in ("query", "crop_query"):
        assert type(out[key]) is torch.Tensor and out[key].shape == (5, 2) and out[key].dtype == torch.float32
    one = RandViewPaird(crop_size=(8, 8, 8), num_queries=1, margin=2, weight_key=None).set_random_state(0)
    out = one({"image": torch.rand(1, 12, 10, 9)})
    assert out["crop"].shape == (1, 8, 8, 8) and out["query"].shape == (1, 3) and out["crop_query"].shape == (1, 3)


def test_clear_errors():
    image = torch.rand(1, 32, 32)
    t = RandViewPaird(crop_size=(16, 16))
    with pytest.raises(ValueError, match=r"image_weight.*\(1, 30, 32\).*\(1, 32, 32\).*'image'"):
        t({"image": image, "image_weight": torch.ones(1, 30, 32)})
    with pytest.raises(ValueError, match="image_weight.*all zero"):
        t({"image": image, "image_weight": torch.zeros(1, 32, 32)})
    with pytest.raises(ValueError, match="image_weight.*non-negative"):
        t({"image": image, "image_weight": -torch.ones(1, 32, 32)})
    with pytest.raises(KeyError, match="image_weight"):
        t({"image": image})
    with pytest.raises(ValueError, match=r"'image'.*crop_size \(16, 16\).*\(1, 8, 32, 32\)"):
        t({"image": torch.rand(1, 8, 32, 32), "image_weight": torch.ones(1, 8, 32, 32)})
    with pytest.raises(ValueError, match="entropy map 'iie'"):
        RandViewPaird(crop_size=(16, 16), weight_key=None, entropy_key="iie")(
            {"image": image, "iie": torch.ones(32, 32)}
        )
    with pytest.raises(ValueError, match="margin 8 leaves no room.*crop_size \\(16, 16\\)"):
        RandViewPaird(crop_size=(16, 16), margin=8)
    with pytest.raises(ValueError, match="rotate_range must be one number or 3 values"):
        RandViewPaird(crop_size=(8, 8, 8), margin=1, rotate_range=(5.0, 5.0))
    with pytest.raises(ValueError, match="scale_range"):
        RandViewPaird(scale_range=1.5)
    with pytest.raises(ValueError, match="crop_size"):
        RandViewPaird(crop_size=(64,))
