"""Inferers: one-shot (k-shot) matching from template images or stored features, and the detector's."""

from bundle import lazy_submodules
from bundle.inferers.heatmap import HeatmapInferer
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer

__all__ = ["HeatmapInferer", "OneShotInferer", "TemplateFeatureInferer"]

__getattr__ = lazy_submodules(__name__)
