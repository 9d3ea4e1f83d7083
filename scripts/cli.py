"""The scripts' command line: Python Fire, with the options checked before the command runs.

Fire reports an option that the called function does not take only after the call (``prepare_data labelme ...
--spacng X`` wrote its datalist without spacing, then failed), and makes an option given without a value ``True``
(``--spacing`` alone became a spacing of 1). :func:`run_fire` refuses both first, naming the option and the
closest ones the command takes, and exits with status 2 as Fire does for a usage error. A yes/no option's value
is read as the bundle's configs read one (``--keep_held_out_images no`` is false; Fire took any word as true). An
error the command raises for bad input (:data:`BAD_INPUT`) is printed as ``error: <message>`` with status 2, without
the traceback.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any, Callable, Sequence

import fire
from bundle.configs import command_line_options
from bundle.settings import FLAG_WORDS

# what the scripts raise for bad input (a DatalistError or ImageError is a ValueError), reported as a usage error
BAD_INPUT = (ValueError, KeyError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def _called_function(component: Any, args: Sequence[str]) -> tuple[Callable | None, list[str], str]:
    """The function that ``args`` call on ``component`` (a function, or a dict of them named by the first argument),
    the arguments left for it and its name on the command line; None when Fire is to report the command itself."""
    if isinstance(component, dict):
        if not args or args[0] not in component:
            return None, [], ""
        return component[args[0]], list(args[1:]), args[0]
    return component, list(args), getattr(component, "__name__", "command")


def _is_yes_no(parameter: inspect.Parameter | None) -> bool:
    return parameter is not None and (isinstance(parameter.default, bool) or parameter.annotation in (bool, "bool"))


def checked_options(function: Callable, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` with the value of each yes/no option (``--flag no``, ``--flag=False``) written as Fire's ``True`` /
    ``False`` (Fire reads ``no`` as a non-empty, so true, string), and what is wrong with the options for
    ``function``: options it does not take (with the closest it does), options without a value that are not yes/no
    ones, yes/no values other than true/false/yes/no/1/0 (any case)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return list(args), []
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    out, errors = list(args), []
    for i, name, text, inline in command_line_options(args):
        parameter = parameters.get(name)
        if parameter is None:
            if name == "help" or takes_any or (name.startswith("no") and _is_yes_no(parameters.get(name[2:]))):
                continue  # Fire's --help, and its --noflag for flag=False
            close = difflib.get_close_matches(name, list(parameters), n=3, cutoff=0.5)
            hint = f" (closest: {', '.join('--' + c for c in close)})" if close else ""
            errors.append(f"unknown option --{name}{hint}")
        elif not _is_yes_no(parameter):
            if text is None:
                errors.append(f"--{name} needs a value (--{name} VALUE)")
        elif text is not None:  # --flag alone: True
            word = FLAG_WORDS.get(text.strip().casefold())
            if word is None:
                errors.append(f"--{name}: expected true/false/yes/no/1/0, got {text!r}")
            elif inline:
                out[i] = f"--{name}={word}"
            else:
                out[i + 1] = str(word)
    return out, errors


def run_fire(component: Any, argv: Sequence[str] | None = None, **fire_kwargs: Any) -> Any:
    """``fire.Fire(component, command=argv)`` once :func:`checked_options` finds nothing wrong; else the errors on
    standard error and exit status 2, before the command does any work."""
    args = list(sys.argv[1:] if argv is None else argv)
    function, rest, name = _called_function(component, args)
    errors = []
    if function is not None:
        rest, errors = checked_options(function, rest)
        args = args[: len(args) - len(rest)] + rest
    if errors:
        print(f"error: {name}: {'; '.join(errors)} (--help lists the options)", file=sys.stderr)
        sys.exit(2)
    try:
        return fire.Fire(component, command=args, **fire_kwargs)
    except BAD_INPUT as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        sys.exit(2)
