"""LandmarkTargetsd and the grid <-> physical maps: points survive resizing exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Resized

from bundle.oneshot import apply_homogeneous
from bundle.transforms.landmarks import LandmarkTargetsd, grid_to_original_pixels


def _png(tmp_path, width=60, height=40):
    arr = np.zeros((height, width), np.uint8)
    arr[10, 45] = 255  # row 10, column 45 -> landmark [45, 10]
    path = tmp_path / "img.png"
    Image.fromarray(arr).save(path)
    return path


def test_grid_to_original_pixels_maps_pixel_centres():
    m = grid_to_original_pixels((30, 20), (60, 40))  # a factor 2 downsampling
    # grid cell 0 covers original pixels 0 and 1: its centre is at 0.5
    np.testing.assert_allclose(m @ [0, 0, 1], [0.5, 0.5, 1])
    np.testing.assert_allclose(m @ [29, 19, 1], [58.5, 38.5, 1])


def test_targets_with_anisotropic_spacing_and_resize(tmp_path):
    item = {"image": str(_png(tmp_path)), "landmarks": [[45.0, 10.0], None], "spacing": [0.1, 0.2]}
    pipeline = Compose(
        [
            LoadImaged("image"),
            EnsureChannelFirstd("image"),
            Resized("image", spatial_size=(32, 32), mode="area"),
            LandmarkTargetsd("image", n_landmarks=2),
        ]
    )
    out = pipeline(item)
    np.testing.assert_allclose(out["label"][0].numpy(), [4.5, 2.0], rtol=1e-6)
    assert torch.isnan(out["label"][1]).all() and torch.isnan(out["landmarks"][1]).all()
    np.testing.assert_allclose(out["spacing"].numpy(), [0.1, 0.2], rtol=1e-6)
    # the label maps to the grid and back to the same physical point
    grid = apply_homogeneous(out["grid_to_physical"], out["label"][:1], inverse=True)
    expected_grid = [(45 + 0.5) * 32 / 60 - 0.5, (10 + 0.5) * 32 / 40 - 0.5]
    np.testing.assert_allclose(grid[0].numpy(), expected_grid, rtol=1e-5)
    # the bright pixel is where the grid says (the area-resized peak lies at the nearest grid cell)
    peak = np.unravel_index(int(out["image"][0].argmax()), (32, 32))
    assert np.allclose(peak, np.round(expected_grid), atol=1)


def test_missing_spacing_warns_and_bad_spacing_raises(tmp_path):
    base = {"image": str(_png(tmp_path)), "landmarks": [[1.0, 2.0], [3.0, 4.0]]}
    load = Compose([LoadImaged("image"), EnsureChannelFirstd("image")])
    with pytest.warns(UserWarning, match="no spacing"):
        out = LandmarkTargetsd("image", n_landmarks=2)(load(dict(base)))
    np.testing.assert_allclose(out["label"].numpy(), [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="spacing"):
        LandmarkTargetsd("image", n_landmarks=2)(load(dict(base, spacing=[0.1, 0.1, 0.1])))
