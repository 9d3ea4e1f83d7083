"""Dense multi-scale encoders for pixel-wise contrastive learning (the CC2D baseline, paper Sec. 3).

An encoder maps ``(B, C_in, *spatial)`` to a list of L2-normalised embedding maps, coarse to fine, one
``(B, embed_dim, *spatial / stride)`` map per stride in ``encoder.strides``. Level ``k`` of a backbone
has stride ``2**k``; the decoder climbs back from the deepest level with skip connections (a U-Net) and
a 1x1 head projects each requested level to ``embed_dim``.

This module holds the shared pieces (stride checks, decoder + heads) and the light, dimension-generic
:class:`DenseUNetEncoder`; ``bundle/networks/vgg.py`` holds the 2D VGG19 backbone.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from monai.networks.blocks import Convolution, ResidualUnit, UpSample

__all__ = ["DenseUNetEncoder", "PyramidDecoder", "check_spatial_size", "validate_strides"]


def validate_strides(strides: Sequence[int], num_levels: int) -> tuple[int, ...]:
    """Check that ``strides`` are distinct powers of two, coarse to fine, reachable by ``num_levels`` levels."""
    strides = tuple(int(s) for s in strides)
    max_stride = 2 ** (num_levels - 1)
    if not strides:
        raise ValueError("strides must name at least one output stride")
    for s in strides:
        if s < 1 or s & (s - 1) or s > max_stride:
            raise ValueError(
                f"stride {s} in strides={strides} must be a power of two between 1 and {max_stride}"
                " (the backbone's deepest level)"
            )
    if list(strides) != sorted(set(strides), reverse=True):
        raise ValueError(f"strides={strides} must be distinct and ordered coarse to fine (decreasing)")
    return strides


def check_spatial_size(x: torch.Tensor, spatial_dims: int, divisor: int) -> None:
    """Raise ValueError unless ``x`` is ``(B, C, *spatial)`` with every spatial size divisible by ``divisor``.

    Written for TorchScript too (the exported networks keep this check).
    """
    if x.dim() != spatial_dims + 2:
        raise ValueError(
            "expected a (B, C, "
            + str(spatial_dims)
            + " spatial) input of "
            + str(spatial_dims + 2)
            + " dims, got shape "
            + str(list(x.shape))
        )
    for size in x.shape[2:]:
        if size % divisor != 0:
            raise ValueError(
                "input spatial size " + str(list(x.shape[2:])) + ": " + str(size) + " is not divisible by the"
                " encoder's deepest stride " + str(divisor)
            )


@torch.jit.interface
class _TensorModule(nn.Module):
    """TorchScript interface of a module mapping one tensor to one tensor (decoder blocks looked up by level)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (the name nn.Sequential uses)
        pass


class PyramidDecoder(nn.Module):
    """U-Net decoder with one embedding head per output stride (shared by every backbone).

    Args:
        spatial_dims: 2 or 3.
        skip_channels: widths of the backbone's levels, level ``k`` at stride ``2**k`` (fine to coarse).
        decoder_channels: decoder widths at levels ``0 .. len(skip_channels) - 2``.
        strides: output strides, coarse to fine.
        embed_dim: width of every embedding.
        norm: MONAI norm name of the decoder blocks.
    """

    def __init__(
        self,
        spatial_dims: int,
        skip_channels: Sequence[int],
        decoder_channels: Sequence[int],
        strides: Sequence[int],
        embed_dim: int,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        num_levels = len(skip_channels)
        if len(decoder_channels) < num_levels - 1:
            raise ValueError(
                f"decoder_channels={tuple(decoder_channels)} needs {num_levels - 1} widths (levels 0..{num_levels - 2})"
            )
        self.strides = validate_strides(strides, num_levels)
        self.levels = [s.bit_length() - 1 for s in self.strides]
        self.top_level = num_levels - 1
        finest = self.levels[-1]
        self.up = nn.ModuleDict()
        self.fuse = nn.ModuleDict()
        width = {self.top_level: skip_channels[-1]}
        for level in range(self.top_level - 1, finest - 1, -1):
            out = decoder_channels[level]
            self.up[str(level)] = UpSample(
                spatial_dims, width[level + 1], out, mode="nontrainable", interp_mode="linear", align_corners=False
            )
            self.fuse[str(level)] = Convolution(spatial_dims, out + skip_channels[level], out, act="relu", norm=norm)
            width[level] = out
        self.heads = nn.ModuleDict(
            {
                str(level): Convolution(spatial_dims, width[level], embed_dim, kernel_size=1, conv_only=True)
                for level in self.levels
            }
        )

    def forward(self, skips: list[torch.Tensor]) -> list[torch.Tensor]:
        """``skips[k]`` is the backbone's level-``k`` map; returns the normalised embeddings, coarse to fine."""
        y = skips[self.top_level]
        outputs: dict[int, torch.Tensor] = {}
        for level in range(self.top_level, self.levels[-1] - 1, -1):
            if level < self.top_level:
                up: _TensorModule = self.up[str(level)]
                fuse: _TensorModule = self.fuse[str(level)]
                y = fuse.forward(torch.cat([up.forward(y), skips[level]], dim=1))
            if level in self.levels:
                head: _TensorModule = self.heads[str(level)]
                outputs[level] = F.normalize(head.forward(y), dim=1)
        return [outputs[level] for level in self.levels]


class DenseUNetEncoder(nn.Module):
    """Light dense encoder: a residual U-Net (MONAI blocks, BatchNorm) with multi-scale unit-norm heads.

    Level 0 works at full resolution, each further level halves the size with a strided residual unit,
    so ``len(channels)`` levels reach stride ``2 ** (len(channels) - 1)`` (16 by default); inputs must be
    divisible by that stride. The same code serves 2D and 3D (``spatial_dims``).
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        embed_dim: int = 32,
        strides: Sequence[int] = (16, 8, 4, 2),
        channels: Sequence[int] = (16, 32, 64, 128, 128),
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
        if len(channels) < 2:
            raise ValueError(f"channels={tuple(channels)} needs at least two levels")
        self.spatial_dims = spatial_dims
        self.embed_dim = embed_dim
        self.size_divisor = 2 ** (len(channels) - 1)
        self.down = nn.ModuleList()
        previous = in_channels
        for level, width in enumerate(channels):
            self.down.append(
                ResidualUnit(
                    spatial_dims, previous, width, strides=1 if level == 0 else 2, subunits=2, act="relu", norm=norm
                )
            )
            previous = width
        self.decoder = PyramidDecoder(spatial_dims, channels, channels[:-1], strides, embed_dim, norm=norm)
        self.strides = self.decoder.strides

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        check_spatial_size(x, self.spatial_dims, self.size_divisor)
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        return self.decoder(skips)
