"""Reading images with errors that name the file, the checks every pipeline makes on a loaded image, and
images read for analysis outside the training pipeline (augmentation estimates, figures).

``LoadImaged`` is MONAI's, except that a file that cannot be read (truncated, not an image, no reader)
raises :class:`ImageError` naming it. ``CheckImaged`` follows ``EnsureChannelFirstd`` in every
``load_transforms`` and refuses, naming the file, an image of the wrong dimensionality (a volume given to
the 2D configuration, a 2D picture given to the 3D one), one smaller than ``min_size`` along an axis and
one holding NaN or infinite values; it warns, naming the file, about a constant image (nothing to match:
its predictions are meaningless).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Hashable, Mapping

import numpy as np
import torch
from monai.config import KeysCollection
from monai.transforms import EnsureChannelFirst, MapTransform, ScaleIntensity
from monai.transforms import LoadImage as _LoadImage
from monai.transforms import LoadImaged as _LoadImaged

from bundle.data.dicom import XRayDicomd

# an image smaller than this along an axis is refused (2D: the coarsest output stride, 16; 3D: raw voxels before
# resampling, where a single slice is no volume)
MIN_IMAGE_SIZE = {2: 16, 3: 2}


class ImageError(ValueError):
    """An image that cannot be used; the message names the file and what is wrong with it."""


def image_name(image: Any, default: str = "image") -> str:
    """The file an image was read from (its ``filename_or_obj`` metadata), else ``default``."""
    meta = getattr(image, "meta", None) or {}
    name = meta.get("filename_or_obj")
    return str(name) if name else default


def _what_is_wrong(file: Any) -> str:
    """What can be told about an unreadable file without its reader: missing, empty, or a DICOM file."""
    if not isinstance(file, (str, os.PathLike)):
        return ""  # a list of files (a series), or not a path at all
    path = Path(file)
    if not path.is_file():
        return "" if path.is_dir() else " (no such file)"
    with path.open("rb") as f:
        head = f.read(132)
    if not head:
        return " (empty file, 0 bytes)"
    if head[128:132] == b"DICM":
        return " (a DICOM file whose data cannot be decoded: truncated, or a compression GDCM cannot read)"
    return ""


def _read_error(files: list, error: Exception) -> ImageError:
    """The error for ``files`` (what the reader was given: one entry per key) that ``error`` stopped; a single
    file is also diagnosed (:func:`_what_is_wrong`)."""
    hint = _what_is_wrong(files[0]) if len(files) == 1 else ""
    return ImageError(f"cannot read image {', '.join(map(str, files))}{hint}: {type(error).__name__}: {error}")


class LoadImaged(_LoadImaged):
    """MONAI's ``LoadImaged``; a file it cannot read raises :class:`ImageError` naming the file."""

    def __call__(self, data, reader=None):
        try:
            return super().__call__(data, reader)
        except ImageError:
            raise
        except Exception as e:
            files = [data[k] for k in self.key_iterator(dict(data))] if isinstance(data, Mapping) else [data]
            raise _read_error(files, e) from e


def load_image(path: str, **kwargs: Any):
    """``monai.transforms.LoadImage(image_only=True, **kwargs)(path)``; an unreadable file raises
    :class:`ImageError`."""
    try:
        return _LoadImage(image_only=True, **kwargs)(path)
    except Exception as e:
        raise _read_error([path], e) from e


