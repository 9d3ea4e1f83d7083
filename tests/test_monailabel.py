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

import io
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scripts.monailabel_server import client_classes

from tests.monailabel_helpers import (
    DETECTOR_TRAIN,
    PYTHON,
    ROOT,
    START_TIMEOUT_S,
    TINY_TRAIN,
    app_server,
    cli_predictions,
    mrk_json,
    request_json,
    require_monailabel_environment,
    wait_training,
)

pytestmark = pytest.mark.slow  # a MONAI Label server per module, trainings through it
require_monailabel_environment()

MONAILabelClient, MONAILabelClientException = client_classes(PYTHON)


def _multipart(field: str, path: Path, filename: str | None = None, params: dict | None = None) -> tuple[bytes, dict]:
    """A multipart body uploading ``path`` as ``field`` (and ``params`` as the ``params`` form field)."""
    boundary = uuid.uuid4().hex
    body = b""
    if params is not None:
        body += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="params"\r\n\r\n{json.dumps(params)}\r\n'
        ).encode()
    body += (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename or path.name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + path.read_bytes()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


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
    with app_server(tmp_path, studies, "datalist", str(datalist_path), "pseudo_templates", "0") as running:
        yield {
            **running,
            "studies": studies,
            "truth": truth,
            "names": list(datalist["landmark_names"]),
            "work": tmp_path,
            "datalist": datalist_path,
        }


def _infer_id(server, image_id: str):
    return request_json(
        f"{server['base']}/infer/landmarks?image={urllib.request.quote(image_id, safe='')}&output=json", b""
    )


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
    reference = cli_predictions(image, server["datalist"], server["work"] / "cli", "--pseudo_templates", "0")
    assert list(result["landmarks"]) == list(names) == list(reference)
    for name in names:
        assert result["landmarks"][name] == pytest.approx(reference[name], abs=1e-3), name
    # no saved label yet: the bundle's template(s); the result file holds a box per landmark, as 3D Slicer's
    # MONAILabel module edits them (tested below), each at the reply's Slicer point of that landmark
    assert result["templates"] and all(t["source"] == "bundle" for t in result["templates"])
    points = {cp["label"]: cp["position"] for cp in result["markups"]["markups"][0]["controlPoints"]}
    boxes = json.loads(Path(out).read_text())["markups"]
    assert [(b["type"], b["name"], b["center"]) for b in boxes] == [("ROI", n, points[n]) for n in names]
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
    reply, status = request_json(f"{server['base']}/infer/landmarks?output=json", *_multipart("file", junk))
    assert 400 <= status < 500, reply
    assert "scan_17.png" in reply["detail"] and "cannot read image" in reply["detail"]
    assert new_files() == []
    # the datastore refuses it too, and keeps no copy
    with pytest.raises(MONAILabelClientException, match="Status: 422"):
        server["client"].upload_image(str(junk), "scan_17")
    assert "scan_17" not in json.dumps(server["client"].datastore())
    assert new_files() == []


def test_an_unreadable_upload_is_refused_in_one_line_naming_no_server_path(server, tmp_path):
    """A junk or truncated upload is refused 422 naming the client's file in one line: no server path (the upload's
    temporary file, the environment's tracebacks: MONAI's error held every reader's) in ``detail``."""
    junk, truncated = tmp_path / "junk_17.png", tmp_path / "cut_17.png"
    junk.write_bytes(os.urandom(3000))
    truncated.write_bytes(b"\x89PNG\r\n\x1a\n")
    for path in (junk, truncated):
        for url, method in [
            (f"{server['base']}/infer/landmarks?output=json", "POST"),
            (f"{server['base']}/datastore/image?image={path.stem}", "PUT"),
        ]:
            reply, status = request_json(url, *_multipart("file", path), method=method)
            assert status == 422 and "cannot read image" in reply["detail"], (url, status, reply)
            assert "\n" not in reply["detail"] and "/" not in reply["detail"].replace("https://", ""), reply
    assert "junk_17" not in json.dumps(server["client"].datastore())


def test_an_upload_reading_its_pixels_from_another_file_is_refused(server, tmp_path):
    """A MetaImage upload whose header names a server file as its pixel data (``ElementDataFile``; ITK read it: a
    client had any file the server could read inferred) is refused 422 naming it, by inference and the datastore,
    also for a file beside it (the temp dir holds other requests' uploads); nothing is stored."""
    before = _tree(server["studies"])
    for data_file in (str(server["studies"] / "test_000.png"), "landmarks-upload-x.png"):
        header = tmp_path / "external.mha"
        header.write_text(
            f"ObjectType = Image\nNDims = 2\nDimSize = 64 64\nElementType = MET_UCHAR\nElementDataFile = {data_file}\n"
        )
        for url, method in [
            (f"{server['base']}/infer/landmarks?output=json", "POST"),
            (f"{server['base']}/datastore/image?image=external", "PUT"),
        ]:
            reply, status = request_json(url, *_multipart("file", header), method=method)
            assert status == 422 and "reads the pixel data from" in reply["detail"], (url, status, reply)
    assert _tree(server["studies"]) == before


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
    return request_json(url, body, {"Content-Type": "application/x-www-form-urlencoded"}, method=method)


# (method, route and query, upload field): VICTIM is a file outside the studies folder, given without its suffix
NAMES_NOT_PATHS = [
    ("PUT", "/datastore/image?image=VICTIM", "file"),  # overwrote VICTIM.png
    ("DELETE", "/datastore/image?id=VICTIM", None),  # deleted it once the PUT had registered it
    ("PUT", "/datastore/image?image=../evil_img", "file"),  # wrote beside the studies folder
    ("PUT", "/datastore/image?image=..", "file"),
    ("PUT", "/datastore/image?image=sub\\evil", "file"),
    ("PUT", "/datastore/image?image=.hidden", "file"),
    ("PUT", "/datastore/image?image=datastore_v2", "json"),  # an image must be an image format
    ("PUT", "/datastore/image?image=a.png.b", "file"),  # its file a.png.b.png read back as image a.b
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
    label = mrk_json(tmp_path / "good.mrk.json", server["names"], server["truth"]["test_001"])
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
        reply, status = request_json(
            url, *_multipart("label" if field == "label" else "file", upload, name), method=method
        )
    else:
        reply, status = request_json(url, b"" if method in ("POST", "PUT") else None, method=method)
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
    victim_label = mrk_json(tmp_path / "outside" / "victim.mrk.json", server["names"], server["truth"]["test_002"])
    outside = _tree(tmp_path / "outside")
    label = mrk_json(tmp_path / "x.mrk.json", server["names"], server["truth"]["test_002"])
    # an image added through the server, then its file replaced by a link pointing out
    reply, status = request_json(
        f"{base}/datastore/image?image=linked", *_multipart("file", victim, "x.png"), method="PUT"
    )
    assert status == 200, reply
    (studies / "linked.png").unlink()
    (studies / "linked.png").symlink_to(victim)
    (studies / "labels" / "final" / "test_002.mrk.json").symlink_to(victim_label)
    try:
        reply, status = request_json(f"{base}/datastore/image?id=linked", method="DELETE")
        assert status == 403 and "'linked'" in reply["detail"] and "outside" in reply["detail"], reply
        reply, status = request_json(
            f"{base}/datastore/image?image=linked", *_multipart("file", victim, "x.png"), method="PUT"
        )
        assert status == 403, reply
        reply, status = request_json(
            f"{base}/datastore/label?image=test_002&tag=final", *_multipart("label", label), method="PUT"
        )
        assert status == 403 and "'test_002'" in reply["detail"], reply
        assert request_json(f"{base}/datastore/image?image=linked")[1] == 404  # not served
        assert _infer_id(server, "linked")[1] == 404
        assert _tree(tmp_path / "outside") == outside
    finally:
        (studies / "labels" / "final" / "test_002.mrk.json").unlink()
        (studies / "linked.png").unlink()
        shutil.copy(studies / "test_000.png", studies / "linked.png")
    reply, status = request_json(f"{base}/datastore/image?id=linked", method="DELETE")  # a plain file again: removed
    assert status == 200, reply
    assert sorted(server["client"].datastore()["objects"]) == ["test_000", "test_001", "test_002", "test_003"]


def _bad_label(path: Path, names: list[str], points: list, position) -> Path:
    """A Slicer point list: ``points`` (pixels, LPS), its first landmark at ``position`` as written (None: kept)."""
    control = [{"label": n, "position": [-p[0], -p[1], 0.0]} for n, p in zip(names, points)]
    if position is not None:
        control[0]["position"] = position
    markup = {"type": "Fiducial", "coordinateSystem": "RAS", "controlPoints": control}
    path.write_text(json.dumps({"markups": [markup]}))
    return path


@pytest.mark.parametrize(
    "position, why",
    [
        ([-50000.0, 70000.0, 0.0], "lies outside the image"),  # pixel (50000, -70000)
        # pixel x 255.5000012 of the 256 px wide image: inside its network grid's extent within the grid check's
        # rounding (it was saved, then the pipeline refused it as a template: every suggestion failed, 500)
        ([-255.5000012, -40.0, 0.0], "lies outside the image (x -0.5 to 255.5, y -0.5 to 287.5 pixels)"),
        ([float("nan"), 1.0, 0.0], "finite"),
        ([True, 1.0, 0.0], "finite"),
        ([1.0, 2.0], "3 finite numbers"),
        ("here", "3 finite numbers"),
    ],
)
def test_a_label_off_the_image_is_refused_naming_the_landmark(server, tmp_path, position, why):
    name = server["names"][0]
    bad = _bad_label(tmp_path / "bad.mrk.json", server["names"], server["truth"]["test_001"], position)
    reply, status = request_json(
        f"{server['base']}/datastore/label?image=test_001&tag=final", *_multipart("label", bad), method="PUT"
    )
    assert status == 422, reply
    assert repr(name) in reply["detail"] and "'test_001'" in reply["detail"] and why in reply["detail"], reply
    assert str(tmp_path) not in reply["detail"] and str(server["tmp"]) not in reply["detail"]
    assert server["client"].datastore()["objects"]["test_001"]["labels"] == {}  # nothing stored


def test_a_label_naming_a_landmark_twice_is_refused_and_another_case_is_matched(server, tmp_path):
    """Labels match the landmark names with case and blanks ignored (a clinician's ``SELLA``): a label whose points
    name one landmark twice that way (``sella`` and ``SELLA ``) is refused naming it, not stored with either."""
    names, truth = server["names"], server["truth"]["test_001"]
    twice = _bad_label(tmp_path / "twice.mrk.json", names + [f"{names[0].upper()} "], truth + [truth[0]], None)
    reply, status = request_json(
        f"{server['base']}/datastore/label?image=test_001&tag=final", *_multipart("label", twice), method="PUT"
    )
    assert status == 422 and f"landmarks [{names[0]!r}] are named by more than one point" in reply["detail"], reply
    assert server["client"].datastore()["objects"]["test_001"]["labels"] == {}  # nothing stored


def test_a_bad_stored_label_is_skipped_naming_it(server, tmp_path):
    """A label already in the datastore that lies off its image (saved by an earlier server) is skipped with a
    warning naming it: inference goes on without it."""
    good = mrk_json(tmp_path / "good.mrk.json", server["names"], server["truth"]["test_002"])
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
        reply, status = request_json(f"{server['base']}/datastore/label?id=test_002&tag=final", method="DELETE")
        assert status == 200, reply


def test_a_label_that_cannot_be_a_template_is_refused_and_skipped_when_stored(server, tmp_path):
    """Every saved label is a template of the suggestions: one whose points lie at one place (fewer than 3 distinct
    positions) is refused 422 naming the image and why, and is not stored; one already stored (an earlier server's)
    is skipped with a warning naming it, and the suggestions go on (it made each of them fail)."""
    names, truth = server["names"], server["truth"]["test_002"]
    good = mrk_json(tmp_path / "good.mrk.json", names, truth)
    server["client"].save_label("test_002", str(good), tag="final")
    _bad_label(server["studies"] / "labels" / "final" / "test_002.mrk.json", names, [truth[0]] * len(names), None)
    try:
        reply, status = _infer_id(server, "test_001")
        assert status == 200 and {t["source"] for t in reply["templates"]} == {"bundle"}, reply
        skipped = f"saved label skipped: label of image 'test_002': the template's {len(names)} landmarks lie at 1 "
        assert skipped in server["log"].read_text()
    finally:
        assert request_json(f"{server['base']}/datastore/label?id=test_002&tag=final", method="DELETE")[1] == 200
    one_place = _bad_label(tmp_path / "one_place.mrk.json", names, [truth[0]] * len(names), None)
    reply, status = request_json(
        f"{server['base']}/datastore/label?image=test_002&tag=final", *_multipart("label", one_place), method="PUT"
    )
    assert status == 422 and "label of image 'test_002'" in reply["detail"], reply
    assert "1 distinct position(s)" in reply["detail"] and "a template needs 3" in reply["detail"], reply
    assert server["client"].datastore()["objects"]["test_002"]["labels"] == {}  # nothing stored
    assert _infer_id(server, "test_001")[1] == 200


SLICER_SCHEMA = "https://raw.githubusercontent.com/slicer/slicer/master/Modules/Loadable/Markups/Resources/Schema/markups-schema-v1.0.3.json#"


def _slicer_run(server, image_id: str, options: dict | None = None) -> tuple[Path, dict, list[dict], list[dict]]:
    """3D Slicer's MONAILabel module's Run on a datastore image, replayed: its model (the first of type
    ``segmentation`` or ``detection`` in ``/info/``), its params (the model's ``config`` as its options table sends
    it, a list by its first item, edited to ``options``, with the result format it asks for), MONAI Label's client
    (the module's transport: its ``MONAILabelLib/client.py`` sends and reads the same bytes), and the result file
    loaded as the module loads it: ``slicer.util.loadMarkups`` when its name ends with ``.json``.

    Returns the result file, the reply, the scene's ROI nodes (:func:`_slicer_rois`) and its other markups nodes
    (``{"type", "name", "points": [{"label", "description", "position"}]}``)."""
    info = server["client"].info()
    model = next(k for k, v in info["models"].items() if v.get("type", "segmentation") in ("segmentation", "detection"))
    config = info["models"][model]["config"]
    params = {k: v[0] if isinstance(v, list) else v for k, v in config.items()}
    params.update(options or {}, result_extension=".nrrd", result_dtype="uint8")
    result_file, reply = server["client"].infer(model, image_id, params)
    assert model == "landmarks" and result_file.endswith(".json"), result_file  # else not loaded as markups
    markups = json.loads(Path(result_file).read_text())["markups"]
    others = [
        {"type": m["type"], "name": m.get("name"), "points": m["controlPoints"]} for m in markups if m["type"] != "ROI"
    ]
    return Path(result_file), reply, _slicer_rois([m for m in markups if m["type"] == "ROI"]), others


def _slicer_rois(loaded: list[dict]) -> list[dict]:
    """The ROI nodes of the module's scene once the ROI markups ``loaded`` are in it: the two it makes for each image
    (``Scribbles ROI``, ``SAM2 ROI``, with no control point), then one per markup, in order; every one but the
    scribbles' renamed ``Detection ROI - i`` (i: its index among the scene's ROI nodes), as the module does after
    loading. A node: ``{"name", "center" (LPS), "size", "points": [[label, LPS]]}`` (the files here are LPS)."""
    rois = [
        {"name": n, "center": [0.0, 0.0, 0.0], "size": [0.0, 0.0, 0.0], "points": []}
        for n in ("Scribbles ROI", "SAM2 ROI")
    ]
    for m in loaded:
        assert m["coordinateSystem"] == "LPS" and m["roiType"] == "Box"
        rois.append(
            {
                "name": m.get("name"),
                "center": m["center"],
                "size": m["size"],
                "points": [[cp["label"], cp["position"]] for cp in m["controlPoints"]],
            }
        )
    for i, roi in enumerate(rois):
        if roi["name"] != "Scribbles ROI":
            roi["name"] = f"Detection ROI - {i}"
    return rois


def _slicer_drag(roi: dict, shift: list[float]) -> None:
    """A box dragged by its centre handle: Slicer moves its centre and, with it, its one control point."""
    roi["center"] = [c + d for c, d in zip(roi["center"], shift)]
    roi["points"] = [[label, roi["center"]] for label, _ in roi["points"]]


def _slicer_submission(path: Path, rois: list[dict]) -> Path:
    """The label file of the module's Submit Label for a ``detection`` model: its ``SAM2 ROI`` emptied first
    (``resetSam2ROI``), then every ROI node but ``Scribbles ROI`` saved as ``slicer.util.saveNode`` saves an ROI node
    (markups[0] of that file, in Slicer's keys), written one per line as ``onGenerateJSONFromMulipltROIs`` writes
    them; point lists are not sent."""
    saved = []
    for roi in rois:
        if roi["name"] == "Scribbles ROI":
            continue
        empty = roi["name"] == "Detection ROI - 1"  # the SAM2 ROI, renamed when the result was loaded
        points = [] if empty else roi["points"]
        saved.append(
            {
                "type": "ROI",
                "coordinateSystem": "LPS",
                "coordinateUnits": "mm",
                "locked": False,
                "fixedNumberOfControlPoints": False,
                "labelFormat": "%N-%d",
                "lastUsedControlPointNumber": len(points),
                "roiType": "Box",
                "center": [0.0, 0.0, 0.0] if empty else roi["center"],
                "orientation": [-1.0, -0.0, -0.0, -0.0, -1.0, -0.0, 0.0, 0.0, 1.0],
                "size": [0.0, 0.0, 0.0] if empty else roi["size"],
                "insideOut": False,
                "controlPoints": [
                    {
                        "id": str(k + 1),
                        "label": label,
                        "description": "",
                        "associatedNodeID": "",
                        "position": position,
                        "orientation": [-1.0, -0.0, -0.0, -0.0, -1.0, -0.0, 0.0, 0.0, 1.0],
                        "selected": True,
                        "locked": False,
                        "visibility": True,
                        "positionStatus": "defined",
                    }
                    for k, (label, position) in enumerate(points)
                ],
                "measurements": [{"name": "volume", "enabled": False, "units": "cm3", "printFormat": "%-#4.4g%s"}],
                "display": {"visibility": True, "opacity": 1.0, "color": [0.4, 1.0, 1.0], "fillOpacity": 0.4},
            }
        )
    text = "{\n" + f' "@schema": "{SLICER_SCHEMA}",\n' + ' "markups": [\n'
    text += ",\n".join(f"  {json.dumps(m)}" for m in saved) + "]\n}"
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


def _draw_result(image: Path, result_file: Path, out: Path, width: int = 480) -> Path:
    """The result file's markups drawn over a PNG as Slicer places them (LPS (x, y, 0) is pixel (x, y)): each box's
    outline with its control point's label, a point list's points with theirs (a 64-colour PNG)."""
    from bundle.reporting import write_png
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    picture = np.asarray(Image.open(image).convert("L"))
    height, side = picture.shape
    fig = Figure(figsize=(width / 100, width / 100 * height / side), dpi=100)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.imshow(picture, cmap="gray")
    for m in json.loads(result_file.read_text())["markups"]:
        for cp in m["controlPoints"]:
            x, y, _ = cp["position"]
            if m["type"] == "ROI":
                sx, sy, _ = m["size"]
                ax.add_patch(Rectangle((x - sx / 2, y - sy / 2), sx, sy, fill=False, edgecolor="cyan", linewidth=1.2))
                ax.annotate(cp["label"], (x, y), xytext=(5, 3), textcoords="offset points", color="cyan", fontsize=6)
            else:
                ax.plot([x], [y], "o", color="orange", markersize=4)
                ax.annotate(cp["label"], (x, y), xytext=(5, 3), textcoords="offset points", color="orange", fontsize=6)
    ax.set_xlim(-0.5, side - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    ax.set_axis_off()
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    small = io.BytesIO()  # 64 colours: a fraction of the size
    Image.open(buffer).convert("RGB").quantize(64).save(small, format="png", optimize=True)
    return write_png(out, small.getvalue())


def test_slicer_run_correct_and_submit_label(server, tmp_path):
    """3D Slicer's MONAILabel module's whole loop replayed with its own requests and files: Run on an image loads
    one box per landmark, labelled with its name; two boxes dragged by a known shift; Submit Label (the file as the
    module writes it, under a temporary ``.json`` name, with its params and no tag) stores the moved landmarks under
    their names, and the next suggestion on another image uses the label as its template. (Submit Label sent ROI
    boxes only, and the point list Run loaded was answered 422.) The picture of docs/monailabel.md is this result
    drawn over the image (``slicer_suggestions.png`` in this test's temp folder)."""
    client, names = server["client"], server["names"]
    result_file, reply, rois, others = _slicer_run(server, "test_002")
    assert others == [] and "warning" not in reply  # a warning would come as a point list (below, the detector's)
    boxes = rois[2:]
    assert [label for roi in boxes for label, _ in roi["points"]] == names  # one box per landmark, by its name
    for roi, name in zip(boxes, names):
        x, y = reply["landmarks"][name]  # a PNG's pixel (x, y) is LPS (x, y, 0)
        assert roi["center"] == roi["points"][0][1] == pytest.approx([x, y, 0.0], abs=1e-6), name
        assert roi["size"][0] > 0
    _draw_result(server["studies"] / "test_002.png", result_file, tmp_path / "slicer_suggestions.png")
    shifts = {names[0]: [3.0, -2.0, 0.0], names[5]: [-1.5, 4.25, 0.0]}
    for roi in boxes:
        if roi["points"][0][0] in shifts:
            _slicer_drag(roi, shifts[roi["points"][0][0]])
    label_in = _slicer_submission(tmp_path / f"tmp{uuid.uuid4().hex[:8]}.json", rois)
    try:
        client.save_label("test_002", str(label_in), params={"label_info": [], "model": "landmarks"})
        stored = json.loads((server["studies"] / "labels" / "final" / "test_002.json").read_text())
        centres = {m["controlPoints"][0]["label"]: m["center"] for m in stored["markups"] if m["controlPoints"]}
        assert list(centres) == names
        for name in names:
            x, y = reply["landmarks"][name]
            dx, dy, _ = shifts.get(name, [0.0, 0.0, 0.0])
            assert centres[name] == pytest.approx([x + dx, y + dy, 0.0], abs=0.01), name
        _, after, _, _ = _slicer_run(server, "test_001")
        assert after["templates"] == [{"image": "test_002", "source": "datastore"}], after
    finally:
        reply, status = request_json(f"{server['base']}/datastore/label?id=test_002&tag=final", method="DELETE")
        assert status == 200, reply


def test_slicer_submit_label_without_a_placed_box_is_refused_saying_what_to_do(server, tmp_path):
    """Submit Label before Run sends only the module's empty ``SAM2 ROI``: 422 naming the image and saying to press
    Run and drag the boxes; nothing is stored."""
    rois = _slicer_rois([])
    label_in = _slicer_submission(tmp_path / f"tmp{uuid.uuid4().hex[:8]}.json", rois)
    with pytest.raises(MONAILabelClientException) as refused:
        server["client"].save_label("test_002", str(label_in), params={"label_info": [], "model": "landmarks"})
    status, _, response = refused.value.msg.partition("; Response: ")
    detail = json.loads(response)["detail"]
    assert status == "Status: 422" and "'test_002'" in detail and "no placed box" in detail, detail
    assert "press Run, drag the wrong boxes" in detail
    assert server["client"].datastore()["objects"]["test_002"]["labels"] == {}


def _labels_of(server, image_id: str) -> list[str]:
    """The label files of ``image_id`` in the ``final`` tag folder."""
    folder = server["studies"] / "labels" / "final"
    return sorted(f.name for f in folder.iterdir() if f.name.split(".")[0] == image_id)


def test_one_label_per_image_and_tag_whatever_its_format(server, tmp_path):
    """A label saved as ``.mrk.json`` then as ``.fcsv`` leaves the ``.fcsv`` alone; deleting it deletes every label
    file of the image and tag (an earlier server's ``.mrk.json`` too): nothing is left to be adopted again and used
    as a template."""
    from bundle.data.markups import ControlPoint, write_fcsv

    base, names, truth = server["base"], server["names"], server["truth"]["test_003"]
    mrk = mrk_json(tmp_path / "a.mrk.json", names, truth)
    fcsv = write_fcsv(tmp_path / "a.fcsv", [ControlPoint(n, (-p[0], -p[1], 0.0)) for n, p in zip(names, truth)], "LPS")
    for label in (mrk, fcsv):
        reply, status = request_json(
            f"{base}/datastore/label?image=test_003", *_multipart("label", label), method="PUT"
        )
        assert status == 200, reply
    assert _labels_of(server, "test_003") == ["test_003.fcsv"]
    assert server["client"].datastore()["objects"]["test_003"]["labels"]["final"]["ext"] == ".fcsv"
    shutil.copy(mrk, server["studies"] / "labels" / "final" / "test_003.mrk.json")  # as an earlier server left it
    reply, status = request_json(f"{base}/datastore/label?id=test_003&tag=final", method="DELETE")
    assert status == 200, reply
    assert _labels_of(server, "test_003") == []
    assert server["client"].datastore()["objects"]["test_003"]["labels"] == {}
    reply, status = _infer_id(server, "test_001")
    assert status == 200 and "test_003" not in [t["image"] for t in reply["templates"]], reply


def test_saving_over_a_hard_linked_label_leaves_the_file_outside(server, tmp_path):
    """A label file that is a hard link to a file outside the studies folder (one name of the same file: no link
    to resolve) is replaced by the saved label, never written through (MONAI Label's copy wrote into the file
    outside)."""
    base, names = server["base"], server["names"]
    outside = mrk_json(tmp_path / "outside.mrk.json", names, server["truth"]["test_003"])
    content = outside.read_bytes()
    linked = server["studies"] / "labels" / "final" / "test_003.mrk.json"
    os.link(outside, linked)
    new = _slicer_point_list(tmp_path / "new.mrk.json", names, server["truth"]["test_003"])
    try:
        reply, status = request_json(f"{base}/datastore/label?image=test_003", *_multipart("label", new), method="PUT")
        assert status == 200, reply
        assert outside.read_bytes() == content and linked.read_bytes() == new.read_bytes()
    finally:
        assert request_json(f"{base}/datastore/label?id=test_003&tag=final", method="DELETE")[1] == 200
    assert outside.read_bytes() == content


def test_a_labelled_image_is_replaced_only_when_asked(server, tmp_path):
    """Re-uploading a labelled image id with another picture is refused 409 naming the id and its label; the same
    bytes again are accepted; with ``params {"replace": true}`` the picture is replaced and its labels removed."""
    base, studies = server["base"], server["studies"]
    first, other = studies / "test_000.png", studies / "test_001.png"
    label = mrk_json(tmp_path / "r.mrk.json", server["names"], server["truth"]["test_000"])
    url = f"{base}/datastore/image?image=reup"
    try:
        assert request_json(url, *_multipart("file", first, "x.png"), method="PUT")[1] == 200
        reply, status = request_json(f"{base}/datastore/label?image=reup", *_multipart("label", label), method="PUT")
        assert status == 200, reply
        stored_label = (studies / "labels" / "final" / "reup.mrk.json").read_bytes()
        reply, status = request_json(url, *_multipart("file", first, "x.png"), method="PUT")  # the same bytes
        assert status == 200, reply
        reply, status = request_json(url, *_multipart("file", other, "x.png"), method="PUT")
        assert status == 409 and "'reup'" in reply["detail"] and "final" in reply["detail"], reply
        assert '{"replace": true}' in reply["detail"]
        assert (studies / "reup.png").read_bytes() == first.read_bytes()
        assert (studies / "labels" / "final" / "reup.mrk.json").read_bytes() == stored_label
        reply, status = request_json(url, *_multipart("file", other, "x.png", {"replace": True}), method="PUT")
        assert status == 200, reply
        assert (studies / "reup.png").read_bytes() == other.read_bytes()
        assert _labels_of(server, "reup") == []
        entry = server["client"].datastore()["objects"]["reup"]
        assert entry["labels"] == {} and "replace" not in entry["image"]["info"], entry
        assert "image 'reup' replaced: its labels ['final'] removed" in server["log"].read_text()
    finally:
        assert request_json(f"{base}/datastore/image?id=reup", method="DELETE")[1] == 200


def test_label_points_naming_no_landmark_are_refused_naming_the_closest(server, tmp_path):
    """A point whose label names no landmark is refused 422 naming it and the closest landmark names (it was
    dropped, the landmark stored as missing); unnamed points, one per landmark, are still read in order."""
    names, truth = server["names"], server["truth"]["test_001"]
    misspelt = [n if i != 2 else n.replace("_", " ")[:-1] + "x" for i, n in enumerate(names)]
    url = f"{server['base']}/datastore/label?image=test_001&tag=final"
    bad = _slicer_point_list(tmp_path / "bad.mrk.json", misspelt, truth)
    reply, status = request_json(url, *_multipart("label", bad), method="PUT")
    assert status == 422 and f"points [{misspelt[2]!r}] name no landmark" in reply["detail"], reply
    assert f"did you mean [{names[2]!r}" in reply["detail"] and "'test_001'" in reply["detail"], reply
    assert server["client"].datastore()["objects"]["test_001"]["labels"] == {}  # nothing stored
    unnamed = _slicer_point_list(tmp_path / "unnamed.mrk.json", [f"F-{i + 1}" for i in range(len(names))], truth)
    reply, status = request_json(url, *_multipart("label", unnamed), method="PUT")
    try:
        assert status == 200, reply
    finally:
        assert request_json(f"{server['base']}/datastore/label?id=test_001&tag=final", method="DELETE")[1] == 200


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
        request_json(f"{base}/session/", *_multipart("files", server["studies"] / "test_000.png"), method="PUT")[1]
        == 406
    )
    reply, status = request_json(
        f"{base}/infer/wsi/landmarks?image=test_001", b"{}", {"Content-Type": "application/json"}
    )
    assert status == 404 and "whole-slide" in reply["detail"], reply


def test_oversized_request_options_are_refused_413_naming_the_limit(server):
    """A 100 KB ``params`` on an infer request and a 100 KB training request body were read and parsed whole (any
    size: FastAPI reads a body into memory), then answered about their keys: now 413 naming the size and the limit,
    nothing queued."""
    base, big = server["base"], json.dumps({"note": "x" * 100_000})
    reply, status = _form(f"{base}/infer/landmarks?image=test_001&output=json", "POST", params=big)
    assert status == 413, reply
    assert f"params of {len(big)} bytes, over the limit of 65536 bytes" in reply["detail"], reply
    reply, status = request_json(f"{base}/train/landmarks", big.encode(), {"Content-Type": "application/json"})
    assert status == 413 and "the train request's body (/train/landmarks): over the limit of 65536" in reply["detail"]
    assert request_json(f"{base}/train/?check_if_running=true")[1] == 404  # nothing was queued
    reply, status = _train_request(server, {"seed": -1})  # a small body still reaches the checks
    assert status == 422 and "'seed'" in reply["detail"], reply


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
    return request_json(
        f"{server['base']}/train/landmarks", json.dumps(params).encode(), {"Content-Type": "application/json"}
    )


def test_detector_training_needs_two_labelled_images(server):
    reply, status = _train_request(server, {**TINY_TRAIN, "network": "detector"})  # no saved label yet
    assert status == 422, reply
    assert "at least 2 labelled images" in reply["detail"] and "has 0 labelled images" in reply["detail"]
    reply, status = request_json(f"{server['base']}/train/?check_if_running=true")
    assert status == 404  # nothing was queued


def test_strategies_first_and_last_skip_labelled_images(server, tmp_path):
    client = server["client"]
    assert client.next_sample("first", {})["id"] == "test_000"
    assert client.next_sample("last", {})["id"] == "test_003"
    reply, status = request_json(
        f"{server['base']}/activelearning/nope", data=b"{}", headers={"Content-Type": "application/json"}
    )
    assert status == 404 and "'nope'" in reply["detail"] and "'first'" in reply["detail"]
    # a bad label is refused naming the image, and saves nothing
    bad = tmp_path / "bad.mrk.json"
    bad.write_text('{"markups": []}')
    with pytest.raises(MONAILabelClientException, match="Status: 422.*test_000"):
        client.save_label("test_000", str(bad), tag="final")
    for image_id in ("test_000", "test_003"):
        label = mrk_json(tmp_path / f"{image_id}.mrk.json", server["names"], server["truth"][image_id])
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
        ({"image_size": [17, 17]}, "image_size"),  # not divisible by 16: queued, then failed in the training
        ({"image_size": [64, 64], "crop_size": [128, 64]}, "crop_size"),
        ({"crop_size": [256, 256]}, "crop_size"),  # larger than train.yaml's image_size: failed in the training
        ({"image_size": [32, 32]}, "crop_size"),  # smaller than train.yaml's crop_size
        ({"crop_size": [16, 16], "batch_size": 1}, "crop_size"),  # one coarsest feature: BatchNorm failed
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
        ({"max_minutes": 0}, "max_minutes"),
        ({"max_minutes": "soon"}, "max_minutes"),
    ],
)
def test_bad_training_values_are_refused_naming_the_key(server, params, key):
    reply, status = _train_request(server, params)
    assert status == 422, reply
    assert repr(key) in reply["detail"]
    with pytest.raises(MONAILabelClientException, match=key):
        server["client"].train_start("landmarks", params)
    reply, status = request_json(f"{server['base']}/train/?check_if_running=true")
    assert status == 404  # nothing was queued


