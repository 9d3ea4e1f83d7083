"""The figure of docs/results.md's "Scale": the rows that ``training_scale``, ``inferring_scale`` and
``templates_scale`` wrote (their ``--output`` / ``--out`` JSON files), drawn against the number of images or
templates."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure


def _axes_pair(ax, x, left, right, left_label: str, right_label: str, log_x: bool = True):
    """``left`` (solid, circles) and ``right`` (dashed, squares, on a second y axis) against ``x``."""
    ax.plot(x, left, "o-", color="tab:blue")
    ax.set_ylabel(left_label, color="tab:blue")
    ax.set_ylim(bottom=0, top=max(left) * 1.3)
    twin = ax.twinx()
    twin.plot(x, right, "s--", color="tab:orange")
    twin.set_ylabel(right_label, color="tab:orange")
    twin.set_ylim(bottom=0, top=max(right) * 1.3)
    if log_x:
        ax.set_xscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:,}" for v in x])
    ax.grid(alpha=0.3)
    return twin


def scale_plot(training: str, inferring: str, templates: str, output: str = "docs/results_scale.png") -> Path:
    """Draw the three benchmarks side by side into ``output`` (PNG): the training's peak memory and seconds per
    iteration under its ``cache_gb`` against N (the all-cached reference as a dotted line), inferring's seconds per
    image and peak memory against N, and matching's seconds per image and the config's build (its template features
    computed in it) against k.

    Args:
        training: the JSON of ``python -m scripts.benchmark training_scale --output F``.
        inferring: the JSON of ``inferring_scale --out F``.
        templates: the JSON of ``templates_scale --out F``.
        output: the PNG to write.
    """
    train = json.loads(Path(training).read_text())["rows"]
    infer = [r for r in json.loads(Path(inferring).read_text())["rows"] if not r.get("rerun")]
    ks = json.loads(Path(templates).read_text())["rows"]
    reference, bounded = train[0], train[1:]
    fig = Figure(figsize=(15.0, 4.2), dpi=100)
    axes = fig.subplots(1, 3)

    n = [r["images"] for r in bounded]
    twin = _axes_pair(
        axes[0],
        n,
        [r["peak_rss_mb"] for r in bounded],
        [r["s_per_iteration"] for r in bounded],
        "peak RSS (MB)",
        "s / iteration",
    )
    axes[0].axhline(reference["peak_rss_mb"], color="tab:blue", linestyle=":", linewidth=1)
    twin.axhline(reference["s_per_iteration"], color="tab:orange", linestyle=":", linewidth=1)
    axes[0].set_title(f"training, cache_gb {bounded[0]['cache_gb']:g} (dotted: {reference['images']} all cached)")
    axes[0].set_xlabel("training images")

    _axes_pair(
        axes[1],
        [r["images"] for r in infer],
        [r["s_per_image"] for r in infer],
        [r["peak_rss_mb"] for r in infer],
        "s / image",
        "peak RSS (MB)",
    )
    axes[1].set_title("inferring")
    axes[1].set_xlabel("images")

    _axes_pair(
        axes[2],
        [r["templates"] for r in ks],
        [r["s_per_image"] for r in ks],
        [r["build_s"] for r in ks],
        "s / image",
        "config built, features included (s)",
        log_x=False,
    )
    axes[2].set_title("matching from k templates")
    axes[2].set_xlabel("templates k")

    fig.tight_layout()
    path = Path(output)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path
