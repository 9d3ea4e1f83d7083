"""Unsupervised choice of the image to annotate as the one-shot template.

The idea of Quan et al., "Which images to label for few-shot medical landmark detection" (CVPR 2022):
label the image whose features best represent the others. Criterion used here (no landmark is read,
so nothing leaks): for a candidate c, points p are laid on a regular grid over its interior; each p is
matched into every other image j by the one-shot multi-scale similarity (forward match q, combined
similarity s) and q is matched back into c (p'). The point counts as reliably represented when the
cycle closes, ``|p' - p| <= cycle_tolerance`` grid pixels. The score of c is the mean over j and p of
``s * 1[cycle closes]``: high when c's structures are found, unambiguously and with similar features,
in the other images. The candidate with the highest score is chosen.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from bundle.oneshot import OneShotInferer, feature_vectors


def grid_points(grid_size: Sequence[int], n_points: int, margin: float = 0.1) -> torch.Tensor:
    """About ``n_points`` points ``(N, D)`` on a regular lattice covering the grid minus a ``margin`` fraction per side."""
    if n_points < 1 or not 0.0 <= margin < 0.5:
        raise ValueError(f"need n_points >= 1 and 0 <= margin < 0.5, got {n_points}, {margin}")
    per_axis = max(1, math.ceil(n_points ** (1.0 / len(grid_size)) - 1e-9))
    axes = [torch.linspace(margin * (s - 1), (1.0 - margin) * (s - 1), per_axis).round() for s in grid_size]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid_size))


def _as_batch(image: torch.Tensor, index: int, grid_size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A channel-first image ``(1, *spatial)`` as a ``(1, 1, *spatial)`` float batch on ``device``."""
    x = torch.as_tensor(image)
    if x.ndim < 3 or x.shape[0] != 1:
        raise ValueError(f"images[{index}]: expected a channel-first (1, *spatial) image, got shape {tuple(x.shape)}")
    if tuple(x.shape[1:]) != grid_size:
        raise ValueError(f"images[{index}]: grid {tuple(x.shape[1:])} differs from images[0] grid {grid_size}")
    return x[None].float().to(device)


def _device(network, default: torch.device) -> torch.device:
    parameters = list(network.parameters()) if hasattr(network, "parameters") else []
    return parameters[0].device if parameters else default


@torch.no_grad()
def select_template(
    network,
    images: Sequence[torch.Tensor],
    candidates: Sequence[int] | None = None,
    points_per_candidate: int = 64,
    cycle_tolerance: float = 2.0,
    margin: float = 0.1,
    inferer: OneShotInferer | None = None,
) -> tuple[int, list[float]]:
    """Pick the template among ``candidates`` (indices into ``images``, default all) by the module's criterion.

    Args:
        network: the dense encoder (list of feature maps, coarse to fine); the caller sets eval mode.
        images: channel-first grid images ``(1, *spatial)`` of one size, e.g. an ``(N, 1, *spatial)``
            tensor or a lazy sequence (the candidates' features are cached, the others computed once).
        points_per_candidate: about this many lattice points per candidate.
        cycle_tolerance: grid pixels within which the forward-backward match must return.
        margin: fraction of each side left out of the lattice.
        inferer: the matcher (combination of scales); default ``OneShotInferer(refine_radius=0)``.

    Returns:
        ``(index, scores)``: the chosen image's index in ``images`` and one score per candidate.
    """
    n_images = len(images)
    candidates = list(range(n_images)) if candidates is None else [int(c) for c in candidates]
    if n_images < 2:
        raise ValueError(f"template selection needs at least 2 images, got {n_images}")
    if not candidates or any(not 0 <= c < n_images for c in candidates):
        raise ValueError(f"candidates must be non-empty indices into the {n_images} images, got {candidates}")
    inferer = OneShotInferer(refine_radius=0.0) if inferer is None else inferer
    first = torch.as_tensor(images[0])
    grid_size = tuple(first.shape[1:])
    device = _device(network, first.device)
    points = grid_points(grid_size, points_per_candidate, margin).to(device)[None]

    def encode(index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        features = list(network(_as_batch(images[index], index, grid_size, device)))
        return features, inferer.feature_norms(features, grid_size)

    cached = {c: encode(c) for c in candidates}
    queries = {c: feature_vectors(cached[c][0], points, grid_size) for c in candidates}
    totals = {c: 0.0 for c in candidates}
    for j in range(n_images):
        others = [c for c in candidates if c != j]
        if not others:
            continue
        features_j, norms_j = cached[j] if j in cached else encode(j)
        for c in others:
            features_c, norms_c = cached[c]
            forward, similarity = inferer.match(queries[c], features_j, grid_size, norms_j)
            backward, _ = inferer.match(feature_vectors(features_j, forward.float(), grid_size), features_c, grid_size, norms_c)
            closes = (backward - points.double()).norm(dim=-1) <= cycle_tolerance
            totals[c] += float((similarity.double() * closes).mean())
    scores = [totals[c] / (n_images - 1) for c in candidates]
    best = candidates[max(range(len(candidates)), key=scores.__getitem__)]
    return best, scores
