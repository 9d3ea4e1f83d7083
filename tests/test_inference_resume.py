"""``inferring`` streams into its journal (bundle.journal.PredictionJournal): a rerun into the same output folder
predicts only the images that no run with the same weights and settings predicted, and reports them all."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle.journal import PredictionJournal, fingerprint
from bundle_runs import SMALL_MATCHING, run_bundle, small_synthetic_set


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A datalist of small synthetic images (its templates), random weights for a 64 x 64 grid, the test images."""
    return small_synthetic_set(tmp_path_factory.mktemp("resume"), n_test=8, seed=3)


def infer(run, output_dir, *extra, images=None, wait=True):
    """``inferring`` on the run's test images (or ``images``) into ``output_dir``; returns the finished process (else
    the running one)."""
    datalist, weights, test_images = run
    args = ["--images", repr([str(i) for i in images or test_images]), "--datalist", datalist, "--ckpt_path", weights]
    args += [*SMALL_MATCHING, "--template_cache", "null", "--output_dir", output_dir, *extra]
    return run_bundle("inferring", "configs/inference.yaml", *args, wait=wait)


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
    assert sorted(p.name for p in (out / "overlays").iterdir()) == sorted(Path(i).stem + ".png" for i in small_run[2])
    # other settings predict again: the journal's fingerprint differs
    other = infer(small_run, out, "--template_combine", "mean")
    assert other.returncode == 0, other.stdout[-3000:]
    assert "already predicted" not in other.stdout
    assert [len(p) for p in journal_lines(out)] == [8]  # a new journal


def test_a_killed_run_is_finished_by_the_rerun(small_run, tmp_path):
    """The run is killed (SIGKILL) once it has predicted two images; the rerun predicts those it had not finished,
    and its report equals that of a run that was not killed."""
    images = small_run[2]
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
    images = small_run[2]
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


def test_overlays_follow_the_run_and_their_image(small_run, tmp_path):
    """A run with overlays after one without predicts the images again to draw them; a later run whose new image has
    the stem of an image predicted before draws its overlay beside, not over, that image's."""
    images = small_run[2][:2]
    out = tmp_path / "out"
    assert infer(small_run, out, "--overlays", "false", images=images).returncode == 0
    assert not (out / "overlays").exists()
    drawn = infer(small_run, out, images=images)
    assert drawn.returncode == 0, drawn.stdout[-3000:]
    assert "already predicted" not in drawn.stdout
    first = {name: (out / "overlays" / name).read_bytes() for name in os.listdir(out / "overlays")}
    assert sorted(first) == sorted(Path(i).stem + ".png" for i in images)
    namesake = tmp_path / "other" / Path(images[0]).name  # another image under the first one's name
    namesake.parent.mkdir()
    namesake.write_bytes(Path(small_run[2][2]).read_bytes())
    later = infer(small_run, out, images=[str(namesake), *images])
    assert later.returncode == 0, later.stdout[-3000:]
    assert "2 of 3 images already predicted" in later.stdout
    stem = Path(images[0]).stem
    assert sorted(os.listdir(out / "overlays")) == sorted([f"{stem}.png", f"{stem}_2.png", Path(images[1]).name])
    assert (out / "overlays" / f"{stem}_2.png").read_bytes() == first[f"{stem}.png"]  # the first image's, unchanged
    assert (out / "overlays" / f"{stem}.png").read_bytes() != first[f"{stem}.png"]
    without = infer(small_run, out, "--overlays", "false", images=images)
    assert "2 of 2 images already predicted" in without.stdout
    assert not (out / "overlays").exists() and not (out / "overview.html").exists()


def test_an_image_whose_overlay_is_gone_is_predicted_again(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(b"an image")
    journal = PredictionJournal(tmp_path / "out", [{"image": str(image)}], fingerprint="f", overlays="yes")
    assert journal.overlays is True
    journal.start()
    overlay = journal.overlay_path(str(image))
    overlay.parent.mkdir(parents=True, exist_ok=True)
    overlay.write_bytes(b"a drawing")
    journal.append(str(image), np.zeros((1, 2)), np.zeros((1, 2)), np.ones(2), overlay)
    journal.close()
    assert journal.pending() == []
    assert PredictionJournal(tmp_path / "out", journal.items, "f", overlays=False).pending() == []
    overlay.unlink()
    assert journal.pending() == journal.items  # its overlay is gone: drawn again
    assert PredictionJournal(tmp_path / "out", journal.items, "f", overlays=False).pending() == []


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


@pytest.mark.parametrize("fingerprints", [(None, None), ("f", "g")], ids=["evaluating", "inferring, other settings"])
def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_keeps_its_predictions(tmp_path, fingerprints):
    """Two runs into one output_dir at once: the second's start is refused naming the folder, its failure removes
    nothing, and the first run's report reads every prediction it made; once it is done the folder is free."""
    images = [{"image": str(tmp_path / f"{i}.png")} for i in range(2)]
    for item in images:
        Path(item["image"]).write_bytes(b"an image")
    first = PredictionJournal(tmp_path / "out", images, fingerprint=fingerprints[0], overlays=False)
    first.start()
    first.append(images[0]["image"], np.zeros((1, 2)), np.zeros((1, 2)), np.ones(2))
    second = PredictionJournal(tmp_path / "out", images, fingerprint=fingerprints[1], overlays=False)
    with pytest.raises(RuntimeError, match=r"out: another run is writing its predictions there"):
        second.start()
    second.abandon()  # what the report handler does after the refusal
    first.append(images[1]["image"], np.ones((1, 2)), np.zeros((1, 2)), np.ones(2))
    first.close()
    assert [r["pred"][0, 0] for r in first.records()] == [0.0, 1.0]
    first.discard()
    second.start()  # the first run is over
    second.discard()


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
