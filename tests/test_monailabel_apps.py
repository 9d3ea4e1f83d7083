"""MONAI Label: each test starts its own app, as a server on 127.0.0.1 or in-process in the app's environment
(tests/monailabel_inprocess.py): the detector's held-out split, a DICOMweb series, the configured device and its one
network, 3D volumes with the 3D configs, the default server with the shipped model, pseudo-templates for few saved
labels, and the annotation loop of ``scripts.experiments.labels_loop`` on real cephalograms."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from bundle.configs import config_files
from PIL import Image

from tests.monailabel_helpers import (
    DETECTOR_TRAIN,
    PYTHON,
    ROOT,
    TINY_TRAIN,
    app_server,
    cli_predictions,
    mrk_json,
    request_json,
    require_monailabel_environment,
    run_checked,
    wait_training,
)

pytestmark = pytest.mark.slow  # apps started per test, trainings through them
require_monailabel_environment()


def _in_process(tmp_path: Path, scenario: str, *args) -> dict:
    """Run a scenario of tests/monailabel_inprocess.py in the MONAI Label environment (working folder
    ``tmp_path/work``); its printed result."""
    (tmp_path / "work").mkdir()
    done = run_checked(
        [PYTHON, ROOT / "tests" / "monailabel_inprocess.py", scenario, tmp_path / "work", *args], tmp_path
    )
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_the_detector_is_scored_on_at_least_three_held_out_images(tmp_path):
    """The held-out split grows to 3 images as soon as 4 are labelled (1 then 2 before), then a quarter, and stays
    sticky; a detector is published only when scored on at least ``min_held_out`` (3) of them."""
    split = _in_process(tmp_path, "split")
    assert split == {
        "2": [1, 1],
        "3": [1, 2],
        "4": [1, 3],
        "5": [2, 3],
        "10": [7, 3],
        "12": [9, 3],
        "20": [15, 5],
        "sticky": True,
        # train.yaml's grids, whatever the label count, unless the request names one; a served detector's own
        "grid": [[192, 192], [64, 64], [64, 64, 64], [288, 288]],
    }


def test_trainings_run_at_a_lower_priority_within_a_time_budget(tmp_path):
    """The train task's child process runs at niceness 10 (suggestions first on shared cores) and reports the epochs
    its last.pt says it ran; the conf's ``max_minutes`` (default 12) and ``epochs`` are checked, naming the key."""
    result = _in_process(tmp_path, "priority")
    assert result["child"] == max(result["own"], 10) and result["epochs_run"] == 3
    assert result["defaults"] == [{"epochs": 10, "max_minutes": 12.0}, {"epochs": 4}]
    assert len(result["refused"]) == 4
    for conf, error in result["refused"].items():
        assert f"--conf {next(iter(json.loads(conf)))}" in error, error


def test_a_failed_datastore_write_leaves_the_old_files(tmp_path):
    """Where no small disk can be mounted (tests/test_monailabel.py fills one): the app's datastore, its label copy
    and its datastore file write made to fail half-way as on a full disk, answers 507 naming what was not stored,
    and leaves the saved label and ``datastore_v2.json`` as they were, with no temporary file beside them."""
    result = _in_process(tmp_path, "full_disk")
    assert result["label"][0] == 507 and "label 'final' of image 'a' not stored: no space left" in result["label"][1]
    assert result["datastore_file"][0] == 507 and "'datastore_v2.json' not stored" in result["datastore_file"][1]
    assert result["intact"], result
    assert result["label_folder"] == ["a.mrk.json"], result
    assert sorted(result["studies"]) == [".lock", "a.png", "datastore_v2.json", "labels"], result


def test_a_detector_publication_that_fails_leaves_the_served_pair(tmp_path):
    """Publishing a detector wrote its record (detector.json: grid, split) first, then copied the weights: a full
    disk during the copy left the new record beside the old weights. Both are now written before either is renamed
    (in-process, tests/monailabel_inprocess.py: the copy fails half-way)."""
    result = _in_process(tmp_path, "detector_publish")
    assert result == {"error": "[Errno 28] No space left on device", "intact": True}, result


