"""DICOM X-rays (2D) and CT series (3D): what MONAI's ITK reader leaves to do, and DICOM datalists.

Pixels are read by MONAI's ``LoadImaged`` with its default DICOM reader, ``ITKReader`` (ITK's GDCM
image IO, a pinned dependency): it masks the bits above Bits Stored (0028,0101), sign-extends signed
data, applies the modality rescale (Rescale Slope / Intercept, 0028,1053 / 0028,1052), reads a folder as
one CT series (slices sorted along their normal, direction from Image Orientation (Patient)) and puts
every header element in the image's meta dictionary as ``"gggg|eeee": "text"``. Two things it does not
do the way the 2D landmark pipeline needs, and ``XRayDicomd`` does them right after ``LoadImaged``:

- a single-frame X-ray comes back as a ``W x H x 1`` volume: the singleton axis is dropped (a file with
  several frames is refused, naming the file and its frame count);
- ITK's pixel spacing of a DX / CR / IO file is unreliable (it reads Imager Pixel Spacing only, or
  nothing): the spacing is set from the header here, Pixel Spacing (0028,0030) first, else Imager
  Pixel Spacing (0018,1164) divided by Estimated Radiographic Magnification Factor (0018,1114) where
  that is present. Both tags are ``row spacing \\ column spacing``; the meta ``spacing`` is ``[x, y]``
  (column, row), the order of the datalist's landmarks and ``spacing``, which still overrides it;
- a VOI window (Window Center / Width, 0028,1050 / 0028,1051, the first pair, with VOI LUT Function
  0028,1056: LINEAR, LINEAR_EXACT or SIGMOID) is applied to the modality values, giving [0, 1];
- MONOCHROME1 (0028,0004; low values bright) ends as MONOCHROME2. GDCM has already inverted the stored
  values within Bits Stored (``2**bits - 1 - stored``) before the rescale; ``XRayDicomd`` recovers the
  modality values from that to apply the window, then inverts the windowed values (``1 - v``).

Landmarks stay in the file's pixel coordinates: ``[x, y]`` = (column, row), as ``LoadImaged`` indexes
every 2D image ``[x, y]``. Images that are not DICOM pass through ``XRayDicomd`` unchanged.

``dicom_xray_datalist`` and ``dicom_series_datalist`` build datalists from a folder of X-ray files (with
a landmark CSV) or of CT series folders (with 3D Slicer markups); ``python -m scripts.prepare_data dicom``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.data.annotations import natural_key, visible_files
from bundle.data.datalist import DatalistError, unsplit_datalist
from bundle.data.hand_csv import read_landmark_csv
from bundle.data.markups import MARKUPS_SUFFIXES, names_of_labels, read_markups
from bundle.data.nifti import find_markups, markups_landmarks, points_outside, warn_outside
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import LoadImage, MapTransform

_TAG = re.compile(r"^[0-9a-fA-F]{4}\|[0-9a-fA-F]{4}$")

PHOTOMETRIC = "0028|0004"
NUMBER_OF_FRAMES = "0028|0008"
SAMPLES_PER_PIXEL = "0028|0002"
BITS_STORED = "0028|0101"
PIXEL_REPRESENTATION = "0028|0103"
PIXEL_SPACING = "0028|0030"
IMAGER_PIXEL_SPACING = "0018|1164"
MAGNIFICATION = "0018|1114"
WINDOW_CENTER = "0028|1050"
WINDOW_WIDTH = "0028|1051"
VOI_LUT_FUNCTION = "0028|1056"
RESCALE_INTERCEPT = "0028|1052"
RESCALE_SLOPE = "0028|1053"
VOI_LUT_SEQUENCE = "0028|3010"
SERIES_INSTANCE_UID = "0020|000e"

TAG_NAMES = {
    PHOTOMETRIC: "PhotometricInterpretation",
    NUMBER_OF_FRAMES: "NumberOfFrames",
    SAMPLES_PER_PIXEL: "SamplesPerPixel",
    BITS_STORED: "BitsStored",
    PIXEL_REPRESENTATION: "PixelRepresentation",
    PIXEL_SPACING: "PixelSpacing",
    IMAGER_PIXEL_SPACING: "ImagerPixelSpacing",
    MAGNIFICATION: "EstimatedRadiographicMagnificationFactor",
    WINDOW_CENTER: "WindowCenter",
    WINDOW_WIDTH: "WindowWidth",
    VOI_LUT_FUNCTION: "VOILUTFunction",
    RESCALE_INTERCEPT: "RescaleIntercept",
    RESCALE_SLOPE: "RescaleSlope",
}


class DicomError(DatalistError):
    """A DICOM file the bundle cannot use; the message names the file and the tag at fault."""


def is_dicom_file(path: str | Path) -> bool:
    """True when ``path`` is a file with the DICOM preamble (``DICM`` at byte 128), whatever its suffix."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:] == b"DICM"


