"""The IIE map's benchmark: skimage's rank entropy against ``local_entropy``, compiled and numpy."""

from __future__ import annotations

import numpy as np
from scripts.benchmarks.measure import DATA, best_time, peak_memory_mb


def cephalogram_2d(rng: np.random.Generator, shape: tuple[int, int] = (1935, 2400)) -> tuple[np.ndarray, str]:
    """The uint8 bin image the IIE map histograms: a real Hamedan cephalogram when present, else a synthetic one.

    The real one (``DATA/hamedan_ceph/images/001.png``) is read as the bundle reads it (``load_image``: grey,
    (x, y) order; scaled to [0, 1] as ``ScaleIntensityd`` does) and quantised as ``local_entropy`` bins it
    (256 bins over the image's range), at its own size. The synthetic one has ISBI 2015 size ``shape``.
    """
    path = DATA / "hamedan_ceph" / "images" / "001.png"
    if path.exists():
        from bundle.data.images import load_image
        from bundle.transforms.entropy import _bin_indices
        from monai.transforms import ScaleIntensity

        image = ScaleIntensity(minv=0.0, maxv=1.0)(load_image(str(path))[None])[0]
        bins = _bin_indices(np.asarray(image), 256, None)
        return bins.astype(np.uint8), f"real ({path.name})"
    from skimage.transform import resize

    x, y = np.meshgrid(np.linspace(-1, 1, shape[0]), np.linspace(-1, 1, shape[1]), indexing="ij")
    skull = 90 * np.exp(-(((x / 0.7) ** 2 + (y / 0.8) ** 2) ** 3)) + 40 * np.sin(7 * x + 3 * y) * (x > -0.2)
    teeth = 60 * ((np.abs(np.sin(40 * x)) > 0.7) & (np.abs(y - 0.4) < 0.1))
    texture = resize(rng.normal(0, 25, (shape[0] // 8, shape[1] // 8)), shape)
    image = 30 + skull + teeth + texture + rng.normal(0, 6, shape)
    return np.clip(image, 0, 255).astype(np.uint8), "synthetic"


def ct_volume_3d(rng: np.random.Generator, shape: tuple[int, int, int] = (128, 256, 256)) -> np.ndarray:
    """A uint8 CT-like volume: smooth soft tissue, a bright ellipsoid (bone), air outside the body, noise."""
    z, y, x = np.meshgrid(*(np.linspace(-1, 1, n, dtype=np.float32) for n in shape), indexing="ij")
    body = (x**2 + (y / 0.8) ** 2) < 0.85
    volume = np.where(body, 100 + 20 * np.sin(5 * x) * np.cos(4 * y + z), 0)
    volume += 80 * ((x - 0.2) ** 2 / 0.05 + y**2 / 0.1 + z**2 / 0.5 < 1)
    volume += body * rng.normal(0, 8, shape).astype(np.float32)
    return np.clip(volume, 0, 255).astype(np.uint8)


def entropy(repeats: int = 5, seed: int = 0) -> None:
    """IIE map: skimage.filters.rank.entropy against ``local_entropy`` (k = 10 in 2D, 5 in 3D), same run.

    ``local_entropy`` runs its compiled sliding histogram; its numpy box sums (what runs without a C compiler)
    are timed beside it. The three are called in turn (skimage, compiled, numpy, skimage, ...) and the best of
    ``repeats`` of each is kept, so all see the same machine load; the ratios to skimage and the largest
    difference of each map from skimage's are printed.
    """
    import torch
    from bundle.transforms.entropy import _bin_indices, _entropy_box_sums, _entropy_rows_kernel, local_entropy
    from skimage.filters.rank import entropy as skimage_entropy

    if _entropy_rows_kernel() is None:
        print("the compiled kernel is not available (no C compiler, or its build failed: see the log)")
    rng = np.random.default_rng(seed)
    image, source = cephalogram_2d(rng)
    cases = [
        (f"2D {image.shape[0]}x{image.shape[1]} k=10, {source}", image, 10),
        ("3D 128x256x256 k=5, synthetic CT", ct_volume_3d(rng), 5),
    ]
    print(f"torch threads: {torch.get_num_threads()}, best of {repeats}, interleaved")
    columns = [("skimage s", 10), ("compiled s", 10), ("speed-up", 9), ("diff", 9), ("numpy s", 8), ("speed-up", 9)]
    columns += [("diff", 9), ("compiled peak MB", 17)]
    header = f"{'case':44s}" + "".join(f" {title:>{width}s}" for title, width in columns)
    print(header)
    print("-" * len(header))
    for name, array, k in cases:
        footprint = np.ones((k,) * array.ndim, dtype=bool)
        window = (k,) * array.ndim
        calls = {
            "skimage": lambda: skimage_entropy(array, footprint),
            "compiled": lambda: local_entropy(array, window=k),
            "numpy": lambda: _entropy_box_sums(_bin_indices(array, 256, None), window, 256),
        }
        times, maps = dict.fromkeys(calls, float("inf")), {}
        for _ in range(repeats):
            for key, call in calls.items():
                time_once, maps[key] = best_time(call, 1)
                times[key] = min(times[key], time_once)
        # largest difference (bits) of each map from skimage's
        diff = {key: float(np.abs(np.asarray(maps[key], np.float64) - maps["skimage"]).max()) for key in maps}
        peak = peak_memory_mb(calls["compiled"])
        flag = "" if max(diff.values()) <= 1e-5 else "  DISAGREE"
        ratio = {key: times["skimage"] / times[key] for key in calls}
        print(
            f"{name:44s} {times['skimage']:10.3f} {times['compiled']:10.3f} {ratio['compiled']:8.1f}x"
            f" {diff['compiled']:9.1e}"
            f" {times['numpy']:8.3f} {ratio['numpy']:8.1f}x {diff['numpy']:9.1e} {peak:17.0f}{flag}"
        )