def test_a_label_stays_with_the_picture_it_was_checked_on(tmp_path):
    """A label saved while its image is re-uploaded as another picture (without ``{"replace": true}``; in-process,
    tests/monailabel_inprocess.py): the datastore's checks and its write are one step, so the re-upload waits for
    the save and is refused 409 (the image is labelled now); the label is stored with the picture it was checked on
    (the re-upload went through between the check and the write, the label then stored on the other picture)."""
    result = _in_process(tmp_path, "label_race")
    assert result == {"checked_on": "A", "reupload": 409, "stored": "A", "label_stored": True, "label_listed": True}, (
        result
    )


def test_dicomweb_series_gives_the_png_landmarks(tmp_path):
    """A DICOMweb studies URL (MONAI Label's datastore, its transport replaced by local copies: no DICOMweb
    server here, see tests/monailabel_inprocess.py): the app reads the series folder the datastore downloads
    (MONAI Label's default NIfTI conversion, on in the helper, would make the X-ray a one-slice volume without its
    VOI window and MONOCHROME1 inversion) and gives the landmarks of the same image as a PNG."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    from tests.test_dicom import dicom_copy

    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=1)
    png = Path(open_datalist(datalist_path)["test"][0]["image"])
    series = tmp_path / "series"
    series.mkdir()
    dicom_copy(png, series / "000001.dcm", [0.125, 0.125])  # MONOCHROME1, 12 bits, a VOI window
    uid = "1.2.826.0.1.3680043.8.498.1"
    result = _in_process(tmp_path, "dicomweb", datalist_path, series, uid, png)
    assert set(result["dicomweb"]) == set(result["local"]) and result["local"]
    for name, point in result["local"].items():
        assert result["dicomweb"][name] == pytest.approx(point, abs=0.01), name


def _two_test_images_one_labelled(tmp_path: Path) -> tuple[Path, Path, str, Path]:
    """A synthetic datalist, a studies folder holding its two test images and a label of the second:
    ``(datalist, studies, labelled id, label file)``."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=2)
    content = open_datalist(datalist_path)
    studies = tmp_path / "studies"
    studies.mkdir()
    for item in content["test"]:
        shutil.copy(item["image"], studies)
    template = content["test"][1]
    label = mrk_json(tmp_path / "template.mrk.json", content["landmark_names"], template["landmarks"])
    return datalist_path, studies, Path(template["image"]).stem, label


def test_one_network_on_the_configured_device(tmp_path):
    """``--conf device``: a device this machine lacks is refused at start naming it; on ``cpu`` the infer task
    and the trainer record it, and one stage-1 network serves inference, the template choice and the scoring
    of a training in the server's process (in-process, tests/monailabel_inprocess.py); the pseudo-template worker's
    own network is gone once it has finished."""
    result = _in_process(tmp_path, "device", *_two_test_images_one_labelled(tmp_path))
    assert sorted(result["refused"]) == ["cuda:7", "cuda:x", "tpu"]
    for device, message in result["refused"].items():
        assert message.startswith(f"conf device {device!r}: "), message
    assert result["infer_device"] == result["train_device"] == "cpu"
    assert result["networks_after_infer"] == result["networks_after_train"] == 1


