"""The stage-2 detector's inferer: heatmaps -> sub-pixel peaks -> physical mm, as the one-shot inferers return."""

from __future__ import annotations

import torch
from bundle.geometry import apply_homogeneous
from bundle.networks.matching import refine_peaks
from monai.inferers import Inferer


class HeatmapInferer(Inferer):
    """Landmarks from a heatmap network: the peak of each channel, refined to sub-pixel precision by
    :func:`bundle.networks.matching.refine_peaks` (parabola through the peak and its neighbours), mapped to physical mm.

    ``__call__(inputs, network, grid_to_physical=None)`` -> ``(B, L, D)`` float64: grid positions, or
    physical mm when ``grid_to_physical`` is given (the ``OneShotInferer`` contract).

    Args:
        activation: "sigmoid" (the logits of :class:`bundle.networks.detector.HeatmapDetector`) or None.
        refine_step: neighbour distance of the sub-pixel fit; 0 = integer argmax.
    """

    def __init__(self, activation: str | None = "sigmoid", refine_step: int = 1) -> None:
        super().__init__()
        if activation not in (None, "sigmoid"):
            raise ValueError(f"activation must be 'sigmoid' or None, got {activation!r}")
        self.activation = activation
        self.refine_step = int(refine_step)

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        maps = torch.as_tensor(network(inputs)).float()
        if self.activation == "sigmoid":
            maps = torch.sigmoid(maps)
        positions, _ = refine_peaks(maps, step=self.refine_step)
        if grid_to_physical is not None:
            positions = apply_homogeneous(grid_to_physical, positions)
        return positions
