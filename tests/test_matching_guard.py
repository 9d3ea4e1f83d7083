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
    with pytest.raises(ValueError, match="contrast_adaptation"):
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
def test_the_handler_keeps_the_setting_of_the_lower_validation_mre_and_records_both(guard_helps):
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


def test_a_single_setting_is_set_without_measuring_or_recording():
    inferer, predictor = _Inferer({False: 0.0, True: 0.0}), _Predictor()
    handler = MatchingGuardHandler([{**PLAIN, "contrast_adaptation": True}], inferer, None, [], None, "cpu", predictor)
    handler(None)
    assert inferer.contrast_adaptation is True and predictor.matching_guard is None
    assert "matching_guard" not in run_provenance("templates", "t.png", "m.pt")