@pytest.mark.parametrize(
    "params, named",
    [
        ({"crop_size": [256, 256]}, ["[256, 256] is larger than image_size [192, 192]", "configs/train.yaml's"]),
        ({"image_size": [32, 32]}, ["[64, 64] is larger than image_size [32, 32]", "crop_size [64, 64]"]),
        ({"crop_size": [16, 16], "batch_size": 1}, ["[16, 16] with batch_size 1", "image_size [192, 192]"]),
    ],
)
def test_training_crops_are_checked_with_the_config_defaults(server, params, named):
    """A crop the bundle's training would refuse (check_crop_size), from a request's value and the train config's
    defaults for the keys it leaves out, is answered 422 naming the values before anything is queued."""
    reply, status = _train_request(server, params)
    assert status == 422 and "'crop_size' refused" in reply["detail"], reply
    assert all(text in reply["detail"] for text in named), reply
    assert request_json(f"{server['base']}/train/?check_if_running=true")[1] == 404  # nothing was queued


def test_a_negative_margin_is_refused_naming_its_value(server):
    """``min_improvement`` -1000 published a worse model over the served one: refused, naming the key and value."""
    reply, status = _train_request(server, {**TINY_TRAIN, "min_improvement": -1000})
    assert status == 422, reply
    assert "'min_improvement' must be a non-negative number" in reply["detail"] and "got -1000" in reply["detail"]
    assert request_json(f"{server['base']}/train/?check_if_running=true")[1] == 404  # nothing was queued


