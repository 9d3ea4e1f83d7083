"""The app in-process, run in the MONAI Label environment by tests/test_monailabel_apps.py (MONAI Label's own code
paths that a server over a local 2D studies folder does not reach). Each scenario prints ``RESULT <json>``.

``dicomweb WORK DATALIST SERIES_FOLDER SERIES_UID PNG``: the app on a DICOMweb studies URL. There is no DICOMweb
server here, so MONAI Label's transport is replaced: the client's QIDO search answers with one series (and no SEG
series) and the series download copies a local folder of DICOM files into MONAI Label's cache, where its
``DICOMWebDatastore`` hands the app what it would hand it after a real download. The rest (the app's datastore
set-up, MONAI Label's datastore and ``infer``, the app's reading of the image) is the real code. Prints
``{"dicomweb": landmarks, "local": landmarks}``: the series inferred through DICOMweb, and its PNG through a
local studies folder.

``ct WORK DATALIST CKPT STUDIES TEMPLATE_ID TEMPLATE_LABEL TARGET_LABEL`` (a 3D datalist: the app takes the 3D
configs): infers the first study (the target) with the bundle's templates, saves ``TEMPLATE_LABEL`` (a Slicer point
list) as the final label of ``TEMPLATE_ID`` and infers again (k-shot from the saved label), fine-tunes one tiny
epoch through the train task, then saves ``TARGET_LABEL`` as the target's label, trains the stage-2 detector
(published whatever its score) and infers with it. Prints ``{"bundle", "saved_label", "detector": suggestions,
"train", "detector_train": stats, "missing_weights": the start-up error of an app given no weights}``.

``priority WORK``: the train task's child process, and the app's training defaults from its conf (see ``priority``).

``split WORK``: the detector's held-out split (``landmark_tasks.train.detector_split``) for 2 to 20 labelled ids,
and its training grid (``landmark_tasks.train.detector_training_grid``) without and with a requested one, 2D and 3D,
and continuing a served detector's.

``full_disk WORK``: the app's local datastore (``landmark_tasks.datastore``) on a studies folder of one image with a
saved label, its writes made to fail as on a full disk (the copy of a label and the write of ``datastore_v2.json``
write half, then raise ENOSPC). Prints each refusal (status, detail) and whether the label and the datastore's
file are as they were, with no file left beside them.

``detector_publish WORK``: a served detector and its record (``detector.json``), then a publication whose copy of
the weights fails half-way as on a full disk (``landmark_tasks.publication.publish_detector``). Prints the error and
whether the model folder is as it was.

``label_race WORK``: the app's local datastore on a studies folder of one unlabelled image ``a`` (picture A): a
label of ``a`` is saved, and while it is checked (against A) another thread re-uploads ``a`` as picture B without
``{"replace": true}``. Prints the re-upload's status, the picture the label was checked on and the one stored, and
whether the label is stored.

``refused_template WORK DATALIST STUDIES TEMPLATE_ID TEMPLATE_LABEL``: an app (templates predictor, no
pseudo-templates) with ``TEMPLATE_LABEL`` saved as the final label of ``TEMPLATE_ID`` infers another study while the
pipeline's template rule (``bundle.transforms.landmarks.template_problem``, which the save-time check does not
reach) refuses the saved label, then while it fails inside; the rules agree on every real label (one definition),
so the fault is injected. Prints each refusal (status, detail) and the templates of a suggestion after them.

``device WORK DATALIST STUDIES TEMPLATE_ID TEMPLATE_LABEL``: apps given devices this machine lacks (their start-up
errors), then an app on ``--conf device cpu``: infers the first study with the bundle's templates, saves
``TEMPLATE_LABEL`` as the final label of ``TEMPLATE_ID``, infers again and fine-tunes one tiny epoch (scored in
this process). Prints the devices that the infer task and the trainer recorded and how many stage-1 networks
are alive after inference and after training.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def new_app(work: Path, studies: str, datalist: str, **conf: str):
    """A fresh copy of the app (its model folder is written) on ``studies``, with the bundle's templates from
    ``datalist`` and the other ``conf`` keys."""
    app_dir = work / f"app-{len(list(work.glob('app-*')))}"
    shutil.copytree(ROOT / "apps" / "monailabel", app_dir, ignore=shutil.ignore_patterns("model", "__pycache__"))
    (app_dir / "bin").mkdir()
    (app_dir / "bin" / "itkimage2segimage").touch()  # MONAI Label downloads dcmqi unless it is there
    # loaded as MONAI Label loads an app (its folder on sys.path while main.py runs)
    from monailabel.utils.others.class_utils import get_class_of_subclass_from_file

    LandmarkApp = get_class_of_subclass_from_file("main", str(app_dir / "main.py"), "MONAILabelApp")
    return LandmarkApp(str(app_dir), studies, {"bundle_root": str(ROOT), "datalist": datalist, **conf})


def settle(app) -> None:
    """Wait until the app's background work (auto's choice, pseudo-templates) is done: a process that ends while a
    daemon thread runs the network is aborted by PyTorch."""
    infer = app._infers["landmarks"]
    deadline = time.monotonic() + 300
    while infer.pending() and time.monotonic() < deadline:
        time.sleep(0.1)


def dicomweb(work: str, datalist: str, series_folder: str, series_uid: str, png: str) -> dict:
    work = Path(work)
    import monailabel.datastore.dicom as dicomweb
    from monailabel.config import settings

    settings.MONAI_LABEL_DICOMWEB_CACHE_PATH = str(work / "cache")
    settings.MONAI_LABEL_DICOMWEB_CONVERT_TO_NIFTI = True  # MONAI Label's default, which the app turns off
    series = {"0020000E": {"vr": "UI", "Value": [series_uid]}, "0020000D": {"vr": "UI", "Value": ["1.2.3.4"]}}

    def search_for_series(self, *args, search_filters=None, **kwargs):
        return [] if (search_filters or {}).get("Modality") == "SEG" else [series]

    def download_series(study_id, series_id, save_dir, client, frame_fetch=False):
        assert series_id == series_uid, series_id
        os.makedirs(save_dir, exist_ok=True)
        for f in Path(series_folder).iterdir():
            shutil.copy(f, save_dir)

    dicomweb.DICOMwebClientX.search_for_series = search_for_series
    dicomweb.dicom_web_download_series = download_series

    out = {}
    app = new_app(work, "http://127.0.0.1:9/dicom-web", datalist)
    out["dicomweb"] = app.infer({"model": "landmarks", "image": series_uid})["params"]["landmarks"]
    studies = work / "studies"
    studies.mkdir()
    shutil.copy(png, studies / "xray.png")
    app = new_app(work, str(studies), datalist)
    out["local"] = app.infer({"model": "landmarks", "image": "xray"})["params"]["landmarks"]
    return out


def ct(
    work: str, datalist: str, ckpt: str, studies: str, template_id: str, template_label: str, target_label: str
) -> dict:
    work = Path(work)
    out = {}
    try:
        new_app(work, studies, datalist, ckpt_path=str(work / "missing.pt"))
    except FileNotFoundError as e:
        out["missing_weights"] = str(e)
    app = new_app(work, studies, datalist, ckpt_path=ckpt)
    target = sorted(app.datastore().list_images())[0]

    def infer(**request) -> dict:
        params = app.infer({"model": "landmarks", "image": target, **request})["params"]
        return {k: params[k] for k in ("landmarks", "templates", "markups", "predictor")}

    out.update(image=target, bundle=infer())
    app.datastore().save_label(template_id, template_label, "final", {})
    out["saved_label"] = infer()
    tiny = {"epochs": 1, "epoch_length": 1, "batch_size": 1, "image_size": [48, 48, 48]}
    out["train"] = app.train({"model": "landmarks", **tiny, "crop_size": [32, 32, 32], "num_queries": 4})
    app.datastore().save_label(target, target_label, "final", {})  # two labels: one to train on, one held out
    out["detector_train"] = app.train({"model": "landmarks", **tiny, "network": "detector", "publish": "always"})
    out["detector"] = infer(predictor="detector")  # (auto serves no detector that learnt from one label)
    settle(app)
    return out


def device(work: str, datalist: str, studies: str, template_id: str, template_label: str) -> dict:
    import gc

    work = Path(work)
    out: dict = {"refused": {}}
    for bad in ("cuda:7", "tpu", "cuda:x"):
        try:
            new_app(work, studies, datalist, device=bad)
        except ValueError as e:
            out["refused"][bad] = str(e)
    app = new_app(work, studies, datalist, device="cpu")
    from bundle.networks.contrastive import ContrastiveLandmarkNet

    def networks() -> int:
        gc.collect()
        return sum(isinstance(o, ContrastiveLandmarkNet) for o in gc.get_objects())

    target = sorted(app.datastore().list_images())[0]
    out["infer_device"] = app.infer({"model": "landmarks", "image": target})["params"]["device"]
    out["networks_after_infer"] = networks()  # the bundle's template choice and the inference
    app.datastore().save_label(template_id, template_label, "final", {})
    app.infer({"model": "landmarks", "image": target})
    # that suggestion started the pseudo-templates of the saved label, on the background worker's own network,
    # which is gone with the worker
    settle(app)
    tiny = {"epochs": 1, "epoch_length": 1, "batch_size": 1, "image_size": [64, 64], "crop_size": [32, 32]}
    out["train_device"] = app.train({"model": "landmarks", **tiny, "num_queries": 4})["device"]
    out["networks_after_train"] = networks()  # the old and new weights scored here too
    return out


def split(work: str) -> dict:
    """The detector's held-out split of n labelled ids: ``{n: [trained, held out]}`` and whether a split grown from
    a served detector's keeps its held-out images held out and its training images in training."""
    sys.path[:0] = [str(ROOT), str(ROOT / "apps" / "monailabel")]
    from bundle.configs import bundle_parser, config_files
    from landmark_tasks.train import detector_split, detector_training_grid

    ids = [f"img{k:02d}" for k in range(20)]
    out: dict = {n: [len(part) for part in detector_split(ids[:n])] for n in (2, 3, 4, 5, 10, 12, 20)}
    trained, held = detector_split(ids[:5])
    _, grown = detector_split(ids[:10], {"trained_on": trained, "held_out": held})
    out["sticky"] = set(held) <= set(grown) and not set(trained) & set(grown)
    grid2, grid3 = (bundle_parser(config_files("train", dims))["image_size"] for dims in (2, 3))
    out["grid"] = [detector_training_grid({}, grid2), detector_training_grid({"image_size": [64, 64]}, grid2)]
    out["grid"] += [detector_training_grid({}, grid3), detector_training_grid({}, grid2, [288, 288])]
    return out


