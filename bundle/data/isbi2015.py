"""The ISBI 2015 cephalometric challenge set (Wang et al. 2016), to a 2D landmark datalist.

Layout::

    ROOT/RawImage/TrainingData/001.bmp …   (training)
    ROOT/RawImage/Test1Data/151.bmp …      (test)
    ROOT/RawImage/Test2Data/301.bmp …      (test, or validation on request)
    ROOT/AnnotationsByMD/400_senior/001.txt, ROOT/AnnotationsByMD/400_junior/001.txt

Each annotation file holds 19 lines ``x,y`` in pixels (x = column, y = row), then classification labels
that are ignored. The reference is the mean of the senior and the junior doctor; the pixel spacing is
0.1 mm. The paper's reference numbers are measured on this set.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
from bundle.data.annotations import MultiAnnotatorSet, find_images
from bundle.data.datalist import DatalistError

ISBI_2015_LANDMARK_NAMES = (
    "sella",
    "nasion",
    "orbitale",
    "porion",
    "subspinale",
    "supramentale",
    "pogonion",
    "menton",
    "gnathion",
    "gonion",
    "lower_incisal_incision",
    "upper_incisal_incision",
    "upper_lip",
    "lower_lip",
    "subnasale",
    "soft_tissue_pogonion",
    "posterior_nasal_spine",
    "anterior_nasal_spine",
    "articulare",
)
ISBI_2015_N_LANDMARKS = len(ISBI_2015_LANDMARK_NAMES)
ISBI_2015_SPACING_MM = 0.1
ISBI_2015_ANNOTATORS = ("400_senior", "400_junior")
ISBI_2015_FOLDERS = ("TrainingData", "Test1Data", "Test2Data")


def read_isbi_annotation(path: str | Path, n_landmarks: int = ISBI_2015_N_LANDMARKS) -> np.ndarray:
    """The first ``n_landmarks`` lines ``x,y`` of an ISBI 2015 annotation file as a ``(n, 2)`` array."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatalistError(f"{path}: unreadable annotation file ({e})") from e
    if len(lines) < n_landmarks:
        raise DatalistError(f"{path}: expected {n_landmarks} lines 'x,y', found {len(lines)} lines")
    out = np.empty((n_landmarks, 2))
    for i, line in enumerate(lines[:n_landmarks]):
        parts = line.strip().split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 2 or not all(math.isfinite(v) for v in values):
            raise DatalistError(f"{path}:{i + 1}: expected 'x,y' (landmark {i + 1}), got {line.strip()!r:.60}")
        out[i] = values
    return out


def read_isbi2015_set(root: str | Path, test2_section: str = "test") -> MultiAnnotatorSet:
    """Read the images of ``ROOT/RawImage/*`` and both doctors' annotations (see the module docstring).

    ``test2_section`` is the section of ``Test2Data`` (``test`` or ``validation``). A missing annotation
    file is a warning naming it; the other doctor's landmarks are then the reference.
    """
    root = Path(root)
    if test2_section not in ("test", "validation"):
        raise ValueError(f"test2_section must be 'test' or 'validation', got {test2_section!r}")
    if not root.is_dir():
        raise DatalistError(f"ISBI 2015 data folder not found: {root}")
    folder_sections = dict(zip(ISBI_2015_FOLDERS, ("training", "test", test2_section)))
    images: dict[str, Path] = {}
    sections: dict[str, str] = {}
    for folder, section in folder_sections.items():
        if not (root / "RawImage" / folder).is_dir():
            continue
        for image_id, path in find_images(root / "RawImage" / folder).items():
            if image_id in images:
                raise DatalistError(f"two images share the id {image_id!r}: {images[image_id]} and {path}")
            images[image_id] = path
            sections[image_id] = section
    if not images:
        raise DatalistError(f"{root / 'RawImage'}: no images in any of {', '.join(ISBI_2015_FOLDERS)}")
    annotators = [a for a in ISBI_2015_ANNOTATORS if (root / "AnnotationsByMD" / a).is_dir()]
    if not annotators:
        raise DatalistError(
            f"{root / 'AnnotationsByMD'}: neither of the folders {', '.join(ISBI_2015_ANNOTATORS)} exists"
        )
    points: dict[str, dict[str, np.ndarray]] = {}
    for image_id in images:
        for annotator in annotators:
            path = root / "AnnotationsByMD" / annotator / f"{image_id}.txt"
            if path.is_file():
                points.setdefault(image_id, {})[annotator] = read_isbi_annotation(path)
            else:
                warnings.warn(f"{path}: annotation file missing for image {images[image_id]}", stacklevel=2)
    return MultiAnnotatorSet(list(ISBI_2015_LANDMARK_NAMES), images, points, sections)


def isbi2015_datalist(root: str | Path, test2_section: str = "test", name: str = "isbi2015") -> dict:
    """Datalist of the ISBI 2015 set with the 0.1 mm spacing on every item."""
    dataset = read_isbi2015_set(root, test2_section)
    return dataset.to_datalist(name, spacing=(ISBI_2015_SPACING_MM, ISBI_2015_SPACING_MM))
