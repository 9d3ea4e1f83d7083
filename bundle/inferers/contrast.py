"""Test-time contrast adaptation (not in the paper): an input of another contrast mapped to the template's.

A T1-weighted template and a T2-weighted input show the same anatomy with other, non-monotone, grey values (CSF
dark in one and bright in the other). The network, trained on one contrast, matches nothing across them. Before
matching, :func:`template_contrast` replaces each input grey value by the template's mean grey value at the voxels
of that value (the conditional mean, from the joint histogram of the two images once the template is registered
to the input by an affine map that maximises their mutual information). :class:`bundle.inferers.oneshot.OneShotInferer`
matches both and keeps the matches that score higher.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import numpy as np
import torch
from bundle.geometry import apply_homogeneous

logger = logging.getLogger(__name__)

# Mutual-information registration of the template to an input (SimpleITK): histogram bins, share of the voxels
# sampled and the sampling's seed (fixed and nonzero: SimpleITK seeds 0 from the clock, and the same inputs must
# give the same map), optimiser steps, the pyramid (shrink, smoothing) and the threads (one: the metric's sums in one
# order, so the same inputs give the same map to the last bit; two threads left 1e-14 between runs on 64³ volumes,
# 4e-4 mm in a validation MRE, for 1.7 times the time)
_MI_BINS, _SAMPLED, _SEED, _STEPS, _SHRINK, _SMOOTH, _THREADS = 32, 0.25, 1, 200, (2, 1), (1.0, 0.0), 1
_GLOBAL_THREADS = threading.Lock()  # held while the global thread count is changed (the MONAI Label app's threads)


def _centroid(image: torch.Tensor) -> torch.Tensor:
    """The centroid ``(D,)`` of a spatial image's foreground (grid voxels, first axis first): the voxels above a
    twentieth of its grey-value range, whatever the contrast (the head of an MRI, the body of a CT)."""
    lo, hi = image.min(), image.max()
    weights = (image > lo + 0.05 * (hi - lo)).double()
    ranges = [torch.arange(s, dtype=torch.float64, device=image.device) for s in image.shape]
    axes = torch.meshgrid(*ranges, indexing="ij")
    total = weights.sum().clamp_min(1e-12)
    return torch.stack([(weights * a).sum() / total for a in axes])


class TemplateRegistration(NamedTuple):
    """The first template registered to one input (:func:`register_template`)."""

    aligned: torch.Tensor  # the template resampled on the input's grid (spatial)
    to_template: torch.Tensor  # (D + 1, D + 1) float64: input grid position -> template grid position


def _matrix(transform, ndim: int) -> np.ndarray:
    """A SimpleITK affine map as a homogeneous matrix on array positions (SimpleITK's axes are the array's reversed)."""
    basis = np.vstack([np.zeros(ndim), np.eye(ndim)])
    mapped = np.array([transform.TransformPoint([float(v) for v in p[::-1]])[::-1] for p in basis])
    matrix = np.eye(ndim + 1)
    matrix[:ndim, :ndim] = (mapped[1:] - mapped[0]).T
    matrix[:ndim, ndim] = mapped[0]
    return matrix


def register_template(template: torch.Tensor, image: torch.Tensor) -> TemplateRegistration:
    """``template`` (spatial) registered to ``image`` (spatial, same rank) by an affine map that maximises the two
    images' Mattes mutual information (SimpleITK; any pair of contrasts), started from their foregrounds' centroids
    aligned, and resampled on the image's grid (linear, 0 outside). When the optimiser fails (too few voxels
    overlap), the template is only shifted by the centroids, with a warning.
    """
    import SimpleITK as sitk  # noqa: N813

    fixed = sitk.GetImageFromArray(image.detach().cpu().numpy().astype(np.float32))
    moving = sitk.GetImageFromArray(template.detach().cpu().numpy().astype(np.float32))
    start = sitk.AffineTransform(image.ndim)  # SimpleITK's axes are the array's reversed
    start.SetCenter(_centroid(image).flip(0).tolist())
    start.SetTranslation((_centroid(template) - _centroid(image)).flip(0).tolist())
    registration = sitk.ImageRegistrationMethod()
    registration.SetMetricAsMattesMutualInformation(numberOfHistogramBins=_MI_BINS)
    registration.SetMetricSamplingStrategy(registration.RANDOM)
    registration.SetMetricSamplingPercentage(_SAMPLED, seed=_SEED)
    registration.SetInterpolator(sitk.sitkLinear)
    registration.SetOptimizerAsRegularStepGradientDescent(learningRate=1.0, minStep=1e-3, numberOfIterations=_STEPS)
    registration.SetOptimizerScalesFromPhysicalShift()
    registration.SetShrinkFactorsPerLevel(list(_SHRINK))
    registration.SetSmoothingSigmasPerLevel(list(_SMOOTH))
    registration.SetInitialTransform(start, inPlace=False)
    with _GLOBAL_THREADS:  # the metric's threads follow SimpleITK's global default: set for this call alone
        threads = sitk.ProcessObject.GetGlobalDefaultNumberOfThreads()
        sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(_THREADS)
        try:
            transform = registration.Execute(fixed, moving)
        except RuntimeError as error:
            logger.warning(
                "contrast adaptation: registration failed, the template is shifted by the centroids: %s", error
            )
            transform = start
        finally:
            sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(threads)
    aligned = sitk.GetArrayFromImage(sitk.Resample(moving, fixed, transform, sitk.sitkLinear, 0.0))
    return TemplateRegistration(torch.from_numpy(aligned).to(image), torch.from_numpy(_matrix(transform, image.ndim)))


def register_templates(inputs: torch.Tensor, template: torch.Tensor) -> list[TemplateRegistration]:
    """:func:`register_template` of ``template`` ``(1, 1, *S)`` to each image of ``inputs`` ``(B, 1, *S)``."""
    reference = template[0, 0].to(inputs)
    return [register_template(reference, image[0]) for image in inputs]


def carried_points(registrations: list[TemplateRegistration], points: torch.Tensor) -> torch.Tensor:
    """Template grid landmarks ``(L, D)`` carried onto each registered input's grid: ``(B, L, D)`` float64 (NaN stays
    NaN), through the inverse of each registration's map."""
    maps = torch.stack([registration.to_template for registration in registrations])
    return apply_homogeneous(maps, points[None].expand(len(registrations), *points.shape), inverse=True)


