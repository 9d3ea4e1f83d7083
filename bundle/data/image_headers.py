"""Image files checked from their headers before a pixel is decoded: too many pixels or voxels, several pages, a
folder of several DICOM series, a pixel data file that is not beside its header, what NIfTI headers get wrong
(:func:`check_file`, the first step of reading every image)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from bundle.data.dicom import series_files, several_series_message
from bundle.data.nifti import nifti_header_problems
from bundle.io_utils import error_summary
from PIL import Image as PILImage
from PIL import ImageMode as PILImageMode


class ImageError(ValueError):
    """An image that cannot be used; the message names the file and what is wrong with it."""


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
