"""The training's time budget (``max_minutes``): it ends the training after the last epoch that fits, and the cosine
schedule still decays to its minimum there."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from bundle.checkpoints import read_checkpoint
from bundle.configs import config_files
from bundle.data.synthetic import generate_synthetic_2d
from bundle.handlers import TrainingTimeBudget
from bundle.handlers import time_budget as time_budget_module
from ignite.engine import Engine, Events
from monai.bundle import ConfigWorkflow

ROOT = Path(__file__).resolve().parents[1]


def _training(epochs: int, max_minutes: float | None, epoch_seconds: float, monkeypatch) -> tuple[Engine, list]:
    """An engine of ``epochs`` epochs of one iteration, each taking ``epoch_seconds`` on a fake clock, with a
    per-epoch cosine schedule and the budget; returns it with the learning rate of each epoch run."""
    clock = [0.0]
    monkeypatch.setattr(time_budget_module.time, "monotonic", lambda: clock[0])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    rates = []

    def step(engine, batch):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        clock[0] += epoch_seconds

    engine = Engine(step)
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda _: scheduler.step())  # as LrScheduleHandler, first
    TrainingTimeBudget(max_minutes, scheduler).attach(engine)
    engine.run([0], max_epochs=epochs)
    return engine, rates


def test_the_training_ends_after_the_last_epoch_that_fits_and_its_schedule_still_decays(monkeypatch):
    # 10 epochs of 100 s in a budget of 10 minutes: 6 fit
    engine, rates = _training(10, 10, 100.0, monkeypatch)
    assert engine.state.epoch == engine.state.max_epochs == 6 and len(rates) == 6
    assert rates[0] == 1.0 and rates[1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))  # the configured start
    assert all(a > b for a, b in zip(rates, rates[1:]))
    # the schedule was cut to 6 epochs: the last epoch's rate is what a 6-epoch cosine gives at its last epoch
    # (scaled by where the cut found it), far below the 10-epoch schedule's rate at epoch 6 (0.345)
    cut = rates[1] * (1 + math.cos(5 * math.pi / 6)) / (1 + math.cos(math.pi / 6))
    assert rates[-1] == pytest.approx(cut) and rates[-1] < 0.08


def test_a_budget_that_holds_every_epoch_changes_nothing(monkeypatch):
    engine, rates = _training(4, 10, 100.0, monkeypatch)
    _, unbudgeted = _training(4, None, 100.0, monkeypatch)
    assert engine.state.epoch == 4 and rates == unbudgeted


def test_a_first_epoch_past_the_budget_ends_the_training_there(monkeypatch):
    engine, rates = _training(10, 1, 100.0, monkeypatch)
    assert engine.state.epoch == engine.state.max_epochs == 1 and len(rates) == 1


@pytest.mark.parametrize("value", [0, -1, "ten", float("nan"), True])
def test_a_bad_budget_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="max_minutes"):
        TrainingTimeBudget(value)


def test_the_training_command_honours_max_minutes(tmp_path):
    """train.yaml's trainer, with a budget smaller than one epoch: one epoch of six runs, and the last model and
    last.pt say so."""
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=1, size=(64, 72), seed=3)
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / f) for f in config_files("train")],
        workflow_type="train",
        logging_file=False,
        bundle_root=str(ROOT),
        datalist=str(datalist),
        output_dir=str(tmp_path / "out"),
        ckpt_dir=str(tmp_path / "models"),
        **{"epochs": 6, "epoch_length": 1, "val_interval": 10, "batch_size": 2, "num_queries": 4},
        **{"image_size": [64, 64], "crop_size": [32, 32], "progress_bar": False, "max_minutes": 1e-6},
    )
    workflow.initialize()
    workflow.trainer.run()
    assert workflow.trainer.state.epoch == workflow.trainer.state.max_epochs == 1
    trainer = read_checkpoint(tmp_path / "models" / "last.pt", "cpu", "last")["trainer"]
    assert trainer["iteration"] == 1 and trainer["max_epochs"] == 1
    assert (tmp_path / "models" / "model_final.pt").is_file()
