"""The bundle's YAML configs loaded in Python (scripts, the MONAI Label app, tests), merged as ``monai.bundle run`` does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from monai.bundle import ConfigParser

BUNDLE_ROOT = Path(__file__).resolve().parents[1]


def bundle_parser(config_files: str | Sequence[str], bundle_root: str | os.PathLike = BUNDLE_ROOT, **overrides: Any) -> ConfigParser:
    """A ``ConfigParser`` over ``config_files`` (paths relative to ``bundle_root``, merged in order, nested
    ``a#b`` keys applied), with ``bundle_root`` set and each of ``overrides`` (ids may contain ``#``) set."""
    files = [config_files] if isinstance(config_files, str) else list(config_files)
    parser = ConfigParser()
    parser.read_config([str(Path(bundle_root) / f) for f in files])
    parser["bundle_root"] = str(bundle_root)
    for key, value in overrides.items():
        parser[key] = value
    return parser
