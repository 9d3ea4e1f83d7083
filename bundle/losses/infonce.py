"""Multi-scale pixel-wise InfoNCE loss (the CC2D baseline the paper builds on, paper Sec. 3: the InfoNCE objective).

For a query pixel seen in an augmented crop and in the whole image, the crop encoder's feature at the
query (the anchor q) should be closer to the image encoder's feature at the same pixel (the positive k+)
than to the image's features elsewhere (the negatives)::

    L_s = -log( exp(q . k+ / T) / sum_k exp(q . k / T) )

At the coarsest scale the keys are every cell of the whole image's map; at finer scales they are a local
window around the positive (cells outside the map are left out of the softmax). The total is the
(optionally weighted) sum over scales of the mean over queries.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from bundle.networks.features import points_to_feature_index, sample_features
from torch.nn.modules.loss import _Loss


class MultiScaleInfoNCELoss(_Loss):
    """Pixel-wise InfoNCE between crop-encoder queries and whole-image-encoder keys, summed over scales (paper Sec. 3).

    Args:
        temperature: T in the softmax ``exp(cos / T)``.
        local_window: key window size per scale, coarse to fine; ``None`` = every cell of the map. An int
            means ``None`` at the coarsest scale and that odd size at every finer one.
        scale_weights: optional weight per scale (default 1 each).
        feature_mixing: optional ``feature_mixing(query, keys, logits, target) -> (logits, target)`` applied to
            every scale's key set before the softmax (where a method that changes the keys plugs in, e.g. the
            comparison methods of ``scripts/experiments/mixing.py``): ``query (B, Q, C)`` the unit query
            features, ``keys (B, Q, K, C)`` each query's key vectors, ``logits (B, Q, K)`` their cosines
            (``-inf``: a cell left out), ``target (B, Q)`` the positive's column. None: the paper's loss.

    Call ``loss(image_features, crop_features, image_points, crop_points, image_size, crop_size)``:
        image_features / crop_features: the two encoders' lists of ``(B, C, *S)`` maps, coarse to fine.
        image_points: ``(B, Q, D)`` query positions in the whole image's input grid (tensor axis order);
            queries with a NaN component (in either point) are ignored.
        crop_points: ``(B, Q, D)`` the same pixels in the crop's input grid.
        image_size / crop_size: the two input grids' spatial sizes.
        return_terms: also return the per-scale (unweighted) terms, coarse to fine.
    """

    def __init__(
        self,
        temperature: float = 0.1,
        local_window: int | Sequence[int | None] = 9,
        scale_weights: Sequence[float] | None = None,
        feature_mixing: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        windows = [local_window] if isinstance(local_window, int) else list(local_window)
        for w in windows:
            if w is not None and (int(w) != w or w < 1 or w % 2 == 0):
                raise ValueError(f"local_window sizes must be odd positive integers or None, got {local_window}")
        self.temperature = float(temperature)
        self.local_window = local_window
        self.scale_weights = None if scale_weights is None else [float(w) for w in scale_weights]
        self.feature_mixing = feature_mixing

    def windows_for(self, num_scales: int) -> list[int | None]:
        """Key window per scale, coarse to fine."""
        if isinstance(self.local_window, int):
            return [None] + [self.local_window] * (num_scales - 1)
        if len(self.local_window) != num_scales:
            raise ValueError(
                f"local_window={self.local_window} has {len(self.local_window)} entries for {num_scales} scales"
            )
        return list(self.local_window)

    def forward(
        self,
        image_features: Sequence[torch.Tensor],
        crop_features: Sequence[torch.Tensor],
        image_points: torch.Tensor,
        crop_points: torch.Tensor,
        image_size: Sequence[int],
        crop_size: Sequence[int],
        return_terms: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        num_scales = len(image_features)
        if len(crop_features) != num_scales:
            raise ValueError(f"image_features has {num_scales} scales but crop_features {len(crop_features)}")
        weights = self.scale_weights if self.scale_weights is not None else [1.0] * num_scales
        if len(weights) != num_scales:
            raise ValueError(f"scale_weights={self.scale_weights} has {len(weights)} entries for {num_scales} scales")
        if image_points.shape != crop_points.shape or image_points.ndim != 3:
            raise ValueError(
                f"image_points {tuple(image_points.shape)} and crop_points {tuple(crop_points.shape)}"
                " must both be (B, Q, D)"
            )
        valid = ~(torch.isnan(image_points).any(-1) | torch.isnan(crop_points).any(-1))
        image_points = torch.where(valid[..., None], image_points, torch.zeros_like(image_points))
        crop_points = torch.where(valid[..., None], crop_points, torch.zeros_like(crop_points))
        _check_inside(valid, ("image_points", image_points, image_size), ("crop_points", crop_points, crop_size))

        terms = []
        n_valid = valid.sum().clamp(min=1)
        for image_map, crop_map, window in zip(image_features, crop_features, self.windows_for(num_scales)):
            query = F.normalize(sample_features(crop_map, crop_points, crop_size), dim=-1)
            cell = points_to_feature_index(image_points.to(image_map.dtype), image_size, image_map.shape[2:])
            cell = _clamp_cells(cell.round().long(), image_map.shape[2:])
            if window is None:
                logits, target, keys = _global_logits(image_map, query, cell)
            else:
                logits, target, keys = _window_logits(image_map, query, cell, window)
            if self.feature_mixing is not None:
                logits, target = self.feature_mixing(query, keys, logits, target)
            ce = F.cross_entropy((logits / self.temperature).flatten(0, 1), target.flatten(), reduction="none")
            terms.append(torch.where(valid, ce.reshape(valid.shape), 0.0).sum() / n_valid)
        total = sum(w * t for w, t in zip(weights, terms))
        return (total, terms) if return_terms else total


def _outside(points: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``(B, Q)``: whether each point leaves its input grid (a component outside ``[-0.5, size - 0.5]``)."""
    return torch.stack([(points[..., a] < -0.5) | (points[..., a] > n - 0.5) for a, n in enumerate(size)], -1).any(-1)


