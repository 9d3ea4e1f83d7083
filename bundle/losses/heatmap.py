"""The stage-2 detector's loss: BCE-with-logits or MSE over the valid landmark channels only."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.loss import _Loss


class MaskedHeatmapLoss(_Loss):
    """Heatmap regression loss over valid landmark channels only (a missing landmark adds nothing).

    ``forward(pred, target)``: ``pred`` ``(B, L, *S)`` logits; ``target`` either ``(heatmap, mask)``
    (``(B, L, *S)`` Gaussians in [0, 1] and ``(B, L)`` 1 = valid) or a heatmap alone (all valid).
    Averaged over the valid channels' pixels; 0 when none is valid.

    Args:
        kind: ``"bce"``: binary cross-entropy with logits against the Gaussians; ``"mse"``: mean squared error
            between ``sigmoid(pred)`` and the Gaussians.
        pos_weight: ``"bce"``'s weight of a pixel at a Gaussian's peak (1 in the background, in between along the
            Gaussian; heatmaps are mostly background).

    Example:
        >>> import torch
        >>> loss = MaskedHeatmapLoss()
        >>> pred, heatmap = torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8)
        >>> round(loss(pred, (heatmap, torch.tensor([[1.0, 0.0]]))).item(), 4)  # log 2, the second landmark left out
        0.6931
    """

    KINDS = ("bce", "mse")

    def __init__(self, kind: str = "bce", pos_weight: float = 1.0) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.kind = kind
        self.pos_weight = float(pos_weight)

    def forward(self, pred: torch.Tensor, target: Any) -> torch.Tensor:
        heatmap, mask = target if isinstance(target, (tuple, list)) else (target, None)
        pred = torch.as_tensor(pred).float()
        heatmap = torch.as_tensor(heatmap).float().to(pred.device)
        if heatmap.shape != pred.shape:
            raise ValueError(f"heatmap target {tuple(heatmap.shape)} and prediction {tuple(pred.shape)} differ")
        mask = (
            torch.ones(pred.shape[:2], device=pred.device)
            if mask is None
            else torch.as_tensor(mask).float().to(pred.device)
        )
        if self.kind == "bce":
            weight = 1.0 + (self.pos_weight - 1.0) * heatmap if self.pos_weight != 1.0 else None
            per_pixel = F.binary_cross_entropy_with_logits(pred, heatmap, weight=weight, reduction="none")
        else:
            per_pixel = (torch.sigmoid(pred) - heatmap).square()
        per_channel = per_pixel.flatten(2).mean(-1)  # (B, L)
        return (per_channel * mask).sum() / mask.sum().clamp_min(1.0)
