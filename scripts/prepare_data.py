"""Write a landmark datalist (the README's datalist contract) from a labelled data set.

Run from the repository root::

    python -m scripts.prepare_data labelme --root DIR --out data/x/datalist.json \\
        [--annotators a,b] [--names isbi | --landmark_names "[n1,n2,...]"] [--spacing "[0.12,0.12]"]
    python -m scripts.prepare_data isbi2015 --root DIR --out ... [--test2 validation]
    python -m scripts.prepare_data hand --root DIR --out ... [--spacing "[0.1,0.1]"] [--csv all.csv]
    python -m scripts.prepare_data nifti --images_dir DIR [--markups_dir DIR] --out ... [--landmark_names ...]
    python -m scripts.prepare_data dicom --root DIR --out ... [--csv marks.csv] [--spacing ...] [--markups_dir DIR]
    python -m scripts.prepare_data mirrored --datalist D --out_dir DIR [--gamma 0.7]

Options of every command: ``--name``; ``--template ID`` makes the item whose file name (without suffix) is ID the
datalist's ``template``, ``--template ID1,ID2,...`` makes those items its ``templates`` (they stay in ``training``
and leave ``validation`` / ``test``); ``--validation IDS`` / ``--test IDS`` move those labelled items to
``validation`` / ``test``; ``--validation_fraction 0.0 --test_fraction 0.0 --seed 0`` then move a seeded random share
of the other labelled ``training`` items there; ``--keep_held_out_images true`` leaves the moved items' images in
``training`` without their landmarks, so that the self-supervised stage sees every image while their labels stay held
out (the transductive protocol of docs/results.md). Reader warnings (duplicated or missing labels, …) are printed,
then a summary, with one line counting the images without landmarks (those meant to be unlabelled are not warned
about one by one).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from bundle.data.annotations import MultiAnnotatorSet, image_stem, natural_key
from bundle.data.datalist import SECTIONS, load_datalist, save_datalist
from bundle.data.dicom import dicom_series_datalist, dicom_xray_datalist, find_dicom_files
from bundle.data.hand_csv import hand_datalist
from bundle.data.images import ImageError, check_image_file, pil_as_displayed
from bundle.data.isbi2015 import ISBI_2015_LANDMARK_NAMES, ISBI_2015_SPACING_MM, read_isbi2015_set
from bundle.data.labelme import read_labelme_set
from bundle.data.nifti import nifti_datalist
from bundle.io_utils import atomic_path, check_output_file
from bundle.settings import as_number
from bundle.transforms.landmarks import outside_excess
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[1]

BUILT_IN_NAMES = {"isbi": ISBI_2015_LANDMARK_NAMES}


def item_id(item: dict) -> str:
    """An item's id: its image file name without suffix (``001.png`` -> ``001``, ``a.nii.gz`` -> ``a``)."""
    return image_stem(item["image"])


def as_names(value: Any, option: str) -> list[str] | None:
    """A list option given as ``a,b`` (fire makes a tuple or a string) or ``"[a,b]"``."""
    if value is None:
        return None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    raise ValueError(f"--{option}: expected a comma-separated list, got {value!r}")


def as_spacing(value: Any, spatial_dims: int) -> list[float] | None:
    """``--spacing``: one positive number for every axis, or ``spatial_dims`` of them."""
    if value is None:
        return None
    values = [value] * spatial_dims if isinstance(value, (int, float)) else value
    if (
        not isinstance(values, (list, tuple))
        or len(values) != spatial_dims
        or not all(isinstance(v, (int, float)) and np.isfinite(v) and v > 0 for v in values)
    ):
        raise ValueError(f"--spacing: expected {spatial_dims} positive numbers (mm per pixel), got {value!r}")
    return [float(v) for v in values]


def as_ids(value: Any, option: str) -> list[str]:
    """An id option: one id (``046``, which fire may hand over as a number) or several (``046,012`` or
    ``"[046,012]"``); none when not given."""
    if value is None:
        return []
    if isinstance(value, str) and value.strip().startswith("["):
        value = value.strip()[1:-1]
    return as_names(value if isinstance(value, (str, list, tuple)) else str(value), option)


