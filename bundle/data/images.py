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
them (:func:`pil_as_displayed`); one of several pages is refused (:func:`check_picture`). Every file's header is
checked before a pixel is decoded (:func:`check_file`): a header that its format's reader cannot read, or that
declares more pixels or voxels than an X-ray or a CT has, is refused naming the file.
"""

from __future__ import annotations

import glob
import math
import os
import warnings
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import monai.transforms
import numpy as np
import torch
from bundle.data.annotations import visible_files
from bundle.data.datalist import configuration_hint
from bundle.data.dicom import (
    XRayDicomd,
    is_dicom_file,
    plane_affine,
    series_files,
    series_folders,
    several_series_message,
)
from bundle.data.nifti import nifti_header_problems
from bundle.io_utils import error_summary
from monai.config import KeysCollection
from monai.data import MetaTensor, PILReader
from monai.transforms import EnsureChannelFirst, LoadImage, MapTransform, ScaleIntensity
from PIL import Image as PILImage
from PIL import ImageMode as PILImageMode
from PIL import ImageOps as PILImageOps

# an image smaller than this along an axis is refused (2D: the coarsest output stride, 16; 3D: raw voxels before
# resampling, where a single slice is no volume)
MIN_IMAGE_SIZE = {2: 16, 3: 2}
# below this standard deviation on [0, 1] after the CT window, a volume is warned about as nearly constant
MIN_WINDOWED_SPREAD = 0.01
# a 2D image whose 1st to 99th percentile spans less than this share of its min to max is warned about
MIN_CONTRAST_SHARE = 0.1


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


# a 2D picture (PNG, JPEG, BMP, TIFF) of more pixels than this is refused from its header, before it is decoded:
# radiographs have at most some 20 million; a 12000 x 12000 blank PNG decodes to 0.6 GB of floats
MAX_PICTURE_PIXELS = 50_000_000
# ... and one whose pixels decode (as PIL stores them: its mode's bands and bytes) to more bytes than this: a 16-bit
# picture at the pixel cap; an RGB or RGBA one at 2/3 or 1/2 of it, still over any radiograph's 20 million
MAX_PICTURE_BYTES = 2 * MAX_PICTURE_PIXELS
# a volume (MetaImage, NRRD, NIfTI, DICOM) of more values (voxels times components) than this is refused from its
# header, before it is read: a CT is some 512 x 512 x 1000 (262 million voxels, 1 GB as float32); 512 x 512 x 2048
# (the pipeline's float32 copy: 2 GiB) leaves a long thin-slice CT room, and the network only ever sees a volume
# resampled to its grid
MAX_VOLUME_VOXELS = 512 * 512 * 2048
# ... and one whose data, as stored (values times the bytes of its type: a float64 volume at the voxel cap decodes to
# 4 GiB before its float32 copy), holds more bytes than this: a 512 x 512 x 2000 int16 CT holds 1 GiB, a float32 one
# just under 2 GiB
MAX_VOLUME_BYTES = 2**31


def check_file(path: Any) -> None:
    """Refuse (:class:`ImageError`) what :func:`check_picture` refuses in a picture that PIL reads, else what
    :func:`check_volume` refuses: every file's header is checked before a pixel of it is decoded."""
    if not check_picture(path):
        check_volume(path)


