"""Labelme point annotations by one or more annotators, to a 2D landmark datalist.

Layout: ``ROOT/images/<id>.<ext>`` and ``ROOT/annotations/<annotator>/<id>.json`` (labelme 5 JSON whose
``point`` shapes are labelled with the landmark names, e.g. ``l1`` … ``l19``, case ignored). The
reference landmark is the mean of the annotators that give it, as in the ISBI 2015 and Hamedan sets. A
label that an annotator repeats or leaves out is a warning naming the file and the label, and that
annotator's value counts as missing: it is never averaged silently.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.annotations import IMAGE_SUFFIXES, MultiAnnotatorSet, find_images, natural_key
from bundle.data.datalist import DatalistError, read_json
from bundle.data.markups import label_key


def read_labelme_points(path: str | Path) -> dict[str, list[list[float]]]:
    """The ``point`` shapes of a labelme JSON file as ``{label: [[x, y], ...]}`` (case-folded labels).

    A label keeps every point given for it, so that a repeated label can be reported by the caller.
    Shapes of another type are ignored with a warning naming the file and the label.
    """
    path = Path(path)
    data = read_json(path, "labelme JSON file")
    shapes = data.get("shapes") if isinstance(data, dict) else None
    if not isinstance(shapes, list):
        raise DatalistError(f"{path}: no 'shapes' list, not a labelme annotation file")
    out: dict[str, list[list[float]]] = {}
    for i, shape in enumerate(shapes):
        if not isinstance(shape, dict) or not isinstance(shape.get("label"), str):
            raise DatalistError(f"{path}: shapes[{i}] must be an object with a string 'label'")
        label = label_key(shape["label"])
        kind = shape.get("shape_type") or "point"
        if kind != "point":
            warnings.warn(f"{path}: label {label!r} is a {kind!r} shape, not a point: ignored", stacklevel=2)
            continue
        pts = shape.get("points")
        if not (
            isinstance(pts, list)
            and len(pts) == 1
            and isinstance(pts[0], (list, tuple))
            and len(pts[0]) == 2
            and all(isinstance(v, (int, float)) and math.isfinite(v) for v in pts[0])
        ):
            raise DatalistError(f"{path}: shapes[{i}] (label {label!r}): 'points' must be [[x, y]], got {pts!r:.80}")
        out.setdefault(label, []).append([float(pts[0][0]), float(pts[0][1])])
    return out


def _annotator_folders(annotations: Path, annotators: Sequence[str] | None) -> dict[str, Path]:
    if not annotations.is_dir():
        raise DatalistError(f"annotation folder not found: {annotations}")
    if annotators is None:
        folders = {p.name: p for p in sorted(annotations.iterdir()) if p.is_dir()}
        if not folders:
            raise DatalistError(f"{annotations}: no annotator sub-folder (expected annotations/<annotator>/<id>.json)")
        return folders
    folders = {}
    for name in annotators:
        folder = annotations / name
        if not folder.is_dir():
            raise DatalistError(f"annotator folder not found: {folder}")
        folders[name] = folder
    return folders


def read_labelme_set(
    root: str | Path, annotators: Sequence[str] | None = None, landmark_names: Sequence[str] | None = None
) -> MultiAnnotatorSet:
    """Read ``ROOT/images`` and ``ROOT/annotations/<annotator>/*.json`` into a :class:`MultiAnnotatorSet`.

    Landmark order is the natural sort of the union of labels (``l1``, ``l2``, …, ``l19``);
    ``landmark_names``, when given, renames them in that order and must have one name per label.
    ``annotators`` defaults to every sub-folder of ``ROOT/annotations``.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatalistError(f"labelme data folder not found: {root}")
    images = find_images(root / "images")
    if not images:
        raise DatalistError(f"{root / 'images'}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    folders = _annotator_folders(root / "annotations", annotators)

    files: dict[str, dict[str, tuple[Path, dict[str, list[list[float]]]]]] = {}
    for annotator, folder in folders.items():
        for path in sorted(folder.glob("*.json")):
            if path.stem not in images:
                warnings.warn(
                    f"{path}: no image with id {path.stem!r} in {root / 'images'}: annotation ignored", stacklevel=2
                )
                continue
            files.setdefault(path.stem, {})[annotator] = (path, read_labelme_points(path))

    labels = sorted({lab for per in files.values() for _, pts in per.values() for lab in pts}, key=natural_key)
    if not labels:
        raise DatalistError(f"{root / 'annotations'}: no point annotation for any image")
    if landmark_names is None:
        names = labels
    else:
        names = [str(n) for n in landmark_names]
        if len(names) != len(labels):
            raise DatalistError(
                f"{len(names)} landmark names given for the {len(labels)} labels found in "
                f"{root / 'annotations'}: {labels}"
            )

    points: dict[str, dict[str, np.ndarray]] = {}
    for image_id in sorted(images, key=natural_key):
        per = files.get(image_id, {})
        if not per:  # an image nobody annotated: unlabelled, as meant (prepare_data counts them in one line)
            continue
        for annotator in folders:
            if annotator not in per:
                warnings.warn(f"{images[image_id]}: no annotation file from annotator {annotator!r}", stacklevel=2)
        points[image_id] = {}
        for annotator, (path, found) in per.items():
            arr = np.full((len(labels), 2), np.nan)
            for j, label in enumerate(labels):
                given = found.get(label, [])
                if len(given) == 1:
                    arr[j] = given[0]
                elif not given:
                    warnings.warn(f"{path}: label {label!r} is missing (no value from this annotator)", stacklevel=2)
                else:
                    warnings.warn(
                        f"{path}: label {label!r} appears {len(given)} times: treated as missing for this annotator",
                        stacklevel=2,
                    )
            points[image_id][annotator] = arr
    return MultiAnnotatorSet(landmark_names=names, images=images, points=points)


def labelme_datalist(
    root: str | Path,
    annotators: Sequence[str] | None = None,
    landmark_names: Sequence[str] | None = None,
    spacing: Sequence[float] | None = None,
    name: str | None = None,
) -> dict:
    """Datalist of a labelme set (see :func:`read_labelme_set`), every item in ``training``."""
    root = Path(root)
    return read_labelme_set(root, annotators, landmark_names).to_datalist(name or root.name, spacing)
