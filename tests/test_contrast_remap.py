"""The contrast remap of the training views (scripts.experiments.contrast_remap, not in the paper): its curves, its
dictionary wrapper and its wiring into the views' intensity transforms
(scripts/experiments/configs/contrast_remap.yaml)."""

from __future__ import annotations

import pytest
import torch
from bundle.configs import bundle_parser
from bundle.transforms.intensity import InfoGuidedIntensityd
from monai.data import MetaTensor
from monai.transforms import Compose
from scripts.experiments.contrast_remap import RandContrastRemap, RandContrastRemapd

CONTRAST_REMAP = ["configs/train.yaml", "scripts/experiments/configs/contrast_remap.yaml"]


@pytest.mark.parametrize("shape", [(1, 24, 20), (1, 12, 10, 8)])
def test_contrast_remap_modes(shape):
    """Each mode's curve, on a 2D image and a 3D volume: monotone keeps the order of the grey values, the
    inversion is 1 - x, the non-monotone curve swaps some; outputs stay in [0, 1] and a MetaTensor keeps its
    metadata; one draw is reproducible from the seed."""
    img = MetaTensor(torch.rand(shape), meta={"filename_or_obj": "v.nii"})
    flat = img.as_tensor().flatten()
    order = flat.argsort()
    swapped = False
    for seed in range(40):
        for mode in ("monotone", "non_monotone", "inversion"):
            remap = RandContrastRemap(prob=1.0, modes=[mode]).set_random_state(seed)
            out = remap(img)
            assert isinstance(out, MetaTensor) and out.meta["filename_or_obj"] == "v.nii"
            values = out.as_tensor().flatten()
            assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0
            if mode == "monotone":
                assert bool((values[order].diff() >= -1e-6).all())
            elif mode == "inversion":
                torch.testing.assert_close(values, 1.0 - flat)
            else:
                swapped |= bool((values[order].diff() < -1e-3).any())
            again = RandContrastRemap(prob=1.0, modes=[mode]).set_random_state(seed)(img)
            torch.testing.assert_close(again.as_tensor(), out.as_tensor())
    assert swapped


def test_contrast_remap_dictionary_and_bad_values():
    data = {"image": torch.rand(1, 16, 16), "entropy": torch.rand(1, 16, 16)}
    out = RandContrastRemapd(keys="image", prob=1.0, modes=["inversion"])(data)
    torch.testing.assert_close(out["image"], 1.0 - data["image"])
    assert out["entropy"] is data["entropy"]
    unchanged = RandContrastRemapd(keys="image", prob=0.0)(data)
    torch.testing.assert_close(unchanged["image"], data["image"])
    with pytest.raises(ValueError, match="modes must be some of"):
        RandContrastRemap(modes=["solarize"])
    with pytest.raises(ValueError, match="num_control_points"):
        RandContrastRemap(num_control_points=(5, 2))


def test_contrast_remap_is_off_by_default_and_refuses_a_probability_above_one():
    """contrast_remap_prob 0 (the default) leaves the views' transforms the paper's; 0.5 adds the remap after the
    crop's and gives the whole image its own; 1.5 is refused naming the key."""
    product = bundle_parser("configs/train.yaml")  # the product's views: the paper's, without the experiment
    assert isinstance(product.get_parsed_content("train#crop_transform"), InfoGuidedIntensityd)
    assert product.get_parsed_content("train#image_transform") is None
    parser = bundle_parser(CONTRAST_REMAP)
    assert isinstance(parser.get_parsed_content("train#crop_transform"), InfoGuidedIntensityd)
    assert parser.get_parsed_content("train#image_transform") is None
    parser = bundle_parser(CONTRAST_REMAP, contrast_remap_prob=0.5)
    composed = parser.get_parsed_content("train#crop_transform")
    assert isinstance(composed, Compose)
    assert [type(t) for t in composed.transforms] == [InfoGuidedIntensityd, RandContrastRemapd]
    assert composed.transforms[1].remap.prob == 0.5
    assert parser.get_parsed_content("train#image_transform").remap.prob == 0.5
    parser = bundle_parser(CONTRAST_REMAP, contrast_remap_prob=1.5)
    with pytest.raises(RuntimeError) as info:
        parser.get_parsed_content("train#crop_transform")
    assert "contrast_remap_prob: expected a finite number in [0, 1], got 1.5" in str(info.value.__cause__)
