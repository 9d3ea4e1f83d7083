"""The cost of XFeat's fine step after the shipped fine-tuned detector in ``inferring``."""

from __future__ import annotations

from pathlib import Path

from scripts.benchmarks.measure import DATA, ROOT, best_time


def refinement(images: int = 5, rounds: int = 2) -> None:
    """``inferring`` with the shipped fine-tuned detector on ``images`` cephalograms (the real ones when ../shared/data
    holds them, else synthetic ones, smaller): seconds per image without and with the XFeat refinement (one template:
    the first image with its predicted landmarks; its descriptors computed once, before the timing), in one run,
    alternating for ``rounds`` rounds (best of each). ``--images`` files carry no spacing, so the 1 mm radius is one
    pixel here: the time is XFeat's descriptor map of each image (the lattice at 0.12 mm, 49 points a landmark, adds
    little to it)."""
    import csv
    import json
    import tempfile

    from bundle.configs import bundle_parser
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    with tempfile.TemporaryDirectory() as tmp:
        if (DATA / "hamedan_ceph").is_dir():
            files = sorted(str(f) for f in (DATA / "hamedan_ceph" / "images").glob("*.png"))[:images]
        else:
            files = [it["image"] for it in open_datalist(generate_synthetic_2d(Path(tmp) / "data"))["test"][:images]]
        detector = str(ROOT / "models" / "finetune" / "model.pt")
        common = {"images": files, "overlays": False, "pipeline": "detector", "detectors": [detector]}
        plain = bundle_parser(["configs/inference.yaml"], output_dir=f"{tmp}/plain", **common)
        plain.get_parsed_content("evaluator").run()
        with open(f"{tmp}/plain/predictions.csv", newline="") as f:
            first = [[float(r["x"]), float(r["y"])] for r in csv.DictReader(f) if r["image"] == files[0]]
        names = plain.get_parsed_content("landmark_names")
        datalist = Path(tmp) / "template.json"
        template = {"image": files[0], "landmarks": first, "spacing": [0.1, 0.1]}
        datalist.write_text(
            json.dumps({"spatial_dims": 2, "landmark_names": names, "training": [template]}), encoding="utf-8"
        )
        fine = bundle_parser(
            ["configs/inference.yaml"],
            output_dir=f"{tmp}/fine",
            datalist=str(datalist),
            xfeat_refinement=True,
            **common,
        )
        fine.get_parsed_content("predictor").refinement.queries()  # the template's descriptors, once per run
        engines = {
            "detector": plain.get_parsed_content("evaluator"),
            "detector + refinement": fine.get_parsed_content("evaluator"),
        }
        best = {name: float("inf") for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                seconds, _ = best_time(engine.run, 1)
                best[name] = min(best[name], seconds / len(files))
    print(f"inferring with the shipped fine-tuned detector, {len(files)} images")
    print(f"{'what':<34}{'s/image':>10}")
    for name in engines:
        print(f"{name:<34}{best[name]:>10.3f}")
    added = best["detector + refinement"] - best["detector"]
    print(
        f"ratio with / without: {best['detector + refinement'] / best['detector']:.2f}; added {added:.3f} s per image"
    )
