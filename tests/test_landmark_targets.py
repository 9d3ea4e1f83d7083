"""LandmarkTargetsd and the grid <-> physical maps: points survive resizing, cropping and padding exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from bundle.geometry import apply_homogeneous, grid_to_physical
from bundle.transforms.landmarks import LandmarkTargets, LandmarkTargetsd
from monai.data import MetaTensor
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Resize,
    Resized,
    SpatialCrop,
    SpatialCropd,
    SpatialPadd,
)
from PIL import Image


def _png(tmp_path, width=60, height=40):
    arr = np.zeros((height, width), np.uint8)
    arr[10, 45] = 255  # row 10, column 45 -> landmark [45, 10]
    path = tmp_path / "img.png"
    Image.fromarray(arr).save(path)
    return path


def _shape_ratio_map(current_size, original_size, spacing) -> np.ndarray:
    """The 2D grid-to-physical map before 2D went through the affine: the shape ratio of a pure resize."""
    scale = np.asarray(original_size, float) / np.asarray(current_size, float)
    m = np.eye(len(scale) + 1)
    m[:-1, :-1] = np.diag(scale)
    m[:-1, -1] = 0.5 * scale - 0.5
    return np.diag(np.append(spacing, 1.0)) @ m


def test_grid_to_physical_maps_pixel_centres():
    image = Resize((30, 20), mode="area")(MetaTensor(torch.zeros(1, 60, 40)))  # a factor 2 downsampling
    m = grid_to_physical(image, [1.0, 1.0])
    # grid cell 0 covers original pixels 0 and 1: its centre is at 0.5
    np.testing.assert_allclose(m @ [0, 0, 1], [0.5, 0.5, 1])
    np.testing.assert_allclose(m @ [29, 19, 1], [58.5, 38.5, 1])


@pytest.mark.parametrize("size", [(32, 32), (64, 48), (17, 23), (120, 80)])
def test_2d_resize_only_gives_the_numbers_of_the_shape_ratio(tmp_path, size):
    item = {"image": str(_png(tmp_path)), "landmarks": [[45.0, 10.0], None], "spacing": [0.1, 0.2]}
    load = [LoadImaged("image"), EnsureChannelFirstd("image")]
    out = Compose([*load, Resized("image", size, mode="area"), LandmarkTargetsd("image", n_landmarks=2)])(item)
    np.testing.assert_array_equal(out["grid_to_physical"].numpy(), _shape_ratio_map(size, (60, 40), [0.1, 0.2]))
    np.testing.assert_array_equal(out["label"][0].numpy(), np.float32([4.5, 2.0]))


@pytest.mark.parametrize(
    "spatial, offset, extent",
    [
        (SpatialCropd("image", roi_start=(20, 4), roi_end=(60, 36)), (-20, -4), (40, 32)),  # crop, then resize
        (SpatialPadd("image", spatial_size=(80, 64)), (10, 12), (80, 64)),  # symmetric pad, then resize
    ],
)
def test_2d_targets_follow_a_crop_or_pad_before_the_resize(tmp_path, spatial, offset, extent):
    item = {"image": str(_png(tmp_path)), "landmarks": [[45.0, 10.0]], "spacing": [0.1, 0.2]}
    pipeline = Compose(
        [
            LoadImaged("image"),
            EnsureChannelFirstd("image"),
            spatial,
            Resized("image", (32, 32), mode="area"),
            LandmarkTargetsd("image", n_landmarks=1),
        ]
    )
    out = pipeline(item)
    np.testing.assert_allclose(out["label"][0].numpy(), [4.5, 2.0], rtol=1e-6)  # physical: file pixels x spacing
    grid = apply_homogeneous(out["grid_to_physical"], out["label"], inverse=True)[0].numpy()
    # file pixel [45, 10] -> shifted by the crop / pad -> scaled by the resize (pixel centres at integers)
    expected = (np.array([45.0, 10.0]) + offset + 0.5) * 32 / np.array(extent) - 0.5
    np.testing.assert_allclose(grid, expected, atol=1e-5)
    peak = np.unravel_index(int(out["image"][0].argmax()), (32, 32))
    assert np.abs(np.array(peak) - expected).max() <= 1  # the bright pixel is where the grid says
    # the shape ratio (correct only for a pure resize) would put it more than a pixel off
    ratio = np.linalg.solve(_shape_ratio_map((32, 32), (60, 40), [0.1, 0.2]), [4.5, 2.0, 1.0])[:2]
    assert np.abs(ratio - expected).max() > 1


def test_2d_targets_go_back_through_the_original_affine():
    """A DICOM-like image (spacing, flipped axes, origin in its read affine) cropped then resized."""
    original = np.array([[-0.1, 0.0, 0.0, 12.0], [0.0, -0.2, 0.0, 7.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    image = MetaTensor(torch.zeros(1, 60, 40), affine=torch.as_tensor(original), meta={"original_affine": original})
    image = Resize((15, 45), mode="area")(SpatialCrop(roi_start=(10, 5), roi_end=(40, 35))(image))
    points, label, spacing, matrix = LandmarkTargets(n_landmarks=1)(image, [[25.0, 20.0]], spacing=[0.5, 0.25])
    np.testing.assert_allclose(label.numpy(), [[12.5, 5.0]])
    grid = np.linalg.solve(matrix.numpy(), [12.5, 5.0, 1.0])[:2]
    expected = (np.array([25.0 - 10, 20.0 - 5]) + 0.5) * np.array([15, 45]) / 30 - 0.5
    np.testing.assert_allclose(grid, expected, atol=1e-9)


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


def test_a_header_spacing_outside_the_datalists_range_is_refused_naming_the_file():
    """A NIfTI header of 1e-5 mm voxels gave MREs of hundreds of mm; the datalist's range applies to it too."""
    image = MetaTensor(torch.zeros(1, 8, 8, 8), affine=torch.diag(torch.tensor([1e-5, 1e-5, 1e-5, 1.0])))
    image.meta["filename_or_obj"] = "tiny_voxels.nii.gz"
    with pytest.raises(ValueError, match=r"tiny_voxels.nii.gz: its header gives a spacing of \[1e-05, 1e-05, 1e-05\]"):
        LandmarkTargets(n_landmarks=1)(image, [[0.0, 0.0, 0.0]])
    image.affine = torch.diag(torch.tensor([2.0, 2.0, 2.0, 1.0]))
    assert LandmarkTargets(n_landmarks=1)(image, [[0.0, 0.0, 0.0]])[2].tolist() == [2.0, 2.0, 2.0]


