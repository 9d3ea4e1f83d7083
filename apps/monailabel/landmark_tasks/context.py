"""The bundle as the MONAI Label app uses it (BundleContext): configs, device, served weights, networks, templates."""

from __future__ import annotations

import copy
import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from bundle.checkpoints import load_weights
from bundle.command_errors import root_cause
from bundle.configs import bundle_parser, config_files
from bundle.data.datalist import DatalistError, read_json
from bundle.data.markups import ControlPoint, check_label_names
from bundle.handlers.confidence import MATCH_MIN_RATIO, MIN_PEAK
from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer, guard_on
from bundle.inferers.refinement import RADIUS_MM, DescriptorRefinement
from bundle.pipeline.choice import (
    SHIPPED_TEMPLATE,
    builtin_templates,
    choose_detector,
    choose_refinement,
    refinement_setting,
)
from bundle.pipeline.detector_data import detector_info as recorded_detector_info
from bundle.pipeline.matching_guard import guard_candidates
from bundle.settings import as_number
from bundle.template_file import join_templates
from bundle.templates.features import compute_template

from .background import BackgroundValue
from .cache_keys import file_key, labels_key
from .frames import image_frame, lps_to_pixels, outside, pixels_to_lps
from .saved_labels import SavedLabels
from .suggestion_templates import ITEM_KEYS, SuggestionTemplates
from .uploads import ImageError, LabelError, cause_of

logger = logging.getLogger(__name__)
PREDICTORS = ("auto", "detector", "templates")


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


class BundleContext(SuggestionTemplates):
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
        # the train config's network grid and training crop: what a train request leaves unset
        self.network_config = {k: self.parser.get_parsed_content(k) for k in ("image_size", "crop_size", "batch_size")}
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
        self.saved_labels = SavedLabels(self.names, self.spatial_dims, self.frame)
        self.shipped_detector = self._shipped_detector()
        self.template_combine = str(self.parser.get_parsed_content("template_combine"))
        self.min_peak, self.min_match_ratio = MIN_PEAK, MATCH_MIN_RATIO  # the commands' confidence warnings
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
        at the detector's ``image_size`` (its ``detector_grid``; None: the train config's ``image_size``)."""
        key = tuple(int(v) for v in image_size or self.network_config["image_size"])
        with self._lock:
            if key not in self._detector_parsers:
                overrides: dict[str, Any] = {**self.overrides, "detector_grid": list(key)}
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
        guarded = guard_on(self.oneshot.contrast_adaptation, self.oneshot.registration_tolerance)  # its image too
        with self._lock:
            known = dict(self._item_features.get(checkpoint_key, {}))
        for key, item in zip(keys, items):
            if key not in known:
                plain = {k: v for k, v in item.items() if k in ITEM_KEYS}
                try:
                    known[key] = compute_template(
                        network, [plain], self.preprocessing, self.names, self.device, checkpoint, guarded
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
        """The evaluation's one-shot inferer (:class:`bundle.inferers.oneshot.OneShotInferer` of the config's keys,
        which :func:`bundle.configs.bundle_parser` has checked): its matcher and combine rule; ``contrast_adaptation:
        auto`` is off (the datastore holds no validation images to choose it on)."""
        with self._lock:
            if self._oneshot is None:
                keys = ("contrast_adaptation", "registration_tolerance")
                setting = guard_candidates(*(self.parser.get_parsed_content(k) for k in keys), self.spatial_dims, [])
                combine = self.parser.get_parsed_content("template_combine")
                self._oneshot = OneShotInferer(template_combine=combine, **setting[0])
            return self._oneshot

    # ---- coordinate frames (landmark_tasks.frames) ------------------------------------------------------
    def frame(self, image: str | Path, data: dict | None = None) -> dict:
        """The frames of an image (:func:`landmark_tasks.frames.image_frame`), cached per file content; ``data``: the
        image already prepared by the evaluation pipeline."""
        key = file_key(image)
        with self._lock:
            if key in self._frames:
                return self._frames[key]
        if data is None:
            data = self.prepare({"image": str(image)})
        frame = image_frame(data, self.spatial_dims)
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

    pixels_to_lps = staticmethod(pixels_to_lps)
    lps_to_pixels = staticmethod(lps_to_pixels)
    outside = staticmethod(outside)

    # ---- saved labels --------------------------------------------------------------------------------
    def label_landmarks(self, label_path: str | Path, image_path: str | Path, where: str, strict: bool = True) -> list:
        """The landmarks of a saved Slicer label (:meth:`landmark_tasks.saved_labels.SavedLabels.label_landmarks`)."""
        return self.saved_labels.label_landmarks(label_path, image_path, where, strict)

    def points_to_landmarks(
        self, points: Sequence[ControlPoint], image_path: str | Path, where: str, strict: bool = True
    ) -> list:
        """The landmarks of control points
        (:meth:`landmark_tasks.saved_labels.SavedLabels.points_to_landmarks`)."""
        return self.saved_labels.points_to_landmarks(points, image_path, where, strict)

    def datastore_items(self, datastore) -> list[dict]:
        """Every datastore image as a datalist item
        (:meth:`landmark_tasks.saved_labels.SavedLabels.datastore_items`)."""
        return self.saved_labels.datastore_items(datastore)