def priority(work: str) -> dict:
    """The train task's child process (``BundleTrainTask._run_bundle``, given a stand-in for the bundle's training
    that writes its own niceness and a ``last.pt`` of 3 epochs of 5 iterations into the candidate's folder) and the
    app's training defaults from its conf (the error of each bad one). Prints ``{"own", "child", "epochs_run",
    "defaults", "refused"}``."""
    sys.path[:0] = [str(ROOT), str(ROOT / "apps" / "monailabel")]
    from types import SimpleNamespace

    from landmark_tasks.train import BundleTrainTask
    from main import training_defaults

    candidate = Path(work) / "model_final.pt"
    child = (
        "import os, sys, torch; from pathlib import Path; folder = Path(sys.argv[1]); "
        "(folder / 'model_final.pt').write_text(str(os.nice(0))); "
        "torch.save({'trainer': {'iteration': 15, 'epoch_length': 5, 'max_epochs': 3}}, folder / 'last.pt')"
    )
    task = BundleTrainTask.__new__(BundleTrainTask)
    task.context = SimpleNamespace(bundle_root=ROOT)
    epochs_run = task._run_bundle([sys.executable, "-c", child, str(work)], candidate)
    refused = {}
    for conf in ({"max_minutes": "0"}, {"max_minutes": "soon"}, {"epochs": "2.5"}, {"max_minutes": "nan"}):
        try:
            training_defaults(conf)
        except ValueError as e:
            refused[json.dumps(conf)] = str(e)
    defaults = [training_defaults({}), training_defaults({"max_minutes": "none", "epochs": "4"})]
    return {
        "own": os.nice(0),
        "child": int(candidate.read_text()),
        "epochs_run": epochs_run,
        "defaults": defaults,
        "refused": refused,
    }