def test_training_reads_the_labels_and_keeps_the_served_model_when_not_better(server):
    client, model = server["client"], server["app"] / "model"
    client.train_start("landmarks", {**TINY_TRAIN, "min_improvement": 1e9})  # the new model can never be better enough
    status = wait_training(server)
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
    _module_reads_the_accuracy(client, stats, "served")
    assert stats["train"]["init_weights"] == "model.pt"  # fine-tuned from the served (shipped) weights, by name
    assert stats["eval"]["metrics"]["mre_trained"] > 0
    assert "leave-one-out" in stats["eval"]["scored_on"] and stats["epoch"] == 1 and "total_time" in stats
    assert (model / "candidate" / "model_final.pt").is_file() and not (model / "model.pt").exists()
    assert stats["device"] == "cpu"  # the app's conf device, also given to the bundle's training
    reply, _ = _infer_id(server, "test_001")
    assert reply["checkpoint"] == "model.pt" and reply["checkpoint_source"] == "shipped"


def _module_reads_the_accuracy(client, stats: dict, served: str) -> None:
    """3D Slicer's MONAILabel module's accuracy bar, read as it reads it (``/info/``'s first ``train_stats``, its
    ``best_metric``, 0 when absent, drawn as 0 to 100 %): the share of landmarks within 2 mm of the saved labels (20
    pixels without spacing) of the model ``served`` after the training (``served`` or ``trained``), the MRE beside it.
    (It was the MRE, which filled the bar as the model got worse.)"""
    train_stats = next(iter(client.info()["train_stats"].values()))
    accuracy = train_stats.get("best_metric", 0)
    metrics = stats["eval"]["metrics"]
    assert 0.0 <= accuracy <= 1.0 and accuracy == metrics[f"success_{served}"], train_stats
    assert train_stats["mre"] == metrics[f"mre_{served}"] > 0 and stats["eval"]["key_metric_name"] == "success"
    assert stats["eval"]["success_radius"] == "2 mm (20 pixels on an image without spacing)"


