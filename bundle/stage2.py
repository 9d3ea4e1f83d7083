"""Stage 2: a heatmap detector trained on stage-1 pseudo-labels (CC2D's second stage), or on human labels.

CC2D (Yao et al., MICCAI 2021) turns the one-shot predictions of its self-supervised stage into
pseudo-labels of every training image and trains a landmark detector on them; the information-guided
paper (Quan et al., CVPR 2023) reports its one-shot results after that stage. This module holds the
engine pieces of ``configs/train_stage2.yaml``, ``configs/finetune.yaml`` and
``configs/evaluate_detector.yaml``:

- :func:`pseudo_labelled_items`: the training items labelled by (k-shot) matching from the templates
  (:func:`bundle.pseudo_labels.pseudo_label`), optionally without their landmarks whose forward-backward
  cycle error exceeds a tolerance; written as an inspectable datalist;
- :class:`MaskedHeatmapLoss`: BCE-with-logits or MSE over the valid landmark channels only;
- :class:`HeatmapPrepareBatch`: ``(image, (heatmap, mask))`` for MONAI's ``SupervisedTrainer``;
- :class:`HeatmapInferer`: heatmaps -> sub-pixel peaks (:func:`bundle.networks.matching.refine_peaks`) -> physical
  mm, ``(B, L, D)`` as ``OneShotInferer`` returns, so the evaluator, metrics and reports are unchanged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from bundle.geometry import apply_homogeneous
from bundle.io_utils import write_json_atomic
from bundle.networks.matching import refine_peaks
from bundle.oneshot import OneShotInferer
from bundle.pseudo_labels import pseudo_label, reliable_landmarks
from bundle.templates import labelled_training_items, with_templates
from monai.inferers import Inferer
from torch.nn.modules.loss import _Loss

__all__ = [
    "HeatmapInferer",
    "HeatmapPrepareBatch",
    "MaskedHeatmapLoss",
    "detector_templates",
    "labelled_items",
    "pseudo_label_templates",
    "pseudo_labelled_items",
    "read_pseudo_labels",
    "write_detector_info",
]

logger = logging.getLogger(__name__)
INFO_FILE = "detector_info.json"


class MaskedHeatmapLoss(_Loss):
    """Heatmap regression loss over valid landmark channels only (a missing landmark adds nothing).

    ``forward(pred, target)``: ``pred`` ``(B, L, *S)`` logits; ``target`` either ``(heatmap, mask)``
    (``(B, L, *S)`` Gaussians in [0, 1] and ``(B, L)`` 1 = valid) or a heatmap alone (all valid).
    ``kind="bce"``: binary cross-entropy with logits against the Gaussians, the positive term weighted by
    ``pos_weight`` (heatmaps are mostly background); ``"mse"``: mean squared error between
    ``sigmoid(pred)`` and the Gaussians. Averaged over the valid channels' pixels; 0 when none is valid.
    """

    KINDS = ("bce", "mse")

    def __init__(self, kind: str = "bce", pos_weight: float = 1.0) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.kind = kind
        self.pos_weight = float(pos_weight)

    def forward(self, pred: torch.Tensor, target: Any) -> torch.Tensor:
        heatmap, mask = target if isinstance(target, (tuple, list)) else (target, None)
        pred = torch.as_tensor(pred).float()
        heatmap = torch.as_tensor(heatmap).float().to(pred.device)
        if heatmap.shape != pred.shape:
            raise ValueError(f"heatmap target {tuple(heatmap.shape)} and prediction {tuple(pred.shape)} differ")
        mask = (
            torch.ones(pred.shape[:2], device=pred.device)
            if mask is None
            else torch.as_tensor(mask).float().to(pred.device)
        )
        if self.kind == "bce":
            weight = 1.0 + (self.pos_weight - 1.0) * heatmap if self.pos_weight != 1.0 else None
            per_pixel = F.binary_cross_entropy_with_logits(pred, heatmap, weight=weight, reduction="none")
        else:
            per_pixel = (torch.sigmoid(pred) - heatmap).square()
        per_channel = per_pixel.flatten(2).mean(-1)  # (B, L)
        return (per_channel * mask).sum() / mask.sum().clamp_min(1.0)


class HeatmapPrepareBatch:
    """``prepare_batch`` of the detector's ``SupervisedTrainer``: ``(image, (heatmap, mask))`` on the device."""

    def __init__(self, image_key: str = "image", heatmap_key: str = "heatmap", mask_key: str = "landmark_mask") -> None:
        self.keys = (image_key, heatmap_key, mask_key)

    def __call__(self, batchdata: dict, device=None, non_blocking: bool = False, **kwargs: Any):
        image, heatmap, mask = (
            torch.as_tensor(batchdata[k]).to(device=device, non_blocking=non_blocking, **kwargs) for k in self.keys
        )
        return image, (heatmap, mask)


class HeatmapInferer(Inferer):
    """Landmarks from a heatmap network: the peak of each channel, refined to sub-pixel precision by
    :func:`bundle.networks.matching.refine_peaks` (parabola through the peak and its neighbours), mapped to physical mm.

    ``__call__(inputs, network, grid_to_physical=None)`` -> ``(B, L, D)`` float64: grid positions, or
    physical mm when ``grid_to_physical`` is given (the ``OneShotInferer`` contract).

    Args:
        activation: "sigmoid" (the logits of :class:`bundle.networks.detector.HeatmapDetector`) or None.
        refine_step: neighbour distance of the sub-pixel fit; 0 = integer argmax.
    """

    def __init__(self, activation: str | None = "sigmoid", refine_step: int = 1) -> None:
        super().__init__()
        if activation not in (None, "sigmoid"):
            raise ValueError(f"activation must be 'sigmoid' or None, got {activation!r}")
        self.activation = activation
        self.refine_step = int(refine_step)

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        maps = torch.as_tensor(network(inputs)).float()
        if self.activation == "sigmoid":
            maps = torch.sigmoid(maps)
        positions, _ = refine_peaks(maps, step=self.refine_step)
        if grid_to_physical is not None:
            positions = apply_homogeneous(grid_to_physical, positions)
        return positions