def dicom_tags(meta: Mapping) -> dict[str, str]:
    """The DICOM elements of an ITK meta dictionary, ``{"gggg|eeee": stripped text}`` (lower-case tags)."""
    return {
        k.lower(): str(v).strip().strip("\x00").strip() for k, v in meta.items() if isinstance(k, str) and _TAG.match(k)
    }


def _tag(tag: str) -> str:
    return f"{TAG_NAMES.get(tag, 'tag')} ({tag.replace('|', ',')})"


def _numbers(tags: Mapping[str, str], tag: str, where: str, count: int | None = None) -> list[float] | None:
    """The numbers of a multi-valued decimal/integer element (``a\\b``), None when absent or empty."""
    text = tags.get(tag, "")
    if not text:
        return None
    try:
        values = [float(v) for v in text.split("\\")]
    except ValueError:
        raise DicomError(f"{where}: {_tag(tag)} is not numeric: {text!r}") from None
    if count is not None and len(values) != count:
        raise DicomError(f"{where}: {_tag(tag)} must hold {count} values, got {text!r}")
    if not all(np.isfinite(values)):
        raise DicomError(f"{where}: {_tag(tag)} is not finite: {text!r}")
    return values


def header_spacing(tags: Mapping[str, str], where: str = "DICOM file") -> list[float] | None:
    """Pixel spacing ``[x, y]`` (mm per column, per row) of an X-ray header, None when it gives none.

    Pixel Spacing (0028,0030) when present, else Imager Pixel Spacing (0018,1164) divided by Estimated
    Radiographic Magnification Factor (0018,1114) when that is present (the detector plane's spacing
    brought back to the patient's). Both tags hold ``row spacing \\ column spacing``.

    Raises:
        DicomError: a present tag that is not two positive numbers (or a magnification <= 0), naming ``where``.
    """
    for tag in (PIXEL_SPACING, IMAGER_PIXEL_SPACING):
        values = _numbers(tags, tag, where, count=2)
        if values is None:
            continue
        if min(values) <= 0:
            raise DicomError(f"{where}: {_tag(tag)} must be two positive numbers, got {tags[tag]!r}")
        row, column = values
        if tag == IMAGER_PIXEL_SPACING:
            factor = _numbers(tags, MAGNIFICATION, where, count=1)
            if factor is not None:
                if factor[0] <= 0:
                    raise DicomError(f"{where}: {_tag(MAGNIFICATION)} must be positive, got {tags[MAGNIFICATION]!r}")
                row, column = row / factor[0], column / factor[0]
        return [column, row]
    return None


def voi_window(values: np.ndarray, center: float, width: float, function: str = "LINEAR") -> np.ndarray:
    """DICOM VOI window (PS3.3 C.11.2.1.2) of modality ``values``, output in [0, 1].

    ``LINEAR``: 0 below ``c - 0.5 - (w - 1) / 2``, 1 above ``c - 0.5 + (w - 1) / 2``, linear between
    (``((x - (c - 0.5)) / (w - 1) + 0.5)``); ``LINEAR_EXACT``: ``(x - c) / w + 0.5`` clipped;
    ``SIGMOID``: ``1 / (1 + exp(-4 (x - c) / w))``.
    """
    x = np.asarray(values, dtype=np.float64)
    if function == "LINEAR":
        if width < 1:
            raise ValueError(f"a LINEAR VOI window needs a width >= 1, got {width}")
        if width == 1:
            return (x > center - 0.5).astype(np.float64)
        return np.clip((x - (center - 0.5)) / (width - 1) + 0.5, 0.0, 1.0)
    if width <= 0:
        raise ValueError(f"a {function} VOI window needs a width > 0, got {width}")
    if function == "LINEAR_EXACT":
        return np.clip((x - center) / width + 0.5, 0.0, 1.0)
    if function == "SIGMOID":
        return 1.0 / (1.0 + np.exp(-4.0 * (x - center) / width))
    raise ValueError(f"unknown VOI LUT function {function!r} (LINEAR, LINEAR_EXACT or SIGMOID)")