def check_picture(path: Any, max_pixels: int = MAX_PICTURE_PIXELS) -> bool:
    """Refuse (:class:`ImageError`) a picture file whose header PIL refuses or cannot read (more than 179 million
    pixels: PIL's ``DecompressionBombError``), gives more than ``max_pixels`` pixels or :data:`MAX_PICTURE_BYTES`
    bytes (:func:`check_size`), or several pages (a multi-page TIFF, an animation: a reader would take the first and
    drop the others without a word; a camera's MPO JPEG, a picture with its previews, is read as its main picture).
    Returns whether PIL reads ``path`` as a picture; other files (DICOM, NIfTI, MetaImage) are left to
    :func:`check_volume`."""
    if not isinstance(path, (str, os.PathLike)) or not Path(path).is_file():
        return False
    try:
        with PILImage.open(path) as picture:
            width, height = picture.size
            mode = PILImageMode.getmode(picture.mode)
            pages = getattr(picture, "n_frames", 1) if picture.format != "MPO" else 1
    except PILImage.UnidentifiedImageError:
        return False
    except PILImage.DecompressionBombError as e:
        raise ImageError(
            f"{path}: more than the {max_pixels:,} pixels an X-ray picture may have, refused before decoding it "
            f"(PIL: {e})"
        ) from None  # the message holds the cause: callers that report a chain's root (the MONAI Label app) show it
    except Exception as e:
        raise ImageError(
            f"{path}: picture header unreadable (refused before decoding it): {error_summary(e)}"
        ) from None
    if pages > 1:
        raise ImageError(
            f"{path}: a picture of {pages} pages (a multi-page TIFF or an animation): only one image per file can be "
            "read; save the page to use as a file of its own"
        )
    check_size(path, (width, height), len(mode.bands), np.dtype(mode.typestr), max_pixels)
    return True


def check_size(
    path: Any, shape: Sequence[int], components: int, dtype: np.dtype, max_pixels: int = MAX_PICTURE_PIXELS
) -> None:
    """Refuse (:class:`ImageError`) an image whose header gives the spatial ``shape`` and ``components`` per voxel
    of ``dtype`` (as stored): a picture (one slice) of more than ``max_pixels`` pixels or
    :data:`MAX_PICTURE_BYTES` bytes, a volume of more than :data:`MAX_VOLUME_VOXELS` values or
    :data:`MAX_VOLUME_BYTES` bytes."""
    count = math.prod(shape)
    values = count * components
    stored = values * dtype.itemsize
    kind = f"{components} {dtype} components" if components > 1 else dtype
    if math.prod(shape[2:]) == 1:
        pixels = " x ".join(map(str, shape[:2]))
        if count > max_pixels:
            raise ImageError(
                f"{path}: {pixels} pixels, more than the {max_pixels:,} an X-ray picture may have (refused before "
                "decoding it)"
            )
        if stored > MAX_PICTURE_BYTES:
            raise ImageError(
                f"{path}: {pixels} pixels of {kind} ({stored:,} bytes), more than the {MAX_PICTURE_BYTES:,} bytes an "
                "X-ray picture may hold (refused before decoding it)"
            )
        return
    dims = " x ".join(map(str, shape))
    if values > MAX_VOLUME_VOXELS:
        per_voxel = f" of {components} components" if components > 1 else ""
        raise ImageError(
            f"{path}: {dims} voxels{per_voxel} ({values:,}), more than the {MAX_VOLUME_VOXELS:,} a volume may have (a "
            "CT has some 512 x 512 x 1000; refused before reading it)"
        )
    if stored > MAX_VOLUME_BYTES:
        raise ImageError(
            f"{path}: {dims} voxels of {kind} ({stored:,} bytes), more than the {MAX_VOLUME_BYTES:,} bytes a volume "
            "may hold (a 512 x 512 x 2000 int16 CT holds 1 GiB; refused before reading it)"
        )


