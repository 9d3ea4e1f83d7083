"""Self-training at few labels (docs/results.md, "Self-training at five labels"): a detector fine-tuned on the
human-labelled training images predicts the unlabelled ones, and a second fine-tuning continuing it learns from both.

    python -m scripts.experiments.self_training pool --datalist D --out runs/pool.json
    python -m monai.bundle run evaluating --config_file "['configs/train.yaml','configs/evaluate.yaml']" \
        --datalist runs/pool.json --pipeline detector --detectors "['runs/ft5/models/finetune/model_final.pt']" \
        --output_dir runs/pool_predictions --overlays false
    python -m scripts.experiments.self_training labelled --datalist D \
        --predictions runs/pool_predictions/predictions.csv --out runs/self_training.json

``pool`` writes a datalist whose ``training`` items are ``D``'s labelled training images and whose ``test`` items are
its other training images (validation and test images left out), so that an evaluating run predicts them (their own
landmarks, where ``D`` drops them but the source has them, only score the pseudo-labels). ``labelled`` writes ``D``
with each unlabelled training image carrying its predicted landmarks (validation and test images left out of the
training items, the order kept); a fine-tuning on it continuing the first detector (``--init_weights``) is the
second round. Image paths are written absolute.
"""

from __future__ import annotations

import os

import numpy as np
from bundle.data.datalist import load_datalist
from bundle.io_utils import write_json_atomic
from bundle.reporting import read_predictions_csv
from bundle.templates.resolution import held_out_images, labelled_training_items
from scripts.cli import run_fire


def _absolute(items: list[dict]) -> list[dict]:
    return [{**it, "image": os.path.abspath(it["image"])} for it in items]


def _unlabelled_training(datalist: dict) -> list[dict]:
    held_out, labelled = held_out_images(datalist), {it["image"] for it in labelled_training_items(datalist)}
    return [it for it in datalist["training"] if it["image"] not in held_out and it["image"] not in labelled]


def pool(datalist: str, out: str, source: str | None = None) -> str:
    """Write ``out``: the labelled training items of ``datalist`` as its training items and its unlabelled ones as
    the test items to predict, with their landmarks in ``source`` (a datalist of the same images, default
    ``datalist``) where it has them.

    Args:
        datalist: the run's datalist (some training images labelled).
        out: the datalist written.
        source: where the test items' own landmarks are read, to score the pseudo-labels.
    """
    data = load_datalist(datalist)
    truth = {it["image"]: it for it in load_datalist(source or datalist)["training"]}
    test = [truth.get(it["image"], it) for it in _unlabelled_training(data)]
    sections = {"training": labelled_training_items(data), "validation": data.get("validation") or [], "test": test}
    write_json_atomic(out, {**data, **{name: _absolute(items) for name, items in sections.items()}})
    print(f"wrote {out}: {len(labelled_training_items(data))} labelled, {len(test)} to predict")
    return out


def labelled(datalist: str, predictions: str, out: str) -> str:
    """Write ``out``: ``datalist`` with each unlabelled training item carrying its landmarks from ``predictions``
    (an evaluating run's predictions.csv on :func:`pool`'s datalist), in the datalist's order, validation and test
    images left out of the training items.

    Args:
        datalist: the run's datalist.
        predictions: the predictions of its unlabelled training images.
        out: the datalist written.

    Raises:
        ValueError: an unlabelled training image without a prediction of every landmark.
    """
    data = load_datalist(datalist)
    names = list(data["landmark_names"])
    points: dict[str, dict[str, list[float]]] = {}
    for row in read_predictions_csv(predictions):
        points.setdefault(os.path.realpath(row["image"]), {})[row["landmark"]] = row["point"].tolist()
    unlabelled = {it["image"] for it in _unlabelled_training(data)}
    held_out = held_out_images(data)
    training = []
    for item in data["training"]:
        if item["image"] in unlabelled:
            found = points.get(os.path.realpath(item["image"]), {})
            missing = [n for n in names if n not in found or not np.isfinite(found[n]).all()]
            if missing:
                raise ValueError(f"{predictions}: no prediction of {missing} on {item['image']}")
            item = {**item, "landmarks": [found[n] for n in names]}
        if item["image"] not in held_out:
            training.append(item)
    sections = {"training": training, "validation": data.get("validation") or [], "test": data.get("test") or []}
    write_json_atomic(out, {**data, **{name: _absolute(items) for name, items in sections.items()}})
    print(f"wrote {out}: {len(training)} training items, {len(unlabelled)} of them pseudo-labelled")
    return out


if __name__ == "__main__":
    run_fire({"pool": pool, "labelled": labelled})