def labelled_item(datalist: dict, wanted: str, option: str) -> dict:
    """The item of id ``wanted`` (in any section), which must carry landmarks; refused naming ``--option``."""
    found = [it for s in SECTIONS for it in datalist[s] if item_id(it) == wanted]
    if not found:
        example = next((item_id(it) for s in SECTIONS for it in datalist[s]), None)
        raise KeyError(f"--{option}: no item with id {wanted!r} (ids are image names without suffix, e.g. {example!r})")
    if not found[0].get("landmarks"):
        raise ValueError(f"--{option}: item {wanted!r} ({found[0]['image']}) carries no landmarks")
    return found[0]


def set_template(datalist: dict, template: Any) -> dict:
    """Copy the item with id ``template`` to ``datalist["template"]`` (several ids: each to ``templates``), removed
    from validation and test."""
    wanted = as_ids(template, "template")
    if not wanted:
        return datalist
    chosen = [dict(labelled_item(datalist, i, "template")) for i in dict.fromkeys(wanted)]
    out = dict(datalist, **({"template": chosen[0]} if len(chosen) == 1 else {"templates": chosen}))
    for section in ("validation", "test"):
        out[section] = [it for it in datalist[section] if item_id(it) not in wanted]
    return out


def move_items(datalist: dict, validation: Any, test: Any, keep_held_out_images: bool = False) -> dict:
    """Move the labelled training items of the ids ``validation`` / ``test`` to those sections (never a template);
    with ``keep_held_out_images`` their images stay in ``training`` without landmarks."""
    targets = {i: "validation" for i in as_ids(validation, "validation")}
    for i in as_ids(test, "test"):
        if targets.get(i) == "validation":
            raise ValueError(f"--validation and --test both name {i!r}: an image is in one of them")
        targets[i] = "test"
    templates = [datalist["template"]] if datalist.get("template") else list(datalist.get("templates") or [])
    for i in targets:
        if i in {item_id(t) for t in templates}:
            raise ValueError(f"--{targets[i]}: {i!r} is a template (--template), it cannot be held out too")
        labelled_item(datalist, i, targets[i])
    if not targets:
        return datalist
    out = dict(datalist)
    out["training"] = [
        {"image": it["image"]} if item_id(it) in targets else it
        for it in datalist["training"]
        if keep_held_out_images or item_id(it) not in targets
    ]
    for section in ("validation", "test"):
        moved = [it for it in datalist["training"] if targets.get(item_id(it)) == section]
        out[section] = sorted(datalist[section] + moved, key=lambda it: natural_key(item_id(it)))
    return out


def split_training(
    datalist: dict, validation_fraction: float, test_fraction: float, seed: int, keep_held_out_images: bool = False
) -> dict:
    """Move a seeded random share of the labelled training items (never the template) to validation / test.

    With ``keep_held_out_images`` the moved items stay in ``training`` as image-only (unlabelled) items.
    """
    for option, value in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"--{option}: expected a number in [0, 1], got {value!r}")
    if validation_fraction + test_fraction > 1.0:
        total = validation_fraction + test_fraction
        raise ValueError(f"--validation_fraction + --test_fraction must not exceed 1, got {total}")
    training = datalist["training"]
    templates = [datalist["template"]] if datalist.get("template") else list(datalist.get("templates") or [])
    kept = {item_id(t) for t in templates}
    candidates = [i for i, it in enumerate(training) if it.get("landmarks") and item_id(it) not in kept]
    order = np.random.default_rng(seed).permutation(len(candidates))
    n_val = round(validation_fraction * len(candidates))
    n_test = min(round(test_fraction * len(candidates)), len(candidates) - n_val)
    moved = {candidates[k]: "validation" for k in order[:n_val]}
    moved.update({candidates[k]: "test" for k in order[n_val : n_val + n_test]})
    kept = [
        (it if i not in moved else {"image": it["image"]})
        for i, it in enumerate(training)
        if keep_held_out_images or i not in moved
    ]
    out = dict(datalist, training=kept)
    for section in ("validation", "test"):
        joined = datalist[section] + [training[i] for i, s in moved.items() if s == section]
        out[section] = sorted(joined, key=lambda it: natural_key(item_id(it)))
    return out


def summary(datalist: dict, n_warnings: int) -> list[str]:
    """Lines that describe a datalist: items per section, landmarks, nulls, template, warnings."""
    lines = [f"{datalist['name']}: {datalist['spatial_dims']}D, {len(datalist['landmark_names'])} landmarks"]
    for section in SECTIONS:
        items = datalist[section]
        labelled = [it for it in items if it.get("landmarks")]
        nulls = sum(p is None for it in labelled for p in it["landmarks"])
        lines.append(f"  {section}: {len(items)} items, {len(labelled)} with landmarks, {nulls} null landmarks")
    template = datalist.get("template")
    lines.append(f"  template: {template['image'] if template else 'none'}")
    if datalist.get("templates"):
        lines.append(f"  templates: {', '.join(item_id(t) for t in datalist['templates'])}")
    unlabelled = [it for it in datalist["training"] if not it.get("landmarks")]
    lines.append(f"  unlabelled: {len(unlabelled)} images without landmarks (in training; inferring finds theirs)")
    lines.append(f"  warnings: {n_warnings}")
    return lines


def annotator_summary(dataset: MultiAnnotatorSet) -> list[str]:
    """The inter-annotator distance of a multi-annotator set, in pixels."""
    d = dataset.inter_annotator_distances()
    if d.size == 0:
        return []
    mean, median = d.mean(), np.median(d)
    return [f"  inter-annotator distance: mean {mean:.2f} px, median {median:.2f} px over {d.size} landmark pairs"]


def check_images(datalist: dict) -> None:
    """Read every image of ``datalist`` as the pipeline does; a file that is unreadable (truncated, not an
    image), of another dimensionality than ``spatial_dims`` or not finite is refused, naming it, and so is a 2D
    landmark outside its image at all (the pipeline's rule, :func:`bundle.transforms.landmarks.outside_excess`, which
    warns about one slightly outside); nothing is then written (size and constant images are left to the pipeline's
    checks)."""
    items = [it for section in SECTIONS for it in datalist.get(section) or []]
    items += [datalist["template"]] if datalist.get("template") else []
    items += list(datalist.get("templates") or [])
    problems, shapes = [], {}
    for image in dict.fromkeys(str(it["image"]) for it in items):
        try:
            shapes[image] = check_image_file(image, datalist["spatial_dims"], min_size=1, warn_constant=False)
        except ImageError as e:
            problems.append(str(e))
    if datalist["spatial_dims"] == 2:  # 2D landmarks are pixels of the file (3D ones are world mm)
        names = datalist["landmark_names"]
        for it in items:
            size = shapes.get(str(it["image"]))
            for name, point in zip(names, it.get("landmarks") or []) if size else []:
                excess = np.linalg.norm(outside_excess([point], size)) if point is not None else 0.0
                if excess > 0:
                    problems.append(
                        f"{it['image']}: landmark {name} at {point} lies outside the {size[0]} x {size[1]} image "
                        f"({excess:.2f} px beyond its pixels' extent, [-0.5, size - 0.5])"
                    )
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"{len(problems)} image(s) or landmark(s) cannot be used; no datalist written:\n  {shown}")


def write(
    read: Callable[[], tuple[dict, list[str]]],
    out: str,
    validation_fraction: float,
    test_fraction: float,
    seed: int,
    template: Any,
    keep_held_out_images: bool = False,
    validation: Any = None,
    test: Any = None,
) -> None:
    """Run the reader, check that every image reads as the pipeline reads it, print the warnings, split, write
    ``out`` atomically (validated), print a summary."""
    seed = as_number(seed, "seed", minimum=0, integer=True)  # before the images are read
    out_path = check_output_file(out)  # before the images are read; a quoted ~/... reaches us unexpanded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # libraries' (SWIG's, ITK's), not the data's; shown always, SWIG's also comes back as the process ends
        warnings.simplefilter("ignore", DeprecationWarning)
        datalist, extra = read()
        check_images(datalist)
    for w in caught:
        print(f"warning: {w.message}")
    datalist = set_template(datalist, template)
    datalist = move_items(datalist, validation, test, keep_held_out_images)
    datalist = split_training(datalist, validation_fraction, test_fraction, seed, keep_held_out_images)
    with atomic_path(out_path) as tmp:  # the file appears only once it passes load_datalist
        save_datalist(datalist, tmp)
        load_datalist(tmp)
    print(f"wrote {out_path}")
    print("\n".join(summary(datalist, len(caught)) + extra))


