"""The template-matching core (paper Sec. 3.4, CC2D inference), TorchScript-scriptable.

One implementation serves every path that finds landmarks by matching features: the one-shot inferer (template
images, :class:`bundle.inferers.oneshot.OneShotInferer`), the stored-template inferer
(:class:`bundle.inferers.oneshot.TemplateFeatureInferer`), the exported network
(:class:`bundle.networks.landmark_points.LandmarkPointsNet`) and the template choice.

For a query vector (a template's unit feature at a landmark) and each scale s, the similarity map is the cosine
between the query and the input's features linearly interpolated at each grid position. The scales are combined as
the product of ``((cos + 1) / 2) ** w_s`` (``combine="product"``, CC2D) or the sum of ``w_s * cos`` (``"sum"``),
and the argmax is taken on the grid (many queries: a tile of grid positions at a time, never the whole maps).
Sub-pixel refinement: the same combined similarity is evaluated on a lattice of step ``refine_resolution`` within
``refine_radius`` pixels of the peak and its maximum refined by :func:`refine_peaks`; the lattice's features are
interpolated from the few map cells it covers, so its cosines come from those cells' dot products with the query and
their Gram matrix instead of sampling every lattice point.

Coordinates: points are float positions on the network's input grid, components in the order of the tensor's
spatial axes, the centre of the first pixel at 0 (:mod:`bundle.networks.features`).
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from bundle.networks.features import sample_features

COMBINE_MODES = ("product", "sum")


def feature_vectors(features: List[torch.Tensor], points: torch.Tensor, grid_size: List[int]) -> List[torch.Tensor]:
    """Unit feature vectors ``(B, N, C)`` at grid ``points`` ``(B, N, D)`` for each scale's map ``(B, C, *S)``."""
    return [F.normalize(sample_features(f.float(), points.float(), grid_size), dim=-1) for f in features]


def _unravel(index: torch.Tensor, size: List[int]) -> torch.Tensor:
    """Grid coordinates ``(..., D)`` (long) of flat indices into a grid of ``size``."""
    coords: List[torch.Tensor] = []
    for extent in size[::-1]:
        coords.append(index % extent)
        index = torch.div(index, extent, rounding_mode="floor")
    coords.reverse()
    return torch.stack(coords, dim=-1)


