"""The view-pair sampler of pixel-wise contrastive training, with query pixels drawn in proportion to rho.

From one whole image it cuts an augmented crop (the CC2D two-view setting) and draws the query pixels
with probability proportional to the sampling weight rho of the paper's step 1 (Sec. 3.2). Crop pixels
and query points pass through one and the same affine matrix, so the query positions in the rotated,
scaled crop are exact (sub-pixel) and positives stay exact.

Three parts, one job each: :class:`QuerySampler` draws pixel positions ∝ a weight map;
:class:`RandAffineCrop` draws the crop's pose and placement and maps pixels and points through it;
:class:`RandViewPaird` composes them with the intensity transforms of the two views. The parts draw from
one random stream, that of :class:`RandViewPaird` (shared in :meth:`RandViewPaird.set_random_state`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import MapTransform, Randomizable, RandomizableTransform
from monai.transforms.utils import create_grid, create_rotate, create_scale, create_translate
from monai.utils import MAX_SEED, TransformBackends, convert_to_tensor

__all__ = ["QuerySampler", "RandAffineCrop", "RandViewPaird"]

_TOLERANCE = 1e-6  # pixels: slack when testing whether a mapped point lies inside the crop's query box


def _per_axis(value: Any, n: int, name: str, cast: type = int) -> tuple:
    values = tuple(np.atleast_1d(np.asarray(value, dtype=float)).tolist())
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        raise ValueError(f"{name} must be one number or {n} values, got {value}")
    return tuple(cast(v) for v in values)


class QuerySampler(Randomizable):
    """Pixel positions drawn with replacement with probability proportional to a weight map (the query pixels
    drawn ∝ rho of the paper's step 1, Sec. 3.2).

    ``__call__(weights, size, candidates=None)``: ``size`` integer positions ``(size, D)`` drawn over the
    whole ``weights`` map (float64, non-negative, sum > 0), or among the ``candidates`` ``(K, D)`` (pixel
    positions whose weights are not all zero).
    """

    def __init__(self) -> None:
        self.drawn = np.zeros(0, dtype=np.intp)

    def randomize(self, data: np.ndarray, size: int = 1) -> None:
        """Draw ``size`` indices into the 1D weights ``data`` ∝ weight (into ``drawn``)."""
        cdf = np.cumsum(data)
        drawn = np.searchsorted(cdf, self.R.random_sample(size) * cdf[-1], side="right")
        self.drawn = np.minimum(drawn, np.searchsorted(cdf, cdf[-1]))  # a rounding up to the total -> last positive

    def __call__(self, weights: np.ndarray, size: int, candidates: np.ndarray | None = None) -> np.ndarray:
        if candidates is None:
            self.randomize(weights.ravel(), size)
            return np.stack(np.unravel_index(self.drawn, weights.shape), -1)
        self.randomize(weights[tuple(candidates.T)], size)
        return candidates[self.drawn]


class RandAffineCrop(RandomizableTransform):
    """A ``crop_size`` box placed around an anchor pixel, rotated and zoomed about its centre at random, and
    the map of pixels and points into it.

    :meth:`randomize` decides (``prob``) whether to rotate by uniform angles in ``±rotate_range`` degrees
    (one angle in 2D, one per axis in 3D) and zoom by a factor in ``1 ± scale_range`` (> 1 magnifies).
    :meth:`place` puts the box at a random integer offset so that the anchor lies at least ``margin``
    pixels inside it, preferring boxes that lie inside the image (or, for an image smaller than the crop,
    boxes that cover it), and returns the matrix from centred crop coordinates to centred image
    coordinates (built with MONAI's ``create_rotate``/``create_scale``/``create_translate``), the centre
    moved so that the anchor keeps its place in the crop. ``__call__(img, matrix)`` resamples the crop
    bilinearly (``grid_sample``, pixel centres at integer positions) through that matrix; parts outside
    the image are filled by ``padding_mode`` (the image is padded implicitly, so crops larger than the
    image are allowed). Arguments as :class:`RandViewPaird`'s.
    """

    backend = [TransformBackends.TORCH]

    def __init__(
        self,
        crop_size: Sequence[int] = (64, 64),
        margin: int | Sequence[int] = 4,
        rotate_range: float | Sequence[float] = 10.0,
        scale_range: float = 0.0,
        prob: float = 1.0,
        padding_mode: str = "zeros",
    ) -> None:
        RandomizableTransform.__init__(self, prob=prob)
        self.crop_size = tuple(int(s) for s in crop_size)
        dims = len(self.crop_size)
        if dims not in (2, 3) or min(self.crop_size) < 1:
            raise ValueError(f"crop_size must be 2 or 3 positive sizes, got {tuple(crop_size)}")
        self.margin = _per_axis(margin, dims, "margin")
        if any(m < 0 or s - 1 - 2 * m < 0 for s, m in zip(self.crop_size, self.margin)):
            raise ValueError(
                f"margin {margin} leaves no room for queries in crop_size {self.crop_size} (need size > 2 * margin)"
            )
        self.rotate_range = _per_axis(rotate_range, 1 if dims == 2 else 3, "rotate_range", cast=float)
        if any(r < 0 for r in self.rotate_range):
            raise ValueError(f"rotate_range must be non-negative degrees, got {rotate_range}")
        if not 0.0 <= float(scale_range) < 1.0:
            raise ValueError(f"scale_range must lie in [0, 1), got {scale_range}")
        self.scale_range = float(scale_range)
        if padding_mode not in ("zeros", "border", "reflection"):
            raise ValueError(f"padding_mode must be 'zeros', 'border' or 'reflection', got {padding_mode!r}")
        self.padding_mode = padding_mode
        # crop pixel positions relative to the crop centre, homogeneous: (D + 1, prod(crop_size))
        self._crop_grid = create_grid(self.crop_size, homogeneous=True, dtype=np.float64).reshape(dims + 1, -1)
        self._crop_centre = (np.asarray(self.crop_size, dtype=np.float64) - 1) / 2
        self._angles = np.zeros(len(self.rotate_range))
        self._zoom = 1.0

    def randomize(self, data: Any = None) -> None:
        """Draw whether to rotate/zoom, the angles (radians) and the zoom factor."""
        super().randomize(None)
        self._angles = np.zeros(len(self.rotate_range))
        self._zoom = 1.0
        if not self._do_transform:
            return
        self._angles = np.radians([self.R.uniform(-r, r) for r in self.rotate_range])
        self._zoom = float(self.R.uniform(1.0 - self.scale_range, 1.0 + self.scale_range))

    def _box_start(self, anchor: np.ndarray, spatial: tuple[int, ...]) -> np.ndarray:
        """Random integer crop-box start per axis that keeps ``anchor`` ``margin`` pixels inside the box."""
        starts = []
        for q, n, s, m in zip(anchor.tolist(), spatial, self.crop_size, self.margin):
            lo, hi = q - (s - 1 - m), q - m  # boxes holding the anchor with the margin
            inside_lo, inside_hi = min(0, n - s), max(0, n - s)  # boxes inside the image (or covering it)
            if max(lo, inside_lo) <= min(hi, inside_hi):
                lo, hi = max(lo, inside_lo), min(hi, inside_hi)
            else:  # the anchor is too close to the border: take the holding box nearest to the preferred ones
                lo = hi = hi if hi < inside_lo else lo
            starts.append(self.R.randint(lo, hi + 1))
        return np.asarray(starts)

    def place(self, anchor: np.ndarray, spatial: tuple[int, ...]) -> np.ndarray:
        """Draw the box start around the integer ``anchor`` ``(D,)`` and return the homogeneous matrix from
        centred crop coordinates to centred image coordinates.

        Rotation and zoom (of the last :meth:`randomize`) act about the crop centre; the centre is placed so
        that the anchor keeps the crop position it has in the axis-aligned box:
        anchor = centre + A (anchor - box_start - crop_centre).
        """
        box_start = self._box_start(anchor, spatial)
        dims = len(self.crop_size)
        rotate = create_rotate(dims, self._angles.tolist() if dims == 3 else float(self._angles[0]))
        linear = rotate @ create_scale(dims, [1.0 / self._zoom] * dims)
        centre = anchor - linear[:dims, :dims] @ ((anchor - box_start) - self._crop_centre)
        return create_translate(dims, (centre - (np.asarray(spatial) - 1) / 2.0).tolist()) @ linear

    def visible_pixels(self, matrix: np.ndarray, spatial: tuple[int, ...]) -> np.ndarray:
        """Image pixels ``(K, D)`` (integers) that land at least ``margin`` pixels inside the crop."""
        dims = len(spatial)
        image_centre = (np.asarray(spatial) - 1) / 2.0
        lo = np.asarray(self.margin, dtype=np.float64)
        hi = np.asarray(self.crop_size, dtype=np.float64) - 1 - lo
        corners = np.stack(np.meshgrid(*zip(lo, hi), indexing="ij"), -1).reshape(-1, dims) - self._crop_centre
        corners_img = corners @ matrix[:dims, :dims].T + matrix[:dims, dims] + image_centre
        first = np.clip(np.floor(corners_img.min(0) - _TOLERANCE), 0, np.asarray(spatial) - 1).astype(int)
        last = np.clip(np.ceil(corners_img.max(0) + _TOLERANCE), 0, np.asarray(spatial) - 1).astype(int)
        # crop coordinates of the pixels in that bounding box, axis by axis with broadcasting
        inverse = np.linalg.inv(matrix)
        axes = [
            (np.arange(a, b + 1) - c).reshape([-1 if k == j else 1 for k in range(dims)])
            for j, (a, b, c) in enumerate(zip(first, last, image_centre))
        ]
        keep = np.ones([b - a + 1 for a, b in zip(first, last)], dtype=bool)
        for j in range(dims):
            in_crop = sum(inverse[j, k] * axes[k] for k in range(dims)) + inverse[j, dims] + self._crop_centre[j]
            keep &= (in_crop >= lo[j] - _TOLERANCE) & (in_crop <= hi[j] + _TOLERANCE)
        return np.argwhere(keep) + first

    def to_crop(self, points: np.ndarray, matrix: np.ndarray, spatial: tuple[int, ...]) -> np.ndarray:
        """Map image-grid points ``(N, D)`` into the crop grid with the inverse of ``matrix``."""
        dims = points.shape[1]
        inverse, image_centre = np.linalg.inv(matrix), (np.asarray(spatial) - 1) / 2.0
        return (points - image_centre) @ inverse[:dims, :dims].T + inverse[:dims, dims] + self._crop_centre

    def __call__(self, img: torch.Tensor, matrix: np.ndarray) -> torch.Tensor:
        """The crop ``(C, *crop_size)`` of ``img`` ``(C, *spatial)`` through ``matrix``, bilinear, float32."""
        spatial = tuple(img.shape[1:])
        dims = len(spatial)
        # image positions of the crop pixels, normalised for grid_sample (align_corners=False: 2 (q + 0.5) / N - 1)
        normalised = (matrix @ self._crop_grid)[:dims] * (2.0 / np.asarray(spatial, dtype=np.float64))[:, None]
        grid = np.ascontiguousarray(normalised[::-1].T).reshape(*self.crop_size, dims)
        grid = torch.as_tensor(grid, dtype=torch.float32)
        return F.grid_sample(
            img[None].float(),
            grid.to(img.device)[None],
            mode="bilinear",
            padding_mode=self.padding_mode,
            align_corners=False,
        )[0]


class RandViewPaird(Randomizable, MapTransform):
    """Cut a randomly rotated/scaled crop from a whole image and place query pixels drawn ∝ rho in both views.

    Sampling (paper step 1, Sec. 3.2): the first query (the anchor) is drawn from the whole image with probability
    proportional to the weight map (:class:`QuerySampler`). The crop box is then placed around it, rotated
    and zoomed (:class:`RandAffineCrop`). The other ``num_queries - 1`` queries are drawn ∝ weight among the
    image pixels that land at least ``margin`` pixels inside the transformed crop (a region that holds the
    anchor, so its weight is never zero). All draws are with replacement. The returned whole image keeps
    its size and grid. The crop's settings (``crop_size``, ``margin``, ``prob``, ...) are read through this
    transform.

    Input: ``data[image_key]`` a channel-first ``(C, *spatial)`` image (the network's input grid);
    ``data[weight_key]`` a non-negative ``(1, *spatial)`` weight map (any scale, not all zero), or
    ``weight_key=None`` for uniform sampling; ``data[entropy_key]`` an optional ``(1, *spatial)`` IIE map.

    Output (other keys pass through unchanged):
        ``image_key``: the whole image, through ``image_intensity_transform`` when given.
        ``crop_key``: the augmented crop ``(C, *crop_size)``, float32.
        ``query_key``: ``(Q, D)`` float32 query positions in the whole image (pixel centres at integers,
        components in tensor axis order).
        ``crop_query_key``: ``(Q, D)`` float32 positions of the same points in the crop's grid.

    Args:
        image_key: key of the image.
        weight_key: key of the sampling-weight map rho; None samples uniformly.
        crop_size: spatial size of the crop (2 or 3 values; sets the dimensionality).
        num_queries: number of query pixels Q (>= 1).
        rotate_range: maximum rotation in degrees: a number, or one per axis in 3D (3 values).
        scale_range: maximum relative zoom, in [0, 1).
        margin: minimum distance in pixels between a query and the crop border (a number or one per axis).
        crop_intensity_transform: dictionary transform applied to ``{image_key: crop, entropy_key:
            cropped IIE map, crop_query_key: the queries' crop positions (Q, D) (numpy, float64)}`` (e.g.
            ``InfoGuidedIntensityd``, whose ``group_mode="query"`` reads the first query there); its
            ``image_key`` output becomes the crop.
        image_intensity_transform: dictionary transform applied the same way to the whole image (with the
            queries' image positions under ``query_key``).
        entropy_key: key of the IIE map handed, cropped like the image, to the intensity transforms.
        padding_mode: ``grid_sample`` padding for crop parts outside the image: zeros, border, reflection.
        prob: probability of applying the rotation and zoom (the crop and the queries are always drawn).
        crop_key, query_key, crop_query_key: output keys.
    """

    backend = RandAffineCrop.backend
    crop_size = property(lambda self: self.cropper.crop_size)
    margin = property(lambda self: self.cropper.margin)
    rotate_range = property(lambda self: self.cropper.rotate_range)
    scale_range = property(lambda self: self.cropper.scale_range)
    padding_mode = property(lambda self: self.cropper.padding_mode)
    prob = property(lambda self: self.cropper.prob)

    def __init__(
        self,
        image_key: str = "image",
        weight_key: str | None = "image_weight",
        crop_size: Sequence[int] = (64, 64),
        num_queries: int = 16,
        rotate_range: float | Sequence[float] = 10.0,
        scale_range: float = 0.0,
        margin: int | Sequence[int] = 4,
        crop_intensity_transform: Callable[[dict], Mapping] | None = None,
        image_intensity_transform: Callable[[dict], Mapping] | None = None,
        entropy_key: str | None = None,
        padding_mode: str = "zeros",
        prob: float = 1.0,
        crop_key: str = "crop",
        query_key: str = "query",
        crop_query_key: str = "crop_query",
    ) -> None:
        MapTransform.__init__(self, keys=image_key)
        self.cropper = RandAffineCrop(crop_size, margin, rotate_range, scale_range, prob, padding_mode)
        self.sampler = QuerySampler()
        if int(num_queries) < 1:
            raise ValueError(f"num_queries must be >= 1, got {num_queries}")
        self.num_queries = int(num_queries)
        self.image_key, self.weight_key, self.entropy_key = image_key, weight_key, entropy_key
        self.crop_key, self.query_key, self.crop_query_key = crop_key, query_key, crop_query_key
        self.crop_intensity_transform = crop_intensity_transform
        self.image_intensity_transform = image_intensity_transform

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None) -> RandViewPaird:
        """Seed this sampler, share its random stream with its parts and, from it, seed any randomizable
        intensity transform (as ``Compose`` does)."""
        super().set_random_state(seed=seed, state=state)
        self.cropper.set_random_state(state=self.R)
        self.sampler.set_random_state(state=self.R)
        for transform in (self.crop_intensity_transform, self.image_intensity_transform):
            if isinstance(transform, Randomizable):
                transform.set_random_state(seed=int(self.R.randint(MAX_SEED, dtype="uint32")))
        return self

    def randomize(self, data: Any = None) -> None:
        """Draw whether to rotate/zoom the crop, the angles and the zoom factor."""
        self.cropper.randomize(data)

    def _fetch(self, data: Mapping[Hashable, Any], key: str, role: str) -> torch.Tensor:
        if key not in data:
            raise KeyError(
                f"RandViewPaird: the {role} key '{key}' is missing from the data (keys: {sorted(map(str, data))})"
            )
        return convert_to_tensor(data[key], track_meta=False)

    def _weights(self, data: Mapping[Hashable, Any], spatial: tuple[int, ...]) -> np.ndarray:
        """The sampling weights rho as a float64 array of the image's spatial shape, validated."""
        if self.weight_key is None:
            return np.ones(spatial)
        weight = self._fetch(data, self.weight_key, "weight")
        if tuple(weight.shape) != (1, *spatial):
            raise ValueError(
                f"weight map '{self.weight_key}' has shape {tuple(weight.shape)}, expected (1, *spatial) = "
                f"{(1, *spatial)} to match image '{self.image_key}'"
            )
        w = weight[0].detach().cpu().numpy().astype(np.float64)
        if not np.all(np.isfinite(w)) or w.min() < 0:
            raise ValueError(f"weight map '{self.weight_key}' must be finite and non-negative (min {np.nanmin(w)})")
        if not w.sum() > 0:
            raise ValueError(f"weight map '{self.weight_key}' is all zero: no pixel can be drawn as a query")
        return w

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        image = self._fetch(d, self.image_key, "image")
        if image.ndim != len(self.crop_size) + 1:
            raise ValueError(
                f"image '{self.image_key}' must be channel-first (C, *spatial) with {len(self.crop_size)} spatial dims "
                f"to match crop_size {self.crop_size}, got shape {tuple(image.shape)}"
            )
        spatial = tuple(image.shape[1:])
        weights = self._weights(d, spatial)
        entropy = None if self.entropy_key is None else self._fetch(d, self.entropy_key, "entropy")
        if entropy is not None and tuple(entropy.shape) != (1, *spatial):
            raise ValueError(
                f"entropy map '{self.entropy_key}' has shape {tuple(entropy.shape)}, expected {(1, *spatial)}"
            )
        self.randomize(None)

        anchor = self.sampler(weights, 1)[0]
        matrix = self.cropper.place(anchor, spatial)
        visible = self.cropper.visible_pixels(matrix, spatial)
        others = self.sampler(weights, self.num_queries - 1, candidates=visible)
        query = np.concatenate([anchor[None], others]).astype(np.float64)
        crop_query = self.cropper.to_crop(query, matrix, spatial)

        crop_views = {self.image_key: self.cropper(image, matrix), self.crop_query_key: crop_query}
        image_views = {self.image_key: data[self.image_key], self.query_key: query}
        if entropy is not None:
            crop_views[self.entropy_key] = self.cropper(entropy, matrix)
            image_views[self.entropy_key] = data[self.entropy_key]
        crop = crop_views[self.image_key]
        if self.crop_intensity_transform is not None:
            crop = self.crop_intensity_transform(crop_views)[self.image_key]
        if self.image_intensity_transform is not None:
            d[self.image_key] = self.image_intensity_transform(image_views)[self.image_key]
        d[self.crop_key] = convert_to_tensor(crop, track_meta=False, dtype=torch.float32)
        d[self.query_key] = torch.as_tensor(query, dtype=torch.float32)
        d[self.crop_query_key] = torch.as_tensor(crop_query, dtype=torch.float32)
        return d