def _publish_always(server, request: dict) -> dict:
    server["client"].train_start("landmarks", {**request, "publish": "always"})  # whatever the new model scores
    status = wait_training(server)
    assert status["status"] == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    return server["client"].info()["train_stats"]["landmarks"]


def test_training_publishes_and_keeps_the_previous_model(server):
    model = server["app"] / "model"
    # in MONAI Label's own names: max_epochs and train_batch_size for epochs and batch_size
    request = {k: v for k, v in TINY_TRAIN.items() if k not in ("epochs", "batch_size")}
    stats = _publish_always(server, dict(request, max_epochs=1, train_batch_size=1))
    assert stats["epoch"] == 1  # not the default 10
    assert stats["published"] is True and stats["checkpoint"] == "model.pt"
    assert stats["decision"].startswith("published (publish 'always')")
    _module_reads_the_accuracy(server["client"], stats, "trained")
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


def _detector_stats(server, params: dict) -> dict:
    server["client"].train_start("landmarks", {**DETECTOR_TRAIN, **params})
    status = wait_training(server)
    assert status["status"] == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    stats = server["client"].info()["train_stats"]["landmarks"]
    assert stats["network"] == "detector"
    assert np.isfinite(stats["eval"]["metrics"]["mre_trained"]) and np.isfinite(stats["eval"]["metrics"]["mre_served"])
    assert (
        server["app"] / "model" / "candidate_detector" / "model_final.pt"
    ).is_file()  # no validation, still a checkpoint
    _module_reads_the_accuracy(server["client"], stats, "trained" if stats["published"] else "served")
    return stats


