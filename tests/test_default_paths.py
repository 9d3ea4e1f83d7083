"""No default command writes into the shipped files: trainings write their checkpoints to their run folder
(``ckpt_dir`` under ``output_dir``), evaluation and inference read the shipped weights."""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import fire.parser
import pytest
import torch
from bundle.configs import bundle_parser, config_files

from training_args import tiny_training_args

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models"
# training command -> its run folder's checkpoint folder, relative to output_dir
TRAININGS = {
    ("train", 2): "models",
    ("train", 3): "models/ct3d",
    ("train_multi_gpu", 2): "models",
    ("train_stage2", 2): "models/stage2",
    ("finetune", 2): "models/finetune",
}
# evaluation / inference command -> the weights it reads by default: the shipped ones, or, where none ship, the
# checkpoint of the default training (command)
EVALUATIONS = {
    ("evaluate", 2): "models/model.pt",
    ("evaluate", 2, "configs/hamedan_ceph.yaml"): "models/model.pt",
    ("inference", 2): "models/model.pt",
    ("evaluate", 3): ("train", 3),
    ("inference", 3): ("train", 3),
}


def _parser(command, **overrides):
    """The parser of ``command``: (a name of bundle.configs.CONFIG_FILES, spatial_dims, config files merged after)."""
    name, spatial_dims, *more = command
    return bundle_parser([*config_files(name, spatial_dims), *more], **overrides)


@pytest.mark.parametrize("files", TRAININGS)
def test_trainings_write_into_their_run_folder(files, tmp_path):
    assert Path(_parser(files).get_parsed_content("ckpt_dir")) == ROOT / "output" / TRAININGS[files]
    run = tmp_path / "run"
    assert Path(_parser(files, output_dir=str(run)).get_parsed_content("ckpt_dir")) == run / TRAININGS[files]


@pytest.mark.parametrize("files", EVALUATIONS)
def test_evaluations_read_the_shipped_weights_else_the_default_trainings(files, tmp_path):
    expected = EVALUATIONS[files]
    if isinstance(expected, str):
        expected = ROOT / expected
        assert expected.is_file() and expected.is_relative_to(SHIPPED)
    else:  # whatever output_dir the evaluation writes to
        expected = ROOT / "output" / TRAININGS[expected] / "model.pt"
    assert Path(_parser(files, output_dir=str(tmp_path / "eval")).get_parsed_content("ckpt_path")) == expected


@pytest.mark.parametrize("files", [("evaluate", 2), ("inference", 2)])
def test_evaluation_and_inference_find_the_shipped_weights_from_another_folder(files, tmp_path, monkeypatch):
    """Run from another working directory with the configs' ``bundle_root: .``, both commands load the shipped weights
    from the bundle's folder (evaluating stopped with 'checkpoint not found: ./models/model.pt'; inferring worked)."""
    monkeypatch.chdir(tmp_path)
    name, spatial_dims = files
    parser = bundle_parser([str(ROOT / f) for f in config_files(name, spatial_dims)], ".", pipeline="templates")
    network = parser.get_parsed_content("network" if name == "evaluate" else "encoder")
    shipped = torch.load(SHIPPED / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(value, shipped[key]) for key, value in network.state_dict().items() if key in shipped)
    assert not (tmp_path / "models").exists()


def _options(command: list[str]) -> dict[str, Any]:
    """``--key value`` pairs after ``monai.bundle run <id>``, each value read as ``monai.bundle run`` reads it (Fire);
    ``config_file`` as a list."""
    start = command.index("run") + 2
    options = {command[i][2:]: fire.parser.DefaultParseValue(command[i + 1]) for i in range(start, len(command), 2)}
    files = options["config_file"]
    options["config_file"] = [files] if isinstance(files, str) else list(files)
    return options


def test_make_demo_evaluates_what_its_training_wrote():
    """``make demo`` and ``make demo-3d`` (dry run): each evaluation loads the model.pt its training writes."""
    dry = subprocess.run(["make", "-n", "demo", "demo-3d"], cwd=ROOT, capture_output=True, text=True, check=True)
    commands = [shlex.split(c) for c in dry.stdout.replace("\\\n", " ").splitlines() if "monai.bundle run" in c]
    assert [c[c.index("run") + 1] for c in commands] == ["training", "evaluating"] * 2
    for training, evaluation in zip(commands[::2], commands[1::2]):
        options = _options(training)
        parser = bundle_parser(options.pop("config_file"), **options)
        assert Path(_options(evaluation)["ckpt_path"]) == Path(parser.get_parsed_content("ckpt_dir")) / "model.pt"


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_default_trainings_leave_the_shipped_files_byte_identical(tmp_path):
    """The README's plain training command, then stage 2 (whose default once wrote over the shipped detector),
    run from a copy of the repository: the shipped files are the same bytes after, the checkpoints are in
    output/models and the command says where at its start and end."""
    root = tmp_path / "bundle"
    for name in ("configs", "bundle", "models"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shipped = _digests(root / "models")
    assert shipped == _digests(SHIPPED) and "model.pt" in shipped and "stage2/model.pt" in shipped
    for configs, ckpt_dir in (
        ("configs/train.yaml", "models"),
        ("['configs/train.yaml','configs/train_stage2.yaml']", "models/stage2"),
    ):
        command = [sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", configs]
        done = subprocess.run([*command, *tiny_training_args(2)], cwd=root, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert _digests(root / "models") == shipped
        run = root / "output" / ckpt_dir
        assert {"model.pt", "model_final.pt", "last.pt"} <= {p.name for p in run.iterdir()}
        assert f"training writes its checkpoints to {run}\n" in done.stdout, done.stdout[-3000:]
        assert f"training finished: checkpoints in {run}: last.pt, model.pt, model_final.pt\n" in done.stdout
