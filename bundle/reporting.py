"""Evaluation report files: metrics.json (provenance.json without references), predictions.csv, overlay PNGs (2D),
3D Slicer markups (3D) and the SDR curve.

Writers (and the reader of predictions.csv) only; :class:`bundle.handlers.report.LandmarkReportHandler` assembles a
run's report from them. Every file is written atomically (``bundle.io_utils``). Figures use matplotlib's Agg
canvas directly, without pyplot's global state, so they work headless and in threads.
"""

from __future__ import annotations

import csv
import html
import io
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import quote

import numpy as np
from bundle.data.annotations import image_stem
from bundle.data.markups import ControlPoint, write_mrk_json
from bundle.io_utils import atomic_path, write_json_atomic, write_text_atomic
from bundle.metrics import DEFAULT_THRESHOLDS, success_detection_rate
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from monai.utils import convert_to_numpy

SUMMARY_KEYS = (
    "n_images",
    "n_landmarks",
    "mre_mm",
    "mre_std_mm",
    "mre_px",
    "sdr",
    "per_landmark_mre_mm",
    "per_landmark_offset_mm",
    "mre_offset_removed_mm",
)
AXES = ("x", "y", "z")


PIPELINES = ("templates", "detector")


def check_pipeline(pipeline: str) -> str:
    """``pipeline`` when it is one of :data:`PIPELINES`, else ValueError naming it."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return pipeline


def run_provenance(
    pipeline: str,
    template: str | Sequence[str],
    checkpoint: str,
    pseudo_templates: Sequence[str] = (),
    refinement: Mapping[str, Any] | None = None,
    matching_guard: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What made a run's predictions: ``pipeline`` (``templates``: one-/k-shot template matching, ``detector``: a
    heatmap detector), ``template`` (the first template image; for a detector the stage-1 template(s) that made its
    pseudo-labels, "" for human labels), ``templates`` (the whole list, when it holds more than one),
    ``pseudo_templates`` (those of them whose landmarks were labelled by matching, when any), ``checkpoint`` and
    ``xfeat_refinement`` (the fine step's settings and templates, null when it did not run:
    :meth:`bundle.inferers.refinement.DescriptorRefinement.settings`) and, where ``contrast_adaptation: auto``
    chose 3D matching's guard on validation images, ``matching_guard`` (the setting kept and each one's validation
    MRE: :func:`bundle.pipeline.matching_guard.choose_guard`)."""
    check_pipeline(pipeline)
    templates = [str(template)] if isinstance(template, (str, os.PathLike)) else [str(t) for t in template]
    templates = [t for t in templates if t]
    return {
        "pipeline": pipeline,
        "template": templates[0] if templates else "",
        **({"templates": templates} if len(templates) > 1 else {}),
        **({"pseudo_templates": [str(t) for t in pseudo_templates]} if pseudo_templates else {}),
        "checkpoint": str(checkpoint),
        "xfeat_refinement": dict(refinement) if refinement else None,
        **({"matching_guard": dict(matching_guard)} if matching_guard else {}),
    }


def write_metrics_json(path: str | os.PathLike, summary: Mapping[str, Any], provenance: Mapping[str, Any]) -> Path:
    """Write metrics.json: the :func:`bundle.metrics.summarize_errors` and :func:`bundle.metrics.landmark_offsets`
    keys plus the run's :func:`run_provenance`."""
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise KeyError(f"summary for {path} lacks keys {missing}")
    return write_json_atomic(path, {**{k: summary[k] for k in SUMMARY_KEYS}, **provenance})


def _number(value) -> str:
    """A CSV cell: fixed 6 decimals, empty for a missing (None/NaN) value."""
    return "" if value is None or math.isnan(float(value)) else f"{float(value):.6f}"


def write_predictions_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write predictions.csv with header ``image,landmark,x,y[,z],error_mm``, row by row (``rows`` may be a
    generator: the file's text is not held in memory).

    Each row is a mapping with ``image``, ``landmark``, ``point`` (D coordinates in the datalist
    convention: 2D original pixels, 3D world mm) and ``error_mm``; missing values become empty cells.
    """
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        dims = None
        for i, row in enumerate(rows):
            if dims is None:
                dims = len(row["point"])
                if dims not in (2, 3):
                    raise ValueError(f"{path}: points must have 2 or 3 coordinates, got {dims}")
                writer.writerow(["image", "landmark", *AXES[:dims], "error_mm"])
            if len(row["point"]) != dims:
                raise ValueError(
                    f"{path}: row {i} ({row['image']}, {row['landmark']}) "
                    f"has {len(row['point'])} coordinates, expected {dims}"
                )
            writer.writerow(
                [row["image"], row["landmark"], *(_number(v) for v in row["point"]), _number(row["error_mm"])]
            )
        if dims is None:
            raise ValueError(f"no prediction rows to write to {path}")
    return Path(path)


def read_predictions_csv(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a predictions.csv that :func:`write_predictions_csv` wrote: ``image``, ``landmark``,
    ``point`` (float array, NaN for an empty cell) and ``error_mm`` (float, NaN when empty)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        axes = [a for a in AXES if a in (reader.fieldnames or [])]
        return [
            {
                "image": row["image"],
                "landmark": row["landmark"],
                "point": np.array([float(row[a] or "nan") for a in axes]),
                "error_mm": float(row["error_mm"] or "nan"),
            }
            for row in reader
        ]


def _png(fig: Figure) -> bytes:
    """The figure as PNG file content."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    return buffer.getvalue()


def write_png(path: str | os.PathLike, png: bytes) -> Path:
    """Write PNG file content (:func:`overlay_png`) to ``path`` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(png)
    return Path(path)


def save_overlay_png(
    path: str | os.PathLike, image_2d, ref_px, pred_px, names: Sequence[str], pixel_aspect: float = 1.0
) -> Path:
    """Write the overlay of :func:`overlay_png` to ``path``."""
    return write_png(path, overlay_png(image_2d, ref_px, pred_px, names, pixel_aspect, where=f"overlay {path}"))


# an overlay's longer side, in pixels, at least (a smaller image is enlarged so that its key and numbers read)
OVERLAY_MIN_SIDE = 800
# landmarks per column of an overlay's key
KEY_ROWS = 20


def overlay_png(
    image_2d, ref_px, pred_px, names: Sequence[str], pixel_aspect: float = 1.0, where: str = "overlay"
) -> bytes:
    """The figure of :func:`overlay_figure` as PNG file content."""
    return _png(overlay_figure(image_2d, ref_px, pred_px, names, pixel_aspect, where))


def overlay_figure(
    image_2d, ref_px, pred_px, names: Sequence[str], pixel_aspect: float = 1.0, where: str = "overlay"
) -> Figure:
    """Grey image with its predicted landmarks (red crosses, each numbered: the key in the top left corner names
    them) and, where known, the reference ones (green circles, each joined to its prediction); the legend lists only
    what is drawn.

    ``image_2d`` is indexed ``[x, y]`` (tensor axis order: x the column); ``ref_px`` and ``pred_px`` are
    ``(L, 2)`` ``[x, y]`` positions in that image's pixels, NaN for missing. The figure has the image's own pixels
    (one per image pixel; a longer side under :data:`OVERLAY_MIN_SIDE` is enlarged to it); ``pixel_aspect`` is a
    pixel's height over its width (the anatomy's true proportions). ``where`` names the overlay in error messages.
    """
    image = np.asarray(convert_to_numpy(image_2d), dtype=np.float64).squeeze()
    if image.ndim != 2:
        raise ValueError(f"{where}: expected a 2D image, got shape {image.shape}")
    ref = np.asarray(ref_px, dtype=np.float64).reshape(-1, 2)
    pred = np.asarray(pred_px, dtype=np.float64).reshape(-1, 2)
    if len(ref) != len(pred) or len(names) != len(ref):
        raise ValueError(f"{where}: {len(ref)} references, {len(pred)} predictions and {len(names)} names")
    width, height = image.shape
    scale = max(1.0, OVERLAY_MIN_SIDE / max(width, height * pixel_aspect))
    dpi = 100.0
    fig = Figure(figsize=(width * scale / dpi, height * pixel_aspect * scale / dpi), dpi=dpi)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    finite = image[np.isfinite(image)]
    lo, hi = np.percentile(finite, (0.5, 99.5)) if finite.size else (0.0, 1.0)
    ax.imshow(
        image.T, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1.0, interpolation="nearest", aspect=pixel_aspect
    )
    # text and marks sized to the figure: a point is dpi / 72 pixels
    font = max(8.0, max(width, height * pixel_aspect) * scale / 110 * 72 / dpi)
    outline = [patheffects.withStroke(linewidth=font / 4, foreground="black")]
    has_ref = np.isfinite(ref).all(1)
    has_pred = np.isfinite(pred).all(1)
    for (rx, ry), (px, py) in zip(ref[has_ref & has_pred], pred[has_ref & has_pred]):
        ax.plot([rx, px], [ry, py], color="yellow", linewidth=font / 8)
    if has_ref.any():
        ax.scatter(
            *ref[has_ref].T,
            s=(font * 1.2) ** 2,
            facecolors="none",
            edgecolors="lime",
            linewidths=font / 6,
            label="reference",
        )
    if has_pred.any():
        ax.scatter(
            *pred[has_pred].T,
            s=(font * 1.2) ** 2,
            marker="x",
            color="red",
            linewidths=font / 6,
            label="prediction (number: the key)",
        )
    for number in np.flatnonzero(has_pred):
        ax.annotate(
            str(number + 1),
            tuple(pred[number]),
            xytext=(font / 2, font / 2),
            textcoords="offset points",
            color="cyan",
            fontsize=font,
            path_effects=outline,
        )
    rows = min(KEY_ROWS, len(names))
    key_font = min(font, fig.get_figheight() * 72 * 0.9 / (max(rows, 1) * 1.3))
    columns = [
        "\n".join(f"{i + 1} {names[i]}" for i in range(c, min(c + rows, len(names))))
        for c in range(0, len(names), max(rows, 1))
    ]
    for c, text in enumerate(columns):
        ax.annotate(
            text,
            (0.01 + 0.2 * c, 0.99),
            xycoords="axes fraction",
            va="top",
            color="white",
            fontsize=key_font,
            family="monospace",
            path_effects=outline,
        )
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    ax.set_axis_off()
    if has_ref.any() or has_pred.any():
        ax.legend(loc="lower right", fontsize=font, framealpha=0.7)
    return fig


def write_overview_html(
    path: str | os.PathLike, overlays: Mapping[str, tuple[str, float | None]], names: Sequence[str], pipeline: str
) -> Path:
    """Write a page showing every overlay of a run (``overlays``: file name in ``overlays/`` -> (its image, its MRE
    in mm or None)), each captioned with its image and MRE, under the key of the landmark numbers."""
    key = ", ".join(f"{i + 1} {html.escape(str(n))}" for i, n in enumerate(names))
    figures = "".join(
        f'<figure><a href="overlays/{quote(name)}"><img src="overlays/{quote(name)}" loading="lazy" alt=""></a>'
        f"<figcaption>{html.escape(str(image))}{'' if mre is None else f' (MRE {mre:.2f} mm)'}</figcaption></figure>\n"
        for name, (image, mre) in overlays.items()
    )
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Landmarks on '
        f"{len(overlays)} images</title><style>body{{font-family:sans-serif}}figure{{display:inline-block;"
        "margin:4px;width:360px;vertical-align:top}img{width:100%}figcaption{font-size:12px;word-break:break-all}"
        f"</style></head><body>\n<h1>Landmarks ({html.escape(pipeline)}) on {len(overlays)} images</h1>\n"
        f"<p>Red crosses: predictions, numbered: {key}. Green circles: reference landmarks, where known. "
        f"Click an image for its full resolution.</p>\n{figures}</body></html>\n"
    )
    return write_text_atomic(path, page)


def save_sdr_curve(
    path: str | os.PathLike, errors_mm, max_mm: float = 10.0, marks: Sequence[float] = DEFAULT_THRESHOLDS
) -> Path:
    """Plot SDR (%) against the threshold from 0 to ``max_mm`` mm, the ``marks`` thresholds labelled."""
    errors = np.asarray(errors_mm, dtype=np.float64).ravel()
    errors = errors[~np.isnan(errors)]
    thresholds = np.linspace(0.0, max_mm, 201)
    sdr = [success_detection_rate(errors, t) for t in thresholds]
    fig = Figure(figsize=(6.0, 4.0), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(thresholds, sdr, color="tab:blue", linewidth=2.0)
    for t in marks:
        value = success_detection_rate(errors, t)
        ax.plot([t], [value], "o", color="tab:red")
        ax.annotate(f"{value:.1f}% @ {t:g} mm", (t, value), xytext=(6, -12), textcoords="offset points", fontsize=8)
    ax.set_xlim(0.0, max_mm)
    ax.set_ylim(0.0, 100.0)
    ax.set_xlabel("threshold (mm)")
    ax.set_ylabel("successful detection rate (%)")
    ax.set_title(f"SDR, {errors.size} landmarks, MRE {errors.mean():.2f} mm")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return write_png(path, _png(fig))


def unique_name(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem_2``, ``stem_3``... when already in ``taken`` (which gets the result)."""
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}_{n}"
    taken.add(name)
    return name


def write_markups_per_image(
    output_dir: str | os.PathLike, records: Sequence[Mapping[str, Any]], names: Sequence[str]
) -> list[Path]:
    """One 3D Slicer ``.mrk.json`` (RAS) per record, ``output_dir/<image stem>.mrk.json``,
    of its ``pred`` (L, 3) world mm.

    A NaN prediction is stored as an unplaced point; two images with the same stem get ``_2``, ``_3``... suffixes.
    """
    taken: set[str] = set()
    paths = []
    for record in records:
        pred = np.asarray(record["pred"], dtype=np.float64)
        if pred.shape != (len(names), 3):
            raise ValueError(
                f"markups for {record['image']}: predictions {pred.shape} do not fit {len(names)} 3D landmarks"
            )
        points = [ControlPoint(str(n), tuple(p) if np.isfinite(p).all() else None) for n, p in zip(names, pred)]
        name = unique_name(image_stem(record["image"]), taken)
        paths.append(write_mrk_json(Path(output_dir) / f"{name}.mrk.json", points, coordinate_system="RAS"))
    return paths
