""":class:`TemplateHandler`: one-shot detection gets its templates when an evaluation starts."""

from __future__ import annotations

from typing import Callable

import torch
from bundle.templates.resolution import with_templates
from ignite.engine import Engine, Events


class TemplateHandler:
    """Ignite handler resolving the templates of one-shot (k-shot) detection at the first ``Events.STARTED``.

    ``templates`` returns the template items (the configs' ``evaluate#choose_templates``: choosing one may take
    many network passes, so it runs when the evaluation starts, not when the config is parsed). They are set,
    prepared by ``preprocessing``, on ``inferer`` (:func:`bundle.templates.resolution.with_templates`) and, as the
    list of their images (and of the pseudo-templates' images), on ``predictor`` (a
    :class:`bundle.pipeline.predictor.Predictor`, whose provenance the report writes) when given.
    """

    def __init__(
        self, templates: Callable[[], list[dict]], inferer, preprocessing, device: torch.device | str, predictor=None
    ) -> None:
        self.templates = templates
        self.inferer, self.preprocessing, self.device, self.predictor = inferer, preprocessing, device, predictor
        self.items: list[dict] | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine: Engine) -> None:
        if self.items is not None:
            return
        self.items = list(self.templates())
        with_templates(self.inferer, self.items, self.preprocessing, self.device)
        if self.predictor is not None:
            self.predictor.templates = [t["image"] for t in self.items]
            self.predictor.pseudo_templates = [t["image"] for t in self.items if t.get("pseudo_label")]
