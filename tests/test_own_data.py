"""The README's "Your own images" commands, run as written (with short training settings, the two options the README
names for a training's length) on a folder of 12 shared Hamedan cephalograms with 1, 5 or 10 of them annotated:
landmarks on every image of the folder. Skipped without ../shared/data."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAMEDAN = ROOT.parent / "shared" / "data" / "hamedan_ceph"
IDS = [f"{i:03d}" for i in range(1, 13)]
SHORT = ("--epochs 10 --epoch_length 40", "--epochs 1 --epoch_length 2")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAMEDAN.is_dir(), reason="../shared/data/hamedan_ceph (real data) absent"),
]


def readme_blocks() -> list[list[str]]:
    """The command blocks of the README's own-data section, each a list of commands (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Your own images:", 1)[1].split("\n## ", 1)[0]
    blocks, current = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("    "):
            current.append(line.strip())
        elif current:
            blocks.append(" ".join(current).replace("\\ ", "").split("python -m ")[1:])
            current = []
    return [["python -m " + c.strip() for c in block] for block in blocks]


def folder_with_annotations(tmp_path: Path, n: int) -> Path:
    """12 cephalograms, the first ``n`` with one doctor's labelme annotation."""
    folder = tmp_path / "ceph"
    (folder / "images").mkdir(parents=True)
    (folder / "annotations" / "farhadifar").mkdir(parents=True)
    for i in IDS:
        shutil.copy(HAMEDAN / "images" / f"{i}.png", folder / "images")
    for i in IDS[:n]:
        shutil.copy(HAMEDAN / "annotations" / "farhadifar" / f"{i}.json", folder / "annotations" / "farhadifar")
    return folder


def run_as_written(command: str, folder: Path, tmp_path: Path) -> str:
    for placeholder, value in (("FOLDER", folder), ("X", tmp_path / "x"), ("W", tmp_path / "w"), ("Y", tmp_path / "y")):
        command = re.sub(rf"\b{placeholder}\b", str(value), command)
    args = shlex.split(command.replace(*SHORT))
    assert args[0] == "python"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize("n, block, pipeline", [(1, 0, "templates"), (5, 0, "templates"), (10, 1, "detector")])
def test_readme_own_data_commands_give_landmarks_on_every_image(tmp_path, n, block, pipeline):
    blocks = readme_blocks()
    assert len(blocks) == 2 and all(len(b) == 3 for b in blocks), blocks
    folder = folder_with_annotations(tmp_path, n)
    prepared = run_as_written(blocks[block][0], folder, tmp_path)
    assert f"unlabelled: {12 - n} images without landmarks" in prepared
    assert "no annotation file" not in prepared  # the images meant to be unlabelled are not warned about
    for command in blocks[block][1:]:
        run_as_written(command, folder, tmp_path)
    with open(tmp_path / "y" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted({Path(r["image"]).stem for r in rows}) == IDS
    assert len(rows) == 12 * 19 and all(r["x"] and r["y"] for r in rows)
    provenance = json.loads((tmp_path / "y" / "provenance.json").read_text())
    assert provenance["pipeline"] == pipeline and provenance["n_images"] == 12
    if pipeline == "templates":  # the annotated images, and pseudo-templates from the others
        annotated = {f"{i}.png" for i in IDS[:n]}
        assert annotated <= set(provenance["templates"]) and provenance["pseudo_templates"]
