"""Server-side guards of the app around MONAI Label 0.8.5 endpoints (installed by the app in the server process).

- ``POST /infer/{model}``: the request is checked before MONAI Label reads it (400 naming the fault): ``params``
  must be at most :data:`PARAMS_MAX` bytes (413; Starlette refuses a form field over 1 MB itself, 400) and a JSON
  object without ``image`` (the image is ``?image=ID`` or an upload, never a value of params);
  an image id or a file must be given (MONAI Label answers 500); no label upload and no ``session_id`` (the
  app's infer takes no label, and sessions are off in this app).
- ``POST /infer/{model}`` with a ``file``: MONAI Label writes the upload to a temporary file and removes it only
  after a successful reply, so a failed request left it in the temp dir for good, and it passes the upload as a
  plain path, which the app could not tell from a path a client typed. Here the app writes the upload itself
  (``landmarks-upload-*`` in the temp dir), registers it as an upload, runs the endpoint on it and removes it in
  every case; the app's ``infer`` accepts a path only when it is a registered upload (else a datastore image id).
- ``POST /train/{model}``: the training options are checked before the task is queued, so a bad value
  (``{"epochs": "abc"}``) is answered 422 naming the key instead of failing later in the training process.
- ``GET /info/``, ``POST /activelearning/{strategy}``, ``GET /datastore/``, ``GET /datastore/image/info``,
  ``GET /datastore/label/info``: server paths in the reply are replaced by file names.
- ``GET /train/``, ``DELETE /train/``: a task's ``details`` (the training process's last log lines, server paths
  among them) are left out unless the operator serves the log (``--conf serve_logs true``); ``DELETE /train/``
  with no training running is answered 404 (MONAI Label answers 200 ``null``).

:class:`RouteGuard` (placed before every route of MONAI Label's FastAPI app) refuses the routes this app does not
serve, before MONAI Label reads the request (:data:`OFF_ROUTES`): a path segment ``.`` or ``..`` (400; also
percent-encoded, once or more), the log (403 unless ``--conf serve_logs true``), batch inference, scoring,
whole-slide inference, the app reload, the dataset archive, replacing or deleting the served weights, the DICOMweb
proxy without a DICOMweb source (404 each, saying so); an infer request's options sent as a JSON body (415: MONAI
Label reads only the multipart form field ``params``, and ignored them); a ``POST /train/{model}`` body over
:data:`PARAMS_MAX` bytes (413, read no further: FastAPI read any body whole, then parsed it).
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
from urllib.parse import unquote

from fastapi import HTTPException
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)
_uploads: dict[str, str] = {}  # path of an upload being inferred -> the client's file name
_lock = threading.Lock()
_SUFFIX = re.compile(r"^(\.[A-Za-z0-9]{1,8}){1,3}$")
# the most bytes of a request's options (an infer request's params, a train request's JSON body): a few hundred
# bytes in use, far below what would cost the server memory or time to read and parse
PARAMS_MAX = 64 * 1024


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
    if params and len(params.encode()) > PARAMS_MAX:
        raise HTTPException(
            status_code=413,
            detail=f"infer {model}: params of {len(params.encode())} bytes, over the limit of {PARAMS_MAX} bytes",
        )
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


def without_paths(value: object) -> object:
    """``value`` (a reply's JSON) with every absolute path replaced by its file name."""
    if isinstance(value, dict):
        return {k: without_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.basename(value.rstrip("/\\")) or value
    return value


SERVE_LOGS = "start the server with --conf serve_logs true to serve it"
# (path prefix, methods (None: all), status, why): MONAI Label routes this app does not serve
OFF_ROUTES = [
    ("/batch/", None, 404, "batch inference is not served by this app: infer each image (POST /infer/landmarks)"),
    ("/scoring/", None, 404, "scoring is not served by this app (it has no scoring methods; training scores itself)"),
    ("/infer/wsi", None, 404, "this app has no whole-slide (WSI) inference: use POST /infer/landmarks"),
    ("/reload", None, 404, "reloading the app is not served by this app: restart the server"),
    (
        "/datastore/dataset",
        None,
        404,
        "the dataset archive is not served by this app (MONAI Label leaves each one in the server's temp dir): "
        "copy the studies folder",
    ),
    (
        "/model/",
        {"PUT", "DELETE"},
        404,
        "replacing or deleting the served weights is not served by this app: POST /train/landmarks publishes them "
        "by its rule (docs/monailabel.md, restoring a model)",
    ),
]


def has_dot_segment(path: str) -> bool:
    """Whether ``path`` (the server's decoded request path) has a segment ``.`` or ``..``, also once it is decoded
    again, as often as it holds percent escapes: the DICOMweb proxy's ``requests`` decodes ``%2e`` in the path it
    forwards, so a client's ``%252e%252e`` reached the DICOMweb server as ``..``."""
    decoded = unquote(path)
    while decoded != path:
        path, decoded = decoded, unquote(decoded)
    return any(part in (".", "..") for part in re.split(r"[/\\]", path))


class RouteGuard:
    """ASGI middleware refusing the routes the app does not serve (module docstring); ``dicomweb``: the studies are
    a DICOMweb source (the proxy is served); ``serve_logs``: the log routes are served."""

    def __init__(self, app, dicomweb: bool, serve_logs: bool) -> None:
        self.app, self.dicomweb, self.serve_logs = app, dicomweb, serve_logs

    def refusal(self, method: str, path: str, content_type: str = "") -> tuple[int, str] | None:
        """(status, why) when the request is not served, else None."""
        if has_dot_segment(path):
            return 400, f"{path!r:.200}: a path segment '.' or '..' (percent-encoded too) is refused"
        if path.startswith("/logs"):
            if not self.serve_logs:
                return 403, f"the server log is not served: {SERVE_LOGS}"
            if path.startswith("/logs/gpu") and shutil.which("nvidia-smi") is None:
                return 404, "no nvidia-smi on this server: no GPU information"
        if path.startswith("/proxy/") and not self.dicomweb:
            return 404, "the DICOMweb proxy is not served: this server's studies are a local folder, not DICOMweb"
        if method == "POST" and path.rstrip("/") == "/train":
            return 404, "training every model at once (POST /train/) is not served by this app: POST /train/landmarks"
        for prefix, methods, status, why in OFF_ROUTES:
            if path.startswith(prefix) and (methods is None or method in methods):
                return status, why
        if method == "POST" and path.startswith("/infer/") and content_type.startswith("application/json"):
            return 415, (
                "an infer request's options are not read from a JSON body: send them as the multipart form field "
                """'params' (curl -F 'params={"predictor": "templates"}' ...)"""
            )
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
            refused = self.refusal(scope["method"], scope["path"], content_type)
        else:
            refused = None
        if (
            refused is None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"].startswith("/train")
        ):
            body, refused = await _capped_body(receive, f"the train request's body ({scope['path']})")
            receive = _replay(body, receive)
        if refused is None:
            return await self.app(scope, receive, send)
        status, why = refused
        await JSONResponse({"detail": why}, status_code=status)(scope, receive, send)


async def _capped_body(receive, what: str) -> tuple[bytes, tuple[int, str] | None]:
    """The request's body read up to :data:`PARAMS_MAX` bytes, and (413, why) when it holds more (read no further)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > PARAMS_MAX:
            return b"", (413, f"{what}: over the limit of {PARAMS_MAX} bytes")
        if not message.get("more_body"):
            return body, None


def _replay(body: bytes, receive):
    """An ASGI ``receive`` giving ``body`` (read already) as the whole request, then ``receive``'s next messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def install_route_guard(dicomweb: bool, serve_logs: bool) -> bool:
    """Place :class:`RouteGuard` before the routes of MONAI Label's FastAPI app (``monailabel.app.app``), once; the
    app is built already when the MONAI Label app starts (its lifespan), so its middleware stack is rebuilt."""
    from fastapi.middleware import Middleware
    from monailabel.app import app

    if any(m.cls is RouteGuard for m in app.user_middleware):
        return True
    app.user_middleware.insert(0, Middleware(RouteGuard, dicomweb=dicomweb, serve_logs=serve_logs))
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()
    return True


# (endpoint module, function) whose replies may carry server paths (a sample's or an image's ``path``, the datalist's
# files, the training statistics' checkpoints)
PATH_REPLIES = [
    ("monailabel.endpoints.info", "app_info"),
    ("monailabel.endpoints.activelearning", "sample"),
    ("monailabel.endpoints.datastore", "datastore"),
    ("monailabel.endpoints.datastore", "get_image_info"),
    ("monailabel.endpoints.datastore", "get_label_info"),
]


def install_names_guard() -> bool:
    """Wrap the endpoints of :data:`PATH_REPLIES`: their replies name files (:func:`without_paths`)."""

    def wrap(original: Callable) -> Callable:
        def reply(*args, **kwargs):
            return without_paths(original(*args, **kwargs))

        return reply

    return all([_install(module, name, wrap) for module, name in PATH_REPLIES])


def install_status_guard(serve_logs: bool) -> bool:
    """Wrap ``monailabel.endpoints.train.status`` and ``stop``: a task's ``details`` (log lines) only when
    ``serve_logs``; ``stop`` with no training running is answered 404."""

    def wrap(original: Callable) -> Callable:
        def reply(*args, **kwargs):
            result = original(*args, **kwargs)
            if result is None:  # stop() with no training running (MONAI Label answers 200 null)
                raise HTTPException(status_code=404, detail="no training is running")
            if serve_logs:
                return result
            tasks = result if isinstance(result, list) else [result]
            kept = [{k: v for k, v in t.items() if k != "details"} if isinstance(t, dict) else t for t in tasks]
            return kept if isinstance(result, list) else kept[0]

        return reply

    return all([_install("monailabel.endpoints.train", name, wrap) for name in ("status", "stop")])
