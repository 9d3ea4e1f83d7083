"""DistributedDataParallel training (configs/multi_gpu_train.yaml) under torchrun: gloo, 2 CPU processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bundle.data.synthetic import generate_synthetic_2d
from bundle.networks.contrastive import ContrastiveLandmarkNet
from bundle_runs import run_bundle

from training_args import tiny_training_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_gloo_processes_train_and_rank0_writes_one_checkpoint(tmp_path):
    """Also: the run starts from ``--init_weights`` (at learning rate 0 it ends with exactly those weights) and each
    process has its own random stream (seed + rank)."""
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=4, n_validation=1, n_test=1, size=(64, 72), seed=1)
    models, logs = tmp_path / "models", tmp_path / "logs"
    torch.manual_seed(123)
    initial = ContrastiveLandmarkNet().state_dict()
    torch.save(initial, tmp_path / "init.pt")
    configs = ["configs/train.yaml", "configs/multi_gpu_train.yaml"]
    args = ["--datalist", datalist, "--ckpt_dir", models, "--output_dir", tmp_path / "out", *tiny_training_args(2)]
    args += ["--init_weights", tmp_path / "init.pt", "--learning_rate", "0"]
    run_bundle("training", configs, *args, processes=2, logs=logs, timeout=240, check=True)

    # both ranks trained both epochs (torchrun keeps one log folder per rank)
    rank_logs = {p.parent.name: p.read_text() + (p.parent / "stdout.log").read_text() for p in logs.rglob("stderr.log")}
    assert sorted(rank_logs) == ["0", "1"]
    for rank, text in rank_logs.items():
        assert "SupervisedTrainer - INFO - Epoch[2] Complete" in text, f"rank {rank} did not finish:\n{text[-2000:]}"
    # handlers on rank 0 only: validation metrics are logged by rank 0 alone
    assert "Metrics -- val_mre_mm" in rank_logs["0"] and "Metrics -- val_mre_mm" not in rank_logs["1"]
    # each process seeded with seed + rank: its own crops, rotations, intensities and queries
    assert "random seed 0;" in rank_logs["0"] and "random seed 1;" in rank_logs["1"]

    # one set of checkpoints, written by rank 0, unwrapped from DDP (plain network keys)
    assert sorted(p.name for p in models.iterdir()) == ["last.pt", "model.pt", "model_final.pt"]
    state = torch.load(models / "model_final.pt", weights_only=True)
    assert all(not k.startswith("module.") for k in state) and any(k.startswith("crop_encoder.") for k in state)
    # started from init_weights: at learning rate 0 the weights are those given (BatchNorm statistics move)
    for key, value in initial.items():
        if not key.endswith(("running_mean", "running_var", "num_batches_tracked")):
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=f"{key} moved")
    last = torch.load(models / "last.pt", weights_only=True)
    assert last["trainer"]["epoch_length"] == 2 and last["trainer"]["iteration"] == 4
