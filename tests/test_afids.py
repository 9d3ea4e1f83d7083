"""The AFID real-data check (scripts/experiments/afids.py): warps carry landmarks exactly; the autoafids resources
and the experiment's datalist (skipped when the autoafids package is not installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from bundle.data.datalist import load_datalist
from scipy.ndimage import map_coordinates
from scripts.experiments import afids_check
from scripts.experiments.afids import (
    afids_files,
    carry_points,
    group_of,
    perturb_intensity,
    prepare_afids_datalist,
    random_affine,
    random_displacement,
    read_afids,
    resource_dir,
    warp_volume,
    working_grid,
)

ROOT = Path(__file__).resolve().parents[1]

needs_autoafids = pytest.mark.skipif(
    importlib.util.find_spec("autoafids") is None,
    reason="autoafids not installed (pip install --no-deps -r requirements-3d.txt)",
)


@pytest.mark.parametrize("elastic_mm", [0.0, 3.0])
def test_warp_carries_points_exactly_onto_the_moved_anatomy(elastic_mm):
    """A volume holding its own world coordinates, warped (affine, or bent too): at each carried point it holds the
    original point."""
    rng = np.random.default_rng(0)
    affine = np.array([[1.2, 0.0, 0.0, -30.0], [0.0, 1.0, 0.1, -40.0], [0.0, 0.0, 1.5, -20.0], [0.0, 0.0, 0.0, 1.0]])
    shape = (50, 60, 40)
    ijk = np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), -1).astype(np.float64)
    world = ijk @ affine[:3, :3].T + affine[:3, 3]
    points = rng.uniform(18, np.asarray(shape) - 19, (6, 3)) @ affine[:3, :3].T + affine[:3, 3]
    warp = random_affine(rng, points.mean(0), rotate_deg=10, scale=0.08, shear=0.03, translate_mm=5)
    grid, grid_shape = working_grid(affine, shape, 2.0)
    np.testing.assert_allclose(np.linalg.norm(grid[:3, :3], axis=0), 2.0)
    bend = random_displacement(rng, grid, grid_shape, elastic_mm) if elastic_mm else None
    moved = carry_points(warp, points, bend, grid)
    voxels = (moved - grid[:3, 3]) @ np.linalg.inv(grid[:3, :3]).T
    held = np.stack(
        [
            map_coordinates(
                warp_volume(world[..., a], affine, warp, grid, grid_shape, bend).astype(np.float64), voxels.T, order=1
            )
            for a in range(3)
        ],
        1,
    )
    np.testing.assert_allclose(held, points, atol=1e-3)
    assert np.abs(moved - points).max() > 1.0  # the warp really moved them
    if elastic_mm:  # the bend moves the points off where the affine map alone puts them
        assert np.sqrt((bend**2).sum(0).mean()) == pytest.approx(elastic_mm, rel=1e-4)
        affine_only = carry_points(warp, points)
        assert np.linalg.norm(moved - affine_only, axis=1).max() > 0.5


def test_perturb_intensity_is_seeded_and_non_negative():
    volume = np.random.default_rng(1).uniform(0, 500, (12, 14, 10)).astype(np.float32)
    a = perturb_intensity(np.random.default_rng(5), volume)
    b = perturb_intensity(np.random.default_rng(5), volume)
    np.testing.assert_array_equal(a, b)
    assert a.shape == volume.shape and a.min() >= 0 and not np.allclose(a, volume)


def test_group_names():
    assert group_of("images/t1w_warped_001.nii.gz") == "T1w -> warped T1w"
    assert group_of("images/t2w.nii.gz") == "T1w -> T2w"
    assert group_of("images/t2w_warped_000.nii.gz") == "T1w -> warped T2w"


@needs_autoafids
def test_resources_and_ground_truth_afids():
    files = afids_files(resource_dir())
    names, points = read_afids(files["afids"])
    assert len(names) == 32 and names[:2] == ["AC", "PC"] and points.shape == (32, 3)
    t1 = nib.load(str(files["t1w"]))
    assert t1.shape == (193, 229, 193)
    voxels = (points - t1.affine[:3, 3]) @ np.linalg.inv(t1.affine[:3, :3]).T
    assert ((voxels > 0) & (voxels < np.asarray(t1.shape) - 1)).all()
    # AC and PC lie on the midline (x close to 0 mm RAS), AC anterior to PC
    assert abs(points[0, 0]) < 2 and abs(points[1, 0]) < 2 and points[0, 1] > points[1, 1]


@needs_autoafids
def test_prepare_afids_datalist(tmp_path):
    path = prepare_afids_datalist(tmp_path, n_training=2, n_test=1, spacing=6.0, seed=3)
    datalist = load_datalist(path)
    assert len(datalist["training"]) == 2
    groups = sorted(group_of(it["image"]) for it in datalist["test"])
    assert groups == ["T1w -> T2w", "T1w -> warped T1w", "T1w -> warped T2w"]
    _, afids = read_afids(afids_files()["afids"])
    np.testing.assert_allclose(datalist["template"]["landmarks"], afids, atol=1e-5)
    image = nib.load(datalist["training"][0]["image"])
    np.testing.assert_allclose(np.linalg.norm(image.affine[:3, :3], axis=0), 6.0)
    warped = next(it for it in datalist["test"] if group_of(it["image"]) == "T1w -> warped T1w")
    assert np.abs(np.asarray(warped["landmarks"]) - afids).max() > 1.0
    # the training warps carry their AFIDs (k-shot templates; training never reads them), each moved by its warp
    for item in datalist["training"]:
        assert (
            np.asarray(item["landmarks"]).shape == (32, 3) and np.abs(np.asarray(item["landmarks"]) - afids).max() > 1.0
        )

    # afids_check --templates k: the T1w template and the first k - 1 training warps with their AFIDs
    kshot = load_datalist(afids_check.kshot_datalist(datalist, 3, tmp_path / "datalist_k3.json"))
    assert "template" not in kshot and [it["image"] for it in kshot["templates"]] == [datalist["template"]["image"]] + [
        it["image"] for it in datalist["training"]
    ]
    np.testing.assert_allclose(kshot["templates"][2]["landmarks"], datalist["training"][1]["landmarks"])
    assert kshot["test"] == datalist["test"] and afids_check.setting_name(1, 5) == "k1_pseudo5"
    assert afids_check.setting_name(1, 0, contrast_adaptation=True) == "k1_adapted"
    assert afids_check.setting_name(1, 0, True, registration_tolerance=2.0) == "k1_adapted_reg2"

    # bent warps: the same affine maps (a generator of their own draws the bends), the AFIDs moved a few mm further
    bent = load_datalist(
        prepare_afids_datalist(tmp_path / "bent", n_training=2, n_test=1, spacing=6.0, seed=3, elastic_mm=4.0)
    )
    assert "bent by 4.0 mm" in bent["description"] and bent["elastic_mm"] == 4.0 and datalist["elastic_mm"] == 0.0
    for plain_item, bent_item in zip(datalist["training"] + datalist["test"], bent["training"] + bent["test"]):
        moved = np.linalg.norm(np.asarray(bent_item["landmarks"]) - np.asarray(plain_item["landmarks"]), axis=1)
        if group_of(plain_item["image"]) == "T1w -> T2w":  # the T2w volume as it is: neither warped nor bent
            assert moved.max() == 0.0
        else:
            assert 0.5 < moved.mean() < 8.0, moved.mean()
    with pytest.raises(ValueError, match="at most 3 templates"):
        afids_check.kshot_datalist(datalist, 4, tmp_path / "datalist_k4.json")


@needs_autoafids
def test_afids_check_pseudo_templates_are_written_and_scored_against_the_carried_afids(tmp_path):
    """afids_check --pseudo_templates: chosen by bundle.templates.resolution.resolve_templates (an untrained tiny
    network here), written as the datalist's templates with their kept pseudo-labels, scored against the carried
    AFIDs."""
    import torch
    from bundle.configs import bundle_parser, config_files
    from scripts.experiments.afids import MRI_LOAD_TRANSFORMS

    path = prepare_afids_datalist(tmp_path / "data", n_training=3, n_test=1, spacing=6.0, seed=3)
    datalist = load_datalist(path)
    configs = [str(ROOT / f) for f in config_files("evaluate", spatial_dims=3)]
    common = {
        "bundle_root": str(ROOT),
        "target_spacing": [6.0] * 3,
        "image_size": [32, 32, 32],
        "load_transforms": MRI_LOAD_TRANSFORMS,
        "progress_bar": False,
        "seed": 0,
        "network_def#channels": [8, 16, 32, 64, 64],
    }
    torch.manual_seed(0)
    ckpt = tmp_path / "untrained.pt"
    overrides = {k: v for k, v in common.items() if k != "bundle_root"}
    torch.save(
        bundle_parser(configs, bundle_root=ROOT, datalist=str(path), **overrides)
        .get_parsed_content("network_def")
        .state_dict(),
        ckpt,
    )
    written, report = afids_check.pseudo_template_datalist(
        configs,
        path,
        ckpt,
        tmp_path / "data" / "datalist_k1_pseudo2.json",
        datalist,
        common,
        pseudo_templates=2,
        pseudo_candidates=3,
        pseudo_cycle_tolerance=1000.0,
        template_combine="geometric_median",
    )
    out = load_datalist(written)
    assert "template" not in out and len(out["templates"]) == 3 and out["templates"][0] == datalist["template"]
    training = {it["image"]: it for it in datalist["training"]}
    assert {it["image"] for it in out["templates"][1:]} <= set(training)
    assert [r["image"] for r in report] == [Path(it["image"]).name for it in out["templates"][1:]]
    for entry, item in zip(report, out["templates"][1:]):
        assert entry["kept"] == 32  # a tolerance of 1000 voxels keeps every pseudo-label
        errors = np.linalg.norm(
            np.asarray(item["landmarks"]) - np.asarray(training[item["image"]]["landmarks"]), axis=1
        )
        assert entry["kept_mre_mm"] == pytest.approx(errors.mean())
