"""MONAI Label: a real server on 127.0.0.1 runs the annotation loop of the app (apps/monailabel).

One server (module fixture, ``--conf device cpu``) over 4 synthetic images serves every test, in file order:
suggestions on an upload (equal to the bundle's command line), image ids confined to the datastore, a junk upload
refused without a leftover temporary file, every datastore route taking names, not paths (nothing written or
deleted outside the studies folder, links pointing out refused), labels off their image refused naming the
landmark and a bad stored one skipped, infer request faults answered 4xx, replies naming no server path, the
``first`` / ``last`` strategies, saved labels becoming the k-shot templates, bad training values (a negative
margin among them) refused naming the key, fine-tuning that keeps the served model when the new one is not
better (and publishes it when asked, keeping the previous one dated), ``train_stats`` in ``/info/``, a DICOM
X-ray giving the PNG's landmarks, and the stage-2 detector trained on the saved labels (refused with too few
labels, kept out when not better, served by the infer task once published). Calls go through MONAI Label's own client
(``monailabel.client.MONAILabelClient``) and raw HTTP where the client has no call or hides the status.

Needs the app's environment (``make monailabel`` -> ``.venv-monailabel``, or ``MONAILABEL_PYTHON``);
without it the module is skipped, except under CI where it must run.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from bundle.configs import config_files
from PIL import Image
from scripts.monailabel_server import MONAILABEL_PYTHON, client_classes, serving

pytestmark = pytest.mark.slow  # a MONAI Label server per module, trainings through it
ROOT = Path(__file__).resolve().parents[1]
PYTHON = MONAILABEL_PYTHON
START_TIMEOUT_S = 120
TRAIN_TIMEOUT_S = 180
TINY_TRAIN = {
    "epochs": 1,
    "epoch_length": 1,
    "batch_size": 1,
    "image_size": [64, 64],
    "crop_size": [32, 32],
    "num_queries": 4,
}

if not PYTHON.is_file():
    if os.environ.get("CI"):
        pytest.fail(f"no MONAI Label environment at {PYTHON}: run `make monailabel` before the tests", pytrace=False)
    pytest.skip(f"no MONAI Label environment at {PYTHON} (make monailabel)", allow_module_level=True)


MONAILabelClient, MONAILabelClientException = client_classes(PYTHON)


def _request(
    url: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 120, method: str | None = None
):
    """JSON reply and status of one HTTP call; 4xx/5xx come back as (detail JSON, status) instead of raising."""
    req = urllib.request.Request(
        url, data=data, headers=headers or {}, method=method or ("POST" if data is not None else "GET")
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return json.loads(response.read()), response.status
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return json.loads(body), e.code
        except ValueError:
            return {"detail": body.decode(errors="replace")}, e.code


def _multipart(field: str, path: Path, filename: str | None = None) -> tuple[bytes, dict]:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename or path.name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + path.read_bytes()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def _checked(command: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``command`` run to its end with one OpenMP thread; its failure is the test's, with its stderr's tail."""
    done = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _cli_predictions(image: Path, datalist: Path | None, out: Path, *args: str) -> dict[str, tuple[float, float]]:
    """The bundle's own command-line inference on ``image`` (the reference the server must match), with the
    templates of ``datalist`` (None: the built-in ones) and the further command-line ``args``."""
    command = [
        sys.executable,
        "-m",
        "monai.bundle",
        "run",
        "inferring",
        "--config_file",
        "configs/inference.yaml",
        *(["--datalist", str(datalist)] if datalist else []),  # the server's template
        "--images",
        f"['{image}']",
        "--output_dir",
        str(out),
        "--overlays",
        "False",
        *args,
    ]
    _checked(command, ROOT, timeout=180)
    with open(out / "predictions.csv") as f:
        return {r["landmark"]: (float(r["x"]), float(r["y"])) for r in csv.DictReader(f)}


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
    _checked(command, ROOT, timeout=300)
    return json.loads((out / "metrics.json").read_text())


def _mrk_json(path: Path, names: list[str], points: list) -> Path:
    """A Slicer point list over a PNG: pixel (x, y) at LPS (x, y, 0)."""
    from bundle.data.markups import ControlPoint, write_mrk_json

    return write_mrk_json(
        path,
        [ControlPoint(n, None if p is None else (-p[0], -p[1], 0.0)) for n, p in zip(names, points)],
        coordinate_system="LPS",
    )


@contextmanager
def _serving(tmp_path: Path, studies: Path, *conf: str) -> Iterator[dict]:
    """``scripts.monailabel_server.serving`` (one thread), a start that fails being the test's failure."""
    try:
        with serving(tmp_path, studies, conf, PYTHON, threads=1, start_timeout_s=START_TIMEOUT_S) as running:
            yield running
    except RuntimeError as e:
        if "did not start" not in str(e):
            raise
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The module's server over 4 synthetic test images (the synthetic set in a temp dir too, given to the server
    as its datalist)."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    tmp_path = tmp_path_factory.mktemp("monailabel")
    datalist_path = generate_synthetic_2d(tmp_path / "data")
    datalist = open_datalist(datalist_path)
    studies = tmp_path / "studies"
    studies.mkdir()
    truth = {}
    for item in datalist["test"][:4]:
        shutil.copy(item["image"], studies)
        truth[Path(item["image"]).stem] = item["landmarks"]
    # pseudo-templates off: the tests below see the saved labels alone as templates (they are tested on their own)
    with _serving(tmp_path, studies, "datalist", str(datalist_path), "pseudo_templates", "0") as running:
        yield {
            **running,
            "studies": studies,
            "truth": truth,
            "names": list(datalist["landmark_names"]),
            "work": tmp_path,
            "datalist": datalist_path,
        }


def _infer_id(server, image_id: str):
    return _request(
        f"{server['base']}/infer/landmarks?image={urllib.request.quote(image_id, safe='')}&output=json", b""
    )