def xray_intensities(
    values: np.ndarray, tags: Mapping[str, str], where: str = "DICOM file", apply_window: bool = True
) -> np.ndarray:
    """MONOCHROME2 presentation values of the pixels ITK (GDCM) read from an X-ray file (see the module doc).

    ``values`` are GDCM's output: bits above Bits Stored masked, the modality rescale applied, and for
    MONOCHROME1 the stored values already inverted within Bits Stored. With a VOI window in the header
    (and ``apply_window``) the result is the window's output in [0, 1], inverted for MONOCHROME1; without
    one it is the modality values (MONOCHROME2) or ``values`` as GDCM inverted them (MONOCHROME1), for
    ``ScaleIntensityd`` to bring to [0, 1].

    Raises:
        DicomError: a photometric interpretation other than MONOCHROME1/2, a signed MONOCHROME1 image, a
            malformed rescale, window or VOI LUT function tag, naming ``where`` and the tag.
    """
    photometric = tags.get(PHOTOMETRIC, "MONOCHROME2").upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DicomError(
            f"{where}: {_tag(PHOTOMETRIC)} is {photometric!r}; "
            "a greyscale X-ray (MONOCHROME1 or MONOCHROME2) is expected"
        )
    x = np.asarray(values, dtype=np.float64)
    centers = _numbers(tags, WINDOW_CENTER, where)
    widths = _numbers(tags, WINDOW_WIDTH, where)
    window = apply_window and centers is not None and widths is not None
    if not window and apply_window and tags.get(VOI_LUT_SEQUENCE) is not None:
        warnings.warn(
            f"{where}: a VOI LUT Sequence (0028,3010) without a window is not applied; the full range is used",
            stacklevel=2,
        )
    if not window:  # MONOCHROME1: GDCM's inversion is MONOCHROME2 already (up to an offset ScaleIntensityd removes)
        return x
    if photometric == "MONOCHROME1":
        if (_numbers(tags, PIXEL_REPRESENTATION, where, 1) or [0.0])[0] != 0:
            raise DicomError(f"{where}: signed {_tag(PIXEL_REPRESENTATION)} MONOCHROME1 images are not supported")
        bits = (_numbers(tags, BITS_STORED, where, 1) or [0.0])[0]
        if not 1 <= bits <= 32:
            raise DicomError(
                f"{where}: {_tag(BITS_STORED)} must be 1..32 for MONOCHROME1, got {tags.get(BITS_STORED)!r}"
            )
        slope = (_numbers(tags, RESCALE_SLOPE, where, 1) or [1.0])[0]
        intercept = (_numbers(tags, RESCALE_INTERCEPT, where, 1) or [0.0])[0]
        # GDCM gave slope * (2**bits - 1 - stored) + intercept; the modality value is slope * stored + intercept
        x = slope * (2.0**bits - 1.0) + 2.0 * intercept - x
    function = tags.get(VOI_LUT_FUNCTION, "").upper() or "LINEAR"
    try:
        out = voi_window(x, centers[0], widths[0], function)
    except ValueError as e:
        raise DicomError(
            f"{where}: {_tag(WINDOW_CENTER)} / {_tag(WINDOW_WIDTH)} / {_tag(VOI_LUT_FUNCTION)}: {e}"
        ) from None
    return 1.0 - out if photometric == "MONOCHROME1" else out


