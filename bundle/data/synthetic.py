"""Embedded synthetic landmark datasets: the bundle's default data for demos and tests (project glue).

Two deterministic phantoms, each drawn per subject from one seeded random stream:

* 2D, an X-ray-like lateral "skull" (8-bit PNG): a thick bright cranial vault (a smooth closed curve), a
  sella-like cup, a clivus-like bar, an orbit-like ring, a nasal bone, a maxilla with an incisor, an
  L-shaped mandible and two vertebra-like blocks, over a medium-bright soft-tissue profile and a dark
  background. Brightness is additive (overlapping bones add up), as in a projection radiograph.
* 3D, a head-like CT (int16 Hounsfield units in NIfTI): air around a soft-tissue head and neck, an
  ellipsoidal skull shell open at the base, brain inside, two fat-filled orbits with bony rims, an air
  sinus, two petrous-like bony blocks, a spine-like rod and a horseshoe mandible. The affine is LPS-like
  (negative x and y steps, non-zero origin) so that orientation handling is exercised downstream.

Every structure is a signed distance function in a canonical "model" frame; landmarks are points on the
boundaries of these structures (tips, corners, notches, extreme points of curves). A subject is the
canonical model with perturbed shape parameters, seen through a smooth invertible displacement field
(a few random sine modes) and a random similarity pose. Pictures are rendered by mapping every pixel
(voxel) into the model frame; landmarks by inverting the same map, so both share one exact geometry.
Intensity gain / offset / gamma (2D), tissue levels (3D), texture and noise vary per subject.

Datalists follow the README's contract: 2D landmarks ``[x, y]`` in pixels (x the column), 3D landmarks ``[x, y, z]``
world millimetres in RAS (``world = affine @ [i, j, k, 1]`` with nibabel's affine).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import nibabel as nib
import numpy as np
from bundle.data.datalist import save_datalist
from bundle.io_utils import atomic_path
from PIL import Image
from scipy.ndimage import gaussian_filter
from scipy.spatial.transform import Rotation
from scipy.special import expit

__all__ = [
    "LANDMARKS_2D",
    "LANDMARKS_3D",
    "PhantomSubject",
    "ensure_synthetic_dataset",
    "generate_synthetic_2d",
    "generate_synthetic_3d",
    "subject_2d",
    "subject_3d",
]

LANDMARKS_2D = (
    "vertex",
    "opisthocranion_like",
    "nasion_like",
    "nasal_tip",
    "sella_floor",
    "anterior_clinoid_tip",
    "basion_like",
    "orbitale_like",
    "anterior_nasal_spine_like",
    "upper_incisor_tip",
    "condylion_like",
    "gonion_like",
    "menton_like",
    "infradentale_like",
    "vertebra_anterior_superior",
    "vertebra_anterior_inferior",
)

LANDMARKS_3D = (
    "vertex",
    "glabella_like",
    "opisthocranion_like",
    "orbit_floor_left",
    "orbit_floor_right",
    "petrous_apex_left",
    "petrous_apex_right",
    "sinus_floor",
    "dens_tip",
    "condyle_left",
    "condyle_right",
    "menton_like",
)

SPLIT_CODES = {"template": 0, "training": 1, "validation": 2, "test": 3}
_EDGE_WIDTH_PX = 0.5  # logistic edge width in output pixels (partial-volume anti-aliasing)


# --------------------------------------------------------------------------------------- geometry
# Points are "coordinate lists": one 1D array per axis (fast column-wise maths, float32 for rendering).
# Parameters enter as Python floats so that they keep the points' dtype.
Coords = list[np.ndarray]


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _norm(c: Coords) -> np.ndarray:
    return np.sqrt(sum(x * x for x in c))


def _shift(p: Coords, a: Sequence[float]) -> Coords:
    return [x - float(v) for x, v in zip(p, a)]


def _linear(matrix: np.ndarray, p: Coords) -> Coords:
    """``matrix @ p`` for a coordinate list."""
    return [sum(float(matrix[i, j]) * p[j] for j in range(len(p))) for i in range(matrix.shape[0])]


def _segment_distance(p: Coords, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distance of points ``p`` to the segment ``a``-``b``."""
    ab = b - a
    ap = _shift(p, a)
    t = np.clip(sum(x * float(v) for x, v in zip(ap, ab)) / float(ab @ ab), 0.0, 1.0)
    return _norm([x - t * float(v) for x, v in zip(ap, ab)])


def _stroke_sdf(p: Coords, vertices: np.ndarray, thickness: float) -> np.ndarray:
    """Signed distance to a polyline stroked with round caps and joins of width ``thickness``."""
    d = functools.reduce(np.minimum, (_segment_distance(p, a, b) for a, b in zip(vertices[:-1], vertices[1:])))
    return d - thickness / 2


def _stroke_start_tip(vertices: np.ndarray, thickness: float) -> np.ndarray:
    """Extreme boundary point of the round cap at the first vertex."""
    return vertices[0] + thickness / 2 * _unit(vertices[0] - vertices[1])