def _held_out_images(datalist: dict) -> set[str]:
    return {it["image"] for split in ("validation", "test") for it in datalist.get(split) or []}


def pseudo_labelled_items(
    datalist: dict,
    network: torch.nn.Module,
    templates: Sequence[dict],
    preprocessing,
    device: torch.device | str,
    combine: str = "geometric_median",
    cycle_tolerance: float | None = None,
    output_path: str | Path | None = None,
    exclude_held_out: bool = True,
) -> list[dict]:
    """Every training item labelled by matching from ``templates`` with the stage-1 ``network`` (CC2D stage 2).

    The templates keep their own (human) landmarks; every other training item is labelled by k-shot
    matching (:func:`bundle.pseudo_labels.pseudo_label`; its own landmarks, if any, are not read). With
    ``cycle_tolerance`` (grid pixels), a landmark whose forward-backward cycle error exceeds it becomes
    ``null`` (left out of the loss, :func:`bundle.pseudo_labels.reliable_landmarks`). Images of the
    validation and test splits are left out (``exclude_held_out``), so that the detector never trains on
    the images it is measured on. ``output_path``: the pseudo-labelled datalist is written there (atomic),
    with the per-landmark cycle errors under ``pseudo_labels``.
    """

    template_images = {t["image"] for t in templates}
    held_out = _held_out_images(datalist) if exclude_held_out else set()
    pool = [
        {k: v for k, v in it.items() if k != "landmarks"}
        for it in datalist.get("training", [])
        if it["image"] not in template_images and it["image"] not in held_out
    ]
    inferer = with_templates(OneShotInferer(template_combine=combine), list(templates), preprocessing, device)
    labelled = pseudo_label(network, inferer, pool, preprocessing, device)
    items = [dict(t) for t in templates]
    cycle = {}
    for entry in labelled:
        item = entry["item"] if cycle_tolerance is None else reliable_landmarks(entry, float(cycle_tolerance))
        items.append(item)
        cycle[item["image"]] = [None if not np.isfinite(e) else round(float(e), 4) for e in entry["cycle_error"]]
    kept = sum(p is not None for it in items for p in it["landmarks"])
    total = sum(len(it["landmarks"]) for it in items)
    logger.info(
        "stage 2: %d training images (%d template(s) + %d pseudo-labelled), %d of %d landmarks kept",
        len(items),
        len(templates),
        len(labelled),
        kept,
        total,
    )
    if output_path is not None:
        out = {k: v for k, v in datalist.items() if k not in ("training",)}
        out["training"] = items
        out["pseudo_labels"] = {
            "templates": [t["image"] for t in templates],
            "cycle_tolerance": cycle_tolerance,
            "cycle_error": cycle,
        }
        write_json_atomic(output_path, out)
        logger.info("pseudo-label datalist written to %s", output_path)
    return items


def write_detector_info(ckpt_dir: str | Path, templates: Sequence[dict] | None, labels: str, n_items: int) -> Path:
    """``ckpt_dir/detector_info.json``: which templates made the pseudo-labels (empty for human labels), so
    that the evaluation of the detector reports them in metrics.json."""
    return write_json_atomic(
        Path(ckpt_dir) / INFO_FILE,
        {"labels": labels, "templates": [t["image"] for t in templates or []], "n_training_items": int(n_items)},
    )


def detector_templates(ckpt_path: str | Path) -> list[str]:
    """The templates recorded beside a detector checkpoint (:func:`write_detector_info`); ``[]`` when none."""
    info = Path(ckpt_path).parent / INFO_FILE
    if not info.is_file():
        return []
    return list(json.loads(info.read_text()).get("templates") or [])


def labelled_items(datalist: dict, n_labelled: int | None = None) -> list[dict]:
    """The first ``n_labelled`` (None = all) labelled training items outside the validation and test splits
    (the human labels of fine-tuning)."""

    held_out = _held_out_images(datalist)
    items = [dict(it) for it in labelled_training_items(datalist) if it["image"] not in held_out]
    if n_labelled is not None:
        if n_labelled < 1:
            raise ValueError(f"n_labelled must be >= 1 or null, got {n_labelled}")
        if n_labelled > len(items):
            raise ValueError(f"n_labelled={n_labelled} but the datalist has only {len(items)} labelled training items")
        items = items[: int(n_labelled)]
    return items


def read_pseudo_labels(path: str | Path) -> list[dict]:
    """The training items of a pseudo-label datalist written by :func:`pseudo_labelled_items` (to reuse or
    edit the pseudo-labels without matching again); image paths as written there."""
    data = json.loads(Path(path).read_text())
    if "pseudo_labels" not in data or "training" not in data:
        raise ValueError(f"{path} is not a pseudo-label datalist (written by stage 2 as output_dir/pseudo_labels.json)")
    return [dict(it) for it in data["training"]]


def pseudo_label_templates(path: str | Path) -> list[dict]:
    """The template items that made the pseudo-labels of :func:`read_pseudo_labels`'s file."""
    images = set(json.loads(Path(path).read_text())["pseudo_labels"]["templates"])
    return [it for it in read_pseudo_labels(path) if it["image"] in images]
