"""The cause of a failed bundle command as the last line of its traceback.

MONAI's config parser wraps an error raised while it evaluates an expression or instantiates a component of a
config in ``RuntimeError("Failed to evaluate ...")`` / ``RuntimeError("Failed to instantiate ...")``. A
``python -m monai.bundle run`` command that refuses bad input therefore ends on that generic line, and the
message that names the file, key or value at fault is printed dozens of lines above it. Importing this module
(the configs' ``imports`` do, before any item is evaluated) installs a ``sys.excepthook`` that prints the
traceback as before and then repeats the innermost cause of such a wrapped error; a :class:`Refusal` (an empty
section of the datalist, say, whose message says how to fill it) is printed alone, as one line. Other uncaught
errors, and errors caught by the caller (tests, the MONAI Label server), are untouched.
"""

from __future__ import annotations

import functools
import sys
from types import TracebackType

MONAI_WRAPPERS = ("Failed to evaluate ", "Failed to instantiate ")
# MONAI's wrapper of an error raised by a transform of a Compose (``monai.transforms.apply_transform``)
TRANSFORM_WRAPPER = "applying transform "


class Refusal(Exception):
    """A refusal whose message says what to do (a mixin of the bundle's error classes): an uncaught one, or one that
    MONAI's wrappers wrap, ends the command on that message alone, without a traceback."""


def root_cause(error: BaseException) -> BaseException:
    """The last error of ``error``'s ``__cause__`` chain (``error`` itself when it has no cause)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _is_wrapper(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and str(error).startswith((*MONAI_WRAPPERS, TRANSFORM_WRAPPER))


def innermost_cause(error: BaseException) -> BaseException | None:
    """The error that MONAI's config-evaluation (and transform) wrappers around ``error`` wrap, or None if ``error`` is
    not such a wrapper. It is the first error of the ``__cause__`` chain that is not a wrapper: the bundle's own
    message naming the file or key (an ``ImageError`` is raised from the reader's error, which it names)."""
    if not (isinstance(error, RuntimeError) and str(error).startswith(MONAI_WRAPPERS)):
        return None
    cause = error
    while _is_wrapper(cause) and cause.__cause__ is not None:
        cause = cause.__cause__
    return None if cause is error else cause


def report_cause_last(
    exc_type: type[BaseException], error: BaseException, tb: TracebackType | None, previous=sys.__excepthook__
) -> None:
    """``sys.excepthook``: the usual report, then ``The cause (above): <type>: <message>`` for a wrapped config
    error; a :class:`Refusal` (wrapped or not): ``<type>: <message>`` alone."""
    cause = innermost_cause(error)
    if isinstance(cause or error, Refusal):
        print(f"{type(cause or error).__name__}: {cause or error}", file=sys.stderr)
        return
    previous(exc_type, error, tb)
    if cause is not None:
        print(f"\nThe cause (above): {type(cause).__name__}: {cause}", file=sys.stderr)


def install() -> None:
    """Put :func:`report_cause_last` in front of the current ``sys.excepthook`` (once)."""
    if getattr(sys.excepthook, "func", None) is report_cause_last:
        return
    sys.excepthook = functools.partial(report_cause_last, previous=sys.excepthook)


install()
