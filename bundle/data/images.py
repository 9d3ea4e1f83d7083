"""Images read for analysis outside the training pipeline (augmentation estimates, figures)."""

from __future__ import annotations

import numpy as np
from monai.transforms import EnsureChannelFirst, LoadImage, ScaleIntensity

from bundle.data.dicom import XRayDicomd


def load_grey(path: str, spatial_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Image as a spatial float array in [0, 1] (channels averaged; 2D indexed ``[x, y]``) and its voxel-to-world affine.

    A DICOM X-ray is made 2D (header spacing, VOI window, MONOCHROME2) as in the pipeline's ``load_transforms``."""
    img = LoadImage(image_only=True)(path)
    if spatial_dims == 2:
        img = XRayDicomd(keys="image")({"image": img})["image"]
    img = EnsureChannelFirst()(img)
    if img.ndim - 1 != spatial_dims:
        raise ValueError(f"{path}: expected a {spatial_dims}D image, LoadImage gave shape {tuple(img.shape)}")
    grey = ScaleIntensity(minv=0.0, maxv=1.0)(img.float().mean(0, keepdim=True))
    return grey[0].numpy().astype(np.float64), np.asarray(img.affine, dtype=np.float64)
