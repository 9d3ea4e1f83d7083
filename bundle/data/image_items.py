"""The images a command runs on: ``--images`` (files, glob patterns, DICOM series folders) or what ``dataset_dir``
holds, and the error when there is none."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Sequence

from bundle.data.annotations import visible_files
from bundle.data.dicom import is_dicom_file, series_folders
from bundle.settings import is_unset

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")


def _is_pattern(path: Path) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than a file or folder of that name."""
    return glob.has_magic(str(path)) and not path.exists()


def image_items(
    images: str | Sequence[str] | None, dataset_dir: str | os.PathLike, spatial_dims: int = 2
) -> list[dict]:
    """Datalist-style items ``{"image": path}`` of the images a command runs on.

    Args:
        images: a path, a glob pattern such as ``scans/*.png``, or a list of them: files, or DICOM series folders
            (a pattern's matches sorted; a leading ``~`` expanded). None, empty or unset (``null`` / ``none``:
            :func:`bundle.settings.is_unset`): what ``dataset_dir`` holds.
        dataset_dir: the folder read without ``images`` (sorted; none when it does not exist, so that the config
            builds without data: :func:`require_items` then fails at run time): in 2D every image file directly in
            it; in 3D ``dataset_dir`` itself when it holds DICOM files (the slices of one series, not volumes of
            their own), then every sub-folder holding DICOM files (a series each), then every volume file directly
            in it.
        spatial_dims: 2 or 3, the configuration's.

    Raises:
        FileNotFoundError: naming an image that does not exist, a pattern that matches nothing, or a list the
            command line could not read.
    """
    if is_unset(images):
        images = None
    if isinstance(images, (str, os.PathLike)):
        text = str(images).strip()
        if text.startswith("[") and text.endswith("]") and not Path(text).is_file():
            raise FileNotFoundError(
                f"images: {text!r} is neither a file nor a list the command line could read: quote each name inside "
                """the list, --images "['a.png','b.png']" (a name holding ' inside \\": --images "[\\"it's.png\\"]")"""
            )
        images = [images]
    if images:
        paths = [Path(os.path.expanduser(str(p))) for p in images]
        unmatched = [str(p) for p in paths if _is_pattern(p) and not glob.glob(str(p))]
        if unmatched:
            raise FileNotFoundError(f"images: no file matches {unmatched}")
        paths = [m for p in paths for m in (sorted(map(Path, glob.glob(str(p)))) if _is_pattern(p) else [p])]
        missing = [str(p) for p in paths if not (p.is_file() or p.is_dir())]
        if missing:
            raise FileNotFoundError(f"images not found: {missing}")
        return [{"image": str(p)} for p in paths]
    folder = Path(dataset_dir)
    if not folder.is_dir():
        return []
    if spatial_dims == 2:
        return [{"image": str(p)} for p in visible_files(folder) if p.name.lower().endswith(IMAGE_SUFFIXES)]
    listed = visible_files(folder)
    slices = {p for p in listed if is_dicom_file(p)}  # each file's preamble read once
    volumes = [p for p in listed if p.name.lower().endswith(IMAGE_SUFFIXES) and p not in slices]
    return [{"image": str(p)} for p in ([folder] if slices else []) + series_folders(folder) + volumes]


def require_items(items: Sequence[Any], dataset_dir: str | os.PathLike, spatial_dims: int = 2) -> None:
    """Raise FileNotFoundError (naming ``dataset_dir``) when there is no image to run on; in 2D, one that names
    configs/train_3d.yaml (after configs/inference.yaml) when ``dataset_dir`` holds DICOM series folders.

    Args:
        items: what :func:`image_items` returned.
        dataset_dir: the folder it read.
        spatial_dims: 2 or 3, the configuration's.
    """
    if len(items) > 0:
        return
    folder = Path(dataset_dir)
    if spatial_dims == 2 and folder.is_dir() and series_folders(folder):
        raise FileNotFoundError(
            f"nothing to run on: dataset_dir {dataset_dir} holds DICOM series folders (volumes), which the 2D command "
            "does not read: merge configs/train_3d.yaml after configs/inference.yaml"
        )
    raise FileNotFoundError(
        f"nothing to run on: no --images given and dataset_dir {dataset_dir} holds no image file "
        f"({', '.join(IMAGE_SUFFIXES)}) and, for volumes, no DICOM series folder; pass --images \"['a.png', ...]\" "
        "or --dataset_dir FOLDER"
    )
