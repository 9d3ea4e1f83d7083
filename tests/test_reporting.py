"""Report writers (bundle/reporting.py) and the report handler (bundle/handlers/report.py), read back."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bundle.handlers.report import LandmarkReportHandler
from bundle.reporting import (
    overlay_figure,
    read_predictions_csv,
    run_provenance,
    save_overlay_png,
    save_sdr_curve,
    write_metrics_json,
    write_predictions_csv,
)
from ignite.engine import Engine
from matplotlib.image import imread
from monai.data import MetaTensor
from PIL import Image

NAN = float("nan")
NAMES = ["sella", "nasion"]


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _colour_fraction(png: np.ndarray, rgb: tuple[float, float, float], tol: float = 0.15) -> float:
    return float((np.abs(png[..., :3] - np.asarray(rgb)) < tol).all(-1).mean())


def test_write_metrics_json_round_trip(tmp_path):
    summary = {
        "n_images": 2,
        "n_landmarks": 2,
        "mre_mm": 1.5,
        "mre_std_mm": 0.5,
        "mre_px": 12.0,
        "sdr": {"2.0": 75.0},
        "per_landmark_mre_mm": {"sella": 1.0, "nasion": None},
        "per_landmark_offset_mm": {"sella": [0.5, -1.0], "nasion": None},
        "mre_offset_removed_mm": 1.25,
    }
    provenance = run_provenance("templates", "t.png", "m.pt")
    path = write_metrics_json(tmp_path / "out" / "metrics.json", summary, provenance)
    assert json.loads(path.read_text()) == {
        **summary,
        "pipeline": "templates",
        "template": "t.png",
        "checkpoint": "m.pt",
        "xfeat_refinement": None,
    }
    with pytest.raises(KeyError, match="mre_px"):
        write_metrics_json(tmp_path / "bad.json", {k: v for k, v in summary.items() if k != "mre_px"}, provenance)
    assert not (tmp_path / "bad.json").exists()


def test_run_provenance_templates_pseudo_templates_and_pipeline():
    kshot = run_provenance("templates", ["a.png", "b.png", "c.png"], "m.pt", pseudo_templates=["c.png"])
    assert kshot == {
        "pipeline": "templates",
        "template": "a.png",
        "templates": ["a.png", "b.png", "c.png"],
        "pseudo_templates": ["c.png"],
        "checkpoint": "m.pt",
        "xfeat_refinement": None,
    }
    # a detector trained on human labels has no template; the fine step after it is said
    fine = {"network": "xfeat", "templates": ["a.png"], "radius_mm": 1.0, "step_px": 2.0}
    assert run_provenance("detector", "", "d.pt", refinement=fine) == {
        "pipeline": "detector",
        "template": "",
        "checkpoint": "d.pt",
        "xfeat_refinement": fine,
    }
    with pytest.raises(ValueError, match="'matching'"):
        run_provenance("matching", "a.png", "m.pt")


def test_write_predictions_csv_2d_3d_and_missing(tmp_path):
    rows = [
        {"image": "a.png", "landmark": "sella", "point": [10.25, 20.5], "error_mm": 0.854},
        {"image": "a.png", "landmark": "nasion", "point": [NAN, NAN], "error_mm": NAN},
        {"image": "b.png", "landmark": "sella", "point": np.array([1.0, 2.0]), "error_mm": None},
    ]
    table = _read_csv(write_predictions_csv(tmp_path / "p.csv", rows))
    assert table[0] == ["image", "landmark", "x", "y", "error_mm"]
    assert table[1] == ["a.png", "sella", "10.250000", "20.500000", "0.854000"]
    assert table[2] == ["a.png", "nasion", "", "", ""]
    assert table[3] == ["b.png", "sella", "1.000000", "2.000000", ""]
    table3 = _read_csv(
        write_predictions_csv(
            tmp_path / "p3.csv", [{"image": "v.nii.gz", "landmark": "l", "point": [-1.5, 2, 3], "error_mm": 1}]
        )
    )
    assert table3 == [
        ["image", "landmark", "x", "y", "z", "error_mm"],
        ["v.nii.gz", "l", "-1.500000", "2.000000", "3.000000", "1.000000"],
    ]
    back = read_predictions_csv(tmp_path / "p.csv")
    assert [(r["image"], r["landmark"]) for r in back] == [("a.png", "sella"), ("a.png", "nasion"), ("b.png", "sella")]
    np.testing.assert_allclose(back[0]["point"], [10.25, 20.5])
    assert back[0]["error_mm"] == pytest.approx(0.854)
    assert np.isnan(back[1]["point"]).all() and np.isnan(back[1]["error_mm"]) and np.isnan(back[2]["error_mm"])
    np.testing.assert_allclose(read_predictions_csv(tmp_path / "p3.csv")[0]["point"], [-1.5, 2.0, 3.0])
    with pytest.raises(ValueError, match="row 1"):
        write_predictions_csv(tmp_path / "bad.csv", [rows[0], {**rows[0], "point": [1.0, 2.0, 3.0]}])
    with pytest.raises(ValueError, match="no prediction rows"):
        write_predictions_csv(tmp_path / "empty.csv", [])


def test_overlay_and_sdr_curve_are_readable_pngs(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.normal(size=(120, 80))  # indexed [x, y]: 120 columns, 80 rows
    ref = np.array([[30.0, 20.0], [90.0, 60.0], [NAN, NAN]])
    pred = ref + np.array([[5.0, 3.0], [-4.0, 6.0], [0.0, 0.0]])
    path = save_overlay_png(tmp_path / "overlays" / "img.png", image, ref, pred, ["a", "b", "c"], pixel_aspect=1.5)
    png = imread(path)
    assert png.shape[:2] == (800, 800)  # 80 rows of pixels 1.5 times as tall as wide: 120 x 120, enlarged to 800
    assert _colour_fraction(png, (1.0, 0.0, 0.0)) > 0  # prediction crosses
    assert _colour_fraction(png, (0.0, 1.0, 0.0)) > 0  # reference circles
    with pytest.raises(ValueError, match="names"):
        save_overlay_png(tmp_path / "bad.png", image, ref, pred, ["a"])
    curve = imread(save_sdr_curve(tmp_path / "sdr.png", [[0.5, 1.0, NAN], [2.2, 3.5, 12.0]]))
    assert curve.shape[:2] == (400, 600)


def _batch(pred_mm, ref_mm, spacing, paths, grid_scale):
    """A batch as the evaluator would hold it: grid images, grid->mm matrices, metadata."""
    b = len(paths)
    matrix = torch.eye(3).repeat(b, 1, 1)
    matrix[:, 0, 0], matrix[:, 1, 1] = grid_scale[:, 0], grid_scale[:, 1]
    images = MetaTensor(torch.rand(b, 1, 64, 48), meta={"filename_or_obj": paths})
    images.is_batch = True
    batch = {"image": images, "spacing": torch.as_tensor(spacing), "grid_to_physical": matrix}
    output = {"image": images, "label": torch.as_tensor(ref_mm), "pred": torch.as_tensor(pred_mm)}
    return batch, output


def test_report_handler_2d_through_an_engine(tmp_path, caplog):
    spacing = np.array([[0.1, 0.2], [0.1, 0.1], [0.2, 0.2]])
    ref_px = np.array([[[10.0, 10.0], [40.0, 30.0]], [[20.0, 20.0], [NAN, NAN]], [[5.0, 5.0], [30.0, 30.0]]])
    pred_px = ref_px + np.array([[[3.0, 4.0], [0.0, 1.0]], [[-6.0, 8.0], [0.0, 0.0]], [[0.0, 0.0], [1.0, 0.0]]])
    pred_px[1, 1] = [11.0, 12.0]
    ref_mm, pred_mm = ref_px * spacing[:, None], pred_px * spacing[:, None]
    paths = [str(tmp_path / "d" / "img001.png"), str(tmp_path / "d" / "img002.png"), str(tmp_path / "e" / "img001.png")]
    for path in paths:  # the overlays are drawn from the files
        Path(path).parent.mkdir(exist_ok=True)
        Image.fromarray(np.full((60, 50), 80, np.uint8)).save(path)
    grid_scale = torch.as_tensor(spacing * 2.0, dtype=torch.float32)  # grid pixels of half the image's resolution
    first, first_out = _batch(pred_mm[:2], ref_mm[:2], spacing[:2], paths[:2], grid_scale[:2])
    second, second_out = _batch(pred_mm[2:], ref_mm[2:], spacing[2:], paths[2:], grid_scale[2:])
    # iteration 1: batched dicts; iteration 2: decollated lists of per-image dicts, as SupervisedEvaluator gives
    steps = [(first, first_out), ([{k: v[0] for k, v in second.items()}], [{k: v[0] for k, v in second_out.items()}])]
    engine = Engine(lambda e, batch: steps[e.state.iteration - 1][1])
    named = SimpleNamespace(provenance=lambda: run_provenance("templates", "/d/tmpl.png", "models/model.pt"))
    handler = LandmarkReportHandler(tmp_path / "eval", NAMES, predictor=named)
    handler.attach(engine)
    with caplog.at_level(logging.INFO, logger="bundle.reporting"):
        engine.run([batch for batch, _ in steps], max_epochs=1)

    expected = np.array([math.hypot(0.3, 0.8), 0.2, math.hypot(0.6, 0.8), 0.0, 0.2])  # nasion of image 2 missing
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["n_images"] == 3 and metrics["n_landmarks"] == 2
    assert metrics["mre_mm"] == pytest.approx(expected.mean())
    assert metrics["mre_std_mm"] == pytest.approx(expected.std())
    assert metrics["mre_px"] == pytest.approx(np.mean([5.0, 1.0, 10.0, 0.0, 1.0]))
    assert metrics["sdr"] == {"2.0": 100.0, "2.5": 100.0, "3.0": 100.0, "4.0": 100.0}
    assert metrics["per_landmark_mre_mm"]["nasion"] == pytest.approx(0.2)
    # each landmark's mean difference in mm: sella (0.3, 0.8), (-0.6, 0.8), (0, 0); nasion (0, 0.2), (0.2, 0)
    np.testing.assert_allclose(metrics["per_landmark_offset_mm"]["sella"], [-0.1, 1.6 / 3])
    np.testing.assert_allclose(metrics["per_landmark_offset_mm"]["nasion"], [0.1, 0.1])
    sella_left = np.hypot([0.4, -0.5, 0.1], [0.8 - 1.6 / 3, 0.8 - 1.6 / 3, -1.6 / 3])
    nasion_left = np.hypot([-0.1, 0.1], [0.1, -0.1])
    assert metrics["mre_offset_removed_mm"] == pytest.approx(np.concatenate([sella_left, nasion_left]).mean())
    assert metrics["template"] == "/d/tmpl.png" and metrics["checkpoint"] == "models/model.pt"
    assert metrics["pipeline"] == "templates" and not (tmp_path / "eval" / "provenance.json").exists()

    table = _read_csv(tmp_path / "eval" / "predictions.csv")
    assert table[0] == ["image", "landmark", "x", "y", "error_mm"] and len(table) == 7
    assert table[1][:2] == [paths[0], "sella"]
    np.testing.assert_allclose(
        [float(v) for v in table[1][2:]], [13.0, 14.0, math.hypot(0.3, 0.8)], atol=1e-6
    )  # original pixels
    assert table[4][1:] == ["nasion", "11.000000", "12.000000", ""]  # predicted but not measurable
    overlays = sorted(p.name for p in (tmp_path / "eval" / "overlays").iterdir())
    assert overlays == ["img001.png", "img001_2.png", "img002.png"]  # stem clash resolved
    assert (tmp_path / "eval" / "sdr_curve.png").stat().st_size > 0
    assert "MRE" in caplog.text and "2.0 mm 100.0%" in caplog.text


def test_report_handler_3d_world_mm_and_missing_keys(tmp_path):
    ref = np.array([[[10.0, -20.0, 30.0], [0.0, 0.0, 0.0]]])
    pred = ref + np.array([[[1.0, 2.0, 2.0], [0.0, 0.0, 4.0]]])
    spacing = np.array([[1.0, 1.0, 2.0]])
    engine = Engine(lambda e, batch: {"pred": torch.as_tensor(pred), "label": torch.as_tensor(ref)})
    handler = LandmarkReportHandler(tmp_path, NAMES)
    handler.attach(engine)
    engine.run([{"spacing": torch.as_tensor(spacing), "image_path": ["/v/ct.nii.gz"]}], max_epochs=1)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["mre_mm"] == pytest.approx(3.5)
    assert metrics["mre_px"] == pytest.approx((math.sqrt(1 + 4 + 1) + 2.0) / 2)
    table = _read_csv(tmp_path / "predictions.csv")
    assert table[0] == ["image", "landmark", "x", "y", "z", "error_mm"]
    assert table[1] == ["/v/ct.nii.gz", "sella", "11.000000", "-18.000000", "32.000000", "3.000000"]
    assert not (tmp_path / "overlays").exists()

    broken = Engine(lambda e, batch: {"pred": torch.as_tensor(pred), "label": torch.as_tensor(ref)})
    LandmarkReportHandler(tmp_path / "b", NAMES).attach(broken)
    with pytest.raises(KeyError, match="spacing"):
        broken.run([{"image_path": ["/v/ct.nii.gz"]}], max_epochs=1)


def test_overlay_names_every_point_and_its_legend_lists_only_what_is_drawn():
    image = np.zeros((200, 100))
    pred = np.array([[30.0, 20.0], [90.0, 60.0], [NAN, NAN]])
    unlabelled = overlay_figure(image, np.full((3, 2), NAN), pred, ["sella", "nasion", "orbitale"])
    ax = unlabelled.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["prediction (number: the key)"]  # no reference
    texts = [t.get_text() for t in ax.texts]
    assert "1" in texts and "2" in texts and "3" not in texts  # each predicted point numbered
    assert "1 sella\n2 nasion\n3 orbitale" in texts  # the key
    labelled = overlay_figure(image, pred + 1.0, pred, ["sella", "nasion", "orbitale"]).axes[0]
    assert [t.get_text() for t in labelled.get_legend().get_texts()] == ["reference", "prediction (number: the key)"]


def test_report_overlays_are_drawn_at_the_images_resolution_with_an_overview(tmp_path):
    """A 1000 x 850 image seen by the network on a 64 x 48 grid: its overlay has the image's 1000 x 850 pixels."""
    paths = [str(tmp_path / "in" / f"case{i}.png") for i in range(2)]
    (tmp_path / "in").mkdir()
    for path in paths:
        Image.fromarray(np.linspace(0, 255, 850 * 1000).reshape(850, 1000).astype(np.uint8)).save(path)
    spacing = np.array([[0.1, 0.1], [0.1, 0.1]])
    ref_px = np.array([[[100.0, 200.0], [700.0, 600.0]], [[NAN, NAN], [NAN, NAN]]])
    pred_px = np.array([[[110.0, 190.0], [690.0, 610.0]], [[300.0, 300.0], [500.0, 400.0]]])
    batch, output = _batch(pred_px * spacing[:, None], ref_px * spacing[:, None], spacing, paths, torch.ones(2, 2))
    engine = Engine(lambda e, b: output)
    LandmarkReportHandler(tmp_path / "eval", NAMES).attach(engine)
    engine.run([batch], max_epochs=1)
    for path in paths:
        assert imread(tmp_path / "eval" / "overlays" / f"{Path(path).stem}.png").shape[:2] == (850, 1000)
    page = (tmp_path / "eval" / "overview.html").read_text()
    assert page.count("<img ") == 2 and 'src="overlays/case0.png"' in page and 'src="overlays/case1.png"' in page
    assert f"{paths[0]} (MRE 1.41 mm)" in page and f"{paths[1]}</figcaption>" in page  # case1: no reference
    assert "1 sella, 2 nasion" in page
    assert not list(tmp_path.glob(".eval*"))  # the staging folder is gone
