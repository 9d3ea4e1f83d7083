"""IIE map (bundle.transforms.entropy): agreement with skimage and a brute-force reference, errors, EntropyMapd."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle import kernels
from bundle.transforms import entropy as entropy_module
from bundle.transforms.entropy import (
    EntropyMapd,
    _bin_indices,
    _entropy_sums_numpy,
    _entropy_sums_torch,
    _xlog2x_table,
    local_entropy,
)
from monai.data import MetaTensor
from skimage.filters.rank import entropy as skimage_entropy

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TOL = 1e-5


@pytest.fixture(params=["compiled", "numpy"], autouse=True)
def cpu_path(request, monkeypatch):
    """Every test runs on both CPU paths: the compiled sliding histogram and the numpy box sums (its fallback)."""
    if request.param == "numpy":
        monkeypatch.setattr(entropy_module, "_entropy_rows_kernel", lambda: None)
    elif kernels._compiler() is None:
        pytest.skip("no C compiler here: the compiled kernel cannot be built")
    else:
        assert entropy_module._entropy_rows_kernel() is not None, "a C compiler is here, but the kernel was not built"
    return request.param


def reference(image: np.ndarray, window: tuple[int, ...]) -> np.ndarray:
    """skimage's local entropy with a full rectangular footprint."""
    return skimage_entropy(image, np.ones(window, dtype=bool))


