"""A command's passes over images (template features, template ranking, pseudo-labels and their XFeat refinement)
shared among the processes torchrun launched: each computes its share, and every one gets all the results in the
images' order, as one process computes them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from bundle.distributed import gather_shards, portable_error, shard, world_size
from bundle.progress import progress

T = TypeVar("T")


def map_shards(fn: Callable[[T], Any], items: Sequence[T], description: str | None = None) -> list:
    """``[fn(item) for item in items]``, each process computing ``fn`` on its share alone
    (:func:`bundle.distributed.shard`: no item twice, none left out; counted by a progress bar ``description``, None: no
    bar) and
    every process getting all the results in the items' order (:func:`bundle.distributed.gather_shards`); in one
    process, the plain loop. Every process calls it with the same ``items``. An error of ``fn`` in any process is
    raised in every process (the lowest failed rank's), so that none waits for a peer that gave up. The results travel
    pickled between processes: ``fn`` returns them on the CPU (a GPU tensor would arrive on the sender's GPU).

    Args:
        fn: the work on one item.
        items: the same sequence in every process.
        description: the progress bar's name, None: no bar.
    """
    share, failure = [], None
    try:
        share_items = shard(items)
        for item in share_items if description is None else progress(share_items, description):
            share.append(fn(item))
    except Exception as e:  # raised below in every process, this one's own with its traceback
        failure = e
    if world_size() == 1:
        if failure is not None:
            raise failure
        return share
    failures = gather_shards([None if failure is None else portable_error(failure)])
    if failure is not None:
        raise failure
    if (first := next((f for f in failures if f is not None), None)) is not None:
        raise first
    return gather_shards(share)
