"""The app's datastores: every id, tag and file name is a name inside the datastore's folder; the local one also
knows X-ray images (DICOM included) and landmark labels (3D Slicer ``.mrk.json`` / ``.fcsv``).

- :class:`ConfinedDatastore` (placed before a MONAI Label ``LocalDatastore`` by :func:`confined`, the DICOMweb
  datastore included, whose cache is a local datastore): the one place where ids, tags and upload names are
  checked, for every route that reaches the datastore. A value that is not a plain name (empty, ``.`` / ``..``,
  hidden, a path separator, a control character, an id whose file name reads back as another id) is answered 400
  naming it; a file that resolves outside the folder (a symlink pointing out) is answered 403 and neither written
  nor deleted, never listed, never served.
  A refused upload's temporary file is removed.
- :class:`LandmarkDatastore`: images are PNG, JPEG, BMP, TIFF, DICOM (``.dcm``), NIfTI, NRRD, MHA in the studies
  folder; labels (tag folders under ``labels/``): ``.mrk.json``, ``.json``, ``.fcsv``. ``add_image`` /
  ``save_label`` check the file first (readable image; markups naming the landmarks, inside the image): a bad one
  is answered 4xx naming it and nothing enters the datastore. Every write (image, label, ``datastore_v2.json``)
  goes to a temporary file beside its target, then is renamed: a failure leaves the old file (507 when the disk
  is full). One label file per image and tag; a labelled image is replaced only when asked (``{"replace": true}``).
  Each write's checks and the write are one step under the datastore's lock (a label is stored with the picture it
  was checked on; a re-upload checked for labels finds the labels it would remove).
"""

from __future__ import annotations

import errno
import filecmp
import fnmatch
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from bundle.io_utils import atomic_path
from fastapi import HTTPException
from filelock import FileLock
from monailabel.datastore.local import DataModel, ImageLabelModel, LocalDatastore

from .uploads import ImageError, LabelError

logger = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (
    "*.png",
    "*.jpg",
    "*.jpeg",
    "*.bmp",
    "*.tif",
    "*.tiff",
    "*.dcm",
    "*.nii.gz",
    "*.nii",
    "*.nrrd",
    "*.mha",
)
# ".json" first: the datastore keeps the LAST matching extension, so "a.mrk.json" gets ".mrk.json"
LABEL_EXTENSIONS = ("*.json", "*.mrk.json", "*.fcsv")
# the longest id, tag or file name taken (UTF-8 bytes): with a suffix and a temporary name's affixes it stays within
# the 255 bytes a file name may have on common file systems (a longer one failed with ENAMETOOLONG: 500)
MAX_NAME_BYTES = 200


def is_upload_temp(path: str) -> bool:
    """A temporary file of MONAI Label's upload endpoints (``tempfile.NamedTemporaryFile`` in the temp dir)."""
    p = Path(path)
    return p.parent.resolve() == Path(tempfile.gettempdir()).resolve() and p.name.startswith("tmp")


def refuse(status: int, detail: str, upload: str | None = None) -> NoReturn:
    """Answer ``status`` with ``detail``; ``upload``, when it is MONAI Label's temporary upload file, is removed
    (MONAI Label removes it only after a successful reply)."""
    if upload and is_upload_temp(upload):
        Path(upload).unlink(missing_ok=True)
    raise HTTPException(status_code=status, detail=detail)


def name_problem(value: object) -> str | None:
    """Why ``value`` is not a plain file name (None when it is one)."""
    if not isinstance(value, str) or not value:
        return "it is empty"
    if value in (".", ".."):
        return "it names a folder"
    if "/" in value or "\\" in value:
        return "it is a path"
    if value.startswith("."):
        return "it is a hidden name"
    if any(ord(c) < 32 for c in value):
        return "it holds a control character"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"it is longer than {MAX_NAME_BYTES} bytes"
    return None


