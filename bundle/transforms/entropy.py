"""Image information entropy (IIE) map, Sec. 3.2 of the paper (step 1): local grey-value histogram entropy.

PLACEHOLDER reference implementation with the final signature; the fast implementation replaces it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def local_entropy(image, window: int | Sequence[int] = 10, bins: int = 256, intensity_range: Sequence[float] | None = None) -> torch.Tensor:
    """Shannon entropy (bits) of the ``bins``-bin grey-value histogram in the window around each pixel.

    ``image`` is a spatial array (H, W) or (D, H, W) without channel; windows are cut at the border (only
    in-image pixels count), centred like ``skimage.filters.rank`` footprints (offsets -k//2 .. k-k//2-1).
    """
    x = torch.as_tensor(np.asarray(image), dtype=torch.float64)
    lo, hi = (float(x.min()), float(x.max())) if intensity_range is None else map(float, intensity_range)
    scale = bins / (hi - lo) if hi > lo else 0.0
    idx = ((x - lo) * scale).floor().clamp(0, bins - 1).long()
    dims = x.ndim
    win = [window] * dims if isinstance(window, int) else list(window)
    onehot = torch.nn.functional.one_hot(idx, bins).movedim(-1, 0).double()
    counts = onehot
    for d, k in enumerate(win):
        before, after = k // 2, k - k // 2 - 1
        n = x.shape[d]
        c = torch.nn.functional.pad(counts.cumsum(d + 1).movedim(d + 1, -1), (1, 0)).movedim(-1, d + 1)
        i = torch.arange(n)
        upper = c.index_select(d + 1, (i + after + 1).clamp(max=n))
        lower = c.index_select(d + 1, (i - before).clamp(min=0))
        counts = upper - lower
    total = counts.sum(0)
    p = counts / total
    ent = -(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(0)
    return ent.float()
