"""``evaluating`` and ``inferring`` under torchrun (gloo, 2 CPU processes): each process predicts its share of the
images, none twice and none left out, and rank 0's report equals that of one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bundle.data.synthetic import generate_synthetic_2d
from bundle.journal import PredictionJournal
from bundle_runs import SMALL_MATCHING, run_bundle, small_synthetic_set


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """Small synthetic images (7 test images: the shares are uneven) and random weights for a 64 x 64 grid."""
    return small_synthetic_set(tmp_path_factory.mktemp("distributed"), n_test=7, seed=5)


def journal_parts(output_dir: Path) -> dict[str, list[str]]:
    """The images each process wrote into the journal, by rank."""
    parts: dict[str, list[str]] = {}
    for part in sorted((output_dir / PredictionJournal.FOLDER).glob("part-*.jsonl")):
        rank = part.name.split("-")[2]
        parts.setdefault(rank, []).extend(json.loads(line)["image"] for line in part.read_text().splitlines())
    return parts


@pytest.mark.slow
def test_two_processes_infer_what_one_infers_each_image_once(small_set, tmp_path):
    datalist, weights, images = small_set
    args = ["--images", repr(images), "--datalist", str(datalist), "--ckpt_path", str(weights), *SMALL_MATCHING]
    args += ["--template_cache", "null"]
    one, two = tmp_path / "one", tmp_path / "two"
    for processes, out in ((1, one), (2, two)):
        logs = tmp_path / f"logs{processes}"
        command = ("inferring", "configs/inference.yaml", *args, "--output_dir", out)
        run_bundle(*command, processes=processes, logs=logs, check=True)
    assert (two / "predictions.csv").read_bytes() == (one / "predictions.csv").read_bytes()
    assert json.loads((two / "provenance.json").read_text()) == json.loads((one / "provenance.json").read_text())
    assert sorted(os.listdir(two / "overlays")) == sorted(os.listdir(one / "overlays"))
    shares = journal_parts(two)
    assert shares == {"0": images[0::2], "1": images[1::2]}  # each image in one share, none left out
    # a rerun of two processes into the same folder: nothing left to predict, in either, and the same report
    report = (two / "predictions.csv").read_bytes()
    again = ("inferring", "configs/inference.yaml", *args, "--output_dir", two)
    run_bundle(*again, processes=2, logs=tmp_path / "logs_again", check=True)
    assert journal_parts(two) == shares and (two / "predictions.csv").read_bytes() == report


@pytest.mark.slow
def test_two_processes_evaluate_what_one_evaluates(small_set, tmp_path):
    datalist, weights, _ = small_set
    configs = ["configs/train.yaml", "configs/evaluate.yaml"]
    args = ["--datalist", str(datalist), "--ckpt_path", str(weights), "--pipeline", "templates", *SMALL_MATCHING]
    one, two = tmp_path / "one", tmp_path / "two"
    for processes, out in ((1, one), (2, two)):
        logs = tmp_path / f"logs{processes}"
        run_bundle("evaluating", configs, *args, "--output_dir", out, processes=processes, logs=logs, check=True)
    assert (two / "predictions.csv").read_bytes() == (one / "predictions.csv").read_bytes()
    assert json.loads((two / "metrics.json").read_text()) == json.loads((one / "metrics.json").read_text())
    assert json.loads((one / "metrics.json").read_text())["n_images"] == 7
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))  # the journal goes once the report is written
    assert not (two / PredictionJournal.FOLDER).exists()


@pytest.mark.slow
def test_more_processes_than_test_images_are_refused_naming_the_count(small_set, tmp_path):
    """Each process of an evaluation computes its share of the metric with the others: one needs an image."""
    _, weights, _ = small_set
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=1, size=(64, 72), seed=6)
    configs = ["configs/train.yaml", "configs/evaluate.yaml"]
    args = ["--datalist", str(datalist), "--ckpt_path", str(weights), "--pipeline", "templates", *SMALL_MATCHING]
    done = run_bundle("evaluating", configs, *args, "--output_dir", str(tmp_path / "two"), processes=2, logs=tmp_path)
    assert done.returncode != 0
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "2 processes for 1 test images: every process of an evaluation needs one" in logs
    assert not (tmp_path / "two").exists()
