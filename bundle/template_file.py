"""Template feature files: a template's unit feature vectors at its landmarks, without its image.

One-shot matching needs, from the template, only the unit feature vectors of the network at the template's
landmarks (paper Sec. 3.4): the image itself is not needed once they are computed. A *template feature
file* stores them, so a bundle can carry its template without carrying the template image (the shipped
cephalogram templates are Hamedan images, which may not be redistributed). It is written by
``python -m scripts.build_template`` with ``torch.save`` and read with ``torch.load(weights_only=True)``:

- ``format``: ``"infoguided-landmarks-template/1"``;
- ``landmark_names``: the L landmark names;
- ``queries``: ``(K, L, S, C)`` float32, for each of K templates, each landmark and each of the network's S
  scales (coarse to fine), the unit feature vector at that landmark; NaN where a template lacks the landmark;
- ``strides``: the S output strides of the network that computed them; ``spatial_dims``; ``grid_size``:
  the network grid the template images were resized to;
- ``sources``: K short descriptions of the template images (no pixel data); ``checkpoint_sha256``: the
  SHA-256 of the weights that computed the features (they only fit those weights); ``pseudo_sources`` (optional):
  those of the sources that are pseudo-templates (landmarks labelled by matching);
- ``registration_image`` and ``registration_points`` (optional, never in a file that ``build_template`` writes): the
  first template's image on the grid ``(1, 1, *grid_size)`` and its landmarks ``(L, D)`` in grid pixels, which the
  matching guard registers to each input (``contrast_adaptation``, ``registration_tolerance``); inferring's features
  computed from a datalist carry them, in its private cache.

Matched by :class:`bundle.inferers.oneshot.TemplateFeatureInferer` (the Python path) and
:class:`bundle.networks.landmark_points.LandmarkPointsNet` (the exported network); computed by
:func:`bundle.templates.features.compute_template`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from bundle.io_utils import atomic_path, error_summary, file_sha256

TEMPLATE_FORMAT = "infoguided-landmarks-template/1"
BUNDLE_DIR = Path(__file__).resolve().parents[1]


def check_template(template: Mapping[str, Any], where: str = "template") -> dict:
    """Validate a template feature dict (see the module doc) and return it as a plain dict."""
    if not isinstance(template, Mapping):
        raise ValueError(f"{where}: expected a template feature dict, got {type(template).__name__}")
    if template.get("format") != TEMPLATE_FORMAT:
        raise ValueError(
            f"{where}: not a template feature file of format {TEMPLATE_FORMAT!r} (format {template.get('format')!r})"
        )
    missing = [k for k in ("landmark_names", "queries", "strides", "spatial_dims", "sources") if k not in template]
    if missing:
        raise ValueError(f"{where}: template feature file lacks {missing}")
    queries = template["queries"]
    names = list(template["landmark_names"])
    if not isinstance(queries, torch.Tensor) or queries.ndim != 4:
        raise ValueError(
            f"{where}: 'queries' must be a (K, L, S, C) tensor, got {getattr(queries, 'shape', type(queries))}"
        )
    k, n, s, _ = queries.shape
    if n != len(names) or s != len(template["strides"]) or k != len(template["sources"]) or k < 1:
        raise ValueError(
            f"{where}: 'queries' {tuple(queries.shape)} does not fit {len(names)} landmark names, "
            f"{len(template['strides'])} strides and {len(template['sources'])} sources"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: duplicate landmark names {names}")
    _check_registration_template(template, where, n)
    valid = ~torch.isnan(queries).any(dim=-1).any(dim=-1)
    if not bool(valid.any()):
        raise ValueError(f"{where}: no template carries any landmark")
    return {**dict(template), "landmark_names": names, "queries": queries.float()}


def _check_registration_template(template: Mapping[str, Any], where: str, n_landmarks: int) -> None:
    """ValueError naming the key when the optional registration image and points are not both there, on the grid
    and of the landmarks' number (see the module doc)."""
    image, points = template.get("registration_image"), template.get("registration_points")
    if image is None and points is None:
        return
    grid = [int(v) for v in template.get("grid_size") or []]
    if not isinstance(image, torch.Tensor) or list(image.shape) != [1, 1, *grid]:
        raise ValueError(
            f"{where}: 'registration_image' must be a (1, 1, *grid_size {grid}) tensor, got "
            f"{getattr(image, 'shape', type(image))}"
        )
    dims = int(template["spatial_dims"])
    if not isinstance(points, torch.Tensor) or list(points.shape) != [n_landmarks, dims]:
        raise ValueError(
            f"{where}: 'registration_points' must be a ({n_landmarks}, {dims}) tensor, got "
            f"{getattr(points, 'shape', type(points))}"
        )


def join_templates(templates: Sequence[Mapping[str, Any]]) -> dict:
    """One template feature dict holding the K templates of each of ``templates`` (checked dicts of the same
    landmark names, strides, dimensionality, grid and weights), in order."""
    if not templates:
        raise ValueError("join_templates needs at least one template")
    first = templates[0]
    for i, other in enumerate(templates[1:], 1):
        for key in ("landmark_names", "strides", "spatial_dims", "grid_size", "checkpoint_sha256"):
            if _plain(other.get(key)) != _plain(first.get(key)):
                raise ValueError(f"template {i} has other {key} than template 0: {other.get(key)} != {first.get(key)}")
    return check_template(
        {
            **dict(first),
            "queries": torch.cat([t["queries"] for t in templates]),
            "sources": [s for t in templates for s in t["sources"]],
            "pseudo_sources": [s for t in templates for s in t.get("pseudo_sources", [])],
        }
    )


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists (a grid may be stored as either)."""
    return list(value) if isinstance(value, tuple) else value


def bundle_path(path: str | os.PathLike) -> Path:
    """``path``; a relative path missing from the working directory is taken in the bundle's own folder (the
    configs' ``bundle_root: .`` then also works for tools that build the network from elsewhere, e.g.
    ``monai.bundle.load``).

    Args:
        path: a file or folder path.
    """
    path = Path(path)
    if not path.exists() and not path.is_absolute() and (BUNDLE_DIR / path).exists():
        return BUNDLE_DIR / path
    return path


def load_template(path: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> dict:
    """Read a template feature file; refuse it (``ValueError`` naming both files) when ``checkpoint`` is not the
    weights that computed its features: every match would be wrong."""
    path = bundle_path(path)
    if checkpoint is not None:
        checkpoint = bundle_path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(
            f"template feature file not found: {path} (build one with python -m scripts.build_template)"
        )
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or pickled objects beyond tensors
        raise ValueError(f"{path}: not a readable template feature file ({error_summary(e)})") from e
    template = check_template(content, str(path))
    expected = template.get("checkpoint_sha256")
    if checkpoint is not None and expected and Path(checkpoint).is_file() and file_sha256(checkpoint) != expected:
        raise ValueError(
            f"{path} holds template features computed with other weights than {checkpoint}: the matches would be "
            "wrong; give the templates' images instead (--datalist) or rebuild the features for these weights with "
            "python -m scripts.build_template"
        )
    return template


def save_template(path: str | os.PathLike, template: Mapping[str, Any]) -> Path:
    """Write a template feature dict atomically (checked first)."""
    template = check_template(template, str(path))
    with atomic_path(path) as tmp:
        torch.save(template, tmp)
        tmp.chmod(0o644)
    return Path(path)
