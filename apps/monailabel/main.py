"""MONAI Label app of the bundle: landmark suggestion on new images and training on the server's images.

    monailabel start_server --app apps/monailabel --studies STUDIES [--conf datalist PATH] [--conf ckpt_path PATH]

Infer task ``landmarks``: every landmark of the bundle's template on the image, from the shipped model
(``models/model.pt`` or ``--conf ckpt_path``; the app's own ``model/model.pt`` as soon as the train task
has written it), with no user input.
Train task ``landmarks``: the bundle's self-supervised training on the datastore's images.
Conf keys: ``bundle_root`` (default: the repository holding this app), ``datalist`` (default: the
bundle's embedded synthetic datalist, generated when missing), ``ckpt_path``, ``epochs``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from monailabel.interfaces.app import MONAILabelApp

APP_DIR = Path(__file__).resolve().parent
logger = logging.getLogger(__name__)


class LandmarkApp(MONAILabelApp):
    def __init__(self, app_dir: str, studies: str, conf: dict[str, str]) -> None:
        self.bundle_root = Path(conf.get("bundle_root", APP_DIR.parents[1])).resolve()
        if not (self.bundle_root / "configs" / "train.yaml").is_file():
            raise FileNotFoundError(f"bundle_root {self.bundle_root} holds no configs/train.yaml (set --conf bundle_root)")
        for path in (str(self.bundle_root), str(APP_DIR)):  # the bundle package and this app's tasks
            if path not in sys.path:
                sys.path.insert(0, path)
        from bundle import __version__ as bundle_version

        self.model_dir = Path(app_dir) / "model"
        self.datalist = conf.get("datalist", str(self.bundle_root / "data" / "synthetic_2d" / "datalist.json"))
        self.ckpt_path = Path(conf.get("ckpt_path", self.bundle_root / "models" / "model.pt"))
        self.train_defaults = {"epochs": int(conf.get("epochs", 10))}
        super().__init__(
            app_dir=app_dir,
            studies=studies,
            conf=conf,
            name="Information-guided one-shot landmarks",
            description="Landmark suggestions from one template by pixel-wise contrastive features (Quan et al., CVPR 2023)",
            version=bundle_version,
        )

    def init_infers(self):
        from landmark_tasks.infer import LandmarkInferTask

        return {"landmarks": LandmarkInferTask(self.bundle_root, self.ckpt_path, self.model_dir / "model.pt", datalist=self.datalist)}

    def init_trainers(self):
        from landmark_tasks.train import BundleTrainTask

        return {"landmarks": BundleTrainTask(self.bundle_root, self.model_dir, self.datalist, self.train_defaults)}