def brute_force(labels: np.ndarray, window: tuple[int, ...]) -> np.ndarray:
    """Entropy of each pixel's window (offsets -k//2 .. k - k//2 - 1, cut at the borders), pixel by pixel."""
    out = np.zeros(labels.shape)
    for index in itertools.product(*(range(n) for n in labels.shape)):
        box = tuple(slice(max(i - k // 2, 0), i + k - k // 2) for i, k in zip(index, window))
        _, counts = np.unique(labels[box], return_counts=True)
        p = counts / counts.sum()
        out[index] = -(p * np.log2(p)).sum()
    return out


def structured_2d(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Smooth gradient, a bright disc and a flat dark band plus noise: low, medium and high entropy regions."""
    y, x = np.mgrid[: shape[0], : shape[1]]
    image = 40 + 0.8 * x + 60 * ((y - shape[0] / 2) ** 2 + (x - shape[1] / 3) ** 2 < (shape[0] / 4) ** 2)
    image = image + rng.normal(0, 6, shape)
    image[:, -12:] = 3  # constant band reaching the border
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 10])
def test_2d_random_matches_skimage(k):
    rng = np.random.default_rng(k)
    image = rng.integers(0, 256, (150, 83)).astype(np.uint8)  # several tiles, partial ones at the ends
    got = local_entropy(image, window=k)
    assert got.dtype == torch.float32 and got.shape == image.shape
    np.testing.assert_allclose(got.numpy(), reference(image, (k, k)), rtol=0, atol=TOL)


@pytest.mark.parametrize("k", [4, 5, 10, 17])  # 17: 289 pixels per window, counts beyond one byte
def test_2d_structured_matches_skimage_including_borders(k):
    image = structured_2d(np.random.default_rng(0), (97, 131))
    got = local_entropy(image, window=k).numpy()
    expected = reference(image, (k, k))
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(got[:k, :], expected[:k, :], rtol=0, atol=TOL)  # borders explicitly
    np.testing.assert_allclose(got[:, -k:], expected[:, -k:], rtol=0, atol=TOL)
    assert got[:, -3:].max() < got.max()  # the flat band is low-information


@pytest.mark.parametrize("window", [(3, 6), (10, 1)])
def test_2d_rectangular_window_matches_skimage(window):
    image = np.random.default_rng(1).integers(0, 40, (45, 38)).astype(np.uint8)
    np.testing.assert_allclose(local_entropy(image, window).numpy(), reference(image, window), rtol=0, atol=TOL)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_3d_random_matches_skimage(k):
    rng = np.random.default_rng(10 + k)
    volume = rng.integers(0, 256, (21, 19, 13)).astype(np.uint8)  # more than one tile along axes 0 and 1
    np.testing.assert_allclose(local_entropy(volume, k).numpy(), reference(volume, (k, k, k)), rtol=0, atol=TOL)


def test_3d_structured_matches_skimage():
    rng = np.random.default_rng(3)
    z, y, x = np.mgrid[:18, :34, :30]
    volume = 80 + 2 * x + 70 * ((x - 15) ** 2 + (y - 17) ** 2 + (2 * z - 18) ** 2 < 100) + rng.normal(0, 5, x.shape)
    volume[:4] = 0  # flat slab at the border
    volume = np.clip(volume, 0, 255).astype(np.uint8)
    for window in [(5, 5, 5), (2, 3, 4)]:
        np.testing.assert_allclose(local_entropy(volume, window).numpy(), reference(volume, window), rtol=0, atol=TOL)


@pytest.mark.parametrize("shape, k", [((1, 5), 3), ((5, 5), 10), ((3, 2, 1), 5), ((200, 3), 10)])
def test_tiny_images_and_windows_larger_than_the_image(shape, k):
    image = np.random.default_rng(len(shape) + k).integers(0, 9, shape).astype(np.uint8)
    np.testing.assert_allclose(local_entropy(image, k).numpy(), reference(image, (k,) * len(shape)), rtol=0, atol=TOL)


@pytest.mark.parametrize("window", [(4, 4), (5, 2), (2, 3, 4)])
def test_matches_brute_force_reference(window):
    rng = np.random.default_rng(sum(window))
    shape = (13, 11) if len(window) == 2 else (7, 6, 9)
    labels = rng.integers(0, 5, shape).astype(np.uint8)
    np.testing.assert_allclose(local_entropy(labels, window).numpy(), brute_force(labels, window), rtol=0, atol=TOL)


def test_even_window_is_centred_like_skimage():
    image = np.zeros((9, 9), dtype=np.uint8)
    image[4, 4] = 1
    got = local_entropy(image, 4).numpy() > 0
    # a window at i covers rows i-2 .. i+1, so the pixel at 4 is seen from 3 .. 6
    expected = np.zeros((9, 9), dtype=bool)
    expected[3:7, 3:7] = True
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, reference(image, (4, 4)) > 0)


def test_float_input_with_intensity_range_equals_binned_uint8():
    rng = np.random.default_rng(4)
    image = rng.uniform(-1.5, 3.5, (60, 50))  # values outside (-1, 3) land in the end bins
    lo, hi, bins = -1.0, 3.0, 64
    binned = np.clip(np.floor((image - lo) / (hi - lo) * bins), 0, bins - 1).astype(np.uint8)
    got = local_entropy(image.astype(np.float32), 6, bins=bins, intensity_range=(lo, hi))
    np.testing.assert_allclose(got.numpy(), local_entropy(binned, 6, bins=256).numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(got.numpy(), reference(binned, (6, 6)), rtol=0, atol=TOL)


def test_default_range_and_coarse_bins():
    rng = np.random.default_rng(5)
    image = rng.integers(10, 200, (40, 40)).astype(np.uint16)
    binned = np.clip(np.floor((image - 10.0) / (199.0 - 10.0) * 16), 0, 15).astype(np.uint8)
    np.testing.assert_allclose(local_entropy(image, 5, bins=16).numpy(), reference(binned, (5, 5)), rtol=0, atol=TOL)
    # a wide int32 range is binned through the float path, with the same result as float64 input
    wide = rng.integers(-100000, 100000, (30, 30)).astype(np.int32)
    np.testing.assert_array_equal(_bin_indices(wide, 256, None), _bin_indices(wide.astype(np.float64), 256, None))
    signed = image.astype(np.int32) - 150
    np.testing.assert_array_equal(_bin_indices(signed, 16, None), binned)


def test_torch_input_and_torch_path_agree_with_numpy_path():
    rng = np.random.default_rng(6)
    volume = rng.integers(0, 30, (9, 12, 10)).astype(np.uint8)
    got = local_entropy(torch.from_numpy(volume), 3)
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
    np.testing.assert_allclose(got.numpy(), reference(volume, (3, 3, 3)), rtol=0, atol=TOL)
    # the whole-image torch path used for GPU tensors, run on the CPU
    for window in [(3, 3, 3), (7, 7, 7)]:  # 8-bit and 16-bit window counts
        indices = _bin_indices(volume, 256, None)
        pad = [(k // 2, k - k // 2 - 1) for k in window]
        padded = np.pad(indices, pad, constant_values=256)
        table = _xlog2x_table(int(np.prod(window)))
        expected = _entropy_sums_numpy(padded, window, 256, table)
        got_sums = _entropy_sums_torch(torch.from_numpy(padded.astype(np.int32)), window, 256, table)
        np.testing.assert_allclose(got_sums.numpy(), expected, rtol=1e-6, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    image = structured_2d(np.random.default_rng(7), (120, 90))
    got = local_entropy(torch.from_numpy(image).cuda(), 10)
    assert got.device.type == "cuda" and got.dtype == torch.float32
    np.testing.assert_allclose(got.cpu().numpy(), reference(image, (10, 10)), rtol=0, atol=TOL)


def test_constant_image_gives_zeros():
    assert torch.count_nonzero(local_entropy(np.full((30, 20), 77, dtype=np.uint8), 10)) == 0
    assert torch.count_nonzero(local_entropy(np.full((6, 7, 8), -3.5), 5)) == 0
    assert torch.count_nonzero(local_entropy(np.full((6, 7), 2.0), 3, intensity_range=(0, 1))) == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_raises(bad):
    image = np.ones((10, 10), dtype=np.float32)
    image[3, 4] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        local_entropy(image)
    with pytest.raises(ValueError, match="NaN or infinite"):
        local_entropy(torch.from_numpy(image))


@pytest.mark.parametrize(
    "image, kwargs, match",
    [
        (np.zeros(10), {}, "2D or 3D"),
        (np.zeros((2, 3, 4, 5)), {}, "2D or 3D"),
        (np.zeros((0, 5)), {}, "non-empty"),
        (np.zeros((5, 5)), {"window": 0}, "window"),
        (np.zeros((5, 5)), {"window": (3, 3, 3)}, "window"),
        (np.zeros((5, 5)), {"bins": 0}, "bins"),
        (np.zeros((5, 5)), {"intensity_range": (2, 1)}, "intensity_range"),
        (np.zeros((5, 5), dtype=complex), {}, "dtype"),
    ],
)
def test_bad_arguments_raise(image, kwargs, match):
    with pytest.raises(ValueError, match=match):
        local_entropy(image, **kwargs)


def test_entropy_mapd_writes_map_and_keeps_meta():
    image = structured_2d(np.random.default_rng(8), (40, 50))
    affine = torch.tensor([[0.5, 0, 0, 3], [0, 0.25, 0, -1], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.float64)
    meta_image = MetaTensor(torch.from_numpy(image)[None].float(), affine=affine, meta={"filename_or_obj": "a.png"})
    out = EntropyMapd(keys="image", window=4)({"image": meta_image, "other": 1})
    entropy = out["image_entropy"]
    assert isinstance(entropy, MetaTensor) and entropy.shape == (1, 40, 50) and entropy.dtype == torch.float32
    np.testing.assert_allclose(entropy[0].numpy(), reference(image, (4, 4)), rtol=0, atol=TOL)
    assert torch.equal(entropy.affine, affine) and entropy.meta["filename_or_obj"] == "a.png"
    entropy.affine[0, 0] = 9.0  # the output owns its meta
    assert meta_image.affine[0, 0] == 0.5 and out["image"] is meta_image and out["other"] == 1


def test_entropy_mapd_plain_inputs_and_output_keys():
    rng = np.random.default_rng(9)
    volume = rng.integers(0, 256, (1, 8, 9, 10)).astype(np.uint8)
    out = EntropyMapd(keys=["a", "b"], window=3, output_keys=["ea", "eb"])({"a": volume, "b": torch.from_numpy(volume)})
    for key in ("ea", "eb"):
        assert type(out[key]) is torch.Tensor and out[key].shape == (1, 8, 9, 10)
        np.testing.assert_allclose(out[key][0].numpy(), reference(volume[0], (3, 3, 3)), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="output_keys"):
        EntropyMapd(keys=["a", "b"], output_keys="ea")


@pytest.mark.parametrize("shape, match", [((2, 8, 8), "1 channel"), ((1, 8), "spatial"), ((1, 2, 3, 4, 5), "spatial")])
def test_entropy_mapd_rejects_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=rf"'img'.*{match}.*{shape[0]}, {shape[1]}") as info:
        EntropyMapd(keys="img")({"img": np.zeros(shape, dtype=np.uint8)})
    assert str(shape) in str(info.value) and match in str(info.value)


def test_entropy_mapd_missing_key():
    with pytest.raises(KeyError, match="image"):
        EntropyMapd(keys="image")({"label": np.zeros((1, 4, 4))})
    assert EntropyMapd(keys="image", allow_missing_keys=True)({"label": 1}) == {"label": 1}


@pytest.mark.skipif(not (DATA / "hamedan_ceph" / "images" / "001.png").exists(), reason="shared real data absent")
def test_real_cephalogram_crop_matches_skimage():
    from PIL import Image

    image = np.asarray(Image.open(DATA / "hamedan_ceph" / "images" / "001.png").convert("L"))[400:620, 500:760]
    np.testing.assert_allclose(local_entropy(image, 10).numpy(), reference(image, (10, 10)), rtol=0, atol=TOL)


def test_window_past_the_image_is_cut_to_it():
    """A window reaching past both ends of an axis from every pixel sees the whole axis: its time and memory grew with
    the window asked for (20000 on an 8 x 8 image: a 3 GB table, MemoryError)."""
    image = np.random.default_rng(11).integers(0, 7, (8, 5)).astype(np.uint8)
    expected = reference(image, (15, 9))
    for window in [(15, 9), (16, 10), (20000, 20000)]:
        np.testing.assert_allclose(local_entropy(image, window).numpy(), expected, rtol=0, atol=TOL)


def test_bfloat16_tensor():
    image = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 8
    expected = local_entropy(image.to(torch.bfloat16).float(), 3)
    torch.testing.assert_close(local_entropy(image.to(torch.bfloat16), 3), expected, rtol=0, atol=0)


@pytest.mark.parametrize("cpu_path", ["compiled"], indirect=True)
def test_compiled_kernel_runs_on_the_cpu(cpu_path, monkeypatch):
    """Where a C compiler is, the CPU path is the compiled kernel, not the numpy box sums (they would raise here)."""

    def no_box_sums(*args):
        raise AssertionError("the numpy box sums ran")

    monkeypatch.setattr(entropy_module, "_entropy_box_sums", no_box_sums)
    image = structured_2d(np.random.default_rng(12), (50, 40))
    np.testing.assert_allclose(local_entropy(image, 10).numpy(), reference(image, (10, 10)), rtol=0, atol=TOL)
    volume = np.random.default_rng(13).integers(0, 20, (6, 7, 8)).astype(np.uint8)
    np.testing.assert_allclose(local_entropy(volume, 3).numpy(), reference(volume, (3, 3, 3)), rtol=0, atol=TOL)


@pytest.mark.parametrize("cpu_path", ["compiled"], indirect=True)
def test_compiled_kernel_splits_rows_between_threads(cpu_path, monkeypatch):
    """Row ranges of 1 and 3 threads (4 and 12 ranges) give the same map: each range starts its histogram afresh."""
    rng = np.random.default_rng(10)
    volume = rng.integers(0, 40, (7, 19, 23)).astype(np.uint8)
    expected = reference(volume, (3, 4, 5))
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        np.testing.assert_allclose(local_entropy(volume, (3, 4, 5)).numpy(), expected, rtol=0, atol=TOL)