class XRayDicomd(MapTransform):
    """Make a DICOM X-ray read by ``LoadImaged`` (ITKReader) a 2D image (see the module doc); others pass.

    Place it right after ``LoadImaged`` (before ``EnsureChannelFirstd``). For a DICOM image it:
    drops the singleton frame axis (``W x H x 1`` -> ``W x H``; several frames or samples per pixel are
    refused), sets the meta ``spacing`` to the header's ``[x, y]`` (removed when the header has none,
    so that ``LandmarkTargetsd`` warns instead of using ITK's 1.0), applies the VOI window and turns
    MONOCHROME1 into MONOCHROME2 (``xray_intensities``), and records ``dicom_photometric`` in the meta.

    Args:
        keys: the image key(s).
        apply_window: apply the header's VOI window (False: the full modality range, min-max later).
        allow_missing_keys: MONAI's flag.

    Raises:
        DicomError: naming the file and tag at fault; also for a DICOM file that was not read by ITKReader
            (no ``gggg|eeee`` tags in its meta: ``MONAI_DICOM_READER`` chose another reader).
    """

    def __init__(self, keys: KeysCollection, apply_window: bool = True, allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)
        self.apply_window = apply_window

    def convert(self, image: torch.Tensor) -> torch.Tensor:
        """The 2D MONOCHROME2 image of one loaded DICOM X-ray; a non-DICOM image unchanged."""
        if not isinstance(image, MetaTensor):
            return image
        where = str(image.meta.get("filename_or_obj", "image"))
        tags = dicom_tags(image.meta)
        if PHOTOMETRIC not in tags and "0008|0016" not in tags:
            if Path(where).is_file() and is_dicom_file(where):
                raise DicomError(
                    f"{where}: a DICOM file read without its header tags; load it with MONAI's ITKReader "
                    "(unset MONAI_DICOM_READER)"
                )
            return image
        frames = _numbers(tags, NUMBER_OF_FRAMES, where, 1)
        shape = tuple(image.shape)
        if (frames is not None and frames[0] > 1) or (len(shape) == 3 and shape[2] != 1):
            n = int(frames[0]) if frames is not None else shape[2]
            raise DicomError(
                f"{where}: {n} frames ({_tag(NUMBER_OF_FRAMES)}, image {'x'.join(map(str, shape))}); "
                "one single-frame 2D X-ray is expected (a CT volume belongs in the 3D configs, as a series folder)"
            )
        samples = _numbers(tags, SAMPLES_PER_PIXEL, where, 1)
        if (samples is not None and samples[0] != 1) or len(shape) not in (2, 3):
            raise DicomError(
                f"{where}: {_tag(SAMPLES_PER_PIXEL)} {tags.get(SAMPLES_PER_PIXEL)}, image {shape}; "
                "a greyscale X-ray is expected"
            )
        plane = image.as_tensor().reshape(shape[:2]).numpy()
        pixels = xray_intensities(plane, tags, where, self.apply_window).astype(np.float32)

        meta = dict(image.meta)
        spacing = header_spacing(tags, where)
        affine2d = plane_affine(image.affine)
        if spacing is not None:  # ITK's column lengths are not the header's: rescale the direction columns
            lengths = np.linalg.norm(affine2d[:2, :2], axis=0)
            affine2d[:2, :2] = affine2d[:2, :2] / np.where(lengths > 0, lengths, 1.0) * np.asarray(spacing)
            meta["spacing"] = np.asarray(spacing, dtype=np.float64)
        else:
            meta.pop("spacing", None)
        meta["spatial_shape"] = np.asarray(shape[:2])
        meta["original_affine"] = affine2d.copy()
        meta["dicom_photometric"] = tags.get(PHOTOMETRIC, "MONOCHROME2").upper()
        meta.pop("affine", None)
        return MetaTensor(torch.from_numpy(pixels), affine=torch.as_tensor(affine2d), meta=meta)

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            d[key] = self.convert(d[key])
        return d


# ---- datalists from DICOM files and series ----


def plane_affine(affine) -> np.ndarray:
    """The ``(3, 3)`` x, y part of a homogeneous ``(4, 4)`` affine (the slice axis dropped)."""
    affine = np.asarray(affine, dtype=np.float64)
    keep = [0, 1, affine.shape[0] - 1]
    return affine[np.ix_(keep, keep)]


def read_header(path: str | Path) -> dict[str, str]:
    """The DICOM elements of one file (SimpleITK / GDCM, pixels not read), as ``dicom_tags`` gives them."""
    import SimpleITK as sitk  # noqa: N813

    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    reader.SetImageIO("GDCMImageIO")
    try:
        reader.ReadImageInformation()
    except RuntimeError as e:
        raise DicomError(
            f"{path}: unreadable DICOM file: truncated, or not DICOM ({str(e).strip().splitlines()[-1]})"
        ) from e
    return dicom_tags({k: reader.GetMetaData(k) for k in reader.GetMetaDataKeys()})


