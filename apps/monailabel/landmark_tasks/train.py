"""MONAI Label train task: the bundle's own training (``monai.bundle run training``) on the server's images.

The method learns without labels, so every image of the datastore is a training image; the bundle's
datalist still supplies the template and the labelled validation items that pick the best checkpoint.
Training runs in a child process (the bundle's command line), writing ``model.pt`` to the app's model
folder, which the infer task then loads.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from monailabel.interfaces.datastore import Datastore
from monailabel.interfaces.tasks.train import TrainTask

from bundle.data.datalist import open_datalist
from bundle.io_utils import write_json_atomic

logger = logging.getLogger(__name__)
# request keys passed to the bundle as --key value (anything else in the request is ignored)
BUNDLE_KEYS = ("epochs", "epoch_length", "batch_size", "learning_rate", "image_size", "crop_size", "num_queries", "val_interval", "seed")


def server_datalist(base: dict, images: list[str], base_dir: Path) -> dict:
    """A datalist whose ``training`` items are the server's ``images`` (absolute paths); ``base`` keeps the rest.

    ``base``'s template and validation items (paths made absolute against ``base_dir``) stay, so that
    validation and the one-shot template work as before.
    """
    if not images:
        raise ValueError("the datastore holds no image to train on")

    def absolute(item: dict) -> dict:
        return dict(item, image=str((base_dir / item["image"]).resolve()))

    out = {k: v for k, v in base.items() if k not in ("training", "validation", "test", "template")}
    out["training"] = [{"image": str(Path(i).resolve())} for i in images]
    out["validation"] = [absolute(it) for it in base.get("validation", [])]
    out["test"] = []
    if base.get("template") is not None:
        out["template"] = absolute(base["template"])
    else:  # keep the labelled training items so that a template can still be chosen
        out["training"] += [absolute(it) for it in base.get("training", []) if it.get("landmarks")]
    return out


class BundleTrainTask(TrainTask):
    """Train the bundle on the datastore's images; the best checkpoint goes to ``model_dir/model.pt``."""

    def __init__(self, bundle_root: Path, model_dir: Path, datalist: str, defaults: dict[str, Any] | None = None) -> None:
        super().__init__("Self-supervised training of the bundle on the server's images (no labels needed)")
        self.bundle_root = Path(bundle_root)
        self.model_dir = Path(model_dir)
        self.datalist = Path(datalist)
        self.defaults = dict(defaults or {})
        self._stats: dict[str, Any] = {}

    def config(self) -> dict[str, Any]:
        return dict(self.defaults)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def __call__(self, request: dict, datastore: Datastore) -> dict[str, Any]:
        images = [datastore.get_image_uri(i) for i in datastore.list_images()]
        base = open_datalist(self.datalist)
        work = self.model_dir / "train"
        datalist_path = write_json_atomic(work / "datalist.json", server_datalist(base, images, self.datalist.parent))
        options = {**self.defaults, **{k: request[k] for k in BUNDLE_KEYS if k in request}}
        command = [
            sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", "configs/train.yaml",
            "--datalist", str(datalist_path), "--ckpt_dir", str(self.model_dir), "--output_dir", str(work / "output"),
            "--progress_bar", "False",
        ]
        for key, value in options.items():
            command += [f"--{key}", json.dumps(value)]
        logger.info(f"training on {len(images)} images: {' '.join(command)}")
        start = time.time()
        done = subprocess.run(command, cwd=self.bundle_root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"bundle training failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        self._stats = {
            "images": len(images),
            "checkpoint": str(self.model_dir / "model.pt"),
            "seconds": round(time.time() - start, 1),
            "options": options,
        }
        return self._stats
