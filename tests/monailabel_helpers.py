"""What the MONAI Label tests share (tests/test_monailabel.py, tests/test_monailabel_apps.py): the app's environment,
a server started through ``scripts.monailabel_server``, raw HTTP calls, Slicer point lists and the bundle's own
command line as the reference the app must match."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from bundle_runs import bundle_command
from scripts.monailabel_server import MONAILABEL_PYTHON, serving

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
DETECTOR_TRAIN = {**TINY_TRAIN, "network": "detector"}


def require_monailabel_environment() -> None:
    """Skips the calling test module without the app's environment (``make monailabel`` -> ``.venv-monailabel``, or
    ``MONAILABEL_PYTHON``); under CI its absence is a failure."""
    if not PYTHON.is_file():
        if os.environ.get("CI"):
            pytest.fail(
                f"no MONAI Label environment at {PYTHON}: run `make monailabel` before the tests", pytrace=False
            )
        pytest.skip(f"no MONAI Label environment at {PYTHON} (make monailabel)", allow_module_level=True)


def request_json(
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


def run_checked(command: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
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


def cli_predictions(
    image: Path, datalist: Path | None, out: Path, *args: str, pipeline: str = "templates"
) -> dict[str, tuple[float, float]]:
    """The bundle's own command-line inference on ``image`` (the reference the server must match): by default
    matching (``--pipeline templates``) from the templates of ``datalist`` (None: the built-in ones), as the app does
    until a detector is served; another ``pipeline`` (``auto``: what ``inferring`` takes), and the further
    command-line ``args``."""
    template = ["--datalist", datalist] if datalist else []  # the server's template
    options = ["--images", f"['{image}']", "--output_dir", out, "--overlays", "False", "--pipeline", pipeline]
    command = bundle_command("inferring", "configs/inference.yaml", *template, *options, *args)
    run_checked(command, ROOT, timeout=180)
    with open(out / "predictions.csv") as f:
        return {r["landmark"]: (float(r["x"]), float(r["y"])) for r in csv.DictReader(f)}


def mrk_json(path: Path, names: list[str], points: list) -> Path:
    """A Slicer point list over a PNG: pixel (x, y) at LPS (x, y, 0)."""
    from bundle.data.markups import ControlPoint, write_mrk_json

    return write_mrk_json(
        path,
        [ControlPoint(n, None if p is None else (-p[0], -p[1], 0.0)) for n, p in zip(names, points)],
        coordinate_system="LPS",
    )


@contextmanager
def app_server(tmp_path: Path, studies: Path, *conf: str) -> Iterator[dict]:
    """``scripts.monailabel_server.serving`` (one thread), a start that fails being the test's failure."""
    try:
        with serving(tmp_path, studies, conf, PYTHON, threads=1, start_timeout_s=START_TIMEOUT_S) as running:
            yield running
    except RuntimeError as e:
        if "did not start" not in str(e):
            raise
        pytest.fail(str(e))


def wait_training(server) -> dict:
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        status = server["client"].train_status()
        if isinstance(status, dict) and status.get("status") in ("DONE", "ERROR"):
            return status
        time.sleep(1)
    pytest.fail(f"training did not end in {TRAIN_TIMEOUT_S} s\n{server['log'].read_text()[-4000:]}")
