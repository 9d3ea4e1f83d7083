"""What the tests that run the bundle's commands in a subprocess share: the ``monai.bundle run`` command line (alone
or under torchrun), run from the repository root on the CPU with one OpenMP thread, and a small synthetic set with
random weights to run it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from bundle.data.synthetic import generate_synthetic_2d
from bundle.networks.contrastive import ContrastiveLandmarkNet

ROOT = Path(__file__).resolve().parents[1]
# inferring and evaluating with random weights on 64 x 64 grids in seconds: no pseudo-templates, no progress bar
SMALL_MATCHING = ["--image_size", "[64,64]", "--pseudo_templates", "0", "--progress_bar", "false"]


def bundle_command(
    command: str, configs: list[str] | str, *args: str, processes: int = 1, logs: Path | None = None
) -> list[str]:
    """``python -m monai.bundle run command --config_file configs args...``, under torchrun (``--standalone``, its
    logs in ``logs``, one folder per rank) when ``processes`` > 1."""
    launcher = []
    if processes > 1:
        assert logs is not None, "torchrun needs a folder for the ranks' logs"
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(processes)]
        launcher += ["--log-dir", str(logs), "--redirects", "3"]
    files = configs if isinstance(configs, str) else repr(list(configs))
    return [sys.executable, *launcher, "-m", "monai.bundle", "run", command, "--config_file", files, *map(str, args)]


def run_bundle(
    command: str,
    configs: list[str] | str,
    *args: str,
    processes: int = 1,
    logs: Path | None = None,
    timeout: float = 300,
    wait: bool = True,
    check: bool = False,
) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run :func:`bundle_command` from the repository root (one OpenMP thread, no GPU, stdout and stderr together):
    the finished process, or the running one when not ``wait``. With ``check`` a failure fails the test, showing
    the output and the ranks' logs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    streams = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    argv = bundle_command(command, configs, *args, processes=processes, logs=logs)
    if not wait:
        return subprocess.Popen(argv, start_new_session=True, **streams)
    done = subprocess.run(argv, timeout=timeout, **streams)
    if check:
        rank_logs = "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*.log"))) if logs else ""
        assert done.returncode == 0, done.stdout[-6000:] + rank_logs
    return done


def small_synthetic_set(root: Path, n_test: int, seed: int) -> tuple[Path, Path, list[str]]:
    """Small synthetic images (64 x 72: 2 training, 1 validation, ``n_test`` test images) and random weights for a
    64 x 64 grid in ``root``: (datalist, weights, the test images' paths)."""
    datalist = generate_synthetic_2d(root / "data", 2, 1, n_test, size=(64, 72), seed=seed)
    torch.manual_seed(0)
    torch.save(ContrastiveLandmarkNet().state_dict(), root / "weights.pt")
    images = [str(Path(datalist).parent / it["image"]) for it in json.loads(Path(datalist).read_text())["test"]]
    return Path(datalist), root / "weights.pt", images
