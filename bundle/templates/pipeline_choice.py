"""Which pipeline predicts a run's landmarks: template matching, or a heatmap detector trained on labels.

``pipeline: auto`` (configs/evaluate.yaml, configs/inference.yaml) takes a detector when one was trained for the
run's landmarks on enough labelled images (:func:`choose_detector`), else matching from the templates at hand.
The rule is the measured ranking of docs/results.md, "The default pipeline at each label count": a detector beats
matching from as many labelled templates at 1 (stage 2's pseudo-labels), 5 and 10 labels, and a detector
fine-tuned on 10 labels beats matching from every template of a larger set.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

from bundle.data.embedded import open_datalist
from bundle.reporting import PIPELINES
from bundle.template_file import load_template
from bundle.templates.detector_data import INFO_FILE, detector_info
from bundle.templates.resolution import labelled_training_items, template_items

logger = logging.getLogger(__name__)

PIPELINE_CHOICES = ("auto", *PIPELINES)
# ``auto`` takes a detector that learnt from this many labelled images whatever the number of templates
ENOUGH_LABELS = 10
# where the default fine-tuning (configs/finetune.yaml) and stage-2 training write their detectors, then the shipped
# stage-2 detector
DEFAULT_DETECTORS = ("output/models/finetune/model.pt", "output/models/stage2/model.pt", "models/stage2/model.pt")


def default_detectors(bundle_root: str | os.PathLike) -> list[str]:
    """The candidates of ``pipeline: auto`` under ``bundle_root`` (:data:`DEFAULT_DETECTORS`), in that order."""
    return [str(Path(bundle_root) / p) for p in DEFAULT_DETECTORS]


def check_pipeline_choice(pipeline: str) -> str:
    """``pipeline`` when it is one of :data:`PIPELINE_CHOICES`, else ValueError naming the key and the value."""
    if pipeline not in PIPELINE_CHOICES:
        raise ValueError(f"pipeline must be one of {PIPELINE_CHOICES}, got {pipeline!r}")
    return pipeline


def template_count(
    datalist: dict | str | os.PathLike | None, max_templates: int, template_path: str | os.PathLike | None = None
) -> int:
    """How many human-labelled images template matching would use: the datalist's own templates, else its
    labelled training items outside the validation and test splits (at most ``max_templates``, as
    :func:`bundle.templates.resolution.resolve_templates` ranks them); with no datalist, the sources of the
    template feature file ``template_path``."""
    if not datalist:
        return len(load_template(template_path)["sources"])
    if not isinstance(datalist, dict):
        datalist = open_datalist(datalist)
    own = template_items(datalist)
    if own:
        return len(own)
    held_out = {it["image"] for split in ("validation", "test") for it in datalist.get(split) or []}
    labelled = [it for it in labelled_training_items(datalist) if it["image"] not in held_out]
    return min(len(labelled), int(max_templates))


def _same_image(image: str, recorded: str) -> bool:
    """Whether ``image`` is the ``recorded`` training image (the same path, or a path ending with a relative one)."""
    image, recorded = Path(image).as_posix(), Path(recorded).as_posix()
    return image == recorded or (not os.path.isabs(recorded) and image.endswith("/" + recorded))


def detector_labels(ckpt_path: str | os.PathLike, landmark_names: Sequence[str], test_images: Sequence[str] = ()):
    """What a detector checkpoint offers a run on ``test_images`` with ``landmark_names``: ``(n_labelled, refusal,
    doubts)``. ``n_labelled``: the human-labelled images behind it
    (:func:`bundle.templates.detector_data.write_detector_info`; 0 when not recorded); ``refusal``: why it cannot
    predict them (no file, other landmarks recorded), else None; ``doubts``: why ``auto`` does not take it (its
    record does not name its landmarks, or a test image is among its training images)."""
    path = Path(ckpt_path)
    if not path.is_file():
        return 0, f"{path}: no such file", []
    info = detector_info(path)
    names = info.get("landmark_names")
    if names and list(names) != list(landmark_names):
        return 0, f"{path}: trained for other landmarks ({len(names)} named in {path.parent / INFO_FILE})", []
    doubts = []
    if not names:
        doubts.append(f"{path}: {path.parent / INFO_FILE} does not name its landmarks (a detector trained before 0.17.0)")
    seen = [t for t in test_images if any(_same_image(str(t), r) for r in info.get("training_images") or [])]
    if seen:
        doubts.append(f"{path}: trained on {len(seen)} of the test images (first: {seen[0]})")
    return int(info.get("n_labelled") or 0), None, doubts


def choose_detector(
    pipeline: str,
    detectors: str | Sequence[str] | None,
    landmark_names: Sequence[str],
    n_templates: int,
    test_images: Sequence[str] = (),
    enough_labels: int = ENOUGH_LABELS,
) -> str | None:
    """The detector checkpoint that predicts the landmarks, or None for template matching.

    ``pipeline``: ``templates`` (None); ``detector``: the candidate of ``detectors`` with the most labels that
    :func:`detector_labels` does not refuse (its doubts logged as warnings; ValueError naming each candidate and why
    when none is left); ``auto``: the candidate with the most labels that has neither a refusal nor a doubt, when it
    learnt from at least as many human-labelled images as the ``n_templates`` templates at hand, or from
    ``enough_labels`` or more, else None. The first of equals wins (list fine-tuned detectors before stage-2 ones)."""
    check_pipeline_choice(pipeline)
    if pipeline == "templates":
        return None
    candidates = [detectors] if isinstance(detectors, (str, os.PathLike)) else list(detectors or [])
    forced = pipeline == "detector"
    usable, reasons = [], []
    for path in candidates:
        n_labelled, refusal, doubts = detector_labels(path, landmark_names, test_images)
        if refusal is None and (forced or not doubts):
            usable.append((n_labelled, str(path), doubts))
        reasons += [refusal] if refusal else doubts
    best = max(usable, key=lambda u: u[0], default=None)  # max keeps the first of equals
    if forced:
        if best is None:
            raise ValueError(f"pipeline 'detector': no usable detector in detectors={candidates}: {'; '.join(reasons)}")
        for doubt in best[2]:
            logger.warning("pipeline detector: %s", doubt)
        return best[1]
    if best is not None and (best[0] >= n_templates or best[0] >= enough_labels):
        logger.info("pipeline auto: the detector %s (%d labelled images; %d templates)", best[1], best[0], n_templates)
        return best[1]
    logger.info(
        "pipeline auto: template matching from %d templates%s",
        n_templates,
        f" (the detector {best[1]} learnt from {best[0]} labelled images)" if best else "",
    )
    return None
