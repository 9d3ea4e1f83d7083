"""NIfTI volumes with 3D Slicer markups, to a 3D landmark datalist (landmarks in world RAS mm).

Volumes ``IMAGES_DIR/X.nii[.gz]`` pair with ``MARKUPS_DIR/X.fcsv`` or ``MARKUPS_DIR/X.mrk.json`` by the
name ``X``. Landmarks are matched by control-point label; a label that is missing, repeated or has no
position is ``null`` with a warning naming the file and the label. A landmark that falls outside its
volume (read through the NIfTI affine, which maps voxels to RAS) is a warning too: it usually means a
mix-up of the LPS and RAS frames.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.annotations import find_images, natural_key, visible_files
from bundle.data.datalist import DatalistError, unsplit_datalist
from bundle.data.markups import (
    MARKUPS_SUFFIXES,
    ControlPoint,
    check_label_names,
    label_key,
    markups_stem,
    names_of_labels,
    read_markups,
)

VOLUME_SUFFIXES = (".nii.gz", ".nii")


def find_markups(folder: str | Path) -> dict[str, Path]:
    """Markups files of ``folder`` by name without suffix; ``X.fcsv`` beside ``X.mrk.json`` is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatalistError(f"markups folder not found: {folder}")
    found: dict[str, Path] = {}
    for path in visible_files(folder):
        stem = markups_stem(path)
        if stem is None:
            continue
        if stem in found:
            raise DatalistError(f"two markups files for {stem!r}: {found[stem]} and {path}; keep one")
        found[stem] = path
    return found


# NIfTI spatial units (xyzt_units) that nibabel reads as millimetres where ITK and 3D Slicer convert them
_UNITS_NOT_MM = ("meter", "micron")
# qform and sform further apart than this (mm, at a corner of the volume) disagree
_FORMS_TOLERANCE_MM = 0.1


def _sheared(affine: np.ndarray) -> bool:
    """Whether the voxel axes of ``affine`` are not orthogonal (a zero axis counts as sheared)."""
    lengths = np.linalg.norm(affine[:3, :3], axis=0)
    if not lengths.all():
        return True
    axes = affine[:3, :3] / lengths
    return not np.allclose(axes.T @ axes, np.eye(3), atol=1e-4)


def nifti_header_problems(path: str | Path) -> tuple[str | None, str | None]:
    """``(refusal, warning)`` messages naming a NIfTI file that the bundle (nibabel) would read otherwise than 3D
    Slicer and ITK show it; ``(None, None)`` for other files and sound headers (an unreadable one is its reader's):

    - voxel sizes in metres or microns (nibabel takes them as millimetres): refused;
    - a qform and an sform that disagree where ITK reads the qform (an sform code other than 1, "scanner": the codes
      2-4 that registration tools write; or a sheared sform): warned about, the bundle reads the sform."""
    import nibabel as nib

    path = Path(path)
    if not path.name.lower().endswith((".nii", ".nii.gz")) or not path.is_file():
        return None, None
    try:
        header = nib.load(str(path)).header
    except Exception:
        return None, None
    unit = header.get_xyzt_units()[0]
    if unit in _UNITS_NOT_MM:
        return (
            f"{path}: its voxel sizes are in {unit}s (NIfTI xyzt_units), which the bundle would read as millimetres "
            "(3D Slicer and ITK convert them): save the volume in millimetres, e.g. SimpleITK.ReadImage then "
            "WriteImage"
        ), None
    qform_code, sform_code = int(header["qform_code"]), int(header["sform_code"])
    if qform_code == 0 or sform_code == 0 or (sform_code == 1 and not _sheared(header.get_sform())):
        return None, None
    extent = np.maximum(np.asarray(header.get_data_shape()[:3], dtype=np.float64) - 1, 0)
    corners = np.array([[*(c * extent), 1.0] for c in np.ndindex(2, 2, 2)])
    apart = float(np.abs(corners @ (header.get_qform() - header.get_sform()).T)[:, :3].max())
    if apart <= _FORMS_TOLERANCE_MM:
        return None, None
    return None, (
        f"{path}: its qform and sform place the volume up to {apart:.1f} mm apart; the bundle reads the sform "
        f"(code {sform_code}), 3D Slicer and ITK the qform (code {qform_code}), so landmarks placed in Slicer lie "
        "that far off here: make the two agree (e.g. nibabel: img.set_qform(img.get_sform())), or write the volume "
        "again with SimpleITK"
    )


def points_outside(
    affine: np.ndarray, shape: Sequence[int], landmarks: Sequence[Sequence[float] | None]
) -> dict[int, np.ndarray]:
    """``{index: voxel}`` of the RAS ``landmarks`` outside a volume of ``shape`` voxels whose voxel-to-RAS map is
    ``affine``."""
    inverse = np.linalg.inv(np.asarray(affine, dtype=np.float64))
    upper = np.asarray(shape[:3], dtype=np.float64) - 0.5
    out = {}
    for j, position in enumerate(landmarks):
        if position is not None:
            voxel = (inverse @ np.append(np.asarray(position, dtype=np.float64), 1.0))[:3]
            if ((voxel < -0.5) | (voxel > upper)).any():
                out[j] = voxel
    return out


