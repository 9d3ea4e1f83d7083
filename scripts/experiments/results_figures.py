"""Figures of docs/results.md: the IIE map with its three groups, prediction overlays (drawn locally: a rendering of a
data set that may not be redistributed stays out of docs/).

    python -m scripts.experiments.results_figures iie --image IMAGE --output docs/results_iie_groups.png \
        [--window 10 --thresholds "[2,4]"]
    python -m scripts.experiments.results_figures overlays --datalist D --eval_dir RUN/eval --output_dir docs \
        [--n 2 --width 480]

The figures are downsampled renderings (``width`` pixels wide) for illustration only.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
from bundle.data.datalist import landmarks_array, load_datalist
from bundle.data.images import load_grey
from bundle.information_groups import GROUP_NAMES, information_groups
from bundle.io_utils import atomic_path
from bundle.reporting import read_predictions_csv, save_overlay_png
from bundle.transforms.entropy import local_entropy
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from monai.transforms import Resize
from scripts.cli import run_fire


def _shrink(image_xy: np.ndarray, width: int, mode: str = "area") -> tuple[np.ndarray, float]:
    """``image_xy`` resized to ``width`` columns (aspect kept) and the scale factor new / old."""
    scale = width / image_xy.shape[0]
    size = (width, max(1, round(image_xy.shape[1] * scale)))
    return np.asarray(Resize(size, mode=mode)(image_xy[None]))[0], scale


def iie(image: str, output: str, window: int = 10, thresholds=(2.0, 4.0), width: int = 400) -> Path:
    """Image, its IIE map (paper Sec. 3 step 1, on the original resolution) and the low/medium/high groups."""
    grey = load_grey(image, 2)[0]  # indexed [x, y], channels averaged, in [0, 1]
    entropy = local_entropy(grey, window).numpy()
    groups = information_groups(entropy, thresholds)
    shown = [
        _shrink(grey, width)[0],
        _shrink(entropy, width)[0],
        _shrink(groups.astype(np.float64), width, "nearest")[0],
    ]
    share = [100.0 * np.mean(groups == g) for g in range(3)]
    fig = Figure(figsize=(12.0, 5.2), dpi=80)
    titles = [
        "image",
        f"IIE map, {window}×{window} window (bits)",
        "groups: " + ", ".join(f"{n} {s:.0f} %" for n, s in zip(GROUP_NAMES, share)),
    ]
    for k, (data, title) in enumerate(zip(shown, titles)):
        ax = fig.add_subplot(1, 3, k + 1)
        if k == 0:
            ax.imshow(data.T, cmap="gray")
        elif k == 1:
            fig.colorbar(ax.imshow(data.T, cmap="magma"), ax=ax, fraction=0.046)
        else:
            ax.imshow(
                data.T, cmap=ListedColormap(["#2c3e91", "#e0a100", "#d62728"]), vmin=0, vmax=2, interpolation="nearest"
            )
        ax.set_title(title, fontsize=10)
        ax.set_axis_off()
    fig.tight_layout()
    FigureCanvasAgg(fig)
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    print(f"wrote {output}: group shares low / medium / high = {share[0]:.1f} / {share[1]:.1f} / {share[2]:.1f} %")
    return Path(output)


def overlays(datalist: str, eval_dir: str, output_dir: str = "docs", n: int = 2, width: int = 480) -> list[Path]:
    """Overlays of the test images with the median and the largest per-image MRE (reference vs prediction)."""
    dl = load_datalist(datalist)
    names = dl["landmark_names"]
    items = {Path(it["image"]).name: it for it in dl["test"]}
    predicted: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in read_predictions_csv(Path(eval_dir) / "predictions.csv"):
        predicted[Path(row["image"]).name][row["landmark"]] = row
    mre = {k: np.nanmean([v["error_mm"] for v in p.values()]) for k, p in predicted.items() if k in items}
    if not mre:
        raise ValueError(f"{eval_dir}/predictions.csv names none of the test images of {datalist}")
    order = sorted(mre, key=mre.get)
    picks = [order[len(order) // 2], order[-1]][:n]
    written = []
    for name in picks:
        grey, scale = _shrink(load_grey(items[name]["image"], 2)[0], width)
        ref = landmarks_array(items[name], len(names), 2) * scale
        pred = np.array([predicted[name][lm]["point"] for lm in names]) * scale
        out = Path(output_dir) / f"results_overlay_{Path(name).stem}.png"
        save_overlay_png(out, grey, ref, pred, names)
        print(f"wrote {out}: {name}, MRE {mre[name]:.2f} mm (rank {order.index(name) + 1} of {len(order)})")
        written.append(out)
    return written


if __name__ == "__main__":
    run_fire({"iie": iie, "overlays": overlays})
