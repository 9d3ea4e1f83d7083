"""The bundle's earlier intensity estimator, an experiment (scripts/experiments/joint_mi.py): the aligned-pixel
mutual information against independent references, its symmetric per-group intensities and its command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from bundle.information import extract_patches
from bundle.information_groups import information_groups
from bundle.transforms.intensity import adjust_brightness_contrast
from estimation_data import write_png_datalist
from scripts.experiments import joint_mi
from scripts.experiments.joint_mi import estimate_group_intensities, mutual_information
from skimage.metrics import normalized_mutual_information

ROOT = Path(__file__).resolve().parents[1]
REAL_DATA = ROOT.parent / "shared" / "data" / "hamedan_ceph"


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _reference_mi(a: np.ndarray, b: np.ndarray, bins: int, value_range) -> float:
    """H(A) + H(B) - H(A,B) from numpy's own 2D histogram on the common range."""
    joint, _, _ = np.histogram2d(a.ravel(), b.ravel(), bins=bins, range=[value_range, value_range])
    joint = joint / joint.sum()
    return _entropy_bits(joint.sum(1)) + _entropy_bits(joint.sum(0)) - _entropy_bits(joint)


# ---------------------------------------------------------------- mutual information


def test_mi_matches_histogram2d_reference_on_union_and_fixed_range():
    rng = np.random.default_rng(0)
    a = rng.random((40, 40))
    b = np.clip(0.6 * a + 0.3 * rng.random((40, 40)) + 0.05, 0, 1)
    union = (min(a.min(), b.min()), max(a.max(), b.max()))
    assert mutual_information(a, b, bins=16) == pytest.approx(_reference_mi(a, b, 16, union), abs=1e-10)
    assert mutual_information(a, b, bins=32, value_range=(0, 1)) == pytest.approx(
        _reference_mi(a, b, 32, (0, 1)), abs=1e-10
    )


def test_mi_matches_skimage_nmi_when_both_patches_span_the_same_range():
    rng = np.random.default_rng(1)
    a = rng.random((30, 30))
    b = np.sqrt(a) + 0.1 * rng.standard_normal((30, 30))
    b = (b - b.min()) / (b.max() - b.min())
    a[0, 0], a[0, 1] = 0.0, 1.0  # both patches span exactly [0, 1]: skimage's per-image bins coincide
    b[5, 5], b[6, 6] = 0.0, 1.0
    joint, _, _ = np.histogram2d(a.ravel(), b.ravel(), bins=20)
    h_ab = _entropy_bits(joint / joint.sum())
    nmi = normalized_mutual_information(a, b, bins=20)  # (H(A) + H(B)) / H(A, B)
    assert mutual_information(a, b, bins=20) == pytest.approx(h_ab * (nmi - 1), abs=1e-9)


def test_mi_analytic_cases_and_inputs():
    rng = np.random.default_rng(2)
    a, b = rng.random(200_000), rng.random(200_000)
    assert mutual_information(a, b, bins=16) < 0.01  # independent noise: only the small-sample bias remains
    counts, _ = np.histogram(a, bins=16, range=(a.min(), a.max()))
    assert mutual_information(a, a, bins=16) == pytest.approx(_entropy_bits(counts / counts.sum()), abs=1e-10)
    vol = rng.random((6, 7, 8))
    other = vol**2
    ref = mutual_information(vol, other)
    assert mutual_information(torch.from_numpy(vol), torch.from_numpy(other).float()) == pytest.approx(ref, abs=1e-6)
    assert mutual_information(np.zeros((4, 4)), np.zeros((4, 4))) == 0.0


def test_mi_common_range_sees_compression_that_per_patch_ranges_would_not():
    rng = np.random.default_rng(3)
    a = 0.2 + 0.6 * rng.random((32, 32))
    darker = 0.5 * a  # same histogram shape on its own range
    assert mutual_information(a, darker) < mutual_information(a, a) - 0.5


