"""One-shot (k-shot) landmark detection from template images (paper Sec. 3.4, CC2D inference).

Each template's landmarks are found in a new image by :class:`bundle.networks.matching.TemplateMatcher` (the one
matching core, shared with the stored-template inferer and the exported network); with several templates their
predictions are combined per landmark by a robust estimator (``bundle.kshot``). Coordinates as in
:mod:`bundle.geometry`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from bundle.geometry import plain_tensor
from bundle.inferers.contrast import carried_points, register_templates, template_contrast
from bundle.kshot import check_combine_rule, combine_templates
from bundle.networks.matching import TemplateMatcher, feature_vectors
from bundle.template_file import check_template
from monai.inferers import Inferer

logger = logging.getLogger(__name__)


class TemplateMatches(NamedTuple):
    """Each template's matches in a batch: grid ``positions`` ``(K, B, L, D)`` (float64), the matcher's ``scores``
    ``(K, B, L)`` and, when asked for, the forward-backward ``cycle_errors`` ``(K, B, L)`` in grid pixels (NaN where a
    template lacks the landmark)."""

    positions: torch.Tensor
    scores: torch.Tensor
    cycle_errors: torch.Tensor | None = None


def match_queries(
    matcher: TemplateMatcher, queries: list[torch.Tensor], features: list[torch.Tensor], grid_size: list[int]
) -> TemplateMatches:
    """Every template's landmarks found in one call of ``matcher`` (each query's match is its own).

    ``queries``: per scale, unit vectors ``(K, L, C)`` per template and landmark (NaN where a template lacks the
    landmark); ``features``: the input's maps per scale ``(B, C, *spatial)``."""
    k, n_landmarks = queries[0].shape[0], queries[0].shape[1]
    b = features[0].shape[0]
    flat = [q.reshape(k * n_landmarks, -1) for q in queries]
    valid = ~torch.stack([torch.isnan(q).any(dim=-1) for q in flat]).any(dim=0)
    out = torch.full((b, k * n_landmarks, len(grid_size)), float("nan"), dtype=torch.float64, device=flat[0].device)
    scores = torch.full(out.shape[:-1], float("nan"), dtype=torch.float64, device=flat[0].device)
    if bool(valid.any()):
        found, score = matcher([q[valid][None].expand(b, -1, -1) for q in flat], features, grid_size)
        out[:, valid], scores[:, valid] = found, score.double()
    return TemplateMatches(
        out.reshape(b, k, n_landmarks, -1).transpose(0, 1), scores.reshape(b, k, n_landmarks).transpose(0, 1)
    )


def template_agreement(matcher: TemplateMatcher, queries: Sequence[torch.Tensor]) -> float | None:
    """How well the templates match each other: the matcher's combined score of each template's landmark feature
    against every other template's feature of the same landmark, averaged over template pairs and landmarks (not in
    the paper). It is the score a match exactly at the landmark gets between two templates, so matches in an image
    the network recognises score higher, and matches in an image it does not (inverted, mirrored, another anatomy or
    contrast) lower (:class:`bundle.handlers.confidence.ConfidenceHandler`). ``queries``: per scale, unit vectors
    ``(K, L, C)`` (NaN where a template lacks the landmark). None with fewer than two templates."""
    k = queries[0].shape[0]
    if k < 2:
        return None
    scores = matcher.combine_scales([torch.einsum("ilc,jlc->ijl", q, q) for q in queries])  # (K, K, L)
    others = ~torch.eye(k, dtype=torch.bool, device=scores.device)
    value = scores[others].nanmean()
    return None if bool(torch.isnan(value)) else float(value)


def check_registration_tolerance(registration_tolerance: float | None) -> float | None:
    """``registration_tolerance`` when it is None or a number >= 0 (grid pixels), else ValueError naming it."""
    if registration_tolerance is not None and not registration_tolerance >= 0:
        raise ValueError(f"registration_tolerance must be >= 0 grid pixels or None, got {registration_tolerance!r}")
    return registration_tolerance


