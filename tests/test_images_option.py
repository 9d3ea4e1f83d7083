"""``--images``: a file name, a glob pattern or a list of them (bundle.data.image_items.image_items)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bundle.configs import bundle_parser
from bundle.data.image_items import image_items
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def scans(tmp_path) -> Path:
    folder = tmp_path / "scans"
    folder.mkdir()
    for name in ("b.png", "a.png", "c.bmp"):
        Image.fromarray(np.zeros((80, 80), np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_a_quoted_pattern_gives_its_matches_sorted(scans):
    pattern = str(scans / "*.png")
    parser = bundle_parser("configs/inference.yaml", ROOT, images=pattern)  # --images 'scans/*.png'
    assert parser.get_parsed_content("dataset").data == [{"image": str(scans / n)} for n in ("a.png", "b.png")]
    mixed = image_items([str(scans / "c.bmp"), str(scans / "[ab].png")], scans)  # a list of a file and a pattern
    assert mixed == [{"image": str(scans / n)} for n in ("c.bmp", "a.png", "b.png")]


def test_a_pattern_that_matches_nothing_is_refused_naming_it(scans):
    with pytest.raises(FileNotFoundError, match=r"images: no file matches \[.*\*\.jpg'\]"):
        image_items(str(scans / "*.jpg"), scans)
