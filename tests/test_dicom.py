"""DICOM X-rays (2D) and CT series (3D) through the bundle's configured load transforms, on files written here.

The files are written byte by byte by the small explicit-VR little-endian writer below (no DICOM library:
the code under test reads them with ITK / GDCM), from stored values chosen here; every expected number is
computed from those values and the DICOM rules in the test, not by the code under test.
"""

from __future__ import annotations

import csv
import json
import re
import struct
import uuid
import warnings
from pathlib import Path

import monai.data
import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch
from bundle.configs import bundle_parser, config_files
from bundle.data.datalist import load_datalist, save_datalist
from bundle.data.dicom import (
    DicomError,
    XRayDicomd,
    dicom_series_datalist,
    dicom_xray_datalist,
    header_spacing,
    read_header,
    voi_window,
)
from bundle.data.images import ImageError, load_grey, load_image
from bundle.data.images import LoadImaged as BundleLoadImaged
from bundle.data.markups import ControlPoint, write_markups
from bundle.data.synthetic import generate_synthetic_2d
from bundle.transforms.landmarks import LandmarkTargetsd
from monai.bundle import run
from monai.transforms import Compose, LoadImaged
from PIL import Image
from scripts import prepare_data

ROOT = Path(__file__).resolve().parents[1]
TRAIN_2D = config_files("train")
TRAIN_3D = config_files("train", spatial_dims=3)


# ---- a minimal DICOM writer (PS3.10 file, explicit VR little endian, uncompressed) ----

DX_STORAGE = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage - For Presentation
CT_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
EXPLICIT_LITTLE = "1.2.840.10008.1.2.1"
# keyword: (group, element, VR)
ELEMENTS = {
    "SOPClassUID": (0x0008, 0x0016, "UI"),
    "SOPInstanceUID": (0x0008, 0x0018, "UI"),
    "SeriesDate": (0x0008, 0x0021, "DA"),
    "Modality": (0x0008, 0x0060, "CS"),
    "PatientID": (0x0010, 0x0020, "LO"),
    "SliceThickness": (0x0018, 0x0050, "DS"),
    "EstimatedRadiographicMagnificationFactor": (0x0018, 0x1114, "DS"),
    "ImagerPixelSpacing": (0x0018, 0x1164, "DS"),
    "StudyInstanceUID": (0x0020, 0x000D, "UI"),
    "SeriesInstanceUID": (0x0020, 0x000E, "UI"),
    "InstanceNumber": (0x0020, 0x0013, "IS"),
    "ImagePositionPatient": (0x0020, 0x0032, "DS"),
    "ImageOrientationPatient": (0x0020, 0x0037, "DS"),
    "FrameOfReferenceUID": (0x0020, 0x0052, "UI"),
    "SamplesPerPixel": (0x0028, 0x0002, "US"),
    "PhotometricInterpretation": (0x0028, 0x0004, "CS"),
    "NumberOfFrames": (0x0028, 0x0008, "IS"),
    "Rows": (0x0028, 0x0010, "US"),
    "Columns": (0x0028, 0x0011, "US"),
    "PixelSpacing": (0x0028, 0x0030, "DS"),
    "BitsAllocated": (0x0028, 0x0100, "US"),
    "BitsStored": (0x0028, 0x0101, "US"),
    "HighBit": (0x0028, 0x0102, "US"),
    "PixelRepresentation": (0x0028, 0x0103, "US"),
    "WindowCenter": (0x0028, 0x1050, "DS"),
    "WindowWidth": (0x0028, 0x1051, "DS"),
    "RescaleIntercept": (0x0028, 0x1052, "DS"),
    "RescaleSlope": (0x0028, 0x1053, "DS"),
    "PixelData": (0x7FE0, 0x0010, "OW"),
}


def new_uid() -> str:
    return f"2.25.{uuid.uuid4().int}"


def _element(group: int, element: int, vr: str, value) -> bytes:
    if vr == "US":
        data = b"".join(struct.pack("<H", int(v)) for v in np.atleast_1d(value))
    elif vr in ("OW", "OB"):
        data = bytes(value)
    else:
        values = value if isinstance(value, (list, tuple, np.ndarray)) else [value]
        data = "\\".join(
            v if isinstance(v, str) else f"{float(v):.10g}" if vr == "DS" else str(v) for v in values
        ).encode()
    if len(data) % 2:
        data += b"\0" if vr in ("UI", "OB") else b" "
    if vr in ("OW", "OB"):
        return struct.pack("<HH2s2xI", group, element, vr.encode(), len(data)) + data
    return struct.pack("<HH2sH", group, element, vr.encode(), len(data)) + data


def write_dicom(path: Path, sop_class: str, **attributes) -> Path:
    """A DICOM file with the ``ELEMENTS`` keywords given, in tag order, after the PS3.10 preamble and file meta."""
    instance = attributes.setdefault("SOPInstanceUID", new_uid())
    attributes["SOPClassUID"] = sop_class
    meta = b"".join(
        [
            _element(0x0002, 0x0001, "OB", b"\0\1"),
            _element(0x0002, 0x0002, "UI", sop_class),
            _element(0x0002, 0x0003, "UI", instance),
            _element(0x0002, 0x0010, "UI", EXPLICIT_LITTLE),
            _element(0x0002, 0x0012, "UI", "2.25.1"),
        ]
    )
    body = b"".join(
        _element(*ELEMENTS[k], v) for k, v in sorted(attributes.items(), key=lambda kv: ELEMENTS[kv[0]][:2])
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 128 + b"DICM" + struct.pack("<HH2sHI", 2, 0, b"UL", 4, len(meta)) + meta + body)
    return path


