"""The coordinate frames of an image: its pixels or voxels, LPS millimetres, the network's grid and the file's frame.

A 2D image's pixel ``(x, y)`` (column, row; the datalist convention) lies where 3D Slicer puts it when it loads the
file: LPS ``(x * sx, y * sy, 0)`` for PNG / JPEG / TIFF (no origin, spacing 1 unless the datalist gives one), and for
DICOM the header's frame (ImagePositionPatient, ImageOrientationPatient, pixel spacing; what ITK reads and
``XRayDicomd`` keeps as ``original_affine``). Saved labels (Slicer ``.mrk.json`` / ``.fcsv``) are mapped back to
pixels through the same frame.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from bundle.data.dicom import dicom_tags
from bundle.transforms.landmarks import LandmarkTargets, file_frame, file_positions, outside_excess


def image_frame(data: dict, spatial_dims: int) -> dict:
    """``{"spacing", "spacing_known", "affine", "grid_to_physical", "grid_shape", "to_file", "file_size"}`` of an
    image that the evaluation pipeline prepared (``data``): 2D pixel -> LPS mm (``affine`` 3x3 or None = pixel *
    spacing; ``spacing_known``: its header gives one, else it is 1), the network grid of the pipeline over the image
    (its bounds), and the file's frame (:func:`bundle.transforms.landmarks.file_frame`)."""
    spacing = np.asarray(torch.as_tensor(data["spacing"]).cpu(), dtype=np.float64).reshape(-1)
    affine = None
    meta = getattr(data["image"], "meta", {})
    original = meta.get("original_affine") if meta else None
    if meta and dicom_tags(meta) and original is not None and np.asarray(original).shape == (3, 3):
        ras = np.asarray(original, dtype=np.float64)
        affine = np.diag([-1.0, -1.0, 1.0]) @ ras  # ITK/MONAI's RAS -> LPS
    frame = {
        "spacing": spacing,
        "spacing_known": LandmarkTargets.header_spacing(data["image"], spatial_dims) is not None,
        "affine": affine,
        "grid_to_physical": np.asarray(torch.as_tensor(data["grid_to_physical"]).cpu(), dtype=np.float64),
        "grid_shape": np.asarray(data["image"].shape[1:], dtype=np.float64),
    }
    frame["to_file"], frame["file_size"] = file_frame(data["image"])
    return frame


def pixels_to_lps(points_px: np.ndarray, frame: dict) -> np.ndarray:
    """``(L, 2)`` pixels -> ``(L, 3)`` LPS mm (z = 0 unless the DICOM frame says otherwise)."""
    p = np.asarray(points_px, dtype=np.float64)
    if frame["affine"] is None:
        xy = p * frame["spacing"]
    else:
        xy = (frame["affine"] @ np.c_[p, np.ones(len(p))].T).T[:, :2]
    return np.c_[xy, np.zeros(len(p))]


def lps_to_pixels(points_lps: np.ndarray, frame: dict) -> np.ndarray:
    """``(L, 3)`` LPS mm -> ``(L, 2)`` pixels (:func:`pixels_to_lps` inverted; z is not read)."""
    p = np.asarray(points_lps, dtype=np.float64)[:, :2]
    if frame["affine"] is None:
        return p / frame["spacing"]
    inverse = np.linalg.inv(frame["affine"])
    return (inverse @ np.c_[p, np.ones(len(p))].T).T[:, :2]


def outside(point: Sequence[float], frame: dict) -> str | None:
    """None when ``point`` (2D: pixels; 3D: world mm) lies on the image by the pipeline's rule
    (:func:`bundle.transforms.landmarks.outside_excess` in the file's frame), else the image's extent in the
    point's units, for a message."""
    to_file, size = frame["to_file"], frame["file_size"]
    if not outside_excess(file_positions(point, to_file), size).any():
        return None
    d = len(size)
    corners = np.array(np.meshgrid(*[[-0.5, n - 0.5] for n in size], indexing="ij")).reshape(d, -1)
    extent = (np.linalg.inv(to_file) @ np.r_[corners, np.ones((1, corners.shape[1]))])[:d]
    axes = ", ".join(f"{a} {lo:g} to {hi:g}" for a, lo, hi in zip("xyz", extent.min(1), extent.max(1)))
    return f"{axes} {'pixels' if d == 2 else 'mm'}"
