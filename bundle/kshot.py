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

COMBINE_RULES = ("geometric_median", "median", "mean")


def geometric_median(points: torch.Tensor, iterations: int = 100, tolerance: float = 1e-6) -> torch.Tensor:
    """Geometric median over the first axis: ``(K, ..., D)`` -> ``(..., D)``, NaN points ignored.

    Weiszfeld's iteration from the coordinate-wise median, with the distance floored at ``tolerance``
    (so a current estimate that coincides with a point does not divide by zero); it stops when no
    estimate moves by more than ``tolerance``. Where every point is NaN the result is NaN.
    """
    p = torch.as_tensor(points, dtype=torch.float64)
    valid = ~torch.isnan(p).any(dim=-1, keepdim=True)  # (K, ..., 1)
    filled = torch.where(valid, p, torch.zeros((), dtype=p.dtype))
    estimate = torch.nanmedian(p, dim=0).values
    for _ in range(iterations):
        distance = (filled - estimate).norm(dim=-1, keepdim=True).clamp_min(tolerance)
        weight = valid / distance
        updated = (weight * filled).sum(0) / weight.sum(0)
        moved = (updated - estimate).norm(dim=-1)
        estimate = updated
        if not bool((moved > tolerance).any()):
            break
    return estimate


def combine_landmarks(predictions, rule: str = "geometric_median") -> torch.Tensor:
    """Combine K templates' predictions ``(K, ..., L, D)`` into ``(..., L, D)`` (float64) with ``rule``.

    ``rule``: ``"geometric_median"`` (default), ``"median"`` (per coordinate) or ``"mean"``. NaN marks a
    landmark a template does not give; a landmark that no template gives stays NaN.
    """
    if rule not in COMBINE_RULES:
        raise ValueError(f"template combination rule must be one of {COMBINE_RULES}, got {rule!r}")
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
