"""Query-pixel sampling weights from the IIE map, Sec. 3 step 1 of the paper.

Query pixels are drawn with probability proportional to ``rho = H ** gamma`` (the paper uses gamma = 0.3)
or to the piecewise ``rho = 1[H >= d]``, so that low-information pixels (flat background) are rarely
used as queries.
"""

from __future__ import annotations

import warnings
from typing import Any, Hashable, Mapping

import numpy as np
import torch
from bundle.settings import as_flag, as_number
from bundle.transforms.utils import like_input, output_keys_for, single_channel_spatial
from monai.config import KeysCollection
from monai.transforms import MapTransform, Transform
from monai.utils import TransformBackends

__all__ = ["sampling_weights", "SamplingWeight", "SamplingWeightd"]

MODES = ("power", "threshold")


def sampling_weights(
    entropy: np.ndarray | torch.Tensor, mode: str = "power", gamma: float = 0.3, threshold: float | None = None
) -> torch.Tensor:
    """Normalised query sampling weights (sum 1) from an entropy map of any shape (Sec. 3 step 1).

    ``mode="power"``: ``rho = H ** gamma`` (``gamma = 0`` gives uniform weights; for ``gamma > 0`` pixels
    with ``H = 0`` get weight 0). ``mode="threshold"``: ``rho = 1[H >= threshold]``. When every weight is 0
    (e.g. a constant image) the weights fall back to uniform with a warning. Returns float32 on the
    map's device.
    """
    h = torch.as_tensor(entropy).detach().as_subclass(torch.Tensor).to(torch.float64)
    if h.numel() == 0:
        raise ValueError("sampling_weights: the entropy map is empty")
    if bool(torch.isnan(h).any()) or bool((h < 0).any()):
        raise ValueError("sampling_weights: the entropy map holds NaN or negative values")
    if mode == "power":
        if not gamma >= 0:
            raise ValueError(f"sampling_weights: gamma must be >= 0, got {gamma!r}")
        rho = h.pow(gamma)
    elif mode == "threshold":
        if threshold is None:
            raise ValueError("sampling_weights: mode 'threshold' needs a threshold d (rho = 1[H >= d])")
        rho = (h >= float(threshold)).to(torch.float64)
    else:
        raise ValueError(f"sampling_weights: mode must be one of {MODES}, got {mode!r}")
    total = rho.sum()
    if not bool(torch.isfinite(total)):
        raise ValueError("sampling_weights: the entropy map holds infinite values")
    if total == 0:
        warnings.warn(
            f"sampling_weights: every weight is 0 (mode={mode!r}, gamma={gamma}, threshold={threshold}, "
            f"max entropy {float(h.max()):.4g}); falling back to uniform weights",
            stacklevel=2,
        )
        rho, total = torch.ones_like(rho), float(rho.numel())
    return (rho / total).to(torch.float32)


class SamplingWeight(Transform):
    """Query sampling weights (Sec. 3 step 1) of a channel-first single-channel IIE map (1, *spatial).

    Returns float32 weights of the same shape that sum to 1 (:func:`sampling_weights`); a MetaTensor input
    gives a MetaTensor with a copy of the input's affine and meta data. Arguments as :class:`SamplingWeightd`'s.
    """

    backend = [TransformBackends.TORCH, TransformBackends.NUMPY]

    def __init__(self, mode: str = "power", gamma: float = 0.3, threshold: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"{type(self).__name__}: mode must be one of {MODES}, got {mode!r}")
        if mode == "threshold" and threshold is None:
            raise ValueError(f"{type(self).__name__}: mode 'threshold' needs a threshold d (rho = 1[H >= d])")
        self.mode = mode
        self.gamma = gamma
        self.threshold = threshold

    def __call__(self, img: Any) -> torch.Tensor:
        single_channel_spatial(img, type(self).__name__)
        return like_input(sampling_weights(img, self.mode, self.gamma, self.threshold), img)


class SamplingWeightd(MapTransform):
    """Dictionary wrapper of :class:`SamplingWeight`: query sampling weights from IIE maps (Sec. 3 step 1).

    For each key, reads a channel-first single-channel entropy map (1, *spatial) (as written by
    :class:`EntropyMapd`) and writes float32 weights of the same shape that sum to 1 (see
    :func:`sampling_weights`) to the matching output key. A MetaTensor input gives a MetaTensor output
    with a copy of the input's affine and meta data.

    Args:
        keys: keys of the entropy maps.
        mode: ``"power"`` for ``rho = H ** gamma``, ``"threshold"`` for ``rho = 1[H >= threshold]``.
        gamma: exponent of the power mode (paper: 0.3; 0 gives uniform weights).
        threshold: entropy threshold d of the threshold mode (required there).
        output_keys: where to write each weight map, one per key; default ``f"{key}_weight"``.
        allow_missing_keys: don't raise an exception if a key is missing.

    Raises:
        ValueError: a map with more than one channel or other than 2 or 3 spatial dims, NaN or negative
            entropy, an unknown mode, or the threshold mode without a threshold.
        KeyError: a missing key when ``allow_missing_keys`` is False.

    Example:
        >>> import torch
        >>> entropy = torch.zeros(1, 4, 4)
        >>> entropy[:, :, 2] = 1.0  # 1 bit in one column
        >>> weights = SamplingWeightd("image_entropy")({"image_entropy": entropy})["image_entropy_weight"]
        >>> weights[0, 0]  # the flat rest is never drawn
        tensor([0.0000, 0.0000, 0.2500, 0.0000])
    """

    backend = SamplingWeight.backend
    mode = property(lambda self: self.weighting.mode)
    gamma = property(lambda self: self.weighting.gamma)
    threshold = property(lambda self: self.weighting.threshold)

    def __init__(
        self,
        keys: KeysCollection,
        mode: str = "power",
        gamma: float = 0.3,
        threshold: float | None = None,
        output_keys: KeysCollection | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.weighting = SamplingWeight(mode, gamma, threshold)
        self.output_keys = output_keys_for(self.keys, output_keys, "_weight")

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key, output_key in self.key_iterator(d, self.output_keys):
            single_channel_spatial(d[key], type(self).__name__, key)
            d[output_key] = self.weighting(d[key])
        return d


def query_gamma(entropy_sampling: bool | str, sampling_gamma: float) -> float:
    """The exponent of the query sampling weights ``H ** gamma`` (Sec. 3 step 1): ``sampling_gamma`` (>= 0) with the
    paper's entropy-based sampling (``entropy_sampling`` on), 0 (uniform sampling, the baseline) without it.

    Args:
        entropy_sampling: the ablation switch (a yes/no value).
        sampling_gamma: gamma of ``rho = H ** gamma``.
    """
    gamma = as_number(sampling_gamma, "sampling_gamma", minimum=0)
    return gamma if as_flag(entropy_sampling, "entropy_sampling") else 0.0
