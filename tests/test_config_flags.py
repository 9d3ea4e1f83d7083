"""Yes/no config keys read the way users type them: ``--entropy_sampling false`` reaches the config as the string
'false' (what ``monai.bundle run`` passes on), which must switch the key off, not on, in every config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle.configs import bundle_parser, config_files
from bundle.settings import SETTINGS, as_flag

ROOT = Path(__file__).resolve().parents[1]

# every command's config list (README); every file of configs/ is in at least one
COMMANDS = {
    "training": config_files("train"),
    "training 3D": config_files("train", spatial_dims=3),
    "training, authors' ranges": [*config_files("train"), "configs/authors_ranges.yaml"],
    "training, shipped model": [*config_files("train"), "configs/hamedan_ceph.yaml"],
    "multi-GPU training": config_files("train_multi_gpu"),
    "stage 2": config_files("train_stage2"),
    "fine-tuning": config_files("finetune"),
    "evaluation": config_files("evaluate"),
    "evaluation 3D": config_files("evaluate", spatial_dims=3),
    "inference": config_files("inference"),
    "inference 3D": config_files("inference", spatial_dims=3),
}
FALSE = ["false", "False", "FALSE", "no", "No", "0", 0]
TRUE = ["true", "True", "TRUE", "yes", "YES", "1", 1]
# a few of them through every reader of every config (as_flag itself is tested with all)
SPELLINGS = ((False, ["false", "No", "0"]), (True, ["TRUE", "yes", 1]))


def _strings(value, prefix=""):
    """``(id, text)`` of every string of a config (list items by position, as the parser addresses them)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        sub = f"{prefix}#{key}" if prefix else str(key)
        if isinstance(item, str):
            yield sub, item
        else:
            yield from _strings(item, sub)


def _flags_and_readers(files):
    """The yes/no keys of the merged ``files`` (top-level keys whose value is true or false) and, for each,
    the ids of the config strings that read it."""
    config = bundle_parser(files).get()
    flags = sorted(k for k, v in config.items() if isinstance(v, bool))
    return {f: [i for i, text in _strings(config) if re.search(rf"@{f}(?![\w#])", text)] for f in flags}


