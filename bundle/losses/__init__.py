"""Losses: the multi-scale pixel-wise InfoNCE, and the detector's heatmap loss."""

from bundle import lazy_submodules
from bundle.losses.heatmap import MaskedHeatmapLoss
from bundle.losses.infonce import MultiScaleInfoNCELoss, window_offsets

__all__ = ["MaskedHeatmapLoss", "MultiScaleInfoNCELoss", "window_offsets"]

__getattr__ = lazy_submodules(__name__)
