"""What the configs instantiate or call is documented: a Google-style ``Args:`` section naming every argument, and
the docstring examples (``>>>``) run.

The targets are read from the configs: every ``_target_: bundle...`` and every ``bundle.X.f(`` call in
configs/*.yaml and scripts/experiments/configs/*.yaml (the ``scripts.experiments.X.f(`` calls there too).
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "scripts/experiments/configs").glob("*.yaml"))
TARGET = re.compile(r"_target_:\s*['\"]?((?:bundle|scripts)\.[\w.]+)|\b((?:bundle|scripts\.experiments)\.[\w.]+)\(")
# modules with docstring examples
EXAMPLES = ("bundle.losses.heatmap", "bundle.metrics", "bundle.transforms.entropy", "bundle.transforms.sampling")


def config_targets() -> list[str]:
    names = set()
    for path in CONFIGS:
        for line in path.read_text().splitlines():
            if not line.lstrip().startswith("#"):
                names.update(a or b for a, b in TARGET.findall(line))
    return sorted(names)


def resolve(name: str):
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):  # a package's class named through the package (bundle.handlers.X)
        return resolve(module) if "." in module else None


def documented_args(doc: str) -> set[str]:
    """The names in the docstring's ``Args:`` section (``name:``, ``a, b:``, ``*args, **kwargs:``)."""
    match = re.search(r"^([ ]*)Args:\n((?:\1[ ]+.*\n|[ ]*\n)+)", inspect.cleandoc(doc) + "\n", re.MULTILINE)
    if match is None:
        return set()
    first = min(len(line) - len(line.lstrip()) for line in match.group(2).splitlines() if line.strip())
    names = set()
    for line in match.group(2).splitlines():
        head = line[first:]
        if line.strip() and not head[:1].isspace() and ":" in head:
            names.update(n.strip() for n in head.split(":", 1)[0].split(","))
    return names


def own_parameters(obj) -> list[str] | None:
    """The arguments a docstring must name, spelled as it names them (``*args``); None: a class whose ``__init__``
    is its parent's, of arguments (an ``Args:`` section that points there is enough)."""
    if inspect.isclass(obj) and "__init__" not in obj.__dict__:
        return None if inspect.signature(obj).parameters else []
    function = obj.__init__ if inspect.isclass(obj) else obj
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [prefix.get(p.kind, "") + n for n, p in inspect.signature(function).parameters.items() if n != "self"]


def test_the_configs_have_targets():
    names = config_targets()
    assert "bundle.networks.contrastive.ContrastiveLandmarkNet" in names
    assert "scripts.experiments.mixing.feature_mixing" in names
    assert all(resolve(n) is not None for n in names), [n for n in names if resolve(n) is None]


@pytest.mark.parametrize("name", config_targets())
def test_every_argument_is_documented(name):
    obj = resolve(name)
    if not callable(obj):
        pytest.skip(f"{name} is a value")
    doc = "\n".join(d for d in (obj.__doc__, getattr(obj.__dict__.get("__init__"), "__doc__", None)) if d)
    documented = documented_args(doc)
    assert documented or own_parameters(obj) == [], f"{name}: no Args: section"
    missing = [p for p in own_parameters(obj) or [] if p not in documented]
    assert not missing, f"{name}: Args: does not name {missing}"


@pytest.mark.parametrize("module", EXAMPLES)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