def test_detector_is_kept_out_when_not_better(server):
    model = server["app"] / "model"
    # 3 epochs asked for, a time budget that ends the training after the first
    stats = _detector_stats(server, {"min_improvement": 1e9, "epochs": 3, "max_minutes": 1e-6})
    assert stats["epoch"] == stats["train"]["epochs_run"] == 1
    assert stats["published"] is False and "kept template matching" in stats["decision"]
    assert stats["predictor"] == "templates" and stats["eval"]["served_predictor"] == "templates"
    # the encoder starts from the served stage-1 weights (published by the contrastive training above)
    assert stats["train"]["init_checkpoint"] == "model.pt" and stats["train"]["init_weights"] is None
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
    # what auto serves before the labels choose: matching, the detector having learnt from 1 saved label
    assert stats["predictor"] == "templates" and stats["checkpoint"] == "model.pt"
    info = json.loads((model / "detector.json").read_text())
    assert info["image_size"] == TINY_TRAIN["image_size"] and info["held_out"] == stats["train"]["held_out"]
    # auto passes over a detector that learnt from 1 saved label (fewer than 5): matching from the saved labels, also
    # before its choice is made (the first replies)
    deadline = time.monotonic() + 180
    while True:
        reply, status = _infer_id(server, "test_001")
        assert status == 200 and reply["predictor"] == "templates", reply
        if not reply["pending"]:
            break
        assert time.monotonic() < deadline, reply["pending"]
        time.sleep(2)
    assert reply["predictor"] == "templates" and "learnt from 1 saved label," in reply["predictor_choice"]["reason"]
    assert server["client"].info()["models"]["landmarks"]["pending"] == []  # /info/ says so too, without a suggestion
    _, reply = server["client"].infer("landmarks", "test_001", {"predictor": "detector"})
    assert (
        reply["predictor"] == "detector"
        and reply["checkpoint"] == "detector.pt"
        and reply["checkpoint_source"] == "published"
        and reply["templates"] == []
    )
    # refined by XFeat from the saved labels, as inferring refines a detector trained on human labels
    assert reply["xfeat_refinement"] == {"templates": ["test_000", "test_003"], "radius_mm": 1.0}, reply
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