@pytest.mark.parametrize(
    "a, b, kwargs, match",
    [
        (np.zeros((3, 3)), np.zeros((3, 4)), {}, "same shape"),
        (np.array([0.0, np.nan]), np.zeros(2), {}, "patch a contains NaN"),
        (np.zeros(2), np.array([0.0, np.inf]), {}, "patch b contains NaN"),
        (np.zeros(0), np.zeros(0), {}, "empty"),
        (np.zeros(3), np.zeros(3), {"bins": 1}, "bins"),
        (np.zeros(3), np.zeros(3), {"value_range": (1, 0)}, "value_range"),
    ],
)
def test_mi_bad_inputs(a, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mutual_information(a, b, **kwargs)


# ---------------------------------------------------------------- intensity estimation


def _first_crossing(patches: np.ndarray, target: float, kind: str, step: float) -> float:
    """Independent re-computation of A: the first t with mean MI(patch, augmented patch) < target."""

    def mean_mi(b: float, c: float) -> float:
        aug = [adjust_brightness_contrast(torch.from_numpy(p)[None], b, c)[0].numpy() for p in patches]
        return float(np.mean([mutual_information(p, q) for p, q in zip(patches, aug)]))

    for k in range(1, int(round(1 / step)) + 1):
        t = k * step
        mi = mean_mi(1 - t, 1.0) if kind == "brightness" else min(mean_mi(1.0, 1 - t), mean_mi(1.0, 1 + t))
        if mi < target:
            return t
    return math.nan


def test_estimate_matches_independent_first_crossing_and_differs_between_groups(synthetic_setup):
    template, others, points, corr, point_entropy = synthetic_setup
    groups = information_groups(point_entropy)
    assert sorted(set(groups.tolist())) == [0, 1, 2]
    res = estimate_group_intensities(
        template, others, points, corr, point_entropy, patch_size=8, n_keypoints=1000, alpha_hat=0.9, step=0.04
    )
    for g, name in enumerate(("low", "medium", "high")):
        e = res[name]
        sel = np.flatnonzero((groups == g) & extract_patches(template, points, 8)[1])
        assert e["n_keypoints"] == len(sel) and e["n_pairs"] == 3 * len(sel)
        patches = extract_patches(template, points[sel], 8)[0]
        ref_target = 0.9 * np.mean(
            [
                mutual_information(patches[i], extract_patches(o, c[sel], 8)[0][i])
                for o, c in zip(others, corr)
                for i in range(len(sel))
            ]
        )
        assert e["target_mi"] == pytest.approx(ref_target, rel=1e-9)
        assert e["target_mi"] < e["self_mi"]
        for kind in ("brightness", "contrast"):
            assert e[kind] == pytest.approx(_first_crossing(patches, e["target_mi"], kind, 0.04))
    # the group's information content changes the tolerated intensity (low: binary patches survive strong
    # darkening until both grey levels share a bin; high: fine grey levels merge much earlier)
    assert res["low"]["brightness"] - res["high"]["brightness"] >= 0.1


def test_larger_alpha_hat_gives_smaller_or_equal_intensities(synthetic_setup):
    template, others, points, corr, point_entropy = synthetic_setup
    runs = [
        estimate_group_intensities(
            template, others, points, corr, point_entropy, patch_size=8, n_keypoints=8, alpha_hat=a
        )
        for a in (0.5, 0.8, 0.95, 1.7)
    ]
    for name in ("low", "medium", "high"):
        for kind in ("brightness", "contrast"):
            values = [r[name][kind] for r in runs]
            assert values[0] >= values[1] >= values[2], (name, kind, values)
    assert runs[0]["high"]["brightness"] > runs[2]["high"]["brightness"]


def test_estimate_flags_empty_groups_and_saturation(synthetic_setup):
    template, others, points, corr, point_entropy = synthetic_setup
    keep = information_groups(point_entropy) != 1  # no medium candidates at all
    res = estimate_group_intensities(
        template,
        others,
        points[keep],
        corr[:, keep],
        point_entropy[keep],
        patch_size=8,
        n_keypoints=5,
        max_intensity=0.1,
        step=0.05,
    )
    assert res["medium"]["brightness"] is None and res["medium"]["contrast"] is None
    assert "no estimate" in res["medium"]["note"] and res["medium"]["n_keypoints"] == 0
    assert res["low"]["brightness"] == pytest.approx(0.1) and res["low"]["brightness_at_max"] is True
    with pytest.raises(ValueError, match="alpha_hat"):
        estimate_group_intensities(template, others, points, corr, point_entropy, alpha_hat=0.0)
    with pytest.raises(ValueError, match="point_entropy"):
        estimate_group_intensities(template, others, points, corr, point_entropy[:3])


# ---------------------------------------------------------------- command-line tool


def test_script_writes_mergeable_yaml(tmp_path, capsys):
    datalist = write_png_datalist(tmp_path)
    out = tmp_path / "aug" / "augmentation.yaml"
    joint_mi.estimate(str(datalist), str(out), n_images=3, patch_size=8, radius=8, stride=8, n_keypoints=10, step=0.05)
    aug = yaml.safe_load(out.read_text())["augmentation"]
    assert aug["thresholds"] == [2.0, 4.0] and aug["alpha_hat"] == 0.8
    assert aug["source"]["template"].endswith("000.png") and aug["source"]["n_images"] == 3
    for kind in ("brightness", "contrast"):
        assert len(aug[kind]) == 3 and all(v is None or 0 < v <= 1 for v in aug[kind])
    assert all(v is not None for v in aug["brightness"])  # the three regions give every group key points
    assert [aug["groups"][g]["brightness"] for g in ("low", "medium", "high")] == aug["brightness"]
    table = capsys.readouterr().out
    assert "A_bright" in table and "medium" in table and str(out) in table
    assert not list(out.parent.glob(".*.tmp*"))  # atomic write left no temporary file


def test_script_cli(tmp_path):
    datalist = write_png_datalist(tmp_path, n_images=3)
    out = tmp_path / "cli.yaml"
    cmd = [
        sys.executable,
        "-m",
        "scripts.experiments.joint_mi",
        "--datalist",
        str(datalist),
        "--output",
        str(out),
        "--n_images",
        "2",
        "--patch_size",
        "8",
        "--radius",
        "4",
        "--stride",
        "4",
        "--thresholds",
        "[2,4]",
        "--step",
        "0.1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(out.read_text())["augmentation"]["source"]["n_images"] == 2
    assert "A_contrast" in proc.stdout


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason="shared Hamedan data not available")
def test_real_cephalograms_landmarks_only(tmp_path):
    """On two real cephalograms with the 19 landmarks alone, sparse groups are reported, not invented."""
    items = []
    for i in (1, 3, 4):  # 002 carries a duplicated label
        js = json.loads((REAL_DATA / "annotations" / "farhadifar" / f"{i:03d}.json").read_text())
        pts = {s["label"].lower(): s["points"][0] for s in js["shapes"]}
        items.append(
            {"image": str(REAL_DATA / "images" / f"{i:03d}.png"), "landmarks": [pts.get(f"l{k}") for k in range(1, 20)]}
        )
    dl = {"name": "ceph", "spatial_dims": 2, "landmark_names": [f"l{k}" for k in range(1, 20)], "training": items}
    path = tmp_path / "dl.json"
    path.write_text(json.dumps(dl))
    res = joint_mi.estimate(str(path), str(tmp_path / "a.yaml"), n_images=2, radius=0, n_keypoints=19, step=0.05)
    groups = res["augmentation"]["groups"]
    assert sum(groups[g]["n_candidates"] for g in groups) == 19
    for g in groups.values():
        assert (g["brightness"] is None) == (g["n_keypoints"] < 3)
        if g["brightness"] is not None:
            assert 0 < g["target_mi"] < g["self_mi"]
