"""Landmark targets for evaluation: the datalist's landmarks, the spacing and the grid-to-physical map.

After the spatial preprocessing of an evaluation item (loading, resizing to the network grid; in 3D
also orientation and resampling), ``LandmarkTargetsd`` adds what the one-shot inferer and the metrics
need, all in one physical millimetre frame:

- ``landmarks``: ``(L, D)`` float tensor in the datalist's convention (2D: original pixels [x, y];
  3D: world mm RAS), NaN where missing;
- ``label``: the same landmarks in physical mm (2D: original pixel x spacing; 3D: world mm);
- ``spacing``: ``(D,)`` mm per original pixel (the item's ``spacing``, else the image header);
- ``grid_to_physical``: ``(D+1, D+1)`` homogeneous map from network-grid positions to physical mm.

Both go through the image's affine, which MONAI keeps up to date through every spatial transform
(:func:`bundle.geometry.grid_to_physical`): 3D landmarks are world mm, the affine's frame; 2D physical positions are the
original file's pixels times the spacing, so the 2D map first takes the affine back to those pixels.

:func:`check_landmarks` is the one check of an item's landmarks against its image, in the file's pixels (3D: voxels,
through the world-to-voxel map of the file's affine), whose centres span ``[0, size - 1]``: a landmark beyond
``[-0.5, size - 0.5]`` is warned about, naming the file, the landmark and how far out it lies (pixels, and mm where
the spacing is known); beyond ``outside_tolerance`` of the image's extent (a wrong coordinate convention, a swapped
axis, LPS given for RAS, a typo) it is refused. A template's landmark is refused as soon as it lies outside (every
prediction would follow it to the border), and so is what cannot be a template: an image smaller than
:data:`TEMPLATE_MIN_SIZE`, no landmark placed, or fewer than :data:`TEMPLATE_MIN_POSITIONS` distinct positions.
Items are templates when they carry :data:`TEMPLATE_KEY` (``bundle.templates.resolution.prepare_template`` sets it).
Its rules need no pixels, for other checkers (a datalist writer, the MONAI Label app's saved labels):
:func:`outside_excess` (how far outside the extent) and :func:`template_problem` (what cannot be a template), on
positions in the file's frame (:func:`file_frame`, :func:`file_positions`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch
from bundle.data.datalist import SPACING_RANGE_MM, landmarks_array
from bundle.geometry import grid_to_physical, physical_to_datalist, world_axis_spacing
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.data.utils import to_affine_nd
from monai.transforms import MapTransform, Transform
from monai.utils import TransformBackends

__all__ = [
    "LandmarkTargets",
    "LandmarkTargetsd",
    "check_landmarks",
    "file_frame",
    "file_positions",
    "outside_excess",
    "template_problem",
]

# the item key that marks a template (the stricter checks of check_landmarks)
TEMPLATE_KEY = "as_template"
# a template image smaller than this (pixels; 3D: the file's voxels) along an axis is refused. 2D: four cells of the
# default network's coarsest stride (16): the network resizes every image to its grid (192 px by default), so a
# smaller template is upsampled more than 3x, its finest features describe interpolated pixels and its coarsest map,
# the one that tells landmarks apart, holds fewer than 4 cells of the image per axis (MIN_IMAGE_SIZE's 16, the size
# any image needs, is one cell). 3D: one coarsest cell (16 voxels) of the file's grid, as a thick-slice CT holds
# few slices before its resampling.
TEMPLATE_MIN_SIZE = {2: 64, 3: 16}
# a template needs this many landmark positions at least one pixel (voxel) apart, or as many as it places when fewer
TEMPLATE_MIN_POSITIONS = 3


# (folder, suffix) of the images whose missing spacing was warned about: one line for a folder of PNGs, not one each
_NO_SPACING_SAID: set[tuple[Path, str]] = set()


def _file(image) -> str:
    return image.meta.get("filename_or_obj", "image") if isinstance(image, MetaTensor) else "image"


def _check_image(image, owner: str, name: str) -> int:
    """The image's number of spatial dims, refused unless it is channel-first 2D or 3D (3D: a MetaTensor)."""
    dims = image.ndim - 1
    if dims not in (2, 3):
        raise ValueError(f"{owner}: {name} must be channel-first 2D or 3D, got shape {tuple(image.shape)}")
    if dims == 3 and not isinstance(image, MetaTensor):
        raise ValueError(f"{owner}: {name} must be a MetaTensor with an affine for 3D landmarks")
    return dims


