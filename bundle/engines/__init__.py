"""Engine pieces: the contrastive training iteration, and the detector's batches."""

from bundle import lazy_submodules
from bundle.engines.contrastive import ContrastiveIterationUpdate
from bundle.engines.heatmap import HeatmapPrepareBatch

__all__ = ["ContrastiveIterationUpdate", "HeatmapPrepareBatch"]

__getattr__ = lazy_submodules(__name__)
