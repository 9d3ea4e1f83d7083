"""Console progress of a command's long steps (template features, template ranking, pseudo-labels, the engines'
passes over the images): a count and the time left, as ignite's ``ProgressBar`` shows training (tqdm).

Off until a command turns it on: each command's first steps call :func:`show_progress` with its ``progress_bar``
(``--progress_bar false`` leaves it off); Python callers (the MONAI Label app) print no bars.
"""

from __future__ import annotations

from typing import Any, Iterable

from bundle.settings import as_flag
from ignite.handlers import ProgressBar
from tqdm import tqdm

_SHOWN = [False]


def show_progress(flag: Any) -> None:
    """Show progress bars from now on when ``flag`` (a yes/no, the commands' ``progress_bar``) is yes, else none."""
    _SHOWN[0] = bool(as_flag(flag, "progress_bar"))


def progress_shown() -> bool:
    """Whether progress bars are shown (:func:`show_progress`)."""
    return _SHOWN[0]


def progress(iterable: Iterable, description: str, total: int | None = None) -> Iterable:
    """``iterable`` counted on the console as ``description`` (count, time left) while it is consumed, when progress
    is shown; the bar goes once done."""
    # every item drawn (mininterval 0): the steps take a second or more an item, and the count a user reads, the
    # last one included, does not depend on the machine's speed
    return tqdm(
        iterable, desc=description, total=total, disable=not _SHOWN[0], leave=False, dynamic_ncols=True, mininterval=0
    )


def progress_handlers(flag: Any) -> list:
    """The training's console progress bar (Ignite's ``ProgressBar``, cleared when an epoch ends) when ``flag``
    is on, else none.

    Args:
        flag: ``progress_bar``, a yes/no value.
    """
    return [ProgressBar(persist=False)] if as_flag(flag, "progress_bar") else []
