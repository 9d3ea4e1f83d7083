"""A warning, naming the image, when the heatmap detector recognises no landmark on it (not in the paper).

On an image unlike those it learnt from, the detector still puts every landmark at its heatmap's argmax, and the
predictions look like any others. Its heatmap peaks tell the two apart: on 30 Hamedan cephalograms (images 071-100)
the shipped detectors' peaks averaged over the 19 landmarks were 0.39-0.65 (``models/finetune``) and 0.80-0.90
(``models/stage2``) per image, on the same images inverted (white background) 0.023-0.056 and mirrored (facing the
other way) 0.029-0.134 (docs/results.md, "A detector's confidence").
"""

from __future__ import annotations

import logging
import warnings

from bundle.data.images import image_name
from bundle.handlers.report import batch_items
from ignite.engine import Engine, Events

__all__ = ["MIN_PEAK", "DetectorConfidenceHandler", "low_peak_message"]

# mean heatmap peak below which an image is warned about (between the 0.056 / 0.134 and 0.39 above)
MIN_PEAK = 0.2


def low_peak_message(name: str, mean_peak: float, min_peak: float = MIN_PEAK) -> str | None:
    """The warning for image ``name`` whose detector peaks average ``mean_peak`` below ``min_peak``; else None."""
    if mean_peak >= min_peak:
        return None
    return (
        f"{name}: the detector's heatmap peaks average {mean_peak:.3f}, below {min_peak:g} (on the images it learnt "
        "from they are about 0.4 to 0.9): it recognises no landmark here, and its predictions are likely wrong. An "
        "inverted (white background) or mirrored (facing the other way) image, or another anatomy, does this"
    )


class DetectorConfidenceHandler:
    """Ignite handler: after each iteration, warn naming each image whose mean heatmap peak (the ``peak_values`` of
    :class:`bundle.inferers.heatmap.HeatmapInferer`) is below ``min_peak``; at the end, log how many were.

    Does nothing when ``inferer`` holds no peak values (template matching), so it can be attached either way.
    """

    def __init__(self, inferer, min_peak: float = MIN_PEAK, image_key: str = "image") -> None:
        self.inferer = inferer
        self.min_peak = float(min_peak)
        self.image_key = image_key
        self.low: list[str] = []
        self.logger = logging.getLogger("bundle.reporting")

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, lambda _: self.low.clear())
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.check)
        engine.add_event_handler(Events.COMPLETED, self.summary)

    def check(self, engine: Engine) -> None:
        peaks = getattr(self.inferer, "peak_values", None)
        if peaks is None:
            return
        for item, mean_peak in zip(batch_items(engine.state.batch), peaks.mean(dim=-1).tolist()):
            name = image_name(item.get(self.image_key))
            message = low_peak_message(name, mean_peak, self.min_peak)
            if message is not None:
                self.low.append(name)
                warnings.warn(message, stacklevel=2)

    def summary(self, engine: Engine) -> None:
        if self.low:
            self.logger.warning("the detector recognised no landmark on %d image(s): %s", len(self.low), self.low)