def _check_inside(valid: torch.Tensor, *named: tuple[str, torch.Tensor, Sequence[int]]) -> None:
    """Every valid query point must lie on its input grid; one host sync for all of them (the loss's only one)."""
    outside = [valid & _outside(points, size) for _, points, size in named]
    if bool(torch.stack(outside).any()):
        for (name, points, size), out in zip(named, outside):
            if out.any():
                raise ValueError(
                    f"{name} contains {points[out][0].tolist()}, outside the input grid of size {tuple(size)}"
                )


def _clamp_cells(cell: torch.Tensor, spatial: Sequence[int]) -> torch.Tensor:
    """Integer cells ``(..., D)`` clamped into a grid of size ``spatial``, per axis (no tensor built from the size)."""
    return torch.stack([cell[..., a].clamp(0, int(n) - 1) for a, n in enumerate(spatial)], -1)


def _global_logits(
    image_map: torch.Tensor, query: torch.Tensor, cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cosines of each query with every cell ``(B, Q, N)``, the positive's flat index ``(B, Q)`` and the key
    vectors ``(B, Q, N, C)`` (a broadcast view)."""
    keys = image_map.flatten(2)  # (B, C, N)
    logits = torch.bmm(query, keys)
    per_query = keys.transpose(1, 2)[:, None].expand(-1, query.shape[1], -1, -1)
    return logits, _flat_index(cell, image_map.shape[2:]), per_query


def window_offsets(window: int, dims: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The cell offsets ``(window**dims, dims)`` of a local key window, row-major from ``-window // 2`` to
    ``window // 2`` per axis: column ``j`` of the window's logits is the cell ``positive + offsets[j]``."""
    return _window_offsets(window, dims, str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=32)
def _window_offsets(window: int, dims: int, device: str) -> torch.Tensor:
    """:func:`window_offsets`, built once per window, dimensionality and device (a host-to-device copy)."""
    half = window // 2
    return torch.tensor(list(itertools.product(range(-half, half + 1), repeat=dims)), device=device)


def _window_logits(
    image_map: torch.Tensor, query: torch.Tensor, cell: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cosines with the ``window**D`` cells centred on each positive (outside cells at -inf), the centre's index
    and the key vectors ``(B, Q, K, C)``."""
    spatial = image_map.shape[2:]
    offsets = window_offsets(window, len(spatial), cell.device)
    cells = cell[:, :, None, :] + offsets  # (B, Q, K, D)
    inside = torch.stack([(cells[..., a] >= 0) & (cells[..., a] < n) for a, n in enumerate(spatial)], -1).all(-1)
    flat = _flat_index(_clamp_cells(cells, spatial), spatial)  # (B, Q, K)
    keys = image_map.flatten(2).transpose(1, 2)  # (B, N, C)
    b, q, k = flat.shape
    gathered = torch.gather(keys, 1, flat.reshape(b, q * k, 1).expand(-1, -1, keys.shape[-1])).reshape(b, q, k, -1)
    logits = torch.einsum("bqc,bqkc->bqk", query, gathered).masked_fill(~inside, float("-inf"))
    target = torch.full((b, q), offsets.shape[0] // 2, dtype=torch.long, device=cell.device)
    return logits, target, gathered


def _flat_index(cell: torch.Tensor, spatial: Sequence[int]) -> torch.Tensor:
    """Row-major flat index of integer cells ``(..., D)`` in a grid of size ``spatial``."""
    flat = torch.zeros(cell.shape[:-1], dtype=torch.long, device=cell.device)
    for axis, size in enumerate(spatial):
        flat = flat * size + cell[..., axis]
    return flat
