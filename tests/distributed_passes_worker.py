"""The passes over images of tests/test_distributed_passes.py, run by one process or by each process torchrun launched:
``python tests/distributed_passes_worker.py DATALIST WEIGHTS OUT`` writes ``OUT/rank<r>.pt`` (what the passes gave this
process) and ``OUT/calls_rank<r>.json`` (the items it prepared or refined, the files it read and wrote). The
pseudo-labels are refined by XFeat where its wheel is installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from bundle import distributed, passes
from bundle.configs import bundle_parser
from bundle.inferers.refinement import PSEUDO_LABEL_RADIUS_MM, DescriptorRefinement
from bundle.networks.xfeat import available as xfeat_available
from bundle.passes import map_shards
from bundle.pipeline import detector_data
from bundle.templates import features
from bundle.templates.resolution import ranked_templates
from bundle.transforms.landmarks import TEMPLATE_KEY

ROOT = Path(__file__).resolve().parents[1]
CHOICE = {"rule": "landmarks", "max_templates": 2, "pseudo_candidates": 3, "pseudo_templates": 2}


def main(datalist_path: str, weights: str, out: str) -> None:
    out_dir = Path(out)
    distributed.join_launched(torch.device("cpu"))
    rank = distributed.rank()
    calls: dict[str, list] = {"mapped": [], "computed": [], "written": [], "cache_read": []}
    parser = bundle_parser(
        ["configs/train.yaml", "configs/evaluate.yaml"],
        datalist=datalist_path,
        output_dir=str(out_dir / "o"),
        image_size=[64, 64],
    )
    network = parser.get_parsed_content("network")
    network.load_state_dict(torch.load(weights, weights_only=True))
    pipeline = parser.get_parsed_content("validate#preprocessing")
    datalist = dict(parser.get_parsed_content("dataset"))

    current_pass = ["template features", "none"]  # the worker's call, then the pass by its progress bar's name

    def named_pass(items, description):
        current_pass[1] = description
        return items

    passes.progress = named_pass

    def preprocessing(item: dict) -> dict:  # every image a pass prepares, templates given to an inferer apart
        if not item.get(TEMPLATE_KEY):
            calls["computed"].append([*current_pass, Path(item["image"]).name])
        return pipeline(item)

    def recorded(name, fn):
        def run(*args, **kwargs):
            calls[name].append(str(args[0]))
            return fn(*args, **kwargs)

        return run

    features.save_template = recorded("written", features.save_template)
    features.load_template = recorded("cache_read", features.load_template)
    detector_data.write_json_atomic = recorded("written", detector_data.write_json_atomic)

    def square(k: int) -> int:
        calls["mapped"].append(k)
        return k * k

    def fail_on_3(k: int) -> int:
        if k == 3:
            raise ValueError(f"item {k} refused on rank {rank}")
        return k

    result: dict = {"squares": map_shards(square, range(5), "squares"), "one": map_shards(square, [7], "one")}
    try:
        map_shards(fail_on_3, range(5), "failing")
    except ValueError as e:
        result["error"] = str(e)
    result["rank_0_says"] = distributed.from_rank_0(lambda: f"rank {rank}")

    cache = out_dir / "cache"
    kwargs = dict(network=network, preprocessing=preprocessing, checkpoint=weights, cache_dir=str(cache), **CHOICE)
    kwargs["image_size"] = [64, 64]
    result["features"] = features.resolve_template_features("unused.pt", datalist_path, **kwargs)
    current_pass[:] = ["cached call", "none"]
    result["cached_features"] = features.resolve_template_features("unused.pt", datalist_path, **kwargs)
    current_pass[:] = ["features rule", "none"]
    result["by_features"] = [
        it["image"] for it in ranked_templates(datalist, network, preprocessing, "cpu", rule="features")
    ]
    current_pass[:] = ["stage 2", "none"]
    templates = [it for it in datalist["training"] if it.get("landmarks")][:1]
    refinement = DescriptorRefinement(templates, radius_mm=PSEUDO_LABEL_RADIUS_MM) if xfeat_available() else None
    if refinement is not None:
        refine_item = refinement.refine_item

        def refined(item: dict, spacing) -> dict:
            calls["computed"].append([*current_pass, Path(item["image"]).name])
            return refine_item(item, spacing)

        refinement.refine_item = refined
    output_path = out_dir / "pseudo_labels.json"
    result["pseudo_labels"] = detector_data.pseudo_labelled_items(
        datalist, network, templates, preprocessing, "cpu", output_path=output_path, refinement=refinement
    )
    torch.save(result, out_dir / f"rank{rank}.pt")
    (out_dir / f"calls_rank{rank}.json").write_text(json.dumps(calls))
    distributed.leave_together()


if __name__ == "__main__":
    main(*sys.argv[1:])
