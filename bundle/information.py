"""Mutual information and augmentation-intensity estimation (paper Sec. 3, step 2).

* Key points are grouped by the IIE (:mod:`bundle.information_groups`).
* The augmentation model shared by the estimator and :class:`bundle.transforms.intensity.InfoGuidedIntensityd`
  is ColorJitter-style brightness then contrast on images in [0, 1]
  (:func:`bundle.transforms.intensity.adjust_brightness_contrast`).
* :func:`estimate_group_ranges` implements the paper's intensity estimate ("Eq. estimate1", "Approximating minimal
  necessary MI"): per group, the target is ``alpha_hat`` times the mean mutual information (MI) of the grey-value
  distributions of corresponding patches of different images; darker and brighter factors grow in steps until the
  MI between a patch and its augmented copy falls below that target. :func:`group_keypoints` and
  :func:`keypoint_entry` are the key-point selection an estimator shares (the bundle's earlier estimator, now
  ``scripts.experiments.joint_mi``, uses them too).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from bundle.information_groups import GROUP_NAMES, check_thresholds, information_groups
from bundle.transforms.intensity import adjust_brightness_contrast


def as_float_array(x, name: str) -> np.ndarray:
    """``x`` (numpy array or torch tensor) as float64, refused naming ``name`` when empty or not finite."""
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    arr = arr.astype(np.float64, copy=False)
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def extract_patches(image: np.ndarray, points: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut cubic patches of side ``patch_size`` centred at the rounded ``points`` (array axis order).

    Returns ``(patches, valid)``: ``patches`` has shape ``(K, *[patch_size] * ndim)`` (zeros where not
    valid) and ``valid`` is False for points that are NaN or whose patch leaves the image.
    """
    image = np.asarray(image, dtype=np.float64)
    points = np.asarray(points, dtype=np.float64).reshape(-1, image.ndim)
    patches = np.zeros((len(points),) + (patch_size,) * image.ndim)
    valid = np.zeros(len(points), dtype=bool)
    for i, p in enumerate(points):
        if not np.isfinite(p).all():
            continue
        start = np.round(p).astype(np.int64) - patch_size // 2
        if (start < 0).any() or (start + patch_size > np.asarray(image.shape)).any():
            continue
        patches[i] = image[tuple(slice(s, s + patch_size) for s in start)]
        valid[i] = True
    return patches, valid


