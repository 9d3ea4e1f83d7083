"""A warning, naming the image, when the network recognises no landmark on it (not in the paper).

On an image unlike those it learnt from, a heatmap detector still puts every landmark at its heatmap's argmax and
template matching at each template's best match, and the predictions look like any others. The detector's heatmap
peaks and the matches' scores against the templates' agreement (:func:`bundle.inferers.oneshot.template_agreement`)
tell the two apart; the thresholds below lie between the values measured on upright cephalograms and on the same
images inverted or mirrored (docs/results.md, "A detector's confidence" and "How well the templates match").
"""

from __future__ import annotations

import logging
import warnings
from typing import Sequence

from bundle.data.images import image_name
from bundle.handlers.report import batch_items
from ignite.engine import Engine, Events
from tqdm import tqdm

__all__ = [
    "MIN_PEAK",
    "MATCH_MIN_RATIO",
    "ConfidenceHandler",
    "low_confidence_messages",
    "low_peak_message",
    "low_match_message",
]

# mean heatmap peak below which an image is warned about
MIN_PEAK = 0.2
# mean match score, as a share of the templates' agreement, below which an image is warned about
MATCH_MIN_RATIO = 0.9

_CAUSES = "An inverted (white background) or mirrored (facing the other way) image, or another anatomy, does this"


def low_peak_message(name: str, mean_peak: float, min_peak: float = MIN_PEAK) -> str | None:
    """The warning for image ``name`` whose detector peaks average ``mean_peak`` below ``min_peak``; else None."""
    if mean_peak >= min_peak:
        return None
    return (
        f"{name}: the detector's heatmap peaks average {mean_peak:.3f}, below {min_peak:g} (on the images it learnt "
        "from they are about 0.4 to 0.9): it recognises no landmark here, and its predictions are likely wrong. "
        f"{_CAUSES}"
    )


def low_match_message(
    name: str, mean_score: float, reference: float | None, min_ratio: float = MATCH_MIN_RATIO
) -> str | None:
    """The warning for image ``name`` whose matches score ``mean_score`` on average, below ``min_ratio`` times the
    templates' agreement ``reference``; else None, and None without a positive reference (fewer than two templates,
    or a matcher combining the scales by a sum, whose scores may be 0 or negative)."""
    if reference is None or reference <= 0 or not mean_score < min_ratio * reference:
        return None
    return (
        f"{name}: its matches with the templates score {mean_score:.3f} on average, below {min_ratio:g} x "
        f"{reference:.3f} (the templates' scores against each other; images the network recognises score above "
        f"that): the landmarks are likely wrong. {_CAUSES}, and so does a contrast unlike the templates'"
    )


def low_confidence_messages(
    inferer, names: Sequence[str], min_peak: float = MIN_PEAK, min_match_ratio: float = MATCH_MIN_RATIO
) -> list[str | None]:
    """The warning (or None) for each image of ``inferer``'s last call, ``names`` in batch order: a
    :class:`bundle.inferers.heatmap.HeatmapInferer`'s ``peak_values`` by :func:`low_peak_message`, a template
    inferer's (:mod:`bundle.inferers.oneshot`) ``match_scores`` against its ``reference_score`` by
    :func:`low_match_message`; None for each with neither."""
    peaks = getattr(inferer, "peak_values", None)
    if peaks is not None:
        return [low_peak_message(n, m, min_peak) for n, m in zip(names, peaks.mean(dim=-1).tolist())]
    scores = getattr(inferer, "match_scores", None)
    if scores is not None:
        means, reference = scores.nanmean(dim=-1).tolist(), inferer.reference_score
        return [low_match_message(n, m, reference, min_match_ratio) for n, m in zip(names, means)]
    return [None] * len(names)


class ConfidenceHandler:
    """Ignite handler: after each iteration, warn naming each image on which ``inferer`` recognises no landmark
    (:func:`low_confidence_messages`); at the end, log how many there were.

    Args:
        inferer: the run's inferer (its last call's ``peak_values`` or ``match_scores`` are read).
        min_peak: a detector's mean heatmap peak below which an image is warned about.
        min_match_ratio: template matching's mean match score, as a share of the templates' agreement
            (``reference_score``), below which an image is warned about.
        image_key: the batch's images, whose file names the warnings give.
    """

    def __init__(
        self, inferer, min_peak: float = MIN_PEAK, min_match_ratio: float = MATCH_MIN_RATIO, image_key: str = "image"
    ) -> None:
        self.inferer = inferer
        self.min_peak = float(min_peak)
        self.min_match_ratio = float(min_match_ratio)
        self.image_key = image_key
        self.low: list[str] = []
        self.logger = logging.getLogger("bundle.reporting")

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, lambda _: self.low.clear())
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.check)
        engine.add_event_handler(Events.COMPLETED, self.summary)

    def check(self, engine: Engine) -> None:
        names = [image_name(item.get(self.image_key)) for item in batch_items(engine.state.batch)]
        messages = low_confidence_messages(self.inferer, names, self.min_peak, self.min_match_ratio)
        for name, message in zip(names, messages):
            if message is not None:
                self.low.append(name)
                with tqdm.external_write_mode():  # on its own line, not after a progress bar's
                    warnings.warn(message, stacklevel=2)

    def summary(self, engine: Engine) -> None:
        if self.low:
            self.logger.warning("the network recognised no landmark on %d image(s): %s", len(self.low), self.low)
