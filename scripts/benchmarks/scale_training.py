"""Training memory and speed against the number of training images, under the ``cache_gb`` bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.benchmarks.measure import ROOT

CEPHALOGRAM = (1935, 2400)  # width x height, the ISBI 2015 cephalograms

TRAINING_RUN = """
import json, resource, sys, time
from bundle.configs import bundle_parser
from ignite.engine import Events
datalist, out_dir, cache_gb, iterations, warmup, result = sys.argv[1:7]
iterations, warmup = int(iterations), int(warmup)
settings = dict(datalist=datalist, output_dir=out_dir, cache_gb=float(cache_gb), epochs=1, val_interval=10**6,
                epoch_length=warmup + iterations, progress_bar=False, cpu_threads=2)
parser = bundle_parser("configs/train.yaml", **settings)
start = time.perf_counter()
trainer = parser.get_parsed_content("train#trainer")
dataset = parser.get_parsed_content("train#dataset")
build = time.perf_counter() - start
stamps = []
trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: stamps.append(time.perf_counter()))
trainer.run()
record = {"images": len(dataset), "dataset": type(dataset).__name__, "cached": dataset.cache_num,
          "build_s": build, "s_per_iteration": (stamps[-1] - stamps[warmup - 1]) / iterations,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
json.dump(record, open(result, "w", encoding="utf-8"))
"""


def _datalist(folder: Path, sources: dict, n: int) -> Path:
    """A datalist of ``n`` training items named ``images/NNNNN.png``, hard links to the ``sources``' training images in
    turn (with their landmarks), and the sources' validation items."""
    images = folder / "images"
    images.mkdir(parents=True)
    root = Path(sources["_root"])
    training = []
    for i in range(n):
        source = sources["training"][i % len(sources["training"])]
        name = f"images/{i:05d}.png"
        os.link(root / source["image"], folder / name)
        training.append({**source, "image": name})
    validation = [{**it, "image": str(root / it["image"])} for it in sources["validation"]]
    header = {k: v for k, v in sources.items() if k not in ("training", "validation", "test", "template", "_root")}
    path = folder / "datalist.json"
    path.write_text(json.dumps({**header, "training": training, "validation": validation, "test": []}))
    return path


def training_scale(
    sizes: tuple[int, ...] = (100, 1000, 10000),
    cache_gb: float = 0.2,
    distinct: int = 50,
    iterations: int = 20,
    warmup: int = 4,
    output: str | None = None,
) -> list[dict]:
    """Peak resident memory and seconds per iteration of the stage-1 training (configs/train.yaml, batch 8, 2 CPU
    threads) on ``sizes`` cephalogram-size (1935 x 2400) synthetic images under ``cache_gb``, each N in a fresh
    process; the first row is the reference, the smallest N with everything cached (``cache_gb`` 64), measured in
    the same run.

    The images are ``distinct`` images of the bundle's generator (``bundle.data.synthetic.generate_synthetic_2d``),
    hard-linked under N names: each name is its own datalist item, read, transformed and cached on its own, so
    the memory and time are those of N different images of that size. Seconds per iteration are the mean of
    ``iterations`` after ``warmup``; ``build_s`` is the time to build the trainer (the cache filled), peak RSS the
    process's own (``getrusage``), what the cache holds included.

    Args:
        sizes: the training set sizes N.
        cache_gb: the bound (small enough here for 10 000 images to exceed it).
        distinct: how many distinct images are generated.
        iterations, warmup: timed and untimed iterations.
        output: a JSON file for the rows (written atomically), or None.
    """
    from bundle.data.synthetic import generate_synthetic_2d
    from bundle.io_utils import write_json_atomic

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate_synthetic_2d(
            Path(tmp) / "distinct", n_training=distinct, n_validation=1, n_test=0, size=CEPHALOGRAM
        )
        sources = {**json.loads(generated.read_text()), "_root": str(generated.parent)}
        runs = [(min(sizes), 64.0, "all cached (reference)")] + [(n, cache_gb, f"cache_gb {cache_gb:g}") for n in sizes]
        for k, (n, budget, label) in enumerate(runs):
            folder = Path(tmp) / f"run{k}"
            datalist = _datalist(folder, sources, n)
            result = folder / "result.json"
            command = [sys.executable, "-c", TRAINING_RUN, str(datalist), str(folder / "out"), str(budget)]
            command += [str(iterations), str(warmup), str(result)]
            done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True)
            if done.returncode:
                raise RuntimeError(f"training on {n} images failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
            row = {"setting": label, "cache_gb": budget, **json.loads(result.read_text())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    reference = rows[0]["s_per_iteration"]
    print(f"training scale: {CEPHALOGRAM[0]} x {CEPHALOGRAM[1]} images ({distinct} distinct, hard-linked), batch 8")
    columns = f"{'setting':<24}{'dataset':<14}{'cached':>8}{'peak RSS MB':>13}{'s/iter':>8}{'x ref':>7}{'build s':>9}"
    print(f"{'N':>7}  {columns}")
    for row in rows:
        print(
            f"{row['images']:>7}  {row['setting']:<24}{row['dataset']:<14}{row['cached']:>8}{row['peak_rss_mb']:>13.0f}"
            f"{row['s_per_iteration']:>8.2f}{row['s_per_iteration'] / reference:>7.2f}{row['build_s']:>9.0f}"
        )
    if output:
        write_json_atomic(output, {"images": list(CEPHALOGRAM), "distinct": distinct, "rows": rows})
    return rows