def _stroke_end_tip(vertices: np.ndarray, thickness: float) -> np.ndarray:
    """Extreme boundary point of the round cap at the last vertex."""
    return vertices[-1] + thickness / 2 * _unit(vertices[-1] - vertices[-2])


def _stroke_outer_corner(vertices: np.ndarray, thickness: float, i: int) -> np.ndarray:
    """Boundary point on the convex side of the join at vertex ``i`` (along the outer bisector)."""
    d_in = _unit(vertices[i] - vertices[i - 1])
    d_out = _unit(vertices[i + 1] - vertices[i])
    return vertices[i] + thickness / 2 * _unit(d_in - d_out)


def _box_sdf(
    p: Coords, centre: np.ndarray, half: np.ndarray, radius: float, axes: np.ndarray | None = None
) -> np.ndarray:
    """Signed distance to a box with rounded edges; ``axes`` (D, D) holds the box axes as rows."""
    local = _shift(p, centre)
    local = local if axes is None else _linear(axes, local)
    q = [np.abs(x) - float(h - radius) for x, h in zip(local, half)]
    outside = _norm([np.maximum(x, 0.0) for x in q])
    inside = np.minimum(functools.reduce(np.maximum, q), 0.0)
    return outside + inside - radius


def _ellipsoid_sdf(p: Coords, centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """Approximate signed distance to an ellipsoid (exact zero set, first-order distance near it)."""
    d = _shift(p, centre)
    k0 = _norm([x / float(r) for x, r in zip(d, radii)])
    k1 = np.maximum(_norm([x / float(r * r) for x, r in zip(d, radii)]), 1e-12)
    return k0 * (k0 - 1.0) / k1


def _sphere_sdf(p: Coords, centre: np.ndarray, radius: float) -> np.ndarray:
    return _norm(_shift(p, centre)) - radius


def _shell(sdf: np.ndarray, thickness: float) -> np.ndarray:
    """A wall of ``thickness`` inside the boundary of a solid with signed distance ``sdf``."""
    return np.abs(sdf + thickness / 2) - thickness / 2


@dataclass(frozen=True)
class _Warp:
    """Smooth invertible displacement ``r -> r + sum_m a_m sin(k_m . r + phi_m)`` with Lipschitz bound < 1."""

    amplitudes: np.ndarray  # (M, D)
    wavevectors: np.ndarray  # (M, D)
    phases: np.ndarray  # (M,)

    @classmethod
    def random(
        cls, rng: np.random.Generator, dims: int, amplitude: float, frequency: tuple[float, float], modes: int = 4
    ) -> _Warp:
        directions = rng.normal(size=(modes, dims))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        wavevectors = directions * rng.uniform(*frequency, size=(modes, 1))
        amplitudes = rng.normal(size=(modes, dims)) * amplitude / np.sqrt(dims)
        lipschitz = float(np.sum(np.linalg.norm(amplitudes, axis=1) * np.linalg.norm(wavevectors, axis=1)))
        if lipschitz > 0.5:  # keep the map a diffeomorphism with a fast-converging inverse
            amplitudes *= 0.5 / lipschitz
        return cls(amplitudes, wavevectors, rng.uniform(0, 2 * np.pi, size=modes))

    def displacement(self, r: Coords) -> Coords:
        waves = [
            np.sin(sum(float(k) * x for k, x in zip(wk, r)) + float(ph))
            for wk, ph in zip(self.wavevectors, self.phases)
        ]
        return [sum(float(a[d]) * w for a, w in zip(self.amplitudes, waves)) for d in range(len(r))]

    def forward(self, r: Coords) -> Coords:
        return [x + dx for x, dx in zip(r, self.displacement(r))]

    def inverse(self, q: Coords, tol: float = 1e-13) -> Coords:
        """Solve ``forward(r) = q`` by fixed-point iteration (a contraction: Lipschitz <= 0.5)."""
        r = list(q)
        for _ in range(200):
            r_next = [x - dx for x, dx in zip(q, self.displacement(r))]
            converged = max(float(np.max(np.abs(a - b))) for a, b in zip(r_next, r)) < tol
            r = r_next
            if converged:
                break
        return r


@dataclass(frozen=True)
class _Pose:
    """Similarity pose ``r -> scale * R r + translation`` from the warped frame to centred output units."""

    rotation: np.ndarray
    scale: float
    translation: np.ndarray

    def to_frame(self, u: Coords) -> Coords:
        return [x / self.scale for x in _linear(self.rotation.T, _shift(u, self.translation))]

    def from_frame(self, r: Coords) -> Coords:
        return [self.scale * x + float(t) for x, t in zip(_linear(self.rotation, r), self.translation)]


# ----------------------------------------------------------------------------------------- subjects
@dataclass(frozen=True)
class PhantomSubject:
    """One synthetic subject: a canonical model seen through a warp and a pose.

    Output points are pixel ``[x, y]`` (2D) or world RAS millimetres (3D), given as arrays (N, D).
    ``clean(points)`` evaluates the noise-free picture (before gain / gamma / texture / noise) at any
    output points; ``landmarks`` are the model's landmarks mapped exactly to output points.
    """

    model: Callable[[Coords, float], dict[str, np.ndarray]]
    compose: Callable[[dict[str, np.ndarray]], np.ndarray]
    model_landmarks: np.ndarray  # (L, D) in the model frame, in the order of LANDMARKS_2D / LANDMARKS_3D
    warp: _Warp
    pose: _Pose
    centre: np.ndarray  # output point of the model origin before the pose translation
    unit: float  # output length (px or mm) of one model unit before the pose scale
    edge_width: float  # logistic edge width in output length
    noise_seed: int
    affine: np.ndarray | None = None  # 3D only: voxel -> world RAS

    def _to_model(self, p: Coords) -> Coords:
        return self.warp.forward(self.pose.to_frame([x / self.unit for x in _shift(p, self.centre)]))

    def from_model(self, q: np.ndarray) -> np.ndarray:
        """Output points (N, D) of model-frame points ``q`` (N, D), through the inverse warp."""
        r = self.pose.from_frame(self.warp.inverse(list(np.asarray(q, float).T)))
        return np.stack([self.unit * x + float(c) for x, c in zip(r, self.centre)], axis=1)

    @property
    def landmarks(self) -> np.ndarray:
        return self.from_model(self.model_landmarks)

    def _layers(self, p: Coords) -> dict[str, np.ndarray]:
        return self.model(self._to_model(p), self.edge_width / (self.unit * self.pose.scale))

    def layers(self, points: np.ndarray) -> dict[str, np.ndarray]:
        """Occupancy (0..1) of every structure at output ``points`` (N, D)."""
        return self._layers(list(np.asarray(points, float).T))

    def clean(self, points: np.ndarray) -> np.ndarray:
        """The noise-free picture at output ``points`` (N, D)."""
        return self.compose(self.layers(points))


def _in_name_order(points: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The model's landmarks, addressed by name, as an (L, D) array in the order of ``names``: a model that
    misses a name or has one that ``names`` lacks is refused, so a reordered or added name cannot mislabel."""
    missing, unknown = [n for n in names if n not in points], sorted(set(points) - set(names))
    if missing or unknown:
        raise ValueError(f"the model's landmarks do not match the landmark names: missing {missing}, unknown {unknown}")
    return np.array([points[name] for name in names])


def _occupancy(sdf: np.ndarray, width: float) -> np.ndarray:
    return expit(-sdf / width)


def _similarity(rng: np.random.Generator, dims: int, translation: float) -> _Pose:
    angle = np.deg2rad(rng.uniform(-10.0, 10.0))
    if dims == 2:
        c, s = np.cos(angle), np.sin(angle)
        rotation = np.array([[c, -s], [s, c]])
    else:
        rotation = Rotation.from_rotvec(angle * _unit(rng.normal(size=3))).as_matrix()
    return _Pose(rotation, float(rng.uniform(0.92, 1.08)), rng.uniform(-translation, translation, size=dims))


def _jitter(rng: np.random.Generator, point: Sequence[float], sd: float = 0.012) -> np.ndarray:
    return np.asarray(point, float) + rng.normal(0.0, sd, size=len(point))


def _scaled(rng: np.random.Generator, value: float, rel: float = 0.05) -> float:
    return float(value * (1.0 + rng.uniform(-rel, rel)))


# -------------------------------------------------------------------------------- 2D skull model
def _skull_model_2d(rng: np.random.Generator) -> tuple[Callable[[Coords, float], dict[str, np.ndarray]], np.ndarray]:
    """Canonical lateral skull (u right = anterior, v down), unit ~ half the image's short side; landmarks in the
    order of ``LANDMARKS_2D``."""
    centre = _jitter(rng, (-0.10, -0.32))
    a, b = _scaled(rng, 0.70, 0.03), _scaled(rng, 0.56, 0.03)
    harmonics = [float(h) for h in np.array([0.03, 0.012, 0.008]) + rng.normal(0.0, 0.008, size=3)]  # k = 2..4
    phases = [float(h) for h in np.array([0.3, -0.4, 0.2]) + rng.normal(0.0, 0.15, size=3)]
    vault_t = _scaled(rng, 0.07, 0.1)

    def radius(theta: np.ndarray) -> np.ndarray:
        """Vault outline in polar form: an ellipse modulated by cos(k theta + phase), k = 2..4."""
        ellipse = a * b / np.sqrt((b * np.cos(theta)) ** 2 + (a * np.sin(theta)) ** 2)
        return ellipse * (1.0 + sum(h * np.cos(k * theta + ph) for k, h, ph in zip((2, 3, 4), harmonics, phases)))

    def vault_point(theta: float) -> np.ndarray:
        return centre + radius(np.asarray(theta)) * np.array([np.cos(theta), np.sin(theta)])

    sella_c, sella_r, sella_t = _jitter(rng, (-0.10, -0.05)), _scaled(rng, 0.07), _scaled(rng, 0.03, 0.1)
    clivus = np.array([_jitter(rng, (-0.07, 0.09)), _jitter(rng, (-0.32, 0.38))])
    orbit_c, orbit_r, orbit_t = _jitter(rng, (0.22, -0.15)), _scaled(rng, 0.085), _scaled(rng, 0.03, 0.1)
    nasion_theta = np.deg2rad(35.0 + rng.normal(0.0, 1.5))
    nasal_dir = np.deg2rad(40.0 + rng.normal(0.0, 3.0))
    nasal_start = vault_point(nasion_theta)
    nasal = np.array([nasal_start, nasal_start + _scaled(rng, 0.15) * np.array([np.cos(nasal_dir), np.sin(nasal_dir)])])
    maxilla = np.array([_jitter(rng, (0.12, 0.30)), _jitter(rng, (0.58, 0.26))])
    incisor = np.array([_jitter(rng, (0.46, 0.30)), _jitter(rng, (0.52, 0.50))])
    mandible = np.array([_jitter(rng, p) for p in ((-0.16, 0.38), (-0.22, 0.76), (0.32, 0.88), (0.44, 0.72))])
    bar_t, mandible_t = _scaled(rng, 0.05, 0.1), _scaled(rng, 0.07, 0.1)
    vert_half, vert_r = np.array([_scaled(rng, 0.11), _scaled(rng, 0.09)]), 0.02
    vertebrae = [_jitter(rng, (-0.52, 0.54)), _jitter(rng, (-0.54, 0.78))]
    face_c, face_half = _jitter(rng, (0.16, 0.56)), np.array([0.30, 0.30])
    neck_c, neck_half = _jitter(rng, (-0.36, 0.95)), np.array([0.32, 0.65])
    nose_c = nasal[1] + np.array([0.02, 0.05])

    def vault_sdf(q: Coords) -> np.ndarray:
        d = _shift(q, centre)
        return _norm(d) - radius(np.arctan2(d[1], d[0]))

    def sella_sdf(q: Coords) -> np.ndarray:  # a cup: the lower half of a ring, open upwards
        d = _shift(q, sella_c)
        ring = np.abs(_norm(d) - sella_r) - sella_t / 2
        ends = np.minimum(_norm([d[0] - sella_r, d[1]]), _norm([d[0] + sella_r, d[1]]))
        return np.where(d[1] >= 0, ring, ends - sella_t / 2)

    def model(q: Coords, width: float) -> dict[str, np.ndarray]:
        vault = vault_sdf(q)
        bones = {
            "vault": _shell(vault, vault_t),
            "sella": sella_sdf(q),
            "clivus": _stroke_sdf(q, clivus, bar_t),
            "orbit": np.abs(_sphere_sdf(q, orbit_c, orbit_r)) - orbit_t / 2,
            "nasal": _stroke_sdf(q, nasal, bar_t * 0.7),
            "maxilla": _stroke_sdf(q, maxilla, bar_t),
            "incisor": _stroke_sdf(q, incisor, bar_t),
            "mandible": _stroke_sdf(q, mandible, mandible_t),
            "vertebra_1": _box_sdf(q, vertebrae[0], vert_half, vert_r),
            "vertebra_2": _box_sdf(q, vertebrae[1], vert_half, vert_r),
        }
        soft = functools.reduce(
            np.minimum,
            [
                vault - 0.06,
                _box_sdf(q, face_c, face_half, 0.15) - 0.04,
                _box_sdf(q, neck_c, neck_half, 0.1),
                _sphere_sdf(q, nose_c, 0.09),
                _stroke_sdf(q, mandible, mandible_t + 0.12),
                _stroke_sdf(q, maxilla, bar_t + 0.14),
            ],
        )
        out = {name: _occupancy(sdf, width) for name, sdf in bones.items()}
        out["soft"] = _occupancy(soft, width)
        out["cranial_cavity"] = _occupancy(vault, width)
        return out

    # the nasion: the notch where the nasal bone's upper edge leaves the vault's outer edge (bisection)
    lo, hi = nasion_theta - 0.6, nasion_theta
    for _ in range(60):
        mid = (lo + hi) / 2
        inside = _segment_distance(list(vault_point(mid)[:, None]), *nasal)[0] < bar_t * 0.35
        lo, hi = (lo, mid) if inside else (mid, hi)
    corner = np.array([vert_half[0] - vert_r, vert_half[1] - vert_r])
    landmarks = {
        "vertex": vault_point(-np.pi / 2),
        "opisthocranion_like": vault_point(np.pi),
        "nasion_like": vault_point((lo + hi) / 2),
        "nasal_tip": _stroke_end_tip(nasal, bar_t * 0.7),
        "sella_floor": sella_c + [0.0, sella_r - sella_t / 2],
        "anterior_clinoid_tip": sella_c + [sella_r, -sella_t / 2],
        "basion_like": _stroke_end_tip(clivus, bar_t),
        "orbitale_like": orbit_c + [0.0, orbit_r + orbit_t / 2],
        "anterior_nasal_spine_like": _stroke_end_tip(maxilla, bar_t),
        "upper_incisor_tip": _stroke_end_tip(incisor, bar_t),
        "condylion_like": _stroke_start_tip(mandible, mandible_t),
        "gonion_like": _stroke_outer_corner(mandible, mandible_t, 1),
        "menton_like": _stroke_outer_corner(mandible, mandible_t, 2),
        "infradentale_like": _stroke_end_tip(mandible, mandible_t),
        "vertebra_anterior_superior": vertebrae[0] + corner * [1, -1] + vert_r * np.array([1, -1]) / np.sqrt(2),
        "vertebra_anterior_inferior": vertebrae[0] + corner + vert_r * np.array([1, 1]) / np.sqrt(2),
    }
    return model, _in_name_order(landmarks, LANDMARKS_2D)


def _xray_levels(rng: np.random.Generator) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    background, soft, cavity, bone = (
        rng.uniform(0.02, 0.06),
        rng.uniform(0.20, 0.26),
        rng.uniform(0.04, 0.08),
        rng.uniform(0.40, 0.50),
    )

    def compose(layers: dict[str, np.ndarray]) -> np.ndarray:
        bones = sum(v for k, v in layers.items() if k not in ("soft", "cranial_cavity"))
        return background + soft * layers["soft"] + cavity * layers["cranial_cavity"] + bone * bones

    return compose


def subject_2d(seed: int, split: str, index: int, size: Sequence[int] = (256, 288)) -> PhantomSubject:
    """The 2D subject that ``generate_synthetic_2d(seed=seed, size=size)`` writes as ``split`` item ``index``."""
    rng = np.random.default_rng([int(seed), 2, SPLIT_CODES[split], int(index)])
    model, landmarks = _skull_model_2d(rng)
    width, height = size
    return PhantomSubject(
        model=model,
        compose=_xray_levels(rng),
        model_landmarks=landmarks,
        warp=_Warp.random(rng, 2, amplitude=0.03, frequency=(1.5, 3.5)),
        pose=_similarity(rng, 2, translation=0.04),
        centre=np.array([(width - 1) / 2, (height - 1) / 2]),
        unit=0.92 * min(width, height) / 2,
        edge_width=_EDGE_WIDTH_PX,
        noise_seed=int(rng.integers(2**63)),
    )


def _render_xray(subject: PhantomSubject, size: Sequence[int]) -> np.ndarray:
    """The subject as an 8-bit grey picture (H, W): bone texture, heel-effect ramp, gain / offset / gamma, noise."""
    width, height = size
    rng = np.random.default_rng(subject.noise_seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    layers = subject._layers([xs.ravel(), ys.ravel()])
    texture = gaussian_filter(rng.standard_normal((height, width), dtype=np.float32), sigma=2.0)
    texture = (texture / texture.std()).ravel()
    bones = [k for k in layers if k not in ("soft", "cranial_cavity")]
    for k in bones:
        layers[k] = layers[k] * (1.0 + 0.15 * texture)
    image = subject.compose(layers).reshape(height, width)
    direction = _unit(rng.normal(size=2))
    ramp = ((xs - width / 2) * direction[0] + (ys - height / 2) * direction[1]) / max(width, height)
    image = image * (1.0 + 0.15 * ramp)
    gain, offset, gamma = rng.uniform(0.85, 1.15), rng.uniform(-0.04, 0.04), rng.uniform(0.8, 1.25)
    image = np.clip(gain * image + offset, 0.0, 1.0) ** gamma
    image = image + rng.normal(0.0, rng.uniform(0.008, 0.025), size=image.shape)
    return np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)


# ---------------------------------------------------------------------------------- 3D head model
def _head_model_3d(rng: np.random.Generator) -> tuple[Callable[[Coords, float], dict[str, np.ndarray]], np.ndarray]:
    """Canonical head in RAS axes (x right, y anterior, z superior), unit ~ half the field of view; landmarks in the
    order of ``LANDMARKS_3D``."""
    head = rng.uniform(0.95, 1.05)  # one size factor for skin and skull, small independent jitter on top
    skin_c, skin_r = (
        _jitter(rng, (0.0, 0.0, 0.05)),
        head * np.array([_scaled(rng, r, 0.02) for r in (0.66, 0.80, 0.76)]),
    )
    face_c, face_r = _jitter(rng, (0.0, 0.22, -0.45)), np.array([0.52, 0.55, 0.38])
    neck = np.array([[0.0, -0.08, -0.2], [0.0, -0.08, -3.0]])
    skull_c, skull_r = (
        _jitter(rng, (0.0, -0.02, 0.10)),
        head * np.array([_scaled(rng, r, 0.02) for r in (0.58, 0.72, 0.66)]),
    )
    skull_t, base_z = _scaled(rng, 0.08, 0.1), -0.30 + rng.normal(0.0, 0.01)
    orbit_r, rim_t = _scaled(rng, 0.12), 0.04
    orbit_right = _jitter(rng, (0.26, 0.50, 0.02))
    orbit_left = orbit_right * [-1, 1, 1] + rng.normal(0.0, 0.008, size=3)
    sinus_c, sinus_r = _jitter(rng, (0.0, 0.45, -0.30)), np.array([_scaled(rng, r) for r in (0.18, 0.14, 0.12)])
    block_half, block_round = np.array([_scaled(rng, 0.15), 0.045, 0.05]), 0.02
    blocks, block_axes = [], []
    for side in (-1, 1):  # -1: left (x < 0), +1: right
        angle = np.deg2rad(35.0 + rng.normal(0.0, 3.0))
        apex_dir = np.array([-side * np.cos(angle), np.sin(angle), 0.0])  # points medially and anteriorly
        axes = np.stack([apex_dir, [-apex_dir[1], apex_dir[0], 0.0], [0.0, 0.0, 1.0]])
        blocks.append(_jitter(rng, (side * 0.26, -0.10, -0.14)))
        block_axes.append(axes)
    rod, rod_r = np.array([_jitter(rng, (0.0, -0.12, -0.42)), [0.0, -0.18, -3.0]]), _scaled(rng, 0.08)
    arch = np.array([_jitter(rng, p) for p in ((-0.36, 0.04, -0.42), (-0.36, 0.32, -0.58), (0.0, 0.50, -0.60))])
    arch = np.concatenate([arch, arch[1::-1] * [-1, 1, 1] + rng.normal(0.0, 0.008, size=(2, 3))])
    arch_t = _scaled(rng, 0.10, 0.1)

    def model(q: Coords, width: float) -> dict[str, np.ndarray]:
        skull_outer = _ellipsoid_sdf(q, skull_c, skull_r)
        below_base = base_z - q[2]
        orbits = np.minimum(_sphere_sdf(q, orbit_left, orbit_r), _sphere_sdf(q, orbit_right, orbit_r))
        sdf = {
            "soft": np.minimum(
                np.minimum(_ellipsoid_sdf(q, skin_c, skin_r), _ellipsoid_sdf(q, face_c, face_r)),
                _stroke_sdf(q, neck, 0.72),
            ),
            "brain": np.maximum(skull_outer + skull_t, below_base),
            "skull": np.maximum(np.maximum(_shell(skull_outer, skull_t), below_base), -orbits),
            "orbit_rim": np.abs(orbits - rim_t / 2) - rim_t / 2,
            "orbit_fat": orbits,
            "sinus": _ellipsoid_sdf(q, sinus_c, sinus_r),
            "blocks": np.minimum(*(_box_sdf(q, c, block_half, block_round, ax) for c, ax in zip(blocks, block_axes))),
            "rod": _stroke_sdf(q, rod, 2 * rod_r),
            "mandible": _stroke_sdf(q, arch, arch_t),
        }
        return {name: _occupancy(v, width) for name, v in sdf.items()}

    landmarks = {
        "vertex": skull_c + [0.0, 0.0, skull_r[2]],
        "glabella_like": skull_c + [0.0, skull_r[1], 0.0],
        "opisthocranion_like": skull_c - [0.0, skull_r[1], 0.0],
        "orbit_floor_left": orbit_left - [0.0, 0.0, orbit_r],
        "orbit_floor_right": orbit_right - [0.0, 0.0, orbit_r],
        "petrous_apex_left": blocks[0] + block_half[0] * block_axes[0][0],  # blocks[0]: the left side
        "petrous_apex_right": blocks[1] + block_half[0] * block_axes[1][0],
        "sinus_floor": sinus_c - [0.0, 0.0, sinus_r[2]],
        "dens_tip": _stroke_start_tip(rod, 2 * rod_r),
        "condyle_left": _stroke_start_tip(arch, arch_t),  # the arch runs from left to right
        "condyle_right": _stroke_end_tip(arch, arch_t),
        "menton_like": _stroke_outer_corner(arch, arch_t, 2),
    }
    return model, _in_name_order(landmarks, LANDMARKS_3D)


_CT_ORDER = ("soft", "brain", "skull", "orbit_rim", "orbit_fat", "sinus", "blocks", "rod", "mandible")


def _ct_levels(rng: np.random.Generator) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """Per-subject Hounsfield units; tissues are painted in ``_CT_ORDER``, later ones over earlier ones."""
    bone = rng.uniform(1000.0, 1500.0)
    hu = {
        "soft": rng.uniform(40.0, 60.0),
        "brain": rng.uniform(20.0, 40.0),
        "skull": bone,
        "orbit_rim": bone * rng.uniform(0.7, 0.9),
        "orbit_fat": rng.uniform(-120.0, -80.0),
        "sinus": rng.uniform(-980.0, -880.0),
        "blocks": rng.uniform(900.0, 1300.0),
        "rod": rng.uniform(700.0, 1000.0),
        "mandible": bone * rng.uniform(0.8, 1.0),
    }

    def compose(layers: dict[str, np.ndarray]) -> np.ndarray:
        value = np.full_like(layers["soft"], -1000.0)
        for name in _CT_ORDER:
            value += layers[name] * (hu[name] - value)
        return value

    return compose


def _lps_like_affine(rng: np.random.Generator, shape: Sequence[int], spacing: Sequence[float]) -> np.ndarray:
    """Voxel -> RAS affine of an LPS-stored volume: i runs to the left, j to the back, k up; non-zero origin."""
    affine = np.eye(4)
    affine[:3, :3] = np.diag([-spacing[0], -spacing[1], spacing[2]])
    world_centre = np.array([4.0, -18.0, 32.0]) + rng.normal(0.0, 5.0, size=3)
    affine[:3, 3] = world_centre - affine[:3, :3] @ ((np.asarray(shape) - 1) / 2)
    return affine


def subject_3d(
    seed: int, split: str, index: int, shape: Sequence[int] = (64, 64, 64), spacing: Sequence[float] = (2.0, 2.0, 2.0)
) -> PhantomSubject:
    """The 3D subject that ``generate_synthetic_3d(seed=seed, shape=shape, spacing=spacing)`` writes as ``split``
    item ``index``."""
    rng = np.random.default_rng([int(seed), 3, SPLIT_CODES[split], int(index)])
    model, landmarks = _head_model_3d(rng)
    affine = _lps_like_affine(rng, shape, spacing)
    return PhantomSubject(
        model=model,
        compose=_ct_levels(rng),
        model_landmarks=landmarks,
        warp=_Warp.random(rng, 3, amplitude=0.03, frequency=(1.5, 3.5)),
        pose=_similarity(rng, 3, translation=0.04),
        centre=affine[:3, :3] @ ((np.asarray(shape) - 1) / 2) + affine[:3, 3],
        unit=0.95 * min(n * s for n, s in zip(shape, spacing)) / 2,
        edge_width=_EDGE_WIDTH_PX * min(spacing),
        noise_seed=int(rng.integers(2**63)),
        affine=affine,
    )


def _render_ct(subject: PhantomSubject, shape: Sequence[int]) -> np.ndarray:
    """The subject as an int16 CT volume indexed [i, j, k]: smooth texture and noise on the tissue levels."""
    rng = np.random.default_rng(subject.noise_seed)
    ijk = [x.ravel() for x in np.meshgrid(*(np.arange(n, dtype=np.float32) for n in shape), indexing="ij")]
    world = [x + float(t) for x, t in zip(_linear(subject.affine[:3, :3], ijk), subject.affine[:3, 3])]
    volume = subject.compose(subject._layers(world)).reshape(shape)
    texture = gaussian_filter(rng.standard_normal(tuple(shape), dtype=np.float32), sigma=1.5)
    texture /= texture.std()
    volume += texture * np.where(
        volume > -500.0, 5.0 + 0.06 * np.maximum(volume - 100.0, 0.0), 0.0
    )  # tissue and bone only
    volume = volume + rng.normal(0.0, rng.uniform(8.0, 20.0), size=shape)
    return np.clip(np.round(volume), -1024, 3071).astype(np.int16)


# ---------------------------------------------------------------------------------------- writers
def _check_counts(**counts: int) -> None:
    for key, n in counts.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{key} must be a non-negative integer, got {n!r}")
    if counts["n_training"] < 1:
        raise ValueError(f"n_training must be at least 1, got {counts['n_training']!r}")


def _check_sizes(key: str, values: Sequence, dims: int, minimum: float, integer: bool) -> None:
    ok = isinstance(values, (list, tuple, np.ndarray)) and len(values) == dims
    ok = ok and all(
        isinstance(v, (int, np.integer) if integer else (int, float, np.number)) and v >= minimum for v in values
    )
    if not ok:
        kind = "integers" if integer else "numbers"
        raise ValueError(f"{key} must be {dims} {kind} >= {minimum}, got {values!r}")


def _splits(n_training: int, n_validation: int, n_test: int) -> list[tuple[str, int]]:
    return (
        [("template", 0)]
        + [("training", i) for i in range(n_training)]
        + [("validation", i) for i in range(n_validation)]
        + [("test", i) for i in range(n_test)]
    )


def _write_datalist(out_dir: Path, header: dict, entries: list[tuple[str, dict]]) -> Path:
    datalist = dict(header, training=[], validation=[], test=[])
    for split, item in entries:
        if split == "template":
            datalist["template"] = item
        else:
            datalist[split].append(item)
    return save_datalist(datalist, out_dir / "datalist.json")


def _check_inside(landmarks: np.ndarray, upper: np.ndarray, where: str) -> None:
    if not (np.all(landmarks >= 0) and np.all(landmarks <= upper)):
        raise ValueError(f"{where}: a landmark falls outside the image; use a larger size")


def generate_synthetic_2d(
    out_dir: str | os.PathLike,
    n_training: int = 40,
    n_validation: int = 6,
    n_test: int = 10,
    size: Sequence[int] = (256, 288),
    spacing: Sequence[float] = (0.5, 0.5),
    seed: int = 0,
) -> Path:
    """Write the 2D skull phantom set (``images/*.png``, 8-bit grey, ``size`` = (width, height)) and its datalist.

    Returns the path of ``out_dir/datalist.json``. The same arguments give the same bytes.
    """
    _check_counts(n_training=n_training, n_validation=n_validation, n_test=n_test, seed=seed)
    _check_sizes("size", size, 2, 64, integer=True)
    _check_sizes("spacing", spacing, 2, 1e-6, integer=False)
    out_dir = Path(out_dir)
    entries = []
    for split, index in _splits(n_training, n_validation, n_test):
        subject = subject_2d(seed, split, index, size)
        name = "template.png" if split == "template" else f"{split}_{index:03d}.png"
        landmarks = subject.landmarks
        _check_inside(landmarks, np.asarray(size) - 1, name)
        with atomic_path(out_dir / "images" / name) as tmp:
            Image.fromarray(_render_xray(subject, size)).save(tmp, format="PNG")
        item = {
            "image": f"images/{name}",
            "landmarks": landmarks.round(4).tolist(),
            "spacing": [float(s) for s in spacing],
        }
        entries.append((split, item))
    header = {
        "name": "synthetic_lateral_skull_2d",
        "description": "Synthetic X-ray-like lateral skull phantoms (bundle.data.synthetic), "
        "landmarks [x, y] in pixels.",
        "seed": int(seed),
        "spatial_dims": 2,
        "landmark_names": list(LANDMARKS_2D),
    }
    return _write_datalist(out_dir, header, entries)


def generate_synthetic_3d(
    out_dir: str | os.PathLike,
    n_training: int = 16,
    n_validation: int = 3,
    n_test: int = 5,
    shape: Sequence[int] = (64, 64, 64),
    spacing: Sequence[float] = (2.0, 2.0, 2.0),
    seed: int = 0,
) -> Path:
    """Write the 3D head CT phantom set (``images/*.nii.gz``, int16 HU, LPS-like affine) and its datalist.

    Landmarks are world RAS millimetres. Returns the path of ``out_dir/datalist.json``.
    """
    _check_counts(n_training=n_training, n_validation=n_validation, n_test=n_test, seed=seed)
    _check_sizes("shape", shape, 3, 24, integer=True)
    _check_sizes("spacing", spacing, 3, 1e-6, integer=False)
    out_dir = Path(out_dir)
    entries = []
    for split, index in _splits(n_training, n_validation, n_test):
        subject = subject_3d(seed, split, index, shape, spacing)
        name = "template.nii.gz" if split == "template" else f"{split}_{index:03d}.nii.gz"
        landmarks = subject.landmarks
        voxels = (landmarks - subject.affine[:3, 3]) @ np.linalg.inv(subject.affine[:3, :3]).T
        _check_inside(voxels, np.asarray(shape) - 1, name)
        image = nib.Nifti1Image(_render_ct(subject, shape), subject.affine)
        image.set_qform(subject.affine, code=1)
        image.set_sform(subject.affine, code=1)
        image.header.set_xyzt_units("mm", "sec")
        with atomic_path(out_dir / "images" / name) as tmp:
            nib.save(image, tmp)
        entries.append((split, {"image": f"images/{name}", "landmarks": landmarks.round(4).tolist()}))
    header = {
        "name": "synthetic_head_ct_3d",
        "description": "Synthetic head CT phantoms (bundle.data.synthetic), landmarks [x, y, z] world RAS mm.",
        "seed": int(seed),
        "spatial_dims": 3,
        "landmark_names": list(LANDMARKS_3D),
    }
    return _write_datalist(out_dir, header, entries)


def ensure_synthetic_dataset(datalist_path: str | os.PathLike, spatial_dims: int = 2) -> Path:
    """Return ``datalist_path``; when it is missing, first generate the default set into its folder.

    The set is generated into a temporary sibling folder and renamed into place, so an interrupted run
    leaves nothing half-written; when a concurrent generator finishes first, its result is kept.
    """
    if spatial_dims not in (2, 3):
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}")
    path = Path(datalist_path)
    if path.is_file():
        return path
    target = path.parent.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the data set is not
    try:
        generated = (generate_synthetic_2d if spatial_dims == 2 else generate_synthetic_3d)(tmp)
        generated.rename(tmp / path.name)
        _move_into_place(tmp, target, path.name)
    except OSError:
        if not path.is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _move_into_place(tmp: Path, target: Path, datalist_name: str) -> None:
    """Rename ``tmp`` onto ``target`` (absent or empty); into a non-empty ``target`` move the images, then the
    datalist."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if (target / datalist_name).is_file() or not target.is_dir():
            raise
    if (target / "images").exists():
        raise FileExistsError(
            f"cannot generate the synthetic set into {target}: {target / 'images'} exists but {datalist_name} does not"
        )
    os.rename(tmp / "images", target / "images")
    os.replace(tmp / datalist_name, target / datalist_name)
