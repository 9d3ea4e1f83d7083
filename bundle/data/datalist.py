"""The datalist contract (README, "Data: the datalist"): reading, validating and writing landmark datalists.

A datalist is a decathlon-style JSON file::

    {"name": ..., "spatial_dims": 2, "landmark_names": [...],
     "training": [{"image": ..., "landmarks": [[x, y], ...] | absent}, ...],
     "validation": [...], "test": [...], "template": {...}, "templates": [{...}, ...]}

2D landmarks are ``[x, y]`` pixel coordinates of the original file (x = column, y = row, the centre of
the top-left pixel at ``[0, 0]``); 3D landmarks are ``[x, y, z]`` world millimetres (RAS). A missing
landmark is ``null``. ``spacing`` (mm per pixel, x, y[, z]) overrides the image header.
Relative image paths resolve against the datalist file's folder.
"""

from __future__ import annotations

import difflib
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from bundle.command_errors import Refusal
from bundle.io_utils import write_json_atomic

SECTIONS = ("training", "validation", "test")


class DatalistError(ValueError):
    """A datalist that breaks the contract; the message names the file and the key at fault."""


class EmptySectionError(DatalistError, Refusal):
    """A datalist section a command runs on is empty; the message says how to fill it (one line, no traceback)."""


# how to fill a section a command needs, after "the '<section>' list is empty"
FILL_SECTION = {
    "training": "add images to the datalist's 'training' list",
    "validation": "make one with python -m scripts.prepare_data ... --validation IDS (or --validation_fraction F)",
    "test": "make one with python -m scripts.prepare_data ... --test IDS (or --test_fraction F); for landmarks without "
    "scores run inferring instead",
}


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The parsed content of a JSON file; an unreadable or invalid file (one nesting too deep to parse included)
    raises ``DatalistError`` naming it."""
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatalistError(f"{path}: not a readable {what} ({e})") from e
    except RecursionError:
        raise DatalistError(f"{path}: not a readable {what} (it nests too deeply to parse)") from None


# pixel spacings (mm) outside this range are typing errors, not images
SPACING_RANGE_MM = (1e-4, 1e4)


def is_finite_number(value: Any) -> bool:
    """A finite int or float; not a bool (JSON ``true`` would read as 1). The bundle's one test of a number read
    from JSON, YAML or a request."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# the keys of an item that the bundle reads; an item may carry others of its own (an id, a note)
ITEM_KEYS = ("image", "landmarks", "spacing")


def _check_item_keys(item: dict, where: str) -> None:
    """Refuse a key that reads as a misspelling of one of :data:`ITEM_KEYS` (``lanmarks``: the item would silently
    count as unlabelled) and per-item ``landmark_names`` (the datalist's top-level list names every item's)."""
    if "landmark_names" in item:
        raise DatalistError(
            f"{where}.landmark_names: landmark names are read only at the datalist's top level ('landmark_names'), "
            "which every item's landmarks follow in order"
        )
    for key in item:
        close = difflib.get_close_matches(str(key), ITEM_KEYS, n=1, cutoff=0.75)
        if close and key not in ITEM_KEYS:
            raise DatalistError(f"{where}: unknown key {key!r}: did you mean {close[0]!r}?")


def _check_item(item: Any, where: str, spatial_dims: int, n_landmarks: int, base: Path, check_files: bool) -> dict:
    if not isinstance(item, dict) or "image" not in item:
        raise DatalistError(f"{where}: an item must be an object with an 'image' key, got {item!r:.80}")
    _check_item_keys(item, where)
    if not isinstance(item["image"], str) or not item["image"].strip():
        raise DatalistError(f"{where}.image: expected a file path, got {item['image']!r}")
    out = dict(item)
    image = Path(os.path.expanduser(str(item["image"])))
    image = image if image.is_absolute() else (base / image)
    if not image.exists() and "\\" in item["image"]:  # a datalist written on Windows: backslashes separate folders
        windows = base / os.path.expanduser(item["image"].replace("\\", "/"))
        image = windows if windows.exists() else image
    if check_files and not image.exists():
        raise DatalistError(f"{where}.image: file not found: {image}")
    out["image"] = os.path.normpath(image)
    if "landmarks" in item and item["landmarks"] is not None:
        lms = item["landmarks"]
        if not isinstance(lms, list) or len(lms) != n_landmarks:
            got = len(lms) if isinstance(lms, list) else type(lms).__name__
            raise DatalistError(
                f"{where}.landmarks: expected {n_landmarks} landmarks (one per landmark_names entry), got {got}"
            )
        for j, p in enumerate(lms):
            if p is None:
                continue
            if not isinstance(p, (list, tuple)) or len(p) != spatial_dims or not all(is_finite_number(v) for v in p):
                raise DatalistError(
                    f"{where}.landmarks[{j}]: expected null or {spatial_dims} finite numbers, got {p!r}"
                )
        out["landmarks"] = [None if p is None else [float(v) for v in p] for p in lms]
    if "spacing" in item and item["spacing"] is not None:
        sp = item["spacing"]
        if (
            not isinstance(sp, (list, tuple))
            or len(sp) != spatial_dims
            or not all(is_finite_number(v) and SPACING_RANGE_MM[0] <= v <= SPACING_RANGE_MM[1] for v in sp)
        ):
            raise DatalistError(
                f"{where}.spacing: expected {spatial_dims} numbers of mm per pixel between {SPACING_RANGE_MM[0]:g} and "
                f"{SPACING_RANGE_MM[1]:g}, got {sp!r}"
            )
        out["spacing"] = [float(v) for v in sp]
    return out


