"""k-shot landmark detection: the predictions of several templates combined per landmark.

One template's match can land on the wrong structure (a gross error); templates that differ in anatomy
rarely fail on the same landmark of the same image, so a robust location estimate of their K predictions
removes most gross errors. The default estimator is the geometric median (the point minimising the sum of
Euclidean distances, breakdown point 1/2) with each template's vote weighted by its match score (:func:`vote_weights`,
``weighted_geometric_median``: a template whose features match well counts more, the more so the more templates
vote; chosen on validation images, docs/results.md "Votes weighted by the match score"); ``geometric_median``
counts every vote the same, ``median`` (per coordinate) and ``mean`` are the cheaper and the non-robust
alternatives. A template that lacks a landmark (NaN) simply does not vote for it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from bundle.geometry import apply_homogeneous

COMBINE_RULES = ("weighted_geometric_median", "geometric_median", "median", "mean")


def check_combine_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`COMBINE_RULES`, else ValueError naming it."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"template combination rule (template_combine) must be one of {COMBINE_RULES}, got {rule!r}")
    return rule


def vote_weights(scores: torch.Tensor, points: torch.Tensor, power_per_vote: float = 0.25) -> torch.Tensor:
    """The weights ``(K, ..., L)`` of K templates' votes ``points`` ``(K, ..., L, D)`` (NaN: no vote) for the weighted
    geometric median: each match score (clamped at 0) to the power ``power_per_vote`` times the landmark's number of
    votes. With few votes the weights stay close (a confident template cannot outvote the others alone), with many
    they sharpen; ``power_per_vote`` was chosen on the validation cephalograms over 3 to 32 templates
    (docs/results.md, "Votes weighted by the match score")."""
    votes = (~torch.isnan(points).any(dim=-1)).sum(0).to(torch.float64)
    return scores.to(torch.float64).clamp_min(0.0) ** (power_per_vote * votes)


def _summed_distances(
    filled: torch.Tensor, valid: torch.Tensor, votes: torch.Tensor, estimate: torch.Tensor
) -> torch.Tensor:
    """The objective: distances ``(..., 1)`` from ``estimate`` (broadcast against each point) to the valid points,
    summed with the weights ``votes``."""
    distance = torch.linalg.vector_norm(filled - estimate, dim=-1, keepdim=True)
    return torch.where(valid, votes * distance, torch.zeros_like(distance)).sum(0)


def _pull_and_ties(
    filled: torch.Tensor, valid: torch.Tensor, votes: torch.Tensor, estimate: torch.Tensor, floor: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """At ``estimate``: the weights ``vote / distance`` of the points away from it (0 for the others), the length of
    the weighted sum of their unit vectors (the objective's slope), the summed votes of the points at it and the
    differences."""
    difference = filled - estimate
    distance = torch.linalg.vector_norm(difference, dim=-1, keepdim=True)
    at_estimate = valid & (distance <= floor)
    weight = torch.where(valid & ~at_estimate, votes, torch.zeros_like(votes)) / torch.maximum(distance, floor)
    pull = torch.linalg.vector_norm((weight * difference).sum(0), dim=-1, keepdim=True)
    return weight, pull, torch.where(at_estimate, votes, torch.zeros_like(votes)).sum(0), difference


def geometric_median(
    points: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    iterations: int = 100,
    tolerance: float = 1e-10,
    halvings: int = 10,
) -> torch.Tensor:
    """Geometric median over the first axis: ``(K, ..., D)`` -> ``(..., D)`` (float64), NaN points ignored.

    The point minimising the summed distances, each weighted by ``weights`` ``(K, ...)`` (non-negative; default all
    1; a point of weight 0 does not count). First the candidates where the minimum may sit on a kink of the
    objective are tested by its optimality condition (Vardi and Zhang, Proc. Natl. Acad. Sci. 2000: the weighted
    unit vectors towards the other points sum to a length of at most the weight of the points there): the
    coordinate-wise median (the middle value of an even count is the mean of the two middle ones: for collinear
    points, whose minimum can be a whole segment, e.g. two templates, this is the segment's midpoint) and each point
    (ties of grid-quantised peaks). Elsewhere the objective is smooth and convex: Newton steps, halved up to
    ``halvings`` times and kept when they lower the objective, else the Weiszfeld step with Vardi and Zhang's
    correction (which never raises it), converge in a few steps where Weiszfeld's iteration alone takes hundreds.
    Scale-free: "at a point" and the stopping step are ``tolerance`` times the points' spread around the
    coordinate-wise median.
    Where every point is NaN the result is NaN. TorchScript-compatible: the exported points network
    (:mod:`bundle.networks.landmark_points`) scripts this function.
    """
    p = points.to(torch.float64)
    valid = ~torch.isnan(p).any(dim=-1, keepdim=True)  # (K, ..., 1)
    votes = torch.ones_like(p[..., :1])
    if weights is not None:  # NaN or negative weights count 0; a landmark whose points all weigh 0 counts them alike
        given = torch.nan_to_num(weights.to(p), nan=0.0).clamp_min(0.0).unsqueeze(-1)
        votes = torch.where(torch.where(valid, given, torch.zeros_like(given)).sum(0) > 0, given, votes)
        valid = valid & (votes > 0)
    filled = torch.where(valid, p, torch.zeros_like(p))
    start = torch.nanquantile(p, 0.5, dim=0)
    distance = torch.linalg.vector_norm(filled - start, dim=-1, keepdim=True)
    spread = torch.where(valid, distance, torch.zeros_like(distance)).amax(0)
    floor = torch.where(spread > 0, tolerance * spread, torch.ones_like(spread))
    slack = 1e-9 * votes.sum(0)  # rounding of a sum of unit vectors

    # a minimum on a kink: the coordinate-wise median, else the first point (in order) that passes the test, all
    # points tested at once (point k against every point: the leading axis of the tests)
    _, pull, ties, _ = _pull_and_ties(filled, valid, votes, start, floor)
    found = pull <= ties + slack
    _, pulls, ties_k, _ = _pull_and_ties(
        filled.unsqueeze(1), valid.unsqueeze(1), votes.unsqueeze(1), filled, floor
    )  # (K, ..., 1)
    optimal = valid & (pulls <= ties_k + slack)
    first = optimal.to(torch.int8).argmax(0, keepdim=True)  # (1, ..., 1)
    at_point = optimal.any(0) & ~found
    estimate = torch.where(at_point, filled.gather(0, first.expand((1,) + start.shape))[0], start)
    found = found | at_point

    # a smooth minimum: safeguarded Newton steps
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    for _iteration in range(iterations):
        weight, pull, ties, difference = _pull_and_ties(filled, valid, votes, estimate, floor)
        gradient = (weight * difference).sum(0)  # minus the objective's gradient
        # unit vectors towards the points away from the estimate (weight = vote / distance there, else 0)
        unit = difference * torch.where(weight > 0, weight / votes, torch.zeros_like(weight))
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
        objective = _summed_distances(filled.unsqueeze(1), valid.unsqueeze(1), votes.unsqueeze(1), candidates)
        fits = objective <= _summed_distances(filled, valid, votes, estimate)  # NaN (a singular Hessian) never fits
        first = fits.to(torch.int8).argmax(0, keepdim=True)  # (1, ..., 1)
        chosen = candidates.gather(0, first.expand((1,) + estimate.shape))[0]
        updated = torch.where(found | ~fits.any(0), estimate, chosen)
        moved = torch.linalg.vector_norm(updated - estimate, dim=-1, keepdim=True)
        estimate = updated
        if not bool((moved > floor).any()):
            break
    return estimate


def combine_landmarks(predictions, rule: str = "geometric_median", scores=None) -> torch.Tensor:
    """Combine K templates' predictions ``(K, ..., L, D)`` into ``(..., L, D)`` (float64) with ``rule``.

    ``rule``: one of :data:`COMBINE_RULES`; ``weighted_geometric_median`` weights each prediction by its match score
    ``scores`` ``(K, ..., L)`` (:func:`vote_weights`; required for it, unused by the others). NaN marks a
    landmark a template does not give; a landmark that no template gives stays NaN.
    """
    check_combine_rule(rule)
    p = torch.as_tensor(predictions, dtype=torch.float64)
    if p.ndim < 3:
        raise ValueError(f"predictions must be (K, ..., L, D), got shape {tuple(p.shape)}")
    if rule == "weighted_geometric_median" and (scores is None or tuple(scores.shape) != tuple(p.shape[:-1])):
        raise ValueError(
            f"weighted_geometric_median needs one match score per prediction {tuple(p.shape[:-1])}, got "
            f"{None if scores is None else tuple(scores.shape)}"
        )
    if p.shape[0] == 1:
        return p[0].clone()
    if rule == "weighted_geometric_median":
        return geometric_median(p, vote_weights(torch.as_tensor(scores), p))
    if rule == "geometric_median":
        return geometric_median(p)
    missing = torch.isnan(p).any(dim=-1, keepdim=True).expand_as(p)
    p = p.masked_fill(missing, float("nan"))
    return torch.nanmedian(p, dim=0).values if rule == "median" else torch.nanmean(p, dim=0)


def combine_templates(per_template, grid_to_physical=None, rule: str = "geometric_median", scores=None) -> torch.Tensor:
    """K templates' grid predictions ``(K, ..., L, D)`` (and match ``scores`` ``(K, ..., L)``) combined per landmark by
    ``rule`` (:func:`combine_landmarks`): in physical mm when ``grid_to_physical`` is given (mapped first), else on the
    grid."""
    if grid_to_physical is not None:
        per_template = apply_homogeneous(grid_to_physical, per_template)
    return combine_landmarks(per_template, rule, scores)