def _wait_training(server) -> dict:
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        status = server["client"].train_status()
        if isinstance(status, dict) and status.get("status") in ("DONE", "ERROR"):
            return status
        time.sleep(1)
    pytest.fail(f"training did not end in {TRAIN_TIMEOUT_S} s\n{server['log'].read_text()[-4000:]}")


def test_start_is_light_and_lists_the_tasks(server):
    info = server["info"]
    assert "landmarks" in info["models"] and "landmarks" in info["trainers"]
    assert {"random", "first", "last"} <= set(info["strategies"])
    # nothing heavy at start: the bundle's templates are resolved on the first request that needs them
    assert not (server["app"] / "model" / "bundle_templates.json").exists()
    assert server["start_s"] < START_TIMEOUT_S


def test_upload_suggests_the_bundle_command_line_landmarks(server):
    names = server["info"]["models"]["landmarks"]["labels"]
    image = sorted(server["studies"].glob("*.png"))[0]
    out, result = server["client"].infer("landmarks", "", {}, file=str(image))
    # the server's datalist templates, without pseudo-templates as the module's server is configured
    reference = _cli_predictions(image, server["datalist"], server["work"] / "cli", "--pseudo_templates", "0")
    assert list(result["landmarks"]) == list(names) == list(reference)
    for name in names:
        assert result["landmarks"][name] == pytest.approx(reference[name], abs=1e-3), name
    # no saved label yet: the bundle's template(s); the result file is the Slicer point list
    assert result["templates"] and all(t["source"] == "bundle" for t in result["templates"])
    assert json.loads(Path(out).read_text()) == result["markups"]
    for i, name in enumerate(names):  # OHIF-style centroids: 1-based index, then rounded pixel indices
        x, y = result["landmarks"][name]
        assert result["centroids"][name] == [str(i + 1), str(round(x)), str(round(y)), "0"]
    markup = result["markups"]["markups"][0]  # a PNG's pixel (x, y) is LPS (x, y, 0) in Slicer (spacing 1)
    assert markup["type"] == "Fiducial" and markup["coordinateSystem"] == "LPS"
    for point in markup["controlPoints"]:
        assert point["position"] == pytest.approx([*result["landmarks"][point["label"]], 0.0], abs=1e-6)
    assert (server["app"] / "model" / "bundle_templates.json").is_file()  # resolved once, now cached
    # the upload and the result file are gone (the result file once the reply is sent: MONAI Label removes it then)
    deadline = time.monotonic() + 30
    while list(server["tmp"].glob("landmarks-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(server["tmp"].glob("landmarks-*")) == []


@pytest.mark.parametrize(
    "image",
    [
        "OUTSIDE",  # a real image outside --studies: the synthetic set's test_005.png
        "../../etc/passwd",
        "/etc/passwd",
        "test_000/../../x",
        "no_such_image",
    ],
)
def test_image_ids_are_confined_to_the_datastore(server, image):
    if image == "OUTSIDE":
        image = str(Path(server["datalist"]).parent / "images" / "test_005.png")
        assert Path(image).is_file()
    reply, status = _infer_id(server, image)
    assert 400 <= status < 500, (status, reply)
    assert image in reply["detail"] and ("datastore" in reply["detail"])
    with pytest.raises(MONAILabelClientException, match="Status: 4"):
        server["client"].infer("landmarks", image, {})
    # params cannot smuggle a path either
    with pytest.raises(MONAILabelClientException, match="Status: 4"):
        server["client"].infer("landmarks", "test_000", {"image": image})


def test_datastore_image_id_is_inferred(server):
    reply, status = _infer_id(server, "test_001")
    assert status == 200, reply
    assert all(v is not None for v in reply["landmarks"].values())


def test_junk_upload_is_refused_naming_it_and_leaves_no_file(server, tmp_path):
    junk = tmp_path / "scan_17.png"
    junk.write_bytes(os.urandom(300_000))
    # files that appeared in the server's temp dir (an earlier reply's file may still be removed meanwhile)
    before = {p.name for p in server["tmp"].iterdir()}
    new_files = lambda: sorted({p.name for p in server["tmp"].iterdir()} - before)  # noqa: E731
    reply, status = _request(f"{server['base']}/infer/landmarks?output=json", *_multipart("file", junk))
    assert 400 <= status < 500, reply
    assert "scan_17.png" in reply["detail"] and "cannot read image" in reply["detail"]
    assert new_files() == []
    # the datastore refuses it too, and keeps no copy
    with pytest.raises(MONAILabelClientException, match="Status: 422"):
        server["client"].upload_image(str(junk), "scan_17")
    assert "scan_17" not in json.dumps(server["client"].datastore())
    assert new_files() == []


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (links not followed) with its content; a link as its target."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            f = Path(root) / name
            out[str(f.relative_to(path))] = os.readlink(f).encode() if f.is_symlink() else f.read_bytes()
    return out


def _form(url: str, method: str, **fields: str):
    body = urllib.parse.urlencode(fields).encode()
    return _request(url, body, {"Content-Type": "application/x-www-form-urlencoded"}, method=method)


# (method, route and query, upload field): VICTIM is a file outside the studies folder, given without its suffix
NAMES_NOT_PATHS = [
    ("PUT", "/datastore/image?image=VICTIM", "file"),  # overwrote VICTIM.png
    ("DELETE", "/datastore/image?id=VICTIM", None),  # deleted it once the PUT had registered it
    ("PUT", "/datastore/image?image=../evil_img", "file"),  # wrote beside the studies folder
    ("PUT", "/datastore/image?image=..", "file"),
    ("PUT", "/datastore/image?image=sub\\evil", "file"),
    ("PUT", "/datastore/image?image=.hidden", "file"),
    ("PUT", "/datastore/image?image=datastore_v2", "json"),  # an image must be an image format
    ("DELETE", "/datastore/image?id=", None),
    ("PUT", "/datastore/label?image=test_001&tag=../../../secret/evil_tag", "label"),  # wrote a label outside
    ("PUT", "/datastore/label?image=VICTIM&tag=final", "label"),
    ("PUT", "/datastore/label?image=test_001&tag=.", "label"),
    ("DELETE", "/datastore/label?id=test_000&tag=../..", None),
    ("DELETE", "/datastore/label?id=VICTIM&tag=final", None),
    ("GET", "/datastore/image?image=VICTIM", None),
    ("HEAD", "/datastore/image?image=VICTIM", None),
    ("GET", "/datastore/label?label=test_000&tag=../../x", None),
    ("GET", "/datastore/image/info?image=VICTIM", None),
    ("GET", "/datastore/label/info?label=test_000&tag=../x", None),
    ("PUT", "/datastore/image/info?image=VICTIM", "info"),
    ("PUT", "/datastore/label/info?label=test_000&tag=../x", "info"),
    ("POST", "/infer/landmarks?image=VICTIM&output=json", None),
]


@pytest.mark.parametrize("method, route, field", NAMES_NOT_PATHS)
def test_datastore_takes_names_not_paths(server, tmp_path, method, route, field):
    """Ids, tags and upload names are names in the studies folder: anything else is refused 4xx naming it, and
    nothing is written or deleted, inside the studies folder or out of it."""
    victim = tmp_path / "victim.png"
    shutil.copy(server["studies"] / "test_000.png", victim)
    label = _mrk_json(tmp_path / "good.mrk.json", server["names"], server["truth"]["test_001"])
    query = route.replace("VICTIM", str(tmp_path / "victim"))
    path, _, params = query.partition("?")
    url = f"{server['base']}{path}?" + urllib.parse.urlencode(urllib.parse.parse_qsl(params, keep_blank_values=True))
    before = {
        "outside": _tree(tmp_path),
        "studies": _tree(server["studies"]),
        "work": sorted(os.listdir(server["work"])),
    }
    if field == "info":
        reply, status = _form(url, method, info="{}")
    elif field:
        upload = {"file": victim, "label": label, "json": label}[field]
        name = {"file": "x.png", "label": "x.mrk.json", "json": "x.json"}[field]
        reply, status = _request(url, *_multipart("label" if field == "label" else "file", upload, name), method=method)
    else:
        reply, status = _request(url, b"" if method in ("POST", "PUT") else None, method=method)
    assert 400 <= status < 500, (status, reply)
    value = dict(urllib.parse.parse_qsl(params, keep_blank_values=True))
    offending = [
        v for k, v in value.items() if k in ("image", "id", "tag") and v not in ("test_000", "test_001", "final")
    ]
    if method != "HEAD" and offending:  # a HEAD reply has no body
        assert repr(offending[0]) in reply["detail"], reply
    assert _tree(tmp_path) == before["outside"]
    assert _tree(server["studies"]) == before["studies"]
    assert sorted(os.listdir(server["work"])) == before["work"]
    assert not (server["studies"] / "labels" / "../../../secret").resolve().exists()


def test_files_linked_outside_the_studies_folder_are_refused(server, tmp_path):
    """A link in the studies folder that points outside it is neither written through, nor deleted through, nor
    served; the image behind it is not an image of the datastore."""
    studies, base = server["studies"], server["base"]
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "victim.png"
    shutil.copy(studies / "test_000.png", victim)
    victim_label = _mrk_json(tmp_path / "outside" / "victim.mrk.json", server["names"], server["truth"]["test_002"])
    outside = _tree(tmp_path / "outside")
    label = _mrk_json(tmp_path / "x.mrk.json", server["names"], server["truth"]["test_002"])
    # an image added through the server, then its file replaced by a link pointing out
    reply, status = _request(f"{base}/datastore/image?image=linked", *_multipart("file", victim, "x.png"), method="PUT")
    assert status == 200, reply
    (studies / "linked.png").unlink()
    (studies / "linked.png").symlink_to(victim)
    (studies / "labels" / "final" / "test_002.mrk.json").symlink_to(victim_label)
    try:
        reply, status = _request(f"{base}/datastore/image?id=linked", method="DELETE")
        assert status == 403 and "'linked'" in reply["detail"] and "outside" in reply["detail"], reply
        reply, status = _request(
            f"{base}/datastore/image?image=linked", *_multipart("file", victim, "x.png"), method="PUT"
        )
        assert status == 403, reply
        reply, status = _request(
            f"{base}/datastore/label?image=test_002&tag=final", *_multipart("label", label), method="PUT"
        )
        assert status == 403 and "'test_002'" in reply["detail"], reply
        assert _request(f"{base}/datastore/image?image=linked")[1] == 404  # not served
        assert _infer_id(server, "linked")[1] == 404
        assert _tree(tmp_path / "outside") == outside
    finally:
        (studies / "labels" / "final" / "test_002.mrk.json").unlink()
        (studies / "linked.png").unlink()
        shutil.copy(studies / "test_000.png", studies / "linked.png")
    reply, status = _request(f"{base}/datastore/image?id=linked", method="DELETE")  # a plain file again: removed
    assert status == 200, reply
    assert sorted(server["client"].datastore()["objects"]) == ["test_000", "test_001", "test_002", "test_003"]


def _bad_label(path: Path, names: list[str], points: list, position) -> Path:
    """A Slicer point list: ``points`` (pixels, LPS), its first landmark at ``position`` as written."""
    control = [{"label": n, "position": [-p[0], -p[1], 0.0]} for n, p in zip(names, points)]
    control[0]["position"] = position
    markup = {"type": "Fiducial", "coordinateSystem": "RAS", "controlPoints": control}
    path.write_text(json.dumps({"markups": [markup]}))
    return path


@pytest.mark.parametrize(
    "position, why",
    [
        ([-50000.0, 70000.0, 0.0], "lies outside the image"),  # pixel (50000, -70000)
        ([float("nan"), 1.0, 0.0], "finite"),
        ([True, 1.0, 0.0], "finite"),
        ([1.0, 2.0], "3 finite numbers"),
        ("here", "3 finite numbers"),
    ],
)
def test_a_label_off_the_image_is_refused_naming_the_landmark(server, tmp_path, position, why):
    name = server["names"][0]
    bad = _bad_label(tmp_path / "bad.mrk.json", server["names"], server["truth"]["test_001"], position)
    reply, status = _request(
        f"{server['base']}/datastore/label?image=test_001&tag=final", *_multipart("label", bad), method="PUT"
    )
    assert status == 422, reply
    assert repr(name) in reply["detail"] and "'test_001'" in reply["detail"] and why in reply["detail"], reply
    assert str(tmp_path) not in reply["detail"] and str(server["tmp"]) not in reply["detail"]
    assert server["client"].datastore()["objects"]["test_001"]["labels"] == {}  # nothing stored


def test_a_bad_stored_label_is_skipped_naming_it(server, tmp_path):
    """A label already in the datastore that lies off its image (saved by an earlier server) is skipped with a
    warning naming it: inference goes on without it."""
    good = _mrk_json(tmp_path / "good.mrk.json", server["names"], server["truth"]["test_002"])
    server["client"].save_label("test_002", str(good), tag="final")
    stored = server["studies"] / "labels" / "final" / "test_002.mrk.json"
    _bad_label(stored, server["names"], server["truth"]["test_002"], [-50000.0, 70000.0, 0.0])
    try:
        reply, status = _infer_id(server, "test_001")
        assert status == 200, reply
        # the only saved label is skipped: the bundle's templates alone (its template and pseudo-templates)
        assert {t["source"] for t in reply["templates"]} == {"bundle"}
        assert "saved label skipped: label of image 'test_002'" in server["log"].read_text()
    finally:
        reply, status = _request(f"{server['base']}/datastore/label?id=test_002&tag=final", method="DELETE")
        assert status == 200, reply


SLICER_SCHEMA = "https://raw.githubusercontent.com/slicer/slicer/master/Modules/Loadable/Markups/Resources/Schema/markups-schema-v1.0.3.json#"


def _slicer_roi_submission(path: Path, centers: list) -> Path:
    """The label file of 3D Slicer's MONAILabel module for a ``detection`` model, written as
    ``MONAILabelWidget.onGenerateJSONFromMulipltROIs`` writes it: one ROI markup (as ``slicer.util.saveNode`` saves
    an ROI node) per ROI node of the scene; point lists are not collected."""
    rois = [
        {
            "type": "ROI",
            "coordinateSystem": "LPS",
            "coordinateUnits": "mm",
            "locked": False,
            "fixedNumberOfControlPoints": False,
            "labelFormat": "%N-%d",
            "lastUsedControlPointNumber": 1,
            "roiType": "Box",
            "center": list(c),
            "orientation": [-1.0, -0.0, -0.0, -0.0, -1.0, -0.0, 0.0, 0.0, 1.0],
            "size": [10.0, 10.0, 1.0],
            "insideOut": False,
            "controlPoints": [{"id": "1", "label": "R-1", "position": list(c), "positionStatus": "defined"}],
        }
        for c in centers
    ]
    text = "{\n" + f' "@schema": "{SLICER_SCHEMA}",\n' + ' "markups": [\n'
    text += ",\n".join(f"  {json.dumps(r)}" for r in rois) + "]\n}"
    path.write_text(text)
    return path


def _slicer_point_list(path: Path, names: list[str], points: list) -> Path:
    """A point list as ``slicer.util.saveNode`` saves a moved vtkMRMLMarkupsFiducialNode over a PNG (LPS mm)."""
    control = [
        {
            "id": str(i + 1),
            "label": n,
            "description": "",
            "associatedNodeID": "vtkMRMLScalarVolumeNode1",
            "position": [p[0], p[1], 0.0],
            "orientation": [-1.0, -0.0, -0.0, -0.0, -1.0, -0.0, 0.0, 0.0, 1.0],
            "selected": True,
            "locked": False,
            "visibility": True,
            "positionStatus": "defined",
        }
        for i, (n, p) in enumerate(zip(names, points))
    ]
    markup = {
        "type": "Fiducial",
        "coordinateSystem": "LPS",
        "coordinateUnits": "mm",
        "locked": False,
        "fixedNumberOfControlPoints": False,
        "labelFormat": "%N-%d",
        "lastUsedControlPointNumber": len(names),
        "controlPoints": control,
        "measurements": [],
        "display": {"visibility": True, "opacity": 1.0, "color": [0.4, 1.0, 1.0]},
    }
    path.write_text(json.dumps({"@schema": SLICER_SCHEMA, "markups": [markup]}, indent=4))
    return path


def test_slicer_submit_label_of_points(server, tmp_path):
    """3D Slicer's MONAILabel module submits a detection model's label as ROI boxes only (its request replayed:
    the file as the module writes it, under a temporary ``.json`` name, with its params and no tag): the answer is
    422 giving the way that carries the points, and nothing is stored. That way (the console snippet's
    ``logic.save_label(image id, saved point list, {})``, which is the client's ``save_label``) stores the label."""
    client, names = server["client"], server["names"]
    truth = server["truth"]["test_002"]
    for centers in ([], [(-40.0, -50.0, 0.0), (-60.0, -70.0, 0.0)]):
        label_in = _slicer_roi_submission(tmp_path / f"tmp{uuid.uuid4().hex[:8]}.json", centers)
        with pytest.raises(MONAILabelClientException) as refused:
            client.save_label("test_002", str(label_in), params={"label_info": [], "model": "landmarks"})
        status, _, response = refused.value.msg.partition("; Response: ")
        detail = json.loads(response)["detail"]
        assert status == "Status: 422" and "'test_002'" in detail, detail
        assert f"holds {len(centers)} ROI box" in detail and "no point list" in detail
        assert "slicer.util.saveNode(n, p)" in detail and 'w.logic.save_label(w.current_sample["id"], p, {})' in detail
        assert "curl -X PUT '<server>/datastore/label?image=<image id>' -F 'label=@landmarks.mrk.json'" in detail
        assert client.datastore()["objects"]["test_002"]["labels"] == {}
    moved = [[x + 1.0, y - 2.0] for x, y in truth]
    points = _slicer_point_list(tmp_path / "landmarks.mrk.json", names, moved)
    try:
        client.save_label("test_002", str(points), params={})
        reply, status = _infer_id(server, "test_001")
        assert status == 200 and reply["templates"] == [{"image": "test_002", "source": "datastore"}], reply
    finally:
        reply, status = _request(f"{server['base']}/datastore/label?id=test_002&tag=final", method="DELETE")
        assert status == 200, reply


def test_infer_request_faults_are_answered_4xx(server):
    """Malformed ``params``, an image given only in ``params``, no image, a session or a whole-slide request:
    answered 4xx with the cause (MONAI Label answered 500 to most)."""
    base = server["base"]
    cases = [
        (f"{base}/infer/landmarks?image=test_001&output=json", {"params": "{not json"}, "params is not JSON"),
        (f"{base}/infer/landmarks?image=test_001&output=json", {"params": "[1, 2]"}, "JSON object"),
        (f"{base}/infer/landmarks?output=json", {"params": '{"image": "test_001"}'}, "'image'"),
        (f"{base}/infer/landmarks?output=json", {}, "?image=ID"),
        (f"{base}/infer/landmarks?image=test_001&session_id=abc&output=json", {}, "session"),
    ]
    for url, fields, why in cases:
        reply, status = _form(url, "POST", **fields)
        assert status == 400 and why in reply["detail"], (url, fields, reply)
    assert (
        _request(f"{base}/session/", *_multipart("files", server["studies"] / "test_000.png"), method="PUT")[1] == 406
    )
    reply, status = _request(f"{base}/infer/wsi/landmarks?image=test_001", b"{}", {"Content-Type": "application/json"})
    assert status == 404 and "whole-slide" in reply["detail"], reply


def test_infer_replies_carry_names_not_server_paths(server):
    """The reply names its templates and checkpoint; no server path (repository, studies, temp dir)."""
    _, from_upload = server["client"].infer("landmarks", "", {}, file=str(server["studies"] / "test_003.png"))
    from_id, status = _infer_id(server, "test_001")
    assert status == 200, from_id
    for reply in (from_upload, from_id):
        text = json.dumps(reply)
        assert str(ROOT) not in text and str(server["work"]) not in text and '"/' not in text, text[:2000]
        assert reply["checkpoint"] == "model.pt" and reply["checkpoint_source"] == "shipped"
        assert reply["template"] == [t["image"] for t in reply["templates"]] and all(
            "/" not in t for t in reply["template"]
        )
        assert reply["device"] == "cpu"  # the app's conf device


def _train_request(server, params: dict):
    return _request(
        f"{server['base']}/train/landmarks", json.dumps(params).encode(), {"Content-Type": "application/json"}
    )


def test_detector_training_needs_two_labelled_images(server):
    reply, status = _train_request(server, {**TINY_TRAIN, "network": "detector"})  # no saved label yet
    assert status == 422, reply
    assert "at least 2 labelled images" in reply["detail"] and "has 0 labelled images" in reply["detail"]
    reply, status = _request(f"{server['base']}/train/?check_if_running=true")
    assert status == 404  # nothing was queued


def test_strategies_first_and_last_skip_labelled_images(server, tmp_path):
    client = server["client"]
    assert client.next_sample("first", {})["id"] == "test_000"
    assert client.next_sample("last", {})["id"] == "test_003"
    reply, status = _request(
        f"{server['base']}/activelearning/nope", data=b"{}", headers={"Content-Type": "application/json"}
    )
    assert status == 404 and "'nope'" in reply["detail"] and "'first'" in reply["detail"]
    # a bad label is refused naming the image, and saves nothing
    bad = tmp_path / "bad.mrk.json"
    bad.write_text('{"markups": []}')
    with pytest.raises(MONAILabelClientException, match="Status: 422.*test_000"):
        client.save_label("test_000", str(bad), tag="final")
    for image_id in ("test_000", "test_003"):
        label = _mrk_json(tmp_path / f"{image_id}.mrk.json", server["names"], server["truth"][image_id])
        client.save_label(image_id, str(label), tag="final")
    assert client.next_sample("first", {})["id"] == "test_001"
    assert client.next_sample("last", {})["id"] == "test_002"


def test_saved_labels_become_the_templates(server):
    reply, status = _infer_id(server, "test_001")
    assert status == 200, reply
    assert reply["templates"] == [
        {"image": "test_000", "source": "datastore"},
        {"image": "test_003", "source": "datastore"},
    ]
    assert reply["template_combine"] == "weighted_geometric_median"
    # an image is never its own template (leave-one-out)
    reply, _ = _infer_id(server, "test_000")
    assert reply["templates"] == [{"image": "test_003", "source": "datastore"}]
    # the 2-shot suggestion is close to the truth of this synthetic set
    truth = np.array(server["truth"]["test_001"], dtype=float)
    found = np.array([_infer_id(server, "test_001")[0]["landmarks"][n] for n in server["names"]], dtype=float)
    assert np.linalg.norm(found - truth, axis=1).mean() < 10.0


@pytest.mark.parametrize(
    "params, key",
    [
        ({"epochs": "abc"}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"image_size": [64]}, "image_size"),
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"min_improvement": [1]}, "min_improvement"),
        ({"network": "unet"}, "network"),
        ({"network": "detector", "holdout": 1.5}, "holdout"),
        ({"max_epochs": -1}, "epochs"),
        ({"max_epochs": 2, "epochs": 3}, "max_epochs"),
        ({"max_epoch": 2}, "max_epoch"),
        ({"min_improvement": -1000}, "min_improvement"),
        ({"min_improvement": float("nan")}, "min_improvement"),
        ({"epochs": float("inf")}, "epochs"),
        ({"learning_rate": float("-inf")}, "learning_rate"),
        ({"image_size": [64, float("inf")]}, "image_size"),
        ({"seed": True}, "seed"),
        ({"seed": -1}, "seed"),
        ({"network": "detector", "holdout": float("nan")}, "holdout"),
        ({"publish": "sometimes"}, "publish"),
    ],
)
def test_bad_training_values_are_refused_naming_the_key(server, params, key):
    reply, status = _train_request(server, params)
    assert status == 422, reply
    assert repr(key) in reply["detail"]
    with pytest.raises(MONAILabelClientException, match=key):
        server["client"].train_start("landmarks", params)
    reply, status = _request(f"{server['base']}/train/?check_if_running=true")
    assert status == 404  # nothing was queued


