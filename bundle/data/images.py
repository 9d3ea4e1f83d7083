"""Reading images with errors that name the file, the checks every pipeline makes on a loaded image, and
images read for analysis outside the training pipeline (augmentation estimates, figures).

``LoadImaged`` is MONAI's, except that a file that cannot be read (truncated, not an image, no reader)
raises :class:`ImageError` naming it. ``CheckImaged`` follows ``EnsureChannelFirstd`` in every
``load_transforms``; in the 2D configuration it first makes a one-slice volume (a 2D X-ray stored as MetaImage,
NRRD or NIfTI: ``(C, X, Y, 1)``) the 2D image ``(C, X, Y)`` with the header's x, y spacing
(:func:`single_slice_as_2d`, the one place where that happens). It refuses, naming the file, an image of the
wrong dimensionality (a volume of several slices given to the 2D configuration, a 2D picture given to the 3D
one), one smaller than ``min_size`` along an axis and one holding NaN or infinite values; it warns, naming the
file, about a constant image (nothing to match: its predictions are meaningless), a 2D image that its min and max
leave almost flat and a volume that the CT window leaves nearly constant. Pictures are read as a viewer shows
them (:func:`pil_as_displayed`). Every file's header is checked before a pixel is decoded
(:func:`bundle.data.image_headers.check_file`). The images a command runs on: :mod:`bundle.data.image_items`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import monai.transforms
import numpy as np
import torch
from bundle.data.datalist import configuration_hint
from bundle.data.dicom import XRayDicomd, plane_affine
from bundle.data.image_headers import ImageError, check_file
from bundle.io_utils import error_summary
from monai.config import KeysCollection
from monai.data import MetaTensor, PILReader
from monai.transforms import EnsureChannelFirst, LoadImage, MapTransform, ScaleIntensity
from PIL import ImageOps as PILImageOps

# an image smaller than this along an axis is refused (2D: the coarsest output stride, 16; 3D: raw voxels before
# resampling, where a single slice is no volume)
MIN_IMAGE_SIZE = {2: 16, 3: 2}
# below this standard deviation on [0, 1] after the CT window, a volume is warned about as nearly constant
MIN_WINDOWED_SPREAD = 0.01
# a 2D image whose 1st to 99th percentile spans less than this share of its min to max is warned about
MIN_CONTRAST_SHARE = 0.1


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
    if path.is_dir():
        return " (a folder: read as a DICOM series, and no series could be read from it)"
    if not path.is_file():
        return " (no such file)"
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
    return ImageError(f"cannot read image {', '.join(map(str, files))}{hint}: {error_summary(error)}")


_EXIF_ORIENTATION = 0x0112  # the EXIF tag of how a picture is turned for display (1: as stored)
# PIL modes whose stored values are not the grey levels a viewer shows (palette indices, alpha, other colour
# spaces): converted to 8-bit grey ("L") on reading; grey, 16-bit, float and RGB images are read as stored
_PIL_MODES_KEPT = {"L", "I", "I;16", "I;16B", "I;16L", "F", "RGB"}


def pil_as_displayed(image):
    """A PIL image as the grey (or RGB) picture a viewer shows: turned as its EXIF orientation says (as labelme
    shows and annotates it), a palette image's colours instead of its indices, no alpha channel. The converter of
    the PNG / JPEG / BMP / TIFF reader of :class:`LoadImaged` and :func:`load_image`."""
    if image.getexif().get(_EXIF_ORIENTATION, 1) != 1:
        image = PILImageOps.exif_transpose(image)
    return image if image.mode in _PIL_MODES_KEPT else image.convert("L")


# the reader of the files PIL reads (PNG, JPEG, BMP, TIFF): as a viewer shows them
DISPLAYED_PIL = PILReader(converter=pil_as_displayed)


def _runtime_reader(files: Any, reader: Any) -> Any:
    """The reader for ``files``: ``reader`` when given, :data:`DISPLAYED_PIL` for PIL's suffixes, else None (MONAI
    then picks the reader by the suffix, without trying each one in turn and logging each failure)."""
    if reader is None and not isinstance(files, (list, tuple)) and DISPLAYED_PIL.verify_suffix(str(files)):
        return DISPLAYED_PIL
    return reader


class LoadImaged(monai.transforms.LoadImaged):
    """MONAI's ``LoadImaged``; a file it cannot read raises :class:`ImageError` naming the file. PNG, JPEG and BMP
    files are read as a viewer shows them (:func:`pil_as_displayed`).

    Args:
        keys: the image key(s), each an image path (its header checked first, :func:`check_file`).
        reader: MONAI's ``reader``; None: for one key, PIL as displayed for PNG, JPEG and BMP, else MONAI's choice by
            the file's suffix.
        *args, **kwargs: the other arguments of MONAI's ``LoadImaged`` (e.g. ``image_only``).
    """

    def __init__(self, keys: KeysCollection, reader=None, *args: Any, **kwargs: Any) -> None:
        super().__init__(keys, reader, *args, **kwargs)
        self.given_reader = reader is not None

    def __call__(self, data, reader=None):
        keys = list(self.key_iterator(dict(data))) if isinstance(data, Mapping) else []
        for key in keys:
            check_file(data[key])
        if len(keys) == 1 and not self.given_reader:
            reader = _runtime_reader(data[keys[0]], reader)
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
    check_file(path)
    try:
        return LoadImage(image_only=True, **kwargs)(path, _runtime_reader(path, kwargs.get("reader")))
    except Exception as e:
        raise _read_error([path], e) from e


def single_slice_as_2d(image, spatial_dims: int):
    """A channel-first one-slice volume ``(C, X, Y, 1)`` as the 2D image ``(C, X, Y)`` when ``spatial_dims`` is 2:
    affine and ``original_affine`` keep their x, y part, the meta ``spacing`` becomes the x, y voxel size of the
    file's affine (the datalist's ``[x, y]`` = column, row; any reader). Any other image, and every image when
    ``spatial_dims`` is 3, is returned as is."""
    shape = tuple(int(s) for s in image.shape[1:])
    if spatial_dims != 2 or len(shape) != 3 or shape[2] != 1:
        return image
    if not isinstance(image, MetaTensor):
        return image[..., 0]
    meta = dict(image.meta)
    meta.pop("affine", None)
    original = meta.get("original_affine")
    spacing = np.linalg.norm(np.asarray(original if original is not None else image.affine, float)[:-1, :2], axis=0)
    if original is not None:
        meta["original_affine"] = _plane(original, spacing)
    meta["spacing"] = spacing
    meta["spatial_shape"] = np.asarray(shape[:2])
    return MetaTensor(image.as_tensor()[..., 0], affine=torch.as_tensor(_plane(image.affine, spacing)), meta=meta)


def _plane(affine, spacing: np.ndarray) -> np.ndarray:
    """The in-plane ``(3, 3)`` affine of a one-slice volume's ``(4, 4)`` one; where the slice is not an x-y plane
    of the world (its x, y part is singular), the pixel grid scaled by ``spacing`` instead."""
    plane = plane_affine(affine)
    if abs(np.linalg.det(plane[:2, :2])) > 1e-12:
        return plane
    return np.diag(np.append(spacing, 1.0))


def check_image(
    image,
    spatial_dims: int,
    min_size: int | None = None,
    name: str | None = None,
    warn_constant: bool = True,
    intensity_window: Sequence[float] | None = None,
):
    """``image`` (channel-first) made 2D if it is a one-slice volume in 2D (:func:`single_slice_as_2d`), then refused
    (:class:`ImageError`) if it is not ``spatial_dims``-D (in 3D: of one channel), smaller than ``min_size`` (default
    :data:`MIN_IMAGE_SIZE`) along an axis, or not finite; a constant one is warned about (unless ``warn_constant``
    is false), and so is one that the CT ``intensity_window`` ``[low, high]`` (``hu_window``) leaves nearly constant
    (:func:`check_intensity_window`) and a 2D one that its min and max leave almost flat (:func:`check_contrast`).
    Returns the (possibly 2D-made) image."""
    name = name or image_name(image)
    image = single_slice_as_2d(image, spatial_dims)
    shape = tuple(int(s) for s in image.shape[1:])
    if len(shape) != spatial_dims:
        raise ImageError(
            f"{name}: a {len(shape)}D image (spatial shape {list(shape)}), but this configuration expects "
            f"{spatial_dims}D images (spatial_dims: {spatial_dims}){configuration_hint(len(shape), spatial_dims)}"
        )
    if spatial_dims == 3 and image.shape[0] != 1:
        raise ImageError(
            f"{name}: a volume of {image.shape[0]} channels (a 4D file: a time series or several contrasts); the 3D "
            "configuration reads one grey volume: save the one to use as a 3D file"
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
        return image
    lo, hi = values.min(), values.max()
    if bool(lo == hi):
        warnings.warn(
            f"{name}: constant image (every value is {float(lo):g}): it shows no structure, so the landmarks "
            "predicted on it (and errors measured on it) are meaningless",
            stacklevel=2,
        )
    elif intensity_window is not None:
        check_intensity_window(values, intensity_window, name)
    elif spatial_dims == 2:
        check_contrast(values, name)
    return image


def _percentiles_1_99(values: torch.Tensor) -> tuple[float, float]:
    """The 1st and 99th percentiles of ``values``, from about a million of them (evenly strided)."""
    sample = values.flatten()[:: max(1, values.numel() // 1_000_000)].double().numpy()
    p1, p99 = np.percentile(sample, [1, 99])
    return float(p1), float(p99)


def check_contrast(values: torch.Tensor, name: str) -> None:
    """Warn when nearly all of a 2D image lies in a sliver of its range (1st to 99th percentile within
    :data:`MIN_CONTRAST_SHARE` of min to max): scaled by its min and max, as the 2D pipeline scales it, it is almost
    flat. A hot pixel, a burned-in marker or an image that is empty but for a few pixels does this, and the
    landmarks found on it are wrong without an error."""
    p1, p99 = _percentiles_1_99(values)
    lo, hi = float(values.min()), float(values.max())
    share = (p99 - p1) / (hi - lo)
    if share < MIN_CONTRAST_SHARE:
        warnings.warn(
            f"{name}: 98 % of its values lie within {100 * share:.2g} % of its range ({p1:.4g} to {p99:.4g} of "
            f"{lo:.4g} to {hi:.4g}): scaled to [0, 1] by its min and max, it is almost flat, and the landmarks found "
            "on it are likely wrong. A hot pixel, a burned-in marker or an almost empty image does this: crop or "
            "clip the outliers",
            stacklevel=2,
        )


def check_intensity_window(values: torch.Tensor, window: Sequence[float], name: str) -> None:
    """Warn when the window ``[low, high]`` leaves ``values`` nearly constant once scaled to [0, 1] (standard
    deviation below :data:`MIN_WINDOWED_SPREAD`): a volume not in HU (an MRI, intensities scaled to [0, 1]) under
    the CT window shows almost no structure, and matching on it fails without an error. Warn too when a window
    reaching below 0 HU meets a volume without negative values (a CT exported without its rescale: no air at -1000
    HU; 14 mm off on a probe's volume)."""
    low, high = float(window[0]), float(window[1])
    windowed = ((values.float() - low) / (high - low)).clamp(0.0, 1.0)
    spread = float(windowed.std())
    if spread >= MIN_WINDOWED_SPREAD:
        lowest = float(values.min())
        if low < 0 <= lowest:
            warnings.warn(
                f"{name}: no value below {lowest:g} under the Hounsfield window [{low:g}, {high:g}] (hu_window), where "
                "a CT holds air at about -1000 HU: an export without its rescale slope and intercept (8-bit, or "
                "stored values) is matched in the wrong contrast. Export the CT in HU, or give hu_window the range of "
                "its values",
                stacklevel=2,
            )
        return
    p1, p99 = _percentiles_1_99(values)
    warnings.warn(
        f"{name}: the intensity window [{low:g}, {high:g}] (hu_window) leaves it nearly constant (standard deviation "
        f"{spread:.2g} on [0, 1]): its values run from {p1:.3g} to {p99:.3g} (1st to 99th percentile), not CT "
        f'Hounsfield units. Give hu_window their range (--hu_window "[{p1:.3g}, {p99:.3g}]"), or for MRI a '
        "percentile window (docs/3d.md)",
        stacklevel=2,
    )


class CheckImaged(MapTransform):
    """:func:`check_image` on each key of a loaded, channel-first item (place it right after ``EnsureChannelFirstd``):
    a one-slice volume becomes 2D in the 2D configuration, an unusable image is refused.

    Args:
        keys: the image key(s).
        spatial_dims: 2 or 3, the configuration's ``spatial_dims``.
        min_size: the smallest size accepted along each spatial axis (default :data:`MIN_IMAGE_SIZE`).
        intensity_window: the CT window ``[low, high]`` that follows (``hu_window``): an image it leaves nearly
            constant is warned about.
        allow_missing_keys: MONAI's flag.
    """

    def __init__(
        self,
        keys: KeysCollection,
        spatial_dims: int,
        min_size: int | None = None,
        intensity_window: Sequence[float] | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}")
        self.spatial_dims = int(spatial_dims)
        self.min_size = min_size
        self.intensity_window = intensity_window

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            d[key] = check_image(d[key], self.spatial_dims, self.min_size, intensity_window=self.intensity_window)
        return d


def load_grey(path: str, spatial_dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Image as a spatial float array in [0, 1] (channels averaged; 2D indexed ``[x, y]``) and its voxel-to-world
    affine.

    A DICOM X-ray or a one-slice volume is made 2D as in the pipeline's ``load_transforms``.
    An unreadable file or an image of another dimensionality raises :class:`ImageError` naming the file."""
    img = load_image(path)
    if spatial_dims == 2:
        img = XRayDicomd(keys="image")({"image": img})["image"]
    img = single_slice_as_2d(EnsureChannelFirst()(img), spatial_dims)
    if img.ndim - 1 != spatial_dims:
        raise ImageError(f"{path}: expected a {spatial_dims}D image, LoadImage gave shape {tuple(img.shape)}")
    grey = ScaleIntensity(minv=0.0, maxv=1.0)(img.float().mean(0, keepdim=True))
    return grey[0].numpy().astype(np.float64), np.asarray(img.affine, dtype=np.float64)


def check_image_file(
    path: str, spatial_dims: int, min_size: int | None = None, warn_constant: bool = True
) -> tuple[int, ...]:
    """Read ``path`` as the pipeline does and :func:`check_image` it (for datalist writers: a file that the
    training would refuse is refused before it enters a datalist); return its spatial shape (x, y[, z])."""
    img = load_image(path)
    if spatial_dims == 2:
        img = XRayDicomd(keys="image")({"image": img})["image"]
    img = check_image(EnsureChannelFirst()(img), spatial_dims, min_size, name=str(path), warn_constant=warn_constant)
    return tuple(int(n) for n in img.shape[1:])
