"""The MONAI Label app's built-in templates in-process (no server): they are refused, naming the way back, for
weights that the train task published, and the infer task pairs them with the checkpoint it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def context(tmp_path):
    """The app's ``BundleContext`` without ``--conf datalist``; the app's package is forgotten afterwards (other
    tests load the app as MONAI Label does)."""
    sys.path.insert(0, str(ROOT / "apps" / "monailabel"))
    try:
        from landmark_tasks.common import BundleContext
    finally:
        sys.path.remove(str(ROOT / "apps" / "monailabel"))
    yield BundleContext(ROOT, None, None, tmp_path / "model", "cpu")
    for name in [m for m in sys.modules if m == "landmark_tasks" or m.startswith("landmark_tasks.")]:
        del sys.modules[name]


def test_builtin_templates_refused_for_published_weights(context):
    shipped = context.builtin_inferer()
    assert [t["source"] for t in context.builtin_sources(shipped)] == ["built-in"] * len(shipped.template["sources"])
    context.served_path.parent.mkdir(parents=True)
    state = torch.load(context.shipped_ckpt, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name] + 1.0  # other weights than the shipped ones: a fine-tuned model, say
    torch.save(state, context.served_path)
    assert context.served_checkpoint() == context.served_path
    with pytest.raises(ValueError, match="remove the app's model/model.pt"):
        context.builtin_inferer()
    assert context.builtin_inferer(context.shipped_ckpt) is not None  # the checkpoint a request runs decides
