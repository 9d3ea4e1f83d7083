"""What the tests of the intensity estimators share (the paper's, tests/test_estimate_augmentation.py, and the
earlier one, tests/test_joint_mi.py): a synthetic image with three information groups, its shifted copies as
correspondences, and a small labelled PNG datalist of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bundle.transforms.entropy import local_entropy
from PIL import Image


def three_region_image(rng: np.random.Generator, n: int = 96) -> np.ndarray:
    """Rows 0-31: 2 grey levels (IIE ~1 bit), 32-63: 8 levels (~3 bits), 64-95: 256 levels (~6 bits)."""

    def levels(k: int, lo: float, hi: float) -> np.ndarray:
        return lo + (hi - lo) * rng.integers(0, k, (n // 3, n)) / (k - 1)

    x = np.concatenate([levels(2, 0.35, 0.45), levels(8, 0.3, 0.7), levels(256, 0.2, 0.8)])
    x[0, 0], x[-1, -1] = 0.0, 1.0
    return x


def estimation_case() -> tuple:
    """A template of three information groups, three shifted and tone-mapped copies, a lattice of key points, their
    correspondences (the shifts) and the template's IIE at them: ``(template, others, points, correspondences,
    point_entropy)``."""
    rng = np.random.default_rng(5)
    template = three_region_image(rng)
    shifts = [(0, -2), (0, 5), (0, 1)]
    others = [
        np.clip(np.roll(template, s, axis=(0, 1)) ** g + 0.02 * rng.standard_normal(template.shape), 0, 1)
        for s, g in zip(shifts, (0.8, 1.2, 0.9))
    ]
    axis = np.arange(10, 87, 7)
    points = np.stack(np.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2).astype(float)
    correspondences = np.stack([points + np.array(s, dtype=float) for s in shifts])
    point_entropy = local_entropy(template, 10).numpy()[tuple(points.astype(int).T)]
    return template, others, points, correspondences, point_entropy


def write_png_datalist(tmp_path: Path, n_images: int = 4, labelled: bool = True) -> Path:
    """``n_images`` shifted copies of :func:`three_region_image` as PNG files in ``tmp_path`` and their datalist (three
    landmarks; only the first image labelled unless ``labelled``)."""
    rng = np.random.default_rng(6)
    base = (three_region_image(rng) * 255).round().astype(np.uint8)  # array axes [x, y]
    landmarks = np.array([[16.0, 40.0], [48.0, 30.0], [80.0, 60.0]])
    items = []
    for i in range(n_images):
        shift = np.array([0, 2 * i - 3])
        Image.fromarray(np.roll(base, tuple(shift), axis=(0, 1)).T).save(tmp_path / f"{i:03d}.png")
        item = {"image": f"{i:03d}.png"}
        if labelled or i == 0:
            item["landmarks"] = (landmarks + shift).tolist()
        items.append(item)
    dl = {
        "name": "synthetic",
        "spatial_dims": 2,
        "landmark_names": ["a", "b", "c"],
        "training": items,
        "validation": [],
        "test": [],
    }
    path = tmp_path / "datalist.json"
    path.write_text(json.dumps(dl))
    return path
