"""Losses: the multi-scale pixel-wise InfoNCE with its comparison mixings, and the detector's heatmap loss."""

from bundle.losses.heatmap import MaskedHeatmapLoss
from bundle.losses.infonce import MultiScaleInfoNCELoss, window_offsets
from bundle.losses.mixing import (
    FeatureTransformation,
    HardNegativeMixing,
    Synthetic,
    Transformed,
    UnmixDraw,
    beta_sample,
    feature_mixing,
    image_mixing,
    unmix_crops,
    unmix_draw,
    unmix_loss,
)

__all__ = [
    "FeatureTransformation",
    "HardNegativeMixing",
    "MaskedHeatmapLoss",
    "MultiScaleInfoNCELoss",
    "Synthetic",
    "Transformed",
    "UnmixDraw",
    "beta_sample",
    "feature_mixing",
    "image_mixing",
    "unmix_crops",
    "unmix_draw",
    "unmix_loss",
    "window_offsets",
]
