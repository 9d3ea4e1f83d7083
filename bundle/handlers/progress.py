"""What the console shows of an engine's run: a progress bar over its iterations (ignite's ``ProgressBar``: count,
time left) when progress is shown (:func:`bundle.progress.show_progress`), and not ignite's "Engine run resuming from
iteration 0" line that starts every evaluation (MONAI's engines set their state up front, so ignite calls each
start a resumption)."""

from __future__ import annotations

import logging

from bundle.progress import progress_shown
from ignite.engine import Engine
from ignite.handlers import ProgressBar

__all__ = ["EngineProgress"]


def _not_a_fresh_start(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Engine run resuming from iteration 0,")


class EngineProgress:
    """An engine's progress bar, and no "resuming from iteration 0" line.

    Args:
        description: what the bar counts (e.g. "images").
    """

    def __init__(self, description: str = "images") -> None:
        self.description = description

    def attach(self, engine: Engine) -> None:
        engine.logger.addFilter(_not_a_fresh_start)
        if progress_shown():
            ProgressBar(persist=False, desc=self.description).attach(engine)
