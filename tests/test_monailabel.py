"""MONAI Label: a real server on 127.0.0.1 suggests landmarks on a posted image and trains on its images.

Needs the app's environment (``make monailabel`` -> ``.venv-monailabel``, or ``MONAILABEL_PYTHON``);
without it the test is skipped, except under CI where it must run.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("MONAILABEL_PYTHON", ROOT / ".venv-monailabel" / "bin" / "python"))
START_TIMEOUT_S = 90
TRAIN_TIMEOUT_S = 120
TINY_TRAIN = {"epochs": 1, "epoch_length": 1, "batch_size": 1, "image_size": [64, 64], "crop_size": [32, 32], "num_queries": 4, "val_interval": 1}

if not PYTHON.is_file():
    if os.environ.get("CI"):
        pytest.fail(f"no MONAI Label environment at {PYTHON}: run `make monailabel` before the tests", pytrace=False)
    pytest.skip(f"no MONAI Label environment at {PYTHON} (make monailabel)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, data: bytes | None = None, headers: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return json.loads(response.read())


def _multipart(field: str, path: Path) -> tuple[bytes, dict]:
    boundary = uuid.uuid4().hex
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{path.name}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def _cli_predictions(image: Path, out: Path) -> dict[str, tuple[float, float]]:
    """The bundle's own command-line inference on ``image`` (the reference the server must match)."""
    command = [
        sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file", "configs/inference.yaml",
        "--datalist", str(ROOT / "data/synthetic_2d/datalist.json"),  # the server's template
        "--images", f"['{image}']", "--output_dir", str(out), "--overlays", "False",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "predictions.csv") as f:
        return {r["landmark"]: (float(r["x"]), float(r["y"])) for r in csv.DictReader(f)}


@pytest.fixture
def server(tmp_path):
    """A MONAI Label server of a copy of the app (it writes logs and models into its folder)."""
    from bundle.data.datalist import open_datalist

    datalist = open_datalist(ROOT / "data/synthetic_2d/datalist.json")  # generated when missing
    app = tmp_path / "app"
    shutil.copytree(ROOT / "apps/monailabel", app, ignore=shutil.ignore_patterns("__pycache__", "bin", "lib", "logs", "model"))
    studies = tmp_path / "studies"
    studies.mkdir()
    for item in datalist["test"][:2]:
        shutil.copy(ROOT / "data/synthetic_2d" / item["image"], studies)
    port = _free_port()
    command = [
        str(PYTHON), "-m", "monailabel.main", "start_server", "--app", str(app), "--studies", str(studies),
        "--host", "127.0.0.1", "--port", str(port), "--conf", "bundle_root", str(ROOT),
    ]
    log = open(tmp_path / "server.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", MONAI_LABEL_DATASTORE_AUTO_RELOAD="false")
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                info = _request(f"{base}/info/", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"server did not start:\n{(tmp_path / 'server.log').read_text()[-4000:]}")
                time.sleep(0.5)
        yield {"base": base, "info": info, "app": app, "studies": studies, "log": tmp_path / "server.log"}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)
        log.close()


def test_server_suggests_landmarks_and_trains_on_its_images(server, tmp_path):
    info = server["info"]
    assert "landmarks" in info["models"] and "landmarks" in info["trainers"]
    names = info["models"]["landmarks"]["labels"]
    image = sorted(server["studies"].glob("*.png"))[0]

    # infer: an uploaded image, no user input; the points match the bundle's own command line
    body, headers = _multipart("file", image)
    result = _request(f"{server['base']}/infer/landmarks?output=json", body, headers, timeout=60)
    reference = _cli_predictions(image, tmp_path / "cli")
    assert list(result["landmarks"]) == list(names) == list(reference)
    for name in names:
        assert result["landmarks"][name] == pytest.approx(reference[name], abs=1e-3), name
    # OHIF-style centroids: 1-based index, then rounded pixel indices
    for i, name in enumerate(names):
        x, y = result["landmarks"][name]
        assert result["centroids"][name] == [str(i + 1), str(round(x)), str(round(y)), "0"]
    # 3D Slicer markups: a PNG's pixel (x, y) sits at LPS (x, y, 0) when Slicer (ITK) loads it with spacing 1
    markup = result["markups"]["markups"][0]
    assert markup["type"] == "Fiducial" and markup["coordinateSystem"] == "LPS"
    for point in markup["controlPoints"]:
        assert point["position"] == pytest.approx([*result["landmarks"][point["label"]], 0.0], abs=1e-6)

    # train: the bundle's training on the server's images writes the app's model, which infer then uses
    _request(f"{server['base']}/train/landmarks", json.dumps(TINY_TRAIN).encode(), {"Content-Type": "application/json"})
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    model = server["app"] / "model" / "model.pt"
    while time.monotonic() < deadline:
        status = _request(f"{server['base']}/train/?check_if_running=false", timeout=10)
        if isinstance(status, dict) and status.get("status") in ("DONE", "ERROR"):
            break
        time.sleep(1)
    assert status.get("status") == "DONE", f"{status}\n{server['log'].read_text()[-4000:]}"
    assert model.is_file()
    datalist = json.loads((server["app"] / "model" / "train" / "datalist.json").read_text())
    assert sorted(Path(it["image"]).name for it in datalist["training"]) == sorted(p.name for p in server["studies"].glob("*.png"))
    retrained = _request(f"{server['base']}/infer/landmarks?output=json", *_multipart("file", image), timeout=60)
    assert result["checkpoint"] == str(ROOT / "models" / "model.pt") and retrained["checkpoint"] == str(model)
    assert list(retrained["landmarks"]) == list(names)