def guard_on(contrast_adaptation: bool, registration_tolerance: float | None) -> bool:
    """Whether matching is guarded (:func:`guarded_matches`): the contrast adaptation or a registration tolerance."""
    return bool(contrast_adaptation) or registration_tolerance is not None


def guarded_matches(
    inputs: torch.Tensor,
    match: Callable[[torch.Tensor], TemplateMatches],
    template: tuple[torch.Tensor, torch.Tensor],
    contrast_adaptation: bool,
    registration_tolerance: float | None,
) -> TemplateMatches:
    """The matches ``match`` finds in ``inputs`` ``(B, 1, *S)``, guarded by the first template registered to each
    input (not in the paper; both inferers' guard): with ``contrast_adaptation`` each input is also matched mapped to
    the template's contrast (:func:`bundle.inferers.contrast.template_contrast`) and the matches with the higher mean
    score are kept; with ``registration_tolerance`` a match further than that (grid pixels) from the template's
    landmark carried by the registration is replaced by the carried landmark (it keeps its score and cycle error).

    Args:
        inputs: the checked input batch on the template's grid.
        match: finds every template's matches in a batch (:class:`TemplateMatches`).
        template: the first template's grid image ``(1, 1, *S)`` and landmarks ``(L, D)`` (NaN: missing).
        contrast_adaptation: match the inputs mapped to the template's contrast too.
        registration_tolerance: grid pixels; None: no registration (0: the registration's landmarks alone).
    """
    matches = match(inputs)
    if not guard_on(contrast_adaptation, registration_tolerance):
        return matches
    image, points = template
    registrations = register_templates(inputs, image.to(inputs.device))
    if contrast_adaptation:
        mapped = match(template_contrast(inputs, registrations))
        better = mapped.scores.nanmean(dim=(0, 2)) > matches.scores.nanmean(dim=(0, 2))  # (B,)
        logger.info("contrast adaptation: %s", ["mapped" if m else "kept" for m in better.tolist()])
        matches = TemplateMatches(
            *[
                None if a is None else torch.where(better.view(1, -1, *[1] * (a.ndim - 2)), m, a)
                for a, m in zip(matches, mapped)
            ]
        )
    if registration_tolerance is None:
        return matches
    carried = carried_points(registrations, points.to(inputs.device)).to(matches.positions)
    far = (matches.positions - carried).norm(dim=-1) > registration_tolerance  # NaN compares False
    logger.info("registration tolerance: %d of %d matches replaced", int(far.sum()), far.numel())
    return matches._replace(
        positions=torch.where(far[..., None], carried.expand_as(matches.positions), matches.positions)
    )


