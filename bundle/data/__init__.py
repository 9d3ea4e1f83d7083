"""Data: the datalist contract, image reading and checks, the readers of public sets, synthetic data."""

from bundle import lazy_submodules

__getattr__ = lazy_submodules(__name__)
