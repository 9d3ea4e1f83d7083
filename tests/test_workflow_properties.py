"""MONAI's own check of the bundle: ``ConfigWorkflow(...).check_properties()`` finds every required property of the
training and evaluation workflows (monai/bundle/properties.py) and no optional one under a wrong id."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bundle.data.synthetic import generate_synthetic_2d, generate_synthetic_3d
from monai.bundle import ConfigWorkflow
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.inferers import Inferer

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = {
    "training": ("train", ["train.yaml"]),
    "training 3D": ("train", ["train.yaml", "train_3d.yaml"]),
    "stage 2": ("train", ["train.yaml", "train_stage2.yaml"]),
    "fine-tuning": ("train", ["train.yaml", "train_stage2.yaml", "finetune.yaml"]),
    "evaluation (infer)": ("infer", ["train.yaml", "evaluate.yaml"]),
    "evaluation (eval)": ("eval", ["train.yaml", "evaluate.yaml"]),
    "evaluation, detector": ("eval", ["train.yaml", "train_stage2.yaml", "evaluate.yaml", "evaluate_detector.yaml"]),
    "inference": ("inference", ["inference.yaml"]),
}


@pytest.fixture(scope="module")
def datalists(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    return {
        2: generate_synthetic_2d(data / "2d", n_training=3, n_validation=1, n_test=1, seed=1),
        3: generate_synthetic_3d(data / "3d", n_training=2, n_validation=1, n_test=1),
    }


@pytest.mark.parametrize("name", WORKFLOWS)
def test_monai_finds_every_property(name, datalists, tmp_path):
    """check_properties() after initialize() (MONAI reads the properties from the parsed config), then the
    properties themselves: the objects the commands run."""
    workflow_type, files = WORKFLOWS[name]
    settings = {"bundle_root": str(ROOT), "output_dir": str(tmp_path / "out")}
    if name != "inference":
        settings["datalist"] = str(datalists[3 if "train_3d.yaml" in files else 2])
    if "evaluate_detector.yaml" in files:  # the shipped detector: the 19 cephalometric landmarks
        settings["network_def#n_landmarks"] = 19
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / "configs" / f) for f in files],
        workflow_type=workflow_type,
        logging_file=False,
        **settings,
    )
    workflow.initialize()
    assert workflow.check_properties() == []
    assert isinstance(workflow.network_def, torch.nn.Module) and workflow.dataset_dir
    if workflow_type == "train":
        trainer = workflow.trainer
        assert isinstance(trainer, SupervisedTrainer) and workflow.max_epochs == trainer.state.max_epochs
        assert isinstance(workflow.train_inferer, Inferer) and workflow.train_inferer is trainer.inferer
        assert workflow.train_dataset is trainer.data_loader.dataset
        handlers = {type(h).__name__: h for h in workflow.train_handlers}
        assert {"LrScheduleHandler", "ValidationHandler", "AtomicCheckpointSaver"} <= set(handlers)
        assert handlers["ValidationHandler"].validator is workflow.evaluator
        assert handlers["ValidationHandler"].interval == workflow.val_interval
    else:
        evaluator = workflow.evaluator
        assert isinstance(evaluator, SupervisedEvaluator) and workflow.inferer is evaluator.inferer
