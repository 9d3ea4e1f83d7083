"""Landmark detection metrics: radial error, mean radial error (MRE) and success detection rate (SDR).

The figures of the paper's Table 1-3 (ISBI 2015 protocol): the radial error of a landmark is the
Euclidean distance between prediction and reference in physical millimetres; MRE is its mean over all
landmark instances, SDR(t) the percentage of instances with error <= t mm. A landmark whose reference
(or prediction) is missing (NaN) is left out of every figure.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from monai.metrics import CumulativeIterationMetric

DEFAULT_THRESHOLDS = (2.0, 2.5, 3.0, 4.0)
GROSS_ERROR_MM = 10.0  # an error above this is a gross failure (a match on the wrong structure)


def radial_errors(pred, ref):
    """Euclidean distance per landmark: ``(..., L, D)`` x2 -> ``(..., L)``; NaN where either point is missing.

    Works on numpy arrays and torch tensors alike (the type of ``pred`` is kept).
    """
    if tuple(pred.shape) != tuple(ref.shape):
        raise ValueError(f"prediction shape {tuple(pred.shape)} differs from reference shape {tuple(ref.shape)}")
    return (((pred - ref) ** 2).sum(-1)) ** 0.5


def threshold_key(threshold: float) -> str:
    """Key of an SDR threshold in reports: ``2.0 -> "2.0"``, ``2.25 -> "2.25"``."""
    return repr(float(threshold))


def success_detection_rate(errors_mm, threshold: float) -> float:
    """Percentage of non-missing errors that are <= ``threshold`` mm (paper's SDR)."""
    e = np.asarray(errors_mm, dtype=np.float64)
    e = e[~np.isnan(e)]
    if e.size == 0:
        raise ValueError("no landmark with both a prediction and a reference: SDR is undefined")
    return float(100.0 * np.mean(e <= threshold))


def summarize_errors(
    errors_mm, errors_px, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, landmark_names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Summary of per-instance errors ``(n_images, n_landmarks)`` (NaN = missing) in the metrics.json layout.

    Returns ``n_images`` (those with at least one measured landmark), ``n_landmarks``, ``mre_mm``, ``mre_std_mm``
    (population std over instances), ``mre_px`` (over the same instances), ``sdr`` ``{"2.0": %, ...}`` and
    ``per_landmark_mre_mm`` ``{name: mm}`` (``None`` for a landmark never measured).
    """
    mm = np.asarray(errors_mm, dtype=np.float64)
    px = np.asarray(errors_px, dtype=np.float64)
    if mm.ndim != 2 or mm.shape != px.shape:
        raise ValueError(f"errors must be (n_images, n_landmarks) arrays of equal shape, got {mm.shape} and {px.shape}")
    n_landmarks = mm.shape[1]
    names = [f"landmark_{i}" for i in range(n_landmarks)] if landmark_names is None else list(landmark_names)
    if len(names) != n_landmarks:
        raise ValueError(f"{len(names)} landmark_names for {n_landmarks} landmarks")
    mask = ~np.isnan(mm)
    measured = mm[mask]
    if measured.size == 0:
        raise ValueError("no landmark with both a prediction and a reference: MRE is undefined")
    per_landmark = {}
    for name, column in zip(names, mm.T):
        column = column[~np.isnan(column)]
        per_landmark[name] = float(column.mean()) if column.size else None
    return {
        "n_images": int(mask.any(axis=1).sum()),
        "n_landmarks": int(n_landmarks),
        "mre_mm": float(measured.mean()),
        "mre_std_mm": float(measured.std()),
        "mre_px": float(px[mask].mean()),
        "sdr": {threshold_key(t): success_detection_rate(measured, t) for t in thresholds},
        "per_landmark_mre_mm": per_landmark,
    }


def landmark_offsets(differences_mm, landmark_names: Sequence[str]) -> dict[str, Any]:
    """Each landmark's systematic error over a set of images, and the MRE that is left once it is taken away.

    ``differences_mm`` is ``(n_images, n_landmarks, D)`` prediction minus reference in mm (NaN = missing). A
    landmark's offset is the mean of its differences (per axis): where the predictions lie on average from the
    references, such as a template placing a landmark otherwise than the references do. Returns
    ``per_landmark_offset_mm`` ``{name: [mm per axis]}`` (``None`` for a landmark never measured) and
    ``mre_offset_removed_mm``, the MRE of the differences less their landmark's offset (what no constant shift per
    landmark explains: the MRE minus it is the share of the error such a shift would remove on these images).
    """
    d = np.asarray(differences_mm, dtype=np.float64)
    if d.ndim != 3 or d.shape[1] != len(landmark_names):
        raise ValueError(f"differences must be (n_images, {len(landmark_names)}, D), got {d.shape}")
    measured = ~np.isnan(d).any(-1)
    if not measured.any():
        raise ValueError("no landmark with both a prediction and a reference: offsets are undefined")
    offsets, residuals = {}, []
    for name, column, keep in zip(landmark_names, d.transpose(1, 0, 2), measured.T):
        if not keep.any():
            offsets[name] = None
            continue
        mean = column[keep].mean(0)
        offsets[name] = [float(v) for v in mean]
        residuals.append(np.linalg.norm(column[keep] - mean, axis=-1))
    return {"per_landmark_offset_mm": offsets, "mre_offset_removed_mm": float(np.concatenate(residuals).mean())}


def lower_error_is_better(current: float, best: float) -> bool:
    """The evaluators' ``metric_cmp_fn``: a validation MRE is the best so far when it is lower than the best.

    Args:
        current: this validation's MRE.
        best: the best so far; below 0: none yet (Ignite's start).
    """
    return best < 0 or current < best


class RadialErrorMetric(CumulativeIterationMetric):
    """Cumulative radial error; ``aggregate()`` gives the MRE in mm (lower is better).

    ``y_pred`` and ``y`` are ``(B, L, D)`` landmarks in physical mm (or lists of ``(L, D)``, as from
    decollated engine outputs); NaN marks a missing landmark. The buffer holds ``(N, L)`` errors (NaN
    for missing), which ``IgniteMetricHandler(save_details=True)`` stores as the per-image details.

    Example:
        >>> import torch
        >>> metric = RadialErrorMetric()
        >>> errors = metric(torch.tensor([[[0.0, 0.0], [3.0, 4.0]]]), torch.zeros(1, 2, 2))  # one image, 2 landmarks
        >>> float(metric.aggregate())  # the mean of 0 and 5 mm
        2.5
    """

    def _compute_tensor(self, y_pred: torch.Tensor, y: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if y is None:
            raise ValueError(f"{type(self).__name__} needs the reference landmarks y")
        if y_pred.ndim != 3:
            raise ValueError(f"{type(self).__name__} expects (B, L, D) landmarks, got shape {tuple(y_pred.shape)}")
        return radial_errors(y_pred.double(), y.to(y_pred.device).double())

    def _measured_errors(self) -> torch.Tensor:
        buffer = self.get_buffer()
        if buffer is None:
            raise ValueError(f"{type(self).__name__}: aggregate() called before any prediction was added")
        errors = buffer.flatten()
        errors = errors[~torch.isnan(errors)]
        if errors.numel() == 0:
            raise ValueError(f"{type(self).__name__}: no landmark with both a prediction and a reference")
        return errors

    def aggregate(self) -> torch.Tensor:  # type: ignore[override]
        """Mean radial error (mm) over all non-missing landmark instances seen since the last reset."""
        return self._measured_errors().mean()


class SuccessDetectionRateMetric(RadialErrorMetric):
    """Cumulative SDR: ``aggregate()`` gives the percentage of instances with error <= ``threshold`` mm."""

    def __init__(self, threshold: float = 2.0) -> None:
        super().__init__()
        self.threshold = float(threshold)

    def aggregate(self) -> torch.Tensor:  # type: ignore[override]
        """SDR (%) at ``threshold`` over the non-missing landmark instances seen since the last reset."""
        return 100.0 * (self._measured_errors() <= self.threshold).double().mean()
