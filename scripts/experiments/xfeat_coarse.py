"""XFeat's similarity in the coarse step of template matching (docs/results.md, "Tried and not kept", "The XFeat
step"): the template's XFeat descriptors at its landmarks are one more scale of the matcher's product of similarities,
beside the stage-1 network's scales, and the combined map's argmax is the match.

    python -m scripts.experiments.xfeat_coarse matching --datalist runs/hamedan/protocol.json --template 046 \
        --weights "[0.0,0.5,1.0,2.0,4.0]" --out runs/xfeat_coarse.json
    python -m scripts.experiments.xfeat_coarse pseudo_labels --datalist runs/hamedan/protocol_046.json \
        --output_dir runs/st2xc --copies 2 --reference runs/hamedan/protocol.json

``matching``: one template (``--template``, a labelled training image of the datalist), matched into the datalist's
validation images and its other labelled training images (those a one-label stage 2 pseudo-labels), each scored
against its own landmarks (MRE, median, SDR 2 / 4 mm, errors > 10 mm), for each XFeat weight (0: the matcher as
shipped), before and after the XFeat fine step (:class:`bundle.inferers.refinement.DescriptorRefinement`,
``--radius_mm``). ``pseudo_labels``: stage 2's pseudo-label file made by the config's own code with XFeat's map
``copies`` times among the stage-1 network's scales (``--copies 0``: as shipped); ``distances`` scores such a file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from bundle.checkpoints import load_weights
from bundle.data.datalist import landmarks_array, load_datalist, read_json
from bundle.geometry import apply_homogeneous
from bundle.inferers.refinement import PSEUDO_LABEL_RADIUS_MM, DescriptorRefinement
from bundle.io_utils import write_json_atomic
from bundle.networks.matching import TemplateMatcher, feature_vectors
from bundle.networks.xfeat import descriptor_map, xfeat_network
from monai.bundle import ConfigParser
from monai.transforms import Compose
from scripts.cli import run_fire
from scripts.experiments.xfeat_refinement import scores


def _grid_descriptors(xfeat, load: Compose, image: str) -> torch.Tensor:
    """XFeat's unit descriptors of the image file read by ``load``, ``(1, 64, X', Y')`` in MONAI's axis order (the map
    covers the whole image, as the network grid does)."""
    loaded = load({"image": image})["image"]
    return descriptor_map(xfeat, loaded).maps.transpose(-1, -2)


def main(
    datalist: str,
    template: str,
    weights: Sequence[float] = (0.0, 0.5, 1.0, 2.0),
    radius_mm: float = PSEUDO_LABEL_RADIUS_MM,
    ckpt_path: str = "models/model.pt",
    config_file: str = "configs/train.yaml",
    out: str | None = None,
) -> list[dict]:
    """Score the matching of ``template`` with each XFeat weight (module doc); print the rows, write them to ``out``."""
    parser = ConfigParser()
    parser.read_config(config_file)
    parser["datalist"] = str(Path(datalist).resolve())
    network = load_weights(parser.get_parsed_content("network_def"), ckpt_path).eval()
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    load_transforms = parser.get_parsed_content("load_transforms")
    data = load_datalist(datalist)
    labelled = [it for it in data["training"] if it.get("landmarks")]
    chosen = [it for it in labelled if Path(it["image"]).stem == str(template)]
    if len(chosen) != 1:
        raise ValueError(f"{datalist}: {len(chosen)} labelled training items named {template!r}")
    targets = {
        "validation": list(data["validation"]),
        "training": [it for it in labelled if it["image"] != chosen[0]["image"]],
    }
    refinement = DescriptorRefinement(chosen, radius_mm=radius_mm, load_transforms=load_transforms)
    xfeat = xfeat_network()
    n_landmarks = len(data["landmark_names"])

    def prepared(item: dict):
        sample = preprocessing(dict(item))
        image = torch.as_tensor(sample["image"])[None].float()
        with torch.no_grad():
            features = [f.float() for f in network(image)] + [_grid_descriptors(xfeat, refinement.load, item["image"])]
        return features, torch.as_tensor(sample["label"]).double(), torch.as_tensor(sample["grid_to_physical"])

    t_features, t_mm, t_g2p = prepared(chosen[0])
    grid = list(parser.get_parsed_content("image_size"))
    t_points = apply_homogeneous(t_g2p, t_mm, inverse=True)  # physical mm to grid pixels
    queries = feature_vectors(t_features, t_points[None].float(), grid)
    n_scales = len(t_features) - 1
    predicted: dict[float, dict[str, dict[str, np.ndarray]]] = {w: {s: {} for s in targets} for w in weights}
    truth: dict[str, dict[str, tuple]] = {s: {} for s in targets}
    for split, items in targets.items():
        for item in items:
            features, _, g2p = prepared(item)
            spacing = np.asarray(item["spacing"], dtype=np.float64)
            truth[split][item["image"]] = (landmarks_array(item, n_landmarks, 2), spacing)
            for w in weights:
                scales = [*range(n_scales), n_scales] if w > 0 else list(range(n_scales))
                matcher = TemplateMatcher(scale_weights=[1.0] * n_scales + ([float(w)] if w > 0 else []))
                with torch.no_grad():
                    found, _ = matcher([queries[s] for s in scales], [features[s] for s in scales], grid)
                mm = apply_homogeneous(g2p.double(), found[0]).numpy()
                predicted[w][split][item["image"]] = mm / spacing
            print(f"{split} {Path(item['image']).stem}", flush=True)
    table = []
    for w in weights:
        for split in targets:
            points = predicted[w][split]
            refined = {image: refinement.refine(image, p, truth[split][image][1]) for image, p in points.items()}
            for step, found in (("matched", points), (f"refined {radius_mm} mm", refined)):
                row = {"xfeat_weight": w, "images": split, "step": step, **scores(found, truth[split])}
                print(row, flush=True)
                table.append(row)
    if out:
        write_json_atomic(out, table)
    return table


class DescriptorScales(torch.nn.Module):
    """The stage-1 ``network`` with XFeat's descriptor map of each input's image file appended ``copies`` times (the
    matcher's product of scales: XFeat's weight), the file found by the input's bytes (``files``, :func:`_image_key`
    of each grid image the run will see)."""

    def __init__(self, network: torch.nn.Module, files: dict[str, str], load: Compose, copies: int):
        super().__init__()
        self.network, self.files, self.copies = network, files, int(copies)
        self._xfeat = [xfeat_network()]  # not a submodule: the template cache follows the stage-1 weights alone
        self._load, self._maps = load, {}

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = list(self.network(x))
        maps = []
        for b in range(x.shape[0]):
            image = self.files[_image_key(x[b])]
            if image not in self._maps:
                self._maps[image] = _grid_descriptors(self._xfeat[0], self._load, image)
            maps.append(self._maps[image].to(x.device))
        descriptors = torch.cat(maps)
        return features + [descriptors] * self.copies


def _real(path: str) -> str:
    return str(Path(path).resolve())


def _image_key(image: torch.Tensor) -> str:
    return hashlib.sha1(np.ascontiguousarray(image.detach().cpu().float().numpy()).tobytes()).hexdigest()


def pseudo_labels(
    datalist: str,
    output_dir: str,
    copies: int = 2,
    reference: str | None = None,
    config_file: Sequence[str] = ("configs/train.yaml", "configs/train_stage2.yaml", "configs/hamedan_ceph.yaml"),
) -> dict:
    """Stage 2's pseudo-labels (``OUTPUT_DIR/pseudo_labels.json``, for ``--pseudo_labels``) made as the config makes
    them (the templates, the pseudo-templates, the matching and the XFeat fine step of ``xfeat_refinement``) with
    XFeat's map ``copies`` times among the matcher's scales (its weight); with ``reference``, their distances to its
    training landmarks."""
    parser = ConfigParser()
    parser.read_config(list(config_file))
    parser["datalist"] = str(Path(datalist).resolve())
    parser["output_dir"] = str(Path(output_dir).resolve())
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    dataset = parser.get_parsed_content("dataset")
    files = {}
    for item in [*dataset["training"], *dataset.get("templates", []), dataset.get("template") or {}]:
        if item:
            files[_image_key(torch.as_tensor(preprocessing({"image": item["image"]})["image"]))] = item["image"]
    load = Compose(parser.get_parsed_content("load_transforms"))
    network = parser.get_parsed_content("stage1_network")
    parser["stage1_network"] = DescriptorScales(network, files, load, copies).eval()
    items = parser.get_parsed_content("stage2#items")
    written = Path(output_dir) / "pseudo_labels.json"
    print(f"{written}: {len(items)} training items", flush=True)
    return {} if reference is None else distances(str(written), reference)


def distances(pseudo_labels: str, reference: str) -> dict:
    """The pseudo-labels' distances to ``reference``'s training landmarks (human-labelled templates left out)."""
    data = read_json(Path(pseudo_labels), "pseudo-label datalist")
    truth = {
        _real(it["image"]): (landmarks_array(it, len(it["landmarks"]), 2), np.asarray(it["spacing"], float))
        for it in load_datalist(reference)["training"]
        if it.get("landmarks")
    }
    made = {_real(it["image"]): landmarks_array(it, len(it["landmarks"]), 2) for it in data["training"]}
    pseudo = set(data["pseudo_labels"]["cycle_error"]) | {
        _real(it["image"]) for it in data["training"] if it.get("pseudo_label")
    }
    found = scores(made, {k: v for k, v in truth.items() if k in {_real(p) for p in pseudo}})
    print(found, flush=True)
    return found


if __name__ == "__main__":
    run_fire({"matching": main, "pseudo_labels": pseudo_labels, "distances": distances})
