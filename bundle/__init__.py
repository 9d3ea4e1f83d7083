"""Information-guided pixel-wise contrastive learning for one-shot landmark detection (a MONAI bundle).

Implements Quan et al., "Information-guided pixel augmentation for pixel-wise contrastive learning",
CVPR 2023, on top of MONAI and Ignite. See ``docs/README.md`` for the model card.
"""

import importlib
import json
from pathlib import Path

# the bundle's one version number: configs/metadata.json's (the model zoo reads it there)
_METADATA = Path(__file__).resolve().parents[1] / "configs" / "metadata.json"
__version__ = json.loads(_METADATA.read_text(encoding="utf-8"))["version"]


def lazy_submodules(package: str):
    """A module ``__getattr__`` (PEP 562) for ``package``: ``package.<name>`` is imported when it is first read, so that
    the configs import ``bundle`` alone and call ``bundle.<module>.<function>`` (only what a command uses is loaded)."""

    def __getattr__(name: str):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


__getattr__ = lazy_submodules(__name__)
