"""A warm MONAI Label suggestion of this tree's app against a reference tree's."""

from __future__ import annotations

from pathlib import Path

from scripts.benchmarks.measure import DATA, ROOT

SUGGESTIONS = """
import json, shutil, statistics, sys, tempfile, time
from pathlib import Path
from scripts.monailabel_server import serving
files, repeats, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with tempfile.TemporaryDirectory() as tmp:
    studies = Path(tmp) / "studies"
    studies.mkdir()
    with serving(Path(tmp) / "work", studies) as server:
        client, seconds = server["client"], []
        request = {"predictor": "templates"}  # matching, also where the app serves the shipped detector by default
        client.infer("landmarks", "", request, file=files[0])  # warm-up: weights and built-in templates loaded
        for _ in range(repeats):
            for image in files:
                start = time.perf_counter()
                client.infer("landmarks", "", request, file=image)
                seconds.append(time.perf_counter() - start)
json.dump({"seconds": seconds, "median": statistics.median(seconds)}, open(out, "w", encoding="utf-8"))
"""


def suggestion(reference: str, images: int = 5, repeats: int = 2, rounds: int = 2) -> None:
    """A warm MONAI Label suggestion by matching (the app with no ``--conf``: shipped weights, built-in templates,
    the request's ``predictor: templates``), uploaded real cephalograms (synthetic images without ../shared/data):
    median seconds per request of a server of this tree against one of the ``reference`` tree (a checkout with
    ``scripts/monailabel_server.py``, 0.9.0 or later), each started by its own tree, alternating for ``rounds``
    rounds (the best median of each kept)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    trees = {"reference": Path(reference).resolve(), "this tree": ROOT}
    if not (trees["reference"] / "scripts" / "monailabel_server.py").is_file():
        raise FileNotFoundError(f"reference tree {reference}: no scripts/monailabel_server.py (0.9.0 or later)")
    with tempfile.TemporaryDirectory() as tmp:
        if (DATA / "hamedan_ceph").is_dir():
            files = sorted(str(f) for f in (DATA / "hamedan_ceph" / "images").glob("*.png"))[-images:]
        else:
            files = [it["image"] for it in open_datalist(generate_synthetic_2d(Path(tmp) / "data"))["test"][:images]]
        best = {name: float("inf") for name in trees}
        for r in range(rounds):
            for name, tree in trees.items():
                out = f"{tmp}/{r}_{name.replace(' ', '_')}.json"
                command = [sys.executable, "-c", SUGGESTIONS, json.dumps(files), str(repeats), out]
                env = dict(os.environ, PYTHONPATH=str(tree))
                env.setdefault("MONAILABEL_PYTHON", str(ROOT / ".venv-monailabel" / "bin" / "python"))
                subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
                best[name] = min(best[name], json.loads(Path(out).read_text(encoding="utf-8"))["median"])
    print(f"warm MONAI Label suggestion, built-in templates, {len(files)} uploaded images x {repeats}, {rounds} rounds")
    print(f"{'tree':<34}{'s/request':>10}")
    for name in trees:
        print(f"{name:<34}{best[name]:>10.3f}")
    print(f"ratio reference / this tree: {best['reference'] / best['this tree']:.2f}")