class ConfinedDatastore:
    """Checks placed before a ``LocalDatastore`` (see the module docstring and :func:`confined`)."""

    image_extensions: tuple[str, ...] | None = None  # patterns an added image's name must match (None: all)

    # ---- the checks --------------------------------------------------------------------------------------
    def check_name(self, value: object, what: str, upload: str | None = None) -> str:
        """``value`` when it is a plain name, else 400 naming it."""
        problem = name_problem(value)
        if problem:
            refuse(
                400,
                f"{what} {value!r} refused: {problem}; the datastore takes names (ids, tags, file names), not paths",
                upload,
            )
        return value

    def _root(self) -> str:
        return os.path.realpath(self._datastore_path)

    def _inside(self, path: str) -> bool:
        root = self._root()
        return os.path.commonpath([root, os.path.realpath(path)]) == root

    def _check_inside(self, path: str, what: str, upload: str | None = None) -> None:
        """403 naming ``what`` unless ``path`` resolves inside the datastore's folder."""
        if not self._inside(path):
            refuse(403, f"{what} resolves outside the datastore's folder (a link pointing out): refused", upload)

    def _stored_file(self, folder: str, image_id: str, ext: str) -> str:
        return os.path.join(folder, self._filename(image_id, ext))

    def _check_read_back(self, image_id: str, ext: str, what: str, upload: str | None = None) -> None:
        """400 unless the file name of ``image_id`` with ``ext`` reads back as that id (``a.png.b`` + ``.png`` reads
        back as ``a.b``, ``006.mrk`` + ``.json`` as image ``006``'s ``.mrk.json``)."""
        name = self._filename(image_id, ext)
        back = self._to_id(name)
        if back != (image_id, ext):
            refuse(
                400,
                f"{what} {image_id!r} refused: its file {name!r} would be read back as {back[1]} of {back[0]!r}",
                upload,
            )

    # ---- writes and deletes --------------------------------------------------------------------------------
    def add_image(self, image_id: str, image_filename: str, image_info: dict[str, Any]) -> str:
        default_id, ext = self._to_id(os.path.basename(image_filename))
        image_id = self.check_name(image_id or default_id, "image id", image_filename)
        name = self.check_name(self._filename(image_id, ext), "image file name", image_filename)
        patterns = self.image_extensions or self._extensions
        if not any(fnmatch.fnmatch(name.lower(), p) for p in patterns):
            refuse(
                415,
                f"image {image_id!r}: {ext or 'no extension'} is not an image format of the datastore "
                f"({', '.join(p.lstrip('*') for p in patterns)})",
                image_filename,
            )
        self._check_read_back(image_id, ext, "image id", image_filename)
        dest = self._stored_file(self._datastore.image_path(), image_id, ext)
        self._check_inside(dest, f"image {image_id!r}", image_filename)
        return super().add_image(image_id, image_filename, image_info)

    def remove_image(self, image_id: str) -> None:
        obj = self._datastore.objects.get(self.check_name(image_id, "image id"))
        if obj is None:
            refuse(404, f"no image {image_id!r} in the datastore")
        self._check_inside(
            self._stored_file(self._datastore.image_path(), image_id, obj.image.ext), f"image {image_id!r}"
        )
        for tag, label in obj.labels.items():
            folder = self._datastore.label_path(tag)
            self._check_inside(self._stored_file(folder, image_id, label.ext), f"label {tag!r} of image {image_id!r}")
        return super().remove_image(image_id)

    def save_label(self, image_id: str, label_filename: str, label_tag: str, label_info: dict, *args, **kwargs) -> str:
        self.check_name(image_id, "image id", label_filename)
        self.check_name(label_tag, "label tag", label_filename)
        _, ext = self._to_id(os.path.basename(label_filename))
        self.check_name(self._filename(image_id, ext), "label file name", label_filename)
        self._check_read_back(image_id, ext, f"label ({ext}) of image", label_filename)
        dest = self._stored_file(self._datastore.label_path(label_tag), image_id, ext)
        self._check_inside(dest, f"label {label_tag!r} of image {image_id!r}", label_filename)
        return super().save_label(image_id, label_filename, label_tag, label_info, *args, **kwargs)

    def remove_label(self, label_id: str, label_tag: str) -> None:
        self.check_name(label_id, "label id")
        self.check_name(label_tag, "label tag")
        label = self._datastore.label(label_id, label_tag)
        if label is None:
            refuse(404, f"no label {label_tag!r} of image {label_id!r} in the datastore")
        folder = self._datastore.label_path(label_tag)
        self._check_inside(self._stored_file(folder, label_id, label.ext), f"label {label_tag!r} of image {label_id!r}")
        return super().remove_label(label_id, label_tag)

    def update_image_info(self, image_id: str, info: dict[str, Any]) -> None:
        return super().update_image_info(self.check_name(image_id, "image id"), info)

    def update_label_info(self, label_id: str, label_tag: str, info: dict[str, Any]) -> None:
        self.check_name(label_tag, "label tag")
        return super().update_label_info(self.check_name(label_id, "label id"), label_tag, info)

    # ---- reads: a file outside the folder is not in the datastore -------------------------------------------
    def get_image_uri(self, image_id: str) -> str:
        uri = super().get_image_uri(self.check_name(image_id, "image id"))
        if uri and not self._inside(uri):
            logger.warning(f"image {image_id!r} resolves outside the datastore's folder: not served")
            return ""
        return uri

    def get_label_uri(self, label_id: str, label_tag: str, *args, **kwargs) -> str:
        self.check_name(label_tag, "label tag")
        uri = super().get_label_uri(self.check_name(label_id, "label id"), label_tag, *args, **kwargs)
        if uri and not self._inside(uri):
            logger.warning(
                f"label {label_tag!r} of image {label_id!r} resolves outside the datastore's folder: not served"
            )
            return ""
        return uri

    def get_image_info(self, image_id: str) -> dict[str, Any]:
        return super().get_image_info(self.check_name(image_id, "image id"))

    def get_label_info(self, label_id: str, label_tag: str) -> dict[str, Any]:
        self.check_name(label_tag, "label tag")
        return super().get_label_info(self.check_name(label_id, "label id"), label_tag)

    def datalist(self, full_path: bool = True) -> list[dict[str, Any]]:
        root = self._root()
        return [d for d in super().datalist(full_path) if all(self._inside(os.path.join(root, p)) for p in d.values())]

    # ---- what the folder and the datastore file hold ---------------------------------------------------------
    def _list_files(self, path, patterns):
        listed = {}
        for key, f in super()._list_files(path, patterns).items():
            problem = name_problem(f) or name_problem(self._to_id(f)[0])
            if problem is None and not self._inside(os.path.join(path, f)):
                problem = "it resolves outside the datastore's folder"
            if problem:
                logger.warning(f"{os.path.join(path, f)} not listed: {problem}")
            else:
                listed[key] = f
        return listed

    def _init_from_datastore_file(self, throw_exception=False):
        loaded = self._config_ts
        super()._init_from_datastore_file(throw_exception)
        if self._config_ts == loaded:
            return
        # entries of an earlier server that took paths for ids: dropped (never served; gone at the next write)
        for image_id in list(self._datastore.objects):
            obj = self._datastore.objects[image_id]
            bad = name_problem(image_id) or name_problem(self._filename(image_id, obj.image.ext))
            if bad:
                logger.warning(f"datastore entry {image_id!r} ignored: {bad}")
                del self._datastore.objects[image_id]
                continue
            for tag in [t for t in obj.labels if name_problem(t)]:
                logger.warning(f"label {tag!r} of image {image_id!r} ignored: {name_problem(tag)}")
                del obj.labels[tag]


