"""The MONAI Label app's built-in templates in-process (no server): they are refused, naming the way back, for
weights that the train task published, and the infer task pairs them with the checkpoint it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def context(tmp_path):
    """The app's ``BundleContext`` without ``--conf datalist``; the app's package is forgotten afterwards (other
    tests load the app as MONAI Label does)."""
    sys.path.insert(0, str(ROOT / "apps" / "monailabel"))
    try:
        from landmark_tasks.context import BundleContext
    finally:
        sys.path.remove(str(ROOT / "apps" / "monailabel"))
    yield BundleContext(ROOT, None, None, tmp_path / "model", "cpu")
    for name in [m for m in sys.modules if m == "landmark_tasks" or m.startswith("landmark_tasks.")]:
        del sys.modules[name]


def _published_other_weights(context) -> None:
    """Weights other than the shipped ones in the app's model folder, as a fine-tuning publishes them."""
    context.served_path.parent.mkdir(parents=True)
    state = torch.load(context.shipped_ckpt, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name] + 1.0
    torch.save(state, context.served_path)


def test_builtin_templates_refused_for_published_weights(context):
    with context.network(context.shipped_ckpt) as network:
        _, sources = context.template_inferer([], context.shipped_ckpt, network)
    assert sources and all(t["source"] == "built-in" for t in sources)
    _published_other_weights(context)
    assert context.served_checkpoint() == context.served_path
    assert context.builtin_template(context.served_path) is None
    with pytest.raises(ValueError, match="remove the app's model/model.pt"), context.network() as network:
        context.template_inferer([], context.served_path, network)
    assert context.builtin_template(context.shipped_ckpt) is not None  # the checkpoint a request runs decides


def test_saved_labels_join_the_builtin_templates_with_features_computed_once(context, tmp_path, monkeypatch):
    """A labelled image and the built-in templates are matched together; each part predicts what its own inferer
    does (the image's features as ``OneShotInferer`` computes them from the image, the built-in ones as
    ``inferring`` matches them), and the image's features are computed once for the weights."""
    from bundle.inferers.oneshot import TemplateFeatureInferer
    from bundle.templates import features
    from bundle.templates.resolution import prepare_template
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (240, 200), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 255, (220, 230), dtype=np.uint8)).save(tmp_path / "b.png")
    label = {"image": str(tmp_path / "a.png"), "id": "a", "landmarks": rng.uniform(20, 180, (19, 2)).tolist()}
    items = context.templates([label], exclude="b")
    assert [t["source"] for t in items] == ["datastore"]
    calls = []
    monkeypatch.setattr(
        sys.modules[context.template_inferer.__module__],
        "compute_template",
        lambda *a, **k: calls.append(1) or features.compute_template(*a, **k),
    )
    data = context.prepare({"image": str(tmp_path / "b.png")})
    batch = torch.as_tensor(data["image"]).unsqueeze(0)
    shipped = context.shipped_ckpt
    with context.network(shipped) as network:
        joined, sources = context.template_inferer(items, shipped, network)
        context.template_inferer(items, shipped, network)
        per_template = joined.predict_per_template(batch, network)
        builtin = context.builtin_template(shipped)
        alone = TemplateFeatureInferer(builtin).predict_per_template(batch, network)
        oneshot = context.oneshot
        image, points = prepare_template({k: label[k] for k in ("image", "landmarks")}, context.preprocessing)
        oneshot.set_templates([image], [points])
        from_image = oneshot.predict_per_template(batch, network)[0]
    assert calls == [1]
    assert sources == [{"image": "a", "source": "datastore"}] + [
        {"image": Path(n).name, "source": "built-in"} for n in builtin["sources"]
    ]
    assert per_template.shape[0] == 1 + len(builtin["sources"])
    torch.testing.assert_close(per_template[1:], alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(per_template[:1], from_image, atol=1e-3, rtol=0)


def test_the_shipped_detector_is_served_until_the_train_task_publishes_one(context):
    """Without a datalist the app serves the detector ``inferring`` takes without one (shipped beside the built-in
    templates) on its recorded grid; a published detector replaces it, with its own record."""
    import json

    from bundle.pipeline.detector_data import detector_info

    shipped = (ROOT / "models" / "finetune" / "model.pt").resolve()
    assert context.served_detector().resolve() == shipped
    grid = detector_info(shipped)["image_size"]
    assert context.detector_info() == {"image_size": grid} and grid != [192, 192]
    context.detector_path.parent.mkdir(parents=True)
    context.detector_path.write_bytes(shipped.read_bytes())
    context.detector_info_path.write_text(json.dumps({"image_size": [192, 192], "trained_on": ["a"], "held_out": []}))
    assert context.served_detector() == context.detector_path
    assert context.detector_info()["image_size"] == [192, 192] and context.is_published(context.detector_path)
