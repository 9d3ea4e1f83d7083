"""A MONAI Label server of the bundle's app (``apps/monailabel``), started and driven from Python with MONAI Label's
own client: what the tests and ``python -m scripts.experiments.labels_loop`` run.

MONAI Label lives in its own environment (``make monailabel``: ``.venv-monailabel``, or ``MONAILABEL_PYTHON``); its
client is imported from there too, after the project's packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
MONAILABEL_PYTHON = Path(os.environ.get("MONAILABEL_PYTHON", ROOT / ".venv-monailabel" / "bin" / "python"))


def client_classes(python: Path = MONAILABEL_PYTHON) -> tuple[type, type]:
    """``(MONAILabelClient, MONAILabelClientException)`` from the server's environment (its ``requests`` is not
    in the project's environment)."""
    if not Path(python).is_file():
        raise FileNotFoundError(
            f"MONAI Label's Python not found: {python} (make monailabel sets up .venv-monailabel; or set "
            "MONAILABEL_PYTHON to the Python of an environment with monailabel)"
        )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    sys.path.append(purelib)  # after the project's packages: only what the project's environment lacks
    try:
        from monailabel.client.client import MONAILabelClient, MONAILabelClientException
    finally:
        sys.path.remove(purelib)
    return MONAILabelClient, MONAILabelClientException


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(
    workdir: Path,
    studies: Path,
    conf: Sequence[str] = (),
    python: Path = MONAILABEL_PYTHON,
    threads: int | None = 1,
    start_timeout_s: float = 300,
) -> Iterator[dict]:
    """A server of a copy of the app (``workdir/app``; its temp dir ``workdir/server_tmp``, its log
    ``workdir/server.log``) over ``studies`` on a free local port, with ``--conf device cpu``, the repository as
    ``bundle_root`` and the ``conf`` key-value pairs; ``threads``: its ``OMP_NUM_THREADS`` (None: the machine's).

    Yields ``{"base", "client", "info", "app", "tmp", "log", "start_s"}``; RuntimeError with the log's tail when it
    does not start within ``start_timeout_s``. Stopped (its process group) on leaving.
    """
    client_class, client_error = client_classes(python)
    workdir, studies = Path(workdir).resolve(), Path(studies).resolve()
    app = workdir / "app"
    shutil.copytree(
        ROOT / "apps/monailabel", app, ignore=shutil.ignore_patterns("__pycache__", "bin", "lib", "logs", "model")
    )
    server_tmp = workdir / "server_tmp"
    server_tmp.mkdir()
    port = free_port()
    command = [str(python), "-m", "monailabel.main", "start_server", "--app", str(app), "--studies", str(studies)]
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--conf",
        "bundle_root",
        str(ROOT),
        "--conf",
        "device",
        "cpu",
    ]
    for key, value in zip(conf[::2], conf[1::2]):
        command += ["--conf", key, value]
    log_path = workdir / "server.log"
    env = dict(os.environ, MONAI_LABEL_DATASTORE_AUTO_RELOAD="false", TMPDIR=str(server_tmp))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        base = f"http://127.0.0.1:{port}"
        client = client_class(base, tmpdir=str(workdir / "client"))
        try:
            while True:
                try:
                    info = client.info()
                    break
                except (OSError, client_error):
                    if process.poll() is not None or time.monotonic() > started + start_timeout_s:
                        written = log_path.read_text(encoding="utf-8", errors="replace")
                        raise RuntimeError(f"the server did not start:\n{written[-4000:]}") from None
                    time.sleep(0.5)
            yield {
                "base": base,
                "client": client,
                "info": info,
                "app": app,
                "tmp": server_tmp,
                "log": log_path,
                "start_s": time.monotonic() - started,
            }
        finally:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """Stop the server's process group (its training children too)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue
