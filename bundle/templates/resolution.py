"""The templates of one-shot (k-shot) detection, as datalist items, and their preparation for the inferer.

Which items are templates: the datalist's own (``templates`` / ``template``), else the best-ranked of its
labelled training items (:func:`ranked_templates`, by the criteria of :mod:`bundle.templates.selection`),
plus pseudo-templates labelled by matching (:func:`resolve_templates`); :func:`with_templates` gives them,
prepared by the evaluation pipeline, to a :class:`bundle.inferers.oneshot.OneShotInferer`.
"""

from __future__ import annotations

import logging
import os

import torch
from bundle.data.datalist import carries_landmarks
from bundle.geometry import grid_landmarks
from bundle.inferers.oneshot import OneShotInferer
from bundle.passes import map_shards
from bundle.progress import progress
from bundle.settings import as_number
from bundle.templates.pseudo_labels import pseudo_label, select_pseudo_templates
from bundle.templates.selection import select_template, select_template_by_landmarks
from bundle.transforms.landmarks import TEMPLATE_KEY

# how many training images at most take part in ranking the template candidates (labelled ones first)
RANKED_POOL = 32


def prepare_template(item: dict, preprocessing) -> tuple[torch.Tensor, torch.Tensor]:
    """The template's network-grid image ``(1, 1, *S)`` and its landmarks ``(L, D)`` in grid positions.

    ``preprocessing`` is the evaluation pipeline (it must end with ``LandmarkTargetsd``, which checks the item as a
    template: :func:`bundle.transforms.landmarks.check_landmarks`).
    """
    if not item.get("landmarks"):
        raise ValueError(f"the template {item.get('image')} carries no 'landmarks'")
    data = preprocessing({**item, TEMPLATE_KEY: True})
    return torch.as_tensor(data["image"]).unsqueeze(0), grid_landmarks(data)[0]


def held_out_images(datalist: dict) -> set[str]:
    """The images of the datalist's validation and test splits (never a template's, a pseudo-label's or a
    detector's training image)."""
    return {it["image"] for split in ("validation", "test") for it in datalist.get(split) or []}


def labelled_training_items(datalist: dict) -> list[dict]:
    """The datalist's training items that carry at least one landmark (the template candidates)."""
    return [it for it in datalist.get("training", []) if carries_landmarks(it)]


def template_items(datalist: dict) -> list[dict]:
    """The datalist's own templates: its ``templates`` list, then its ``template`` item unless listed already."""
    listed = [dict(it) for it in datalist.get("templates") or []]
    single = datalist.get("template")
    if single is not None and all(it["image"] != single["image"] for it in listed):
        listed.append(dict(single))
    return listed


def default_template(datalist: dict) -> dict:
    """The datalist's first labelled training item (the template when the datalist names none)."""
    labelled = labelled_training_items(datalist)
    if not labelled:
        raise ValueError(
            "the datalist has no 'template' or 'templates' and no training item with 'landmarks' to serve as one"
        )
    return dict(labelled[0])


def default_templates(datalist: dict) -> list[dict]:
    """The datalist's templates (:func:`template_items`), else its first labelled training item (validation).

    Args:
        datalist: the run's datalist.
    """
    return template_items(datalist) or [default_template(datalist)]


def with_templates(inferer, items: list[dict], preprocessing, device: torch.device | str):
    """Give ``inferer`` (a ``bundle.inferers.oneshot.OneShotInferer``) the template ``items`` and return it.

    Args:
        inferer: the matching inferer.
        items: the template items (image and landmarks).
        preprocessing: the matching's preprocessing of an item.
        device: where the templates' images and landmarks go.
    """
    prepared = [prepare_template(item, preprocessing) for item in progress(items, "templates")]
    inferer.set_templates([image.to(device) for image, _ in prepared], [points.to(device) for _, points in prepared])
    return inferer


TEMPLATE_RULES = ("landmarks", "features")