def landmarks_outside(volume: Path, landmarks: Sequence[Sequence[float] | None]) -> dict[int, np.ndarray]:
    """:func:`points_outside` of ``volume``'s NIfTI header (its other problems, :func:`nifti_header_problems`, are
    found when the volume is read: ``prepare_data`` reads every image as the pipeline does)."""
    import nibabel as nib

    try:
        image = nib.load(str(volume))
    except Exception as e:  # nibabel raises several types for a corrupt or truncated header
        raise DatalistError(f"{volume}: unreadable NIfTI header ({e})") from e
    return points_outside(image.affine, image.shape, landmarks)


def warn_outside(
    markups: Path, volume: Path, names: Sequence[str], landmarks: Sequence, outside: dict[int, np.ndarray]
) -> None:
    """A warning for each landmark of ``markups`` that lies ``outside`` (:func:`points_outside`) its volume."""
    for j, voxel in outside.items():
        warnings.warn(
            f"{markups}: label {names[j]!r} at RAS {landmarks[j]} lies outside {volume} "
            f"(voxel {np.round(voxel, 1).tolist()}): LPS/RAS mix-up?",
            stacklevel=3,
        )


def markups_landmarks(path: Path, points: Sequence[ControlPoint], names: Sequence[str]) -> list[list[float] | None]:
    """Positions of ``names`` among ``points`` (by label, case and blanks ignored: :func:`label_key`); missing,
    repeated or unplaced -> None, warned."""
    check_label_names(names)
    counts = Counter(label_key(p.label) for p in points)
    by_label = {label_key(p.label): p.position for p in points}
    keys = {label_key(n) for n in names}
    extra = sorted({p.label for p in points if label_key(p.label) not in keys}, key=natural_key)
    if extra:
        warnings.warn(f"{path}: labels {extra} are not landmark names: ignored", stacklevel=2)
    out: list[list[float] | None] = []
    for label in names:
        key = label_key(label)
        if counts[key] == 0:
            warnings.warn(f"{path}: label {label!r} is missing: null", stacklevel=2)
        elif counts[key] > 1:
            warnings.warn(f"{path}: label {label!r} appears {counts[key]} times: null", stacklevel=2)
        elif by_label[key] is None:
            warnings.warn(f"{path}: label {label!r} has no position (not placed): null", stacklevel=2)
        else:
            out.append(list(by_label[key]))
            continue
        out.append(None)
    return out


def nifti_datalist(
    images_dir: str | Path,
    markups_dir: str | Path | None = None,
    landmark_names: Sequence[str] | None = None,
    name: str | None = None,
) -> dict:
    """Datalist of the volumes of ``images_dir`` and their markups (``markups_dir``, default the same folder).

    Landmark names default to the natural sort of every label found. A volume without markups is kept
    without landmarks; markups without a volume are ignored (both warned).
    """
    images_dir = Path(images_dir)
    markups_dir = images_dir if markups_dir is None else Path(markups_dir)
    volumes = find_images(images_dir, VOLUME_SUFFIXES)
    if not volumes:
        raise DatalistError(f"{images_dir}: no NIfTI volumes ({', '.join(VOLUME_SUFFIXES)})")
    files = find_markups(markups_dir)
    if not files:
        raise DatalistError(f"{markups_dir}: no markups files ({', '.join(MARKUPS_SUFFIXES)})")
    for stem in sorted(set(files) - set(volumes), key=natural_key):
        warnings.warn(f"{files[stem]}: no volume named {stem!r} in {images_dir}: ignored", stacklevel=2)
    points = {stem: read_markups(files[stem]) for stem in volumes if stem in files}
    if landmark_names is None:
        names = names_of_labels(points, markups_dir)
        if not names:
            raise DatalistError(f"{markups_dir}: the markups files hold no control points")
    else:
        names = [str(n) for n in landmark_names]

    items = []
    for stem in sorted(volumes, key=natural_key):
        item: dict = {"image": str(volumes[stem])}
        if stem not in points:
            warnings.warn(
                f"{volumes[stem]}: no markups file {stem}.fcsv or {stem}.mrk.json: kept without landmarks", stacklevel=2
            )
        else:
            item["landmarks"] = markups_landmarks(files[stem], points[stem], names)
            outside = landmarks_outside(volumes[stem], item["landmarks"])
            warn_outside(files[stem], volumes[stem], names, item["landmarks"], outside)
        items.append(item)
    return unsplit_datalist(name or images_dir.name, 3, names, items)
