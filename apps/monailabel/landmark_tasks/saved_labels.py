"""The datastore's saved labels (3D Slicer markups) read as the bundle's landmarks, and its images as datalist items."""

from __future__ import annotations

import logging
import os
from collections import Counter
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from bundle.data.markups import ControlPoint, label_key, read_markups
from bundle.transforms.landmarks import file_positions, template_problem

from .frames import lps_to_pixels, outside
from .slicer import box_points
from .uploads import ImageError, LabelError

logger = logging.getLogger(__name__)
FINAL_TAG = "final"


class SavedLabels:
    """Saved labels read as landmarks of the bundle's names, each checked to lie on its image.

    Args:
        names: the landmark names, in the bundle's order.
        spatial_dims: 2 (landmarks in pixels) or 3 (in world mm).
        frame: the coordinate frames of an image file (:func:`landmark_tasks.frames.image_frame`, cached).
    """

    def __init__(self, names: Sequence[str], spatial_dims: int, frame: Callable[[str | Path], dict]) -> None:
        self.names, self.spatial_dims, self.frame = list(names), spatial_dims, frame

    def label_landmarks(self, label_path: str | Path, image_path: str | Path, where: str, strict: bool = True) -> list:
        """The landmarks of a saved Slicer label as pixel ``[x, y]`` per landmark name (None where missing).

        Control points are matched by label to the landmark names; a file whose labels name none of them but
        holds exactly one point per landmark is read in order (Slicer's default labels ``F-1``, ``F-2``, ...);
        a file of ROI boxes (3D Slicer's MONAILabel module's Submit Label) gives their centres, named by their
        control points' labels (:func:`landmark_tasks.slicer.box_points`); ``strict``: see
        :meth:`points_to_landmarks`.
        """
        try:
            points = box_points(label_path)
            if points is None:
                points = read_markups(label_path)
        except Exception as e:
            detail = str(e).replace(str(label_path), "the file")  # a server path (an upload's temporary file)
            raise LabelError(
                f"label of {where}: not a usable 3D Slicer markups file (.mrk.json / .fcsv): {detail}"
            ) from e
        return self.points_to_landmarks(points, image_path, where, strict)

    def points_to_landmarks(
        self, points: Sequence[ControlPoint], image_path: str | Path, where: str, strict: bool = True
    ) -> list:
        """Landmarks (2D: pixel ``[x, y]``; 3D: world ``[x, y, z]``; None where missing) of ``points`` on the image,
        each checked to lie on it (LabelError naming the landmark and ``where``). Labels match names with case and
        blanks ignored (:func:`bundle.data.markups.label_key`); a point whose label names no landmark is refused
        naming it and the closest names (``strict``), else left out with a warning (a label saved earlier). Landmarks
        that cannot be a template (:func:`bundle.transforms.landmarks.template_problem`) are refused: each saved label
        is one."""
        counts = Counter(label_key(p.label) for p in points)
        by_label = {label_key(p.label): p.position for p in points}
        by_name = {n: by_label[label_key(n)] for n in self.names if label_key(n) in by_label}
        twice = [n for n in by_name if counts[label_key(n)] > 1]
        if twice:
            raise LabelError(f"label of {where}: landmarks {twice} are named by more than one point")
        in_order = self.spatial_dims == 2 and not by_name and len(points) == len(self.names)
        keys = {label_key(n): n for n in self.names}
        unknown = [] if in_order else [p.label for p in points if label_key(p.label) not in keys]
        if unknown and strict:
            close = {u: [keys[k] for k in get_close_matches(label_key(u), keys, n=3)] for u in unknown}
            hints = "; ".join(f"{u!r}: did you mean {c}?" for u, c in close.items() if c)
            in_order_rule = (
                f" (unnamed points are read in order only when there is one per landmark, {len(self.names)})"
                if self.spatial_dims == 2 and not by_name
                else ""
            )
            raise LabelError(
                f"label of {where}: points {unknown} name no landmark{in_order_rule}"
                + (f"; {hints}" if hints else "")
                + f"; the landmarks are {', '.join(self.names)}"
            )
        if unknown:
            logger.warning(f"label of {where}: points {unknown} name no landmark, left out")
        if in_order:
            by_name = {n: p.position for n, p in zip(self.names, points)}
        frame = self.frame(image_path)
        out = []
        for name in self.names:
            ras = by_name.get(name)
            if ras is None:
                out.append(None)
                continue
            if self.spatial_dims == 2:
                point = [float(v) for v in lps_to_pixels(np.array([[-ras[0], -ras[1], ras[2]]]), frame)[0]]
            else:
                point = [float(v) for v in ras]
            extent = outside(point, frame)
            if extent:
                raise LabelError(
                    f"label of {where}: landmark {name!r} at ({', '.join(f'{v:g}' for v in point)}) lies outside "
                    f"the image ({extent})"
                )
            out.append(point)
        # every saved label is a template of the suggestions: one that cannot be is refused (stored: skipped)
        points = np.array([[np.nan] * self.spatial_dims if p is None else p for p in out], dtype=np.float64)
        problem = template_problem(file_positions(points, frame["to_file"]), frame["file_size"])
        if problem:
            raise LabelError(f"label of {where}: {problem}")
        return out

    def datastore_items(self, datastore) -> list[dict]:
        """Every datastore image (sorted ids) as a datalist item ``{"image", "id"[, "landmarks"]}``.

        A label saved with the ``final`` tag gives ``landmarks``; an unreadable one is logged and skipped.
        """
        items = []
        for image_id in sorted(datastore.list_images()):
            uri = datastore.get_image_uri(image_id)
            if not uri:
                continue
            item: dict[str, Any] = {"image": uri, "id": image_id}
            label = (
                datastore.get_label_uri(image_id, FINAL_TAG)
                if FINAL_TAG in datastore.get_labels_by_image_id(image_id)
                else ""
            )
            if label and os.path.isfile(label):
                try:
                    item["landmarks"] = self.label_landmarks(label, uri, f"image {image_id!r}", strict=False)
                    item["label"] = label
                except (LabelError, ImageError) as e:
                    logger.warning(f"saved label skipped: {e}")
            items.append(item)
        return items
