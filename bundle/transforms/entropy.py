"""Image information entropy (IIE) map, Sec. 3 step 1 of the paper: local grey-value histogram entropy.

The IIE of a pixel is the Shannon entropy (bits) of the histogram of the k x k (k x k x k) window around
it. With the window's bin counts ``c_b`` and population ``n``::

    H = -sum_b (c_b / n) log2(c_b / n) = (n log2 n - sum_b c_b log2 c_b) / n

On the CPU a compiled kernel (``bundle/csrc/local_entropy.c``, built on first use by :mod:`bundle.kernels`)
slides each row's histogram along the row and keeps ``sum_b c_b log2 c_b`` up to date in exact fixed point,
rows split between threads. Where no C compiler is found, and on a GPU, the counts of every bin are box sums of
that bin's indicator image (separable: along each axis in turn, by log2(k) doubling additions on the flattened
stack). On the CPU that fallback cuts the image into small tiles (24 x 24 in 2D, plus a halo of ``k - 1``),
each with only the bins present in it (on a cephalogram some 35 of 256); tiles are sorted by their number of
bins and processed in batches of similar ones, on a few threads. Counts are small integers (two bins per 16-bit
word when they fit a byte, so one addition serves two bins) and ``c log2 c`` comes from a lookup table indexed
by the word. On a GPU the same sums run over the whole image, a chunk of bins at a time. All paths equal
``skimage.filters.rank.entropy`` (a per-pixel sliding histogram, each pixel's entropy summed over all bins) to
float32 rounding; the ratios are printed by ``python -m scripts.benchmark entropy`` and written in
docs/results.md, "Benchmarks".
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.kernels import kernel_function
from bundle.transforms.utils import like_input, output_keys_for, single_channel_spatial
from monai.config import KeysCollection
from monai.transforms import MapTransform, Transform
from monai.utils import TransformBackends

__all__ = ["local_entropy", "EntropyMap", "EntropyMapd"]

# CPU tile edge per spatial rank (measured on a real cephalogram and a CT-like volume, two shared cores:
# larger tiles hold more distinct bins, smaller ones repeat more halo).
_TILE = {2: (24, 24), 3: (16, 16, 64)}
# Indicator words per CPU batch of tiles (a few MB: stays in cache, amortises the Python calls).
_BATCH_ELEMENTS = 1 << 20
# Tiles per bincount of the bins present (its counts, tiles x (bins + 1), stay in cache).
_PRESENCE_TILES = 128
# Elements of one bin chunk on the torch path (bounds its memory to a few bytes per element).
_TORCH_CHUNK_ELEMENTS = 1 << 25
# Scale of the compiled kernel's fixed-point c log2 c (its sums are exact integers; 2^-32 bits per term).
_FIXED_POINT = 2.0**32


def _window_shape(window: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    sizes = (window,) * ndim if isinstance(window, (int, np.integer)) else tuple(window)
    if len(sizes) != ndim or not all(isinstance(k, (int, np.integer)) and k >= 1 for k in sizes):
        raise ValueError(f"window must be a positive int or {ndim} positive ints, got {window!r}")
    return tuple(int(k) for k in sizes)


def _xlog2x_table(max_count: int) -> np.ndarray:
    """``c log2 c`` for c = 0 .. max_count (0 at c = 0), float32."""
    c = np.arange(max_count + 1, dtype=np.float64)
    return (c * np.log2(np.maximum(c, 1.0))).astype(np.float32)


def _count_dtype(max_count: int) -> type:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_count <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"window of {max_count} pixels is too large")


def _box_sum_flat(x: Any, k: int, step: int) -> Any:
    """``y[m] = sum_{r < k} x[m + r * step]`` over a flat array (numpy or torch), length ``len(x) - (k - 1) * step``.

    With ``step`` the stride of an axis this is a box sum along that axis; entries whose window runs past
    the end of the axis are left over as garbage that the caller does not read. It builds width-k sums from
    width 1, 2, 4, ... partial sums (about log2(k) + popcount(k) contiguous additions per element).
    """
    total, total_width = None, 0
    power, width = x, 1
    while True:
        if k & width:
            if total is None:
                total, total_width = power, width
            else:
                size = len(x) - (total_width + width - 1) * step
                total = total[:size] + power[total_width * step : total_width * step + size]
                total_width += width
        if 2 * width > k:
            return total
        size = len(x) - (2 * width - 1) * step
        power = power[:size] + power[width * step : width * step + size]
        width *= 2


def _window_counts(indicators: Any, window: Sequence[int]) -> Any:
    """Per-bin window counts (B, *valid) from a contiguous indicator stack (B, *padded) (numpy or torch).

    The box sums run on the flattened stack (long contiguous additions); the result is a strided view of
    the valid entries (``valid = padded - window + 1`` per axis), every one of which lies inside the
    summed buffer.
    """
    padded = indicators.shape[1:]
    steps = [math.prod(padded[axis + 1 :]) for axis in range(len(padded))]
    flat = indicators.reshape(-1)
    for k, step in zip(window, steps):
        flat = _box_sum_flat(flat, k, step)
    shape = (indicators.shape[0],) + tuple(n - k + 1 for n, k in zip(padded, window))
    strides = [math.prod(padded)] + steps
    if isinstance(flat, np.ndarray):
        return np.lib.stride_tricks.as_strided(flat, shape, [s * flat.itemsize for s in strides], writeable=False)
    return flat.as_strided(shape, strides)


def _window_population(shape: Sequence[int], window: Sequence[int]) -> np.ndarray:
    """Number of in-image pixels in each pixel's window (the window cut at the borders), int64."""
    population = np.ones((), dtype=np.int64)
    for length, k in zip(shape, window):
        i = np.arange(length)
        count = np.minimum(i + (k - k // 2 - 1), length - 1) - np.maximum(i - k // 2, 0) + 1
        population = np.multiply.outer(population, count)
    return population


def _bin_formula(values: Any, lo: float, hi: float, bins: int, xp: Any) -> Any:
    """floor((v - lo) / (hi - lo) * bins) clipped to [0, bins - 1] on float64 values (numpy or torch)."""
    if hi == lo:
        return xp.zeros_like(values)
    return xp.clip(xp.floor((values - lo) / (hi - lo) * bins), 0, bins - 1)


def _bin_indices(image: np.ndarray | torch.Tensor, bins: int, intensity_range: Sequence[float] | None) -> Any:
    """Histogram bin of every pixel: uint16 numpy array for numpy input, int32 tensor for a tensor."""
    if intensity_range is not None:
        if len(intensity_range) != 2 or not float(intensity_range[1]) > float(intensity_range[0]):
            raise ValueError(f"intensity_range must be (lo, hi) with hi > lo, got {intensity_range!r}")
    if isinstance(image, torch.Tensor):
        values = image.to(torch.float64)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("local_entropy: the image contains NaN or infinite values")
        lo, hi = (float(values.min()), float(values.max())) if intensity_range is None else map(float, intensity_range)
        return _bin_formula(values, lo, hi, bins, torch).to(torch.int32)
    if image.dtype.kind not in "biuf":
        raise ValueError(f"local_entropy: unsupported image dtype {image.dtype}")
    if image.dtype.kind == "f" and not np.isfinite(image).all():
        raise ValueError("local_entropy: the image contains NaN or infinite values")
    vmin, vmax = int(image.min()) if image.dtype.kind != "f" else image.min(), image.max()
    lo, hi = (float(vmin), float(vmax)) if intensity_range is None else map(float, intensity_range)
    if image.dtype.kind != "f" and int(vmax) - vmin < 1 << 16:
        # integer image: bin each distinct value once, then look the pixels up by value - min
        table = _bin_formula(np.arange(vmin, int(vmax) + 1, dtype=np.float64), lo, hi, bins, np).astype(np.uint16)
        values = image.view(np.uint8) if image.dtype.kind == "b" else image
        return np.take(table, values - vmin if vmin >= 0 else values.astype(np.int64) - vmin)
    return _bin_formula(image.astype(np.float64), lo, hi, bins, np).astype(np.uint16)


def _packed_table(table: np.ndarray) -> tuple[type, int, np.ndarray]:
    """Word dtype, bins per word and ``c log2 c`` table indexed by a word's value.

    When every count fits a byte, two bins share a uint16 word (one per byte: box sums add both lanes at
    once and one table look-up gives ``f(lo) + f(hi)``); otherwise one bin per word of a wide enough dtype.
    """
    max_count = len(table) - 1
    if max_count > 255:
        return _count_dtype(max_count), 1, table
    lanes = np.zeros(256, dtype=np.float64)
    lanes[: max_count + 1] = table
    return np.uint16, 2, (lanes[None, :] + lanes[:, None]).astype(np.float32).reshape(-1)


def _entropy_sums_numpy(padded: np.ndarray, window: tuple[int, ...], bins: int, table: np.ndarray) -> np.ndarray:
    """sum_b c_b log2 c_b for every pixel; ``padded`` = uint16 bin indices padded with the value ``bins``.

    The image is cut into small tiles (plus a halo of k - 1), each with only the bins present in it. Tiles
    are sorted by their number of count words and processed in batches of similar ones (one set of numpy
    calls per batch, on a few threads), so tiles can be small (few bins each) without Python overhead.
    """
    ndim = padded.ndim
    shape = tuple(s - k + 1 for s, k in zip(padded.shape, window))
    word, per_word, word_table = _packed_table(table)
    tile = tuple(min(t, n) for t, n in zip(_TILE[ndim], shape))
    grid = tuple(-(-n // t) for n, t in zip(shape, tile))
    block = tuple(t + k - 1 for t, k in zip(tile, window))
    block_size, n_tiles = math.prod(block), math.prod(grid)
    extra = [(0, g * t + k - 1 - s) for g, t, k, s in zip(grid, tile, window, padded.shape)]
    padded = np.pad(padded, extra, constant_values=bins)
    strides = tuple(t * s for t, s in zip(tile, padded.strides)) + padded.strides
    # every tile's block in one copy (numpy copies without the GIL, where fancy indexing holds it)
    blocks = np.lib.stride_tricks.as_strided(padded, grid + block, strides, writeable=False)
    blocks = np.ascontiguousarray(blocks).reshape(n_tiles, block_size)

    def in_rows(tile_blocks: np.ndarray) -> np.ndarray:
        """Bin indices of tiles' blocks (n, block_size) moved to row i of an (n, bins + 1) table for the i-th tile."""
        return tile_blocks + np.arange(len(tile_blocks), dtype=np.int32)[:, None] * np.int32(bins + 1)

    # the bins present in each block: one bincount per few tiles (its counts stay in cache)
    present = np.empty((n_tiles, bins + 1), dtype=bool)
    step = _PRESENCE_TILES
    for first in range(0, n_tiles, step):
        chunk = blocks[first : first + step]
        counts = np.bincount(in_rows(chunk).ravel(), minlength=len(chunk) * (bins + 1))
        present[first : first + len(chunk)] = counts.reshape(len(chunk), bins + 1) > 0
    present[:, bins] = False  # padding
    rank = np.cumsum(present, axis=1, dtype=np.int32) - 1
    n_words = -(-present.sum(1) // per_word)
    # batches of tiles with similar word counts, about _BATCH_ELEMENTS indicator words each
    order = np.argsort(n_words, kind="stable")
    batches, first = [], 0
    while first < n_tiles:
        last = first + 1
        while last < n_tiles and int(n_words[order[last]]) * (last + 1 - first) * block_size <= _BATCH_ELEMENTS:
            last += 1
        batches.append(order[first:last])
        first = last
    # the sums land in their tiles of the image through a (grid + tile) view of it
    image = np.empty(tuple(g * t for g, t in zip(grid, tile)), dtype=np.float32)
    tile_strides = tuple(t * s for t, s in zip(tile, image.strides)) + image.strides
    tiles = np.lib.stride_tricks.as_strided(image, grid + tile, tile_strides)
    coords = np.unravel_index(np.arange(n_tiles), grid)

    def run(index: np.ndarray) -> None:
        n, n_batch_words = len(index), int(n_words[index[-1]])
        # present bin of rank r lives in word r // per_word, byte lane r % per_word; others in none
        word_of = np.where(present[index], rank[index] // per_word, n_batch_words).astype(np.uint16)
        unit = np.where(present[index], np.left_shift(1, 8 * (rank[index] % per_word)), 0).astype(word)
        flat = in_rows(np.take(blocks, index, axis=0)).reshape(1, -1)
        indicators = np.multiply(
            np.take(word_of, flat) == np.arange(n_batch_words, dtype=np.uint16)[:, None],
            np.take(unit, flat),
            dtype=word,
        )
        counts = _window_counts(indicators.reshape((n_batch_words * n,) + block), window)
        terms = np.take(word_table, counts).reshape((n_batch_words, n) + tile)
        while len(terms) > 1:  # pairwise sum over words: float32 rounding grows with log2(#words) only
            half = (len(terms) + 1) // 2
            terms[: len(terms) - half] += terms[half:]
            terms = terms[:half]
        tiles[tuple(c[index] for c in coords)] = terms[0]

    workers = max(1, min(torch.get_num_threads(), len(batches)))
    if workers == 1:
        for index in batches:
            run(index)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, batches))
    return image[tuple(slice(0, n) for n in shape)]


def _entropy_sums_torch(padded: torch.Tensor, window: tuple[int, ...], bins: int, table: np.ndarray) -> torch.Tensor:
    """Same sums as :func:`_entropy_sums_numpy` with torch on ``padded``'s device, a chunk of bins at a time."""
    ndim = padded.ndim
    lut = torch.as_tensor(table, device=padded.device)
    count_dtype = torch.uint8 if len(table) <= 256 else torch.int32
    present = torch.nonzero(torch.bincount(padded.flatten(), minlength=bins + 1)[:bins]).flatten().to(padded.dtype)
    chunk = max(1, _TORCH_CHUNK_ELEMENTS // padded.numel())
    shape = tuple(s - k + 1 for s, k in zip(padded.shape, window))
    sums = torch.zeros(shape, dtype=torch.float32, device=padded.device)
    for first in range(0, len(present), chunk):
        values = present[first : first + chunk].reshape((-1,) + (1,) * ndim)
        indicators = (padded[None] == values).to(count_dtype)
        sums += lut[_window_counts(indicators, window).long()].sum(0)
    return sums


def _fixed_xlog2x_table(max_count: int) -> np.ndarray:
    """``round(c log2 c * 2^32)`` for c = 0 .. max_count, int64 (the compiled kernel's exact fixed-point sums)."""
    c = np.arange(max_count + 1, dtype=np.float64)
    return np.rint(c * np.log2(np.maximum(c, 1.0)) * _FIXED_POINT).astype(np.int64)


def _entropy_rows_kernel() -> Any:
    """``local_entropy_rows`` of ``bundle/csrc/local_entropy.c`` (:func:`bundle.kernels.kernel_function`); None
    where it cannot be built."""
    int64 = ctypes.c_int64
    arguments = (ctypes.c_void_p, *[int64] * 7, ctypes.c_void_p, int64, ctypes.c_double, int64, int64, ctypes.c_void_p)
    return kernel_function("local_entropy", "local_entropy_rows", ctypes.c_int, arguments)


def _entropy_compiled(indices: np.ndarray, window: tuple[int, ...], bins: int) -> np.ndarray | None:
    """The IIE map (float32) of uint16 bin ``indices`` by the compiled sliding histogram, rows split between
    threads (ctypes releases the GIL); None when the kernel is not available or a window holds too many pixels for
    its fixed-point sums. Same mathematics as the numpy path, summed exactly (:func:`local_entropy`)."""
    kernel = _entropy_rows_kernel()
    max_count = math.prod(min(k, n) for k, n in zip(window, indices.shape))
    if kernel is None or max_count * math.log2(max(max_count, 2)) * _FIXED_POINT >= 2.0**62:
        return None
    table = _fixed_xlog2x_table(max_count)
    volume = np.ascontiguousarray(indices.reshape((1,) * (3 - indices.ndim) + indices.shape), dtype=np.uint16)
    sizes = (1,) * (3 - len(window)) + window
    entropy = np.empty(volume.shape, dtype=np.float32)
    rows = volume.shape[0] * volume.shape[1]
    workers = max(1, min(torch.get_num_threads(), rows))
    # a few ranges per thread, so a thread slowed by other processes does not hold the others up
    bounds = np.linspace(0, rows, min(rows, 4 * workers) + 1).astype(np.int64)

    def run(first: int, last: int) -> None:
        status = kernel(
            volume.ctypes.data,
            *volume.shape,
            *sizes,
            bins,
            table.ctypes.data,
            max_count,
            1.0 / _FIXED_POINT,
            first,
            last,
            entropy.ctypes.data,
        )
        if status != 0:
            raise MemoryError("local_entropy: the compiled kernel could not allocate its histogram")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(run, bounds[:-1].tolist(), bounds[1:].tolist()))
    return entropy.reshape(indices.shape)


def local_entropy(
    image: np.ndarray | torch.Tensor,
    window: int | Sequence[int] = 10,
    bins: int = 256,
    intensity_range: Sequence[float] | None = None,
) -> torch.Tensor:
    """IIE map (Sec. 3 step 1): Shannon entropy (bits) of the ``bins``-bin histogram in each pixel's window.

    ``image`` is a spatial array (H, W) or (D, H, W) without channel (numpy or torch). Bins are
    ``floor((v - lo) / (hi - lo) * bins)`` clipped to [0, bins - 1] with (lo, hi) = ``intensity_range``
    (default: the image's min and max). ``window`` (int or one int per axis; the paper uses 10 in 2D and
    5 in 3D) is cut at the borders (only in-image pixels count) and centred like
    ``skimage.filters.rank`` footprints (offsets -k//2 .. k - k//2 - 1). On uint8 input it equals
    ``skimage.filters.rank.entropy(image, np.ones((k,) * ndim, bool))``. A constant image gives zeros.
    Returns a float32 tensor of the image's shape on the image's device.
    """
    if isinstance(image, torch.Tensor):
        image = image.detach().as_subclass(torch.Tensor)
        if image.device.type == "cpu":
            image = (image.float() if image.dtype == torch.bfloat16 else image).numpy()  # numpy has no bfloat16
    else:
        image = np.asarray(image)
    if image.ndim not in (2, 3) or 0 in image.shape:
        raise ValueError(
            f"local_entropy expects a non-empty 2D or 3D spatial array without channel, got shape {tuple(image.shape)}"
        )
    if not isinstance(bins, (int, np.integer)) or not 1 <= bins < np.iinfo(np.uint16).max:
        raise ValueError(f"bins must be an int in [1, {np.iinfo(np.uint16).max - 1}], got {bins!r}")
    # a window reaching past both ends of an axis from every pixel (2n - 1 or more) sees the whole axis, as 2n - 1 does
    window = tuple(min(k, 2 * n - 1) for k, n in zip(_window_shape(window, image.ndim), image.shape))
    indices = _bin_indices(image, bins, intensity_range)
    compiled = _entropy_compiled(indices, window, bins) if isinstance(indices, np.ndarray) else None
    return torch.from_numpy(compiled) if compiled is not None else _entropy_box_sums(indices, window, bins)


def _entropy_box_sums(indices: np.ndarray | torch.Tensor, window: tuple[int, ...], bins: int) -> torch.Tensor:
    """The IIE map from per-bin box sums: numpy tiles on the CPU (where the compiled kernel is not available),
    torch on the tensor's device (GPU). ``indices``: bin indices from :func:`_bin_indices`."""
    table = _xlog2x_table(math.prod(window))
    pad = [(k // 2, k - k // 2 - 1) for k in window]
    population = _window_population(indices.shape, window)
    # H = (n log2 n - S) / n with n log2 n from the same table as S: exactly 0 where a window holds one bin
    full, population = np.take(table, population), population.astype(np.float32)
    if isinstance(indices, np.ndarray):
        sums = _entropy_sums_numpy(np.pad(indices, pad, constant_values=bins), window, bins, table)
        entropy = np.subtract(full, sums)
        return torch.from_numpy(np.divide(np.maximum(entropy, 0, out=entropy), population, out=entropy))
    flat_pad = [p for before_after in reversed(pad) for p in before_after]
    sums = _entropy_sums_torch(torch.nn.functional.pad(indices, flat_pad, value=bins), window, bins, table)
    full, population = torch.from_numpy(full).to(indices.device), torch.from_numpy(population).to(indices.device)
    return (full - sums).clip(0) / population


class EntropyMap(Transform):
    """IIE map (Sec. 3 step 1) of a channel-first single-channel image (1, H, W) or (1, D, H, W).

    Returns the float32 (1, *spatial) map of :func:`local_entropy`; a MetaTensor input gives a MetaTensor with a
    copy of the input's affine and meta data. Arguments as :class:`EntropyMapd`'s.
    """

    backend = [TransformBackends.TORCH, TransformBackends.NUMPY]

    def __init__(
        self, window: int | Sequence[int] = 10, bins: int = 256, intensity_range: Sequence[float] | None = None
    ) -> None:
        self.window = window
        self.bins = bins
        self.intensity_range = intensity_range

    def __call__(self, img: Any) -> torch.Tensor:
        spatial = single_channel_spatial(img, type(self).__name__)
        return like_input(local_entropy(spatial, self.window, self.bins, self.intensity_range)[None], img)


class EntropyMapd(MapTransform):
    """Dictionary wrapper of :class:`EntropyMap`: the IIE map of Sec. 3 step 1 of the paper.

    For each key, reads a channel-first single-channel image (1, H, W) or (1, D, H, W) and writes its
    IIE map (see :func:`local_entropy`), a float32 (1, *spatial) tensor, to the matching output key. A
    MetaTensor input gives a MetaTensor output with a copy of the input's affine and meta data.

    Args:
        keys: keys of the images to process.
        window: side of the local window in pixels, an int or one int per spatial axis (the paper uses 10
            in 2D and 5 in 3D); cut at the image borders and centred like ``skimage.filters.rank``.
        bins: number of grey-value histogram bins.
        intensity_range: (lo, hi) range binned into ``bins`` bins; values outside are clipped to the end
            bins. Default: each image's own min and max.
        output_keys: where to write each map, one per key; default ``f"{key}_entropy"``.
        allow_missing_keys: don't raise an exception if a key is missing.

    Raises:
        ValueError: an image with more than one channel, or with other than 2 or 3 spatial dims.
        KeyError: a missing key when ``allow_missing_keys`` is False.

    Example:
        >>> import torch
        >>> image = torch.zeros(1, 16, 16)
        >>> image[:, :, 8:] = 1.0  # a vertical edge
        >>> entropy = EntropyMapd("image", window=4)({"image": image})["image_entropy"]
        >>> entropy.shape, float(entropy.min()), float(entropy.max())  # 0 bits in the flat parts, 1 at the edge
        (torch.Size([1, 16, 16]), 0.0, 1.0)
    """

    backend = EntropyMap.backend
    window = property(lambda self: self.entropy_map.window)
    bins = property(lambda self: self.entropy_map.bins)
    intensity_range = property(lambda self: self.entropy_map.intensity_range)

    def __init__(
        self,
        keys: KeysCollection,
        window: int | Sequence[int] = 10,
        bins: int = 256,
        intensity_range: Sequence[float] | None = None,
        output_keys: KeysCollection | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.entropy_map = EntropyMap(window, bins, intensity_range)
        self.output_keys = output_keys_for(self.keys, output_keys, "_entropy")

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key, output_key in self.key_iterator(d, self.output_keys):
            single_channel_spatial(d[key], type(self).__name__, key)
            d[output_key] = self.entropy_map(d[key])
        return d
