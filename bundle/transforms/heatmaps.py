"""Heatmap training targets of the stage-2 detector (CC2D's second stage; the supervised fine-tuning).

:class:`GaussianHeatmapd` renders, after ``LandmarkTargetsd``, one Gaussian per landmark on the network
grid (sigma in grid pixels) as a multi-channel ``heatmap`` with the image's metadata, and a per-landmark
``landmark_mask`` (0 where the landmark is missing, ``null`` in the datalist: that channel is left out of
the loss). Being a MetaTensor on the same grid as the image, the heatmap goes through MONAI's
``RandAffined`` together with the image (same random rotation, scale and translation), so the target
follows the augmented image exactly; :class:`RandIsotropicAffined` is that ``RandAffined`` with one range for every
axis.

Not MONAI's ``GenerateHeatmapd`` (1.6): it draws another target. With ``normalize=True`` every channel is scaled to
peak 1, so a landmark between pixel centres gets a raised, flattened peak (up to 0.27 away from the Gaussian here,
sigma 2 on a 48 x 64 grid); with ``normalize=False`` it is the density, peak ``1 / (2 pi sigma^2)``. The shipped
detector was trained on these targets; MONAI's also took 27x longer for 19 landmarks on the 192 x 192 grid.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.geometry import grid_landmarks
from bundle.transforms.utils import like_input
from monai.config import KeysCollection
from monai.transforms import MapTransform, RandAffined, Transform
from monai.utils import TransformBackends

__all__ = ["GaussianHeatmap", "GaussianHeatmapd", "RandIsotropicAffined", "render_gaussian_heatmaps"]


def render_gaussian_heatmaps(
    points: torch.Tensor, grid_size: Sequence[int], sigma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussians ``exp(-|x - p|^2 / (2 sigma^2))`` ``(L, *grid_size)`` (float32, peak 1 at a point on a pixel
    centre) at grid ``points`` ``(L, D)``, and the mask ``(L,)`` (1 = valid, 0 = NaN point, all-zero channel)."""
    if sigma <= 0:
        raise ValueError(f"sigma must be positive, got {sigma}")
    points = torch.as_tensor(points, dtype=torch.float64)
    dims = len(grid_size)
    if points.ndim != 2 or points.shape[1] != dims:
        raise ValueError(f"points must be (L, {dims}), got {tuple(points.shape)}")
    valid = torch.isfinite(points).all(dim=1)
    safe = torch.where(valid[:, None], points, torch.zeros_like(points))
    total = torch.zeros((points.shape[0], *grid_size), dtype=torch.float64)
    for axis, size in enumerate(grid_size):
        coord = torch.arange(size, dtype=torch.float64)
        d2 = (coord[None, :] - safe[:, axis : axis + 1]) ** 2  # (L, size)
        shape = [points.shape[0]] + [1] * dims
        shape[axis + 1] = size
        total = total + d2.reshape(shape)
    heatmaps = torch.exp(-total / (2.0 * sigma**2)) * valid.reshape(-1, *([1] * dims))
    return heatmaps.to(torch.float32), valid.to(torch.float32)


class GaussianHeatmap(Transform):
    """Gaussian heatmaps ``(L, *S)`` and mask ``(L,)`` of grid ``points`` ``(L, D)`` on the grid of ``img``
    ``(C, *S)`` (:func:`render_gaussian_heatmaps`); the heatmaps are a MetaTensor with a copy of a MetaTensor
    image's metadata (affine), ready for a joint spatial augmentation."""

    backend = [TransformBackends.TORCH]

    def __init__(self, sigma: float = 2.0) -> None:
        if sigma <= 0:
            raise ValueError(f"sigma must be positive, got {sigma}")
        self.sigma = float(sigma)

    def __call__(self, img: Any, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heatmaps, mask = render_gaussian_heatmaps(points, tuple(img.shape[1:]), self.sigma)
        return like_input(heatmaps, img), mask


class GaussianHeatmapd(MapTransform):
    """Dictionary wrapper of :class:`GaussianHeatmap`: add ``heatmap_key`` ``(L, *S)`` and ``mask_key``
    ``(L,)`` to an item prepared by ``LandmarkTargetsd``.

    The landmarks' grid positions come from the item's ``label`` and ``grid_to_physical``
    (:func:`bundle.geometry.grid_landmarks`), the grid from the image ``keys`` (one key); the heatmap is a
    MetaTensor with the image's metadata (affine), ready for a joint spatial augmentation.

    Args:
        keys: the image key (one key).
        sigma: the Gaussians' standard deviation in grid pixels.
        heatmap_key: where to write the heatmaps ``(L, *S)``, peak 1 at a landmark on a pixel centre.
        mask_key: where to write the mask ``(L,)``: 1 = labelled, 0 = missing (an all-zero channel).
        allow_missing_keys: MONAI's flag.
    """

    backend = GaussianHeatmap.backend
    sigma = property(lambda self: self.heatmap.sigma)

    def __init__(
        self,
        keys: KeysCollection,
        sigma: float = 2.0,
        heatmap_key: str = "heatmap",
        mask_key: str = "landmark_mask",
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if len(self.keys) != 1:
            raise ValueError(f"GaussianHeatmapd takes one image key, got {self.keys}")
        self.heatmap = GaussianHeatmap(sigma)
        self.heatmap_key = heatmap_key
        self.mask_key = mask_key

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        image = d[self.first_key(d)]
        if "label" not in d or "grid_to_physical" not in d:
            raise KeyError("GaussianHeatmapd needs 'label' and 'grid_to_physical': put LandmarkTargetsd before it")
        points, _ = grid_landmarks(d)
        d[self.heatmap_key], d[self.mask_key] = self.heatmap(image, points)
        return d


class RandIsotropicAffined(RandAffined):
    """MONAI's ``RandAffined`` with one range for every spatial axis: a rotation of up to ``rotate`` degrees (about
    the one axis of a 2D image, each of the three of a volume), a scale of up to ``1 +- scale`` and a translation of
    up to ``translate`` grid pixels along each axis; the detector's augmentation of the image and its heatmap together.

    Args:
        keys: the keys to transform together (image and heatmap).
        spatial_dims: 2 or 3.
        rotate: ``affine_rotate``, the largest rotation in degrees.
        scale: ``affine_scale``, the largest relative scale change.
        translate: ``affine_translate``, the largest translation in grid pixels.
        **kwargs: the other arguments of ``RandAffined`` (``prob``, ``mode``, ``padding_mode``...).

    Example::

        RandIsotropicAffined(["image", "heatmap"], spatial_dims=2, rotate=10.0, scale=0.1, translate=8.0, prob=0.8)
    """

    def __init__(
        self, keys: KeysCollection, spatial_dims: int, rotate: float, scale: float, translate: float, **kwargs: Any
    ) -> None:
        dims = int(spatial_dims)
        super().__init__(
            keys,
            rotate_range=[float(np.deg2rad(rotate))] * (1 if dims == 2 else 3),
            scale_range=[scale] * dims,
            translate_range=[translate] * dims,
            **kwargs,
        )
