"""k-shot landmark detection: the predictions of several templates combined per landmark.

One template's match can land on the wrong structure (a gross error); templates that differ in anatomy
rarely fail on the same landmark of the same image, so a robust location estimate of their K predictions
removes most gross errors. The default estimator is the geometric median (the point minimising the sum of
Euclidean distances, breakdown point 1/2), computed by Weiszfeld's iteration; ``median`` (per coordinate)
and ``mean`` are the cheaper and the non-robust alternatives. A template that lacks a landmark (NaN)
simply does not vote for it.
"""

from __future__ import annotations

import torch
from bundle.geometry import apply_homogeneous

COMBINE_RULES = ("geometric_median", "median", "mean")


def check_combine_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`COMBINE_RULES`, else ValueError naming it."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"template combination rule (template_combine) must be one of {COMBINE_RULES}, got {rule!r}")
    return rule


def geometric_median(
    points: torch.Tensor, iterations: int = 1000, tolerance: float = 1e-10, check_every: int = 16
) -> torch.Tensor:
    """Geometric median over the first axis: ``(K, ..., D)`` -> ``(..., D)`` (float64), NaN points ignored.

    Weiszfeld's iteration with Vardi and Zhang's step (Proc. Natl. Acad. Sci. 2000), from the coordinate-wise
    median: points at the current estimate are left out of the weighted mean and pull the estimate back in
    proportion to their number, so a median that lies on a point (ties of grid-quantised peaks) is reached
    exactly instead of approached ever more slowly. Scale-free: "at the estimate" and the stopping step are
    ``tolerance`` times the points' spread around the start, so the result scales with the points (the same
    landmarks in pixels and in mm). Convergence is read on the host every ``check_every`` steps (a GPU waits for
    each read; steps past convergence move the estimate by less than the stopping step). Where every point is
    NaN the result is NaN. TorchScript-compatible: the
    exported points network (:mod:`bundle.networks.landmark_points`) scripts this function.
    """
    p = points.to(torch.float64)
    valid = ~torch.isnan(p).any(dim=-1, keepdim=True)  # (K, ..., 1)
    filled = torch.where(valid, p, torch.zeros_like(p))
    estimate = torch.nanmedian(p, dim=0)[0]
    start = torch.linalg.vector_norm(filled - estimate, dim=-1, keepdim=True)
    spread = torch.where(valid, start, torch.zeros_like(start)).amax(0)  # (..., 1)
    floor = torch.where(spread > 0, tolerance * spread, torch.ones_like(spread))
    for step in range(iterations):
        difference = filled - estimate
        distance = torch.linalg.vector_norm(difference, dim=-1, keepdim=True)
        at_estimate = valid & (distance <= floor)
        weight = (valid & ~at_estimate).to(p.dtype) / torch.maximum(distance, floor)
        mean = (weight * filled).sum(0) / torch.maximum(weight.sum(0), torch.full_like(floor, 1e-300))
        pull = torch.linalg.vector_norm((weight * torch.where(valid, difference, filled)).sum(0), dim=-1, keepdim=True)
        ties = at_estimate.to(p.dtype).sum(0)
        stay = torch.where(pull > 0, torch.clamp(ties / pull, max=1.0), torch.ones_like(pull))
        updated = (1.0 - stay) * mean + stay * estimate
        moved = torch.linalg.vector_norm(updated - estimate, dim=-1, keepdim=True)
        estimate = updated
        if (step + 1) % check_every == 0 and not bool((moved > floor).any()):
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
