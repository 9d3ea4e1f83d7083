"""What the commands print: progress (count, time left) over every long step, silenced by ``--progress_bar false``,
and no line a user would read as an error when nothing is wrong (readers tried in turn, one "no spacing" warning per
image, SWIG's deprecation, ignite's "resuming from iteration 0")."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from bundle.data.images import LoadImaged
from bundle.data.synthetic import generate_synthetic_2d
from bundle.transforms.landmarks import LandmarkTargetsd
from monai.transforms import EnsureChannelFirstd
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--image_size", "[64, 64]", "--pipeline", "templates", "--overlays", "false", "--pseudo_candidates", "2"]


def _mha_test_split(tmp_path: Path) -> Path:
    """A synthetic datalist whose test images are MetaImage files (as the hand X-rays are)."""
    path = generate_synthetic_2d(tmp_path / "data", n_training=3, n_validation=1, n_test=2, seed=1)
    datalist = json.loads(Path(path).read_text())
    for item in datalist["test"]:
        png = Path(item["image"])
        png = png if png.is_absolute() else Path(path).parent / png
        mha = png.with_suffix(".mha")
        sitk.WriteImage(sitk.GetImageFromArray(np.asarray(Image.open(png))), str(mha))
        item["image"] = str(mha)
    Path(path).write_text(json.dumps(datalist))
    return Path(path)


def _evaluate(datalist: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "monai.bundle", "run", "evaluating"]
    command += ["--config_file", "['configs/train.yaml','configs/evaluate.yaml']", "--datalist", str(datalist)]
    command += ["--output_dir", str(out), *TINY, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def mha_datalist(tmp_path_factory) -> Path:
    return _mha_test_split(tmp_path_factory.mktemp("mha"))


def test_evaluating_shows_progress_and_no_noise(mha_datalist, tmp_path):
    done = _evaluate(mha_datalist, tmp_path / "on")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert "pseudo-labels: " in printed and "2/2" in printed  # the pseudo-templates' labelling, counted
    assert "images: [1/2]" in printed  # the pass over the test images, counted, with the time left
    assert "unable to load" not in printed  # MONAI's readers tried one by one on each .mha
    assert "Engine run resuming from iteration 0" not in printed
    assert "DeprecationWarning" not in printed


def test_progress_bar_false_silences_every_bar(mha_datalist, tmp_path):
    done = _evaluate(mha_datalist, tmp_path / "off", "--progress_bar", "false")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert "pseudo-labels" not in printed and "images: [" not in printed and "it/s" not in printed
    assert (tmp_path / "off" / "metrics.json").is_file()


def test_a_metaimage_is_read_without_a_line_per_reader_tried(tmp_path, caplog):
    path = tmp_path / "x.mha"
    sitk.WriteImage(sitk.GetImageFromArray(np.arange(64 * 48, dtype=np.uint8).reshape(48, 64)), str(path))
    with caplog.at_level(logging.DEBUG):
        image = LoadImaged("image")({"image": str(path)})["image"]
    assert tuple(image.shape) == (64, 48)
    assert not [r for r in caplog.records if "unable to load" in r.getMessage()]


def test_no_spacing_is_warned_once_for_a_folder_of_pngs(tmp_path):
    folder = tmp_path / "pngs"
    folder.mkdir()
    load = EnsureChannelFirstd("image", channel_dim="no_channel")
    targets = LandmarkTargetsd("image", n_landmarks=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            Image.fromarray(np.full((40, 50), 10 * i + 5, np.uint8)).save(folder / f"{i}.png")
            targets(load(LoadImaged("image")({"image": str(folder / f"{i}.png"), "landmarks": [[1.0, 2.0]]})))
    said = [str(w.message) for w in caught if "no spacing" in str(w.message)]
    assert len(said) == 1 and "0.png" in said[0] and str(folder) in said[0]


def test_prepare_data_prints_no_library_deprecation(tmp_path):
    """A hand-radiograph set of MetaImage files (read by ITK, whose SWIG types warn as Python ends)."""
    images = tmp_path / "hand" / "images"
    images.mkdir(parents=True)
    rows = []
    for i in range(3):
        sitk.WriteImage(sitk.GetImageFromArray(np.full((80, 80), 40 * i + 20, np.uint8)), str(images / f"{i}.mha"))
        rows.append(f"{i},10,20,30,40")
    (tmp_path / "hand" / "all.csv").write_text("\n".join(rows) + "\n")
    command = [sys.executable, "-m", "scripts.prepare_data", "hand", str(tmp_path / "hand"), str(tmp_path / "d.json")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote" in done.stdout and "DeprecationWarning" not in done.stderr