def template_contrast(inputs: torch.Tensor, registrations: list[TemplateRegistration], bins: int = 64) -> torch.Tensor:
    """``inputs`` ``(B, 1, *S)`` with each image's grey values mapped to the contrast of the template registered to it
    (``registrations``, :func:`register_templates`).

    Per image: its grey values are cut into ``bins`` bins, and the registered template's mean grey value at each
    bin's voxels (linearly interpolated between bin centres) replaces them. A constant image is kept as it is.
    """
    out = inputs.clone()
    for b, registration in enumerate(registrations):
        image = inputs[b, 0]
        lo, hi = image.min(), image.max()
        if not bool(hi > lo):
            continue
        position = (image - lo).double() / float(hi - lo) * bins
        index = position.long().clamp(0, bins - 1).flatten()
        counts = torch.bincount(index, minlength=bins).double()
        sums = torch.bincount(index, weights=registration.aligned.flatten().double(), minlength=bins)
        filled = counts > 0
        centres = torch.arange(bins, dtype=torch.float64, device=inputs.device) + 0.5
        out[b, 0] = _interp(position, centres[filled], sums[filled] / counts[filled]).to(inputs.dtype)
    return out


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of ``(xp, fp)`` (``xp`` increasing) at ``x``, constant beyond the ends."""
    if len(xp) == 1:
        return torch.full_like(x, float(fp[0]))
    right = torch.searchsorted(xp, x.clamp(xp[0], xp[-1]).contiguous()).clamp(1, len(xp) - 1)
    left = right - 1
    t = ((x - xp[left]) / (xp[right] - xp[left])).clamp(0, 1)
    return fp[left] + t * (fp[right] - fp[left])
