"""Ignite/MONAI engine pieces: the contrastive training step and evaluation helpers.

``ContrastiveIterationUpdate`` is the ``iteration_update`` of MONAI's ``SupervisedTrainer`` for the
paper's pixel-wise contrastive learning (two encoders, multi-scale InfoNCE, Sec. 3.1): the whole image
goes through the image encoder, the augmented crop through the crop encoder, and the loss compares the
crop's query features with the image's. The rest glues checkpoints and templates to the evaluator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.utils.enums import CommonKeys as Keys

TRAIN_KEYS = ("image", "crop", "query", "crop_query")


class ContrastiveIterationUpdate:
    """One optimisation step on a batch of view pairs (keys ``image``, ``crop``, ``query``, ``crop_query``).

    Uses the trainer's network (``forward`` = image encoder, ``encode_crops`` = crop encoder), loss
    function, optimizer, ``amp`` flag and grad scaler; fires MONAI's iteration events so that handlers
    that listen to them keep working.
    """

    def __call__(self, engine: SupervisedTrainer, batchdata: dict[str, Any]) -> dict:
        missing = [k for k in TRAIN_KEYS if k not in batchdata]
        if missing:
            raise KeyError(f"training batch lacks {missing}: the view-pair sampler must produce {list(TRAIN_KEYS)}")
        device, nb = engine.state.device, engine.non_blocking
        image, crop, query, crop_query = (torch.as_tensor(batchdata[k]).to(device, non_blocking=nb) for k in TRAIN_KEYS)
        network = engine.network
        network.train()
        engine.optimizer.zero_grad(set_to_none=engine.optim_set_to_none)

        def forward() -> torch.Tensor:
            image_features = network(image)
            crop_features = network.encode_crops(crop)
            engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            loss = engine.loss_function(
                image_features, crop_features, query, crop_query, tuple(image.shape[2:]), tuple(crop.shape[2:])
            )
            engine.state.output = {Keys.IMAGE: image, Keys.LOSS: loss}
            engine.fire_event(IterationEvents.LOSS_COMPLETED)
            return loss

        if engine.amp and engine.scaler is not None:
            with torch.autocast(device.type if isinstance(device, torch.device) else "cuda", **engine.amp_kwargs):
                loss = forward()
            engine.scaler.scale(loss).backward()
            engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
            engine.scaler.step(engine.optimizer)
            engine.scaler.update()
        else:
            loss = forward()
            loss.backward()
            engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
            engine.optimizer.step()
        engine.state.output[Keys.LOSS] = loss.detach()
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output


def load_weights(network: torch.nn.Module, path: str | Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Load a checkpoint (a state dict, or a dict holding one under ``model``) into ``network`` and return it.

    Checkpoints load with ``torch.load(weights_only=True)``; a missing file or mismatched keys raise
    errors that name the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path} (train first, or pass --ckpt_path)")
    state = torch.load(path, map_location=device, weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {path} does not fit the configured network: {e}") from e
    return network.to(device)


def physical_to_grid(grid_to_physical: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Map ``(L, D)`` physical points to grid positions with the inverse of a ``(D+1, D+1)`` homogeneous map."""
    inverse = torch.linalg.inv(grid_to_physical.double())
    d = points.shape[-1]
    return (points.double() @ inverse[:d, :d].T + inverse[:d, d]).to(torch.float32)


def template_record(item: dict, how: str, scores: np.ndarray | None = None) -> dict:
    """What metrics.json records of the template: its image and how it was chosen."""
    record = {"image": item["image"], "chosen_by": how}
    if scores is not None:
        record["selection_score"] = float(np.max(scores))
    return record


def prepare_template(item: dict, preprocessing) -> tuple[torch.Tensor, torch.Tensor]:
    """The template's network-grid image ``(1, 1, *S)`` and its landmarks ``(L, D)`` in grid positions.

    ``preprocessing`` is the evaluation pipeline (it must end with ``LandmarkTargetsd``).
    """
    if not item.get("landmarks"):
        raise ValueError(f"the template {item.get('image')} carries no 'landmarks'")
    data = preprocessing(dict(item))
    points = physical_to_grid(data["grid_to_physical"], data["label"])
    return torch.as_tensor(data["image"]).unsqueeze(0), points


def default_template(datalist: dict) -> dict:
    """The datalist's ``template``, else its first training item with landmarks (validation during training)."""
    if datalist.get("template") is not None:
        return dict(datalist["template"], chosen_by="datalist")
    for item in datalist.get("training", []):
        if item.get("landmarks") and any(p is not None for p in item["landmarks"]):
            return dict(item, chosen_by="first labelled training item")
    raise ValueError("the datalist has no 'template' and no training item with 'landmarks' to serve as one")


def with_template(inferer, item: dict, preprocessing, device: torch.device | str):
    """Give ``inferer`` (a ``bundle.oneshot.OneShotInferer``) the template ``item`` and return it."""
    image, points = prepare_template(item, preprocessing)
    inferer.set_template(image.to(device), points.to(device))
    return inferer


def resolve_template(
    datalist: dict, network: torch.nn.Module, preprocessing, device: torch.device | str, max_images: int = 32
) -> dict:
    """The evaluation template: the datalist's ``template``, else one chosen among its labelled training items.

    The choice is unsupervised (``bundle.template_selection.select_template``: the candidate whose features
    match the other training images best, Quan et al. CVPR 2022); the landmarks play no part in it. At most
    ``max_images`` training images (the labelled ones first) take part, to bound the cost.
    """
    from bundle.template_selection import select_template

    if datalist.get("template") is not None:
        return dict(datalist["template"], chosen_by="datalist")
    training = datalist.get("training", [])
    labelled = [it for it in training if it.get("landmarks") and any(p is not None for p in it["landmarks"])]
    if not labelled:
        raise ValueError("the datalist has no 'template' and no training item with 'landmarks' to choose one from")
    if len(labelled) == 1:
        return dict(labelled[0], chosen_by="the only labelled training item")
    unlabelled = [it for it in training if it not in labelled]
    pool = (labelled + unlabelled)[: max(max_images, 2)]
    candidates = [i for i, it in enumerate(pool) if it in labelled]
    images = [torch.as_tensor(preprocessing(dict(it))["image"]).to(device) for it in pool]
    network.eval()
    with torch.no_grad():
        index, scores = select_template(network, images, candidates=candidates)
    score = float(scores[candidates.index(index)])
    return dict(pool[index], chosen_by="unsupervised feature matching", selection_score=score)
