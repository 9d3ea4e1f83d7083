"""What the infer and train tasks share: the bundle's configs, the served checkpoint, the datastore's saved labels
as templates and the bundle's own templates (resolved lazily, once, and cached on disk for the training process).

Coordinates. A 2D image's pixel ``(x, y)`` (column, row; the datalist convention) lies where 3D Slicer puts it
when it loads the file: LPS ``(x * sx, y * sy, 0)`` for PNG / JPEG / TIFF (no origin, spacing 1 unless the
datalist gives one), and for DICOM the header's frame (ImagePositionPatient, ImageOrientationPatient, pixel
spacing; what ITK reads and ``XRayDicomd`` keeps as ``original_affine``). Saved labels (Slicer ``.mrk.json`` /
``.fcsv``) are mapped back to pixels through the same frame.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import threading
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from bundle.checkpoints import load_weights
from bundle.command_errors import root_cause
from bundle.configs import as_number, bundle_parser, config_files
from bundle.data.datalist import DatalistError, read_json
from bundle.data.dicom import dicom_tags
from bundle.data.images import detached_data_file
from bundle.data.markups import ControlPoint, check_label_names, label_key, read_markups
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer
from bundle.inferers.refinement import RADIUS_MM, DescriptorRefinement
from bundle.io_utils import error_summary, write_json_atomic
from bundle.pipeline.choice import (
    SHIPPED_TEMPLATE,
    builtin_templates,
    choose_detector,
    choose_refinement,
    refinement_setting,
)
from bundle.pipeline.detector_data import base_grid
from bundle.pipeline.detector_data import detector_info as recorded_detector_info
from bundle.pipeline.predictor import matching_inferer
from bundle.template_file import join_templates, load_template
from bundle.templates.features import compute_template
from bundle.templates.resolution import resolve_templates
from bundle.transforms.landmarks import LandmarkTargets, file_frame, file_positions, outside_excess, template_problem

from .slicer import box_points

logger = logging.getLogger(__name__)
PREDICTORS = ("auto", "detector", "templates")
IMAGE_EXTENSIONS = (
    "*.png",
    "*.jpg",
    "*.jpeg",
    "*.bmp",
    "*.tif",
    "*.tiff",
    "*.dcm",
    "*.nii.gz",
    "*.nii",
    "*.nrrd",
    "*.mha",
)
# ".json" first: the datastore keeps the LAST matching extension, so "a.mrk.json" gets ".mrk.json"
LABEL_EXTENSIONS = ("*.json", "*.mrk.json", "*.fcsv")
FINAL_TAG = "final"
ITEM_KEYS = ("image", "landmarks", "spacing", "id")  # what of a datastore item a template needs (not its label file)


class ImageError(ValueError):
    """An image the bundle cannot read (the message names it)."""


def check_upload(path: str, name: str) -> None:
    """Refuse (:class:`ImageError`) an uploaded MetaImage or NRRD header that reads its pixels from another file
    (:func:`bundle.data.images.detached_data_file`): only the uploaded file is the client's (a file beside it in the
    server's temp dir is another request's upload)."""
    data_file = detached_data_file(Path(path))
    if data_file is not None:
        raise ImageError(
            f"upload {name!r}: its header reads the pixel data from another file, {data_file!r}: upload the image as "
            "one file (ElementDataFile = LOCAL, or a .nrrd / .mha holding its data)"
        )


class LabelError(ValueError):
    """A saved label that is not a usable landmark file (the message names it)."""


def file_key(path: str | Path) -> tuple[str, int, int]:
    """Identity of a file's current content for caches: path, mtime (ns) and size."""
    st = os.stat(path)
    return (str(path), st.st_mtime_ns, st.st_size)


def labels_key(labelled: Sequence[dict]) -> tuple:
    """What of saved labels a result computed from them depends on: each image's id and landmarks."""
    return tuple((it["id"], json.dumps(it["landmarks"])) for it in labelled)


def datalist_dims(path: Path) -> int:
    """The ``spatial_dims`` of the datalist at ``path`` (2 when the file does not exist yet: the embedded
    synthetic 2D set, generated on start)."""
    if not path.is_file():
        return 2
    content = read_json(path, "datalist")
    dims = content.get("spatial_dims") if isinstance(content, dict) else None
    if dims not in (2, 3):
        raise DatalistError(f"{path}: 'spatial_dims' must be 2 or 3, got {dims!r}")
    return int(dims)


def resolve_device(value: str | None) -> torch.device:
    """The app's device (conf key ``device``): ``cpu``, ``cuda`` or ``cuda:N``; default ``cuda`` when available,
    else ``cpu``. One that this machine lacks raises ValueError naming it."""
    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"conf device {value!r}: not a device ({e}); expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"conf device {value!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"conf device {value!r}: this machine has no CUDA device (use cpu)")
        if (device.index or 0) >= count:
            raise ValueError(
                f"conf device {value!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def device_expression(device: torch.device) -> str:
    """``device`` as a config expression of the bundle (its ``device`` key)."""
    return f"$torch.device({str(device)!r})"


# the niceness of the app's background work (trainings' child processes, pseudo-templates, auto's choice): on cores
# that it shares with the server, suggestions come first
BACKGROUND_NICENESS = 10


def lower_priority(pid: int, what: str) -> None:
    """Give process or thread ``pid`` (``what`` it is, for the warning) ``BACKGROUND_NICENESS`` where the system has
    niceness. The threads it starts later inherit it."""
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, BACKGROUND_NICENESS)
        except OSError as e:  # a process that has already ended, or a system that refuses
            logger.warning(f"{what} {pid} keeps its priority: {e}")


