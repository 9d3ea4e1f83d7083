"""contrast_adaptation: auto: 3D matching's guard chosen on the validation images (bundle.pipeline.matching_guard)."""

from __future__ import annotations

import pytest
import torch
from bundle.pipeline.matching_guard import GUARD_TOLERANCE, MatchingGuardHandler, guard_candidates
from bundle.reporting import run_provenance
from bundle.settings import flag_or_auto

PLAIN = {"contrast_adaptation": False, "registration_tolerance": None}
LABELLED = [{"image": "v.nii.gz", "landmarks": [[1.0, 2.0, 3.0], None]}]


@pytest.mark.parametrize(
    "setting, tolerance, dims, items, expected",
    [
        ("auto", None, 3, LABELLED, [PLAIN, {"contrast_adaptation": True, "registration_tolerance": GUARD_TOLERANCE}]),
        (
            "auto",
            1.0,
            3,
            LABELLED,
            [{**PLAIN, "registration_tolerance": 1.0}, {"contrast_adaptation": True, "registration_tolerance": 1.0}],
        ),
        ("auto", None, 2, LABELLED, [PLAIN]),  # 2D: off
        ("auto", None, 3, [], [PLAIN]),  # nothing to choose on
        ("auto", None, 3, [{"image": "v.nii.gz", "landmarks": [None, None]}], [PLAIN]),  # no landmark
        (True, None, 3, LABELLED, [{**PLAIN, "contrast_adaptation": True}]),  # given: as given, no choice
        (False, 2.0, 2, LABELLED, [{**PLAIN, "registration_tolerance": 2.0}]),
    ],
)
def test_auto_weighs_the_guard_only_in_3d_with_labelled_validation_images(setting, tolerance, dims, items, expected):
    assert guard_candidates(setting, tolerance, dims, items) == expected


def test_the_setting_reads_auto_or_a_yes_no_word_and_names_the_key_it_refuses():
    assert [flag_or_auto(v, "contrast_adaptation") for v in ("AUTO", "false", True, 1)] == ["auto", False, True, True]
    with pytest.raises(ValueError, match="contrast_adaptation: expected auto, true or false .*'sometimes'"):
        flag_or_auto("sometimes", "contrast_adaptation")


class _Inferer:
    """Predicts each item's label moved along x by ``offsets[contrast_adaptation]`` mm."""

    def __init__(self, offsets: dict) -> None:
        self.offsets, self.contrast_adaptation, self.registration_tolerance = offsets, False, None

    def __call__(self, inputs, network, grid_to_physical=None):
        return inputs[:, 0, :, :3] + torch.tensor([self.offsets[self.contrast_adaptation], 0.0, 0.0])


class _Predictor:
    matching_guard = None


def _prepare(item):
    label = torch.tensor(item["landmarks"], dtype=torch.float32)
    return {"image": label[None], "label": label, "grid_to_physical": torch.eye(4)}


@pytest.mark.parametrize("guard_helps", [True, False])
def test_the_handler_keeps_the_setting_of_the_lower_validation_mre_and_records_both(guard_helps, capsys, monkeypatch):
    from bundle import progress

    monkeypatch.setattr(progress, "_SHOWN", [True])  # as a command shows its bars
    inferer = _Inferer({False: 3.0, True: 1.0} if guard_helps else {False: 0.0, True: 1.0})
    predictor = _Predictor()
    items = [{"landmarks": [[0.0, 0.0, 0.0], [5.0, 5.0, 5.0]]}, {"landmarks": [[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]}]
    candidates = guard_candidates("auto", None, 3, items)
    handler = MatchingGuardHandler(candidates, inferer, None, items, _prepare, "cpu", predictor)
    handler(None)
    assert inferer.contrast_adaptation is guard_helps
    assert inferer.registration_tolerance == (GUARD_TOLERANCE if guard_helps else None)
    record = predictor.matching_guard
    assert record["validation_images"] == 2 and record["contrast_adaptation"] is guard_helps
    assert [c["mre_mm"] for c in record["validation_mre_mm"]] == ([3.0, 1.0] if guard_helps else [0.0, 1.0])
    assert run_provenance("templates", "t.nii.gz", "m.pt", matching_guard=record)["matching_guard"] == record
    handler(None)  # once per run
    assert predictor.matching_guard is record
    printed = capsys.readouterr().err  # each setting's pass over the validation volumes, counted (no silent minute)
    assert "matching guard, plain: validation" in printed and "matching guard, guarded: validation" in printed
    assert "2/2" in printed


def test_a_single_setting_is_set_without_measuring_or_recording():
    inferer, predictor = _Inferer({False: 0.0, True: 0.0}), _Predictor()
    handler = MatchingGuardHandler([{**PLAIN, "contrast_adaptation": True}], inferer, None, [], None, "cpu", predictor)
    handler(None)
    assert inferer.contrast_adaptation is True and predictor.matching_guard is None
    assert "matching_guard" not in run_provenance("templates", "t.png", "m.pt")


def _smooth_volume(seed: int, grid=(32, 32, 32)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand((1, 1, *grid), generator=generator)
    return torch.nn.functional.avg_pool3d(noise, 5, 1, 2)


def _guard_scene():
    """A seeded untrained 3D network, two smooth template volumes with 3 landmarks, two inputs (the first template
    shifted, and the same inverted: another contrast), the template items and an evaluation pipeline's stand-in."""
    from bundle.networks.contrastive import ContrastiveLandmarkNet

    torch.manual_seed(0)
    network = ContrastiveLandmarkNet(spatial_dims=3, channels=(8, 16, 32, 64, 64)).eval()
    templates = [_smooth_volume(1), _smooth_volume(2)]
    points = [torch.tensor([[6.0, 8.0, 10.0], [21.0, 12.0, 9.0], [11.0, 23.0, 20.0]])] * 2
    shift = (2, -1, 1)
    shifted = torch.roll(templates[0], shift, dims=(2, 3, 4))
    inputs = torch.cat([shifted, 1.0 - shifted])
    volumes = {f"t{k}.nii.gz": (image, p) for k, (image, p) in enumerate(zip(templates, points))}
    moved = points[0] + torch.tensor(shift, dtype=torch.float32)  # the inputs' true landmarks
    volumes.update({f"v{b}.nii.gz": (inputs[b : b + 1], moved) for b in range(2)})
    items = [{"image": name, "landmarks": volumes[name][1].tolist()} for name in ("t0.nii.gz", "t1.nii.gz")]

    def prepare(item):  # an evaluation pipeline's output: the grid image, the landmarks (grid = world here)
        image, p = volumes[item["image"]]
        return {"image": image[0], "label": p, "grid_to_physical": torch.eye(4)}

    return network, templates, points, inputs, items, prepare


@pytest.mark.parametrize("adaptation, tolerance", [(True, None), (False, 1.0), (True, 0.0)])
def test_stored_features_are_guarded_as_the_template_images_are(adaptation, tolerance):
    """The guard of inferring's stored template features (the first template's image they carry) gives what
    evaluating's guard on the template images gives: the same matches, registration and contrast map included."""
    from bundle.inferers.oneshot import OneShotInferer
    from bundle.templates.features import compute_template

    network, templates, points, inputs, items, prepare = _guard_scene()
    oneshot = OneShotInferer(contrast_adaptation=adaptation, registration_tolerance=tolerance)
    oneshot.set_templates(templates, points)
    names = ["a", "b", "c"]
    stored = compute_template(network, items, prepare, names, registration_image=True)
    torch.testing.assert_close(stored["registration_image"], templates[0])
    guarded = oneshot.feature_inferer(stored)
    assert (guarded.contrast_adaptation, guarded.registration_tolerance) == (adaptation, tolerance)
    expected = oneshot(inputs, network)
    torch.testing.assert_close(guarded(inputs, network), expected, rtol=0, atol=1e-6)
    unguarded = OneShotInferer()
    unguarded.set_templates(templates, points)
    assert not torch.allclose(unguarded(inputs, network), expected, atol=1e-3)  # the guard changed something

    plain = compute_template(network, items, prepare, names)
    assert "registration_image" not in plain  # a file to share carries no pixel data
    with pytest.raises(ValueError, match="carry no template image"):  # refused as it is built, not at an image
        oneshot.feature_inferer(plain)


def test_the_guard_chosen_on_stored_features_is_the_lower_validation_mre_and_leaves_no_scores(tmp_path):
    """choose_guard with inferring's inferer (stored features read back from a cache file): the candidate kept is the
    one whose validation MRE, computed here setting by setting, is lower; the run's fingerprint is that of an
    inferer given the kept setting outright (no validation scores left on it)."""
    from bundle.inferers.oneshot import TemplateFeatureInferer
    from bundle.journal import fingerprint
    from bundle.pipeline.matching_guard import choose_guard, validation_mre
    from bundle.template_file import load_template, save_template
    from bundle.templates.features import compute_template

    network, _, _, _, items, prepare = _guard_scene()
    computed = compute_template(network, items, prepare, ["a", "b", "c"], registration_image=True)
    stored = load_template(save_template(tmp_path / "cached.pt", computed))  # weights_only, as the cache is read
    assert torch.equal(stored["registration_image"], computed["registration_image"])
    assert torch.equal(stored["registration_points"], computed["registration_points"])
    validation = [{"image": f"v{b}.nii.gz", "landmarks": [[0.0, 0.0, 0.0]]} for b in range(2)]
    candidates = guard_candidates("auto", None, 3, validation)
    direct = [
        validation_mre(TemplateFeatureInferer(stored, **c), network, [prepare(it) for it in validation], "cpu")
        for c in candidates
    ]
    assert direct[0] != pytest.approx(direct[1], abs=1e-3)  # the choice matters here
    inferer = TemplateFeatureInferer(stored)
    record = choose_guard(candidates, inferer, network, validation, prepare, "cpu")
    kept = candidates[min(range(2), key=direct.__getitem__)]
    assert {k: record[k] for k in kept} == kept
    assert [c["mre_mm"] for c in record["validation_mre_mm"]] == [round(d, 4) for d in direct]
    assert inferer.match_scores is None
    assert fingerprint(inferer=inferer) == fingerprint(inferer=TemplateFeatureInferer(stored, **kept))


def _feature_file(spatial_dims: int, grid: list[int]) -> dict:
    """A template feature dict of one template and two landmarks, without pixel data."""
    from bundle.template_file import TEMPLATE_FORMAT

    return {
        "format": TEMPLATE_FORMAT,
        "landmark_names": ["a", "b"],
        "queries": torch.ones(1, 2, 1, 4),
        "strides": [4],
        "spatial_dims": spatial_dims,
        "grid_size": grid,
        "sources": ["t.nii.gz" if spatial_dims == 3 else "t.png"],
    }


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"registration_image": torch.zeros(1, 1, 16, 16)}, "registration_image"),  # not on the grid
        ({"registration_image": torch.zeros(1, 1, 32, 32)}, "registration_points"),  # points missing
        ({"registration_image": torch.zeros(1, 1, 32, 32), "registration_points": torch.zeros(3, 2)}, "points"),
    ],
)
def test_a_registration_image_off_the_grid_or_without_its_landmarks_is_refused_naming_the_key(extra, key):
    from bundle.template_file import check_template

    template = _feature_file(2, [32, 32])
    assert check_template(
        {**template, "registration_image": torch.zeros(1, 1, 32, 32), "registration_points": torch.zeros(2, 2)}
    )
    with pytest.raises(ValueError, match=key):
        check_template({**template, **extra}, "t.pt")


