"""Multi-scale InfoNCE loss against hand computations (numpy), masking, temperature and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bundle.losses.infonce import MultiScaleInfoNCELoss
from bundle.networks.contrastive import ContrastiveLandmarkNet


def unit(array: np.ndarray) -> np.ndarray:
    return array / np.linalg.norm(array, axis=0, keepdims=True)


def bilinear(feature: np.ndarray, point: tuple[float, float], input_size: tuple[int, int]) -> np.ndarray:
    """Independent reference of sampling a (C, H, W) map at an input-grid point (cell i at (i+0.5)*s-0.5)."""
    out = np.zeros(feature.shape[0])
    corners = []
    for axis in range(2):
        pos = (point[axis] + 0.5) * feature.shape[axis + 1] / input_size[axis] - 0.5
        pos = min(max(pos, 0.0), feature.shape[axis + 1] - 1.0)
        low = min(math.floor(pos), feature.shape[axis + 1] - 2)
        corners.append((low, pos - low))
    (i0, fi), (j0, fj) = corners
    for di, wi in ((0, 1 - fi), (1, fi)):
        for dj, wj in ((0, 1 - fj), (1, fj)):
            out += wi * wj * feature[:, i0 + di, j0 + dj]
    return out


def info_nce(query: np.ndarray, keys: np.ndarray, positive: int, temperature: float) -> float:
    """-log softmax of the positive: logsumexp(q.k / T) - q.k+ / T."""
    q = query / np.linalg.norm(query)
    logits = keys @ q / temperature
    return float(np.log(np.exp(logits).sum()) - logits[positive])


def to_torch(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.tensor(a[None], dtype=torch.float64) for a in arrays]


@pytest.fixture()
def two_scale_case() -> dict:
    rng = np.random.default_rng(0)
    return {
        "image": [unit(rng.normal(size=(3, 2, 2))), unit(rng.normal(size=(3, 4, 4)))],  # strides 2 and 1 on a 4x4 input
        "crop": [unit(rng.normal(size=(3, 2, 2))), unit(rng.normal(size=(3, 4, 4)))],
        "image_points": np.array([[1.0, 2.0], [3.0, 0.0]]),
        "crop_points": np.array([[1.3, 0.6], [2.0, 2.5]]),
    }


def test_two_scales_match_hand_computation(two_scale_case: dict) -> None:
    case, temperature = two_scale_case, 0.2
    expected_terms = []
    for scale, window in ((0, None), (1, 3)):
        image_map, crop_map = case["image"][scale], case["crop"][scale]
        size = image_map.shape[1]
        losses = []
        for ip, cp in zip(case["image_points"], case["crop_points"]):
            query = bilinear(crop_map, tuple(cp), (4, 4))
            cell = [int(round((c + 0.5) * size / 4 - 0.5)) for c in ip]
            if window is None:
                cells = [(i, j) for i in range(size) for j in range(size)]
            else:  # 3x3 window clipped at the border
                rows, cols = range(cell[0] - 1, cell[0] + 2), range(cell[1] - 1, cell[1] + 2)
                cells = [(i, j) for i in rows for j in cols if 0 <= i < size and 0 <= j < size]
            keys = np.stack([image_map[:, i, j] for i, j in cells])
            losses.append(info_nce(query, keys, cells.index(tuple(cell)), temperature))
        expected_terms.append(np.mean(losses))

    loss = MultiScaleInfoNCELoss(temperature=temperature, local_window=[None, 3])
    total, terms = loss(
        to_torch(*case["image"]),
        to_torch(*case["crop"]),
        *to_torch(case["image_points"], case["crop_points"]),
        (4, 4),
        (4, 4),
        return_terms=True,
    )
    np.testing.assert_allclose([t.item() for t in terms], expected_terms, rtol=1e-10)
    assert total.item() == pytest.approx(sum(expected_terms), rel=1e-10)

    weighted = MultiScaleInfoNCELoss(temperature=temperature, local_window=[None, 3], scale_weights=[0.5, 2.0])
    value = weighted(
        to_torch(*case["image"]),
        to_torch(*case["crop"]),
        *to_torch(case["image_points"], case["crop_points"]),
        (4, 4),
        (4, 4),
    )
    assert value.item() == pytest.approx(0.5 * expected_terms[0] + 2.0 * expected_terms[1], rel=1e-10)


def test_window_is_clipped_not_wrapped_at_borders() -> None:
    rng = np.random.default_rng(1)
    image = unit(rng.normal(size=(2, 5, 5)))
    crop = unit(rng.normal(size=(2, 5, 5)))
    point = np.array([[0.0, 4.0]])  # corner cell (0, 4): a 3x3 window keeps 4 cells
    loss = MultiScaleInfoNCELoss(temperature=0.1, local_window=[3])
    value = loss(to_torch(image), to_torch(crop), *to_torch(point, point), (5, 5), (5, 5)).item()
    cells = [(0, 3), (0, 4), (1, 3), (1, 4)]
    keys = np.stack([image[:, i, j] for i, j in cells])
    assert value == pytest.approx(info_nce(crop[:, 0, 4], keys, 1, 0.1), rel=1e-10)

    # cells outside the window (including those a wrap-around would reach) do not matter
    changed = image.copy()
    changed[:, 4, :] = unit(rng.normal(size=(2, 5)))
    changed[:, :, 0] = unit(rng.normal(size=(2, 5)))
    changed[:, 2:, 2] = unit(rng.normal(size=(2, 3)))
    again = loss(to_torch(changed), to_torch(crop), *to_torch(point, point), (5, 5), (5, 5))
    assert again.item() == pytest.approx(value, rel=1e-12)


def test_window_in_3d_matches_global_when_it_covers_the_map() -> None:
    torch.manual_seed(0)
    image = F.normalize(torch.randn(2, 4, 3, 3, 3), dim=1)
    crop = F.normalize(torch.randn(2, 4, 3, 3, 3), dim=1)
    points = torch.rand(2, 5, 3) * 2
    local = MultiScaleInfoNCELoss(local_window=[5])([image], [crop], points, points, (3, 3, 3), (3, 3, 3))
    whole = MultiScaleInfoNCELoss(local_window=[None])([image], [crop], points, points, (3, 3, 3), (3, 3, 3))
    assert local.item() == pytest.approx(whole.item(), rel=1e-5)
    smaller = MultiScaleInfoNCELoss(local_window=[1])([image], [crop], points, points, (3, 3, 3), (3, 3, 3))
    assert smaller.item() == pytest.approx(0.0, abs=1e-6)  # a single key: the positive


def test_temperature_scales_the_logits(two_scale_case: dict) -> None:
    case = two_scale_case
    points = to_torch(case["image_points"], case["crop_points"])
    args = (to_torch(*case["image"]), to_torch(*case["crop"]), *points, (4, 4), (4, 4))
    q = bilinear(case["crop"][0], tuple(case["crop_points"][0]), (4, 4))
    keys = case["image"][0].reshape(3, -1).T
    for temperature in (0.05, 1.0):
        _, terms = MultiScaleInfoNCELoss(temperature=temperature, local_window=[None, 3])(*args, return_terms=True)
        q1 = bilinear(case["crop"][0], tuple(case["crop_points"][1]), (4, 4))
        expected = np.mean([info_nce(q, keys, 0 * 2 + 1, temperature), info_nce(q1, keys, 1 * 2 + 0, temperature)])
        assert terms[0].item() == pytest.approx(expected, rel=1e-10)
    with pytest.raises(ValueError, match="temperature"):
        MultiScaleInfoNCELoss(temperature=0.0)


def test_identity_pair_reaches_the_minimum() -> None:
    eye = np.eye(16).reshape(16, 4, 4)  # distinct one-hot feature per pixel
    points = np.array([[i, j] for i in range(4) for j in range(4)], dtype=float)
    for temperature in (0.1, 0.05):
        loss = MultiScaleInfoNCELoss(temperature=temperature, local_window=[None])
        value = loss(to_torch(eye), to_torch(eye), *to_torch(points, points), (4, 4), (4, 4)).item()
        assert value == pytest.approx(math.log(1 + 15 * math.exp(-1 / temperature)), rel=1e-9)
        assert value < 1e-3
    rng = np.random.default_rng(2)
    other = MultiScaleInfoNCELoss(temperature=0.1, local_window=[None])(
        to_torch(eye), to_torch(unit(rng.normal(size=(16, 4, 4)))), *to_torch(points, points), (4, 4), (4, 4)
    )
    assert other.item() > 1.0


def test_nan_queries_are_ignored(two_scale_case: dict) -> None:
    case = two_scale_case
    loss = MultiScaleInfoNCELoss(temperature=0.2, local_window=[None, 3])
    image, crop = to_torch(*case["image"]), to_torch(*case["crop"])
    ip, cp = to_torch(case["image_points"][:1], case["crop_points"][:1])
    single = loss(image, crop, ip, cp, (4, 4), (4, 4))
    with_nan = np.concatenate([case["image_points"][:1], [[np.nan, 1.0]]])
    value = loss(image, crop, *to_torch(with_nan, case["crop_points"]), (4, 4), (4, 4))
    assert torch.isfinite(value) and value.item() == pytest.approx(single.item(), rel=1e-12)
    none_valid = loss(image, crop, *to_torch(np.full((2, 2), np.nan), case["crop_points"]), (4, 4), (4, 4))
    assert none_valid.item() == 0.0


def test_bad_inputs_raise(two_scale_case: dict) -> None:
    case = two_scale_case
    image, crop = to_torch(*case["image"]), to_torch(*case["crop"])
    ip, cp = to_torch(case["image_points"], case["crop_points"])
    with pytest.raises(ValueError, match="odd"):
        MultiScaleInfoNCELoss(local_window=4)
    with pytest.raises(ValueError, match="local_window"):
        MultiScaleInfoNCELoss(local_window=[None, 3, 3])(image, crop, ip, cp, (4, 4), (4, 4))
    with pytest.raises(ValueError, match="image_points contains"):
        MultiScaleInfoNCELoss(local_window=3)(image, crop, ip + 3.0, cp, (4, 4), (4, 4))
    with pytest.raises(ValueError, match="crop_features"):
        MultiScaleInfoNCELoss(local_window=3)(image, crop[:1], ip, cp, (4, 4), (4, 4))


def test_gradients_reach_both_encoders() -> None:
    torch.manual_seed(0)
    net = ContrastiveLandmarkNet(spatial_dims=2, embed_dim=8, strides=(8, 4), channels=(4, 8, 8, 8))
    images = torch.rand(2, 1, 32, 32)
    crops = images[:, :, 8:24, 8:24]
    crop_points = torch.rand(2, 6, 2) * 15
    image_points = crop_points + 8
    loss = MultiScaleInfoNCELoss(temperature=0.1, local_window=3)
    value = loss(net(images), net.encode_crops(crops), image_points, crop_points, (32, 32), (16, 16))
    value.backward()
    for encoder in (net.image_encoder, net.crop_encoder):
        grads = [p.grad for p in encoder.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert sum(g.abs().sum().item() for g in grads) > 0
