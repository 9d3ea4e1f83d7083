"""Pseudo-labels from one-shot matching, with a label-free reliability of each landmark.

From the labelled template(s), unlabelled images are labelled by (k-shot) matching. Each predicted
landmark gets the forward-backward cycle error of its match (the input's feature at the match, matched
back into the template, lands this many grid pixels from the template's landmark; the median over the
templates): a match on the wrong structure rarely returns to where it started. Two uses:

- pseudo-templates (:func:`select_pseudo_templates`): the images whose matches are most reliable, with
  their unreliable landmarks left out (``null``), become extra templates for k-shot matching;
- the paper's one-shot stage 2 (CC2D's second stage): every training image with its pseudo-labels trains
  a heatmap detector (``configs/train_stage2.yaml``).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from bundle.data.datalist import datalist_landmarks
from bundle.geometry import physical_to_datalist
from bundle.inferers.oneshot import OneShotInferer
from bundle.kshot import combine_templates
from bundle.passes import map_shards

logger = logging.getLogger(__name__)


@torch.no_grad()
def pseudo_label(
    network: torch.nn.Module, inferer: OneShotInferer, items: Sequence[dict], preprocessing, device: torch.device | str
) -> list[dict]:
    """Label ``items`` by matching from the inferer's templates.

    Returns one dict per item: ``item`` (a copy of the datalist item whose ``landmarks`` are the combined
    predictions in the datalist convention), ``cycle_error`` (``(L,)`` grid pixels, median over the
    templates; NaN where no template gives the landmark) and ``spacing`` (mm per pixel, the datalist's or the
    header's, as the pipeline read it). ``preprocessing`` is the evaluation pipeline
    (ending with ``LandmarkTargetsd``); the caller's network is put in eval mode. Under torchrun each process labels
    its share of ``items`` and every one returns all of them (:func:`bundle.passes.map_shards`).
    """
    network.eval()

    def label(item: dict) -> dict:
        data = preprocessing({k: v for k, v in item.items() if k != "landmarks"})
        image = torch.as_tensor(data["image"])[None].float().to(device)
        matches = inferer.match_templates(image, network, cycle=True)
        matrix = torch.as_tensor(data["grid_to_physical"], dtype=torch.float64)
        physical = combine_templates(
            matches.positions[:, 0].cpu(), matrix, inferer.template_combine, matches.scores[:, 0].cpu()
        )
        points = physical_to_datalist(physical.numpy(), torch.as_tensor(data["spacing"]).numpy())
        landmarks = datalist_landmarks(points)
        errors = matches.cycle_errors[:, 0].cpu()
        median = torch.where(torch.isnan(errors).all(0), float("nan"), errors.nanmedian(dim=0).values)
        spacing = [float(v) for v in torch.as_tensor(data["spacing"]).reshape(-1)]
        return {"item": {**item, "landmarks": landmarks}, "cycle_error": median.numpy(), "spacing": spacing}

    # each process its share of the images under torchrun (bundle.passes.map_shards)
    return map_shards(label, items, "pseudo-labels")


def reliable_landmarks(labelled: dict, cycle_tolerance: float) -> dict:
    """The pseudo-labelled item with every landmark whose cycle error exceeds ``cycle_tolerance`` set to ``None``."""
    item = dict(labelled["item"])
    item["landmarks"] = [
        p if p is not None and np.isfinite(e) and e <= cycle_tolerance else None
        for p, e in zip(item["landmarks"], labelled["cycle_error"])
    ]
    return item


def reliability(labelled: dict, cycle_tolerance: float) -> tuple[float, float]:
    """Sort key of a pseudo-labelled image (higher is better): the fraction of its landmarks whose cycle
    closes within ``cycle_tolerance``, then the negated median cycle error."""
    errors = np.asarray(labelled["cycle_error"], dtype=np.float64)
    closes = np.isfinite(errors) & (errors <= cycle_tolerance)
    finite = errors[np.isfinite(errors)]
    return float(closes.mean()), -float(np.median(finite)) if finite.size else -np.inf


def select_pseudo_templates(labelled: Sequence[dict], keep: int, cycle_tolerance: float = 2.0) -> list[dict]:
    """The ``keep`` most reliable pseudo-labelled images (:func:`reliability`) as template items, their
    unreliable landmarks left out (:func:`reliable_landmarks`)."""
    if keep < 0:
        raise ValueError(f"the number of pseudo-templates to keep must be >= 0, got {keep}")
    ranked = sorted(labelled, key=lambda entry: reliability(entry, cycle_tolerance), reverse=True)
    chosen = [reliable_landmarks(entry, cycle_tolerance) for entry in ranked[:keep]]
    for item in chosen:
        kept = sum(p is not None for p in item["landmarks"])
        logger.info(
            "pseudo-template %s: %d of %d landmarks kept (cycle error <= %.1f px)",
            item["image"],
            kept,
            len(item["landmarks"]),
            cycle_tolerance,
        )
    return chosen
