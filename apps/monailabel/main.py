"""MONAI Label app of the bundle: an annotation loop for anatomical landmarks.

    monailabel start_server --app apps/monailabel --studies STUDIES [--conf datalist PATH] [--conf ckpt_path PATH]

- Infer task ``landmarks``: every landmark on an image of the datastore (``?image=ID``) or an uploaded file, no
  user input. Templates: the datastore's images with a saved label (k-shot, combined per landmark by the
  bundle's ``template_combine``), else the bundle's templates (the datalist's, resolved on first use; without a
  datalist the built-in ones).
- Train task ``landmarks``: fine-tunes the served weights on the datastore's images (``network: contrastive``),
  or trains the stage-2 heatmap detector on the saved labels (``network: detector``); the new weights replace
  the served ones only when they score better on the saved labels (see landmark_tasks/train.py). Once a
  detector is published, the infer task serves it (the detector with its test-time shifts, no template). Without
  a datalist the detector shipped beside the built-in templates is served from the start, as ``inferring`` takes
  it without one, and a detector training continues from it.
- Strategies ``first`` / ``last`` (sorted ids, unlabelled only) beside MONAI Label's ``random``.
- ``--studies`` a DICOMweb URL: MONAI Label downloads each series into its cache folder and the app reads the
  folder's X-ray as DICOM (header spacing, VOI window, MONOCHROME1); MONAI Label's conversion to NIfTI is
  turned off. Its templates are the bundle's: MONAI Label's DICOMweb datastore stores final labels only as
  DICOM SEG, which holds no landmarks, so saving point lists (k-shot from saved labels) needs a local studies
  folder.

Ids, tags and upload names are names inside the studies folder, for every route (one place: the confined datastore
of landmark_tasks/datastore.py): a path, ``..``, an empty name or a link pointing out is answered 4xx and nothing
is written or deleted; an unknown id, an unreadable image or label is answered 4xx naming it. MONAI Label's
sessions are off (they unpack uploaded archives as they come). Replies name images, files and checkpoints, never a
server path. MONAI Label routes the app does not serve (batch inference, scoring, whole-slide inference, reload,
replacing the served weights, the DICOMweb proxy without a DICOMweb source, the log) are refused 4xx saying so
(landmark_tasks/guards.py). Start-up does no heavy work: network, templates and the bundle's template search wait
for the first request.

Conf keys: ``bundle_root`` (default: the repository holding this app), ``datalist`` (the templates' images and the
landmark names; its ``spatial_dims`` selects the 2D or 3D configs; default: none, the built-in templates of the
shipped weights, 19 cephalometric landmarks, and the fine-tuned detector shipped beside them, as ``inferring``
uses them),
``ckpt_path`` (default: the shipped 2D weights; 3D: ``output/models/ct3d/model.pt``, where the default 3D
training writes), ``epochs`` (default 10), ``max_minutes`` (a background training's time budget: it ends after the last
epoch that fits; default 12, so that a training and its scoring end within 15 minutes; ``none``: no budget),
``predictor`` (``auto``: what the saved labels show to be best of the served detector, matching with the built-in
templates and matching from the saved labels alone; before they can show it, the detector once one is published or
shipped, else template matching; ``detector``; ``templates``),
``pseudo_templates`` (default: the bundle's, 20; 0: none): how many pseudo-templates join few saved labels (the
infer task computes them in the background after the labels change) or the datalist's few templates,
``device`` (``cpu``, ``cuda``, ``cuda:N``; default ``cuda`` when available, else ``cpu``; one this machine lacks
stops the start naming it): where the server infers and scores and the bundle trains, one stage-1 network on it,
``serve_logs`` (default ``false``; ``true``: ``/logs/`` serves the server log, and the train status its last lines).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

# MONAI Label makes this app's folder importable only while it loads this file (class_utils.module_from_file):
# the app's task package is imported now, and its other modules later through the package
from landmark_tasks.strategy import OrderedStrategy
from monailabel.config import settings
from monailabel.interfaces.app import MONAILabelApp
from monailabel.interfaces.exception import MONAILabelException

APP_DIR = Path(__file__).resolve().parent
# a background training's time budget in minutes (conf ``max_minutes``): with the scoring after it, within 15
DEFAULT_MAX_MINUTES = 12
logger = logging.getLogger(__name__)


def import_bundle(bundle_root: Path) -> None:
    """Import the ``bundle`` package of ``bundle_root`` (a conf key MONAI Label knows nothing of) under its name;
    nothing else of that folder (its ``scripts``, ``tests``) becomes importable. A ``bundle`` package already
    imported from another folder stops the start, naming both."""
    init = bundle_root / "bundle" / "__init__.py"
    loaded = sys.modules.get("bundle")
    if loaded is not None:
        if Path(loaded.__file__).resolve() != init.resolve():
            raise ImportError(f"a bundle package from {loaded.__file__} is loaded already, not {init}")
        return
    spec = importlib.util.spec_from_file_location("bundle", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["bundle"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["bundle"]
        raise


def training_defaults(conf: dict[str, str]) -> dict:
    """The train task's defaults from the conf keys ``epochs`` and ``max_minutes`` (``none``: no budget), checked as
    a train request's values are (ValueError naming a bad one)."""
    from landmark_tasks.train_options import BUNDLE_OPTIONS

    defaults = {}
    for key, default in (("epochs", 10), ("max_minutes", DEFAULT_MAX_MINUTES)):
        text = str(conf.get(key, default)).strip()
        if key == "max_minutes" and text.lower() in ("none", "null"):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = text  # not a number: refused below, saying what it must be
        try:
            defaults[key] = BUNDLE_OPTIONS[key](value)
        except ValueError as e:
            raise ValueError(f"--conf {key}: expected {e}, got {text!r}") from None
    return defaults


