"""Evaluation reports: metrics.json, predictions.csv, overlay PNGs (2D), 3D Slicer markups (3D) and the SDR curve.

Every file is written atomically (``bundle.io_utils``); :class:`LandmarkReportHandler` builds a run's whole
report in a hidden sibling folder of ``output_dir`` and moves it into place only when it is complete, so a
failed run leaves the previous report as it was, never a mix of old and new files. Figures use matplotlib's Agg canvas directly,
without pyplot's global state, so they work headless and in threads.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from ignite.engine import Engine, Events
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from monai.data import decollate_batch
from monai.utils import convert_to_numpy

from bundle.data.annotations import image_stem
from bundle.data.markups import ControlPoint, write_mrk_json
from bundle.io_utils import StagedOutputs, atomic_path, write_json_atomic, write_text_atomic
from bundle.metrics import DEFAULT_THRESHOLDS, radial_errors, success_detection_rate, summarize_errors
from bundle.oneshot import apply_homogeneous
from bundle.transforms.landmarks import physical_to_datalist

SUMMARY_KEYS = ("n_images", "n_landmarks", "mre_mm", "mre_std_mm", "mre_px", "sdr", "per_landmark_mre_mm")
AXES = ("x", "y", "z")
REPORT_FILES = ("metrics.json", "predictions.csv", "sdr_curve.png", "overlays")


def report_outputs(output_dir: str | os.PathLike) -> list[Path]:
    """The files of a report in ``output_dir`` (:data:`REPORT_FILES` and the 3D ``*.mrk.json``): what a new
    report replaces as a whole."""
    output_dir = Path(output_dir)
    return [output_dir / n for n in REPORT_FILES] + sorted(output_dir.glob("*.mrk.json"))


def write_metrics_json(path: str | os.PathLike, summary: Mapping[str, Any], template: str | Sequence[str], checkpoint: str) -> Path:
    """Write metrics.json: the :func:`bundle.metrics.summarize_errors` keys plus ``template`` and ``checkpoint``.

    ``template`` is one image or a list of them (k-shot): ``template`` gets the first, and ``templates`` the
    whole list when it holds more than one.
    """
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise KeyError(f"summary for {path} lacks keys {missing}")
    templates = [str(template)] if isinstance(template, (str, os.PathLike)) else [str(t) for t in template]
    extra = {"templates": templates} if len(templates) > 1 else {}
    return write_json_atomic(
        path, {**{k: summary[k] for k in SUMMARY_KEYS}, "template": templates[0] if templates else "", **extra, "checkpoint": str(checkpoint)}
    )


def _number(value) -> str:
    """A CSV cell: fixed 6 decimals, empty for a missing (None/NaN) value."""
    return "" if value is None or math.isnan(float(value)) else f"{float(value):.6f}"


def write_predictions_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write predictions.csv with header ``image,landmark,x,y[,z],error_mm``.

    Each row is a mapping with ``image``, ``landmark``, ``point`` (D coordinates in the datalist
    convention: 2D original pixels, 3D world mm) and ``error_mm``; missing values become empty cells.
    """
    rows = list(rows)
    if not rows:
        raise ValueError(f"no prediction rows to write to {path}")
    dims = len(rows[0]["point"])
    if dims not in (2, 3):
        raise ValueError(f"{path}: points must have 2 or 3 coordinates, got {dims}")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["image", "landmark", *AXES[:dims], "error_mm"])
    for i, row in enumerate(rows):
        if len(row["point"]) != dims:
            raise ValueError(f"{path}: row {i} ({row['image']}, {row['landmark']}) has {len(row['point'])} coordinates, expected {dims}")
        writer.writerow([row["image"], row["landmark"], *(_number(v) for v in row["point"]), _number(row["error_mm"])])
    return write_text_atomic(path, buffer.getvalue())


