"""The template features of the ``inferring`` command: read from a template feature file
(:mod:`bundle.template_file`), or computed from a datalist's template images (and kept in a cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from bundle import __version__
from bundle.checkpoints import load_weights
from bundle.data.embedded import open_datalist
from bundle.distributed import from_rank_0, rank
from bundle.geometry import plain_tensor
from bundle.io_utils import cache_root, not_private, private_folder
from bundle.networks.matching import feature_vectors
from bundle.passes import map_shards
from bundle.settings import as_flag, is_unset
from bundle.template_file import TEMPLATE_FORMAT, bundle_path, check_template, file_sha256, load_template, save_template
from bundle.templates.resolution import check_rule, prepare_template, resolve_templates

logger = logging.getLogger(__name__)


@torch.no_grad()
def compute_template(
    network: torch.nn.Module,
    items: Sequence[Mapping[str, Any]],
    preprocessing,
    landmark_names: Sequence[str],
    device: torch.device | str = "cpu",
    checkpoint: str | os.PathLike | None = None,
    registration_image: bool = False,
) -> dict:
    """The template feature dict of annotated ``items`` (``image``, ``landmarks``; datalist convention).

    ``preprocessing`` is the inference pipeline (it must end with ``LandmarkTargetsd``, as the configs'
    do), so the features are those the inference sees; ``network`` gives multi-scale features (eval mode
    is set here). A landmark an item lacks is NaN in ``queries``. ``pseudo_sources`` names the items marked
    ``pseudo_label`` (pseudo-templates). With ``registration_image``, the dict also carries the first item's grid
    image and landmarks, which the matching guard registers (:mod:`bundle.template_file`; pixel data: not for a file
    to share).
    """
    if not items:
        raise ValueError("compute_template needs at least one annotated item")
    network.eval()

    def template_queries(item: Mapping[str, Any]) -> tuple[torch.Tensor, tuple[int, ...], list[int], dict]:
        """The item's queries ``(L, scales, C)``, its grid, the strides of its feature maps and, for the first item
        with ``registration_image``, its grid image and landmarks."""
        image, points = prepare_template(dict(item), preprocessing)
        if points.shape[0] != len(landmark_names):
            raise ValueError(f"template {item['image']}: {points.shape[0]} landmarks for {len(landmark_names)} names")
        guard = {}
        if registration_image and item is items[0]:
            guard = {
                "registration_image": plain_tensor(image).float().cpu(),
                "registration_points": plain_tensor(points).float().cpu(),
            }
        grid_size = tuple(int(s) for s in image.shape[2:])
        features = [plain_tensor(f) for f in network(image.to(device))]
        valid = ~torch.isnan(points).any(dim=-1)
        queries = torch.full((len(landmark_names), len(features), features[0].shape[1]), float("nan"))
        if bool(valid.any()):
            vectors = feature_vectors(features, points[valid].to(device)[None], list(grid_size))
            queries[valid] = torch.stack([v[0].float().cpu() for v in vectors], dim=1)
        return queries, grid_size, [grid_size[0] // f.shape[2] for f in features], guard

    # each process its share of the templates under torchrun (bundle.passes.map_shards)
    per_template, grids, feature_strides, guards = zip(*map_shards(template_queries, items, "template features"))
    grid_size = grids[-1]
    strides = [int(s) for s in getattr(network, "strides", [])] or feature_strides[-1]
    return check_template(
        {
            "format": TEMPLATE_FORMAT,
            "landmark_names": [str(n) for n in landmark_names],
            "queries": torch.stack(per_template),
            "strides": strides,
            "spatial_dims": len(grid_size),
            "grid_size": list(grid_size),
            "sources": [Path(str(it["image"])).name for it in items],
            "pseudo_sources": [Path(str(it["image"])).name for it in items if it.get("pseudo_label")],
            "checkpoint_sha256": file_sha256(checkpoint) if checkpoint is not None else "",
            **guards[0],
        }
    )


def template_source_names(
    template_path: str | os.PathLike,
    template_datalist: str | os.PathLike | None = None,
    spatial_dims: int | None = None,
) -> list[str]:
    """The landmark names of the template source: ``template_datalist`` when given (refused when its spatial
    dimensions are not ``spatial_dims``), else the feature file.

    Args:
        template_path: the template feature file.
        template_datalist: a datalist the templates come from, None: the feature file's.
        spatial_dims: 2 or 3, the datalist's checked (None: not checked).
    """
    if template_datalist:
        return list(open_datalist(template_datalist, spatial_dims)["landmark_names"])
    return load_template(template_path)["landmark_names"]


def default_template_cache() -> Path:
    """Where the ``inferring`` command keeps computed template features: ``templates`` in
    :func:`bundle.io_utils.cache_root`."""
    return cache_root() / "templates"


def template_cache_dir(value: str | os.PathLike | bool | None) -> Path | None:
    """The ``template_cache`` folder: a path, or a yes/no word of :func:`bundle.settings.as_flag` (yes: the default
    folder, no: no cache); None too, and what a command line gives for it (:func:`bundle.settings.is_unset`)."""
    if is_unset(value):
        return None
    flag = as_flag(value, "template_cache", path=True)
    if isinstance(flag, bool):
        return default_template_cache() if flag else None
    return Path(flag)


def _trusted_cache(cache_dir: str | os.PathLike) -> Path | None:
    """``cache_dir`` made where missing (mode 0700) and checked as the kernel cache is
    (:func:`bundle.io_utils.private_folder`; the default folder from ``infoguided-landmarks`` down, and the folders
    above): None, with a warning naming the folder and why, when it is a link, another user's or writable by others
    (features planted there under a predictable key would make every match wrong)."""
    try:
        if Path(cache_dir) == default_template_cache():
            return private_folder(cache_root(), default_template_cache().name)
        return private_folder(cache_dir)
    except PermissionError as e:
        logger.warning("template cache %s not used: %s", cache_dir, e)
    except OSError as e:  # a read-only or full cache does not stop inference
        logger.warning("template cache %s not made (%s)", cache_dir, e)
    return None


def template_cache_key(
    datalist_path: str | os.PathLike,
    datalist: dict,
    checkpoint: str | os.PathLike,
    image_size,
    strides: Sequence[int] | None = None,
    choice: Mapping[str, Any] | None = None,
) -> str:
    """SHA-256 of what a datalist's template features depend on: the datalist's bytes, the identity (path, size,
    modification time) of every image it names as a template or training item, the weights' bytes, the template
    ``choice`` (the keyword arguments of :func:`bundle.templates.resolution.resolve_templates`: rule, count,
    pseudo-templates), the network grid and ``strides``, the file format and the bundle's version (its code:
    preprocessing and feature sampling). Not in it: a preprocessing pipeline changed by a merged config (clear the
    cache, or set ``template_cache`` null)."""
    images = [
        str(it["image"])
        for key in ("template", "templates", "training")
        for it in ([datalist[key]] if isinstance(datalist.get(key), dict) else datalist.get(key) or [])
    ]
    stats = []
    for image in sorted(set(images)):
        st = os.stat(image) if os.path.exists(image) else None
        stats.append([image, st.st_size if st else None, st.st_mtime_ns if st else None])
    content = {
        "format": TEMPLATE_FORMAT,
        "datalist": file_sha256(datalist_path),
        "images": stats,
        "checkpoint": file_sha256(checkpoint),
        "choice": {k: choice[k] for k in sorted(choice or {})},
        "image_size": [int(v) for v in image_size] if image_size is not None else None,
        "strides": [int(v) for v in strides] if strides is not None else None,
        "version": __version__,
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _cache_lookup(
    cache_dir: Path | None,
    template_datalist: str | os.PathLike,
    datalist: dict,
    checkpoint: Path | None,
    image_size,
    network: torch.nn.Module,
    choice: Mapping[str, Any],
) -> tuple[Path | None, dict | None]:
    """``(the cache file of these templates, its features)`` for :func:`resolve_template_features`: the file None
    without a usable cache (no folder, no checkpoint, or untrusted), the features None when the file is missing or
    unreadable (computed again and written there)."""
    if not cache_dir or checkpoint is None or not (cache_dir := _trusted_cache(cache_dir)):
        return None, None
    strides = getattr(network, "strides", None)
    key = template_cache_key(template_datalist, datalist, checkpoint, image_size, strides, choice)
    cached = cache_dir / f"{key}.pt"
    if reason := not_private(cached):
        logger.warning("template cache %s not used: %s", cache_dir, reason)
        return None, None
    if cached.is_file():
        try:
            template = load_template(cached, checkpoint)
        except Exception as e:  # a damaged or foreign cache file is computed again (torch.load raises many kinds)
            logger.warning("template cache %s unreadable (%s): computing the templates", cached, e)
        else:
            logger.info("template(s) of %s from the cache %s: %s", template_datalist, cached, template["sources"])
            return cached, template
    return cached, None


def resolve_template_features(
    template_path: str | os.PathLike,
    template_datalist: str | os.PathLike | None,
    network: torch.nn.Module,
    preprocessing,
    device: torch.device | str = "cpu",
    checkpoint: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    image_size=None,
    **choice,
) -> dict:
    """The template features of inference: from ``template_datalist`` when given (the templates that
    :func:`bundle.templates.resolution.resolve_templates` chooses with the keyword arguments ``choice``: the
    datalist's ``templates`` / ``template`` items, else its labelled training items ranked best by ``rule``, plus
    pseudo-templates when they are few), computed with ``network`` after loading ``checkpoint`` into it, else read
    from the feature file ``template_path`` (``network`` is then not used, so that building the export network needs
    no weights).

    A datalist's features carry the first template's grid image for the matching guard (:mod:`bundle.template_file`).
    With ``cache_dir`` (and a ``checkpoint``), they are kept there as a template feature file named
    by :func:`template_cache_key` (``image_size``: the network grid) and read back by later calls with the same
    datalist, images, weights, template choice, grid, network strides and bundle version instead of choosing and
    computing the templates again.

    Args:
        template_path: the template feature file (:mod:`bundle.template_file`).
        template_datalist: a datalist to choose the templates from, None: the feature file.
        network: the contrastive network that computes the features.
        preprocessing: the matching's preprocessing of an item.
        device: where the features are computed.
        checkpoint: the weights of ``network``; a feature file computed with others is refused.
        cache_dir: ``template_cache``: a folder, or a yes/no value (:func:`template_cache_dir`).
        image_size: the network grid, part of the cache key.
        **choice: the template choice of :func:`bundle.templates.resolution.resolve_templates` (``rule``,
            ``max_templates``, the pseudo-templates' settings, ...).

    Returns:
        the template features (:mod:`bundle.template_file`).
    """
    check_rule(choice.setdefault("rule", "landmarks"))
    if not template_datalist:
        return load_template(template_path, checkpoint)
    datalist = open_datalist(template_datalist)
    cache_dir = template_cache_dir(cache_dir)
    if checkpoint is not None:
        checkpoint = bundle_path(checkpoint)
    # under torchrun rank 0 alone looks in (and makes) the cache, and writes it below; every process follows what it
    # found: one finding the file when another did not would wait forever for the other in the passes over the images
    cached, template = from_rank_0(
        lambda: _cache_lookup(cache_dir, template_datalist, datalist, checkpoint, image_size, network, choice)
    )
    if template is not None:
        return template
    if checkpoint is not None:
        network = load_weights(network, checkpoint, device)
    network.eval()
    items = resolve_templates(datalist, network, preprocessing, device, **choice)
    pseudo = [it["image"] for it in items if it.get("pseudo_label")]
    logger.info(
        "template(s) from %s: %s (pseudo-templates: %s)", template_datalist, [it["image"] for it in items], pseudo
    )
    names = datalist["landmark_names"]
    template = compute_template(network, items, preprocessing, names, device, checkpoint, registration_image=True)
    if cached is not None and rank() == 0:
        try:
            save_template(cached, template)
        # a read-only or full cache does not stop inference; torch.save reports a failed write (a full disk) as
        # RuntimeError ("PytorchStreamWriter failed writing file")
        except (OSError, RuntimeError) as e:
            logger.warning("template cache %s not written (%s)", cached, e)
    return template
