"""The stage-2 detector's batches for MONAI's ``SupervisedTrainer``: ``(image, (heatmap, mask))``."""

from __future__ import annotations

from typing import Any

import torch


class HeatmapPrepareBatch:
    """``prepare_batch`` of the detector's ``SupervisedTrainer``: ``(image, (heatmap, mask))`` on the device.

    Args:
        image_key: the batch's images ``(B, C, *S)``.
        heatmap_key: their target heatmaps ``(B, L, *S)`` (:class:`bundle.transforms.heatmaps.GaussianHeatmapd`).
        mask_key: the landmarks' validity ``(B, L)``, 1 = labelled.
    """

    def __init__(self, image_key: str = "image", heatmap_key: str = "heatmap", mask_key: str = "landmark_mask") -> None:
        self.keys = (image_key, heatmap_key, mask_key)

    def __call__(self, batchdata: dict, device=None, non_blocking: bool = False, **kwargs: Any):
        image, heatmap, mask = (
            torch.as_tensor(batchdata[k]).to(device=device, non_blocking=non_blocking, **kwargs) for k in self.keys
        )
        return image, (heatmap, mask)