def test_a_negative_margin_is_refused_naming_its_value(server):
    """``min_improvement`` -1000 published a worse model over the served one: refused, naming the key and value."""
    reply, status = _train_request(server, {**TINY_TRAIN, "min_improvement": -1000})
    assert status == 422, reply
    assert "'min_improvement' must be a non-negative number" in reply["detail"] and "got -1000" in reply["detail"]
    assert _request(f"{server['base']}/train/?check_if_running=true")[1] == 404  # nothing was queued


def test_training_reads_the_labels_and_keeps_the_served_model_when_not_better(server):
    client, model = server["client"], server["app"] / "model"
    client.train_start("landmarks", {**TINY_TRAIN, "min_improvement": 1e9})  # the new model can never be better enough
    status = _wait_training(server)
    assert status["status"] == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    datalist = json.loads((model / "train" / "datalist.json").read_text())
    labelled = {Path(it["image"]).stem: it["landmarks"] for it in datalist["training"] if it.get("landmarks")}
    assert sorted(Path(it["image"]).name for it in datalist["training"]) == sorted(
        p.name for p in server["studies"].glob("*.png")
    )
    assert labelled.keys() == {"test_000", "test_003"}
    np.testing.assert_allclose(
        np.array(labelled["test_003"], float), np.array(server["truth"]["test_003"], float), atol=1e-6
    )
    stats = client.info()["train_stats"]["landmarks"]  # written by the training process, shown by /info/
    assert stats["published"] is False and "kept the served model" in stats["decision"]
    assert stats["train"]["init_weights"] == str(ROOT / "models" / "model.pt")  # fine-tuned from the served weights
    assert stats["eval"]["key_metric_name"] == "mre" and stats["eval"]["metrics"]["mre_trained"] > 0
    assert "leave-one-out" in stats["eval"]["scored_on"] and stats["epoch"] == 1 and "total_time" in stats
    assert (model / "candidate" / "model_final.pt").is_file() and not (model / "model.pt").exists()
    assert stats["device"] == "cpu"  # the app's conf device, also given to the bundle's training
    reply, _ = _infer_id(server, "test_001")
    assert reply["checkpoint"] == "model.pt" and reply["checkpoint_source"] == "shipped"


