"""MONAI's own check of the bundle: ``ConfigWorkflow(...).check_properties()`` finds every required property of the
training and evaluation workflows (monai/bundle/properties.py) and no optional one under a wrong id."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bundle.configs import bundle_parser, config_files
from bundle.data.datalist import load_datalist
from bundle.data.synthetic import generate_synthetic_2d, generate_synthetic_3d
from bundle.networks.detector import HeatmapDetector
from bundle.pipeline.detector_data import write_detector_info
from monai.bundle import ConfigWorkflow
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.inferers import Inferer

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = {
    "training": ("train", config_files("train")),
    "training 3D": ("train", config_files("train", spatial_dims=3)),
    "stage 2": ("train", config_files("train_stage2")),
    "fine-tuning": ("train", config_files("finetune")),
    "evaluation (infer)": ("infer", config_files("evaluate")),
    "evaluation (eval)": ("eval", config_files("evaluate")),
    "evaluation, detector": ("eval", config_files("evaluate")),
    "evaluation 3D": ("eval", config_files("evaluate", spatial_dims=3)),
    "inference": ("inference", config_files("inference")),
    "inference 3D": ("inference", config_files("inference", spatial_dims=3)),
}


def _detector(folder: Path, datalist: dict) -> Path:
    """An untrained detector of the default 2D settings for ``datalist``'s landmarks, its record beside it."""
    network = HeatmapDetector(n_landmarks=len(datalist["landmark_names"]))
    folder.mkdir(parents=True)
    torch.save({"model": network.state_dict()}, folder / "model.pt")
    write_detector_info(folder, [], "human", datalist["training"], [192, 192], datalist["landmark_names"], {})
    return folder / "model.pt"


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
    volumes = "configs/train_3d.yaml" in files
    if name != "inference":
        settings["datalist"] = str(datalists[3 if volumes else 2])
    if name in ("inference 3D", "evaluation 3D"):  # no 3D weights ship: an untrained network of the default 3D settings
        network = bundle_parser(config_files("train", spatial_dims=3)).get_parsed_content("network_def")
        torch.save(network.state_dict(), tmp_path / "untrained_3d.pt")
        settings["ckpt_path"] = str(tmp_path / "untrained_3d.pt")
    if name == "evaluation, detector":  # a detector of the datalist's landmarks, with its record
        settings["pipeline"] = "detector"
        settings["detectors"] = str(_detector(tmp_path / "detector", load_datalist(datalists[2])))
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / f) for f in files], workflow_type=workflow_type, logging_file=False, **settings
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


@pytest.mark.parametrize("name", WORKFLOWS)
def test_initialize_computes_and_writes_nothing(name, tmp_path, monkeypatch):
    """``ConfigWorkflow(...).initialize()`` in an empty working folder, with the default settings (the embedded data,
    no datalist given): no file is written there or under the output folder, and neither the embedded data sets nor
    pseudo-labels are made (each raises if called); the work is ``run``'s."""
    import bundle.data.embedded
    import bundle.data.synthetic
    import bundle.pipeline.detector_data

    def refuse(*args, **kwargs):
        raise AssertionError("initialize() computed what only run should")

    for module, function in (
        (bundle.data.embedded, "ensure_synthetic_dataset"),
        (bundle.data.synthetic, "ensure_synthetic_dataset"),
        (bundle.pipeline.detector_data, "pseudo_labelled_items"),
    ):
        monkeypatch.setattr(module, function, refuse)
    monkeypatch.chdir(tmp_path)
    workflow_type, files = WORKFLOWS[name]
    workflow = ConfigWorkflow(
        config_file=[str(ROOT / f) for f in files],
        workflow_type=workflow_type,
        bundle_root=str(ROOT),
        output_dir=str(tmp_path / "out"),
    )
    workflow.initialize()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == []
