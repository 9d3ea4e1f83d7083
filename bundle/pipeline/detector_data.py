"""The stage-2 detector's training items (CC2D's second stage; the supervised fine-tuning) and their record.

- :func:`pseudo_labelled_items`: the training items labelled by (k-shot) matching from the templates
  (:func:`bundle.templates.pseudo_labels.pseudo_label`), optionally without their landmarks whose
  forward-backward cycle error exceeds a tolerance; written as an inspectable datalist;
- :func:`labelled_items`: the human-labelled training items of a fine-tuning;
- ``detector_info.json`` beside the detector's checkpoints: what it learnt from (the templates that made its
  pseudo-labels, its labelled and training images), its landmarks, network settings and the grid it was trained
  on; :func:`detector_grid` gives that grid to the evaluation, :func:`load_detector` refuses to run it on another,
  :func:`recorded_detector` rebuilds its network, and ``bundle.pipeline.choice`` reads the rest;
- :func:`finetune_grid` and :func:`follow_grid`: the fine-tuned detector's grid by its number of labels, and the
  settings in grid pixels that follow it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from bundle.checkpoints import RECORD_KEY, UndescribedCheckpointError, describes, load_weights, read_record
from bundle.data.datalist import read_json
from bundle.distributed import rank
from bundle.inferers.oneshot import OneShotInferer
from bundle.inferers.refinement import DescriptorRefinement
from bundle.io_utils import write_json_atomic
from bundle.networks.detector import HeatmapDetector, load_stage1_encoder
from bundle.passes import map_shards
from bundle.settings import as_flag, check_image_size, is_unset
from bundle.templates.pseudo_labels import pseudo_label, reliable_landmarks
from bundle.templates.resolution import held_out_images, labelled_training_items, resolve_templates, with_templates

logger = logging.getLogger(__name__)


INFO_FILE = "detector_info.json"


def _kept_landmarks(items: Sequence[dict]) -> tuple[int, int]:
    """``(landmarks not null, all landmarks)`` over ``items``."""
    return sum(p is not None for it in items for p in it["landmarks"]), sum(len(it["landmarks"]) for it in items)


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
    refinement: DescriptorRefinement | None = None,
) -> list[dict]:
    """Every training item labelled by matching from ``templates`` with the stage-1 ``network`` (CC2D stage 2).

    The human-labelled templates keep their own landmarks; every other training item is labelled by k-shot
    matching (:func:`bundle.templates.pseudo_labels.pseudo_label`; its own landmarks, if any, are not read). With
    ``cycle_tolerance`` (grid pixels), a landmark whose forward-backward cycle error exceeds it becomes
    ``null`` (left out of the loss, :func:`bundle.templates.pseudo_labels.reliable_landmarks`). Images of the
    validation and test splits are left out (``exclude_held_out``), so that the detector never trains on
    the images it is measured on. ``refinement`` (2D; not in the paper): each pseudo-labelled image's landmarks
    moved by the XFeat fine step from the human-labelled templates, the pseudo-templates' too once they have served as
    templates (validation: docs/results.md, "A pretrained fine step"). ``output_path``: the pseudo-labelled datalist
    is written there (atomic; by rank 0 alone under torchrun, where each process labels and refines its share of the
    images and every one returns all the items), with the per-landmark cycle errors and the refinement's settings under
    ``pseudo_labels``.
    """

    template_images = {t["image"] for t in templates}
    held_out = held_out_images(datalist) if exclude_held_out else set()
    pool = [
        {k: v for k, v in it.items() if k != "landmarks"}
        for it in datalist.get("training", [])
        if it["image"] not in template_images and it["image"] not in held_out
    ]
    inferer = with_templates(OneShotInferer(template_combine=combine), list(templates), preprocessing, device)
    labelled = pseudo_label(network, inferer, pool, preprocessing, device)
    if refinement is not None:
        # the spacing the pipeline read (a DICOM header's when the datalist gives none); each process its share
        labelled = map_shards(
            lambda entry: {**entry, "item": refinement.refine_item(entry["item"], entry["spacing"])},
            labelled,
            "XFeat refinement",
        )
        logger.info("stage 2: %d pseudo-labelled images refined by XFeat", len(labelled))
    items = [dict(t) for t in templates]
    if refinement is not None:  # the pseudo-templates' training labels, at the spacing the pipeline reads
        items = [
            refinement.refine_item(t, preprocessing(dict(t))["spacing"]) if t.get("pseudo_label") else t for t in items
        ]
    cycle = {}
    for entry in labelled:
        item = entry["item"] if cycle_tolerance is None else reliable_landmarks(entry, float(cycle_tolerance))
        items.append(item)
        cycle[item["image"]] = [None if not np.isfinite(e) else round(float(e), 4) for e in entry["cycle_error"]]
    logger.info(
        "stage 2: %d training images (%d template(s) + %d pseudo-labelled), %d of %d landmarks kept",
        len(items),
        len(templates),
        len(labelled),
        *_kept_landmarks(items),
    )
    if output_path is not None and rank() == 0:  # under torchrun, every process holds the same items
        out = {k: v for k, v in datalist.items() if k not in ("training",)}
        out["training"] = items
        out["pseudo_labels"] = {
            "templates": [t["image"] for t in templates],
            "cycle_tolerance": cycle_tolerance,
            "cycle_error": cycle,
            "xfeat_refinement": refinement.settings() if refinement is not None else None,
        }
        write_json_atomic(output_path, out)
        logger.info("pseudo-label datalist written to %s", output_path)
    return items


def detector_record(
    templates: Sequence[dict] | None,
    labels: str,
    items: Sequence[dict],
    image_size: Sequence[int],
    landmark_names: Sequence[str],
    network: dict,
    init_weights: str | Path | None = None,
) -> dict:
    """What a detector is and what it learnt from, as its training writes it beside each of its checkpoints
    (``{"file": "detector_info.json", "content": ...}``: the ``record`` of
    :class:`bundle.handlers.checkpoints.AtomicCheckpointSaver`, which adds the ``checkpoints`` it describes). The
    content: ``labels`` (``pseudo`` or ``human``), the ``templates`` that made its pseudo-labels (empty for human
    labels), its ``labelled_images`` (the human-labelled ones: the training ``items`` for human labels, the templates
    that are not pseudo-templates for pseudo-labels) and their number ``n_labelled``, its ``training_images`` (real
    paths), the grid ``image_size``, its ``landmark_names``, the ``network`` settings of
    :class:`bundle.networks.detector.HeatmapDetector` (:func:`recorded_detector`) and ``init_weights``, the detector
    it continued (real path; null: it started from a stage-1 encoder or at random).

    Args:
        templates: the templates that made the pseudo-labels (None or empty: human labels).
        labels: ``detector_labels``: ``pseudo`` or ``human``.
        items: the detector's training items.
        image_size: the grid it is trained on.
        landmark_names: its landmarks.
        network: its :class:`bundle.networks.detector.HeatmapDetector` settings (``detector_network``).
        init_weights: the detector it continues, None: none.
    """
    templates = list(templates or [])
    labelled = items if labels == "human" else [t for t in templates if not t.get("pseudo_label")]
    content = {
        "labels": labels,
        "templates": [t["image"] for t in templates],
        "n_labelled": len(labelled),
        "labelled_images": [os.path.realpath(it["image"]) for it in labelled],
        "training_images": [os.path.realpath(it["image"]) for it in items],
        "image_size": [int(v) for v in image_size],
        "landmark_names": [str(n) for n in landmark_names],
        "network": {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in network.items()},
        "init_weights": os.path.realpath(init_weights) if init_weights else None,
    }
    return {"file": INFO_FILE, "content": content}


def write_detector_info(ckpt_dir: str | Path, *args, **kwargs) -> Path:
    """``ckpt_dir/detector_info.json`` holding :func:`detector_record`'s content (the other arguments are its), without
    ``checkpoints``: a record of every checkpoint in ``ckpt_dir`` (one written for checkpoints made elsewhere)."""
    return write_json_atomic(Path(ckpt_dir) / INFO_FILE, detector_record(*args, **kwargs)["content"])


def detector_info(ckpt_path: str | Path) -> dict:
    """The record :func:`detector_record` made beside ``ckpt_path``; ``{}`` when there is none. An unreadable one,
    and one that does not name ``ckpt_path`` among its ``checkpoints`` (a later training in that folder wrote it, and
    the file holds an earlier training's weights: :class:`bundle.checkpoints.UndescribedCheckpointError`) raise
    an error naming them."""
    path = Path(ckpt_path)
    record_path = path.parent / INFO_FILE
    if not record_path.is_file():
        return {}
    info = read_record(record_path, "detector record")
    if not describes(info, path):
        raise UndescribedCheckpointError(
            f"{path} is not among the checkpoints its record {record_path} describes "
            f"({', '.join(info[RECORD_KEY]) or 'none'}): a later training in that folder wrote the record and has not "
            "replaced this file, which holds an earlier training's weights; use a checkpoint the record names, or "
            "train again"
        )
    return info


def detector_templates(ckpt_path: str | Path) -> list[str]:
    """The templates recorded beside a detector checkpoint (:func:`write_detector_info`); ``[]`` when none."""
    return list(detector_info(ckpt_path).get("templates") or [])


def detector_grid(ckpt_path: str | Path) -> list[int] | None:
    """The grid a detector checkpoint was trained on (:func:`write_detector_info`), None for a checkpoint without a
    record (it runs on the pipeline's own grid)."""
    trained = detector_info(ckpt_path).get("image_size")
    return [int(v) for v in trained] if trained is not None else None


def recorded_detector(
    ckpt_path: str | Path, spatial_dims: int, n_landmarks: int, backbone: str, embed_dim: int, strides: Sequence[int]
) -> HeatmapDetector:
    """The :class:`bundle.networks.detector.HeatmapDetector` of ``ckpt_path`` (weights not loaded) with the
    ``network`` settings and as many landmarks as recorded beside it; a record without them (before 0.17.0) takes
    the given settings and the detector's default ``head_channels``."""
    settings = {
        "spatial_dims": int(spatial_dims),
        "n_landmarks": int(n_landmarks),
        "backbone": backbone,
        "embed_dim": int(embed_dim),
        "strides": list(strides),
    }
    info = detector_info(ckpt_path)
    settings.update(info.get("network") or {})
    if info.get("landmark_names"):
        settings["n_landmarks"] = len(info["landmark_names"])
    return HeatmapDetector(**settings)


# the fine-tuned detector's grid is FINE_GRID_SCALE times finer from FINE_GRID_LABELS human labels on (2D)
FINE_GRID_LABELS = 10
FINE_GRID_SCALE = 1.5


def finetune_grid(n_labelled: int, image_size: Sequence[int], spatial_dims: int) -> list[int]:
    """The grid of a detector fine-tuned on ``n_labelled`` human labels: the network grid ``image_size``, or in 2D
    from :data:`FINE_GRID_LABELS` labels on, :data:`FINE_GRID_SCALE` times it (rounded to the encoder's stride 16). A
    finer grid places the peaks more finely but confuses similar structures more often with few labels
    (docs/results.md, "The grid grows with the labels": chosen on validation images at 5 and 10 labels over two
    seeds).

    Args:
        n_labelled: the fine-tuning's number of human-labelled images.
        image_size: train.yaml's network grid.
        spatial_dims: 2 or 3.
    """
    base = check_image_size(image_size, spatial_dims)
    if spatial_dims != 2 or n_labelled < FINE_GRID_LABELS:
        return base
    return check_image_size([int(round(v * FINE_GRID_SCALE / 16)) * 16 for v in base], spatial_dims)


def follow_grid(length: float, detector_grid: Sequence[int], image_size: Sequence[int]) -> float:
    """A ``length`` in pixels of the network grid ``image_size`` (train_stage2.yaml's ``heatmap_sigma``,
    ``affine_translate``) in pixels of ``detector_grid``, so that it stays the same in mm (by the first axis: a length
    in grid pixels is one number for every axis).

    Args:
        length: the length on ``image_size``.
        detector_grid: the detector's grid.
        image_size: the network grid the length is given on.
    """
    return float(length) * float(detector_grid[0]) / float(image_size[0])


def load_detector(
    ckpt_path: str | Path,
    device: torch.device | str,
    image_size: Sequence[int] | None,
    spatial_dims: int,
    n_landmarks: int,
    backbone: str,
    embed_dim: int,
    strides: Sequence[int],
) -> torch.nn.Module:
    """The detector of ``ckpt_path`` (:func:`recorded_detector`, the other arguments its fallback settings) with its
    weights, to run on the grid ``image_size``. A detector finds its landmarks at the scale it was trained on: a grid
    other than the one recorded beside the checkpoint (:func:`write_detector_info`; none recorded: not checked) is
    refused, naming both and the key to set."""
    trained = detector_info(ckpt_path).get("image_size")
    if trained is not None and [int(v) for v in trained] != [int(v) for v in image_size]:
        raise ValueError(
            f"the detector {ckpt_path} was trained on the grid {list(trained)} ({Path(ckpt_path).parent / INFO_FILE}) "
            f"but image_size is {list(image_size)}: leave --image_size out (the evaluation takes the recorded grid) or "
            f'pass --image_size "{list(trained)}"'
        )
    network = recorded_detector(ckpt_path, spatial_dims, n_landmarks, backbone, embed_dim, strides)
    return load_weights(network, ckpt_path, device)


def labelled_items(datalist: dict, n_labelled: int | None = None) -> list[dict]:
    """The first ``n_labelled`` (None = all) labelled training items outside the validation and test splits
    (the human labels of fine-tuning).

    Args:
        datalist: the run's datalist.
        n_labelled: how many items, None: all.

    Raises:
        ValueError: ``n_labelled`` below 1 or above the number of labelled training items.
    """

    held_out = held_out_images(datalist)
    items = [dict(it) for it in labelled_training_items(datalist) if it["image"] not in held_out]
    if n_labelled is not None:
        if n_labelled < 1:
            raise ValueError(f"n_labelled must be >= 1 or null, got {n_labelled}")
        if n_labelled > len(items):
            raise ValueError(f"n_labelled={n_labelled} but the datalist has only {len(items)} labelled training items")
        items = items[: int(n_labelled)]
    return items


def read_pseudo_labels(path: str | Path, cycle_tolerance: float | None = None) -> list[dict]:
    """The training items of a pseudo-label datalist written by :func:`pseudo_labelled_items` (to reuse or
    edit the pseudo-labels without matching again; an edited landmark keeps its recorded cycle error); image paths as
    written there.

    With ``cycle_tolerance`` (grid pixels) the pseudo-labelled landmarks whose recorded cycle error exceeds it
    become ``null``, as :func:`pseudo_labelled_items` does; the templates keep theirs. A file written with a
    stricter tolerance is refused: the landmarks it left out cannot be restored.
    """
    data = _read_pseudo_label_file(path)
    items = [dict(it) for it in data["training"]]
    if cycle_tolerance is None:
        return items
    written = data["pseudo_labels"].get("cycle_tolerance")
    if written is not None and float(written) < float(cycle_tolerance):
        raise ValueError(
            f"{path} was written with pseudo_label_tolerance {written}: its pseudo-labels cannot be kept up to "
            f"the looser {cycle_tolerance}; make them again (pseudo_labels: null)"
        )
    cycle = data["pseudo_labels"].get("cycle_error")
    if not isinstance(cycle, dict):
        raise ValueError(f"{path}: no per-image cycle errors under pseudo_labels.cycle_error to apply the tolerance to")
    for i, item in enumerate(items):
        if item["image"] not in cycle:
            continue  # a template: its own landmarks
        if len(cycle[item["image"]]) != len(item["landmarks"]):
            raise ValueError(
                f"{path}: {item['image']} has {len(item['landmarks'])} landmarks but "
                f"{len(cycle[item['image']])} cycle errors"
            )
        errors = np.array([np.nan if e is None else e for e in cycle[item["image"]]])
        items[i] = reliable_landmarks({"item": item, "cycle_error": errors}, float(cycle_tolerance))
    logger.info("%s: %d of %d landmarks kept (cycle error <= %g)", path, *_kept_landmarks(items), cycle_tolerance)
    return items


def pseudo_label_templates(path: str | Path) -> list[dict]:
    """The template items that made the pseudo-labels of :func:`read_pseudo_labels`'s file."""
    data = _read_pseudo_label_file(path)
    images = data["pseudo_labels"].get("templates")
    if not isinstance(images, list):
        raise ValueError(f"{path}: no list of template images under pseudo_labels.templates")
    images = set(images)
    return [dict(it) for it in data["training"] if it["image"] in images]


def _read_pseudo_label_file(path: str | Path) -> dict:
    """The JSON of a pseudo-label datalist (:func:`pseudo_labelled_items`), refused naming ``path`` if not one."""
    data = read_json(path, "pseudo-label datalist")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("pseudo_labels"), dict)
        or not isinstance(data.get("training"), list)
    ):
        raise ValueError(f"{path} is not a pseudo-label datalist (written by stage 2 as output_dir/pseudo_labels.json)")
    return data


