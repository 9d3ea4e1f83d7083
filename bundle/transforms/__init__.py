"""MONAI transforms of the paper's method: array transforms and their dictionary wrappers (the public names that
docs/transforms.md documents)."""

from bundle import lazy_submodules
from bundle.transforms.entropy import EntropyMap, EntropyMapd, local_entropy
from bundle.transforms.heatmaps import GaussianHeatmap, GaussianHeatmapd
from bundle.transforms.intensity import InfoGuidedIntensity, InfoGuidedIntensityd, adjust_brightness_contrast
from bundle.transforms.landmarks import LandmarkTargets, LandmarkTargetsd
from bundle.transforms.sampling import SamplingWeight, SamplingWeightd, sampling_weights
from bundle.transforms.view_pair import QuerySampler, RandAffineCrop, RandViewPaird

__all__ = [
    "EntropyMap",
    "EntropyMapd",
    "GaussianHeatmap",
    "GaussianHeatmapd",
    "InfoGuidedIntensity",
    "InfoGuidedIntensityd",
    "LandmarkTargets",
    "LandmarkTargetsd",
    "QuerySampler",
    "RandAffineCrop",
    "RandViewPaird",
    "SamplingWeight",
    "SamplingWeightd",
    "adjust_brightness_contrast",
    "local_entropy",
    "sampling_weights",
]

__getattr__ = lazy_submodules(__name__)
