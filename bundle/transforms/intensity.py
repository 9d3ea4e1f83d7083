"""Adaptive, information-guided brightness / contrast augmentation (paper Sec. 3, step 3).

:func:`adjust_brightness_contrast` is the augmentation model (ColorJitter-style brightness then contrast)
shared with the intensity estimator of :mod:`bundle.information`; :class:`InfoGuidedIntensity` draws its
factors per information group and blends them per pixel; :class:`InfoGuidedIntensityd` is its dictionary
wrapper.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.information_groups import GROUP_NAMES, check_thresholds, group_memberships, information_groups
from bundle.settings import as_flag
from monai.config import KeysCollection
from monai.data.meta_obj import get_track_meta
from monai.transforms import MapTransform, Randomizable, RandomizableTransform
from monai.utils import TransformBackends, convert_to_tensor

__all__ = ["adjust_brightness_contrast", "InfoGuidedIntensity", "InfoGuidedIntensityd"]

GROUP_MODES = ("pixel", "query")


def adjust_brightness_contrast(image: torch.Tensor, brightness, contrast) -> torch.Tensor:
    """ColorJitter-style brightness then contrast on a channel-first image ``(C, *spatial)`` in [0, 1].

    ``x1 = clip(f * x, 0, 1)``; ``x2 = clip(c * x1 + (1 - c) * mean(x1), 0, 1)``, the mean taken per
    channel over the spatial axes (torchvision clips after each operation in the same way). ``f`` and
    ``c`` are scalars or tensors broadcastable to ``image`` (per-pixel factors of the adaptive
    augmentation); with scalars this is the plain, non-adaptive augmentation.
    """
    spatial = tuple(range(1, image.ndim))
    x1 = (image * brightness).clamp(0.0, 1.0)
    mean = x1.mean(dim=spatial, keepdim=True)
    return (contrast * x1 + (1.0 - contrast) * mean).clamp(0.0, 1.0)


def _check_intensities(values: Sequence[float], name: str) -> tuple[float, float, float]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be three numbers in [0, 1] (low, medium, high), got {values!r}") from e
    if len(out) != 3 or not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in out):
        raise ValueError(f"{name} must be three numbers in [0, 1] (low, medium, high), got {values!r}")
    return out


def _check_ranges(values, name: str) -> np.ndarray:
    """Three ColorJitter factor ranges ``[[lo, hi]] * 3`` (low, medium, high), ``0 <= lo <= hi``, as a (3, 2) array."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be three factor ranges [lo, hi] (low, medium, high), got {values!r}") from e
    if arr.shape != (3, 2) or not np.isfinite(arr).all() or (arr[:, 0] < 0).any() or (arr[:, 0] > arr[:, 1]).any():
        raise ValueError(
            f"{name} must be three factor ranges [lo, hi] with 0 <= lo <= hi (low, medium, high), got {values!r}"
        )
    return arr


def _entropy_map(entropy, owner: str, name: str) -> torch.Tensor:
    """The IIE map as a plain tensor, refused unless it is a finite ``(1, *spatial)`` map."""
    entropy = convert_to_tensor(entropy, track_meta=False)
    if entropy.ndim < 2 or entropy.shape[0] != 1:
        raise ValueError(f"{owner}: {name} must be a (1, *spatial) IIE map, got shape {tuple(entropy.shape)}")
    if not torch.isfinite(entropy).all():
        raise ValueError(f"{owner}: {name} contains NaN or infinite values")
    return entropy


def _image_in_unit_range(img, entropy: torch.Tensor, owner: str, name: str, entropy_name: str) -> torch.Tensor:
    """The image as a floating-point tensor, refused unless finite, in [0, 1] and on the IIE map's grid."""
    img = convert_to_tensor(img, track_meta=get_track_meta())
    if not img.is_floating_point():
        img = img.float()
    if img.shape[1:] != entropy.shape[1:]:
        raise ValueError(
            f"{owner}: {name} has spatial shape {tuple(img.shape[1:])} but {entropy_name} has "
            f"{tuple(entropy.shape[1:])}; they must match"
        )
    if not torch.isfinite(img).all():
        raise ValueError(f"{owner}: {name} contains NaN or infinite values")
    lo, hi = float(img.min()), float(img.max())
    if lo < -1e-6 or hi > 1 + 1e-6:
        raise ValueError(f"{owner}: {name} must be scaled to [0, 1], its values span [{lo:.4g}, {hi:.4g}]")
    return img


