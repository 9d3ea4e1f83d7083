"""Information groups of the IIE (paper Sec. 3, steps 1 and 3): which pixels get which augmentation.

Pixels fall in a low / medium / high information group by their IIE value H: low ``H < t0``, medium
``t0 <= H < t1``, high ``H >= t1`` (default ``t = (2, 4)`` bits). :func:`information_groups` gives the hard
groups (the estimate of step 2 and the per-crop mode of the augmentation); :func:`group_memberships` the soft
per-pixel blend of the adaptive augmentation (step 3).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

GROUP_NAMES = ("low", "medium", "high")


def check_thresholds(thresholds: Sequence[float]) -> tuple[float, float]:
    """Validate the two IIE thresholds (bits) and return them as floats."""
    try:
        t = tuple(float(v) for v in thresholds)
    except (TypeError, ValueError):
        t = ()
    if len(t) != 2 or not all(math.isfinite(v) for v in t) or not t[0] < t[1]:
        raise ValueError(f"thresholds must be two finite increasing numbers (bits), got {thresholds!r}")
    return t


def information_groups(entropy, thresholds: Sequence[float] = (2.0, 4.0)) -> np.ndarray:
    """Group index per value (0 low ``H < t0``, 1 medium ``t0 <= H < t1``, 2 high ``H >= t1``), Sec. 3 step 1."""
    t = check_thresholds(thresholds)
    h = np.asarray(entropy, dtype=np.float64)
    return np.searchsorted(np.asarray(t), h, side="right")


def group_memberships(entropy: torch.Tensor, thresholds: Sequence[float], blend_width: float) -> torch.Tensor:
    """Soft low / medium / high memberships ``(3, *entropy.shape)`` that sum to 1 (adaptive augmentation, step 3).

    Around each threshold ``t`` the share of the upper side ramps linearly from 0 at ``t - w/2`` to 1 at
    ``t + w/2`` (``w = blend_width``); ``w = 0`` gives the hard groups of :func:`information_groups`.
    Both ramps have the same width, so the medium membership (difference of the two) is never negative.
    """
    t0, t1 = check_thresholds(thresholds)
    if not (math.isfinite(blend_width) and blend_width >= 0):
        raise ValueError(f"blend_width must be a finite number >= 0 (bits), got {blend_width!r}")
    h = torch.as_tensor(entropy)
    h = h if h.is_floating_point() else h.float()

    def above(t: float) -> torch.Tensor:
        if blend_width == 0:
            return (h >= t).to(h.dtype)
        return ((h - (t - blend_width / 2)) / blend_width).clamp(0.0, 1.0)

    s0, s1 = above(t0), above(t1)
    return torch.stack([1.0 - s0, s0 - s1, s1])
