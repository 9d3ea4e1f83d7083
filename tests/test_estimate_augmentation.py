"""The paper's augmentation estimator (MI between grey-value distributions, asymmetric factor ranges), the
information groups and the augmentation model it shares with training: bundle/information.py,
bundle/information_groups.py and scripts/estimate_augmentation.py (``--correspondences``)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import yaml
from bundle.data.images import load_grey
from bundle.information import (
    distribution_mutual_information,
    estimate_group_ranges,
    extract_patches,
    grey_level_histogram,
    offset_correspondences,
    paired_sample_mutual_information,
    search_factor_range,
)
from bundle.information_groups import group_memberships, information_groups
from bundle.transforms.entropy import local_entropy
from bundle.transforms.intensity import adjust_brightness_contrast
from estimation_data import three_region_image, write_png_datalist
from PIL import Image
from scripts import estimate_augmentation
from scripts.experiments import joint_mi


def _hand_mi(a, b) -> float:
    """MI (nats) of paired samples written out with Python counters: sum p(x,y) log(p(x,y) / (p(x) p(y)))."""
    n = len(a)
    pairs, ca, cb = Counter(zip(a, b)), Counter(a), Counter(b)
    return sum(c / n * math.log((c / n) / ((ca[x] / n) * (cb[y] / n))) for (x, y), c in pairs.items())


# ---------------------------------------------------------------- MI of two count vectors


def test_paired_sample_mi_by_hand():
    assert paired_sample_mutual_information([0, 0, 1, 1], [5, 5, 9, 9]) == pytest.approx(math.log(2))
    assert paired_sample_mutual_information([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-12)
    assert paired_sample_mutual_information([3, 3, 3, 3], [0, 1, 2, 3]) == 0.0  # one category: no information
    # 1, 2, 3, 4 all distinct against two values: MI = H(b) = log 2
    assert paired_sample_mutual_information([1, 2, 3, 4], [7, 7, 8, 8]) == pytest.approx(math.log(2))
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rng.integers(0, 6, 256)
        b = np.where(rng.random(256) < 0.6, a, rng.integers(0, 9, 256))
        assert paired_sample_mutual_information(a, b) == pytest.approx(_hand_mi(a.tolist(), b.tolist()), rel=1e-12)
        assert paired_sample_mutual_information(a, b) == pytest.approx(
            paired_sample_mutual_information(b, a), rel=1e-12
        )
    with pytest.raises(ValueError, match="same length"):
        paired_sample_mutual_information([1, 2], [1, 2, 3])


def test_paired_sample_mi_equals_sklearn_mutual_info_score():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    for _ in range(5):
        a, b = rng.integers(0, 40, 256), rng.integers(0, 40, 256)
        assert paired_sample_mutual_information(a, b) == pytest.approx(metrics.mutual_info_score(a, b), rel=1e-9)


def test_distribution_mi_of_two_patches_is_the_mi_of_their_256_bin_histograms():
    rng = np.random.default_rng(2)
    a, b = rng.random((64, 64)) ** 2, rng.random((64, 64))
    ha = np.histogram(np.rint(a * 255), bins=256, range=(-0.5, 255.5))[0]  # numpy's own 8-bit histogram
    hb = np.histogram(np.rint(b * 255), bins=256, range=(-0.5, 255.5))[0]
    np.testing.assert_array_equal(grey_level_histogram(a), ha)
    assert grey_level_histogram(a).sum() == 64 * 64 and grey_level_histogram(np.array([-1.0, 2.0])).tolist()[::255] == [
        1,
        1,
    ]
    assert distribution_mutual_information(a, b) == pytest.approx(_hand_mi(ha.tolist(), hb.tolist()), rel=1e-12)
    # with itself: the entropy (nats) of the distribution of the count values
    counts = np.unique(ha, return_counts=True)[1] / 256
    assert distribution_mutual_information(a, a) == pytest.approx(-(counts * np.log(counts)).sum(), rel=1e-12)
    # only the histograms matter: a shuffled patch has the same distribution, any shape
    assert distribution_mutual_information(a, rng.permutation(a.ravel())) == pytest.approx(
        distribution_mutual_information(a, a)
    )


# ---------------------------------------------------------------- range search


def _mean_mi(patches: np.ndarray, kind: str, factor: float) -> float:
    """Independent: augment each patch on its own (numpy ColorJitter) and average the histogram MIs by hand."""
    out = []
    for p in patches:
        q = np.clip(p * factor, 0, 1) if kind == "brightness" else np.clip(factor * p + (1 - factor) * p.mean(), 0, 1)
        ha = np.bincount(np.rint(p * 255).astype(int).ravel(), minlength=256).tolist()
        hb = np.bincount(np.rint(q * 255).astype(int).ravel(), minlength=256).tolist()
        out.append(_hand_mi(ha, hb))
    return float(np.mean(out))


@pytest.mark.parametrize("kind", ["brightness", "contrast"])
def test_search_returns_the_first_factors_whose_mi_falls_below_the_target(kind):
    rng = np.random.default_rng(3)
    patches = np.clip(0.3 + 0.15 * rng.standard_normal((4, 24, 24)), 0, 1)
    self_mi = _mean_mi(patches, kind, 1.0)
    target = 0.7 * self_mi
    step = 0.05
    res = search_factor_range(patches, target, kind, step=step, max_factor=3.0)
    lo, hi = res["lo"], res["hi"]
    assert 0 < lo < 1 < hi < 3.0 and not res["lo_at_limit"] and not res["hi_at_limit"]
    # the bound hits the target: below it at the bound, at or above it one step closer to 1 (each side)
    assert _mean_mi(patches, kind, lo) < target <= _mean_mi(patches, kind, lo + step) or lo + step >= 1 - 1e-9
    assert _mean_mi(patches, kind, hi) < target <= _mean_mi(patches, kind, hi - step) or hi - step <= 1 + 1e-9
    assert res["lo_mi"] == pytest.approx(_mean_mi(patches, kind, lo)) and res["hi_mi"] == pytest.approx(
        _mean_mi(patches, kind, hi)
    )
    # every factor nearer to 1 than the bound keeps the MI at or above the target (first crossing)
    for f in np.arange(lo + step, 1.0 - 1e-9, step):
        assert _mean_mi(patches, kind, f) >= target
    # an unreachable target stops at the limits, flagged
    flat = search_factor_range(patches, -1.0, kind, step=0.25, min_factor=0.5, max_factor=1.5)
    assert (flat["lo"], flat["hi"], flat["lo_at_limit"], flat["hi_at_limit"]) == (0.5, 1.5, True, True)


def test_group_ranges_target_and_search_match_an_independent_computation(synthetic_setup):
    template, others, points, corr, point_entropy = synthetic_setup
    groups = information_groups(point_entropy)
    res = estimate_group_ranges(
        template, others, points, corr, point_entropy, patch_size=8, n_keypoints=1000, alpha_hat=0.9, step=0.05
    )
    for g, name in enumerate(("low", "medium", "high")):
        e = res[name]
        sel = np.flatnonzero((groups == g) & extract_patches(template, points, 8)[1])
        assert e["n_keypoints"] == len(sel) and e["n_pairs"] == 3 * len(sel)
        patches = extract_patches(template, points[sel], 8)[0]
        pairs = [
            _hand_mi(
                np.bincount(np.rint(patches[i] * 255).astype(int).ravel(), minlength=256).tolist(),
                np.bincount(
                    np.rint(extract_patches(o, c[sel], 8)[0][i] * 255).astype(int).ravel(), minlength=256
                ).tolist(),
            )
            for o, c in zip(others, corr)
            for i in range(len(sel))
        ]
        assert e["target_mi"] == pytest.approx(0.9 * np.mean(pairs), rel=1e-9)
        for kind in ("brightness", "contrast"):
            lo, hi = e[kind]
            assert lo < 1 < hi
            assert e[f"{kind}_mi"][0] == pytest.approx(_mean_mi(patches, kind, lo))
            if not e[f"{kind}_at_limit"][0]:
                assert _mean_mi(patches, kind, lo) < e["target_mi"]
    with pytest.raises(ValueError, match="alpha_hat"):
        estimate_group_ranges(template, others, points, corr, point_entropy, alpha_hat=0.0)


def test_information_groups_and_memberships():
    h = np.array([0.0, 1.99, 2.0, 3.99, 4.0, 6.0])
    np.testing.assert_array_equal(information_groups(h), [0, 0, 1, 1, 2, 2])
    hard = group_memberships(torch.tensor(h), (2.0, 4.0), 0.0)
    np.testing.assert_array_equal(hard.argmax(0).numpy(), information_groups(h))
    ramp = torch.linspace(0, 6, 601)
    m = group_memberships(ramp, (2.0, 4.0), 1.0)
    assert torch.all(m >= 0) and torch.allclose(m.sum(0), torch.ones(601, dtype=m.dtype))
    at = {float(v): m[:, i] for i, v in enumerate(ramp) if round(float(v), 2) in (1.5, 2.0, 2.5, 4.0)}
    assert at[1.5].tolist() == pytest.approx([1, 0, 0]) and at[2.0].tolist() == pytest.approx([0.5, 0.5, 0])
    assert at[2.5].tolist() == pytest.approx([0, 1, 0]) and at[4.0].tolist() == pytest.approx([0, 0.5, 0.5])
    with pytest.raises(ValueError, match="thresholds"):
        information_groups(h, (4.0, 2.0))
    with pytest.raises(ValueError, match="blend_width"):
        group_memberships(ramp, (2.0, 4.0), -1.0)


def test_adjust_brightness_contrast_formula():
    rng = np.random.default_rng(4)
    x = rng.random((2, 8, 9))
    out = adjust_brightness_contrast(torch.from_numpy(x), 1.3, 0.6).numpy()
    x1 = np.clip(1.3 * x, 0, 1)
    mean = x1.reshape(2, -1).mean(1)[:, None, None]  # per channel
    np.testing.assert_allclose(out, np.clip(0.6 * x1 + 0.4 * mean, 0, 1), atol=1e-12)


def test_patches_and_offset_correspondences():
    image = np.arange(100.0).reshape(10, 10)
    points = np.array([[4.4, 5.6], [1.0, 1.0], [np.nan, 3.0], [8.0, 8.0], [8.0, 9.0]])
    patches, valid = extract_patches(image, points, 4)
    assert patches.shape == (5, 4, 4) and valid.tolist() == [True, False, False, True, False]
    np.testing.assert_array_equal(patches[0], image[2:6, 4:8])
    np.testing.assert_array_equal(patches[3], image[6:10, 6:10])
    tmpl = np.array([[10.0, 20.0], [np.nan, np.nan]])
    others = np.array([[[13.0, 18.0], [5.0, 5.0]]])
    pts, corr, idx = offset_correspondences(tmpl, others, radius=2, stride=2)
    assert pts.shape == (18, 2) and corr.shape == (1, 18, 2) and idx.tolist() == [0] * 9 + [1] * 9
    np.testing.assert_array_equal(corr[0, :9] - pts[:9], np.tile([3.0, -2.0], (9, 1)))
    assert np.isnan(pts[9:]).all()


def test_script_image_orientation_and_entropy_at_points(tmp_path):
    script = estimate_augmentation
    datalist = write_png_datalist(tmp_path, n_images=1)
    img, _ = load_grey(str(tmp_path / "000.png"), 2)
    expected = np.asarray(Image.open(tmp_path / "000.png"), dtype=np.float64).T / 255.0
    np.testing.assert_allclose(img, expected, atol=1e-6)  # [x, y] indexing, scaled to [0, 1]
    points = np.array([[0.0, 0.0], [40.2, 17.7], [95.0, 50.0], [95.0, 95.0], [-3.0, 4.0]])
    full = local_entropy(img, 10, intensity_range=(0.0, 1.0)).numpy()
    got = script.entropy_at_points(img, points, 10)
    np.testing.assert_allclose(got[:4], [full[0, 0], full[40, 18], full[95, 50], full[95, 95]], atol=1e-5)
    assert np.isnan(got[4])
    with pytest.raises(ValueError, match="correspondences"):
        script.estimate(str(datalist), str(tmp_path / "x.yaml"), correspondences="optical flow")


def test_script_world_to_voxel_for_3d():
    script = estimate_augmentation
    affine = np.array([[2.0, 0, 0, -10], [0, 1.5, 0, 5], [0, 0, 3.0, 0], [0, 0, 0, 1]])
    world = np.array([[-10.0, 5.0, 0.0], [-6.0, 8.0, 9.0]])
    np.testing.assert_allclose(script.landmarks_to_array_axes(world, affine, 3), [[0, 0, 0], [2, 2, 3]])


# ---------------------------------------------------------------- command-line tool


def test_script_default_is_the_distribution_estimate_and_merges_into_training(tmp_path, capsys):
    from bundle.configs import bundle_parser

    script = estimate_augmentation
    datalist = write_png_datalist(tmp_path)
    out = tmp_path / "augmentation.yaml"
    script.estimate(
        str(datalist),
        str(out),
        n_images=3,
        patch_size=16,
        image_size=None,
        radius=8,
        stride=8,
        n_keypoints=10,
        step=0.1,
    )
    aug = yaml.safe_load(out.read_text())["augmentation"]
    assert aug["mi"] == "distribution" and "brightness" not in aug and aug["source"]["patch_size"] == 16
    for kind in ("brightness_ranges", "contrast_ranges"):
        assert len(aug[kind]) == 3 and all(lo < 1 < hi for lo, hi in aug[kind])
    assert "brightness [lo, hi]" in capsys.readouterr().out
    parser = bundle_parser(["configs/train.yaml", str(out)])
    transform = parser.get_parsed_content("train#crop_augmentation")
    np.testing.assert_allclose(transform.brightness_ranges, aug["brightness_ranges"])
    np.testing.assert_allclose(transform.contrast_ranges, aug["contrast_ranges"])
    assert transform.group_mode == "pixel" and transform.thresholds == (2.0, 4.0)
    # the earlier estimator, an experiment, writes the symmetric intensities through the same writer
    joint_mi.estimate(
        str(datalist), str(tmp_path / "joint.yaml"), n_images=3, patch_size=8, radius=8, stride=8, step=0.1
    )
    joint = yaml.safe_load((tmp_path / "joint.yaml").read_text())["augmentation"]
    assert joint["mi"] == "joint" and len(joint["brightness"]) == 3 and "brightness_ranges" not in joint
    with pytest.raises(ValueError, match="ckpt_path"):
        script.estimate(str(datalist), str(tmp_path / "x.yaml"), correspondences="encoder")


@pytest.mark.parametrize("mi", ["distribution", "joint"])
def test_a_group_without_key_points_takes_a_neighbours_estimate_so_the_yaml_trains(tmp_path, mi):
    """Thresholds below every key point's IIE leave the low and medium groups empty: both estimators fill them from
    the high group (``filled_from``) instead of writing null, and the YAML instantiates the training's transform."""
    from bundle.configs import bundle_parser

    out = tmp_path / "augmentation.yaml"
    estimator = estimate_augmentation if mi == "distribution" else joint_mi
    estimator.estimate(
        str(write_png_datalist(tmp_path)),
        str(out),
        thresholds=(1e-6, 2e-6),
        n_images=3,
        patch_size=8,
        radius=8,
        stride=8,
        step=0.1,
    )
    aug = yaml.safe_load(out.read_text())["augmentation"]
    assert [aug["groups"][g].get("filled_from") for g in ("low", "medium", "high")] == ["high", "high", None]
    kinds = ("brightness_ranges", "contrast_ranges") if mi == "distribution" else ("brightness", "contrast")
    for kind in kinds:
        assert aug[kind][0] == aug[kind][1] == aug[kind][2] is not None
    transform = bundle_parser(["configs/train.yaml", str(out)]).get_parsed_content("train#crop_augmentation")
    assert transform.thresholds == (1e-6, 2e-6)