class InfoGuidedIntensity(RandomizableTransform):
    """Brightness and contrast whose strength follows each pixel's information group (adaptive augmentation,
    Sec. 3 step 3).

    Each call draws ``u_b, u_c ~ U(-1, 1)`` once; group ``g`` (low, medium, high IIE) gets the factors
    ``f_g = 1 + u_b * brightness[g]`` and ``c_g = 1 + u_c * contrast[g]``, so each lies uniformly in
    ``[1 - A_g, 1 + A_g]`` and all groups move in the same direction (no artificial edges between
    regions). A pixel's factor is the blend ``sum_g m_g(H) f_g`` with the soft memberships of
    :func:`bundle.information_groups.group_memberships` (linear ramps of width ``blend_width`` bits around each
    threshold, summing to 1), and :func:`adjust_brightness_contrast` applies it:
    ``x1 = clip(f x, 0, 1)``, ``x2 = clip(c x1 + (1 - c) mean(x1), 0, 1)``.

    Plain (non-adaptive) ColorJitter-style augmentation is the special case of equal values, e.g.
    ``brightness=(0.15, 0.15, 0.15)``: every pixel then gets the same factors.

    Asymmetric ranges (``brightness_ranges`` / ``contrast_ranges``, ``[[lo, hi]] * 3``, e.g. from
    ``python -m scripts.estimate_augmentation``) replace the symmetric intensities with
    torchvision ColorJitter's semantics: group ``g``'s factor is uniform in ``[lo_g, hi_g]`` (brightness
    multiplies, contrast blends with the mean grey). One quantile ``p = (u + 1) / 2`` is shared by the
    groups, ``f_g = lo_g + p (hi_g - lo_g)``, so that they still move together; the symmetric A is the
    range ``[1 - A, 1 + A]`` (the same factors as above).

    ``group_mode``: ``"pixel"`` blends the groups' factors per pixel as above; ``"query"`` gives the whole
    image the factors of ONE group, that of the IIE at its first query pixel (the anchor, ``query[0]`` of
    ``(Q, D)`` positions in the image's grid) by hard thresholds (the authors' code: medium for
    ``3.5 < H < 4.5``, otherwise high, i.e. ``thresholds=(3.5, 4.5)`` with the low group given the high
    group's ranges).

    ``__call__(img, entropy, query=None, randomize=True)``: ``img`` ``(C, *spatial)`` (2D or 3D) in [0, 1],
    ``entropy`` its ``(1, *spatial)`` IIE map in bits, ``query`` the positions read by ``group_mode="query"``.
    Arguments as :class:`InfoGuidedIntensityd`'s.
    """

    backend = [TransformBackends.TORCH]

    def __init__(
        self,
        thresholds: Sequence[float] = (2.0, 4.0),
        brightness: Sequence[float] = (0.1, 0.15, 0.2),
        contrast: Sequence[float] = (0.2, 0.25, 0.3),
        blend_width: float = 0.5,
        prob: float = 1.0,
        brightness_ranges: Sequence[Sequence[float]] | None = None,
        contrast_ranges: Sequence[Sequence[float]] | None = None,
        group_mode: str = "pixel",
    ) -> None:
        RandomizableTransform.__init__(self, prob)
        self.thresholds = check_thresholds(thresholds)
        if group_mode not in GROUP_MODES:
            raise ValueError(f"group_mode must be one of {GROUP_MODES}, got {group_mode!r}")
        self.group_mode = group_mode
        # symmetric intensities (None where a range replaces them) and the (3, 2) factor ranges used for drawing
        self.brightness = None if brightness_ranges is not None else _check_intensities(brightness, "brightness")
        self.contrast = None if contrast_ranges is not None else _check_intensities(contrast, "contrast")
        self.brightness_ranges = (
            _check_ranges(brightness_ranges, "brightness_ranges")
            if brightness_ranges is not None
            else np.stack([1.0 - np.asarray(self.brightness), 1.0 + np.asarray(self.brightness)], 1)
        )
        self.contrast_ranges = (
            _check_ranges(contrast_ranges, "contrast_ranges")
            if contrast_ranges is not None
            else np.stack([1.0 - np.asarray(self.contrast), 1.0 + np.asarray(self.contrast)], 1)
        )
        self.last_group: int | None = None
        self.blend_width = float(blend_width)
        group_memberships(torch.zeros(1), self.thresholds, self.blend_width)  # validates blend_width
        self.brightness_factors = np.ones(len(GROUP_NAMES))
        self.contrast_factors = np.ones(len(GROUP_NAMES))

    @property
    def do_transform(self) -> bool:
        """Whether the last :meth:`randomize` decided to augment."""
        return self._do_transform

    def randomize(self, data: object = None) -> None:
        """Decide whether to augment and draw the per-group factors (stored in ``*_factors``)."""
        super().randomize(None)
        if not self._do_transform:
            return
        u_b, u_c = self.R.uniform(-1.0, 1.0, size=2)
        self.brightness_factors = self._factors(u_b, self.brightness, self.brightness_ranges)
        self.contrast_factors = self._factors(u_c, self.contrast, self.contrast_ranges)

    @staticmethod
    def _factors(u: float, intensities, ranges: np.ndarray) -> np.ndarray:
        """Per-group factors of the shared draw ``u`` in [-1, 1]: ``1 + u A`` (symmetric), else the quantile
        ``(u + 1) / 2`` of each range (ColorJitter: uniform in [lo, hi])."""
        if intensities is not None:
            return 1.0 + u * np.asarray(intensities)
        return ranges[:, 0] + (u + 1.0) / 2.0 * (ranges[:, 1] - ranges[:, 0])

    def query_group(self, query, entropy: torch.Tensor) -> int:
        """The group (0 low, 1 medium, 2 high) of the IIE at the first query pixel (rounded, kept on the grid)."""
        query = torch.as_tensor(convert_to_tensor(query, track_meta=False)).reshape(-1, entropy.ndim - 1)
        spatial = torch.as_tensor(entropy.shape[1:])
        index = torch.minimum(query[0].round().long().clamp(min=0), spatial - 1)
        return int(information_groups(float(entropy[(0, *index.tolist())]), self.thresholds))

    def _pixel_factors(
        self, entropy: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """Blended factor maps ``(1, *spatial)``; plain scalars when all groups share the same factors."""
        if np.ptp(self.brightness_factors) == 0 and np.ptp(self.contrast_factors) == 0:
            return float(self.brightness_factors[0]), float(self.contrast_factors[0])
        m = group_memberships(entropy.to(like.dtype), self.thresholds, self.blend_width)  # (3, 1, *spatial)
        shape = (len(GROUP_NAMES),) + (1,) * (m.ndim - 1)
        f = torch.as_tensor(self.brightness_factors, dtype=like.dtype, device=like.device).reshape(shape)
        c = torch.as_tensor(self.contrast_factors, dtype=like.dtype, device=like.device).reshape(shape)
        return (m * f).sum(0), (m * c).sum(0)

    def __call__(self, img, entropy, query=None, randomize: bool = True) -> torch.Tensor:
        if randomize:
            self.randomize(None)
        if not self._do_transform:
            return convert_to_tensor(img, track_meta=get_track_meta())
        owner = type(self).__name__
        entropy = _entropy_map(entropy, owner, "the IIE map")
        img = _image_in_unit_range(img, entropy, owner, "the image", "the IIE map")
        if self.group_mode == "query":
            if query is None:
                raise ValueError(f"{owner}: group_mode 'query' needs the query positions (Q, D)")
            self.last_group = self.query_group(query, entropy)
            f, c = float(self.brightness_factors[self.last_group]), float(self.contrast_factors[self.last_group])
        else:
            self.last_group = None
            f, c = self._pixel_factors(entropy.to(img.device), img)
        return adjust_brightness_contrast(img, f, c)


class InfoGuidedIntensityd(Randomizable, MapTransform):
    """Dictionary wrapper of :class:`InfoGuidedIntensity` (adaptive augmentation, Sec. 3 step 3).

    One draw per call is shared by all ``keys``; the IIE map is read from ``data[entropy_key]`` and, for
    ``group_mode="query"``, the query positions from ``data[query_key]`` (``(Q, D)`` in the image's grid, as
    ``RandViewPaird`` hands them over). The transform's settings and last draw (``brightness_factors``,
    ``contrast_factors``, ``last_group``, ...) are read through the wrapper.

    Args:
        keys: image keys; each ``(C, *spatial)`` (2D or 3D) with values in [0, 1].
        entropy_key: key of the IIE map ``(1, *spatial)`` in bits (e.g. from ``EntropyMapd``), same
            spatial shape as the images.
        thresholds: IIE thresholds (bits) between the low / medium and medium / high groups.
        brightness: brightness intensities ``(A_l, A_m, A_h)`` in [0, 1].
        contrast: contrast intensities ``(A_l, A_m, A_h)`` in [0, 1].
        blend_width: width (bits) of the membership ramp around each threshold; 0 gives hard groups.
        prob: probability of augmenting; otherwise the data pass through unchanged.
        allow_missing_keys: don't raise an error if an image key is missing.
        brightness_ranges: optional brightness factor ranges ``[[lo, hi]] * 3``; replaces ``brightness``.
        contrast_ranges: optional contrast factor ranges ``[[lo, hi]] * 3``; replaces ``contrast``.
        group_mode: ``"pixel"`` (per-pixel blend) or ``"query"`` (one group per call, from the query pixel).
        query_key: key of the query positions used by ``group_mode="query"``.
    """

    backend = InfoGuidedIntensity.backend
    prob = property(lambda self: self.intensity.prob)
    thresholds = property(lambda self: self.intensity.thresholds)
    blend_width = property(lambda self: self.intensity.blend_width)
    group_mode = property(lambda self: self.intensity.group_mode)
    brightness = property(lambda self: self.intensity.brightness)
    contrast = property(lambda self: self.intensity.contrast)
    brightness_ranges = property(lambda self: self.intensity.brightness_ranges)
    contrast_ranges = property(lambda self: self.intensity.contrast_ranges)
    brightness_factors = property(lambda self: self.intensity.brightness_factors)
    contrast_factors = property(lambda self: self.intensity.contrast_factors)
    last_group = property(lambda self: self.intensity.last_group)

    def __init__(
        self,
        keys: KeysCollection,
        entropy_key: str,
        thresholds: Sequence[float] = (2.0, 4.0),
        brightness: Sequence[float] = (0.1, 0.15, 0.2),
        contrast: Sequence[float] = (0.2, 0.25, 0.3),
        blend_width: float = 0.5,
        prob: float = 1.0,
        allow_missing_keys: bool = False,
        brightness_ranges: Sequence[Sequence[float]] | None = None,
        contrast_ranges: Sequence[Sequence[float]] | None = None,
        group_mode: str = "pixel",
        query_key: str = "crop_query",
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        self.intensity = InfoGuidedIntensity(
            thresholds, brightness, contrast, blend_width, prob, brightness_ranges, contrast_ranges, group_mode
        )
        self.entropy_key, self.query_key = entropy_key, query_key

    def set_random_state(
        self, seed: int | None = None, state: np.random.RandomState | None = None
    ) -> InfoGuidedIntensityd:
        super().set_random_state(seed, state)
        self.intensity.set_random_state(seed, state)
        return self

    def randomize(self, data: object = None) -> None:
        """Decide whether to augment and draw the factors (the array transform's one random stream)."""
        self.intensity.randomize(data)

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        d = dict(data)
        self.randomize(None)
        keys = list(self.key_iterator(d))
        if not self.intensity.do_transform or not keys:
            for key in keys:
                d[key] = convert_to_tensor(d[key], track_meta=get_track_meta())
            return d
        owner = type(self).__name__
        if self.entropy_key not in d:
            raise KeyError(f"{owner}: entropy key {self.entropy_key!r} not found (keys: {sorted(map(str, d))})")
        entropy = _entropy_map(d[self.entropy_key], owner, repr(self.entropy_key))
        query = None
        if self.group_mode == "query":
            if self.query_key not in d:
                raise KeyError(
                    f"{owner}: group_mode 'query' needs the query positions under {self.query_key!r} "
                    f"(keys: {sorted(map(str, d))})"
                )
            query = d[self.query_key]
        for key in keys:
            _image_in_unit_range(d[key], entropy, owner, repr(key), repr(self.entropy_key))  # errors name the key
            d[key] = self.intensity(d[key], entropy, query, randomize=False)
        return d


# the baseline's uniform brightness / contrast jitter (the augmentation without the paper's steps 2-3)
BASELINE_BRIGHTNESS = 0.15
BASELINE_CONTRAST = 0.25


def crop_augmentation(
    keys: KeysCollection, entropy_key: str, augmentation: Mapping, adaptive_augmentation: bool | str
) -> InfoGuidedIntensityd:
    """The crops' brightness / contrast augmentation of training (Sec. 3 steps 2-3): the per-group intensities of
    ``augmentation`` (``thresholds``, ``brightness``, ``contrast``, optional ``brightness_ranges`` /
    ``contrast_ranges`` and ``group_mode``) with the paper's adaptive augmentation (``adaptive_augmentation`` on),
    else the baseline's uniform :data:`BASELINE_BRIGHTNESS` / :data:`BASELINE_CONTRAST` in every group.

    Args:
        keys: the image keys.
        entropy_key: the key of their IIE maps.
        augmentation: the configs' ``augmentation`` (scripts/estimate_augmentation.py writes one).
        adaptive_augmentation: the ablation switch (a yes/no value).
    """
    if as_flag(adaptive_augmentation, "adaptive_augmentation"):
        chosen = dict(augmentation)
    else:
        chosen = {"brightness": [BASELINE_BRIGHTNESS] * 3, "contrast": [BASELINE_CONTRAST] * 3}
    return InfoGuidedIntensityd(
        keys,
        entropy_key=entropy_key,
        thresholds=augmentation["thresholds"],
        brightness=chosen.get("brightness"),
        contrast=chosen.get("contrast"),
        brightness_ranges=chosen.get("brightness_ranges"),
        contrast_ranges=chosen.get("contrast_ranges"),
        group_mode=chosen.get("group_mode", "pixel"),
    )
