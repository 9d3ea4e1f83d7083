"""The embedded synthetic data sets: opening a datalist, generating the default set when it is missing.

Sits above :mod:`bundle.data.datalist` (the contract) and :mod:`bundle.data.synthetic` (the generator, which
writes its datalist with the former), so that neither imports the other back.
"""

from __future__ import annotations

import os
from pathlib import Path

from bundle.data.datalist import load_datalist
from bundle.data.synthetic import ensure_synthetic_dataset

EMBEDDED_DATASETS = {"synthetic_2d": 2, "synthetic_3d": 3}


def ensure_embedded_dataset(path: str | os.PathLike) -> Path:
    """Return ``path``; when it is a missing embedded synthetic default (``.../synthetic_2d|3d/datalist.json``),
    first generate that set (the configs' ``initialize`` step). Any other path is left as it is.

    Args:
        path: the configuration's ``datalist``.
    """
    path = Path(path)
    if not path.exists() and path.parent.name in EMBEDDED_DATASETS:
        ensure_synthetic_dataset(path, spatial_dims=EMBEDDED_DATASETS[path.parent.name])
    return path


def open_datalist(path: str | os.PathLike, spatial_dims: int | None = None) -> dict:
    """Load a datalist (of ``spatial_dims`` when given, :func:`bundle.data.datalist.load_datalist`); the embedded
    synthetic default is generated when missing (:func:`ensure_embedded_dataset`)."""
    return load_datalist(ensure_embedded_dataset(path), spatial_dims=spatial_dims)
