"""Stage 2 (CC2D's second stage) and fine-tuning: heatmap targets, joint augmentation, masked loss, encoder
initialisation, the heatmap inferer, and a tiny pseudo-label training + evaluation through monai.bundle.run."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle.checkpoints import load_weights
from bundle.data.datalist import load_datalist
from bundle.data.synthetic import generate_synthetic_2d
from bundle.inferers.heatmap import HeatmapInferer
from bundle.losses.heatmap import MaskedHeatmapLoss
from bundle.networks.contrastive import ContrastiveLandmarkNet
from bundle.networks.detector import HeatmapDetector, load_stage1_encoder
from bundle.networks.matching import refine_peaks
from bundle.networks.xfeat import available as xfeat_available
from bundle.pipeline.choice import default_detectors
from bundle.pipeline.detector_data import (
    detector_grid,
    detector_templates,
    finetune_grid,
    follow_grid,
    load_detector,
    pseudo_label_templates,
    pseudo_labelled_items,
    read_pseudo_labels,
    write_detector_info,
)
from bundle.reporting import SUMMARY_KEYS
from bundle.transforms.heatmaps import GaussianHeatmapd, render_gaussian_heatmaps
from monai.bundle import ConfigParser, run
from monai.data import MetaTensor
from monai.transforms import RandAffined

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "image_size": [64, 64],
    "crop_size": [32, 32],
    "num_queries": 8,
    "batch_size": 4,
    "progress_bar": False,
    "seed": 0,
}


def _item(points: np.ndarray, size=(48, 56)) -> dict:
    """An item as LandmarkTargetsd leaves it, with grid = physical (identity grid_to_physical)."""
    image = MetaTensor(torch.rand(1, *size))
    return {
        "image": image,
        "label": torch.as_tensor(points, dtype=torch.float32),
        "grid_to_physical": torch.eye(3, dtype=torch.float64),
    }


def test_heatmap_peak_is_at_the_landmark_subpixel():
    points = np.array([[10.3, 20.6], [30.0, 7.25], [np.nan, np.nan]])
    d = GaussianHeatmapd("image", sigma=2.0)(_item(points))
    heatmap, mask = d["heatmap"], d["landmark_mask"]
    assert heatmap.shape == (3, 48, 56) and mask.tolist() == [1.0, 1.0, 0.0]
    assert float(heatmap[2].abs().max()) == 0.0
    # analytic values: exp(-|x - p|^2 / (2 sigma^2)) at pixel centres
    assert float(heatmap[0, 10, 21]) == pytest.approx(math.exp(-(0.3**2 + 0.4**2) / 8.0), abs=1e-6)
    assert float(heatmap[1, 30, 7]) == pytest.approx(math.exp(-(0.25**2) / 8.0), abs=1e-6)
    # a parabola through the log-heatmap is exact; through the heatmap itself close
    exact, _ = refine_peaks(torch.log(heatmap[None, :2].clamp_min(1e-30)), step=1)
    assert torch.allclose(exact[0], torch.as_tensor(points[:2]), atol=1e-4)
    approx, _ = refine_peaks(heatmap[None, :2], step=1)
    assert torch.allclose(approx[0], torch.as_tensor(points[:2]), atol=0.1)


def test_rand_affine_keeps_the_heatmap_peak_at_the_transformed_landmark():
    points = np.array([[20.4, 25.7], [30.2, 18.9]])
    d = GaussianHeatmapd("image", sigma=2.5)(_item(points, size=(56, 56)))
    affine = RandAffined(
        ["image", "heatmap"],
        prob=1.0,
        rotate_range=0.4,
        scale_range=(0.15, 0.15),
        translate_range=(4, 4),
        mode=["bilinear", "bilinear"],
        padding_mode="zeros",
    )
    affine.set_random_state(3)
    out = affine(d)
    # the heatmap keeps the image's metadata and follows the same transform
    assert torch.allclose(out["heatmap"].affine, out["image"].affine)
    matrix = out["heatmap"].affine.double()
    matrix = matrix[[0, 1, -1]][:, [0, 1, -1]]  # the 2D part of MONAI's (4, 4) affine
    assert not torch.allclose(matrix, torch.eye(3, dtype=matrix.dtype))
    # a landmark at index p (identity affine before) is at index inv(A_out) p after the transform
    moved = (torch.linalg.inv(matrix) @ torch.cat([torch.as_tensor(points), torch.ones(2, 1)], 1).T).T[:, :2]
    found, _ = refine_peaks(torch.log(out["heatmap"].as_tensor()[None].clamp_min(1e-30)), step=1)
    assert torch.allclose(found[0], moved, atol=0.25), (found, moved)


def test_masked_loss_ignores_missing_landmarks():
    torch.manual_seed(0)
    target, _ = render_gaussian_heatmaps(torch.tensor([[5.0, 6.0], [9.0, 3.0], [2.0, 2.0]]), (16, 16), 2.0)
    target = target[None].repeat(2, 1, 1, 1)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for kind in ("bce", "mse"):
        loss = MaskedHeatmapLoss(kind, pos_weight=10.0)
        pred = torch.randn(2, 3, 16, 16, requires_grad=True)
        value = loss(pred, (target, mask))
        value.backward()
        value = value.detach()
        assert float(pred.grad[:, 1].abs().max()) == 0.0 and float(pred.grad[1, 2].abs().max()) == 0.0
        changed = pred.detach().clone()
        changed[:, 1] += 100.0
        changed[1, 2] -= 50.0
        assert float(loss(changed, (target, mask))) == pytest.approx(float(value), rel=1e-6)
        # equals the mean over the valid channels
        valid = [
            loss(pred[b : b + 1, c : c + 1].detach(), target[b : b + 1, c : c + 1]) for b, c in ((0, 0), (0, 2), (1, 0))
        ]
        assert float(value) == pytest.approx(float(sum(valid)) / 3, rel=1e-5)


def test_detector_encoder_loads_the_stage1_weights(tmp_path):
    torch.manual_seed(1)
    stage1 = ContrastiveLandmarkNet(spatial_dims=2)
    torch.save(stage1.state_dict(), tmp_path / "model.pt")
    detector = load_stage1_encoder(HeatmapDetector(spatial_dims=2, n_landmarks=5), tmp_path / "model.pt")
    reference = stage1.image_encoder.state_dict()
    loaded = detector.image_encoder.state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    random = HeatmapDetector(spatial_dims=2, n_landmarks=5)
    assert not all(torch.equal(random.image_encoder.state_dict()[k], reference[k]) for k in reference)
    out = detector.eval()(torch.rand(2, 1, 32, 48))
    assert out.shape == (2, 5, 32, 48)
    torch.save({"something": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match="image_encoder"):
        load_stage1_encoder(HeatmapDetector(spatial_dims=2, n_landmarks=5), tmp_path / "other.pt")


def test_heatmap_inferer_returns_physical_landmarks():
    points = torch.tensor([[[4.2, 9.7], [12.5, 3.1]]], dtype=torch.float64)
    maps, _ = render_gaussian_heatmaps(points[0], (20, 16), 1.5)
    logits = torch.logit(maps.clamp(1e-6, 1 - 1e-6))[None]
    matrix = torch.tensor([[0.5, 0.0, 1.0], [0.0, 0.25, -2.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    found = HeatmapInferer()(torch.zeros(1, 1, 20, 16), lambda x: logits, grid_to_physical=matrix[None])
    assert found.shape == (1, 2, 2) and found.dtype == torch.float64
    expected = points @ matrix[:2, :2].T + matrix[:2, 2]
    assert torch.allclose(found, expected, atol=0.06)


def test_shift_tta_moves_the_input_and_brings_each_run_back():
    """``shift_tta``: each run's input is moved by its offset (zeros where it left), its peaks moved back, so a
    network that follows its input finds the same landmarks in every run; a whole number of pixels is required."""
    from bundle.inferers.heatmap import _shifted

    points = torch.tensor([[4.2, 9.7], [12.5, 3.1]], dtype=torch.float64)
    maps, _ = render_gaussian_heatmaps(points, (20, 16), 1.5)
    image = maps[None].float()  # (1, 2, 20, 16): the "network" below returns its input as the heatmaps
    moved = _shifted(image.clone(), [2, -3])
    assert torch.equal(moved[..., 2:, :13], image[..., :18, 3:]) and not moved[..., :2, :].any()
    assert not moved[..., -3:].any()
    inferer = HeatmapInferer(activation=None, shift_tta=2)
    assert inferer._offsets(2) == [[0, 0], [2, 0], [-2, 0], [0, 2], [0, -2]]
    for offset in inferer._offsets(2):  # every run, not only their mean, lands on the landmarks
        run = inferer._peaks(_shifted(image.clone(), offset), lambda x: x)[0] - torch.tensor(
            offset, dtype=torch.float64
        )
        torch.testing.assert_close(run[0], points, atol=0.06, rtol=0)
    torch.testing.assert_close(inferer(image, lambda x: x)[0], points, atol=0.06, rtol=0)
    one_way = HeatmapInferer(activation=None, shift_tta=2)
    one_way._offsets = lambda spatial_dims: [[0, 0], [2, -3]]  # not symmetric: each run must be moved back itself
    torch.testing.assert_close(one_way(image, lambda x: x)[0], points, atol=0.06, rtol=0)
    with pytest.raises(ValueError, match="shift_tta must be a whole number of grid pixels >= 0"):
        HeatmapInferer(shift_tta=1.5)


def test_finetune_config_uses_the_first_labelled_training_items(tmp_path):
    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=10, n_validation=1, n_test=1, seed=5)
    parser = ConfigParser()
    parser.read_config([str(ROOT / f"configs/{c}.yaml") for c in ("train", "train_stage2", "finetune")])
    parser.update({"bundle_root": str(ROOT), "datalist": str(datalist_path), "n_labelled": 2})
    items = parser.get_parsed_content("stage2#items")
    labelled = [it for it in load_datalist(datalist_path)["training"] if it.get("landmarks")]
    assert [it["image"] for it in items] == [it["image"] for it in labelled[:2]]
    assert parser.get_parsed_content("stage2#templates") == []
    assert parser.get_parsed_content("ckpt_dir").endswith("models/finetune")
    assert parser.get_parsed_content("init_weights") is None  # the shipped detectors are for other landmarks


@pytest.mark.parametrize(
    "overrides, grid, sigma, translate",
    [
        ({"n_labelled": 9}, [192, 192], 2.0, 8.0),  # below FINE_GRID_LABELS (10): train.yaml's grid
        ({"n_labelled": 10}, [288, 288], 3.0, 12.0),  # from there on 1.5 times finer
        ({"n_labelled": 2, "detector_grid": [384, 384]}, [384, 384], 4.0, 16.0),  # a given grid: the lengths follow it
        ({"n_labelled": 10, "image_size": [128, 128]}, [192, 192], 3.0, 12.0),  # the rule from another network grid
    ],
)
def test_finetune_grid_grows_with_the_labels_and_the_lengths_in_grid_pixels_follow(
    tmp_path, overrides, grid, sigma, translate
):
    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=10, n_validation=1, n_test=1, seed=5)
    parser = ConfigParser()
    parser.read_config([str(ROOT / f"configs/{c}.yaml") for c in ("train", "train_stage2", "finetune")])
    parser.update({"bundle_root": str(ROOT), "datalist": str(datalist_path), **overrides})
    assert parser.get_parsed_content("detector_grid") == grid
    transforms = {type(t).__name__: t for t in parser.get_parsed_content("stage2#transforms")}
    assert list(transforms["Resized"].resizer.spatial_size) == grid
    assert transforms["GaussianHeatmapd"].sigma == sigma
    translate_range = transforms["RandIsotropicAffined"].rand_affine.rand_affine_grid.translate_range
    assert list(translate_range) == [translate] * 2  # RandAffine: uniform in (-t, t) along each axis
    resize = parser.get_parsed_content("validate#resize")  # the detector's validation runs on its grid
    assert list(resize.resizer.spatial_size) == grid
    assert parser.get_parsed_content("ckpt_record")["content"]["image_size"] == grid  # detector_info.json's grid


def test_finetune_grid_in_3d_stays_train_3d_s_whatever_the_labels():
    assert finetune_grid(1000, [64, 64, 64], 3) == [64, 64, 64]
    assert follow_grid(2.0, [64, 64, 64], [64, 64, 64]) == 2.0
    assert follow_grid(8.0, [128, 128, 128], [64, 64, 64]) == 16.0  # a given grid: the lengths follow it


def test_evaluation_grid_is_the_one_recorded_beside_the_detector(tmp_path):
    items = [{"image": f"/data/{i}.png"} for i in range(10)]
    write_detector_info(tmp_path / "recorded", [], "human", items, [288, 288], ["a"], {"spatial_dims": 2})
    assert detector_grid(tmp_path / "recorded" / "model.pt") == [288, 288]
    assert detector_grid(tmp_path / "none" / "model.pt") is None  # no record: the pipeline's own grid


@pytest.mark.parametrize(
    "random_init, expected", [("true", None), ("false", "stage1"), (True, None), ("maybe", ValueError)]
)
def test_random_init_as_the_command_line_gives_it(random_init, expected):
    """``--random_init true`` reaches the config as the string 'true' (and ``--init_checkpoint None`` not at all)."""
    parser = ConfigParser()
    parser.read_config([str(ROOT / f"configs/{c}.yaml") for c in ("train", "train_stage2", "finetune")])
    parser.update({"bundle_root": str(ROOT), "random_init": random_init})
    if expected is ValueError:
        with pytest.raises(RuntimeError) as info:  # MONAI's config wraps the error; the cause names the key
            parser.get_parsed_content("encoder_checkpoint")
        assert "random_init: expected true or false (yes/no, 1/0, any case), got 'maybe'" in str(info.value.__cause__)
        return
    init = parser.get_parsed_content("encoder_checkpoint")
    assert init == (None if expected is None else parser.get_parsed_content("ckpt_path"))


def test_shipped_detector_loads_into_the_configured_network_and_names_its_templates():
    """models/stage2 (the one-label stage-2 detector of the model card) fits the default 2D configuration."""
    parser = ConfigParser()
    parser.read_config([str(ROOT / f"configs/{c}.yaml") for c in ("train", "train_stage2")])
    parser.update({"bundle_root": str(ROOT), "network_def#n_landmarks": 19})  # the 19 cephalometric landmarks
    ckpt = ROOT / "models" / "stage2" / "model.pt"
    assert str(ckpt) in default_detectors(ROOT)  # a candidate of pipeline auto
    detector = parser.get_parsed_content("network_def")
    load_weights(detector, ckpt)  # strict: every weight of the detector, nothing else
    assert detector.n_landmarks == 19
    assert [Path(t).name for t in detector_templates(ckpt)][:1] == ["046.png"]


def test_reused_pseudo_labels_drop_the_landmarks_past_the_cycle_tolerance(tmp_path):
    path = tmp_path / "pseudo_labels.json"
    items = [
        {"image": "t.png", "landmarks": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]},
        {"image": "a.png", "landmarks": [[1.5, 2.5], [3.5, 4.5], [5.5, 6.5]]},
    ]
    record = {"templates": ["t.png"], "cycle_tolerance": None, "cycle_error": {"a.png": [0.5, 2.5, None]}}
    path.write_text(json.dumps({"training": items, "pseudo_labels": record}))
    assert read_pseudo_labels(path) == items
    assert pseudo_label_templates(path) == items[:1]
    template, pseudo = read_pseudo_labels(path, cycle_tolerance=2.0)
    assert template == items[0]  # a template keeps its landmarks
    assert pseudo["landmarks"] == [[1.5, 2.5], None, None]  # past the tolerance; no cycle error (no match back)
    assert read_pseudo_labels(path, cycle_tolerance=3.0)[1]["landmarks"] == [[1.5, 2.5], [3.5, 4.5], None]
    path.write_text(json.dumps({"training": items, "pseudo_labels": {**record, "cycle_tolerance": 1.0}}))
    assert read_pseudo_labels(path, cycle_tolerance=1.0)[1]["landmarks"] == [[1.5, 2.5], None, None]  # as strict
    with pytest.raises(ValueError, match=r"pseudo_labels.json was written with pseudo_label_tolerance 1.0"):
        read_pseudo_labels(path, cycle_tolerance=2.0)
    short = {**record, "cycle_error": {"a.png": [0.5, 2.5]}}
    path.write_text(json.dumps({"training": items, "pseudo_labels": short}))
    with pytest.raises(ValueError, match=r"a.png has 3 landmarks but 2 cycle errors"):
        read_pseudo_labels(path, cycle_tolerance=2.0)
    path.write_text(json.dumps({"training": items, "pseudo_labels": {"cycle_tolerance": None}}))
    with pytest.raises(ValueError, match=r"pseudo_labels.json: no list of template images under"):
        pseudo_label_templates(path)
    for text in ("[]", json.dumps({"training": items})):
        path.write_text(text)
        for read in (read_pseudo_labels, pseudo_label_templates):
            with pytest.raises(ValueError, match=r"pseudo_labels.json is not a pseudo-label datalist"):
                read(path)


XFEAT = xfeat_available()


def test_the_refinement_moves_every_pseudo_label_the_pseudo_templates_too_not_the_human_ones(monkeypatch):
    """Stage 2's training labels: the human template's as labelled, each pseudo-labelled image's and each
    pseudo-template's refined (the latter once matching has used them as templates), each at the spacing the pipeline
    read."""
    import bundle.pipeline.detector_data as detector_data

    human = {"image": "h.png", "landmarks": [[1.0, 2.0], [3.0, 4.0]]}
    pseudo_template = {"image": "p.png", "landmarks": [[5.0, 6.0], None], "pseudo_label": True}
    unlabelled = {"image": "u.png"}
    datalist = {"training": [human, pseudo_template, unlabelled], "validation": [], "test": []}
    matched = []
    monkeypatch.setattr(detector_data, "with_templates", lambda inferer, items, *a: matched.extend(items) or inferer)
    monkeypatch.setattr(
        detector_data,
        "pseudo_label",
        lambda network, inferer, pool, *a: [
            {"item": {**it, "landmarks": [[7.0, 8.0], [9.0, 10.0]]}, "cycle_error": np.zeros(2), "spacing": [0.1, 0.1]}
            for it in pool
        ],
    )

    class Shift:
        calls = []

        def refine_item(self, item, spacing):
            self.calls.append((item["image"], list(spacing)))
            moved = [None if p is None else [p[0] + 1.0, p[1]] for p in item["landmarks"]]
            return {**item, "landmarks": moved}

        def settings(self):
            return {}

    items = pseudo_labelled_items(
        datalist, None, [human, pseudo_template], lambda it: {"spacing": [0.5, 0.5]}, "cpu", refinement=Shift()
    )
    assert [it["image"] for it in matched] == ["h.png", "p.png"]  # matching used the pseudo-template as given
    assert matched[1]["landmarks"] == [[5.0, 6.0], None]
    assert items[0] == human
    assert items[1]["landmarks"] == [[6.0, 6.0], None] and items[1]["pseudo_label"] is True
    assert items[2]["landmarks"] == [[8.0, 8.0], [10.0, 10.0]]
    assert sorted(Shift.calls) == [("p.png", [0.5, 0.5]), ("u.png", [0.1, 0.1])]


@pytest.mark.slow
def test_tiny_stage2_training_and_evaluation_beat_chance(tmp_path):
    from tests.test_end_to_end import chance_mre_mm

    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=8, n_validation=1, n_test=2, seed=3)
    datalist = load_datalist(datalist_path)
    common = dict(bundle_root=str(ROOT), datalist=str(datalist_path), **TINY)
    run(
        "training",
        config_file=str(ROOT / "configs/train.yaml"),
        output_dir=str(tmp_path / "t1"),
        ckpt_dir=str(tmp_path / "m1"),
        epochs=2,
        epoch_length=15,
        val_interval=2,
        **common,
    )
    stage2 = [str(ROOT / f"configs/{c}.yaml") for c in ("train", "train_stage2")]
    run(
        "training",
        config_file=stage2,
        output_dir=str(tmp_path / "t2"),
        ckpt_dir=str(tmp_path / "m2"),
        ckpt_path=str(tmp_path / "m1" / "model.pt"),
        epochs=4,
        epoch_length=15,
        val_interval=4,
        **common,
    )
    assert (tmp_path / "m2" / "model.pt").is_file() and (tmp_path / "m2" / "model_final.pt").is_file()
    pseudo = json.loads((tmp_path / "t2" / "pseudo_labels.json").read_text())
    held_out = {it["image"] for it in datalist["validation"] + datalist["test"]}
    templates = set(pseudo["pseudo_labels"]["templates"])
    expected = templates | {it["image"] for it in datalist["training"] if it["image"] not in held_out}
    assert {it["image"] for it in pseudo["training"]} == expected and len(pseudo["training"]) == len(expected)
    assert not held_out & {it["image"] for it in pseudo["training"]}
    assert set(pseudo["pseudo_labels"]["cycle_error"]) == {it["image"] for it in pseudo["training"]} - set(
        pseudo["pseudo_labels"]["templates"]
    )
    # the pseudo-labels are refined by XFeat from the human-labelled template (xfeat_refinement auto, the wheel here)
    refined = pseudo["pseudo_labels"]["xfeat_refinement"]
    assert refined is None if not XFEAT else refined["templates"] == [datalist["template"]["image"]]

    # a fine-tuning on two human labels, one of them the stage-2 detector's template, continues that detector
    stage2_record = json.loads((tmp_path / "m2" / "detector_info.json").read_text())
    assert stage2_record["init_weights"] is None and stage2_record["checkpoints"] == ["model.pt", "model_final.pt"]
    two_labels = tmp_path / "two_labels.json"
    two_labels.write_text(json.dumps({**datalist, "training": [datalist["template"]] + datalist["training"]}))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what the key must change, whatever an earlier training left
    try:
        run(
            "training",
            config_file=stage2 + [str(ROOT / "configs/finetune.yaml")],
            output_dir=str(tmp_path / "t3"),
            ckpt_dir=str(tmp_path / "m3"),
            detectors=[str(tmp_path / "m2" / "model.pt")],
            n_labelled=2,
            epochs=1,
            epoch_length=2,
            val_interval=2,
            **dict(common, datalist=str(two_labels), cpu_threads=1),
        )
        assert torch.get_num_threads() == 1  # stage 2 and fine-tuning read cpu_threads too (they once did not)
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "m3" / "detector_info.json").read_text())
    assert record["init_weights"] == os.path.realpath(tmp_path / "m2" / "model.pt") and record["n_labelled"] == 2
    assert record["checkpoints"] == ["model.pt", "model_final.pt"]  # no validation ran: model.pt is the final weights

    out = tmp_path / "eval"
    run(  # no image_size given: the detector's own grid, read from detector_info.json
        "evaluating",
        config_file=[str(ROOT / f"configs/{c}.yaml") for c in ("train", "evaluate")],
        output_dir=str(out),
        pipeline="detector",
        detectors=str(tmp_path / "m2" / "model.pt"),
        **{k: v for k, v in common.items() if k != "image_size"},
    )
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (*SUMMARY_KEYS, "template", "checkpoint"):
        assert key in metrics
    assert metrics["n_images"] == 2 and metrics["template"] == pseudo["pseudo_labels"]["templates"][0]
    assert metrics["pipeline"] == "detector"
    with open(out / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(datalist["landmark_names"])
    chance = chance_mre_mm(datalist, (256, 288))
    assert metrics["mre_mm"] < chance / 4, (metrics["mre_mm"], chance)

    # the default evaluation (no detector config merged) takes this detector: it learnt from as many labelled
    # images (the one template) as matching would use; `pipeline templates` forces matching
    evaluation = [str(ROOT / f"configs/{c}.yaml") for c in ("train", "evaluate")]
    detectors = [str(tmp_path / "m2" / "model.pt")]
    for pipeline, out_auto in (("auto", tmp_path / "eval_auto"), ("templates", tmp_path / "eval_templates")):
        run(
            "evaluating",
            config_file=evaluation,
            output_dir=str(out_auto),
            ckpt_path=str(tmp_path / "m1" / "model.pt"),
            detectors=detectors,
            pipeline=pipeline,
            **common,
        )
    auto = json.loads((tmp_path / "eval_auto" / "metrics.json").read_text())
    assert auto["pipeline"] == "detector" and auto["checkpoint"] == detectors[0]
    assert auto["mre_mm"] == pytest.approx(metrics["mre_mm"], rel=1e-6)
    matching = json.loads((tmp_path / "eval_templates" / "metrics.json").read_text())
    assert matching["pipeline"] == "templates" and matching["checkpoint"] == str(tmp_path / "m1" / "model.pt")
    # inferring on new images too: its provenance names the detector, its points are the evaluation's
    run(
        "inferring",
        config_file=str(ROOT / "configs/inference.yaml"),
        output_dir=str(tmp_path / "infer"),
        datalist=str(datalist_path),
        images=[it["image"] for it in datalist["test"]],
        detectors=detectors,
        ckpt_path=str(tmp_path / "m1" / "model.pt"),
        template_cache=None,
        bundle_root=str(ROOT),
        **{k: TINY[k] for k in ("image_size", "seed")},
    )
    provenance = json.loads((tmp_path / "infer" / "provenance.json").read_text())
    assert provenance["pipeline"] == "detector" and provenance["checkpoint"] == detectors[0]
    with open(tmp_path / "infer" / "predictions.csv") as f:
        inferred = list(csv.DictReader(f))
    assert [(r["x"], r["y"]) for r in inferred] == [(r["x"], r["y"]) for r in rows]
    assert provenance["xfeat_refinement"] is None  # auto: not after a detector trained on pseudo-labels
    if XFEAT:  # asked for, evaluating and inferring run the fine step and say so
        for command, config, out_fine in (
            ("evaluating", evaluation, tmp_path / "eval_fine"),
            ("inferring", [str(ROOT / "configs/inference.yaml")], tmp_path / "infer_fine"),
        ):
            images = {} if command == "evaluating" else {"images": [it["image"] for it in datalist["test"]]}
            run(
                command,
                config_file=config,
                output_dir=str(out_fine),
                ckpt_path=str(tmp_path / "m1" / "model.pt"),
                detectors=detectors,
                xfeat_refinement="true",
                template_cache=None,
                **images,
                **common,
            )
        fine = json.loads((tmp_path / "eval_fine" / "metrics.json").read_text())["xfeat_refinement"]
        assert fine["templates"] == [datalist["template"]["image"]] and fine["radius_mm"] == 1.0
        assert json.loads((tmp_path / "infer_fine" / "provenance.json").read_text())["xfeat_refinement"] == fine
        with open(tmp_path / "eval_fine" / "predictions.csv") as f:
            moved = [(r["x"], r["y"]) for r in csv.DictReader(f)]
        assert len(moved) == len(rows) and moved != [(r["x"], r["y"]) for r in rows]

    # the training grid is recorded beside the checkpoint; loading the detector on another grid is refused naming both
    info = tmp_path / "m2" / "detector_info.json"
    assert json.loads(info.read_text())["image_size"] == TINY["image_size"]
    other = [2 * v for v in TINY["image_size"]]
    with pytest.raises(ValueError, match=re.escape(f"was trained on the grid {TINY['image_size']} ({info})")):
        load_detector(tmp_path / "m2" / "model.pt", "cpu", other, 2, 2, "light", 32, [16, 8, 4, 2])
