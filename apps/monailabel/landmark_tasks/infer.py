"""MONAI Label infer task: landmarks suggested on a new image by one-shot matching (paper Sec. 3.4).

No input from the user: the bundle's weights and templates (the datalist's ``templates`` / ``template`` items, or one chosen
among its labelled training items) give every landmark. The result is returned in the forms viewers read:
a 3D Slicer markups file (``.mrk.json``, also under ``markups`` in the result JSON), the points as ``landmarks`` (image
pixels in 2D / world mm in 3D) and OHIF-style ``centroids`` (``{name: [index, i, j, k]}``, voxel indices).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monailabel.interfaces.tasks.infer_v2 import InferTask, InferType

from bundle.data.markups import ControlPoint, write_mrk_json
from bundle.configs import bundle_parser
from bundle.engine import load_weights, with_templates

logger = logging.getLogger(__name__)
CONFIGS = ("configs/train.yaml", "configs/evaluate.yaml")  # the datalist's template; inference.yaml is standalone


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


def markups_points(names: list[str], points_mm: np.ndarray) -> list[ControlPoint]:
    """Control points in RAS for ``write_mrk_json``.

    3D points are world RAS mm already. A 2D image read by 3D Slicer (ITK) has its pixel (x, y) at LPS
    ``(x * sx, y * sy, 0)``, i.e. RAS ``(-x * sx, -y * sy, 0)``.
    """
    out = []
    for name, p in zip(names, points_mm):
        if not np.isfinite(p).all():
            out.append(ControlPoint(name, None))
        elif p.shape[0] == 2:
            out.append(ControlPoint(name, (-float(p[0]), -float(p[1]), 0.0)))
        else:
            out.append(ControlPoint(name, tuple(float(v) for v in p)))
    return out


class LandmarkInferTask(InferTask):
    """Suggest every landmark of the bundle's template on the requested image (no clicks, no labels)."""

    def __init__(self, bundle_root: Path, ckpt_path: Path, trained_path: Path | None = None, datalist: str | None = None) -> None:
        self.bundle_root = Path(bundle_root)
        self.shipped_path = Path(ckpt_path)
        self.trained_path = None if trained_path is None else Path(trained_path)
        self.ckpt_path = self._current_checkpoint()
        overrides = {"ckpt_path": str(self.ckpt_path)} if datalist is None else {"datalist": datalist, "ckpt_path": str(self.ckpt_path)}
        self.parser = bundle_parser(CONFIGS, self.bundle_root, **overrides)
        self.names = list(self.parser.get_parsed_content("landmark_names"))
        self.spatial_dims = int(self.parser.get_parsed_content("spatial_dims"))
        super().__init__(
            type=InferType.DETECTION,
            labels={n: i + 1 for i, n in enumerate(self.names)},
            dimension=self.spatial_dims,
            description="One-shot landmark suggestion (information-guided pixel-wise contrastive features)",
            config={"template": None},
        )
        self._lock = threading.Lock()
        self.preprocessing = self.parser.get_parsed_content("validate#preprocessing")
        self.device = self.parser.get_parsed_content("device")
        self.network = self.parser.get_parsed_content("network")  # loads ckpt_path
        self._loaded_mtime = self.ckpt_path.stat().st_mtime
        templates = self.parser.get_parsed_content("evaluate#templates")
        self._config["template"] = [t["image"] for t in templates]
        self.inferer = with_templates(self.parser.get_parsed_content("evaluate#inferer"), templates, self.preprocessing, self.device)

    def is_valid(self) -> bool:
        return self._current_checkpoint().is_file()

    def _current_checkpoint(self) -> Path:
        """The app's own trained weights once the train task has written them, else the shipped ones."""
        if self.trained_path is not None and self.trained_path.is_file():
            return self.trained_path
        return self.shipped_path

    def _reload_if_retrained(self) -> None:
        """Pick up the weights the train task wrote since the last request."""
        path = self._current_checkpoint()
        mtime = path.stat().st_mtime
        if (path, mtime) != (self.ckpt_path, self._loaded_mtime):
            load_weights(self.network, path, self.device)
            self.ckpt_path, self._loaded_mtime = path, mtime
            logger.info(f"reloaded weights from {path}")

    def __call__(self, request: dict) -> tuple[str, dict]:
        image = request.get("image")
        if not image or not Path(image).is_file():
            raise FileNotFoundError(f"landmarks infer: image not found: {image!r}")
        with self._lock, torch.no_grad():
            self._reload_if_retrained()
            data = self.preprocessing({"image": str(image)})
            self.network.eval()
            batch = torch.as_tensor(data["image"]).unsqueeze(0).to(self.device)
            g2p = torch.as_tensor(data["grid_to_physical"]).unsqueeze(0).to(self.device)
            points_mm = self.inferer(batch, self.network, g2p)[0].cpu().numpy()
        spacing = np.asarray(torch.as_tensor(data["spacing"]).cpu(), dtype=np.float64).reshape(-1)
        result = landmark_result(self.names, points_mm, spacing)
        fd, path = tempfile.mkstemp(suffix=".mrk.json")
        os.close(fd)
        write_mrk_json(path, markups_points(self.names, points_mm), coordinate_system="LPS" if self.spatial_dims == 2 else "RAS")
        result["markups"] = json.loads(Path(path).read_text())
        result["template"] = self._config["template"]
        result["checkpoint"] = str(self.ckpt_path)
        return path, result
