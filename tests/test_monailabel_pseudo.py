"""The MONAI Label app's pseudo-templates in-process (no server): one background worker computes the newest label
set's, a failure gives none for that set without retrying it, unreadable candidates are skipped, a labelled image's
own suggestion gets none, and the train task's scoring (``wait``) computes them at once and raises its errors.

``resolve_templates`` (the bundle's, tested with the commands) is replaced by a recording stand-in, so that these
tests see what the app asks of it and when."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def app(tmp_path, monkeypatch):
    """``(context, calls, gate)``: the app's ``BundleContext`` on a synthetic datalist (no built-in template joins
    the saved labels), its ``resolve_templates`` replaced: each call is recorded as (saved label ids, candidate ids),
    waits for ``gate``, fails for a label set holding id ``bad`` and else makes a pseudo-template of every
    candidate."""
    from bundle.data.synthetic import generate_synthetic_2d

    datalist = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=0, n_test=1, seed=2)
    sys.path.insert(0, str(ROOT / "apps" / "monailabel"))
    try:
        import landmark_tasks.context as context_module
        import landmark_tasks.suggestion_templates as suggestion_templates
    finally:
        sys.path.remove(str(ROOT / "apps" / "monailabel"))
    calls, gate = [], threading.Event()

    def resolve_templates(datalist, network, preprocessing, device, **choice):
        assert choice["pseudo_templates"] == 20 and choice["pseudo_max_labelled"] == 5
        ids = [it["id"] for it in datalist["templates"]]
        calls.append((ids, [it["id"] for it in datalist["training"]]))
        gate.wait(30)
        if "bad" in ids:
            raise RuntimeError("out of memory")
        return datalist["templates"] + [dict(it, landmarks=[], pseudo_label=True) for it in datalist["training"]]

    monkeypatch.setattr(suggestion_templates, "resolve_templates", resolve_templates)
    yield context_module.BundleContext(ROOT, str(datalist), None, tmp_path / "model", "cpu"), calls, gate
    for name in [m for m in sys.modules if m == "landmark_tasks" or m.startswith("landmark_tasks.")]:
        del sys.modules[name]


def _images(folder: Path, *ids: str) -> list[dict]:
    rng = np.random.default_rng(0)
    for i in ids:
        Image.fromarray(rng.integers(0, 255, (120, 100), dtype=np.uint8)).save(folder / f"{i}.png")
    return [{"image": str(folder / f"{i}.png"), "id": i} for i in ids]


def _settled(context) -> None:
    deadline = time.monotonic() + 60
    while context.pseudo.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not context.pseudo.pending(), "the pseudo-template worker did not finish"


def _sources(items: list[dict]) -> list[tuple[str, str]]:
    return [(it["id"], it["source"]) for it in items]


def test_the_worker_computes_the_newest_label_set_and_a_failure_once(app, tmp_path):
    context, calls, gate = app
    assert context.served_detector() is None  # a datalist's landmarks: matching, not the shipped detector
    checkpoint = context.served_checkpoint()
    a, b, bad = ({**it, "landmarks": [[10.0, 20.0]] * len(context.names)} for it in _images(tmp_path, "a", "b", "bad"))
    unlabelled = _images(tmp_path, "u1", "u2")
    assert _sources(context.suggestion_templates([a], unlabelled, checkpoint)) == [("a", "datastore")]
    deadline = time.monotonic() + 60
    while not calls and time.monotonic() < deadline:  # the worker is computing the first set
        time.sleep(0.05)
    # a second label saved while the first set is computed: the worker goes on to the newest set, once
    assert _sources(context.suggestion_templates([a, b], unlabelled, checkpoint)) == [
        ("a", "datastore"),
        ("b", "datastore"),
    ]
    gate.set()
    _settled(context)
    assert calls == [(["a"], ["u1", "u2"]), (["a", "b"], ["u1", "u2"])]
    served = context.suggestion_templates([a, b], unlabelled, checkpoint, exclude="u1")
    assert _sources(served) == [("a", "datastore"), ("b", "datastore"), ("u2", "pseudo")]  # never its own template
    # a labelled image's own suggestion: the other label alone (the pseudo-templates were made from its label too)
    assert _sources(context.suggestion_templates([a, b], unlabelled, checkpoint, exclude="a")) == [("b", "datastore")]
    # a failure is logged and gives the saved labels alone for that set, without computing it again
    for _ in range(2):
        assert _sources(context.suggestion_templates([bad], unlabelled, checkpoint)) == [("bad", "datastore")]
        _settled(context)
    assert calls[2:] == [(["bad"], ["u1", "u2"])]
    # more saved labels than pseudo_max_labelled (5), or no unlabelled image: none asked for
    many = [{**a, "id": f"a{i}"} for i in range(6)]
    assert [s for _, s in _sources(context.suggestion_templates(many, unlabelled, checkpoint))] == ["datastore"] * 6
    assert _sources(context.suggestion_templates([a], [], checkpoint)) == [("a", "datastore")]
    _settled(context)
    assert len(calls) == 3


def test_unreadable_candidates_are_skipped_and_waiting_raises(app, tmp_path, caplog):
    context, calls, gate = app
    gate.set()
    checkpoint = context.served_checkpoint()
    (a,) = ({**it, "landmarks": [[10.0, 20.0]] * len(context.names)} for it in _images(tmp_path, "a"))
    (tmp_path / "junk.png").write_bytes(b"not an image")
    unlabelled = [*_images(tmp_path, "u1"), {"image": str(tmp_path / "junk.png"), "id": "junk"}]
    served = context.suggestion_templates([a], unlabelled, checkpoint, wait=True)  # the train task's scoring
    assert _sources(served) == [("a", "datastore"), ("u1", "pseudo")]
    assert calls == [(["a"], ["u1"])]
    assert "pseudo-template candidate skipped: cannot read image 'junk'" in caplog.text
    with pytest.raises(RuntimeError, match="out of memory"):
        context.suggestion_templates([{**a, "id": "bad"}], unlabelled, checkpoint, wait=True)


def test_the_app_stopping_stops_the_pseudo_templates_between_candidates(app, tmp_path, monkeypatch):
    """At exit the worker gives up at the next candidate the bundle prepares, not after all of them."""
    context, _, _ = app
    background = sys.modules["landmark_tasks.background"]
    monkeypatch.setattr(background, "STOPPING", threading.Event())  # this test's own stop, as stop_all sets it
    prepared, first, proceed = [], threading.Event(), threading.Event()

    def resolve_templates(datalist, network, preprocessing, device, **choice):
        for item in datalist["training"]:  # the bundle prepares the candidates one by one with `preprocessing`
            preprocessing({k: v for k, v in item.items() if k != "landmarks"})
            prepared.append(item["id"])
            first.set()
            proceed.wait(30)
        return datalist["templates"]

    monkeypatch.setattr(sys.modules["landmark_tasks.suggestion_templates"], "resolve_templates", resolve_templates)
    (a,) = ({**it, "landmarks": [[10.0, 20.0]] * len(context.names)} for it in _images(tmp_path, "a"))
    unlabelled = _images(tmp_path, *[f"u{i}" for i in range(5)])
    context.suggestion_templates([a], unlabelled, context.served_checkpoint())
    assert first.wait(60), "the pseudo-template worker did not start"
    background.STOPPING.set()
    proceed.set()
    background.BackgroundValue.stop_all(60)
    assert not context.pseudo.pending()
    assert prepared == ["u0"]
    assert context.pseudo.get("another key") is None  # nothing computed for the stopped set
    background.BackgroundValue.stop_all(60)  # the worker that get() started ends at once: the app is stopping


def test_a_full_disk_skips_the_bundle_templates_cache_with_a_warning(tmp_path, small_disk, caplog):
    """model/bundle_templates.json that cannot be written (a full disk) made every suggestion resolving the bundle's
    templates fail (OSError: 500); now they are kept in the process, with a warning naming the file."""
    from bundle.data.synthetic import generate_synthetic_2d

    datalist = generate_synthetic_2d(tmp_path / "data", n_training=2, n_validation=0, n_test=1, seed=2)
    sys.path.insert(0, str(ROOT / "apps" / "monailabel"))
    try:
        import landmark_tasks.context as context_module
        import landmark_tasks.suggestion_templates as suggestion_templates
    finally:
        sys.path.remove(str(ROOT / "apps" / "monailabel"))
    try:
        context = context_module.BundleContext(ROOT, str(datalist), None, small_disk / "model", "cpu", 0)
        (small_disk / "model").mkdir()
        with open(small_disk / "filler", "wb", buffering=0) as filler:  # the disk filled up
            with pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 65536)
        with caplog.at_level("WARNING", logger=suggestion_templates.__name__):
            templates = context.bundle_templates()
        assert [Path(t["image"]).name for t in templates] == ["template.png"]
        cache = small_disk / "model" / "bundle_templates.json"
        assert f"{cache} not written (No space left on device)" in caplog.text
        assert list((small_disk / "model").iterdir()) == []
    finally:
        for name in [m for m in sys.modules if m == "landmark_tasks" or m.startswith("landmark_tasks.")]:
            del sys.modules[name]
