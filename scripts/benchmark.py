"""Benchmarks of the bundle's heavy pieces, one command per section.

Run from the repository root, e.g. ``python -m scripts.benchmark entropy --repeats 3``; ``inferring`` and
``suggestion`` compare this tree with a checkout of an earlier version (``git worktree add /tmp/reference v0.9.0``).
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[1]

DATA = ROOT.parent / "shared" / "data"


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time in seconds of ``repeats`` calls of ``fn`` and the last result."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Peak memory (MB) that ``fn`` allocates through numpy and Python, by tracemalloc (untimed run)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def cephalogram_2d(rng: np.random.Generator, shape: tuple[int, int] = (1935, 2400)) -> tuple[np.ndarray, str]:
    """The uint8 bin image the IIE map histograms: a real Hamedan cephalogram when present, else a synthetic one.

    The real one (``DATA/hamedan_ceph/images/001.png``) is read as the bundle reads it (``load_image``: grey,
    (x, y) order; scaled to [0, 1] as ``ScaleIntensityd`` does) and quantised as ``local_entropy`` bins it
    (256 bins over the image's range), at its own size. The synthetic one has ISBI 2015 size ``shape``.
    """
    path = DATA / "hamedan_ceph" / "images" / "001.png"
    if path.exists():
        from bundle.data.images import load_image
        from bundle.transforms.entropy import _bin_indices
        from monai.transforms import ScaleIntensity

        image = ScaleIntensity(minv=0.0, maxv=1.0)(load_image(str(path))[None])[0]
        bins = _bin_indices(np.asarray(image), 256, None)
        return bins.astype(np.uint8), f"real ({path.name})"
    from skimage.transform import resize

    x, y = np.meshgrid(np.linspace(-1, 1, shape[0]), np.linspace(-1, 1, shape[1]), indexing="ij")
    skull = 90 * np.exp(-(((x / 0.7) ** 2 + (y / 0.8) ** 2) ** 3)) + 40 * np.sin(7 * x + 3 * y) * (x > -0.2)
    teeth = 60 * ((np.abs(np.sin(40 * x)) > 0.7) & (np.abs(y - 0.4) < 0.1))
    texture = resize(rng.normal(0, 25, (shape[0] // 8, shape[1] // 8)), shape)
    image = 30 + skull + teeth + texture + rng.normal(0, 6, shape)
    return np.clip(image, 0, 255).astype(np.uint8), "synthetic"


def ct_volume_3d(rng: np.random.Generator, shape: tuple[int, int, int] = (128, 256, 256)) -> np.ndarray:
    """A uint8 CT-like volume: smooth soft tissue, a bright ellipsoid (bone), air outside the body, noise."""
    z, y, x = np.meshgrid(*(np.linspace(-1, 1, n, dtype=np.float32) for n in shape), indexing="ij")
    body = (x**2 + (y / 0.8) ** 2) < 0.85
    volume = np.where(body, 100 + 20 * np.sin(5 * x) * np.cos(4 * y + z), 0)
    volume += 80 * ((x - 0.2) ** 2 / 0.05 + y**2 / 0.1 + z**2 / 0.5 < 1)
    volume += body * rng.normal(0, 8, shape).astype(np.float32)
    return np.clip(volume, 0, 255).astype(np.uint8)


def entropy(repeats: int = 5, seed: int = 0) -> None:
    """IIE map: skimage.filters.rank.entropy against ``local_entropy`` (k = 10 in 2D, 5 in 3D), same run.

    ``local_entropy`` runs its compiled sliding histogram; its numpy box sums (what runs without a C compiler)
    are timed beside it. The three are called in turn (skimage, compiled, numpy, skimage, ...) and the best of
    ``repeats`` of each is kept, so all see the same machine load; the ratios to skimage and the largest
    difference of each map from skimage's are printed.
    """
    import torch
    from bundle.transforms.entropy import _bin_indices, _entropy_box_sums, _entropy_rows_kernel, local_entropy
    from skimage.filters.rank import entropy as skimage_entropy

    if _entropy_rows_kernel() is None:
        print("the compiled kernel is not available (no C compiler, or its build failed: see the log)")
    rng = np.random.default_rng(seed)
    image, source = cephalogram_2d(rng)
    cases = [
        (f"2D {image.shape[0]}x{image.shape[1]} k=10, {source}", image, 10),
        ("3D 128x256x256 k=5, synthetic CT", ct_volume_3d(rng), 5),
    ]
    print(f"torch threads: {torch.get_num_threads()}, best of {repeats}, interleaved")
    columns = [("skimage s", 10), ("compiled s", 10), ("speed-up", 9), ("diff", 9), ("numpy s", 8), ("speed-up", 9)]
    columns += [("diff", 9), ("compiled peak MB", 17)]
    header = f"{'case':44s}" + "".join(f" {title:>{width}s}" for title, width in columns)
    print(header)
    print("-" * len(header))
    for name, array, k in cases:
        footprint = np.ones((k,) * array.ndim, dtype=bool)
        window = (k,) * array.ndim
        calls = {
            "skimage": lambda: skimage_entropy(array, footprint),
            "compiled": lambda: local_entropy(array, window=k),
            "numpy": lambda: _entropy_box_sums(_bin_indices(array, 256, None), window, 256),
        }
        times, maps = dict.fromkeys(calls, float("inf")), {}
        for _ in range(repeats):
            for key, call in calls.items():
                time_once, maps[key] = best_time(call, 1)
                times[key] = min(times[key], time_once)
        # largest difference (bits) of each map from skimage's
        diff = {key: float(np.abs(np.asarray(maps[key], np.float64) - maps["skimage"]).max()) for key in maps}
        peak = peak_memory_mb(calls["compiled"])
        flag = "" if max(diff.values()) <= 1e-5 else "  DISAGREE"
        ratio = {key: times["skimage"] / times[key] for key in calls}
        print(
            f"{name:44s} {times['skimage']:10.3f} {times['compiled']:10.3f} {ratio['compiled']:8.1f}x"
            f" {diff['compiled']:9.1e}"
            f" {times['numpy']:8.3f} {ratio['numpy']:8.1f}x {diff['numpy']:9.1e} {peak:17.0f}{flag}"
        )


def _peak_memory_note(device: Any) -> str:
    import resource

    import torch

    if device.type == "cuda":
        return f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB"
    return f"peak process RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"


def training(
    iterations: int = 20,
    warmup: int = 3,
    config: str | list[str] = "configs/train.yaml",
    compare: int = 6,
    **overrides: Any,
) -> None:
    """Training throughput of ``config`` (default 2D settings): full iterations (data pipeline + step) against
    the optimisation step alone on one fixed batch, measured in the same run; then the configured step
    (``cpu_channels_last``, ``cpu_threads``) against the earlier one (torch's defaults: contiguous layout,
    torch's thread count), ``compare`` steps each, interleaved (old, new, old, new, ...) on two copies of the
    network with equal weights and the same batch, so that the load of other processes hits both alike;
    the losses of the two sequences show whether the results stay equal (0 skips the comparison)."""
    import copy
    import tempfile

    import torch
    from bundle.configs import bundle_parser
    from bundle.engines.contrastive import ContrastiveIterationUpdate
    from ignite.engine import Events

    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            "output_dir": tmp,
            "ckpt_dir": tmp,
            "epochs": 1,
            "epoch_length": warmup + iterations,
            "val_interval": 10**6,
            "progress_bar": False,
            **overrides,
        }
        parser = bundle_parser(config, **settings)
        parser.get_parsed_content("ensure_data")  # as the commands: the embedded data set when missing
        trainer = parser.get_parsed_content("train#trainer")
        device = parser.get_parsed_content("device")
        batch_size = parser.get_parsed_content("batch_size")
        stamps: list[float] = []

        def stamp(engine: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

        initial = copy.deepcopy(trainer.network)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, stamp)
        trainer.run()
        full = (stamps[-1] - stamps[warmup - 1]) / iterations
        batch = next(iter(parser.get_parsed_content("train#dataloader")))
        step_fn = parser.get_parsed_content("train#trainer#iteration_update")
        step_times = []
        for _ in range(warmup + iterations):
            trainer.state.batch = batch  # as ignite does before each iteration (MONAI decollates it after)
            start = time.perf_counter()
            step_fn(trainer, batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_times.append(time.perf_counter() - start)
        step = float(np.mean(step_times[warmup:]))
        comparison = (
            _compare_steps(
                trainer,
                initial,
                batch,
                step_fn,
                ContrastiveIterationUpdate(),
                default_threads,
                parser.get_parsed_content("learning_rate"),
                warmup,
                compare,
                device,
            )
            if compare
            else None
        )
    print(
        f"training ({config}, device {device}, batch {batch_size}, "
        f"image {parser['image_size']}, crop {parser['crop_size']})"
    )
    print(f"{'what':<32}{'s/iteration':>12}{'samples/s':>11}")
    print(f"{'full iteration (data + step)':<32}{full:>12.3f}{batch_size / full:>11.1f}")
    print(f"{'step alone (reference)':<32}{step:>12.3f}{batch_size / step:>11.1f}")
    print(
        f"ratio full / step alone: {full / step:.2f} (1.0 = the data pipeline costs nothing); "
        f"{_peak_memory_note(device)}"
    )
    if comparison is not None:
        old, new, losses_old, losses_new, threads = comparison
        print(
            f"step: earlier (torch defaults, {default_threads} threads) against configured (cpu_channels_last="
            f"{parser['cpu_channels_last']}, cpu_threads={parser['cpu_threads']}: {threads} threads), "
            f"{compare} interleaved pairs"
        )
        print(f"{'':<12}" + "".join(f"{k + 1:>8d}" for k in range(compare)) + f"{'median':>9}")
        print(f"{'earlier s':<12}" + "".join(f"{t:>8.2f}" for t in old) + f"{np.median(old):>9.2f}")
        print(f"{'new s':<12}" + "".join(f"{t:>8.2f}" for t in new) + f"{np.median(new):>9.2f}")
        ratios = np.asarray(old) / np.asarray(new)
        print(
            f"speed-up earlier / new: median of pairs {np.median(ratios):.2f}x, of totals {sum(old) / sum(new):.2f}x "
            f"(pairs {' '.join(f'{r:.2f}' for r in ratios)})"
        )
        rel = np.abs(np.asarray(losses_new) - np.asarray(losses_old)) / np.abs(np.asarray(losses_old))
        print(f"losses, earlier: {' '.join(f'{v:.5f}' for v in losses_old)}")
        print(f"losses, new:     {' '.join(f'{v:.5f}' for v in losses_new)}  (max relative difference {rel.max():.1e})")


def _compare_steps(
    trainer, initial, batch, new_fn, old_fn, default_threads: int, lr: float, warmup: int, n: int, device
) -> tuple:
    """Interleaved timing of two step functions, each on its own copy of ``initial`` with a fresh Adam at ``lr``."""
    import copy

    import torch

    runs = {}
    for name in ("old", "new"):
        net = copy.deepcopy(initial).to(device)
        runs[name] = {"network": net, "optimizer": torch.optim.Adam(net.parameters(), lr=lr), "times": [], "losses": []}
    functions = {"old": old_fn, "new": new_fn}
    new_threads = torch.get_num_threads()
    for _ in range(max(warmup, len(getattr(new_fn, "candidates", [])) * getattr(new_fn, "trials", 1) + 1) + n):
        for name in ("old", "new"):
            run = runs[name]
            if name == "old":
                torch.set_num_threads(default_threads)  # the earlier step ran with torch's own count
            else:
                torch.set_num_threads(new_threads)  # what the configured step left set
            trainer.network, trainer.optimizer = run["network"], run["optimizer"]
            trainer.state.batch = batch
            start = time.perf_counter()
            out = functions[name](trainer, batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            run["times"].append(time.perf_counter() - start)
            run["losses"].append(
                float((out if isinstance(out, dict) else out[0])["loss"])
            )  # MONAI decollates the output
            if name == "new":
                new_threads = torch.get_num_threads()
    torch.set_num_threads(default_threads)
    return (
        runs["old"]["times"][-n:],
        runs["new"]["times"][-n:],
        runs["old"]["losses"],
        runs["new"]["losses"],
        new_threads,
    )


def inference(repeats: int = 3, config: str | list[str] = "configs/train.yaml", **overrides: Any) -> None:
    """One-shot inference time per test image (matching included) against the network forward alone."""
    import tempfile

    import torch
    from bundle.configs import bundle_parser

    with tempfile.TemporaryDirectory() as tmp:
        settings = {"output_dir": tmp, "overlays": False, "pipeline": "templates", **overrides}
        parser = bundle_parser(
            [*([config] if isinstance(config, str) else config), "configs/evaluate.yaml"], **settings
        )
        parser.get_parsed_content("ensure_data")
        parser["network"] = "$@network_def.to(@device)"  # timing does not need trained weights
        parser["evaluate#choose_templates"] = "$lambda: bundle.templates.resolution.default_templates(@dataset)"
        evaluator = parser.get_parsed_content("evaluate#evaluator")
        device = parser.get_parsed_content("device")
        n_images = len(parser.get_parsed_content("evaluate#dataset"))
        per_image, _ = best_time(evaluator.run, repeats)
        per_image /= n_images
        image = torch.as_tensor(parser.get_parsed_content("evaluate#dataset")[0]["image"])[None].to(device)
        network = parser.get_parsed_content("network").eval()

        def forward() -> None:
            with torch.no_grad():
                network(image)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        forward_time, _ = best_time(forward, repeats * 3)
    print(f"one-shot inference ({n_images} test images, device {device}, image {parser['image_size']})")
    print(f"{'what':<34}{'ms/image':>10}")
    print(f"{'inference (load + match + refine)':<34}{1000 * per_image:>10.1f}")
    print(f"{'network forward alone (reference)':<34}{1000 * forward_time:>10.1f}")
    print(f"ratio: {per_image / forward_time:.2f}; {_peak_memory_note(device)}")


def template_cache(images: int = 2) -> None:
    """``inferring --datalist``: the first call (templates chosen and their features computed) against the second
    (features read from the template cache), same images and predictions; the Hamedan protocol datalist when
    ../shared/data holds it, else the synthetic set."""
    import tempfile

    from bundle.configs import config_files
    from bundle.data.embedded import open_datalist
    from bundle.data.synthetic import generate_synthetic_2d
    from scripts.bundle_commands import run_command
    from scripts.prepare_data import hamedan_protocol

    with tempfile.TemporaryDirectory() as tmp:
        if (DATA / "hamedan_ceph").is_dir():
            datalist = hamedan_protocol(DATA / "hamedan_ceph", f"{tmp}/protocol.json")
        else:
            datalist = str(generate_synthetic_2d(Path(tmp) / "synthetic"))
        chosen = [it["image"] for it in open_datalist(datalist)["test"][:images]]
        runs = []
        for call in ("first", "second"):
            overrides = {
                "datalist": datalist,
                "images": chosen,
                "output_dir": f"{tmp}/{call}",
                "overlays": False,
                "template_cache": f"{tmp}/cache",
                "pipeline": "templates",  # the template cache, whatever detector is at hand
            }
            runs.append(run_command("inferring", config_files("inference"), overrides, log=f"{tmp}/{call}.log"))
        first, second = (run.outputs["predictions"] for run in runs)
        difference = max(float(np.abs(a["point"] - b["point"]).max()) for a, b in zip(first, second))
    print(f"inferring --datalist {Path(datalist).name}, {len(chosen)} images (wall time of the command)")
    print(f"{'call':<42}{'s':>8}")
    print(f"{'first (templates chosen, features computed)':<42}{runs[0].seconds:>8.1f}")
    print(f"{'second (features from the cache)':<42}{runs[1].seconds:>8.1f}")
    print(f"ratio first / second: {runs[0].seconds / runs[1].seconds:.1f}; predictions differ by {difference:g} px")


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
        fine.get_parsed_content("refinement").queries()  # the template's descriptors, once per run
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


def all(repeats: int = 3) -> None:  # noqa: A001 - the CLI's name for every section
    """Every section in turn."""
    entropy(repeats=repeats)
    training()
    inference(repeats=repeats)


def training_3d(iterations: int = 10, warmup: int = 2, **overrides: Any) -> None:
    """3D training throughput (configs/train.yaml + configs/train_3d.yaml, synthetic CT) and peak memory."""
    from bundle.configs import config_files

    training(iterations=iterations, warmup=warmup, config=config_files("train", spatial_dims=3), **overrides)


def inference_3d(repeats: int = 2, **overrides: Any) -> None:
    """3D one-shot inference time per volume (load, resample, window, match, refine) against the forward alone."""
    from bundle.configs import config_files

    inference(repeats=repeats, config=config_files("train", spatial_dims=3), **overrides)


COMMANDS = {
    "entropy": entropy,
    "training": training,
    "inference": inference,
    "all": all,
    "training_3d": training_3d,
    "inference_3d": inference_3d,
    "template_cache": template_cache,
    "inferring": inferring,
    "suggestion": suggestion,
    "refinement": refinement,
}

if __name__ == "__main__":
    run_fire(COMMANDS)
