"""The array transforms behind the dictionary transforms (bundle/transforms): the array result equals the
dictionary result, seeding the wrapper reproduces the draws, and wrong input raises naming the key / value."""

from __future__ import annotations

import re
from pathlib import Path

import bundle.transforms
import numpy as np
import pytest
import torch
from bundle.transforms import (
    EntropyMap,
    EntropyMapd,
    GaussianHeatmap,
    GaussianHeatmapd,
    InfoGuidedIntensity,
    InfoGuidedIntensityd,
    LandmarkTargets,
    LandmarkTargetsd,
    QuerySampler,
    RandAffineCrop,
    RandViewPaird,
    SamplingWeight,
    SamplingWeightd,
)
from bundle.transforms.heatmaps import RandIsotropicAffined
from bundle.transforms.utils import WindowIntensityd
from monai.data import MetaTensor
from monai.transforms import RandAffined


def _image(seed: int = 0, spatial=(24, 20)) -> MetaTensor:
    rng = np.random.default_rng(seed)
    affine = torch.diag(torch.tensor([0.5, 0.25] + [1.0] * (4 - len(spatial)), dtype=torch.float64))
    return MetaTensor(torch.from_numpy(rng.random((1, *spatial)).astype(np.float32)), affine=affine)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b) and torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, MetaTensor):
        assert torch.equal(a.affine, b.affine)


# ----------------------------------------------------------------------------- IIE map and weights
def test_entropy_map_equals_the_dictionary_transform_and_names_the_value_or_key():
    image = _image()
    _same(EntropyMap(window=5)(image), EntropyMapd("img", window=5)({"img": image})["img_entropy"])
    assert EntropyMapd("img", window=5).window == 5
    with pytest.raises(ValueError, match=r"EntropyMap: the image must have exactly 1 channel, got shape \(2, 4, 4\)"):
        EntropyMap()(np.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match=r"EntropyMapd: 'img' must be channel-first.*\(1, 4\)"):
        EntropyMapd("img")({"img": np.zeros((1, 4))})


def test_sampling_weight_equals_the_dictionary_transform_and_names_the_value_or_key():
    entropy = EntropyMap(window=5)(_image(1))
    for kwargs in ({"gamma": 0.3}, {"mode": "threshold", "threshold": 3.0}):
        _same(SamplingWeight(**kwargs)(entropy), SamplingWeightd("h", **kwargs)({"h": entropy})["h_weight"])
    assert SamplingWeightd("h", gamma=0.7).gamma == 0.7
    with pytest.raises(ValueError, match=r"SamplingWeight: the image must have exactly 1 channel, got shape \(3, 5"):
        SamplingWeight()(np.ones((3, 5, 5)))
    with pytest.raises(ValueError, match=r"SamplingWeightd: 'h' must have exactly 1 channel"):
        SamplingWeightd("h")({"h": np.ones((3, 5, 5))})
    with pytest.raises(ValueError, match="SamplingWeight: mode must be one of"):
        SamplingWeight(mode="softmax")


# -------------------------------------------------------------------------------- adaptive intensity
INTENSITY = {
    "pixel": dict(brightness=(0.1, 0.2, 0.3), contrast=(0.05, 0.1, 0.4), prob=0.6),
    "query": dict(
        thresholds=(3.5, 4.5),
        brightness_ranges=[[0.2, 0.3], [0.5, 0.6], [1.5, 1.6]],
        contrast_ranges=[[0.4, 2.0]] * 3,
        group_mode="query",
    ),
}


@pytest.mark.parametrize("mode", INTENSITY)
def test_intensity_equals_the_dictionary_transform_draw_for_draw(mode):
    image, other = _image(2), _image(3)
    entropy = EntropyMap(window=5)(image)
    query = np.array([[3.0, 4.0], [10.0, 2.0]])
    wrapper = InfoGuidedIntensityd(["a", "b"], "h", query_key="q", **INTENSITY[mode]).set_random_state(5)
    array = InfoGuidedIntensity(**INTENSITY[mode]).set_random_state(5)
    for _ in range(6):
        out = wrapper({"a": image, "b": other, "h": entropy, "q": query})
        a = array(image, entropy, query)  # one draw per call, shared by the keys
        b = array(other, entropy, query, randomize=False)
        _same(out["a"], a)
        _same(out["b"], b)
        np.testing.assert_array_equal(wrapper.brightness_factors, array.brightness_factors)
        assert wrapper.last_group == array.last_group


