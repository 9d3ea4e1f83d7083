"""The app's local datastore: MONAI Label's ``LocalDatastore`` that knows X-ray images (DICOM included) and
landmark labels (3D Slicer ``.mrk.json`` / ``.fcsv``), and refuses what the bundle cannot read.

- images: PNG, JPEG, BMP, TIFF, DICOM (``.dcm``), NIfTI, NRRD, MHA in the studies folder; labels (tag folders
  under ``labels/``): ``.mrk.json``, ``.json``, ``.fcsv``. Each kind is only looked for in its own folder.
- ``add_image`` / ``save_label`` check the file first (readable image; markups naming the landmarks): a bad one
  is answered 4xx naming it, nothing enters the datastore, and the upload's temporary file is removed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from fastapi import HTTPException
from monailabel.datastore.local import LocalDatastore

from .common import IMAGE_EXTENSIONS, LABEL_EXTENSIONS, ImageError, LabelError

logger = logging.getLogger(__name__)


def is_upload_temp(path: str) -> bool:
    """A temporary file of MONAI Label's upload endpoints (``tempfile.NamedTemporaryFile`` in the temp dir)."""
    p = Path(path)
    return p.parent.resolve() == Path(tempfile.gettempdir()).resolve() and p.name.startswith("tmp")


class LandmarkDatastore(LocalDatastore):
    def __init__(
        self,
        path: str,
        check_image: Callable[[str, str], Any] | None = None,
        check_label: Callable[[str, str, str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._check_image = check_image
        self._check_label = check_label
        super().__init__(path, extensions=[*IMAGE_EXTENSIONS, *LABEL_EXTENSIONS], **kwargs)

    def _list_files(self, path, patterns):
        is_image_dir = os.path.realpath(path) == os.path.realpath(self._datastore.image_path())
        wanted = IMAGE_EXTENSIONS if is_image_dir else LABEL_EXTENSIONS
        return super()._list_files(path, [p for p in patterns if p in wanted])

    def add_image(self, image_id: str, image_filename: str, image_info: dict[str, Any]) -> str:
        name = (image_info or {}).get("name") or image_id or os.path.basename(image_filename)
        if self._check_image is not None:
            try:
                self._check_image(image_filename, str(name))
            except ImageError as e:
                if is_upload_temp(image_filename):
                    Path(image_filename).unlink(missing_ok=True)
                raise HTTPException(status_code=422, detail=str(e)) from None
        return super().add_image(image_id, image_filename, image_info)

    def save_label(self, image_id: str, label_filename: str, label_tag: str, label_info: dict[str, Any]) -> str:
        def refuse(status: int, detail: str):
            if is_upload_temp(label_filename):
                Path(label_filename).unlink(missing_ok=True)
            raise HTTPException(status_code=status, detail=detail)

        if image_id not in self._datastore.objects:
            refuse(404, f"no image {image_id!r} in the datastore")
        if not any(label_filename.lower().endswith(p[1:]) for p in LABEL_EXTENSIONS):
            refuse(
                422,
                f"label of image {image_id!r}: expected a 3D Slicer markups file (.mrk.json or .fcsv), "
                f"got {os.path.basename(label_filename)!r}",
            )
        if self._check_label is not None:
            try:
                self._check_label(label_filename, self.get_image_uri(image_id), image_id)
            except (LabelError, ImageError) as e:
                refuse(422, str(e))
        return super().save_label(image_id, label_filename, label_tag, label_info)
