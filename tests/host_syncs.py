"""Counting the operations that make a GPU program wait for the device (host syncs), on any device.

``HostSyncCounter`` is a ``TorchFunctionMode`` that counts, inside its ``with`` block, the calls that read a
tensor's values on the host (``bool(t)``, ``item``, ``tolist``, ``nonzero``, ``masked_select``, boolean-mask
indexing, ``cpu`` / ``numpy``) and the tensors built from Python data (``torch.tensor`` / ``as_tensor`` of a
list: a blocking host-to-device copy on a GPU). It works on the CPU, so tests need no GPU.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.__bool__: "bool",
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.total`` and ``syncs.kinds`` (a Counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.kinds[_READS[func]] += 1
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_mask(args[1]):
            self.kinds["boolean index"] += 1
        elif func in (torch.tensor, torch.as_tensor) and isinstance(args[0] if args else None, (list, tuple)):
            self.kinds["tensor from Python data"] += 1
        return func(*args, **kwargs)


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
