"""Server-side guards of the app around two MONAI Label 0.8.5 endpoints (installed by the app in the server process).

- ``POST /infer/{model}``: the request is checked before MONAI Label reads it (400 naming the fault): ``params``
  must be a JSON object without ``image`` (the image is ``?image=ID`` or an upload, never a value of params);
  an image id or a file must be given (MONAI Label answers 500); no label upload and no ``session_id`` (the
  app's infer takes no label, and sessions are off in this app).
- ``POST /infer/{model}`` with a ``file``: MONAI Label writes the upload to a temporary file and removes it only
  after a successful reply, so a failed request left it in the temp dir for good, and it passes the upload as a
  plain path, which the app could not tell from a path a client typed. Here the app writes the upload itself
  (``landmarks-upload-*`` in the temp dir), registers it as an upload, runs the endpoint on it and removes it in
  every case; the app's ``infer`` accepts a path only when it is a registered upload (else a datastore image id).
- ``POST /train/{model}``: the training options are checked before the task is queued, so a bad value
  (``{"epochs": "abc"}``) is answered 422 naming the key instead of failing later in the training process.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from fastapi import HTTPException

logger = logging.getLogger(__name__)
_uploads: dict[str, str] = {}  # path of an upload being inferred -> the client's file name
_lock = threading.Lock()
_SUFFIX = re.compile(r"^(\.[A-Za-z0-9]{1,8}){1,3}$")


def upload_name(path: object) -> str | None:
    """The client's file name when ``path`` is an upload that the guard registered, else None."""
    with _lock:
        return _uploads.get(path) if isinstance(path, str) else None


def _suffix(filename: str | None) -> str:
    suffix = "".join(Path(filename or "").suffixes)
    return suffix if _SUFFIX.match(suffix) else ""


def _install(module: str, name: str, wrap: Callable[[Callable], Callable]) -> bool:
    """Replace ``module.name`` by ``wrap(original)``, once per process; False (warned) when monailabel has no
    such module."""
    try:
        endpoint = importlib.import_module(module)
    except ImportError:  # pragma: no cover - another monailabel layout
        logger.warning(f"{module} not found: {name} is not guarded")
        return False
    original = getattr(endpoint, name)
    if getattr(original, "_landmark_guard", False):
        return True
    guarded = functools.wraps(original)(wrap(original))
    guarded._landmark_guard = True
    setattr(endpoint, name, guarded)
    return True


def check_infer_request(model: str, image: str, session_id: str, params: str, file, label) -> None:
    """Refuse (400 naming the fault) an infer request that the app cannot serve, before MONAI Label reads it."""

    def bad(detail: str):
        raise HTTPException(status_code=400, detail=f"infer {model}: {detail}")

    if session_id:
        bad(f"sessions are off in this app (session_id {session_id!r:.60}); give ?image=ID or upload the file")
    if label:
        bad("this app's infer takes no label upload (save labels with PUT /datastore/label)")
    try:
        values = json.loads(params) if params else {}
    except ValueError as e:
        bad(f"params is not JSON ({e}): {params!r:.80}")
    if not isinstance(values, dict):
        bad(f"params must be a JSON object, got {params!r:.80}")
    if "image" in values:
        bad(f"params may not hold 'image' ({values['image']!r:.60}): give the image as ?image=ID or upload a file")
    if not image and not file:
        bad("give an image id of the datastore (?image=ID) or upload a file")


def install_infer_guard() -> bool:
    """Wrap ``monailabel.endpoints.infer.run_inference`` (called by the route at request time)."""

    def wrap(original: Callable) -> Callable:
        def run_inference(
            background_tasks, model, image="", session_id="", params="{}", file=None, label=None, output=None
        ):
            check_infer_request(model, image, session_id, params, file, label)
            if not file:
                return original(background_tasks, model, image, session_id, params, file, label, output)
            fd, path = tempfile.mkstemp(prefix="landmarks-upload-", suffix=_suffix(file.filename))
            try:
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(file.file, out)
                with _lock:
                    _uploads[path] = os.path.basename(file.filename or "upload")
                return original(background_tasks, model, path, session_id, params, None, label, output)
            finally:
                with _lock:
                    _uploads.pop(path, None)
                Path(path).unlink(missing_ok=True)

        return run_inference

    return _install("monailabel.endpoints.infer", "run_inference", wrap)


def install_train_guard(validate: Callable[[dict], object]) -> bool:
    """Wrap ``monailabel.endpoints.train.run_model``: ``validate(params)`` raising ValueError -> 422."""

    def wrap(original: Callable) -> Callable:
        def run_model(model, params=None, run_sync=False, enqueue=False):
            try:
                validate(dict(params or {}))
            except ValueError as e:
                raise HTTPException(status_code=422, detail=str(e)) from None
            return original(model, params, run_sync, enqueue)

        return run_model

    return _install("monailabel.endpoints.train", "run_model", wrap)
