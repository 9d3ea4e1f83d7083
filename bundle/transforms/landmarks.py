"""Landmark targets for evaluation: the datalist's landmarks, the spacing and the grid-to-physical map.

After the spatial preprocessing of an evaluation item (loading, resizing to the network grid; in 3D
also orientation and resampling), ``LandmarkTargetsd`` adds what the one-shot inferer and the metrics
need, all in one physical millimetre frame:

- ``landmarks``: ``(L, D)`` float tensor in the datalist's convention (2D: original pixels [x, y];
  3D: world mm RAS), NaN where missing;
- ``label``: the same landmarks in physical mm (2D: original pixel x spacing; 3D: world mm);
- ``spacing``: ``(D,)`` mm per original pixel (the item's ``spacing``, else the image header);
- ``grid_to_physical``: ``(D+1, D+1)`` homogeneous map from network-grid positions to physical mm.

2D uses the ratio of the original and current shapes (the 2D evaluation pipeline only resizes); 3D uses
the image's affine, which MONAI keeps up to date through every spatial transform.

A landmark outside the image by more than ``outside_tolerance`` of its extent (a wrong coordinate
convention, a swapped axis, LPS given for RAS, a typo) is refused, naming the file, the landmark and its
value: it could never be predicted, and as a template landmark it would drag every prediction to the border.
"""

from __future__ import annotations

import warnings
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import MapTransform

from bundle.data.datalist import landmarks_array


def grid_to_original_pixels(current_size, original_size) -> np.ndarray:
    """Homogeneous ``(D+1, D+1)`` map from a resized grid to the original pixel grid (pixel centres at integers)."""
    scale = np.asarray(original_size, float) / np.asarray(current_size, float)
    d = len(scale)
    m = np.eye(d + 1)
    m[:d, :d] = np.diag(scale)
    m[:d, d] = 0.5 * scale - 0.5
    return m


def world_axis_spacing(affine: np.ndarray) -> np.ndarray:
    """Voxel size (mm) along the world axes x, y, z of a ``(4, 4)`` voxel-to-world affine.

    Each voxel axis is assigned to the world axis it is closest to (nibabel's ``io_orientation``), so a
    volume stored in any axis order (e.g. sagittal slices) gives its spacing in world x, y, z order, the
    order of the landmark components that pixel errors are divided by.
    """
    from nibabel.orientations import io_orientation

    affine = np.asarray(affine, float)
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    world_axis = io_orientation(affine)[:, 0]
    if np.isnan(world_axis).any():
        raise ValueError(f"degenerate affine, no voxel-to-world orientation: {affine.tolist()}")
    spacing = np.empty(3)
    spacing[world_axis.astype(int)] = sizes
    return spacing


def physical_to_datalist(points_mm, spacing) -> np.ndarray:
    """Physical points ``(..., D)`` in the datalist convention (the inverse of ``label``): 2D original pixels
    (mm / spacing), 3D world mm unchanged."""
    points_mm = np.asarray(points_mm, dtype=np.float64)
    spacing = np.asarray(spacing, dtype=np.float64)
    return points_mm / spacing if spacing.size == 2 else points_mm


