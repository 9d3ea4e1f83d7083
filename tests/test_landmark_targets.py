"""LandmarkTargetsd and the grid <-> physical maps: points survive resizing, cropping and padding exactly."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from bundle.geometry import apply_homogeneous, grid_to_physical
from bundle.transforms.landmarks import TEMPLATE_KEY, LandmarkTargets, LandmarkTargetsd, check_landmarks
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


def _ceph(width=1340, height=1040) -> MetaTensor:
    """A cephalogram-sized image as the reader gives it (its file's size in ``spatial_shape``), resized to a grid."""
    image = MetaTensor(torch.zeros(1, width, height), meta={"filename_or_obj": "ceph.png"})
    image.meta["spatial_shape"] = np.array([width, height])
    return Resize((64, 64), mode="area")(image)


def test_a_landmark_outside_is_warned_about_in_an_item_and_refused_in_a_template():
    """A template sella at x = 1400 in a 1340-wide image (within the 5 % once accepted) took that landmark's error
    from 7.8 to 127 mm; now each outside landmark is named with its distance, a template's refused."""
    names = ["sella", "nasion"]
    points = np.array([[1400.0, 500.0], [1339.5, -0.5]])  # nasion on the last pixel's far edge: inside
    with pytest.warns(UserWarning) as record:
        check_landmarks(_ceph(), points, [0.1, 0.1], names)
    assert [str(w.message) for w in record] == [
        "ceph.png: landmark 0 ('sella') [1400.0, 500.0] lies 60.50 px (6.05 mm) outside the image: the image's pixels "
        "span x in [-0.5, 1339.5], y in [-0.5, 1039.5] (2D landmarks are [x, y] pixels of the original file, x the "
        "column, y the row); a prediction on the image is scored at least that far off"
    ]
    expected = "ceph.png: template landmark 0 ('sella') [1400.0, 500.0] lies 60.50 px (6.05 mm) outside the image"
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_landmarks(_ceph(), points, [0.1, 0.1], names, template=True)
    with pytest.warns(UserWarning, match=re.escape("[1400.0, 500.0] lies 60.50 px outside the image: the")):
        check_landmarks(_ceph(), points, None, names)  # no spacing known: pixels only
    with pytest.raises(ValueError, match=re.escape("[1500.0, 500.0] lies 160.50 px (16.05 mm) outside the image")):
        check_landmarks(_ceph(), np.array([[1500.0, 500.0], [1.0, 2.0]]), [0.1, 0.1], names)  # beyond 5 %: refused
    # through the transform: a template item is the one carrying TEMPLATE_KEY
    item = {"image": _ceph(), "landmarks": points.tolist(), "spacing": [0.1, 0.1]}
    with pytest.warns(UserWarning, match="sella"):
        LandmarkTargetsd("image", n_landmarks=2, landmark_names=names)(dict(item))
    with pytest.raises(ValueError, match=re.escape(expected)):
        LandmarkTargetsd("image", n_landmarks=2, landmark_names=names)({**item, TEMPLATE_KEY: True})


def test_a_3d_landmark_outside_is_measured_in_the_files_voxels():
    affine = np.array([[-2.0, 0, 0, 40], [0, 2.0, 0, -30], [0, 0, 3.0, 5], [0, 0, 0, 1]])
    volume = MetaTensor(torch.zeros(1, 20, 20, 20), affine=torch.as_tensor(affine), meta={"filename_or_obj": "ct.nii"})
    volume.meta.update(spatial_shape=np.array([20, 20, 20]), original_affine=affine)
    volume = Resize((16, 16, 16), mode="area")(volume)
    world = affine @ [3.0, 4.0, 20.0, 1.0]  # voxel z 20: half a voxel (1.5 mm) beyond the last voxel's edge 19.5
    with pytest.warns(
        UserWarning, match=re.escape(f"ct.nii: landmark 0 {world[:3].tolist()} lies 0.50 voxels (1.50 mm)")
    ):
        check_landmarks(volume, np.array([world[:3], [30.0, -20.0, 20.0]]))
    with pytest.raises(ValueError, match=re.escape("at voxel [3.0, 4.0, 20.0] of its 20 x 20 x 20")):
        check_landmarks(volume, np.array([world[:3], [30.0, -20.0, 20.0]]), template=True)


@pytest.mark.parametrize(
    "points, size, error",
    [
        ([[10.0, 10.0], [10.4, 10.3], [10.2, 9.9]], 100, "the template's 3 landmarks lie at 1 distinct position(s)"),
        ([[10.0, 10.0]] * 10 + [[50.0, 40.0]] * 9, 100, "the template's 19 landmarks lie at 2 distinct position(s)"),
        ([[10.0, 10.0], [10.5, 10.0], [None] * 2], 100, "the template's 2 landmarks lie at 1 distinct position(s)"),
        ([[None] * 2] * 3, 100, "a template must place at least one landmark; all of them are null"),
        ([[5.0, 5.0], [20.0, 3.0], [9.0, 30.0]], 32, "a template image of 32 x 32 px is too small: a template needs"),
        ([[5.0, 5.0], [20.0, 3.0], [9.0, 30.0]], 64, None),  # 64 px, 3 distinct positions
        ([[5.0, 5.0], [None] * 2, [None] * 2], 64, None),  # a single landmark
        ([[5.0, 5.0], [6.0, 5.0], [6.0, 6.0]], 64, None),  # 3 positions one pixel apart
        ([[5.0, 5.0], [6.0, 5.0], [6.0, 5.0]], 64, "the template's 3 landmarks lie at 2 distinct position(s)"),
    ],
)
def test_what_cannot_be_a_template_is_refused_naming_why(points, size, error):
    points = np.array([[np.nan if v is None else v for v in p] for p in points], float)
    image = MetaTensor(torch.zeros(1, size, size), meta={"filename_or_obj": "t.png", "spatial_shape": [size, size]})
    check_landmarks(image, points)  # as a test item: nothing to say
    if error is None:
        check_landmarks(image, points, template=True)
    else:
        with pytest.raises(ValueError, match=re.escape(f"t.png: {error}")):
            check_landmarks(image, points, template=True)


def test_a_landmark_at_1e308_is_refused_naming_it_without_overflow():
    """A landmark of 1e308 (a datalist accepts it) on an oblique CT overflowed the world-to-voxel map to NaN: it was
    taken for a missing landmark and the item passed; in 2D its distance read inf px, with numpy's overflow
    warnings. Now it is refused, naming the landmark and how far out it lies."""
    c = np.sqrt(0.5) / 2  # 0.5 mm voxels, rotated 45 degrees about z
    affine = np.array([[c, -c, 0, 0], [c, c, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 1.0]])
    volume = MetaTensor(torch.zeros(1, 20, 20, 20), affine=torch.as_tensor(affine), meta={"filename_or_obj": "ct.nii"})
    volume.meta.update(spatial_shape=np.array([20, 20, 20]), original_affine=affine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning
        for template in (False, True):
            with pytest.raises(
                ValueError,
                match=re.escape("ct.nii: ")
                + ".*"
                + re.escape(
                    "landmark 0 ('a') [1.7e+308, 1.7e+308, 0.0] lies more than 1.8e+308 voxels (more than 1.8e+308 mm) "
                    "outside the image: at a voxel beyond any float of its 20 x 20 x 20"
                ),
            ):
                check_landmarks(volume, np.array([[1.7e308, 1.7e308, 0.0]]), None, ["a"], template=template)
        with pytest.raises(ValueError, match=re.escape("landmark 1 ('b') [-1e+308, 5.0] lies 1e+308 px (3e+307 mm)")):
            check_landmarks(_ceph(), np.array([[1.0, 2.0], [-1e308, 5.0]]), [0.3, 0.3], ["a", "b"])
        with pytest.raises(
            ValueError, match=re.escape("landmark 0 ('a') [1e+308, 1e+308] lies 1.41e+308 px (more than")
        ):
            LandmarkTargets(1, ["a"])(_ceph(), [[1e308, 1e308]], [3.0, 3.0])
