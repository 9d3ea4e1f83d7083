"""MONAI Label train task: fine-tune a network of the bundle on the datastore, publish it only when it is better.

``network`` (request key): ``contrastive`` (default; the stage-1 network) or ``detector`` (the stage-2 heatmap
detector, trained on the saved labels).

Contrastive network:

1. The training datalist: every datastore image (sorted ids) is a ``training`` item; images with a saved label
   (tag ``final``) carry the user's ``landmarks`` and are the ``templates`` (else the bundle's templates).
2. The bundle's own training (``monai.bundle run training``, a child process) starts from the CURRENT served
   weights (``init_weights``, a key of configs/train.yaml) and writes its last weights to ``model/candidate/``.
   Validation is off (``val_interval`` > ``epochs``): the candidate is scored below instead.
3. Scoring (the publication rule): old (served) and new weights are compared by their mean radial error (mm;
   pixels where an image has no spacing) on the labelled images of the datastore, each predicted k-shot from
   the OTHER labelled images (leave-one-out), or, with a single labelled image, from the bundle's templates.
   With no labelled image, the bundle datalist's ``validation`` items are scored from the bundle's templates.
   With the built-in templates (no ``datalist`` conf) at least 2 labelled images are needed (refused naming the
   count): the built-in features belong to the shipped weights, so only the labelled images can score new ones.
   The new weights replace ``model/model.pt`` (the served model) only when
   ``mre_new < mre_served - min_improvement`` (request key, default 0); otherwise the served model stays and the
   result says so. Nothing to score on: the served model stays.

Detector (the bundle's fine-tuning on human labels, ``configs/train.yaml`` + ``train_stage2.yaml`` +
``finetune.yaml``, ``--n_labelled None``):

1. Split of the labelled images (at least 2, else refused naming the count): a held-out set that the
   candidate never trains on and both predictors are scored on, the rest the training items. The held-out
   set is sticky: images held out for the served detector stay held out, images it was trained on are never
   held out (so the served detector is not scored on its own training images either), and newly labelled
   images fill the held-out set up to ``max(1, round(holdout * n_labelled), min(min_held_out, n_labelled - 1))``
   (request keys ``holdout``, default 0.25, and ``min_held_out``, default 3) in a fixed order (SHA-1 of the image
   id); at least one image is always trained on.
2. The child trains the detector from the served detector (``init_weights``: ``model/detector.pt``, or without a
   datalist the shipped one, ``models/finetune/model.pt``) on its grid if there is one, else as
   configs/finetune.yaml starts (a bundle detector that learnt from fewer of these labels, else its encoder from
   the served stage-1 weights, ``init_checkpoint`` = the served ``model.pt``) on train.yaml's grid (a request's
   ``image_size`` replaces either), into ``model/candidate_detector/`` (``model_final.pt``; no validation:
   ``val_interval`` > ``epochs``).
3. Scoring on the held-out images: the candidate (``bundle.inferers.heatmap.HeatmapInferer``, as served) against
   the served predictor: the served detector, or, when none, template matching with the served stage-1
   weights from every OTHER labelled image and, while they are few, their pseudo-templates (leave-one-out, as the
   infer task would answer). Published to
   ``model/detector.pt`` (with ``model/detector.json``: its grid, trained-on and held-out ids) only when
   ``mre_new < mre_served - min_improvement`` on at least ``min_held_out`` held-out images; the infer task then
   serves the detector.

Request values are checked before the task is queued (422 naming the key and the value): numbers must be finite
JSON numbers of their kind (no booleans, strings, NaN or infinities), ``min_improvement`` non-negative (a negative
margin would publish a worse model), and the stage-1 crops as the bundle takes them
(:func:`landmark_tasks.train_options.check_training_crop`: the request's ``crop_size``, ``image_size``,
``batch_size``, else the train config's). ``publish``: ``if_better``
(default, the rule above) or ``always`` (the candidate replaces the served weights whatever it scores; the decision
says so). Whatever replaces a served file (``model.pt``, ``detector.pt`` with ``detector.json``) first keeps it
beside itself as ``<name>.<YYYYmmdd-HHMMSS>.<ext>`` (``kept_previous`` in the stats): copying it back restores it.

The bundle's training runs on the app's device (``--conf device``) in a child process of lower priority (niceness
``BACKGROUND_NICENESS``: suggestions requested meanwhile get the shared cores first), within a time budget
(``max_minutes``, request key or ``--conf max_minutes``, default 12: the training ends after the last epoch that fits,
its learning-rate schedule shortened to end there; ``epoch`` in the stats is the number of epochs run). Scoring uses
the app's one stage-1 network of that device, and a CUDA device's cache is emptied after each training.

``model/train_stats.json`` (MONAI Label's convention; ``/info/`` shows it under ``train_stats``) records the
network trained, both scores (each the MRE, which the publication rule compares, and the share of landmarks within
2 mm, 20 pixels on an image without spacing) and their ``units`` (``mm`` when every scored image has a spacing, else
pixels), the decision, the predictor served and the device; ``best_metric`` is the share of the model served after
the training, what 3D Slicer's MONAILabel module shows as its accuracy, with its ``mre`` beside it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from bundle.checkpoints import read_checkpoint
from bundle.io_utils import atomic_path, write_json_atomic
from bundle.pipeline.detector_data import detector_info
from monailabel.interfaces.datastore import Datastore
from monailabel.interfaces.tasks.train import TrainTask

from .background import lower_priority
from .context import BundleContext, device_expression
from .publication import keep_previous, publication, publish_detector, score_stats
from .scoring import leave_one_out, score_checkpoint, score_detector, scoring_cases, served_before_choice
from .train_options import (
    DETECTOR_HOLDOUT,
    DETECTOR_MIN_HELD_OUT,
    check_contrastive_labels,
    check_detector_labels,
    validate_options,
)

logger = logging.getLogger(__name__)


def _hash(image_id: str) -> str:
    return hashlib.sha1(image_id.encode()).hexdigest()


def detector_split(
    labelled_ids: list[str],
    previous: dict | None = None,
    holdout: float = DETECTOR_HOLDOUT,
    min_held_out: int = DETECTOR_MIN_HELD_OUT,
) -> tuple[list[str], list[str]]:
    """``(trained_on, held_out)`` ids of the labelled images (see the module docstring, detector step 1).

    ``previous``: the served detector's record (``model/detector.json``: ``trained_on``, ``held_out``).
    """
    check_detector_labels(len(labelled_ids))
    ids = sorted(labelled_ids)
    previous = previous or {}
    seen_train, seen_held = set(previous.get("trained_on") or []), set(previous.get("held_out") or [])
    held = [i for i in ids if i in seen_held]
    new = sorted((i for i in ids if i not in seen_train and i not in seen_held), key=_hash)
    target = max(1, round(holdout * len(ids)), min(min_held_out, len(ids) - 1))
    held += new[: max(0, target - len(held))]
    trained = [i for i in ids if i not in held]
    if not trained:  # every labelled image was held out before: train on one of them (it is then not scored on)
        trained = [max(held, key=_hash)]
        held.remove(trained[0])
    return trained, sorted(held)


def training_datalist(
    context: BundleContext, items: list[dict], templates: list[dict], test: list[dict] | None = None
) -> dict:
    """The child's datalist: ``items`` the training items (labelled ones with their landmarks); ``test``: images
    held out (the bundle's fine-tuning never trains on the test split)."""
    if not items:
        raise ValueError("the datastore holds no image to train on")
    return {
        "name": "MONAI Label datastore",
        "spatial_dims": context.spatial_dims,
        "landmark_names": list(context.names),
        "training": [{k: v for k, v in it.items() if k in ("image", "landmarks")} for it in items],
        "validation": [],
        "test": [{k: v for k, v in it.items() if k in ("image", "landmarks")} for it in test or []],
        "templates": [{k: v for k, v in t.items() if k in ("image", "landmarks", "spacing")} for t in templates],
    }


def detector_training_grid(
    options: dict, network_grid: Sequence[int], served_grid: Sequence[int] | None = None
) -> list[int]:
    """The grid of a detector train request: its ``image_size``, else the grid of the served detector it continues
    (``served_grid``), else the train config's ``network_grid``, not the finer grid that finetune.yaml takes from 10
    labels (its cost per iteration is past a background training's budget on a CPU)."""
    return [int(v) for v in options.get("image_size") or served_grid or network_grid]


def training_command(
    config_file: str,
    datalist: Path,
    ckpt_dir: Path,
    work: Path,
    epochs: int,
    init_args: list[str],
    options: dict,
    device: torch.device,
) -> list[str]:
    """The bundle's training command for a train request: ``config_file`` on ``datalist``, checkpoints to
    ``ckpt_dir``, logs to ``work/output``, no validation during the ``epochs``, the initialisation ``init_args``,
    the app's ``device`` and the request's ``options`` as JSON values."""
    command = [sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", config_file]
    command += ["--datalist", str(datalist), "--ckpt_dir", str(ckpt_dir), "--output_dir", str(work / "output")]
    command += ["--device", device_expression(device)]
    command += ["--val_interval", str(epochs + 1), "--progress_bar", "False", *init_args]
    for key, value in options.items():
        command += [f"--{key}", json.dumps(value)]
    return command


class BundleTrainTask(TrainTask):
    """Fine-tune the served weights (or the detector) on the datastore's images; publish only when better."""

    def __init__(self, context: BundleContext, defaults: dict[str, Any] | None = None) -> None:
        super().__init__(
            "Fine-tunes the served network (network=contrastive, self-supervised) or the stage-2 detector "
            "(network=detector, on the saved labels); published only when it scores better on the saved labels"
        )
        self.context = context
        self.model_dir = context.model_dir
        self.stats_path = self.model_dir / "train_stats.json"
        self.defaults = dict(defaults or {})

    def config(self) -> dict[str, Any]:
        return {
            **self.defaults,
            "min_improvement": 0.0,
            "network": "contrastive",
            "holdout": DETECTOR_HOLDOUT,
            "min_held_out": DETECTOR_MIN_HELD_OUT,
            "publish": "if_better",
        }

    def stats(self) -> dict[str, Any]:
        """The last training's statistics (``model/train_stats.json``, written by the training process)."""
        try:
            return json.loads(self.stats_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _run_bundle(self, command: list[str], candidate: Path) -> int:
        """Run the bundle's training (``BACKGROUND_NICENESS``: suggestions come first on shared cores) until it has
        written ``candidate``; returns the epochs it ran (``max_minutes`` may end it early)."""
        process = subprocess.Popen(
            command, cwd=self.context.bundle_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        lower_priority(process.pid, "the training process")
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"bundle training failed (exit {process.returncode}):\n{stderr[-4000:]}")
        if not candidate.is_file():
            raise RuntimeError(f"bundle training wrote no {candidate}")
        trainer = read_checkpoint(candidate.parent / "last.pt", "cpu", "the training's last.pt")["trainer"]
        return trainer["iteration"] // trainer["epoch_length"]

    def __call__(self, request: dict, datastore: Datastore) -> dict[str, Any]:
        start = time.time()
        options = validate_options(
            request, self.defaults, self.context.spatial_dims, network_config=self.context.network_config
        )
        rule = {"min_improvement": options.pop("min_improvement", 0.0), "publish": options.pop("publish", "if_better")}
        network = options.pop("network", "contrastive")
        holdout = options.pop("holdout", DETECTOR_HOLDOUT)
        min_held_out = options.pop("min_held_out", DETECTOR_MIN_HELD_OUT)
        items = self.context.datastore_items(datastore)
        try:
            if network == "detector":
                stats = self._train_detector(items, options, rule, holdout, min_held_out)
            else:
                stats = self._train_contrastive(items, options, rule)
        finally:
            if self.context.device.type == "cuda":  # what scoring cached on the GPU (a server's run_sync training)
                torch.cuda.empty_cache()
        predictor, checkpoint = served_before_choice(self.context, sum(bool(it.get("landmarks")) for it in items))
        epochs = stats["train"]["epochs_run"]
        stats = {
            "network": network,
            "epoch": epochs,
            "start_ts": int(start),
            "total_time": str(datetime.timedelta(seconds=int(time.time() - start))),
            **stats,
            "predictor": predictor,
            "checkpoint": str(checkpoint if network == "detector" else self.context.served_checkpoint()),
            "device": str(self.context.device),
        }
        stats["eval"]["best_metric_epoch"] = epochs
        write_json_atomic(self.stats_path, stats)
        return stats

    # ---- the stage-1 (contrastive) network -------------------------------------------------------------
    def _train_contrastive(self, items: list[dict], options: dict, rule: dict) -> dict[str, Any]:
        labelled = [it for it in items if it.get("landmarks")]
        check_contrastive_labels(len(labelled), self.context.datalist is None)
        templates = labelled or self.context.bundle_templates()
        work = self.model_dir / "train"
        datalist_path = write_json_atomic(work / "datalist.json", training_datalist(self.context, items, templates))
        candidate_dir = self.model_dir / "candidate"
        shutil.rmtree(candidate_dir, ignore_errors=True)
        served = self.context.served_checkpoint()
        epochs = int(options.get("epochs", 10))
        command = training_command(
            json.dumps(list(self.context.train_configs)),
            datalist_path,
            candidate_dir,
            work,
            epochs,
            ["--init_weights", str(served)],
            options,
            self.context.device,
        )
        logger.info(f"fine-tuning {served} on {len(items)} images ({len(labelled)} labelled): {' '.join(command)}")
        candidate = candidate_dir / "model_final.pt"
        epochs_run = self._run_bundle(command, candidate)

        cases, scored_on = scoring_cases(self.context, labelled)
        old = new = None
        if cases:
            unlabelled = [it for it in items if not it.get("landmarks")]
            old = score_checkpoint(self.context, served, cases, unlabelled)
            new = score_checkpoint(self.context, candidate, cases, unlabelled)
        published, decision = publication(
            None if new is None else new.mre,
            None if old is None else old.mre,
            f"the served model {served.name}",
            **rule,
        )
        kept_previous = {}
        if published:
            kept_previous = keep_previous(self.context.served_path)
            with atomic_path(self.context.served_path) as tmp:
                shutil.copyfile(candidate, tmp)
        logger.info(f"scored on {scored_on}: {decision}")
        scores = score_stats(new, old, published)
        return {
            **scores,
            "train": {
                "images": len(items),
                "labelled": len(labelled),
                "options": options,
                "init_weights": str(served),
                "epochs_run": epochs_run,
            },
            "eval": {
                **scores["eval"],
                "units": self.context.error_units([item for item, _ in cases]) if cases else None,
                "scored_on": scored_on,
            },
            "published": published,
            "decision": decision,
            "kept_previous": kept_previous,
            "candidate": str(candidate),
            "templates": [t.get("id", t["image"]) for t in templates],
        }

    # ---- the stage-2 heatmap detector ------------------------------------------------------------------
    def _train_detector(
        self, items: list[dict], options: dict, rule: dict, holdout: float, min_held_out: int
    ) -> dict[str, Any]:
        context = self.context
        labelled = {it["id"]: it for it in items if it.get("landmarks")}
        served_detector = context.served_detector()
        previous = context.detector_info() if served_detector else {}
        trained_ids, held_ids = detector_split(list(labelled), previous, holdout, min_held_out)
        trained, held = [labelled[i] for i in trained_ids], [labelled[i] for i in held_ids]
        work = self.model_dir / "train_detector"
        datalist_path = write_json_atomic(
            work / "datalist.json", training_datalist(context, trained, trained, test=held)
        )
        candidate_dir = self.model_dir / "candidate_detector"
        shutil.rmtree(candidate_dir, ignore_errors=True)
        stage1 = context.served_checkpoint()
        epochs = int(options.get("epochs", 10))
        image_size = detector_training_grid(options, context.network_config["image_size"], previous.get("image_size"))
        # the detector's grid; image_size stays the train config's, the grid its heatmap sigma and shifts are given on
        options = {**{k: v for k, v in options.items() if k != "image_size"}, "detector_grid": image_size}
        if served_detector:  # the whole served detector; no stage-1 encoder to load first
            init_args = ["--init_weights", str(served_detector), "--random_init", "true"]
        else:
            init_args = ["--init_checkpoint", str(stage1)]
        command = training_command(
            json.dumps(list(context.detector_configs)),
            datalist_path,
            candidate_dir,
            work,
            epochs,
            init_args,
            options,
            context.device,
        )
        logger.info(
            f"training the detector on {len(trained)} labelled images ({len(held)} held out): {' '.join(command)}"
        )
        candidate = candidate_dir / "model_final.pt"
        epochs_run = self._run_bundle(command, candidate)
        # without a served detector the fine-tuning config chooses where to start (a detector of fewer of these
        # labels, else the stage-1 encoder): its record says which
        continued = str(served_detector) if served_detector else detector_info(candidate).get("init_weights")
        init = {"init_weights": continued, "init_checkpoint": None if continued else str(stage1)}

        new = score_detector(context, candidate, image_size, held)
        if served_detector:
            served_predictor = "detector"
            old = score_detector(context, served_detector, previous.get("image_size"), held)
            kept = f"the served detector {Path(served_detector).name}"
            scored_on = f"{len(held)} held-out labelled images, the served detector and the new one"
        else:
            served_predictor = "templates"
            # each held-out image as the infer task would match it, had it not been labelled
            cases = leave_one_out(list(labelled.values()), held)
            unlabelled = [it for it in items if not it.get("landmarks")]
            old = score_checkpoint(context, stage1, cases, unlabelled)
            kept = f"template matching ({Path(stage1).name})"
            scored_on = (
                f"{len(held)} held-out labelled images: the new detector, and template matching from the other "
                "templates (leave-one-out; with their pseudo-templates while the labels are few)"
            )
        published, decision = publication(new.mre, old.mre, kept, **rule)
        if published and rule["publish"] != "always" and len(held) < min_held_out:
            published = False
            decision = (
                f"kept {kept}: the new detector was scored on {len(held)} held-out image(s), fewer than min_held_out "
                f"({min_held_out}); {decision}"
            )
        kept_previous = {}
        if published:
            kept_previous = keep_previous(context.detector_path, context.detector_info_path)
            publish_detector(
                context,
                candidate,
                {
                    "image_size": [int(v) for v in image_size],
                    "trained_on": trained_ids,
                    "held_out": held_ids,
                    "mre_held_out": new.mre,
                    "published_ts": int(time.time()),
                    **init,
                },
            )
        logger.info(f"scored on {scored_on}: {decision}")
        scores = score_stats(new, old, published)
        return {
            **scores,
            "train": {
                "images": len(trained),
                "labelled": len(labelled),
                "options": options,
                **init,
                "trained_on": trained_ids,
                "held_out": held_ids,
                "epochs_run": epochs_run,
            },
            "eval": {
                **scores["eval"],
                "units": context.error_units(held),
                "scored_on": scored_on,
                "served_predictor": served_predictor,
            },
            "published": published,
            "decision": decision,
            "kept_previous": kept_previous,
            "candidate": str(candidate),
        }
