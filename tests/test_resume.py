"""Resilience: training killed after an epoch resumes from ckpt_dir/last.pt at the next epoch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from bundle.checkpoints import resume_path
from bundle.data.synthetic import generate_synthetic_2d
from bundle_runs import bundle_command

from training_args import tiny_training_args

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 6


def _command(datalist: Path, models: Path, out: Path, *extra: str) -> list[str]:
    args = ["--datalist", datalist, "--ckpt_dir", models, "--output_dir", out, *tiny_training_args(EPOCHS), *extra]
    return bundle_command("training", "configs/train.yaml", *args)


@pytest.mark.slow
def test_killed_training_resumes_from_its_last_epoch(tmp_path):
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=4, n_validation=1, n_test=1, size=(64, 72), seed=2)
    models = tmp_path / "models"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # killed as soon as the first epoch is saved (SIGKILL: no clean-up of any kind)
    first = subprocess.Popen(
        _command(datalist, models, tmp_path / "out1"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    last = models / "last.pt"
    deadline = time.monotonic() + 120
    while not last.is_file() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    output = first.communicate(timeout=30)[0]
    assert last.is_file(), f"no last.pt before the kill:\n{output[-3000:]}"
    trainer = torch.load(last, weights_only=True)["trainer"]
    saved_epoch = trainer["iteration"] // trainer["epoch_length"]
    assert 1 <= saved_epoch < EPOCHS, f"the first run was not interrupted mid-way (epoch {saved_epoch})"
    assert not list(models.glob(".*.tmp*")), "a temporary checkpoint was left behind"

    resumed = subprocess.run(
        _command(datalist, models, tmp_path / "out2", "--resume", "true"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert f"Restored all variables from {last}" in log
    epochs_run = [int(e) for e in re.findall(r"SupervisedTrainer - INFO - Epoch\[(\d+)\] Complete", log)]
    assert epochs_run == list(range(saved_epoch + 1, EPOCHS + 1))
    state = torch.load(last, weights_only=True)
    assert state["trainer"]["iteration"] == EPOCHS * 2
    assert set(state) == {"model", "optimizer", "lr_scheduler", "best_saver", "trainer"}
    assert (models / "model_final.pt").is_file() and (models / "model.pt").is_file()


def test_resume_path_choices(tmp_path):
    assert resume_path(tmp_path, False) is None
    assert resume_path(tmp_path, True) is None  # nothing saved yet: a fresh start
    (tmp_path / "last.pt").write_bytes(b"x")
    assert resume_path(tmp_path, True) == str(tmp_path / "last.pt")
    assert resume_path(tmp_path, "true") == str(tmp_path / "last.pt")
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        resume_path(tmp_path, str(tmp_path / "nope.pt"))


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused_naming_each(tmp_path):
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=3, n_validation=1, n_test=1, size=(64, 72), seed=2)
    models, out = tmp_path / "models", tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(
        [*_command(datalist, models, out), "--epochs", "2"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (models / "last.pt").read_bytes()
    changed = ["--resume", "true", "--learning_rate", "0.01", "--epochs", "4", "--epoch_length", "3"]
    second = subprocess.run(
        _command(datalist, models, out, *changed), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert second.returncode != 0
    for message in (
        "learning_rate is 0.01, the resumed run's 0.001",
        "epochs is 4, the resumed run's 2",
        "epoch_length is 3, the resumed run's 2",
    ):
        assert message in second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
    assert (models / "last.pt").read_bytes() == saved  # nothing trained, nothing written


@pytest.mark.slow
def test_a_training_without_validation_writes_its_final_weights_as_model_pt_and_says_so(tmp_path):
    """No validation split: nothing to choose the best checkpoint by, so model.pt (what the commands load) holds the
    final weights, and the log says why; with a validation split model.pt stays the best one's (the test above)."""
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=3, n_validation=0, n_test=1, size=(64, 72), seed=2)
    models = tmp_path / "models"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*_command(datalist, models, tmp_path / "out"), "--epochs", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert f"nothing to choose the best checkpoint by; the final weights are written as {models / 'model.pt'}" in log
    best, final = (torch.load(models / name, weights_only=True) for name in ("model.pt", "model_final.pt"))
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in final)
