"""A seeded tiny training + one-shot evaluation through the bundle's own commands: it learns better than chance."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle.configs import config_files
from bundle.data.datalist import landmarks_array, load_datalist
from bundle.data.synthetic import generate_synthetic_2d
from monai.bundle import run

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "image_size": [96, 96],
    "crop_size": [48, 48],
    "num_queries": 8,
    "batch_size": 4,
    "epochs": 6,
    "epoch_length": 20,
    "val_interval": 3,
    "progress_bar": False,
    "seed": 0,
}


def chance_mre_mm(datalist: dict, size_px: tuple[int, int], n: int = 4000, seed: int = 0) -> float:
    """Mean radial error (mm) of guessing each test landmark uniformly at random inside the image."""
    rng = np.random.default_rng(seed)
    errors = []
    for item in datalist["test"]:
        spacing = np.asarray(item["spacing"])
        guesses = rng.uniform(-0.5, np.asarray(size_px) - 0.5, size=(n, 2))
        for point in landmarks_array(item, len(datalist["landmark_names"]), 2):
            errors.append(np.linalg.norm((guesses - point) * spacing, axis=1).mean())
    return float(np.mean(errors))


def evaluate(datalist: Path, out: Path, ckpt: Path, **overrides) -> dict:
    run(
        "evaluating",
        config_file=[str(ROOT / f) for f in config_files("evaluate")],
        bundle_root=str(ROOT),
        datalist=str(datalist),
        output_dir=str(out),
        ckpt_path=str(ckpt),
        **{k: TINY[k] for k in ("image_size", "progress_bar", "seed")},
        **overrides,
    )
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_tiny_training_learns_better_than_chance_and_than_untrained(tmp_path):
    datalist_path = generate_synthetic_2d(tmp_path / "data", n_training=12, n_validation=2, n_test=4, seed=3)
    datalist = load_datalist(datalist_path)
    models = tmp_path / "models"
    run(
        "training",
        config_file=str(ROOT / "configs/train.yaml"),
        bundle_root=str(ROOT),
        datalist=str(datalist_path),
        output_dir=str(tmp_path / "train"),
        ckpt_dir=str(models),
        **TINY,
    )
    assert (models / "model.pt").is_file() and (models / "model_final.pt").is_file()
    state = torch.load(models / "model.pt", weights_only=True)
    assert any(k.startswith("image_encoder.") for k in state) and any(k.startswith("crop_encoder.") for k in state)

    trained = evaluate(datalist_path, tmp_path / "eval", models / "model.pt")
    torch.manual_seed(0)
    untrained_ckpt = tmp_path / "untrained.pt"
    from bundle.networks.contrastive import ContrastiveLandmarkNet

    torch.save(ContrastiveLandmarkNet(spatial_dims=2).state_dict(), untrained_ckpt)
    untrained = evaluate(datalist_path, tmp_path / "eval_untrained", untrained_ckpt)

    n_landmarks = len(datalist["landmark_names"])
    assert trained["n_images"] == 4 and trained["n_landmarks"] == n_landmarks
    with open(tmp_path / "eval" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * n_landmarks and set(rows[0]) == {"image", "landmark", "x", "y", "error_mm"}
    assert len(list((tmp_path / "eval" / "overlays").glob("*.png"))) == 4

    chance = chance_mre_mm(datalist, (256, 288))
    assert trained["mre_mm"] < chance / 8, (trained["mre_mm"], chance)
    assert trained["mre_mm"] < 0.5 * untrained["mre_mm"], (trained["mre_mm"], untrained["mre_mm"])

    # k-shot: three labelled training images as `templates`, plus two pseudo-templates labelled by them
    kshot = dict(datalist, templates=[it for it in datalist["training"] if it.get("landmarks")][:3])
    kshot.pop("template", None)
    kshot_path = tmp_path / "data" / "kshot.json"
    kshot_path.write_text(json.dumps(kshot))
    combined = evaluate(
        kshot_path, tmp_path / "eval_kshot", models / "model.pt", pseudo_candidates=4, pseudo_templates=2
    )
    assert len(combined["templates"]) == 5 and combined["template"] == kshot["templates"][0]["image"]
    assert (
        combined["pseudo_templates"] == combined["templates"][3:]
    )  # metrics.json says which were labelled by matching
    held_out = {it["image"] for it in datalist["test"] + datalist["validation"]}
    assert not held_out & set(combined["templates"])
    assert combined["mre_mm"] < chance / 8, (combined["mre_mm"], chance)
