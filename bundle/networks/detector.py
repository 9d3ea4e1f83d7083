"""Heatmap landmark detector initialised from the self-supervised encoder (CC2D's stage 2, paper Sec. 4).

CC2D (Yao et al., MICCAI 2021) and the information-guided paper (Quan et al., CVPR 2023) report their
one-shot headline numbers after a second stage: a landmark detector with one heatmap channel per
landmark is trained on the pseudo-labels that one-shot matching with the stage-1 network gives for
every training image. The same detector trained on human labels is the supervised use of the
self-supervised weights (fine-tuning).

:class:`HeatmapDetector` is the stage-1 image encoder (:func:`bundle.networks.contrastive.build_encoder`,
same arguments, so the ``image_encoder.*`` weights of a stage-1 checkpoint load strictly) followed by a
small head: the multi-scale embedding maps are upsampled to the input grid, concatenated, and two MONAI
convolutions (1x1 to ``head_channels``, 3x3, 1x1 to the landmarks; cheap at full resolution) give one
heatmap (logit) per landmark on the input grid.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from bundle.checkpoints import read_state_dict
from bundle.networks.contrastive import build_encoder
from monai.networks.blocks import Convolution

__all__ = ["HeatmapDetector", "load_stage1_encoder"]

STAGE1_PREFIX = "image_encoder."


def load_stage1_encoder(
    detector: HeatmapDetector, path: str | os.PathLike | None, device: torch.device | str = "cpu"
) -> HeatmapDetector:
    """``detector`` with its ``image_encoder`` loaded from the ``image_encoder.*`` weights of a stage-1 checkpoint,
    strictly; other entries (the crop encoder) are ignored.

    Args:
        detector: the stage-2 network.
        path: the stage-1 checkpoint (a ``ContrastiveLandmarkNet`` state dict, or a dict holding one under
            ``model``); None: ``detector`` unchanged (random initialisation).
        device: where the checkpoint's tensors are read to.
    """
    if path is None:
        return detector
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"stage-1 checkpoint not found: {path} (train stage 1 first, or pass --random_init true)"
        )
    state = read_state_dict(path, device, what="stage-1 checkpoint")
    encoder_state = {k[len(STAGE1_PREFIX) :]: v for k, v in state.items() if k.startswith(STAGE1_PREFIX)}
    if not encoder_state:
        raise RuntimeError(
            f"{path} holds no '{STAGE1_PREFIX}*' weights: not a stage-1 (ContrastiveLandmarkNet) checkpoint"
        )
    try:
        detector.image_encoder.load_state_dict(encoder_state, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"the stage-1 encoder of {path} does not fit the detector's encoder: {e}") from e
    logging.getLogger(__name__).info("detector encoder initialised from the stage-1 checkpoint %s", path)
    return detector


class HeatmapDetector(nn.Module):
    """One heatmap (logit map) per landmark on the input grid, from the stage-1 dense encoder (CC2D's stage 2,
    paper Sec. 4).

    Args:
        spatial_dims: 2 or 3.
        n_landmarks: number of output channels (landmarks).
        backbone, in_channels, embed_dim, strides, channels, pretrained_path: as for
            :class:`bundle.networks.contrastive.ContrastiveLandmarkNet` (must match the stage-1 network to load it).
        head_channels: width of the head's hidden convolutions.

    The encoder starts random; :func:`load_stage1_encoder` gives it a stage-1 checkpoint's weights.

    ``forward(x)``: ``(B, in_channels, *S)`` -> ``(B, n_landmarks, *S)`` logits.
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        n_landmarks: int = 1,
        backbone: str = "light",
        in_channels: int = 1,
        embed_dim: int = 32,
        strides: Sequence[int] = (16, 8, 4, 2),
        channels: Sequence[int] = (16, 32, 64, 128, 128),
        pretrained_path: str | os.PathLike | None = None,
        head_channels: int = 32,
    ) -> None:
        super().__init__()
        if n_landmarks < 1:
            raise ValueError(f"n_landmarks must be >= 1, got {n_landmarks}")
        self.spatial_dims = spatial_dims
        self.n_landmarks = int(n_landmarks)
        self.image_encoder = build_encoder(
            backbone=backbone,
            spatial_dims=spatial_dims,
            in_channels=in_channels,
            embed_dim=embed_dim,
            strides=strides,
            channels=channels,
            pretrained_path=pretrained_path,
        )
        self.strides = self.image_encoder.strides
        features = embed_dim * len(self.strides) + in_channels
        self.head = nn.Sequential(
            Convolution(spatial_dims, features, head_channels, kernel_size=1, act="relu", norm="batch"),
            Convolution(spatial_dims, head_channels, head_channels, kernel_size=3, act="relu", norm="batch"),
            Convolution(spatial_dims, head_channels, self.n_landmarks, kernel_size=1, conv_only=True),
        )
        # background prior of the logits (RetinaNet's focal-loss initialisation): heatmaps are mostly ~0, so
        # training does not spend its first iterations learning the bias
        final = self.head[-1].conv
        nn.init.constant_(final.bias, -4.6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = tuple(x.shape[2:])
        mode = "bilinear" if self.spatial_dims == 2 else "trilinear"
        maps = [F.interpolate(f, size=size, mode=mode, align_corners=False) for f in self.image_encoder(x)]
        return self.head(torch.cat(maps + [x], dim=1))
