"""The files 3D Slicer's stock MONAILabel module exchanges with the app: the result file Run loads and the label file
Submit Label sends.

What the module does with a model of type ``detection`` (Project-MONAI/MONAILabel,
``plugins/slicer/MONAILabel/MONAILabel.py``): Run loads the result file with ``slicer.util.loadMarkups`` when its name
ends with ``.json`` (each markup of the file becomes a node; every ROI node of the scene but ``Scribbles ROI`` is
renamed ``Detection ROI - i``) and shows nothing else of the reply. Submit Label saves every ROI node of the scene but
``Scribbles ROI`` (also the empty ``SAM2 ROI`` it makes for each image) and sends them as one markups file under a
temporary ``.json`` name, with no tag; point lists are not sent.

So the result file holds one small box (ROI) per landmark whose one control point is labelled with the landmark's
name: the label is shown in the views (the box's own name, which the module replaces, is hidden), moves with the
box when it is dragged and is saved with it. A low-confidence suggestion's warning comes as a point list of one
point labelled with it, at the image's corner: shown, never sent back. A file of boxes is read as the point list of
the placed boxes' centres, each named by its control point's label (:func:`box_points`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bundle.data.datalist import DatalistError, is_finite_number, read_json
from bundle.data.markups import MRK_JSON_SCHEMA, ControlPoint

# a box's side, as a share of the image's diagonal (about 4.6 mm on a cephalogram of 193 x 240 mm)
BOX_SHARE = 0.015
# how Slicer writes an axis-aligned box's orientation in LPS
LPS_AXES = [-1.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 1.0]
WARNING_LABEL = "Low confidence: these suggestions are likely wrong (the warning in full: this point's description)"


def _lps(ras: Sequence[float]) -> list[float]:
    return [-float(ras[0]), -float(ras[1]), float(ras[2])]


def result_markups(
    points: Sequence[ControlPoint], corners: Sequence[Sequence[float]], warning: str | None = None
) -> dict:
    """The result file's markups of a suggestion: a box per placed landmark of ``points`` (RAS mm), its side
    ``BOX_SHARE`` of the diagonal between the image's ``corners`` (RAS mm), and ``warning`` (if any) as a point
    labelled ``WARNING_LABEL`` near the first corner, the warning in its description; in LPS, as Slicer saves."""
    (x0, y0, z0), (x1, y1, z1) = corners
    side = BOX_SHARE * float(((x1 - x0) ** 2 + (y1 - y0) ** 2 + (z1 - z0) ** 2) ** 0.5)
    markups = []
    for name, ras in points:
        if ras is None:
            continue
        center = _lps(ras)
        markups.append(
            {
                "type": "ROI",
                "name": name,
                "coordinateSystem": "LPS",
                "coordinateUnits": "mm",
                "roiType": "Box",
                "center": center,
                "orientation": LPS_AXES,
                "size": [side, side, side],
                "insideOut": False,
                "controlPoints": [{"id": "1", "label": name, "position": center, "positionStatus": "defined"}],
                "display": {"pointLabelsVisibility": True, "propertiesLabelVisibility": False},
            }
        )
    if warning:
        near = [a + 0.05 * (b - a) for a, b in zip(corners[0], corners[1])]
        point = {"id": "1", "label": WARNING_LABEL, "description": warning, "position": _lps(near)}
        markups.append(
            {
                "type": "Fiducial",
                "name": "Warning",
                "coordinateSystem": "LPS",
                "coordinateUnits": "mm",
                "locked": True,
                "controlPoints": [{**point, "positionStatus": "defined", "locked": True}],
                "display": {"pointLabelsVisibility": True, "color": [1.0, 0.5, 0.0], "selectedColor": [1.0, 0.5, 0.0]},
            }
        )
    return {"@schema": MRK_JSON_SCHEMA, "markups": markups}


def box_points(path: str | Path) -> list[ControlPoint] | None:
    """The placed boxes of a markups JSON file of ROI markups only (what Submit Label sends) as points: each box's
    ``center`` (RAS mm), labelled by its first placed control point (an ROI without one, such as the module's empty
    ``SAM2 ROI``, is no box); None for any other file. DatalistError naming the box: a centre that is not 3 finite
    numbers, a frame or unit Slicer does not write; and when no box is placed."""
    if not str(path).casefold().endswith(".json"):
        return None
    try:
        content = read_json(path, "markups JSON file")
    except DatalistError:
        return None  # read_markups names the fault
    markups = content.get("markups") if isinstance(content, dict) else None
    if not isinstance(markups, list) or not all(isinstance(m, dict) and m.get("type") == "ROI" for m in markups):
        return None
    points = []
    for i, markup in enumerate(markups):
        placed = [
            cp
            for cp in markup.get("controlPoints") or []
            if isinstance(cp, dict) and cp.get("positionStatus", "defined") == "defined"
        ]
        if not placed:
            continue
        label = str(placed[0].get("label") or placed[0].get("id") or len(points) + 1)
        box = f"box markups[{i}] ({label!r})"
        system, units = markup.get("coordinateSystem", "LPS"), markup.get("coordinateUnits", "mm")
        center = markup.get("center")
        if system not in ("LPS", "RAS"):
            raise DatalistError(f"{box}: coordinateSystem {system!r:.40}, expected 'LPS' or 'RAS'")
        if units not in ("mm", ["mm"]):
            raise DatalistError(f"{box}: coordinateUnits {units!r:.40}, expected 'mm'")
        if not (isinstance(center, list) and len(center) == 3 and all(is_finite_number(v) for v in center)):
            raise DatalistError(f"{box}: center {center!r:.80}, expected 3 finite numbers")
        points.append(ControlPoint(label, tuple(_lps(center)) if system == "LPS" else tuple(map(float, center))))
    if not points:
        raise DatalistError(
            f"the file holds {len(markups)} ROI node(s) and no placed box (3D Slicer's MONAILabel "
            "module sends the boxes that Run loaded: press Run, drag the wrong boxes onto their landmarks, then "
            "Submit Label)"
        )
    return points
