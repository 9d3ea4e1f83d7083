"""Information-guided pixel-wise contrastive learning for one-shot landmark detection (a MONAI bundle).

Implements Quan et al., "Information-guided pixel augmentation for pixel-wise contrastive learning",
CVPR 2023, on top of MONAI and Ignite. See ``docs/README.md`` for the model card.
"""

import json
from pathlib import Path

# the bundle's one version number: configs/metadata.json's (the model zoo reads it there)
_METADATA = Path(__file__).resolve().parents[1] / "configs" / "metadata.json"
__version__ = json.loads(_METADATA.read_text(encoding="utf-8"))["version"]
