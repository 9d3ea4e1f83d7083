"""MONAI Label infer task: landmarks suggested on an image by one-shot / k-shot matching (paper Sec. 3.4).

No input from the user. Templates (k-shot), their predictions combined per landmark by the bundle's
``template_combine`` rule (by default the geometric median of votes weighted by their match scores): the
datastore's images with a saved label (tag ``final``, a 3D Slicer ``.mrk.json`` / ``.fcsv``) but the image being
inferred, else the bundle's templates (``evaluate#templates`` of the configured datalist, resolved on the first
request and cached); without a datalist, the built-in template features join them while the shipped weights are
served. With few saved labels (at most the bundle's ``pseudo_max_labelled``) and no built-in template joining them,
pseudo-templates join them as in the evaluating command: unlabelled datastore images labelled by matching
(``BundleContext.suggestion_templates``), computed in the background after the labels change, so the first suggestions
after a save match the saved labels alone. Template features are computed once per weights and label. The reply
names the templates it used, each with its ``source`` (``datastore``, ``pseudo``, ``bundle``, ``built-in``).

Once the train task has published a stage-2 heatmap detector (``model/detector.pt``, trained on the saved labels),
the detector is served instead: ``bundle.inferers.heatmap.HeatmapInferer`` (5 forward passes with the default
test-time shifts, ``shift_tta``), no template. Without a datalist the detector shipped beside the built-in templates
(``models/finetune``, what ``inferring`` takes without a datalist: ``BundleContext.shipped_detector``) is served until
then.

``predictor`` ``auto`` (the default) lets the saved labels decide: once they can score two candidates (the served
detector, matching with the built-in templates, matching from the saved labels alone), the one with the lowest error
on the newest saved labels that the detector has not trained on is served (a detector the train task made from fewer
saved labels than the commands' rule admits, ``bundle.pipeline.choice.detector_admitted``, is no candidate;
``scoring.choose_predictor``; computed in the background after the labels, the datastore's images or the served
models change, so the first suggestions after a save are served by the previous choice). The same choice says whether
the built-in templates join the saved labels (always for a labelled image's own suggestion when no other label is
saved). The reply's
``predictor`` says what served it (``"detector"`` | ``"templates"``), ``predictor_choice`` the scores it was chosen by
(None before any), and ``pending`` the background work under way (``predictor_choice``: also when the choice served
is not yet that of the labels of now; ``pseudo_templates``; ``/info/`` too, under ``models``), after which the
suggestions may change. The request key
``predictor`` (or the app's conf key of that name: ``auto``, ``detector`` or ``templates``) forces one, e.g. template
matching beside a served detector.

The result is returned in the forms viewers read: a 3D Slicer point list (``markups`` in the result JSON, in the
image's own LPS frame so that Slicer shows it over the image), the result file of the same points as the boxes that
3D Slicer's MONAILabel module edits and sends back (:mod:`landmark_tasks.slicer`, with the warning of a
low-confidence suggestion), the points as ``landmarks`` (image pixels in 2D / world mm in 3D) and OHIF-style
``centroids`` (``{name: [index, i, j, k]}``). The reply names things, never a server path: ``templates`` by
datastore id (the bundle's by file name), ``checkpoint`` by file name with ``checkpoint_source`` (``shipped`` |
``published``); ``device`` is the app's.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from bundle.data.markups import ControlPoint, write_mrk_json
from bundle.geometry import apply_homogeneous
from bundle.handlers.confidence import low_confidence_messages
from bundle.io_utils import write_json_atomic
from monailabel.interfaces.tasks.infer_v2 import InferTask, InferType

from .background import BackgroundValue
from .cache_keys import file_key, labels_key
from .context import PREDICTORS, BundleContext
from .scoring import choose_predictor, served_before_choice
from .slicer import result_markups
from .suggestion_templates import ITEM_KEYS

logger = logging.getLogger(__name__)


def landmark_result(names: list[str], points_mm: np.ndarray, spacing: np.ndarray) -> dict[str, Any]:
    """Result JSON of one image: ``landmarks`` (datalist convention) and OHIF-style ``centroids``.

    2D: ``[x, y]`` original pixels (mm / spacing); 3D: ``[x, y, z]`` world mm. Centroids are rounded pixel
    (voxel) indices, 1-based landmark index first, as strings (what MONAI Label sends to OHIF).
    """
    two_d = points_mm.shape[1] == 2
    points = points_mm / spacing if two_d else points_mm
    landmarks = {n: (None if not np.isfinite(p).all() else [float(v) for v in p]) for n, p in zip(names, points)}
    centroids = {}
    for i, (name, p) in enumerate(zip(names, points)):
        if np.isfinite(p).all():
            voxel = list(np.rint(p).astype(int)) + ([0] if two_d else [])
            centroids[name] = [str(i + 1)] + [str(v) for v in voxel]
    return {"landmarks": landmarks, "landmark_names": list(names), "centroids": centroids}


def markups_points(names: list[str], points: np.ndarray, frame: dict | None = None) -> list[ControlPoint]:
    """Control points in RAS for ``write_mrk_json``.

    3D points are world RAS mm already. 2D points are pixels, placed in the image's LPS frame
    (:meth:`BundleContext.pixels_to_lps`; without ``frame``: LPS = pixels), then given as RAS.
    """
    out = []
    for name, p in zip(names, points):
        if not np.isfinite(p).all():
            out.append(ControlPoint(name, None))
        elif p.shape[0] == 2:
            lps = BundleContext.pixels_to_lps(p[None], frame or {"spacing": np.ones(2), "affine": None})[0]
            out.append(ControlPoint(name, (-float(lps[0]), -float(lps[1]), float(lps[2]))))
        else:
            out.append(ControlPoint(name, tuple(float(v) for v in p)))
    return out


class LandmarkInferTask(InferTask):
    """Suggest every landmark on the requested image from the datastore's labelled images
    (or the bundle's templates)."""

    def __init__(
        self, context: BundleContext, datastore: Callable[[], Any] | None = None, predictor: str = "auto"
    ) -> None:
        if predictor not in PREDICTORS:
            raise ValueError(f"conf predictor must be one of {PREDICTORS}, got {predictor!r}")
        self.context = context
        self.predictor = predictor
        self.datastore = datastore
        self.names = context.names
        self.spatial_dims = context.spatial_dims
        super().__init__(
            type=InferType.DETECTION,
            labels={n: i + 1 for i, n in enumerate(self.names)},
            dimension=self.spatial_dims,
            description="One-shot / k-shot landmark suggestion (information-guided pixel-wise contrastive features)",
            config={"template_combine": context.template_combine, "predictor": predictor},
        )
        self._lock = threading.Lock()
        # loaded on the first request (start-up stays fast); the network is the context's (one per device)
        self.detector = None  # (network, preprocessing, inferer) of the served detector
        self.detector_key = None
        self.choice = BackgroundValue("predictor-choice", partial(choose_predictor, context))

    def is_valid(self) -> bool:
        return self.context.served_checkpoint().is_file()

    def info(self) -> dict[str, Any]:
        """MONAI Label's task info (``/info/``, under ``models``), with ``pending``: the background work under way
        (:meth:`pending`), so that a client can wait for it without asking for a suggestion."""
        return {**super().info(), "pending": self.pending()}

    def pending(self, choice_current: bool = True) -> list[str]:
        """The background work under way after which the suggestions may change: ``predictor_choice`` (also when the
        choice served is not that of the saved labels of now, ``choice_current`` False) and ``pseudo_templates``."""
        work = ["predictor_choice"] if not choice_current or self.choice.pending() else []
        return work + (["pseudo_templates"] if self.context.pseudo.pending() else [])

    def _load_detector(self, path: Path) -> None:
        """The served detector (``model/detector.pt`` at the grid recorded in ``model/detector.json``),
        reloaded when republished."""
        key = self.context.detector_key()
        if key == self.detector_key:
            return
        self.detector = self.context.new_detector(path, self.context.detector_info().get("image_size"))
        self.detector_key = key
        logger.info(f"serving the detector {path}")

    def _choice(self, labelled: list[dict], unlabelled: list[dict]) -> tuple[dict | None, bool]:
        """``auto``'s last choice (:func:`scoring.choose_predictor`; None before the first, or when there is nothing to
        choose between) and whether it is that of the saved labels and served models of now (else that one is
        computed in the background)."""
        if not labelled:
            return None, True
        checkpoint, detector = self.context.served_checkpoint(), self.context.served_detector()
        unlabelled_ids = tuple(it["id"] for it in unlabelled)
        key = (file_key(checkpoint), self.context.detector_key(), labels_key(labelled), unlabelled_ids)
        keep = (*ITEM_KEYS, "label")  # the label file's time orders the saved labels
        plain = [[{k: it[k] for k in keep if k in it} for it in part] for part in (labelled, unlabelled)]
        info = self.context.detector_info() if detector else {}
        last = self.choice.get(key, *plain, checkpoint, detector, info)
        return (None, False) if last is None else (last[1], last[0] == key)

    def _predictor(self, request: dict, labelled: list[dict], unlabelled: list[dict]) -> tuple[str, dict | None, bool]:
        """``(predictor, choice, current)`` of this request: ``detector`` or ``templates`` (its ``predictor`` key over
        the conf's; ``auto``: that of :meth:`_choice`, else :func:`scoring.served_before_choice`), and the choice that
        decided it and whether the built-in templates join (:meth:`_choice`; not asked for a forced detector)."""
        wanted = request.get("predictor") or self.predictor
        if wanted not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {wanted!r:.40}")
        served = self.context.served_detector() is not None
        if wanted == "detector":
            if not served:
                raise ValueError(
                    'no detector is served yet (train one: POST /train/landmarks with {"network": "detector"})'
                )
            return wanted, None, True
        choice, current = self._choice(labelled, unlabelled)
        if wanted == "auto":
            if choice is None:
                return served_before_choice(self.context, len(labelled))[0], choice, current
            return "detector" if served and choice["predictor"] == "detector" else "templates", choice, current
        return wanted, choice, current

    def _corners(self, data: dict, spacing: np.ndarray, frame: dict | None) -> np.ndarray:
        """The first and last corners of the image's grid in RAS mm (2D: in its frame, as the suggestions)."""
        grid = np.asarray(data["image"].shape[1:], dtype=np.float64)
        ends = apply_homogeneous(data["grid_to_physical"], np.stack([np.zeros_like(grid), grid - 1])).numpy()
        if self.spatial_dims == 3:
            return ends
        return np.array([cp.position for cp in markups_points(["first", "last"], ends / spacing, frame)])

    def _datastore_items(self) -> tuple[list[dict], list[dict]]:
        """The datastore's images with a saved label, and those without."""
        if self.datastore is None:
            return [], []
        items = self.context.datastore_items(self.datastore())
        return [it for it in items if it.get("landmarks")], [it for it in items if not it.get("landmarks")]

    def __call__(self, request: dict) -> tuple[str, dict]:
        image = request.get("image")
        name = request.get("image_name") or (Path(image).name if image else image)
        if not image or not Path(image).exists():  # a file, or a DICOM series folder from a DICOMweb datastore
            raise FileNotFoundError(f"landmarks infer: image not found: {name!r}")
        labelled, unlabelled = self._datastore_items()
        predictor, choice, choice_current = self._predictor(request, labelled, unlabelled)
        data = self.context.prepare({"image": str(image)}, name)
        spacing = np.asarray(torch.as_tensor(data["spacing"]).cpu(), dtype=np.float64).reshape(-1)
        refined = None  # the XFeat fine step after a detector: the saved labels (ids) it refined from, its radius
        with self._lock, torch.no_grad():
            if predictor == "detector":
                detector_path = self.context.served_detector()
                self._load_detector(detector_path)
                network, preprocessing, inferer = self.detector
                grid = self.context.prepare({"image": str(image)}, name, preprocessing)  # the detector's own grid
                batch = torch.as_tensor(grid["image"]).unsqueeze(0).to(self.context.device)
                g2p = torch.as_tensor(grid["grid_to_physical"]).unsqueeze(0).to(self.context.device)
                points_mm = inferer(batch, network, g2p)[0].cpu().numpy()
                detector_peak, match_score = float(inferer.peak_values[0].mean()), None
                refinement = self.context.refinement(labelled, request.get("image_id"))
                if refinement is not None:  # as inferring after a detector trained on human labels
                    points_mm = refinement.refine(str(image), points_mm / spacing, spacing) * spacing
                    ids = [it["id"] for it in labelled if it["image"] in refinement.sources]
                    refined = {"templates": ids, "radius_mm": refinement.radius_mm}
                templates, checkpoint = [], detector_path
            else:
                # one checkpoint for the whole request: the train task may publish new weights meanwhile
                checkpoint = self.context.served_checkpoint()
                # the built-in templates join as the choice says, and always when no other saved label would match
                others = [it for it in labelled if it["id"] != request.get("image_id")]
                builtin = choice is None or choice["builtin_templates"] or not others
                items = self.context.suggestion_templates(
                    labelled, unlabelled, checkpoint, request.get("image_id"), builtin=builtin
                )
                detector_peak = None
                batch = torch.as_tensor(data["image"]).unsqueeze(0).to(self.context.device)
                g2p = torch.as_tensor(data["grid_to_physical"]).unsqueeze(0).to(self.context.device)
                with self.context.network(checkpoint) as network:
                    inferer, templates = self.context.template_inferer(items, checkpoint, network, builtin)
                    points_mm = inferer(batch, network, g2p)[0].cpu().numpy()
                match_score = float(inferer.match_scores[0].nanmean())
            warning = low_confidence_messages(inferer, [name], self.context.min_peak, self.context.min_match_ratio)[0]
        result = landmark_result(self.names, points_mm, spacing)
        frame = self.context.frame(image, data) if self.spatial_dims == 2 else None
        points = points_mm / spacing if self.spatial_dims == 2 else points_mm
        control_points = markups_points(self.names, points, frame)
        fd, path = tempfile.mkstemp(prefix="landmarks-", suffix=".mrk.json")
        os.close(fd)
        try:
            # the point list for the reply; the result file: a box per landmark, what 3D Slicer's module edits
            write_mrk_json(path, control_points, coordinate_system="LPS" if self.spatial_dims == 2 else "RAS")
            result["markups"] = json.loads(Path(path).read_text(encoding="utf-8"))
            write_json_atomic(path, result_markups(control_points, self._corners(data, spacing, frame), warning))
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        # names, not server paths: datastore ids, the bundle templates' file names, the checkpoint's file name
        result["templates"] = templates
        result["template"] = [t["image"] for t in templates]
        result["template_combine"] = self.context.template_combine
        result["checkpoint"] = checkpoint.name
        result["checkpoint_source"] = "published" if self.context.is_published(checkpoint) else "shipped"
        result["predictor"] = predictor
        result["xfeat_refinement"] = refined
        result["predictor_choice"] = choice
        result["pending"] = self.pending(choice_current)
        result["device"] = str(self.context.device)
        # the network's confidence (bundle.handlers.confidence): a suggestion on an image it does not recognise is
        # flagged
        result["detector_peak"] = detector_peak
        result["match_score"] = match_score
        if warning is not None:
            logger.warning(warning)
            result["warning"] = warning
        return path, result