def test_slicer_shows_a_low_confidence_warning(server):
    """A suggestion the served model is unsure of (the detector published above, trained for one iteration: its
    heatmap peaks are low; the module's options table set to ``predictor: detector``) carries its warning where the
    module shows it: beside the boxes, a point list of one point near the image's corner labelled as unsure, the
    warning in full its description. (The module printed the reply to its Python console only.) Submit Label sends
    ROI nodes only, so the point is never part of the label."""
    _, reply, rois, others = _slicer_run(server, "test_002", {"predictor": "detector"})
    assert reply["predictor"] == "detector" and "the detector's heatmap peaks average" in reply["warning"], reply
    assert len(rois) == 2 + len(server["names"])
    (note,) = others
    assert note["type"] == "Fiducial" and note["name"] == "Warning"
    (point,) = note["points"]
    assert point["label"].startswith("Low confidence: these suggestions are likely wrong")
    assert point["description"] == reply["warning"] and point["locked"] is True
    width, height = Image.open(server["studies"] / "test_002.png").size
    x, y, _ = point["position"]
    assert 0 <= x < 0.1 * width and 0 <= y < 0.1 * height


def test_detector_retrains_from_the_served_one_on_the_same_held_out_images(server, tmp_path):
    model = server["app"] / "model"
    before = json.loads((model / "detector.json").read_text())
    label = mrk_json(tmp_path / "test_001.mrk.json", server["names"], server["truth"]["test_001"])
    server["client"].save_label("test_001", str(label), tag="final")  # a third labelled image
    stats = _detector_stats(server, {"min_improvement": 1e9})
    assert stats["train"]["init_weights"] == "detector.pt" and stats["train"]["init_checkpoint"] is None
    assert stats["eval"]["served_predictor"] == "detector" and "kept the served detector" in stats["decision"]
    # the served detector is scored only on images it never trained on: its held-out image stays held out, its
    # training image stays in training, and the new one fills the held-out set (2 of 3: min_held_out 3, capped)
    assert sorted(stats["train"]["held_out"]) == sorted(before["held_out"] + ["test_001"])
    assert stats["train"]["trained_on"] == before["trained_on"]
    assert stats["published"] is False and stats["predictor"] == "templates"  # the served one learnt from 1 label
    assert json.loads((model / "detector.json").read_text()) == before


