"""Bad input at every entry point: each case fails with a message naming the file, key or value at fault (or
warns, naming the image, where the result is still meaningful), and a failed run leaves no mix of old and
new outputs."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import monai.data
import nibabel as nib
import numpy as np
import pytest
import torch
from bundle.checkpoints import CheckpointError, load_weights, resume_path, save_atomically
from bundle.configs import bundle_parser, check_command_line, check_device, config_files
from bundle.data.datalist import DatalistError, load_datalist
from bundle.data.image_items import image_items
from bundle.data.synthetic import generate_synthetic_2d
from bundle.handlers.checkpoints import LastCheckpointSaver, ResumeCheckpointLoader
from bundle.networks.contrastive import ContrastiveLandmarkNet
from bundle.settings import check_image_size
from bundle.templates.features import compute_template
from bundle.templates.resolution import prepare_template
from ignite.engine import Engine
from monai.bundle import run
from monai.transforms import Compose
from PIL import Image
from scripts import prepare_data
from scripts.experiments.mixing import FeatureTransformation, UnmixLoss

ROOT = Path(__file__).resolve().parents[1]
TRAIN = config_files("train")
EVALUATE = config_files("evaluate")
EVALUATE_3D = config_files("evaluate", spatial_dims=3)
SMALL = {"image_size": [64, 64], "progress_bar": False, "seed": 0}


def messages(error: BaseException) -> str:
    """Every message of an exception chain (MONAI wraps a transform's error in 'applying transform ...')."""
    texts = []
    while error is not None:
        texts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def raises(fn, *args, **kwargs) -> str:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return messages(info.value)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture(scope="module")
def data2d(tmp_path_factory):
    """A tiny 2D set (64 x 72 px) and untrained weights that fit the 2D configuration."""
    root = tmp_path_factory.mktemp("data2d")
    datalist = generate_synthetic_2d(root / "set", n_training=2, n_validation=1, n_test=2, size=(64, 72), seed=2)
    torch.manual_seed(0)
    ckpt = root / "net.pt"
    torch.save(ContrastiveLandmarkNet(spatial_dims=2).state_dict(), ckpt)
    return {"datalist": datalist, "ckpt": ckpt, "content": json.loads(datalist.read_text())}


def variant(data2d, tmp_path: Path, **changes) -> Path:
    """A copy of the tiny datalist (absolute image paths) with top-level keys replaced."""
    base = data2d["datalist"].parent
    content = json.loads(json.dumps(data2d["content"]))

    def absolute(item):
        return {**item, "image": str(base / item["image"])}

    for section in ("training", "validation", "test"):
        content[section] = [absolute(it) for it in content[section]]
    content["template"] = absolute(content["template"])
    content.update(changes)
    return write_json(tmp_path / "datalist.json", content)


def preprocessing(files, datalist: Path, key: str = "validate#preprocessing", **overrides) -> Compose:
    return bundle_parser(files, ROOT, datalist=str(datalist), **overrides).get_parsed_content(key)


def evaluate(datalist: Path, out: Path, ckpt: Path, **overrides) -> None:
    run(
        "evaluating",
        config_file=[str(ROOT / f) for f in EVALUATE],
        bundle_root=str(ROOT),
        datalist=str(datalist),
        output_dir=str(out),
        ckpt_path=str(ckpt),
        **{**SMALL, **overrides},
    )


def infer(images: list[str], out: Path, ckpt: Path, **overrides) -> None:
    run(
        "inferring",
        config_file=str(ROOT / "configs/inference.yaml"),
        bundle_root=str(ROOT),
        images=images,
        output_dir=str(out),
        ckpt_path=str(ckpt),
        **overrides,
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def staging_leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]


# ---------------------------------------------------------------- datalists: empty splits, duplicate names


def test_empty_test_list_is_refused_naming_the_datalist(data2d, tmp_path):
    datalist = variant(data2d, tmp_path, test=[])
    text = raises(evaluate, datalist, tmp_path / "eval", data2d["ckpt"])
    assert f"{datalist}: the 'test' list is empty" in text
    assert not (tmp_path / "eval").exists()


def test_a_test_list_without_landmarks_is_refused_naming_the_datalist(data2d, tmp_path):
    content = json.loads(variant(data2d, tmp_path).read_text())
    unlabelled = [dict(it, landmarks=[None] * len(content["landmark_names"])) for it in content["test"]]
    datalist = variant(data2d, tmp_path, test=unlabelled)
    text = raises(evaluate, datalist, tmp_path / "eval", data2d["ckpt"])
    assert f"{datalist}: no 'test' item carries a landmark: nothing to score" in text
    assert not (tmp_path / "eval").exists()


def test_a_misspelled_or_misplaced_item_key_is_refused_naming_the_item(data2d, tmp_path):
    """``lanmarks`` would make the item silently unlabelled; per-item ``landmark_names`` would be ignored."""
    content = json.loads(variant(data2d, tmp_path).read_text())
    test = [dict(content["test"][0]), *content["test"][1:]]
    test[0]["lanmarks"] = test[0].pop("landmarks")
    with pytest.raises(DatalistError, match=re.escape("test[0]: unknown key 'lanmarks': did you mean 'landmarks'?")):
        load_datalist(variant(data2d, tmp_path, test=test))
    test[0] = dict(content["test"][0], landmark_names=content["landmark_names"][::-1])
    with pytest.raises(DatalistError, match=re.escape("test[0].landmark_names: landmark names are read only at")):
        load_datalist(variant(data2d, tmp_path, test=test))
    test[0] = dict(content["test"][0], patient="P-17")  # a key of the user's own passes
    assert load_datalist(variant(data2d, tmp_path, test=test))["test"][0]["patient"] == "P-17"


def test_scored_items_twice_are_refused_and_unlabelled_ones_are_named(data2d, tmp_path):
    from bundle.data.datalist import section_items

    content = json.loads(variant(data2d, tmp_path).read_text())
    test = content["test"]
    datalist = variant(data2d, tmp_path, test=[*test, test[0]])
    with pytest.raises(DatalistError, match=re.escape(f"'test' items 0 and {len(test)} are the same image")):
        section_items(load_datalist(datalist), "test", datalist, labelled=True)
    unlabelled = dict(test[1], landmarks=None)
    datalist = variant(data2d, tmp_path, test=[test[0], unlabelled, *test[2:]])
    with pytest.warns(UserWarning, match=re.escape("'test' items [1] carry no landmark: they are predicted, not")):
        assert len(section_items(load_datalist(datalist), "test", datalist, labelled=True)) == len(test)


def test_a_truncated_template_feature_file_is_refused_naming_it(tmp_path):
    from bundle.template_file import load_template

    truncated = tmp_path / "template_features.pt"
    truncated.write_bytes((ROOT / "models" / "template_features.pt").read_bytes()[:1000])
    with pytest.raises(ValueError, match=re.escape(f"{truncated}: not a readable template feature file (")):
        load_template(truncated)


def test_empty_training_list_is_refused_naming_the_datalist(data2d, tmp_path):
    datalist = variant(data2d, tmp_path, training=[])
    text = raises(
        run,
        "training",
        config_file=str(ROOT / "configs/train.yaml"),
        bundle_root=str(ROOT),
        datalist=str(datalist),
        output_dir=str(tmp_path / "out"),
        ckpt_dir=str(tmp_path / "models"),
        epochs=1,
        epoch_length=2,
        **SMALL,
    )
    assert f"{datalist}: the 'training' list is empty" in text


@pytest.mark.parametrize(
    "command, link", [("train", "models folder"), ("train_stage2", "models folder"), ("train", "checkpoint")]
)
def test_a_training_refuses_a_link_it_would_write_through(data2d, tmp_path, command, link):
    """A symbolic link in output_dir (``models`` to another folder) had the checkpoints written into the linked
    folder, and a linked ``last.pt`` was replaced: the training refuses before it writes anything, naming the link,
    and the linked folder is left as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.pt").write_bytes(b"the user's file")
    out.mkdir()
    if link == "models folder":
        (out / "models").symlink_to(elsewhere, target_is_directory=True)
        expected = f"{out / 'models'}: a symbolic link in output_dir {out}, on the way to"
    else:
        (out / "models").mkdir()
        (out / "models" / "last.pt").symlink_to(elsewhere / "mine.pt")
        expected = f"{out / 'models' / 'last.pt'}: a symbolic link where the training writes its checkpoints"
    text = raises(
        run,
        "training",
        config_file=[str(ROOT / f) for f in config_files(command)],
        bundle_root=str(ROOT),
        datalist=str(data2d["datalist"]),
        output_dir=str(out),
        epochs=1,
        epoch_length=1,
        **SMALL,
    )
    assert f"FileExistsError: {expected}" in text, text
    assert [p.name for p in elsewhere.iterdir()] == ["mine.pt"]
    assert (elsewhere / "mine.pt").read_bytes() == b"the user's file"
    assert sorted(p.name for p in out.iterdir()) == ["models"]  # no TensorBoard log, no pseudo-labels either
    linked = out / "models" if link == "models folder" else out / "models" / "last.pt"
    assert linked.is_symlink()


def test_duplicate_landmark_names_are_refused_naming_the_duplicate(data2d, tmp_path):
    names = list(data2d["content"]["landmark_names"])
    names[5] = names[2]
    datalist = variant(data2d, tmp_path, landmark_names=names)
    with pytest.raises(
        DatalistError, match=rf"'landmark_names' must be unique, duplicated: '{names[2]}' at positions \[2, 5\]"
    ):
        load_datalist(datalist)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("landmarks", [True, False], "test[0].landmarks[0]: expected null or 2 finite numbers, got [True, False]"),
        ("spacing", [True, True], "test[0].spacing: expected 2 numbers of mm per pixel between 0.0001 and 10000"),
        ("spacing", [1e-300, 1e-300], "test[0].spacing: expected 2 numbers of mm per pixel"),
        ("image", "", "test[0].image: expected a file path, got ''"),
    ],
)
def test_values_of_the_wrong_kind_are_refused_naming_item_and_key(data2d, tmp_path, field, value, expected):
    """JSON true is not the number 1, a spacing of 1e-300 mm is a typing error, an empty path is no image."""
    content = json.loads(data2d["datalist"].read_text())
    item = dict(content["test"][0])
    if field == "landmarks":
        item["landmarks"] = [value] + item["landmarks"][1:]
    else:
        item[field] = value
    datalist = variant(data2d, tmp_path, test=[item] + content["test"][1:])
    with pytest.raises(DatalistError) as failure:
        load_datalist(datalist, check_files=False)  # the derived datalist sits elsewhere than the images
    assert expected in str(failure.value)


def test_a_test_image_is_never_its_own_template(data2d, tmp_path):
    """A template that is also a test image is left out (the score would be measured on itself); when no template
    is left the evaluation stops naming it, before any output is written."""
    content = json.loads(variant(data2d, tmp_path).read_text())
    test_image = content["test"][0]
    datalist = variant(data2d, tmp_path, templates=[test_image, content["template"]])
    evaluate(datalist, tmp_path / "eval", data2d["ckpt"])
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["template"] == content["template"]["image"]
    assert test_image["image"] not in metrics.get("templates", [])  # nor among the pseudo-templates
    datalist = variant(data2d, tmp_path, template=test_image, templates=[])
    text = raises(evaluate, datalist, tmp_path / "eval2", data2d["ckpt"])
    assert f"every template is also a test image (['{test_image['image']}'])" in text
    assert not (tmp_path / "eval2").exists()


# ---------------------------------------------------------------- images: content, size, dimensionality


@pytest.mark.parametrize("mode", ["P", "LA", "RGBA"])
def test_png_modes_are_read_as_the_grey_image_a_viewer_shows(tmp_path, mode):
    """A palette PNG holds indices into its palette (here scrambled): it is read as the palette's grey levels,
    not the indices; an alpha channel is not averaged into the grey."""
    from bundle.data.images import LoadImaged, load_image
    from PIL import Image

    grey = (np.arange(64 * 80).reshape(64, 80) % 251).astype(np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    if mode == "P":
        order = np.random.default_rng(0).permutation(256)  # palette entry i shows grey level order[i]
        picture = Image.fromarray(np.argsort(order)[grey].astype(np.uint8), mode="P")
        picture.putpalette([v for level in order for v in (level, level, level)])
    else:
        picture = Image.fromarray(grey).convert(mode)
    picture.save(tmp_path / "picture.png")
    assert Image.open(tmp_path / "picture.png").mode == mode
    expected = LoadImaged("image")({"image": str(tmp_path / "grey.png")})["image"]
    read = LoadImaged("image")({"image": str(tmp_path / "picture.png")})["image"]
    assert read.shape == expected.shape and torch.equal(torch.as_tensor(read), torch.as_tensor(expected))
    assert torch.equal(torch.as_tensor(load_image(str(tmp_path / "picture.png"))), torch.as_tensor(expected))


def test_constant_image_warns_naming_it(data2d, tmp_path):
    png = tmp_path / "black.png"
    Image.fromarray(np.zeros((72, 64), np.uint8)).save(png)
    with pytest.warns(UserWarning, match=rf"{png}: constant image \(every value is 0\)"):
        preprocessing(TRAIN, data2d["datalist"], **SMALL)({"image": str(png)})


def test_tiny_image_is_refused_naming_it(data2d, tmp_path):
    png = tmp_path / "tiny.png"
    Image.fromarray(np.arange(25, dtype=np.uint8).reshape(5, 5)).save(png)
    text = raises(preprocessing(TRAIN, data2d["datalist"], **SMALL), {"image": str(png)})
    assert f"{png}: an image of 5 x 5 pixels is too small for the network: every axis needs at least 16" in text


def test_truncated_png_is_refused_naming_it(data2d, tmp_path):
    good = Path(data2d["content"]["test"][0]["image"])
    png = tmp_path / "truncated.png"
    data = (data2d["datalist"].parent / good).read_bytes()
    png.write_bytes(data[: len(data) // 2])
    text = raises(preprocessing(TRAIN, data2d["datalist"], **SMALL), {"image": str(png)})
    assert f"ImageError: cannot read image {png}: OSError: image file is truncated" in text


def png_header(width: int, height: int, depth: int = 8, colour: int = 0) -> bytes:
    """A PNG of ``width`` x ``height`` (grey unless ``colour`` says otherwise: 6 is RGBA) whose pixel data is one
    compressed zero row: a header, nothing to show."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def tiff_header(width: int, height: int, bits: int = 8, sample_format: int = 1) -> bytes:
    """A grey TIFF of ``width`` x ``height`` (8-bit unsigned unless said otherwise: 32 bits of format 3 are floats),
    its one strip missing."""
    tags = [(256, width), (257, height), (258, bits), (259, 1), (262, 1), (273, 8), (277, 1), (278, height)]
    tags += [(279, width * height * bits // 8), (339, sample_format)]
    entries = b"".join(struct.pack("<HHII", tag, 4, 1, value) for tag, value in tags)  # LONG values
    return b"II*\0" + struct.pack("<IH", 8, len(tags)) + entries + b"\0" * 4


def nifti_header(shape: tuple[int, ...], dtype=np.uint8, compress: bool = True) -> bytes:
    """A NIfTI-1 header (352 bytes, some 60 compressed) declaring ``shape`` of ``dtype``, no voxel."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    block = header.binaryblock + b"\0" * 4
    return gzip.compress(block, mtime=0) if compress else block  # mtime 0: the same bytes in every process (xdist)


BMP_30000 = b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 30000, 30000, 1, 24, *[0] * 6)
JPEG_65500 = b"\xff\xd8\xff\xc0" + struct.pack(">HBHHB", 11, 8, 65500, 65500, 1) + bytes([1, 0x11, 0]) + b"\xff\xd9"
PICTURE_BOMB = (
    "more than the 50,000,000 pixels an X-ray picture may have, refused before decoding it (PIL: Image size ("
)
VOLUME_CAP = "20000 x 20000 x 20000 voxels (8,000,000,000,000), more than the 536,870,912 a volume may have"
MHA = "ObjectType = Image\nNDims = 3\nDimSize = 20000 20000 20000\nElementType = {}\nElementDataFile = LOCAL\n"
CHANNELS = MHA.replace("20000 20000 20000", "{}").replace("ElementType", "ElementNumberOfChannels = 64\nElementType")
BYTE_CAP = "more than the 2,147,483,648 bytes a volume may hold"
NRRD = "NRRD0004\ntype: uchar\ndimension: 3\nsizes: 20000 20000 {}\nencoding: raw\n\n"


HEADER_CASES = [
    ("giant.png", png_header(20000, 20000), PICTURE_BOMB + "400000000 pixels)"),
    ("large.png", png_header(9000, 9000), "9000 x 9000 pixels, more than the 50,000,000 an X-ray picture may"),
    ("giant.jpg", JPEG_65500, PICTURE_BOMB + "4290250000 pixels)"),
    ("lying.bmp", BMP_30000, PICTURE_BOMB + "900000000 pixels)"),
    ("giant.tif", tiff_header(20000, 20000), PICTURE_BOMB + "400000000 pixels)"),
    ("large.tif", tiff_header(9000, 9000), "9000 x 9000 pixels, more than the 50,000,000"),
    ("giant.mha", MHA.format("MET_UCHAR").encode(), VOLUME_CAP),
    ("giant.nrrd", NRRD.format(20000).encode(), VOLUME_CAP),
    ("giant.nii.gz", nifti_header((20000, 20000, 20000)), VOLUME_CAP),
    (
        "double.nii",
        nifti_header((512, 512, 2000), np.float64, compress=False),
        f"512 x 512 x 2000 voxels of float64 (4,194,304,000 bytes), {BYTE_CAP}",
    ),
    ("channels.mha", CHANNELS.format("512 512 100", "MET_UCHAR").encode(), "512 x 512 x 100 voxels of 64 components"),
    (
        "double_channels.mha",
        CHANNELS.format("256 256 100", "MET_DOUBLE").encode(),
        f"of 64 float64 components (3,355,443,200 bytes), {BYTE_CAP}",
    ),
    ("rgba.png", png_header(6000, 6000, colour=6), "6000 x 6000 pixels of 4 uint8 components (144,000,000 bytes)"),
    ("float.tif", tiff_header(8000, 6000, 32, 3), "8000 x 6000 pixels of float32 (192,000,000 bytes), more than"),
    ("broken.mha", MHA.format("MET_NOTHING").encode(), "unreadable header (MetaImageIO), refused before reading"),
    ("broken.nrrd", NRRD.format("").encode(), "unreadable header (NrrdImageIO), refused before reading it"),
    ("broken.png", png_header(20000, 20000)[:29] + b"xxxx", "unreadable header (PNGImageIO), refused before"),
]


@pytest.mark.parametrize("name, content, expected", HEADER_CASES, ids=[case[0] for case in HEADER_CASES])
def test_a_header_too_large_or_unreadable_is_refused_before_any_pixel_is_decoded(
    tmp_path, monkeypatch, name, content, expected
):
    """A picture or volume whose header declares more pixels than an X-ray (or voxels than a CT) has, or a header its
    format's reader cannot read, is refused naming the file before a reader decodes it (a 20000 x 20000 PNG passed:
    PIL's own DecompressionBombError was taken for "not a picture" and ITK decoded it, 5 GB). So is one whose decoded
    bytes (components per voxel, bytes per component) are too many: a float64 NIfTI of 512 x 512 x 2000, under the
    voxel cap, had 4.8 GB taken before failing; a 64-channel MetaImage, an RGBA PNG and a float TIFF passed."""
    from bundle.data.images import ImageError, LoadImaged

    def decode(self, *args, **kwargs):
        raise AssertionError("a reader decoded the file")

    for reader in (monai.data.PILReader, monai.data.ITKReader, monai.data.NibabelReader, monai.data.NumpyReader):
        monkeypatch.setattr(reader, "read", decode)
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ImageError) as refused:
        LoadImaged("image")({"image": str(path)})
    message = str(refused.value)
    assert message.startswith((f"{path}: ", f"cannot read image {path}: ")) and expected in message, message


@pytest.mark.parametrize(
    "name, content",
    [
        ("ct.nii", nifti_header((512, 512, 600), np.int16, compress=False)),
        ("ct.mha", MHA.replace("20000 20000 20000", "512 512 600").format("MET_SHORT").encode()),
        ("long_ct.nii.gz", nifti_header((512, 512, 2000), np.float32)),
        ("radiograph.png", png_header(7000, 7000, depth=16)),
    ],
)
def test_a_header_of_a_ct_or_radiograph_is_accepted(tmp_path, name, content):
    """The size caps leave real images room: an int16 CT of 512 x 512 x 600 (300 MiB), a float32 one of 2000 slices
    (just under 2 GiB), a 16-bit radiograph of 49 million pixels pass the header check."""
    from bundle.data.image_headers import check_file

    path = tmp_path / name
    path.write_bytes(content)
    check_file(path)


@pytest.mark.parametrize("name, line", [("outside.mha", "ElementDataFile = {}"), ("outside.nrrd", "data file: {}")])
def test_a_header_reading_its_pixels_from_another_folder_is_refused(tmp_path, name, line):
    """A MetaImage or NRRD header whose data file is outside its folder (an absolute path, a folder up, a link) is
    refused naming both before any reader opens it (ITK read any file the process could read as the image's
    pixels); a data file beside the header is read."""
    from bundle.data.images import ImageError, LoadImaged

    secret = tmp_path / "private" / "secret.raw"
    secret.parent.mkdir()
    secret.write_bytes(bytes(range(256)) * 16)
    header = (
        "NRRD0004\ntype: uint8\ndimension: 2\nsizes: 64 64\nencoding: raw\n"
        if name.endswith(".nrrd")
        else "ObjectType = Image\nNDims = 2\nDimSize = 64 64\nElementType = MET_UCHAR\n"
    )
    (tmp_path / "linked.raw").symlink_to(secret)
    for data_file in (str(secret), "private/secret.raw", "../secret.raw", "linked.raw"):
        path = tmp_path / name
        path.write_text(header + line.format(data_file) + "\n\n")
        with pytest.raises(ImageError) as refused:
            LoadImaged("image")({"image": str(path)})
        assert str(refused.value).startswith(f"{path}: its header reads the pixel data from {data_file!r}, not one"), (
            refused.value
        )
    shutil.copy(secret, tmp_path / "beside.raw")
    path.write_text(header + line.format("beside.raw") + "\n\n")
    assert LoadImaged("image")({"image": str(path)})["image"].shape[-2:] == (64, 64)


def test_volume_in_the_2d_configuration_is_refused(data2d, tmp_path):
    volume = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.random.default_rng(0).normal(size=(32, 32, 32)).astype(np.float32), np.eye(4)), volume)
    text = raises(preprocessing(TRAIN, data2d["datalist"], **SMALL), {"image": str(volume)})
    assert f"{volume}: a 3D image (spatial shape [32, 32, 32]), but this configuration expects 2D images" in text
    two_slices = tmp_path / "two.nii.gz"
    nib.save(
        nib.Nifti1Image(np.random.default_rng(0).normal(size=(40, 32, 2)).astype(np.float32), np.eye(4)), two_slices
    )
    text = raises(preprocessing(TRAIN, data2d["datalist"], **SMALL), {"image": str(two_slices)})
    assert f"{two_slices}: a 3D image (spatial shape [40, 32, 2]), but this configuration expects 2D images" in text
    # one slice is a 2D image stored as a volume (an X-ray converted to NIfTI): read as 2D, x, y spacing kept
    one_slice = tmp_path / "xray.nii.gz"
    nib.save(
        nib.Nifti1Image(
            np.random.default_rng(0).normal(size=(40, 32, 1)).astype(np.float32), np.diag([0.2, 0.3, 5, 1])
        ),
        one_slice,
    )
    parser = bundle_parser(TRAIN, ROOT, datalist=str(data2d["datalist"]), **SMALL)
    image = Compose(parser.get_parsed_content("load_transforms"))({"image": str(one_slice)})["image"]
    assert tuple(image.shape) == (1, 40, 32) and tuple(image.affine.shape) == (3, 3)
    np.testing.assert_allclose(np.asarray(image.meta["spacing"], float), [0.2, 0.3])
    assert tuple(preprocessing(TRAIN, data2d["datalist"], **SMALL)({"image": str(one_slice)})["image"].shape) == (
        1,
        64,
        64,
    )


def test_one_slice_off_the_xy_plane_keeps_its_in_plane_spacing():
    """A one-slice volume whose slice is a sagittal plane (pixel axes along world y and z): 2D with the spacing of its
    own pixel axes, an invertible 2D affine (its x, y part of the world is singular)."""
    from bundle.data.images import single_slice_as_2d
    from monai.data import MetaTensor

    affine = np.array([[0, 0, 3.0, 1], [0.2, 0, 0, 2], [0, 0.3, 0, 3], [0, 0, 0, 1]])
    volume = MetaTensor(torch.rand(1, 20, 24, 1), affine=torch.as_tensor(affine), meta={"original_affine": affine})
    image = single_slice_as_2d(volume, 2)
    assert tuple(image.shape) == (1, 20, 24)
    np.testing.assert_allclose(image.meta["spacing"], [0.2, 0.3])
    np.testing.assert_allclose(np.asarray(image.affine), np.diag([0.2, 0.3, 1.0]))
    np.testing.assert_allclose(image.meta["original_affine"], np.diag([0.2, 0.3, 1.0]))
    assert single_slice_as_2d(volume, 3) is volume


def volume_datalist(tmp_path: Path, image: Path, landmarks=None) -> Path:
    item = {"image": str(image), "landmarks": landmarks or [[0.0, 0.0, 0.0], [10.0, 10.0, 10.0]]}
    return write_json(
        tmp_path / "ct.json", {"spatial_dims": 3, "landmark_names": ["a", "b"], "training": [item], "test": [item]}
    )


def test_2d_png_in_the_3d_configuration_is_refused(data2d, tmp_path):
    png = Path(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    pipeline = preprocessing(EVALUATE_3D, volume_datalist(tmp_path, png), image_size=[32, 32, 32])
    text = raises(pipeline, {"image": str(png)})
    assert (
        f"{png}: a 2D image (spatial shape [64, 72]), but this configuration expects 3D images (spatial_dims: 3)"
        in text
    )


def test_a_datalist_of_the_other_dimensionality_is_refused_naming_both(data2d, tmp_path):
    """A 2D datalist under the 3D configuration (and a 3D one under the 2D): refused when the datalist is read, with
    what to run instead (it was refused later as an image too small, or as landmarks of the wrong length)."""
    path = data2d["datalist"]
    parser = bundle_parser(config_files("train", spatial_dims=3), ROOT, datalist=str(path))
    text = raises(parser.get_parsed_content, "dataset")
    assert (
        f"DatalistError: {path}: a 2D datalist (spatial_dims: 2), but this configuration is 3D (spatial_dims: 3); 2D "
        "images need the 2D configuration (configs/train.yaml without configs/train_3d.yaml)" in text
    )
    volumes = volume_datalist(tmp_path, tmp_path / "ct.nii.gz")
    text = raises(bundle_parser(TRAIN, ROOT, datalist=str(volumes)).get_parsed_content, "dataset")
    assert "a 3D datalist (spatial_dims: 3), but this configuration is 2D (spatial_dims: 2); volumes need" in text


def test_nan_volume_in_3d_evaluation_is_refused_naming_it(tmp_path):
    data = np.random.default_rng(0).normal(size=(24, 24, 24)).astype(np.float32) * 100
    data[3, 4, 5] = np.nan
    data[6, 7, 8] = np.inf
    volume = tmp_path / "nan.nii.gz"
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0])), volume)
    pipeline = preprocessing(EVALUATE_3D, volume_datalist(tmp_path, volume), image_size=[32, 32, 32])
    text = raises(pipeline, {"image": str(volume)})
    assert f"{volume}: 2 of 13824 values are NaN or infinite" in text


def test_a_4d_volume_in_3d_evaluation_is_refused_naming_it(tmp_path):
    """Two contrasts in one NIfTI reached the network as two channels: a shape error naming no file."""
    data = np.random.default_rng(0).normal(size=(24, 24, 24, 2)).astype(np.float32) * 100
    volume = tmp_path / "two_contrasts.nii.gz"
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0])), volume)
    pipeline = preprocessing(EVALUATE_3D, volume_datalist(tmp_path, volume), image_size=[32, 32, 32])
    assert f"{volume}: a volume of 2 channels (a 4D file" in raises(pipeline, {"image": str(volume)})


def test_a_volume_not_in_hu_is_warned_about_and_a_ct_is_not(tmp_path):
    """Intensities scaled to [0, 1] under the CT window [-200, 400] HU are nearly constant: matching failed silently
    (16.7 mm on the probe's volume). Warned, naming the file, its range and the option to set; a CT in HU is not."""
    from bundle.data.synthetic import generate_synthetic_3d

    rng = np.random.default_rng(0)
    data = rng.random((24, 24, 24)).astype(np.float32)
    volume = tmp_path / "mri_scaled.nii.gz"
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0])), volume)
    ct = json.loads(generate_synthetic_3d(tmp_path / "ct", 1, 0, 0, shape=(32, 32, 32)).read_text())
    ct_volume = tmp_path / "ct" / ct["training"][0]["image"]
    pipeline = preprocessing(EVALUATE_3D, volume_datalist(tmp_path, volume), image_size=[32, 32, 32])
    with pytest.warns(UserWarning) as record:
        pipeline({"image": str(volume)})
        pipeline({"image": str(ct_volume)})
    warned = [str(w.message) for w in record if "intensity window" in str(w.message)]
    assert len(warned) == 1 and warned[0].startswith(
        f"{volume}: the intensity window [-200, 400] (hu_window) leaves it nearly constant (standard deviation 0.00"
    )
    assert "its values run from 0.00996 to 0.992 (1st to 99th percentile), not CT Hounsfield units" in warned[0]
    assert '--hu_window "[0.00996, 0.992]"' in warned[0] and "percentile window (docs/3d.md)" in warned[0]
    # the CT exported as 8-bit without its rescale (0-255): air is no longer at -1000 HU
    image = nib.load(str(ct_volume))
    hu = np.asarray(image.dataobj, dtype=np.float32)
    stored = np.round((hu - hu.min()) / (hu.max() - hu.min()) * 255).astype(np.uint8)
    nib.save(nib.Nifti1Image(stored, image.affine), tmp_path / "ct_uint8.nii.gz")
    with pytest.warns(UserWarning, match=re.escape("ct_uint8.nii.gz: no value below 0 under the Hounsfield window")):
        pipeline({"image": str(tmp_path / "ct_uint8.nii.gz")})


