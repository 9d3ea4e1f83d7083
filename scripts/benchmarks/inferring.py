"""The ``inferring`` command's engine of this tree against a reference tree's, and where its time goes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scripts.benchmarks.measure import DATA, ROOT

ENGINE_PASSES = """
import csv, json, sys, tempfile, time
import torch
from bundle.configs import bundle_parser
files, passes, out, template, combine = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
with tempfile.TemporaryDirectory() as tmp:
    settings = dict(images=files, output_dir=tmp, overlays=False, template_path=template, template_combine=combine,
                    pipeline="templates")  # matching (a key the reference tree may not know, then unused)
    parser = bundle_parser(["configs/inference.yaml"], **settings)
    evaluator = parser.get_parsed_content("evaluator")
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        evaluator.run()
        seconds.append(time.perf_counter() - start)
    with open(tmp + "/predictions.csv", encoding="utf-8") as f:
        points = [[float(r["x"]), float(r["y"])] for r in csv.DictReader(f)]
json.dump({"seconds": seconds, "points": points, "threads": torch.get_num_threads()}, open(out, "w", encoding="utf-8"))
"""


def inferring(
    reference: str, images: int = 20, rounds: int = 3, passes: int = 2, combine: str = "geometric_median"
) -> None:
    """The ``inferring`` command's engine with the built-in templates (the first ``images`` real cephalograms when
    ../shared/data holds them, else synthetic images): ms per image of this tree against the ``reference`` tree (a
    checkout of an earlier version, e.g. ``git worktree add /tmp/reference v0.8.0``), each in its own process,
    alternating for ``rounds`` rounds of ``passes`` engine passes (best pass of each), both with this tree's built-in
    templates and the rule ``combine`` (``template_combine``; the default is one every version knows, so that both
    compute the same), with the predictions' largest difference; then where this tree's time goes (cProfile of one
    pass, with this tree's default rule)."""
    import cProfile
    import json
    import os
    import pstats
    import subprocess
    import sys
    import tempfile

    from bundle.configs import bundle_parser
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    trees = {"reference": Path(reference).resolve(), "this tree": ROOT}
    template = str(ROOT / "models" / "template_features.pt")  # the same templates for both trees
    if not (trees["reference"] / "configs" / "inference.yaml").is_file():
        raise FileNotFoundError(f"reference tree {reference}: no configs/inference.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        if (DATA / "hamedan_ceph").is_dir():
            files = sorted(str(f) for f in (DATA / "hamedan_ceph" / "images").glob("*.png"))[:images]
        else:
            files = [it["image"] for it in open_datalist(generate_synthetic_2d(Path(tmp) / "data"))["test"][:images]]
        best = {name: float("inf") for name in trees}
        results = {}
        for r in range(rounds):
            for name, tree in trees.items():
                out = f"{tmp}/{r}_{name}.json"
                command = [sys.executable, "-c", ENGINE_PASSES, json.dumps(files), str(passes), out, template, combine]
                env = dict(os.environ, PYTHONPATH=str(tree))
                subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
                results[name] = json.loads(Path(out).read_text(encoding="utf-8"))
                best[name] = min(best[name], min(results[name]["seconds"]) / len(files))
        parser = bundle_parser(
            ["configs/inference.yaml"], images=files, output_dir=tmp, overlays=False, pipeline="templates"
        )
        evaluator = parser.get_parsed_content("evaluator")
        evaluator.run()
        profile = cProfile.Profile()
        profile.enable()
        evaluator.run()
        profile.disable()
    difference = float(
        np.abs(np.asarray(results["reference"]["points"]) - np.asarray(results["this tree"]["points"])).max()
    )
    print(
        f"inferring engine, built-in templates combined by {combine}, {len(files)} images, "
        f"{results['this tree']['threads']} threads"
    )
    print(f"{'tree':<34}{'ms/image':>10}")
    for name in trees:
        print(f"{name:<34}{1000 * best[name]:>10.1f}")
    print(f"ratio reference / this tree: {best['reference'] / best['this tree']:.2f}")
    print(f"predictions differ by at most {difference:.3g} px of the original images")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
