"""Choice of the one-shot template among candidate images.

``select_template`` needs no labels (which image to annotate); ``select_template_by_landmarks`` ranks
images that are labelled already by how well their landmarks transfer to the others.

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
from bundle.geometry import apply_homogeneous, plain_tensor
from bundle.inferers.oneshot import OneShotInferer
from bundle.networks.matching import feature_vectors
from bundle.passes import map_shards


def grid_points(grid_size: Sequence[int], n_points: int, margin: float = 0.1) -> torch.Tensor:
    """About ``n_points`` points ``(N, D)`` on a regular lattice
    covering the grid minus a ``margin`` fraction per side."""
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


def _encode(network, image: torch.Tensor, index: int, grid_size: tuple[int, ...], device: torch.device):
    """The network's feature maps of ``images[index]`` (the matcher computes their grid norms when its path needs
    them: every call below matches many images' or templates' queries at once)."""
    return [plain_tensor(f) for f in network(_as_batch(image, index, grid_size, device))]


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

    def encode(index: int) -> list[torch.Tensor]:
        return _encode(network, images[index], index, grid_size, device)

    # under torchrun each process encodes its share of the candidates, matches into its share of the images and back
    # into its candidates (bundle.passes.map_shards); the queries and matches travel on the CPU
    cached: dict[int, list[torch.Tensor]] = {}  # this process's candidates' features

    def candidate_queries(c: int) -> list[torch.Tensor]:
        cached[c] = encode(c)
        return [q.cpu() for q in feature_vectors(cached[c], points, grid_size)]

    queries = {
        c: [q.to(device) for q in found] for c, found in zip(candidates, map_shards(candidate_queries, candidates))
    }

    # forward: every candidate's points found in image j in one matcher call; the features there are the queries
    # of the backward match into the candidate, every image's in one call per candidate
    def forward_matches(j: int) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
        others = [c for c in candidates if c != j]
        if not others:
            return {}
        features_j = cached[j] if j in cached else encode(j)
        stacked = [torch.cat([queries[c][s] for c in others], dim=1) for s in range(len(features_j))]
        forward, similarity = inferer.matcher(stacked, features_j, grid_size)
        return {
            c: (score.cpu(), [q.cpu() for q in feature_vectors(features_j, found.float(), grid_size)])
            for c, found, score in zip(
                others, forward.split(points.shape[1], dim=1), similarity.split(points.shape[1], 1)
            )
        }

    similarities: dict[int, dict[int, torch.Tensor]] = {c: {} for c in candidates}
    back_queries: dict[int, dict[int, list[torch.Tensor]]] = {c: {} for c in candidates}
    for j, matches in enumerate(map_shards(forward_matches, range(n_images), "template ranking")):
        for c, (score, found) in matches.items():
            similarities[c][j] = score.to(device)
            back_queries[c][j] = [q.to(device) for q in found]

    def cycle_total(c: int) -> float:
        sources = list(back_queries[c])
        stacked = [torch.cat([back_queries[c][j][s] for j in sources], dim=1) for s in range(len(cached[c]))]
        backward, _ = inferer.matcher(stacked, cached[c], grid_size)
        total = 0.0
        for j, back in zip(sources, backward.split(points.shape[1], dim=1)):
            closes = (back - points.double()).norm(dim=-1) <= cycle_tolerance
            total += float((similarities[c][j].double() * closes).mean())
        return total

    totals = dict(zip(candidates, map_shards(cycle_total, candidates)))
    scores = [totals[c] / (n_images - 1) for c in candidates]
    best = candidates[max(range(len(candidates)), key=scores.__getitem__)]
    return best, scores


@torch.no_grad()
def landmark_transfer_errors(
    network,
    images: Sequence[torch.Tensor],
    points: Sequence[torch.Tensor],
    grid_to_physical: Sequence[torch.Tensor],
    inferer: OneShotInferer | None = None,
    templates: Sequence[int] | None = None,
) -> torch.Tensor:
    """Matrix ``(N, N)``: entry ``[c, j]`` is the mean radial error (mm) of one-shot detection in image ``j`` with
    image ``c`` as the template, against ``j``'s own landmarks (NaN on the diagonal and where no landmark is shared).

    Args:
        images: channel-first grid images ``(1, *spatial)`` of one size.
        points: each image's landmarks ``(L, D)`` in grid positions (NaN = missing).
        grid_to_physical: each image's homogeneous grid-to-mm matrix ``(D+1, D+1)``.
        inferer: the matcher; default ``OneShotInferer()`` (with the sub-pixel refinement used at inference).
        templates: the rows to compute (default all); the other rows stay NaN.
    """
    n_images = len(images)
    if not n_images == len(points) == len(grid_to_physical) or n_images < 2:
        raise ValueError(
            f"need at least 2 images with one points array and one matrix each, "
            f"got {n_images}, {len(points)}, {len(grid_to_physical)}"
        )
    inferer = OneShotInferer() if inferer is None else inferer
    grid_size = tuple(torch.as_tensor(images[0]).shape[1:])
    device = _device(network, torch.as_tensor(images[0]).device)
    pts = [torch.as_tensor(p, dtype=torch.float32, device=device) for p in points]
    physical = [apply_homogeneous(m, p) for m, p in zip(grid_to_physical, pts)]
    rows = range(n_images) if templates is None else [int(t) for t in templates]
    known = {c: ~torch.isnan(pts[c]).any(dim=1) for c in rows}
    # under torchrun each process encodes its share of the images and finds every template's landmarks in them
    # (bundle.passes.map_shards); the queries travel on the CPU
    features: dict[int, list[torch.Tensor]] = {}  # this process's images' features

    def encoded_queries(i: int) -> list[torch.Tensor] | None:
        features[i] = _encode(network, images[i], i, grid_size, device)
        if i not in known or not known[i].any():
            return None
        return [q.cpu() for q in feature_vectors(features[i], pts[i][known[i]][None], grid_size)]

    found_queries = map_shards(encoded_queries, range(n_images), "template ranking")
    queries = {c: [q.to(device) for q in found_queries[c]] for c in rows if found_queries[c] is not None}

    def transfer_errors(j: int) -> torch.Tensor:
        """Column ``j``: every template's mean error in image ``j``."""
        column = torch.full((n_images,), float("nan"), dtype=torch.float64)
        features_j = features.pop(j)
        # every template's landmarks found in image j in one matcher call (each query's match is its own)
        sources = [c for c in queries if c != j]
        if not sources:
            return column
        stacked = [torch.cat([queries[c][s] for c in sources], dim=1) for s in range(len(features_j))]
        found, _ = inferer.matcher(stacked, features_j, grid_size)
        for c, part in zip(sources, found[0].split([int(known[c].sum()) for c in sources])):
            distance = (apply_homogeneous(grid_to_physical[j], part) - physical[j][known[c]].to(part)).norm(dim=-1)
            if bool(torch.isfinite(distance).any()):
                column[c] = distance.nanmean().cpu()
        return column

    return torch.stack(map_shards(transfer_errors, range(n_images), "template ranking"), dim=1)


def select_template_by_landmarks(
    network,
    images: Sequence[torch.Tensor],
    points: Sequence[torch.Tensor],
    grid_to_physical: Sequence[torch.Tensor],
    inferer: OneShotInferer | None = None,
) -> tuple[int, list[float]]:
    """Among labelled images, the template whose landmarks transfer best: the lowest mean of its row of
    :func:`landmark_transfer_errors` (leave-one-out one-shot MRE over the other images).

    Returns:
        ``(index, scores)``: the chosen index and each image's mean transfer error in mm (lower is better).
    """
    errors = landmark_transfer_errors(network, images, points, grid_to_physical, inferer)
    scores = errors.nanmean(dim=1)
    if bool(torch.isnan(scores).all()):
        raise ValueError("no image shares a landmark with another: cannot rank templates by landmarks")
    index = int(torch.where(torch.isnan(scores), torch.inf, scores).argmin())
    return index, [float(v) for v in scores]
