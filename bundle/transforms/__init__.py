"""MONAI dictionary transforms of the paper's method (the public names of the README)."""

from bundle.transforms.entropy import EntropyMapd, local_entropy
from bundle.transforms.intensity import InfoGuidedIntensityd
from bundle.transforms.landmarks import LandmarkTargetsd
from bundle.transforms.sampling import SamplingWeightd, sampling_weights
from bundle.transforms.view_pair import RandViewPaird

__all__ = [
    "EntropyMapd",
    "InfoGuidedIntensityd",
    "LandmarkTargetsd",
    "RandViewPaird",
    "SamplingWeightd",
    "local_entropy",
    "sampling_weights",
]
