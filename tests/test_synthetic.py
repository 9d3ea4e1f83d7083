"""Tests of the embedded synthetic landmark datasets (bundle/data/synthetic.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from bundle.data import synthetic
from bundle.data.datalist import SECTIONS, landmarks_array, load_datalist
from monai.transforms import LoadImage
from PIL import Image
from scipy import ndimage

SMALL_2D = dict(n_training=3, n_validation=1, n_test=2, seed=3)
SMALL_3D = dict(n_training=2, n_validation=1, n_test=1, seed=3)


@pytest.fixture(scope="module")
def set_2d(tmp_path_factory) -> dict:
    return load_datalist(synthetic.generate_synthetic_2d(tmp_path_factory.mktemp("s2d"), **SMALL_2D))


@pytest.fixture(scope="module")
def set_3d(tmp_path_factory) -> dict:
    return load_datalist(synthetic.generate_synthetic_3d(tmp_path_factory.mktemp("s3d"), **SMALL_3D))


def _items(datalist: dict) -> list[tuple[str, int, dict]]:
    return [("template", 0, datalist["template"])] + [(s, i, it) for s in SECTIONS for i, it in enumerate(datalist[s])]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _edge_check(subject: synthetic.PhantomSubject, points: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    """Contrast of the clean picture across the local edge normal at ``points``, and how far the value at the
    point is from the midpoint of the two sides (as a fraction of the contrast): ~0 on an edge."""
    h = 0.25 * step
    grad = np.stack(
        [subject.clean(points + h * e) - subject.clean(points - h * e) for e in np.eye(points.shape[1])], axis=1
    )
    normal = grad / np.maximum(np.linalg.norm(grad, axis=1, keepdims=True), 1e-12)
    plus, minus = subject.clean(points + step * normal), subject.clean(points - step * normal)
    contrast = np.abs(plus - minus)
    return contrast, np.abs(subject.clean(points) - (plus + minus) / 2) / np.maximum(contrast, 1e-12)


def _normals(subject: synthetic.PhantomSubject, points: np.ndarray, h: float) -> np.ndarray:
    grad = np.stack(
        [subject.clean(points + h * e) - subject.clean(points - h * e) for e in np.eye(points.shape[1])], axis=1
    )
    return grad / np.linalg.norm(grad, axis=1, keepdims=True)


def _head_correlation(volume: np.ndarray, reference: np.ndarray) -> float:
    """Correlation of two CT volumes over the head (either above -500 HU), air and fat clipped to -200 HU."""
    mask = (volume > -500) | (reference > -500)
    return float(np.corrcoef(np.maximum(volume[mask], -200), np.maximum(reference[mask], -200))[0, 1])


# ------------------------------------------------------------------------------------------------ 2D
def test_2d_datalist_contract(set_2d):
    assert set_2d["spatial_dims"] == 2
    names = set_2d["landmark_names"]
    assert names == list(synthetic.LANDMARKS_2D) and len(names) >= 10 and len(set(names)) == len(names)
    assert [len(set_2d[s]) for s in SECTIONS] == [3, 1, 2]
    template = set_2d["template"]["image"]
    assert template not in {it["image"] for s in SECTIONS for it in set_2d[s]}
    for _, _, item in _items(set_2d):
        assert item["spacing"] == [0.5, 0.5]
        assert len(item["landmarks"]) == len(names) and all(p is not None for p in item["landmarks"])
        with Image.open(item["image"]) as im:
            assert im.mode == "L" and im.size == (256, 288)  # (width, height)


def test_2d_landmarks_inside_and_equal_to_subject_api(set_2d):
    for split, index, item in _items(set_2d):
        lms = landmarks_array(item, len(synthetic.LANDMARKS_2D), 2)
        assert np.all(lms >= 0) and np.all(lms <= [255, 287])
        np.testing.assert_allclose(lms, synthetic.subject_2d(3, split, index).landmarks, atol=1e-3)


def test_2d_landmarks_lie_on_structure_edges_of_the_model():
    contrasts, offsets = [], []
    for index in range(25):
        subject = synthetic.subject_2d(11, "training", index)
        c, m = _edge_check(subject, subject.landmarks, step=2.0)
        contrasts.append(c)
        offsets.append(m)
    assert np.min(contrasts) > 0.3  # a bone edge: ~0.4 (bone level) between the two sides
    assert np.max(offsets) < 0.2  # the landmark sits at the edge's midpoint, not beside it
    # the check can fail: random points of the same pictures are rarely on an edge
    rng = np.random.default_rng(0)
    subject = synthetic.subject_2d(11, "training", 0)
    c, m = _edge_check(subject, rng.uniform([0, 0], [255, 287], size=(400, 2)), step=2.0)
    assert np.mean((c > 0.3) & (m < 0.2)) < 0.15


def test_2d_written_picture_has_the_model_geometry(set_2d):
    """The PNG read the MONAI way, as (W, H) with img[x, y], matches the model and the landmarks."""
    rng = np.random.default_rng(1)
    loader = LoadImage(image_only=True)
    for split, index, item in _items(set_2d):
        img = np.asarray(loader(item["image"]), dtype=float)
        assert img.shape == (256, 288)
        subject = synthetic.subject_2d(3, split, index)
        xs, ys = np.meshgrid(np.arange(256), np.arange(288), indexing="ij")
        clean = subject.clean(np.stack([xs.ravel(), ys.ravel()], axis=1)).reshape(img.shape)
        assert np.corrcoef(img.ravel(), clean.ravel())[0, 1] > 0.95
        assert np.corrcoef(img.ravel(), clean[::-1].ravel())[0, 1] < 0.75  # a mirrored geometry does not fit
        # across each landmark's edge the picture changes strongly
        lms = np.asarray(item["landmarks"])
        normal = _normals(subject, lms, 0.5)
        sides = [ndimage.map_coordinates(img, (lms + s * 3.0 * normal).T, order=1) for s in (1, -1)]
        assert np.min(np.abs(sides[0] - sides[1])) > 40
        # and its gradient magnitude is far above that of random pixels
        gm = ndimage.gaussian_gradient_magnitude(img, 1.0)
        at = gm[tuple(np.round(lms).astype(int).T)]
        rand = gm[rng.integers(0, 256, 1000), rng.integers(0, 288, 1000)]
        assert np.median(at) > 3 * np.mean(rand)


def test_2d_deterministic_for_a_seed(tmp_path):
    args = dict(n_training=2, n_validation=1, n_test=1, size=(96, 112))
    a = _files(synthetic.generate_synthetic_2d(tmp_path / "a", seed=5, **args).parent)
    b = _files(synthetic.generate_synthetic_2d(tmp_path / "b", seed=5, **args).parent)
    c = _files(synthetic.generate_synthetic_2d(tmp_path / "c", seed=6, **args).parent)
    assert len(a) == 6 and a == b
    assert all(a[k] != c[k] for k in a if k.endswith(".png"))


# ------------------------------------------------------------------------------------------------ 3D
def test_3d_datalist_and_nifti_headers(set_3d):
    assert set_3d["spatial_dims"] == 3
    assert set_3d["landmark_names"] == list(synthetic.LANDMARKS_3D) and len(synthetic.LANDMARKS_3D) >= 10
    assert [len(set_3d[s]) for s in SECTIONS] == [2, 1, 1]
    for _, _, item in _items(set_3d):
        assert item["image"].endswith(".nii.gz")
        image = nib.load(item["image"])
        data = np.asarray(image.dataobj)
        assert data.dtype == np.int16 and data.shape == (64, 64, 64)
        affine = image.affine
        assert nib.aff2axcodes(affine) == ("L", "P", "S")  # LPS-like storage
        np.testing.assert_allclose(np.diag(affine)[:3], [-2.0, -2.0, 2.0])
        assert np.linalg.norm(affine[:3, 3]) > 10.0
        assert data.min() <= -1000 and np.median(data[:4, :4, :4]) < -950  # air
        assert 700 <= data.max() <= 1700 and 0.01 < np.mean(data > 600) < 0.2  # bone
        assert -1000 < np.median(data[data > -500]) < 300  # mostly soft tissue inside the head


def test_3d_landmarks_are_ras_world_mm_on_structures(set_3d):
    names = list(synthetic.LANDMARKS_3D)
    for split, index, item in _items(set_3d):
        image = nib.load(item["image"])
        data = np.asarray(image.dataobj, dtype=float)
        world = landmarks_array(item, len(names), 3)
        subject = synthetic.subject_3d(3, split, index)
        np.testing.assert_allclose(world, subject.landmarks, atol=1e-3)
        np.testing.assert_allclose(image.affine, subject.affine)
        vox = (np.c_[world, np.ones(len(world))] @ np.linalg.inv(image.affine).T)[:, :3]
        assert np.all(vox >= 0) and np.all(vox <= 63)
        # RAS semantics: +x right, +y anterior, +z superior
        at = dict(zip(names, world))
        assert at["vertex"][2] == world[:, 2].max()
        assert at["glabella_like"][1] > at["opisthocranion_like"][1] + 60
        assert at["orbit_floor_left"][0] < at["orbit_floor_right"][0] - 20
        assert at["condyle_left"][0] < at["condyle_right"][0] - 20
        # the written volume changes strongly across each landmark's structure boundary (3 mm each side)
        normal = _normals(subject, world, 0.5)
        sides = []
        for s in (1, -1):
            p = world + s * 3.0 * normal
            sides.append(
                ndimage.map_coordinates(
                    data, ((np.c_[p, np.ones(len(p))] @ np.linalg.inv(image.affine).T)[:, :3]).T, order=1
                )
            )
        assert np.min(np.abs(sides[0] - sides[1])) > 300
        # the whole volume has the model's geometry, read through the header's affine
        ijk = np.stack(np.meshgrid(*(np.arange(64),) * 3, indexing="ij"), axis=-1).reshape(-1, 3)
        clean = subject.clean(nib.affines.apply_affine(image.affine, ijk)).reshape(data.shape)
        assert _head_correlation(data, clean) > 0.97
        assert _head_correlation(data, clean[:, ::-1]) < 0.85  # front and back swapped does not fit


def test_3d_landmarks_lie_on_structure_edges_of_the_model():
    contrasts, offsets = [], []
    for index in range(12):
        subject = synthetic.subject_3d(11, "training", index)
        c, m = _edge_check(subject, subject.landmarks, step=2.0)
        contrasts.append(c)
        offsets.append(m)
    assert np.min(contrasts) > 400  # HU across a tissue boundary
    assert np.max(offsets) < 0.2


def test_3d_deterministic_for_a_seed(tmp_path):
    args = dict(n_training=1, n_validation=0, n_test=0, shape=(40, 40, 40), spacing=(3.0, 3.0, 3.0))
    a = _files(synthetic.generate_synthetic_3d(tmp_path / "a", seed=2, **args).parent)
    b = _files(synthetic.generate_synthetic_3d(tmp_path / "b", seed=2, **args).parent)
    c = _files(synthetic.generate_synthetic_3d(tmp_path / "c", seed=4, **args).parent)
    assert len(a) == 3 and a == b
    assert all(a[k] != c[k] for k in a if k.endswith(".nii.gz"))


# -------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(size=(32, 300)), "size"),
        (dict(size=(256,)), "size"),
        (dict(spacing=(0.5, -1.0)), "spacing"),
        (dict(n_training=0), "n_training"),
        (dict(n_test=-1), "n_test"),
        (dict(n_validation=1.5), "n_validation"),
    ],
)
def test_bad_arguments_raise_naming_the_key(tmp_path, kwargs, key):
    with pytest.raises(ValueError, match=key):
        synthetic.generate_synthetic_2d(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_bad_3d_shape_raises(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        synthetic.generate_synthetic_3d(tmp_path / "out", shape=(64, 64))
    with pytest.raises(ValueError, match="spatial_dims"):
        synthetic.ensure_synthetic_dataset(tmp_path / "x" / "datalist.json", spatial_dims=4)


# ----------------------------------------------------------------------------------------- ensure
def test_ensure_generates_the_default_set_once(tmp_path, monkeypatch):
    path = tmp_path / "data" / "synthetic_2d" / "dataset.json"
    assert synthetic.ensure_synthetic_dataset(path) == path
    datalist = load_datalist(path)
    assert [len(datalist[s]) for s in SECTIONS] == [40, 6, 10] and datalist["spatial_dims"] == 2
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["synthetic_2d"]  # no temporary left
    before = {p: p.stat().st_mtime_ns for p in path.parent.rglob("*")}

    def fail(*args, **kwargs):
        raise AssertionError("must not regenerate")

    monkeypatch.setattr(synthetic, "generate_synthetic_2d", fail)
    assert synthetic.ensure_synthetic_dataset(path) == path
    assert {p: p.stat().st_mtime_ns for p in path.parent.rglob("*")} == before


def test_ensure_3d_uses_the_3d_generator(tmp_path, monkeypatch):
    small = functools.partial(
        synthetic.generate_synthetic_3d, n_training=1, n_validation=0, n_test=0, shape=(32, 32, 32)
    )
    monkeypatch.setattr(synthetic, "generate_synthetic_3d", small)
    path = synthetic.ensure_synthetic_dataset(tmp_path / "ct" / "datalist.json", spatial_dims=3)
    assert load_datalist(path)["spatial_dims"] == 3


def test_ensure_interrupted_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(out_dir, **kwargs):
        (Path(out_dir) / "images").mkdir(parents=True)
        (Path(out_dir) / "images" / "half.png").write_bytes(b"\x89PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "generate_synthetic_2d", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthetic.ensure_synthetic_dataset(tmp_path / "data" / "s" / "datalist.json")
    assert list((tmp_path / "data").iterdir()) == []


def test_ensure_keeps_a_concurrent_generators_result(tmp_path, monkeypatch):
    target = tmp_path / "data" / "s"
    small = functools.partial(synthetic.generate_synthetic_2d, n_training=1, n_validation=0, n_test=0, size=(80, 96))

    def racing(out_dir, **kwargs):
        result = small(out_dir, seed=0)
        small(target, seed=9)  # another process finishes first
        return result

    monkeypatch.setattr(synthetic, "generate_synthetic_2d", racing)
    path = synthetic.ensure_synthetic_dataset(target / "datalist.json")
    assert json.loads(path.read_text())["seed"] == 9
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["s"]


def test_ensure_fills_an_existing_folder(tmp_path, monkeypatch):
    target = tmp_path / "s"
    target.mkdir()
    (target / "README.txt").write_text("keep me")
    small = functools.partial(synthetic.generate_synthetic_2d, n_training=1, n_validation=0, n_test=0, size=(80, 96))
    monkeypatch.setattr(synthetic, "generate_synthetic_2d", small)
    path = synthetic.ensure_synthetic_dataset(target / "datalist.json")
    assert (target / "README.txt").read_text() == "keep me"
    assert len(load_datalist(path)["training"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    (target / "datalist.json").unlink()  # images/ exists now but the datalist does not: refuse to mix
    with pytest.raises(FileExistsError, match="images"):
        synthetic.ensure_synthetic_dataset(target / "datalist.json")


# ------------------------------------------------------------------------------------------ names
def test_model_landmarks_are_addressed_by_name(monkeypatch):
    """Reordering the landmark names reorders the points with them; a name the model lacks is refused."""
    points = dict(zip(synthetic.LANDMARKS_2D, synthetic.subject_2d(3, "training", 0).landmarks))
    monkeypatch.setattr(synthetic, "LANDMARKS_2D", synthetic.LANDMARKS_2D[::-1])
    reordered = synthetic.subject_2d(3, "training", 0).landmarks
    np.testing.assert_array_equal(reordered, [points[name] for name in synthetic.LANDMARKS_2D])
    names_3d = synthetic.LANDMARKS_3D
    monkeypatch.setattr(synthetic, "LANDMARKS_3D", names_3d + ("bregma_like",))
    with pytest.raises(ValueError, match=r"missing \['bregma_like'\], unknown \[\]"):
        synthetic.subject_3d(3, "training", 0)
    monkeypatch.setattr(synthetic, "LANDMARKS_3D", names_3d[:-2])
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['condyle_right', 'menton_like'\]"):
        synthetic.subject_3d(3, "training", 0)
