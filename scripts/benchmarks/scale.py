"""How ``inferring`` scales: seconds per image and peak memory over 100 to 10 000 images, and the cost of k templates.

Each measurement runs the command's own config in a fresh process (``bundle_parser`` on configs/inference.yaml, then
:func:`bundle.handlers.report.run_reported`, as ``monai.bundle run inferring``), which reports its wall time and its
peak resident memory (``ru_maxrss``). The images are the bundle's synthetic cephalogram-like phantoms at the size
of the shared cephalograms (1340 x 1671 pixels): ``distinct`` of them are generated and a folder of N images holds
hard links to them under N names, so that each name is an image of its own to the command (read, predicted and
reported once) without N images' worth of generating and disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.measure import DATA, ROOT

CEPHALOGRAM_SIZE = (1340, 1671)  # (width, height) of the shared cephalograms

INFER = """
import json, resource, sys, time
from bundle.configs import bundle_parser
from bundle.handlers.report import run_reported
settings = json.loads(sys.argv[1])
start = time.perf_counter()
parser = bundle_parser(["configs/inference.yaml"], **settings)
evaluator, report = parser.get_parsed_content("evaluator"), parser.get_parsed_content("report")
built = time.perf_counter()
run_reported(evaluator, report)
end = time.perf_counter()
print(json.dumps({"build_s": built - start, "run_s": end - built, "images": len(evaluator.data_loader),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _infer(settings: dict) -> dict:
    """One ``inferring`` run with ``settings`` in a fresh process: its times (s), image count and peak RSS (MB)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", INFER, json.dumps(settings)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"inferring failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _linked_folder(folder: Path, sources: list[Path], n: int) -> Path:
    """``folder`` holding ``n`` hard links to ``sources`` in turn (``img_00000.png``...)."""
    folder.mkdir(parents=True)
    for i in range(n):
        os.link(sources[i % len(sources)], folder / f"img_{i:05d}.png")
    return folder


def inferring_scale(
    counts: tuple = (100, 1000, 10000),
    distinct: int = 20,
    pipeline: str = "detector",
    shift_tta: int = 0,
    out: str = "",
) -> list[dict]:
    """Seconds per image and peak resident memory of ``inferring`` over folders of ``counts`` images (no overlays:
    10 000 overlays of this size are 10 GB), with the built-in templates and the shipped ``pipeline`` (``detector``:
    the shipped fine-tuned detector, ``shift_tta`` test-time shifts; ``templates``: matching), then a rerun into the
    same output folder of the largest count (every image predicted before: nothing is predicted again). Writes the
    rows as JSON to ``out`` when given."""
    from bundle.data.synthetic import generate_synthetic_2d

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        datalist = generate_synthetic_2d(Path(tmp) / "data", 1, 1, distinct, size=CEPHALOGRAM_SIZE, seed=11)
        sources = sorted((datalist.parent / "images").glob("test_*.png"))
        settings = dict(overlays=False, progress_bar=False, pipeline=pipeline, shift_tta=shift_tta)
        for n in counts:
            folder = _linked_folder(Path(tmp) / f"images_{n}", sources, n)
            output = Path(tmp) / f"out_{n}"
            result = _infer({**settings, "dataset_dir": str(folder), "output_dir": str(output)})
            rows.append({"images": n, **result, "s_per_image": result["run_s"] / n})
            print(
                f"{n:>6} images: {result['run_s'] / n:.3f} s/image, peak RSS {result['peak_rss_mb']:.0f} MB "
                f"(config built in {result['build_s']:.1f} s)",
                flush=True,
            )
        again = _infer({**settings, "dataset_dir": str(folder), "output_dir": str(output)})
        rows.append({"images": counts[-1], "rerun": True, **again})
        print(f"rerun of {counts[-1]}: {again['images']} predicted again, {again['run_s']:.1f} s", flush=True)
    if out:
        Path(out).write_text(json.dumps({"pipeline": pipeline, "shift_tta": shift_tta, "rows": rows}, indent=2) + "\n")
    return rows


def templates_scale(
    ks: tuple = (1, 5, 32), images: int = 20, datalist: str = "runs/hamedan/protocol.json", out: str = ""
) -> list[dict]:
    """The cost of matching from k labelled templates (``max_templates`` k, no pseudo-templates): the template
    features' seconds (built once per run) and seconds per image on ``images`` cephalograms, with the shared data's
    protocol ``datalist`` (scripts/prepare_data.py: the k labelled training images that
    the template rule ranks best, its first test images; synthetic cephalogram-size phantoms without it)."""
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not ((DATA / "hamedan_ceph").is_dir() and Path(datalist).is_file()):
            datalist = generate_synthetic_2d(Path(tmp) / "data", max(ks), 1, images, size=CEPHALOGRAM_SIZE, seed=12)
        files = [it["image"] for it in open_datalist(datalist)["test"][:images]]
        for k in ks:
            settings = dict(
                images=files,
                datalist=str(datalist),
                max_templates=k,
                pseudo_templates=0,
                template_cache=None,
                pipeline="templates",
                overlays=False,
                progress_bar=False,
                output_dir=str(Path(tmp) / f"out_{k}"),
            )
            result = _infer(settings)
            rows.append({"templates": k, **result, "s_per_image": result["run_s"] / len(files)})
            print(
                f"{k:>3} templates: features {result['build_s']:.1f} s, {result['run_s'] / len(files):.3f} s/image, "
                f"peak RSS {result['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    if out:
        Path(out).write_text(json.dumps({"images": len(files), "rows": rows}, indent=2) + "\n")
    return rows