def _check_spacing(spacing, dims: int, image, owner: str, name: str) -> np.ndarray | None:
    """A given spacing override as a float array, refused unless it has ``dims`` values."""
    if spacing is None:
        return None
    spacing = np.asarray(spacing, float)
    if spacing.shape != (dims,):
        raise ValueError(f"{owner}: {name} of {_file(image)} must have {dims} values, got {spacing}")
    return spacing


def _file_frame(image, spacing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The homogeneous map from the pixels (3D: voxels) of the image's file to physical mm (2D: ``spacing``; 3D: the
    reader's ``original_affine``) and the file's size (the reader's ``spatial_shape``); an image not read from a file
    gives its own grid's (:func:`grid_to_physical`)."""
    dims = image.ndim - 1
    meta = image.meta if isinstance(image, MetaTensor) else {}
    shape = meta.get("spatial_shape")
    if shape is None:
        return grid_to_physical(image, spacing), np.asarray(image.shape[1:], float)
    if dims == 2:
        return np.diag(np.append(spacing, 1.0)), np.asarray(shape, float)[:2]
    original = meta.get("original_affine")
    affine = np.asarray(to_affine_nd(3, original if original is not None else image.affine), float)
    return affine, np.asarray(shape, float)[:3]


def file_frame(image) -> tuple[np.ndarray, np.ndarray]:
    """The homogeneous map from the datalist convention (2D: the file's pixels [x, y]; 3D: world mm) to the pixels
    (3D: voxels) of the file of a channel-first ``image``, and the file's size: the frame :func:`check_landmarks`
    checks landmarks in (:func:`file_positions`)."""
    to_physical, size = _file_frame(image, np.ones(image.ndim - 1))
    return np.linalg.inv(to_physical), size


def file_positions(points: np.ndarray, to_file: np.ndarray) -> np.ndarray:
    """``(L, D)`` landmarks (datalist convention, NaN = missing) in the file's pixels (3D: voxels), through the map
    ``to_file`` of :func:`file_frame`."""
    points = np.asarray(points, float).reshape(-1, len(to_file) - 1)
    return (to_file @ np.c_[points, np.ones(len(points))].T).T[:, :-1]


def outside_excess(voxels: np.ndarray, size: Sequence[float]) -> np.ndarray:
    """How far ``(L, D)`` positions in an image's pixels (voxels) lie beyond its extent ``[-0.5, size - 0.5]`` along
    each axis (0 inside; NaN where missing): the one rule of "outside the image"."""
    voxels, size = np.asarray(voxels, float), np.asarray(size, float)
    excess = np.maximum(np.maximum(-0.5 - voxels, voxels - (size - 0.5)), 0.0)
    excess[excess < 1e-6] = 0.0  # the rounding of a map to mm and back
    return excess


def template_problem(voxels: np.ndarray, size: Sequence[float]) -> str | None:
    """Why landmarks at ``voxels`` ``(L, D)`` (the file's pixels, 3D: voxels, NaN = missing; :func:`file_positions`)
    of an image of ``size`` cannot be a template, None when they can: the image is smaller than
    :data:`TEMPLATE_MIN_SIZE`, no landmark is placed, or they lie at fewer than :data:`TEMPLATE_MIN_POSITIONS`
    distinct positions (the one definition; the image's pixels are not needed)."""
    voxels, size = np.asarray(voxels, float), np.asarray(size, float)
    dims = len(size)
    unit, cell = ("px", "pixel") if dims == 2 else ("voxels", "voxel")
    if (size < TEMPLATE_MIN_SIZE[dims]).any():
        return (
            f"a template image of {' x '.join(f'{n:g}' for n in size)} {unit} is too small: a template needs "
            f"at least {TEMPLATE_MIN_SIZE[dims]} {unit} along each axis (the network reads it resized to its grid)"
        )
    present = ~np.isnan(voxels).any(axis=1)
    if not present.any():
        return "a template must place at least one landmark; all of them are null"
    distinct: list[np.ndarray] = []
    for p in voxels[present]:
        if all(np.linalg.norm(p - q) >= 1.0 for q in distinct):
            distinct.append(p)
    need = min(TEMPLATE_MIN_POSITIONS, int(present.sum()))
    if len(distinct) < need:
        return (
            f"the template's {int(present.sum())} landmarks lie at {len(distinct)} distinct position(s) (less than "
            f"one {cell} apart): a template needs {need} (landmarks on top of each other, e.g. copied coordinates, "
            "cannot be told apart)"
        )
    return None


def _length(excess: np.ndarray, unit: str, scale: np.ndarray | float = 1.0) -> str:
    """The length of a landmark's ``excess`` outside the image times ``scale``, in ``unit``, without overflowing
    (1e308 px is not inf; beyond the floating-point range: more than its largest number)."""
    with np.errstate(over="ignore", invalid="ignore"):
        length = float(np.hypot.reduce(np.asarray(excess, float) * scale))
    if not np.isfinite(length):
        return f"more than {np.finfo(float).max:.3g} {unit}"
    return f"{length:.2f} {unit}" if length < 1e6 else f"{length:.3g} {unit}"


def check_landmarks(
    image,
    points: np.ndarray,
    spacing: Sequence[float] | None = None,
    landmark_names: Sequence[str] | None = None,
    template: bool = False,
    outside_tolerance: float = 0.05,
) -> None:
    """Check the landmarks ``points`` ``(L, D)`` (datalist convention, NaN = missing) of a channel-first ``image``
    (see module doc): warn about each one outside the image and refuse (ValueError naming the file, the landmark and
    the distance) one beyond ``outside_tolerance`` of the image's extent, or, for a ``template``, one outside at all
    and what cannot be a template (:func:`template_problem`). ``spacing``: mm per pixel in 2D when known (3D: the
    file's affine gives it)."""
    file, dims = _file(image), image.ndim - 1
    to_file, size = file_frame(image)
    with np.errstate(over="ignore", invalid="ignore"):  # a coordinate such as 1e308 overflows the map: refused below
        voxels = file_positions(points, to_file)
    present = ~np.isnan(np.asarray(points, float).reshape(voxels.shape)).any(axis=1)
    unplaced = present & ~np.isfinite(voxels).all(axis=1)  # beyond the floating-point range in the file's frame
    if template and not unplaced.any():
        problem = template_problem(voxels, size)
        if problem:
            raise ValueError(f"{file}: {problem}")
    scale = np.ones(dims) if spacing is None or dims == 3 else np.asarray(spacing, float)
    to_mm = np.diag(scale) @ np.linalg.inv(to_file)[:dims, :dims]
    voxel_mm = np.linalg.norm(to_mm, axis=0) if spacing is not None or dims == 3 else None
    unit = "px" if dims == 2 else "voxels"
    excess = outside_excess(voxels, size)
    excess[unplaced] = np.inf
    outside = present & (excess > 0).any(axis=1)
    refused = outside if template else outside & (excess > outside_tolerance * size).any(axis=1)

    def describe(j: int) -> str:
        name = f" ({landmark_names[j]!r})" if landmark_names else ""
        value = [round(float(v), 4) for v in points[j]]
        mm = f" ({_length(excess[j], 'mm', voxel_mm)})" if voxel_mm is not None else ""
        if dims == 2:
            where = (
                f"the image's pixels span x in [-0.5, {size[0] - 0.5:g}], y in [-0.5, {size[1] - 0.5:g}] (2D landmarks "
                "are [x, y] pixels of the original file, x the column, y the row)"
            )
        else:
            at = f"voxel {[round(float(v), 1) for v in voxels[j]]}" if not unplaced[j] else "a voxel beyond any float"
            where = (
                f"at {at} of its {' x '.join(f'{n:g}' for n in size)} (3D landmarks are [x, y, z] world RAS mm; LPS "
                "coordinates, as DICOM gives them, need x and y negated)"
            )
        return (
            f"{file}: {'template ' if template else ''}landmark {j}{name} {value} lies "
            f"{_length(excess[j], unit)}{mm} outside the image: {where}"
        )

    if refused.any():
        first, more = int(np.argmax(refused)), int(refused.sum()) - 1
        raise ValueError(
            describe(first)
            + (f"; {more} more landmark(s) of this item lie outside too" if more else "")
            + ("; a template's landmarks must lie on its image (every prediction follows them)" if template else "")
        )
    for j in np.flatnonzero(outside):
        warnings.warn(f"{describe(int(j))}; a prediction on the image is scored at least that far off", stacklevel=2)


class LandmarkTargets(Transform):
    """The evaluation targets of one channel-first image (see module doc).

    ``__call__(img, landmarks=None, spacing=None)`` takes the datalist's landmark list (``None`` entries
    or no list: NaN) and an optional spacing override (mm per pixel, x, y[, z]) and returns ``landmarks``
    ``(L, D)``, ``label`` ``(L, D)`` (float32), ``spacing`` ``(D,)`` (float32) and ``grid_to_physical``
    ``(D+1, D+1)`` (float64, :func:`grid_to_physical`); ``template``: the image is a template's
    (:func:`check_landmarks`). Arguments as :class:`LandmarkTargetsd`'s.
    """

    backend = [TransformBackends.TORCH, TransformBackends.NUMPY]

    def __init__(
        self,
        n_landmarks: int | None = None,
        landmark_names: Sequence[str] | None = None,
        outside_tolerance: float = 0.05,
    ) -> None:
        if n_landmarks is None and landmark_names is None:
            raise ValueError("LandmarkTargets: give n_landmarks or landmark_names")
        self.n_landmarks = len(landmark_names) if n_landmarks is None else int(n_landmarks)
        if landmark_names is not None and len(landmark_names) != self.n_landmarks:
            raise ValueError(f"{len(landmark_names)} landmark_names for {self.n_landmarks} landmarks")
        self.landmark_names = None if landmark_names is None else [str(n) for n in landmark_names]
        if not outside_tolerance >= 0:
            raise ValueError(f"outside_tolerance must be >= 0, got {outside_tolerance}")
        self.outside_tolerance = float(outside_tolerance)

    @staticmethod
    def header_spacing(image, dims: int) -> np.ndarray | None:
        """The header's spacing (3D: of the original affine's world axes), None when the header gives none."""
        if not isinstance(image, MetaTensor):
            return None
        if dims == 3:
            original = image.meta.get("original_affine")
            return world_axis_spacing(np.asarray(original if original is not None else image.affine, float))
        header = image.meta.get("spacing")
        if header is not None and np.all(np.asarray(header, float)[:dims] > 0):
            return np.asarray(header, float)[:dims]
        return None

    @classmethod
    def _spacing(cls, image, dims: int) -> np.ndarray:
        """The header's spacing, refused outside the datalist's range (:data:`SPACING_RANGE_MM`); 1.0 with a warning
        when absent."""
        spacing = cls.header_spacing(image, dims)
        if spacing is not None:
            low, high = SPACING_RANGE_MM
            if not np.all((spacing >= low) & (spacing <= high)):
                raise ValueError(
                    f"{_file(image)}: its header gives a spacing of {np.round(spacing, 8).tolist()} mm, outside "
                    f"{low:g} to {high:g} mm per pixel: give the item a 'spacing' in the datalist"
                )
            return spacing
        name = Path(str(_file(image)))
        if (name.parent, name.suffix.lower()) not in _NO_SPACING_SAID:
            _NO_SPACING_SAID.add((name.parent, name.suffix.lower()))
            warnings.warn(
                f"no spacing for {name}: neither the datalist item nor the header gives one; using 1.0 (mm figures "
                f"are then pixels; said once for the {name.suffix or 'other'} files of {name.parent})",
                stacklevel=2,
            )
        return np.ones(dims)

    def __call__(self, img, landmarks=None, spacing=None, template: bool = False) -> tuple[torch.Tensor, ...]:
        owner = type(self).__name__
        dims = _check_image(img, owner, "the image")
        spacing = _check_spacing(spacing, dims, img, owner, "the spacing")
        if spacing is not None and dims == 3:
            header = self.header_spacing(img, dims)
            if header is not None and not np.allclose(spacing, header, rtol=1e-3):
                raise ValueError(
                    f"{_file(img)}: the datalist's spacing {spacing.tolist()} differs from its header's "
                    f"{np.round(header, 6).tolist()} mm along the world x, y, z axes (a 3D spacing is given in that "
                    "order, not in the file's voxel order); in 3D the header's affine places the voxels and the "
                    "landmarks (world mm), so a spacing cannot override it: fix the header, or leave 'spacing' out"
                )
        known = spacing if spacing is not None else self.header_spacing(img, dims)
        spacing = self._spacing(img, dims) if spacing is None else spacing
        points = landmarks_array({"landmarks": landmarks}, self.n_landmarks, dims)
        check_landmarks(img, points, known, self.landmark_names, template, self.outside_tolerance)
        label = points * spacing if dims == 2 else points  # 2D: original pixels x spacing; 3D: world mm as given
        to_physical = grid_to_physical(img, spacing)
        return (
            torch.as_tensor(points, dtype=torch.float32),
            torch.as_tensor(label, dtype=torch.float32),
            torch.as_tensor(spacing, dtype=torch.float32),
            torch.as_tensor(to_physical, dtype=torch.float64),
        )


class LandmarkTargetsd(MapTransform):
    """Dictionary wrapper of :class:`LandmarkTargets`: add ``landmarks``, ``label``, ``spacing`` and
    ``grid_to_physical`` to an evaluation item (see module doc).

    Args:
        keys: the image key (one key).
        n_landmarks: number of landmarks in the datalist; None: ``len(landmark_names)``.
        landmarks_key: the item's landmark list (absent or ``None``: all NaN, e.g. unlabelled images).
        spacing_key: the item's spacing override (mm per pixel, x, y[, z]).
        label_key: where to write the landmarks in physical mm.
        allow_missing_keys: MONAI's flag; the image key must be present.
        landmark_names: names of the landmarks, for the messages of :func:`check_landmarks`.
        outside_tolerance: how far (fraction of the image extent) a landmark may lie outside the image, warned
            about, before it is refused (a template's is refused when outside at all).

    An item carrying :data:`TEMPLATE_KEY` (true) is a template's, checked as such (the key is removed).
    """

    backend = LandmarkTargets.backend
    n_landmarks = property(lambda self: self.targets.n_landmarks)
    landmark_names = property(lambda self: self.targets.landmark_names)
    outside_tolerance = property(lambda self: self.targets.outside_tolerance)

    def __init__(
        self,
        keys: KeysCollection,
        n_landmarks: int | None = None,
        landmarks_key: str = "landmarks",
        spacing_key: str = "spacing",
        label_key: str = "label",
        allow_missing_keys: bool = False,
        landmark_names: Sequence[str] | None = None,
        outside_tolerance: float = 0.05,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if len(self.keys) != 1:
            raise ValueError(f"LandmarkTargetsd takes one image key, got {self.keys}")
        self.targets = LandmarkTargets(n_landmarks, landmark_names, outside_tolerance)
        self.landmarks_key = landmarks_key
        self.spacing_key = spacing_key
        self.label_key = label_key

    def __call__(self, data: Mapping[Hashable, torch.Tensor]) -> dict:
        d = dict(data)
        key = self.first_key(d)
        image, owner = d[key], type(self).__name__
        dims = _check_image(image, owner, f"'{key}'")  # errors name the key
        spacing = _check_spacing(d.get(self.spacing_key), dims, image, owner, f"'{self.spacing_key}'")
        d[self.landmarks_key], d[self.label_key], d[self.spacing_key], d["grid_to_physical"] = self.targets(
            image, d.get(self.landmarks_key), spacing, bool(d.pop(TEMPLATE_KEY, False))
        )
        return d


class LandmarkPointsd(MapTransform):
    """Post-processing: ``points`` = the predictions ``pred`` (physical mm) in the datalist convention
    (2D: original-image pixels ``[x, y]``; 3D: world mm), from the item's ``spacing``.

    Args:
        keys: the predictions' key (the first present one is read), ``(L, D)`` in physical mm.
        spacing_key: the item's spacing (mm per pixel of the original image).
        output_key: where to write the points ``(L, D)``, float64.
    """

    def __init__(self, keys: KeysCollection = "pred", spacing_key: str = "spacing", output_key: str = "points") -> None:
        super().__init__(keys)
        self.spacing_key = spacing_key
        self.output_key = output_key

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        key = self.first_key(d)
        pred = torch.as_tensor(d[key]).detach().cpu().double().numpy()
        spacing = torch.as_tensor(d[self.spacing_key]).detach().cpu().double().numpy()
        d[self.output_key] = torch.as_tensor(np.asarray(physical_to_datalist(pred, spacing)), dtype=torch.float64)
        return d
