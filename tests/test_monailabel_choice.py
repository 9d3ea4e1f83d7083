"""The MONAI Label app's ``auto`` choice (``landmark_tasks.scoring.choose_predictor``) in-process: which candidates
are scored, on which saved labels, and what is chosen. The scores themselves (the detector's and template
matching's radial errors, tested through the server in tests/test_monailabel_apps.py) are replaced by a table, so
that these tests see what the rule asks for and decides; and the background computation it runs in."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def app_modules():
    sys.path.insert(0, str(ROOT / "apps" / "monailabel"))
    try:
        import landmark_tasks.background as background
        import landmark_tasks.scoring as scoring
    finally:
        sys.path.remove(str(ROOT / "apps" / "monailabel"))
    yield background, scoring
    for name in [m for m in sys.modules if m == "landmark_tasks" or m.startswith("landmark_tasks.")]:
        del sys.modules[name]


@pytest.fixture
def rule(app_modules, monkeypatch):
    """``(choose, calls)``: ``choose(labelled, detector, info, table, builtin=True, diagonal=1000.0)`` runs
    ``choose_predictor`` with scores from ``table`` (candidate -> score, or an error it raises) on a stand-in context
    whose built-in
    templates fit (``builtin``) and whose images have that diagonal; ``calls`` records (candidate, scored ids,
    templates' ids per case)."""
    _, scoring = app_modules
    calls = []
    table = {}

    def score_detector(context, checkpoint, image_size, items):
        calls.append(("detector", [it["id"] for it in items], None))
        return score("detector")

    def score_checkpoint(context, checkpoint, cases, unlabelled=(), builtin=True, network=None):
        assert network == "private copy" and [it["id"] for it in unlabelled] == ["u0"]  # pseudo-template candidates
        name = "templates_builtin" if builtin else "templates"
        calls.append((name, [it["id"] for it, _ in cases], [[o["id"] for o in others] for _, others in cases]))
        return score(name)

    def score(name: str):
        if isinstance(table[name], Exception):
            raise table[name]
        return scoring.Score(table[name], 0.0)

    monkeypatch.setattr(scoring, "score_detector", score_detector)
    monkeypatch.setattr(scoring, "score_checkpoint", score_checkpoint)

    def choose(labelled, detector, info, scores, builtin=True, diagonal=1000.0):
        table.clear()
        table.update(scores)
        calls.clear()
        context = SimpleNamespace(
            private_network=lambda checkpoint: "private copy",
            builtin_template=lambda checkpoint: {"sources": []} if builtin else None,
            error_units=lambda items: "pixels",
            frame=lambda image: {
                "grid_shape": np.array([9.0, 9.0]),
                "grid_to_physical": np.diag([diagonal / 8.0 / np.sqrt(2)] * 2 + [1.0]),
            },
        )
        unlabelled = [{"id": "u0", "image": "u0.png"}]
        return scoring.choose_predictor(context, labelled, unlabelled, Path("model.pt"), detector, info)

    return choose, calls


def _labels(folder: Path, n: int) -> list[dict]:
    """``n`` saved labels ``l00``... whose label files were saved in that order (one second apart)."""
    items = []
    for i in range(n):
        label = folder / f"l{i:02d}.mrk.json"
        label.write_text("{}")
        os.utime(label, (1000 + i, 1000 + i))
        items.append(
            {"id": f"l{i:02d}", "image": str(folder / f"l{i:02d}.png"), "landmarks": [[1, 2]], "label": str(label)}
        )
    return items


def test_the_lowest_error_on_the_newest_labels_the_detector_did_not_train_on(rule, tmp_path):
    choose, calls = rule
    labelled = _labels(tmp_path, 14)
    info = {"trained_on": ["l11", "l02", "l00", "l01", "l06"], "image_size": [64, 64]}
    choice = choose(labelled, Path("detector.pt"), info, {"detector": 5.0, "templates_builtin": 3.0, "templates": 4.0})
    newest = [f"l{i:02d}" for i in (13, 12, 10, 9, 8, 7, 5, 4, 3)]  # the detector's training images left out
    assert [c[:2] for c in calls] == [("detector", newest), ("templates_builtin", newest), ("templates", newest)]
    # each scored label matched from every other saved label (the detector's training images among them)
    assert all(len(others) == 13 and scored not in others for scored, others in zip(newest, calls[1][2]))
    assert choice["predictor"] == "templates" and choice["builtin_templates"] is True
    assert choice["scored_on"] == newest and choice["labels"] == 14
    assert choice["mre"] == {"detector": 5.0, "templates_builtin": 3.0, "templates": 4.0}

    choice = choose(labelled, Path("detector.pt"), info, {"detector": 2.0, "templates_builtin": 3.0, "templates": 1.0})
    assert choice["predictor"] == "templates" and choice["builtin_templates"] is False
    choice = choose(labelled, Path("detector.pt"), info, {"detector": 3.0, "templates_builtin": 3.0, "templates": 4.0})
    assert choice["predictor"] == "detector" and choice["builtin_templates"] is True  # a tie keeps the detector


def test_a_detector_trained_on_few_saved_labels_is_not_served(rule, tmp_path):
    """A detector that the train task made from fewer saved labels than the commands' rule admits (fewer than the
    saved labels and than ENOUGH_LABELS, 5) is passed over, however it scores on its few held-out labels (one made from
    2 labels won on its 3 and lost on 30 test images)."""
    choose, calls = rule
    labelled = _labels(tmp_path, 5)
    info = {"trained_on": ["l01", "l04"], "held_out": ["l00", "l02", "l03"], "image_size": [64, 64]}
    scores = {"detector": 1.0, "templates_builtin": 3.0, "templates": 2.0}
    choice = choose(labelled, Path("detector.pt"), info, scores)
    held_out = ["l03", "l02", "l00"]
    assert [c[:2] for c in calls] == [("templates_builtin", held_out), ("templates", held_out)]
    assert choice["predictor"] == "templates" and choice["builtin_templates"] is False
    assert "learnt from 2 saved labels, fewer than the 5 saved and than 5" in choice["reason"]
    assert "detector" not in choice["mre"]
    # no built-in template: matching from the saved labels is served without scoring
    choice = choose(labelled, Path("detector.pt"), info, scores, builtin=False)
    assert calls == [] and choice["predictor"] == "templates" and choice["builtin_templates"] is False
    # both matchings failing to score still leaves the detector out
    failed = {"templates_builtin": RuntimeError("x"), "templates": RuntimeError("y")}
    assert choose(labelled, Path("detector.pt"), info, failed)["predictor"] == "templates"
    # from 5 saved labels it competes (here it wins); the shipped detector (no trained_on) always does
    info = {**info, "trained_on": ["l01", "l04", "l05", "l06", "l07"]}
    labelled = _labels(tmp_path, 8)
    assert choose(labelled, Path("detector.pt"), info, scores)["predictor"] == "detector"
    assert choose(labelled, Path("detector.pt"), {}, scores)["predictor"] == "detector"


def test_the_app_admits_a_detector_by_the_commands_rule(app_modules):
    """The app's detector passes by ``bundle.pipeline.choice.detector_admitted``, as the commands' do: from as many
    labels as are saved, or from 5."""
    from bundle.pipeline.choice import detector_admitted

    _, scoring = app_modules

    def few(n_trained: int, n_saved: int):
        return scoring.learnt_from_few({"trained_on": [f"l{i:02d}" for i in range(n_trained)]}, n_saved)

    assert (few(2, 5), few(4, 10), few(5, 8), few(7, 10), few(3, 3)) == (2, 4, None, None, None)
    assert all((few(t, n) is None) == detector_admitted(t, n) for t in range(1, 12) for n in range(t, 15))
    assert scoring.learnt_from_few({"image_size": [288, 288]}, 30) is None  # the shipped one: other labels


def test_a_candidate_that_cannot_be_scored_is_left_out(rule, tmp_path):
    choose, calls = rule
    labelled = _labels(tmp_path, 3)
    scores = {"detector": RuntimeError("out of memory"), "templates_builtin": 3.0, "templates": 2.0}
    choice = choose(labelled, Path("d.pt"), {}, scores)
    assert [c[0] for c in calls] == ["detector", "templates_builtin", "templates"]
    assert choice["mre"] == {"templates_builtin": 3.0, "templates": 2.0} and choice["predictor"] == "templates"
    scores = {"detector": 1.0, "templates_builtin": RuntimeError("no landmark to score on")}
    assert choose(labelled[:1], Path("d.pt"), {}, scores) is None  # one candidate left: nothing to compare


def test_nothing_to_choose_between_keeps_the_default(rule, tmp_path):
    choose, calls = rule
    labelled = _labels(tmp_path, 3)
    # every saved label trained the detector: it cannot be scored
    assert choose(labelled, Path("d.pt"), {"trained_on": ["l00", "l01", "l02"]}, {}) is None and calls == []
    # a datalist's templates (no built-in one) and no detector: matching is the only candidate
    assert choose(labelled, None, {}, {"templates": 1.0}, builtin=False) is None and calls == []
    # one label, no detector: the built-in templates are scored (they could miss it grossly), not the label alone
    assert choose(labelled[:1], None, {}, {"templates_builtin": 29.0}) is None
    assert [c[:2] for c in calls] == [("templates_builtin", ["l00"])]


def test_one_label_that_the_served_models_miss_grossly_is_matched_alone(rule, tmp_path):
    """With one saved label, matching from it alone cannot be scored; it is chosen when the shipped detector and the
    built-in templates both miss that label by more than 3 % of the image diagonal (here 1000)."""
    choose, calls = rule
    (label,) = _labels(tmp_path, 1)
    scores = {"detector": 55.0, "templates_builtin": 31.0}
    choice = choose([label], Path("d.pt"), {}, scores)
    assert [c[:2] for c in calls] == [("detector", ["l00"]), ("templates_builtin", ["l00"])]
    assert calls[1][2] == [[]]  # the built-in templates alone
    assert choice["predictor"] == "templates" and choice["builtin_templates"] is False
    assert "3%" in choice["reason"] and choice["mre"] == scores
    kept = choose([label], Path("d.pt"), {}, scores, diagonal=1100.0)  # 31 < 33: the lower of the two scored
    assert kept["predictor"] == "templates" and kept["builtin_templates"] is True and "lowest" in kept["reason"]
    assert choose([label], None, {}, {"templates_builtin": 31.0})["predictor"] == "templates"


def test_the_background_value_is_the_newest_wish_and_a_failure_its_fallback(app_modules):
    background, _ = app_modules
    gate, started = threading.Event(), []

    def compute(x):
        started.append(x)
        gate.wait(30)
        if x == "bad":
            raise RuntimeError("out of memory")
        return x * 2

    value = background.BackgroundValue("test", compute, fallback="none")
    assert value.get("a", "a") is None and value.pending()
    deadline = time.monotonic() + 30
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    value.get("b", "b")
    value.get("c", "c")  # replaces the wish for "b": only the newest is computed after "a"
    gate.set()
    deadline = time.monotonic() + 30
    while value.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started == ["a", "c"] and value.get("c", "c") == ("c", "cc") and not value.pending()
    assert value.get("bad", "bad") == ("c", "cc")  # the last value stays readable while the next is computed
    while value.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert value.get("bad", "bad") == ("bad", "none") and not value.pending()  # failed once, not retried


def test_a_process_ending_during_background_work_stops_it_and_exits_cleanly(tmp_path):
    """A process that ends while a background computation runs the network is not aborted (PyTorch aborts one whose
    daemon thread is inside an operation at exit): the computation stops at its next check and is waited for."""
    script = tmp_path / "ending.py"
    script.write_text(
        "import sys, time, torch\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'apps' / 'monailabel')!r}]\n"
        "from landmark_tasks.background import BackgroundValue, check_stopping\n"
        "def work():\n"
        "    x, started = torch.randn(1, 1, 600, 600), time.monotonic()\n"
        "    while time.monotonic() < started + 60:\n"
        "        check_stopping()\n"
        "        x = torch.nn.functional.conv2d(x, torch.randn(1, 1, 9, 9), padding=4)\n"
        "value = BackgroundValue('ending', work)\n"
        "value.get('key')\n"
        "time.sleep(1)\n"
        "print('ending', flush=True)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ending" in done.stdout, done.stderr[-2000:]
    assert time.monotonic() - started < 50  # stopped, not run to its end
