"""Test-time contrast adaptation (not in the paper): an input of another contrast mapped to the template's.

A T1-weighted template and a T2-weighted input show the same anatomy with other, non-monotone, grey values (CSF
dark in one and bright in the other). The network, trained on one contrast, matches nothing across them. Before
matching, :func:`template_contrast` replaces each input grey value by the template's mean grey value at the voxels
of that value (the conditional mean, from the joint histogram of the two images after aligning the centroids of
their foregrounds). :class:`bundle.inferers.oneshot.OneShotInferer` matches both and keeps the matches that score
higher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _centroid(image: torch.Tensor) -> torch.Tensor:
    """The centroid ``(D,)`` of a spatial image's foreground (grid voxels, first axis first): the voxels above a
    twentieth of its grey-value range, whatever the contrast (the head of an MRI, the body of a CT)."""
    lo, hi = image.min(), image.max()
    weights = (image > lo + 0.05 * (hi - lo)).double()
    ranges = [torch.arange(s, dtype=torch.float64, device=image.device) for s in image.shape]
    axes = torch.meshgrid(*ranges, indexing="ij")
    total = weights.sum().clamp_min(1e-12)
    return torch.stack([(weights * a).sum() / total for a in axes])


def _shifted(image: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``image`` (spatial) sampled at ``x + shift`` (grid voxels, linear, zero outside)."""
    size = torch.tensor(image.shape, dtype=torch.float64, device=image.device)
    # grid_sample's last axis is the first spatial axis reversed; normalised with align_corners=True
    offset = (2 * shift / (size - 1).clamp_min(1)).flip(0).to(image.dtype)
    ndim = image.ndim
    theta = torch.cat([torch.eye(ndim, dtype=image.dtype, device=image.device), offset[:, None]], dim=1)[None]
    grid = F.affine_grid(theta, [1, 1, *image.shape], align_corners=True)
    return F.grid_sample(image[None, None], grid, mode="bilinear", align_corners=True)[0, 0]


def template_contrast(inputs: torch.Tensor, template: torch.Tensor, bins: int = 64) -> torch.Tensor:
    """``inputs`` ``(B, 1, *S)`` with each image's grey values mapped to the contrast of ``template`` ``(1, 1, *S)``.

    Per image: the template is shifted so that its foreground's centroid meets the image's; the image's grey
    values are cut into ``bins`` bins, and the template's mean grey value at each bin's voxels (linearly
    interpolated between bin centres) replaces them. A constant image is kept as it is.
    """
    out = inputs.clone()
    reference = template[0, 0].to(inputs)
    reference_centre = _centroid(reference)
    for b in range(inputs.shape[0]):
        image = inputs[b, 0]
        lo, hi = image.min(), image.max()
        if not bool(hi > lo):
            continue
        aligned = _shifted(reference, reference_centre - _centroid(image))
        position = (image - lo).double() / float(hi - lo) * bins
        index = position.long().clamp(0, bins - 1).flatten()
        counts = torch.bincount(index, minlength=bins).double()
        sums = torch.bincount(index, weights=aligned.flatten().double(), minlength=bins)
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
