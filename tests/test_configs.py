"""The shipped configs instantiate with their defaults (the paths a user's first command takes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bundle.checkpoints import load_weights
from bundle.configs import apply_cpu_threads, bundle_parser, config_files
from bundle.data.synthetic import generate_synthetic_2d
from ignite.handlers import ProgressBar
from monai.bundle import ConfigParser
from monai.engines import SupervisedEvaluator, SupervisedTrainer

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
            config_files("evaluate"), datalist=str(no_template), output_dir=str(tmp_path / "out"), template_rule=rule
        )
        assert Path(parser.get_parsed_content("evaluate#templates")[0]["image"]).name in labelled
    parser = bundle_parser(
        config_files("evaluate"), datalist=str(no_template), output_dir=str(tmp_path / "out"), template_rule="nearest"
    )
    with pytest.raises(RuntimeError) as failure:  # MONAI wraps the error of a config expression
        parser.get_parsed_content("evaluate#templates")
    assert "template rule must be one of ('landmarks', 'features'), got 'nearest'" in str(failure.value.__cause__)
    # refused also where the datalist names its template and the rule would go unused
    parser = bundle_parser(
        config_files("evaluate"), datalist=str(tiny_datalist), output_dir=str(tmp_path / "out"), template_rule="nearest"
    )
    with pytest.raises(RuntimeError) as failure:
        parser.get_parsed_content("evaluate#templates")
    assert "template rule must be one of ('landmarks', 'features'), got 'nearest'" in str(failure.value.__cause__)


def test_shipped_model_config_builds_and_loads_the_shipped_weights(tiny_datalist, tmp_path):
    parser = parser_for(["train.yaml", "hamedan_ceph.yaml"], tiny_datalist, tmp_path)
    trainer = parser.get_parsed_content("train#trainer")
    assert trainer.state.max_epochs * trainer.state.epoch_length == 3000
    network = parser.get_parsed_content("network")
    load_weights(network, ROOT / "models" / "model.pt")  # strict: the architecture of the weights it made
    sampling = parser.get_parsed_content("train#sampling_weight")
    assert sampling.gamma == parser.get_parsed_content("sampling_gamma") > 0


def _config_ids(value, prefix=""):
    """Every id of a YAML config (``a#b`` for nested keys; list items are not ids of their own)."""
    if isinstance(value, dict):
        for key, item in value.items():
            key = str(key).lstrip("+").replace("::", "#")
            yield f"{prefix}{key}"
            yield from _config_ids(item, f"{prefix}{key}#")


def _config_strings(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _config_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _config_strings(item)
    elif isinstance(value, str):
        yield value


def test_no_config_id_addresses_a_list_item_by_position():
    import re

    import yaml

    configs = {path.name: yaml.safe_load(path.read_text()) for path in sorted((ROOT / "configs").glob("*.yaml"))}
    raw = {}  # id -> its value in the first file that defines it
    for content in configs.values():
        for i in _config_ids(content):
            node = content
            for part in i.split("#"):
                node = node.get(part, node.get(f"+{part}")) if isinstance(node, dict) else None
            if node is not None:
                raw.setdefault(i, node)
    for name, content in configs.items():
        for text in _config_strings(content):
            for ref in re.findall(r"[@%]([\w#:]+)", text) + [text.replace("::", "#")]:
                parts = ref.replace("::", "#").split("#")
                assert not any(p.isdigit() for p in parts[1:]), f"{name}: {text!r} addresses a list item by position"
            for ref, index in re.findall(r"@([\w#]+)\[([^\]]*)\]", text):
                value = raw.get(ref)
                items = isinstance(value, list) and any(isinstance(v, (dict, str)) for v in value)
                assert ":" not in index and not items, f"{name}: {text!r} indexes the list {ref} by position"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_parsing_writes_nothing_and_runs_no_network(tmp_path, monkeypatch, caplog):
    """Parsing the trainer and both evaluators on the default datalist path writes nothing and runs no network;
    the embedded set is generated by `ensure_data` (the commands' first step), the template is chosen when the
    evaluation starts."""
    import json
    import logging
    import shutil

    import bundle.data.embedded
    import torch
    from bundle.data.datalist import DatalistError

    root = tmp_path / "bundle"
    shutil.copytree(ROOT / "configs", root / "configs")
    files = config_files("evaluate")
    settings = {"bundle_root": root, "ckpt_path": str(ROOT / "models" / "model.pt")}
    before = _files(tmp_path)
    # the default datalist missing: parsing needs no data until the datalist is read, which names the file
    parser = bundle_parser(files, **settings)
    assert isinstance(parser.get_parsed_content("network_def"), torch.nn.Module)
    with pytest.raises(RuntimeError) as failure:
        parser.get_parsed_content("dataset")
    assert isinstance(failure.value.__cause__, DatalistError)
    assert str(root / "data" / "synthetic_2d" / "datalist.json") in str(failure.value.__cause__)
    assert _files(tmp_path) == before
    # `ensure_data` generates the embedded set (a tiny one here), and a user's datalist is left as it is
    generated = []
    monkeypatch.setattr(
        bundle.data.embedded,
        "ensure_synthetic_dataset",
        lambda path, spatial_dims: (
            generated.append(path)
            or generate_synthetic_2d(Path(path).parent, n_training=4, n_validation=1, n_test=1, seed=1)
        ),
    )
    bundle_parser(files, **settings, datalist=str(tmp_path / "mine.json")).get_parsed_content("ensure_data")
    assert generated == []
    bundle_parser(files, **settings).get_parsed_content("ensure_data")
    datalist = root / "data" / "synthetic_2d" / "datalist.json"
    assert generated == [datalist] and datalist.is_file()
    content = json.loads(datalist.read_text())
    del content["template"]  # the evaluation must choose one: network passes, at run time only
    datalist.write_text(json.dumps(content))

    forwards = []
    hook = torch.nn.modules.module.register_module_forward_hook(lambda *args: forwards.append(1))
    try:
        before = _files(tmp_path)
        parser = bundle_parser(files, **settings, template_rule="features")
        assert isinstance(parser.get_parsed_content("train#trainer"), SupervisedTrainer)
        assert isinstance(parser.get_parsed_content("validate#evaluator"), SupervisedEvaluator)
        evaluator = parser.get_parsed_content("evaluate#evaluator")
        assert _files(tmp_path) == before and not forwards
        with caplog.at_level(logging.INFO, logger="bundle.templates"):
            evaluator.run()
    finally:
        hook.remove()
    assert forwards and "templates ranked among 4 labelled training items (rule 'features')" in caplog.text
    metrics = json.loads((root / "output" / "metrics.json").read_text())
    labelled = {Path(it["image"]).name for it in content["training"] if it.get("landmarks")}
    # k-shot by default (max_templates 32): every labelled training item, the best-ranked first
    assert {Path(t).name for t in metrics["templates"]} == labelled and metrics["template"] == metrics["templates"][0]


def test_loading_the_bundle_as_monai_does_writes_nothing(tmp_path):
    """`monai.bundle.load` / `create_workflow` run the train config's `initialize`: no data set is generated."""
    import shutil

    from monai.bundle import ConfigWorkflow

    root = tmp_path / "bundle"
    shutil.copytree(ROOT / "configs", root / "configs")
    before = _files(tmp_path)
    workflow = ConfigWorkflow(
        config_file=str(root / "configs" / "train.yaml"), workflow_type="train", bundle_root=str(root)
    )
    workflow.initialize()
    assert workflow.network_def is not None
    assert _files(tmp_path) == before


@pytest.mark.parametrize("value", ["two", 0, True, 1.5])
def test_cpu_threads_of_a_command_without_a_stage_1_step_is_checked(value):
    """Stage 2, fine-tuning and evaluation set ``cpu_threads`` for the whole command (the stage-1 step sets its own);
    ``auto`` and null leave torch's setting, a bad value is refused naming the key."""
    threads = torch.get_num_threads()
    assert apply_cpu_threads("auto") == threads and apply_cpu_threads(None) == threads
    with pytest.raises(ValueError, match="cpu_threads must be null, 'auto' or a positive integer"):
        apply_cpu_threads(value)
    # the stage-1 step's engine takes the key as it is: refused as the command starts (bundle.settings.SETTINGS)
    with pytest.raises(ValueError, match="cpu_threads must be null, 'auto' or a positive integer"):
        bundle_parser(config_files("train"), cpu_threads=value)
