""":class:`LandmarkReportHandler`: an evaluation's report files (:mod:`bundle.reporting`)."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch.distributed as dist
from bundle.data.annotations import image_stem
from bundle.data.images import load_grey
from bundle.distributed import leave_together, rank, world_size
from bundle.geometry import physical_to_datalist
from bundle.io_utils import StagedOutputs, write_json_atomic
from bundle.journal import PredictionJournal, link_or_copy
from bundle.metrics import DEFAULT_THRESHOLDS, landmark_offsets, radial_errors, summarize_errors
from bundle.reporting import (
    overlay_png,
    run_provenance,
    save_sdr_curve,
    unique_name,
    write_markups_per_image,
    write_metrics_json,
    write_overview_html,
    write_png,
    write_predictions_csv,
)
from ignite.engine import Engine, Events
from monai.data import decollate_batch
from monai.utils import convert_to_numpy

logger = logging.getLogger(__name__)


def batch_items(data: Any) -> list[dict]:
    """Per-image dicts from an engine's (possibly decollated) ``state.output`` / ``state.batch``."""
    if data is None:
        return []
    if isinstance(data, Mapping):
        return [dict(d) for d in decollate_batch(dict(data))]
    if isinstance(data, (list, tuple)) and all(isinstance(d, Mapping) for d in data):
        return [dict(d) for d in data]
    raise TypeError(f"expected a dict or a list of dicts per image, got {type(data).__name__}")


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
      - 2D overlays: drawn from the image's file (``path_key`` / ``filename_or_obj``) at its own resolution.
    Each image's predictions go into the run's :class:`bundle.journal.PredictionJournal` (``output_dir/.journal``)
    as it finishes, with its 2D overlay when the journal's ``overlays`` asks for one (drawn from the image's file at
    its own resolution); nothing of an image is kept in memory. At ``COMPLETED`` the report is written from the
    journal, in the order of the run's images (under torchrun by the process of rank 0, once every process is done:
    each predicted its share): ``output_dir``/metrics.json, predictions.csv, sdr_curve.png and overlays/<image
    stem>.png with overview.html, a page showing them all (2D), or <image stem>.mrk.json (3D, the predictions as a 3D
    Slicer point list in RAS), and
    MRE and SDR are logged. When no image has a reference landmark (inference on new images), predictions.csv, the
    overlays (markups) and provenance.json are written.
    metrics.json and provenance.json say what made the predictions: ``predictor.provenance()`` as the report is
    written (:class:`bundle.pipeline.predictor.Predictor`: its template images are set by
    :class:`bundle.handlers.templates.TemplateHandler` when the templates are chosen as the run starts); without a
    ``predictor``, template matching from unnamed templates (:func:`bundle.reporting.run_provenance`).
    The report files are written into a staging folder beside ``output_dir``, which replaces the previous run's
    report files only when complete (:class:`bundle.io_utils.StagedOutputs`): after a failure the report files of
    ``output_dir`` are as they were (the journal holds what was predicted), and files that no run wrote are never
    touched. Each report file is checked (:meth:`bundle.io_utils.StagedOutputs.check`) as soon as its name is known
    (predictions.csv as the epoch starts, metrics.json and sdr_curve.png with the first labelled image, an overlay
    or markup file with its image), so that a user's file in the way is refused before the work; provenance.json
    as the epoch starts when ``unlabelled`` (inferring's images, which carry no landmarks), else when the report is
    written (only then is it known that no image had a reference landmark).

    Args:
        output_dir: the report's folder.
        landmark_names: the datalist's, in its order.
        predictor: what made the predictions (its ``provenance()``); None: template matching from unnamed templates.
        thresholds: the SDR's radii in mm.
        unlabelled: the images carry no landmarks (inferring): provenance.json is checked as the epoch starts, and
            the report keeps no image's landmarks in memory (no metrics).
        journal: where the predictions go as they come (inferring: one that a later run may reuse), which says
            whether the 2D overlays and overview.html are written (its ``overlays``); None: a new one in
            ``output_dir``, not reused, with overlays.
        pred_key, label_key, spacing_key, path_key, image_key: the items' keys of the contract above.
        logger_name: the logger of the MRE and SDR lines.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        landmark_names: Sequence[str],
        predictor: Any = None,
        thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
        unlabelled: bool = False,
        journal: PredictionJournal | None = None,
        pred_key: str = "pred",
        label_key: str = "label",
        spacing_key: str = "spacing",
        path_key: str = "image_path",
        image_key: str = "image",
        logger_name: str = "bundle.reporting",
    ) -> None:
        self.output_dir = Path(output_dir)
        self.landmark_names = [str(n) for n in landmark_names]
        self.predictor = predictor
        self.thresholds = tuple(float(t) for t in thresholds)
        self.unlabelled = unlabelled
        self.pred_key, self.label_key, self.spacing_key = pred_key, label_key, spacing_key
        self.path_key, self.image_key = path_key, image_key
        self.logger = logging.getLogger(logger_name)
        self.journal = journal if journal is not None else PredictionJournal(self.output_dir)
        self.collected = 0  # the images this process predicted in this run
        self._markups: set[str] = set()  # the 3D markup files' stems (as write_markups_per_image names them)
        self._labelled = False  # whether an image with reference landmarks came
        self._staging = StagedOutputs(self.output_dir)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self.reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.collect)
        engine.add_event_handler(Events.COMPLETED, self.write)
        engine.add_event_handler(Events.EXCEPTION_RAISED, self.failed)

    def failed(self, engine: Engine, error: BaseException) -> None:
        """A failed run: the staging folder goes and the error is raised again. Ignite calls only the first
        ``EXCEPTION_RAISED`` handler that raises, so the configs attach this handler before MONAI's StatsHandler.
        The journal keeps what a later run reuses (:meth:`bundle.journal.PredictionJournal.abandon`)."""
        self._staging.discard()
        self.journal.abandon()
        raise error

    def reset(self, engine: Engine | None = None) -> None:
        self.collected = 0
        self._markups = set()
        self._labelled = False
        self._staging.discard()
        self._staging.check(["predictions.csv", "provenance.json"] if self.unlabelled else ["predictions.csv"])
        self.journal.start()

    def _array(self, item: Mapping, key: str, shape_hint: str) -> np.ndarray:
        if key not in item:
            raise KeyError(
                f"LandmarkReportHandler: the engine's batch/output has no key {key!r} ({shape_hint}); "
                f"keys: {sorted(item)}"
            )
        return np.asarray(convert_to_numpy(item[key]), dtype=np.float64)

    def _image_name(self, item: Mapping) -> str:
        if self.path_key in item:
            return str(item[self.path_key])
        meta = getattr(item.get(self.image_key), "meta", {})
        if "filename_or_obj" in meta:
            return str(meta["filename_or_obj"])
        raise KeyError(
            f"LandmarkReportHandler: no {self.path_key!r} key and no filename_or_obj in {self.image_key!r} metadata"
        )

    def collect(self, engine: Engine) -> None:
        """Record the predictions of the current iteration (and draw their overlays); on a failure (a user's file in
        the way) the staging folder goes (a failure elsewhere leaves it to the next run's start or the process's
        end, :class:`bundle.io_utils.StagedOutputs`)."""
        try:
            self._collect(engine)
        except BaseException:
            self._staging.discard()
            raise

    def _collect(self, engine: Engine) -> None:
        outputs, batches = batch_items(engine.state.output), batch_items(engine.state.batch)
        if batches and len(batches) != len(outputs):
            raise ValueError(f"LandmarkReportHandler: {len(batches)} batch items but {len(outputs)} output items")
        for i, out in enumerate(outputs):
            item = {**(batches[i] if batches else {}), **out}
            pred = self._array(item, self.pred_key, "(L, D) predicted mm")
            ref = self._array(item, self.label_key, "(L, D) reference mm")
            spacing = self._array(item, self.spacing_key, "(D,) mm per pixel")
            if pred.shape != ref.shape or pred.shape != (len(self.landmark_names), spacing.size):
                raise ValueError(
                    f"LandmarkReportHandler: pred {pred.shape}, label {ref.shape} and spacing {spacing.shape} do not "
                    f"fit {len(self.landmark_names)} landmarks"
                )
            image = self._image_name(item)
            if not self._labelled and np.isfinite(ref).any():  # the first labelled image: a scored run
                self._staging.check(["metrics.json", "sdr_curve.png"])
                self._labelled = True
            if spacing.size == 3:
                self._staging.check([f"{unique_name(image_stem(image), self._markups)}.mrk.json"])
            overlay = self._overlay(image, pred, ref, spacing) if self.journal.overlays and spacing.size == 2 else None
            self.journal.append(image, pred, ref, spacing, overlay)
            self.collected += 1

    def _overlay(self, image: str, pred: np.ndarray, ref: np.ndarray, spacing: np.ndarray) -> Path:
        """Draw the image's overlay from its file, at its own resolution, into the journal; its path there."""
        path, name = self.journal.overlay_path(image), self.journal.overlay_name(image)
        self._staging.check([f"overlays/{name}", "overview.html"])
        pixels, _ = load_grey(image, 2)
        png = overlay_png(
            pixels,
            physical_to_datalist(ref, spacing),
            physical_to_datalist(pred, spacing),
            self.landmark_names,
            float(spacing[1] / spacing[0]),
            where=f"overlay {name}",
        )
        write_png(path, png)
        return path

    def write(self, engine: Engine | None = None) -> dict[str, Any]:
        """Write metrics.json, predictions.csv and sdr_curve.png from the journal, then move the report into
        ``output_dir``; return the summary (under torchrun: rank 0's; the others return an empty one)."""
        self.journal.close()
        if world_size() > 1:
            dist.barrier()  # every process's predictions are in the journal
            if rank() != 0:
                self._staging.discard()
                return {}
        try:
            summary = self._write(self._staging.folder)
            self._staging.commit()
        except BaseException:
            self._staging.discard()
            raise
        self.journal.discard()
        if "mre_mm" not in summary:  # inference on unlabelled images: predictions only
            self.logger.info(
                "landmarks (%s) on %d images without reference landmarks: predictions in %s",
                self.provenance()["pipeline"],
                summary["n_images"],
                self.output_dir,
            )
            return summary
        sdr = ", ".join(f"{k} mm {v:.1f}%" for k, v in summary["sdr"].items())
        self.logger.info(
            "landmarks (%s) on %d images: MRE %.3f +/- %.3f mm (%.2f px); SDR %s; reports in %s",
            self.provenance()["pipeline"],
            summary["n_images"],
            summary["mre_mm"],
            summary["mre_std_mm"],
            summary["mre_px"],
            sdr,
            self.output_dir,
        )
        return summary

    def provenance(self) -> dict[str, Any]:
        """What made the predictions (metrics.json, provenance.json): the predictor's, as it stands now."""
        if self.predictor is None:
            return run_provenance("templates", "", "")
        return self.predictor.provenance()

    def _write(self, folder: Path) -> dict[str, Any]:
        """The report files from the journal's records, one image at a time: the predictions' rows streamed, the
        overlays linked in; the landmarks kept for the metrics unless ``unlabelled``."""
        provenance = self.provenance()
        kept: list[dict] = []  # the records the metrics and the 3D markups need
        captions: dict[str, tuple[str, float | None]] = {}
        labelled = False
        n_images = 0

        records = self.journal.records()
        first = next(records, None)
        if first is None:
            raise ValueError(f"LandmarkReportHandler: no predictions were collected for {self.output_dir}")

        def rows():
            nonlocal labelled, n_images
            for record in itertools.chain([first], records):
                n_images += 1
                errors = radial_errors(record["pred"], record["ref"])
                labelled = labelled or bool(np.isfinite(record["ref"]).any())
                overlay = self.journal.overlay_name(record["image"])
                if record["overlay"] is not None and overlay not in captions:  # an image listed twice: once
                    link_or_copy(record["overlay"], folder / "overlays" / overlay)
                    mre = float(np.nanmean(errors)) if np.isfinite(errors).any() else None
                    captions[overlay] = (record["image"], mre)
                if not self.unlabelled or record["spacing"].size == 3:
                    kept.append({k: record[k] for k in ("image", "pred", "ref", "spacing")})
                for j, name in enumerate(self.landmark_names):
                    point = physical_to_datalist(record["pred"][j], record["spacing"])
                    yield {"image": record["image"], "landmark": name, "point": point, "error_mm": errors[j]}

        write_predictions_csv(folder / "predictions.csv", rows())
        if captions:
            write_overview_html(folder / "overview.html", captions, self.landmark_names, provenance["pipeline"])
        if kept and kept[0]["spacing"].size == 3:
            write_markups_per_image(folder, kept, self.landmark_names)
        if not labelled:  # inference on unlabelled images: predictions only
            write_json_atomic(folder / "provenance.json", {**provenance, "n_images": n_images})
            return {"n_images": n_images}
        preds = np.stack([r["pred"] for r in kept])
        refs = np.stack([r["ref"] for r in kept])
        spacings = np.stack([r["spacing"] for r in kept])[:, None, :]
        errors_mm = radial_errors(preds, refs)
        errors_px = radial_errors(preds / spacings, refs / spacings)
        summary = {
            **summarize_errors(errors_mm, errors_px, self.thresholds, self.landmark_names),
            **landmark_offsets(preds - refs, self.landmark_names),
        }
        write_metrics_json(folder / "metrics.json", summary, provenance)
        save_sdr_curve(folder / "sdr_curve.png", errors_mm, marks=self.thresholds)
        return summary


def run_reported(evaluator: Engine, report: LandmarkReportHandler) -> None:
    """Run ``evaluator`` over its images, or, when this process has none (an earlier run into the same output folder
    predicted them all, or torchrun started more processes than there are images left), write ``report`` from its
    journal as the run would; then the processes leave together (:func:`bundle.distributed.leave_together`). An
    evaluator with a key metric (evaluating) needs an image in every process, the processes computing the metric
    together: ValueError.

    Args:
        evaluator: the command's evaluator (MONAI's ``SupervisedEvaluator``), ``report`` among its handlers.
        report: its report handler.
    """
    if len(evaluator.data_loader) > 0:
        evaluator.run()
    elif evaluator.state.key_metric_name is not None:
        raise ValueError(
            f"{world_size()} processes for {len(report.journal.items)} test images: every process of an evaluation "
            "needs one, torchrun's --nproc_per_node may be at most the number of test images"
        )
    else:
        report.reset()
        report.write()
    leave_together()
