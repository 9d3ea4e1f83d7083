"""3D matching's guard, chosen on the validation images (``contrast_adaptation: auto``, not in the paper).

Template matching can also match each volume mapped to the first template's contrast (``contrast_adaptation``) and
replace a match far from the template's landmark carried by an affine registration (``registration_tolerance``). On
the bent AFID check the two together took a T1w template on T2w volumes from 29.7 to 2.6 mm, while on the synthetic
CT demo they trade a lower MRE for fewer landmarks within 2 mm (docs/results.md, "3D: bent warps, matching guarded
by the registration"): so ``auto`` measures both settings on the run's labelled validation images, as the
evaluation starts (:class:`MatchingGuardHandler`) or as inferring's predictor is built, and keeps the lower MRE
(:func:`choose_guard`). 2D, and a run without labelled validation images, match without the guard; metrics.json and
provenance.json say what was chosen and on what (``matching_guard``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from bundle.data.datalist import carries_landmarks
from bundle.distributed import from_rank_0
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer, guard_on
from bundle.metrics import radial_errors
from bundle.progress import progress
from ignite.engine import Engine, Events

logger = logging.getLogger(__name__)

# the registration tolerance (grid voxels) that auto's guarded setting takes when registration_tolerance is null:
# the one chosen on the bent AFID check's seed 0 and checked on seed 1 (docs/results.md, "3D: bent warps")
GUARD_TOLERANCE = 2.0


def weighs_validation(setting: bool | str, spatial_dims: int) -> bool:
    """Whether ``contrast_adaptation`` ``setting`` weighs the guard on validation images: ``auto`` in 3D."""
    return setting == "auto" and int(spatial_dims) == 3


def guard_candidates(
    setting: bool | str, registration_tolerance: float | None, spatial_dims: int, validation_items: Sequence[Mapping]
) -> list[dict[str, Any]]:
    """The matching settings (``contrast_adaptation``, ``registration_tolerance``) a run weighs: for ``auto`` in 3D
    with labelled ``validation_items``, matching as given and matching guarded (the contrast adaptation with
    ``registration_tolerance``, else :data:`GUARD_TOLERANCE`); else the one setting (``auto`` without the
    adaptation).

    Args:
        setting: ``contrast_adaptation``: ``auto`` or a bool (:func:`bundle.settings.flag_or_auto`).
        registration_tolerance: the configured tolerance (None: no registration).
        spatial_dims: 2 or 3.
        validation_items: the datalist's validation items.
    """
    plain = {"contrast_adaptation": False, "registration_tolerance": registration_tolerance}
    if setting != "auto":
        return [{**plain, "contrast_adaptation": bool(setting)}]
    if not weighs_validation(setting, spatial_dims) or not any(map(carries_landmarks, validation_items)):
        return [plain]
    tolerance = GUARD_TOLERANCE if registration_tolerance is None else registration_tolerance
    return [plain, {"contrast_adaptation": True, "registration_tolerance": tolerance}]


def validation_mre(
    inferer: OneShotInferer | TemplateFeatureInferer,
    network,
    prepared: Sequence[Mapping],
    device,
    description: str | None = None,
) -> float:
    """The MRE (mm) of ``inferer`` with ``network`` (set to eval mode) over items ``prepared`` by the run's pipeline
    (the image on the network grid, ``label`` and ``grid_to_physical``), counted on the console as ``description``
    (:func:`bundle.progress.progress`; None: not counted)."""
    if isinstance(network, torch.nn.Module):
        network.eval()
    errors = []
    with torch.no_grad():
        for data in prepared if description is None else progress(prepared, description):
            inputs = data["image"][None].to(device)
            predicted = inferer(inputs, network, grid_to_physical=torch.as_tensor(data["grid_to_physical"])[None])
            errors.append(radial_errors(predicted.double().cpu(), torch.as_tensor(data["label"]).double()[None]))
    return float(torch.cat([e.flatten() for e in errors]).nanmean())


def choose_guard(candidates, inferer, network, items, preprocessing, device) -> dict | None:
    """Set ``inferer``'s guard to the candidate of :func:`guard_candidates` with the lowest MRE on ``items`` and
    return what was chosen and on what (``matching_guard`` in metrics.json and provenance.json); one candidate: set,
    nothing measured, None.

    Args:
        candidates: the settings weighed (:func:`guard_candidates`).
        inferer: an :class:`bundle.inferers.oneshot.OneShotInferer` with its templates set, or a
            :class:`bundle.inferers.oneshot.TemplateFeatureInferer`.
        network: the matching network.
        items: the labelled validation items.
        preprocessing: the run's pipeline (the image on the network grid, ``label`` and ``grid_to_physical``).
        device: where the network runs.
    """

    def use(candidate: Mapping[str, Any]) -> None:
        inferer.contrast_adaptation = candidate["contrast_adaptation"]
        inferer.registration_tolerance = candidate["registration_tolerance"]

    if len(candidates) == 1:
        use(candidates[0])
        return None

    def kind(candidate: Mapping[str, Any]) -> str:
        return "guarded" if guard_on(**candidate) else "plain"

    def score() -> list[float]:
        prepared = [preprocessing(dict(item)) for item in items]  # read once, scored per candidate
        scores = []
        for candidate in candidates:
            use(candidate)
            description = f"matching guard, {kind(candidate)}: validation"
            scores.append(validation_mre(inferer, network, prepared, device, description))
        return scores

    scores = from_rank_0(score)  # under torchrun every process keeps rank 0's choice
    best = min(range(len(scores)), key=scores.__getitem__)
    use(candidates[best])
    inferer.match_scores = None  # the validation volumes' scores are no output of the run (its fingerprint)
    logger.info(
        "contrast_adaptation auto: %s on %d validation image(s) (MRE %s mm)",
        kind(candidates[best]),
        len(items),
        " against ".join(f"{s:.3f}" for s in scores),
    )
    return {
        **candidates[best],
        "validation_images": len(items),
        "validation_mre_mm": [{**c, "mre_mm": round(s, 4)} for c, s in zip(candidates, scores)],
    }


class MatchingGuardHandler:
    """Ignite handler of evaluating that chooses ``inferer``'s guard (:func:`choose_guard`) at the first
    ``Events.STARTED``, after the templates are set (:class:`bundle.handlers.templates.TemplateHandler`), and records
    the choice on ``predictor`` (``matching_guard``) for the report.

    Args:
        candidates: the settings weighed (:func:`guard_candidates`); one: set, nothing measured.
        inferer: the run's :class:`bundle.inferers.oneshot.OneShotInferer`.
        network: the matching network.
        items: the labelled validation items.
        preprocessing: the evaluation's pipeline.
        device: where the network runs.
        predictor: the run's :class:`bundle.pipeline.predictor.Predictor`.
    """

    def __init__(self, candidates, inferer, network, items, preprocessing, device, predictor) -> None:
        self.choice = (list(candidates), inferer, network, list(items), preprocessing, device)
        self.predictor, self.done = predictor, False

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine: Engine) -> None:
        if self.done:
            return
        self.done = True
        self.predictor.matching_guard = choose_guard(*self.choice)
