"""3D Slicer point lists (.fcsv and .mrk.json): reading to, and writing from, RAS world millimetres.

3D landmarks of a datalist are RAS world coordinates (the datalist contract). Slicer files state their frame:
``.fcsv`` in a header line ``# CoordinateSystem = RAS|LPS`` (``0`` = RAS, ``1`` = LPS in files older
than Slicer 4.11, RAS when the line is absent); ``.mrk.json`` in ``markups[i].coordinateSystem``
(LPS when absent, the schema's default). LPS and RAS differ by the sign of x and y.
"""

from __future__ import annotations

import csv
import io
import warnings
from collections import Counter
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np
from bundle.data.annotations import natural_key, strip_suffix
from bundle.data.datalist import DatalistError, is_finite_number, read_json
from bundle.io_utils import write_json_atomic, write_text_atomic

MARKUPS_SUFFIXES = (".mrk.json", ".fcsv")
MRK_JSON_SCHEMA = (
    "https://raw.githubusercontent.com/slicer/slicer/master/Modules/Loadable/Markups/Resources/Schema/"
    "markups-schema-v1.0.3.json#"
)
FCSV_COLUMNS = ("id", "x", "y", "z", "ow", "ox", "oy", "oz", "vis", "sel", "lock", "label", "desc", "associatedNodeID")
_LPS_RAS_FLIP = np.array([-1.0, -1.0, 1.0])  # LPS <-> RAS (its own inverse)
_FCSV_SYSTEMS = {"RAS": "RAS", "0": "RAS", "LPS": "LPS", "1": "LPS"}
_UNIT_TO_MM = {"mm": 1.0, "um": 1e-3}


class ControlPoint(NamedTuple):
    """A labelled point: ``position`` in RAS mm, or None where the point is not placed."""

    label: str
    position: tuple[float, float, float] | None


def label_key(label: str) -> str:
    """A control-point label as it is compared with landmark names: case and runs of blanks ignored."""
    return " ".join(str(label).split()).casefold()


def check_label_names(names: Sequence[str]) -> None:
    """Refuse (DatalistError) landmark names that differ only in case or blanks: labels cannot tell them apart."""
    clashes = sorted({n for n in names if sum(label_key(m) == label_key(n) for m in names) > 1})
    if clashes:
        raise DatalistError(f"landmark names {clashes} differ only in case or blanks: markups labels cannot tell them")


def names_of_labels(points: Mapping[Path, Sequence[ControlPoint]], where: str | Path) -> list[str]:
    """Landmark names of every label in ``points`` (per file), in natural order.

    Labels equal but for case or blanks (``Nasion`` in one file, ``nasion `` in another) are one landmark, spelt
    as most points spell it; a warning names the spellings.
    """
    spellings: dict[str, Counter] = {}
    for file_points in points.values():
        for p in file_points:
            spellings.setdefault(label_key(p.label), Counter())[p.label] += 1
    names = []
    for counts in spellings.values():
        name = min(counts, key=lambda label: (-counts[label], label))
        if len(counts) > 1:
            warnings.warn(
                f"{where}: labels {sorted(counts)} differ only in case or blanks: read as one landmark {name!r}",
                stacklevel=2,
            )
        names.append(name)
    return sorted(names, key=natural_key)


def markups_stem(path: str | Path) -> str | None:
    """The file name without its markups suffix (``a.mrk.json`` -> ``a``), None for other files."""
    return strip_suffix(Path(path).name, MARKUPS_SUFFIXES)


def _convert(position: Sequence[float], system: str, scale: float = 1.0) -> tuple[float, float, float]:
    """``position`` (times ``scale``) between RAS and ``system``: the LPS flip is its own inverse."""
    p = np.asarray(position, dtype=np.float64) * scale
    if system == "LPS":
        p = p * _LPS_RAS_FLIP
    return (float(p[0]), float(p[1]), float(p[2]))


