"""The training data set: MONAI's ``CacheDataset`` holding as many items as a memory budget (``cache_gb``) allows.

A cached item is what the deterministic head of the training transform leaves (stage 1: the image, its IIE map and
the sampling weights on the network grid, 0.42 MB at 192² whatever the original size); an item beyond the budget
runs the whole transform each time it is drawn (a 1935 x 2400 cephalogram: about 0.4 s on a CPU core, against 0.02 s
for the random part of a cached one). Every item of the network grid has the same size, so the first one measured
tells how many fit. glibc keeps the heap pages an item's full-resolution temporaries used once a small cached result
lies among them (16 MB of resident memory for each 0.42 MB item of a cephalogram): the cache gives them back after each
item, and after each item beyond the cache (:func:`release_free_memory`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch
from bundle.settings import as_number
from monai.data import CacheDataset

__all__ = ["TrimmedCacheDataset", "cached_dataset", "item_bytes", "release_free_memory"]

logger = logging.getLogger(__name__)

GB = 2**30


def release_free_memory() -> None:
    """The C heap's free pages given back to the system (glibc's ``malloc_trim``); nothing where the C library has
    no such call (macOS, musl)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class TrimmedCacheDataset(CacheDataset):
    """MONAI's ``CacheDataset`` giving the heap's free pages back after computing each cached item and after each
    item beyond the cache transformed whole (:func:`release_free_memory`), so that its resident memory is that of the
    items it holds, however many of the others are drawn.

    Args:
        *args, **kwargs: those of MONAI's ``CacheDataset``.
    """

    def _load_cache_item(self, idx: int):
        item = super()._load_cache_item(idx)
        release_free_memory()
        return item

    def _transform(self, index: int):
        item = super()._transform(index)
        if index % len(self) >= self.cache_num:  # transformed whole, its full-resolution temporaries freed
            release_free_memory()
        return item


def item_bytes(item: Any) -> int:
    """The bytes of the arrays and tensors in ``item`` (dicts, lists and tuples searched), a MetaTensor's metadata
    included; a storage shared by several tensors counts for each."""
    if isinstance(item, torch.Tensor):
        meta = getattr(item, "meta", None)
        return item.untyped_storage().nbytes() + (item_bytes(dict(meta)) if meta else 0)
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, dict):
        return sum(item_bytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_bytes(v) for v in item)
    return 0


def cached_dataset(
    data: Sequence[dict], transform: Callable, cache_gb: float, num_workers: int | None = 1
) -> TrimmedCacheDataset:
    """A :class:`TrimmedCacheDataset` of ``data`` caching the first items whose deterministic transforms fit in
    ``cache_gb``, the others transformed whole each time they are drawn (every item yielded, its transform applied).

    The first item's cached form is computed once more to measure it (:func:`item_bytes`); all fit (the embedded
    demo, the 100-image sets) caches everything, as ``CacheDataset`` with ``cache_rate`` 1 did.

    Args:
        data: the items (datalist entries).
        transform: the training transform (a ``Compose``, its deterministic head cached).
        cache_gb: the memory the cached items may take, in GB (2^30 bytes); 0: none cached.
        num_workers: threads computing the cache (at least 1).

    Raises:
        ValueError: ``cache_gb`` is not a number >= 0 (the message names the key).
    """
    budget = as_number(cache_gb, "cache_gb", minimum=0) * GB
    data = list(data)
    workers = max(1, num_workers or 1)
    size = item_bytes(TrimmedCacheDataset(data[:1], transform, num_workers=1, progress=False)._cache) if data else 0
    cache_num = len(data) if size == 0 else min(len(data), int(budget // size))
    if cache_num < len(data):
        logger.warning(
            "training cache: %d of %d items fit in cache_gb %s (%.2f MB each); the other %d run their whole "
            "transform each time they are drawn (slower iterations): raise cache_gb if memory allows",
            cache_num,
            len(data),
            cache_gb,
            size / 2**20,
            len(data) - cache_num,
        )
    return TrimmedCacheDataset(data, transform, cache_num=cache_num, num_workers=workers, progress=False)
