"""How the app scores its predictors on the saved labels: the train task's publication rule and the infer task's
``auto`` choice.

A score (:class:`Score`) is the mean radial error (mm, or pixels where an image has no spacing) of a predictor's
suggestions on labelled images, with the share of landmarks found within 2 mm (20 pixels without spacing):
template matching from the OTHER saved labels (leave-one-out, as the infer task answers an image that has no label
yet), or a detector on images it has not trained on.

``auto`` (:func:`choose_predictor`): the served detector, template matching with the saved labels and the built-in
templates, or template matching with the saved labels alone (and, while they are few, their pseudo-templates), as
their errors on the newest saved labels that the detector has not trained on say. On a site unlike the shipped
model's, the built-in templates and the shipped detector are what the saved labels show to be worse.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from bundle.geometry import apply_homogeneous
from bundle.pipeline.choice import ENOUGH_LABELS, detector_admitted

from .background import AppStopping, check_stopping
from .context import BundleContext

logger = logging.getLogger(__name__)
# the newest saved labels that auto's choice is scored on (a detector pass and two matchings each)
CHOICE_MAX_IMAGES = 10
# with one saved label, a candidate whose error on it is above this share of the image's diagonal fails on these
# images (about 10 mm on a cephalogram of 230 x 290 mm, what docs/results.md counts a gross error)
GROSS_DIAGONAL_SHARE = 0.03
# a landmark is found within this radius of its label (the success detection rate of cephalometry at 2 mm); on an
# image without spacing, within this many pixels (2 mm at the 0.1 mm pixels of the ISBI 2015 cephalograms)
SUCCESS_RADIUS_MM = 2.0
SUCCESS_RADIUS_PIXELS = 20.0


class Score(NamedTuple):
    """A predictor's score on labelled images: its mean radial error (mm, or pixels where an image has no spacing)
    and the share of landmarks it finds within the success radius (:func:`success_radius`), the accuracy 3D
    Slicer's MONAILabel module shows."""

    mre: float
    success: float


def success_radius(context: BundleContext, item: dict) -> float:
    """``SUCCESS_RADIUS_MM`` on an image with a spacing, else ``SUCCESS_RADIUS_PIXELS``."""
    return SUCCESS_RADIUS_MM if context.spacing_known(item) else SUCCESS_RADIUS_PIXELS


def radial_errors(context: BundleContext, item: dict, network, inferer, preprocessing=None) -> list[float]:
    """Radial errors (mm, or pixels without spacing) of ``inferer(image, network)`` on a labelled ``item``."""
    data = context.prepare(
        {k: v for k, v in item.items() if k in ("image", "landmarks", "spacing")}, preprocessing=preprocessing
    )
    image = torch.as_tensor(data["image"]).unsqueeze(0).to(context.device)
    g2p = torch.as_tensor(data["grid_to_physical"]).unsqueeze(0).to(context.device)
    pred = inferer(image, network, g2p)[0].cpu().numpy().astype(np.float64)
    truth = np.asarray(torch.as_tensor(data["label"]).cpu(), dtype=np.float64)
    e = np.linalg.norm(pred - truth, axis=-1)
    return e[np.isfinite(e)].tolist()


def score_of(errors: list[float], radii: list[float]) -> Score:
    """The :class:`Score` of radial ``errors``, each found when within its radius of ``radii``."""
    if not errors:
        raise ValueError("no landmark to score on")
    return Score(float(np.mean(errors)), float(np.mean(np.asarray(errors) <= np.asarray(radii))))


def score_checkpoint(
    context: BundleContext,
    checkpoint: str | Path,
    cases: list[tuple[dict, list[dict]]],
    unlabelled: list[dict] = (),
    builtin: bool = True,
    network: torch.nn.Module | None = None,
) -> Score:
    """The :class:`Score` of ``checkpoint`` over ``cases`` (item, the saved labels it is matched from), matched as the
    infer task matches with those weights: from those labels (else the bundle's templates), with the built-in
    templates where they fit and ``builtin``, else, while the labels are few, with their pseudo-templates among
    ``unlabelled`` computed with those weights (:meth:`BundleContext.suggestion_templates`). ``network``: a network
    holding those weights to run (default: the context's shared one, held case by case)."""
    errors: list[float] = []
    radii: list[float] = []
    for item, labelled in cases:
        check_stopping()
        # first: choosing the templates may run the shared network with other weights (the bundle's template choice)
        templates = context.suggestion_templates(
            labelled, unlabelled, checkpoint, wait=True, builtin=builtin, network=network
        )
        with torch.no_grad(), context.network(checkpoint, network) as net:
            inferer, _ = context.template_inferer(templates, checkpoint, net, builtin)
            found = radial_errors(context, item, net, inferer)
        errors += found
        radii += [success_radius(context, item)] * len(found)
    return score_of(errors, radii)