def write_xray(
    path: Path,
    stored: np.ndarray,
    bits_stored: int | None = None,
    photometric: str = "MONOCHROME2",
    signed: bool = False,
    **tags,
) -> Path:
    """A DX file of ``stored`` ((rows, columns), or (frames, rows, columns)) with the given attributes."""
    bits = bits_stored or stored.dtype.itemsize * 8
    attributes = dict(
        Modality="DX",
        PatientID="test",
        StudyInstanceUID=new_uid(),
        SeriesInstanceUID=new_uid(),
        SamplesPerPixel=1,
        PhotometricInterpretation=photometric,
        Rows=stored.shape[-2],
        Columns=stored.shape[-1],
        BitsAllocated=stored.dtype.itemsize * 8,
        BitsStored=bits,
        HighBit=bits - 1,
        PixelRepresentation=int(signed),
        PixelData=np.ascontiguousarray(stored).astype(stored.dtype.newbyteorder("<")).tobytes(),
        **tags,
    )
    if stored.ndim == 3:
        attributes["NumberOfFrames"] = stored.shape[0]
    return write_dicom(path, DX_STORAGE, **attributes)


def load_2d(path: Path, item: dict | None = None) -> dict:
    """The configured 2D load transforms (configs/train.yaml) and LandmarkTargetsd on one file."""
    transforms = bundle_parser(TRAIN_2D).get_parsed_content("load_transforms")
    targets = LandmarkTargetsd(keys="image", n_landmarks=1)
    return Compose([*transforms, targets])({"image": str(path), **(item or {})})


def minmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x - x.min()) / (x.max() - x.min())


def ramp(rows: int = 20, columns: int = 30, top: int = 4095, seed: int = 0) -> np.ndarray:
    """Stored values (rows, columns) covering 0..top, in a random order (no symmetry to hide a transpose)."""
    values = np.linspace(0, top, rows * columns).round()
    return np.random.default_rng(seed).permutation(values).reshape(rows, columns)


# ---- 2D X-rays: geometry and spacing ----


