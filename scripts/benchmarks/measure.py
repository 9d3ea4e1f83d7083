"""What the benchmarks share: the repository's and the shared data's folders, best wall time, peak memory."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]

DATA = ROOT.parent / "shared" / "data"


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time in seconds of ``repeats`` calls of ``fn`` and the last result."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Peak memory (MB) that ``fn`` allocates through numpy and Python, by tracemalloc (untimed run)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def peak_memory_note(device: Any) -> str:
    """The peak memory of this process on ``device``: allocated GPU memory, or the resident set on the CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB"
    return f"peak process RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