def labelme(
    root: str,
    out: str,
    annotators: Any = None,
    names: str | None = None,
    landmark_names: Any = None,
    spacing: Any = None,
    name: str | None = None,
    validation_fraction: float = 0.0,
    test_fraction: float = 0.0,
    seed: int = 0,
    template: Any = None,
    validation: Any = None,
    test: Any = None,
    keep_held_out_images: bool = False,
) -> None:
    """Labelme set ROOT/images + ROOT/annotations/<annotator>/*.json; ``--names isbi`` names l1..l19 as ISBI 2015."""
    if names is not None and landmark_names is not None:
        raise ValueError("give --names or --landmark_names, not both")
    if names is not None and names not in BUILT_IN_NAMES:
        raise KeyError(f"--names: unknown built-in name list {names!r} (known: {', '.join(BUILT_IN_NAMES)})")
    lm_names = BUILT_IN_NAMES[names] if names is not None else as_names(landmark_names, "landmark_names")

    def read() -> tuple[dict, list[str]]:
        dataset = read_labelme_set(root, as_names(annotators, "annotators"), lm_names)
        return dataset.to_datalist(name or Path(root).name, as_spacing(spacing, 2)), annotator_summary(dataset)

    write(read, out, validation_fraction, test_fraction, seed, template, keep_held_out_images, validation, test)


def isbi2015(
    root: str,
    out: str,
    test2: str = "test",
    name: str = "isbi2015",
    validation_fraction: float = 0.0,
    test_fraction: float = 0.0,
    seed: int = 0,
    template: Any = None,
    validation: Any = None,
    test: Any = None,
    keep_held_out_images: bool = False,
) -> None:
    """ISBI 2015 set ROOT/RawImage + ROOT/AnnotationsByMD; ``--test2 validation`` puts Test2Data in validation."""

    def read() -> tuple[dict, list[str]]:
        dataset = read_isbi2015_set(root, test2)
        return dataset.to_datalist(name, [ISBI_2015_SPACING_MM] * 2), annotator_summary(dataset)

    write(read, out, validation_fraction, test_fraction, seed, template, keep_held_out_images, validation, test)


def hand(
    root: str,
    out: str,
    spacing: Any = None,
    landmark_names: Any = None,
    csv: str = "all.csv",
    name: str | None = None,
    validation_fraction: float = 0.0,
    test_fraction: float = 0.0,
    seed: int = 0,
    template: Any = None,
    validation: Any = None,
    test: Any = None,
    keep_held_out_images: bool = False,
) -> None:
    """Hand set ROOT/<csv> + ROOT/images; ``--spacing`` for images whose format has no header spacing."""

    def read() -> tuple[dict, list[str]]:
        names = as_names(landmark_names, "landmark_names")
        return hand_datalist(root, as_spacing(spacing, 2), names, csv, name), []

    write(read, out, validation_fraction, test_fraction, seed, template, keep_held_out_images, validation, test)


def nifti(
    images_dir: str,
    out: str,
    markups_dir: str | None = None,
    landmark_names: Any = None,
    name: str | None = None,
    validation_fraction: float = 0.0,
    test_fraction: float = 0.0,
    seed: int = 0,
    template: Any = None,
    validation: Any = None,
    test: Any = None,
    keep_held_out_images: bool = False,
) -> None:
    """NIfTI volumes IMAGES_DIR/X.nii[.gz] with 3D Slicer markups MARKUPS_DIR/X.fcsv or X.mrk.json."""

    def read() -> tuple[dict, list[str]]:
        names = as_names(landmark_names, "landmark_names")
        return nifti_datalist(images_dir, markups_dir, names, name), []

    write(read, out, validation_fraction, test_fraction, seed, template, keep_held_out_images, validation, test)


def dicom(
    root: str,
    out: str,
    csv: str | None = None,
    spacing: Any = None,
    markups_dir: str | None = None,
    landmark_names: Any = None,
    name: str | None = None,
    validation_fraction: float = 0.0,
    test_fraction: float = 0.0,
    seed: int = 0,
    template: Any = None,
    validation: Any = None,
    test: Any = None,
    keep_held_out_images: bool = False,
) -> None:
    """DICOM: single-frame X-ray files in ROOT (any suffix) with a landmark CSV ``id,x1,y1,...`` (``--csv``),
    or, when ROOT holds no DICOM file itself, one CT series per sub-folder ROOT/X/ with 3D Slicer markups
    X.fcsv / X.mrk.json (in ``--markups_dir``, default ROOT). X-ray spacing is read from the headers at load
    time; ``--spacing`` is written only for files whose header has none."""

    def read() -> tuple[dict, list[str]]:
        names = as_names(landmark_names, "landmark_names")
        root_path = Path(root)
        if root_path.is_dir() and find_dicom_files(root_path):
            if markups_dir is not None:
                raise ValueError(f"--markups_dir is for CT series folders, but {root} holds DICOM X-ray files")
            return dicom_xray_datalist(root, csv, as_spacing(spacing, 2), names, name), []
        if csv is not None or spacing is not None:
            raise ValueError(f"--csv / --spacing are for X-ray files, but {root} holds no DICOM file itself")
        return dicom_series_datalist(root, markups_dir, names, name), []

    write(read, out, validation_fraction, test_fraction, seed, template, keep_held_out_images, validation, test)


