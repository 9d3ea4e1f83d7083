"""The commands' config lists (bundle.configs.config_files) and running a command from code
(scripts.bundle_commands): what each command wrote, read from its files."""

from __future__ import annotations

import json
import math

import pytest
from bundle.configs import CONFIG_FILES, config_files
from bundle.data.synthetic import generate_synthetic_2d
from scripts.bundle_commands import read_outputs, run_command

TINY = dict(epochs=2, epoch_length=2, batch_size=2, image_size=[64, 64], crop_size=[32, 32], num_queries=4)


def test_3d_lists_merge_train_3d_after_the_2d_base():
    assert config_files("train", spatial_dims=3) == ["configs/train.yaml", "configs/train_3d.yaml"]
    assert config_files("evaluate", spatial_dims=3) == [
        "configs/train.yaml",
        "configs/train_3d.yaml",
        "configs/evaluate.yaml",
    ]
    assert config_files("finetune", spatial_dims=3)[:2] == ["configs/train.yaml", "configs/train_3d.yaml"]
    assert config_files("inference", spatial_dims=3) == ["configs/inference.yaml", "configs/train_3d.yaml"]
    assert all(config_files(name) == list(files) for name, files in CONFIG_FILES.items())
    for name, dims in (("train", 4),):
        with pytest.raises(ValueError, match=f"{name}: no configuration for spatial_dims {dims}"):
            config_files(name, spatial_dims=dims)


@pytest.mark.slow
def test_training_and_evaluating_return_what_they_wrote(tmp_path):
    """The training's best validation MRE (the checkpoint saver's ranking in last.pt) and the evaluation's
    metrics.json, from a tiny run of each command line."""
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=3, n_validation=1, n_test=1, seed=1)
    run = tmp_path / "run"
    settings = dict(datalist=datalist, progress_bar=False, **TINY)
    trained = run_command("training", config_files("train"), dict(settings, output_dir=run, val_interval=1))
    assert set(trained.outputs) == {"val_mre_mm"} and math.isfinite(trained.outputs["val_mre_mm"])
    assert trained.seconds > 0 and trained.peak_rss_mb > 0
    # no validation yet (val_interval beyond the epochs): nothing ranked
    unvalidated = dict(settings, output_dir=tmp_path / "unvalidated", val_interval=10)
    assert run_command("training", config_files("train"), unvalidated).outputs == {}
    evaluation = dict(settings, output_dir=tmp_path / "eval", ckpt_path=run / "models" / "model.pt", overlays=False)
    evaluated = run_command("evaluating", config_files("evaluate"), evaluation, log=tmp_path / "eval.log")
    assert evaluated.outputs == json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated.outputs["n_images"] == 1 and "Engine run" in (tmp_path / "eval.log").read_text()
    assert read_outputs("training", config_files("train"), dict(settings, output_dir=run)) == trained.outputs
