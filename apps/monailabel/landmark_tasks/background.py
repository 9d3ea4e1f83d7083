"""Work of the app in the background: at a lower priority, stopped between its steps when the process ends."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

logger = logging.getLogger(__name__)

# the niceness of the app's background work (trainings' child processes, pseudo-templates, auto's choice): on cores
# that it shares with the server, suggestions come first
BACKGROUND_NICENESS = 10


def lower_priority(pid: int, what: str) -> None:
    """Give process or thread ``pid`` (``what`` it is, for the warning) ``BACKGROUND_NICENESS`` where the system has
    niceness. The threads it starts later inherit it."""
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, BACKGROUND_NICENESS)
        except OSError as e:  # a process that has already ended, or a system that refuses
            logger.warning(f"{what} {pid} keeps its priority: {e}")


# set when the process ends: background work stops between its steps (check_stopping), and the process waits for it
# (a process that ends while a daemon thread runs the network is aborted by PyTorch)
STOPPING = threading.Event()
STOP_WAIT_S = 60.0


class AppStopping(RuntimeError):
    """Background work given up because the process is ending."""


def check_stopping() -> None:
    """Raise :class:`AppStopping` once the process is ending (called by background work between its steps)."""
    if STOPPING.is_set():
        raise AppStopping("the app is stopping")


def stoppable(transform: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``transform`` calling :func:`check_stopping` first: work that prepares its items one by one with it (the
    bundle's pseudo-template choice, :func:`bundle.templates.resolution.resolve_templates`) stops between items."""

    def run(data: Any) -> Any:
        check_stopping()
        return transform(data)

    return run


class BackgroundValue:
    """A value computed in the background for the newest key asked for, by one daemon thread at a time at
    ``BACKGROUND_NICENESS``; the last computed ``(key, value)`` stays readable meanwhile. A failure is logged and gives
    ``fallback`` for its key (computed again once another key is asked for). When the process ends, the computation
    running is waited for (up to ``STOP_WAIT_S``; ``compute`` should call :func:`check_stopping` between its steps)."""

    _instances: weakref.WeakSet[BackgroundValue] = weakref.WeakSet()

    def __init__(self, name: str, compute: Callable[..., Any], fallback: Any = None) -> None:
        self.name, self.compute, self.fallback = name, compute, fallback
        self._lock = threading.Lock()
        self._last: tuple[Any, Any] | None = None
        self._wanted: tuple[Any, tuple] | None = None
        self._worker: threading.Thread | None = None
        BackgroundValue._instances.add(self)

    @classmethod
    def stop_all(cls, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop every background computation (:data:`STOPPING`) and wait for each, ``timeout_s`` in all."""
        STOPPING.set()
        deadline = time.monotonic() + timeout_s
        for value in list(cls._instances):
            with value._lock:
                worker = value._worker
            if worker is not None:
                worker.join(max(0.0, deadline - time.monotonic()))

    def get(self, key: Any, *args: Any) -> tuple[Any, Any] | None:
        """The last computed ``(key, value)`` (None before the first). Unless its key is ``key``, ``compute(*args)`` is
        wanted for ``key``: started now, or after the computation running (a newer wish replaces an older one)."""
        with self._lock:
            if self._last is None or self._last[0] != key:
                self._wanted = (key, args)
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, name=self.name, daemon=True)
                    self._worker.start()
            return self._last

    def pending(self) -> bool:
        """Whether a computation is running or wanted."""
        with self._lock:
            return self._worker is not None

    def _work(self) -> None:
        lower_priority(threading.get_native_id(), f"the {self.name} thread")
        try:
            while True:
                with self._lock:
                    wanted = self._wanted
                    if wanted is None or (self._last is not None and self._last[0] == wanted[0]) or STOPPING.is_set():
                        return
                key, args = wanted
                try:
                    value = self.compute(*args)
                except AppStopping:
                    return
                except Exception:
                    logger.exception(f"{self.name}: not computed")
                    value = self.fallback
                with self._lock:
                    self._last = (key, value)
        finally:
            with self._lock:
                self._worker = None


atexit.register(BackgroundValue.stop_all)
