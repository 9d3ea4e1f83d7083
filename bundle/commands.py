"""What every command checks and sets before any work: its command line and config values as the workflow starts
(:func:`check_workflow`, the configs' ``initialize``), then its device, process group, progress bars, seed and
threads (:func:`start_command`, the first step of ``training``, ``evaluating``, ``inferring``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from bundle.configs import apply_cpu_threads, check_command_line, check_device, seed_everything
from bundle.distributed import join_launched
from bundle.progress import show_progress
from bundle.settings import check_settings
from monai.bundle import ConfigWorkflow


def check_workflow() -> None:
    """Refuse a misread command line (:func:`bundle.configs.check_command_line`), then check the config of the
    ``ConfigWorkflow`` that runs this (``monai.bundle run``, ``monai.bundle.load``, a ``ConfigWorkflow``) against
    :data:`bundle.settings.SETTINGS` (:func:`bundle.settings.check_settings`): the configs' ``initialize`` step,
    before anything is built. A config parsed by :func:`bundle.configs.bundle_parser` is checked there instead."""
    check_command_line()
    frame = inspect.currentframe()
    while frame is not None:
        workflow = frame.f_locals.get("self")
        if isinstance(workflow, ConfigWorkflow):
            check_settings(workflow.parser)
            return
        frame = frame.f_back


def start_command(
    device: torch.device | str,
    progress_bar: Any = True,
    seed: int | None = None,
    cudnn_benchmark: Any = False,
    cpu_threads: int | str | None = None,
) -> torch.device:
    """Refuse a misread command line (:func:`bundle.configs.check_command_line`: read once, a no-op when the
    ``initialize`` step of :func:`check_workflow` has passed it, and the check where a stray word took the place of
    MONAI's ``init_id`` so that ``initialize`` did not run) and a
    device this machine lacks (:func:`bundle.configs.check_device`), join the process group when
    torchrun launched several processes (:func:`bundle.distributed.join_launched`), show progress bars or not
    (``progress_bar``), then, when given, seed everything (``seed``, with ``cudnn_benchmark``:
    :func:`bundle.configs.seed_everything`) and set the command's CPU threads (``cpu_threads``:
    :func:`bundle.configs.apply_cpu_threads`; the stage-1 training sets its own).

    Args:
        device: the command's ``device``.
        progress_bar: a yes/no value.
        seed: the seed (a process's own under torchrun), None: not seeded here.
        cudnn_benchmark: a yes/no value, cuDNN's autotuner after the seeding.
        cpu_threads: an int, ``auto`` or None (torch's setting kept).

    Returns:
        the checked device.
    """
    check_command_line()
    show_progress(progress_bar)
    checked = check_device(device)
    join_launched(checked)
    if seed is not None:
        seed_everything(seed, cudnn_benchmark)
    if cpu_threads is not None:
        apply_cpu_threads(cpu_threads)
    return checked
