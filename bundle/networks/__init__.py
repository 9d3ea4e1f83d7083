"""Networks: the dense encoders, the two-encoder contrastive model, matching, the detector, XFeat."""

from bundle import lazy_submodules

__getattr__ = lazy_submodules(__name__)
