"""``inferring`` streams into its journal (bundle.journal.PredictionJournal): a rerun into the same output folder
predicts only the images that no run with the same weights and settings predicted, and reports them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bundle.data.synthetic import generate_synthetic_2d
from bundle.journal import PredictionJournal, fingerprint
from bundle.networks.contrastive import ContrastiveLandmarkNet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A datalist of small synthetic images (its templates) and random weights for a 64 x 64 grid."""
    root = tmp_path_factory.mktemp("resume")
    datalist = generate_synthetic_2d(root / "data", n_training=2, n_validation=1, n_test=8, size=(64, 72), seed=3)
    torch.manual_seed(0)
    torch.save(ContrastiveLandmarkNet().state_dict(), root / "weights.pt")
    images = [it["image"] for it in json.loads(Path(datalist).read_text())["test"]]
    images = [str(Path(datalist).parent / i) for i in images]
    return root, datalist, root / "weights.pt", images


def infer(run, output_dir, *extra, images=None, wait=True):
    """``inferring`` on the run's test images (or ``images``) into ``output_dir``; returns the finished process (else
    the running one)."""
    root, datalist, weights, test_images = run
    command = [
        sys.executable,
        "-m",
        "monai.bundle",
        "run",
        "inferring",
        "--config_file",
        "configs/inference.yaml",
        "--images",
        repr([str(i) for i in images or test_images]),
        "--datalist",
        str(datalist),
        "--ckpt_path",
        str(weights),
        "--image_size",
        "[64,64]",
        "--pseudo_templates",
        "0",
        "--template_cache",
        "null",
        "--progress_bar",
        "false",
        "--output_dir",
        str(output_dir),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    streams = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, timeout=300, **streams) if wait else subprocess.Popen(command, **streams)


def journal_lines(output_dir: Path) -> list[list[str]]:
    """The images of each part of the journal, in the order the runs wrote them (whole lines only)."""
    parts = sorted((output_dir / PredictionJournal.FOLDER).glob("part-*.jsonl"))
    return [
        [json.loads(line)["image"] for line in p.read_text().splitlines(keepends=True) if line.endswith("\n")]
        for p in parts
    ]


def test_a_rerun_predicts_nothing_again_and_writes_the_same_report(small_run, tmp_path):
    out = tmp_path / "out"
    first = infer(small_run, out)
    assert first.returncode == 0, first.stdout[-3000:]
    report = (out / "predictions.csv").read_bytes()
    again = infer(small_run, out)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "8 of 8 images already predicted by the same weights and settings" in again.stdout
    assert [len(p) for p in journal_lines(out)] == [8, 0]  # the rerun opened its part and predicted nothing
    assert (out / "predictions.csv").read_bytes() == report
    assert sorted(p.name for p in (out / "overlays").iterdir()) == sorted(Path(i).stem + ".png" for i in small_run[3])
    # other settings predict again: the journal's fingerprint differs
    other = infer(small_run, out, "--template_combine", "mean")
    assert other.returncode == 0, other.stdout[-3000:]
    assert "already predicted" not in other.stdout
    assert [len(p) for p in journal_lines(out)] == [8]  # a new journal


def test_a_killed_run_is_finished_by_the_rerun(small_run, tmp_path):
    """The run is killed (SIGKILL) once it has predicted two images; the rerun predicts those it had not finished,
    and its report equals that of a run that was not killed."""
    images = small_run[3]
    whole = tmp_path / "whole"
    assert infer(small_run, whole).returncode == 0
    out = tmp_path / "out"
    process = infer(small_run, out, wait=False)
    deadline = time.monotonic() + 240
    while sum(map(len, journal_lines(out))) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.kill()
    process.communicate()
    finished = [image for part in journal_lines(out) for image in part]
    assert 2 <= len(finished) < len(images), "killed too late to leave images unfinished"
    assert not (out / "predictions.csv").exists()
    rerun = infer(small_run, out)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"{len(finished)} of {len(images)} images already predicted" in rerun.stdout
    assert journal_lines(out)[-1] == images[len(finished) :]
    assert (out / "predictions.csv").read_bytes() == (whole / "predictions.csv").read_bytes()
    assert sorted(os.listdir(out / "overlays")) == sorted(os.listdir(whole / "overlays"))


def test_an_image_changed_since_is_predicted_again(small_run, tmp_path):
    images = small_run[3]
    folder = tmp_path / "images"
    folder.mkdir()
    copies = [folder / Path(i).name for i in images[:2]]
    for image, copy in zip(images, copies):
        copy.write_bytes(Path(image).read_bytes())
    out = tmp_path / "out"
    assert infer(small_run, out, images=copies).returncode == 0
    copies[1].write_bytes(Path(images[2]).read_bytes())  # another image under the same name
    rerun = infer(small_run, out, images=copies)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "1 of 2 images already predicted" in rerun.stdout
    assert journal_lines(out)[1] == [str(copies[1])]


def test_a_journal_folder_that_the_bundle_did_not_write_is_refused(tmp_path):
    (tmp_path / PredictionJournal.FOLDER).mkdir()
    (tmp_path / PredictionJournal.FOLDER / "mine.txt").write_text("a user's")
    journal = PredictionJournal(tmp_path, [{"image": "a.png"}], fingerprint="f")
    with pytest.raises(FileExistsError, match=r"\.journal: not a journal of this bundle"):
        journal.pending()
    with pytest.raises(FileExistsError, match="not a journal of this bundle"):
        journal.start()
    assert (tmp_path / PredictionJournal.FOLDER / "mine.txt").read_text() == "a user's"


def test_a_journal_is_never_written_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / PredictionJournal.FOLDER).symlink_to(elsewhere)
    with pytest.raises(FileExistsError, match="a symbolic link"):
        PredictionJournal(tmp_path / "out", fingerprint="f").start()
    assert list(elsewhere.iterdir()) == []


def test_the_fingerprint_follows_the_weights_and_the_settings():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    same = torch.nn.Linear(3, 2)
    same.load_state_dict(net.state_dict())
    assert fingerprint(network=net, size=[64, 64]) == fingerprint(network=same, size=[64, 64])
    assert fingerprint(network=net, size=[64, 64]) != fingerprint(network=net, size=[64, 96])
    with torch.no_grad():
        same.bias[0] += 1e-6
    assert fingerprint(network=net, size=[64, 64]) != fingerprint(network=same, size=[64, 64])
