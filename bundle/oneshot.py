"""One-shot landmark detection by multi-scale template matching (paper Sec. 3.4, CC2D inference).

A landmark is found in a new image as the position whose dense features are most similar (cosine) to
the template image's features at that landmark, combining every scale of the network (the product of
the per-scale similarity maps, as in CC2D), then refined to sub-pixel precision by evaluating the same
similarity on a fine lattice around the peak. With several templates (k-shot), each one is matched and
their predictions are combined per landmark by a robust estimator (``bundle.kshot``).

Coordinates: points are float positions on the network's input grid ("grid"), components in the order
of the tensor's spatial axes, the centre of the first pixel at 0. ``grid_to_physical`` is a homogeneous
``(D+1, D+1)`` (or batched ``(B, D+1, D+1)``) matrix from grid positions to physical millimetres.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from bundle.kshot import COMBINE_RULES, combine_landmarks
from bundle.networks.features import sample_features
from monai.data import MetaTensor
from monai.inferers import Inferer

COMBINE_MODES = ("product", "sum")


def _plain(x: Any) -> Any:
    """A MetaTensor as a plain tensor (metadata is not needed for matching); anything else unchanged."""
    return x.as_tensor() if isinstance(x, MetaTensor) else x


def apply_homogeneous(matrix, points, inverse: bool = False) -> torch.Tensor:
    """Map ``points`` ``(..., N, D)`` through a homogeneous ``matrix`` ``(..., D+1, D+1)`` (or its inverse).

    Computed in float64; NaN points stay NaN without affecting the others.
    """
    m = torch.as_tensor(_plain(matrix), dtype=torch.float64)
    p = torch.as_tensor(_plain(points), dtype=torch.float64)
    d = p.shape[-1]
    if m.shape[-2:] != (d + 1, d + 1):
        raise ValueError(f"homogeneous matrix must be (..., {d + 1}, {d + 1}) for {d}-D points, got {tuple(m.shape)}")
    m = m.to(p.device)
    if inverse:
        m = torch.linalg.inv(m)
    return p @ m[..., :d, :d].transpose(-1, -2) + m[..., None, :d, d]


def feature_vectors(
    features: Sequence[torch.Tensor], points: torch.Tensor, grid_size: Sequence[int]
) -> list[torch.Tensor]:
    """Unit feature vectors ``(B, N, C)`` at grid ``points`` ``(B, N, D)`` for each scale's map ``(B, C, *S)``."""
    return [F.normalize(sample_features(_plain(f).float(), points.float(), grid_size), dim=-1) for f in features]


def _upsampled_norm(features: torch.Tensor, grid_size: tuple[int, ...], chunk: int) -> torch.Tensor:
    """Norm ``(B, 1, *G)`` of the features linearly interpolated at every grid position, channels in chunks."""
    mode = "bilinear" if len(grid_size) == 2 else "trilinear"
    total = None
    for start in range(0, features.shape[1], chunk):
        up = F.interpolate(features[:, start : start + chunk], size=grid_size, mode=mode, align_corners=False)
        part = up.square().sum(dim=1, keepdim=True)
        total = part if total is None else total + part
    return total.sqrt().clamp_min(1e-8)


