"""How much of an evaluating run's error is each landmark's systematic offset, and whether the offsets measured on one
image set (the validation images) hold on another (docs/results.md, "Where the few-label errors lie"):

    python -m scripts.experiments.landmark_offsets --datalist runs/hamedan/protocol.json \
        --calibration runs/det_val/metrics.json --predictions runs/det_test/predictions.csv

``--calibration`` is the metrics.json of a run on other images (its ``per_landmark_offset_mm``), ``--predictions``
the predictions.csv of a run on the datalist's ``test`` items (2D). Prints the predictions' scores as predicted,
less their own offsets (metrics.json's ``mre_offset_removed_mm``: an oracle) and less the calibration's offsets (what
a correction learnt from the calibration images' labels would give), and each landmark's cosine between the two
sets' offsets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bundle.data.datalist import landmarks_array, load_datalist, read_json
from bundle.metrics import landmark_offsets
from bundle.reporting import read_predictions_csv
from scripts.cli import run_fire
from scripts.experiments.xfeat_refinement import scores


def main(datalist: str, calibration: str, predictions: str) -> dict:
    """The scores and cosines of the module doc."""
    data = load_datalist(datalist)
    names = list(data["landmark_names"])
    items = {str(Path(it["image"]).resolve()): it for it in data["test"]}
    rows: dict[str, dict[str, np.ndarray]] = {}
    for row in read_predictions_csv(predictions):
        rows.setdefault(str(Path(row["image"]).resolve()), {})[row["landmark"]] = row["point"]
    predicted = {image: np.stack([points[n] for n in names]) for image, points in rows.items()}
    reference = {
        image: (landmarks_array(items[image], len(names), 2), np.asarray(items[image]["spacing"], float))
        for image in predicted
    }
    differences = np.stack([(predicted[i] - truth) * spacing for i, (truth, spacing) in reference.items()])
    own = landmark_offsets(differences, names)
    measured = read_json(calibration).get("per_landmark_offset_mm") or {}
    missing = [n for n in names if measured.get(n) is None]
    if missing:
        raise ValueError(f"{calibration}: no per_landmark_offset_mm for {missing}")
    offsets = np.array([measured[n] for n in names])
    corrected = {image: predicted[image] - offsets / reference[image][1] for image in predicted}
    cosines = {}
    for name, a, b in zip(names, offsets, (own["per_landmark_offset_mm"][n] for n in names)):
        norm = np.linalg.norm(a) * np.linalg.norm(b)
        cosines[name] = round(float(np.dot(a, b) / norm), 2) if norm > 0 else None
    result = {
        "as predicted": scores(predicted, reference),
        "own offsets removed (mre_offset_removed_mm)": round(own["mre_offset_removed_mm"], 3),
        "calibration offsets removed": scores(corrected, reference),
        "cosine of the two sets' offsets": cosines,
    }
    return result


if __name__ == "__main__":
    run_fire(main)
