"""Ignite handlers of the configs: checkpoint savers, the resume loader and the evaluation report.

:class:`AtomicCheckpointSaver` writes the best and the final model files, each through
:func:`bundle.checkpoints.save_atomically`; :class:`LastCheckpointSaver` writes ``last.pt``, which
:class:`ResumeCheckpointLoader` restores; :class:`CheckpointDirReport` prints where they are;
:class:`TemplateHandler` gives one-shot detection its templates when an evaluation starts;
:class:`LandmarkReportHandler` writes an evaluation's report files (:mod:`bundle.reporting`);
:class:`DeferredSummaryWriter` opens TensorBoard logs at their first value. Only public MONAI and Ignite API is used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ignite.distributed as idist
import numpy as np
import torch
from bundle.checkpoints import CheckpointError, read_checkpoint, save_atomically
from bundle.geometry import apply_homogeneous, physical_to_datalist
from bundle.io_utils import StagedOutputs
from bundle.metrics import DEFAULT_THRESHOLDS, radial_errors, summarize_errors
from bundle.reporting import (
    overlay_png,
    save_sdr_curve,
    unique_name,
    write_markups_per_image,
    write_metrics_json,
    write_png,
    write_predictions_csv,
)
from bundle.templates import with_templates
from ignite.engine import Engine, Events
from ignite.handlers.checkpoint import BaseSaveHandler, Checkpoint
from monai.data import decollate_batch
from monai.handlers import CheckpointLoader
from monai.utils import convert_to_numpy, is_scalar

# --------------------------------------------------------------------------- checkpoints


class AtomicSaveHandler(BaseSaveHandler):
    """Ignite save handler writing every checkpoint to the one file ``dirname/filename`` with
    :func:`bundle.checkpoints.save_atomically` (rank 0): each save replaces the previous file atomically, so
    there is nothing to remove."""

    def __init__(self, dirname: str | os.PathLike, filename: str) -> None:
        self.path = Path(dirname).expanduser() / filename
        # read while every process builds its handlers: ignite's first call synchronises the processes
        self.rank = idist.get_rank()

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_atomically(checkpoint, self.path)

    def remove(self, filename: str) -> None:
        """Nothing to do: the next save replaces the file."""


class AtomicCheckpointSaver:
    """The configs' model saver (in place of MONAI's ``CheckpointSaver``, whose writes are not atomic).

    ``save_final``: the state of ``save_dict`` when the engine completes or fails, to ``final_filename``.
    ``save_key_metric``: after each evaluation whose key metric (``engine.state.key_metric_name``) is the best
    so far, to ``key_metric_filename``; the lowest is best with ``key_metric_negative_sign``. Both are Ignite
    ``Checkpoint`` objects (a single object is saved as its own ``state_dict``) writing through
    :class:`AtomicSaveHandler`. ``state_dict``/``load_state_dict`` carry the key-metric ranking, so that a
    resumed run keeps the best file of the run before it.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        save_dict: dict,
        save_final: bool = False,
        final_filename: str = "model_final.pt",
        save_key_metric: bool = False,
        key_metric_filename: str = "model.pt",
        key_metric_negative_sign: bool = False,
    ) -> None:
        if not save_dict:
            raise ValueError("AtomicCheckpointSaver: save_dict is empty, there is nothing to save")
        self.sign = -1.0 if key_metric_negative_sign else 1.0
        self.logger = logging.getLogger(__name__)
        self.final_checkpoint = self.key_metric_checkpoint = None
        if save_final:
            self.final_checkpoint = Checkpoint(
                save_dict,
                AtomicSaveHandler(save_dir, final_filename),
                score_function=lambda engine: engine.state.iteration,
                score_name="final_iteration",
            )
        if save_key_metric:
            self.key_metric_checkpoint = Checkpoint(
                save_dict,
                AtomicSaveHandler(save_dir, key_metric_filename),
                score_function=self.score,
                score_name="key_metric",
            )

    def score(self, engine: Engine) -> float:
        """The evaluation's key metric, signed so that higher ranks better."""
        name = engine.state.key_metric_name
        value = engine.state.metrics[name]
        if not is_scalar(value):
            raise ValueError(f"the key metric {name} must be a scalar to rank checkpoints, got {value!r}")
        return self.sign * float(value)

    def state_dict(self) -> dict:
        return {} if self.key_metric_checkpoint is None else self.key_metric_checkpoint.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.key_metric_checkpoint is not None and state_dict:
            self.key_metric_checkpoint.load_state_dict(state_dict)

    def attach(self, engine: Engine) -> None:
        if self.final_checkpoint is not None:
            engine.add_event_handler(Events.COMPLETED, self.save_final)
            engine.add_event_handler(Events.EXCEPTION_RAISED, self.save_final_and_raise)
        if self.key_metric_checkpoint is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED, self.key_metric_checkpoint)

    def save_final(self, engine: Engine) -> None:
        """Write the final state (over an earlier final file of this run: one fixed name)."""
        self.final_checkpoint.reset()
        self.final_checkpoint(engine)
        self.logger.info("final checkpoint saved: %s", self.final_checkpoint.save_handler.path)

    def save_final_and_raise(self, engine: Engine, error: Exception) -> None:
        """On an exception: keep the state reached, then raise the exception again."""
        self.save_final(engine)
        raise error