def find_dicom_files(folder: Path) -> dict[str, Path]:
    """DICOM files of ``folder`` (by preamble, any suffix) by name without a ``.dcm`` / ``.dicom`` suffix."""
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not is_dicom_file(path):
            continue
        stem = path.name[: -len(path.suffix)] if path.suffix.lower() in (".dcm", ".dicom") else path.name
        if stem in found:
            raise DicomError(f"two DICOM files share the id {stem!r}: {found[stem]} and {path}")
        found[stem] = path.absolute()
    return found


def check_single_frame(path: Path, tags: Mapping[str, str]) -> None:
    """Refuse a multi-frame or non-greyscale X-ray file, naming it."""
    frames = _numbers(tags, NUMBER_OF_FRAMES, str(path), 1)
    if frames is not None and frames[0] > 1:
        raise DicomError(
            f"{path}: {int(frames[0])} frames ({_tag(NUMBER_OF_FRAMES)}); one single-frame 2D X-ray is expected"
        )
    photometric = tags.get(PHOTOMETRIC, "MONOCHROME2").upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DicomError(f"{path}: {_tag(PHOTOMETRIC)} is {photometric!r}; a greyscale X-ray is expected")


def dicom_xray_datalist(
    root: str | Path,
    csv_path: str | Path | None = None,
    spacing: Sequence[float] | None = None,
    landmark_names: Sequence[str] | None = None,
    name: str | None = None,
) -> dict:
    """2D datalist of the single-frame DICOM X-rays in ``root`` (any suffix), all in ``training``.

    Landmarks come from ``csv_path`` (rows ``id, x1, y1, ..., xN, yN`` in pixels, x = column, the id the
    file name without ``.dcm``), as the hand layout's CSV. Items carry no ``spacing``: the header gives it
    at load time; ``spacing`` is written only for files whose header has none (else a warning).
    """

    root = Path(root)
    if not root.is_dir():
        raise DatalistError(f"DICOM folder not found: {root}")
    files = find_dicom_files(root)
    if not files:
        raise DatalistError(f"{root}: no DICOM files (files with the DICM preamble)")
    rows = read_landmark_csv(csv_path) if csv_path is not None else {}
    n_landmarks = next(iter(rows.values())).shape[0] if rows else 0
    names = [f"l{j + 1}" for j in range(n_landmarks)] if landmark_names is None else [str(n) for n in landmark_names]
    if rows and len(names) != n_landmarks:
        raise DatalistError(f"{len(names)} landmark names given for the {n_landmarks} landmarks of {csv_path}")
    if not names:
        raise DatalistError(f"{root}: give a landmark CSV (--csv) or the landmark names (--landmark_names)")
    for image_id in sorted(set(rows) - set(files)):
        warnings.warn(f"{csv_path}: id {image_id!r} has no DICOM file in {root}: row left out", stacklevel=2)
    items, no_spacing = [], []
    for image_id, path in files.items():
        tags = read_header(path)
        check_single_frame(path, tags)
        item: dict = {"image": str(path)}
        if image_id in rows:
            item["landmarks"] = rows[image_id].tolist()
        elif rows:
            warnings.warn(f"{path}: no row with id {image_id!r} in {csv_path}: kept without landmarks", stacklevel=2)
        if header_spacing(tags, str(path)) is None:
            if spacing is not None:
                item["spacing"] = [float(v) for v in spacing]
            else:
                no_spacing.append(path)
        items.append(item)
    if no_spacing:
        warnings.warn(
            f"{len(no_spacing)} DICOM files carry neither PixelSpacing nor ImagerPixelSpacing and no spacing was "
            f"given (first: {no_spacing[0]}): errors can only be measured in pixels",
            stacklevel=2,
        )
    return unsplit_datalist(name or root.name, 2, names, items)


