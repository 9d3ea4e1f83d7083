"""What the app refuses of what a client sends: unreadable images, unusable labels, detached image data."""

from __future__ import annotations

from pathlib import Path

from bundle.command_errors import root_cause
from bundle.data.image_headers import detached_data_file
from bundle.io_utils import error_summary


class ImageError(ValueError):
    """An image the bundle cannot read (the message names it)."""


def check_upload(path: str, name: str) -> None:
    """Refuse (:class:`ImageError`) an uploaded MetaImage or NRRD header that reads its pixels from another file
    (:func:`bundle.data.image_headers.detached_data_file`): only the uploaded file is the client's (a file beside it
    in the server's temp dir is another request's upload)."""
    data_file = detached_data_file(Path(path))
    if data_file is not None:
        raise ImageError(
            f"upload {name!r}: its header reads the pixel data from another file, {data_file!r}: upload the image as "
            "one file (ElementDataFile = LOCAL, or a .nrrd / .mha holding its data)"
        )


class LabelError(ValueError):
    """A saved label that is not a usable landmark file (the message names it)."""


def cause_of(error: BaseException, path: str | Path, name: str) -> str:
    """``<type>: <first line>`` of the root cause of ``error`` (:func:`bundle.command_errors.root_cause`: MONAI wraps a
    transform's error in ``RuntimeError("applying transform <object>")``, and a reader's message holds every reader's
    traceback), the server's ``path`` named ``name``."""
    return error_summary(root_cause(error)).replace(str(path), name)
