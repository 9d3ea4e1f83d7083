"""Estimate the per-group augmentation of the paper (Sec. 3, step 2, "Approximating minimal necessary MI")
from a datalist.

    python -m scripts.estimate_augmentation --datalist D --output augmentation.yaml \
        [--alpha_hat 0.8 --window 10 --thresholds "[2,4]" --n_images 10 --patch_size 64 \
         --image_size 384 --correspondences landmarks|encoder --ckpt_path models/model.pt --seed 0]

The paper's estimator: a patch's feature is its 256-level grey-value
histogram G(v) (64x64 patches on images resized to 384x384 by default); the mutual information (MI, nats)
is that of the two 256-long count vectors taken as paired discrete samples
(:func:`bundle.information.distribution_mutual_information`). Per information group the target is
``alpha_hat`` times the mean MI of corresponding patches of different images, and darker and brighter
ColorJitter factors are searched separately: the output holds asymmetric ranges
``brightness_ranges`` / ``contrast_ranges`` ``[[lo, hi]] * 3`` (low, medium, high IIE)
(:func:`bundle.information.estimate_group_ranges`).

The bundle's earlier estimator (the MI of aligned pixels, symmetric intensities) is an experiment now:
``scripts.experiments.joint_mi``.

The template (the datalist's ``template``, else the first training item with landmarks) and ``n_images``
other training/validation items (drawn with ``seed``) are loaded with MONAI ``LoadImage`` as grey images
scaled to [0, 1]. Candidate key points are the template's landmarks plus a grid of offsets (``radius``,
``stride``, in original pixels/voxels); their group is the template's IIE
(:func:`bundle.transforms.entropy.local_entropy` at original resolution) at the point.
Correspondences in the other images (``--correspondences``):

* ``landmarks``: the other images' annotated landmarks plus the same offsets, a rigid translation near
  each landmark (:func:`bundle.information.offset_correspondences`); the other images must be labelled.
* ``encoder``: the template's key points matched one-shot into each other image by a trained stage-1
  network (``--ckpt_path``, the network of ``--config_file``, default ``configs/train.yaml``) with the
  bundle's :class:`bundle.inferers.oneshot.OneShotInferer` on the network grid; the other images need no labels.

Patches are cut on the working grid (``image_size`` or the original size). The result is written
atomically as YAML that a bundle config merges (``augmentation: {thresholds, ...}``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch
import yaml
from bundle.data.datalist import landmarks_array, load_datalist
from bundle.data.images import load_grey
from bundle.information import estimate_group_ranges, offset_correspondences
from bundle.information_groups import GROUP_NAMES, check_thresholds
from bundle.io_utils import check_output_file, write_text_atomic
from bundle.settings import as_number
from bundle.transforms.entropy import local_entropy
from monai.transforms import Resize
from scripts.cli import run_fire

CORRESPONDENCE_SOURCES = ("landmarks", "encoder")


def landmarks_to_array_axes(landmarks: np.ndarray, affine: np.ndarray, spatial_dims: int) -> np.ndarray:
    """Datalist landmarks in array axis order: 2D ``[x, y]`` pixels index ``img[x, y]`` as they are;
    3D world RAS millimetres go through the inverse of the image's (RAS) affine (the header's, not a
    datalist ``spacing`` override)."""
    if spatial_dims == 2:
        return landmarks
    homogeneous = np.concatenate([landmarks, np.ones((len(landmarks), 1))], axis=1)
    return (np.linalg.inv(affine) @ homogeneous.T).T[:, :3]


def entropy_at_points(image: np.ndarray, points: np.ndarray, window: int) -> np.ndarray:
    """IIE (bits) of ``image`` at the rounded ``points`` (NaN outside the image).

    Each value is ``local_entropy`` of the window around the point alone, equal to the full-image IIE
    map at that pixel (the map's window is cut at the border in the same way and the grey range is
    fixed to [0, 1]), without computing the map for millions of pixels that are not used.
    """
    out = np.full(len(points), np.nan)
    shape = np.asarray(image.shape)
    for i, p in enumerate(points):
        if not np.isfinite(p).all():
            continue
        q = np.round(p).astype(np.int64)
        if (q < 0).any() or (q >= shape).any():
            continue
        start = np.maximum(q - window // 2, 0)
        stop = np.minimum(q + window - window // 2, shape)
        crop = image[tuple(slice(a, b) for a, b in zip(start, stop))]
        out[i] = float(local_entropy(crop, window=window, intensity_range=(0.0, 1.0))[tuple(q - start)])
    return out


def _to_working_grid(image: np.ndarray, points: np.ndarray, image_size) -> tuple[np.ndarray, np.ndarray]:
    """Resize to ``image_size`` (None: keep) and map points with the pixel-centre convention."""
    if image_size is None:
        return image, points
    size = [int(s) for s in (image_size if isinstance(image_size, (list, tuple)) else [image_size] * image.ndim)]
    if len(size) != image.ndim:
        raise ValueError(f"image_size must have {image.ndim} entries (array axis order), got {image_size!r}")
    resized = Resize(size, mode="bilinear", anti_aliasing=True)(torch.from_numpy(image)[None])[0].numpy()
    scale = np.asarray(size, dtype=np.float64) / np.asarray(image.shape, dtype=np.float64)
    return resized.astype(np.float64), (points + 0.5) * scale - 0.5


def _pick_items(datalist: dict, n_images: int, seed: int, need_labels: bool = True) -> tuple[dict, list[dict]]:
    labelled = [it for sec in ("training", "validation") for it in datalist[sec] if it.get("landmarks")]
    template = datalist.get("template") or (labelled[0] if labelled else None)
    if template is None:
        raise ValueError("the datalist has no 'template' and no training/validation item with 'landmarks'")
    candidates = labelled if need_labels else [it for sec in ("training", "validation") for it in datalist[sec]]
    pool, seen = [], {template["image"]}
    for it in candidates:
        if it["image"] not in seen:
            pool.append(it)
            seen.add(it["image"])
    if not pool:
        kind = "labelled " if need_labels else ""
        raise ValueError(f"the datalist has no {kind}training/validation item besides the template")
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(pool), size=min(int(n_images), len(pool)), replace=False))
    return template, [pool[i] for i in chosen]


def _network_grid(image: np.ndarray, grid_size: list[int]) -> torch.Tensor:
    """The image on the network grid ``(1, 1, *grid)`` as the evaluation pipeline makes it (``Resized``, area)."""
    resized = Resize(grid_size, mode="area")(torch.from_numpy(image).float()[None])
    return torch.as_tensor(resized).as_subclass(torch.Tensor)[None].float()


def encoder_correspondences(
    template: np.ndarray,
    template_points: np.ndarray,
    others: list[np.ndarray],
    ckpt_path: str,
    config_file="configs/train.yaml",
    device: str = "cpu",
) -> np.ndarray:
    """Correspondences ``(len(others), K, D)`` (original pixels/voxels, array axes) of the template's points,
    found by one-shot matching with a trained stage-1 network (:class:`bundle.inferers.oneshot.OneShotInferer`).

    Images go to the network grid of ``config_file``'s ``image_size`` (area resampling, as in evaluation);
    points map with the pixel-centre convention both ways. NaN template points stay NaN.
    """
    from bundle.checkpoints import load_weights
    from bundle.configs import bundle_parser
    from bundle.inferers.oneshot import OneShotInferer
    from bundle.settings import check_image_size

    parser = bundle_parser(config_file, device=f"$torch.device('{device}')")
    dims = template.ndim
    grid = check_image_size(parser.get_parsed_content("image_size"), dims)
    network = load_weights(parser.get_parsed_content("network_def"), ckpt_path, device).eval()
    grid_arr = np.asarray(grid, dtype=np.float64)

    def to_grid(points, shape):
        return (points + 0.5) * grid_arr / np.asarray(shape, dtype=np.float64) - 0.5

    def from_grid(points, shape):
        return (points + 0.5) * np.asarray(shape, dtype=np.float64) / grid_arr - 0.5

    points = np.asarray(template_points, dtype=np.float64)
    inferer = OneShotInferer()
    inferer.set_template(
        _network_grid(template, grid).to(device), torch.as_tensor(to_grid(points, template.shape), dtype=torch.float32)
    )
    out = []
    with torch.no_grad():
        for image in others:
            found = inferer.predict_per_template(_network_grid(image, grid).to(device), network)[0][0, 0].cpu().numpy()
            out.append(from_grid(found, image.shape))
    return np.stack(out)


def estimation_inputs(
    datalist: str,
    output: str,
    alpha_hat: float,
    patch_size: int,
    bins: int,
    step: float,
    window: int = 10,
    thresholds=(2.0, 4.0),
    n_images: int = 10,
    image_size=None,
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    radius: int = 16,
    stride: int = 8,
    correspondences: str = "landmarks",
    ckpt_path: str | None = None,
    config_file="configs/train.yaml",
    device: str = "cpu",
    seed: int = 0,
) -> tuple[tuple, dict, dict]:
    """What an estimator of the per-group intensities reads (the options checked and ``output``'s name refused
    before any image is read): ``(inputs, common, source)``. ``inputs``: the template and the other images on the
    working grid (``image_size``, None: original size), the template's key points, their correspondences and IIE;
    ``common``: the estimator's shared keyword arguments (thresholds, key points, patch size, ``alpha_hat``, ``step``,
    ``bins``, ``seed``); ``source``: what the estimate was made from, for the output.

    Args:
        datalist: the datalist (the template: its ``template``, else the first labelled item).
        output: the YAML file the estimate goes to (checked here).
        alpha_hat: the target's share of the MI of corresponding patches.
        patch_size: the patches' side on the working grid.
        bins: the MI's histogram bins.
        step: the search step of the factors.
        window: the IIE window (original pixels).
        thresholds: the IIE group thresholds.
        n_images: how many other images.
        image_size: the working grid, None: each image's own size.
        n_keypoints: at most this many key points per group.
        min_keypoints: fewer usable key points give a group no estimate.
        radius: the offsets around each landmark (original pixels).
        stride: their step.
        correspondences: ``"landmarks"`` or ``"encoder"``.
        ckpt_path: the stage-1 checkpoint of encoder correspondences.
        config_file: its network's config.
        device: where the encoder runs.
        seed: the draw of the images and key points.
    """
    if correspondences not in CORRESPONDENCE_SOURCES:
        raise ValueError(
            f"correspondences={correspondences!r} is not available; choose one of {CORRESPONDENCE_SOURCES}"
        )
    if correspondences == "encoder" and not ckpt_path:
        raise ValueError("correspondences='encoder' needs --ckpt_path (a trained stage-1 checkpoint)")
    as_number(alpha_hat, "alpha_hat", minimum=1e-6, maximum=1)  # a share of the MI of different images
    check_output_file(output)  # before the images are read
    window, n_images = (
        as_number(window, "window", minimum=1, integer=True),
        as_number(n_images, "n_images", minimum=1, integer=True),
    )
    # a patch of fewer than 8 x 8 pixels has too few grey values for a histogram's MI (3 x 3 gave contrast 0)
    patch_size = as_number(patch_size, "patch_size", minimum=8, integer=True)
    thresholds = check_thresholds(thresholds)
    dl = load_datalist(datalist)
    dims, n_lm = dl["spatial_dims"], len(dl["landmark_names"])
    if isinstance(image_size, (int, float)):
        image_size = [int(image_size)] * dims
    template, others = _pick_items(dl, n_images, seed, need_labels=correspondences == "landmarks")

    t_img, t_affine = load_grey(template["image"], dims)
    t_lm = landmarks_to_array_axes(landmarks_array(template, n_lm, dims), t_affine, dims)
    other_imgs, other_lms = [], []
    for item in others:
        img, affine = load_grey(item["image"], dims)
        other_imgs.append(img)
        if correspondences == "landmarks":
            other_lms.append(landmarks_to_array_axes(landmarks_array(item, n_lm, dims), affine, dims))
        else:
            other_lms.append(np.full((n_lm, dims), np.nan))
    t_points, corr, _ = offset_correspondences(t_lm, np.stack(other_lms), radius, stride)
    if correspondences == "encoder":
        corr = encoder_correspondences(t_img, t_points, other_imgs, ckpt_path, config_file, device)
    point_entropy = entropy_at_points(t_img, t_points, window)

    t_work, t_points_work = _to_working_grid(t_img, t_points, image_size)
    work = [_to_working_grid(img, c, image_size) for img, c in zip(other_imgs, corr)]
    common = dict(
        thresholds=thresholds,
        n_keypoints=n_keypoints,
        min_keypoints=min_keypoints,
        patch_size=patch_size,
        alpha_hat=alpha_hat,
        step=float(step),
        bins=int(bins),
        seed=seed,
    )
    inputs = (t_work, [w[0] for w in work], t_points_work, np.stack([w[1] for w in work]), point_entropy)
    source = {
        "datalist": str(Path(datalist).resolve()),
        "template": template["image"],
        "images": [it["image"] for it in others],
        "n_images": len(others),
        "correspondences": correspondences,
        "window": int(window),
        "patch_size": int(patch_size),
        "image_size": None if image_size is None else list(np.atleast_1d(image_size).astype(int).tolist()),
        "radius": int(radius),
        "stride": int(stride),
        "n_keypoints": int(n_keypoints),
        "bins": int(bins),
        "step": float(step),
        "seed": int(seed),
    }
    if correspondences == "encoder":
        source.update(ckpt_path=str(Path(ckpt_path).resolve()), config_file=config_file)
    return inputs, common, source


def input_options(options: dict) -> dict:
    """The arguments of :func:`estimation_inputs` among an estimator command's ``options`` (its ``locals()``)."""
    names = inspect.signature(estimation_inputs).parameters
    return {k: v for k, v in options.items() if k in names}