def _publish_always(server, request: dict) -> dict:
    server["client"].train_start("landmarks", {**request, "publish": "always"})  # whatever the new model scores
    status = _wait_training(server)
    assert status["status"] == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    return server["client"].info()["train_stats"]["landmarks"]


def test_training_publishes_and_keeps_the_previous_model(server):
    model = server["app"] / "model"
    # in MONAI Label's own names: max_epochs and train_batch_size for epochs and batch_size
    request = {k: v for k, v in TINY_TRAIN.items() if k not in ("epochs", "batch_size")}
    stats = _publish_always(server, dict(request, max_epochs=1, train_batch_size=1))
    assert stats["epoch"] == 1  # not the default 10
    assert stats["published"] is True and stats["checkpoint"] == str(model / "model.pt")
    assert stats["decision"].startswith("published (publish 'always')")
    assert stats["best_metric"] == stats["eval"]["metrics"]["mre_trained"]
    assert stats["kept_previous"] == {}  # the shipped weights were served: nothing replaced
    reply, _ = _infer_id(server, "test_001")
    assert reply["checkpoint"] == "model.pt" and reply["checkpoint_source"] == "published"
    # a second publication keeps the first one beside it, dated, and copying it back restores it
    first = (model / "model.pt").read_bytes()
    stats = _publish_always(server, TINY_TRAIN)
    (kept,) = stats["kept_previous"].values()
    assert stats["kept_previous"] == {"model.pt": kept} and re.fullmatch(r"model\.\d{8}-\d{6}(-\d+)?\.pt", kept)
    assert (model / kept).read_bytes() == first != (model / "model.pt").read_bytes()
    shutil.copyfile(model / kept, model / "model.pt")
    reply, status = _infer_id(server, "test_001")
    assert status == 200 and reply["checkpoint_source"] == "published", reply


