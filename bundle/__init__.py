"""Information-guided pixel-wise contrastive learning for one-shot landmark detection (a MONAI bundle).

Implements Quan et al., "Information-guided pixel augmentation for pixel-wise contrastive learning",
CVPR 2023, on top of MONAI and Ignite. See ``docs/README.md`` for the model card.
"""

__version__ = "0.5.0"
