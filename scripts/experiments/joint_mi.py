"""The bundle's first intensity estimator, kept to reproduce docs/results.md ("Estimated augmentation intensities",
"The paper's estimator"): the MI of the joint grey-value histogram of ALIGNED pixels, and one symmetric intensity A
per information group, where the paper's estimator (:func:`bundle.information.estimate_group_ranges`, the product's)
compares grey-value distributions and searches darker and brighter factors apart.

    python -m scripts.experiments.joint_mi --datalist D --output augmentation.yaml [--alpha_hat 0.8 --patch_size 32 \
        --bins 32 --step 0.02 --max_intensity 1.0 ...]

The other options and the key points, groups and correspondences are those of ``scripts.estimate_augmentation``
(:func:`scripts.estimate_augmentation.estimation_inputs`); the output's ``brightness`` / ``contrast`` ``[A_l, A_m,
A_h]`` merge after configs/train.yaml as the paper's ranges do.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from bundle.information import as_float_array, group_keypoints, keypoint_entry
from bundle.information_groups import GROUP_NAMES
from bundle.transforms.intensity import adjust_brightness_contrast
from scripts.cli import run_fire
from scripts.estimate_augmentation import estimation_inputs, input_options, write_estimate


def _paired_mutual_information(
    a: np.ndarray, b: np.ndarray, bins: int, value_range: Sequence[float] | None
) -> np.ndarray:
    """MI (bits) of each row pair ``a[i], b[i]`` of two ``(N, M)`` arrays; see :func:`mutual_information`."""
    n = a.shape[0]
    if value_range is None:
        lo = np.minimum(a.min(axis=1), b.min(axis=1))
        hi = np.maximum(a.max(axis=1), b.max(axis=1))
    else:
        lo, hi = (np.full(n, float(v)) for v in value_range)
    width = hi - lo
    scale = np.where(width > 0, bins / np.where(width > 0, width, 1.0), 0.0)[:, None]
    ia = np.clip(np.floor((a - lo[:, None]) * scale), 0, bins - 1).astype(np.int64)
    ib = np.clip(np.floor((b - lo[:, None]) * scale), 0, bins - 1).astype(np.int64)
    flat = (np.arange(n)[:, None] * bins + ia) * bins + ib
    joint = np.bincount(flat.ravel(), minlength=n * bins * bins).reshape(n, bins, bins) / a.shape[1]

    def entropy(p: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return -np.sum(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0), axis=axes)

    mi = entropy(joint.sum(axis=2), (1,)) + entropy(joint.sum(axis=1), (1,)) - entropy(joint, (1, 2))
    return np.maximum(mi, 0.0)


def mutual_information(a, b, bins: int = 32, value_range: Sequence[float] | None = None) -> float:
    """Mutual information (bits) of two same-shape patches from their joint ``bins x bins`` grey-value histogram.

    MI = H(A) + H(B) - H(A, B). Both patches are binned on ONE common range: by default the union ``min..max`` of
    the two, or the fixed ``value_range = (lo, hi)`` (values outside are put in the end bins). A common range, rather
    than each patch's own min..max, is what lets an augmentation that compresses or saturates grey values lower the
    MI: with per-patch ranges a pure brightness scaling would leave the histogram, and so the MI, unchanged. A
    zero-width range gives 0.

    Args:
        a: a patch, numpy array or torch tensor, 2D or 3D (any shape, compared element-wise with ``b``).
        b: a patch of the same shape.
        bins: histogram bins per axis, at least 2.
        value_range: ``(lo, hi)``, the common range, None: the union of the two patches' ranges.
    """
    if not isinstance(bins, int) or bins < 2:
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    if value_range is not None:
        lo, hi = (float(v) for v in value_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"value_range must be two finite numbers lo < hi, got {value_range!r}")
    xa, xb = as_float_array(a, "patch a"), as_float_array(b, "patch b")
    if xa.shape != xb.shape:
        raise ValueError(f"mutual_information needs two patches of the same shape, got {xa.shape} and {xb.shape}")
    return float(_paired_mutual_information(xa.reshape(1, -1), xb.reshape(1, -1), bins, value_range)[0])


def _augmented_mi(patches: torch.Tensor, brightness: float, contrast: float, bins: int, value_range) -> float:
    """Mean MI between each patch (one per channel of ``patches``) and its augmented copy."""

    augmented = adjust_brightness_contrast(patches, brightness, contrast)
    flat = patches.reshape(len(patches), -1).numpy()
    return float(
        _paired_mutual_information(flat, augmented.reshape(len(patches), -1).numpy(), bins, value_range).mean()
    )


def estimate_group_intensities(
    template: np.ndarray,
    others: Sequence[np.ndarray],
    template_points: np.ndarray,
    correspondences: np.ndarray,
    point_entropy: np.ndarray,
    thresholds: Sequence[float] = (2.0, 4.0),
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    patch_size: int = 32,
    alpha_hat: float = 0.8,
    step: float = 0.02,
    max_intensity: float = 1.0,
    bins: int = 32,
    value_range: Sequence[float] | None = None,
    seed: int = 0,
) -> dict:
    """Per-group symmetric brightness and contrast intensities A_l, A_m, A_h from the aligned-pixel MI.

    For each group: ``correspondence_mi`` = mean MI(template patch, corresponding patch) over key points and images;
    ``target_mi = alpha_hat * correspondence_mi``. The intensity ``t`` grows by ``step``; the augmentation's MI is the
    mean over the key points' template patches of MI(patch, augmented patch), each patch augmented on its own (its own
    mean for contrast) at the information-reducing extremes: brightness factor ``1 - t``; contrast factors ``1 - t``
    and ``1 + t``, of which the LOWER mean MI counts. A is the first ``t`` whose MI is below the target; if none up to
    ``max_intensity`` is, A = ``max_intensity`` and ``*_at_max`` is True (A is then only a lower bound).

    Args:
        template: the template's spatial array in [0, 1] (no channel axis).
        others: the other images' spatial arrays in [0, 1].
        template_points: candidate key points ``(K, D)`` in the template, array axis order.
        correspondences: ``(len(others), K, D)`` the same anatomical points in the other images (NaN: unknown).
        point_entropy: ``(K,)`` the template's IIE (bits) at each candidate; it sets the candidate's group.
        thresholds: the IIE group thresholds.
        n_keypoints: at most this many key points drawn (without replacement, ``seed``) per group.
        min_keypoints: a group with fewer usable key points gets no estimate (``None`` and a ``note``).
        patch_size: the patches' side.
        alpha_hat: the target's share of the MI of corresponding patches.
        step: the intensity's step.
        max_intensity: the largest intensity searched.
        bins: the joint histogram's bins per axis.
        value_range: the common grey range, None: each pair's union.
        seed: the key points' draw.
    """
    if not (0 < step <= max_intensity <= 1):
        raise ValueError(f"need 0 < step <= max_intensity <= 1, got step={step!r}, max_intensity={max_intensity!r}")
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
    n_steps = int(math.floor(max_intensity / step + 1e-9))
    ts = [round((k + 1) * step, 10) for k in range(n_steps)]
    result: dict = {}
    for name, candidates, chosen in keypoints:
        pair_mi = []
        for patches, valid in other_patches:
            use = chosen[valid[chosen]]
            if len(use):
                flat = (template_patches[use].reshape(len(use), -1), patches[use].reshape(len(use), -1))
                pair_mi.append(_paired_mutual_information(*flat, bins, value_range))
        pair_mi = np.concatenate(pair_mi) if pair_mi else np.zeros(0)
        entry = keypoint_entry(candidates, chosen, len(pair_mi), min_keypoints)
        if "note" in entry:
            result[name] = entry
            continue
        correspondence_mi = float(pair_mi.mean())
        target = alpha_hat * correspondence_mi
        patches_t = torch.from_numpy(template_patches[chosen])
        entry.update(
            correspondence_mi=correspondence_mi,
            target_mi=target,
            self_mi=_augmented_mi(patches_t, 1.0, 1.0, bins, value_range),
        )
        curves = {
            "brightness": lambda t: _augmented_mi(patches_t, 1.0 - t, 1.0, bins, value_range),
            "contrast": lambda t: min(
                _augmented_mi(patches_t, 1.0, 1.0 - t, bins, value_range),
                _augmented_mi(patches_t, 1.0, 1.0 + t, bins, value_range),
            ),
        }
        for kind, curve in curves.items():
            reached, mi = ts[-1], float("nan")
            for t in ts:
                mi = curve(t)
                if mi < target:
                    reached = t
                    break
            entry[kind] = reached
            entry[f"{kind}_mi"] = mi
            entry[f"{kind}_at_max"] = bool(mi >= target)
        result[name] = entry
    return result


def estimate(
    datalist: str,
    output: str = "augmentation.yaml",
    alpha_hat: float = 0.8,
    window: int = 10,
    thresholds=(2.0, 4.0),
    n_images: int = 10,
    patch_size: int = 32,
    image_size=None,
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    radius: int = 16,
    stride: int = 8,
    bins: int = 32,
    step: float = 0.02,
    max_intensity: float = 1.0,
    correspondences: str = "landmarks",
    ckpt_path: str | None = None,
    config_file="configs/train.yaml",
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Estimate the symmetric per-group intensities, write ``output`` (YAML: ``augmentation.brightness`` /
    ``contrast``) and print a table. The images at their original size unless ``image_size``; the other options:
    :func:`scripts.estimate_augmentation.estimation_inputs`."""
    inputs, common, source = estimation_inputs(**input_options(locals()))
    groups = estimate_group_intensities(*inputs, max_intensity=max_intensity, **common)
    source.update(max_intensity=float(max_intensity))
    result = write_estimate(
        output, groups, source, alpha_hat, common["thresholds"], "joint", ("brightness", "contrast")
    )
    print(f"{'group':<8}{'key pts':>8}{'target MI':>11}{'A_bright':>10}{'A_contrast':>12}")
    for g in GROUP_NAMES:
        e = groups[g]

        def fmt(kind: str) -> str:
            return "n/a" if e.get(kind) is None else (">=" if e[f"{kind}_at_max"] else "") + f"{e[kind]:.2f}"

        target = f"{e['target_mi']:.3f}" if "target_mi" in e else "n/a"
        print(f"{g:<8}{e['n_keypoints']:>8}{target:>11}{fmt('brightness'):>10}{fmt('contrast'):>12}")
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    run_fire(estimate, serialize=lambda result: None)
