"""VGG19 dense encoder (2D), the backbone of CC2D and used in the paper's experiments (Sec. 4, implementation details).

The convolutional stack is laid out exactly as torchvision's ``vgg19().features`` (conv, ReLU and
max-pool modules at the same indices), so a torchvision-format state dict ("features.N.weight" /
"features.N.bias") loads by index. Its five stages (strides 1, 2, 4, 8, 16; the final stride-32 pool is
not used) feed the shared U-Net decoder and embedding heads of ``bundle.networks.encoders``.
Pretrained weights only ever come from a local file; nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from bundle.networks.encoders import PyramidDecoder, check_spatial_size

__all__ = ["VGG19_CONFIG", "VGG19DenseEncoder", "load_vgg19_state_dict"]

# torchvision's configuration "E": conv widths, "M" a 2x2 max-pool.
VGG19_CONFIG: tuple[int | str, ...] = (
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    512,
    "M",
)
VGG19_STAGE_CHANNELS = (64, 128, 256, 512, 512)


def _vgg19_features(in_channels: int) -> nn.Sequential:
    """VGG19 conv stack up to (not including) the last pool, with torchvision's module indices."""
    layers: list[nn.Module] = []
    width = in_channels
    for item in VGG19_CONFIG[:-1]:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(width, int(item), kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            width = int(item)
    return nn.Sequential(*layers)


def load_vgg19_state_dict(features: nn.Sequential, path: str | os.PathLike) -> None:
    """Copy a torchvision-format VGG19 state dict from ``path`` into ``features`` (built by ``_vgg19_features``).

    Keys are "features.N.weight" / "features.N.bias" (a bare "N.weight" is accepted too); classifier keys
    are ignored. For a single-channel network, a 3-channel first conv is summed over its RGB input
    channels, so a grey image x gives the response that the RGB image (x, x, x) would.

    Raises:
        FileNotFoundError: the file does not exist.
        KeyError: conv weights are missing (the message names the file and the keys).
        ValueError: shapes do not match (the message names the file, the keys and the shapes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VGG19 weights file not found: {path}")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a state dict (a mapping of tensors), got {type(loaded).__name__}")
    source = {k[len("features.") :] if k.startswith("features.") else k: v for k, v in loaded.items()}
    target = features.state_dict()
    missing = sorted((k for k in target if k not in source), key=lambda k: int(k.split(".")[0]))
    if missing:
        raise KeyError(f"{path}: missing VGG19 keys {['features.' + k for k in missing]}")
    converted = {}
    mismatched = []
    for key, expected in target.items():
        value = source[key]
        if not isinstance(value, torch.Tensor):
            mismatched.append(f"features.{key}: not a tensor")
            continue
        if key == "0.weight" and value.ndim == 4 and value.shape[1] == 3 and expected.shape[1] == 1:
            value = value.sum(dim=1, keepdim=True)
        if value.shape != expected.shape:
            mismatched.append(f"features.{key}: file {tuple(value.shape)} vs network {tuple(expected.shape)}")
            continue
        converted[key] = value.to(expected.dtype)
    if mismatched:
        raise ValueError(f"{path}: VGG19 weights do not fit: {'; '.join(mismatched)}")
    features.load_state_dict(converted)


class VGG19DenseEncoder(nn.Module):
    """VGG19 conv features (strides 1..16) + U-Net decoder + unit-norm embedding heads; 2D only.

    Args:
        spatial_dims: must be 2 (VGG19 is a 2D network).
        in_channels: 1 for grey images (default) or 3.
        embed_dim: embedding width.
        strides: output strides, coarse to fine, each in {1, 2, 4, 8, 16}; inputs must be divisible by 16.
        decoder_channels: decoder widths at strides 1, 2, 4, 8 (a fifth value, if given, is unused:
            the stride-16 level is VGG19's own 512-wide stage).
        pretrained_path: optional local torchvision-format VGG19 state dict (see ``load_vgg19_state_dict``).
        norm: MONAI norm name of the decoder blocks (the VGG19 stack itself has none).

    The input is used as given (no ImageNet mean/std normalisation).
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        embed_dim: int = 32,
        strides: Sequence[int] = (16, 8, 4, 2),
        decoder_channels: Sequence[int] = (16, 32, 64, 128),
        pretrained_path: str | os.PathLike | None = None,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if spatial_dims != 2:
            raise ValueError(
                f"the vgg19 backbone is 2D only, got spatial_dims={spatial_dims}; use the light backbone for 3D"
            )
        self.spatial_dims = 2
        self.embed_dim = embed_dim
        self.size_divisor = 2 ** (len(VGG19_STAGE_CHANNELS) - 1)
        self.features = _vgg19_features(in_channels)
        # index of the module whose output closes each stage: the ReLU just before each pool, and the last ReLU
        pools = [i for i, m in enumerate(self.features) if isinstance(m, nn.MaxPool2d)]
        self.stage_ends = [i - 1 for i in pools] + [len(self.features) - 1]
        if pretrained_path is not None:
            load_vgg19_state_dict(self.features, pretrained_path)
        self.decoder = PyramidDecoder(2, VGG19_STAGE_CHANNELS, decoder_channels, strides, embed_dim, norm=norm)
        self.strides = self.decoder.strides

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        check_spatial_size(x, self.spatial_dims, self.size_divisor)
        skips = []
        for index, module in enumerate(self.features):
            x = module(x)
            if index in self.stage_ends:
                skips.append(x)
        return self.decoder(skips)