@pytest.mark.parametrize(
    "tags, expected",
    [
        ({"PixelSpacing": [0.2, 0.1]}, [0.1, 0.2]),  # row spacing \ column spacing -> [x, y]
        ({"ImagerPixelSpacing": [0.15, 0.125]}, [0.125, 0.15]),
        ({"ImagerPixelSpacing": [0.15, 0.125], "EstimatedRadiographicMagnificationFactor": 1.25}, [0.1, 0.12]),
        (
            {
                "PixelSpacing": [0.12, 0.12],
                "ImagerPixelSpacing": [0.3, 0.3],
                "EstimatedRadiographicMagnificationFactor": 2,
            },
            [0.12, 0.12],
        ),
    ],
)
def test_spacing_from_each_header_tag(tmp_path, tags, expected):
    stored = ramp().astype(np.uint16)
    path = write_xray(tmp_path / "x.dcm", stored, bits_stored=12, **tags)
    d = load_2d(path, {"landmarks": [[3.0, 4.0]]})
    image = d["image"]
    assert tuple(image.shape) == (1, 30, 20)  # channel, x = column, y = row: the singleton frame axis dropped
    np.testing.assert_allclose(d["spacing"].numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(d["label"].numpy(), [[3.0 * expected[0], 4.0 * expected[1]]], rtol=1e-6)
    # the datalist's spacing still overrides the header
    d = load_2d(path, {"spacing": [0.5, 0.25]})
    np.testing.assert_allclose(d["spacing"].numpy(), [0.5, 0.25])


def test_no_spacing_tag_warns_and_uses_pixels(tmp_path):
    path = write_xray(tmp_path / "x.dcm", ramp(top=255).astype(np.uint8))
    with pytest.warns(UserWarning, match=r"no spacing for .*x\.dcm"):
        d = load_2d(path)
    np.testing.assert_array_equal(d["spacing"].numpy(), [1.0, 1.0])


def test_pixels_are_indexed_column_row_like_png(tmp_path):
    stored = ramp(top=255, seed=1).astype(np.uint8)
    png = tmp_path / "x.png"
    Image.fromarray(stored).save(png)
    dicom = write_xray(tmp_path / "x.dcm", stored, PixelSpacing=[0.1, 0.1])
    from_dicom, from_png = load_2d(dicom)["image"][0].numpy(), load_2d(png)["image"][0].numpy()
    np.testing.assert_allclose(from_dicom, minmax(stored).T, atol=1e-6)  # [x, y] = [column, row]
    np.testing.assert_array_equal(from_dicom, from_png)
    # the analysis loader (augmentation estimate, figures) reads it alike, with the header spacing in its affine
    grey, affine = load_grey(str(dicom), 2)
    np.testing.assert_allclose(grey, minmax(stored).T, atol=1e-6)
    np.testing.assert_allclose(np.abs(np.diag(affine)), [0.1, 0.1, 1.0])


# ---- 2D X-rays: intensities ----


def test_monochrome1_is_inverted(tmp_path):
    stored = ramp(top=3000).astype(np.uint16)
    path = write_xray(tmp_path / "m1.dcm", stored, bits_stored=12, photometric="MONOCHROME1", PixelSpacing=[0.1, 0.1])
    image = load_2d(path)["image"][0].numpy().T
    np.testing.assert_allclose(image, minmax(-stored.astype(np.float64)), atol=1e-6)
    # the brightest pixel of the result is where the stored value is lowest
    assert np.unravel_index(image.argmax(), image.shape) == np.unravel_index(stored.argmin(), stored.shape)


def test_12_bit_stored_in_16_ignores_the_upper_bits(tmp_path):
    stored = ramp(top=4095, seed=2).astype(np.uint16)
    garbage = np.random.default_rng(3).integers(0, 16, stored.shape).astype(np.uint16) << 12  # overlay-like bits 12-15
    path = write_xray(tmp_path / "b12.dcm", stored | garbage, bits_stored=12, PixelSpacing=[0.1, 0.1])
    loaded = LoadImaged(keys="image")({"image": str(path)})
    raw = XRayDicomd(keys="image")(loaded)["image"].numpy().T
    np.testing.assert_array_equal(raw, stored)  # values before ScaleIntensityd: the 12 stored bits
    np.testing.assert_allclose(load_2d(path)["image"][0].numpy().T, stored / 4095.0, atol=1e-6)


def test_signed_12_bit_and_rescale(tmp_path):
    values = ramp(top=1500, seed=4) - 700  # -700..800
    stored = (values.astype(np.int16).view(np.uint16)) & np.uint16(0x0FFF)  # 12-bit two's complement
    path = write_xray(
        tmp_path / "s.dcm",
        stored,
        bits_stored=12,
        signed=True,
        RescaleSlope=0.5,
        RescaleIntercept=10,
        PixelSpacing=[0.1, 0.1],
    )
    raw = XRayDicomd(keys="image")(LoadImaged(keys="image")({"image": str(path)}))["image"].numpy().T
    np.testing.assert_allclose(raw, 0.5 * values + 10, atol=1e-4)


def dicom_linear_window(x: np.ndarray, c: float, w: float) -> np.ndarray:
    """PS3.3 C.11.2.1.2.1, LINEAR, output range [0, 1], written out case by case."""
    out = np.empty_like(x, dtype=np.float64)
    for idx, v in np.ndenumerate(x):
        if v <= c - 0.5 - (w - 1) / 2:
            out[idx] = 0.0
        elif v > c - 0.5 + (w - 1) / 2:
            out[idx] = 1.0
        else:
            out[idx] = (v - (c - 0.5)) / (w - 1) + 0.5
    return out


@pytest.mark.parametrize("photometric", ["MONOCHROME2", "MONOCHROME1"])
def test_rescale_then_voi_window(tmp_path, photometric):
    stored = ramp(top=4000, seed=5).astype(np.uint16)
    slope, intercept, center, width = 2.0, -1000.0, 3000.0, 4001.0
    path = write_xray(
        tmp_path / "w.dcm",
        stored,
        bits_stored=12,
        photometric=photometric,
        RescaleSlope=slope,
        RescaleIntercept=intercept,
        WindowCenter=center,
        WindowWidth=width,
        PixelSpacing=[0.1, 0.1],
    )
    modality = slope * stored + intercept  # -1000..7000: the window [1000, 5000] clips both ends
    windowed = dicom_linear_window(modality, center, width)
    expected = windowed if photometric == "MONOCHROME2" else 1.0 - windowed
    raw = XRayDicomd(keys="image")(LoadImaged(keys="image")({"image": str(path)}))["image"].numpy().T
    np.testing.assert_allclose(raw, expected, atol=1e-6)
    assert 0.2 < (expected == 0).mean() + (expected == 1).mean() < 0.8  # the window does clip, and not everything
    np.testing.assert_allclose(load_2d(path)["image"][0].numpy().T, expected, atol=1e-6)  # already spans [0, 1]


def test_voi_functions():
    x = np.array([0.0, 99.5, 100.0, 200.0, 300.0, 400.0])
    np.testing.assert_allclose(voi_window(x, 200.0, 201.0), [0.0, 0.0, 0.0025, 0.5025, 1.0, 1.0])
    np.testing.assert_allclose(voi_window(x, 200.0, 200.0, "LINEAR_EXACT"), [0.0, 0.0, 0.0, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(
        voi_window(np.array([200.0, 250.0]), 200.0, 100.0, "SIGMOID"), [0.5, 1 / (1 + np.exp(-2))]
    )
    with pytest.raises(ValueError, match="unknown VOI LUT function"):
        voi_window(x, 1.0, 2.0, "CUBIC")


# ---- bad input ----


def test_two_frame_file_is_refused_naming_it(tmp_path):
    stored = np.stack([ramp(), ramp(seed=1)]).astype(np.uint16)
    path = write_xray(tmp_path / "cine.dcm", stored, bits_stored=12, PixelSpacing=[0.1, 0.1])
    loaded = LoadImaged(keys="image")({"image": str(path)})
    with pytest.raises(DicomError, match=r"cine\.dcm: 2 frames \(NumberOfFrames \(0028,0008\)"):
        XRayDicomd(keys="image")(loaded)
    with pytest.raises(RuntimeError) as record:  # through the configured pipeline, the cause names the file
        load_2d(path)
    assert "cine.dcm: 2 frames" in str(record.value.__cause__)


def test_truncated_file_is_refused_naming_it_as_a_dicom_file(tmp_path):
    path = write_xray(tmp_path / "cut.dcm", ramp().astype(np.uint16), bits_stored=12, PixelSpacing=[0.1, 0.1])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match=r"cannot read image \S*cut\.dcm \(a DICOM file whose data cannot be decoded"):
        load_grey(str(path), 2)
    with pytest.raises(DicomError, match=r"cut\.dcm: unreadable DICOM file: truncated, or not DICOM"):
        read_header(path)
    (tmp_path / "empty.dcm").write_bytes(b"")
    with pytest.raises(ImageError, match=r"empty\.dcm \(empty file, 0 bytes\)"):
        load_grey(str(tmp_path / "empty.dcm"), 2)


def test_a_header_declaring_an_absurd_size_is_refused_before_the_pixels_are_read(tmp_path, monkeypatch):
    """A DICOM file (Rows, Columns 65535, one frame or a thousand) or series whose header declares more pixels than an
    X-ray has, or more voxels than a CT, is refused naming it before ITK allocates the image (it tried: 4 TB)."""
    monkeypatch.setattr(monai.data.ITKReader, "read", lambda *a, **k: pytest.fail("ITK read the pixels"))
    stored = np.zeros((2, 2), np.uint16)
    frame = write_xray(tmp_path / "frame.dcm", stored)
    cine = write_xray(tmp_path / "cine.dcm", stored, NumberOfFrames=1000)
    row, col, _, affine_lps = oblique_sagittal_geometry()
    series = write_ct_series(tmp_path / "series", np.zeros((2, 2, 3), np.int16), affine_lps, row, col)
    for file in [frame, cine, *series.iterdir()]:  # Rows and Columns (US, 2 bytes each, in a row) made 65535
        data = file.read_bytes()
        at = data.index(struct.pack("<HH2sH", 0x0028, 0x0010, b"US", 2))
        file.write_bytes(data[: at + 8] + b"\xff\xff" + data[at + 10 : at + 18] + b"\xff\xff" + data[at + 20 :])
    for path, expected in [
        (frame, "65535 x 65535 pixels, more than the 50,000,000 an X-ray picture may have"),
        (cine, "65535 x 65535 x 1000 voxels (4,294,836,225,000), more than the 536,870,912 a volume may have"),
        (series, "65535 x 65535 x 3 voxels (12,884,508,675), more than the 536,870,912 a volume may have"),
    ]:
        with pytest.raises(ImageError, match=re.escape(f"{path}: {expected}")):
            BundleLoadImaged("image")({"image": str(path)})


def test_malformed_spacing_tag_names_file_and_tag(tmp_path):
    path = write_xray(tmp_path / "bad.dcm", ramp(top=255).astype(np.uint8), PixelSpacing=[0.1, 0.0])
    loaded = LoadImaged(keys="image")({"image": str(path)})
    with pytest.raises(DicomError, match=r"bad\.dcm: PixelSpacing \(0028,0030\) must be two positive numbers"):
        XRayDicomd(keys="image")(loaded)
    with pytest.raises(DicomError, match=r"x\.dcm: ImagerPixelSpacing \(0018,1164\) must hold 2 values"):
        header_spacing({"0018|1164": "0.1"}, "x.dcm")


def test_non_dicom_images_pass_unchanged(tmp_path):
    png = tmp_path / "x.png"
    Image.fromarray(ramp(top=255).astype(np.uint8)).save(png)
    loaded = LoadImaged(keys="image")({"image": str(png)})
    assert XRayDicomd(keys="image")(loaded)["image"] is loaded["image"]


# ---- 3D: a CT series in a non-axial orientation against the same volume as NIfTI, NRRD and MHA ----

SHAPE_3D = (24, 28, 20)  # (columns i, rows j, slices k)


def oblique_sagittal_geometry() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row and column direction cosines (LPS), slice normal and the 4x4 voxel (i, j, k) -> LPS affine.

    Sagittal slices tilted by 36.87 degrees (cosines 0.6 / 0.8, 1.25 mm pixels): every affine entry is
    exact in float32, the precision of a NIfTI header. (With a general angle the float32 roundoff can flip
    MONAI's choice of where ``Spacingd`` puts its output grid, a fraction of a voxel: the world positions
    still agree, the voxel-by-voxel comparison below would not.)
    """
    row = np.array([0.0, 0.6, 0.8])  # along a row (column index i): posterior and superior
    col = np.array([0.0, 0.8, -0.6])  # down a column (row index j): posterior and inferior
    normal = np.cross(row, col)  # -x (LPS): slices run to the patient's right
    spacing = np.array([1.25, 1.25, 2.5])  # column, row, slice
    affine = np.eye(4)
    affine[:3, :3] = np.stack([row, col, normal], axis=1) * spacing
    affine[:3, 3] = [30.0, -40.0, 25.0]
    return row, col, normal, affine


def blob_volume(affine_lps: np.ndarray, centre_ras: np.ndarray) -> np.ndarray:
    """HU volume (i, j, k): -1000 background and a Gaussian bone-like blob (peak 1000 HU) at ``centre_ras``."""
    ijk = np.stack(np.meshgrid(*(np.arange(n) for n in SHAPE_3D), indexing="ij"), -1).astype(np.float64)
    ras = (ijk @ affine_lps[:3, :3].T + affine_lps[:3, 3]) * [-1.0, -1.0, 1.0]
    r2 = ((ras - centre_ras) ** 2).sum(-1)
    return np.round(-1000.0 + 2000.0 * np.exp(-r2 / (2 * 6.0**2))).astype(np.int16)


def write_ct_series(
    folder: Path,
    hu: np.ndarray,
    affine_lps: np.ndarray,
    row: np.ndarray,
    col: np.ndarray,
    dated: dict[int, str] | None = None,
) -> Path:
    """One CT slice file per k (unsigned stored = HU + 1024, RescaleIntercept -1024), in shuffled file names;
    ``dated``: the Series Date of slices from k on (``{k: "YYYYMMDD"}``)."""
    folder.mkdir(parents=True, exist_ok=True)
    study, series, frame = new_uid(), new_uid(), new_uid()
    order = np.random.default_rng(0).permutation(hu.shape[2])
    for k in range(hu.shape[2]):
        days = [day for first, day in sorted((dated or {}).items()) if k >= first]
        date = {"SeriesDate": days[-1]} if days else {}
        write_dicom(
            folder / f"IM{order[k]:04d}",
            CT_STORAGE,
            Modality="CT",
            PatientID="test",
            StudyInstanceUID=study,
            SeriesInstanceUID=series,
            FrameOfReferenceUID=frame,
            InstanceNumber=k + 1,
            ImagePositionPatient=list(affine_lps[:3, :3] @ [0, 0, k] + affine_lps[:3, 3]),
            ImageOrientationPatient=list(np.concatenate([row, col])),
            PixelSpacing=[np.linalg.norm(affine_lps[:3, 1]), np.linalg.norm(affine_lps[:3, 0])],
            SliceThickness=np.linalg.norm(affine_lps[:3, 2]),
            SamplesPerPixel=1,
            PhotometricInterpretation="MONOCHROME2",
            Rows=hu.shape[1],
            Columns=hu.shape[0],
            BitsAllocated=16,
            BitsStored=12,
            HighBit=11,
            PixelRepresentation=0,
            RescaleIntercept=-1024,
            RescaleSlope=1,
            PixelData=np.ascontiguousarray((hu[:, :, k].T.astype(np.int32) + 1024).astype("<u2")).tobytes(),
            **date,
        )
    return folder


def world_centroid(image: torch.Tensor) -> np.ndarray:
    """Intensity-weighted centroid (above half maximum) of a channel-first volume, in world RAS mm."""
    v = image[0].numpy().astype(np.float64)
    w = np.where(v > 0.5 * v.max(), v, 0.0)
    ijk = np.stack(np.meshgrid(*(np.arange(n) for n in v.shape), indexing="ij"), -1)
    voxel = (ijk * w[..., None]).reshape(-1, 3).sum(0) / w.sum()
    affine = np.asarray(image.affine, np.float64)
    return affine[:3, :3] @ voxel + affine[:3, 3]


def test_ct_series_equals_the_same_volume_as_nifti_nrrd_and_mha(tmp_path):
    row, col, _, affine_lps = oblique_sagittal_geometry()
    centre = np.array([-6.0, 18.0, 27.0])  # RAS, inside the volume
    hu = blob_volume(affine_lps, centre)
    series = write_ct_series(tmp_path / "series", hu, affine_lps, row, col)
    affine_ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine_lps
    nifti = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(hu, affine_ras), str(nifti))
    others = []
    for suffix in (".nrrd", ".mha"):
        image = sitk.GetImageFromArray(np.transpose(hu, (2, 1, 0)))  # sitk arrays are (k, j, i)
        image.SetSpacing([float(s) for s in np.linalg.norm(affine_lps[:3, :3], axis=0)])
        image.SetDirection((affine_lps[:3, :3] / np.linalg.norm(affine_lps[:3, :3], axis=0)).ravel().tolist())
        image.SetOrigin(affine_lps[:3, 3].tolist())
        sitk.WriteImage(image, str(tmp_path / f"ct{suffix}"))
        others.append(tmp_path / f"ct{suffix}")

    load = Compose(bundle_parser(TRAIN_3D).get_parsed_content("load_transforms"))
    reference = load({"image": str(nifti)})["image"]
    assert reference.shape[1:] != hu.shape  # reoriented and resampled to 2 mm
    # the blob's world position is the one it was drawn at (up to the resampling and rounding)
    assert np.linalg.norm(world_centroid(reference) - centre) < 0.3
    for path in [series, *others]:
        image = load({"image": str(path)})["image"]
        assert image.shape == reference.shape, path
        np.testing.assert_allclose(np.asarray(image.affine), np.asarray(reference.affine), atol=1e-4, err_msg=str(path))
        np.testing.assert_allclose(image.numpy(), reference.numpy(), atol=1e-4, err_msg=str(path))  # HU alike
        assert np.linalg.norm(world_centroid(image) - world_centroid(reference)) < 1e-3, path
        # the datalist's world landmark maps to the same grid position in both: LandmarkTargetsd's map
        d = LandmarkTargetsd(keys="image", n_landmarks=1)({"image": image, "landmarks": [centre.tolist()]})
        r = LandmarkTargetsd(keys="image", n_landmarks=1)({"image": reference, "landmarks": [centre.tolist()]})
        grid = np.linalg.solve(d["grid_to_physical"].numpy(), np.append(centre, 1.0))
        np.testing.assert_allclose(r["grid_to_physical"].numpy() @ grid, np.append(centre, 1.0), atol=1e-3)
        np.testing.assert_allclose(d["spacing"].numpy(), r["spacing"].numpy(), atol=1e-5)


# ---- prepare_data: DICOM files and series folders ----


def test_dicom_datalists_for_xray_files_and_ct_series(tmp_path):
    xrays = tmp_path / "xrays"
    write_xray(xrays / "001.dcm", ramp().astype(np.uint16), bits_stored=12, PixelSpacing=[0.1, 0.1])
    write_xray(xrays / "002", ramp(seed=1).astype(np.uint16), bits_stored=12)  # no suffix, no spacing
    (xrays / "notes.txt").write_text("not an image")
    (xrays / "marks.csv").write_text("001,1,2,3,4\n002,5,6,7,8\n")
    with pytest.warns(UserWarning, match=r"1 DICOM files carry neither .*002"):
        dl = dicom_xray_datalist(xrays, xrays / "marks.csv", landmark_names=["a", "b"])
    assert [Path(it["image"]).name for it in dl["training"]] == ["001.dcm", "002"]
    assert dl["training"][1]["landmarks"] == [[5.0, 6.0], [7.0, 8.0]] and "spacing" not in dl["training"][0]
    dl = dicom_xray_datalist(xrays, xrays / "marks.csv", spacing=[0.2, 0.2])
    assert dl["training"][1]["spacing"] == [0.2, 0.2] and "spacing" not in dl["training"][0]
    write_xray(xrays / "003.dcm", np.zeros((2, 4, 4), np.uint16), PixelSpacing=[0.1, 0.1])
    with pytest.raises(DicomError, match=r"003\.dcm: 2 frames"):
        dicom_xray_datalist(xrays, xrays / "marks.csv")

    row, col, _, affine_lps = oblique_sagittal_geometry()
    cts = tmp_path / "cts"
    write_ct_series(cts / "a", blob_volume(affine_lps, np.array([-6.0, 18.0, 27.0])), affine_lps, row, col)
    write_markups(cts / "a.mrk.json", [ControlPoint("tip", (-6.0, 18.0, 27.0))], "LPS")
    dl = dicom_series_datalist(cts)
    assert dl["spatial_dims"] == 3 and dl["landmark_names"] == ["tip"]
    assert Path(dl["training"][0]["image"]).name == "a" and dl["training"][0]["landmarks"] == [[-6.0, 18.0, 27.0]]

    out = tmp_path / "lists" / "ct.json"
    prepare_data.main(["dicom", str(cts), str(out)])
    assert load_datalist(out)["training"][0]["landmarks"] == [[-6.0, 18.0, 27.0]]
    (xrays / "003.dcm").unlink()
    out = tmp_path / "lists" / "xr.json"
    prepare_data.main(["dicom", str(xrays), str(out), "--csv", str(xrays / "marks.csv"), "--spacing", "0.3"])
    items = load_datalist(out)["training"]
    assert [it.get("spacing") for it in items] == [None, [0.3, 0.3]]


def test_dataset_dir_of_volumes_lists_dicom_series_folders(tmp_path):
    """`inferring --dataset_dir` on volumes listed files only: a folder of DICOM series gave nothing to run on, and a
    series' own folder gave one "volume" per slice. In 3D its series folders, and the folder itself when it holds
    slices, are items; in 2D a DICOM X-ray file stays one picture."""
    from bundle.data.image_items import image_items, require_items

    row, col, _, affine_lps = oblique_sagittal_geometry()
    studies = tmp_path / "studies"
    for name in ("b", "a"):
        write_ct_series(studies / name, blob_volume(affine_lps, np.array([-6.0, 18.0, 27.0])), affine_lps, row, col)
    (studies / "notes").mkdir()
    (studies / "notes" / "read.txt").write_text("no images here")
    (studies / ".trash").mkdir()
    write_ct_series(studies / ".trash" / "old", np.zeros((4, 4, 2), np.int16) - 1000, affine_lps, row, col)
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)), str(studies / "c.nii.gz"))
    (studies / "c.csv").write_text("not an image")
    assert image_items(None, studies, spatial_dims=3) == [
        {"image": str(studies / name)} for name in ("a", "b", "c.nii.gz")
    ]
    assert image_items(None, studies / "a", spatial_dims=3) == [{"image": str(studies / "a")}]
    xrays = tmp_path / "xrays"
    write_xray(xrays / "001.dcm", ramp().astype(np.uint16), bits_stored=12, PixelSpacing=[0.1, 0.1])
    assert image_items(None, xrays, spatial_dims=2) == [{"image": str(xrays / "001.dcm")}]
    assert image_items(None, studies, spatial_dims=2) == [{"image": str(studies / "c.nii.gz")}]
    (studies / "c.nii.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"holds DICOM series folders .* merge configs/train_3d\.yaml"):
        require_items(image_items(None, studies, spatial_dims=2), studies, spatial_dims=2)
    require_items(image_items(None, studies, spatial_dims=3), studies, spatial_dims=3)


# ---- the target: the same landmarks from a PNG and from its DICOM copy, header spacing for mm ----


def dicom_copy(png: Path, path: Path, spacing: list[float]) -> Path:
    """The PNG as a MONOCHROME1, 12-of-16-bit DX file with a rescale: the same picture once decoded."""
    grey = np.asarray(Image.open(png).convert("L"), dtype=np.uint16)  # (rows, columns)
    stored = 4095 - grey * 16  # MONOCHROME1: bright = low; 0..4080 in 12 bits
    return write_xray(
        path,
        stored.astype(np.uint16),
        bits_stored=12,
        photometric="MONOCHROME1",
        RescaleSlope=0.5,
        RescaleIntercept=-20,
        PixelSpacing=[spacing[1], spacing[0]],
        ImagerPixelSpacing=[3 * spacing[1], 3 * spacing[0]],
    )


def read_predictions(path: Path) -> dict[tuple[str, str], list[float]]:
    with path.open() as f:
        return {
            (Path(r["image"]).stem, r["landmark"]): [float(r["x"]), float(r["y"]), float(r["error_mm"] or "nan")]
            for r in csv.DictReader(f)
        }


def png_and_dicom_datalists(tmp_path: Path) -> tuple[Path, Path]:
    """A small synthetic set as PNG (with the datalist's spacing) and as DICOM copies (spacing from the headers)."""
    png_list = generate_synthetic_2d(tmp_path / "png", n_training=1, n_validation=0, n_test=2, seed=5)
    datalist = load_datalist(png_list)
    dicom = {}
    for item in datalist["training"] + datalist["test"] + [datalist["template"]]:
        name = Path(item["image"]).stem + ".dcm"
        dicom[item["image"]] = str(dicom_copy(Path(item["image"]), tmp_path / "dcm" / name, item["spacing"]))

    def as_dicom(item: dict) -> dict:  # no datalist spacing: the header's must give the same mm
        return {"image": dicom[item["image"]], "landmarks": item["landmarks"]}

    dicom_list = save_datalist(
        {
            **datalist,
            "training": [as_dicom(it) for it in datalist["training"]],
            "test": [as_dicom(it) for it in datalist["test"]],
            "template": as_dicom(datalist["template"]),
        },
        tmp_path / "dcm" / "datalist.json",
    )
    return png_list, dicom_list


def same_predictions(png: dict, dcm: dict) -> float:
    """Largest difference (pixels) between the x, y of two predictions.csv tables with the same rows."""
    assert png.keys() == dcm.keys() and len(png) > 0
    return float(
        np.abs(np.array([png[k][:2] for k in sorted(png)]) - np.array([dcm[k][:2] for k in sorted(png)])).max()
    )


def test_evaluating_gives_the_same_landmarks_and_mm_on_png_and_dicom(tmp_path):
    png_list, dicom_list = png_and_dicom_datalists(tmp_path)
    config = [str(ROOT / f) for f in config_files("evaluate")]
    results = {}
    for kind, path in (("png", png_list), ("dcm", dicom_list)):
        out = tmp_path / f"eval_{kind}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(
                "evaluating",
                config_file=config,
                bundle_root=str(ROOT),
                datalist=str(path),
                output_dir=str(out),
                ckpt_path=str(ROOT / "models" / "model.pt"),
                progress_bar=False,
                overlays=False,
            )
        results[kind] = (read_predictions(out / "predictions.csv"), json.loads((out / "metrics.json").read_text()))
    (png, png_metrics), (dcm, dcm_metrics) = results["png"], results["dcm"]
    assert len(png) == 2 * 16 and same_predictions(png, dcm) < 0.01  # pixels
    errors_png = np.array([png[k][2] for k in sorted(png)])
    errors_dcm = np.array([dcm[k][2] for k in sorted(png)])
    assert np.isfinite(errors_png).all() and errors_png.max() > 0
    np.testing.assert_allclose(errors_dcm, errors_png, atol=1e-3)  # mm from PixelSpacing (not the x3 imager spacing)
    assert abs(dcm_metrics["mre_mm"] - png_metrics["mre_mm"]) < 1e-3 and dcm_metrics["n_images"] == 2


def test_inferring_gives_the_same_landmarks_on_png_and_dicom(tmp_path):
    png_list, dicom_list = png_and_dicom_datalists(tmp_path)
    predictions = {}
    for kind, path in (("png", png_list), ("dcm", dicom_list)):
        out = tmp_path / f"infer_{kind}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the standalone inference config, its template taken from the datalist's template item
            run(
                "inferring",
                config_file=str(ROOT / "configs" / "inference.yaml"),
                bundle_root=str(ROOT),
                datalist=str(path),
                images=[it["image"] for it in load_datalist(path)["test"]],
                output_dir=str(out),
                ckpt_path=str(ROOT / "models" / "model.pt"),
                overlays=False,
            )
        predictions[kind] = read_predictions(out / "predictions.csv")
    assert len(predictions["png"]) == 2 * 16
    assert same_predictions(predictions["png"], predictions["dcm"]) < 0.01  # pixels


def test_a_folder_of_two_series_is_refused_naming_it(tmp_path):
    """A reader takes one of a folder's series without a word (a registered copy 40 mm away read as the scan):
    refused when it is read, as `prepare_data dicom` refuses it."""
    row, col, _, affine_lps = oblique_sagittal_geometry()
    hu = blob_volume(affine_lps, np.array([-6.0, 18.0, 27.0]))
    write_ct_series(tmp_path / "one", hu, affine_lps, row, col)
    assert tuple(BundleLoadImaged("image")({"image": str(tmp_path / "one")})["image"].shape) == hu.shape
    both = write_ct_series(tmp_path / "both", hu, affine_lps, row, col)
    moved = affine_lps.copy()
    moved[:3, 3] += [40.0, 0.0, 0.0]
    for file in write_ct_series(tmp_path / "moved", hu, moved, row, col).iterdir():
        file.rename(both / f"B{file.name}")
    with pytest.raises(ImageError, match=re.escape(f"{both}: 2 DICOM series in one folder, as the reader groups")):
        BundleLoadImaged("image")({"image": str(both)})


def test_a_nifti_file_read_otherwise_than_slicer_shows_it_is_refused_or_warned_about(tmp_path):
    """nibabel takes voxel sizes in metres as millimetres, and the sform where ITK (3D Slicer) reads the qform (an
    sform code other than 1): the first is refused, the second warned about with the distance, naming the file."""
    data = np.zeros((20, 20, 10), np.int16)
    data[5:15, 5:15, 3:7] = 100
    affine = np.diag([2.0, 2.0, 3.0, 1.0])
    for unit in ("meter", "micron"):
        scaled = nib.Nifti1Image(data, affine)
        scaled.header.set_xyzt_units(unit)
        nib.save(scaled, str(tmp_path / f"{unit}.nii.gz"))
        with pytest.raises(ImageError, match=re.escape(f"{tmp_path / unit}.nii.gz: its voxel sizes are in {unit}s")):
            load_image(str(tmp_path / f"{unit}.nii.gz"))
    moved = affine.copy()
    moved[0, 3] += 30.0
    sheared = moved.copy()
    sheared[0, 1] = 0.5  # ITK reads the qform of a sheared sform whatever its code
    cases = ((2, "aligned.nii.gz", moved), (1, "scanner.nii.gz", moved), (1, "sheared.nii.gz", sheared))
    for code, name, sform in cases:
        image = nib.Nifti1Image(data, None)
        image.set_qform(affine, code=1)
        image.set_sform(sform, code=code)
        nib.save(image, str(tmp_path / name))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = load_image(str(tmp_path / "aligned.nii.gz"))
        load_image(str(tmp_path / "scanner.nii.gz"))  # ITK reads its sform too: nothing to say
        load_image(str(tmp_path / "sheared.nii.gz"))
    forms = [str(w.message) for w in record if "qform and sform" in str(w.message)]
    assert len(forms) == 2 and forms[1].startswith(f"{tmp_path / 'sheared.nii.gz'}: its qform and sform place")
    assert forms[:1] == [
        f"{tmp_path / 'aligned.nii.gz'}: its qform and sform place the volume up to 30.0 mm apart; the bundle reads "
        "the sform (code 2), 3D Slicer and ITK the qform (code 1), so landmarks placed in Slicer lie that far off "
        "here: make the two agree (e.g. nibabel: img.set_qform(img.get_sform())), or write the volume again with "
        "SimpleITK"
    ]
    assert float(loaded.affine[0, 3]) == 30.0  # read as before: the sform


def test_a_series_landmark_outside_its_volume_is_warned_about_as_for_nifti(tmp_path):
    """`prepare_data dicom` checked no landmark against its series (the NIfTI converter did): LPS values in a file
    declared RAS passed without a word."""
    row, col, _, affine_lps = oblique_sagittal_geometry()
    centre = np.array([-6.0, 18.0, 27.0])  # RAS, inside the volume
    write_ct_series(tmp_path / "cts" / "case1", blob_volume(affine_lps, centre), affine_lps, row, col)
    lps = centre * [-1, -1, 1]  # the same point in LPS, read as RAS: outside
    points = [ControlPoint("inside", tuple(centre)), ControlPoint("mixed_up", tuple(lps))]
    write_markups(tmp_path / "cts" / "case1.mrk.json", points)
    with pytest.warns(UserWarning) as record:
        datalist = dicom_series_datalist(tmp_path / "cts")
    outside = [str(w.message) for w in record if "lies outside" in str(w.message)]
    assert len(outside) == 1 and "label 'mixed_up' at RAS [6.0, -18.0, 27.0] lies outside" in outside[0], outside
    assert datalist["training"][0]["landmarks"][1] == [6.0, -18.0, 27.0]


def test_a_series_the_reader_splits_is_refused_when_read_and_by_prepare_data(tmp_path):
    """A series crossing midnight (its later slices dated the next day): MONAI's reader groups slices by date too and
    read half the volume as the scan; one Series Instance UID let both checks pass. Refused, naming the folder."""
    row, col, _, affine_lps = oblique_sagittal_geometry()
    hu = blob_volume(affine_lps, np.array([-6.0, 18.0, 27.0]))
    dated = {0: "20261128", 10: "20261129"}
    folder = write_ct_series(tmp_path / "cts" / "case1", hu, affine_lps, row, col, dated=dated)
    write_markups(tmp_path / "cts" / "case1.mrk.json", [ControlPoint("a", (-6.0, 18.0, 27.0))])
    message = f"{folder}: 2 DICOM series in one folder, as the reader groups the slices (by series, series date"
    with pytest.raises(DicomError, match=re.escape(message)):
        dicom_series_datalist(tmp_path / "cts")
    with pytest.raises(ImageError, match=re.escape(message)):
        BundleLoadImaged("image")({"image": str(folder)})