def test_a_3d_datalist_spacing_other_than_the_header_is_refused():
    """In 3D the affine places voxels and landmarks: an item's spacing changed only mre_px, silently."""
    image = MetaTensor(torch.zeros(1, 8, 8, 8), affine=torch.diag(torch.tensor([2.0, 2.0, 2.0, 1.0])))
    image.meta["filename_or_obj"] = "ct.nii.gz"
    with pytest.raises(
        ValueError, match=r"ct.nii.gz: the datalist's spacing \[1.0, 1.0, 1.0\] differs from its header"
    ):
        LandmarkTargets(n_landmarks=1)(image, [[0.0, 0.0, 0.0]], spacing=[1.0, 1.0, 1.0])
    assert LandmarkTargets(n_landmarks=1)(image, [[0.0, 0.0, 0.0]], spacing=[2.0, 2.0, 2.0])[2].tolist() == [2.0] * 3
    # sagittal slices (voxel axes y, x, z): the voxel sizes in file order are not the spacing's world order
    sagittal = MetaTensor(
        torch.zeros(1, 8, 8, 8), affine=torch.tensor([[0.0, 5, 0, 0], [0.5, 0, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 1]])
    )
    sagittal.meta["filename_or_obj"] = "sagittal.nii.gz"
    with pytest.raises(ValueError, match=re.escape("header's [5.0, 0.5, 0.5] mm along the world x, y, z axes")):
        LandmarkTargets(n_landmarks=1)(sagittal, [[0.0, 0.0, 0.0]], spacing=[0.5, 5.0, 0.5])
