"""InfoGuidedIntensityd: adaptive per-group brightness / contrast (bundle/transforms/intensity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bundle.transforms.intensity import InfoGuidedIntensityd
from monai.data import MetaTensor
from monai.transforms import Compose


def _jitter(x: np.ndarray, f, c) -> np.ndarray:
    """ColorJitter-style reference written out: brightness, clip, contrast about the per-channel mean, clip."""
    x1 = np.clip(x * f, 0, 1)
    mean = x1.reshape(x1.shape[0], -1).mean(1).reshape((-1,) + (1,) * (x.ndim - 1))
    return np.clip(c * x1 + (1 - c) * mean, 0, 1)


def _memberships(h: np.ndarray, t=(2.0, 4.0), w=0.5) -> np.ndarray:
    s0 = np.clip((h - t[0] + w / 2) / w, 0, 1)
    s1 = np.clip((h - t[1] + w / 2) / w, 0, 1)
    return np.stack([1 - s0, s0 - s1, s1])


def _data(rng: np.random.Generator, spatial=(12, 10), channels=1, entropy=None):
    img = rng.random((channels, *spatial)).astype(np.float32)
    h = rng.uniform(0, 6.5, (1, *spatial)) if entropy is None else np.broadcast_to(entropy, (1, *spatial))
    meta = {"filename_or_obj": "case.png", "affine": torch.eye(len(spatial) + 1)}
    return {
        "image": MetaTensor(torch.from_numpy(img), meta=meta),
        "entropy": torch.as_tensor(np.array(h), dtype=torch.float32),
    }


def test_deterministic_with_set_random_state_and_factor_ranges():
    data = _data(np.random.default_rng(0))
    outs = []
    for seed in (3, 3, 4):
        t = InfoGuidedIntensityd("image", "entropy", brightness=(0.1, 0.2, 0.3), contrast=(0.05, 0.1, 0.4))
        t.set_random_state(seed)
        outs.append(t(data)["image"])
        b = np.asarray(t.brightness_factors) - 1
        c = np.asarray(t.contrast_factors) - 1
        assert np.all(np.abs(b) <= [0.1, 0.2, 0.3]) and np.all(np.abs(c) <= [0.05, 0.1, 0.4])
        # one draw per operation, scaled by each group's intensity: all groups move the same way
        np.testing.assert_allclose(b / [0.1, 0.2, 0.3], b[0] / 0.1, rtol=1e-9)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_uniform_intensities_reproduce_plain_color_jitter():
    rng = np.random.default_rng(1)
    data = _data(rng, spatial=(16, 16), channels=2)
    t = InfoGuidedIntensityd("image", "entropy", brightness=(0.3,) * 3, contrast=(0.4,) * 3).set_random_state(7)
    for _ in range(5):
        out = t(data)["image"]
        f, c = t.brightness_factors[0], t.contrast_factors[0]
        assert np.ptp(t.brightness_factors) == 0 and 0.7 <= f <= 1.3 and 0.6 <= c <= 1.4
        np.testing.assert_allclose(out.numpy(), _jitter(data["image"].numpy().astype(np.float64), f, c), atol=1e-6)


@pytest.mark.parametrize("level, group", [(0.5, 0), (3.0, 1), (6.0, 2)])
def test_single_group_image_uses_that_groups_factors(level, group):
    data = _data(np.random.default_rng(2), entropy=level)
    t = InfoGuidedIntensityd("image", "entropy", brightness=(0.1, 0.3, 0.5), contrast=(0.2, 0.4, 0.6)).set_random_state(
        5
    )
    out = t(data)["image"]
    f, c = t.brightness_factors[group], t.contrast_factors[group]
    np.testing.assert_allclose(out.numpy(), _jitter(data["image"].numpy().astype(np.float64), f, c), atol=1e-6)


def test_prob_zero_leaves_image_unchanged_and_meta_is_kept():
    data = _data(np.random.default_rng(3))
    out = InfoGuidedIntensityd("image", "entropy", prob=0.0)(data)["image"]
    assert torch.equal(out.as_tensor(), data["image"].as_tensor())
    aug = InfoGuidedIntensityd("image", "entropy", prob=1.0).set_random_state(0)(data)["image"]
    assert isinstance(aug, MetaTensor) and aug.meta["filename_or_obj"] == "case.png"
    assert not torch.equal(aug.as_tensor(), data["image"].as_tensor())


def test_no_seam_across_a_threshold():
    h = np.linspace(1.5, 2.5, 101)[None, None, :]  # IIE ramp across the 2-bit threshold, steps of 0.01
    data = {"image": torch.full((1, 1, 101), 0.5), "entropy": torch.as_tensor(h, dtype=torch.float32)}
    jumps = {}
    for width in (0.5, 0.0):
        t = InfoGuidedIntensityd("image", "entropy", brightness=(0.0, 0.8, 0.8), contrast=(0.0,) * 3, blend_width=width)
        t.set_random_state(11)
        out = t(data)["image"][0, 0].numpy().astype(np.float64)
        gap = abs(t.brightness_factors[1] - t.brightness_factors[0])
        assert gap > 0.1
        jumps[width] = (np.abs(np.diff(out)).max(), gap)
        # independent reference: the blended factor times the grey value 0.5
        m = (
            _memberships(h[0, 0], w=width)
            if width
            else np.stack([h[0, 0] < 2, h[0, 0] >= 2, 0 * h[0, 0]]).astype(float)
        )
        np.testing.assert_allclose(out, 0.5 * (m.T @ t.brightness_factors), atol=1e-6)
    smooth, gap = jumps[0.5]
    assert smooth <= 0.5 * gap * 0.01 / 0.5 + 1e-5  # a linear ramp: at most slope x step
    hard, gap = jumps[0.0]
    assert hard == pytest.approx(0.5 * gap, abs=1e-5)  # hard groups jump by the full factor gap


def test_3d_volume_matches_blended_reference():
    rng = np.random.default_rng(4)
    data = _data(rng, spatial=(6, 7, 8))
    t = InfoGuidedIntensityd("image", "entropy", brightness=(0.1, 0.2, 0.4), contrast=(0.1, 0.3, 0.5), blend_width=1.0)
    out = Compose([t]).set_random_state(9)(data)["image"]
    assert out.shape == (1, 6, 7, 8)
    m = _memberships(data["entropy"].numpy()[0].astype(np.float64), w=1.0)
    f = np.tensordot(t.brightness_factors, m, axes=1)[None]
    c = np.tensordot(t.contrast_factors, m, axes=1)[None]
    np.testing.assert_allclose(out.numpy(), _jitter(data["image"].numpy().astype(np.float64), f, c), atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(5)
    t = InfoGuidedIntensityd("image", "entropy")
    bad = _data(rng)
    bad["image"][0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="'image' contains NaN"):
        t(bad)
    wrong = _data(rng)
    wrong["entropy"] = torch.zeros(1, 5, 5)
    with pytest.raises(ValueError, match=r"'image' has spatial shape \(12, 10\) but 'entropy' has \(5, 5\)"):
        t(wrong)
    wrong["entropy"] = torch.zeros(2, 12, 10)
    with pytest.raises(ValueError, match="'entropy' must be a \\(1, \\*spatial\\)"):
        t(wrong)
    with pytest.raises(KeyError, match="entropy key 'entropy' not found"):
        t({"image": _data(rng)["image"]})
    with pytest.raises(KeyError, match="image"):
        t({"entropy": _data(rng)["entropy"]})
    only_entropy = {"entropy": _data(rng)["entropy"]}
    assert InfoGuidedIntensityd("image", "entropy", allow_missing_keys=True)(only_entropy).keys() == {"entropy"}
    hu = _data(rng)
    hu["image"] = hu["image"] * 1000
    with pytest.raises(ValueError, match=r"'image' must be scaled to \[0, 1\]"):
        t(hu)
    with pytest.raises(ValueError, match="brightness"):
        InfoGuidedIntensityd("image", "entropy", brightness=(0.1, 0.2))
    with pytest.raises(ValueError, match="contrast"):
        InfoGuidedIntensityd("image", "entropy", contrast=(0.1, 0.2, 1.5))
    with pytest.raises(ValueError, match="thresholds"):
        InfoGuidedIntensityd("image", "entropy", thresholds=(4, 2))
    with pytest.raises(ValueError, match="blend_width"):
        InfoGuidedIntensityd("image", "entropy", blend_width=-0.1)


# ---------------------------------------------------------------- factor ranges and the per-crop group


def test_ranges_draw_factors_within_lo_hi_uniformly_and_together():
    data = _data(np.random.default_rng(6))
    b_ranges, c_ranges = [[0.5, 1.2], [0.505, 1.997], [0.9, 1.0]], [[0.34, 2.329], [1.0, 1.5], [0.416, 1.817]]
    t = InfoGuidedIntensityd("image", "entropy", brightness_ranges=b_ranges, contrast_ranges=c_ranges).set_random_state(
        0
    )
    assert t.brightness is None and t.contrast is None
    draws_b, draws_c = [], []
    for _ in range(400):
        t(data)
        draws_b.append(t.brightness_factors.copy())
        draws_c.append(t.contrast_factors.copy())
    b, c = np.array(draws_b), np.array(draws_c)
    for draws, ranges in ((b, np.array(b_ranges)), (c, np.array(c_ranges))):
        assert np.all(draws >= ranges[:, 0] - 1e-12) and np.all(draws <= ranges[:, 1] + 1e-12)
        quantile = (draws - ranges[:, 0]) / (ranges[:, 1] - ranges[:, 0])
        np.testing.assert_allclose(quantile, quantile[:, :1].repeat(3, 1), atol=1e-9)  # one shared quantile
        assert quantile.min() < 0.05 and quantile.max() > 0.95 and abs(quantile.mean() - 0.5) < 0.05  # uniform


def test_symmetric_intensities_equal_the_ranges_one_minus_plus_a():
    data = _data(np.random.default_rng(7))
    sym = InfoGuidedIntensityd(
        "image", "entropy", brightness=(0.1, 0.2, 0.3), contrast=(0.2, 0.3, 0.4)
    ).set_random_state(2)
    rng_t = InfoGuidedIntensityd(
        "image",
        "entropy",
        brightness_ranges=[[0.9, 1.1], [0.8, 1.2], [0.7, 1.3]],
        contrast_ranges=[[0.8, 1.2], [0.7, 1.3], [0.6, 1.4]],
    ).set_random_state(2)
    for _ in range(3):
        torch.testing.assert_close(sym(data)["image"].as_tensor(), rng_t(data)["image"].as_tensor(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(sym.brightness_factors, rng_t.brightness_factors, atol=1e-12)


def test_query_mode_gives_the_whole_crop_one_group_from_the_query_pixel():
    rng = np.random.default_rng(8)
    img = rng.random((1, 20, 20)).astype(np.float32)
    h = np.full((1, 20, 20), 4.0, dtype=np.float32)  # medium (3.5 < H < 4.5) ...
    h[:, :, 10:] = 6.0  # ... and high on the right half
    h[:, 15:, :] = 1.0  # low at the bottom
    b_ranges = [[0.2, 0.3], [0.5, 0.6], [1.5, 1.6]]  # disjoint, so the group is read off the factor
    t = InfoGuidedIntensityd(
        "image",
        "entropy",
        thresholds=(3.5, 4.5),
        brightness_ranges=b_ranges,
        contrast_ranges=[[0.4, 2.0]] * 3,
        group_mode="query",
    ).set_random_state(3)
    for query, group in (([2.0, 3.0], 1), ([4.2, 12.6], 2), ([17.0, 4.0], 0), ([-3.0, 30.0], 2)):
        data = {
            "image": torch.from_numpy(img),
            "entropy": torch.from_numpy(h),
            "crop_query": np.array([query, [17.0, 1.0]]),
        }
        out = t(data)["image"].numpy().astype(np.float64)
        assert t.last_group == group
        f, c = t.brightness_factors[group], t.contrast_factors[group]
        assert b_ranges[group][0] <= f <= b_ranges[group][1] and 0.4 <= c <= 2.0
        # one factor pair for every pixel of the crop, whatever their own IIE; contrast blends with the mean grey
        np.testing.assert_allclose(out, _jitter(img.astype(np.float64), f, c), atol=1e-6)
    with pytest.raises(KeyError, match="crop_query"):
        t({"image": torch.from_numpy(img), "entropy": torch.from_numpy(h)})
    with pytest.raises(ValueError, match="group_mode"):
        InfoGuidedIntensityd("image", "entropy", group_mode="crop")
    with pytest.raises(ValueError, match="brightness_ranges"):
        InfoGuidedIntensityd("image", "entropy", brightness_ranges=[[1.2, 0.8]] * 3)
    with pytest.raises(ValueError, match="contrast_ranges"):
        InfoGuidedIntensityd("image", "entropy", contrast_ranges=[[0.8, 1.2]] * 2)


def test_query_mode_in_the_view_pair_sampler_uses_the_anchor_query():
    from bundle.transforms.view_pair import RandViewPaird

    rng = np.random.default_rng(9)
    image = torch.from_numpy(rng.random((1, 48, 48)).astype(np.float32))
    h = torch.full((1, 48, 48), 4.0)
    h[:, 24:] = 6.0
    t = InfoGuidedIntensityd(
        "image",
        "entropy",
        thresholds=(3.5, 4.5),
        brightness_ranges=[[0.2, 0.3], [0.5, 0.6], [1.5, 1.6]],
        contrast_ranges=[[1.0, 1.0]] * 3,
        group_mode="query",
    )
    sampler = RandViewPaird(
        weight_key=None, crop_size=(16, 16), num_queries=4, entropy_key="entropy", crop_intensity_transform=t
    )
    sampler.set_random_state(1)
    for _ in range(10):
        out = sampler({"image": image, "entropy": h})
        anchor = out["query"][0].round().long()
        assert t.last_group == (2 if anchor[0] >= 24 else 1)
