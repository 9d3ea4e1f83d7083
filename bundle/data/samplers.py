"""Samplers of the training data loader."""

from __future__ import annotations

from typing import Iterator

from monai.data import DistributedSampler

__all__ = ["ReshufflingDistributedSampler"]


class ReshufflingDistributedSampler(DistributedSampler):
    """MONAI's ``DistributedSampler`` drawing a new order each time it is iterated.

    The parent's order depends on ``seed + epoch`` alone, so when an epoch's ``epoch_length`` outruns the
    loader and Ignite reads it again within the epoch, every pass repeats the first. Here pass ``n`` (counted
    over the sampler's life, the same count on every rank) adds ``n * 2**20`` to the seed: every pass has its
    own order, and the ranks still split each pass into disjoint shares.

    Args:
        *args, **kwargs: those of MONAI's ``DistributedSampler`` (``dataset``, ``even_divisible``, ``shuffle``,
            ``seed``, ...); ``seed`` is the first pass's.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.base_seed = self.seed
        self.passes = 0

    def __iter__(self) -> Iterator[int]:
        self.seed = self.base_seed + self.passes * 2**20
        self.passes += 1
        return super().__iter__()