def score_detector(
    context: BundleContext, checkpoint: str | Path, image_size: list[int] | None, items: list[dict]
) -> Score:
    """The :class:`Score` of a detector checkpoint (at its training grid ``image_size``) over labelled ``items``."""
    network, preprocessing, inferer = context.new_detector(checkpoint, image_size)
    errors: list[float] = []
    radii: list[float] = []
    with torch.no_grad():
        for item in items:
            check_stopping()
            found = radial_errors(context, item, network, inferer, preprocessing)
            errors += found
            radii += [success_radius(context, item)] * len(found)
    return score_of(errors, radii)


def leave_one_out(labelled: list[dict], scored: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(item, the saved labels it is matched from) for each ``scored`` item: every other one of ``labelled``."""
    return [(it, [o for o in labelled if o["id"] != it["id"]]) for it in scored]


def scoring_cases(context: BundleContext, labelled: list[dict]) -> tuple[list[tuple[dict, list[dict]]], str]:
    """(item, the saved labels it is matched from) pairs of the publication rule and a sentence saying what they
    are: each labelled image from the other ones (leave-one-out), else the bundle datalist's validation images from
    its templates (no saved label)."""
    if labelled:
        cases = leave_one_out(labelled, labelled)
        return cases, f"{len(labelled)} labelled datastore images, each from the other templates (leave-one-out)"
    template_images = {t["image"] for t in context.templates([])}
    validation = [
        it
        for it in context.parser.get_parsed_content("dataset").get("validation", [])
        if it["image"] not in template_images
    ]
    return [
        (it, []) for it in validation
    ], f"the bundle datalist's {len(validation)} validation images, from its templates"


def image_diagonal(context: BundleContext, item: dict) -> float:
    """The length of ``item``'s image diagonal in the units of its radial errors (mm, or pixels without spacing)."""
    frame = context.frame(item["image"])
    corners = np.stack([np.zeros_like(frame["grid_shape"]), frame["grid_shape"] - 1])
    ends = apply_homogeneous(frame["grid_to_physical"], corners).numpy()
    return float(np.linalg.norm(ends[1] - ends[0]))


def newest_labels(labelled: list[dict], exclude: set[str], limit: int = CHOICE_MAX_IMAGES) -> list[dict]:
    """The ``limit`` most recently saved labels (their label file's time; ids break ties) but the ids ``exclude``."""

    def saved(item: dict) -> float:
        try:
            return os.path.getmtime(item["label"])
        except (KeyError, OSError):
            return -math.inf

    kept = [it for it in labelled if it["id"] not in exclude]
    return sorted(kept, key=lambda it: (saved(it), it["id"]), reverse=True)[:limit]


def learnt_from_few(detector_info: dict, n_saved: int) -> int | None:
    """How many saved labels the served detector learnt from when the commands' rule does not admit it against the
    ``n_saved`` saved labels (:func:`bundle.pipeline.choice.detector_admitted`: ``auto`` does not serve it), else None
    (admitted, or the shipped one: it learnt from other labels). A detector that the train task made always holds some
    saved labels out, so it is admitted from ``ENOUGH_LABELS`` on. Measured: one learnt from 2 labels beat matching on
    its 3 held-out images (12.8 against 17.6 px) and lost on the next 5 (two errors of 41 and 54 px) and on 30 test
    images (2.78 against 2.18 mm) (docs/results.md, "Why a detector made from few labels is passed over")."""
    n = len(detector_info.get("trained_on") or [])
    return n if n and not detector_admitted(n, n_saved) else None


def served_before_choice(context: BundleContext, n_saved: int) -> tuple[str, Path]:
    """What ``auto`` serves before the ``n_saved`` saved labels choose: ``("detector", path)``, the served detector
    unless it learnt from few saved labels (:func:`learnt_from_few`), else ``("templates", the served stage-1
    checkpoint)``."""
    detector = context.served_detector()
    if detector is not None and not learnt_from_few(context.detector_info(), n_saved):
        return "detector", detector
    return "templates", context.served_checkpoint()


def choose_predictor(
    context: BundleContext,
    labelled: list[dict],
    unlabelled: list[dict],
    checkpoint: Path,
    detector: Path | None,
    detector_info: dict,
) -> dict | None:
    """``auto``'s predictor for the saved labels ``labelled`` (datastore items; ``unlabelled``: the datastore's other
    images): each candidate is scored on the newest saved labels that the served ``detector`` (``detector_info``: its
    record) has not trained on, and the one with the lowest mean radial error is chosen (ties: the order below):

    - ``detector``: the served detector;
    - ``templates_builtin``: matching with the ``checkpoint`` weights from the other saved labels and the built-in
      templates (where they fit those weights);
    - ``templates``: matching from the other saved labels alone, with their pseudo-templates while they are few (at
      least 2 saved labels), as served.

    A detector that the train task made from too few saved labels is not a candidate (:func:`learnt_from_few`: the
    commands' rule, :func:`bundle.pipeline.choice.detector_admitted`).
    With one saved label, matching from it alone cannot be scored: it is chosen when every candidate that can be
    misses that label by more than ``GROSS_DIAGONAL_SHARE`` of the image's diagonal on average (the served models
    fail on these images; one-shot matching with pseudo-templates is a few mm on the bundle's own data). A candidate
    whose scoring fails is left out (logged). The matching runs on a copy of the stage-1 network, so that requests
    wait for the shared one only while features are stored.

    Returns ``{"predictor": "detector" | "templates", "builtin_templates": whether the built-in templates join the
    saved labels (the better matching), "reason", "mre": {candidate: score}, "scored_on": ids, "units", "labels":
    how many saved labels}``, or None when nothing is to be chosen (the app's default stands)."""
    trained_on = set(detector_info.get("trained_on", [])) if detector else set()
    images = newest_labels(labelled, trained_on)
    if not images:
        return None
    few = learnt_from_few(detector_info, len(labelled)) if detector else None
    candidates = [
        name
        for name, possible in (
            ("detector", detector is not None and not few),
            ("templates_builtin", context.builtin_template(checkpoint) is not None),
            ("templates", len(labelled) >= 2),
        )
        if possible
    ]
    plural = "" if few == 1 else "s"
    passed_over = (
        f"the detector learnt from {few} saved label{plural}, fewer than the {len(labelled)} saved and than "
        f"{ENOUGH_LABELS}: "
        if few
        else ""
    )
    units = context.error_units(images)
    if candidates == ["templates"] and few:  # (few implies at least 2 saved labels: matching is a candidate)
        reason = passed_over + "matching from the saved labels, the one other candidate"
        nothing_scored = {"scored_on": [], "units": units, "labels": len(labelled), "mre": {}}
        return {"predictor": "templates", "builtin_templates": False, "reason": reason, **nothing_scored}
    if candidates in ([], ["templates"]):
        return None
    cases = leave_one_out(labelled, images)
    network = context.private_network(checkpoint)
    mre: dict[str, float] = {}
    for name in candidates:
        check_stopping()
        try:
            if name == "detector":
                mre[name] = score_detector(context, detector, detector_info.get("image_size"), images).mre
            else:
                builtin = name == "templates_builtin"
                mre[name] = score_checkpoint(context, checkpoint, cases, unlabelled, builtin, network).mre
        except AppStopping:
            raise
        except Exception:
            logger.exception(f"auto's choice: {name} not scored")
    scored = {"scored_on": [it["id"] for it in images], "units": units, "labels": len(labelled), "mre": mre}
    if len(labelled) == 1 and mre and min(mre.values()) > GROSS_DIAGONAL_SHARE * image_diagonal(context, images[0]):
        reason = f"the scored candidates miss the one saved label by over {GROSS_DIAGONAL_SHARE:.0%} of its diagonal"
        return {"predictor": "templates", "builtin_templates": False, "reason": reason, **scored}
    if len(mre) < 2 and not few:
        return None
    best = min(mre, key=mre.get, default="templates")  # (few: matching, whatever could be scored)
    return {
        "predictor": "detector" if best == "detector" else "templates",
        "builtin_templates": mre.get("templates_builtin", math.inf) <= mre.get("templates", math.inf),
        "reason": passed_over + "the lowest mean error on the saved labels",
        **scored,
    }