class LandmarkApp(MONAILabelApp):
    def __init__(self, app_dir: str, studies: str, conf: dict[str, str]) -> None:
        self.bundle_root = Path(conf.get("bundle_root", APP_DIR.parents[1])).resolve()
        if not (self.bundle_root / "configs" / "train.yaml").is_file():
            raise FileNotFoundError(
                f"bundle_root {self.bundle_root} holds no configs/train.yaml (set --conf bundle_root)"
            )
        import_bundle(self.bundle_root)
        from bundle import __version__ as bundle_version
        from bundle.settings import as_flag
        from landmark_tasks.context import BundleContext

        self.model_dir = Path(app_dir) / "model"
        self.context = BundleContext(
            self.bundle_root,
            conf.get("datalist"),
            conf.get("ckpt_path"),
            self.model_dir,
            conf.get("device"),
            conf.get("pseudo_templates"),
            conf.get("xfeat_refinement", "auto"),
        )
        self.train_defaults = training_defaults(conf)
        self.predictor = conf.get("predictor", "auto")
        self.serve_logs = as_flag(conf.get("serve_logs", "false"), "--conf serve_logs")
        if settings.MONAI_LABEL_SESSIONS:
            # MONAI Label's sessions unpack uploaded archives as they come (members may name paths outside);
            # the app takes an image id or an upload per request instead
            logger.info("sessions are off in this app (MONAI_LABEL_SESSIONS set to false): upload the file to infer")
            settings.MONAI_LABEL_SESSIONS = False
        super().__init__(
            app_dir=app_dir,
            studies=studies,
            conf=conf,
            name="Information-guided one-shot landmarks",
            description="Landmark suggestions from the labelled images (k-shot) by pixel-wise contrastive features "
            "(Quan et al., CVPR 2023), fine-tuned on the server's images",
            version=bundle_version,
        )
        if "monailabel.app" in sys.modules:  # the server process (not a training child)
            from landmark_tasks.guards import (
                install_infer_guard,
                install_names_guard,
                install_route_guard,
                install_status_guard,
                install_train_guard,
            )

            install_route_guard(self.studies.startswith(("http://", "https://")), self.serve_logs)
            install_infer_guard()
            install_train_guard(self._check_train_request)
            install_status_guard(self.serve_logs)
            install_names_guard()

    def _check_train_request(self, params: dict) -> None:
        """Before a train request is queued: its values, and enough saved labels for the detector
        (ValueError -> 422)."""
        from landmark_tasks.saved_labels import FINAL_TAG
        from landmark_tasks.train_options import check_contrastive_labels, check_detector_labels, validate_options

        options = validate_options(
            params, spatial_dims=self.context.spatial_dims, strict=True, network_config=self.context.network_config
        )
        n_labelled = len(self.datastore().get_labeled_images(FINAL_TAG))
        if options.get("network") == "detector":
            check_detector_labels(n_labelled)
        else:
            check_contrastive_labels(n_labelled, self.context.datalist is None)

    def _check_uploaded_image(self, path: str, name: str) -> None:
        """An image uploaded to the datastore: one file (:func:`landmark_tasks.uploads.check_upload`) that the bundle
        reads (ImageError naming ``name``)."""
        from landmark_tasks.uploads import check_upload

        check_upload(path, name)
        self.context.prepare({"image": path}, name)

    # ---- MONAI Label hooks ---------------------------------------------------------------------------
    def init_datastore(self):
        """The studies folder's datastore, or MONAI Label's DICOMweb one, confined (landmark_tasks/datastore.py)."""
        from landmark_tasks.datastore import LandmarkDatastore, confine, confined

        if self.studies.startswith(("http://", "https://")):
            if settings.MONAI_LABEL_DICOMWEB_CONVERT_TO_NIFTI:
                # MONAI Label's NIfTI conversion makes an X-ray a one-slice volume without its VOI window and
                # MONOCHROME1 inversion; the bundle reads the downloaded series folder itself
                logger.info(
                    "DICOMweb: the app reads each series as DICOM (MONAI_LABEL_DICOMWEB_CONVERT_TO_NIFTI set to false)"
                )
                settings.MONAI_LABEL_DICOMWEB_CONVERT_TO_NIFTI = False
            return confine(super().init_datastore())
        return confined(LandmarkDatastore)(
            self.studies,
            check_image=self._check_uploaded_image,
            check_label=lambda label, image, image_id: self.context.label_landmarks(
                label, image, f"image {image_id!r}"
            ),
            auto_reload=settings.MONAI_LABEL_DATASTORE_AUTO_RELOAD,
            read_only=settings.MONAI_LABEL_DATASTORE_READ_ONLY,
        )

    def init_infers(self):
        from landmark_tasks.infer import LandmarkInferTask

        return {"landmarks": LandmarkInferTask(self.context, datastore=self.datastore, predictor=self.predictor)}

    def init_trainers(self):
        from landmark_tasks.train import BundleTrainTask

        return {"landmarks": BundleTrainTask(self.context, self.train_defaults)}

    def init_strategies(self):
        return {**super().init_strategies(), "first": OrderedStrategy(last=False), "last": OrderedStrategy(last=True)}

    def next_sample(self, request):
        """MONAI Label's active learning; an unknown strategy is answered 404 naming the strategies, a ``client_id``
        (which MONAI Label stores in ``datastore_v2.json``) that is not a string of at most ``MAX_NAME_BYTES``
        bytes without control characters 400 naming it."""
        from fastapi import HTTPException
        from landmark_tasks.datastore import MAX_NAME_BYTES

        strategy = request.get("strategy") or "random"
        if strategy not in self._strategies:
            raise HTTPException(
                status_code=404, detail=f"no strategy {strategy!r}; the strategies are {sorted(self._strategies)}"
            )
        client_id = request.get("client_id")
        if client_id is not None:
            if not isinstance(client_id, str):
                problem = "it is not a string"
            elif any(ord(c) < 32 for c in client_id):
                problem = "it holds a control character"
            elif len(client_id.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                problem = f"it is longer than {MAX_NAME_BYTES} bytes"
            else:
                problem = None
            if problem:
                raise HTTPException(
                    status_code=400, detail=f"activelearning: 'client_id' {client_id!r:.60} refused: {problem}"
                )
        return super().next_sample(request)

    def infer(self, request, datastore=None):
        """``image``: an id of the (confined) datastore or an upload of this request; errors answered 4xx with their
        cause."""
        from fastapi import HTTPException
        from landmark_tasks.guards import upload_name
        from landmark_tasks.uploads import ImageError, cause_of, check_upload

        request = dict(request)
        image = request.get("image")
        name = upload_name(image)
        datastore = datastore or self.datastore()
        if name is not None:
            request["image_name"] = name
            request.pop("image_id", None)
        else:
            if not isinstance(image, str) or not image:
                raise HTTPException(
                    status_code=400,
                    detail="landmarks infer: give an image id of the datastore (?image=ID) or upload a file",
                )
            # a file, or a DICOM series folder from a DICOMweb datastore; a path is refused 400 there
            uri = datastore.get_image_uri(image)
            if not uri or not os.path.exists(uri):
                raise HTTPException(status_code=404, detail=f"landmarks infer: no image {image!r} in the datastore")
            request.update(image=uri, image_id=image, image_name=image)
        try:
            if name is not None:
                check_upload(image, name)
            return super().infer(request, datastore)
        except HTTPException:
            raise
        except ImageError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        except MONAILabelException as e:
            raise HTTPException(status_code=400, detail=e.msg) from None
        except (FileNotFoundError, ValueError) as e:
            raise HTTPException(
                status_code=422, detail=f"landmarks infer on {request.get('image_name')!r}: {e}"
            ) from None
        except Exception as e:
            logger.exception("landmarks infer failed")
            name = request.get("image_name")
            raise HTTPException(
                status_code=500, detail=f"landmarks infer on {name!r} failed: {cause_of(e, request['image'], name)}"
            ) from None