class LandmarkTargetsd(MapTransform):
    """Add ``landmarks``, ``label``, ``spacing`` and ``grid_to_physical`` to an evaluation item (see module doc).

    Args:
        keys: the image key (one key).
        n_landmarks: number of landmarks in the datalist (``len(landmark_names)``).
        landmarks_key: the item's landmark list (absent or ``None``: all NaN, e.g. unlabelled images).
        spacing_key: the item's spacing override (mm per pixel, x, y[, z]).
        allow_missing_keys: MONAI's flag; the image key must be present.
    """

    def __init__(
        self,
        keys: KeysCollection,
        n_landmarks: int,
        landmarks_key: str = "landmarks",
        spacing_key: str = "spacing",
        label_key: str = "label",
        allow_missing_keys: bool = False,
        landmark_names: Sequence[str] | None = None,
        outside_tolerance: float = 0.05,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if len(self.keys) != 1:
            raise ValueError(f"LandmarkTargetsd takes one image key, got {self.keys}")
        self.n_landmarks = int(n_landmarks)
        if landmark_names is not None and len(landmark_names) != self.n_landmarks:
            raise ValueError(f"{len(landmark_names)} landmark_names for {self.n_landmarks} landmarks")
        self.landmark_names = None if landmark_names is None else [str(n) for n in landmark_names]
        if not outside_tolerance >= 0:
            raise ValueError(f"outside_tolerance must be >= 0, got {outside_tolerance}")
        self.outside_tolerance = float(outside_tolerance)
        self.landmarks_key = landmarks_key
        self.spacing_key = spacing_key
        self.label_key = label_key

    def _spacing(self, d: Mapping, image: MetaTensor, dims: int) -> np.ndarray:
        if d.get(self.spacing_key) is not None:
            spacing = np.asarray(d[self.spacing_key], float)
            if spacing.shape != (dims,):
                raise ValueError(f"'{self.spacing_key}' of {image.meta.get('filename_or_obj')} must have {dims} values, got {spacing}")
            return spacing
        header = image.meta.get("spacing") if isinstance(image, MetaTensor) else None
        if dims == 3 and isinstance(image, MetaTensor):
            original = image.meta.get("original_affine")
            return world_axis_spacing(np.asarray(original if original is not None else image.affine, float))
        if header is not None and np.all(np.asarray(header, float)[:dims] > 0):
            return np.asarray(header, float)[:dims]
        warnings.warn(
            f"no spacing for {image.meta.get('filename_or_obj') if isinstance(image, MetaTensor) else 'image'}: "
            "neither the datalist item nor the header gives one; using 1.0 (mm figures are then pixels)"
        )
        return np.ones(dims)

    def _check_inside(self, points: np.ndarray, label: np.ndarray, to_physical: np.ndarray, grid_shape: tuple, image) -> None:
        """Refuse a landmark outside the image by more than ``outside_tolerance`` of its extent (see module doc)."""
        present = ~np.isnan(label).any(axis=1)
        if not present.any():
            return
        size = np.asarray(grid_shape, float)
        homogeneous = np.concatenate([label[present], np.ones((int(present.sum()), 1))], axis=1)
        grid = (np.linalg.inv(to_physical) @ homogeneous.T).T[:, :-1]
        margin = -0.5 - self.outside_tolerance * size
        outside = ((grid < margin) | (grid > size - 1 - margin)).any(axis=1)
        if not outside.any():
            return
        j = int(np.flatnonzero(present)[np.argmax(outside)])
        name = f" ({self.landmark_names[j]!r})" if self.landmark_names else ""
        file = image.meta.get("filename_or_obj", "image") if isinstance(image, MetaTensor) else "image"
        value = [round(float(v), 4) for v in points[j]]
        if len(grid_shape) == 2:
            original = np.asarray(image.meta["spatial_shape"], int)[:2] if isinstance(image, MetaTensor) else size.astype(int)
            where = (
                f"the image's pixels span x in [-0.5, {original[0] - 0.5:g}], y in [-0.5, {original[1] - 0.5:g}] "
                "(2D landmarks are [x, y] pixels of the original file, x the column, y the row)"
            )
        else:
            where = "3D landmarks are [x, y, z] world RAS mm (LPS coordinates, as DICOM gives them, need x and y negated)"
        more = int(outside.sum()) - 1
        raise ValueError(
            f"{file}: landmark {j}{name} {value} lies outside the image: {where}"
            + (f"; {more} more landmark(s) of this item lie outside too" if more else "")
        )

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        key = self.first_key(d)
        image = d[key]
        dims = image.ndim - 1
        if dims not in (2, 3):
            raise ValueError(f"'{key}' must be channel-first 2D or 3D, got shape {tuple(image.shape)}")
        spacing = self._spacing(d, image, dims)
        points = landmarks_array(d, self.n_landmarks, dims)
        if dims == 2:
            original = np.asarray(image.meta["spatial_shape"], int)[:2] if isinstance(image, MetaTensor) else image.shape[1:]
            to_physical = np.diag(np.append(spacing, 1.0)) @ grid_to_original_pixels(image.shape[1:], original)
            label = points * spacing
        else:
            if not isinstance(image, MetaTensor):
                raise ValueError(f"'{key}' must be a MetaTensor with an affine for 3D landmarks")
            to_physical = np.asarray(image.affine, float)
            label = points
        self._check_inside(points, label, to_physical, tuple(image.shape[1:]), image)
        d[self.landmarks_key] = torch.as_tensor(points, dtype=torch.float32)
        d[self.label_key] = torch.as_tensor(label, dtype=torch.float32)
        d[self.spacing_key] = torch.as_tensor(spacing, dtype=torch.float32)
        d["grid_to_physical"] = torch.as_tensor(to_physical, dtype=torch.float64)
        return d
