"""Standalone inference with a built-in template: template feature files and their inferer.

One-shot matching needs, from the template, only the unit feature vectors of the network at the template's
landmarks (paper Sec. 3.4): the image itself is not needed once they are computed. A *template feature
file* stores them, so a bundle can carry its template without carrying the template image (the shipped
cephalogram templates are Hamedan images, which may not be redistributed). It is written by
``scripts/build_template.py`` with ``torch.save`` and read with ``torch.load(weights_only=True)``:

- ``format``: ``"infoguided-landmarks-template/1"``;
- ``landmark_names``: the L landmark names;
- ``queries``: ``(K, L, S, C)`` float32, for each of K templates, each landmark and each of the network's S
  scales (coarse to fine), the unit feature vector at that landmark; NaN where a template lacks the landmark;
- ``strides``: the S output strides of the network that computed them; ``spatial_dims``; ``grid_size``:
  the network grid the template images were resized to;
- ``sources``: K short descriptions of the template images (no pixel data); ``checkpoint_sha256``: the
  SHA-256 of the weights that computed the features (they only fit those weights).

:class:`TemplateFeatureInferer` is the Python inference path (sub-pixel refinement, predictions of the K
templates combined per landmark by :func:`bundle.kshot.combine_landmarks`);
:class:`bundle.networks.landmark_points.LandmarkPointsNet` is the TorchScript-scriptable network of the model
zoo (image -> landmark positions on the input grid, integer grid peaks combined by the geometric median),
which loads the bundle's ``model.pt`` unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.io_utils import atomic_path
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.inferers import Inferer
from monai.transforms import MapTransform

TEMPLATE_FORMAT = "infoguided-landmarks-template/1"
BUNDLE_DIR = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- template feature files


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    valid = ~torch.isnan(queries).any(dim=-1).any(dim=-1)
    if not bool(valid.any()):
        raise ValueError(f"{where}: no template carries any landmark")
    return {**dict(template), "landmark_names": names, "queries": queries.float()}


def bundle_path(path: str | os.PathLike) -> Path:
    """``path``; a relative path missing from the working directory is taken in the bundle's own folder (the
    configs' ``bundle_root: .`` then also works for tools that build the network from elsewhere, e.g.
    ``monai.bundle.load``)."""
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
        raise FileNotFoundError(f"template feature file not found: {path} (build one with scripts/build_template.py)")
    template = check_template(torch.load(path, map_location="cpu", weights_only=True), str(path))
    expected = template.get("checkpoint_sha256")
    if checkpoint is not None and expected and Path(checkpoint).is_file() and file_sha256(checkpoint) != expected:
        raise ValueError(
            f"{path} holds template features computed with other weights than {checkpoint}: the matches would be "
            "wrong; give the templates' images instead (--datalist) or rebuild the features for these weights with "
            "scripts/build_template.py"
        )
    return template


def save_template(path: str | os.PathLike, template: Mapping[str, Any]) -> Path:
    """Write a template feature dict atomically (checked first)."""
    template = check_template(template, str(path))
    with atomic_path(path) as tmp:
        torch.save(template, tmp)
        tmp.chmod(0o644)
    return Path(path)


@torch.no_grad()
def compute_template(
    network: torch.nn.Module,
    items: Sequence[Mapping[str, Any]],
    preprocessing,
    landmark_names: Sequence[str],
    device: torch.device | str = "cpu",
    checkpoint: str | os.PathLike | None = None,
) -> dict:
    """The template feature dict of annotated ``items`` (``image``, ``landmarks``; datalist convention).

    ``preprocessing`` is the inference pipeline (it must end with ``LandmarkTargetsd``, as the configs'
    do), so the features are those the inference sees; ``network`` gives multi-scale features (eval mode
    is set here). A landmark an item lacks is NaN in ``queries``.
    """
    from bundle.oneshot import feature_vectors
    from bundle.templates import prepare_template

    if not items:
        raise ValueError("compute_template needs at least one annotated item")
    network.eval()
    per_template, grid_size = [], None
    for item in items:
        image, points = prepare_template(dict(item), preprocessing)
        if points.shape[0] != len(landmark_names):
            raise ValueError(f"template {item['image']}: {points.shape[0]} landmarks for {len(landmark_names)} names")
        grid_size = tuple(int(s) for s in image.shape[2:])
        features = list(network(image.to(device)))
        valid = ~torch.isnan(points).any(dim=-1)
        queries = torch.full((len(landmark_names), len(features), features[0].shape[1]), float("nan"))
        if bool(valid.any()):
            vectors = feature_vectors(features, points[valid].to(device)[None], grid_size)
            queries[valid] = torch.stack([v[0].float().cpu() for v in vectors], dim=1)
        per_template.append(queries)
    strides = [int(s) for s in getattr(network, "strides", [])] or [grid_size[0] // f.shape[2] for f in features]
    return check_template(
        {
            "format": TEMPLATE_FORMAT,
            "landmark_names": [str(n) for n in landmark_names],
            "queries": torch.stack(per_template),
            "strides": strides,
            "spatial_dims": len(grid_size),
            "grid_size": list(grid_size),
            "sources": [Path(str(it["image"])).name for it in items],
            "checkpoint_sha256": file_sha256(checkpoint) if checkpoint is not None else "",
        }
    )


def template_source_names(
    template_path: str | os.PathLike, template_datalist: str | os.PathLike | None = None
) -> list[str]:
    """The landmark names of the template source: ``template_datalist`` when given, else the feature file."""
    if template_datalist:
        from bundle.data.embedded import open_datalist

        return list(open_datalist(template_datalist)["landmark_names"])
    return load_template(template_path)["landmark_names"]


def resolve_template(
    template_path: str | os.PathLike,
    template_datalist: str | os.PathLike | None,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str = "cpu",
    checkpoint: str | os.PathLike | None = None,
    rule: str = "landmarks",
) -> dict:
    """The template features of inference: from ``template_datalist`` when given (its ``templates`` /
    ``template`` items, else one chosen among its labelled training items by ``rule``, computed now with
    ``network`` after loading ``checkpoint`` into it), else read from the feature file ``template_path``
    (``network`` is then not used, so that building the export network needs no weights)."""
    from bundle.templates import check_rule, resolve_templates

    check_rule(rule)
    if not template_datalist:
        return load_template(template_path, checkpoint)
    from bundle.checkpoints import load_weights
    from bundle.data.embedded import open_datalist

    datalist = open_datalist(template_datalist)
    if checkpoint is not None:
        network = load_weights(network, bundle_path(checkpoint), device)
    network.eval()
    items = resolve_templates(datalist, network, preprocessing, device, rule=rule)
    logger.info("template(s) from %s: %s", template_datalist, [it["image"] for it in items])
    return compute_template(network, items, preprocessing, datalist["landmark_names"], device, checkpoint)


# --------------------------------------------------------------------------- inference on new images


def image_items(images: str | Sequence[str] | None, dataset_dir: str | os.PathLike) -> list[dict]:
    """Datalist-style items ``{"image": path}`` of ``images`` (a path or a list of paths), or, when None or
    empty, of every image file directly in ``dataset_dir`` (sorted; none when it does not exist, so that the
    config builds without data: :func:`require_items` then fails at run time)."""
    if isinstance(images, (str, os.PathLike)):
        images = [images]
    if images:
        paths = [Path(os.path.expanduser(str(p))) for p in images]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"images not found: {missing}")
        return [{"image": str(p)} for p in paths]
    folder = Path(dataset_dir)
    if not folder.is_dir():
        return []
    return [
        {"image": str(p)} for p in sorted(folder.iterdir()) if p.is_file() and p.name.lower().endswith(IMAGE_SUFFIXES)
    ]


def require_items(items: Sequence[Any], dataset_dir: str | os.PathLike) -> None:
    """Raise FileNotFoundError (naming ``dataset_dir``) when there is no image to run on."""
    if len(items) == 0:
        raise FileNotFoundError(
            f"nothing to run on: no --images given and dataset_dir {dataset_dir} holds no image file "
            f"({', '.join(IMAGE_SUFFIXES)}); pass --images \"['a.png', ...]\" or --dataset_dir FOLDER"
        )


class TemplateFeatureInferer(Inferer):
    """One-shot (k-shot) inference from stored template features (see the module doc).

    For each template, each landmark it carries is found by :meth:`bundle.oneshot.OneShotInferer.match`
    (multi-scale cosine similarity, sub-pixel refinement within ``refine_radius`` grid pixels); the K
    templates' predictions are combined per landmark by ``template_combine``
    (:func:`bundle.kshot.combine_landmarks`), in physical mm when ``grid_to_physical`` is given. With the
    features of a template image this gives what ``OneShotInferer`` gives with that image.

    Args:
        template: a template feature dict (:func:`load_template`).
        template_combine: ``geometric_median`` | ``median`` | ``mean``.
        refine_radius, refine_resolution, combine, scale_weights: as for ``OneShotInferer``.
    """

    def __init__(
        self,
        template: Mapping[str, Any],
        template_combine: str = "geometric_median",
        refine_radius: float = 1.0,
        refine_resolution: float = 0.1,
        combine: str = "product",
        scale_weights: Sequence[float] | None = None,
    ) -> None:
        from bundle.kshot import COMBINE_RULES
        from bundle.oneshot import OneShotInferer

        super().__init__()
        if template_combine not in COMBINE_RULES:
            raise ValueError(f"template_combine must be one of {COMBINE_RULES}, got {template_combine!r}")
        self.template = check_template(template)
        self.landmark_names = self.template["landmark_names"]
        self.template_combine = template_combine
        self.matcher = OneShotInferer(
            combine=combine,
            scale_weights=scale_weights,
            refine_radius=refine_radius,
            refine_resolution=refine_resolution,
        )

    @torch.no_grad()
    def predict_per_template(self, inputs: torch.Tensor, network) -> torch.Tensor:
        """Each template's predictions ``(K, B, L, D)`` on the grid (float64, NaN where a template lacks a landmark)."""
        inputs = inputs.as_tensor() if isinstance(inputs, MetaTensor) else inputs
        grid_size = tuple(int(s) for s in inputs.shape[2:])
        queries = self.template["queries"].to(inputs.device)
        k, n_landmarks, n_scales, _ = queries.shape
        if len(grid_size) != int(self.template["spatial_dims"]):
            raise ValueError(f"the template is {self.template['spatial_dims']}D, the input grid {grid_size}")
        features = list(network(inputs))
        if len(features) != n_scales:
            raise ValueError(f"the template has features of {n_scales} scales, the network gives {len(features)}")
        b = inputs.shape[0]
        norms = self.matcher.feature_norms(features, grid_size)
        out = torch.full((k, b, n_landmarks, len(grid_size)), float("nan"), dtype=torch.float64, device=inputs.device)
        for t in range(k):
            valid = ~torch.isnan(queries[t]).any(dim=-1).any(dim=-1)
            if not bool(valid.any()):
                continue
            per_scale = [queries[t, valid, s][None].expand(b, -1, -1) for s in range(n_scales)]
            out[t][:, valid] = self.matcher.match(per_scale, features, grid_size, norms)[0]
        return out

    def __call__(self, inputs: torch.Tensor, network, grid_to_physical=None) -> torch.Tensor:  # type: ignore[override]
        """Predicted landmarks ``(B, L, D)`` (float64): grid pixels, or physical mm with ``grid_to_physical``."""
        from bundle.kshot import combine_landmarks
        from bundle.oneshot import apply_homogeneous

        per_template = self.predict_per_template(inputs, network)
        if grid_to_physical is not None:
            per_template = apply_homogeneous(grid_to_physical, per_template)
        return combine_landmarks(per_template, self.template_combine)


class LandmarkPointsd(MapTransform):
    """Post-processing: ``points`` = the predictions ``pred`` (physical mm) in the datalist convention
    (2D: original-image pixels ``[x, y]``; 3D: world mm), from the item's ``spacing``."""

    def __init__(self, keys: KeysCollection = "pred", spacing_key: str = "spacing", output_key: str = "points") -> None:
        super().__init__(keys)
        self.spacing_key = spacing_key
        self.output_key = output_key

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        from bundle.transforms.landmarks import physical_to_datalist

        d = dict(data)
        key = self.first_key(d)
        pred = torch.as_tensor(d[key]).detach().cpu().double().numpy()
        spacing = torch.as_tensor(d[self.spacing_key]).detach().cpu().double().numpy()
        d[self.output_key] = torch.as_tensor(np.asarray(physical_to_datalist(pred, spacing)), dtype=torch.float64)
        return d