class OneShotInferer(Inferer):
    """One-shot (k-shot) inference: landmarks of annotated templates found in each input by feature matching.

    The template image's features at its landmarks are the queries of :class:`TemplateMatcher` (multi-scale
    cosine similarity, sub-pixel refinement). The template features follow the network given: they are computed
    again when it or its weights change (training), else kept between calls. The caller sets eval mode; no
    gradients are kept. With K templates (:meth:`set_templates`) each is matched on its own and the K predictions
    of a landmark are combined by ``template_combine`` (:func:`bundle.kshot.combine_landmarks`), in physical mm
    when a grid-to-physical map is given; a template that lacks a landmark does not vote for it.

    Args:
        combine, scale_weights, refine_radius, refine_resolution, max_map_elements: the matcher's
            (:class:`TemplateMatcher`).
        template_combine: how several templates' predictions are combined, one of ``bundle.kshot.COMBINE_RULES``.
        contrast_adaptation: also match each input mapped to the first template's contrast
            (:func:`bundle.inferers.contrast.template_contrast`) and keep the matches that score higher (not in the
            paper).
        registration_tolerance: grid pixels; when given, the first template is registered to each input
            (:func:`bundle.inferers.contrast.register_template`, once for both options) and a match further than this
            from the first template's landmark carried by that registration is replaced by the carried landmark (not
            in the paper): a match on another structure falls back to where the registration puts it; 0 keeps the
            registration's landmarks alone. A replaced match keeps its score (its vote's weight) and cycle error.
    """

    def __init__(
        self,
        combine: str = "product",
        scale_weights: Sequence[float] | None = None,
        refine_radius: float = 1.0,
        refine_resolution: float = 0.1,
        max_map_elements: int = 2**25,
        template_combine: str = "weighted_geometric_median",
        contrast_adaptation: bool = False,
        registration_tolerance: float | None = None,
    ) -> None:
        super().__init__()
        check_combine_rule(template_combine)
        self.registration_tolerance = check_registration_tolerance(registration_tolerance)
        self.matcher = TemplateMatcher(combine, scale_weights, refine_radius, refine_resolution, max_map_elements)
        self.template_combine = template_combine
        self.contrast_adaptation = contrast_adaptation
        self.templates: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cache: list[list[torch.Tensor]] = []  # the templates' feature maps (_template_features)
        self._cache_network = None  # the network that computed them (held: its id cannot be reused meanwhile)
        self._cache_key: tuple | None = None
        self.match_scores: torch.Tensor | None = None
        self.reference_score: float | None = None

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
            image = plain_tensor(torch.as_tensor(image))
            pts = torch.as_tensor(plain_tensor(pts), dtype=torch.float32)
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
        self._cache, self._cache_network, self._cache_key = [], None, None

    def feature_inferer(self, template: Mapping[str, Any]) -> "TemplateFeatureInferer":
        """A :class:`TemplateFeatureInferer` of stored ``template`` features with this inferer's matcher, combine
        rule and guard: this inferer's predictions with those templates' images, their features computed once."""
        inferer = TemplateFeatureInferer(
            template,
            self.template_combine,
            contrast_adaptation=self.contrast_adaptation,
            registration_tolerance=self.registration_tolerance,
        )
        inferer.matcher = self.matcher
        return inferer

    def _template_features(self, network, device: torch.device, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """Each template's feature maps from ``network``, computed again only when the network or its weights
        changed (a training step, a batch-norm update or a loaded checkpoint bumps the tensors' in-place version
        counters)."""
        versions = tuple(t._version for t in [*network.parameters(), *network.buffers()])
        key = (versions, bool(network.training), device, dtype)
        if self._cache_network is not network or self._cache_key != key:
            self._cache = [
                [plain_tensor(f) for f in network(image.to(device=device, dtype=dtype))] for image, _ in self.templates
            ]
            self._cache_network, self._cache_key = network, key
        return self._cache

    @property
    def template_image(self) -> torch.Tensor | None:
        """The first (or only) template's grid image."""
        return self.templates[0][0] if self.templates else None

    @property
    def template_points(self) -> torch.Tensor | None:
        """The first (or only) template's grid landmarks."""
        return self.templates[0][1] if self.templates else None

    def predict_per_template(
        self, inputs: torch.Tensor, network, cycle: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each template's predictions ``(K, B, L, D)`` on the grid and, with ``cycle``, their cycle errors
        (:meth:`match_templates`)."""
        matches = self.match_templates(inputs, network, cycle)
        return matches.positions, matches.cycle_errors

    @torch.no_grad()
    def match_templates(self, inputs: torch.Tensor, network, cycle: bool = False) -> TemplateMatches:
        """Each template's matches in ``inputs`` (grid positions, NaN where a template lacks a landmark, and scores).

        With ``cycle``, also the forward-backward cycle error in grid pixels: the input's feature at the match is
        matched back into the template, and the distance to the template's landmark is taken (a label-free
        reliability of the match; NaN where the landmark is missing). With ``contrast_adaptation``, each input is
        also matched after :func:`bundle.inferers.contrast.template_contrast`, and the matches with the higher mean
        score are kept; with ``registration_tolerance``, matches far from the registration's landmarks are replaced
        by them.
        """
        if not self.templates:
            raise RuntimeError(
                "OneShotInferer: call set_template(image, points) or set_templates(...) before inference"
            )
        inputs = plain_tensor(inputs)
        grid_size = tuple(inputs.shape[2:])
        if tuple(self.template_image.shape[2:]) != grid_size:
            raise ValueError(
                f"template grid {tuple(self.template_image.shape[2:])} differs from the input grid {grid_size}"
            )
        return guarded_matches(
            inputs,
            lambda x: self._match(x, network, cycle),
            (self.template_image, self.template_points),
            self.contrast_adaptation,
            self.registration_tolerance,
        )

    def _match(self, inputs: torch.Tensor, network, cycle: bool) -> TemplateMatches:
        """:meth:`match_templates` on checked ``inputs``, as they are."""
        grid_size = tuple(inputs.shape[2:])
        b = inputs.shape[0]
        n_landmarks, spatial_dims = self.template_points.shape
        features = [plain_tensor(f) for f in network(inputs)]
        all_template_features = self._template_features(network, inputs.device, inputs.dtype)
        queries = [
            torch.full((len(self.templates), n_landmarks, f.shape[1]), float("nan"), device=inputs.device)
            for f in features
        ]
        given = []  # (template, its landmarks' mask, those landmarks) of the templates that give any
        for k, (_, template_points) in enumerate(self.templates):
            if len(all_template_features[k]) != len(features):
                raise ValueError("the network returned a different number of scales for the template and the input")
            points = template_points.to(inputs.device)
            valid = ~torch.isnan(points).any(dim=1)
            if bool(valid.any()):
                given.append((k, valid, points[valid]))
                vectors = feature_vectors(all_template_features[k], points[valid][None], list(grid_size))
                for q, v in zip(queries, vectors):
                    q[k, valid] = v[0]
        matches = match_queries(self.matcher, queries, features, list(grid_size))
        self.reference_score = template_agreement(self.matcher, queries)
        if cycle:
            errors = torch.full(matches.scores.shape, float("nan"), dtype=torch.float64, device=inputs.device)
            for k, valid, points in given:
                found = matches.positions[k][:, valid]
                back_queries = [
                    v.reshape(1, -1, v.shape[-1]) for v in feature_vectors(features, found.float(), list(grid_size))
                ]
                back = self.matcher(back_queries, all_template_features[k], list(grid_size))[0]
                errors[k][:, valid] = (back.reshape(b, -1, spatial_dims) - points.double()).norm(dim=-1)
            matches = matches._replace(cycle_errors=errors)
        return matches

    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        """Predicted landmarks ``(B, L, D)`` (float64): grid pixels, or physical mm when ``grid_to_physical`` is given.

        Several templates' predictions are combined by ``template_combine`` (in the space returned).
        """
        matches = self.match_templates(inputs, network)
        self.match_scores = matches.scores.nanmean(dim=0)
        return combine_templates(matches.positions, grid_to_physical, self.template_combine, matches.scores)


class TemplateFeatureInferer(Inferer):
    """One-shot (k-shot) inference from stored template features (a template feature file, :mod:`bundle.template_file`).

    For each template, each landmark it carries is found by :class:`TemplateMatcher`
    (multi-scale cosine similarity, sub-pixel refinement within ``refine_radius`` grid pixels); the K
    templates' predictions are combined per landmark by ``template_combine``
    (:func:`bundle.kshot.combine_landmarks`), in physical mm when ``grid_to_physical`` is given. With the
    features of a template image this gives what ``OneShotInferer`` gives with that image, ``match_scores`` and
    ``reference_score`` included, and its guard (:func:`guarded_matches`) from the first template's grid image that
    features computed from a datalist carry (``registration_image``, :mod:`bundle.template_file`).

    Args:
        template: a template feature dict (:func:`bundle.template_file.load_template`).
        template_combine: one of ``bundle.kshot.COMBINE_RULES``.
        refine_radius, refine_resolution, combine, scale_weights: the matcher's (:class:`TemplateMatcher`).
        contrast_adaptation, registration_tolerance: the guard, as :class:`OneShotInferer`'s.
    """

    def __init__(
        self,
        template: Mapping[str, Any],
        template_combine: str = "weighted_geometric_median",
        refine_radius: float = 1.0,
        refine_resolution: float = 0.1,
        combine: str = "product",
        scale_weights: Sequence[float] | None = None,
        contrast_adaptation: bool = False,
        registration_tolerance: float | None = None,
    ) -> None:
        super().__init__()
        check_combine_rule(template_combine)
        self.template = check_template(template)
        self.landmark_names = self.template["landmark_names"]
        self.template_combine = template_combine
        self.matcher = TemplateMatcher(combine, scale_weights, refine_radius, refine_resolution)
        self.contrast_adaptation = contrast_adaptation
        self.registration_tolerance = check_registration_tolerance(registration_tolerance)
        self.match_scores: torch.Tensor | None = None
        self._check_guard()

    def _check_guard(self) -> None:
        """ValueError when the guard is on and the template features carry no template image to register."""
        if (
            guard_on(self.contrast_adaptation, self.registration_tolerance)
            and "registration_image" not in self.template
        ):
            raise ValueError(
                f"the template features of {self.template['sources'][:3]} carry no template image, which "
                "contrast_adaptation and registration_tolerance register: compute them from the templates' datalist "
                "(--datalist), or set both off"
            )

    @property
    def reference_score(self) -> float | None:
        """The stored templates' :func:`template_agreement` (with this inferer's matcher)."""
        return template_agreement(self.matcher, list(self.template["queries"].unbind(2)))

    def predict_per_template(self, inputs: torch.Tensor, network) -> torch.Tensor:
        """Each template's predictions ``(K, B, L, D)`` on the grid (float64, NaN where a template lacks a landmark)."""
        return self.match_templates(inputs, network).positions

    @torch.no_grad()
    def match_templates(self, inputs: torch.Tensor, network) -> TemplateMatches:
        """Each template's matches in ``inputs`` (grid positions, NaN where a template lacks a landmark, and scores)."""
        inputs = plain_tensor(inputs)
        grid_size = [int(s) for s in inputs.shape[2:]]
        queries = self.template["queries"].to(inputs.device)
        n_scales = queries.shape[2]
        if len(grid_size) != int(self.template["spatial_dims"]):
            raise ValueError(f"the template is {self.template['spatial_dims']}D, the input grid {grid_size}")
        template_grid = [int(s) for s in self.template.get("grid_size") or grid_size]
        if template_grid != grid_size:
            raise ValueError(
                f"the template features were computed on the grid {template_grid}, the input is on {grid_size}: "
                f"give image_size {template_grid}, or compute the features on this grid"
            )

        def match(batch: torch.Tensor) -> TemplateMatches:
            features = [plain_tensor(f) for f in network(batch)]
            if len(features) != n_scales:
                raise ValueError(f"the template has features of {n_scales} scales, the network gives {len(features)}")
            return match_queries(self.matcher, list(queries.unbind(2)), features, grid_size)

        self._check_guard()
        return guarded_matches(
            inputs,
            match,
            (self.template.get("registration_image"), self.template.get("registration_points")),
            self.contrast_adaptation,
            self.registration_tolerance,
        )

    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        """Predicted landmarks ``(B, L, D)`` (float64): grid pixels, or physical mm with ``grid_to_physical``."""
        matches = self.match_templates(inputs, network)
        self.match_scores = matches.scores.nanmean(dim=0)
        return combine_templates(matches.positions, grid_to_physical, self.template_combine, matches.scores)