def test_dicom_upload_gives_the_png_landmarks_in_its_own_frame(server, tmp_path):
    from tests.test_dicom import dicom_copy

    png = server["studies"] / "test_002.png"
    # MONOCHROME1, 12 bits, rescale; isotropic spacing in the header (k-shot combines templates in mm: with
    # anisotropic pixels the geometric median of several templates is not the pixel-space one)
    dcm = dicom_copy(png, tmp_path / "xray.dcm", [0.125, 0.125])
    _, from_png = server["client"].infer("landmarks", "", {}, file=str(png))
    _, from_dcm = server["client"].infer("landmarks", "", {}, file=str(dcm))
    for name in server["names"]:
        assert from_dcm["landmarks"][name] == pytest.approx(from_png["landmarks"][name], abs=0.01), name
    # the Slicer point list sits in the DICOM's own frame: LPS (x * sx, y * sy, 0)
    for spacing, result in (
        ([0.125, 0.125], from_dcm),
        (
            [0.1, 0.2],
            server["client"].infer("landmarks", "", {}, file=str(dicom_copy(png, tmp_path / "aniso.dcm", [0.1, 0.2])))[
                1
            ],
        ),
    ):
        for point in result["markups"]["markups"][0]["controlPoints"]:
            x, y = result["landmarks"][point["label"]]
            assert point["position"] == pytest.approx([x * spacing[0], y * spacing[1], 0.0], abs=1e-6)
    # into the datastore as .dcm, then inferred by its id
    server["client"].upload_image(str(dcm), "xray_dcm")
    reply, status = _infer_id(server, "xray_dcm")
    assert status == 200, reply
    for name in server["names"]:
        assert reply["landmarks"][name] == pytest.approx(from_png["landmarks"][name], abs=0.01), name


DETECTOR_TRAIN = {**TINY_TRAIN, "network": "detector"}


def _detector_stats(server, params: dict) -> dict:
    server["client"].train_start("landmarks", {**DETECTOR_TRAIN, **params})
    status = _wait_training(server)
    assert status["status"] == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    stats = server["client"].info()["train_stats"]["landmarks"]
    assert stats["network"] == "detector" and stats["eval"]["key_metric_name"] == "mre"
    assert np.isfinite(stats["eval"]["metrics"]["mre_trained"]) and np.isfinite(stats["eval"]["metrics"]["mre_served"])
    assert (
        server["app"] / "model" / "candidate_detector" / "model_final.pt"
    ).is_file()  # no validation, still a checkpoint
    return stats


def test_detector_is_kept_out_when_not_better(server):
    model = server["app"] / "model"
    stats = _detector_stats(server, {"min_improvement": 1e9})
    assert stats["published"] is False and "kept template matching" in stats["decision"]
    assert stats["predictor"] == "templates" and stats["eval"]["served_predictor"] == "templates"
    # the encoder starts from the served stage-1 weights (published by the contrastive training above)
    assert stats["train"]["init_checkpoint"] == str(model / "model.pt") and stats["train"]["init_weights"] is None
    # two labelled images: one trained on, one held out and scored on; the child never sees the held-out one
    trained, held = stats["train"]["trained_on"], stats["train"]["held_out"]
    assert len(trained) == len(held) == 1 and sorted(trained + held) == ["test_000", "test_003"]
    datalist = json.loads((model / "train_detector" / "datalist.json").read_text())
    assert [Path(it["image"]).stem for it in datalist["training"]] == trained
    assert [Path(it["image"]).stem for it in datalist["test"]] == held
    assert not (model / "detector.pt").exists()
    reply, status = _infer_id(server, "test_001")
    assert status == 200 and reply["predictor"] == "templates", reply
    with pytest.raises(MONAILabelClientException, match="Status: 422.*no detector is served"):
        server["client"].infer("landmarks", "test_001", {"predictor": "detector"})