def test_real_world_picture_files_are_read_as_shown_or_refused_naming_them(data2d, tmp_path):
    """Files as X-ray pictures come: a JPEG turned by its EXIF orientation is read as a viewer (and labelme) shows
    it (it was read lying on its side, landmarks 500 px off); a multi-page TIFF is refused (its first page was read
    and the others dropped); macOS's hidden ``._*`` companions in an image folder are skipped (one stopped the run)."""
    from bundle.data.annotations import find_images
    from bundle.data.image_items import image_items
    from bundle.data.images import ImageError, load_image

    png = Path(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    picture = Image.open(png).convert("L")
    picture.save(tmp_path / "upright.jpg", quality=95)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    picture.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "turned.jpg", quality=95, exif=exif.tobytes())
    upright, turned = (np.asarray(load_image(str(tmp_path / f"{n}.jpg")), np.float64) for n in ("upright", "turned"))
    assert turned.shape == upright.shape == (64, 72) and np.abs(turned - upright).mean() < 2.0
    pages = tmp_path / "pages.tif"
    picture.save(pages, save_all=True, append_images=[picture.point(lambda v: 255 - v)])
    with pytest.raises(ImageError, match=re.escape(f"{pages}: a picture of 2 pages (a multi-page TIFF")):
        load_image(str(pages))
    camera = tmp_path / "camera.jpg"  # an MPO JPEG (a picture and its preview, as cameras write): the picture is read
    picture.save(camera, "MPO", quality=95, save_all=True, append_images=[picture.resize((16, 18))])
    assert Image.open(camera).n_frames == 2 and np.abs(np.asarray(load_image(str(camera))) - upright).mean() < 2.0
    folder = tmp_path / "studies"
    folder.mkdir()
    shutil.copy(png, folder / "a.png")
    (folder / "._a.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    assert image_items(None, folder) == [{"image": str(folder / "a.png")}]
    assert list(find_images(folder)) == ["a"]


def test_an_almost_flat_picture_is_warned_about_and_a_radiograph_is_not(data2d):
    """A hot pixel or a burned-in marker squeezes the rest of the image into a sliver of [0, 1] once scaled by its min
    and max, as does an image empty but for a few pixels: the landmarks were 500 to 1000 px off without a word."""
    from bundle.data.images import check_image

    png = Path(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    radiograph = np.asarray(Image.open(png).convert("L"), dtype=np.float32)[None] * 16  # a 12-bit range
    hot = radiograph.copy()
    hot[0, 0, 0] = 65535.0
    sparse = np.zeros_like(radiograph)
    sparse[0, 10, 10], sparse[0, 30, 40] = 255.0, 200.0
    with pytest.warns(UserWarning) as record:
        for name, image in (("radiograph", radiograph), ("hot", hot), ("sparse", sparse)):
            check_image(torch.from_numpy(image), 2, name=name)
    flat = [str(w.message) for w in record if "almost flat" in str(w.message)]
    assert [m.split(":")[0] for m in flat] == ["hot", "sparse"]
    assert flat[0].startswith("hot: 98 % of its values lie within 4.2 % of its range (0 to 2752 of 0 to 6.554e+04)")
    assert "A hot pixel, a burned-in marker or an almost empty image does this" in flat[1]


def test_a_datalist_written_on_windows_reads(data2d, tmp_path):
    """Relative image paths with backslashes (a datalist written on Windows) were 'file not found'."""
    content = json.loads(json.dumps(data2d["content"]))
    base = data2d["datalist"].parent
    for item in content["training"]:
        item["image"] = item["image"].replace("/", "\\")
    path = write_json(base / "windows.json", content)
    try:
        loaded = load_datalist(path)
    finally:
        path.unlink()
    assert "\\" in content["training"][0]["image"]
    expected = [str(base / item["image"]) for item in data2d["content"]["training"]]
    assert [item["image"] for item in loaded["training"]] == expected


# ---------------------------------------------------------------- landmarks outside the image


def test_landmark_far_outside_its_image_is_refused_in_test_items_and_templates(data2d, tmp_path):
    item = dict(data2d["content"]["test"][0])
    item["image"] = str(data2d["datalist"].parent / item["image"])
    item["landmarks"] = [list(p) for p in item["landmarks"]]
    item["landmarks"][3] = [4469.0, 20.0]
    name = data2d["content"]["landmark_names"][3]
    pipeline = preprocessing(EVALUATE, data2d["datalist"], **SMALL)
    expected = (
        f"landmark 3 ('{name}') [4469.0, 20.0] lies 4405.50 px (2202.75 mm) outside the image: "
        "the image's pixels span x in [-0.5, 63.5]"
    )
    assert f"{item['image']}: {expected}" in raises(pipeline, item)
    # the template: refused before any matching
    assert f"{item['image']}: template {expected}" in raises(prepare_template, item, pipeline)
    inside = dict(item, landmarks=[list(p) for p in data2d["content"]["test"][0]["landmarks"]])
    assert pipeline(inside)["label"].shape == (len(item["landmarks"]), 2)


def test_a_template_landmark_just_outside_is_refused_and_a_test_items_warned_about(data2d, tmp_path):
    """Within 5 % of the image (once accepted silently): a template's landmark outside its image is refused by the
    evaluating command, naming image, landmark and distance; a test item's ground truth there is warned about."""
    content = json.loads(variant(data2d, tmp_path).read_text())
    name = content["landmark_names"][0]
    template = dict(content["template"], landmarks=[[65.5, 20.0], *content["template"]["landmarks"][1:]])
    text = raises(evaluate, variant(data2d, tmp_path, template=template), tmp_path / "eval", data2d["ckpt"])
    assert (
        f"{template['image']}: template landmark 0 ('{name}') [65.5, 20.0] lies 2.00 px (1.00 mm) outside the image"
        in text
    )
    assert not (tmp_path / "eval").exists()
    test = [dict(content["test"][0], landmarks=[[10.0, -2.0], *content["test"][0]["landmarks"][1:]])]
    with pytest.warns(UserWarning) as record:
        evaluate(variant(data2d, tmp_path, test=test + content["test"][1:]), tmp_path / "eval", data2d["ckpt"])
    expected = f"{test[0]['image']}: landmark 0 ('{name}') [10.0, -2.0] lies 1.50 px (0.75 mm) outside the image"
    assert any(expected in str(w.message) for w in record), [str(w.message) for w in record]
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["n_images"] == len(content["test"])


def test_a_degenerate_template_is_refused_naming_why(data2d):
    """A template whose landmarks all lie at one place was matched as if it were real; as a test item it is scored."""
    item = dict(
        data2d["content"]["test"][0], image=str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    )
    item["landmarks"] = [[30.0, 31.0]] * len(item["landmarks"])
    pipeline = preprocessing(EVALUATE, data2d["datalist"], **SMALL)
    expected = f"{item['image']}: the template's {len(item['landmarks'])} landmarks lie at 1 distinct position(s)"
    assert expected in raises(prepare_template, item, pipeline)
    # inferring's template features and the MONAI Label app's saved labels (compute_template): the same check
    names = data2d["content"]["landmark_names"]
    assert expected in raises(compute_template, torch.nn.Identity(), [item], pipeline, names)
    assert pipeline(item)["label"].shape == (len(item["landmarks"]), 2)


# ---------------------------------------------------------------- configuration values


@pytest.mark.parametrize("mixing", ["foo", "MoCHi", "mix"])
def test_unknown_mixing_is_refused_naming_the_key(mixing):
    comparison = [*TRAIN, "scripts/experiments/configs/comparison.yaml"]  # the comparison methods' experiment
    for part in ("loss", "train#trainer#iteration_update"):  # neither trains the baseline in its place
        text = raises(bundle_parser(comparison, ROOT, mixing=mixing).get_parsed_content, part)
        assert f"mixing must be one of ['none', 'unmix', 'mochi', 'zhu'], got {mixing!r}" in text, part
    none = type(None)
    for mixing, (loss, step) in {
        "zhu": (FeatureTransformation, none),
        "unmix": (none, UnmixLoss),
        "none": (none, none),
    }.items():
        parser = bundle_parser(comparison, ROOT, mixing=mixing)
        assert type(parser.get_parsed_content("loss").feature_mixing) is loss
        assert type(parser.get_parsed_content("train#trainer#iteration_update").extra_loss) is step


def test_images_by_a_shell_wildcard_are_refused_not_cut_to_the_first(data2d, tmp_path):
    """``--images *.png`` as typed in a shell: the second file became MONAI's ``init_id`` and the command ran on the
    first image alone. Refused, naming the word and the quoting that works, before any output is written."""
    folder = tmp_path / "images"
    folder.mkdir()
    for item, name in zip(data2d["content"]["test"][:2], ("a.png", "b.png")):
        shutil.copy(data2d["datalist"].parent / item["image"], folder / name)
    config = ROOT / "configs" / "inference.yaml"
    line = f"'{sys.executable}' -m monai.bundle run inferring --config_file '{config}' --bundle_root '{ROOT}' "
    line += "--images *.png --output_dir out"
    done = subprocess.run(["bash", "-c", line], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "command line: ['b.png'] follow(s) no --key" in done.stderr.splitlines()[-1]
    assert "--images \"['a.png','b.png']\"" in done.stderr.splitlines()[-1]
    assert not (folder / "out").exists()


def test_an_unknown_key_on_the_command_line_is_refused_naming_the_closest(data2d, tmp_path):
    """``--gamma`` (for ``--sampling_gamma``) would be a new key nothing reads: refused before any work."""
    command = [sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", "configs/train.yaml"]
    command += ["--datalist", str(data2d["datalist"]), "--output_dir", str(tmp_path / "out"), "--gamma", "0.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "unknown config key(s) ['gamma'] on the command line (closest: --gamma: sampling_gamma" in done.stderr
    assert not (tmp_path / "out").exists()
    # an argument added to a component of the config is a MONAI override, not a typo
    main = str(Path(sys.executable).parent / "monai" / "bundle" / "__main__.py")  # how argv[0] reads under -m
    check_command_line(
        [main, "run", "training", "--config_file", str(ROOT / TRAIN[0]), "--train#dataloader#drop_last", "1"]
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"target_spacing": [2, 2]}, "target_spacing: expected 3 positive numbers, got [2, 2]"),
        ({"target_spacing": [0, 2, 2]}, "target_spacing: expected 3 positive numbers, got [0, 2, 2]"),
        ({"hu_window": [400, -200]}, "hu_window: expected low < high, got [400, -200]"),
        ({"hu_window": [0, 0]}, "hu_window: expected low < high, got [0, 0]"),
    ],
)
def test_a_3d_spacing_or_ct_window_monai_would_bend_is_refused_naming_the_key(override, expected):
    """MONAI's Spacingd pads a short spacing and ignores a zero; a reversed window inverts the contrast."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        bundle_parser(config_files("train", spatial_dims=3), ROOT, **override)


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--epochs"], "--epochs needs a value (--epochs VALUE; the config's is 10)"),
        (["--max_templates", "two"], "--max_templates: expected an integer as the config's 32, got 'two'"),
        (["--max_templates=2.7"], "--max_templates: expected an integer as the config's 32, got '2.7'"),
        (["--learning_rate", "fast"], "--learning_rate: expected a number as the config's 0.001, got 'fast'"),
        (["--temperature", "--epochs", "2"], "--temperature needs a value"),
        (["--max_templates", "null"], None),
        (["--entropy_sampling"], None),
        (["--rotate_range", "7.5", "--epochs", "2", "--learning_rate", "1e-3"], None),
        (["--seed", "-1", "--output_dir=out"], None),
        (["initialize", "--epochs", "2"], None),  # MONAI's init_id: an item of the config
        (["--", "extra"], None),
        # a shell wildcard's second file, an unquoted space: Fire would give the word to init_id and run without it
        (["--output_dir", "my", "folder", "--epochs", "2"], "command line: ['folder'] follow(s) no --key: each value"),
        (["--datalist", "a.json", "b.json"], "A shell wildcard (--images *.png) or a space in a value splits it"),
    ],
)
def test_a_value_missing_or_not_a_number_where_the_config_has_one_is_refused_before_any_work(override, expected):
    """MONAI's command line makes ``--epochs`` alone ``True`` (one epoch) and passes ``two`` on as text."""
    main = str(Path(sys.executable).parent / "monai" / "bundle" / "__main__.py")  # how argv[0] reads under -m
    argv = [main, "run", "training", "--config_file", str(ROOT / TRAIN[0]), *override]
    if expected is None:
        check_command_line(argv)
    else:
        with pytest.raises(ValueError, match=re.escape(expected)):
            check_command_line(argv)


def test_a_command_line_is_read_once_however_many_steps_check_it(monkeypatch):
    """The configs' ``initialize`` step and the command's first step both check the command line: the config files
    are read for the first, and a refused command line is refused at every call."""
    from monai.bundle import ConfigParser

    main = str(Path(sys.executable).parent / "monai" / "bundle" / "__main__.py")
    argv = [
        main,
        "run",
        "training",
        "--config_file",
        str(ROOT / TRAIN[0]),
        "--epochs",
        "7",
        "--learning_rate",
        "4.2e-4",
    ]
    reads, read = [], ConfigParser.read_config
    monkeypatch.setattr(ConfigParser, "read_config", lambda self, files: reads.append(files) or read(self, files))
    check_command_line(argv)
    check_command_line(argv)
    assert len(reads) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="--epochs: expected an integer"):
            check_command_line([*argv, "--epochs", "seven"])


def test_a_script_refuses_an_unknown_option_or_one_without_a_value_before_it_writes(tmp_path, capsys):
    """Fire would run ``build`` / ``labelme`` with the defaults and report the misspelled option afterwards, its
    output written (a shipped template file overwritten), and make ``--spacing`` alone a spacing of 1."""
    from scripts import build_template
    from scripts.cli import checked_options, run_fire

    out = tmp_path / "template_features.pt"
    with pytest.raises(SystemExit) as exit_:
        run_fire(build_template.build, ["--datalist", "x.json", "--output", str(out), "--templtes", "['a']"])
    assert exit_.value.code == 2 and not out.exists()
    assert "build: unknown option --templtes (closest: --templates" in capsys.readouterr().err
    datalist = tmp_path / "datalist.json"
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main(["labelme", str(tmp_path), str(datalist), "--names", "isbi", "--spacing"])
    assert exit_.value.code == 2 and not datalist.exists()
    assert "labelme: --spacing needs a value (--spacing VALUE)" in capsys.readouterr().err
    # yes/no options may stand alone (Fire's --flag / --noflag), hyphens name the same option
    for args in (["--keep_held_out_images"], ["--nokeep_held_out_images"], ["--validation-fraction", "0.1"]):
        assert checked_options(prepare_data.labelme, args)[1] == []
    # a yes/no option's words are read as the configs read them: Fire took "no" (a non-empty string) as true
    assert checked_options(prepare_data.labelme, ["--keep_held_out_images", "no", "--seed", "1"]) == (
        ["--keep_held_out_images", "False", "--seed", "1"],
        [],
    )
    assert checked_options(prepare_data.labelme, ["--keep-held-out-images=YES"])[0] == ["--keep_held_out_images=True"]
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main(["labelme", str(tmp_path), str(datalist), "--keep_held_out_images", "maybe"])
    assert exit_.value.code == 2 and not datalist.exists()
    assert "--keep_held_out_images: expected true/false/yes/no/1/0, got 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("learning_rate", float("nan"), "learning_rate: expected a finite number >= 0, got nan"),
        ("learning_rate", -0.1, "learning_rate: expected a finite number >= 0, got -0.1"),
        ("learning_rate", True, "learning_rate: expected a finite number >= 0, got True"),
        ("embed_dim", 0, "embed_dim: expected an integer >= 1, got 0"),
        ("epochs", 0, "epochs: expected an integer >= 1, got 0"),
        ("epoch_length", 0, "epoch_length: expected an integer >= 1, got 0"),
        ("val_interval", 0, "val_interval: expected an integer >= 1, got 0"),
        ("batch_size", -4, "batch_size: expected an integer >= 1, got -4"),
        ("sampling_gamma", float("nan"), "sampling_gamma: expected a finite number >= 0, got nan"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_key(key, value, expected):
    """Refused as the command starts (bundle.settings.SETTINGS), before anything is built."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        bundle_parser(TRAIN, ROOT, **{key: value})


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(crop_size=[16, 16], batch_size=1), "crop_size: [16, 16] with batch_size 1 gives one coarsest feature"),
        (dict(crop_size=[20, 20]), "crop_size: expected 2 positive integers (the network grid), each divisible by 16"),
        (dict(crop_size=[256, 256]), "crop_size: [256, 256] is larger than image_size [192, 192]"),
    ],
)
def test_crop_sizes_the_network_cannot_train_on_are_refused_naming_the_key(overrides, expected):
    """(crop_size 16 with batch_size 1 failed in BatchNorm, naming neither key.)"""
    assert expected in raises(bundle_parser(TRAIN, ROOT, **overrides).get_parsed_content, "train#view_pair_transforms")


def test_unknown_template_rule_is_refused_with_built_in_templates():
    parser = bundle_parser(["configs/inference.yaml"], ROOT, template_rule="nearest")
    text = raises(parser.get_parsed_content, "template")
    assert "template rule must be one of ('landmarks', 'features'), got 'nearest'" in text


def test_zero_image_size_is_refused_naming_the_key(data2d):
    text = raises(preprocessing, TRAIN, data2d["datalist"], image_size=[0, 0])
    assert (
        "image_size: expected 2 positive integers (the network grid), each divisible by 16" in text and "[0, 0]" in text
    )
    assert check_image_size([64, 96], 2) == [64, 96]
    with pytest.raises(ValueError, match=r"image_size: expected 3 positive integers .* got \[64, 64\]"):
        check_image_size([64, 64], 3)


def test_images_given_as_one_string_is_one_image(data2d, tmp_path):
    png = str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    parser = bundle_parser("configs/inference.yaml", ROOT, images=png)
    assert parser.get_parsed_content("dataset").data == [{"image": png}]
    # `--images null` (the command line gives the text): the dataset_dir's images, not a file named 'null'
    folder = str(Path(png).parent)
    parser = bundle_parser("configs/inference.yaml", ROOT, images="null", dataset_dir=folder)
    assert parser.get_parsed_content("dataset").data == image_items(None, folder) != []
    with pytest.raises(FileNotFoundError, match=r"images not found: \['a.png,b.png'\]"):
        image_items("a.png,b.png", tmp_path)
    # a list the command line could not read (a ' in a name ends the quoted name): the quoting that works is named
    with pytest.raises(FileNotFoundError, match=re.escape("""--images "[\\"it's.png\\"]\"""")):
        image_items("['it's.png','b.png']", tmp_path)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("case", ["empty", "truncated", "list", "int_keys", "text", "nan"])
def test_unusable_checkpoints_are_refused_naming_the_file(data2d, tmp_path, case):
    path = tmp_path / f"{case}.pt"
    if case == "empty":
        path.write_bytes(b"")
        expected = f"checkpoint {path} is empty (0 bytes)"
    elif case == "truncated":
        data = data2d["ckpt"].read_bytes()
        path.write_bytes(data[: len(data) // 3])
        expected = f"checkpoint {path} ({len(data) // 3} bytes) is not a readable PyTorch checkpoint"
    elif case == "list":
        torch.save([torch.zeros(2)], path)
        expected = f"checkpoint {path} holds a list, not a dict"
    elif case == "int_keys":
        torch.save({101: torch.zeros(2), "a": 3}, path)
        expected = f"checkpoint {path} is not a state dict (names -> tensors): entries ['101', \"'a'\"]"
    elif case == "nan":  # what a diverged training saved
        state = torch.load(data2d["ckpt"], weights_only=True)
        state = state.get("model", state)
        name = next(k for k, v in state.items() if v.is_floating_point())
        state[name] = torch.full_like(state[name], float("nan"))
        torch.save(state, path)
        expected = f"checkpoint {path} holds non-finite weights (NaN or inf) in ['{name}']"
    else:
        path.write_text("not a checkpoint")
        expected = f"checkpoint {path} (16 bytes) is not a readable PyTorch checkpoint"
    with pytest.raises(CheckpointError) as info:
        load_weights(ContrastiveLandmarkNet(spatial_dims=2), path)
    assert expected in str(info.value)


def test_a_folder_given_as_checkpoint_is_named_as_a_folder(tmp_path):
    with pytest.raises(IsADirectoryError, match=re.escape(f"checkpoint {tmp_path} is a folder: give the checkpoint")):
        load_weights(ContrastiveLandmarkNet(spatial_dims=2), tmp_path)


def test_unusable_resume_checkpoints_are_refused_naming_the_file(data2d, tmp_path):
    network = ContrastiveLandmarkNet(spatial_dims=2)

    def resume(path: Path) -> str:
        engine = Engine(lambda e, b: None)
        ResumeCheckpointLoader(load_path=str(path), load_dict={"model": network}).attach(engine)
        return raises(engine.run, [0], max_epochs=1)

    empty = tmp_path / "last.pt"
    empty.write_bytes(b"")
    assert f"resume checkpoint {empty} is empty (0 bytes)" in resume(empty)
    message = resume(data2d["ckpt"])  # a weights file: a state dict of many tensors
    assert f"resume checkpoint {data2d['ckpt']} lacks ['model', 'trainer']" in message
    assert " more): resume from the last.pt" in message and len(message) < 1000  # not every tensor's name


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_checkpoint_writes_go_through_unique_temporaries_and_ignore_killed_leftovers(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    # what a write killed by SIGKILL leaves: a 0-byte temporary of a process that is gone (and ignite's old style)
    leftover = models / f".last.pt.{dead_pid()}.abcd1234.tmp"
    leftover.write_bytes(b"")
    (models / "tmpq1w2e3r4").write_bytes(b"")
    assert resume_path(models, True) is None  # a temporary is never taken for last.pt

    network = torch.nn.Linear(2, 2)
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(
        "bundle.io_utils.os.replace",
        lambda src, dst: (replaced.append((Path(src), Path(dst))), real_replace(src, dst))[1],
    )
    saver = LastCheckpointSaver(models / "last.pt", {"model": network}, engine_key=None)
    saver(Engine(lambda e, b: None))
    saver(Engine(lambda e, b: None))
    assert resume_path(models, True) == str(models / "last.pt")
    assert torch.load(models / "last.pt", weights_only=True)["model"].keys() == network.state_dict().keys()
    assert not leftover.exists(), "the killed writer's temporary was not cleaned up"
    (src1, dst1), (src2, dst2) = replaced
    assert dst1 == dst2 == models / "last.pt" and src1 != src2 and src1.parent == models
    assert src1.name.startswith(f".last.pt.{os.getpid()}.") and src1.name.endswith(".tmp")  # hidden, never *.pt

    # a write that fails half-way keeps the previous checkpoint and leaves no temporary
    before = (models / "last.pt").read_bytes()

    def broken(obj, path):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_atomically({"x": torch.zeros(1)}, models / "last.pt", save=broken)
    assert (models / "last.pt").read_bytes() == before
    assert sorted(p.name for p in models.iterdir()) == ["last.pt", "tmpq1w2e3r4"]

    # a full disk: torch.save's "unexpected pos" becomes an error naming the file, the previous one kept
    def full(obj, path):
        Path(path).write_bytes(b"part")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 490")

    with pytest.raises(
        CheckpointError,
        match=rf"cannot write checkpoint {re.escape(str(models / 'last.pt'))} \(the "
        r"previous one, if any, is kept\); \d+ MiB free there: RuntimeError: .*unexpected pos",
    ):
        save_atomically({"x": torch.zeros(1)}, models / "last.pt", save=full)
    assert (models / "last.pt").read_bytes() == before
    assert sorted(p.name for p in models.iterdir()) == ["last.pt", "tmpq1w2e3r4"]


# ---------------------------------------------------------------- output folders: all old or all new


def test_failed_evaluation_keeps_the_previous_outputs_unmixed(data2d, tmp_path):
    out = tmp_path / "eval"
    evaluate(data2d["datalist"], out, data2d["ckpt"])
    before = snapshot(out)
    assert {"metrics.json", "predictions.csv", "sdr_curve.png"} <= set(before) and any(
        k.startswith("overlays/") for k in before
    )

    # the second test image breaks after the first one's overlay was drawn
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    content = json.loads(variant(data2d, tmp_path).read_text())
    content["test"][1]["image"] = str(broken)
    datalist = write_json(tmp_path / "broken.json", content)
    text = raises(evaluate, datalist, out, data2d["ckpt"])
    assert f"cannot read image {broken}" in text
    assert snapshot(out) == before
    assert staging_leftovers(out) == []

    # a successful run replaces the whole report: no overlay of the earlier run survives
    content["test"] = content["test"][:1]
    evaluate(write_json(tmp_path / "one.json", content), out, data2d["ckpt"])
    after = snapshot(out)
    assert sorted(k for k in after if k.startswith("overlays/")) == ["overlays/test_000.png"]
    assert json.loads(after["metrics.json"])["n_images"] == 1
    assert staging_leftovers(out) == []


def test_an_evaluation_replaces_only_the_files_runs_write(data2d, tmp_path):
    """A user's files in the output folder (a 3D Slicer markup, a figure among the overlays) outlive every run."""
    out = tmp_path / "eval"
    (out / "overlays").mkdir(parents=True)
    (out / "case1.mrk.json").write_text("{}")
    (out / "overlays" / "my_figure.png").write_bytes(b"mine")
    evaluate(data2d["datalist"], out, data2d["ckpt"])
    content = json.loads(variant(data2d, tmp_path).read_text())
    content["test"] = content["test"][1:2]
    evaluate(write_json(tmp_path / "second.json", content), out, data2d["ckpt"])
    after = snapshot(out)
    assert after["case1.mrk.json"] == b"{}" and after["overlays/my_figure.png"] == b"mine"
    runs = sorted(k for k in after if k.startswith("overlays/") and k != "overlays/my_figure.png")
    assert runs == ["overlays/test_001.png"] and json.loads(after["metrics.json"])["n_images"] == 1
    assert staging_leftovers(out) == []


def staged_run(out: Path, files: dict[str, bytes]):
    """A run's StagedOutputs of ``out`` with ``files`` (relative name -> bytes) written into its staging folder."""
    from bundle.io_utils import StagedOutputs

    staging = StagedOutputs(out)
    for name, content in files.items():
        (staging.folder / name).parent.mkdir(parents=True, exist_ok=True)
        (staging.folder / name).write_bytes(content)
    return staging


@pytest.mark.parametrize("manifest", ["a list of names", "a wrong record"])
def test_a_manifest_is_not_trusted_to_remove_a_users_file(tmp_path, manifest):
    """Every relative path .outputs.json listed was deleted by the next run: a hand-written one, or a previous run's
    edited, removed the user's data. A file is now removed only with the size and SHA-256 recorded by the run."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "mydata.csv").write_bytes(b"mine")
    listed = ["mydata.csv"] if manifest == "a list of names" else {"mydata.csv": {"size": 4, "sha256": "0" * 64}}
    write_json(out / ".outputs.json", {"files": listed})
    staged_run(out, {"metrics.json": b"{}"}).commit()
    assert snapshot(out) == {
        "mydata.csv": b"mine",
        "metrics.json": b"{}",
        ".outputs.json": snapshot(out)[".outputs.json"],
    }
    assert staging_leftovers(out) == []


def test_a_previous_output_changed_since_is_left_alone(tmp_path, caplog):
    """A run's own output that the user edited (or hard-linked, then edited through the link) is theirs now: the next
    run leaves it, with a warning naming it, and refuses to replace it."""
    out = tmp_path / "eval"
    staged_run(out, {"predictions.csv": b"run 1", "notes.csv": b"run 1", "sdr_curve.png": b"run 1"}).commit()
    (out / "notes.csv").write_bytes(b"edited by the user")
    os.link(out / "sdr_curve.png", tmp_path / "kept.png")  # a hard link: replacing the entry keeps its bytes
    with caplog.at_level(logging.WARNING, logger="bundle.io_utils"):
        staged_run(out, {"predictions.csv": b"run 2", "sdr_curve.png": b"run 2"}).commit()
    assert f"{out / 'notes.csv'}: an earlier run's output, changed since: left as it is" in caplog.text
    after = snapshot(out)
    assert (
        after["notes.csv"] == b"edited by the user" and after["predictions.csv"] == after["sdr_curve.png"] == b"run 2"
    )
    assert (tmp_path / "kept.png").read_bytes() == b"run 1"
    staging = staged_run(out, {"notes.csv": b"run 3"})
    with pytest.raises(FileExistsError, match=re.escape(f"{out / 'notes.csv'}: the run would replace this file")):
        staging.commit()
    assert snapshot(out) == after and staging_leftovers(out) == []


def test_a_full_disk_leaves_the_previous_outputs_and_their_manifest(small_disk):
    """The manifest was written after the new outputs had replaced the old ones: on a full disk the old ones were
    gone, the new ones stood under the old manifest (unprovable: the next run refused to replace them). Now the
    manifest is written first: the failure names it and output_dir is left as it was."""
    out = small_disk / "eval"
    staged_run(out, {"predictions.csv": b"run 1"}).commit()
    before = snapshot(out)
    staging = staged_run(out, {"predictions.csv": b"run 2"})
    with open(small_disk / "filler", "wb", buffering=0) as filler:  # the disk filled up
        with pytest.raises(OSError, match="No space left"):
            while True:
                filler.write(b"\0" * 65536)
    with pytest.raises(OSError, match=re.escape(f"{out / '.outputs.json'} not written (No space left on device)")):
        staging.commit()
    assert snapshot(out) == before and staging_leftovers(out) == []
    (small_disk / "filler").unlink()
    staged_run(out, {"predictions.csv": b"run 3"}).commit()
    assert snapshot(out)["predictions.csv"] == b"run 3"


def test_concurrent_commits_leave_one_runs_outputs(tmp_path):
    """Run 2 read the manifest, run 1 committed, run 2 moved its outputs in: run 1's other file was left under run
    2's manifest (outputs of two runs mixed). Now a commit waits for the other one: the last run's files alone."""
    import threading

    out = tmp_path / "eval"
    staged_run(out, {"predictions.csv": b"run 0", "overlays/a.png": b"run 0"}).commit()
    run1 = staged_run(out, {"predictions.csv": b"run 1", "overlays/b.png": b"run 1"})
    run2 = staged_run(out, {"predictions.csv": b"run 2"})
    other = threading.Thread(target=run1.commit)
    moves = run2._new_manifest

    @contextlib.contextmanager
    def run1_commits_meanwhile(files):  # run 2 has read the previous outputs, nothing moved yet
        other.start()
        other.join(timeout=5)  # without a lock run 1 is done here
        with moves(files) as tmp:
            yield tmp

    run2._new_manifest = run1_commits_meanwhile
    run2.commit()
    other.join()
    after = snapshot(out)
    manifest = json.loads(after.pop(".outputs.json"))["files"]
    assert after == {"predictions.csv": b"run 1", "overlays/b.png": b"run 1"} and sorted(manifest) == sorted(after)
    assert staging_leftovers(out) == []


@pytest.mark.parametrize("link", ["overlays folder", "metrics file"])
def test_no_output_is_written_or_removed_through_a_link(tmp_path, link):
    """An overlays folder linked to another folder got the overlays written there, and a later run without overlays
    deleted files from it (those the manifest listed); now a link on the way is refused, naming it, nothing moved."""
    out, elsewhere = tmp_path / "eval", tmp_path / "elsewhere"
    staged_run(out, {"metrics.json": b"run 1", "overlays/a.png": b"run 1"}).commit()
    if link == "overlays folder":  # the user moves the overlays away and links them back
        (out / "overlays").rename(elsewhere)
        (out / "overlays").symlink_to(elsewhere, target_is_directory=True)
        linked, second = out / "overlays", {"metrics.json": b"run 2"}  # a run with --overlays false
    else:
        elsewhere.mkdir()
        (elsewhere / "metrics.json").write_bytes(b"run 1")
        (out / "metrics.json").unlink()
        (out / "metrics.json").symlink_to(elsewhere / "metrics.json")
        linked, second = out / "metrics.json", {"metrics.json": b"run 2", "overlays/a.png": b"run 2"}
    before, theirs = snapshot(out), snapshot(elsewhere)
    staging = staged_run(out, second)
    with pytest.raises(FileExistsError, match=re.escape(f"{linked}: a symbolic link in output_dir {out}")):
        staging.commit()
    with pytest.raises(FileExistsError, match=re.escape(f"{linked}: a symbolic link") + ".*choose another output_dir"):
        staging.check(["metrics.json"])  # what the writer calls before its work
    assert snapshot(out) == before and snapshot(elsewhere) == theirs and staging_leftovers(out) == []


def test_a_users_file_the_run_would_write_is_refused(tmp_path):
    """A user's overlays/005.png, a name the run writes but never wrote there, was replaced without a word."""
    out = tmp_path / "eval"
    (out / "overlays").mkdir(parents=True)
    (out / "overlays" / "005.png").write_bytes(b"mine")
    staging = staged_run(out, {"metrics.json": b"{}", "overlays/004.png": b"new", "overlays/005.png": b"new"})
    message = re.escape(f"{out / 'overlays' / '005.png'}: the run would replace this file, which no run of this bundle")
    with pytest.raises(FileExistsError, match=message + ".*remove it or choose another output_dir"):
        staging.commit()
    with pytest.raises(FileExistsError, match=message):
        staging.check(["metrics.json", "overlays/005.png"])  # what the writer calls before its work
    assert snapshot(out) == {"overlays/005.png": b"mine"} and staging_leftovers(out) == []


def test_an_evaluation_refuses_a_users_file_it_would_replace(data2d, tmp_path):
    """End to end: a user's overlay-named file is refused naming it (as the image comes, before the report is
    written), the file intact and no report moved in."""
    out = tmp_path / "eval"
    (out / "overlays").mkdir(parents=True)
    (out / "overlays" / "test_001.png").write_bytes(b"mine")
    text = raises(evaluate, data2d["datalist"], out, data2d["ckpt"])
    assert f"{out / 'overlays' / 'test_001.png'}: the run would replace this file" in text
    assert "remove it or choose another output_dir" in text
    assert snapshot(out) == {"overlays/test_001.png": b"mine"} and staging_leftovers(out) == []


def test_inferring_refuses_a_users_provenance_json_before_the_work(data2d, tmp_path, monkeypatch):
    """A user's provenance.json in output_dir was refused only when the report moved in, after every prediction
    (every other output name is checked as soon as it is known); a folder at an output name was called a file."""
    from bundle.handlers.report import LandmarkReportHandler

    collected = []
    monkeypatch.setattr(LandmarkReportHandler, "collect", lambda self, engine: collected.append(engine))
    out = tmp_path / "inference"
    out.mkdir()
    (out / "provenance.json").write_text("mine")
    png = str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    text = raises(infer, [png], out, data2d["ckpt"], datalist=str(data2d["datalist"]), image_size=[64, 64])
    assert f"{out / 'provenance.json'}: the run would replace this file, which no run" in text
    assert collected == [] and snapshot(out) == {"provenance.json": b"mine"} and staging_leftovers(out) == []
    (out / "provenance.json").unlink()
    (out / "predictions.csv").mkdir()
    text = raises(infer, [png], out, data2d["ckpt"], datalist=str(data2d["datalist"]), image_size=[64, 64])
    assert f"{out / 'predictions.csv'}: a folder where the run writes the file predictions.csv: remove it" in text
    assert collected == [] and staging_leftovers(out) == []


def test_an_output_dir_that_is_a_file_is_refused_before_the_run(tmp_path):
    """It failed at the very end, after every prediction, with a bare FileExistsError."""
    from bundle.io_utils import StagedOutputs

    existing = tmp_path / "results"
    existing.write_text("a user's file")
    with pytest.raises(NotADirectoryError, match=re.escape(f"output_dir {existing}: a file, not a folder")):
        StagedOutputs(existing)
    assert existing.read_text() == "a user's file"


def test_an_output_folder_on_another_file_system_gets_its_report(data2d, tmp_path):
    """An output folder linked to (or mounted from) another disk: the report is staged on that disk, where the
    final renames can reach it (they failed with a cross-device error after the whole evaluation)."""
    other = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    if other is None or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system here")
    try:
        (tmp_path / "eval").symlink_to(other, target_is_directory=True)
        evaluate(data2d["datalist"], tmp_path / "eval", data2d["ckpt"])
        assert {"metrics.json", "predictions.csv", "sdr_curve.png"} <= {p.name for p in other.iterdir()}
        assert not [p.name for p in other.iterdir() if p.name.endswith(".staging")]
        assert staging_leftovers(tmp_path / "eval") == []
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_built_in_template_features_of_other_weights_are_refused(data2d, tmp_path):
    """The shipped template features with another checkpoint: every match would be wrong (it only warned)."""
    png = str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    text = raises(infer, [png], tmp_path / "out", data2d["ckpt"])
    assert "template_features.pt holds template features computed with other weights than" in text
    assert str(data2d["ckpt"]) in text and "--datalist" in text
    assert not (tmp_path / "out").exists()


def test_template_without_landmarks_fails_before_inference_leaving_outputs(data2d, tmp_path):
    out = tmp_path / "inference"
    out.mkdir()
    (out / "predictions.csv").write_text("old\n")
    template = dict(data2d["content"]["template"], landmarks=[None] * len(data2d["content"]["landmark_names"]))
    template["image"] = str(data2d["datalist"].parent / template["image"])
    datalist = variant(data2d, tmp_path, template=template, templates=[])
    png = str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    text = raises(infer, [png], out, data2d["ckpt"], datalist=str(datalist), image_size=[64, 64])
    assert f"{datalist}:template: a template must carry 'landmarks', at least one of them not null" in text
    assert snapshot(out) == {"predictions.csv": b"old\n"} and staging_leftovers(out) == []


# ---------------------------------------------------------------- prepare_data


def test_prepare_data_refuses_a_truncated_png(tmp_path, capsys):
    root = tmp_path / "hand"
    (root / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in (1, 2):
        Image.fromarray(rng.integers(0, 255, (40, 30), dtype=np.uint8)).save(root / "images" / f"{i}.png")
    data = (root / "images" / "2.png").read_bytes()
    (root / "images" / "2.png").write_bytes(data[: len(data) // 2])
    (root / "all.csv").write_text("1,3,4\n2,5,6\n")
    out = tmp_path / "datalist.json"
    with pytest.raises(SystemExit):
        prepare_data.main(["hand", str(root), str(out), "--spacing", "[0.1,0.1]"])
    err = capsys.readouterr().err
    assert (
        "1 image(s) or landmark(s) cannot be used; no datalist written" in err
        and f"cannot read image {root / 'images' / '2.png'}" in err
    )
    assert "image file is truncated" in err and not out.exists()


def test_prepare_data_refuses_a_landmark_outside_its_image(tmp_path, capsys):
    """prepare_data refuses a landmark outside its image at all, by the pipeline's rule (its extent and rounding,
    naming the distance): one on the image's edge, within a rounding of it, is inside."""
    root = tmp_path / "hand"
    (root / "images").mkdir(parents=True)
    for i in (1, 2):
        Image.fromarray(np.full((40, 30), 9 * i, dtype=np.uint8)).save(root / "images" / f"{i}.png")
    (root / "all.csv").write_text("1,3,4\n2,29.5000001,39.5\n")  # image 2's landmark on its edge: inside
    prepare_data.main(["hand", str(root), str(tmp_path / "ok.json"), "--spacing", "[0.1,0.1]"])
    (root / "all.csv").write_text("1,3,4\n2,300,4\n")
    with pytest.raises(SystemExit):
        prepare_data.main(["hand", str(root), str(tmp_path / "bad.json"), "--spacing", "[0.1,0.1]"])
    err = capsys.readouterr().err
    assert f"{root / 'images' / '2.png'}: landmark" in err and "at [300.0, 4.0] lies outside the 30 x 40 image" in err
    assert "(270.50 px beyond its pixels' extent, [-0.5, size - 0.5])" in err
    assert not (tmp_path / "bad.json").exists()


# ---------------------------------------------------------------- the command line: the cause is the last line


def test_hook_repeats_the_cause_of_a_wrapped_config_error_only():
    from bundle.command_errors import report_cause_last

    seen, printed = [], []

    def previous(*args):
        seen.append(args)

    def report(error):
        buffer = io.StringIO()
        with contextlib.redirect_stderr(buffer):
            report_cause_last(type(error), error, None, previous=previous)
        printed.append(buffer.getvalue())

    def chain(*errors):
        """``errors[0]`` raised from ``errors[1]``, raised from ``errors[2]``, ..."""
        for outer, inner in zip(errors, errors[1:]):
            outer.__cause__ = inner
        return errors[0]

    def wrapped(message):
        # the bundle's message (naming the file) raised from the library's error, under MONAI's transform wrapper
        bundle_error = chain(ValueError("cannot read image x.png: OSError: truncated"), OSError("truncated"))
        return chain(RuntimeError(message), RuntimeError("applying transform <LoadImaged>"), bundle_error)

    report(wrapped("Failed to evaluate ConfigExpression: $f(1)"))
    report(wrapped("Failed to instantiate component 'x' with keywords: a"))
    report(chain(RuntimeError("Failed to evaluate ConfigExpression: $f(1)"), FileNotFoundError("x.json: no such file")))
    report(wrapped("something else failed"))
    report(RuntimeError("Failed to evaluate ConfigExpression: $f(1)"))  # nothing underneath
    assert len(seen) == 5  # the usual report always comes first
    assert printed[:2] == ["\nThe cause (above): ValueError: cannot read image x.png: OSError: truncated\n"] * 2
    assert printed[2:] == ["\nThe cause (above): FileNotFoundError: x.json: no such file\n", "", ""]


def test_bundle_command_ends_on_the_message_naming_the_file(data2d, tmp_path):
    datalist = variant(data2d, tmp_path, test=[])
    command = [sys.executable, "-m", "monai.bundle", "run", "evaluating", "--config_file", str(EVALUATE)]
    command += ["--bundle_root", str(ROOT), "--datalist", str(datalist), "--output_dir", str(tmp_path / "eval")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    # an empty test list: one line saying how to make one, no traceback
    assert last.startswith(f"EmptySectionError: {datalist}: the 'test' list is empty"), last
    assert "prepare_data ... --test IDS" in last and "Traceback" not in result.stderr, result.stderr[-3000:]
    # an unreadable image: the bundle's message naming it, not the readers' errors it was raised from
    empty = tmp_path / "empty.png"
    empty.touch()
    command = [sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file", "configs/inference.yaml"]
    command += ["--images", f"['{empty}']", "--output_dir", str(tmp_path / "inferred")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and not (tmp_path / "inferred").exists()
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"The cause (above): ImageError: cannot read image {empty} (empty file, 0 bytes)"), last


@pytest.mark.parametrize("device", ["meta", "xla", "hpu"])
def test_a_device_type_the_bundle_does_not_run_on_is_refused_naming_it(device):
    """``--device meta`` (tensors without data) was taken, and the run failed later on its first tensor copy."""
    with pytest.raises(ValueError, match=re.escape(f"device {device!r}: the bundle runs on cpu, cuda (cuda:N) or mps")):
        check_device(device)


def test_a_device_or_thread_count_this_machine_lacks_is_named_not_blamed_on_the_checkpoint(data2d, tmp_path):
    """``--device cuda`` without a CUDA GPU was reported as "not a readable PyTorch checkpoint" and ``--cpu_threads
    100000`` crashed evaluating (a segmentation fault): the device is refused naming the key before the checkpoint
    is read, by evaluating and inferring; the thread count is lowered to the CPUs there are, with a warning naming
    the key."""
    from bundle.settings import available_cpus

    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"  # a GPU it lacks
    image = str(data2d["datalist"].parent / data2d["content"]["test"][0]["image"])
    evaluating = [sys.executable, "-m", "monai.bundle", "run", "evaluating", "--config_file", str(EVALUATE)]
    evaluating += [
        "--bundle_root",
        str(ROOT),
        "--datalist",
        str(data2d["datalist"]),
        "--ckpt_path",
        str(data2d["ckpt"]),
    ]
    evaluating += ["--image_size", "[64, 64]", "--progress_bar", "false", "--overlays", "false"]
    inferring = [sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file", "configs/inference.yaml"]
    inferring += ["--images", f"['{image}']"]
    for command in (evaluating, inferring):
        out = tmp_path / command[4]
        line = [*command, "--output_dir", str(out), "--device", device]
        result = subprocess.run(line, cwd=ROOT, capture_output=True, text=True, timeout=300)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode != 0 and not out.exists(), result.stderr[-2000:]
        assert last.startswith(f"The cause (above): ValueError: device '{device}': this machine has"), last
        assert "checkpoint" not in last, last
    line = [*evaluating, "--output_dir", str(tmp_path / "threads"), "--cpu_threads", "100000"]
    result = subprocess.run(line, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cpus = available_cpus()
    warned = f"cpu_threads 100000: more than the {cpus} CPUs this process may use; {cpus} threads are used"
    assert warned in result.stdout + result.stderr  # the log goes to stdout (configs/logging.conf)
    assert (tmp_path / "threads" / "metrics.json").is_file()


@pytest.mark.parametrize("thresholds", [2, "ab", [1, "x"], [4, 2], [1, float("nan")]])
def test_iie_thresholds_that_are_not_two_increasing_numbers_are_refused_naming_them(thresholds):
    from bundle.information_groups import check_thresholds

    with pytest.raises(ValueError, match="thresholds must be two finite increasing numbers"):
        check_thresholds(thresholds)


def test_build_template_refuses_a_negative_first_labelled():
    from scripts.build_template import select_items

    with pytest.raises(ValueError, match=re.escape("first_labelled: expected an integer >= 0, got -2")):
        select_items({"training": []}, None, -2)


def test_output_files_are_refused_before_the_work(tmp_path, monkeypatch):
    """A folder, or a path under a file, as the output of a script that computes for minutes: refused before any of
    it (build_template used to compute the features first; estimate_augmentation and prepare_data read the images)."""
    from scripts import build_template, estimate_augmentation

    work = []
    monkeypatch.setattr(build_template, "open_datalist", lambda *args: work.append("features"))
    monkeypatch.setattr(estimate_augmentation, "load_datalist", lambda *args: work.append("estimate"))
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder")
    with pytest.raises(IsADirectoryError, match=re.escape(f"{tmp_path}: a folder; give the name of the file")):
        build_template.build("datalist.json", output=str(tmp_path))
    with pytest.raises(NotADirectoryError, match=re.escape(f"{blocker / 'a' / 'aug.yaml'}: {blocker} is a file")):
        estimate_augmentation.estimate("datalist.json", output=str(blocker / "a" / "aug.yaml"))
    with pytest.raises(IsADirectoryError, match=re.escape(f"{tmp_path}: a folder")):
        prepare_data.write(lambda: work.append("read"), str(tmp_path), 0.0, 0.0, 0, None)
    assert work == [] and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_loop_names_a_missing_monailabel_environment_and_how_to_make_it(tmp_path):
    from scripts.monailabel_server import client_classes

    with pytest.raises(FileNotFoundError, match=re.escape("(make monailabel sets up .venv-monailabel; or set")):
        client_classes(tmp_path / "bin" / "python")


def test_a_folder_as_output_file_a_fractional_seed_and_a_quoted_home_are_handled(data2d, tmp_path, monkeypatch):
    from bundle.io_utils import atomic_path

    with pytest.raises(IsADirectoryError, match=re.escape(f"{tmp_path}: a folder; give the name of the file")):
        with atomic_path(tmp_path):
            pass
    with pytest.raises(SystemExit) as exit_:
        prepare_data.main(["hand", str(tmp_path), str(tmp_path / "d.json"), "--seed", "1.5"])
    assert exit_.value.code == 2
    monkeypatch.setenv("HOME", str(data2d["datalist"].parent))  # '~/datalist.json' as a quoted argument gives it
    assert load_datalist(f"~/{data2d['datalist'].name}")["landmark_names"] == data2d["content"]["landmark_names"]