def check_image(
    image, spatial_dims: int, min_size: int | None = None, name: str | None = None, warn_constant: bool = True
) -> None:
    """Refuse (:class:`ImageError`) a channel-first ``image`` that is not ``spatial_dims``-D, smaller than
    ``min_size`` (default :data:`MIN_IMAGE_SIZE`) along an axis, or not finite; warn about a constant one
    (unless ``warn_constant`` is false)."""
    name = name or image_name(image)
    shape = tuple(int(s) for s in image.shape[1:])
    if len(shape) != spatial_dims:
        hint = {
            (3, 2): "; volumes need the 3D configuration (merge configs/train_3d.yaml, "
            "and configs/evaluate_3d.yaml to evaluate)",
            (2, 3): "; 2D images need the 2D configuration (configs/train.yaml without configs/train_3d.yaml)",
        }.get((len(shape), spatial_dims), "")
        if (len(shape), spatial_dims) == (3, 2) and shape[2] == 1:
            hint = (
                "; it is one slice: a 2D image stored as a volume (an X-ray converted to NIfTI, say) is not read as "
                "2D, give the 2D file itself (DICOM, PNG, ...)"
            )
        raise ImageError(
            f"{name}: a {len(shape)}D image (spatial shape {list(shape)}), but this configuration expects "
            f"{spatial_dims}D images (spatial_dims: {spatial_dims}){hint}"
        )
    min_size = MIN_IMAGE_SIZE.get(spatial_dims, 1) if min_size is None else int(min_size)
    if min(shape) < min_size:
        raise ImageError(
            f"{name}: an image of {' x '.join(map(str, shape))} pixels is too small for the network: every axis "
            f"needs at least {min_size} (min_image_size)"
        )
    values = image.as_tensor() if hasattr(image, "as_tensor") else torch.as_tensor(np.asarray(image))
    if values.is_floating_point() or values.is_complex():
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise ImageError(
                f"{name}: {bad} of {finite.numel()} values are NaN or infinite; "
                "the image cannot be used (fix or re-export it)"
            )
    if not warn_constant:
        return
    lo, hi = values.min(), values.max()
    if bool(lo == hi):
        warnings.warn(
            f"{name}: constant image (every value is {float(lo):g}): it shows no structure, so the landmarks "
            "predicted on it (and errors measured on it) are meaningless",
            stacklevel=2,
        )


class CheckImaged(MapTransform):
    """:func:`check_image` on each key of a loaded, channel-first item (place it right after ``EnsureChannelFirstd``).

    Args:
        keys: the image key(s).
        spatial_dims: 2 or 3, the configuration's ``spatial_dims``.
        min_size: the smallest size accepted along each spatial axis (default :data:`MIN_IMAGE_SIZE`).
    """

    def __init__(
        self, keys: KeysCollection, spatial_dims: int, min_size: int | None = None, allow_missing_keys: bool = False
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}")
        self.spatial_dims = int(spatial_dims)
        self.min_size = min_size

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            check_image(d[key], self.spatial_dims, self.min_size)
        return d


def load_grey(path: str, spatial_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Image as a spatial float array in [0, 1] (channels averaged; 2D indexed ``[x, y]``) and its voxel-to-world
    affine.

    A DICOM X-ray is made 2D (header spacing, VOI window, MONOCHROME2) as in the pipeline's ``load_transforms``.
    An unreadable file or an image of another dimensionality raises :class:`ImageError` naming the file."""
    img = load_image(path)
    if spatial_dims == 2:
        img = XRayDicomd(keys="image")({"image": img})["image"]
    img = EnsureChannelFirst()(img)
    if img.ndim - 1 != spatial_dims:
        raise ImageError(f"{path}: expected a {spatial_dims}D image, LoadImage gave shape {tuple(img.shape)}")
    grey = ScaleIntensity(minv=0.0, maxv=1.0)(img.float().mean(0, keepdim=True))
    return grey[0].numpy().astype(np.float64), np.asarray(img.affine, dtype=np.float64)


def check_image_file(path: str, spatial_dims: int, min_size: int | None = None, warn_constant: bool = True) -> None:
    """Read ``path`` as the pipeline does and :func:`check_image` it (for datalist writers: a file that the
    training would refuse is refused before it enters a datalist)."""
    img = load_image(path)
    if spatial_dims == 2:
        img = XRayDicomd(keys="image")({"image": img})["image"]
    check_image(EnsureChannelFirst()(img), spatial_dims, min_size, name=str(path), warn_constant=warn_constant)
