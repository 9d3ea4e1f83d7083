"""k-shot landmark detection: the predictions of several templates combined per landmark.

One template's match can land on the wrong structure (a gross error); templates that differ in anatomy
rarely fail on the same landmark of the same image, so a robust location estimate of their K predictions
removes most gross errors. The default estimator is the geometric median (the point minimising the sum of
Euclidean distances, breakdown point 1/2), computed by Weiszfeld's iteration; ``median`` (per coordinate)
and ``mean`` are the cheaper and the non-robust alternatives. A template that lacks a landmark (NaN)
simply does not vote for it.
"""

from __future__ import annotations

from typing import Tuple

import torch
from bundle.geometry import apply_homogeneous

COMBINE_RULES = ("geometric_median", "median", "mean")


def check_combine_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`COMBINE_RULES`, else ValueError naming it."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"template combination rule (template_combine) must be one of {COMBINE_RULES}, got {rule!r}")
    return rule


def _summed_distances(filled: torch.Tensor, valid: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
    """The objective: summed distances ``(..., 1)`` from ``estimate`` (broadcast against each point) to the valid
    points."""
    distance = torch.linalg.vector_norm(filled - estimate, dim=-1, keepdim=True)
    return torch.where(valid, distance, torch.zeros_like(distance)).sum(0)


def _pull_and_ties(
    filled: torch.Tensor, valid: torch.Tensor, estimate: torch.Tensor, floor: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """At ``estimate``: the weights ``1 / distance`` of the points away from it (0 for the others), the length of the
    sum of their unit vectors (the objective's slope), the number of points at it and the differences."""
    difference = filled - estimate
    distance = torch.linalg.vector_norm(difference, dim=-1, keepdim=True)
    at_estimate = valid & (distance <= floor)
    weight = (valid & ~at_estimate).to(filled.dtype) / torch.maximum(distance, floor)
    pull = torch.linalg.vector_norm((weight * difference).sum(0), dim=-1, keepdim=True)
    return weight, pull, at_estimate.to(filled.dtype).sum(0), difference


def geometric_median(
    points: torch.Tensor, iterations: int = 100, tolerance: float = 1e-10, halvings: int = 10
) -> torch.Tensor:
    """Geometric median over the first axis: ``(K, ..., D)`` -> ``(..., D)`` (float64), NaN points ignored.

    The point minimising the summed distances. First the candidates where the minimum may sit on a kink of the
    objective are tested by its optimality condition (Vardi and Zhang, Proc. Natl. Acad. Sci. 2000: the unit
    vectors towards the other points sum to a length of at most the number of points there): the coordinate-wise
    median (the middle value of an even count is the mean of the two middle ones: for collinear points, whose
    minimum can be a whole segment, e.g. two templates, this is the segment's midpoint) and each point (ties of
    grid-quantised peaks). Elsewhere the objective is smooth and convex: Newton steps, halved up to ``halvings``
    times and kept when they lower the objective, else the Weiszfeld step with Vardi and Zhang's correction (which
    never raises it), converge in a few steps where Weiszfeld's iteration alone takes hundreds. Scale-free: "at a
    point" and the stopping step are ``tolerance`` times the points' spread around the coordinate-wise median.
    Where every point is NaN the result is NaN. TorchScript-compatible: the exported points network
    (:mod:`bundle.networks.landmark_points`) scripts this function.
    """
    p = points.to(torch.float64)
    valid = ~torch.isnan(p).any(dim=-1, keepdim=True)  # (K, ..., 1)
    filled = torch.where(valid, p, torch.zeros_like(p))
    start = torch.nanquantile(p, 0.5, dim=0)
    distance = torch.linalg.vector_norm(filled - start, dim=-1, keepdim=True)
    spread = torch.where(valid, distance, torch.zeros_like(distance)).amax(0)
    floor = torch.where(spread > 0, tolerance * spread, torch.ones_like(spread))
    slack = 1e-9 * p.shape[0]  # rounding of a sum of unit vectors

    # a minimum on a kink: the coordinate-wise median, else the first point (in order) that passes the test, all
    # points tested at once (point k against every point: the leading axis of the tests)
    _, pull, ties, _ = _pull_and_ties(filled, valid, start, floor)
    found = pull <= ties + slack
    _, pulls, ties_k, _ = _pull_and_ties(filled.unsqueeze(1), valid.unsqueeze(1), filled, floor)  # (K, ..., 1)
    optimal = valid & (pulls <= ties_k + slack)
    first = optimal.to(torch.int8).argmax(0, keepdim=True)  # (1, ..., 1)
    at_point = optimal.any(0) & ~found
    estimate = torch.where(at_point, filled.gather(0, first.expand((1,) + start.shape))[0], start)
    found = found | at_point

    # a smooth minimum: safeguarded Newton steps
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    for _iteration in range(iterations):
        weight, pull, ties, difference = _pull_and_ties(filled, valid, estimate, floor)
        gradient = (weight * difference).sum(0)  # minus the objective's gradient
        unit = difference * weight  # unit vectors towards the points away from the estimate
        hessian = (weight[..., None] * (eye - unit[..., :, None] * unit[..., None, :])).sum(0)
        direction = torch.linalg.solve_ex(hessian, gradient.unsqueeze(-1))[0].squeeze(-1)
        mean = (weight * filled).sum(0) / torch.clamp(weight.sum(0), min=1e-300)
        stay = torch.where(pull > 0, torch.clamp(ties / pull, max=1.0), torch.ones_like(pull))
        # backtracking: the Newton step, else its halvings (near a point the quadratic model holds in a small region
        # only), else the Weiszfeld step: the first that does not raise the objective (near the minimum the
        # objectives are equal within rounding and the Newton step is the accurate one)
        candidates = torch.stack(
            [estimate + direction * 0.5**h for h in range(halvings)] + [(1.0 - stay) * mean + stay * estimate]
        )
        objective = _summed_distances(filled.unsqueeze(1), valid.unsqueeze(1), candidates)
        fits = objective <= _summed_distances(filled, valid, estimate)  # NaN (a singular Hessian) never fits
        first = fits.to(torch.int8).argmax(0, keepdim=True)  # (1, ..., 1)
        chosen = candidates.gather(0, first.expand((1,) + estimate.shape))[0]
        updated = torch.where(found | ~fits.any(0), estimate, chosen)
        moved = torch.linalg.vector_norm(updated - estimate, dim=-1, keepdim=True)
        estimate = updated
        if not bool((moved > floor).any()):
            break
    return estimate


def combine_landmarks(predictions, rule: str = "geometric_median") -> torch.Tensor:
    """Combine K templates' predictions ``(K, ..., L, D)`` into ``(..., L, D)`` (float64) with ``rule``.

    ``rule``: ``"geometric_median"`` (default), ``"median"`` (per coordinate) or ``"mean"``. NaN marks a
    landmark a template does not give; a landmark that no template gives stays NaN.
    """
    check_combine_rule(rule)
    p = torch.as_tensor(predictions, dtype=torch.float64)
    if p.ndim < 3:
        raise ValueError(f"predictions must be (K, ..., L, D), got shape {tuple(p.shape)}")
    if p.shape[0] == 1:
        return p[0].clone()
    if rule == "geometric_median":
        return geometric_median(p)
    missing = torch.isnan(p).any(dim=-1, keepdim=True).expand_as(p)
    p = p.masked_fill(missing, float("nan"))
    return torch.nanmedian(p, dim=0).values if rule == "median" else torch.nanmean(p, dim=0)


def combine_templates(per_template, grid_to_physical=None, rule: str = "geometric_median") -> torch.Tensor:
    """K templates' grid predictions ``(K, ..., L, D)`` combined per landmark by ``rule``
    (:func:`combine_landmarks`): in physical mm when ``grid_to_physical`` is given (mapped first), else on the grid."""
    if grid_to_physical is not None:
        per_template = apply_homogeneous(grid_to_physical, per_template)
    return combine_landmarks(per_template, rule)