def header_layout(path: Path, series: Sequence[Sequence[str]] = ()) -> tuple[tuple[int, ...], int, np.dtype] | None:
    """The spatial shape, components per voxel and their type as stored that the header of ``path`` gives, no pixel
    read, as the readers after PIL's in :class:`LoadImaged` read it: nibabel for NIfTI (its shape and data type), else
    ITK (MetaImage, NRRD, DICOM, pictures PIL does not read; a folder: its one DICOM ``series``, the first file's
    header times the files). None for a file no ITK reader takes; a header that these readers take but cannot read
    raises :class:`ImageError` naming the file."""
    import nibabel as nib
    import SimpleITK as sitk  # noqa: N813

    if path.is_dir():
        if len(series) != 1:
            return None
        first = header_layout(Path(series[0][0]))
        if first is None:
            return None
        shape, components, dtype = first
        return (*shape[:2], math.prod(shape[2:]) * len(series[0])), components, dtype
    if path.name.lower().endswith((".nii", ".nii.gz")):
        try:
            header = nib.load(str(path)).header
            return tuple(int(n) for n in header.get_data_shape()), 1, header.get_data_dtype()
        except Exception:
            pass  # MONAI's readers go on to ITK's
    reader = sitk.ImageFileReader()
    image_io = reader.GetImageIOFromFileName(str(path))
    if not image_io:
        return None
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError as e:  # ITK's message: where it was thrown, then what it says
        itk_message = " ".join(line.strip() for line in str(e).strip().splitlines()[1:])
        raise ImageError(
            f"cannot read image {path}: unreadable header ({image_io}), refused before reading it: {itk_message}"
        ) from None
    components = reader.GetNumberOfComponents()
    # the component type: that of a one-voxel image of the header's pixel type, as SimpleITK gives it to numpy
    dtype = sitk.GetArrayViewFromImage(sitk.Image([1, 1], reader.GetPixelID(), components)).dtype
    return tuple(int(n) for n in reader.GetSize()), components, dtype


# the header keys naming a MetaImage's / an NRRD's pixel data when it is kept in a file of its own
_DATA_FILE_KEYS = {(".mha", ".mhd"): ("elementdatafile", "="), (".nrrd", ".nhdr"): ("data file", "datafile", ":")}


def detached_data_file(path: Path) -> str | None:
    """The pixel data file that the header of a MetaImage (``ElementDataFile``) or NRRD (``data file``) file names,
    None for data kept in the file itself (``LOCAL``, or no such key) and for other files."""
    found = [spec for suffixes, spec in _DATA_FILE_KEYS.items() if path.name.lower().endswith(suffixes)]
    if not found:
        return None
    *keys, separator = found[0]
    with path.open("rb") as f:
        head = f.read(65536).decode("latin-1")
    for line in head.splitlines():
        if separator == ":" and not line.strip():
            return None  # an NRRD header ends at its first blank line
        key, found, value = line.partition(separator)
        if found and key.strip().lower() in keys:
            value = value.strip()
            return None if value.upper() == "LOCAL" else value
    return None


def check_data_file(path: Path) -> None:
    """Refuse (:class:`ImageError`) a MetaImage or NRRD header whose pixel data file (:func:`detached_data_file`)
    is not one file beside it: an absolute path, a folder up, a link or a list of files would have another folder's
    file (any file the process can read, a device) read as the image's pixels."""
    name = detached_data_file(path)
    if name is None:
        return
    beside = path.parent / name
    if len(name.split()) > 1 or Path(name).name != name or name in (".", "..") or beside.is_symlink():
        raise ImageError(
            f"{path}: its header reads the pixel data from {name!r}, not one file beside it (refused before reading "
            "it): keep the data in the file (ElementDataFile = LOCAL, or a .nrrd / .mha of one file)"
        )


def check_volume(path: Any) -> None:
    """Refuse (:class:`ImageError`) or warn about a volume that MONAI's readers would read otherwise than 3D Slicer
    and ITK show it, or that its header makes too large (:func:`header_layout`, :func:`check_size`), before reading
    it: a folder of several DICOM series (:func:`bundle.data.dicom.several_series_message`: the reader would read
    one, or a part of a split series), and what :func:`bundle.data.nifti.nifti_header_problems` finds in a NIfTI
    file. Files no reader's header takes are left to the readers."""
    if not isinstance(path, (str, os.PathLike)):
        return
    path = Path(path)
    if path.is_dir():
        series = series_files(path)
        message = several_series_message(path, series)
        if message:
            raise ImageError(message)
        layout = header_layout(path, series)
        if layout is not None:
            check_size(path, *layout)
        return
    if not path.is_file():
        return
    check_data_file(path)
    layout = header_layout(path)
    if layout is not None:
        check_size(path, *layout)
    refusal, warning = nifti_header_problems(path)
    if refusal:
        raise ImageError(refusal)
    if warning:
        warnings.warn(warning, stacklevel=2)


