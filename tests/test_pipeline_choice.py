"""Which pipeline predicts (``pipeline: auto | templates | detector``): the detector record, the rule of
:func:`bundle.pipeline.choice.choose_detector`, the templates and labelled images it counts, and a
pipeline moved to a detector's grid (the commands with a detector at hand: tests/test_stage2.py)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import bundle.checkpoints
import bundle.pipeline.choice
import pytest
import torch
from bundle.checkpoints import CheckpointError, save_with_record
from bundle.networks.detector import HeatmapDetector
from bundle.pipeline.choice import (
    SHIPPED_TEMPLATE,
    SHIPPED_WEIGHTS,
    STARTING_DETECTORS,
    assess_detector,
    builtin_templates,
    choose_detector,
    default_detectors,
    labelled_at_hand,
    prediction_refinement,
    pseudo_label_refinement,
    starting_detector,
)
from bundle.pipeline.detector_data import detector_info, detector_record, recorded_detector, write_detector_info
from bundle.transforms.utils import on_grid
from monai.transforms import Compose, Lambdad, Resized

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["a", "b"]
NETWORK = {"spatial_dims": 2, "backbone": "light", "embed_dim": 8, "strides": [16, 8], "head_channels": 4}


def _labelled(n: int, root: str = "/data") -> list[dict]:
    return [{"image": f"{root}/train_{i}.png", "landmarks": [[1.0, 2.0], [3.0, 4.0]]} for i in range(n)]


def _datalist(n_labelled: int, n_test: int = 2, **extra) -> dict:
    """``n_labelled`` labelled training items /data/train_<i>.png, unlabelled ones and test items /test/<i>.png."""
    tests = [{"image": f"/test/{i}.png", "landmarks": [[1.0, 2.0], [3.0, 4.0]]} for i in range(n_test)]
    unlabelled = [{"image": f"/data/u_{i}.png"} for i in range(5)]
    return {"landmark_names": NAMES, "training": _labelled(n_labelled) + unlabelled, "test": tests, **extra}


def _detector(folder: Path, labels: str = "human", items=None, names=NAMES, templates=None, **record) -> Path:
    """A detector checkpoint with its record (``items``: its training items, by default /data/train_0..4.png)."""
    folder.mkdir(parents=True, exist_ok=True)
    network = HeatmapDetector(n_landmarks=len(names), **NETWORK)
    torch.save({"model": network.state_dict()}, folder / "model.pt")
    items = _labelled(5) if items is None else items
    write_detector_info(folder, templates, labels, items, [64, 64], names, NETWORK)
    if record:
        info = json.loads((folder / "detector_info.json").read_text())
        info.update(record)
        (folder / "detector_info.json").write_text(json.dumps({k: v for k, v in info.items() if v is not None}))
    return folder / "model.pt"


def test_the_record_says_what_the_detector_learnt_from_and_rebuilds_it(tmp_path):
    human = _detector(tmp_path / "human", items=_labelled(7))
    info = detector_info(human)
    assert info["n_labelled"] == 7 and info["labelled_images"][0] == "/data/train_0.png"
    assert info["training_images"] == info["labelled_images"]
    assert info["landmark_names"] == NAMES and info["image_size"] == [64, 64]
    templates = [{"image": "/t.png"}] + [{"image": f"/p{i}.png", "pseudo_label": True} for i in (1, 2)]
    pseudo = _detector(tmp_path / "pseudo", labels="pseudo", items=_labelled(9), templates=templates)
    assert detector_info(pseudo)["labelled_images"] == ["/t.png"]  # one human-labelled template, two pseudo ones
    assert detector_info(pseudo)["n_labelled"] == 1
    # the recorded network settings and landmark count, not the given ones (which would not fit the weights)
    net = recorded_detector(human, 2, 19, "vgg19", 64, [1])
    net.load_state_dict(torch.load(human)["model"])
    assert net.n_landmarks == 2


def test_labelled_at_hand_counts_what_matching_would_use():
    datalist = _datalist(6)
    datalist["training"] += datalist["test"]  # test images listed among the training items too
    count, labelled = labelled_at_hand(datalist, 32)
    assert count == 6 and "/data/train_5.png" in labelled  # less the test images
    assert labelled_at_hand(datalist, 3)[0] == 3  # at most max_templates
    assert labelled_at_hand({**datalist, "templates": _labelled(2)}, 32)[0] == 2  # the datalist's own
    assert labelled_at_hand(None, 32) == (0, [])  # inference's built-in templates


@pytest.mark.parametrize(
    "n_labelled, n_templates, chosen",
    [(1, 1, True), (2, 2, True), (5, 5, True), (4, 10, False), (5, 10, True), (10, 32, True), (1, 3, False)],
)
def test_auto_takes_a_detector_with_as_many_labels_as_the_templates_or_five(tmp_path, n_labelled, n_templates, chosen):
    path = str(_detector(tmp_path / "d", items=_labelled(n_labelled)))
    datalist = _datalist(max(n_labelled, n_templates))
    args = (NAMES, 2, datalist, n_templates)
    assert choose_detector("auto", [path], *args) == (path if chosen else None)
    assert choose_detector("templates", [path], *args) is None
    assert choose_detector("detector", [path], *args) == path
    assert choose_detector("auto", [path], NAMES, 2, None, 32) is None  # no datalist, no built-in templates: matching


def test_without_a_datalist_auto_weighs_the_detectors_shipped_beside_the_built_in_templates(tmp_path, caplog):
    root = tmp_path / "bundle"
    (root / "models").mkdir(parents=True)
    builtin, weights = root / SHIPPED_TEMPLATE, root / SHIPPED_WEIGHTS
    builtin.write_bytes((ROOT / SHIPPED_TEMPLATE).read_bytes())  # 32 templates
    weights.write_bytes(b"weights")
    copy = tmp_path / "mine.pt"
    copy.write_bytes(builtin.read_bytes())
    assert builtin_templates(builtin, weights, root) == builtin
    assert builtin_templates(copy, weights, root) is None  # a template file of the user's: matching, as before
    assert builtin_templates(builtin, copy, root) is None  # other weights (refused by the template file's check)
    link = tmp_path / "link.pt"  # the built-in file under another name: the same templates, found beside models/
    link.symlink_to(builtin)
    assert builtin_templates(link, weights, root) == builtin

    def choose(candidates, template_path=builtin, pipeline="auto"):
        builtin_in_use = builtin_templates(template_path, weights, root)
        return choose_detector(pipeline, candidates, NAMES, 2, None, 32, builtin=builtin_in_use)

    many = str(_detector(root / "models" / "finetune", items=_labelled(60)))
    one = str(_detector(root / "models" / "stage2", items=_labelled(1)))
    mine = str(_detector(root / "output" / "models" / "finetune", items=_labelled(60, root="/mine")))
    assert choose([mine, many, one]) == many  # shipped, 60 labels >= 32 templates; the user's own is not weighed
    assert choose([mine, many, one], template_path=link) == many
    stored = tmp_path / "store" / "model.pt"  # a shipped checkpoint linked from a file store: still beside them
    stored.parent.mkdir()
    Path(many).rename(stored)
    Path(many).symlink_to(stored)
    assert choose([mine, many, one]) == many
    assert choose([mine, one]) is None  # one label against 32 templates
    assert choose([mine, many], template_path=copy) is None
    with caplog.at_level(logging.WARNING):
        assert choose([mine], pipeline="detector") == mine  # forced: any usable candidate, with a warning
    assert "learnt from labelled images this run does not hold" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert choose([many], pipeline="detector") == many  # a shipped one: the built-in templates' labels
    assert not caplog.text
    assert choose([many], pipeline="templates") is None


def test_auto_prefers_the_most_labels_and_the_first_of_equals(tmp_path):
    few, many, same = (_detector(tmp_path / n, items=_labelled(k)) for n, k in (("few", 2), ("many", 12), ("same", 12)))
    datalist = _datalist(40)
    assert choose_detector("auto", [str(few), str(many), str(same)], NAMES, 2, datalist, 32) == str(many)
    assert choose_detector("auto", [str(same), str(many)], NAMES, 2, datalist, 32) == str(same)


def test_auto_passes_over_a_detector_that_is_not_this_run_s(tmp_path, caplog):
    datalist = _datalist(12, n_test=0)
    other = _detector(tmp_path / "other", items=_labelled(12), names=["x", "y"])
    flat = _detector(tmp_path / "3d", items=_labelled(12), network={**NETWORK, "spatial_dims": 3})
    unnamed = _detector(tmp_path / "unnamed", items=_labelled(12), landmark_names=None)
    elsewhere = _detector(tmp_path / "elsewhere", items=_labelled(12, root="/other"))  # not the datalist's labels
    seen = _detector(tmp_path / "seen", items=_labelled(12) + [{"image": "/test/1.png"}])
    missing = tmp_path / "missing" / "model.pt"
    tested = ["/test/0.png", "/test/1.png"]
    candidates = [str(p) for p in (other, flat, unnamed, elsewhere, seen, missing)]
    with caplog.at_level(logging.INFO, logger="bundle.pipeline.choice"):
        assert choose_detector("auto", candidates, NAMES, 2, datalist, 32, test_images=tested) is None
    for why in (
        "trained for other landmarks",
        "a 3D detector",
        "does not name its landmarks",
        "learnt from labelled images this run does not hold (first: /other/train_0.png)",
        "trained on 1 of the test images (first: /test/1.png)",
    ):
        assert why in caplog.text, why
    # forced: a doubt is a warning, a refusal stays one
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bundle.pipeline.choice"):
        assert choose_detector("detector", [str(seen)], NAMES, 2, datalist, 32, test_images=tested) == str(seen)
    assert "trained on 1 of the test images" in caplog.text
    assert choose_detector("detector", [str(unnamed)], NAMES, 2, datalist, 32) == str(unnamed)
    with pytest.raises(ValueError) as refused:
        choose_detector("detector", [str(other), str(missing)], NAMES, 2, datalist, 32)
    assert "trained for other landmarks" in str(refused.value) and f"{missing}: no such file" in str(refused.value)
    with pytest.raises(ValueError, match="pipeline must be one of"):
        choose_detector("best", [], NAMES, 2, datalist, 32)


def test_fine_tuning_continues_the_detector_of_fewer_of_its_labels(tmp_path):
    """configs/finetune.yaml's ``init_weights``: the detector that learnt from the most of fewer of the run's labelled
    images, with the run's network settings (on any grid) and from none of its validation and test images; else None
    (the stage-1 encoder)."""
    datalist = _datalist(5)
    items = datalist["training"][:5]
    one_label = [{"image": "/data/train_0.png"}, {"image": "/data/u_0.png", "pseudo_label": True}]
    stage2 = _detector(tmp_path / "stage2", labels="pseudo", items=datalist["training"], templates=one_label)
    three = _detector(tmp_path / "three", items=_labelled(3))
    args = (NAMES, NETWORK, datalist)
    assert starting_detector([str(stage2)], items, *args) == str(stage2)
    assert starting_detector([str(stage2)], items, *args, random_start=True) is None  # --random_init true
    assert starting_detector([str(stage2), str(three)], items, *args) == str(three)  # the most labels
    coarse = _detector(tmp_path / "coarse", items=_labelled(4), image_size=[32, 32])
    assert starting_detector([str(coarse), str(three)], items, *args) == str(coarse)  # another grid: continued
    wider = dict(NETWORK, head_channels=8)  # the weights would not fit
    assert starting_detector([str(stage2)], items, NAMES, wider, datalist) is None
    _, refusal, _ = assess_detector(stage2, NAMES, 2, network=wider)
    assert "other network settings" in refusal and "'head_channels': 8" in refusal
    assert starting_detector([str(stage2)], items[1:], *args) is None  # its labelled image is not the run's
    assert starting_detector([str(three)], items[:3], *args) is None  # as many labels: not a continuation
    seen = _detector(
        tmp_path / "seen", labels="pseudo", items=datalist["training"] + datalist["test"][:1], templates=one_label
    )
    other = _detector(tmp_path / "other", items=_labelled(3), names=["x", "y"])
    missing = tmp_path / "missing" / "model.pt"
    assert starting_detector([str(seen), str(other), str(missing)], items, *args) is None
    record = tmp_path / "stage2" / "detector_info.json"
    record.write_text("{truncated")
    with pytest.raises(ValueError, match=re.escape(f"{record}: not a readable detector record")):
        starting_detector([str(stage2)], items, *args)


def test_a_training_never_lends_its_record_to_an_earlier_trainings_files(tmp_path, monkeypatch):
    """The savers write detector_info.json with each model file, naming the files it describes: a new training in
    the folder of an earlier one (a fine-tuning continuing in place) leaves no earlier weights under its record,
    wherever it stops; the pipeline choice passes such a file over and a named use of it is refused."""
    folder = tmp_path / "finetune"
    earlier = detector_record([], "human", _labelled(5), [192, 192], NAMES, NETWORK)
    weights = {"w": torch.zeros(2)}
    for name in ("model.pt", "model_final.pt"):
        save_with_record(weights, folder / name, folder / earlier["file"], earlier["content"])
    assert detector_info(folder / "model_final.pt")["image_size"] == [192, 192]
    assert json.loads((folder / "detector_info.json").read_text())["checkpoints"] == ["model.pt", "model_final.pt"]
    later = detector_record([], "human", _labelled(10), [288, 288], NAMES, NETWORK, folder / "model.pt")

    def killed(checkpoint, path):  # the process dies while the new weights are written
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle.checkpoints, "save_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        save_with_record(weights, folder / "model.pt", folder / later["file"], later["content"])
    monkeypatch.undo()
    # the earlier model.pt is whole but no longer described (its record was about to go); model_final.pt still is
    assert detector_info(folder / "model_final.pt")["image_size"] == [192, 192]
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / 'model.pt'} is not among the checkpoints")):
        detector_info(folder / "model.pt")
    save_with_record(weights, folder / "model.pt", folder / later["file"], later["content"])
    assert detector_info(folder / "model.pt")["image_size"] == [288, 288]  # the new weights, the new record
    with pytest.raises(CheckpointError, match=r"model_final\.pt is not among the checkpoints .* \(model\.pt\)"):
        detector_info(folder / "model_final.pt")  # an earlier training's weights under the new record
    n, refusal, _ = assess_detector(folder / "model_final.pt", NAMES, 2)
    assert n == 0 and "earlier training's weights" in refusal
    assert choose_detector("detector", [str(folder / "model_final.pt"), str(folder / "model.pt")], NAMES, 2, None, 0)
    save_with_record(weights, folder / "model_final.pt", folder / later["file"], later["content"])  # training ends
    assert detector_info(folder / "model_final.pt")["n_labelled"] == 10
    assert json.loads((folder / "detector_info.json").read_text())["checkpoints"] == ["model.pt", "model_final.pt"]
    # a record without `checkpoints` (written whole for a folder's files, as the shipped ones are) describes them all
    legacy = _detector(tmp_path / "legacy")
    (legacy.parent / "model_final.pt").write_bytes(legacy.read_bytes())
    assert detector_info(legacy.parent / "model_final.pt")["n_labelled"] == 5
    save_with_record(weights, legacy, legacy.parent / later["file"], later["content"])
    with pytest.raises(CheckpointError, match="is not among the checkpoints"):
        detector_info(legacy.parent / "model_final.pt")


def test_relative_datalist_paths_and_links_are_the_recorded_images(tmp_path, monkeypatch):
    """The record holds real paths; a datalist read through a relative path or a link names the same files."""
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "link").symlink_to(data)
    items = [{"image": str(data / f"train_{i}.png")} for i in range(10)]
    path = str(_detector(tmp_path / "d", items=items))
    monkeypatch.chdir(tmp_path)
    labelled = [{"image": f"link/train_{i}.png", "landmarks": [[1.0, 2.0], [3.0, 4.0]]} for i in range(10)]
    datalist = {"landmark_names": NAMES, "training": labelled, "test": [{"image": "link/train_3.png"}]}
    assert choose_detector("auto", [path], NAMES, 2, {**datalist, "test": []}, 32) == path
    assert choose_detector("auto", [path], NAMES, 2, datalist, 32, test_images=["link/train_3.png"]) is None


def test_the_shipped_stage2_detector_is_auto_s_choice_for_hamedan_s_046_alone():
    shipped = str(ROOT / "models" / "stage2" / "model.pt")
    names = detector_info(shipped)["landmark_names"]
    assert len(names) == 19
    image = "/any/where/hamedan_ceph/images/{}.png"
    one = {"landmark_names": names, "training": [{"image": image.format("046"), "landmarks": [[1.0, 1.0]] * 19}]}
    test = [image.format("005")]  # a test image of the protocol, not a training image
    assert choose_detector("auto", default_detectors(ROOT), names, 2, one, 32, test) == shipped
    # another annotated image: the user's own template is matched (the detector did not learn from it)
    other = {**one, "training": [{"image": "/mine/ceph_1.png", "landmarks": [[1.0, 1.0]] * 19}]}
    assert choose_detector("auto", default_detectors(ROOT), names, 2, other, 32, test) is None
    mine = {"image": "/mine/2.png", "landmarks": [[1.0, 1.0]] * 19}
    three = {**one, "training": one["training"] + other["training"] + [mine]}
    assert choose_detector("auto", default_detectors(ROOT), names, 2, three, 32, test) is None  # 1 label < 3
    assert choose_detector("auto", default_detectors(ROOT), names, 2, one, 32, [image.format("001")]) is None


def test_a_fine_tuning_on_hamedan_s_five_continues_the_shipped_unrefined_stage2_detector():
    """046 and 001-004 labelled: predictions at one label come from models/stage2 (refined pseudo-labels), a
    fine-tuning on the five continues models/stage2_unrefined (matching's own pseudo-labels; the better start)."""
    names = detector_info(str(ROOT / "models" / "stage2" / "model.pt"))["landmark_names"]
    image = "/any/where/hamedan_ceph/images/{}.png"
    items = [{"image": image.format(i), "landmarks": [[1.0, 1.0]] * 19} for i in ("046", "001", "002", "003", "004")]
    datalist = {"landmark_names": names, "training": items, "test": [{"image": image.format("005")}]}
    network = detector_info(str(ROOT / "models" / "stage2" / "model.pt"))["network"]
    candidates = default_detectors(ROOT, STARTING_DETECTORS)
    assert str(ROOT / "models" / "stage2" / "model.pt") not in candidates
    start = starting_detector(candidates, items, names, network, datalist)
    assert start == str(ROOT / "models" / "stage2_unrefined" / "model.pt")


def test_inferring_without_a_datalist_takes_the_shipped_fine_tuned_detector(tmp_path, monkeypatch):
    from bundle.configs import bundle_parser
    from bundle.template_file import load_template

    shipped = ROOT / "models" / "finetune" / "model.pt"
    info = detector_info(shipped)
    builtin = load_template(ROOT / SHIPPED_TEMPLATE)
    assert info["landmark_names"] == builtin["landmark_names"] and info["n_labelled"] == 60
    assert info["labels"] == "human" and info["image_size"] == [288, 288]
    names = {Path(s).name for s in builtin["sources"]}  # the built-in templates' images are among its labels
    assert names <= {Path(i).name for i in info["labelled_images"]}

    def detector(root=str(ROOT), **overrides):
        parser = bundle_parser(["configs/inference.yaml"], bundle_root=str(ROOT), **overrides)
        parser["bundle_root"] = root
        predictor = parser.get_parsed_content("predictor")
        return predictor.checkpoint if predictor.pipeline == "detector" else None

    assert Path(detector()).resolve() == shipped.resolve()
    assert detector(pipeline="templates") is None
    matching = bundle_parser(["configs/inference.yaml"], bundle_root=str(ROOT), pipeline="templates")
    assert isinstance(matching.get_parsed_content("encoder"), torch.nn.Module)
    monkeypatch.chdir(tmp_path)  # bundle_root "." from elsewhere (monai.bundle.load): found in the bundle's folder
    assert Path(detector(root=".")).resolve() == shipped.resolve()
    mine = tmp_path / "mine.pt"  # the user's own template file: matched, as before
    mine.write_bytes((ROOT / SHIPPED_TEMPLATE).read_bytes())
    assert detector(template_path=str(mine)) is None


def test_the_xfeat_refinement_runs_where_validation_says_it_helps(tmp_path, monkeypatch):
    """``auto``: after a detector trained on human labels, from the datalist's labelled templates (its own, else the
    first ``max_templates`` labelled training items), never from a test image; not after a pseudo-label detector nor
    after matching, not in 3D, not without the wheel. ``true`` where it cannot run names why; ``false``: never."""
    human, pseudo = _detector(tmp_path / "h"), _detector(tmp_path / "p", labels="pseudo", templates=_labelled(1))
    datalist = _datalist(5)
    chosen = prediction_refinement("auto", str(human), datalist, 3, 2, "median")
    assert chosen.sources == [f"/data/train_{i}.png" for i in range(3)] and chosen.combine == "median"
    own = {**datalist, "templates": _labelled(2), "test": datalist["test"] + [_labelled(1)[0]]}
    assert prediction_refinement("auto", str(human), own, 3, 2, "median").sources == ["/data/train_1.png"]
    for detector, dims in ((str(pseudo), 2), (None, 2), (str(human), 3)):
        assert prediction_refinement("auto", detector, datalist, 3, dims, "median") is None
    assert prediction_refinement("false", str(human), datalist, 3, 2, "median") is None
    assert prediction_refinement(True, None, datalist, 3, 2, "median").sources[0] == "/data/train_0.png"
    with pytest.raises(ValueError, match="2D only"):
        prediction_refinement("true", str(human), datalist, 3, 3, "median")
    with pytest.raises(ValueError, match="no human-labelled template"):
        prediction_refinement("true", str(human), None, 3, 2, "median")
    with pytest.raises(ValueError, match="xfeat_refinement"):
        prediction_refinement("sometimes", str(human), datalist, 3, 2, "median")
    monkeypatch.setattr(bundle.pipeline.choice, "available", lambda: False)
    assert prediction_refinement("auto", str(human), datalist, 3, 2, "median") is None
    # stage 2's pseudo-labels: refined by auto from the human-labelled templates only
    monkeypatch.undo()
    templates = _labelled(2) + [{"image": "/data/u_0.png", "landmarks": [[1.0, 2.0], None], "pseudo_label": True}]
    assert pseudo_label_refinement("auto", templates, 2, "median").sources == ["/data/train_0.png", "/data/train_1.png"]
    assert pseudo_label_refinement("auto", templates, 3, "median") is None


def test_on_grid_moves_the_resize_and_leaves_the_original_alone():
    pipeline = Compose([Lambdad("image", lambda x: x * 2), Resized("image", (64, 64), mode="area")])
    moved = on_grid(pipeline, [96, 80])
    image = torch.rand(1, 100, 90)
    assert moved({"image": image})["image"].shape == (1, 96, 80)
    assert pipeline({"image": image})["image"].shape == (1, 64, 64)
    with pytest.raises(ValueError, match="no Resized"):
        on_grid(Compose([Lambdad("image", lambda x: x)]), [96, 80])
