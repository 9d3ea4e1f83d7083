"""Which pipeline predicts (``pipeline: auto | templates | detector``): the detector record, the rule of
:func:`bundle.templates.pipeline_choice.choose_detector`, the templates it counts, a pipeline moved to a detector's
grid, and the evaluating and inferring commands run with a detector at hand."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from bundle.networks.detector import HeatmapDetector
from bundle.templates.detector_data import detector_info, recorded_detector, write_detector_info
from bundle.templates.pipeline_choice import choose_detector, default_detectors, template_count
from bundle.transforms.utils import on_grid
from monai.transforms import Compose, Lambdad, Resized

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["a", "b"]
NETWORK = {"spatial_dims": 2, "backbone": "light", "embed_dim": 8, "strides": [16, 8], "head_channels": 4}


def _detector(folder: Path, labels: str = "human", n_items: int = 5, names=NAMES, templates=None, **record) -> Path:
    """A detector checkpoint with its record: ``n_items`` training items /data/train_<i>.png."""
    folder.mkdir(parents=True, exist_ok=True)
    network = HeatmapDetector(n_landmarks=len(names), **{k: v for k, v in NETWORK.items()})
    torch.save({"model": network.state_dict()}, folder / "model.pt")
    items = [{"image": f"/data/train_{i}.png"} for i in range(n_items)]
    write_detector_info(folder, templates, labels, items, [64, 64], names, NETWORK)
    if record:
        info = json.loads((folder / "detector_info.json").read_text())
        info.update(record)
        (folder / "detector_info.json").write_text(json.dumps({k: v for k, v in info.items() if v is not None}))
    return folder / "model.pt"


def test_the_record_says_what_the_detector_learnt_from_and_rebuilds_it(tmp_path):
    human = _detector(tmp_path / "human", n_items=7)
    info = detector_info(human)
    assert info["n_labelled"] == 7 and info["training_images"][0] == "/data/train_0.png"
    assert info["landmark_names"] == NAMES and info["image_size"] == [64, 64]
    templates = [{"image": "t.png"}, {"image": "p1.png", "pseudo_label": True}, {"image": "p2.png", "pseudo_label": True}]
    pseudo = _detector(tmp_path / "pseudo", labels="pseudo", n_items=9, templates=templates)
    assert detector_info(pseudo)["n_labelled"] == 1  # one human-labelled template, two pseudo-templates
    # the recorded network settings, not the given ones (which would not fit the weights)
    net = recorded_detector(human, 2, 19, "vgg19", 64, [1])
    net.load_state_dict(torch.load(human)["model"])
    assert net.n_landmarks == 2


def test_template_count_is_what_matching_would_use(tmp_path):
    labelled = [{"image": f"/d/{i}.png", "landmarks": [[1, 2]]} for i in range(6)]
    datalist = {"training": labelled + [{"image": "/d/u.png"}], "validation": [labelled[0]], "test": [labelled[1]]}
    assert template_count(datalist, 32) == 4  # labelled training items less the validation and test images
    assert template_count(datalist, 3) == 3  # at most max_templates
    assert template_count({**datalist, "templates": labelled[2:4]}, 32) == 2  # the datalist's own
    assert template_count(None, 32, ROOT / "models" / "template_features.pt") == 32  # the built-in templates


@pytest.mark.parametrize(
    "n_items, n_templates, chosen",
    [(1, 1, True), (5, 5, True), (5, 10, False), (10, 32, True), (1, 3, False)],
)
def test_auto_takes_a_detector_with_as_many_labels_as_the_templates_or_ten(tmp_path, n_items, n_templates, chosen):
    path = _detector(tmp_path / "d", n_items=n_items)
    assert choose_detector("auto", [str(path)], NAMES, n_templates) == (str(path) if chosen else None)
    assert choose_detector("templates", [str(path)], NAMES, n_templates) is None
    assert choose_detector("detector", [str(path)], NAMES, 1000) == str(path)


def test_auto_prefers_the_most_labels_and_the_first_of_equals(tmp_path):
    few, many, same = (_detector(tmp_path / n, n_items=k) for n, k in (("few", 2), ("many", 12), ("same", 12)))
    assert choose_detector("auto", [str(few), str(many), str(same)], NAMES, 40) == str(many)
    assert choose_detector("auto", [str(same), str(many)], NAMES, 40) == str(same)


def test_auto_leaves_out_other_landmarks_an_unnamed_record_and_a_detector_trained_on_a_test_image(tmp_path, caplog):
    other = _detector(tmp_path / "other", n_items=12, names=["x", "y"])
    unnamed = _detector(tmp_path / "unnamed", n_items=12, landmark_names=None)
    seen = _detector(tmp_path / "seen", n_items=12)
    missing = tmp_path / "missing" / "model.pt"
    candidates = [str(p) for p in (other, unnamed, seen, missing)]
    tested = ["/elsewhere/x.png", "/data/train_3.png"]
    assert choose_detector("auto", candidates, NAMES, 1, test_images=tested) is None
    # forced: a doubt is a warning, a refusal stays one
    with caplog.at_level(logging.WARNING, logger="bundle.templates.pipeline_choice"):
        assert choose_detector("detector", [str(seen)], NAMES, 1, test_images=tested) == str(seen)
    assert "trained on 1 of the test images (first: /data/train_3.png)" in caplog.text
    assert choose_detector("detector", [str(unnamed)], NAMES, 1) == str(unnamed)
    with pytest.raises(ValueError) as refused:
        choose_detector("detector", [str(other), str(missing)], NAMES, 1)
    message = str(refused.value)
    assert "trained for other landmarks" in message and f"{missing}: no such file" in message
    with pytest.raises(ValueError, match="pipeline must be one of"):
        choose_detector("best", [], NAMES, 1)


def test_the_shipped_stage2_detector_is_auto_s_choice_for_one_hamedan_template_not_on_its_training_images():
    names = detector_info(ROOT / "models" / "stage2" / "model.pt")["landmark_names"]
    assert len(names) == 19
    shipped = str(ROOT / "models" / "stage2" / "model.pt")
    test_image = "/any/where/hamedan_ceph/images/005.png"  # a test image of the protocol, not a training image
    assert choose_detector("auto", default_detectors(ROOT), names, 1, [test_image]) == shipped
    assert choose_detector("auto", default_detectors(ROOT), names, 3, [test_image]) is None
    trained_on = "/any/where/hamedan_ceph/images/046.png"
    assert choose_detector("auto", default_detectors(ROOT), names, 1, [trained_on]) is None


def test_on_grid_moves_the_resize_and_leaves_the_original_alone():
    pipeline = Compose([Lambdad("image", lambda x: x * 2), Resized("image", (64, 64), mode="area")])
    moved = on_grid(pipeline, [96, 80])
    image = torch.rand(1, 100, 90)
    assert moved({"image": image})["image"].shape == (1, 96, 80)
    assert pipeline({"image": image})["image"].shape == (1, 64, 64)