def _position(value: object, where: str) -> list[float]:
    if not (isinstance(value, (list, tuple)) and len(value) == 3 and all(is_finite_number(v) for v in value)):
        raise DatalistError(f"{where}: expected a position of 3 finite numbers, got {value!r:.80}")
    return [float(v) for v in value]


def read_fcsv(path: str | Path) -> list[ControlPoint]:
    """Control points of a Slicer ``.fcsv`` file, positions converted to RAS."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatalistError(f"{path}: unreadable markups file ({e})") from e
    system, columns = "RAS", list(FCSV_COLUMNS)
    points = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#"):
            key, _, value = line[1:].partition("=")
            key, value = key.strip().casefold(), value.strip()
            if key == "coordinatesystem":
                if value.upper() not in _FCSV_SYSTEMS:
                    raise DatalistError(f"{path}:{line_no}: unknown CoordinateSystem {value!r} (RAS, LPS, 0 or 1)")
                system = _FCSV_SYSTEMS[value.upper()]
            elif key == "columns":
                columns = [c.strip() for c in value.split(",")]
                missing = [c for c in ("x", "y", "z") if c not in columns]
                if missing:
                    raise DatalistError(f"{path}:{line_no}: the columns line lacks {missing}")
            continue
        if not line.strip():
            continue
        cells = next(csv.reader([line]))
        row = dict(zip(columns, cells))
        if not {"x", "y", "z"} <= row.keys():
            raise DatalistError(f"{path}:{line_no}: {len(cells)} columns, too few for x, y, z (columns {columns})")
        try:
            xyz = [float(row[c]) for c in ("x", "y", "z")]
        except ValueError as e:
            raise DatalistError(f"{path}:{line_no}: non-numeric coordinate ({e})") from e
        label = row.get("label") or row.get("id") or str(len(points) + 1)
        points.append(ControlPoint(label, _convert(_position(xyz, f"{path}:{line_no}"), system)))
    return points


def read_mrk_json(path: str | Path) -> list[ControlPoint]:
    """Control points of the ``Fiducial`` markups of a Slicer ``.mrk.json`` file, positions in RAS.

    A point whose ``positionStatus`` is not ``defined`` has no position (None).
    """
    path = Path(path)
    data = read_json(path, "markups JSON file")
    markups = data.get("markups") if isinstance(data, dict) else None
    if not isinstance(markups, list) or not markups:
        raise DatalistError(f"{path}: no 'markups' list, not a 3D Slicer markups file")
    points = []
    for i, markup in enumerate(markups):
        where = f"{path}: markups[{i}]"
        if not isinstance(markup, dict):
            raise DatalistError(f"{where} must be an object")
        if markup.get("type", "Fiducial") != "Fiducial":
            warnings.warn(f"{where} is a {markup.get('type')!r} markup, not a point list: ignored", stacklevel=2)
            continue
        system = markup.get("coordinateSystem", "LPS")
        if system not in ("LPS", "RAS"):
            raise DatalistError(f"{where}.coordinateSystem: expected 'LPS' or 'RAS', got {system!r}")
        units = markup.get("coordinateUnits", "mm")
        unit = units[0] if isinstance(units, list) and units else units
        if unit not in _UNIT_TO_MM:
            raise DatalistError(f"{where}.coordinateUnits: expected 'mm' or 'um', got {units!r}")
        control_points = markup.get("controlPoints", [])
        if not isinstance(control_points, list):
            raise DatalistError(f"{where}.controlPoints must be a list")
        for j, cp in enumerate(control_points):
            if not isinstance(cp, dict):
                raise DatalistError(f"{where}.controlPoints[{j}] must be an object")
            label = str(cp.get("label") or cp.get("id") or len(points) + 1)
            cp_where = f"{where}.controlPoints[{j}] ({label!r})"
            if cp.get("positionStatus", "defined") != "defined":
                points.append(ControlPoint(label, None))
                continue
            position = _position(cp.get("position"), f"{cp_where}.position")
            points.append(ControlPoint(label, _convert(position, system, _UNIT_TO_MM[unit])))
    return points


def read_markups(path: str | Path) -> list[ControlPoint]:
    """Control points of a ``.fcsv`` or ``.mrk.json`` file in RAS millimetres."""
    path = Path(path)
    if not path.is_file():
        raise DatalistError(f"markups file not found: {path}")
    name = path.name.casefold()
    if name.endswith(".fcsv"):
        return read_fcsv(path)
    if name.endswith(".json"):
        return read_mrk_json(path)
    raise DatalistError(f"{path}: not a markups file (expected {' or '.join(MARKUPS_SUFFIXES)})")


def _check_write_args(points: Sequence[ControlPoint], coordinate_system: str) -> None:
    if coordinate_system not in ("RAS", "LPS"):
        raise ValueError(f"coordinate_system must be 'RAS' or 'LPS', got {coordinate_system!r}")
    for i, (label, position) in enumerate(points):
        if not isinstance(label, str):
            raise ValueError(f"points[{i}]: the label must be a string, got {label!r}")
        if position is not None:
            _position(list(position), f"points[{i}] ({label!r})")


def write_mrk_json(path: str | Path, points: Sequence[ControlPoint], coordinate_system: str = "RAS") -> Path:
    """Write a Slicer ``.mrk.json`` point list; RAS ``points`` are stored in ``coordinate_system``.

    A point without position is stored with ``positionStatus: "undefined"`` and no position.
    """
    _check_write_args(points, coordinate_system)
    control_points = []
    for i, (label, position) in enumerate(points):
        cp: dict = {"id": str(i + 1), "label": label}
        if position is None:
            cp["positionStatus"] = "undefined"
        else:
            cp["position"] = list(_convert(position, coordinate_system))
            cp["positionStatus"] = "defined"
        control_points.append(cp)
    markup = {
        "type": "Fiducial",
        "coordinateSystem": coordinate_system,
        "coordinateUnits": "mm",
        "locked": False,
        "labelFormat": "%N-%d",
        "controlPoints": control_points,
    }
    return write_json_atomic(path, {"@schema": MRK_JSON_SCHEMA, "markups": [markup]})


def write_fcsv(path: str | Path, points: Sequence[ControlPoint], coordinate_system: str = "RAS") -> Path:
    """Write a Slicer ``.fcsv`` file (format version 4.11); RAS ``points`` are stored in ``coordinate_system``.

    The format has no unplaced points: a point without position is left out (a warning names it).
    """
    _check_write_args(points, coordinate_system)
    buffer = io.StringIO()
    buffer.write("# Markups fiducial file version = 4.11\n")
    buffer.write(f"# CoordinateSystem = {coordinate_system}\n")
    buffer.write(f"# columns = {','.join(FCSV_COLUMNS)}\n")
    writer = csv.writer(buffer, lineterminator="\n")
    for i, (label, position) in enumerate(points):
        if position is None:
            warnings.warn(f"{path}: point {label!r} has no position: not written (.fcsv cannot store it)", stacklevel=2)
            continue
        x, y, z = _convert(position, coordinate_system)
        writer.writerow([str(i + 1), repr(x), repr(y), repr(z), 0, 0, 0, 1, 1, 1, 0, label, "", ""])
    return write_text_atomic(path, buffer.getvalue())


def write_markups(path: str | Path, points: Sequence[ControlPoint], coordinate_system: str = "RAS") -> Path:
    """Write ``points`` (RAS mm) as ``.fcsv`` or ``.mrk.json``, chosen by the file name."""
    name = Path(path).name.casefold()
    if name.endswith(".fcsv"):
        return write_fcsv(path, points, coordinate_system)
    if name.endswith(".mrk.json"):
        return write_mrk_json(path, points, coordinate_system)
    raise ValueError(f"{path}: unknown markups format (the name must end with {' or '.join(MARKUPS_SUFFIXES)})")
