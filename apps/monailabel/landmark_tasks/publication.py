"""Whether a trained candidate replaces the served model, the stats of that decision, and the replacing."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

from bundle.io_utils import atomic_path

from .context import BundleContext
from .scoring import SUCCESS_RADIUS_MM, SUCCESS_RADIUS_PIXELS, Score


def publication(
    new: float | None, old: float | None, kept: str, min_improvement: float, publish: str
) -> tuple[bool, str]:
    """``(published, decision)`` of the publication rule on the scores of the new and the served predictor
    (None: nothing to score on); ``kept`` names the served one."""
    if publish == "always":
        scores = "not scored" if new is None else f"MRE {new:.3f}, the served model's {old:.3f}"
        return True, f"published (publish 'always'): {scores}"
    if new is None:
        return False, f"kept {kept}: no labelled image to compare the new weights on"
    margin = f" - {min_improvement:g}" if min_improvement else ""
    if new < old - min_improvement:
        return True, f"published: MRE {new:.3f} < {old:.3f} of the served model{margin}"
    return False, f"kept {kept}: the new one's MRE {new:.3f} is not below {old:.3f}{margin}"


def score_stats(new: Score | None, old: Score | None, published: bool) -> dict[str, Any]:
    """The stats' scores of a training (None: nothing scored): ``best_metric``, the share of landmarks that the
    predictor served after it finds within the success radius (0 to 1, higher is better: what 3D Slicer's
    MONAILabel module shows as its accuracy bar; left out when nothing was scored, which the module reads as 0), its
    ``mre`` beside it, and ``eval`` with both predictors' scores."""
    best = new if published else old
    metrics = {"mre_served": None, "mre_trained": None, "success_served": None, "success_trained": None}
    for which, score in (("served", old), ("trained", new)):
        if score is not None:
            metrics.update({f"mre_{which}": score.mre, f"success_{which}": score.success})
    evaluation = {
        "metrics": metrics,
        "key_metric_name": "success",
        "best_metric": None if best is None else best.success,
        "success_radius": f"{SUCCESS_RADIUS_MM:g} mm ({SUCCESS_RADIUS_PIXELS:g} pixels on an image without spacing)",
    }
    scores = {} if best is None else {"best_metric": best.success, "mre": best.mre}
    return {**scores, "eval": evaluation}


def keep_previous(*paths: Path) -> dict[str, str]:
    """Before ``paths`` are replaced: a copy of each existing one beside it, ``<stem>.<YYYYmmdd-HHMMSS><suffix>``
    (one time stamp for all, made unique), so that a published model stays restorable. {file name: copy's name}."""
    existing = [p for p in paths if p.is_file()]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 0

    def copy_of(p: Path) -> Path:
        return p.with_name(f"{p.stem}.{stamp}{f'-{n}' if n else ''}{p.suffix}")

    while any(copy_of(p).exists() for p in existing):
        n += 1
    for p in existing:
        with atomic_path(copy_of(p)) as tmp:
            shutil.copyfile(p, tmp)
    return {p.name: copy_of(p).name for p in existing}


def publish_detector(context: BundleContext, candidate: Path, info: dict[str, Any]) -> None:
    """``candidate`` as the served detector and ``info`` as its record (``detector.json``), both written beside
    their names before either is renamed: a failed write (a full disk) leaves the served pair as it was (the record
    written first stood beside the old weights, its grid and split not theirs)."""
    with atomic_path(context.detector_path) as weights, atomic_path(context.detector_info_path) as record:
        shutil.copyfile(candidate, weights)
        record.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