def test_intensity_wrapper_seed_reproduces_the_draws_of_one_random_stream():
    """The wrapper delegates every draw to its array transform: with prob < 1 too, the factors are those of
    one RandomState(seed): the prob draw, then u_b, u_c when augmenting (the draws before the split)."""
    data = {"img": _image(4), "h": EntropyMap(window=5)(_image(4))}
    kwargs = dict(brightness=(0.1, 0.2, 0.3), contrast=(0.2, 0.3, 0.4), prob=0.5)
    runs = []
    for _ in range(2):
        t = InfoGuidedIntensityd("img", "h", **kwargs).set_random_state(11)
        runs.append([(t(data)["img"], t.brightness_factors.copy(), t.contrast_factors.copy()) for _ in range(8)])
    reference, augmented = np.random.RandomState(11), 0
    factors = (np.ones(3), np.ones(3))
    for (out, b, c), (again, b2, c2) in zip(*runs):
        assert torch.equal(out, again) and np.array_equal(b, b2) and np.array_equal(c, c2)
        if reference.rand() < 0.5:
            u_b, u_c = reference.uniform(-1.0, 1.0, size=2)
            factors = (1 + u_b * np.array([0.1, 0.2, 0.3]), 1 + u_c * np.array([0.2, 0.3, 0.4]))
            augmented += 1
        np.testing.assert_array_equal(b, factors[0])
        np.testing.assert_array_equal(c, factors[1])
    assert 0 < augmented < 8


def test_intensity_wrong_input_names_the_value_or_key():
    image, entropy = _image(5), EntropyMap(window=5)(_image(5))
    t = InfoGuidedIntensity()
    with pytest.raises(ValueError, match=r"InfoGuidedIntensity: the image has spatial shape \(24, 20\) but the IIE"):
        t(image, entropy[:, :10])
    with pytest.raises(ValueError, match=r"InfoGuidedIntensity: the image must be scaled to \[0, 1\], its values span"):
        t(image * 3, entropy)
    with pytest.raises(ValueError, match=r"InfoGuidedIntensity: the IIE map must be a \(1, \*spatial\) IIE map"):
        t(image, torch.cat([entropy, entropy]))
    with pytest.raises(ValueError, match="group_mode 'query' needs the query positions"):
        InfoGuidedIntensity(group_mode="query")(image, entropy)
    with pytest.raises(ValueError, match=r"InfoGuidedIntensityd: 'x' must be scaled to \[0, 1\]"):
        InfoGuidedIntensityd("x", "h")({"x": image * 3, "h": entropy})
    with pytest.raises(KeyError, match="'q'"):
        InfoGuidedIntensityd("x", "h", group_mode="query", query_key="q")({"x": image, "h": entropy})


# ------------------------------------------------------------------------------ landmark targets
def test_landmark_targets_equal_the_dictionary_transform_and_name_the_value_or_key():
    image = MetaTensor(torch.zeros(1, 30, 20), meta={"spatial_shape": (60, 40), "filename_or_obj": "a.png"})
    landmarks = [[10.0, 4.0], None]
    out = LandmarkTargetsd("image", n_landmarks=2)({"image": image, "landmarks": landmarks, "spacing": [0.1, 0.2]})
    array = LandmarkTargets(n_landmarks=2)(image, landmarks, [0.1, 0.2])
    for key, value in zip(("landmarks", "label", "spacing", "grid_to_physical"), array):
        torch.testing.assert_close(out[key], value, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match=r"LandmarkTargets: the image must be channel-first 2D or 3D, got shape \(1,"):
        LandmarkTargets(n_landmarks=1)(torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"LandmarkTargets: the spacing of a.png must have 2 values"):
        LandmarkTargets(n_landmarks=1)(image, None, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"LandmarkTargetsd: 'sp' of a.png must have 2 values"):
        LandmarkTargetsd("image", n_landmarks=1, spacing_key="sp")({"image": image, "sp": [0.1]})
    with pytest.raises(ValueError, match=r"LandmarkTargetsd: 'image' must be a MetaTensor with an affine"):
        LandmarkTargetsd("image", n_landmarks=1)({"image": torch.zeros(1, 4, 4, 4)})


def test_gaussian_heatmap_equals_the_dictionary_transform_and_names_the_value_or_key():
    image = MetaTensor(torch.zeros(1, 16, 12), affine=torch.diag(torch.tensor([2.0, 2.0, 1.0, 1.0])))
    item = {
        "image": image,
        "label": torch.tensor([[3.0, 4.0], [float("nan")] * 2]),
        "grid_to_physical": torch.eye(3, dtype=torch.float64),
    }
    out = GaussianHeatmapd("image", sigma=1.5)(item)
    heatmaps, mask = GaussianHeatmap(sigma=1.5)(image, item["label"])
    _same(out["heatmap"], heatmaps)
    assert torch.equal(out["landmark_mask"], mask) and mask.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"points must be \(L, 2\), got \(2, 3\)"):
        GaussianHeatmap()(image, torch.zeros(2, 3))
    with pytest.raises(KeyError, match="'label' and 'grid_to_physical'"):
        GaussianHeatmapd("image")({"image": image})


