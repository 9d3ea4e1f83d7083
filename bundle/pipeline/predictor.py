"""What predicts a run's landmarks, built in one place (:func:`build_predictor`) for evaluating and inferring (the
MONAI Label app builds its matching inferer from the same keys): the pipeline that
:func:`bundle.pipeline.choice.choose_detector` takes (a heatmap detector or template matching), its network with its
weights, the preprocessing on that network's grid, its inferer, XFeat's fine step after it
(:func:`bundle.pipeline.choice.prediction_refinement`) and what the reports say ran."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import torch
from bundle.data.datalist import carries_landmarks
from bundle.data.embedded import open_datalist
from bundle.handlers.templates import TemplateHandler
from bundle.inferers.heatmap import HeatmapInferer
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer
from bundle.inferers.refinement import DescriptorRefinement, RefiningInferer
from bundle.journal import fingerprint
from bundle.pipeline.choice import ENOUGH_LABELS, choose_detector, prediction_refinement
from bundle.pipeline.detector_data import detector_grid, detector_templates, load_detector
from bundle.pipeline.matching_guard import MatchingGuardHandler, choose_guard, guard_candidates, weighs_validation
from bundle.reporting import run_provenance
from bundle.transforms.utils import on_grid
from monai.data import Dataset
from monai.transforms import Compose


@dataclasses.dataclass
class Predictor:
    """What predicts: ``pipeline`` (``detector`` or ``templates``), the ``checkpoint`` of its weights, its
    ``network``, the ``preprocessing`` on that network's grid, the pipeline's ``inferer`` (the confidence check reads
    its scores), the ``refinement`` after it (None: none) and ``refining_inferer``, the two together (the
    evaluator's). ``templates`` / ``pseudo_templates`` name the template images (a detector's: those that made its
    pseudo-labels); ``handlers`` run as the evaluation starts (the choice of the templates to match from, and of 3D
    matching's guard); ``matching_guard`` records the guard's choice (evaluating's as it starts, inferring's as its
    predictor is built; None where nothing was chosen)."""

    pipeline: str
    checkpoint: str
    network: torch.nn.Module
    preprocessing: Compose
    inferer: Any
    refinement: DescriptorRefinement | None
    templates: list[str]
    pseudo_templates: list[str]
    handlers: list
    matching_guard: dict | None = None
    refining_inferer: RefiningInferer = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.refining_inferer = RefiningInferer(self.inferer, self.refinement)

    def provenance(self) -> dict[str, Any]:
        """What made the predictions, for metrics.json and provenance.json (:func:`bundle.reporting.run_provenance`)."""
        settings = self.refinement.settings() if self.refinement is not None else None
        return run_provenance(
            self.pipeline, self.templates, self.checkpoint, self.pseudo_templates, settings, self.matching_guard
        )

    def dataset(self, items: Sequence[Mapping]) -> Dataset:
        """MONAI's ``Dataset`` of ``items`` (datalist items) prepared by :attr:`preprocessing`."""
        return Dataset(list(items), transform=self.preprocessing)

    def fingerprint(self) -> str:
        """A hash of what predicts (:func:`bundle.journal.fingerprint`): the provenance, the network's weights, the
        preprocessing's and the inferer's settings (the template features matched from); equal for two runs that
        predict alike, so that inferring reuses the predictions of an earlier run into its output folder."""
        return fingerprint(
            provenance=self.provenance(), network=self.network, preprocessing=self.preprocessing, inferer=self.inferer
        )


def build_predictor(
    pipeline: str,
    detectors: Sequence[str],
    landmark_names: Sequence[str],
    spatial_dims: int,
    datalist: dict | str | os.PathLike | None,
    encoder: torch.nn.Module,
    ckpt_path: str | os.PathLike,
    preprocessing: Compose,
    device: torch.device | str,
    backbone: str,
    embed_dim: int,
    strides: Sequence[int],
    max_templates: int,
    template_combine: str,
    shift_tta: int,
    xfeat_refinement: bool | str,
    load_transforms: Sequence | None = None,
    choose_templates: Callable[[], list[dict]] | None = None,
    template_features: Callable[[], dict] | None = None,
    contrast_adaptation: bool | str = False,
    registration_tolerance: float | None = None,
    test_items: Sequence[Mapping] = (),
    builtin: str | os.PathLike | None = None,
    enough_labels: int = ENOUGH_LABELS,
) -> Predictor:
    """The :class:`Predictor` of a run (configs/evaluate.yaml, configs/inference.yaml).

    Args:
        pipeline: ``auto``, ``detector`` or ``templates``: the choice among ``detectors`` by
            :func:`bundle.pipeline.choice.choose_detector`.
        detectors: the candidate detector checkpoints.
        landmark_names: the run's landmarks (a detector must have been trained for them).
        spatial_dims: 2 or 3.
        datalist: the run's datalist (its labels at hand); None: inferring from a template file.
        encoder: the contrastive network with the weights of ``ckpt_path``, which matching uses.
        ckpt_path: the contrastive network's weights, named in the report when matching predicts.
        preprocessing: the matching network's (load, grey, [0, 1], its grid); a detector's is moved to the grid
            recorded beside it.
        device: where the networks run.
        backbone, embed_dim, strides: a detector's network settings where its record lacks them.
        max_templates: the most templates taken from the datalist's labelled training items: what ``auto`` weighs
            a detector's labels against, the refinement's templates.
        template_combine: how several templates' votes combine (matching and the refinement).
        shift_tta: a detector's test-time shifts (:class:`bundle.inferers.heatmap.HeatmapInferer`).
        xfeat_refinement: ``auto``, true or false (:func:`bundle.pipeline.choice.prediction_refinement`).
        load_transforms: how the refinement reads an image file.
        choose_templates: evaluating: the template items matched from, chosen as the evaluation starts (a
            :class:`bundle.handlers.templates.TemplateHandler`), matched by a
            :class:`bundle.inferers.oneshot.OneShotInferer`.
        template_features: inferring: the template features matched from (called only when matching), by a
            :class:`bundle.inferers.oneshot.TemplateFeatureInferer`.
        contrast_adaptation: matching also from the inputs mapped to the first template's contrast; ``auto``: in 3D,
            with ``registration_tolerance``, where the datalist's labelled validation images measure it better
            (:mod:`bundle.pipeline.matching_guard`: as evaluating starts, as inferring's predictor is built; checked
            as the command starts, :data:`bundle.settings.SETTINGS`).
        registration_tolerance: matching falls back to the registered template's landmarks beyond this many grid
            pixels (None: no registration).
        test_items: the items predicted (datalist items); ``auto`` takes no detector trained on one of their images
            (``detector`` warns).
        builtin: the shipped template file when inferring from it (:func:`bundle.pipeline.choice.builtin_templates`),
            whose shipped detectors ``auto`` weighs without a datalist.
        enough_labels: ``auto`` takes a detector that learnt from this many labelled images whatever the number of
            templates.

    Returns:
        the run's :class:`Predictor`.

    Raises:
        ValueError: neither or both of ``choose_templates`` and ``template_features`` given.
    """
    if (choose_templates is None) == (template_features is None):
        raise ValueError("build_predictor: give either choose_templates (evaluating) or template_features (inferring)")
    test_images = [str(it["image"]) for it in test_items]
    detector = choose_detector(
        pipeline, detectors, landmark_names, spatial_dims, datalist, max_templates, test_images, enough_labels, builtin
    )
    refinement = prediction_refinement(
        xfeat_refinement, detector, datalist, max_templates, spatial_dims, template_combine, load_transforms
    )
    if detector is not None:
        grid = detector_grid(detector)
        network = load_detector(detector, device, grid, spatial_dims, len(landmark_names), backbone, embed_dim, strides)
        return Predictor(
            "detector",
            str(detector),
            network,
            preprocessing if grid is None else on_grid(preprocessing, grid),
            HeatmapInferer(shift_tta=shift_tta),
            refinement,
            detector_templates(detector),
            [],
            [],
        )
    # the datalist's labelled validation images, read only where the guard is weighed on them (auto, 3D)
    validation = _labelled_validation(datalist) if weighs_validation(contrast_adaptation, spatial_dims) else []
    if template_features is not None:
        features = template_features()
        # the guard registers the template image that features computed from a datalist carry (a file's do not)
        weighed = validation if "registration_image" in features else []
        candidates = guard_candidates(contrast_adaptation, registration_tolerance, spatial_dims, weighed)
        inferer = TemplateFeatureInferer(features, template_combine, **candidates[0])
        sources, pseudo = list(features["sources"]), list(features.get("pseudo_sources", []))
        predictor = Predictor(
            "templates", str(ckpt_path), encoder, preprocessing, inferer, refinement, sources, pseudo, []
        )
        predictor.matching_guard = choose_guard(candidates, inferer, encoder, weighed, preprocessing, device)
        return predictor
    candidates = guard_candidates(contrast_adaptation, registration_tolerance, spatial_dims, validation)
    inferer = OneShotInferer(template_combine=template_combine, **candidates[0])
    predictor = Predictor("templates", str(ckpt_path), encoder, preprocessing, inferer, refinement, [], [], [])
    predictor.handlers.append(TemplateHandler(choose_templates, inferer, preprocessing, device, predictor))
    predictor.handlers.append(
        MatchingGuardHandler(candidates, inferer, encoder, validation, preprocessing, device, predictor)
    )
    return predictor


def _labelled_validation(datalist: dict | str | os.PathLike | None) -> list[dict]:
    """The validation items of ``datalist`` (a dict, a file, or None) that carry a landmark."""
    if not datalist:
        return []
    if not isinstance(datalist, Mapping):
        datalist = open_datalist(datalist)
    return [it for it in datalist.get("validation") or [] if carries_landmarks(it)]