def refine_peaks(maps: torch.Tensor, step: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sub-pixel peak positions of score maps ``(B, N, *G)`` -> positions ``(B, N, D)`` (float64),
    peak values ``(B, N)``.

    The integer argmax is refined along each axis by the vertex of the parabola through the values at
    the peak and at ``peak +/- step`` (separable quadratic fit); an axis whose neighbours fall outside
    the map or that is flat keeps the integer position. ``step=0`` returns the integer argmax.
    """
    b, n = maps.shape[0], maps.shape[1]
    size = [int(s) for s in maps.shape[2:]]
    flat = maps.reshape(b, n, -1)
    values, index = flat.max(dim=-1)
    coords = _unravel(index, size)  # (B, N, D) long
    positions = coords.to(torch.float64)
    if step <= 0:
        return positions, values
    centre = values.double()
    stride = 1
    for axis in range(len(size) - 1, -1, -1):
        extent = size[axis]
        c = coords[..., axis]
        inside = (c - step >= 0) & (c + step <= extent - 1)
        lower = flat.gather(-1, (index - step * stride * inside).unsqueeze(-1)).squeeze(-1).double()
        upper = flat.gather(-1, (index + step * stride * inside).unsqueeze(-1)).squeeze(-1).double()
        curvature = lower - 2.0 * centre + upper
        usable = inside & (curvature < 0)
        offset = torch.where(
            usable, 0.5 * step * (lower - upper) / torch.where(usable, curvature, -torch.ones_like(curvature)), 0.0
        )
        positions[..., axis] += offset.clamp(-0.5 * step, 0.5 * step)
        stride *= extent
    return positions, values


def _to_grid(maps: torch.Tensor, grid_size: List[int]) -> torch.Tensor:
    """Maps ``(B, N, *S)`` linearly interpolated to the grid ``(B, N, *G)`` (pixel centres aligned)."""
    mode = "bilinear" if len(grid_size) == 2 else "trilinear"
    return F.interpolate(maps, size=grid_size, mode=mode, align_corners=False)


def _norm_on_grid(squares: torch.Tensor) -> torch.Tensor:
    """The feature norm ``(B, 1, *G)`` from the channels' summed squares, floored (no division by zero)."""
    return squares.sqrt().clamp_min(1e-8)


def _upsampled_norm(features: torch.Tensor, grid_size: List[int], chunk: int) -> torch.Tensor:
    """Norm ``(B, 1, *G)`` of the features linearly interpolated at every grid position, channels in chunks."""
    total = torch.zeros(0)
    for start in range(0, features.shape[1], chunk):
        up = _to_grid(features[:, start : start + chunk], grid_size)
        part = up.square().sum(dim=1, keepdim=True)
        total = part if start == 0 else total + part
    return _norm_on_grid(total)


def _lattice_weights(
    centres: torch.Tensor, offsets: torch.Tensor, span: float, grid_size: List[int], map_size: List[int]
) -> Tuple[List[torch.Tensor], torch.Tensor, List[int]]:
    """Per-axis linear-interpolation weights of the lattice ``centres + offsets`` (each axis) in a feature map.

    ``centres`` ``(B, N, D)`` on the input grid, ``offsets`` ``(K,)`` spanning ``span`` grid pixels. Returns, per
    axis, the weights ``(B, N, K, P)`` of each lattice coordinate on the P map cells from ``starts[..., axis]``
    (``starts`` ``(B, N, D)`` long), and P per axis: the coordinates and border clamp of :func:`sample_features`.
    """
    weights: List[torch.Tensor] = []
    starts: List[torch.Tensor] = []
    patch: List[int] = []
    for axis in range(len(grid_size)):
        cells = map_size[axis]
        # a lattice spanning x map cells meets ceil(x) + 2 of them (linear interpolation reads the next cell)
        size = min(cells, math.ceil(span * cells / grid_size[axis] - 1e-9) + 2)
        g = 2.0 * (centres[..., axis, None] + offsets + 0.5) / float(grid_size[axis]) - 1.0
        u = (((g + 1.0) * cells - 1.0) / 2.0).clamp(0.0, float(cells - 1))
        lower = u.floor()
        upper_weight = u - lower
        first = lower.long()
        start = first[..., :1].clamp(max=cells - size)
        cols = torch.arange(size, device=centres.device)
        low = (first - start).clamp(max=size - 1).unsqueeze(-1) == cols
        high = (first + 1 - start).clamp(max=size - 1).unsqueeze(-1) == cols
        axis_weights = (1.0 - upper_weight).unsqueeze(-1) * low + upper_weight.unsqueeze(-1) * high
        weights.append(axis_weights)
        starts.append(start.squeeze(-1))
        patch.append(size)
    return weights, torch.stack(starts, dim=-1), patch


def _gather_patches(features: torch.Tensor, starts: torch.Tensor, patch: List[int]) -> torch.Tensor:
    """The feature vectors ``(B, N, prod(patch), C)`` of the map cells ``starts + [0, patch)`` (row-major)."""
    b, c = features.shape[0], features.shape[1]
    size = [int(v) for v in features.shape[2:]]
    n = starts.shape[1]
    index = torch.zeros([b, n, 1], dtype=torch.long, device=features.device)
    for axis in range(len(size)):
        cells = starts[..., axis, None] + torch.arange(patch[axis], device=features.device)
        index = (index * size[axis]).unsqueeze(-1) + cells.unsqueeze(-2)
        index = index.reshape(b, n, -1)
    vectors = features.reshape(b, c, -1).transpose(1, 2)
    flat = index.reshape(b, -1, 1).expand(-1, -1, c)
    return vectors.gather(1, flat).reshape(b, n, -1, c)


def _contract_axes(values: torch.Tensor, weights: List[torch.Tensor]) -> torch.Tensor:
    """``(B, N, P_1, .., P_D)`` contracted along each axis with ``weights[a]`` ``(B, N, K_a, P_a)`` -> ``(B, N, K_1, ..,
    K_D)``."""
    b, n = values.shape[0], values.shape[1]
    shape = [int(v) for v in values.shape[2:]]
    for w in weights:
        rest = shape[1:]
        values = torch.matmul(w, values.reshape(b, n, shape[0], -1)).reshape([b, n, w.shape[2]] + rest)
        values = values.movedim(2, -1)
        shape = rest + [int(w.shape[2])]
    return values


class TemplateMatcher(torch.nn.Module):
    """Best match on the input grid of unit query vectors, per scale, in multi-scale feature maps (module doc).

    Args:
        combine: "product" or "sum".
        scale_weights: one weight per network scale (coarse to fine); default all 1.
        refine_radius: half-width in grid pixels of the sub-pixel search; 0 disables it.
        refine_resolution: lattice step in grid pixels of the sub-pixel search.
        max_map_elements: bound on ``batch x queries x grid voxels`` per chunk of queries (memory).
    """

    scale_weights: List[float]

    def __init__(
        self,
        combine: str = "product",
        scale_weights: Optional[Sequence[float]] = None,
        refine_radius: float = 1.0,
        refine_resolution: float = 0.1,
        max_map_elements: int = 2**25,
    ) -> None:
        super().__init__()
        if combine not in COMBINE_MODES:
            raise ValueError(f"combine must be one of {COMBINE_MODES}, got {combine!r}")
        if refine_radius < 0 or refine_resolution <= 0:
            raise ValueError(
                f"refine_radius must be >= 0 and refine_resolution > 0, got {refine_radius}, {refine_resolution}"
            )
        if max_map_elements < 1:
            raise ValueError(f"max_map_elements must be positive, got {max_map_elements}")
        self.combine = combine
        self.has_weights = scale_weights is not None
        self.scale_weights: List[float] = [] if scale_weights is None else [float(w) for w in scale_weights]
        self.refine_radius = float(refine_radius)
        self.refine_resolution = float(refine_resolution)
        self.max_map_elements = int(max_map_elements)
        # the dense search of many queries (_unit_map_peaks): queries per chunk and scores per tile of grid positions
        # (1 MB of float32: a tile stays in the processor's cache between the scales' terms)
        self.tile_queries = 256
        self.tile_scores = 1 << 18

    def _weights(self, n_scales: int) -> List[float]:
        if self.has_weights and len(self.scale_weights) != n_scales:
            raise ValueError(
                f"scale_weights has {len(self.scale_weights)} values but the network gives {n_scales} scales"
            )
        return self.scale_weights if self.has_weights else [1.0] * n_scales

    def _affine(self, w: float) -> Tuple[float, float]:
        """``(a, b)`` of a scale term's affine part ``a * cos + b``: "product" ``(cos + 1) / 2`` (then clamped to
        [0, 1] and raised to the power w by :meth:`_finish`), "sum" ``w * cos``."""
        return (0.5, 0.5) if self.combine == "product" else (w, 0.0)

    def _finish(self, term: torch.Tensor, w: float) -> torch.Tensor:
        if self.combine == "product":
            term = term.clamp_(0.0, 1.0)
            if w != 1.0:
                term = term.pow_(w)
        return term

    def _accumulate(self, score: Optional[torch.Tensor], term: torch.Tensor) -> torch.Tensor:
        if score is None:
            return term
        return score.mul_(term) if self.combine == "product" else score.add_(term)

    def combine_scales(
        self, values: List[torch.Tensor], inverse_norms: Optional[List[torch.Tensor]] = None
    ) -> torch.Tensor:
        """Combine per-scale cosine maps (same shape) into one score map: the cosines ``values``, or dot products
        ``values`` times ``inverse_norms`` (per scale, broadcast). Each scale's term is computed in place on one new
        tensor."""
        weights = self._weights(len(values))
        score: Optional[torch.Tensor] = None
        for s in range(len(values)):
            a, b = self._affine(weights[s])
            if inverse_norms is None:
                term = values[s].mul(a)
            else:
                term = values[s].mul(inverse_norms[s] * a)
            score = self._accumulate(score, self._finish(term.add_(b), weights[s]))
        assert score is not None
        return score

    def _combined_unit_map(self, queries: List[torch.Tensor], unit_maps: List[torch.Tensor]) -> torch.Tensor:
        """The combined score ``(B, N, V)`` from feature maps interpolated to (V positions of) the grid and scaled to
        unit length at each position (``(B, C, V)`` per scale): each scale's affine term one batched matrix
        product."""
        weights = self._weights(len(queries))
        score: Optional[torch.Tensor] = None
        for s in range(len(queries)):
            a, bias = self._affine(weights[s])
            term = torch.bmm(queries[s] * a, unit_maps[s]).add_(bias)
            score = self._accumulate(score, self._finish(term, weights[s]))
        assert score is not None
        return score

    @staticmethod
    def _voxels(grid_size: List[int]) -> int:
        voxels = 1
        for s in grid_size:
            voxels *= s
        return voxels

    def _chunk(self, batch: int, grid_size: List[int]) -> int:
        return max(1, self.max_map_elements // max(1, batch * self._voxels(grid_size)))

    def feature_norms(self, features: List[torch.Tensor], grid_size: List[int]) -> List[torch.Tensor]:
        """Per scale, the norm ``(B, 1, *G)`` of the features interpolated on the grid (reusable across
        :meth:`forward` calls on the same features)."""
        return [_upsampled_norm(f.float(), grid_size, self._chunk(f.shape[0], grid_size)) for f in features]

    def combined_map(
        self, queries: List[torch.Tensor], maps: List[torch.Tensor], norms: List[torch.Tensor], grid_size: List[int]
    ) -> torch.Tensor:
        """Combined similarity ``(B, N, *G)`` of unit queries ``(B, N, C)`` with the feature maps on the grid.

        Per scale: the dot product with the map, interpolated to the grid and divided by the interpolated
        features' norm (:meth:`feature_norms`), i.e. the cosine; then :meth:`combine_scales`.
        """
        dots: List[torch.Tensor] = []
        for s in range(len(queries)):
            dot = torch.einsum("bnc,bc...->bn...", queries[s], maps[s])
            dots.append(_to_grid(dot, grid_size))
        return self.combine_scales(dots, [1.0 / n for n in norms])

    def _lattice_axis(self, device: torch.device) -> Tuple[torch.Tensor, float]:
        """Offsets ``(K,)`` of the sub-pixel search lattice along one axis (the lattice is their product) and the
        distance from the first to the last."""
        half = int(round(self.refine_radius / self.refine_resolution))
        offsets = torch.arange(-half, half + 1, device=device, dtype=torch.float32) * self.refine_resolution
        return offsets, 2 * half * self.refine_resolution

    def _refine(
        self, queries: List[torch.Tensor], maps: List[torch.Tensor], peaks: torch.Tensor, grid_size: List[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Maximise the combined similarity on the lattice around each integer peak (then a parabola fit).

        The features at the lattice points are linear in the few feature-map cells the lattice covers (a patch of
        P cells per axis), so each point's dot product with the query and squared norm follow from the patch's
        dot products and Gram matrix and the per-axis interpolation weights (:func:`_lattice_weights`): the cosines
        of sampling every point's features (:func:`sample_features`) without sampling them.
        """
        b, n, d = peaks.shape[0], peaks.shape[1], peaks.shape[2]
        offsets, span = self._lattice_axis(peaks.device)
        k = offsets.shape[0]
        centres = peaks.float()
        pairs: List[int] = []  # the Gram matrix's axes (p_1 .. p_D, p'_1 .. p'_D) reordered as (p_1, p'_1, ..)
        for a in range(d):
            pairs += [2 + a, 2 + d + a]
        dots: List[torch.Tensor] = []
        inverse_norms: List[torch.Tensor] = []
        for q, f in zip(queries, maps):
            weights, starts, patch = _lattice_weights(centres, offsets, span, grid_size, [int(v) for v in f.shape[2:]])
            cells = _gather_patches(f, starts, patch)  # (B, N, P**D, C)
            dot = torch.einsum("bnpc,bnc->bnp", cells, q).reshape([b, n] + patch)
            gram = torch.matmul(cells, cells.transpose(-1, -2)).reshape([b, n] + patch + patch)
            squares = [p * p for p in patch]
            gram = gram.permute([0, 1] + pairs).reshape([b, n] + squares)
            outer = [(w[..., :, None] * w[..., None, :]).reshape(b, n, k, -1) for w in weights]
            dots.append(_contract_axes(dot, weights).reshape(b, n, -1))
            squared = _contract_axes(gram, outer).reshape(b, n, -1)
            inverse_norms.append(1.0 / squared.clamp_min(0.0).sqrt().clamp_min(1e-12))
        index, value = refine_peaks(self.combine_scales(dots, inverse_norms).reshape([b, n] + [k] * d), step=1)
        refined = peaks + (index - (k - 1) / 2) * self.refine_resolution
        upper = torch.tensor([s - 1 for s in grid_size], dtype=refined.dtype, device=refined.device)
        return torch.minimum(refined.clamp_min(0.0), upper), value

    def _unit_map_peaks(
        self, queries: List[torch.Tensor], unit_maps: List[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Integer argmax (positions ``(B, N, D)`` float64, values) of :meth:`_combined_unit_map`, computed a tile of
        grid positions at a time (a tile of scores stays in the processor's cache) and never held whole."""
        b, n = queries[0].shape[0], queries[0].shape[1]
        grid = [int(v) for v in unit_maps[0].shape[2:]]
        voxels = self._voxels(grid)
        flats = [m.reshape(b, m.shape[1], voxels) for m in unit_maps]
        tile = max(1, self.tile_scores // max(1, b * n))
        best = torch.zeros(0)
        where = torch.zeros(0, dtype=torch.long)
        for start in range(0, voxels, tile):
            part = [f[:, :, start : start + tile] for f in flats]
            values, index = self._combined_unit_map(queries, part).max(dim=-1)
            if start == 0:
                best, where = values, index
            else:
                better = values > best
                best = torch.where(better, values, best)
                where = torch.where(better, index + start, where)
        return _unravel(where, grid).to(torch.float64), best

    def forward(
        self,
        queries: List[torch.Tensor],
        features: List[torch.Tensor],
        grid_size: List[int],
        norms: Optional[List[torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Best match on the grid of each query: positions ``(B, N, D)`` (float64) and combined scores ``(B, N)``.

        ``queries``: per scale, unit vectors ``(B, N, C)``; ``features``: per scale, maps ``(B, C, *S)``;
        ``norms``: :meth:`feature_norms` of ``features`` when already computed.
        Scores: "product" in [0, 1], "sum" the weighted sum of cosines, at the (refined) peak.
        """
        if len(queries) != len(features):
            raise ValueError(f"{len(queries)} query scales for {len(features)} feature scales")
        b, n = queries[0].shape[0], queries[0].shape[1]
        chunk = self._chunk(b, grid_size)
        maps = [f.float() for f in features]
        refine = self.refine_radius > 0
        # more queries than channels: the features are interpolated to the grid and scaled to unit length once, and
        # each query's map is one matrix product with them (interpolation is linear: the same cosines), within the
        # memory bound of max_map_elements
        unit_maps: Optional[List[torch.Tensor]] = None
        channels = 0
        for m in maps:
            channels += m.shape[1]
        if n * len(maps) > channels and b * channels * self._voxels(grid_size) <= self.max_map_elements:
            unit_maps = []
            for m in maps:
                up = _to_grid(m, grid_size)
                unit_maps.append(up / _norm_on_grid(up.square().sum(dim=1, keepdim=True)))
            chunk = min(chunk, self.tile_queries)
        elif norms is None:
            norms = self.feature_norms(maps, grid_size)
        positions: List[torch.Tensor] = []
        scores: List[torch.Tensor] = []
        for start in range(0, n, chunk):
            q_chunk = [q[:, start : start + chunk].float() for q in queries]
            if unit_maps is not None:
                pos, score = self._unit_map_peaks(q_chunk, unit_maps)
            else:
                assert norms is not None
                pos, score = refine_peaks(self.combined_map(q_chunk, maps, norms, grid_size), step=0)
            if refine:
                pos, score = self._refine(q_chunk, maps, pos, grid_size)
            positions.append(pos)
            scores.append(score)
        return torch.cat(positions, dim=1), torch.cat(scores, dim=1)


def disc_lattice(radius: float, step: float, spatial_dims: int = 2) -> torch.Tensor:
    """Offsets ``(P, D)`` (float64) of a lattice of ``step`` within ``radius`` of the origin (the origin included)."""
    if not radius >= 0 or not step > 0:
        raise ValueError(f"the lattice needs radius >= 0 and step > 0, got radius {radius} and step {step}")
    half = int(math.floor(radius / step + 1e-9))
    axis = torch.arange(-half, half + 1, dtype=torch.float64) * step
    grids = torch.meshgrid([axis] * spatial_dims, indexing="ij")
    offsets = torch.stack([g.reshape(-1) for g in grids], dim=-1)
    return offsets[torch.linalg.vector_norm(offsets, dim=-1) <= radius + 1e-9]


def local_votes(
    queries: torch.Tensor, descriptors: torch.Tensor, candidates: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each template's best candidate for each landmark (the fine step of
    :class:`bundle.inferers.refinement.DescriptorRefinement`; not in the paper).

    ``queries`` ``(K, L, C)``: each template's unit descriptor of each landmark (NaN where it lacks the landmark);
    ``descriptors`` ``(L, P, C)``: the image's unit descriptors at ``candidates`` ``(L, P, D)``, the positions searched
    for each landmark. Returns the votes ``(K, L, D)`` (the candidate of highest cosine; NaN for a missing query) and
    their cosines ``(K, L)``."""
    cosines = torch.einsum("klc,lpc->klp", queries.to(descriptors.dtype), descriptors)
    best, index = cosines.nan_to_num(-2.0).max(dim=-1)
    votes = candidates[torch.arange(candidates.shape[0])[None], index].to(torch.float64)
    missing = torch.isnan(queries).any(dim=-1)
    votes = votes.masked_fill(missing[..., None], float("nan"))
    return votes, best.masked_fill(missing, float("nan")).to(torch.float64)
