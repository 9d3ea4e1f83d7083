"""A training's time budget: :class:`TrainingTimeBudget` ends the training after the last epoch that fits in it."""

from __future__ import annotations

import logging
import math
import time

import ignite.distributed as idist
from bundle.settings import as_number
from ignite.engine import Engine, Events
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler

logger = logging.getLogger(__name__)


class TrainingTimeBudget:
    """End a training after the last whole epoch that fits in ``max_minutes`` of its epochs' time.

    After each epoch the mean epoch time so far (from the engine's start, validations included) gives how many
    more epochs fit; when fewer than the configured ones, ``engine.state.max_epochs`` is lowered to end there,
    and a cosine ``lr_scheduler`` (``CosineAnnealingLR``, stepped every epoch) gets the new length as its
    ``T_max``, so that the learning rate still decays to its minimum at the last epoch. The budget never adds
    epochs. In a distributed run every rank attaches it and follows rank 0's timing. ``max_minutes=None``
    attaches nothing. What is done before the engine starts (reading and caching the data) is not counted; the
    epochs run are in ``engine.state.max_epochs``, and in ``last.pt``. A cut run is reproducible only where its
    epochs take the same time: set ``epochs`` instead for that; it resumes with ``epochs`` set to its cut length.

    Args:
        max_minutes: the budget in minutes (> 0); None: no budget.
        lr_scheduler: the training's LR scheduler; a ``CosineAnnealingLR`` gets the cut length as its ``T_max``.
    """

    def __init__(self, max_minutes: float | None, lr_scheduler: LRScheduler | None = None) -> None:
        self.seconds = None if max_minutes is None else 60.0 * as_number(max_minutes, "max_minutes", minimum=0)
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"max_minutes: expected a number > 0 or null, got {max_minutes!r}")
        self.lr_scheduler = lr_scheduler
        self.start: float | None = None
        self.first_epoch = 0

    def attach(self, engine: Engine) -> None:
        if self.seconds is None:
            return
        engine.add_event_handler(Events.STARTED, self.started)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.epoch_completed)

    def started(self, engine: Engine) -> None:
        self.start, self.first_epoch = time.monotonic(), engine.state.epoch  # a resumed run starts past epoch 0

    def epoch_completed(self, engine: Engine) -> None:
        done = engine.state.epoch - self.first_epoch
        elapsed = time.monotonic() - self.start
        fitting = engine.state.epoch + math.floor((self.seconds - elapsed) / (elapsed / done))
        fitting = int(idist.broadcast(float(fitting), src=0))  # the same decision on every rank
        if fitting >= engine.state.max_epochs:
            return
        last = max(engine.state.epoch, fitting)
        logger.info(
            f"max_minutes {self.seconds / 60:g}: {done} epoch(s) took {elapsed:.0f} s, so the training ends after "
            f"epoch {last} of {engine.state.max_epochs}"
        )
        engine.state.max_epochs = last
        if isinstance(self.lr_scheduler, CosineAnnealingLR) and last > engine.state.epoch:
            self.lr_scheduler.T_max = last
