"""Estimate the per-group augmentation intensities A_l, A_m, A_h of the paper (Sec. 3, step 2) from a datalist.

    python scripts/estimate_augmentation.py --datalist D --output augmentation.yaml \
        [--alpha_hat 0.8 --window 10 --thresholds "[2,4]" --n_images 10 --patch_size 32 --image_size None --seed 0]

The template (the datalist's ``template``, else the first training item with landmarks) and ``n_images``
other labelled training/validation items (drawn with ``seed``) are loaded with MONAI ``LoadImage`` as
grey images scaled to [0, 1]. Candidate key points are the template's landmarks plus a grid of offsets
(``radius``, ``stride``, in original pixels/voxels) that move rigidly with each landmark
(:func:`bundle.information.offset_correspondences`); their group is the template's IIE
(:func:`bundle.transforms.entropy.local_entropy` at original resolution) at the point. Patches are cut
on the working grid (``image_size`` or the original size). The result is written atomically as YAML
that a bundle config can merge (``augmentation: {thresholds, brightness, contrast, alpha_hat, ...}``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fire  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from monai.transforms import Resize  # noqa: E402

from bundle.data.datalist import load_datalist, landmarks_array  # noqa: E402
from bundle.data.images import load_grey  # noqa: E402
from bundle.information import GROUP_NAMES, check_thresholds, estimate_group_intensities, offset_correspondences  # noqa: E402
from bundle.io_utils import write_text_atomic  # noqa: E402
from bundle.transforms.entropy import local_entropy  # noqa: E402

CORRESPONDENCE_SOURCES = ("landmarks",)


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


def _pick_items(datalist: dict, n_images: int, seed: int) -> tuple[dict, list[dict]]:
    labelled = [it for sec in ("training", "validation") for it in datalist[sec] if it.get("landmarks")]
    template = datalist.get("template") or (labelled[0] if labelled else None)
    if template is None:
        raise ValueError("the datalist has no 'template' and no training/validation item with 'landmarks'")
    pool = [it for it in labelled if it["image"] != template["image"]]
    if not pool:
        raise ValueError("the datalist has no labelled training/validation item besides the template")
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(pool), size=min(int(n_images), len(pool)), replace=False))
    return template, [pool[i] for i in chosen]


def estimate(
    datalist: str,
    output: str = "augmentation.yaml",
    alpha_hat: float = 0.8,
    window: int = 10,
    thresholds=(2.0, 4.0),
    n_images: int = 10,
    patch_size: int = 32,
    image_size=None,
    n_keypoints: int = 20,
    min_keypoints: int = 3,
    radius: int = 16,
    stride: int = 8,
    bins: int = 32,
    step: float = 0.02,
    max_intensity: float = 1.0,
    correspondences: str = "landmarks",
    seed: int = 0,
) -> dict:
    """Estimate A_l, A_m, A_h (brightness, contrast), write ``output`` (YAML) and print a table.

    ``correspondences`` names where the other images' key points come from. Only ``"landmarks"`` (the
    annotated landmarks plus rigid offsets) exists; matching template points with a trained encoder's
    features is the planned second source and plugs in here.
    """
    if correspondences not in CORRESPONDENCE_SOURCES:
        raise ValueError(f"correspondences={correspondences!r} is not available; choose one of {CORRESPONDENCE_SOURCES}")
    thresholds = check_thresholds(thresholds)
    dl = load_datalist(datalist)
    dims, n_lm = dl["spatial_dims"], len(dl["landmark_names"])
    template, others = _pick_items(dl, n_images, seed)

    t_img, t_affine = load_grey(template["image"], dims)
    t_lm = landmarks_to_array_axes(landmarks_array(template, n_lm, dims), t_affine, dims)
    other_imgs, other_lms = [], []
    for item in others:
        img, affine = load_grey(item["image"], dims)
        other_imgs.append(img)
        other_lms.append(landmarks_to_array_axes(landmarks_array(item, n_lm, dims), affine, dims))
    t_points, corr, _ = offset_correspondences(t_lm, np.stack(other_lms), radius, stride)
    point_entropy = entropy_at_points(t_img, t_points, window)

    t_work, t_points_work = _to_working_grid(t_img, t_points, image_size)
    work = [_to_working_grid(img, c, image_size) for img, c in zip(other_imgs, corr)]
    groups = estimate_group_intensities(
        t_work, [w[0] for w in work], t_points_work, np.stack([w[1] for w in work]), point_entropy,
        thresholds=thresholds, n_keypoints=n_keypoints, min_keypoints=min_keypoints, patch_size=patch_size,
        alpha_hat=alpha_hat, step=step, max_intensity=max_intensity, bins=bins, seed=seed,
    )

    def clean(v):
        return round(v, 4) if isinstance(v, float) else v

    result = {
        "augmentation": {
            "thresholds": list(thresholds),
            "brightness": [clean(groups[g]["brightness"]) for g in GROUP_NAMES],
            "contrast": [clean(groups[g]["contrast"]) for g in GROUP_NAMES],
            "alpha_hat": float(alpha_hat),
            "source": {
                "datalist": str(Path(datalist).resolve()), "template": template["image"],
                "images": [it["image"] for it in others], "n_images": len(others), "correspondences": correspondences,
                "window": int(window), "patch_size": int(patch_size),
                "image_size": None if image_size is None else list(np.atleast_1d(image_size).astype(int).tolist()),
                "radius": int(radius), "stride": int(stride), "n_keypoints": int(n_keypoints), "bins": int(bins),
                "step": float(step), "max_intensity": float(max_intensity), "seed": int(seed),
            },
            "groups": {g: {k: clean(v) for k, v in groups[g].items()} for g in GROUP_NAMES},
        }
    }
    write_text_atomic(output, yaml.safe_dump(result, sort_keys=False))
    print(f"{'group':<8}{'key pts':>8}{'target MI':>11}{'A_bright':>10}{'A_contrast':>12}")
    for g in GROUP_NAMES:
        e = groups[g]

        def fmt(kind: str) -> str:
            if e.get(kind) is None:
                return "n/a"
            return (">=" if e[f"{kind}_at_max"] else "") + f"{e[kind]:.2f}"

        target = f"{e['target_mi']:.3f}" if "target_mi" in e else "n/a"
        print(f"{g:<8}{e['n_keypoints']:>8}{target:>11}{fmt('brightness'):>10}{fmt('contrast'):>12}")
        if "note" in e:
            print(f"  warning ({g}): {e['note']}")
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    fire.Fire(estimate, serialize=lambda result: None)
