"""What the landmark-set readers share: image discovery, natural ordering, multi-annotator references.

The reference landmark of a multi-annotator set is the mean of the annotators that give it (the ISBI
2015 and Hamedan convention); an annotator's missing value is NaN and never averaged in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.datalist import SECTIONS, DatalistError, datalist_landmarks

IMAGE_SUFFIXES = (".png", ".bmp", ".jpg", ".jpeg", ".tif", ".tiff")
# formats whose header carries the voxel spacing
HEADER_IMAGE_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".nhdr")


def strip_suffix(name: str, suffixes: Sequence[str]) -> str | None:
    """``name`` without the first of ``suffixes`` it ends with (case ignored); None when it ends with none."""
    suffix = next((s for s in suffixes if name.casefold().endswith(s)), None)
    return None if suffix is None else name[: -len(suffix)]


def image_stem(path: str | Path) -> str:
    """An image's file name without its suffix, multi-part ones included (``a.nii.gz`` -> ``a``, ``b.png`` -> ``b``)."""
    name = Path(path).name
    stem = strip_suffix(name, HEADER_IMAGE_SUFFIXES)
    return Path(name).stem if stem is None else stem


def natural_key(text: str) -> list:
    """Sort key that orders embedded numbers by value (``l2`` before ``l10``), case ignored."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text.casefold())]


def visible_files(folder: Path) -> list[Path]:
    """The files of ``folder``, sorted, without hidden ones (names starting with a dot: the ``._*`` companions
    that macOS writes beside every file on a foreign disk, ``.DS_Store``)."""
    return [p for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]


def find_images(folder: Path, suffixes: Sequence[str] = IMAGE_SUFFIXES) -> dict[str, Path]:
    """Image files (absolute paths) of ``folder`` by stem; two files with one stem are an error naming both."""
    if not folder.is_dir():
        raise DatalistError(f"image folder not found: {folder}")
    found: dict[str, Path] = {}
    for path in visible_files(folder):
        stem = strip_suffix(path.name, suffixes)
        if stem is None:
            continue
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
        """The datalist item: reference landmarks (``null`` where missing), optional fixed ``spacing``."""
        dims = None
        sections: dict[str, list[dict]] = {s: [] for s in SECTIONS}
        for image_id in sorted(self.images, key=natural_key):
            item: dict = {"image": str(self.images[image_id])}
            ref = self.reference(image_id)
            if ref is not None:
                dims = ref.shape[1]
                item["landmarks"] = datalist_landmarks(ref)
            if spacing is not None:
                item["spacing"] = [float(v) for v in spacing]
            section = self.sections.get(image_id, "training")
            if section not in sections:
                raise DatalistError(f"image {image_id!r}: unknown section {section!r} (one of {SECTIONS})")
            sections[section].append(item)
        return {"name": name, "spatial_dims": dims or 2, "landmark_names": list(self.landmark_names), **sections}
