"""The annotation loop of the MONAI Label app, measured: suggestion accuracy against the number of saved labels.

Run from the repository root (needs ``make monailabel``)::

    python -m scripts.experiments.labels_loop --datalist runs/hamedan/protocol.json --out runs/labels_loop \\
        [--steps "[1,3,5,10]"] [--heldout 30] [--train "{}"] [--threads null] \\
        [--server_datalist D] [--unlabelled 30] [--detector false]

A MONAI Label server of the app as a user starts it (no ``--conf``: the shipped weights, their built-in templates
and the detector shipped beside them, served from the start) over copies of the datalist's labelled training images
that are not among the built-in templates is driven by MONAI Label's own client, as a clinician runs the loop: at
each step the next images (datalist order) get a saved label (their reference landmarks, standing for corrected
suggestions); from 2 labels on the server is asked to train the detector (``{"network": "detector"}`` and the
``--train`` keys; the app's defaults otherwise), which it publishes only when it scores better on its held-out
labels. Before the first label, after saving the labels of a step and after its training, every held-out image (the
datalist's ``test`` items, uploaded: the server never sees their labels) is suggested and scored against its
reference in mm (the datalist's spacing).
``--server_datalist D`` starts the server with ``--conf datalist D`` instead (a new anatomy's loop: D's template
before the first label, the saved labels alone after it), and ``--unlabelled N`` adds N unlabelled images to the
studies folder, of which the app makes pseudo-templates while the saved labels are few (``run``).

Writes ``OUT/learning_curve.json`` (after every evaluation, so a stopped run keeps what it measured) and
``OUT/learning_curve.png``, and prints the table: labels, what the server served (predictor, templates), MRE,
SDR 2 mm, errors above 10 mm, the step's time (saving + training), a suggestion's time during the training.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from bundle.data.datalist import load_datalist
from bundle.data.markups import ControlPoint, write_mrk_json
from bundle.io_utils import atomic_path, write_json_atomic
from bundle.metrics import GROSS_ERROR_MM
from bundle.settings import as_flag
from bundle.template_file import load_template
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scripts.cli import run_fire
from scripts.monailabel_server import ROOT, serving


def point_list(path: Path, names: Sequence[str], landmarks: Sequence) -> Path:
    """A 3D Slicer point list of pixel landmarks over a PNG (pixel ``(x, y)`` is LPS ``(x, y, 0)``), as Slicer saves
    a corrected suggestion."""
    points = [
        ControlPoint(n, None if p is None else (-float(p[0]), -float(p[1]), 0.0)) for n, p in zip(names, landmarks)
    ]
    return write_mrk_json(path, points, coordinate_system="LPS")


def score(client, items: Sequence[dict], names: Sequence[str]) -> dict[str, Any]:
    """Suggestions for uploaded ``items`` scored against their landmarks (mm through their spacing)."""
    errors, seconds, replies = [], [], []
    for item in items:
        started = time.monotonic()
        _, reply = client.infer("landmarks", "", {}, file=item["image"])
        seconds.append(time.monotonic() - started)
        replies.append(reply)
        spacing = np.asarray(item.get("spacing") or [1.0, 1.0], dtype=float)
        for name, truth in zip(names, item["landmarks"]):
            found = reply["landmarks"].get(name)
            if truth is None or found is None:
                continue
            errors.append(float(np.linalg.norm((np.asarray(found) - np.asarray(truth)) * spacing)))
    e = np.asarray(errors)
    return {
        "mre_mm": float(e.mean()),
        "median_mm": float(np.median(e)),
        "sdr_2mm": float((e <= 2.0).mean()),
        "sdr_4mm": float((e <= 4.0).mean()),
        "gross_10mm": float((e > GROSS_ERROR_MM).mean()),
        "landmarks_scored": int(e.size),
        "suggestion_s_median": float(np.median(seconds)),
        "predictor": replies[-1]["predictor"],
        "predictor_choice": replies[-1]["predictor_choice"],
        "templates": [t["image"] for t in replies[-1]["templates"]],
        "checkpoint": replies[-1]["checkpoint"],
    }


def _suggestion_during(client, image: str, delay_s: float, out: dict) -> None:
    time.sleep(delay_s)
    started = time.monotonic()
    client.infer("landmarks", "", {}, file=image)
    out["suggestion_during_training_s"] = time.monotonic() - started


def train_detector(client, request: dict, probe_image: str, timeout_s: float = 7200) -> dict[str, Any]:
    """One detector training of the server, timed, with a suggestion requested while it runs; its ``train_stats``."""
    probe: dict[str, float] = {}
    started = time.monotonic()
    client.train_start("landmarks", {"network": "detector", **request})
    thread = threading.Thread(target=_suggestion_during, args=(client, probe_image, 20.0, probe))
    thread.start()
    while True:
        status = client.train_status()
        if isinstance(status, dict) and status.get("status") in ("DONE", "ERROR"):
            break
        if time.monotonic() > started + timeout_s:
            raise RuntimeError(f"the training did not end in {timeout_s} s")
        time.sleep(2)
    seconds = time.monotonic() - started
    thread.join()
    if status["status"] != "DONE":
        raise RuntimeError(f"the server's training failed: {status}")
    stats = client.info()["train_stats"]["landmarks"]
    return {
        "train_s": seconds,
        **probe,
        "published": stats["published"],
        "decision": stats["decision"],
        "trained_on": stats["train"]["trained_on"],
        "held_out": stats["train"]["held_out"],
        "mre_served": stats["eval"]["metrics"]["mre_served"],
        "mre_trained": stats["eval"]["metrics"]["mre_trained"],
        "units": stats["eval"]["units"],
    }


def plot(runs: dict[str, Sequence[dict]], path: Path, top_mm: float | None = None) -> Path:
    """MRE of the suggestions against the number of saved labels (after each step's training), one line per named
    run's rows; t / d mark what the server served (templates, detector). ``top_mm``: the axis ends there, and an MRE
    above it is drawn at the top with its value."""
    figure = Figure(figsize=(5.5, 3.4 + 0.2 * len(runs)), dpi=120)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for name, rows in runs.items():
        last = {row["labels"]: row for row in rows}  # the last row of each step: after its training
        labels = sorted(last)
        mre = [last[n]["mre_mm"] for n in labels]
        shown = [min(v, top_mm) if top_mm else v for v in mre]
        ax.plot(labels, shown, "o-", label=name)
        for i, (n, v, y) in enumerate(zip(labels, mre, shown)):
            if y < v and i > 0 and mre[i - 1] == v:
                continue  # an MRE above the axis is named once while it holds
            text = last[n]["predictor"][0] + (f" {v:.0f} mm" if y < v else "")
            ax.annotate(text, (n, y), textcoords="offset points", xytext=(4, -12 if y < v else 4))
    ax.set_ylim(bottom=0, top=top_mm)
    ax.set_xlabel("labels saved in MONAI Label")
    ax.set_ylabel("MRE of the suggestions (mm)")
    ax.set_title("held-out images; t = templates, d = detector served", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def wait_for_background(client, image: str, timeout_s: float) -> float | None:
    """Seconds until a suggestion for ``image`` names no background work under way (its ``pending``: auto's choice and
    pseudo-templates, which the app computes after the labels or the served models change), None when some is still
    under way after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() < started + timeout_s:
        _, reply = client.infer("landmarks", "", {}, file=image)
        if not reply["pending"]:
            return time.monotonic() - started
        time.sleep(5)  # a suggestion per poll: few, so that the work waited for gets the cores
    return None


def run(
    datalist: str,
    out: str = "runs/labels_loop",
    steps: Sequence[int] = (1, 3, 5, 10),
    heldout: int | None = None,
    train: dict | None = None,
    threads: int | None = None,
    detector: bool = True,
    server_datalist: str | None = None,
    unlabelled: int = 0,
    settle_s: float = 600,
) -> Path:
    """The loop (module doc); returns the path of ``learning_curve.json``. ``detector=False`` requests no detector
    training (the suggestions of what is served as the labels are saved, minutes instead of hours).

    ``server_datalist``: the server's ``--conf datalist`` (its templates stand in before the first label, and no
    built-in template joins the saved labels: the loop of a new anatomy). ``unlabelled``: that many of the datalist's
    training images that the loop never labels are copied into the studies folder too, unlabelled: with few saved
    labels (at most the bundle's ``pseudo_max_labelled``) and no built-in template joining them, the app makes
    pseudo-templates of them. After saving the labels of a step and after its training, the loop waits (up to
    ``settle_s``) until the app's background work is done (auto's choice, pseudo-templates) before it scores
    (``settled_s`` in the row)."""
    detector = as_flag(detector, "detector")  # the command line gives "false" as a string
    data = load_datalist(datalist)
    names = list(data["landmark_names"])
    builtin = set()
    if not server_datalist:
        builtin = {Path(s).stem for s in load_template(ROOT / "models/template_features.pt")["sources"]}
    pool = [it for it in data["training"] if it.get("landmarks") and Path(it["image"]).stem not in builtin]
    steps = sorted(int(n) for n in steps)
    if len(pool) < steps[-1]:
        raise ValueError(
            f"{datalist}: {len(pool)} labelled training images outside the built-in templates, {steps[-1]} needed"
        )
    held = list(data["test"])[: heldout or None]
    if not held:
        raise ValueError(f"{datalist}: no test items to score the suggestions on")
    work = Path(out)
    shutil.rmtree(work / "server", ignore_errors=True)
    studies = work / "server" / "studies"
    studies.mkdir(parents=True)
    labelled = {it["image"] for it in pool[: steps[-1]]}
    extra = [it for it in data["training"] if it["image"] not in labelled][: int(unlabelled)]
    for item in pool[: steps[-1]] + extra:
        shutil.copy(item["image"], studies)
    (work / "labels").mkdir(exist_ok=True)
    rows: list[dict] = []
    result_path = work / "learning_curve.json"

    def record(row: dict) -> None:
        rows.append(row)
        write_json_atomic(result_path, {"datalist": str(datalist), "heldout": len(held), "rows": rows})
        print(
            f"{row['labels']:>3} labels  {row['stage']:<14} {row['predictor']:<9} "
            f"{len(row['templates']):>2} templates  "
            f"MRE {row['mre_mm']:.2f} mm  SDR2 {100 * row['sdr_2mm']:.1f} %  >10 mm {100 * row['gross_10mm']:.1f} %  "
            f"step {row.get('step_s', 0):.0f} s",
            flush=True,
        )

    conf = ("datalist", str(Path(server_datalist).resolve())) if server_datalist else ()
    with serving(work / "server", studies, conf, threads=threads) as server:
        client = server["client"]
        served_names = list(server["info"]["models"]["landmarks"]["labels"])
        if served_names != names:
            raise ValueError(f"{datalist}: landmark names {names} differ from the server's {served_names}")
        record({"labels": 0, "stage": "start", "step_s": server["start_s"], **score(client, held, names)})
        saved = 0
        for n in steps:
            started = time.monotonic()
            for item in pool[saved:n]:
                stem = Path(item["image"]).stem
                label = point_list(work / "labels" / f"{stem}.mrk.json", names, item["landmarks"])
                client.save_label(stem, str(label), tag="final")
            saved = n
            step_s = time.monotonic() - started
            settled_s = wait_for_background(client, held[0]["image"], settle_s)
            record(
                {
                    "labels": n,
                    "stage": "labels saved",
                    "step_s": step_s,
                    "settled_s": settled_s,
                    **score(client, held, names),
                }
            )
            if detector and n >= 2:
                trained = train_detector(client, dict(train or {}), held[0]["image"])
                settled_s = wait_for_background(client, held[0]["image"], settle_s)
                record(
                    {
                        "labels": n,
                        "stage": "trained",
                        "step_s": trained["train_s"],
                        "settled_s": settled_s,
                        **trained,
                        **score(client, held, names),
                    }
                )
    plot({Path(out).name: rows}, work / "learning_curve.png")
    return result_path


if __name__ == "__main__":
    run_fire(run)
