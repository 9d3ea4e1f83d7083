"""Training throughput: full iterations against the optimisation step, the configured step against the earlier one."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from scripts.benchmarks.measure import peak_memory_note


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
        f"{peak_memory_note(device)}"
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


def training_3d(iterations: int = 10, warmup: int = 2, **overrides: Any) -> None:
    """3D training throughput (configs/train.yaml + configs/train_3d.yaml, synthetic CT) and peak memory."""
    from bundle.configs import config_files

    training(iterations=iterations, warmup=warmup, config=config_files("train", spatial_dims=3), **overrides)