def test_a_pipeline_failure_on_a_saved_label_names_its_cause(tmp_path):
    """A saved label that the evaluation pipeline refuses as a template during a suggestion is answered 422 naming
    the image and the cause, a failure inside it 500 naming its cause (both were 500 ``RuntimeError: applying
    transform <bundle.transforms.landmarks.LandmarkTargetsd object at 0x...>``), with no object address or server
    path; the suggestions go on once it passes (in-process, tests/monailabel_inprocess.py: the save-time check and
    the pipeline share their rules, so the fault is injected into the pipeline's)."""
    datalist_path, studies, template_id, label = _two_test_images_one_labelled(tmp_path)
    result = _in_process(tmp_path, "refused_template", datalist_path, studies, template_id, label)
    status, detail = result["refused"]
    assert status == 422, result
    assert f"label of image {template_id!r} refused as a template: ValueError: {template_id}: " in detail, detail
    assert "the pipeline's own refusal" in detail, detail
    status, detail = result["internal"]
    assert status == 500 and "failed: RuntimeError: an internal fault" in detail, result
    for _, detail in (result["refused"], result["internal"]):
        assert "applying transform" not in detail and " at 0x" not in detail and str(tmp_path) not in detail
    assert [t["image"] for t in result["after"]] == [template_id]


def _cli_evaluate_3d(datalist: dict, ckpt: Path, out: Path, *options: str) -> dict[str, list[float]]:
    """The bundle's 3D evaluation (one test image) from the command line, with ``options``: {landmark: [x, y, z]
    world mm}."""
    out.mkdir(parents=True)
    (out / "datalist.json").write_text(json.dumps(datalist))
    configs = config_files("evaluate", spatial_dims=3)
    command = [sys.executable, "-m", "monai.bundle", "run", "evaluating", "--config_file", json.dumps(configs)]
    command += ["--datalist", str(out / "datalist.json"), "--ckpt_path", str(ckpt), "--output_dir", str(out / "eval")]
    # the app matches without 3D matching's guard (it weighs no validation volumes): the command's auto, off
    command += ["--contrast_adaptation", "false", *options]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "eval" / "predictions.csv") as f:
        return {r["landmark"]: [float(r[a]) for a in "xyz"] for r in csv.DictReader(f)}


def test_ct_volumes_are_served_with_the_3d_configs(tmp_path):
    """A 3D datalist: the app takes the bundle's 3D configs. Its suggestions equal the bundle's 3D evaluation
    with the datalist's template, then with a saved label as the template (k-shot from the datastore); the
    train task fine-tunes on the volumes and trains a 3D detector that the infer task then serves (in-process,
    tests/monailabel_inprocess.py)."""
    import torch
    from bundle.data.embedded import open_datalist
    from bundle.data.markups import ControlPoint, write_mrk_json
    from bundle.data.synthetic import generate_synthetic_3d
    from bundle.networks.contrastive import ContrastiveLandmarkNet

    datalist_path = generate_synthetic_3d(tmp_path / "data", n_training=2, n_validation=1, n_test=2)
    content = open_datalist(datalist_path)
    torch.manual_seed(0)
    ckpt = tmp_path / "net3d.pt"
    torch.save(ContrastiveLandmarkNet(spatial_dims=3).state_dict(), ckpt)
    studies = tmp_path / "studies"
    studies.mkdir()
    target, template = content["test"]
    for item in (target, template):
        shutil.copy(item["image"], studies)
    names = content["landmark_names"]
    # the saved label's points as a clinician may type them: another case, a trailing blank (matched all the same)
    label = write_mrk_json(
        tmp_path / "template.mrk.json",
        [ControlPoint(f"{n.upper()} ", tuple(p)) for n, p in zip(names, template["landmarks"])],
    )
    template_id = Path(template["image"]).name.split(".")[0]
    target_label = write_mrk_json(
        tmp_path / "target.mrk.json", [ControlPoint(n, tuple(p)) for n, p in zip(names, target["landmarks"])]
    )
    result = _in_process(tmp_path, "ct", datalist_path, ckpt, studies, template_id, label, target_label)
    assert result["image"] == Path(target["image"]).name.split(".")[0]
    missing = tmp_path / "work" / "missing.pt"
    assert result["missing_weights"].startswith(f"no network weights at {missing}: give --conf ckpt_path (3D: ")

    references = {
        "bundle": _cli_evaluate_3d(dict(content, test=[target]), ckpt, tmp_path / "cli_bundle"),
        # the app matches from its saved labels as they are: no pseudo-templates from the datastore's images
        "saved_label": _cli_evaluate_3d(
            dict(content, test=[target], template=template), ckpt, tmp_path / "cli_label", "--pseudo_templates", "0"
        ),
    }
    assert result["saved_label"]["templates"] == [{"image": template_id, "source": "datastore"}]
    assert result["bundle"]["templates"][0]["source"] == "bundle"
    for case, reference in references.items():
        served = result[case]["landmarks"]
        for name in names:
            assert served[name] == pytest.approx(reference[name], abs=1e-3), (case, name)
        # the point list is in world RAS mm, as the landmarks
        points = {p["label"]: p["position"] for p in result[case]["markups"]["markups"][0]["controlPoints"]}
        assert result[case]["markups"]["markups"][0]["coordinateSystem"] == "RAS"
        for name in names:
            assert points[name] == pytest.approx(served[name], abs=1e-6), (case, name)
    stats = result["train"]
    assert stats["train"]["images"] == 2 and stats["train"]["labelled"] == 1, stats
    assert np.isfinite(stats["eval"]["metrics"]["mre_trained"]), stats
    stats = result["detector_train"]
    assert stats["network"] == "detector" and stats["published"] is True, stats
    assert np.isfinite(stats["eval"]["metrics"]["mre_trained"]), stats
    detector = result["detector"]
    assert detector["predictor"] == "detector" and detector["templates"] == []
    assert all(np.isfinite(detector["landmarks"][name]).all() for name in names)