def refine_peaks(maps: torch.Tensor, step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-pixel peak positions of score maps ``(B, N, *G)`` -> positions ``(B, N, D)`` (float64),
    peak values ``(B, N)``.

    The integer argmax is refined along each axis by the vertex of the parabola through the values at
    the peak and at ``peak +/- step`` (separable quadratic fit); an axis whose neighbours fall outside
    the map or that is flat keeps the integer position. ``step=0`` returns the integer argmax.
    """
    b, n = maps.shape[:2]
    size = maps.shape[2:]
    flat = maps.reshape(b, n, -1)
    values, index = flat.max(dim=-1)
    coords = torch.stack(torch.unravel_index(index, tuple(size)), dim=-1)  # (B, N, D) long
    positions = coords.to(torch.float64)
    if step <= 0:
        return positions, values
    strides = [math.prod(size[a + 1 :]) for a in range(len(size))]
    centre = values.double()
    for axis, (extent, stride) in enumerate(zip(size, strides)):
        c = coords[..., axis]
        inside = (c - step >= 0) & (c + step <= extent - 1)
        lower = flat.gather(-1, (index - step * stride * inside).unsqueeze(-1)).squeeze(-1).double()
        upper = flat.gather(-1, (index + step * stride * inside).unsqueeze(-1)).squeeze(-1).double()
        curvature = lower - 2.0 * centre + upper
        usable = inside & (curvature < 0)
        offset = torch.where(usable, 0.5 * step * (lower - upper) / torch.where(usable, curvature, -1.0), 0.0)
        positions[..., axis] += offset.clamp(-0.5 * step, 0.5 * step)
    return positions, values


class OneShotInferer(Inferer):
    """One-shot (k-shot) inference: landmarks of annotated templates found in each input by feature matching.

    For every landmark and scale s, the similarity map is the cosine between the template feature at
    the landmark and the input's features linearly interpolated at each grid position (the
    interpolation of :func:`bundle.networks.features.sample_features`). The scales are combined as the
    product of ``((cos + 1) / 2) ** w_s`` (``combine="product"``, CC2D) or the sum of ``w_s * cos``
    (``"sum"``) and the argmax is taken on the grid. Sub-pixel refinement: the same combined similarity
    is evaluated on a lattice of step ``refine_resolution`` within ``refine_radius`` pixels of the peak
    and its maximum refined by :func:`refine_peaks`, so predictions are not tied to the grid.
    The template features are recomputed at each call with the network given, so the template follows
    training. The caller sets eval mode; no gradients are kept. With K templates (:meth:`set_templates`)
    each is matched on its own and the K predictions of a landmark are combined by ``template_combine``
    (:func:`bundle.kshot.combine_landmarks`), in physical mm when a grid-to-physical map is given; a
    template that lacks a landmark does not vote for it.

    Args:
        combine: "product" or "sum".
        scale_weights: one weight per network scale (coarse to fine); default all 1.
        refine_radius: half-width in grid pixels of the sub-pixel search; 0 disables it.
        refine_resolution: lattice step in grid pixels of the sub-pixel search.
        max_map_elements: bound on ``batch x landmarks x grid voxels`` per chunk of landmarks (memory).
        template_combine: how several templates' predictions are combined, one of ``bundle.kshot.COMBINE_RULES``.
    """

    def __init__(
        self,
        combine: str = "product",
        scale_weights: Sequence[float] | None = None,
        refine_radius: float = 1.0,
        refine_resolution: float = 0.1,
        max_map_elements: int = 2**25,
        template_combine: str = "geometric_median",
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
        if template_combine not in COMBINE_RULES:
            raise ValueError(f"template_combine must be one of {COMBINE_RULES}, got {template_combine!r}")
        self.combine = combine
        self.scale_weights = None if scale_weights is None else [float(w) for w in scale_weights]
        self.refine_radius = float(refine_radius)
        self.refine_resolution = float(refine_resolution)
        self.max_map_elements = int(max_map_elements)
        self.template_combine = template_combine
        self.templates: list[tuple[torch.Tensor, torch.Tensor]] = []

    def set_template(self, image: torch.Tensor, points) -> None:
        """Use one template: its grid image ``(1, 1, *spatial)``
        and landmarks ``(L, D)`` in grid pixels (NaN = missing)."""
        self.set_templates([image], [points])

    def set_templates(self, images: Sequence[torch.Tensor], points: Sequence) -> None:
        """Use K templates: grid images ``(1, 1, *spatial)`` of one size
        and landmarks ``(L, D)`` (same L; NaN = missing)."""
        if len(images) != len(points) or not images:
            raise ValueError(
                f"need one landmark array per template image "
                f"and at least one template, got {len(images)} and {len(points)}"
            )
        templates = []
        for k, (image, pts) in enumerate(zip(images, points)):
            image = _plain(torch.as_tensor(image))
            pts = torch.as_tensor(_plain(pts), dtype=torch.float32)
            spatial_dims = image.ndim - 2
            if image.ndim < 4 or image.shape[:2] != (1, 1):
                raise ValueError(f"template {k}: image must be (1, 1, *spatial), got {tuple(image.shape)}")
            if pts.ndim != 2 or pts.shape[1] != spatial_dims:
                raise ValueError(f"template {k}: points must be (L, {spatial_dims}), got {tuple(pts.shape)}")
            if templates and (image.shape != templates[0][0].shape or pts.shape != templates[0][1].shape):
                raise ValueError(
                    f"template {k}: image {tuple(image.shape)} and points {tuple(pts.shape)} differ from template 0's "
                    f"{tuple(templates[0][0].shape)} and {tuple(templates[0][1].shape)}"
                )
            templates.append((image.detach().float(), pts))
        self.templates = templates

    @property
    def template_image(self) -> torch.Tensor | None:
        """The first (or only) template's grid image."""
        return self.templates[0][0] if self.templates else None

    @property
    def template_points(self) -> torch.Tensor | None:
        """The first (or only) template's grid landmarks."""
        return self.templates[0][1] if self.templates else None

    def _combine(self, cosines: Sequence[torch.Tensor]) -> torch.Tensor:
        """Combine per-scale cosine maps (same shape) into one score map."""
        if self.scale_weights is not None and len(self.scale_weights) != len(cosines):
            raise ValueError(
                f"scale_weights has {len(self.scale_weights)} values but the network gives {len(cosines)} scales"
            )
        weights = self.scale_weights or [1.0] * len(cosines)
        if self.combine == "product":
            terms = [((c + 1.0) * 0.5).clamp(0.0, 1.0) for c in cosines]
            return math.prod(t if w == 1.0 else t**w for t, w in zip(terms, weights))
        return sum(c if w == 1.0 else w * c for c, w in zip(cosines, weights))

    def _lattice(self, spatial_dims: int, device: torch.device) -> torch.Tensor:
        """Offsets ``(K**D, D)`` of the sub-pixel search lattice."""
        half = int(round(self.refine_radius / self.refine_resolution))
        axis = torch.arange(-half, half + 1, device=device, dtype=torch.float32) * self.refine_resolution
        return torch.stack(torch.meshgrid(*([axis] * spatial_dims), indexing="ij"), dim=-1).reshape(-1, spatial_dims)

    def _chunk(self, batch: int, grid_size: Sequence[int]) -> int:
        return max(1, self.max_map_elements // max(1, batch * math.prod(grid_size)))

    def feature_norms(self, features: Sequence[torch.Tensor], grid_size: Sequence[int]) -> list[torch.Tensor]:
        """Per scale, the norm ``(B, 1, *G)`` of the features interpolated on the grid
        (reusable across :meth:`match` calls)."""
        grid_size = tuple(int(s) for s in grid_size)
        return [_upsampled_norm(_plain(f).float(), grid_size, self._chunk(f.shape[0], grid_size)) for f in features]

    def combined_map(
        self,
        queries: Sequence[torch.Tensor],
        maps: Sequence[torch.Tensor],
        norms: Sequence[torch.Tensor],
        grid_size: tuple[int, ...],
    ) -> torch.Tensor:
        """Combined similarity ``(B, N, *G)`` of unit queries ``(B, N, C)`` with the feature maps on the grid.

        Per scale: the dot product with the map, interpolated to the grid and divided by the
        interpolated features' norm (:meth:`feature_norms`), i.e. the cosine; then :meth:`_combine`.
        """
        mode = "bilinear" if len(grid_size) == 2 else "trilinear"
        cosines = [
            F.interpolate(torch.einsum("bnc,bc...->bn...", q, f), size=grid_size, mode=mode, align_corners=False) / norm
            for q, f, norm in zip(queries, maps, norms)
        ]
        return self._combine(cosines)

    def match(
        self,
        queries: Sequence[torch.Tensor],
        features: Sequence[torch.Tensor],
        grid_size: Sequence[int],
        norms: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Best match on the grid of each query: positions ``(B, N, D)`` (float64) and combined scores ``(B, N)``.

        ``queries``: per scale, unit vectors ``(B, N, C)``; ``features``: per scale, maps ``(B, C, *S)``;
        ``norms``: :meth:`feature_norms` of ``features`` when already computed.
        Scores: "product" in [0, 1], "sum" the weighted sum of cosines, at the (refined) peak.
        """
        if len(queries) != len(features):
            raise ValueError(f"{len(queries)} query scales for {len(features)} feature scales")
        grid_size = tuple(int(s) for s in grid_size)
        spatial_dims = len(grid_size)
        b, n = queries[0].shape[:2]
        chunk = self._chunk(b, grid_size)
        maps = [_plain(f).float() for f in features]
        norms = self.feature_norms(maps, grid_size) if norms is None else norms
        lattice = self._lattice(spatial_dims, maps[0].device) if self.refine_radius > 0 else None
        positions, scores = [], []
        for start in range(0, n, chunk):
            q_chunk = [q[:, start : start + chunk].float() for q in queries]
            pos, score = refine_peaks(self.combined_map(q_chunk, maps, norms, grid_size), step=0)
            if lattice is not None:
                pos, score = self._refine(q_chunk, maps, pos, lattice, grid_size)
            positions.append(pos)
            scores.append(score)
        return torch.cat(positions, dim=1), torch.cat(scores, dim=1)

    def _refine(
        self,
        q_chunk: list[torch.Tensor],
        maps: list[torch.Tensor],
        peaks: torch.Tensor,
        lattice: torch.Tensor,
        grid_size: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Maximise the combined similarity on the lattice around each integer peak (then a parabola fit)."""
        b, n, d = peaks.shape
        k = round(lattice.shape[0] ** (1.0 / d))
        centre = peaks.float()
        points = (centre[:, :, None, :] + lattice).reshape(b, -1, d)
        cosines = []
        for q, f in zip(q_chunk, maps):
            sampled = F.normalize(sample_features(f, points, grid_size), dim=-1).reshape(b, n, -1, f.shape[1])
            cosines.append(torch.einsum("bnmc,bnc->bnm", sampled, q))
        index, value = refine_peaks(self._combine(cosines).reshape(b, n, *([k] * d)), step=1)
        refined = peaks + (index - (k - 1) / 2) * self.refine_resolution
        upper = torch.as_tensor([s - 1 for s in grid_size], dtype=refined.dtype, device=refined.device)
        return torch.minimum(refined.clamp_min(0.0), upper), value

    @torch.no_grad()
    def predict_per_template(
        self, inputs: torch.Tensor, network, cycle: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each template's predictions ``(K, B, L, D)`` on the grid (float64, NaN where a template lacks a landmark).

        With ``cycle``, also the forward-backward cycle error ``(K, B, L)`` in grid pixels: the input's feature
        at the match is matched back into the template, and the distance to the template's landmark is taken
        (a label-free reliability of the match; NaN where the landmark is missing).
        """
        if not self.templates:
            raise RuntimeError(
                "OneShotInferer: call set_template(image, points) or set_templates(...) before inference"
            )
        inputs = _plain(inputs)
        grid_size = tuple(inputs.shape[2:])
        if tuple(self.template_image.shape[2:]) != grid_size:
            raise ValueError(
                f"template grid {tuple(self.template_image.shape[2:])} differs from the input grid {grid_size}"
            )
        b = inputs.shape[0]
        n_landmarks, spatial_dims = self.template_points.shape
        out = torch.full(
            (len(self.templates), b, n_landmarks, spatial_dims), float("nan"), dtype=torch.float64, device=inputs.device
        )
        errors = torch.full(out.shape[:-1], float("nan"), dtype=torch.float64, device=inputs.device) if cycle else None
        features = list(network(inputs))
        norms = self.feature_norms(features, grid_size)
        for k, (template_image, template_points) in enumerate(self.templates):
            valid = ~torch.isnan(template_points).any(dim=1)
            if not bool(valid.any()):
                continue
            template_features = list(network(template_image.to(device=inputs.device, dtype=inputs.dtype)))
            if len(template_features) != len(features):
                raise ValueError("the network returned a different number of scales for the template and the input")
            points = template_points[valid].to(inputs.device)[None]
            queries = [v.expand(b, -1, -1) for v in feature_vectors(template_features, points, grid_size)]
            found = self.match(queries, features, grid_size, norms)[0]
            out[k][:, valid] = found
            if cycle:
                back_queries = [
                    v.reshape(1, -1, v.shape[-1]) for v in feature_vectors(features, found.float(), grid_size)
                ]
                back = self.match(back_queries, template_features, grid_size)[0].reshape(b, -1, spatial_dims)
                errors[k][:, valid] = (back - points.double()).norm(dim=-1)
        return out, errors

    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        """Predicted landmarks ``(B, L, D)`` (float64): grid pixels, or physical mm when ``grid_to_physical`` is given.

        Several templates' predictions are combined by ``template_combine`` (in the space returned).
        """
        per_template, _ = self.predict_per_template(inputs, network)
        if grid_to_physical is not None:
            per_template = apply_homogeneous(grid_to_physical, per_template)
        return combine_landmarks(per_template, self.template_combine)