_CONFINED: dict[type, type] = {}


def confined(cls: type) -> type:
    """``cls`` (a ``LocalDatastore``) with :class:`ConfinedDatastore`'s checks run before its own methods."""
    if cls not in _CONFINED:
        _CONFINED[cls] = type(f"Confined{cls.__name__}", (ConfinedDatastore, cls), {})
    return _CONFINED[cls]


def confine(datastore: LocalDatastore) -> LocalDatastore:
    """The same ``datastore`` object, confined (for one that MONAI Label builds, e.g. the DICOMweb datastore)."""
    datastore.__class__ = confined(type(datastore))
    return datastore


class LandmarkDatastore(LocalDatastore):
    """MONAI Label's local datastore of X-ray images and landmark labels (the app uses it ``confined``)."""

    image_extensions = IMAGE_EXTENSIONS

    def __init__(
        self,
        path: str,
        check_image: Callable[[str, str], Any] | None = None,
        check_label: Callable[[str, str, str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._check_image = check_image
        self._check_label = check_label
        self._writes = threading.RLock()  # the checks and the write of each write as one step
        super().__init__(path, extensions=[*IMAGE_EXTENSIONS, *LABEL_EXTENSIONS], **kwargs)

    def _list_files(self, path, patterns):
        is_image_dir = os.path.realpath(path) == os.path.realpath(self._datastore.image_path())
        wanted = IMAGE_EXTENSIONS if is_image_dir else LABEL_EXTENSIONS
        return super()._list_files(path, [p for p in patterns if p in wanted])

    # ---- writes: the old file stays until the new one is complete, one file per image (and per image and tag) ----
    def _write(self, source: str, dest: str, what: str, upload: str) -> None:
        """``source`` copied onto ``dest`` through a temporary file beside it (:func:`atomic_path`)."""
        with _writing(what, upload):
            with atomic_path(dest, keep_suffix=False) as tmp:  # no suffix: never listed as an image or a label
                shutil.copyfile(source, tmp)

    def _files_of(self, folder: str, image_id: str, extensions: tuple[str, ...]) -> list[str]:
        """The files of ``image_id`` in ``folder``, one per extension (a file that reads back as another id's is
        not one: ``006.mrk`` + ``.json`` is ``006``'s ``.mrk.json``)."""
        files = []
        for ext in (e.lstrip("*") for e in extensions):
            path = self._stored_file(folder, image_id, ext)
            if self._to_id(os.path.basename(path)) == (image_id, ext) and os.path.lexists(path):
                files.append(path)
        return files

    def add_image(self, image_id: str, image_filename: str, image_info: dict[str, Any]) -> str:
        """MONAI Label's ``add_image``, written atomically. A labelled image is replaced only when ``params`` say
        ``{"replace": true}``, its labels (every tag) then removed; the same bytes again change nothing."""
        image_info = dict(image_info or {})
        replace = image_info.pop("replace", False)
        name = image_info.get("name") or image_id or os.path.basename(image_filename)
        if self._check_image is not None:
            try:
                self._check_image(image_filename, str(name))
            except ImageError as e:
                refuse(422, str(e), image_filename)
        with self._writes:
            _, ext = self._to_id(os.path.basename(image_filename))
            dest = self._stored_file(self._datastore.image_path(), image_id, ext)
            obj = self._datastore.objects.get(image_id)
            if obj is not None:
                if obj.image.ext == ext and os.path.isfile(dest) and filecmp.cmp(dest, image_filename, shallow=False):
                    return image_id
                if obj.labels and replace is not True:
                    refuse(
                        409,
                        f"image {image_id!r} has labels ({', '.join(sorted(obj.labels))}): another picture under "
                        'its id would carry them; to replace it and remove its labels send params {"replace": true}',
                        image_filename,
                    )
            with FileLock(self._lock_file):
                self._write(image_filename, dest, f"image {image_id!r}", image_filename)
                if obj is not None:
                    for tag in obj.labels:
                        for path in self._files_of(self._datastore.label_path(tag), image_id, LABEL_EXTENSIONS):
                            os.unlink(path)
                    if obj.labels:
                        logger.warning(f"image {image_id!r} replaced: its labels {sorted(obj.labels)} removed")
                    if obj.image.ext != ext:  # the replaced picture in another format
                        Path(self._stored_file(self._datastore.image_path(), image_id, obj.image.ext)).unlink(
                            missing_ok=True
                        )
                image_info.update(ts=int(time.time()), name=self._filename(image_id, ext))
                self._datastore.objects[image_id] = ImageLabelModel(image=DataModel(info=image_info, ext=ext))
                self._update_datastore_file(lock=False)
        return image_id

    def save_label(self, image_id: str, label_filename: str, label_tag: str, label_info: dict[str, Any]) -> str:
        """MONAI Label's ``save_label``, written atomically; the image's other label file of the tag (another
        format) is removed once the new one is in place."""
        with self._writes:
            obj = self._datastore.objects.get(image_id)
            if obj is None:
                refuse(404, f"no image {image_id!r} in the datastore", label_filename)
            if not any(label_filename.lower().endswith(p[1:]) for p in LABEL_EXTENSIONS):
                refuse(
                    422,
                    f"label of image {image_id!r}: expected a 3D Slicer markups file (.mrk.json or .fcsv), "
                    f"got {os.path.basename(label_filename)!r}",
                    label_filename,
                )
            if self._check_label is not None:
                try:
                    self._check_label(label_filename, self.get_image_uri(image_id), image_id)
                except (LabelError, ImageError) as e:
                    refuse(422, str(e), label_filename)
            _, ext = self._to_id(os.path.basename(label_filename))
            folder = self._datastore.label_path(label_tag)
            dest = self._stored_file(folder, image_id, ext)
            with FileLock(self._lock_file):
                os.makedirs(folder, exist_ok=True)
                self._write(label_filename, dest, f"label {label_tag!r} of image {image_id!r}", label_filename)
                for path in self._files_of(folder, image_id, LABEL_EXTENSIONS):
                    if path != dest:
                        logger.info(f"label {label_tag!r} of image {image_id!r}: {os.path.basename(path)} replaced")
                        os.unlink(path)
                label_info = dict(label_info or {}, ts=int(time.time()), name=self._filename(image_id, ext))
                obj.labels[label_tag] = DataModel(info=label_info, ext=ext)
                self._update_datastore_file(lock=False)
        return image_id

    def remove_label(self, label_id: str, label_tag: str) -> None:
        """Every label file of the image and tag (whatever its format) removed."""
        with self._writes:
            for path in self._files_of(self._datastore.label_path(label_tag), label_id, LABEL_EXTENSIONS):
                os.unlink(path)
            super().remove_label(label_id, label_tag)

    def remove_image(self, image_id: str) -> None:
        with self._writes:
            super().remove_image(image_id)

    def _update_datastore_file(self, lock: bool = True) -> None:
        """MONAI Label's datastore file written atomically (its own write empties it first: a failed write left it
        cut short, and MONAI Label does not start on it). The rename is no modification of the file: the watcher
        has none to ignore, and the temporary name matches none of its patterns."""

        def write() -> None:
            text = json.dumps(self._datastore.model_dump(exclude={"base_path"}), indent=2, default=str)
            with _writing(f"the datastore's file {os.path.basename(self._datastore_config_path)!r}"):
                with atomic_path(self._datastore_config_path, keep_suffix=False) as tmp:
                    tmp.write_text(text, encoding="utf-8")
            self._config_ts = os.stat(self._datastore_config_path).st_mtime

        if lock:
            with FileLock(self._lock_file):
                write()
        else:
            write()


@contextmanager
def _writing(what: str, upload: str | None = None) -> Iterator[None]:
    """An OSError of writing ``what`` answered 507 (no space left) or 4xx / 500 naming its cause."""
    try:
        yield
    except OSError as e:
        cause = os.strerror(e.errno) if e.errno else str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            refuse(507, f"{what} not stored: no space left on the datastore's disk ({cause})", upload)
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            refuse(403, f"{what} not stored: the datastore's folder is not writable ({cause})", upload)
        refuse(500, f"{what} not stored: {cause}", upload)
