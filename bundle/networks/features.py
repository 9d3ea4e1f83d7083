"""Reading dense feature maps at point positions, shared by the loss, the one-shot inferer and template selection.

Convention: a point is a float position in pixels of the network's input grid, its components in the
order of the tensor's spatial axes, with the centre of the first pixel at 0. A feature map of stride s
covers the same field as the input, so its cell i is centred at input position (i + 0.5) * s - 0.5.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F


def points_to_feature_index(
    points: torch.Tensor, input_size: Sequence[int], feature_size: Sequence[int]
) -> torch.Tensor:
    """Continuous positions of input-grid ``points`` (..., D) in a feature grid of ``feature_size``."""
    axes = [(points[..., a] + 0.5) * (f / i) - 0.5 for a, (f, i) in enumerate(zip(feature_size, input_size))]
    return torch.stack(axes, -1)  # per axis, no tensor built from the sizes (a host-to-device copy on a GPU)


def sample_features(features: torch.Tensor, points: torch.Tensor, input_size: List[int]) -> torch.Tensor:
    """Bilinear (trilinear) features at ``points`` (TorchScript-scriptable).

    Args:
        features: ``(B, C, *S)`` feature map of any stride.
        points: ``(B, N, D)`` positions in input-grid pixels (axis order of the tensor's spatial axes).
        input_size: the input grid's spatial size (D values).

    Returns:
        ``(B, N, C)`` features (not re-normalised).
    """
    spatial_dims = features.dim() - 2
    if points.shape[-1] != spatial_dims or len(input_size) != spatial_dims:
        raise ValueError(
            f"points have {points.shape[-1]} components and input_size {len(input_size)}, features {spatial_dims}"
        )
    points = points.to(features.dtype)
    # align_corners=False convention, per axis (no tensor built from the sizes)
    axes: List[torch.Tensor] = []
    for a in range(spatial_dims):
        axes.append(2.0 * (points[..., a] + 0.5) / float(input_size[a]) - 1.0)
    grid = torch.stack(axes, -1).flip(-1)  # grid_sample wants (x=last axis, y, z) order
    grid = grid.reshape([grid.shape[0], grid.shape[1]] + [1] * (spatial_dims - 1) + [spatial_dims])
    sampled = F.grid_sample(features, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return sampled.reshape(features.shape[0], features.shape[1], -1).transpose(1, 2)