def write_estimate(
    output: str, groups: dict, source: dict, alpha_hat: float, thresholds, mi: str, keys: tuple[str, str]
) -> dict:
    """Write the estimate ``groups`` atomically to ``output`` as the YAML a bundle config merges
    (``augmentation: {thresholds, <keys>, alpha_hat, mi, source, groups}``; a group without an estimate takes its
    neighbour's, :func:`_fill_missing_groups`, and is warned about) and return it.

    Args:
        output: the YAML file.
        groups: the estimator's result per group.
        source: what it was made from (:func:`estimation_inputs`).
        alpha_hat: the target's share.
        thresholds: the IIE group thresholds.
        mi: the estimator's name.
        keys: the config keys of the brightness and the contrast values.
    """

    def clean(v):
        if isinstance(v, list):
            return [clean(x) for x in v]
        return round(v, 4) if isinstance(v, float) else v

    augmentation: dict = {"thresholds": list(thresholds)}
    filled = _fill_missing_groups(groups)
    for key, kind in zip(keys, ("brightness", "contrast")):
        augmentation[key] = [clean(filled[g][kind]) for g in GROUP_NAMES]
    augmentation.update(
        alpha_hat=float(alpha_hat),
        mi=mi,
        source=source,
        groups={g: {k: clean(v) for k, v in groups[g].items()} for g in GROUP_NAMES},
    )
    result = {"augmentation": augmentation}
    write_text_atomic(output, yaml.safe_dump(result, sort_keys=False))
    for g in GROUP_NAMES:
        if "note" in groups[g]:
            filled_from = groups[g].get("filled_from")
            print(
                f"  warning ({g}): {groups[g]['note']}"
                + (f"; uses the {filled_from} group's values" if filled_from else "")
            )
    return result


