"""MONAI Label train task: fine-tune the served network on the datastore's images, publish it only when it is better.

1. The training datalist: every datastore image (sorted ids) is a ``training`` item; images with a saved label
   (tag ``final``) carry the user's ``landmarks`` and are the ``templates`` (else the bundle's templates).
2. The bundle's own training (``monai.bundle run training``, a child process) starts from the CURRENT served
   weights (``init_weights``, a key of configs/train.yaml) and writes its last weights to ``model/candidate/``.
   Validation is off (``val_interval`` > ``epochs``): the candidate is scored below instead.
3. Scoring (the publication rule): old (served) and new weights are compared by their mean radial error (mm;
   pixels where an image has no spacing) on the labelled images of the datastore, each predicted k-shot from
   the OTHER labelled images (leave-one-out), or, with a single labelled image, from the bundle's templates.
   With no labelled image, the bundle datalist's ``validation`` items are scored from the bundle's templates.
   The new weights replace ``model/model.pt`` (the served model) only when
   ``mre_new < mre_served - min_improvement`` (request key, default 0); otherwise the served model stays and the
   result says so. Nothing to score on: the served model stays.
4. ``model/train_stats.json`` (MONAI Label's convention; ``/info/`` shows it under ``train_stats``).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monailabel.interfaces.datastore import Datastore
from monailabel.interfaces.tasks.train import TrainTask

from bundle.io_utils import atomic_path, write_json_atomic

from .common import BundleContext

logger = logging.getLogger(__name__)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError("a positive integer")
    return int(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError("an integer")
    return int(value)


def _positive_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError("a positive number")
    return float(value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError("a finite number")
    return float(value)


def _size(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("a list of positive integers, one per spatial axis")
    try:
        return [_positive_int(v) for v in value]
    except ValueError:
        raise ValueError("a list of positive integers, one per spatial axis") from None


def _network(value: Any) -> str:
    if value != "contrastive":
        raise ValueError("'contrastive' (the stage-2 detector is not trained by this app)")
    return value


# request key -> parser; the bundle keys go to `monai.bundle run training` as --key value
BUNDLE_OPTIONS = {
    "epochs": _positive_int, "epoch_length": _positive_int, "batch_size": _positive_int, "learning_rate": _positive_float,
    "image_size": _size, "crop_size": _size, "num_queries": _positive_int, "seed": _int,
}
APP_OPTIONS = {"min_improvement": _float, "network": _network}


def validate_options(request: dict, defaults: dict | None = None, spatial_dims: int = 2) -> dict[str, Any]:
    """The training options of ``request`` (over ``defaults``), each checked; a bad one raises ValueError naming it.

    Other request keys (MONAI Label adds ``model``, ``gpus``, ``client_id``, ...) are ignored.
    """
    options = dict(defaults or {})
    for key, parse in {**BUNDLE_OPTIONS, **APP_OPTIONS}.items():
        if key not in request or request[key] is None:
            continue
        try:
            options[key] = parse(request[key])
        except ValueError as e:
            raise ValueError(f"train request: {key!r} must be {e}, got {request[key]!r:.60}") from None
        if key in ("image_size", "crop_size") and len(options[key]) != spatial_dims:
            raise ValueError(f"train request: {key!r} must have {spatial_dims} values, got {request[key]!r:.60}")
    return options


def training_datalist(context: BundleContext, items: list[dict], templates: list[dict]) -> dict:
    """The child's datalist: every datastore image a training item (labelled ones with their landmarks)."""
    if not items:
        raise ValueError("the datastore holds no image to train on")
    return {
        "name": "MONAI Label datastore",
        "spatial_dims": context.spatial_dims,
        "landmark_names": list(context.names),
        "training": [{k: v for k, v in it.items() if k in ("image", "landmarks")} for it in items],
        "validation": [],
        "test": [],
        "templates": [{k: v for k, v in t.items() if k in ("image", "landmarks", "spacing")} for t in templates],
    }


def score_checkpoint(context: BundleContext, checkpoint: str | Path, cases: list[tuple[dict, list[dict]]]) -> float:
    """Mean radial error (mm, or pixels without spacing) of ``checkpoint`` over ``cases`` (item, its templates)."""
    network = context.new_network(checkpoint)
    errors = []
    with torch.no_grad():
        for item, templates in cases:
            inferer = context.new_inferer(templates)
            data = context.prepare({k: v for k, v in item.items() if k in ("image", "landmarks", "spacing")})
            image = torch.as_tensor(data["image"]).unsqueeze(0).to(context.device)
            g2p = torch.as_tensor(data["grid_to_physical"]).unsqueeze(0).to(context.device)
            pred = inferer(image, network, g2p)[0].cpu().numpy().astype(np.float64)
            truth = np.asarray(torch.as_tensor(data["label"]).cpu(), dtype=np.float64)
            e = np.linalg.norm(pred - truth, axis=-1)
            errors.extend(e[np.isfinite(e)].tolist())
    if not errors:
        raise ValueError("no landmark to score on")
    return float(np.mean(errors))


