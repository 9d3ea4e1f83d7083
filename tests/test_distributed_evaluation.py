"""``evaluating`` and ``inferring`` under torchrun (gloo, 2 CPU processes): each process predicts its share of the
images, none twice and none left out, and rank 0's report equals that of one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bundle.data.synthetic import generate_synthetic_2d
from bundle.journal import PredictionJournal
from bundle.networks.contrastive import ContrastiveLandmarkNet

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--image_size", "[64,64]", "--pseudo_templates", "0", "--progress_bar", "false"]


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """Small synthetic images (7 test images: the shares are uneven) and random weights for a 64 x 64 grid."""
    root = tmp_path_factory.mktemp("distributed")
    datalist = generate_synthetic_2d(root / "data", n_training=2, n_validation=1, n_test=7, size=(64, 72), seed=5)
    torch.manual_seed(0)
    torch.save(ContrastiveLandmarkNet().state_dict(), root / "weights.pt")
    return datalist, root / "weights.pt"


def bundle_command(processes: int, command: str, configs: list[str], logs: Path, *args: str) -> None:
    """``monai.bundle run command`` in one process, or under torchrun in ``processes``; fails showing the logs."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(processes)]
    launcher += ["--log-dir", str(logs), "--redirects", "3"]
    run = [sys.executable, *(launcher if processes > 1 else []), "-m", "monai.bundle", "run", command]
    run += ["--config_file", repr(configs), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rank_logs = "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*.log")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + rank_logs


def journal_parts(output_dir: Path) -> dict[str, list[str]]:
    """The images each process wrote into the journal, by rank."""
    parts: dict[str, list[str]] = {}
    for part in sorted((output_dir / PredictionJournal.FOLDER).glob("part-*.jsonl")):
        rank = part.name.split("-")[2]
        parts.setdefault(rank, []).extend(json.loads(line)["image"] for line in part.read_text().splitlines())
    return parts


@pytest.mark.slow
def test_two_processes_infer_what_one_infers_each_image_once(small_set, tmp_path):
    datalist, weights = small_set
    images = [str(Path(datalist).parent / it["image"]) for it in json.loads(Path(datalist).read_text())["test"]]
    args = ["--images", repr(images), "--datalist", str(datalist), "--ckpt_path", str(weights), *SMALL]
    args += ["--template_cache", "null"]
    one, two = tmp_path / "one", tmp_path / "two"
    bundle_command(1, "inferring", ["configs/inference.yaml"], tmp_path / "logs1", *args, "--output_dir", str(one))
    bundle_command(2, "inferring", ["configs/inference.yaml"], tmp_path / "logs2", *args, "--output_dir", str(two))
    assert (two / "predictions.csv").read_bytes() == (one / "predictions.csv").read_bytes()
    assert json.loads((two / "provenance.json").read_text()) == json.loads((one / "provenance.json").read_text())
    assert sorted(os.listdir(two / "overlays")) == sorted(os.listdir(one / "overlays"))
    shares = journal_parts(two)
    assert shares == {"0": images[0::2], "1": images[1::2]}  # each image in one share, none left out


@pytest.mark.slow
def test_two_processes_evaluate_what_one_evaluates(small_set, tmp_path):
    datalist, weights = small_set
    configs = ["configs/train.yaml", "configs/evaluate.yaml"]
    args = ["--datalist", str(datalist), "--ckpt_path", str(weights), "--pipeline", "templates", *SMALL]
    one, two = tmp_path / "one", tmp_path / "two"
    bundle_command(1, "evaluating", configs, tmp_path / "logs1", *args, "--output_dir", str(one))
    bundle_command(2, "evaluating", configs, tmp_path / "logs2", *args, "--output_dir", str(two))
    assert (two / "predictions.csv").read_bytes() == (one / "predictions.csv").read_bytes()
    assert json.loads((two / "metrics.json").read_text()) == json.loads((one / "metrics.json").read_text())
    assert json.loads((one / "metrics.json").read_text())["n_images"] == 7
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))  # the journal goes once the report is written
    assert not (two / PredictionJournal.FOLDER).exists()
