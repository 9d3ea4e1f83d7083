"""The settable keys' rules (bundle.settings.SETTINGS), checked once as a command starts: by bundle_parser for Python
callers and by the configs' ``initialize`` step for ``monai.bundle`` workflows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from bundle.configs import bundle_parser
from bundle.settings import SETTINGS
from monai.bundle import ConfigWorkflow

ROOT = Path(__file__).resolve().parents[1]


def test_values_are_read_by_their_rule_and_replace_the_given_ones():
    parser = bundle_parser("configs/train.yaml", amp="no", epochs=2.0, resume="TRUE", max_minutes="null")
    assert parser["amp"] is False and parser["resume"] is True and parser["max_minutes"] is None
    assert parser["epochs"] == 2 and isinstance(parser["epochs"], int)
    assert parser.get_parsed_content("train#trainer#max_epochs") == 2


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("epochs", 0, r"epochs: expected an integer >= 1, got 0"),
        ("batch_size", 2.5, r"batch_size: expected an integer >= 1, got 2.5"),
        ("amp", "maybe", r"amp: expected true or false"),
        ("learning_rate", float("nan"), r"learning_rate: expected a finite number >= 0"),
        ("cache_gb", "lots", r"cache_gb: expected a finite number >= 0"),
    ],
)
def test_a_refused_value_names_its_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        bundle_parser("configs/train.yaml", **{key: value})


def test_a_null_cpu_threads_keeps_torch_s_setting():
    assert bundle_parser("configs/train.yaml", cpu_threads="null")["cpu_threads"] is None


def test_an_expression_is_the_configs_own_and_is_left_as_it_is():
    parser = bundle_parser("configs/train.yaml", epochs="$1 + 2")
    assert parser["epochs"] == "$1 + 2"
    assert parser.get_parsed_content("epochs") == 3


def test_a_workflow_checks_its_config_in_initialize(tmp_path):
    workflow = ConfigWorkflow(
        config_file=str(ROOT / "configs" / "train.yaml"), workflow_type="train", amp="yes", output_dir=str(tmp_path)
    )
    workflow.initialize()
    assert workflow.parser["amp"] is True
    refused = ConfigWorkflow(config_file=str(ROOT / "configs" / "train.yaml"), workflow_type="train", epochs=-1)
    with pytest.raises(RuntimeError) as failure:  # MONAI wraps the error of a config expression
        refused.initialize()
    assert "epochs: expected an integer >= 1, got -1" in str(failure.value.__cause__)


def test_every_rule_is_of_a_documented_key_of_the_configs():
    defined = set()
    for path in (ROOT / "configs").glob("*.yaml"):
        defined |= set(yaml.safe_load(path.read_text(encoding="utf-8")))
    reference = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", reference, re.M))
    documented |= set(re.findall(r"^\| `[a-z_0-9]+`, `([a-z_0-9]+)`", reference, re.M))
    assert set(SETTINGS) <= defined, set(SETTINGS) - defined
    assert set(SETTINGS) <= documented, set(SETTINGS) - documented
