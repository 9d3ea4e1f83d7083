"""The shipped configs instantiate with their defaults (the paths a user's first command takes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ignite.handlers import ProgressBar
from monai.bundle import ConfigParser
from monai.engines import SupervisedEvaluator, SupervisedTrainer

from bundle.checkpoints import load_weights
from bundle.configs import bundle_parser
from bundle.data.synthetic import generate_synthetic_2d

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_datalist(tmp_path_factory):
    return generate_synthetic_2d(tmp_path_factory.mktemp("data"), n_training=3, n_validation=1, n_test=1, seed=1)


def parser_for(files, datalist, tmp_path) -> ConfigParser:
    return bundle_parser(
        [f"configs/{f}" for f in files],
        datalist=str(datalist),
        output_dir=str(tmp_path / "out"),
        ckpt_dir=str(tmp_path / "models"),
    )


def test_training_config_defaults_build_a_trainer_with_its_handlers(tiny_datalist, tmp_path):
    parser = parser_for(["train.yaml"], tiny_datalist, tmp_path)
    trainer = parser.get_parsed_content("train#trainer")
    assert isinstance(trainer, SupervisedTrainer)
    assert any(isinstance(h, ProgressBar) for h in parser.get_parsed_content("train#progress_handlers"))
    assert isinstance(parser.get_parsed_content("validate#evaluator"), SupervisedEvaluator)


def test_evaluation_and_inference_configs_load_the_shipped_model(tiny_datalist, tmp_path):
    parser = parser_for(["train.yaml", "evaluate.yaml"], tiny_datalist, tmp_path)
    assert parser.get_parsed_content("ckpt_path") == str(ROOT / "models" / "model.pt")
    assert isinstance(parser.get_parsed_content("evaluate#evaluator"), SupervisedEvaluator)
    assert parser.get_parsed_content("dataset_dir") == str(Path(tiny_datalist).parent)  # the zoo's key
    # inference.yaml alone: the built-in template, or the datalist's when one is given
    for overrides in ({}, {"datalist": str(tiny_datalist)}):
        parser = bundle_parser("configs/inference.yaml", output_dir=str(tmp_path / "out"), **overrides)
        assert parser.get_parsed_content("ckpt_path") == str(ROOT / "models" / "model.pt")
        assert isinstance(parser.get_parsed_content("evaluator"), SupervisedEvaluator)
        expected = 19 if not overrides else len(ConfigParser.load_config_file(tiny_datalist)["landmark_names"])
        assert len(parser.get_parsed_content("landmark_names")) == expected


def test_evaluation_picks_a_labelled_training_template_by_either_rule(tiny_datalist, tmp_path):
    import json

    datalist = json.loads(Path(tiny_datalist).read_text())
    del datalist["template"]  # the bundle must choose one
    no_template = Path(tiny_datalist).parent / "no_template.json"  # beside the original: same relative paths
    no_template.write_text(json.dumps(datalist))
    labelled = {Path(it["image"]).name for it in datalist["training"] if it.get("landmarks")}
    assert len(labelled) >= 2
    for rule in ("landmarks", "features"):
        parser = bundle_parser(
            ["configs/train.yaml", "configs/evaluate.yaml"],
            datalist=str(no_template),
            output_dir=str(tmp_path / "out"),
            template_rule=rule,
        )
        assert Path(parser.get_parsed_content("evaluate#template")["image"]).name in labelled
    parser = bundle_parser(
        ["configs/train.yaml", "configs/evaluate.yaml"],
        datalist=str(no_template),
        output_dir=str(tmp_path / "out"),
        template_rule="nearest",
    )
    with pytest.raises(RuntimeError) as failure:  # MONAI wraps the error of a config expression
        parser.get_parsed_content("evaluate#template")
    assert "template rule must be one of ('landmarks', 'features'), got 'nearest'" in str(failure.value.__cause__)


def test_shipped_model_config_builds_and_loads_the_shipped_weights(tiny_datalist, tmp_path):
    parser = parser_for(["train.yaml", "hamedan_ceph.yaml"], tiny_datalist, tmp_path)
    trainer = parser.get_parsed_content("train#trainer")
    assert trainer.state.max_epochs * trainer.state.epoch_length == 3000
    network = parser.get_parsed_content("network")
    load_weights(network, ROOT / "models" / "model.pt")  # strict: the architecture of the weights it made
    sampling = parser.get_parsed_content("train#view_pair_transforms")[2]
    assert sampling.gamma == parser.get_parsed_content("sampling_gamma") > 0