@pytest.mark.parametrize(
    "side, expected",
    [
        (12000, "12000 x 12000 pixels, more than the 50,000,000"),
        (
            20000,
            "more than the 50,000,000 pixels an X-ray picture may have, refused before decoding it (PIL: Image size",
        ),
    ],
)
def test_a_giant_picture_is_refused_before_it_is_decoded(server, tmp_path, side, expected):
    """A blank PNG of 12000 x 12000 (140 kB on disk, 0.6 GB of floats decoded) or 20000 x 20000 (49 kB, 1-bit; past
    PIL's own DecompressionBombError, once taken for "not a picture" and decoded: 5 GB) is refused 4xx naming its
    size by the datastore's upload and by inference; neither keeps it (studies folder and datastore unchanged)."""
    giant = tmp_path / "giant.png"
    Image.new("L" if side < 20000 else "1", (side, side)).save(giant)
    before = _tree(server["studies"])
    url = f"{server['base']}/datastore/image?image=giant"
    reply, status = request_json(url, *_multipart("file", giant, "giant.png"), method="PUT")
    assert status == 422, (status, reply)
    assert expected in reply["detail"], reply
    reply, status = request_json(f"{server['base']}/infer/landmarks?output=json", *_multipart("file", giant))
    assert 400 <= status < 500 and expected in reply["detail"], (status, reply)
    assert _tree(server["studies"]) == before
    assert "giant" not in json.dumps(server["client"].datastore())