def estimate(
    datalist: str,
    output: str = "augmentation.yaml",
    alpha_hat: float = 0.8,
    window: int = 10,
    thresholds=(2.0, 4.0),
    n_images: int = 10,
    patch_size: int = 64,
    image_size=384,
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    radius: int = 16,
    stride: int = 8,
    bins: int = 256,
    step: float = 0.01,
    min_factor: float = 0.0,
    max_factor: float = 3.0,
    correspondences: str = "landmarks",
    ckpt_path: str | None = None,
    config_file="configs/train.yaml",
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Estimate the per-group ColorJitter factor ranges by the paper's estimator
    (:func:`bundle.information.estimate_group_ranges`, searched by ``step`` within ``[min_factor, max_factor]``),
    write ``output`` (YAML) and print a table. ``image_size``: the working grid (one size for every axis, or one per
    axis; None: original size). ``correspondences``: ``"landmarks"`` or ``"encoder"`` (with ``ckpt_path`` and the
    network of ``config_file``); the other options: :func:`estimation_inputs`.
    """
    inputs, common, source = estimation_inputs(**input_options(locals()))
    groups = estimate_group_ranges(*inputs, min_factor=min_factor, max_factor=max_factor, **common)
    source.update(min_factor=float(min_factor), max_factor=float(max_factor))
    keys = ("brightness_ranges", "contrast_ranges")
    result = write_estimate(output, groups, source, alpha_hat, common["thresholds"], "distribution", keys)
    _print_table(groups)
    print(f"wrote {output}")
    return result


def _fill_missing_groups(groups: dict) -> dict:
    """A group without an estimate (too few key points) takes the ranges of the nearest group that has one
    (medium first), recorded in its ``filled_from``, so that the YAML stays usable for training."""
    filled = {g: dict(e) for g, e in groups.items()}
    order = {"low": ("medium", "high"), "medium": ("high", "low"), "high": ("medium", "low")}
    for g in GROUP_NAMES:
        if groups[g].get("brightness") is not None:
            continue
        donor = next((d for d in order[g] if groups[d].get("brightness") is not None), None)
        if donor is None:
            raise ValueError(
                "no information group has enough key points for an estimate; add images, landmarks or a larger radius"
            )
        for kind in ("brightness", "contrast"):
            filled[g][kind] = groups[donor][kind]
        groups[g]["filled_from"] = donor
    return filled


def _print_table(groups: dict) -> None:
    print(f"{'group':<8}{'key pts':>8}{'target MI':>11}{'brightness [lo, hi]':>22}{'contrast [lo, hi]':>20}")
    for g in GROUP_NAMES:
        e = groups[g]

        def fmt(kind: str) -> str:
            if e.get(kind) is None:
                return "n/a"
            lo_flag, hi_flag = ("<=" if f else "" for f in e[f"{kind}_at_limit"])
            return f"[{lo_flag}{e[kind][0]:.3f}, {'>=' if hi_flag else ''}{e[kind][1]:.3f}]"

        target = f"{e['target_mi']:.3f}" if "target_mi" in e else "n/a"
        print(f"{g:<8}{e['n_keypoints']:>8}{target:>11}{fmt('brightness'):>22}{fmt('contrast'):>20}")


if __name__ == "__main__":
    run_fire(estimate, serialize=lambda result: None)