def test_authors_ranges_config_merges():
    from bundle.configs import bundle_parser

    transform = bundle_parser(["configs/train.yaml", "configs/authors_ranges.yaml"]).get_parsed_content(
        "train#crop_augmentation"
    )
    assert transform.group_mode == "query" and transform.thresholds == (3.5, 4.5)
    np.testing.assert_allclose(transform.brightness_ranges[1], [0.505, 1.997])
    np.testing.assert_allclose(transform.contrast_ranges[2], [0.416, 1.817])
    np.testing.assert_allclose(transform.contrast_ranges[0], transform.contrast_ranges[2])  # "otherwise high"
    baseline = bundle_parser(["configs/train.yaml", "configs/authors_ranges.yaml"], adaptive_augmentation=False)
    plain = baseline.get_parsed_content("train#crop_augmentation")
    assert plain.group_mode == "pixel" and plain.brightness == (0.15,) * 3


def test_encoder_correspondences_need_no_labels_and_find_identical_images(tmp_path):
    from bundle.configs import bundle_parser

    script = estimate_augmentation
    torch.manual_seed(0)
    network = bundle_parser("configs/train.yaml", image_size=[96, 96]).get_parsed_content("network_def")
    ckpt = tmp_path / "model.pt"
    torch.save(network.state_dict(), ckpt)
    rng = np.random.default_rng(7)
    image = three_region_image(rng)
    points = np.array([[20.0, 30.0], [50.0, 40.0], [75.0, 70.0], [np.nan, np.nan]])
    (tmp_path / "cfg.yaml").write_text("image_size: [96, 96]\n")
    corr = script.encoder_correspondences(
        image, points, [image, image], str(ckpt), ["configs/train.yaml", str(tmp_path / "cfg.yaml")]
    )
    assert corr.shape == (2, 4, 2) and np.isnan(corr[:, 3]).all()
    np.testing.assert_allclose(
        corr[:, :3], np.broadcast_to(points[:3], (2, 3, 2)), atol=1.0
    )  # the same image: the same points
    # the script: only the template needs landmarks
    datalist = write_png_datalist(tmp_path, n_images=3, labelled=False)
    out = tmp_path / "enc.yaml"
    script.estimate(
        str(datalist),
        str(out),
        correspondences="encoder",
        ckpt_path=str(ckpt),
        config_file=["configs/train.yaml", str(tmp_path / "cfg.yaml")],
        n_images=2,
        patch_size=16,
        image_size=None,
        radius=8,
        stride=8,
        step=0.1,
    )
    aug = yaml.safe_load(out.read_text())["augmentation"]
    assert aug["source"]["correspondences"] == "encoder" and aug["source"]["n_images"] == 2
    assert all(lo <= 1 <= hi for lo, hi in aug["brightness_ranges"])