@pytest.mark.parametrize("with_image", [True, False])
def test_inferring_weighs_the_guard_only_with_the_template_image_its_features_carry(with_image, monkeypatch):
    """Inferring's predictor chooses the guard as it is built, on the datalist's labelled validation volumes, when its
    template features carry the template image (computed from a datalist); from a template feature file (no pixel
    data) it matches plain and records nothing."""
    from bundle.pipeline import predictor as predictor_module

    template = _feature_file(3, [8, 8, 8])
    if with_image:
        template.update(registration_image=torch.zeros(1, 1, 8, 8, 8), registration_points=torch.zeros(2, 3))
    weighed = []

    def choose(candidates, inferer, network, items, preprocessing, device):
        weighed.append((len(candidates), len(items)))
        return {"contrast_adaptation": True} if len(candidates) > 1 else None

    monkeypatch.setattr(predictor_module, "choose_guard", choose)
    datalist = {"landmark_names": ["a", "b"], "validation": LABELLED + [{"image": "u.nii.gz"}], "training": []}
    built = predictor_module.build_predictor(
        "templates",
        [],
        ["a", "b"],
        3,
        datalist,
        None,
        "m.pt",
        None,
        "cpu",
        "light",
        32,
        [4],
        5,
        "weighted_geometric_median",
        0,
        False,
        template_features=lambda: template,
        contrast_adaptation="auto",
    )
    assert weighed == ([(2, 1)] if with_image else [(1, 0)])  # the one labelled validation volume, or nothing
    assert built.matching_guard == ({"contrast_adaptation": True} if with_image else None)
    assert ("matching_guard" in built.provenance()) is with_image