CEPHALOGRAM = ROOT.parent / "shared" / "data" / "hamedan_ceph" / "images" / "001.png"


def test_default_serves_the_shipped_cephalometric_model(tmp_path):
    """Started without ``--conf datalist``, the server serves what ``inferring`` takes without a datalist: the
    detector shipped beside the built-in templates (``models/finetune``), for their 19 landmark names; a request's
    ``predictor: templates`` matches from the built-in templates as ``inferring --pipeline templates`` does, and a
    saved label joins them (a real cephalogram when ../shared/data is there, else a synthetic image). Training is
    refused until 2 images are labelled, naming the count. After the save, auto's choice is made in the background
    by scores that the server's own suggestions for the labelled image reproduce."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d
    from bundle.template_file import load_template

    builtin = load_template(ROOT / "models" / "template_features.pt")
    image = CEPHALOGRAM
    if not image.is_file():
        image = Path(open_datalist(generate_synthetic_2d(tmp_path / "data"))["test"][0]["image"])
    studies = tmp_path / "studies"
    studies.mkdir()
    shutil.copy(image, studies)
    with app_server(tmp_path, studies) as running:
        assert running["info"]["models"]["landmarks"]["labels"] == {
            n: i + 1 for i, n in enumerate(builtin["landmark_names"])
        }
        assert len(builtin["landmark_names"]) == 19
        _, reply = running["client"].infer("landmarks", image.stem, {})
        assert reply["landmark_names"] == builtin["landmark_names"]
        assert reply["predictor"] == "detector" and reply["templates"] == [], reply
        assert reply["checkpoint"] == "model.pt" and reply["checkpoint_source"] == "shipped"
        if image == CEPHALOGRAM:  # the detector's confidence: high on it, low on it inverted (a MONOCHROME1 export)
            assert reply["detector_peak"] > 0.3 and "warning" not in reply, reply
            Image.open(image).convert("L").point(lambda v: 255 - v).save(tmp_path / "inverted.png")
            _, inverted = running["client"].infer("landmarks", "", {}, file=str(tmp_path / "inverted.png"))
            assert inverted["detector_peak"] < 0.1 and "the detector's heatmap peaks average" in inverted["warning"]
        expected = cli_predictions(image, None, tmp_path / "cli_auto", pipeline="auto")
        for name in builtin["landmark_names"]:
            np.testing.assert_allclose(reply["landmarks"][name], expected[name], atol=1e-3, err_msg=name)
        _, matched = running["client"].infer("landmarks", image.stem, {"predictor": "templates"})
        assert {t["source"] for t in matched["templates"]} == {"built-in"} and matched["predictor"] == "templates"
        assert matched["checkpoint"] == "model.pt" and matched["checkpoint_source"] == "shipped"
        assert matched["template"] == [Path(s).name for s in builtin["sources"]]
        expected = cli_predictions(image, None, tmp_path / "cli")
        for name in builtin["landmark_names"]:
            np.testing.assert_allclose(matched["landmarks"][name], expected[name], atol=1e-3, err_msg=name)
        assert matched["detector_peak"] is None
        if image == CEPHALOGRAM:  # the matches' confidence: above the templates' agreement on it, below inverted
            assert matched["match_score"] > 0.6 and "warning" not in matched, matched
            _, inverted = running["client"].infer(
                "landmarks", "", {"predictor": "templates"}, file=str(tmp_path / "inverted.png")
            )
            assert inverted["match_score"] < 0.45 and "its matches with the templates score" in inverted["warning"]
        reply, status = request_json(
            f"{running['base']}/train/landmarks?run_sync=false",
            json.dumps({"epochs": 1}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 422 and "at least 2 labelled images" in reply["detail"] and "has 0 labelled" in reply["detail"]
        # a saved label joins the built-in templates (they fit the served shipped weights): matched from an upload
        # (a datastore image is never its own template), the label first, then the built-in ones
        # (the matched points moved by (6, -4) pixels: a label that no candidate reproduces exactly)
        label_points = {image.stem: [np.add(expected[n], (6.0, -4.0)).tolist() for n in builtin["landmark_names"]]}
        label = mrk_json(tmp_path / "label.mrk.json", builtin["landmark_names"], label_points[image.stem])
        running["client"].save_label(image.stem, str(label), tag="final")
        _, joined = running["client"].infer("landmarks", "", {"predictor": "templates"}, file=str(image))
        assert joined["templates"] == [{"image": image.stem, "source": "datastore"}] + [
            {"image": Path(s).name, "source": "built-in"} for s in builtin["sources"]
        ]
        # the first suggestion after the save is served as before it, and starts auto's choice in the background
        _, served = running["client"].infer("landmarks", "", {}, file=str(image))
        assert served["predictor"] == "detector" and served["templates"] == [] and served["predictor_choice"] is None
        assert served["pending"] == ["predictor_choice"]
        # the choice's scores are the errors of the server's own suggestions for the labelled image
        choice = _settled(running["client"], str(image), 1)["predictor_choice"]
        assert choice["scored_on"] == [image.stem] and choice["units"] == "pixels"
        assert set(choice["mre"]) == {"detector", "templates_builtin"}  # not the one label alone: nothing to match
        for candidate, predictor in (("detector", "detector"), ("templates_builtin", "templates")):
            served_mre = _served_error(
                running["client"], [image.stem], label_points, builtin["landmark_names"], predictor
            )
            assert choice["mre"][candidate] == pytest.approx(served_mre, rel=1e-4), candidate


def _settled(client, image: str, labels: int, timeout_s: float = 180) -> dict:
    """An upload's suggestion once the app's background work for ``labels`` saved labels is done (no ``pending``;
    auto's choice, when it has one, made for that many)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, reply = client.infer("landmarks", "", {}, file=image)
        choice = reply["predictor_choice"]
        if not reply["pending"] and (choice is None or choice["labels"] == labels):
            return reply
        assert time.monotonic() < deadline, f"still pending after {timeout_s} s: {reply['pending']}"
        time.sleep(3)


def _served_error(client, image_ids: list[str], labels: dict, names: list[str], predictor: str) -> float:
    """Mean radial error (pixels) of the server's suggestions for datastore images (their own label is never their
    template) by ``predictor``, against ``labels`` (id -> pixel landmarks)."""
    errors = []
    for image_id in image_ids:
        _, reply = client.infer("landmarks", image_id, {"predictor": predictor})
        errors += [np.linalg.norm(np.subtract(reply["landmarks"][n], p)) for n, p in zip(names, labels[image_id])]
    return float(np.mean(errors))


def test_auto_serves_what_the_saved_labels_show_best_on_another_site(tmp_path):
    """Cephalograms of another site (``prepare_data mirrored``: mirrored and exposed otherwise), which the shipped
    detector and the built-in templates miss, on the default server: after one saved label, auto serves matching from
    it alone with its pseudo-templates (the unlabelled datastore images), far better than the detector; after two,
    the candidate with the lowest error on them, by scores that the server's own suggestions (the detector) and the
    command line (matching with pseudo-templates, leave-one-out) reproduce. Skipped without ../shared/data."""
    if not CEPHALOGRAM.is_file():
        pytest.skip("no ../shared/data/hamedan_ceph")
    from bundle.data.datalist import load_datalist, save_datalist
    from bundle.template_file import load_template
    from scripts.prepare_data import hamedan_protocol, mirrored

    protocol = load_datalist(hamedan_protocol(CEPHALOGRAM.parents[1], tmp_path / "protocol.json"))
    builtin = {Path(s).stem for s in load_template(ROOT / "models" / "template_features.pt")["sources"]}
    chosen = [it for it in protocol["training"] if it.get("landmarks") and Path(it["image"]).stem not in builtin]
    names = list(protocol["landmark_names"])
    save_datalist({"spatial_dims": 2, "landmark_names": names, "training": chosen[:5]}, tmp_path / "five.json")
    mirrored(str(tmp_path / "five.json"), str(tmp_path / "site"))
    site = load_datalist(tmp_path / "site" / "datalist.json")["training"]
    studies = tmp_path / "studies"
    studies.mkdir()
    for item in site[:4]:  # two to label, two unlabelled
        shutil.copy(item["image"], studies)
    labels = {Path(it["image"]).stem: it["landmarks"] for it in site}
    first, second = (Path(it["image"]).stem for it in site[:2])
    upload = site[4]["image"]
    with app_server(tmp_path, studies) as running:
        client = running["client"]
        client.save_label(first, str(mrk_json(tmp_path / "first.mrk.json", names, labels[first])), tag="final")
        reply = _settled(client, upload, 1)
        choice = reply["predictor_choice"]
        assert choice["predictor"] == "templates" and choice["builtin_templates"] is False, choice
        assert "one saved label" in choice["reason"] and set(choice["mre"]) == {"detector", "templates_builtin"}
        assert reply["predictor"] == "templates" and reply["templates"][0] == {"image": first, "source": "datastore"}
        assert {t["source"] for t in reply["templates"][1:]} == {"pseudo"}, reply["templates"]
        upload_label = {"upload": site[4]["landmarks"]}

        def upload_error(predictor: str) -> float:
            _, answer = client.infer("landmarks", "", {"predictor": predictor}, file=upload)
            found = [answer["landmarks"][n] for n in names]
            return float(np.mean(np.linalg.norm(np.subtract(found, upload_label["upload"]), axis=-1)))

        assert upload_error("auto") < 0.25 * upload_error("detector")
        # the labelled image itself, which is never its own template: the built-in templates stand in
        _, own = client.infer("landmarks", first, {})
        assert own["predictor"] == "templates" and {t["source"] for t in own["templates"]} == {"built-in"}

        client.save_label(second, str(mrk_json(tmp_path / "second.mrk.json", names, labels[second])), tag="final")
        choice = _settled(client, upload, 2)["predictor_choice"]
        assert set(choice["mre"]) == {"detector", "templates_builtin", "templates"} and choice["scored_on"] == [
            second,
            first,
        ]
        best = min(choice["mre"], key=choice["mre"].get)
        assert choice["predictor"] == ("detector" if best == "detector" else "templates")
        assert choice["builtin_templates"] == (choice["mre"]["templates_builtin"] <= choice["mre"]["templates"])
        served_mre = _served_error(client, [second, first], labels, names, "detector")
        assert choice["mre"]["detector"] == pytest.approx(served_mre, rel=1e-4)
    # matching from the saved labels alone is scored as an unlabelled image would get it: the command line's
    # inference from the other label and its pseudo-templates among the datastore's unlabelled images
    unlabelled = [{"image": str(studies / Path(it["image"]).name)} for it in site[2:4]]
    errors = []
    for scored, other in ((second, first), (first, second)):
        template = {"image": str(studies / f"{other}.png"), "landmarks": labels[other]}
        datalist = _command_datalist(tmp_path / f"loo_{scored}.json", names, [template], unlabelled)
        found = cli_predictions(studies / f"{scored}.png", datalist, tmp_path / f"cli_{scored}")
        errors += [np.linalg.norm(np.subtract(found[n], p)) for n, p in zip(names, labels[scored])]
    assert choice["mre"]["templates"] == pytest.approx(float(np.mean(errors)), rel=1e-4)


def _cli_evaluation(datalist: Path, out: Path) -> dict:
    """The bundle's evaluating command on ``datalist`` (its defaults): its metrics.json."""
    command = [sys.executable, "-m", "monai.bundle", "run", "evaluating", "--config_file"]
    command += [
        json.dumps(config_files("evaluate")),
        "--datalist",
        datalist,
        "--output_dir",
        out,
        "--overlays",
        "false",
    ]
    run_checked(command, ROOT, timeout=300)
    return json.loads((out / "metrics.json").read_text())


def _command_datalist(path: Path, names: list, templates: list, unlabelled: list, test: list = ()) -> Path:
    """A datalist of saved labels as ``templates`` and the unlabelled datastore images as ``training`` (the
    command line's view of the app's datastore)."""
    content = {"spatial_dims": 2, "landmark_names": names, "templates": templates, "training": unlabelled}
    path.write_text(json.dumps({**content, "test": list(test)} if test else content))
    return path


def test_few_saved_labels_get_pseudo_templates_as_the_commands_make_them(tmp_path):
    """With the app's default keys and unlabelled datastore images: the first suggestion after a saved label matches
    the label alone and starts the pseudo-templates in the background; once they are ready, an upload's suggestion
    and its pseudo-templates are those of ``inferring --datalist`` on the same label and unlabelled images. With two
    labels, the detector training scores template matching on its held-out label as the evaluating command scores
    it from the other label and its pseudo-templates."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=4, n_validation=0, n_test=1, seed=5)
    datalist = open_datalist(datalist_path)
    studies = tmp_path / "studies"
    studies.mkdir()
    for item in [datalist["template"], *datalist["training"]]:
        shutil.copy(item["image"], studies)
    names = list(datalist["landmark_names"])
    # the saved labels: the template, then a training image; the upload is not in the datastore
    saved = [(Path(it["image"]).stem, it["landmarks"]) for it in (datalist["template"], datalist["training"][0])]
    upload = Path(datalist["test"][0]["image"])
    unlabelled = sorted(Path(it["image"]).stem for it in datalist["training"])

    def item(stem: str, landmarks: list | None = None) -> dict:
        return {"image": str(studies / f"{stem}.png"), **({"landmarks": landmarks} if landmarks else {})}

    with app_server(tmp_path, studies, "datalist", str(datalist_path)) as running:
        client = running["client"]
        client.save_label(saved[0][0], str(mrk_json(tmp_path / "label0.mrk.json", names, saved[0][1])), tag="final")
        _, first = client.infer("landmarks", "", {}, file=str(upload))
        assert first["templates"] == [{"image": "template", "source": "datastore"}], first["templates"]
        deadline = time.monotonic() + 120
        while True:
            _, reply = client.infer("landmarks", "", {}, file=str(upload))
            if any(t["source"] == "pseudo" for t in reply["templates"]) or time.monotonic() > deadline:
                break
            time.sleep(2)
        pseudo = [t["image"] for t in reply["templates"] if t["source"] == "pseudo"]
        assert reply["templates"][0] == {"image": "template", "source": "datastore"}
        assert sorted(pseudo) == unlabelled, (reply["templates"], running["log"].read_text()[-3000:])
        one_label = _command_datalist(
            tmp_path / "one.json", names, [item(*saved[0])], [item(stem) for stem in unlabelled]
        )
        expected = cli_predictions(upload, one_label, tmp_path / "cli")
        provenance = json.loads((tmp_path / "cli" / "provenance.json").read_text())
        assert [Path(p).stem for p in provenance["pseudo_templates"]] == pseudo
        for name in names:
            np.testing.assert_allclose(reply["landmarks"][name], expected[name], atol=1e-3, err_msg=name)

        client.save_label(saved[1][0], str(mrk_json(tmp_path / "label1.mrk.json", names, saved[1][1])), tag="final")
        client.train_start("landmarks", {**DETECTOR_TRAIN, "min_improvement": 1e9})
        status = wait_training(running)
        assert status["status"] == "DONE", f"{status}\n{running['log'].read_text()[-4000:]}"
        stats = client.info()["train_stats"]["landmarks"]
    (held,) = stats["train"]["held_out"]
    (other,) = [label for label in saved if label[0] != held]
    two_labels = _command_datalist(
        tmp_path / "two.json",
        names,
        [item(*other)],
        [item(stem) for stem in unlabelled if stem != saved[1][0]],
        test=[item(held, dict(saved)[held])],
    )
    metrics = _cli_evaluation(two_labels, tmp_path / "evaluation")
    assert len(metrics["pseudo_templates"]) == len(unlabelled) - 1  # every unlabelled image (fewer than 20)
    assert stats["eval"]["metrics"]["mre_served"] == pytest.approx(metrics["mre_mm"], abs=1e-3)  # spacing 1: pixels


def test_labels_loop_drives_the_server_through_the_annotation_loop(tmp_path):
    """``python -m scripts.experiments.labels_loop`` on the real cephalograms (skipped without ../shared/data): the
    default server, two labels saved one step at a time, a detector training, the held-out uploads scored; the saved
    labels join the built-in templates and the results file holds every step."""
    if not CEPHALOGRAM.is_file():
        pytest.skip("no ../shared/data/hamedan_ceph")
    from scripts.experiments.labels_loop import run
    from scripts.prepare_data import hamedan_protocol

    datalist = hamedan_protocol(CEPHALOGRAM.parents[1], tmp_path / "protocol.json")
    result = run(datalist, str(tmp_path / "loop"), steps=[1, 2], heldout=1, train=TINY_TRAIN, threads=1)
    rows = json.loads(Path(result).read_text())["rows"]
    assert [(r["labels"], r["stage"]) for r in rows] == [
        (0, "start"),
        (1, "labels saved"),
        (2, "labels saved"),
        (2, "trained"),
    ]
    # the shipped detector is served throughout: the candidate continued from it is kept out (one image held out)
    assert all(r["predictor"] == "detector" and r["templates"] == [] for r in rows)
    assert len({r["mre_mm"] for r in rows}) == 1
    assert all(0 < r["mre_mm"] < 10 and r["landmarks_scored"] == 19 for r in rows)
    assert rows[3]["published"] is False and rows[3]["held_out"]
    assert (tmp_path / "loop" / "learning_curve.png").stat().st_size > 0