def full_disk(work: str) -> dict:
    import errno
    import pathlib
    from unittest import mock

    sys.path[:0] = [str(ROOT), str(ROOT / "apps" / "monailabel")]
    from fastapi import HTTPException
    from landmark_tasks import datastore as ds
    from PIL import Image

    studies = Path(work) / "studies"
    studies.mkdir()
    Image.new("L", (8, 8)).save(studies / "a.png")
    store = ds.confined(ds.LandmarkDatastore)(str(studies))
    (Path(work) / "old.mrk.json").write_text('{"markups": []}')
    (Path(work) / "new.mrk.json").write_text('{"markups": [' + " " * 4000 + "]}")
    store.save_label("a", str(Path(work) / "old.mrk.json"), "final", {})
    label, config = studies / "labels" / "final" / "a.mrk.json", studies / "datastore_v2.json"
    before = {p: p.read_bytes() for p in (label, config)}

    def half_then_full(write):
        def failing(*args, **kwargs):
            write(*args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return failing

    def half_copy(source, dest, **kwargs):
        Path(dest).write_bytes(Path(source).read_bytes()[:100])

    def half_text(path, text, **kwargs):
        with open(path, "w") as f:
            f.write(text[:10])

    out: dict = {}
    attempts = {
        "label": (
            mock.patch("shutil.copyfile", half_then_full(half_copy)),
            lambda: store.save_label("a", str(Path(work) / "new.mrk.json"), "final", {}),
        ),
        "datastore_file": (
            mock.patch.object(pathlib.Path, "write_text", half_then_full(half_text)),
            lambda: store.update_image_info("a", {"note": "x" * 100}),
        ),
    }
    for what, (patch, attempt) in attempts.items():
        with patch:
            try:
                attempt()
                out[what] = None
            except HTTPException as e:
                out[what] = [e.status_code, e.detail]
            except OSError as e:
                out[what] = [type(e).__name__, str(e)]
    out["intact"] = {p: p.read_bytes() for p in before} == before
    out["label_folder"] = sorted(os.listdir(label.parent))
    out["studies"] = sorted(os.listdir(studies))
    return out


def detector_publish(work: str) -> dict:
    import errno
    from types import SimpleNamespace
    from unittest import mock

    sys.path[:0] = [str(ROOT), str(ROOT / "apps" / "monailabel")]
    from landmark_tasks import publication

    model = Path(work) / "model"
    model.mkdir()
    context = SimpleNamespace(detector_path=model / "detector.pt", detector_info_path=model / "detector.json")
    context.detector_path.write_bytes(b"old weights")
    context.detector_info_path.write_text('{"image_size": [64, 64]}')
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    (Path(work) / "candidate.pt").write_bytes(b"new weights" * 1000)

    def half_copy(source, dest, **kwargs):
        Path(dest).write_bytes(Path(source).read_bytes()[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with mock.patch("shutil.copyfile", half_copy):
        try:
            publication.publish_detector(context, Path(work) / "candidate.pt", {"image_size": [128, 128]})
            error = None
        except OSError as e:
            error = str(e)
    return {"error": error, "intact": {p.name: p.read_bytes() for p in model.iterdir()} == before}


def label_race(work: str) -> dict:
    import threading

    import numpy as np

    sys.path[:0] = [str(ROOT), str(ROOT / "apps" / "monailabel")]
    from fastapi import HTTPException
    from landmark_tasks import datastore as ds
    from PIL import Image

    studies, other = Path(work) / "studies", Path(work) / "b.png"
    studies.mkdir()
    rng = np.random.default_rng(0)
    for path in (studies / "a.png", other):
        Image.fromarray(rng.integers(0, 255, (64, 64), dtype=np.uint8)).save(path)
    pictures = {(studies / "a.png").read_bytes(): "A", other.read_bytes(): "B"}
    out: dict = {}

    def reupload() -> None:
        try:
            store.add_image("a", str(other), {})
            out["reupload"] = 200
        except HTTPException as e:
            out["reupload"] = e.status_code

    uploader = threading.Thread(target=reupload, daemon=True)

    def check_label(label: str, image: str, image_id: str) -> None:
        out["checked_on"] = pictures.get(Path(image).read_bytes())
        uploader.start()
        uploader.join(timeout=2)  # done unless it waits for this save

    store = ds.confined(ds.LandmarkDatastore)(str(studies), check_label=check_label)
    label = Path(work) / "a.mrk.json"
    label.write_text('{"markups": []}')
    store.save_label("a", str(label), "final", {})
    uploader.join(timeout=60)
    out["stored"] = pictures.get((studies / "a.png").read_bytes())
    out["label_stored"] = (studies / "labels" / "final" / "a.mrk.json").is_file()
    out["label_listed"] = "final" in store.get_labels_by_image_id("a")
    return out


def refused_template(work: str, datalist: str, studies: str, template_id: str, template_label: str) -> dict:
    from unittest import mock

    from fastapi import HTTPException

    app = new_app(Path(work), studies, datalist, device="cpu", pseudo_templates="0", predictor="templates")
    app.datastore().save_label(template_id, template_label, "final", {})
    target = next(i for i in sorted(app.datastore().list_images()) if i != template_id)
    out: dict = {}
    faults = {
        "refused": {"return_value": "the pipeline's own refusal"},
        "internal": {"side_effect": RuntimeError("an internal fault")},
    }
    for what, fault in faults.items():
        # the pipeline's template rule alone (LandmarkTargetsd's check_landmarks; the app's save-time check is kept)
        with mock.patch("bundle.transforms.landmarks.template_problem", **fault):
            try:
                app.infer({"model": "landmarks", "image": target})
                out[what] = None
            except HTTPException as e:
                out[what] = [e.status_code, e.detail]
    out["after"] = app.infer({"model": "landmarks", "image": target})["params"]["templates"]
    settle(app)
    return out


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    scenarios = {
        "dicomweb": dicomweb,
        "ct": ct,
        "device": device,
        "split": split,
        "priority": priority,
        "full_disk": full_disk,
        "label_race": label_race,
        "refused_template": refused_template,
        "detector_publish": detector_publish,
    }
    print("RESULT " + json.dumps(scenarios[scenario](*args), default=str))
