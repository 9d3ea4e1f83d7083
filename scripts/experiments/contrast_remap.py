"""A random contrast remap of the training views (not in the paper), an experiment outside the product.

:class:`RandContrastRemap` remaps a view's intensities by a random curve, for templates and images of different
contrasts (T1w / T2w MRI); measured on the AFID check, it has not paid on T2w (docs/results.md, "3D: a contrast remap
against T1w -> T2w"). ``scripts/experiments/configs/contrast_remap.yaml``, merged after ``configs/train.yaml`` (and
``configs/train_3d.yaml``), declares ``contrast_remap_prob`` and puts the remap in the views' intensity transforms
(:func:`crop_transform`, :func:`image_transform`); ``contrast_remap_prob: 0`` trains as the product does.

Key (contrast_remap.yaml, default): ``contrast_remap_prob`` (0.0), the probability of a random intensity curve on
each of the two views, drawn independently (:class:`RandContrastRemapd`: monotone, non-monotone or an inversion;
on the crop after its brightness / contrast), so that a template and an image of different contrasts (T1w / T2w
MRI) still match; ``python -m scripts.experiments.afids_check --contrast_remap_prob 0.5`` trains the AFID check with it.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.settings import as_number
from monai.config import KeysCollection
from monai.data.meta_obj import get_track_meta
from monai.transforms import Compose, MapTransform, Randomizable, RandomizableTransform
from monai.utils import TransformBackends, convert_to_dst_type, convert_to_tensor

REMAP_MODES = ("monotone", "non_monotone", "inversion")


class RandContrastRemap(RandomizableTransform):
    """A random intensity curve far beyond brightness and contrast: the views of a volume differ as a T1-weighted
    and a T2-weighted scan of it do (the 3D contrast robustness the information-guided augmentation lacks).

    With probability ``prob`` one of ``modes`` is drawn (uniformly) and the image ``(C, *spatial)`` in [0, 1] goes
    through a piecewise-linear curve on [0, 1]:

    - ``monotone``: through ``n`` random increasing values between 0 and 1 (a histogram shift: order kept);
    - ``non_monotone``: through ``n + 2`` independent uniform values (dark and bright tissues may swap);
    - ``inversion``: ``1 - x``.

    ``n`` is drawn in ``num_control_points`` (inclusive range). The output stays in [0, 1]; the IIE map and the
    query positions are untouched.
    """

    backend = [TransformBackends.TORCH]

    def __init__(
        self, prob: float = 0.5, num_control_points: Sequence[int] = (2, 6), modes: Sequence[str] = REMAP_MODES
    ) -> None:
        RandomizableTransform.__init__(self, prob)
        low, high = (int(v) for v in num_control_points)
        if not 1 <= low <= high:
            raise ValueError(
                f"num_control_points must be a range [low, high] with 1 <= low <= high, got {num_control_points!r}"
            )
        unknown = [m for m in modes if m not in REMAP_MODES]
        if unknown or not modes:
            raise ValueError(f"modes must be some of {REMAP_MODES}, got {list(modes)!r}")
        self.num_control_points = (low, high)
        self.modes = tuple(modes)
        self.mode: str | None = None
        self.curve = np.array([0.0, 1.0])

    def randomize(self, data: object = None) -> None:
        """Decide whether to remap and draw the mode and the curve's values at equally spaced points of [0, 1]."""
        super().randomize(None)
        if not self._do_transform:
            return
        self.mode = self.modes[self.R.randint(len(self.modes))]
        n = self.R.randint(self.num_control_points[0], self.num_control_points[1] + 1)
        if self.mode == "monotone":
            self.curve = np.concatenate([[0.0], np.sort(self.R.uniform(0.0, 1.0, n)), [1.0]])
        elif self.mode == "non_monotone":
            self.curve = self.R.uniform(0.0, 1.0, n + 2)
        else:
            self.curve = np.array([1.0, 0.0])

    def __call__(self, img, randomize: bool = True) -> torch.Tensor:
        if randomize:
            self.randomize(None)
        img = convert_to_tensor(img, track_meta=get_track_meta())
        if not self._do_transform:
            return img
        values = torch.as_tensor(self.curve, dtype=torch.float32, device=img.device)
        x = img.clamp(0.0, 1.0) * (len(values) - 1)
        left = x.floor().clamp(max=len(values) - 2).long()
        weight = (x - left).to(values.dtype)
        out = values[left] * (1.0 - weight) + values[left + 1] * weight
        return convert_to_dst_type(out, dst=img)[0]


class RandContrastRemapd(Randomizable, MapTransform):
    """Dictionary wrapper of :class:`RandContrastRemap`: one draw per call shared by all ``keys``."""

    backend = RandContrastRemap.backend

    def __init__(
        self,
        keys: KeysCollection,
        prob: float = 0.5,
        num_control_points: Sequence[int] = (2, 6),
        modes: Sequence[str] = REMAP_MODES,
        allow_missing_keys: bool = False,
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        self.remap = RandContrastRemap(prob, num_control_points, modes)

    def set_random_state(
        self, seed: int | None = None, state: np.random.RandomState | None = None
    ) -> RandContrastRemapd:
        super().set_random_state(seed, state)
        self.remap.set_random_state(seed, state)
        return self

    def randomize(self, data: object = None) -> None:
        self.remap.randomize(data)

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        d = dict(data)
        self.randomize(None)
        for key in self.key_iterator(d):
            d[key] = self.remap(d[key], randomize=False)
        return d


def _probability(contrast_remap_prob: float) -> float:
    return as_number(contrast_remap_prob, "contrast_remap_prob", minimum=0, maximum=1)


def crop_transform(crop_augmentation: MapTransform, contrast_remap_prob: float = 0.0) -> MapTransform:
    """The crop's intensity transform: ``crop_augmentation``, then (``contrast_remap_prob`` > 0) a random curve
    (:class:`RandContrastRemapd`) with that probability; ``crop_augmentation`` itself at 0.

    Args:
        crop_augmentation: the training's crop intensity transform (``train#crop_augmentation``).
        contrast_remap_prob: the probability of the remap, in [0, 1] (refused naming the key otherwise).
    """
    prob = _probability(contrast_remap_prob)
    return crop_augmentation if prob == 0 else Compose([crop_augmentation, RandContrastRemapd(keys="image", prob=prob)])


def image_transform(contrast_remap_prob: float = 0.0) -> RandContrastRemapd | None:
    """The whole image's intensity transform (the view that inference encodes): its own random curve with
    probability ``contrast_remap_prob``, so that both encoders meet changed contrasts; None (the paper) at 0.

    Args:
        contrast_remap_prob: the probability of the remap, in [0, 1] (refused naming the key otherwise).
    """
    prob = _probability(contrast_remap_prob)
    return None if prob == 0 else RandContrastRemapd(keys="image", prob=prob)
