"""One-shot inference time per image against the network forward alone, and the template features' cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from scripts.benchmarks.measure import DATA, best_time, peak_memory_note


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
    print(f"ratio: {per_image / forward_time:.2f}; {peak_memory_note(device)}")


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


def inference_3d(repeats: int = 2, **overrides: Any) -> None:
    """3D one-shot inference time per volume (load, resample, window, match, refine) against the forward alone."""
    from bundle.configs import config_files

    inference(repeats=repeats, config=config_files("train", spatial_dims=3), **overrides)