def series_files(folder: Path) -> list[tuple[str, ...]]:
    """The files of each DICOM series in ``folder`` as MONAI's reader groups its slices (``monai.data.ITKReader``: by
    Series Instance UID, Series Date and GDCM's series details, such as slice thickness and size), so that a series
    the reader would read in parts counts as several."""
    import itk

    names = itk.GDCMSeriesFileNames.New()
    names.SetUseSeriesDetails(True)
    names.AddSeriesRestriction("0008|0021")
    names.SetGlobalWarningDisplay(False)
    names.SetDirectory(str(folder))
    return [tuple(names.GetFileNames(uid)) for uid in names.GetSeriesUIDs()]


def holds_dicom_files(folder: Path) -> bool:
    """True when a visible file of ``folder`` is DICOM (by its preamble, any suffix)."""
    return any(is_dicom_file(path) for path in visible_files(folder))


def series_folders(root: Path) -> list[Path]:
    """The visible sub-folders of ``root`` holding DICOM files (a series each), sorted."""
    return [p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".") and holds_dicom_files(p)]


def several_series_message(folder: Path, series: Sequence[Sequence[str]] | None = None) -> str | None:
    """What is wrong with ``folder`` when it holds more than one DICOM series (``series``, default
    :func:`series_files`: a reader would read one of them, or a part of a split series, as the volume); None
    otherwise."""
    count = len(series_files(folder) if series is None else series)
    if count <= 1:
        return None
    return (
        f"{folder}: {count} DICOM series in one folder, as the reader groups the slices (by series, series date, "
        "slice thickness and size); it would read one of them as the volume: keep the slices of one volume alone in "
        "a folder"
    )


def series_geometry(folder: Path) -> tuple[np.ndarray, tuple[int, ...]]:
    """The voxel-to-RAS affine and the shape of the volume that MONAI's reader makes of the series in ``folder``."""
    image = LoadImage(image_only=True)(str(folder))
    return np.asarray(image.affine, dtype=np.float64), tuple(int(n) for n in image.shape[:3])


def dicom_series_datalist(
    root: str | Path,
    markups_dir: str | Path | None = None,
    landmark_names: Sequence[str] | None = None,
    name: str | None = None,
) -> dict:
    """3D datalist of the CT series folders ``root/X/`` (one series each) with markups ``X.fcsv`` / ``X.mrk.json``.

    ``markups_dir`` defaults to ``root``. Landmarks are world RAS mm, matched by label as for NIfTI
    volumes (``bundle.data.nifti``), and each outside the volume the reader makes of its series warned about
    (:func:`series_geometry`); a folder with several series, as the reader groups them, is refused
    (:func:`several_series_message`).
    """

    root = Path(root)
    if not root.is_dir():
        raise DatalistError(f"DICOM folder not found: {root}")
    folders = {}
    for folder in series_folders(root):
        message = several_series_message(folder)
        if message:
            raise DicomError(message)
        folders[folder.name] = folder.absolute()
    if not folders:
        raise DatalistError(f"{root}: no sub-folder holds a DICOM series")
    markups_dir = root if markups_dir is None else Path(markups_dir)
    files = find_markups(markups_dir)
    if not files:
        raise DatalistError(f"{markups_dir}: no markups files ({', '.join(MARKUPS_SUFFIXES)})")
    for stem in sorted(set(files) - set(folders), key=natural_key):
        warnings.warn(f"{files[stem]}: no series folder named {stem!r} in {root}: ignored", stacklevel=2)
    points = {stem: read_markups(files[stem]) for stem in folders if stem in files}
    names = names_of_labels(points, markups_dir) if landmark_names is None else [str(n) for n in landmark_names]
    if not names:
        raise DatalistError(f"{markups_dir}: the markups files hold no control points")
    items = []
    for stem in sorted(folders, key=natural_key):
        item: dict = {"image": str(folders[stem])}
        if stem in points:
            item["landmarks"] = markups_landmarks(files[stem], points[stem], names)
            affine, shape = series_geometry(folders[stem])
            outside = points_outside(affine, shape, item["landmarks"])
            warn_outside(files[stem], folders[stem], names, item["landmarks"], outside)
        else:
            warnings.warn(
                f"{folders[stem]}: no markups file {stem}.fcsv or {stem}.mrk.json: kept without landmarks", stacklevel=2
            )
        items.append(item)
    return unsplit_datalist(name or root.name, 3, names, items)