def test_published_detector_is_served(server):
    from PIL import Image

    model = server["app"] / "model"
    stats = _detector_stats(server, {"publish": "always"})  # whatever the detector scores
    assert stats["published"] is True and stats["decision"].startswith("published")
    assert stats["predictor"] == "detector" and stats["checkpoint"] == str(model / "detector.pt")
    info = json.loads((model / "detector.json").read_text())
    assert info["image_size"] == TINY_TRAIN["image_size"] and info["held_out"] == stats["train"]["held_out"]
    reply, status = _infer_id(server, "test_001")
    assert status == 200, reply
    assert (
        reply["predictor"] == "detector"
        and reply["checkpoint"] == "detector.pt"
        and reply["checkpoint_source"] == "published"
        and reply["templates"] == []
    )
    width, height = Image.open(server["studies"] / "test_001.png").size
    points = np.array([reply["landmarks"][n] for n in server["names"]], dtype=float)
    assert (
        np.isfinite(points).all()
        and (points >= 0).all()
        and (points[:, 0] <= width - 1).all()
        and (points[:, 1] <= height - 1).all()
    )
    # template matching stays available on request
    _, forced = server["client"].infer("landmarks", "test_001", {"predictor": "templates"})
    assert forced["predictor"] == "templates" and forced["templates"][0]["source"] == "datastore"
    with pytest.raises(MONAILabelClientException, match="Status: 422.*predictor"):
        server["client"].infer("landmarks", "test_001", {"predictor": "magic"})


def test_detector_retrains_from_the_served_one_on_the_same_held_out_images(server, tmp_path):
    model = server["app"] / "model"
    before = json.loads((model / "detector.json").read_text())
    label = _mrk_json(tmp_path / "test_001.mrk.json", server["names"], server["truth"]["test_001"])
    server["client"].save_label("test_001", str(label), tag="final")  # a third labelled image
    stats = _detector_stats(server, {"min_improvement": 1e9})
    assert stats["train"]["init_weights"] == str(model / "detector.pt") and stats["train"]["init_checkpoint"] is None
    assert stats["eval"]["served_predictor"] == "detector" and "kept the served detector" in stats["decision"]
    # the served detector is scored only on images it never trained on: its held-out image stays held out, its
    # training image stays in training, and the new one fills the held-out set (2 of 3: min_held_out 3, capped)
    assert sorted(stats["train"]["held_out"]) == sorted(before["held_out"] + ["test_001"])
    assert stats["train"]["trained_on"] == before["trained_on"]
    assert stats["published"] is False and stats["predictor"] == "detector"
    assert json.loads((model / "detector.json").read_text()) == before


def _in_process(tmp_path: Path, scenario: str, *args) -> dict:
    """Run a scenario of tests/monailabel_inprocess.py in the MONAI Label environment (working folder
    ``tmp_path/work``); its printed result."""
    (tmp_path / "work").mkdir()
    done = _checked([PYTHON, ROOT / "tests" / "monailabel_inprocess.py", scenario, tmp_path / "work", *args], tmp_path)
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
    }


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


