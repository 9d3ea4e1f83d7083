"""The XFeat fine step measured on an evaluating run's predictions (docs/results.md, "A pretrained fine step"): the
setting's radius chosen on validation predictions, and a stage-2 pseudo-label file refined after the fact.

    python -m scripts.experiments.xfeat_refinement score --datalist runs/one046_val.json \
        --predictions runs/det_val/predictions.csv --radii_mm "[1.0,2.0,3.0]" --out runs/xfeat_val.json
    python -m scripts.experiments.xfeat_refinement pseudo_labels --datalist runs/one046_val.json \
        --pseudo_labels runs/stage2/pseudo_labels.json --out runs/stage2/pseudo_labels_xfeat.json \
        --reference runs/hamedan/protocol.json

The step itself is :class:`bundle.inferers.refinement.DescriptorRefinement` (what ``xfeat_refinement`` runs in the
commands). ``score`` prints the run's own predictions' MRE, median, SDR 2 / 4 mm and errors > 10 mm, then those of
each refinement radius. Templates: the datalist's ``templates``, else its ``template``, else its first ``k`` labelled
training items. ``pseudo_labels`` refines every training item of a pseudo-label file but the datalist's templates
and writes another, for ``--pseudo_labels`` of configs/train_stage2.yaml; with ``--reference`` (a datalist whose
training items carry human landmarks) it prints both files' distances to those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.datalist import landmarks_array, load_datalist, read_json
from bundle.inferers.refinement import RADIUS_MM, DescriptorRefinement
from bundle.io_utils import write_json_atomic
from bundle.pipeline.choice import refinement_templates
from bundle.reporting import read_predictions_csv
from scripts.cli import run_fire


def scores(predicted: dict[str, np.ndarray], reference: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """MRE, median, SDR 2 / 4 mm and errors > 10 mm of ``predicted`` (image -> (L, 2)) against ``reference``
    (image -> (landmarks, spacing))."""
    errors = np.concatenate(
        [np.linalg.norm((predicted[image] - truth) * spacing, axis=1) for image, (truth, spacing) in reference.items()]
    )
    errors = errors[~np.isnan(errors)]
    return {
        "mre_mm": round(float(errors.mean()), 3),
        "median_mm": round(float(np.median(errors)), 3),
        "sdr_2mm": round(float((errors <= 2).mean() * 100), 1),
        "sdr_4mm": round(float((errors <= 4).mean() * 100), 1),
        "errors_over_10mm": int((errors > 10).sum()),
        "n_landmarks": int(errors.size),
    }


def _landmarks(item: dict) -> np.ndarray:
    return landmarks_array(item, len(item["landmarks"]), 2)


def main(
    datalist: str,
    predictions: str,
    radii_mm: Sequence[float] = (RADIUS_MM,),
    k: int = 1,
    combine: str = "weighted_geometric_median",
    out: str | None = None,
) -> list[dict]:
    """Score ``predictions`` (an evaluating run's predictions.csv on the datalist's ``test`` items) and their
    refinements at each radius (module doc); print each row, write them all to ``out`` (JSON)."""
    data = load_datalist(datalist)
    items = {str(Path(it["image"]).resolve()): it for it in data["test"]}
    rows: dict[str, list] = {}
    for row in read_predictions_csv(predictions):
        rows.setdefault(str(Path(row["image"]).resolve()), []).append(row["point"])
    predicted = {image: np.stack(points) for image, points in rows.items()}
    reference = {image: (_landmarks(items[image]), np.asarray(items[image]["spacing"], float)) for image in predicted}
    table = [{"setting": "as predicted", **scores(predicted, reference)}]
    print(table[0], flush=True)
    refinement = DescriptorRefinement(refinement_templates(data, k), combine=combine)
    for radius in radii_mm:
        refinement.radius_mm = float(radius)
        refined = {image: refinement.refine(image, points, reference[image][1]) for image, points in predicted.items()}
        row = {"setting": f"{len(refinement.templates)} template(s), radius {radius} mm", **scores(refined, reference)}
        print(row, flush=True)
        table.append(row)
    if out:
        write_json_atomic(out, table)
    return table


def pseudo_labels(
    datalist: str, pseudo_labels: str, out: str, radius_mm: float = RADIUS_MM, reference: str | None = None
) -> dict:
    """Write ``out``: the pseudo-label file ``pseudo_labels`` with every training item but ``datalist``'s templates
    refined (module doc); return (and print) the distances to ``reference``'s training landmarks, before and after."""
    templates = refinement_templates(load_datalist(datalist), 1)
    human = {str(Path(it["image"]).resolve()) for it in templates}
    refinement = DescriptorRefinement(templates, radius_mm=radius_mm)
    data = read_json(Path(pseudo_labels), "pseudo-label file")
    before, after = {}, {}
    for n, item in enumerate(data["training"]):
        image = str(Path(item["image"]).resolve())
        if image not in human:
            data["training"][n] = refinement.refine_item(item)
            before[image], after[image] = _landmarks(item), _landmarks(data["training"][n])
    data["pseudo_labels"]["xfeat_refinement"] = refinement.settings()
    write_json_atomic(out, data)
    if reference is None:
        return {}
    truth = {
        str(Path(it["image"]).resolve()): (_landmarks(it), np.asarray(it["spacing"], float))
        for it in load_datalist(reference)["training"]
        if it.get("landmarks") and str(Path(it["image"]).resolve()) in before
    }
    distances = {
        "pseudo-labels": scores({k: before[k] for k in truth}, truth),
        "refined": scores({k: after[k] for k in truth}, truth),
    }
    print(distances)
    return distances


if __name__ == "__main__":
    run_fire({"score": main, "pseudo_labels": pseudo_labels})
