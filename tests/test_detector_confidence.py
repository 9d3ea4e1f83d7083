"""The detector's confidence: its heatmap peaks, and the warning naming an image it recognises nothing on."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from bundle.handlers.confidence import MIN_PEAK, DetectorConfidenceHandler
from bundle.inferers.heatmap import HeatmapInferer
from ignite.engine import Engine
from monai.data import MetaTensor
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parents[1]
CEPHALOGRAM = ROOT.parent / "shared" / "data" / "hamedan_ceph" / "images" / "071.png"


class _FixedMaps(torch.nn.Module):
    """Two landmark channels on an 8 x 8 grid whatever the input: peak logits 2.0 and -1.0 at (3, 4) and (5, 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maps = torch.full((x.shape[0], 2, 8, 8), -8.0)
        maps[:, 0, 3, 4], maps[:, 1, 5, 1] = 2.0, -1.0
        return maps


def test_peak_values_are_each_landmark_s_heatmap_peak_averaged_over_the_shifted_runs():
    inferer = HeatmapInferer(shift_tta=1)
    assert inferer.peak_values is None
    positions = inferer(torch.zeros(3, 1, 8, 8), _FixedMaps())
    expected = torch.sigmoid(torch.tensor([2.0, -1.0], dtype=torch.float64)).expand(3, 2)
    torch.testing.assert_close(inferer.peak_values.double(), expected, rtol=0, atol=1e-6)
    assert positions.shape == (3, 2, 2)


def test_an_image_below_the_minimum_peak_is_named_in_a_warning():
    inferer = HeatmapInferer()
    inferer.peak_values = torch.tensor([[0.05, 0.12], [0.6, 0.3]])  # means 0.085 and 0.45
    engine = Engine(lambda e, b: None)
    engine.state.batch = [
        {"image": MetaTensor(torch.zeros(1, 4, 4), meta={"filename_or_obj": f"/data/{name}.png"})}
        for name in ("inverted", "upright")
    ]
    handler = DetectorConfidenceHandler(inferer)
    with pytest.warns(UserWarning) as record:
        handler.check(engine)
    assert [str(w.message) for w in record] == [
        f"/data/inverted.png: the detector's heatmap peaks average 0.085, below {MIN_PEAK:g} (on the images it learnt "
        "from they are about 0.4 to 0.9): it recognises no landmark here, and its predictions are likely wrong. An "
        "inverted (white background) or mirrored (facing the other way) image, or another anatomy, does this"
    ]
    assert handler.low == ["/data/inverted.png"]
    handler.inferer = object()  # template matching: no peaks, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handler.check(engine)


@pytest.mark.skipif(not CEPHALOGRAM.is_file(), reason="shared Hamedan data not available")
def test_inferring_names_an_inverted_cephalogram_and_not_the_upright_one(tmp_path):
    """The default `inferring` (the shipped fine-tuned detector) on a cephalogram and on the same image inverted, as
    a MONOCHROME1 export may come: the inverted one is named, the upright one is not."""
    ImageOps.invert(Image.open(CEPHALOGRAM).convert("L")).save(tmp_path / "inverted.png")
    images = f"['{CEPHALOGRAM}','{tmp_path / 'inverted.png'}']"
    command = [sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file", "configs/inference.yaml"]
    command += ["--images", images, "--output_dir", str(tmp_path / "out"), "--overlays", "false"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    named = [line for line in done.stderr.splitlines() if "heatmap peaks average" in line]
    assert len(named) == 1 and named[0].startswith(f"{tmp_path / 'inverted.png'}: the detector's heatmap peaks"), named
    assert (tmp_path / "out" / "predictions.csv").is_file()