def offset_correspondences(
    template_landmarks: np.ndarray, other_landmarks: np.ndarray, radius: int, stride: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate key points around annotated landmarks and their correspondences in the other images.

    Each landmark ``L`` of the template (and ``L'`` of another image) gives the points ``L + d`` and
    ``L' + d`` for every offset ``d`` of a grid with step ``stride`` in ``[-radius, radius]`` per axis:
    the correspondence assumes the anatomy moves as a rigid translation within ``radius`` of a landmark
    (no local rotation or scaling), which holds approximately for offsets small against the anatomy.
    ``radius = 0`` uses the landmarks alone. NaN (missing) landmarks give NaN points.

    Returns ``(template_points (K, D), correspondences (n, K, D), landmark_index (K,))``.
    """
    tmpl = np.asarray(template_landmarks, dtype=np.float64)
    others = np.asarray(other_landmarks, dtype=np.float64).reshape(-1, *tmpl.shape)
    if radius < 0 or stride < 1:
        raise ValueError(f"radius must be >= 0 and stride >= 1, got radius={radius!r}, stride={stride!r}")
    axis = np.arange(-radius, radius + 1, stride, dtype=np.float64)
    offsets = np.stack(np.meshgrid(*([axis] * tmpl.shape[1]), indexing="ij"), -1).reshape(-1, tmpl.shape[1])
    template_points = (tmpl[:, None, :] + offsets[None]).reshape(-1, tmpl.shape[1])
    correspondences = (others[:, :, None, :] + offsets[None, None]).reshape(len(others), -1, tmpl.shape[1])
    landmark_index = np.repeat(np.arange(len(tmpl)), len(offsets))
    return template_points, correspondences, landmark_index


def group_keypoints(
    template,
    others,
    template_points,
    correspondences,
    point_entropy,
    thresholds,
    n_keypoints,
    min_keypoints,
    patch_size,
    alpha_hat,
    seed,
) -> tuple[np.ndarray, list, list]:
    """The key-point selection an estimator shares: the arguments checked, the template's patches and the
    corresponding patches of every other image (:func:`extract_patches`, with their validity), and per IIE
    group ``(name, candidates, chosen)``: the usable candidates and at most ``n_keypoints`` of them drawn
    without replacement (``seed``), in the order of ``GROUP_NAMES``."""
    check_thresholds(thresholds)
    if not alpha_hat > 0:
        raise ValueError(f"alpha_hat must be positive, got {alpha_hat!r}")
    if patch_size < 2 or n_keypoints < 1 or min_keypoints < 1:
        raise ValueError(
            f"need patch_size >= 2, n_keypoints >= 1, min_keypoints >= 1; "
            f"got {patch_size}, {n_keypoints}, {min_keypoints}"
        )
    template = as_float_array(template, "template image")
    points = np.asarray(template_points, dtype=np.float64).reshape(-1, template.ndim)
    corr = np.asarray(correspondences, dtype=np.float64).reshape(len(others), len(points), template.ndim)
    entropy = np.asarray(point_entropy, dtype=np.float64).reshape(-1)
    if len(entropy) != len(points):
        raise ValueError(f"point_entropy has {len(entropy)} values for {len(points)} template points")
    template_patches, ok = extract_patches(template, points, patch_size)
    ok &= np.isfinite(entropy)
    other_patches = [
        extract_patches(as_float_array(img, f"image {i}"), corr[i], patch_size) for i, img in enumerate(others)
    ]
    groups = information_groups(np.where(np.isfinite(entropy), entropy, 0.0), thresholds)
    rng = np.random.default_rng(seed)
    keypoints = []
    for g, name in enumerate(GROUP_NAMES):
        candidates = np.flatnonzero(ok & (groups == g))
        keypoints.append(
            (name, candidates, np.sort(rng.choice(candidates, size=min(n_keypoints, len(candidates)), replace=False)))
        )
    return template_patches, other_patches, keypoints


def keypoint_entry(candidates: np.ndarray, chosen: np.ndarray, n_pairs: int, min_keypoints: int) -> dict:
    """A group's result entry with its counts; with too few key points or no pair, the ``note`` that says so
    (brightness and contrast None)."""
    entry: dict = {"n_candidates": int(len(candidates)), "n_keypoints": int(len(chosen)), "n_pairs": int(n_pairs)}
    if len(chosen) < min_keypoints or n_pairs == 0:
        entry.update(
            brightness=None,
            contrast=None,
            note=f"only {len(chosen)} key points with {n_pairs} corresponding patches in this group "
            f"(need >= {min_keypoints} key points and >= 1 pair): no estimate",
        )
    return entry


# ------------------------------------------------------------------------------------------------------------
# The paper's estimator: MI between the grey-value DISTRIBUTIONS of two patches ("Approximating minimal
# necessary MI"). A patch's feature G(v) is its grey-level histogram (``bins`` levels, 256 for 8-bit images);
# the MI is that of the two count vectors taken as ``bins`` paired discrete samples (natural log, nats).


def grey_level_histogram(patch, bins: int = 256) -> np.ndarray:
    """Counts ``(bins,)`` of the grey levels of a patch in [0, 1], quantised as an 8-bit image would be
    (``level = round(x * (bins - 1))``, values outside [0, 1] put in the end levels)."""
    if not isinstance(bins, int) or bins < 2:
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    x = as_float_array(patch, "patch").reshape(-1)
    levels = np.clip(np.rint(x * (bins - 1)), 0, bins - 1).astype(np.int64)
    return np.bincount(levels, minlength=bins)


def paired_sample_mutual_information(a, b) -> float:
    """MI (nats) of two equally long vectors read as paired samples ``(a[i], b[i])`` of two discrete variables.

    Every distinct value is one category: ``MI = sum_xy p(x, y) log(p(x, y) / (p(x) p(y)))`` with the
    empirical frequencies of the pairs. This is the quantity that scikit-learn's ``mutual_info_score``
    returns for two label vectors; a vector with one distinct value gives 0.
    """
    xa, xb = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    if xa.shape != xb.shape or xa.size == 0:
        raise ValueError(f"need two non-empty vectors of the same length, got {xa.shape} and {xb.shape}")
    _, ia = np.unique(xa, return_inverse=True)
    _, ib = np.unique(xb, return_inverse=True)
    na, nb = int(ia.max()) + 1, int(ib.max()) + 1
    if na == 1 or nb == 1:
        return 0.0
    joint = np.bincount(ia * nb + ib, minlength=na * nb).reshape(na, nb).astype(np.float64) / xa.size
    pa, pb = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    nz = joint > 0
    return float(max(np.sum(joint[nz] * np.log(joint[nz] / (pa * pb)[nz])), 0.0))


def distribution_mutual_information(a, b, bins: int = 256) -> float:
    """MI (nats) between the grey-value distributions of two patches: :func:`paired_sample_mutual_information`
    of their :func:`grey_level_histogram` count vectors (the paper's G(v), G(v')). The patches may differ in
    shape; only their histograms are compared."""
    return paired_sample_mutual_information(grey_level_histogram(a, bins), grey_level_histogram(b, bins))


RANGE_KINDS = ("brightness", "contrast")


def _distribution_curve_mi(
    histograms: list[np.ndarray], patches: torch.Tensor, kind: str, factor: float, bins: int
) -> float:
    """Mean over the patches of the distribution MI between each patch and its copy augmented by ``factor``."""

    augmented = (
        adjust_brightness_contrast(patches, factor, 1.0)
        if kind == "brightness"
        else adjust_brightness_contrast(patches, 1.0, factor)
    )
    out = augmented.numpy()
    return float(
        np.mean([paired_sample_mutual_information(h, grey_level_histogram(p, bins)) for h, p in zip(histograms, out)])
    )


def search_factor_range(
    patches,
    target: float,
    kind: str,
    step: float = 0.01,
    min_factor: float = 0.0,
    max_factor: float = 3.0,
    bins: int = 256,
) -> dict:
    """Asymmetric ColorJitter factor range ``[lo, hi]`` of one kind (``brightness``, ``contrast``) for a target MI.

    ``patches``: ``(K, *spatial)`` patches in [0, 1]. Darker (or flatter) and brighter (or steeper) are
    searched separately: the factor moves from 1 in steps of ``step`` (down to ``min_factor``, up to
    ``max_factor``) until the mean over the patches of the distribution MI between a patch and its
    augmented copy (:func:`distribution_mutual_information`; contrast blends with the patch's own mean)
    falls below ``target``; that first factor is the bound. A side that never falls below the target
    stops at its limit and is flagged (``lo_at_limit`` / ``hi_at_limit``: the bound is then only a limit).
    Returns ``{lo, hi, lo_mi, hi_mi, lo_at_limit, hi_at_limit}`` with the mean MI at each bound.
    """
    if kind not in RANGE_KINDS:
        raise ValueError(f"kind must be one of {RANGE_KINDS}, got {kind!r}")
    if not (0 < step < 1 and 0 <= min_factor < 1 < max_factor):
        raise ValueError(
            f"need 0 < step < 1 and 0 <= min_factor < 1 < max_factor, got {step!r}, {min_factor!r}, {max_factor!r}"
        )
    patches_t = torch.as_tensor(as_float_array(patches, "patches"))
    histograms = [grey_level_histogram(p, bins) for p in patches_t.numpy()]
    result: dict = {}
    for side, sign, limit in (("lo", -1.0, min_factor), ("hi", 1.0, max_factor)):
        n = int(math.floor(abs(limit - 1.0) / step + 1e-9))
        factor, mi = 1.0, float("nan")
        for k in range(1, n + 1):
            factor = round(1.0 + sign * k * step, 10)
            mi = _distribution_curve_mi(histograms, patches_t, kind, factor, bins)
            if mi < target:
                break
        result[side] = factor
        result[f"{side}_mi"] = mi
        result[f"{side}_at_limit"] = bool(not mi < target)
    return result


def estimate_group_ranges(
    template: np.ndarray,
    others: Sequence[np.ndarray],
    template_points: np.ndarray,
    correspondences: np.ndarray,
    point_entropy: np.ndarray,
    thresholds: Sequence[float] = (2.0, 4.0),
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    patch_size: int = 64,
    alpha_hat: float = 0.8,
    step: float = 0.01,
    min_factor: float = 0.0,
    max_factor: float = 3.0,
    bins: int = 256,
    seed: int = 0,
) -> dict:
    """Per-group asymmetric brightness and contrast factor ranges, the paper's estimator ("Approximating
    minimal necessary MI").

    For each group (the key points of :func:`group_keypoints`): ``correspondence_mi`` = mean over key points and
    images of the distribution MI (:func:`distribution_mutual_information`) between the template's patch and the
    corresponding patch; ``target_mi = alpha_hat * correspondence_mi``; ``self_mi`` = the mean distribution MI of a
    patch with itself (no augmentation); then :func:`search_factor_range` per kind on the key points' template
    patches gives ``brightness = [lo, hi]`` and ``contrast = [lo, hi]`` (ColorJitter factors).

    Args:
        template: the template's spatial array in [0, 1] (no channel axis).
        others: the other images' spatial arrays in [0, 1] (shapes may differ from the template).
        template_points: candidate key points ``(K, D)`` in the template, array axis order.
        correspondences: ``(len(others), K, D)`` the same anatomical points in the other images (NaN: unknown).
        point_entropy: ``(K,)`` the template's IIE (bits) at each candidate; it sets the candidate's group.
        thresholds: the IIE group thresholds.
        n_keypoints: at most this many key points drawn (without replacement, ``seed``) per group.
        min_keypoints: a group with fewer usable key points gets no estimate (``None`` and a ``note``).
        patch_size: the patches' side.
        alpha_hat: the target's share of the MI of corresponding patches.
        step: the factors' search step.
        min_factor: the lowest factor searched.
        max_factor: the highest factor searched.
        bins: the grey levels of a patch's histogram.
        seed: the key points' draw.
    """
    template_patches, other_patches, keypoints = group_keypoints(
        template,
        others,
        template_points,
        correspondences,
        point_entropy,
        thresholds,
        n_keypoints,
        min_keypoints,
        patch_size,
        alpha_hat,
        seed,
    )
    result: dict = {}
    for name, candidates, chosen in keypoints:
        pair_mi = [
            distribution_mutual_information(template_patches[i], patches[i], bins)
            for patches, valid in other_patches
            for i in chosen
            if valid[i]
        ]
        entry = keypoint_entry(candidates, chosen, len(pair_mi), min_keypoints)
        if "note" in entry:
            result[name] = entry
            continue
        correspondence_mi = float(np.mean(pair_mi))
        target = alpha_hat * correspondence_mi
        patches = template_patches[chosen]
        entry.update(
            correspondence_mi=correspondence_mi,
            target_mi=target,
            self_mi=float(np.mean([distribution_mutual_information(p, p, bins) for p in patches])),
        )
        for kind in RANGE_KINDS:
            found = search_factor_range(patches, target, kind, step, min_factor, max_factor, bins)
            entry[kind] = [found["lo"], found["hi"]]
            entry[f"{kind}_mi"] = [found["lo_mi"], found["hi_mi"]]
            entry[f"{kind}_at_limit"] = [found["lo_at_limit"], found["hi_at_limit"]]
        result[name] = entry
    return result