class LastCheckpointSaver:
    """Every ``interval`` epochs, the state of every object of ``save_dict`` in one file, written atomically.

    ``save_dict`` maps names to objects with ``state_dict()`` (network, optimizer, LR scheduler, savers);
    the engine it is attached to is added under ``engine_key`` (the config cannot name the trainer in a
    handler of that trainer); a wrapped (DDP) network is saved unwrapped. Only rank 0 writes. The file
    loads with ``torch.load(weights_only=True)`` and resumes training through MONAI's ``CheckpointLoader``.
    """

    def __init__(
        self, path: str | Path, save_dict: dict[str, Any], interval: int = 1, engine_key: str | None = "trainer"
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        missing = [k for k, v in save_dict.items() if not hasattr(v, "state_dict")]
        if missing:
            raise TypeError(f"save_dict entries {missing} have no state_dict()")
        self.path = Path(path)
        self.save_dict = dict(save_dict)
        self.interval = interval
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        """Save every ``interval`` epochs; the engine itself is saved under ``engine_key`` (unless None)."""
        if self.engine_key is not None:
            self.save_dict[self.engine_key] = engine
        engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.interval), self)

    def __call__(self, engine: Engine) -> None:
        if idist.get_rank() != 0:
            return
        state = {}
        for name, obj in self.save_dict.items():
            if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
                obj = obj.module
            state[name] = obj.state_dict()
        save_atomically(state, self.path)