def carries_landmarks(item: dict) -> bool:
    """Whether a datalist item holds at least one landmark (not null): a template candidate, a scored item."""
    return any(p is not None for p in item.get("landmarks") or [])


def configuration_hint(found_dims: int, expected_dims: int) -> str:
    """What to run instead when data of ``found_dims`` spatial dimensions meet a configuration of ``expected_dims``."""
    return {
        (
            3,
            2,
        ): "; volumes need the 3D configuration (merge configs/train_3d.yaml after configs/train.yaml to train and "
        "evaluate, after configs/inference.yaml to infer)",
        (2, 3): "; 2D images need the 2D configuration (configs/train.yaml without configs/train_3d.yaml)",
    }.get((found_dims, expected_dims), "")


def load_datalist(path: str | os.PathLike, check_files: bool = True, spatial_dims: int | None = None) -> dict:
    """Read and validate a datalist; return it with absolute image paths.

    Args:
        path: the datalist JSON file (a leading ``~`` is expanded); relative image paths are taken from its folder.
        check_files: also refuse an item whose image file does not exist.
        spatial_dims: the configuration's, which the datalist's own must equal (None: either).

    Raises:
        DatalistError: naming the file and the key at fault (missing file, wrong landmark count, ...).
    """
    path = Path(os.path.expanduser(path))  # a quoted ~/... reaches us unexpanded
    if not path.is_file():
        raise DatalistError(f"datalist not found: {path}")
    data = read_json(path, "datalist JSON file")
    if not isinstance(data, dict):
        raise DatalistError(f"{path}: the top level must be an object")
    expected_dims, spatial_dims = spatial_dims, data.get("spatial_dims")
    if spatial_dims not in (2, 3):
        raise DatalistError(f"{path}: 'spatial_dims' must be 2 or 3, got {spatial_dims!r}")
    if expected_dims is not None and spatial_dims != expected_dims:
        raise DatalistError(
            f"{path}: a {spatial_dims}D datalist (spatial_dims: {spatial_dims}), but this configuration is "
            f"{expected_dims}D (spatial_dims: {expected_dims}){configuration_hint(spatial_dims, expected_dims)}"
        )
    names = data.get("landmark_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise DatalistError(f"{path}: 'landmark_names' must be a non-empty list of strings")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        where = "; ".join(f"{n!r} at positions {[i for i, m in enumerate(names) if m == n]}" for n in duplicates)
        raise DatalistError(f"{path}: 'landmark_names' must be unique, duplicated: {where}")
    base = path.parent
    out = dict(data)
    for section in SECTIONS:
        items = data.get(section, [])
        if not isinstance(items, list):
            raise DatalistError(f"{path}: '{section}' must be a list")
        out[section] = [
            _check_item(it, f"{path}:{section}[{i}]", spatial_dims, len(names), base, check_files)
            for i, it in enumerate(items)
        ]
    if data.get("template") is not None:
        out["template"] = _check_template(
            data["template"], f"{path}:template", spatial_dims, len(names), base, check_files
        )
    templates = data.get("templates")
    if templates is not None:
        if not isinstance(templates, list):
            raise DatalistError(f"{path}: 'templates' must be a list of items with landmarks")
        out["templates"] = [
            _check_template(it, f"{path}:templates[{i}]", spatial_dims, len(names), base, check_files)
            for i, it in enumerate(templates)
        ]
    return out


def section_items(
    datalist: dict, section: str, path: str | os.PathLike = "the datalist", labelled: bool = False
) -> list[dict]:
    """The datalist's ``section`` items; an empty or absent section raises ``DatalistError`` naming ``path``, and
    so does, with ``labelled`` (what an evaluation scores), one in which no item carries a landmark.

    What a command runs on (``training`` for training, ``test`` for evaluation): without it the command
    would finish without a result and without an error.

    Args:
        datalist: a datalist as :func:`load_datalist` returns it.
        section: ``training``, ``validation`` or ``test``.
        path: the datalist's file, for the messages.
        labelled: what an evaluation scores: also refuse a section in which no item carries a landmark or one that
            lists an image twice, and warn naming the items without a landmark.
    """
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
    items = datalist.get(section) or []
    if not items:
        raise EmptySectionError(
            f"{path}: the '{section}' list is empty: nothing to {'train on' if section == 'training' else 'run on'} "
            f"(the sections hold {', '.join(f'{s}: {len(datalist.get(s) or [])}' for s in SECTIONS)}); "
            f"{FILL_SECTION[section]}"
        )
    if labelled:
        unlabelled = [i for i, it in enumerate(items) if not carries_landmarks(it)]
        if len(unlabelled) == len(items):
            raise DatalistError(
                f"{path}: no '{section}' item carries a landmark: nothing to score (for landmarks on unlabelled "
                "images, run the inferring command)"
            )
        if unlabelled:
            warnings.warn(
                f"{path}: '{section}' items {unlabelled} carry no landmark: they are predicted, not scored "
                "(metrics.json's n_images counts the scored images)",
                stacklevel=2,
            )
        first: dict[str, int] = {}
        for i, it in enumerate(items):
            j = first.setdefault(os.path.normcase(it["image"]), i)
            if j != i:
                raise DatalistError(
                    f"{path}: '{section}' items {j} and {i} are the same image {it['image']}: it would be scored twice"
                )
    return items


def _check_template(item: Any, where: str, spatial_dims: int, n_landmarks: int, base: Path, check_files: bool) -> dict:
    """A checked template item: it must carry at least one landmark."""
    item = _check_item(item, where, spatial_dims, n_landmarks, base, check_files)
    if not carries_landmarks(item):
        raise DatalistError(f"{where}: a template must carry 'landmarks', at least one of them not null")
    return item


def unsplit_datalist(name: str, spatial_dims: int, landmark_names: list[str], items: list[dict]) -> dict:
    """A datalist with every item in ``training`` and empty ``validation`` / ``test`` (a folder's images as read,
    before ``prepare_data`` splits them)."""
    return {
        "name": name,
        "spatial_dims": spatial_dims,
        "landmark_names": landmark_names,
        **{s: (items if s == "training" else []) for s in SECTIONS},
    }


def save_datalist(datalist: dict, path: str | os.PathLike) -> Path:
    """Write ``datalist`` atomically, image paths made relative to the file's folder where possible."""
    path = Path(path)
    base = path.parent.resolve()

    def rel(item: dict) -> dict:
        item = dict(item)
        image = Path(item["image"])
        if image.is_absolute():
            try:
                item["image"] = os.path.relpath(image.resolve(), base)
            except ValueError:  # another drive on Windows
                item["image"] = str(image)
        return item

    out = dict(datalist)
    for section in SECTIONS:
        if section in out:
            out[section] = [rel(it) for it in out[section]]
    if out.get("template") is not None:
        out["template"] = rel(out["template"])
    if out.get("templates") is not None:
        out["templates"] = [rel(it) for it in out["templates"]]
    return write_json_atomic(path, out)


def datalist_landmarks(points) -> list[list[float] | None]:
    """Points ``(L, D)`` as a datalist's ``landmarks``: lists of floats, ``None`` where a point is not finite."""
    return [None if not np.isfinite(p).all() else [float(v) for v in p] for p in np.asarray(points, dtype=np.float64)]


def landmarks_array(item: dict, n_landmarks: int, spatial_dims: int) -> np.ndarray:
    """The item's landmarks as a float array ``(n_landmarks, spatial_dims)``, NaN where missing or absent."""
    arr = np.full((n_landmarks, spatial_dims), np.nan, dtype=np.float64)
    for j, p in enumerate(item.get("landmarks") or []):
        if p is not None:
            arr[j] = p
    return arr
