"""Write a template feature file (``bundle.template_file``): the network's feature vectors at K templates' landmarks.

    python -m scripts.build_template --datalist runs/hamedan/protocol.json --output models/template_features.pt \
        [--templates "['019']"] [--first_labelled 5] [--ckpt_path models/model.pt]

Without ``--output`` the file goes to ``output/template_features.pt``: the shipped one is only replaced when named.
The shipped ``models/template_features.pt`` is built this way from the Hamedan protocol datalist, made by

    python -m scripts.prepare_data labelme HAMEDAN_DIR runs/hamedan/protocol.json --names isbi \
        --spacing "[0.12,0.12]" --validation_fraction 0.1 --test_fraction 0.3 --seed 0 --keep_held_out_images true

with no ``--templates``: the K = 32 labelled training items that the default rule ``landmarks`` ranks best (what
the evaluation takes by default, see docs/README.md). The file holds (K, L, S, C) feature vectors and the
landmark names, no pixel data, so it can ship where the images may not.

Templates: ``--templates`` names images (file stem or path) among the datalist's items with landmarks, and
``--first_labelled N`` adds the first N labelled training items; with neither, the datalist's own
``templates`` / ``template`` items, else the ``--max_templates`` (32) of its labelled training items that ``--rule``
ranks best, plus pseudo-templates when those are few, as ``inferring --datalist`` chooses them (its
``template_choice``). The
features are computed with ``configs/inference.yaml``'s network and preprocessing and the weights
``--ckpt_path``, whose SHA-256 the file records (the features fit only those weights).
"""

from __future__ import annotations

from pathlib import Path

import torch
from bundle.configs import bundle_parser
from bundle.data.annotations import image_stem
from bundle.data.embedded import open_datalist
from bundle.io_utils import check_output_file
from bundle.settings import as_number
from bundle.template_file import save_template
from bundle.templates.features import compute_template
from bundle.templates.resolution import labelled_training_items
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[1]


def _labelled_items(datalist: dict) -> list[dict]:
    """Every item of the datalist that carries landmarks (template, templates, then each split)."""
    items = [datalist["template"]] if datalist.get("template") else []
    items += list(datalist.get("templates") or [])
    for split in ("training", "validation", "test"):
        items += [it for it in datalist.get(split) or [] if it.get("landmarks")]
    return items


def select_items(datalist: dict, templates: list[str] | None = None, first_labelled: int = 0) -> list[dict]:
    """The named ``templates`` (stem or path), then the first ``first_labelled`` labelled training items, no repeats."""
    chosen: list[dict] = []
    pool = _labelled_items(datalist)
    for name in templates or []:
        matches = [it for it in pool if image_stem(it["image"]) == image_stem(str(name)) or it["image"] == str(name)]
        if not matches:
            raise ValueError(f"template {name!r}: no item with landmarks of that name in the datalist")
        chosen.append(matches[0])
    count = as_number(first_labelled, "first_labelled", minimum=0, integer=True)
    for item in labelled_training_items(datalist)[:count]:
        chosen.append(item)
    unique, seen = [], set()
    for item in chosen:
        if item["image"] not in seen:
            seen.add(item["image"])
            unique.append(dict(item))
    return unique


def build(
    datalist: str,
    output: str = "output/template_features.pt",
    templates: list[str] | str | None = None,
    first_labelled: int = 0,
    ckpt_path: str | None = None,
    rule: str = "landmarks",
    max_templates: int = 32,
    device: str | None = None,
) -> str:
    """Compute the template features of the chosen items of ``datalist`` and write them to ``output``."""
    if isinstance(templates, (str, int)):
        templates = [str(templates)]
    check_output_file(output)  # before the features are computed
    data = open_datalist(datalist)
    overrides = {"datalist": str(datalist), "pipeline": "templates"}  # the matching network, whatever detector
    if ckpt_path is not None:
        overrides["ckpt_path"] = str(ckpt_path)
    if device is not None:
        overrides["device"] = torch.device(device)
    parser = bundle_parser("configs/inference.yaml", ROOT, **overrides)
    network = parser.get_parsed_content("encoder")
    preprocessing = parser.get_parsed_content("preprocessing")
    device_ = parser.get_parsed_content("device")
    checkpoint = parser.get_parsed_content("ckpt_path")
    items = select_items(data, templates, first_labelled)
    if not items:
        from bundle.templates.resolution import resolve_templates

        choice = dict(parser.get_parsed_content("template_choice"), rule=rule, max_templates=max_templates)
        items = resolve_templates(data, network, preprocessing, device_, **choice)
    template = compute_template(network, items, preprocessing, data["landmark_names"], device_, checkpoint)
    prefix = data.get("name", Path(datalist).stem)
    for key in ("sources", "pseudo_sources"):  # named by the datalist too, the pseudo-templates among them
        template[key] = [f"{prefix}/{Path(name).name}" for name in template.get(key, [])]
    path = save_template(output, template)
    valid = (~torch.isnan(template["queries"]).any(-1).any(-1)).sum(1).tolist()
    print(
        f"{path}: {len(items)} templates ({', '.join(template['sources'])}), landmarks per template {valid}, "
        f"{path.stat().st_size / 1024:.0f} KB"
    )
    return str(path)


if __name__ == "__main__":
    run_fire(build)
