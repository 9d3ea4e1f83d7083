"""Labelme point annotations by one or more annotators, to a 2D landmark datalist.

Layout: ``ROOT/images/<id>.<ext>`` and ``ROOT/annotations/<annotator>/<id>.json`` (labelme 5 JSON whose
``point`` shapes are labelled with the landmark names, e.g. ``l1`` … ``l19``, case ignored). The
reference landmark is the mean of the annotators that give it, as in the ISBI 2015 and Hamedan sets. A
label that an annotator repeats or leaves out is a warning naming the file and the label, and that
annotator's value counts as missing: it is never averaged silently.

This module also holds what the multi-annotator readers share (:class:`MultiAnnotatorSet`,
:func:`natural_key`); ``isbi2015.py`` builds the same structure.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np

from bundle.data.datalist import SECTIONS, DatalistError

IMAGE_SUFFIXES = (".png", ".bmp", ".jpg", ".jpeg", ".tif", ".tiff")


def natural_key(text: str) -> list:
    """Sort key that orders embedded numbers by value (``l2`` before ``l10``), case ignored."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text.casefold())]


def find_images(folder: Path, suffixes: Sequence[str] = IMAGE_SUFFIXES) -> dict[str, Path]:
    """Image files (absolute paths) of ``folder`` by stem; two files with one stem are an error naming both."""
    if not folder.is_dir():
        raise DatalistError(f"image folder not found: {folder}")
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        name = path.name.casefold()
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None or not path.is_file():
            continue
        stem = path.name[: -len(suffix)]
        if stem in found:
            raise DatalistError(f"two images share the id {stem!r}: {found[stem]} and {path}")
        found[stem] = path.absolute()
    return found


@dataclass
class MultiAnnotatorSet:
    """Images and each annotator's landmarks for them.

    ``points[image_id][annotator]`` is a ``(n_landmarks, spatial_dims)`` array, NaN where that annotator
    gives no (usable) value; an image absent from ``points`` has no annotation at all.
    ``sections[image_id]`` names the datalist section (``training`` when absent).
    """

    landmark_names: list[str]
    images: dict[str, Path]
    points: dict[str, dict[str, np.ndarray]]
    sections: dict[str, str] = field(default_factory=dict)

    def reference(self, image_id: str) -> np.ndarray | None:
        """Mean over the annotators that give each landmark; NaN rows where none does; None if unannotated."""
        per_annotator = self.points.get(image_id)
        if not per_annotator:
            return None
        stack = np.stack(list(per_annotator.values()))  # (A, N, D)
        given = ~np.isnan(stack).any(axis=-1, keepdims=True)
        count = given.sum(axis=0)
        total = np.where(given, stack, 0.0).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    def inter_annotator_distances(self) -> np.ndarray:
        """Distances (pixels) between every two annotators, over the landmarks both of them give."""
        dists: list[np.ndarray] = []
        for per_annotator in self.points.values():
            for a, b in combinations(per_annotator.values(), 2):
                d = np.linalg.norm(a - b, axis=-1)
                dists.append(d[~np.isnan(d)])
        return np.concatenate(dists) if dists else np.zeros(0)

    def to_datalist(self, name: str, spacing: Sequence[float] | None = None) -> dict:
        """The DESIGN.md datalist: reference landmarks (``null`` where missing), optional fixed ``spacing``."""
        dims = None
        sections: dict[str, list[dict]] = {s: [] for s in SECTIONS}
        for image_id in sorted(self.images, key=natural_key):
            item: dict = {"image": str(self.images[image_id])}
            ref = self.reference(image_id)
            if ref is not None:
                dims = ref.shape[1]
                item["landmarks"] = [None if np.isnan(p).any() else [float(v) for v in p] for p in ref]
            if spacing is not None:
                item["spacing"] = [float(v) for v in spacing]
            section = self.sections.get(image_id, "training")
            if section not in sections:
                raise DatalistError(f"image {image_id!r}: unknown section {section!r} (one of {SECTIONS})")
            sections[section].append(item)
        return {"name": name, "spatial_dims": dims or 2, "landmark_names": list(self.landmark_names), **sections}


def read_labelme_points(path: str | Path) -> dict[str, list[list[float]]]:
    """The ``point`` shapes of a labelme JSON file as ``{label: [[x, y], ...]}`` (case-folded labels).

    A label keeps every point given for it, so that a repeated label can be reported by the caller.
    Shapes of another type are ignored with a warning naming the file and the label.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatalistError(f"{path}: not a readable labelme JSON file ({e})") from e
    shapes = data.get("shapes") if isinstance(data, dict) else None
    if not isinstance(shapes, list):
        raise DatalistError(f"{path}: no 'shapes' list, not a labelme annotation file")
    out: dict[str, list[list[float]]] = {}
    for i, shape in enumerate(shapes):
        if not isinstance(shape, dict) or not isinstance(shape.get("label"), str):
            raise DatalistError(f"{path}: shapes[{i}] must be an object with a string 'label'")
        label = shape["label"].strip().casefold()
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
        if not per:
            warnings.warn(
                f"{images[image_id]}: no annotation file from any annotator: kept without landmarks", stacklevel=2
            )
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
