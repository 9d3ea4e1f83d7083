"""Hand radiographs with a landmark CSV (Digital Hand Atlas layout of the CC2D papers), to a 2D datalist.

Layout: ``ROOT/all.csv`` without header, one row an image: ``id, x1, y1, …, xN, yN`` in pixels
(x = column, y = row), and ``ROOT/images/<id>.<ext>``. The pixel spacing comes from the image header
for formats that carry one (MetaImage, NRRD, NIfTI, read with SimpleITK); PNG/JPG/BMP carry none, so
``spacing`` is used for them, or they get no spacing (a warning).
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.annotations import HEADER_IMAGE_SUFFIXES, IMAGE_SUFFIXES, find_images, natural_key
from bundle.data.datalist import DatalistError, unsplit_datalist


def read_landmark_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Rows ``id, x1, y1, …, xN, yN`` as ``{id: (N, 2) array}``; every row must have the same N.

    Raises:
        DatalistError: naming the file and line of a malformed row or a repeated id.
    """
    path = Path(path)
    if not path.is_file():
        raise DatalistError(f"landmark CSV not found: {path}")
    out: dict[str, np.ndarray] = {}
    n_columns = None
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for row in reader:
            line = f"{path}:{reader.line_num}"
            cells = [c.strip() for c in row]
            if not any(cells):
                continue
            if len(cells) < 3 or len(cells) % 2 == 0:
                raise DatalistError(
                    f"{line}: expected 'id, x1, y1, ..., xN, yN' (an odd number of columns >= 3), "
                    f"got {len(cells)} columns"
                )
            if n_columns is None:
                n_columns = len(cells)
            elif len(cells) != n_columns:
                raise DatalistError(f"{line}: {len(cells)} columns where the first row has {n_columns}")
            image_id = cells[0]
            if image_id in out:
                raise DatalistError(f"{line}: id {image_id!r} appears twice")
            try:
                values = np.array([float(c) for c in cells[1:]])
            except ValueError as e:
                raise DatalistError(f"{line}: non-numeric coordinate ({e})") from e
            if not np.isfinite(values).all():
                raise DatalistError(f"{line}: non-finite coordinate")
            out[image_id] = values.reshape(-1, 2)
    if not out:
        raise DatalistError(f"{path}: no landmark rows")
    return out


def header_spacing_2d(path: str | Path) -> list[float]:
    """Pixel spacing (x, y) in mm from an image header (SimpleITK); a single-slice 3D file counts as 2D."""
    import SimpleITK as sitk  # noqa: N813

    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError as e:
        raise DatalistError(f"{path}: unreadable image header ({str(e).strip().splitlines()[-1]})") from e
    size, spacing = reader.GetSize(), reader.GetSpacing()
    if len(size) < 2 or any(s != 1 for s in size[2:]):
        raise DatalistError(f"{path}: not a 2D image (size {size})")
    return [float(spacing[0]), float(spacing[1])]


def hand_datalist(
    root: str | Path,
    spacing: Sequence[float] | None = None,
    landmark_names: Sequence[str] | None = None,
    csv_name: str = "all.csv",
    name: str | None = None,
) -> dict:
    """Datalist of ``ROOT/<csv_name>`` and ``ROOT/images`` (see the module docstring), all in ``training``.

    ``spacing`` applies to images whose format has no spacing in its header. A CSV row without an image
    is left out, an image without a row is kept without landmarks: both are warnings naming them.
    Landmarks are named ``l1`` … ``lN`` unless ``landmark_names`` (N names) is given.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatalistError(f"hand data folder not found: {root}")
    rows = read_landmark_csv(root / csv_name)
    n_landmarks = next(iter(rows.values())).shape[0]
    if landmark_names is None:
        names = [f"l{j + 1}" for j in range(n_landmarks)]
    else:
        names = [str(n) for n in landmark_names]
        if len(names) != n_landmarks:
            raise DatalistError(
                f"{len(names)} landmark names given for the {n_landmarks} landmarks of {root / csv_name}"
            )
    images = find_images(root / "images", HEADER_IMAGE_SUFFIXES + IMAGE_SUFFIXES)
    for image_id in sorted(set(rows) - set(images), key=natural_key):
        warnings.warn(
            f"{root / csv_name}: id {image_id!r} has no image in {root / 'images'}: row left out", stacklevel=2
        )

    items, no_spacing = [], []
    for image_id in sorted(images, key=natural_key):
        path = images[image_id]
        item: dict = {"image": str(path)}
        if image_id in rows:
            item["landmarks"] = rows[image_id].tolist()
        else:
            warnings.warn(
                f"{path}: no row with id {image_id!r} in {root / csv_name}: kept without landmarks", stacklevel=2
            )
        if path.name.casefold().endswith(HEADER_IMAGE_SUFFIXES):
            item["spacing"] = header_spacing_2d(path)
        elif spacing is not None:
            item["spacing"] = [float(v) for v in spacing]
        else:
            no_spacing.append(path)
        items.append(item)
    if no_spacing:
        warnings.warn(
            f"{len(no_spacing)} images carry no spacing in their format and no spacing was given "
            f"(first: {no_spacing[0]}): they have no 'spacing', errors can only be measured in pixels",
            stacklevel=2,
        )
    return unsplit_datalist(name or root.name, 2, names, items)