def _comparable(value):
    """Parsed values compared by content (fresh objects of equal settings compare equal)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value), {k: _comparable(v) for k, v in vars(value).items() if not k.startswith("_")})
    return value


def test_every_config_file_is_in_a_command_and_every_yes_no_key_is_read():
    assert {f for files in COMMANDS.values() for f in files} == {
        f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")
    }
    readers = {}
    for files in COMMANDS.values():
        for flag, ids in _flags_and_readers(files).items():
            readers.setdefault(flag, []).extend(ids)
    assert {"entropy_sampling", "adaptive_augmentation", "progress_bar", "amp", "overlays"} <= set(readers)
    unread = sorted(f for f, ids in readers.items() if not ids)
    assert not unread, f"{unread}: read by no config string"
    unruled = sorted(set(readers) - set(SETTINGS))
    assert not unruled, f"{unruled}: yes/no keys without a rule in bundle.settings.SETTINGS (read as they are given)"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_yes_no_key_reads_any_spelling_and_refuses_others(command, tmp_path):
    """Every reader of every yes/no key: each spelling of false (true) gives what the YAML false (true) gives,
    and anything else is refused naming the key and the value."""
    files = COMMANDS[command]
    readers = _flags_and_readers(files)
    assert readers, f"{command}: no yes/no key found"
    settings = {"output_dir": str(tmp_path / "out"), "ckpt_dir": str(tmp_path / "models")}
    for flag, ids in readers.items():  # (stage 2 has no contrastive step: cpu_channels_last goes unread)
        for truth, spellings in SPELLINGS:
            expected = bundle_parser(files, **settings, **{flag: truth})
            for spelling in spellings:
                parser = bundle_parser(files, **settings, **{flag: spelling})
                for i in ids:
                    got, want = parser.get_parsed_content(i), expected.get_parsed_content(i)
                    assert _comparable(got) == _comparable(want), f"{command}: {i} with {flag}={spelling!r}"
        try:
            parser = bundle_parser(files, **settings, **{flag: "flase"})
        except ValueError as refused:  # as the command starts (bundle.settings.SETTINGS)
            assert re.search(rf"\b{flag}\b.*\bflase\b", str(refused)), f"{command}: {refused}"
            continue
        for i in ids:
            with pytest.raises(RuntimeError) as failure:  # MONAI wraps the error of a config expression
                parser.get_parsed_content(i)
            message = str(failure.value.__cause__)  # resume takes a path too: "resume checkpoint not found: flase"
            assert re.search(rf"\b{flag}\b.*\bflase\b", message), f"{command}: {i}: {message}"


@pytest.mark.parametrize("value, expected", [*((v, False) for v in FALSE), *((v, True) for v in TRUE)])
def test_as_flag_reads_the_usual_spellings(value, expected):
    assert as_flag(value, "k") is expected and as_flag(expected, "k") is expected


@pytest.mark.parametrize("value", ["flase", "", "on", 2, 0.5, None, [True]])
def test_as_flag_refuses_anything_else_naming_key_and_value(value):
    with pytest.raises(ValueError, match=rf"^amp: expected true or false .*, got {re.escape(repr(value))}$"):
        as_flag(value, "amp")


def test_as_flag_passes_a_path_where_one_is_allowed():
    assert as_flag("runs/a/last.pt", "resume", path=True) == "runs/a/last.pt"
    assert as_flag("No", "resume", path=True) is False and as_flag(1, "resume", path=True) is True


# merged after train.yaml: factor ranges for the adaptive augmentation, and a run id that prints what the
# three switches built (nothing is trained)
PROBE = """augmentation#brightness_ranges: [[0.5, 1.5], [0.6, 1.4], [0.7, 1.3]]
probe: "$print('PROBE', @train#sampling_weight.gamma, @train#crop_augmentation.brightness_ranges[0].tolist(),
  len(@train#progress_handlers))"
"""


def _probe(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    probe = tmp_path / "probe.yaml"
    probe.write_text(PROBE)
    command = [sys.executable, "-m", "monai.bundle", "run", "probe"]
    command += ["--config_file", f"['configs/train.yaml','{probe}']", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_command_line_switches_off_in_lowercase(tmp_path):
    """The real command line (``monai.bundle run``): each switch typed in lowercase turns its part off."""
    on = _probe(tmp_path)
    assert on.returncode == 0, on.stderr[-3000:]
    assert "PROBE 0.3 [0.5, 1.5] 1" in on.stdout  # entropy-weighted queries, the ranges, a progress bar
    off = _probe(tmp_path, "--entropy_sampling", "false", "--adaptive_augmentation", "false", "--progress_bar", "false")
    assert off.returncode == 0, off.stderr[-3000:]
    assert "PROBE 0.0 [0.85, 1.15] 0" in off.stdout  # uniform queries, the baseline's jitter, no progress bar
    bad = _probe(tmp_path, "--entropy_sampling", "flase")
    assert bad.returncode != 0 and "entropy_sampling: expected true or false" in bad.stderr
    assert "got 'flase'" in bad.stderr


@pytest.mark.parametrize(
    "value, unset", [(None, True), ("null", True), (" None ", True), ("", True), (0, False), ("2", False)]
)
def test_a_command_line_null_is_unset_for_every_nullable_key(value, unset):
    """``--key null`` reaches the config as a string: the template cache and the registration tolerance read it
    through the one rule, ``bundle.settings.is_unset``."""
    from bundle.settings import is_unset
    from bundle.templates.features import template_cache_dir

    assert is_unset(value) is unset
    if unset:
        assert template_cache_dir(value) is None
        from bundle.settings import SETTINGS

        assert SETTINGS["registration_tolerance"](value, "registration_tolerance") is None