def test_one_network_on_the_configured_device(tmp_path):
    """``--conf device``: a device this machine lacks is refused at start naming it; on ``cpu`` the infer task
    and the trainer record it, and one stage-1 network serves inference, the template choice and the scoring
    of a training in the server's process (in-process, tests/monailabel_inprocess.py); the pseudo-template worker's
    own network is gone once it has finished."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=2)
    content = open_datalist(datalist_path)
    studies = tmp_path / "studies"
    studies.mkdir()
    for item in content["test"]:
        shutil.copy(item["image"], studies)
    template = content["test"][1]
    label = _mrk_json(tmp_path / "template.mrk.json", content["landmark_names"], template["landmarks"])
    result = _in_process(tmp_path, "device", datalist_path, studies, Path(template["image"]).stem, label)
    assert sorted(result["refused"]) == ["cuda:7", "cuda:x", "tpu"]
    for device, message in result["refused"].items():
        assert message.startswith(f"conf device {device!r}: "), message
    assert result["infer_device"] == result["train_device"] == "cpu"
    assert result["networks_after_infer"] == result["networks_after_train"] == 1


def _cli_evaluate_3d(datalist: dict, ckpt: Path, out: Path, *options: str) -> dict[str, list[float]]:
    """The bundle's 3D evaluation (one test image) from the command line, with ``options``: {landmark: [x, y, z]
    world mm}."""
    out.mkdir(parents=True)
    (out / "datalist.json").write_text(json.dumps(datalist))
    configs = config_files("evaluate", spatial_dims=3)
    command = [sys.executable, "-m", "monai.bundle", "run", "evaluating", "--config_file", json.dumps(configs)]
    command += ["--datalist", str(out / "datalist.json"), "--ckpt_path", str(ckpt), "--output_dir", str(out / "eval")]
    command += list(options)
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
    label = write_mrk_json(
        tmp_path / "template.mrk.json", [ControlPoint(n, tuple(p)) for n, p in zip(names, template["landmarks"])]
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


def test_a_giant_picture_is_refused_before_it_is_decoded(server, tmp_path):
    """A 12000 x 12000 blank PNG (140 kB on disk, 0.6 GB of floats decoded) is refused 422 naming it; the studies
    folder is unchanged."""
    giant = tmp_path / "giant.png"
    Image.new("L", (12000, 12000)).save(giant)
    before = _tree(server["studies"])
    url = f"{server['base']}/datastore/image?image=giant"
    reply, status = _request(url, *_multipart("file", giant, "giant.png"), method="PUT")
    assert status == 422, (status, reply)
    assert "12000 x 12000 pixels, more than the 50,000,000" in reply["detail"], reply
    assert _tree(server["studies"]) == before


CEPHALOGRAM = ROOT.parent / "shared" / "data" / "hamedan_ceph" / "images" / "001.png"


def test_default_serves_the_shipped_cephalometric_model(tmp_path):
    """Started without ``--conf datalist``, the server serves the shipped weights with their built-in templates
    and 19 landmark names, as the ``inferring`` command (a real cephalogram when ../shared/data is there, else a
    synthetic image); fine-tuning is refused until 2 images are labelled, naming the count."""
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
    with _serving(tmp_path, studies) as running:
        assert running["info"]["models"]["landmarks"]["labels"] == {
            n: i + 1 for i, n in enumerate(builtin["landmark_names"])
        }
        assert len(builtin["landmark_names"]) == 19
        _, reply = running["client"].infer("landmarks", image.stem, {})
        assert reply["landmark_names"] == builtin["landmark_names"]
        assert {t["source"] for t in reply["templates"]} == {"built-in"} and reply["checkpoint"] == "model.pt", reply
        assert reply["checkpoint_source"] == "shipped"
        assert reply["template"] == [Path(s).name for s in builtin["sources"]]
        expected = _cli_predictions(image, None, tmp_path / "cli")
        for name in builtin["landmark_names"]:
            np.testing.assert_allclose(reply["landmarks"][name], expected[name], atol=1e-3, err_msg=name)
        reply, status = _request(
            f"{running['base']}/train/landmarks?run_sync=false",
            json.dumps({"epochs": 1}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 422 and "at least 2 labelled images" in reply["detail"] and "has 0 labelled" in reply["detail"]
        # a saved label joins the built-in templates (they fit the served shipped weights): matched from an upload
        # (a datastore image is never its own template), the label first, then the built-in ones
        label = _mrk_json(tmp_path / "label.mrk.json", builtin["landmark_names"], [expected[n] for n in expected])
        running["client"].save_label(image.stem, str(label), tag="final")
        _, joined = running["client"].infer("landmarks", "", {}, file=str(image))
        assert joined["templates"] == [{"image": image.stem, "source": "datastore"}] + [
            {"image": Path(s).name, "source": "built-in"} for s in builtin["sources"]
        ]


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

    with _serving(tmp_path, studies, "datalist", str(datalist_path)) as running:
        client = running["client"]
        client.save_label(saved[0][0], str(_mrk_json(tmp_path / "label0.mrk.json", names, saved[0][1])), tag="final")
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
        expected = _cli_predictions(upload, one_label, tmp_path / "cli")
        provenance = json.loads((tmp_path / "cli" / "provenance.json").read_text())
        assert [Path(p).stem for p in provenance["pseudo_templates"]] == pseudo
        for name in names:
            np.testing.assert_allclose(reply["landmarks"][name], expected[name], atol=1e-3, err_msg=name)

        client.save_label(saved[1][0], str(_mrk_json(tmp_path / "label1.mrk.json", names, saved[1][1])), tag="final")
        client.train_start("landmarks", {**DETECTOR_TRAIN, "min_improvement": 1e9})
        status = _wait_training(running)
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
    """``python -m scripts.labels_loop`` on the real cephalograms (skipped without ../shared/data): the default
    server, two labels saved one step at a time, a detector training, the held-out uploads scored; the saved labels
    join the built-in templates and the results file holds every step."""
    if not CEPHALOGRAM.is_file():
        pytest.skip("no ../shared/data/hamedan_ceph")
    from bundle.template_file import load_template
    from scripts.labels_loop import run
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
    builtin = len(load_template(ROOT / "models" / "template_features.pt")["sources"])
    assert [len(r["templates"]) for r in rows[:3]] == [builtin, builtin + 1, builtin + 2]
    assert all(0 < r["mre_mm"] < 10 and r["landmarks_scored"] == 19 for r in rows)
    assert rows[3]["published"] is False and rows[3]["held_out"] and rows[3]["predictor"] == "templates"
    assert (tmp_path / "loop" / "learning_curve.png").stat().st_size > 0