class CheckpointDirReport:
    """Prints where the training writes its checkpoints when it starts, and the files there when it completes
    (attached last, after the savers; rank 0, whose handlers save)."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        self.ckpt_dir = Path(ckpt_dir).expanduser().resolve()

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self.started)
        engine.add_event_handler(Events.COMPLETED, self.completed)

    def started(self, engine: Engine) -> None:
        print(f"training writes its checkpoints to {self.ckpt_dir}", flush=True)

    def completed(self, engine: Engine) -> None:
        files = ", ".join(sorted(p.name for p in self.ckpt_dir.glob("*.pt")))
        print(f"training finished: checkpoints in {self.ckpt_dir}: {files}", flush=True)


class ResumeCheckpointLoader(CheckpointLoader):
    """MONAI's ``CheckpointLoader`` that also restores the engine it is attached to (under ``engine_key``).

    The trainer's epoch and iteration come back with the network, optimizer and scheduler, so a resumed
    run goes on from the epoch after the last one saved.
    """

    def __init__(self, load_path: str, load_dict: dict[str, Any], engine_key: str = "trainer", **kwargs: Any) -> None:
        super().__init__(load_path=load_path, load_dict=dict(load_dict), **kwargs)
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        self.load_dict[self.engine_key] = engine
        super().attach(engine)

    def __call__(self, engine: Engine) -> None:
        checkpoint = read_checkpoint(self.load_path, self.map_location or "cpu", "resume checkpoint")
        missing = [k for k in self.load_dict if k not in checkpoint]
        if missing:
            held = sorted(map(str, checkpoint))
            shown = f"{held[:5]} and {len(held) - 5} more" if len(held) > 5 else str(held)
            raise CheckpointError(
                f"resume checkpoint {self.load_path} lacks {missing} (it holds {shown}): "
                "resume from the last.pt that training writes, not from a weights file such as model.pt"
            )
        changed = _changed_settings(checkpoint, self.load_dict, engine)
        if changed:
            raise ValueError(
                f"cannot resume from {self.load_path} with other settings: "
                + "; ".join(f"{key} is {new!r}, the resumed run's {old!r}" for key, new, old in changed)
                + ". A resumed run keeps its settings: resume with the same values, or start a new run in another "
                "ckpt_dir"
            )
        super().__call__(engine)


# what a resumed run cannot change, as the config names it: optimiser and LR-scheduler settings, epoch length
_SETTING_NAMES = {"initial_lr": "learning_rate", "T_max": "epochs"}
_SCHEDULE_STATE = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "base_lrs", "_is_initial"}


def _changed_settings(checkpoint: Mapping, load_dict: Mapping[str, Any], engine: Engine) -> list[tuple[str, Any, Any]]:
    """(key, configured, resumed) for each setting of the run being resumed that the config now gives otherwise."""
    pairs = []  # (what, configured state, resumed state, state entries that are progress, not settings)
    optimizer, scheduler = load_dict.get("optimizer"), load_dict.get("lr_scheduler")
    if optimizer is not None and "optimizer" in checkpoint:
        groups = zip(optimizer.state_dict()["param_groups"], checkpoint["optimizer"].get("param_groups", []))
        pairs += [("optimizer", new, old, {"params", "lr"}) for new, old in groups]
    if scheduler is not None and "lr_scheduler" in checkpoint:
        pairs.append(("lr_scheduler", scheduler.state_dict(), checkpoint["lr_scheduler"], _SCHEDULE_STATE))
    changed = []
    for what, new, old, progress in pairs:
        for key in sorted(set(new) & set(old) - progress):
            entry = (_SETTING_NAMES.get(key, f"{what} {key}"), new[key], old[key])
            if new[key] != old[key] and entry not in changed:  # one entry for the same change in several groups
                changed.append(entry)
    saved_length = checkpoint.get("trainer", {}).get("epoch_length")
    if saved_length is not None and engine.state.epoch_length not in (None, saved_length):
        changed.append(("epoch_length", engine.state.epoch_length, saved_length))
    return changed


def resume_handlers(resume: str | None, load_dict: dict[str, Any], device: torch.device | str = "cpu") -> list:
    """``[ResumeCheckpointLoader]`` for the checkpoint ``resume`` (see :func:`bundle.checkpoints.resume_path`),
    or ``[]`` when None."""
    if resume is None:
        return []
    return [ResumeCheckpointLoader(load_path=resume, load_dict=load_dict, map_location=device)]


# --------------------------------------------------------------------------- the evaluation report


def _items(data: Any) -> list[dict]:
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
      - 2D overlays only: ``image_key`` ("image") the ``(1, W, H)`` grid image and ``grid_key``
        ("grid_to_physical") its ``(3, 3)`` grid-to-mm matrix; items without them get no overlay.
    At ``EPOCH_STARTED`` the collection is reset; at ``COMPLETED`` it writes ``output_dir``/metrics.json,
    predictions.csv, sdr_curve.png and overlays/<image stem>.png (2D) or <image stem>.mrk.json (3D, the
    predictions as a 3D Slicer point list in RAS), and logs MRE and SDR. When no image has
    a reference landmark (inference on new images), only predictions.csv and the overlays are written.
    Everything is written at ``COMPLETED`` (the overlays drawn as their images come, kept in memory) into a
    staging folder beside ``output_dir``, which replaces the previous run's report files only when complete
    (:class:`bundle.io_utils.StagedOutputs`): after a failure ``output_dir`` is as it was, and files that no
    run wrote are never touched.
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
        self._overlays: dict[str, bytes] = {}  # overlay file name -> PNG, written with the report
        self._staging = StagedOutputs(self.output_dir)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self.reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.collect)
        engine.add_event_handler(Events.COMPLETED, self.write)

    def reset(self, engine: Engine | None = None) -> None:
        self.records = []
        self._stems = set()
        self._overlays = {}
        self._staging.discard()

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
        """Record the predictions of the current iteration (and draw their overlays)."""
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
                    f"LandmarkReportHandler: pred {pred.shape}, label {ref.shape} and spacing {spacing.shape} do not "
                    f"fit {len(self.landmark_names)} landmarks"
                )
            record = {"image": self._image_name(item), "pred": pred, "ref": ref, "spacing": spacing}
            self.records.append(record)
            if self.overlays and spacing.size == 2 and self.image_key in item and self.grid_key in item:
                self._overlay(record, item)

    def _overlay(self, record: dict, item: Mapping) -> None:
        name = unique_name(Path(record["image"]).stem, self._stems)
        matrix = np.asarray(convert_to_numpy(item[self.grid_key]), dtype=np.float64)
        ref_grid = apply_homogeneous(matrix, record["ref"], inverse=True).numpy()
        pred_grid = apply_homogeneous(matrix, record["pred"], inverse=True).numpy()
        size_x, size_y = np.linalg.norm(matrix[:2, :2], axis=0)  # mm per grid pixel along x and y
        self._overlays[f"{name}.png"] = overlay_png(
            item[self.image_key], ref_grid, pred_grid, self.landmark_names, size_y / size_x, where=f"overlay {name}.png"
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
            self.logger.info(
                "one-shot detection on %d images without reference landmarks: predictions in %s",
                len(self.records),
                self.output_dir,
            )
            return summary
        sdr = ", ".join(f"{k} mm {v:.1f}%" for k, v in summary["sdr"].items())
        self.logger.info(
            "one-shot detection on %d images: MRE %.3f +/- %.3f mm (%.2f px); SDR %s; reports in %s",
            summary["n_images"],
            summary["mre_mm"],
            summary["mre_std_mm"],
            summary["mre_px"],
            sdr,
            self.output_dir,
        )
        return summary

    def _write(self, folder: Path) -> dict[str, Any]:
        preds = np.stack([r["pred"] for r in self.records])
        refs = np.stack([r["ref"] for r in self.records])
        spacings = np.stack([r["spacing"] for r in self.records])[:, None, :]
        errors_mm = radial_errors(preds, refs)
        errors_px = radial_errors(preds / spacings, refs / spacings)
        rows = [
            {
                "image": r["image"],
                "landmark": name,
                "point": physical_to_datalist(r["pred"][j], r["spacing"]),
                "error_mm": errors_mm[i, j],
            }
            for i, r in enumerate(self.records)
            for j, name in enumerate(self.landmark_names)
        ]
        write_predictions_csv(folder / "predictions.csv", rows)
        for name, png in self._overlays.items():
            write_png(folder / "overlays" / name, png)
        if preds.shape[-1] == 3:
            write_markups_per_image(folder, self.records, self.landmark_names)
        if np.isnan(refs).all():  # inference on unlabelled images: predictions only
            return {"n_images": len(self.records)}
        summary = summarize_errors(errors_mm, errors_px, self.thresholds, self.landmark_names)
        write_metrics_json(folder / "metrics.json", summary, self.template, self.checkpoint)
        save_sdr_curve(folder / "sdr_curve.png", errors_mm, marks=self.thresholds)
        return summary


# --------------------------------------------------------------------------- TensorBoard


class DeferredSummaryWriter:
    """A TensorBoard ``SummaryWriter`` of ``log_dir`` opened at its first use (the first value logged), for the
    ``summary_writer`` of MONAI's TensorBoard handlers: building the handler writes nothing."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = str(log_dir)
        self._writer = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocol lookups do not open the writer
            raise AttributeError(name)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return getattr(self._writer, name)


# --------------------------------------------------------------------------- templates


class TemplateHandler:
    """Ignite handler resolving the templates of one-shot (k-shot) detection at the first ``Events.STARTED``.

    ``templates`` returns the template items (the configs' ``evaluate#choose_templates``: choosing one may take
    many network passes, so it runs when the evaluation starts, not when the config is parsed). They are set,
    prepared by ``preprocessing``, on ``inferer`` (:func:`bundle.templates.with_templates`) and, as the list of
    their images, on ``report`` (a :class:`LandmarkReportHandler`, for metrics.json) when given.
    """

    def __init__(
        self,
        templates: Callable[[], list[dict]],
        inferer,
        preprocessing,
        device: torch.device | str,
        report: LandmarkReportHandler | None = None,
    ) -> None:
        self.templates = templates
        self.inferer, self.preprocessing, self.device, self.report = inferer, preprocessing, device, report
        self.items: list[dict] | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine: Engine) -> None:
        if self.items is not None:
            return
        self.items = list(self.templates())
        with_templates(self.inferer, self.items, self.preprocessing, self.device)
        if self.report is not None:
            self.report.template = [t["image"] for t in self.items]
