""":class:`DeferredSummaryWriter`: TensorBoard logs opened at their first value."""

from __future__ import annotations

import os
from typing import Any


class DeferredSummaryWriter:
    """A TensorBoard ``SummaryWriter`` of ``log_dir`` opened at its first use (the first value logged), for the
    ``summary_writer`` of MONAI's TensorBoard handlers: building the handler writes nothing.

    Args:
        log_dir: the event files' folder.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = str(log_dir)
        self._writer = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocol lookups do not open the writer
            raise AttributeError(name)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return getattr(self._writer, name)
