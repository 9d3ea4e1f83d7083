"""One training in several processes (torchrun; configs/multi_gpu_train.yaml): the process group, each process's
device and rank, and what rank 0 alone does."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """This process's device: the GPU of its ``LOCAL_RANK`` (torchrun's) when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return torch.device("cpu")


def init_process_group(device: torch.device) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPUs) unless joined, and make ``device`` the current GPU.

    Args:
        device: this process's device (:func:`rank_device`).
    """
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)


def device_ids(device: torch.device) -> list[torch.device] | None:
    """``DistributedDataParallel``'s ``device_ids``: the process's GPU, none on a CPU.

    Args:
        device: this process's device (:func:`rank_device`).
    """
    return [device] if device.type == "cuda" else None


def rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK`` (0 without torchrun)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def on_rank_0(rank_0: Any, others: Any) -> Any:
    """``rank_0`` in the process of rank 0 (console, TensorBoard, checkpoints), ``others`` in the others.

    Args:
        rank_0: what rank 0 gets (its handlers, say).
        others: what the other ranks get.
    """
    return rank_0 if rank() == 0 else others


def leave_together() -> None:
    """Wait for every rank, then leave the process group: rank 0 may still write its final checkpoint when the others
    finish their last epoch, and a rank that tore down its connections then could abort a peer (gloo)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
