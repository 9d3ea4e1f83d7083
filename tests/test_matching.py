"""The matching core against its definition: every grid position's and lattice point's features sampled one by one.

:class:`bundle.networks.matching.TemplateMatcher` computes the dense maps a tile at a time and the sub-pixel
refinement from the covered cells' dot products and Gram matrices; the reference here samples the features at each
point (:func:`sample_features`), takes cosines and combines the scales as the paper's product (or sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bundle.networks.features import sample_features
from bundle.networks.matching import TemplateMatcher, refine_peaks


def _smooth_features(grid: list[int], strides: list[int], channels: int, seed: int) -> list[torch.Tensor]:
    """Random feature maps blurred over a few cells (peaks of realistic width), one per stride."""
    generator = torch.Generator().manual_seed(seed)
    maps = []
    for stride in strides:
        size = [g // stride for g in grid]
        noise = torch.randn([1, channels] + size, generator=generator)
        pool = F.avg_pool2d if len(grid) == 2 else F.avg_pool3d
        maps.append(pool(noise, 3, stride=1, padding=1, count_include_pad=False))
    return maps


def _scores(matcher: TemplateMatcher, queries, features, points: torch.Tensor, grid: list[int]) -> torch.Tensor:
    """Combined score at ``points`` ``(1, N, M, D)`` of each query: sampled features, cosines, the scales combined."""
    n, m = points.shape[1], points.shape[2]
    cosines = []
    for q, f in zip(queries, features):
        sampled = F.normalize(sample_features(f, points.reshape(1, n * m, -1), grid), dim=-1).reshape(1, n, m, -1)
        cosines.append(torch.einsum("bnmc,bnc->bnm", sampled, q))
    return matcher.combine_scales(cosines)


def _grid_points(grid: list[int]) -> torch.Tensor:
    axes = [torch.arange(g, dtype=torch.float32) for g in grid]
    return torch.stack(torch.meshgrid(axes, indexing="ij"), dim=-1).reshape(-1, len(grid))


@pytest.mark.parametrize(
    "grid, strides, combine",
    [([48, 40], [16, 8, 4, 2], "product"), ([48, 40], [8, 2, 1], "sum"), ([32, 24, 32], [8, 4, 2], "product")],
)
def test_dense_search_and_refinement_equal_sampling_every_point(grid, strides, combine):
    torch.manual_seed(0)
    features = _smooth_features(grid, strides, channels=8, seed=1)
    n = 13  # more queries than channels: the tiled unit-map search
    queries = [F.normalize(torch.randn(1, n, 8), dim=-1) for _ in strides]
    # three queries are the features of border points: their peaks lie on the grid's edges
    edges = torch.tensor([[0.0] * len(grid), [g - 1.0 for g in grid], [0.0] * (len(grid) - 1) + [grid[-1] - 1.0]])
    for q, f in zip(queries, features):
        q[:, :3] = F.normalize(sample_features(f, edges[None], grid), dim=-1)
    matcher = TemplateMatcher(combine=combine, scale_weights=[1.0, 0.5, 2.0, 1.0][: len(strides)])
    matcher.tile_queries, matcher.tile_scores = 5, 97  # several query chunks and many small tiles
    with torch.no_grad():
        positions, scores = matcher(queries, features, grid)
        # dense: every grid position sampled
        every = _grid_points(grid)
        dense = _scores(matcher, queries, features, every.expand(1, n, -1, -1), grid).reshape([1, n] + grid)
        peaks, _ = refine_peaks(dense, step=0)
        # refinement: every lattice point around each peak sampled
        axis = torch.arange(-10, 11, dtype=torch.float32) * 0.1
        lattice = torch.stack(torch.meshgrid([axis] * len(grid), indexing="ij"), dim=-1).reshape(-1, len(grid))
        points = peaks.float()[:, :, None, :] + lattice
        fine = _scores(matcher, queries, features, points, grid).reshape([1, n] + [21] * len(grid))
        index, expected_scores = refine_peaks(fine, step=1)
        expected = (peaks + (index - 10) * 0.1).clamp_min(0.0)
        expected = torch.minimum(expected, torch.tensor(grid, dtype=expected.dtype) - 1)
        # the border queries' peaks lie on a plateau (the feature maps are smooth and the query is the border's own
        # feature): another lattice point may score the same to float32 rounding
        found = _scores(matcher, queries, features, positions[:, :, None, :].float(), grid).reshape(1, n)
    close = (positions - expected).abs().amax(-1) <= 2e-3
    tie = (found.double() - expected_scores.double()).abs() <= 1e-6
    tie[:, 3:] = False  # only the border queries' peaks lie on a plateau
    assert bool((close | tie).all()), ((positions - expected).abs().amax(-1), found - expected_scores)
    assert torch.allclose(scores.double(), expected_scores.double(), atol=1e-5)
    # the few-queries path (dots interpolated, norms apart) finds the same integer peaks
    with torch.no_grad():
        direct, _ = TemplateMatcher(combine=combine, scale_weights=matcher.scale_weights, refine_radius=0.0)(
            [q[:, :2] for q in queries], features, grid
        )
    assert torch.equal(direct, peaks[:, :2])