def check_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`TEMPLATE_RULES`, else ValueError naming it (checked also where a named
    template leaves the rule unused: a typo is not silently ignored)."""
    if rule not in TEMPLATE_RULES:
        raise ValueError(f"template rule must be one of {TEMPLATE_RULES}, got {rule!r}")
    return rule


def ranked_templates(
    datalist: dict,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str,
    max_images: int = RANKED_POOL,
    rule: str = "landmarks",
) -> list[dict]:
    """The datalist's labelled training items that may be templates, best first by ``rule`` (at least 2 of them).

    ``rule``: ``"landmarks"`` ranks by how close an item's landmarks, matched one-shot into each other candidate,
    land to that candidate's own landmarks (:func:`bundle.templates.selection.select_template_by_landmarks`);
    ``"features"`` reads no landmark and ranks by how well an item's features match the other training images
    (:func:`bundle.templates.selection.select_template`, Quan et al. CVPR 2022), the choice of which image to
    annotate. At most ``max_images`` training images (the labelled ones first) take part, to bound the cost.
    """
    check_rule(rule)
    labelled = labelled_training_items(datalist)
    unlabelled = [it for it in datalist["training"] if it not in labelled]
    pool = (labelled if rule == "landmarks" else labelled + unlabelled)[: max(max_images, 2)]
    candidates = [i for i, it in enumerate(pool) if it in labelled]
    # each process its share of the candidates under torchrun (bundle.passes.map_shards)
    prepared = map_shards(lambda it: preprocessing(dict(it)), pool, "template candidates")
    images = [torch.as_tensor(d["image"]).to(device) for d in prepared]
    network.eval()
    with torch.no_grad():
        if rule == "landmarks":
            points, matrices = zip(*(grid_landmarks(d) for d in prepared))
            _, errors = select_template_by_landmarks(network, images, points, matrices)
            order = sorted(candidates, key=lambda i: errors[i] if errors[i] == errors[i] else float("inf"))
            how = f"mean one-shot error {errors[order[0]]:.2f} mm over the other {len(pool) - 1} candidates"
        else:
            _, scores = select_template(network, images, candidates=candidates)
            order = [candidates[j] for j in sorted(range(len(candidates)), key=lambda j: -scores[j])]
            how = f"score {scores[candidates.index(order[0])]:.3f}, no landmark read"
    logging.getLogger(__name__).info(
        "templates ranked among %d labelled training items (rule %r): first %s (%s)",
        len(candidates),
        rule,
        pool[order[0]]["image"],
        how,
    )
    return [dict(pool[i]) for i in order]


def resolve_template(
    datalist: dict,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str,
    max_images: int = RANKED_POOL,
    rule: str = "landmarks",
) -> dict:
    """The evaluation template: the datalist's ``template``, else the labelled training item that
    :func:`ranked_templates` ranks first by ``rule``."""
    check_rule(rule)
    if datalist.get("template") is not None:
        return dict(datalist["template"])
    if len(labelled_training_items(datalist)) < 2:
        return default_template(datalist)
    return ranked_templates(datalist, network, preprocessing, device, max_images, rule)[0]


def pseudo_template_pool(datalist: dict, templates: list[dict]) -> list[dict]:
    """Training items that may become pseudo-templates, their landmarks dropped: not a template and not an
    image of the validation or test split (those are never used to label the test images)."""
    taken = held_out_images(datalist) | {it["image"] for it in templates}
    return [
        {k: v for k, v in it.items() if k != "landmarks"}
        for it in datalist.get("training", [])
        if it["image"] not in taken
    ]


def without_test_images(templates: list[dict], datalist: dict) -> list[dict]:
    """``templates`` less those whose image is also a ``test`` item (a score measured on its own template),
    each left out with a warning naming it; none left raises ``ValueError`` naming them."""
    tested = {os.path.realpath(it["image"]) for it in datalist.get("test") or []}
    kept = [t for t in templates if os.path.realpath(t["image"]) not in tested]
    left_out = [t["image"] for t in templates if os.path.realpath(t["image"]) in tested]
    if left_out and not kept:
        raise ValueError(
            f"every template is also a test image ({left_out}): the test would score each image against itself; "
            "take the template(s) out of the 'test' list"
        )
    for image in left_out:
        logging.getLogger(__name__).warning(
            "template %s is also a test image: left out of the templates (a test image is never its own template)",
            image,
        )
    return kept


def resolve_templates(
    datalist: dict,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str,
    rule: str = "landmarks",
    max_images: int = RANKED_POOL,
    max_templates: int = 1,
    pseudo_candidates: int = 0,
    pseudo_templates: int = 0,
    cycle_tolerance: float = 2.0,
    combine: str = "weighted_geometric_median",
    pseudo_max_labelled: int | None = None,
) -> list[dict]:
    """The evaluation templates: the datalist's ``templates`` / ``template`` (k-shot), else the ``max_templates``
    labelled training items that :func:`ranked_templates` ranks best by ``rule`` (one: :func:`resolve_template`);
    then, when ``pseudo_templates`` > 0 and those labelled templates number at most ``pseudo_max_labelled`` (None:
    any number), that many pseudo-templates, each marked ``"pseudo_label": True``.

    Pseudo-templates: the first ``pseudo_candidates`` images of :func:`pseudo_template_pool` are labelled by
    matching from the templates (combined by ``combine``) and the ``pseudo_templates`` most reliable ones are
    added by forward-backward cycle error, each without its landmarks whose cycle error exceeds
    ``cycle_tolerance`` grid pixels (:func:`bundle.templates.pseudo_labels.select_pseudo_templates`).

    Args:
        datalist: the run's datalist.
        network: the contrastive network that matches.
        preprocessing: the matching's preprocessing of an item.
        device: where the matching runs.
        rule: ``landmarks`` or ``features`` (:func:`ranked_templates`).
        max_images: the most training images ranked.
        max_templates: the most labelled templates chosen (>= 1).
        pseudo_candidates: the images labelled by matching to draw pseudo-templates from (>= 0).
        pseudo_templates: the pseudo-templates added (>= 0).
        cycle_tolerance: the largest forward-backward cycle error (grid pixels) of a pseudo-template's landmark
            kept.
        combine: how the templates' predictions combine per landmark (:data:`bundle.kshot.COMBINE_RULES`).
        pseudo_max_labelled: the most labelled templates with which pseudo-templates are added, None: any number.

    Returns:
        the template items, test images left out.

    Raises:
        ValueError: a count out of range, or an unknown ``rule``.
    """
    if pseudo_templates < 0 or pseudo_candidates < 0:
        raise ValueError(
            f"pseudo_candidates and pseudo_templates must be >= 0, got {pseudo_candidates}, {pseudo_templates}"
        )
    if pseudo_max_labelled is not None:
        pseudo_max_labelled = as_number(pseudo_max_labelled, "pseudo_max_labelled", minimum=0, integer=True)
    if max_templates < 1:
        raise ValueError(f"max_templates must be >= 1, got {max_templates}")
    check_rule(rule)
    templates = template_items(datalist)
    if not templates and max_templates > 1 and len(labelled_training_items(datalist)) >= 2:
        templates = ranked_templates(datalist, network, preprocessing, device, max_images, rule)[:max_templates]
    elif not templates:
        templates = [resolve_template(datalist, network, preprocessing, device, max_images, rule)]
    templates = without_test_images(templates, datalist)
    if pseudo_templates == 0 or (pseudo_max_labelled is not None and len(templates) > pseudo_max_labelled):
        return templates
    pool = pseudo_template_pool(datalist, templates)[:pseudo_candidates]
    if len(pool) < pseudo_templates:
        logging.getLogger(__name__).warning(
            "pseudo_templates=%d but only %d training images outside the templates and the validation/test splits "
            "(pseudo_candidates=%d): all of them are labelled and kept",
            pseudo_templates,
            len(pool),
            pseudo_candidates,
        )
    if not pool:
        return templates
    inferer = with_templates(OneShotInferer(template_combine=combine), templates, preprocessing, device)
    labelled = pseudo_label(network, inferer, pool, preprocessing, device)
    chosen = select_pseudo_templates(labelled, min(pseudo_templates, len(pool)), cycle_tolerance)
    return templates + [dict(item, pseudo_label=True) for item in chosen]
