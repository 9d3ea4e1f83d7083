"""Several processes (torchrun): the process group, each process's device and rank, what rank 0 alone does, and
each process's share of a command's images merged back in their order.

A training joins by configs/multi_gpu_train.yaml; evaluating, inferring, pseudo-labelling and template features join
when torchrun launched them (:func:`launched`), each process taking every ``world_size``-th image from its rank
(:func:`shard`, :func:`evaluation_sampler`) and the shares merged back in the images' order (:func:`gather_shards`).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


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


def world_size() -> int:
    """The number of processes: the process group's, else torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def launched() -> bool:
    """Whether torchrun launched this process as one of several (``WORLD_SIZE`` above 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join_launched(device: torch.device) -> None:
    """Join the process group when torchrun launched several processes (:func:`launched`); nothing otherwise.

    Args:
        device: this process's device (:func:`rank_device`).
    """
    if launched():
        init_process_group(device)


def shard(items: Sequence[T]) -> list[T]:
    """This process's share of ``items``: every :func:`world_size`-th from its :func:`rank` (each item in one share,
    none left out; all of them in one process).

    Args:
        items: the same sequence in every process.
    """
    return list(items[rank() :: world_size()])


def evaluation_sampler(dataset: Sequence) -> list[int] | None:
    """The data loader's sampler of an evaluation: the indices of this process's :func:`shard` of ``dataset``, in
    order (no item repeated to even the shares, none for a process beyond the items: MONAI's ``DistributedSampler``
    refuses fewer items than processes) under a process group, else None (every item).

    Args:
        dataset: the evaluation's dataset.
    """
    if world_size() == 1:
        return None
    return shard(range(len(dataset)))


def gather_shards(share: Sequence[T]) -> list[T]:
    """Every process's :func:`shard` results merged back in the order of the items they came from (the item ``k`` of
    the whole is the ``k // n``-th of process ``k % n``'s share), in every process; ``share`` alone in one process.

    Args:
        share: the results of this process's items, in their order.
    """
    if world_size() == 1:
        return list(share)
    shares: list = [None] * world_size()
    dist.all_gather_object(shares, list(share))
    merged = []
    for k in range(sum(len(s) for s in shares)):
        merged.append(shares[k % len(shares)][k // len(shares)])
    return merged


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


def portable_error(error: Exception) -> Exception:
    """``error`` when it can travel pickled to the other processes, else a RuntimeError carrying its type and message.

    Args:
        error: an error raised in this process.
    """
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def from_rank_0(fn: Callable[[], T]) -> T:
    """``fn()`` called by rank 0 alone and its value sent to every process (``broadcast_object_list``): what one process
    decides and the others follow (a cache read where rank 0 alone writes); ``fn()`` in one process. An error of
    ``fn`` is raised in every process.

    Args:
        fn: the work, without arguments; its value travels pickled (keep it on the CPU).
    """
    if world_size() == 1:
        return fn()
    value, failure = None, None
    if rank() == 0:
        try:
            value = fn()
        except Exception as e:  # raised below in every process, rank 0's own with its traceback
            failure = e
    box = [(value, None if failure is None else portable_error(failure))]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    value, sent = box[0]
    if sent is not None:
        raise sent
    return value