class LoadImaged(monai.transforms.LoadImaged):
    """MONAI's ``LoadImaged``; a file it cannot read raises :class:`ImageError` naming the file. PNG, JPEG and BMP
    files are read as a viewer shows them (:func:`pil_as_displayed`)."""

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


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")


def _is_pattern(path: Path) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than a file or folder of that name."""
    return glob.has_magic(str(path)) and not path.exists()


def image_items(
    images: str | Sequence[str] | None, dataset_dir: str | os.PathLike, spatial_dims: int = 2
) -> list[dict]:
    """Datalist-style items ``{"image": path}`` of ``images`` (a path, a glob pattern such as ``scans/*.png``, or a
    list of them: files, or DICOM series folders; a pattern's matches sorted), or, when None or empty, of what
    ``dataset_dir`` holds (sorted; none when it does not exist, so that the config builds without data:
    :func:`require_items` then fails at run time): in 2D every image file directly in it; in 3D ``dataset_dir``
    itself when it holds DICOM files (the slices of one series, not volumes of their own), then every sub-folder
    holding DICOM files (a series each), then every volume file directly in it."""
    if isinstance(images, (str, os.PathLike)):
        text = str(images).strip()
        if text.startswith("[") and text.endswith("]") and not Path(text).is_file():
            raise FileNotFoundError(
                f"images: {text!r} is neither a file nor a list the command line could read: quote each name inside "
                """the list, --images "['a.png','b.png']" (a name holding ' inside \\": --images "[\\"it's.png\\"]")"""
            )
        images = [images]
    if images:
        paths = [Path(os.path.expanduser(str(p))) for p in images]
        unmatched = [str(p) for p in paths if _is_pattern(p) and not glob.glob(str(p))]
        if unmatched:
            raise FileNotFoundError(f"images: no file matches {unmatched}")
        paths = [m for p in paths for m in (sorted(map(Path, glob.glob(str(p)))) if _is_pattern(p) else [p])]
        missing = [str(p) for p in paths if not (p.is_file() or p.is_dir())]
        if missing:
            raise FileNotFoundError(f"images not found: {missing}")
        return [{"image": str(p)} for p in paths]
    folder = Path(dataset_dir)
    if not folder.is_dir():
        return []
    if spatial_dims == 2:
        return [{"image": str(p)} for p in visible_files(folder) if p.name.lower().endswith(IMAGE_SUFFIXES)]
    listed = visible_files(folder)
    slices = {p for p in listed if is_dicom_file(p)}  # each file's preamble read once
    volumes = [p for p in listed if p.name.lower().endswith(IMAGE_SUFFIXES) and p not in slices]
    return [{"image": str(p)} for p in ([folder] if slices else []) + series_folders(folder) + volumes]


def require_items(items: Sequence[Any], dataset_dir: str | os.PathLike, spatial_dims: int = 2) -> None:
    """Raise FileNotFoundError (naming ``dataset_dir``) when there is no image to run on; in 2D, one that names
    configs/inference_3d.yaml when ``dataset_dir`` holds DICOM series folders."""
    if len(items) > 0:
        return
    folder = Path(dataset_dir)
    if spatial_dims == 2 and folder.is_dir() and series_folders(folder):
        raise FileNotFoundError(
            f"nothing to run on: dataset_dir {dataset_dir} holds DICOM series folders (volumes), which the 2D command "
            "does not read: merge configs/inference_3d.yaml after configs/inference.yaml"
        )
    raise FileNotFoundError(
        f"nothing to run on: no --images given and dataset_dir {dataset_dir} holds no image file "
        f"({', '.join(IMAGE_SUFFIXES)}) and, for volumes, no DICOM series folder; pass --images \"['a.png', ...]\" "
        "or --dataset_dir FOLDER"
    )
