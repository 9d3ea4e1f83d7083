"""Helpers shared by the transforms: input checks, output keys, outputs on the input's grid, a pipeline moved to
another network grid; the preprocessing to the network grid and the CT intensity window."""

from __future__ import annotations

import copy
from typing import Any, Hashable, Sequence

import torch
from bundle.settings import check_image_size
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import Compose, Resized, ScaleIntensityRanged
from monai.utils import ensure_tuple

__all__ = [
    "GridResized",
    "WindowIntensityd",
    "channel_mean",
    "like_input",
    "on_grid",
    "output_keys_for",
    "single_channel_spatial",
]


def channel_mean(image: torch.Tensor) -> torch.Tensor:
    """A channel-first image made grey: the mean over its channels when it has several (RGB), else itself.

    Args:
        image: a channel-first image (C, *spatial).
    """
    return image.mean(0, keepdim=True) if image.shape[0] > 1 else image


def single_channel_spatial(image: Any, owner: str, key: Hashable | None = None) -> Any:
    """The spatial array of a channel-first (1, H, W) or (1, D, H, W) image; otherwise a ValueError that names
    ``key`` (a dictionary transform's key; "the image" when None) and the shape."""
    shape = tuple(image.shape)
    name = "the image" if key is None else f"'{key}'"
    if len(shape) not in (3, 4):
        raise ValueError(f"{owner}: {name} must be channel-first with 2 or 3 spatial dims, got shape {shape}")
    if shape[0] != 1:
        raise ValueError(f"{owner}: {name} must have exactly 1 channel, got shape {shape}")
    return image[0]


def output_keys_for(
    keys: tuple[Hashable, ...], output_keys: KeysCollection | None, suffix: str
) -> tuple[Hashable, ...]:
    """``output_keys`` as a tuple matching ``keys`` (default: each key with ``suffix`` appended)."""
    if output_keys is None:
        return tuple(f"{key}{suffix}" for key in keys)
    outputs = ensure_tuple(output_keys)
    if len(outputs) != len(keys):
        raise ValueError(f"output_keys {outputs!r} must give one key per input key {keys!r}")
    return outputs


def like_input(result: torch.Tensor, image: Any) -> torch.Tensor:
    """``result`` as a MetaTensor with its own copy of ``image``'s affine, meta and applied operations when
    ``image`` is a MetaTensor (the map lies on the image's grid); ``result`` itself otherwise."""
    if isinstance(image, MetaTensor):
        meta, operations = copy.deepcopy(image.meta), copy.deepcopy(image.applied_operations)
        return MetaTensor(result, meta=meta, applied_operations=operations)
    return result


def on_grid(pipeline: Compose, grid: Sequence[int]) -> Compose:
    """A copy of ``pipeline`` whose ``Resized`` transforms resize to ``grid`` instead (each keeps its mode and
    anti-aliasing): the evaluation pipeline of a detector trained on another grid than the matching network's."""
    moved = copy.deepcopy(pipeline)
    resizes = [t for t in moved.flatten().transforms if isinstance(t, Resized)]
    if not resizes:
        raise ValueError("on_grid: the pipeline has no Resized transform to move to another grid")
    for transform in resizes:
        transform.resizer.spatial_size = tuple(int(v) for v in grid)
    return moved


class GridResized(Resized):
    """``Resized`` to the network grid ``image_size`` (checked against ``spatial_dims``: a multiple of the encoder's
    coarsest stride, :func:`bundle.settings.check_image_size`): by area in 2D; trilinear with anti-aliasing in 3D, which
    keeps positions exact where area mode would be nearest-like (a volume enlarged to the grid).

    Args:
        keys: the images (and maps on their grid) to resize.
        image_size: the network grid, one size per spatial axis.
        spatial_dims: 2 or 3.
    """

    def __init__(self, keys: KeysCollection, image_size: Sequence[int], spatial_dims: int) -> None:
        volume = int(spatial_dims) == 3
        super().__init__(
            keys,
            check_image_size(image_size, spatial_dims),
            mode="trilinear" if volume else "area",
            anti_aliasing=volume,
        )


class WindowIntensityd(ScaleIntensityRanged):
    """An intensity window ``[low, high]`` (a CT window in HU, ``hu_window``) mapped to [0, 1], values outside it
    clipped: MONAI's ``ScaleIntensityRanged`` from the window itself.

    Args:
        keys: the images to window.
        window: ``[low, high]``, low < high (checked as the command starts, :func:`bundle.settings.intensity_window`).

    Example::

        WindowIntensityd("image", window=[-200, 400])  # soft tissue and bone
    """

    def __init__(self, keys: KeysCollection, window: Sequence[float]) -> None:
        low, high = window
        super().__init__(keys, a_min=low, a_max=high, b_min=0.0, b_max=1.0, clip=True)