def _strings(value) -> list[str]:
    """Every string of a JSON value, keys included."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_replies_name_no_server_path_and_the_log_is_not_served(server):
    """``/info/`` (the training statistics' checkpoints), ``/activelearning/``, the datastore's image info and datalist
    and the task status replies carry names, not server paths; the server log (``/logs/``, also a task's
    ``details``) is served only where the operator turns it on (``--conf serve_logs true``)."""
    base = server["base"]
    reply, status = request_json(f"{base}/logs/")
    assert status == 403 and "--conf serve_logs true" in reply["detail"], reply
    assert request_json(f"{base}/logs/gpu")[1] == 403
    sample, status = request_json(f"{base}/activelearning/first", b"{}", {"Content-Type": "application/json"})
    assert status == 200 and sample["id"], sample  # an unlabelled image is left
    replies = {
        "info": request_json(f"{base}/info/"),
        "activelearning": (sample, status),
        "train": request_json(f"{base}/train/?all=true"),
        "image_info": request_json(f"{base}/datastore/image/info?image=test_000"),
        "datalist": request_json(f"{base}/datastore/?output=train"),
        "batch": request_json(f"{base}/batch/infer/landmarks", b"{}", {"Content-Type": "application/json"}),
    }
    assert replies["info"][0]["train_stats"]["landmarks"]["checkpoint"] == "model.pt"  # the trainings above ran
    assert replies["train"][1] == 200 and replies["train"][0]
    assert {"image": "test_000.png", "label": "test_000.mrk.json"} in replies["datalist"][0]  # file names
    for name, (reply, _) in replies.items():
        for text in _strings(reply):
            assert not text.startswith("/") and str(server["studies"]) not in text, (name, text)
            assert str(server["work"]) not in text and str(ROOT) not in text, (name, text)


def test_a_label_nesting_too_deep_is_refused_naming_the_image(server, tmp_path):
    """A label whose JSON nests 100000 levels (json.loads raises RecursionError: 500) is answered 422 naming the image;
    nothing is stored."""
    deep = tmp_path / "deep.mrk.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    before = _tree(server["studies"])
    reply, status = request_json(
        f"{server['base']}/datastore/label?image=test_002&tag=final", *_multipart("label", deep), method="PUT"
    )
    assert status == 422 and "'test_002'" in reply["detail"] and "nests too deeply" in reply["detail"], reply
    assert _tree(server["studies"]) == before


def test_a_long_image_id_is_refused_naming_the_limit(server):
    """A 300-character image id (its file name too long for the file system, ENAMETOOLONG: 500) is answered 400
    naming it and the limit; nothing is stored."""
    long_id = "a" * 300
    before = _tree(server["studies"])
    reply, status = request_json(
        f"{server['base']}/datastore/image?image={long_id}",
        *_multipart("file", server["studies"] / "test_000.png", "x.png"),
        method="PUT",
    )
    assert status == 400 and repr(long_id) in reply["detail"] and "longer than 200 bytes" in reply["detail"], reply
    assert _tree(server["studies"]) == before


@pytest.mark.parametrize(
    "method, route, status, why",
    [
        ("POST", "/batch/infer/landmarks?run_sync=true", 404, "batch inference is not served"),  # ZeroDivisionError
        ("GET", "/batch/infer", 404, "batch inference is not served"),
        ("POST", "/scoring/anything", 404, "scoring is not served"),  # started an app in a subprocess, which failed
        ("GET", "/scoring/", 404, "scoring is not served"),
        ("POST", "/train/", 404, "POST /train/landmarks"),  # MONAI Label's every-model route skipped the checks
        ("GET", "/proxy/dicom/studies", 404, "not DICOMweb"),  # requests' MissingSchema: 500
        ("GET", "/proxy/dicom/qido/studies", 404, "not DICOMweb"),
        ("POST", "/infer/wsi_v2/landmarks", 404, "whole-slide"),  # no image: 500
        ("POST", "/reload", 404, "restart the server"),  # dropped the app: the next request built a new one
        ("PUT", "/model/landmarks", 404, "POST /train/landmarks publishes"),
        ("DELETE", "/model/landmarks", 404, "POST /train/landmarks publishes"),
        ("GET", "/datastore/dataset", 404, "copy the studies folder"),  # a zip of the dataset left in the temp dir
        ("GET", "/ohif/..", 400, "'..'"),  # FileResponse of a folder: 500
        # percent-encoded '..' on any route; with a DICOMweb source the proxy's requests decodes a client's
        # %252e%252e to '..' in the path it forwards with the server's credentials
        ("GET", "/proxy/dicom/%2e%2e/secret", 400, "'..'"),
        ("GET", "/proxy/dicom/qido/%2E%2e/", 400, "'..'"),
        ("POST", "/proxy/dicom/wado/..%2fsecret", 400, "'..'"),
        ("GET", "/proxy/dicom/%252e%252e/secret", 400, "'..'"),
        ("GET", "/proxy/dicom/stow/%252E%252E%252fsecret", 400, "'..'"),
        ("GET", "/ohif/%2e%2e", 400, "'..'"),
        ("GET", "/static/%252e%252e/secret", 400, "'..'"),
        ("GET", "/datastore/image/%2e", 400, "'..'"),
        ("GET", "/logs/gpu", 403, "serve_logs"),  # no nvidia-smi: 500
    ],
)
def test_routes_not_served_are_refused_saying_so(server, method, route, status, why):
    reply, got = request_json(f"{server['base']}{route}", b"{}" if method in ("POST", "PUT") else None, method=method)
    assert got == status and why in reply["detail"], (got, reply)


def test_infer_options_in_a_json_body_are_refused_saying_where_they_go(server):
    """``POST /infer`` with its options as a JSON body (``-H "Content-Type: application/json" -d '{"predictor":
    "templates"}'``) was answered 200 and the options ignored (only the multipart ``params`` field is read): 415
    saying so; the same options in ``params`` are read."""
    url = f"{server['base']}/infer/landmarks?image=test_000&output=json"
    body = json.dumps({"predictor": "templates"}).encode()
    reply, status = request_json(url, body, {"Content-Type": "application/json"})
    assert status == 415 and "multipart form field 'params'" in reply["detail"], (status, reply)
    reply, status = _form(url, "POST", params=json.dumps({"predictor": "templates"}))
    assert status == 200 and reply["predictor"] == "templates", (status, reply)


def test_a_full_disk_leaves_the_saved_label_intact(server, small_disk, tmp_path):
    """On a full studies disk, saving a label over a saved one is answered 507 naming the cause, and the saved
    label and the datastore's file are left byte-identical (MONAI Label copied the new label over the old one in
    place: a 500, and the old label cut to broken JSON)."""
    studies = small_disk / "studies"
    studies.mkdir()
    shutil.copy(server["studies"] / "test_000.png", studies)
    names = server["names"]
    saved = mrk_json(tmp_path / "saved.mrk.json", names, server["truth"]["test_000"])
    (tmp_path / "work").mkdir()
    with app_server(tmp_path / "work", studies, "datalist", str(server["datalist"])) as running:
        url = f"{running['base']}/datastore/label?image=test_000"
        assert request_json(url, *_multipart("label", saved), method="PUT")[1] == 200
        label = studies / "labels" / "final" / "test_000.mrk.json"
        before = {p: p.read_bytes() for p in (label, studies / "datastore_v2.json")}
        with open(small_disk / "filler", "wb", buffering=0) as filler:  # the disk filled up
            with pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 65536)
        moved = [[x + 3.0, y + 3.0] for x, y in server["truth"]["test_000"]]
        new = _slicer_point_list(tmp_path / "new.mrk.json", names, moved)
        reply, status = request_json(url, *_multipart("label", new), method="PUT")
        assert status == 507, (status, reply)
        assert "label 'final' of image 'test_000' not stored: no space left" in reply["detail"], reply
        assert {p: p.read_bytes() for p in before} == before
        assert sorted(os.listdir(label.parent)) == ["test_000.mrk.json"]  # no temporary file left
        (small_disk / "filler").unlink()
        assert request_json(url, *_multipart("label", new), method="PUT")[1] == 200
        assert label.read_bytes() == new.read_bytes()


@pytest.mark.parametrize(
    "client_id, why",
    [
        ("x" * 2000, "longer than 200 bytes"),  # stored whole in datastore_v2.json
        ("slicer\n\x1b[31m", "control character"),
        ({"nested": [1, 2]}, "not a string"),
    ],
)
def test_a_bad_client_id_is_refused_naming_it(server, client_id, why):
    """``/activelearning/`` stores the request's ``client_id`` with the sample in ``datastore_v2.json``: one that is
    not a short string without control characters is answered 400 naming it; nothing is stored."""
    before = _tree(server["studies"])
    reply, status = request_json(
        f"{server['base']}/activelearning/first",
        json.dumps({"client_id": client_id}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400 and "'client_id'" in reply["detail"] and why in reply["detail"], (status, reply)
    assert _tree(server["studies"]) == before


def test_stopping_no_training_is_answered_404(server):
    """``DELETE /train/`` with no training running answered 200 ``null``: 404 saying so."""
    assert request_json(f"{server['base']}/train/?check_if_running=true")[1] == 404
    reply, status = request_json(f"{server['base']}/train/", method="DELETE")
    assert status == 404 and reply["detail"] == "no training is running", (status, reply)
