"""Coordinates of the bundle, the bottom layer: grid positions, physical millimetres and the datalist's convention.

- grid: float positions on the network's input grid, components in the order of the tensor's spatial axes, the
  centre of the first pixel at 0;
- physical: millimetres (2D: the original file's pixels times the spacing; 3D: world RAS mm);
- datalist: 2D original pixels ``[x, y]``, 3D world mm.

``grid_to_physical`` is a homogeneous ``(D+1, D+1)`` (or batched ``(B, D+1, D+1)``) matrix from grid positions to
physical millimetres. It is a matrix, not MONAI's ``ApplyTransformToPointsd``: the inferers map batched predictions
with it after the network, and the 2D physical frame (original pixels times the spacing) is not the affine of a
PNG, so :func:`grid_to_physical` builds it from the image's affine and :func:`apply_homogeneous` applies it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor
from monai.data.utils import to_affine_nd
from nibabel.orientations import io_orientation


def plain_tensor(x: Any) -> Any:
    """A MetaTensor as a plain tensor (metadata is not needed for matching); anything else unchanged."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x


def apply_homogeneous(matrix, points, inverse: bool = False) -> torch.Tensor:
    """Map ``points`` ``(..., N, D)`` through a homogeneous ``matrix`` ``(..., D+1, D+1)`` (or its inverse).

    Computed in float64; NaN points stay NaN without affecting the others.
    """
    m = torch.as_tensor(plain_tensor(matrix), dtype=torch.float64)
    p = torch.as_tensor(plain_tensor(points), dtype=torch.float64)
    d = p.shape[-1]
    if m.shape[-2:] != (d + 1, d + 1):
        raise ValueError(f"homogeneous matrix must be (..., {d + 1}, {d + 1}) for {d}-D points, got {tuple(m.shape)}")
    m = m.to(p.device)
    if inverse:
        m = torch.linalg.inv(m)
    return p @ m[..., :d, :d].transpose(-1, -2) + m[..., None, :d, d]


def grid_to_physical(image, spacing) -> np.ndarray:
    """Homogeneous ``(D+1, D+1)`` map from the grid positions of a channel-first ``image`` to physical mm.

    The image's affine maps its grid to the frame it was read in (MONAI updates it in every spatial
    transform; a plain tensor has the identity). In 3D that frame is world mm, the physical frame. In 2D the
    physical frame is the original file's pixels (centres at integers) times ``spacing`` ``[x, y]``: the
    affine is taken back to those pixels by the inverse of the affine the file was read with
    (``original_affine``, e.g. a DICOM's; absent, as for PNG, when that was the identity).
    """
    dims = image.ndim - 1
    affine = np.asarray(to_affine_nd(dims, image.affine), float) if isinstance(image, MetaTensor) else np.eye(dims + 1)
    if dims == 3:
        return affine
    original = image.meta.get("original_affine") if isinstance(image, MetaTensor) else None
    if original is not None:
        affine = np.linalg.solve(to_affine_nd(dims, np.asarray(original, float)), affine)
    return np.diag(np.append(np.asarray(spacing, float), 1.0)) @ affine


def world_axis_spacing(affine: np.ndarray) -> np.ndarray:
    """Voxel size (mm) along the world axes x, y, z of a ``(4, 4)`` voxel-to-world affine.

    Each voxel axis is assigned to the world axis it is closest to (nibabel's ``io_orientation``), so a
    volume stored in any axis order (e.g. sagittal slices) gives its spacing in world x, y, z order, the
    order of the landmark components that pixel errors are divided by.
    """
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


def grid_landmarks(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Landmarks ``(L, D)`` (float32) in grid positions of an item that the evaluation pipeline (ending with
    ``LandmarkTargetsd``) prepared, and its grid-to-physical matrix (float64)."""
    matrix = torch.as_tensor(data["grid_to_physical"], dtype=torch.float64)
    return apply_homogeneous(matrix, data["label"], inverse=True).to(torch.float32), matrix