def stage2_templates(
    pseudo_labels: str | Path | None,
    datalist: dict,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str,
    **choice,
) -> list[dict]:
    """Stage 2's templates (configs/train_stage2.yaml): those recorded in an earlier run's ``pseudo_labels`` file,
    else the evaluation's choice on ``datalist`` with the stage-1 ``network``
    (:func:`bundle.templates.resolution.resolve_templates` with the keyword arguments ``choice``).

    Args:
        pseudo_labels: an earlier run's pseudo-label datalist (``output_dir/pseudo_labels.json``), None: match.
        datalist: the run's datalist.
        network: the stage-1 network.
        preprocessing: the evaluation's preprocessing of an item.
        device: where the matching runs.
        **choice: the template choice of :func:`bundle.templates.resolution.resolve_templates` (``rule``,
            ``max_templates``, the pseudo-templates' settings, ...).
    """
    if not is_unset(pseudo_labels):
        return pseudo_label_templates(pseudo_labels)
    return resolve_templates(datalist, network, preprocessing, device, **choice)


def stage2_items(
    pseudo_labels: str | Path | None,
    cycle_tolerance: float | None,
    datalist: dict,
    network: torch.nn.Module,
    templates: Sequence[dict],
    preprocessing,
    device: torch.device | str,
    combine: str,
    output_path: str | Path,
    refinement: DescriptorRefinement | None = None,
) -> list[dict]:
    """Stage 2's training items with their (pseudo-)labels: an earlier run's ``pseudo_labels`` file read again
    (:func:`read_pseudo_labels`), else every training item of ``datalist`` labelled by matching from ``templates``
    (:func:`pseudo_labelled_items`, written to ``output_path``); validation and test images are never among them.

    Args:
        pseudo_labels: an earlier run's pseudo-label datalist, None: match.
        cycle_tolerance: ``pseudo_label_tolerance``, the largest forward-backward cycle error (grid pixels) of a
            pseudo-labelled landmark kept, None: every one.
        datalist: the run's datalist.
        network: the stage-1 network.
        templates: stage 2's templates (:func:`stage2_templates`).
        preprocessing: the evaluation's preprocessing of an item.
        device: where the matching runs.
        combine: how the templates' predictions combine per landmark (:data:`bundle.kshot.COMBINE_RULES`).
        output_path: where the pseudo-label datalist is written.
        refinement: the pseudo-labels' XFeat refinement
            (:func:`bundle.pipeline.choice.pseudo_label_refinement`), None: none.
    """
    if not is_unset(pseudo_labels):
        return read_pseudo_labels(pseudo_labels, cycle_tolerance)
    return pseudo_labelled_items(
        datalist,
        network,
        templates,
        preprocessing,
        device,
        combine=combine,
        cycle_tolerance=cycle_tolerance,
        output_path=output_path,
        refinement=refinement,
    )


def encoder_checkpoint(init_checkpoint: str | Path | None, random_init: bool | str) -> str | Path | None:
    """The stage-1 checkpoint whose image encoder starts the detector: ``init_checkpoint``, None (random weights)
    with ``random_init`` on.

    Args:
        init_checkpoint: the stage-1 checkpoint.
        random_init: a yes/no value.
    """
    return None if as_flag(random_init, "random_init") else init_checkpoint


def initial_detector(
    network: HeatmapDetector,
    init_weights: str | Path | None,
    encoder_checkpoint: str | Path | None,
    device: torch.device | str,
) -> HeatmapDetector:
    """The detector before training, on ``device``: the whole detector of ``init_weights`` (a fine-tuning continuing
    a detector), else its encoder from the stage-1 ``encoder_checkpoint`` (None: random weights).

    Args:
        network: the detector as built.
        init_weights: a detector checkpoint, None or empty: none.
        encoder_checkpoint: the stage-1 checkpoint (:func:`encoder_checkpoint`).
        device: where the detector goes.
    """
    if init_weights:
        return load_weights(network, init_weights, device)
    return load_stage1_encoder(network, encoder_checkpoint).to(device)
