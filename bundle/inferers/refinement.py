"""A pretrained fine step after any pipeline (not in the paper): each predicted landmark moved to where the labelled
templates' XFeat descriptors match best nearby (:mod:`bundle.networks.xfeat`; docs/results.md, "A pretrained fine
step").

For each landmark, each template's descriptor at its landmark is compared with the image's descriptors on a lattice of
``step_px`` file pixels within ``radius_mm`` of the prediction (:func:`bundle.networks.matching.local_votes`); each
template votes for its best lattice point and the votes are combined as the matching combines templates
(``template_combine``, :func:`bundle.kshot.combine_landmarks`, the cosines as the match scores). 2D images only: the
descriptors are computed at the image file's own pixels.

:class:`RefiningInferer` puts the step after an inferer of the ``OneShotInferer`` contract (physical mm); the
pseudo-labels of stage 2 are refined by :meth:`DescriptorRefinement.refine` directly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from bundle.data.datalist import datalist_landmarks, landmarks_array
from bundle.data.images import load_image
from bundle.kshot import check_combine_rule, combine_landmarks
from bundle.networks.matching import disc_lattice, local_votes
from bundle.networks.xfeat import descriptor_map, xfeat_network
from monai.inferers import Inferer
from monai.transforms import Compose

# the search radii chosen on the 10 validation cephalograms (docs/results.md, "A pretrained fine step"): after a
# detector, and for the stage-2 pseudo-labels (from matching, further from the landmarks)
RADIUS_MM = 1.0
PSEUDO_LABEL_RADIUS_MM = 2.0
STEP_PX = 2.0


class DescriptorRefinement:
    """The fine step of the module doc from labelled ``templates`` (datalist items: ``image``, ``landmarks`` in file
    pixels, NaN / ``None`` for a missing one); their descriptors are computed at the first call.

    Args:
        templates: the human-labelled template items (at least one).
        radius_mm: the search radius around each prediction (pixels when an image has no spacing).
        step_px: the lattice step in file pixels.
        combine: how the templates' votes are combined (:data:`bundle.kshot.COMBINE_RULES`).
        load_transforms: the dictionary transforms that read an image file as the pipeline does (``load_transforms``
            of the configs: a DICOM X-ray's photometric interpretation applied, grey); None: MONAI's ``LoadImage``,
            channel first (the channels averaged).
    """

    def __init__(
        self,
        templates: Sequence[dict],
        radius_mm: float = RADIUS_MM,
        step_px: float = STEP_PX,
        combine: str = "weighted_geometric_median",
        load_transforms: Sequence | None = None,
    ) -> None:
        if not templates:
            raise ValueError("the XFeat refinement needs at least one labelled template")
        if not radius_mm > 0 or not step_px > 0:
            raise ValueError(f"xfeat refinement: radius_mm and step_px must be > 0, got {radius_mm} and {step_px}")
        self.templates = [
            {"image": str(t["image"]), "landmarks": landmarks_array(t, len(t["landmarks"]), 2)} for t in templates
        ]
        self.radius_mm, self.step_px = float(radius_mm), float(step_px)
        self.combine = check_combine_rule(combine)
        self.load = Compose(list(load_transforms)) if load_transforms else None
        self._network: torch.nn.Module | None = None
        self._queries: torch.Tensor | None = None

    @property
    def sources(self) -> list[str]:
        """The template images, for the run's provenance."""
        return [t["image"] for t in self.templates]

    def settings(self) -> dict:
        """What ran, for metrics.json / provenance.json."""
        return {"network": "xfeat", "templates": self.sources, "radius_mm": self.radius_mm, "step_px": self.step_px}

    def _descriptors(self, image):
        if self._network is None:
            self._network = xfeat_network()
        if isinstance(image, (str, Path)):
            path = str(image)
            image = (
                self.load({"image": path})["image"]
                if self.load is not None
                else load_image(path, ensure_channel_first=True)
            )
        return descriptor_map(self._network, image)

    def queries(self) -> torch.Tensor:
        """The templates' unit descriptors ``(K, L, 64)`` at their landmarks (NaN where one lacks the landmark)."""
        if self._queries is None:
            found = []
            for t in self.templates:
                vectors = self._descriptors(t["image"]).sample(np.nan_to_num(t["landmarks"]))
                found.append(vectors.masked_fill(torch.as_tensor(np.isnan(t["landmarks"]).any(-1))[:, None], np.nan))
            self._queries = torch.stack(found)
        return self._queries

    def without(self, image: str) -> DescriptorRefinement | None:
        """This refinement less the templates of ``image`` (an image is never its own template), their descriptors
        kept, not computed again; None when no template is left."""
        keep = [i for i, t in enumerate(self.templates) if t["image"] != str(image)]
        if len(keep) == len(self.templates):
            return self
        if not keep:
            return None
        other = copy.copy(self)
        other.templates = [self.templates[i] for i in keep]
        other._queries = self.queries()[keep]
        return other

    @torch.no_grad()
    def refine(self, image, points: np.ndarray, spacing: Sequence[float] | None = None) -> np.ndarray:
        """``points`` ``(L, 2)`` (file pixels [x, y], NaN for a missing one) of ``image`` (a file, or a 2D array in
        MONAI's axis order) moved by the fine step; ``spacing``: mm per pixel (None: the radius is in pixels)."""
        points = np.asarray(points, dtype=np.float64)
        queries = self.queries()
        if queries.shape[1] != len(points):
            where = image if isinstance(image, (str, Path)) else "an image"
            raise ValueError(
                f"xfeat refinement of {where}: {len(points)} landmarks, the templates have {queries.shape[1]}"
            )
        spacing_xy = np.ones(2) if spacing is None else np.asarray(spacing, dtype=np.float64).reshape(2)
        lattice = disc_lattice(self.radius_mm / float(spacing_xy.min()), self.step_px).numpy()
        lattice = lattice[np.linalg.norm(lattice * spacing_xy, axis=1) <= self.radius_mm + 1e-9]  # in mm: anisotropic
        candidates = np.nan_to_num(points)[:, None] + lattice[None]  # (L, P, 2)
        descriptors = self._descriptors(image).sample(candidates)
        votes, cosines = local_votes(queries, descriptors, torch.as_tensor(candidates))
        scale = torch.as_tensor(spacing_xy)
        refined = (combine_landmarks(votes * scale, self.combine, cosines) / scale).numpy()
        return np.where(np.isnan(points) | np.isnan(refined), points, refined)

    def refine_item(self, item: dict, spacing: Sequence[float] | None = None) -> dict:
        """A copy of datalist ``item`` (``image``, ``landmarks``) with its landmarks refined; ``spacing``: mm per pixel,
        else the item's ``spacing``."""
        points = landmarks_array(item, len(item["landmarks"]), 2)
        spacing = item.get("spacing") if spacing is None else spacing
        return {**item, "landmarks": datalist_landmarks(self.refine(item["image"], points, spacing))}


class RefiningInferer(Inferer):
    """An inferer of the ``OneShotInferer`` contract (``(inputs, network, grid_to_physical)`` -> ``(B, L, 2)``
    physical mm, 2D: the file's pixels times ``spacing``) followed by ``refinement`` (None: the inferer alone). The
    image files are the inputs' ``filename_or_obj``; ``spacing`` ``(B, 2)`` comes with the batch (``prepare_batch``)."""

    def __init__(self, inferer: Inferer, refinement: DescriptorRefinement | None = None) -> None:
        super().__init__()
        self.inferer, self.refinement = inferer, refinement

    def __call__(self, inputs, network, grid_to_physical=None, spacing=None):  # type: ignore[override]
        predicted = self.inferer(inputs, network, grid_to_physical)
        if self.refinement is None:
            return predicted
        if grid_to_physical is None or spacing is None or inputs.ndim != 4:
            raise ValueError("the XFeat refinement needs 2D inputs with their grid_to_physical map and spacing")
        files = inputs.meta["filename_or_obj"]
        spacing = torch.as_tensor(spacing, dtype=torch.float64).cpu().numpy().reshape(-1, 2)
        refined = [
            self.refinement.refine(str(files[b]), predicted[b].cpu().numpy() / spacing[b], spacing[b]) * spacing[b]
            for b in range(predicted.shape[0])
        ]
        return torch.as_tensor(np.stack(refined), dtype=predicted.dtype, device=predicted.device)