# set when the process ends: background work stops between its steps (check_stopping), and the process waits for it
# (a process that ends while a daemon thread runs the network is aborted by PyTorch)
STOPPING = threading.Event()
STOP_WAIT_S = 60.0


class AppStopping(RuntimeError):
    """Background work given up because the process is ending."""


def check_stopping() -> None:
    """Raise :class:`AppStopping` once the process is ending (called by background work between its steps)."""
    if STOPPING.is_set():
        raise AppStopping("the app is stopping")


def stoppable(transform: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``transform`` calling :func:`check_stopping` first: work that prepares its items one by one with it (the
    bundle's pseudo-template choice, :func:`bundle.templates.resolution.resolve_templates`) stops between items."""

    def run(data: Any) -> Any:
        check_stopping()
        return transform(data)

    return run


class BackgroundValue:
    """A value computed in the background for the newest key asked for, by one daemon thread at a time at
    ``BACKGROUND_NICENESS``; the last computed ``(key, value)`` stays readable meanwhile. A failure is logged and gives
    ``fallback`` for its key (computed again once another key is asked for). When the process ends, the computation
    running is waited for (up to ``STOP_WAIT_S``; ``compute`` should call :func:`check_stopping` between its steps)."""

    _instances: weakref.WeakSet[BackgroundValue] = weakref.WeakSet()

    def __init__(self, name: str, compute: Callable[..., Any], fallback: Any = None) -> None:
        self.name, self.compute, self.fallback = name, compute, fallback
        self._lock = threading.Lock()
        self._last: tuple[Any, Any] | None = None
        self._wanted: tuple[Any, tuple] | None = None
        self._worker: threading.Thread | None = None
        BackgroundValue._instances.add(self)

    @classmethod
    def stop_all(cls, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop every background computation (:data:`STOPPING`) and wait for each, ``timeout_s`` in all."""
        STOPPING.set()
        deadline = time.monotonic() + timeout_s
        for value in list(cls._instances):
            with value._lock:
                worker = value._worker
            if worker is not None:
                worker.join(max(0.0, deadline - time.monotonic()))

    def get(self, key: Any, *args: Any) -> tuple[Any, Any] | None:
        """The last computed ``(key, value)`` (None before the first). Unless its key is ``key``, ``compute(*args)`` is
        wanted for ``key``: started now, or after the computation running (a newer wish replaces an older one)."""
        with self._lock:
            if self._last is None or self._last[0] != key:
                self._wanted = (key, args)
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, name=self.name, daemon=True)
                    self._worker.start()
            return self._last

    def pending(self) -> bool:
        """Whether a computation is running or wanted."""
        with self._lock:
            return self._worker is not None

    def _work(self) -> None:
        lower_priority(threading.get_native_id(), f"the {self.name} thread")
        try:
            while True:
                with self._lock:
                    wanted = self._wanted
                    if wanted is None or (self._last is not None and self._last[0] == wanted[0]) or STOPPING.is_set():
                        return
                key, args = wanted
                try:
                    value = self.compute(*args)
                except AppStopping:
                    return
                except Exception:
                    logger.exception(f"{self.name}: not computed")
                    value = self.fallback
                with self._lock:
                    self._last = (key, value)
        finally:
            with self._lock:
                self._worker = None


atexit.register(BackgroundValue.stop_all)


def cause_of(error: BaseException, path: str | Path, name: str) -> str:
    """``<type>: <first line>`` of the root cause of ``error`` (:func:`bundle.command_errors.root_cause`: MONAI wraps a
    transform's error in ``RuntimeError("applying transform <object>")``, and a reader's message holds every reader's
    traceback), the server's ``path`` named ``name``."""
    return error_summary(root_cause(error)).replace(str(path), name)


class BundleContext:
    """The bundle as the app uses it: configs, device, preprocessing, network and templates (all lazy)."""

    def __init__(
        self,
        bundle_root: Path,
        datalist: str | None,
        shipped_ckpt: Path | None,
        model_dir: Path,
        device: str | None = None,
        pseudo_templates: str | int | None = None,
        xfeat_refinement: str | bool = "auto",
    ) -> None:
        """``datalist``: the bundle's templates and landmark names come from it; None: the built-in templates
        (``models/template_features.pt``, the shipped weights' features of the cephalometric templates, with their
        19 names), as ``inferring --pipeline templates`` uses them. ``shipped_ckpt``: the weights served until a
        training publishes others; None: the evaluation config's ``ckpt_path`` (2D: the shipped ``models/model.pt``; 3D:
        ``output/models/ct3d/model.pt``, where the default 3D training writes). ``device``: see
        :func:`resolve_device`. ``pseudo_templates``: how many pseudo-templates join few saved labels
        (:meth:`pseudo_templates`; None: the evaluation config's ``pseudo_templates``, 0: none). ``xfeat_refinement``:
        whether XFeat's fine step follows the detector (:meth:`refinement`; ``auto``, ``true``, ``false``)."""
        self.device = resolve_device(device)
        self.bundle_root = Path(bundle_root)
        self.datalist = Path(datalist).resolve() if datalist else None
        self.builtin_template_path = None if self.datalist else self.bundle_root / SHIPPED_TEMPLATE
        self.model_dir = Path(model_dir)
        self.served_path = self.model_dir / "model.pt"
        self.detector_path = self.model_dir / "detector.pt"
        self.detector_info_path = self.model_dir / "detector.json"
        self.templates_cache = self.model_dir / "bundle_templates.json"
        self._lock = threading.RLock()
        self.spatial_dims = datalist_dims(self.datalist) if self.datalist else 2
        # the bundle's configs of the datalist's spatial_dims: training; evaluation (the datalist's template(s);
        # inference.yaml is standalone); the stage-2 heatmap detector fine-tuned on human labels (`finetune.yaml`)
        self.train_configs = config_files("train", self.spatial_dims)
        self.detector_configs = config_files("finetune", self.spatial_dims)
        # what every parser of the app sets: the device, and the datalist or (below) the built-in templates' names
        self.overrides: dict[str, Any] = {"device": device_expression(self.device)}
        self.xfeat_refinement = refinement_setting(xfeat_refinement, self.spatial_dims, "--conf xfeat_refinement")
        if self.datalist:
            self.overrides["datalist"] = str(self.datalist)
        if pseudo_templates is not None:
            self.overrides["pseudo_templates"] = as_number(
                int(pseudo_templates) if str(pseudo_templates).strip().isdigit() else pseudo_templates,
                "conf pseudo_templates",
                minimum=0,
                integer=True,
            )
        overrides = dict(self.overrides)
        if shipped_ckpt is not None:
            overrides["ckpt_path"] = str(shipped_ckpt)
        self.parser = bundle_parser(config_files("evaluate", self.spatial_dims), self.bundle_root, **overrides)
        self.shipped_ckpt = Path(self.parser.get_parsed_content("ckpt_path")).resolve()
        if not self.served_checkpoint().is_file():
            raise FileNotFoundError(
                f"no network weights at {self.shipped_ckpt}: give --conf ckpt_path"
                + (" (3D: the default 3D training writes output/models/ct3d/)" if self.spatial_dims == 3 else "")
            )
        if self.datalist:
            self.parser.get_parsed_content("ensure_data")  # as the commands: the embedded data set when missing
        else:  # the built-in templates' names, read once and refused for other weights
            self.overrides["landmark_names"] = self._check_builtin(self.shipped_ckpt)["landmark_names"]
            self.parser["landmark_names"] = self.overrides["landmark_names"]
        self.names: list[str] = list(self.parser.get_parsed_content("landmark_names"))
        check_label_names(self.names)  # saved labels name their points: names they cannot tell apart are refused
        self.shipped_detector = self._shipped_detector()
        self.template_combine = str(self.parser.get_parsed_content("template_combine"))
        self.min_peak = float(self.parser.get_parsed_content("detector_min_peak"))
        self.min_match_ratio = float(self.parser.get_parsed_content("match_min_ratio"))
        # the template choice of the evaluating command (the keyword arguments of its evaluate#choose_templates call of
        # bundle.templates.resolution.resolve_templates, but the data, network and device), for the pseudo-templates
        call = "evaluate#choose_templates"
        self.pseudo_choice = {
            key: self.parser.get_parsed_content(f"{call}#{key}")
            for key in self.parser.get(call)
            if not key.startswith("_") and key not in ("datalist", "network", "preprocessing", "device")
        }
        if self.pseudo_choice["pseudo_max_labelled"] is not None:  # checked once, at start
            self.pseudo_choice["pseudo_max_labelled"] = as_number(
                self.pseudo_choice["pseudo_max_labelled"], "pseudo_max_labelled", minimum=0, integer=True
            )
        # pseudo-templates of the saved labels, computed in the background (one set at a time, on a network of its own)
        self.pseudo = BackgroundValue("pseudo-templates", self._background_pseudo, fallback=[])
        self._preprocessing = None
        self._network = None  # the stage-1 network of the device, and the file whose weights it holds
        self._network_key = None
        self._bundle_templates: list[dict] | None = None
        self._builtin: tuple[tuple, dict | None] | None = None  # (checkpoint key, built-in features fitting it)
        self._oneshot: OneShotInferer | None = None
        # template features of items: {weights' file key: {(image, landmarks): features}}, the newest weights last
        self._item_features: dict[tuple, dict[tuple, dict]] = {}
        self._frames: dict[tuple, dict] = {}
        self._detector_parsers: dict[tuple, Any] = {}
        self._refinement: tuple[tuple, DescriptorRefinement | None] | None = None  # (saved labels' key, refinement)

    def _check_builtin(self, checkpoint: Path) -> dict:
        """The built-in template features, refused (ValueError) for weights other than those that computed them."""
        try:
            return load_template(self.builtin_template_path, checkpoint)
        except ValueError:
            published = (
                " (fine-tuned by the train task; remove the app's model/model.pt to serve the shipped weights again)"
                if self.is_published(checkpoint)
                else ""
            )
            remedy = (
                "or label images of the datastore (they become the templates)"
                if published
                else "(these weights need their own templates' images)"
            )
            raise ValueError(
                f"the built-in templates ({SHIPPED_TEMPLATE}) hold features of the shipped weights, not of "
                f"{checkpoint.name}{published}: give the templates' images (--conf datalist) {remedy}"
            ) from None

    def _shipped_detector(self) -> Path | None:
        """The detector shipped beside the built-in templates that ``inferring`` takes without a datalist
        (:func:`bundle.pipeline.choice.choose_detector`, ``pipeline: auto``), served until the train task
        publishes one; None with a datalist (the user's landmarks and templates) or when ``auto`` takes matching."""
        if self.datalist is not None:
            return None
        chosen = choose_detector(
            "auto",
            self.parser.get_parsed_content("detectors"),
            self.names,
            self.spatial_dims,
            None,
            self.parser.get_parsed_content("max_templates"),
            enough_labels=self.parser.get_parsed_content("detector_enough_labels"),
            builtin=builtin_templates(self.builtin_template_path, self.shipped_ckpt, self.bundle_root),
        )
        return None if chosen is None else Path(chosen)

    # ---- bundle pieces -------------------------------------------------------------------------------
    @property
    def preprocessing(self):
        with self._lock:
            if self._preprocessing is None:
                self._preprocessing = self.parser.get_parsed_content("validate#preprocessing")
            return self._preprocessing

    def served_checkpoint(self) -> Path:
        """The weights the infer task serves: the app's ``model/model.pt`` once training published one,
        else the shipped ones."""
        return self.served_path if self.served_path.is_file() else self.shipped_ckpt

    def is_published(self, checkpoint: str | Path) -> bool:
        """Whether ``checkpoint`` is one that the train task published (in the app's model folder)."""
        return Path(checkpoint).resolve().parent == self.model_dir.resolve()

    @contextmanager
    def network(
        self, checkpoint: str | Path | None = None, private: torch.nn.Module | None = None
    ) -> Iterator[torch.nn.Module]:
        """The stage-1 network of the device holding ``checkpoint``'s weights (default: the served ones), for the
        ``with`` block alone. One instance, built on first use, shared by inference, template choice and scoring.
        ``private``: a network of the caller's own already holding those weights (:meth:`private_network`), given back
        as it is, no lock taken."""
        if private is not None:
            yield private
            return
        path = Path(checkpoint or self.served_checkpoint())
        with self._lock:
            if self._network is None:
                self._network = self.parser.get_parsed_content("network_def", lazy=False)
                logger.info(f"stage-1 network built on {self.device}")
            key = file_key(path)
            if key != self._network_key:
                self._network_key = None
                load_weights(self._network, path, self.device).eval()
                self._network_key = key
            yield self._network

    def private_network(self, checkpoint: str | Path) -> torch.nn.Module:
        """A copy of the stage-1 network holding ``checkpoint``'s weights, for background work that should not hold
        the shared one (and the requests waiting for it) for long."""
        with self.network(checkpoint) as network:
            return copy.deepcopy(network)

    # ---- the stage-2 detector ------------------------------------------------------------------------
    def served_detector(self) -> Path | None:
        """``model/detector.pt`` once the train task published a detector, else the shipped one without a datalist
        (:attr:`shipped_detector`), else None (template matching is served)."""
        return self.detector_path if self.detector_path.is_file() else self.shipped_detector

    def detector_key(self) -> tuple | None:
        """What identifies the served detector: its file's and its record's keys (None: no detector served)."""
        detector = self.served_detector()
        if detector is None:
            return None
        info = self.detector_info_path
        return file_key(detector), file_key(info) if detector == self.detector_path and info.is_file() else None

    def detector_info(self) -> dict:
        """What is known of the served detector: ``model/detector.json`` of a published one (``image_size``,
        ``trained_on``, ``held_out``); the ``image_size`` recorded beside the shipped one (its training images are
        not datastore ids)."""
        if self.detector_path.is_file():
            try:
                return json.loads(self.detector_info_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return {}
        if self.shipped_detector is not None:
            return {"image_size": recorded_detector_info(self.shipped_detector)["image_size"]}
        return {}

    def refinement(self, labelled: Sequence[dict], exclude: str | None = None) -> DescriptorRefinement | None:
        """The XFeat refinement of the served detector's suggestions (``xfeat_refinement``, as the commands decide it:
        :func:`bundle.pipeline.choice.choose_refinement`; the app's detectors learn from human labels) from
        the first ``max_templates`` saved labels, less the image ``exclude`` (an id); None without another saved label.
        The templates' descriptors are kept while those labels stay the same."""
        if self.xfeat_refinement is False:
            return None
        with self._lock:
            chosen = list(labelled)[: int(self.parser.get_parsed_content("max_templates"))]
            key = labels_key(chosen)
            if self._refinement is None or self._refinement[0] != key:
                templates = [{"image": it["image"], "landmarks": it["landmarks"]} for it in chosen]
                load = self.parser.get_parsed_content("load_transforms")
                refinement = (
                    choose_refinement(
                        self.xfeat_refinement,
                        templates,
                        self.spatial_dims,
                        self.template_combine,
                        True,
                        RADIUS_MM,
                        load,
                    )
                    if templates
                    else None
                )
                self._refinement = (key, refinement)
            refinement = self._refinement[1]
        excluded = [it["image"] for it in chosen if it.get("id") == exclude]
        return refinement.without(excluded[0]) if refinement is not None and excluded else refinement

    def detector_parser(self, image_size: Sequence[int] | None = None):
        """The bundle's fine-tuning configs for the datalist's dimensionality (``detector_configs``)
        at the detector's ``image_size`` (None: train.yaml's)."""
        key = tuple(int(v) for v in image_size or base_grid(self.spatial_dims))
        with self._lock:
            if key not in self._detector_parsers:
                overrides: dict[str, Any] = {**self.overrides, "image_size": list(key)}
                self._detector_parsers[key] = bundle_parser(self.detector_configs, self.bundle_root, **overrides)
            return self._detector_parsers[key]

    def new_detector(self, checkpoint: str | Path, image_size: Sequence[int] | None = None):
        """``(network, preprocessing, inferer)`` of a detector checkpoint: ``HeatmapDetector`` with its weights, the
        evaluation pipeline at ``image_size`` (the grid it was trained on) and
        ``bundle.inferers.heatmap.HeatmapInferer``."""
        parser = self.detector_parser(image_size)
        with self._lock:
            network = parser.get_parsed_content("network_def", lazy=False)
            preprocessing = parser.get_parsed_content("validate#preprocessing")
            inferer = parser.get_parsed_content("stage2#inferer", lazy=False)
        return load_weights(network, checkpoint, self.device).eval(), preprocessing, inferer

    def prepare(self, item: dict, name: str | None = None, preprocessing=None) -> dict:
        """The evaluation pipeline (or ``preprocessing``) on ``item``;
        unreadable images raise :class:`ImageError` naming ``name``."""
        try:
            return (preprocessing or self.preprocessing)(dict(item))
        except Exception as e:  # MONAI wraps reader errors in RuntimeError chains: report the innermost cause
            name = name or Path(item["image"]).name
            raise ImageError(f"cannot read image {name!r}: {cause_of(e, item['image'], name)}") from e

    def builtin_template(self, checkpoint: str | Path) -> dict | None:
        """The built-in template features when they fit ``checkpoint`` (no ``--conf datalist``, the shipped weights),
        else None."""
        if self.builtin_template_path is None:
            return None
        with self._lock:
            key = file_key(checkpoint)
            if self._builtin is None or self._builtin[0] != key:
                try:
                    self._builtin = (key, self._check_builtin(Path(checkpoint)))
                except ValueError:
                    self._builtin = (key, None)
            return self._builtin[1]

    def templates(self, labelled: Sequence[dict], exclude: str | None = None) -> list[dict]:
        """The template images of a suggestion, each with its ``source``: the labelled datastore items but the image
        ``exclude`` (an id; an image is never its own template) as ``"datastore"``, else the bundle datalist's
        templates as ``"bundle"`` (they stand in until an image is labelled). The built-in features, which stay
        while the shipped weights are served, join them in :meth:`template_inferer`."""
        items = [dict(it, source="datastore") for it in labelled if it.get("id") != exclude]
        return items or [dict(it, source="bundle") for it in self.bundle_templates()]

    def suggestion_templates(
        self,
        labelled: Sequence[dict],
        unlabelled: Sequence[dict],
        checkpoint: str | Path,
        exclude: str | None = None,
        wait: bool = False,
        builtin: bool = True,
        network: torch.nn.Module | None = None,
    ) -> list[dict]:
        """The templates of a suggestion with ``checkpoint``'s weights: :meth:`templates` (the saved labels but the
        image ``exclude``, else the bundle's), and while the saved labels are few and no built-in template joins them
        (``builtin``: they join where they fit the weights), their :meth:`pseudo_templates` (``wait``: computed now
        when not ready, as scoring needs them, with ``network`` when given). A labelled image's own suggestion gets
        none: they are made from all the saved labels, its own among them."""
        items = self.templates(labelled, exclude)
        own_label = any(it.get("id") == exclude for it in labelled) if exclude is not None else False
        if items and items[0]["source"] == "datastore" and not own_label:
            if self._pseudo_apply(labelled, unlabelled, checkpoint, builtin):
                pseudo = self.pseudo_templates(labelled, unlabelled, checkpoint, wait, network)
                items += [it for it in pseudo if it["id"] != exclude]
        return items

    def _pseudo_apply(
        self, labelled: Sequence[dict], unlabelled: Sequence[dict], checkpoint: str | Path, builtin: bool = True
    ) -> bool:
        """Whether pseudo-templates join ``labelled``: ``pseudo_templates`` > 0, some saved labels but no more than
        ``pseudo_max_labelled``, some unlabelled image, and no built-in template joining the saved labels
        (``builtin`` False, or none fitting ``checkpoint``)."""
        limit = self.pseudo_choice["pseudo_max_labelled"]
        return bool(
            labelled
            and unlabelled
            and self.pseudo_choice["pseudo_templates"] > 0
            and (limit is None or len(labelled) <= limit)
            and not (builtin and self.builtin_template(checkpoint) is not None)
        )

    def pseudo_templates(
        self,
        labelled: Sequence[dict],
        unlabelled: Sequence[dict],
        checkpoint: str | Path,
        wait: bool = False,
        network: torch.nn.Module | None = None,
    ) -> list[dict]:
        """Pseudo-templates of the saved labels, as the evaluating command adds them: the first ``pseudo_candidates``
        unlabelled datastore images (sorted ids) labelled by matching from ``labelled``, the ``pseudo_templates``
        most reliable kept (:func:`bundle.templates.resolution.resolve_templates` with the evaluation config's keys),
        each with ``source`` ``"pseudo"``.

        They take many network passes, so unless ``wait`` they are computed in the background (:attr:`pseudo`) once
        per weights, labels and candidates (a failure is logged and gives none for that set): [] until they are
        ready. ``wait``: computed now with ``network`` (holding ``checkpoint``'s weights; default: the context's
        network), errors raised.
        """
        candidates = list(unlabelled)[: int(self.pseudo_choice["pseudo_candidates"])]
        plain = [[{k: it[k] for k in ITEM_KEYS if k in it} for it in part] for part in (labelled, candidates)]
        if wait:
            with self.network(checkpoint, network) as held:
                return self._compute_pseudo(*plain, held)
        key = (file_key(checkpoint), labels_key(labelled), tuple(it["id"] for it in candidates))
        last = self.pseudo.get(key, *plain, Path(checkpoint))
        return last[1] if last is not None and last[0] == key else []

    def _background_pseudo(self, labelled: list[dict], candidates: list[dict], checkpoint: Path) -> list[dict]:
        """:meth:`pseudo_templates` in the background, on a :meth:`private_network` (the requests keep the shared
        one)."""
        return self._compute_pseudo(labelled, candidates, self.private_network(checkpoint))

    def _compute_pseudo(self, labelled: list[dict], candidates: list[dict], network: torch.nn.Module) -> list[dict]:
        """The pseudo-templates of ``labelled`` among ``candidates`` (an unreadable one is skipped, named)."""
        readable = []
        for item in candidates:
            check_stopping()
            try:
                self.prepare(item, item.get("id"))
                readable.append(item)
            except ImageError as e:
                logger.warning(f"pseudo-template candidate skipped: {e}")
        datalist = {"templates": labelled, "training": readable}
        items = resolve_templates(
            datalist, network.eval(), stoppable(self.preprocessing), self.device, **self.pseudo_choice
        )
        pseudo = [dict(it, source="pseudo") for it in items if it.get("pseudo_label")]
        logger.info(f"pseudo-templates of {len(labelled)} saved label(s): {[it['id'] for it in pseudo]}")
        return pseudo

    def template_inferer(
        self, items: Sequence[dict], checkpoint: str | Path, network: torch.nn.Module, builtin: bool = True
    ) -> tuple[TemplateFeatureInferer, list[dict]]:
        """The k-shot inferer of template ``items`` (:meth:`templates`) and, while they fit ``checkpoint`` (and
        ``builtin``), the built-in templates, with the template records ``{"image": id or file name, "source"}`` it
        holds.

        ``network`` holds ``checkpoint``'s weights. An item's features are computed once per checkpoint and label
        (those of the two newest checkpoints are kept: the served weights and a candidate being scored), so a request
        matches stored features only (``OneShotInferer.feature_inferer``: the same predictions). They are computed
        outside the context's lock, with ``network``. No template at all (the built-in features do not fit published
        weights and no image is labelled): ValueError saying so.
        """
        checkpoint_key = file_key(checkpoint)
        keys = [(item["image"], json.dumps(item["landmarks"])) for item in items]
        with self._lock:
            known = dict(self._item_features.get(checkpoint_key, {}))
        for key, item in zip(keys, items):
            if key not in known:
                plain = {k: v for k, v in item.items() if k in ITEM_KEYS}
                try:
                    known[key] = compute_template(
                        network, [plain], self.preprocessing, self.names, self.device, checkpoint
                    )
                except Exception as e:  # a saved label that the pipeline refuses: the client's to fix
                    if item["source"] != "datastore" or not isinstance(root_cause(e), ValueError):
                        raise
                    cause = cause_of(e, item["image"], item["id"])
                    raise LabelError(f"label of image {item['id']!r} refused as a template: {cause}") from e
        with self._lock:
            cache = self._item_features.pop(checkpoint_key, {})
            cache.update({key: known[key] for key in keys})
            self._item_features[checkpoint_key] = cache  # the newest last
            while len(self._item_features) > 2:
                del self._item_features[next(iter(self._item_features))]
        parts = [known[key] for key in keys]
        sources = [{"image": it.get("id") or Path(it["image"]).name, "source": it["source"]} for it in items]
        features = self.builtin_template(checkpoint) if builtin else None
        if features is not None:
            parts.append(features)
            sources += [{"image": Path(name).name, "source": "built-in"} for name in features["sources"]]
        if not parts:
            if builtin:
                self._check_builtin(Path(checkpoint))  # raises, naming the way back
            raise ValueError("no template to match from: no image of the datastore is labelled")
        return self.oneshot.feature_inferer(join_templates(parts)), sources

    @property
    def oneshot(self) -> OneShotInferer:
        """The evaluation's one-shot inferer (:func:`bundle.pipeline.predictor.matching_inferer` with the config's
        keys): its matcher and combine rule."""
        with self._lock:
            if self._oneshot is None:
                keys = ("template_combine", "contrast_adaptation", "registration_tolerance")
                self._oneshot = matching_inferer(*(self.parser.get_parsed_content(k) for k in keys))
            return self._oneshot

    def frame(self, image: str | Path, data: dict | None = None) -> dict:
        """``{"spacing", "spacing_known", "affine", "grid_to_physical", "grid_shape", "to_file", "file_size"}`` of an
        image: 2D pixel -> LPS mm (``affine`` 3x3 or None = pixel * spacing; ``spacing_known``: its header gives one,
        else it is 1), the network grid of the evaluation pipeline over the image (its bounds), and the file's frame
        (:func:`bundle.transforms.landmarks.file_frame`)."""
        key = file_key(image)
        with self._lock:
            if key in self._frames:
                return self._frames[key]
        if data is None:
            data = self.prepare({"image": str(image)})
        spacing = np.asarray(torch.as_tensor(data["spacing"]).cpu(), dtype=np.float64).reshape(-1)
        affine = None
        meta = getattr(data["image"], "meta", {})
        original = meta.get("original_affine") if meta else None
        if meta and dicom_tags(meta) and original is not None and np.asarray(original).shape == (3, 3):
            ras = np.asarray(original, dtype=np.float64)
            affine = np.diag([-1.0, -1.0, 1.0]) @ ras  # ITK/MONAI's RAS -> LPS
        frame = {
            "spacing": spacing,
            "spacing_known": LandmarkTargets.header_spacing(data["image"], self.spatial_dims) is not None,
            "affine": affine,
            "grid_to_physical": np.asarray(torch.as_tensor(data["grid_to_physical"]).cpu(), dtype=np.float64),
            "grid_shape": np.asarray(data["image"].shape[1:], dtype=np.float64),
        }
        frame["to_file"], frame["file_size"] = file_frame(data["image"])
        with self._lock:
            self._frames[key] = frame
        return frame

    def spacing_known(self, item: dict) -> bool:
        """Whether a datalist ``item`` has a spacing, its own or its image header's (its errors are in mm)."""
        return bool(item.get("spacing")) or self.frame(item["image"])["spacing_known"]

    def error_units(self, items: Sequence[dict]) -> str:
        """The unit of radial errors on ``items``: ``mm`` when each has a spacing (:meth:`spacing_known`),
        ``pixels`` when none has, else ``mm where the spacing is known, else pixels``."""
        known = [self.spacing_known(it) for it in items]
        if all(known):
            return "mm"
        return "pixels" if not any(known) else "mm where the spacing is known, else pixels"

    @staticmethod
    def pixels_to_lps(points_px: np.ndarray, frame: dict) -> np.ndarray:
        """``(L, 2)`` pixels -> ``(L, 3)`` LPS mm (z = 0 unless the DICOM frame says otherwise)."""
        p = np.asarray(points_px, dtype=np.float64)
        if frame["affine"] is None:
            xy = p * frame["spacing"]
        else:
            xy = (frame["affine"] @ np.c_[p, np.ones(len(p))].T).T[:, :2]
        return np.c_[xy, np.zeros(len(p))]

    @staticmethod
    def lps_to_pixels(points_lps: np.ndarray, frame: dict) -> np.ndarray:
        p = np.asarray(points_lps, dtype=np.float64)[:, :2]
        if frame["affine"] is None:
            return p / frame["spacing"]
        inverse = np.linalg.inv(frame["affine"])
        return (inverse @ np.c_[p, np.ones(len(p))].T).T[:, :2]

    # ---- saved labels --------------------------------------------------------------------------------
    def label_landmarks(self, label_path: str | Path, image_path: str | Path, where: str, strict: bool = True) -> list:
        """The landmarks of a saved Slicer label as pixel ``[x, y]`` per landmark name (None where missing).

        Control points are matched by label to the landmark names; a file whose labels name none of them but
        holds exactly one point per landmark is read in order (Slicer's default labels ``F-1``, ``F-2``, ...);
        a file of ROI boxes (3D Slicer's MONAILabel module's Submit Label) gives their centres, named by their
        control points' labels (:func:`landmark_tasks.slicer.box_points`); ``strict``: see
        :meth:`points_to_landmarks`.
        """
        try:
            points = box_points(label_path)
            if points is None:
                points = read_markups(label_path)
        except Exception as e:
            detail = str(e).replace(str(label_path), "the file")  # a server path (an upload's temporary file)
            raise LabelError(
                f"label of {where}: not a usable 3D Slicer markups file (.mrk.json / .fcsv): {detail}"
            ) from e
        return self.points_to_landmarks(points, image_path, where, strict)

    def outside(self, point: Sequence[float], frame: dict) -> str | None:
        """None when ``point`` (2D: pixels; 3D: world mm) lies on the image by the pipeline's rule
        (:func:`bundle.transforms.landmarks.outside_excess` in the file's frame), else the image's extent in the
        point's units, for a message."""
        to_file, size = frame["to_file"], frame["file_size"]
        if not outside_excess(file_positions(point, to_file), size).any():
            return None
        d = len(size)
        corners = np.array(np.meshgrid(*[[-0.5, n - 0.5] for n in size], indexing="ij")).reshape(d, -1)
        extent = (np.linalg.inv(to_file) @ np.r_[corners, np.ones((1, corners.shape[1]))])[:d]
        axes = ", ".join(f"{a} {lo:g} to {hi:g}" for a, lo, hi in zip("xyz", extent.min(1), extent.max(1)))
        return f"{axes} {'pixels' if d == 2 else 'mm'}"

    def points_to_landmarks(
        self, points: Sequence[ControlPoint], image_path: str | Path, where: str, strict: bool = True
    ) -> list:
        """Landmarks (2D: pixel ``[x, y]``; 3D: world ``[x, y, z]``; None where missing) of ``points`` on the image,
        each checked to lie on it (LabelError naming the landmark and ``where``). Labels match names with case and
        blanks ignored (:func:`bundle.data.markups.label_key`); a point whose label names no landmark is refused
        naming it and the closest names (``strict``), else left out with a warning (a label saved earlier). Landmarks
        that cannot be a template (:func:`bundle.transforms.landmarks.template_problem`) are refused: each saved label
        is one."""
        counts = Counter(label_key(p.label) for p in points)
        by_label = {label_key(p.label): p.position for p in points}
        by_name = {n: by_label[label_key(n)] for n in self.names if label_key(n) in by_label}
        twice = [n for n in by_name if counts[label_key(n)] > 1]
        if twice:
            raise LabelError(f"label of {where}: landmarks {twice} are named by more than one point")
        in_order = self.spatial_dims == 2 and not by_name and len(points) == len(self.names)
        keys = {label_key(n): n for n in self.names}
        unknown = [] if in_order else [p.label for p in points if label_key(p.label) not in keys]
        if unknown and strict:
            close = {u: [keys[k] for k in get_close_matches(label_key(u), keys, n=3)] for u in unknown}
            hints = "; ".join(f"{u!r}: did you mean {c}?" for u, c in close.items() if c)
            in_order_rule = (
                f" (unnamed points are read in order only when there is one per landmark, {len(self.names)})"
                if self.spatial_dims == 2 and not by_name
                else ""
            )
            raise LabelError(
                f"label of {where}: points {unknown} name no landmark{in_order_rule}"
                + (f"; {hints}" if hints else "")
                + f"; the landmarks are {', '.join(self.names)}"
            )
        if unknown:
            logger.warning(f"label of {where}: points {unknown} name no landmark, left out")
        if in_order:
            by_name = {n: p.position for n, p in zip(self.names, points)}
        frame = self.frame(image_path)
        out = []
        for name in self.names:
            ras = by_name.get(name)
            if ras is None:
                out.append(None)
                continue
            if self.spatial_dims == 2:
                point = [float(v) for v in self.lps_to_pixels(np.array([[-ras[0], -ras[1], ras[2]]]), frame)[0]]
            else:
                point = [float(v) for v in ras]
            extent = self.outside(point, frame)
            if extent:
                raise LabelError(
                    f"label of {where}: landmark {name!r} at ({', '.join(f'{v:g}' for v in point)}) lies outside "
                    f"the image ({extent})"
                )
            out.append(point)
        # every saved label is a template of the suggestions: one that cannot be is refused (stored: skipped)
        points = np.array([[np.nan] * self.spatial_dims if p is None else p for p in out], dtype=np.float64)
        problem = template_problem(file_positions(points, frame["to_file"]), frame["file_size"])
        if problem:
            raise LabelError(f"label of {where}: {problem}")
        return out

    def datastore_items(self, datastore) -> list[dict]:
        """Every datastore image (sorted ids) as a datalist item ``{"image", "id"[, "landmarks"]}``.

        A label saved with the ``final`` tag gives ``landmarks``; an unreadable one is logged and skipped.
        """
        items = []
        for image_id in sorted(datastore.list_images()):
            uri = datastore.get_image_uri(image_id)
            if not uri:
                continue
            item: dict[str, Any] = {"image": uri, "id": image_id}
            label = (
                datastore.get_label_uri(image_id, FINAL_TAG)
                if FINAL_TAG in datastore.get_labels_by_image_id(image_id)
                else ""
            )
            if label and os.path.isfile(label):
                try:
                    item["landmarks"] = self.label_landmarks(label, uri, f"image {image_id!r}", strict=False)
                    item["label"] = label
                except (LabelError, ImageError) as e:
                    logger.warning(f"saved label skipped: {e}")
            items.append(item)
        return items

    # ---- the bundle's templates ----------------------------------------------------------------------
    def bundle_templates(self) -> list[dict]:
        """The bundle's templates (``evaluate#templates`` of the configured datalist), resolved on first use.

        When the datalist names no template, ``evaluate#templates`` chooses one among its labelled training
        items by matching (slow on large datalists): that happens once, and the result is kept in
        ``model/bundle_templates.json`` (keyed by the datalist's path and mtime and the template choice) so that
        other processes of the app (the training task runs in a child process) read it instead of searching again;
        one that cannot be written (a full disk) is skipped with a warning.
        """
        with self._lock:
            if self._bundle_templates is not None:
                return self._bundle_templates
            if self.datalist is None:  # built-in templates: features, no images (builtin_inferer)
                self._bundle_templates = []
                return self._bundle_templates
            key = {
                "datalist": str(self.datalist),
                "mtime_ns": os.stat(self.datalist).st_mtime_ns,
                "choice": self.pseudo_choice,  # the rule and pseudo-templates (conf pseudo_templates)
            }
            if self.templates_cache.is_file():
                try:
                    cached = json.loads(self.templates_cache.read_text(encoding="utf-8"))
                    if cached.get("key") == key and cached.get("templates"):
                        self._bundle_templates = cached["templates"]
                        return self._bundle_templates
                except (OSError, ValueError):
                    pass
            with self.network() as network:  # the template choice runs the served network: the shared one
                self.parser["network"] = network
                templates = [
                    dict(t, image=str(Path(t["image"]).resolve()))
                    for t in self.parser.get_parsed_content("evaluate#templates")
                ]
            templates = json.loads(json.dumps(templates, default=float))  # plain JSON types
            try:
                write_json_atomic(self.templates_cache, {"key": key, "templates": templates})
            except OSError as e:  # a cache: a full or read-only disk costs the other processes a search, not a reply
                logger.warning(
                    f"{self.templates_cache} not written ({os.strerror(e.errno) if e.errno else e}): the "
                    "bundle's templates are kept in this process only"
                )
            self._bundle_templates = templates
            logger.info(f"bundle templates resolved: {[t['image'] for t in templates]}")
            return templates