def scoring_cases(context: BundleContext, labelled: list[dict]) -> tuple[list[tuple[dict, list[dict]]], str]:
    """(item, templates) pairs of the publication rule and a sentence saying what they are."""
    if len(labelled) >= 2:
        cases = [(it, [t for t in labelled if t is not it]) for it in labelled]
        return cases, f"{len(labelled)} labelled datastore images, each from the other {len(labelled) - 1} (leave-one-out)"
    templates = context.bundle_templates()
    if labelled:
        return [(labelled[0], templates)], "the one labelled datastore image, from the bundle's templates"
    template_images = {t["image"] for t in templates}
    validation = [it for it in context.parser.get_parsed_content("dataset").get("validation", []) if it["image"] not in template_images]
    return [(it, templates) for it in validation], f"the bundle datalist's {len(validation)} validation images, from its templates"


class BundleTrainTask(TrainTask):
    """Fine-tune the served weights on the datastore's images; publish to ``model/model.pt`` only when better."""

    def __init__(self, context: BundleContext, defaults: dict[str, Any] | None = None) -> None:
        super().__init__("Fine-tunes the served network on the datastore's images (self-supervised); "
                         "published only when it scores better on the saved labels")
        self.context = context
        self.model_dir = context.model_dir
        self.stats_path = self.model_dir / "train_stats.json"
        self.defaults = dict(defaults or {})

    def config(self) -> dict[str, Any]:
        return {**self.defaults, "min_improvement": 0.0}

    def stats(self) -> dict[str, Any]:
        """The last training's statistics (``model/train_stats.json``, written by the training process)."""
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}

    def __call__(self, request: dict, datastore: Datastore) -> dict[str, Any]:
        start = time.time()
        options = validate_options(request, self.defaults, self.context.spatial_dims)
        min_improvement = options.pop("min_improvement", 0.0)
        options.pop("network", None)
        items = self.context.datastore_items(datastore)
        labelled = [it for it in items if it.get("landmarks")]
        templates = labelled or self.context.bundle_templates()
        work = self.model_dir / "train"
        datalist_path = write_json_atomic(work / "datalist.json", training_datalist(self.context, items, templates))
        candidate_dir = self.model_dir / "candidate"
        shutil.rmtree(candidate_dir, ignore_errors=True)
        served = self.context.served_checkpoint()
        epochs = int(options.get("epochs", 10))
        command = [
            sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", "configs/train.yaml",
            "--datalist", str(datalist_path), "--ckpt_dir", str(candidate_dir), "--output_dir", str(work / "output"),
            "--init_weights", str(served), "--val_interval", str(epochs + 1), "--progress_bar", "False",
        ]
        for key, value in options.items():
            command += [f"--{key}", json.dumps(value)]
        logger.info(f"fine-tuning {served} on {len(items)} images ({len(labelled)} labelled): {' '.join(command)}")
        done = subprocess.run(command, cwd=self.context.bundle_root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"bundle training failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        candidate = candidate_dir / "model_final.pt"
        if not candidate.is_file():
            raise RuntimeError(f"bundle training wrote no {candidate}")

        cases, scored_on = scoring_cases(self.context, labelled)
        old = new = None
        if cases:
            old = score_checkpoint(self.context, served, cases)
            new = score_checkpoint(self.context, candidate, cases)
            published = new < old - min_improvement
            decision = (
                f"published: MRE {new:.3f} < {old:.3f} of the served model" + (f" - {min_improvement:g}" if min_improvement else "")
                if published else
                f"kept the served model {served}: the new one's MRE {new:.3f} is not below {old:.3f}"
                + (f" - {min_improvement:g}" if min_improvement else "")
            )
        else:
            published = False
            decision = f"kept the served model {served}: no labelled image to compare the new weights on"
        if published:
            with atomic_path(self.context.served_path) as tmp:
                shutil.copyfile(candidate, tmp)
        logger.info(f"scored on {scored_on}: {decision}")
        best = None if old is None else (new if published else old)
        stats = {
            "epoch": epochs,
            "start_ts": int(start),
            "total_time": str(datetime.timedelta(seconds=int(time.time() - start))),
            "best_metric": best,
            "train": {"images": len(items), "labelled": len(labelled), "options": options, "init_weights": str(served)},
            "eval": {
                "metrics": {"mre_served": old, "mre_trained": new},
                "key_metric_name": "mre",
                "best_metric": best,
                "best_metric_epoch": epochs,
                "scored_on": scored_on,
            },
            "published": published,
            "decision": decision,
            "checkpoint": str(self.context.served_checkpoint()),
            "candidate": str(candidate),
            "templates": [t.get("id", t["image"]) for t in templates],
        }
        write_json_atomic(self.stats_path, stats)
        return stats