def hamedan_protocol(root: str | Path, out: str | Path) -> str:
    """The datalist of docs/results.md's protocol from the Hamedan set at ``root`` (labelme, ISBI names, 0.12 mm,
    seeded 60 / 10 / 30 split, the held-out images kept unlabelled in ``training``), written to ``out``."""
    labelme(
        str(root),
        str(out),
        names="isbi",
        spacing=[0.12, 0.12],
        validation_fraction=0.1,
        test_fraction=0.3,
        seed=0,
        keep_held_out_images=True,
    )
    return str(out)


def mirrored(datalist: str, out_dir: str, gamma: float = 0.7) -> None:
    """Another site, simulated (the annotation loop's images unlike the shipped detector's, docs/results.md): every
    image of the 2D 8-bit ``datalist`` mirrored left-right (a face that looked right looks left) and exposed with
    ``gamma`` (``255 (v / 255) ** gamma``), to ``out_dir/images/<name>.png``, and ``out_dir/datalist.json``: the same
    items and sections with the landmarks mirrored too (``x -> width - 1 - x``)."""
    from PIL import Image

    if as_number(gamma, "--gamma", minimum=0) == 0:
        raise ValueError(f"--gamma: expected a number > 0, got {gamma!r}")
    source = load_datalist(datalist)
    if source["spatial_dims"] != 2:
        raise ValueError(f"{datalist}: mirrored takes a 2D datalist, not spatial_dims {source['spatial_dims']}")
    for path in sorted({it["image"] for section in SECTIONS for it in source.get(section) or []}):
        try:  # every image's header first, so that nothing is written for a datalist it cannot convert
            with Image.open(path) as opened:
                mode = opened.mode
        except OSError as e:
            raise ValueError(f"{path}: mirrored reads 8-bit PNG, JPEG or BMP pictures, not this file ({e})") from e
        if mode not in ("L", "P", "RGB", "RGBA"):
            raise ValueError(f"{path}: mirrored takes 8-bit images, this one is {mode}")
    images = Path(out_dir) / "images"
    images.mkdir(parents=True, exist_ok=True)
    widths: dict[str, int] = {}

    def convert(item: dict) -> dict:
        path = Path(item["image"])
        target = images / f"{path.stem}.png"
        if str(path) not in widths:
            with Image.open(path) as opened:  # turned by its EXIF orientation, as the pipeline reads it
                pixels = np.asarray(pil_as_displayed(opened).convert("L"), dtype=np.float64)
            exposed = np.round(255.0 * (pixels / 255.0) ** gamma)[:, ::-1].astype(np.uint8)
            with atomic_path(target) as tmp:
                Image.fromarray(exposed).save(tmp, format="PNG")
            widths[str(path)] = pixels.shape[1]
        width = widths[str(path)]
        out = dict(item, image=str(target.resolve()))
        if item.get("landmarks"):
            out["landmarks"] = [None if p is None else [width - 1 - p[0], p[1]] for p in item["landmarks"]]
        return out

    result = {k: [convert(it) for it in v] if k in SECTIONS else v for k, v in source.items()}
    result["name"] = f"{source.get('name', 'datalist')}_mirrored_gamma{gamma:g}"
    out_path = Path(out_dir) / "datalist.json"
    with atomic_path(out_path) as tmp:
        save_datalist(result, tmp)
        load_datalist(tmp)
    print(f"wrote {out_path} ({len(widths)} images)")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python -m scripts.prepare_data {labelme|isbi2015|hand|nifti|dicom|mirrored} ...``."""
    run_fire(
        {"labelme": labelme, "isbi2015": isbi2015, "hand": hand, "nifti": nifti, "dicom": dicom, "mirrored": mirrored},
        argv,
    )


if __name__ == "__main__":
    main()
