"""The stage-2 detector's inferer: heatmaps -> sub-pixel peaks -> physical mm, as the one-shot inferers return."""

from __future__ import annotations

import torch
from bundle.geometry import apply_homogeneous
from bundle.networks.matching import refine_peaks
from monai.inferers import Inferer

# the detector's test-time shifts of the commands (train_stage2.yaml, evaluate.yaml, inference.yaml ``shift_tta``):
# chosen on validation images (docs/results.md, "Fine-tuning on human labels")
SHIFT_TTA = 2


class HeatmapInferer(Inferer):
    """Landmarks from a heatmap network: the peak of each channel, refined to sub-pixel precision by
    :func:`bundle.networks.matching.refine_peaks` (parabola through the peak and its neighbours), mapped to physical mm.

    ``__call__(inputs, network, grid_to_physical=None)`` -> ``(B, L, D)`` float64: grid positions, or
    physical mm when ``grid_to_physical`` is given (the ``OneShotInferer`` contract). After a call, ``peak_values``
    ``(B, L)`` holds each landmark's heatmap peak (the mean over the runs): how surely the detector recognises it
    (:class:`bundle.handlers.confidence.ConfidenceHandler`).

    Args:
        activation: "sigmoid" (the logits of :class:`bundle.networks.detector.HeatmapDetector`) or None.
        refine_step: neighbour distance of the sub-pixel fit; 0 = integer argmax.
        shift_tta: grid pixels; > 0: test-time augmentation (not in the paper): the input is also run shifted by
            plus and minus this along each axis (zero-padded), each run's peaks are shifted back, and the 2D + 1
            runs' peaks are averaged per landmark.
    """

    def __init__(self, activation: str | None = "sigmoid", refine_step: int = 1, shift_tta: int = 0) -> None:
        super().__init__()
        if activation not in (None, "sigmoid"):
            raise ValueError(f"activation must be 'sigmoid' or None, got {activation!r}")
        if int(shift_tta) != shift_tta or shift_tta < 0:
            raise ValueError(f"shift_tta must be a whole number of grid pixels >= 0, got {shift_tta!r}")
        self.activation = activation
        self.refine_step = int(refine_step)
        self.shift_tta = int(shift_tta)
        self.peak_values: torch.Tensor | None = None

    def _offsets(self, spatial_dims: int) -> list[list[int]]:
        offsets = [[0] * spatial_dims]
        for axis in range(spatial_dims if self.shift_tta else 0):
            for sign in (1, -1):
                offsets.append([sign * self.shift_tta if a == axis else 0 for a in range(spatial_dims)])
        return offsets

    def _peaks(self, inputs: torch.Tensor, network) -> tuple[torch.Tensor, torch.Tensor]:
        maps = torch.as_tensor(network(inputs)).float()
        if self.activation == "sigmoid":
            maps = torch.sigmoid(maps)
        return refine_peaks(maps, step=self.refine_step)

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        runs, values = [], []
        for offset in self._offsets(inputs.ndim - 2):
            peaks, peak_values = self._peaks(_shifted(inputs, offset), network)
            runs.append(peaks - torch.tensor(offset, dtype=torch.float64, device=inputs.device))
            values.append(peak_values)
        positions = torch.stack(runs).mean(dim=0)
        self.peak_values = torch.stack(values).mean(dim=0)
        if grid_to_physical is not None:
            positions = apply_homogeneous(grid_to_physical, positions)
        return positions


def _shifted(image: torch.Tensor, offset: list[int]) -> torch.Tensor:
    """``image`` ``(B, C, *S)`` moved by ``offset`` grid pixels along its spatial axes, zeros where it moved from."""
    for axis, step in enumerate(offset, start=2):
        if step:
            image = torch.roll(image, step, dims=axis)
            index = [slice(None)] * image.ndim
            index[axis] = slice(0, step) if step > 0 else slice(step, None)
            image[tuple(index)] = 0
    return image
