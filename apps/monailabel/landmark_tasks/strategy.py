"""Active-learning strategies ``first`` and ``last``: the first / last image, in the datastore's sorted image ids,
that has no label yet (deterministic annotation order, beside MONAI Label's ``random``)."""

from __future__ import annotations

import logging

from monailabel.interfaces.datastore import Datastore
from monailabel.interfaces.tasks.strategy import Strategy

logger = logging.getLogger(__name__)


class OrderedStrategy(Strategy):
    """The first (``last=False``) or last unlabelled image of the sorted image ids; None when all are labelled."""

    def __init__(self, last: bool = False) -> None:
        self.last = last
        super().__init__(f"The {'last' if last else 'first'} unlabelled image in sorted image-id order")

    def __call__(self, request, datastore: Datastore):
        images = sorted(datastore.get_unlabeled_images(request.get("label_tag"), request.get("labels")))
        if not images:
            return None
        image = images[-1] if self.last else images[0]
        logger.info(f"{'Last' if self.last else 'First'}: selected image {image} of {len(images)} unlabelled")
        return {"id": image}
