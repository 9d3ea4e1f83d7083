"""The network's confidence: a detector's heatmap peaks, template matches' scores against the templates' agreement,
and the warning naming an image it recognises nothing on."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from bundle.handlers.confidence import MATCH_MIN_RATIO, MIN_PEAK, ConfidenceHandler
from bundle.inferers.heatmap import HeatmapInferer
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer, template_agreement
from bundle.networks.matching import TemplateMatcher
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


def _engine_on(*names: str) -> Engine:
    engine = Engine(lambda e, b: None)
    engine.state.batch = [
        {"image": MetaTensor(torch.zeros(1, 4, 4), meta={"filename_or_obj": f"/data/{name}.png"})} for name in names
    ]
    return engine


def test_an_image_below_the_minimum_peak_is_named_in_a_warning():
    inferer = HeatmapInferer()
    inferer.peak_values = torch.tensor([[0.05, 0.12], [0.6, 0.3]])  # means 0.085 and 0.45
    engine = _engine_on("inverted", "upright")
    handler = ConfidenceHandler(inferer)
    with pytest.warns(UserWarning) as record:
        handler.check(engine)
    assert [str(w.message) for w in record] == [
        f"/data/inverted.png: the detector's heatmap peaks average 0.085, below {MIN_PEAK:g} (on the images it learnt "
        "from they are about 0.4 to 0.9): it recognises no landmark here, and its predictions are likely wrong. An "
        "inverted (white background) or mirrored (facing the other way) image, or another anatomy, does this"
    ]
    assert handler.low == ["/data/inverted.png"]
    handler.inferer = object()  # neither peaks nor match scores: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handler.check(engine)


def test_template_agreement_is_the_mean_combined_score_of_other_templates_same_landmark():
    """Against a plain loop over template pairs, landmarks and scales: product of (cos + 1) / 2 (the matcher's
    default rule); a landmark a template lacks (NaN) is left out; one template has no agreement."""
    torch.manual_seed(0)
    queries = [torch.nn.functional.normalize(torch.randn(3, 4, 6), dim=-1) for _ in range(2)]  # 2 scales (K, L, C)
    queries[0][2, 1] = queries[1][2, 1] = float("nan")
    terms = []
    for i in range(3):
        for j in range(3):
            for landmark in range(4):
                if i != j and not (landmark == 1 and 2 in (i, j)):
                    term = 1.0
                    for q in queries:
                        term *= (float(q[i, landmark] @ q[j, landmark]) + 1) / 2
                    terms.append(term)
    assert template_agreement(TemplateMatcher(), queries) == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    assert template_agreement(TemplateMatcher(), [q[:1] for q in queries]) is None


def test_an_image_whose_matches_score_below_the_share_of_the_agreement_is_named():
    class _Matching:
        match_scores = torch.tensor([[0.30, float("nan"), 0.40], [0.70, 0.60, 0.65]])  # means 0.35 and 0.65
        reference_score = 0.5

    handler = ConfidenceHandler(_Matching())
    with pytest.warns(UserWarning) as record:
        handler.check(_engine_on("inverted", "upright"))
    assert [str(w.message) for w in record] == [
        f"/data/inverted.png: its matches with the templates score 0.350 on average, below {MATCH_MIN_RATIO:g} x 0.500 "
        "(the templates' scores against each other; images the network recognises score above that): the landmarks "
        "are likely wrong. An inverted (white background) or mirrored (facing the other way) image, or another "
        "anatomy, does this, and so does a contrast unlike the templates'"
    ]
    assert handler.low == ["/data/inverted.png"]
    _Matching.reference_score = None  # one template: no agreement to compare with
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handler.check(_engine_on("inverted", "upright"))


def test_both_template_inferers_report_the_same_scores_and_agreement(tmp_path):
    """Matching from template images (evaluating) and from their stored features (inferring, MONAI Label) give each
    image's match scores and the templates' agreement alike; the agreement is that of the templates' queries."""
    from bundle.configs import bundle_parser
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d
    from bundle.templates.features import compute_template
    from bundle.templates.resolution import with_templates

    path = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=1, n_test=1)
    datalist = open_datalist(path)
    parser = bundle_parser("configs/inference.yaml", pipeline="templates", datalist=str(path))
    network = parser.get_parsed_content("encoder").eval()
    preprocessing = parser.get_parsed_content("preprocessing")
    templates = [datalist["template"], datalist["training"][0]]
    data = preprocessing(dict(datalist["test"][0]))
    image = torch.as_tensor(data["image"])[None]
    from_images = with_templates(OneShotInferer(), templates, preprocessing, "cpu")
    from_images(image, network)
    stored = compute_template(network, templates, preprocessing, datalist["landmark_names"])
    from_features = TemplateFeatureInferer(stored)
    from_features(image, network)
    assert from_images.match_scores.shape == (1, len(datalist["landmark_names"]))
    torch.testing.assert_close(from_features.match_scores, from_images.match_scores)
    assert from_features.reference_score == pytest.approx(from_images.reference_score, rel=1e-5)
    queries = list(stored["queries"].unbind(2))
    assert from_images.reference_score == pytest.approx(template_agreement(TemplateMatcher(), queries), rel=1e-5)


@pytest.mark.skipif(not CEPHALOGRAM.is_file(), reason="shared Hamedan data not available")
@pytest.mark.parametrize(
    "pipeline, named_by",
    [("auto", ": the detector's heatmap peaks average"), ("templates", ": its matches with the templates score")],
)
def test_inferring_names_an_inverted_cephalogram_and_not_the_upright_one(tmp_path, pipeline, named_by):
    """`inferring` on a cephalogram and on the same image inverted, as a MONOCHROME1 export may come, by the default
    pipeline (the shipped fine-tuned detector) and by the built-in templates: the inverted one is named, the upright
    one is not."""
    ImageOps.invert(Image.open(CEPHALOGRAM).convert("L")).save(tmp_path / "inverted.png")
    images = f"['{CEPHALOGRAM}','{tmp_path / 'inverted.png'}']"
    command = [sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file", "configs/inference.yaml"]
    command += ["--images", images, "--output_dir", str(tmp_path / "out"), "--overlays", "false"]
    done = subprocess.run(command + ["--pipeline", pipeline], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    named = [line for line in done.stderr.splitlines() if named_by in line]
    assert len(named) == 1 and named[0].startswith(f"{tmp_path / 'inverted.png'}{named_by}"), named
    assert (tmp_path / "out" / "predictions.csv").is_file()