def read_predictions_csv(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a predictions.csv that :func:`write_predictions_csv` wrote: ``image``, ``landmark``,
    ``point`` (float array, NaN for an empty cell) and ``error_mm`` (float, NaN when empty)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        axes = [a for a in AXES if a in (reader.fieldnames or [])]
        return [{"image": row["image"], "landmark": row["landmark"],
                 "point": np.array([float(row[a] or "nan") for a in axes]),
                 "error_mm": float(row["error_mm"] or "nan")} for row in reader]


def _save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    FigureCanvasAgg(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    return Path(path)


def save_overlay_png(path: str | os.PathLike, image_2d, ref_px, pred_px, names: Sequence[str], pixel_aspect: float = 1.0) -> Path:
    """Grey image with reference (green circles) and predicted (red crosses) landmarks joined by a line.

    ``image_2d`` is indexed ``[x, y]`` (tensor axis order: x the column); ``ref_px`` and ``pred_px`` are
    ``(L, 2)`` ``[x, y]`` positions in that image's pixels, NaN for missing. ``pixel_aspect`` is a
    pixel's height over its width (so a resized grid is shown with the anatomy's true proportions).
    """
    image = np.asarray(convert_to_numpy(image_2d), dtype=np.float64).squeeze()
    if image.ndim != 2:
        raise ValueError(f"overlay {path}: expected a 2D image, got shape {image.shape}")
    ref = np.asarray(ref_px, dtype=np.float64).reshape(-1, 2)
    pred = np.asarray(pred_px, dtype=np.float64).reshape(-1, 2)
    if len(ref) != len(pred) or len(names) != len(ref):
        raise ValueError(f"overlay {path}: {len(ref)} references, {len(pred)} predictions and {len(names)} names")
    width, height = image.shape
    fig = Figure(figsize=(7.0, 7.0 * pixel_aspect * height / width), dpi=100)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    finite = image[np.isfinite(image)]
    lo, hi = np.percentile(finite, (0.5, 99.5)) if finite.size else (0.0, 1.0)
    ax.imshow(image.T, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1.0, interpolation="bilinear", aspect=pixel_aspect)
    for (rx, ry), (px, py) in zip(ref, pred):
        if np.isfinite([rx, ry, px, py]).all():
            ax.plot([rx, px], [ry, py], color="yellow", linewidth=1.0)
    ax.scatter(ref[:, 0], ref[:, 1], s=36, facecolors="none", edgecolors="lime", linewidths=1.5, label="reference")
    ax.scatter(pred[:, 0], pred[:, 1], s=36, marker="x", color="red", linewidths=1.5, label="prediction")
    for name, (rx, ry) in zip(names, ref):
        if np.isfinite([rx, ry]).all():
            ax.annotate(str(name), (rx, ry), xytext=(4, 4), textcoords="offset points", color="cyan", fontsize=7)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    ax.set_axis_off()
    ax.legend(loc="lower right", fontsize=8, framealpha=0.7)
    return _save_figure(fig, path)


def save_sdr_curve(path: str | os.PathLike, errors_mm, max_mm: float = 10.0, marks: Sequence[float] = DEFAULT_THRESHOLDS) -> Path:
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
    return _save_figure(fig, path)


def _items(data: Any) -> list[dict]:
    """Per-image dicts from an engine's (possibly decollated) ``state.output`` / ``state.batch``."""
    if data is None:
        return []
    if isinstance(data, Mapping):
        return [dict(d) for d in decollate_batch(dict(data))]
    if isinstance(data, (list, tuple)) and all(isinstance(d, Mapping) for d in data):
        return [dict(d) for d in data]
    raise TypeError(f"expected a dict or a list of dicts per image, got {type(data).__name__}")


def _unique(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem_2``, ``stem_3``... when already in ``taken`` (which gets the result)."""
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}_{n}"
    taken.add(name)
    return name


def write_markups_per_image(output_dir: str | os.PathLike, records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[Path]:
    """One 3D Slicer ``.mrk.json`` (RAS) per record, ``output_dir/<image stem>.mrk.json``, of its ``pred`` (L, 3) world mm.

    A NaN prediction is stored as an unplaced point; two images with the same stem get ``_2``, ``_3``... suffixes.
    """
    taken: set[str] = set()
    paths = []
    for record in records:
        pred = np.asarray(record["pred"], dtype=np.float64)
        if pred.shape != (len(names), 3):
            raise ValueError(f"markups for {record['image']}: predictions {pred.shape} do not fit {len(names)} 3D landmarks")
        points = [ControlPoint(str(n), tuple(p) if np.isfinite(p).all() else None) for n, p in zip(names, pred)]
        name = _unique(image_stem(record["image"]), taken)
        paths.append(write_mrk_json(Path(output_dir) / f"{name}.mrk.json", points, coordinate_system="RAS"))
    return paths


class LandmarkReportHandler:
    """Ignite handler writing the evaluation reports of one-shot detection at ``Events.COMPLETED``.

    Contract: for each image, the union of its ``engine.state.batch`` item and ``engine.state.output``
    item (output wins; batched dicts or decollated lists of dicts both work) provides
      - ``pred_key`` ("pred"): ``(L, D)`` predicted landmarks in physical mm, NaN for missing;
      - ``label_key`` ("label"): ``(L, D)`` reference landmarks in physical mm, NaN for missing;
      - ``spacing_key`` ("spacing"): ``(D,)`` mm per pixel of the original image. In 2D physical mm are
        original pixels times spacing, so the CSV gets ``pred / spacing``; in 3D the CSV gets world mm.
        Pixel errors (``mre_px``) are ``|(pred - ref) / spacing|``;
      - ``path_key`` ("image_path"): the image's path for the CSV, else the ``filename_or_obj`` of
        the ``image_key`` MetaTensor;
      - 2D overlays only: ``image_key`` ("image") the ``(1, W, H)`` grid image and ``grid_key``
        ("grid_to_physical") its ``(3, 3)`` grid-to-mm matrix; items without them get no overlay.
    At ``EPOCH_STARTED`` the collection is reset; at ``COMPLETED`` it writes ``output_dir``/metrics.json,
    predictions.csv, sdr_curve.png and overlays/<image stem>.png (2D) or <image stem>.mrk.json (3D, the
    predictions as a 3D Slicer point list in RAS), and logs MRE and SDR. When no image has
    a reference landmark (inference on new images), only predictions.csv and the overlays are written.
    Everything is written into a staging folder beside ``output_dir`` first and replaces the previous report
    files (:func:`report_outputs`) only at the end: after a failure ``output_dir`` is as it was.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        landmark_names: Sequence[str],
        template: str | Sequence[str] = "",
        checkpoint: str = "",
        thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
        overlays: bool = True,
        pred_key: str = "pred",
        label_key: str = "label",
        spacing_key: str = "spacing",
        path_key: str = "image_path",
        image_key: str = "image",
        grid_key: str = "grid_to_physical",
        logger_name: str = "bundle.reporting",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.landmark_names = [str(n) for n in landmark_names]
        self.template = template
        self.checkpoint = checkpoint
        self.thresholds = tuple(float(t) for t in thresholds)
        self.overlays = overlays
        self.pred_key, self.label_key, self.spacing_key = pred_key, label_key, spacing_key
        self.path_key, self.image_key, self.grid_key = path_key, image_key, grid_key
        self.logger = logging.getLogger(logger_name)
        self.records: list[dict] = []
        self._stems: set[str] = set()
        self._staging = StagedOutputs(self.output_dir, owned=report_outputs)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self.reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.collect)
        engine.add_event_handler(Events.COMPLETED, self.write)
        # a run that fails removes its staging folder; ignite stops at the first EXCEPTION_RAISED handler that
        # raises (MONAI's StatsHandler does), so this one goes first and raises only when it is the only one
        engine.add_event_handler(Events.EXCEPTION_RAISED, self._failed)
        handlers = getattr(engine, "_event_handlers", {}).get(Events.EXCEPTION_RAISED)
        if isinstance(handlers, list) and len(handlers) > 1:
            handlers.insert(0, handlers.pop())

    def _failed(self, engine: Engine, error: BaseException) -> None:
        self._staging.discard()
        handlers = getattr(engine, "_event_handlers", {}).get(Events.EXCEPTION_RAISED)
        if not isinstance(handlers, list) or len(handlers) <= 1:
            raise error

    def reset(self, engine: Engine | None = None) -> None:
        self.records = []
        self._stems = set()
        self._staging.discard()

    def _array(self, item: Mapping, key: str, shape_hint: str) -> np.ndarray:
        if key not in item:
            raise KeyError(f"LandmarkReportHandler: the engine's batch/output has no key {key!r} ({shape_hint}); keys: {sorted(item)}")
        return np.asarray(convert_to_numpy(item[key]), dtype=np.float64)

    def _image_name(self, item: Mapping) -> str:
        if self.path_key in item:
            return str(item[self.path_key])
        meta = getattr(item.get(self.image_key), "meta", {})
        if "filename_or_obj" in meta:
            return str(meta["filename_or_obj"])
        raise KeyError(f"LandmarkReportHandler: no {self.path_key!r} key and no filename_or_obj in {self.image_key!r} metadata")

    def collect(self, engine: Engine) -> None:
        """Record the predictions of the current iteration (and write their overlays)."""
        outputs, batches = _items(engine.state.output), _items(engine.state.batch)
        if batches and len(batches) != len(outputs):
            raise ValueError(f"LandmarkReportHandler: {len(batches)} batch items but {len(outputs)} output items")
        for i, out in enumerate(outputs):
            item = {**(batches[i] if batches else {}), **out}
            pred = self._array(item, self.pred_key, "(L, D) predicted mm")
            ref = self._array(item, self.label_key, "(L, D) reference mm")
            spacing = self._array(item, self.spacing_key, "(D,) mm per pixel")
            if pred.shape != ref.shape or pred.shape != (len(self.landmark_names), spacing.size):
                raise ValueError(
                    f"LandmarkReportHandler: pred {pred.shape}, label {ref.shape} and spacing {spacing.shape} do not fit "
                    f"{len(self.landmark_names)} landmarks"
                )
            record = {"image": self._image_name(item), "pred": pred, "ref": ref, "spacing": spacing}
            self.records.append(record)
            if self.overlays and spacing.size == 2 and self.image_key in item and self.grid_key in item:
                self._overlay(record, item)

    def _overlay(self, record: dict, item: Mapping) -> None:
        name = _unique(Path(record["image"]).stem, self._stems)
        matrix = np.asarray(convert_to_numpy(item[self.grid_key]), dtype=np.float64)
        ref_grid = apply_homogeneous(matrix, record["ref"], inverse=True).numpy()
        pred_grid = apply_homogeneous(matrix, record["pred"], inverse=True).numpy()
        size_x, size_y = np.linalg.norm(matrix[:2, :2], axis=0)  # mm per grid pixel along x and y
        save_overlay_png(
            self._staging.folder / "overlays" / f"{name}.png", item[self.image_key], ref_grid, pred_grid, self.landmark_names, size_y / size_x
        )

    def write(self, engine: Engine | None = None) -> dict[str, Any]:
        """Write metrics.json, predictions.csv and sdr_curve.png, then move the report into ``output_dir``;
        return the summary."""
        if not self.records:
            self._staging.discard()
            raise ValueError(f"LandmarkReportHandler: no predictions were collected for {self.output_dir}")
        try:
            summary = self._write(self._staging.folder)
            self._staging.commit()
        except BaseException:
            self._staging.discard()
            raise
        if "mre_mm" not in summary:  # inference on unlabelled images: predictions only
            self.logger.info("one-shot detection on %d images without reference landmarks: predictions in %s", len(self.records), self.output_dir)
            return summary
        sdr = ", ".join(f"{k} mm {v:.1f}%" for k, v in summary["sdr"].items())
        self.logger.info(
            "one-shot detection on %d images: MRE %.3f +/- %.3f mm (%.2f px); SDR %s; reports in %s",
            summary["n_images"], summary["mre_mm"], summary["mre_std_mm"], summary["mre_px"], sdr, self.output_dir,
        )
        return summary

    def _write(self, folder: Path) -> dict[str, Any]:
        preds = np.stack([r["pred"] for r in self.records])
        refs = np.stack([r["ref"] for r in self.records])
        spacings = np.stack([r["spacing"] for r in self.records])[:, None, :]
        errors_mm = radial_errors(preds, refs)
        errors_px = radial_errors(preds / spacings, refs / spacings)
        rows = [
            {"image": r["image"], "landmark": name, "point": physical_to_datalist(r["pred"][j], r["spacing"]), "error_mm": errors_mm[i, j]}
            for i, r in enumerate(self.records)
            for j, name in enumerate(self.landmark_names)
        ]
        write_predictions_csv(folder / "predictions.csv", rows)
        if preds.shape[-1] == 3:
            write_markups_per_image(folder, self.records, self.landmark_names)
        if np.isnan(refs).all():  # inference on unlabelled images: predictions only
            return {"n_images": len(self.records)}
        summary = summarize_errors(errors_mm, errors_px, self.thresholds, self.landmark_names)
        write_metrics_json(folder / "metrics.json", summary, self.template, self.checkpoint)
        save_sdr_curve(folder / "sdr_curve.png", errors_mm, marks=self.thresholds)
        return summary