@pytest.mark.parametrize("spatial", [(16, 12), (8, 10, 6)])
def test_isotropic_affine_draws_what_monai_rand_affine_draws_with_per_axis_ranges(spatial):
    dims = len(spatial)
    item = {"image": _image(1, spatial), "heatmap": _image(2, spatial)}
    keys = ["image", "heatmap"]
    ours = RandIsotropicAffined(keys, spatial_dims=dims, rotate=10.0, scale=0.1, translate=3.0, prob=1.0)
    reference = RandAffined(
        ["image", "heatmap"],
        prob=1.0,
        rotate_range=[np.pi / 18] * (1 if dims == 2 else 3),
        scale_range=[0.1] * dims,
        translate_range=[3.0] * dims,
    )
    ours.set_random_state(7)
    reference.set_random_state(7)
    a, b = ours(dict(item)), reference(dict(item))
    for key in item:
        _same(a[key], b[key])
        assert not torch.equal(torch.as_tensor(a[key]), torch.as_tensor(item[key]))  # it moved


def test_window_intensity_clips_to_the_window_and_scales_it_to_the_unit_range():
    volume = torch.tensor([[[-1000.0, -200.0], [100.0, 400.0], [1500.0, 0.0]]])
    out = WindowIntensityd("image", window=[-200, 400])({"image": volume})["image"]
    expected = np.clip((volume.numpy() + 200.0) / 600.0, 0.0, 1.0)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------ the view-pair parts
def test_view_pair_parts_share_one_random_stream_and_reproduce_the_composition():
    image = torch.rand(1, 48, 40, generator=torch.Generator().manual_seed(0))
    weights = torch.rand(1, 48, 40, generator=torch.Generator().manual_seed(1))
    t = RandViewPaird(crop_size=(24, 20), num_queries=6, scale_range=0.1, prob=0.7).set_random_state(3)
    assert t.cropper.R is t.R and t.sampler.R is t.R
    outs = [t({"image": image, "image_weight": weights}) for _ in range(4)]
    # the same draws, part by part, from one RandomState(3)
    crop, sampler = RandAffineCrop((24, 20), 4, 10.0, 0.1, 0.7), QuerySampler()
    crop.set_random_state(3)
    sampler.set_random_state(state=crop.R)
    w = weights[0].double().numpy()
    for out in outs:
        crop.randomize()
        anchor = sampler(w, 1)[0]
        matrix = crop.place(anchor, (48, 40))
        query = np.concatenate([anchor[None], sampler(w, 5, candidates=crop.visible_pixels(matrix, (48, 40)))])
        np.testing.assert_array_equal(out["query"].numpy(), query.astype(np.float32))
        crop_query = crop.to_crop(query.astype(float), matrix, (48, 40))
        np.testing.assert_array_equal(out["crop_query"].numpy(), crop_query.astype(np.float32))
        assert torch.equal(out["crop"], crop(image, matrix))
    again = RandViewPaird(crop_size=(24, 20), num_queries=6, scale_range=0.1, prob=0.7).set_random_state(3)
    for out in outs:
        assert all(torch.equal(out[k], v) for k, v in again({"image": image, "image_weight": weights}).items())


def test_query_sampler_draws_only_positive_weights_and_affine_crop_names_bad_arguments():
    weights = np.zeros((6, 5))
    weights[2, 3], weights[4, 1] = 1.0, 3.0
    sampler = QuerySampler()
    sampler.set_random_state(0)
    drawn = sampler(weights, 400)
    assert {tuple(p) for p in drawn.tolist()} == {(2, 3), (4, 1)} and 0.65 < np.mean(drawn[:, 0] == 4) < 0.85
    candidates = np.array([[2, 3], [0, 0]])
    assert (sampler(weights, 20, candidates=candidates) == [2, 3]).all()
    with pytest.raises(ValueError, match=r"margin 8 leaves no room for queries in crop_size \(16, 16\)"):
        RandAffineCrop((16, 16), margin=8)
    with pytest.raises(ValueError, match="padding_mode must be"):
        RandAffineCrop((16, 16), padding_mode="edge")


def test_every_transform_that_docs_transforms_md_names_is_exported_by_bundle_transforms():
    section = Path(__file__).parents[1].joinpath("docs", "transforms.md").read_text().split("\n## ")[1]
    names = set(re.findall(r"`([A-Z][A-Za-z]+)[`(]", section))
    assert {"EntropyMapd", "GaussianHeatmap", "RandViewPaird"} <= names
    assert sorted(n for n in names if not hasattr(bundle.transforms, n)) == []
