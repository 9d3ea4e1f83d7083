"""Build the model-zoo archive of the bundle: ``<name>_v<version>.zip`` holding one top-level folder ``<name>/``.

    python -m scripts.package [--output_dir dist] [--name cephalometric_xray_landmark_detection]

What goes in is what the bundle needs to run from its own folder and to be read (MONAI model-zoo layout):
``configs/``, ``models/``, the ``bundle/`` package the configs import, the product's ``scripts/`` (not
``scripts/experiments/``, the studies behind docs/results.md), ``LICENSE``, ``large_files.yml``,
``requirements.txt``, and of ``docs/`` the model card (``docs/README.md``), the guides reachable from it by links,
the files it links itself (its figure) and the data's licence terms (:func:`docs_files`); the other result records
and figures of docs/ stay out. The model zoo refuses files over 25 MB: such a file must
be listed in ``large_files.yml`` (and is then fetched by MONAI from its URL, not shipped); an unlisted
one is an error. ``configs/metadata.json`` must carry its ``version`` in its ``changelog``.
Each ``configs/*.yaml`` also goes in as ``configs/*.json`` (the same content): ``monai.bundle.load`` builds a
bundle's network from ``configs/<workflow_type>.json`` only, so ``train.yaml`` and ``inference.yaml`` go in under
each name MONAI takes for their workflow type too (``infer``, ``eval``, ``evaluation``, ``training``). The default
name follows the zoo's convention (anatomy, data type, task: the shipped weights and template are for lateral
cephalograms).
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import yaml
from bundle.io_utils import atomic_path
from bundle.settings import as_number
from monai.bundle import BundleWorkflow
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_NAME = "cephalometric_xray_landmark_detection"
INCLUDE = ("configs", "models", "scripts", "bundle", "LICENSE", "large_files.yml", "requirements.txt")
LEFT_OUT = ("scripts/experiments",)  # the studies, sweeps and comparison methods: not part of the product
MODEL_CARD = "docs/README.md"
DATA_LICENSE = "docs/data_license.txt"
LINK = re.compile(r"\]\(([^)\s#]+)")  # a markdown link's target, without its anchor
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}
SKIP_SUFFIXES = {".pyc", ".pyo", ".tmp"}
MAX_MB = 25.0


class PackagingError(ValueError):
    """The bundle breaks a model-zoo rule; the message names the file at fault."""


def large_file_paths(root: Path) -> set[str]:
    """Paths (relative to the bundle root) listed in ``large_files.yml`` (``large_files: [{path, url, ...}]``)."""
    path = root / "large_files.yml"
    if not path.is_file():
        return set()
    content = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = content.get("large_files") or []
    if not isinstance(entries, list) or any(not isinstance(e, dict) or "path" not in e for e in entries):
        raise PackagingError(f"{path}: 'large_files' must be a list of mappings with a 'path' (and 'url')")
    return {str(Path(e["path"])) for e in entries}


def linked_docs(root: Path, page: Path) -> list[Path]:
    """The files under ``root/docs`` that the markdown ``page`` links to (relative links; web addresses skipped)."""
    docs = root / "docs"
    found = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if ":" in target:
            continue
        path = (page.parent / target).resolve()
        if path.is_file() and path.is_relative_to(docs) and path not in found:
            found.append(path)
    return found


def docs_files(root: Path) -> list[Path]:
    """The docs of the archive (``root`` resolved): the model card, the markdown guides reachable from it by links
    (so that their links to each other hold), the other files the model card links (its figures) and the data's
    licence terms."""
    card = root / MODEL_CARD
    pages, queue, figures = [card], [card], [p for p in linked_docs(root, card) if p.suffix != ".md"]
    while queue:
        for path in linked_docs(root, queue.pop(0)):
            if path.suffix == ".md" and path not in pages:
                pages.append(path)
                queue.append(path)
    licence = [root / DATA_LICENSE] if (root / DATA_LICENSE).is_file() else []
    return sorted(set(pages + figures + licence))


def bundle_files(root: Path, max_mb: float = MAX_MB) -> list[Path]:
    """The files of the archive, relative to ``root``; large files listed in ``large_files.yml`` are left out."""
    root = root.resolve()
    listed = large_file_paths(root)
    candidates = []
    for top in INCLUDE:
        base = root / top
        candidates += [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    candidates = [p for p in candidates if not any(p.is_relative_to(root / out) for out in LEFT_OUT)]
    files = []
    for path in candidates + docs_files(root):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or path.suffix in SKIP_SUFFIXES or path.name.startswith("."):
            continue
        if path.stat().st_size > max_mb * 2**20:
            if str(rel) in listed:
                continue
            raise PackagingError(
                f"{rel} is over {max_mb:g} MB: list it in large_files.yml (path, url, hash_val, hash_type)"
            )
        files.append(rel)
    if not files:
        raise PackagingError(f"nothing to package under {root}")
    return files


def json_configs(root: Path, files: list[Path]) -> dict[str, str]:
    """JSON twins of the YAML configs among ``files``: ``{"configs/x.json": text}``, and of ``train.yaml`` /
    ``inference.yaml`` under each other name MONAI takes for a training / inference ``workflow_type``
    (``configs/infer.json``, ``training.json``, ...: ``monai.bundle.load`` reads ``configs/<workflow_type>.json``);
    a JSON file of the same name that is already there wins."""
    present = {rel.as_posix() for rel in files}
    aliases = {"train": BundleWorkflow.supported_train_type, "inference": BundleWorkflow.supported_infer_type}
    twins = {}
    for rel in files:
        if rel.parts[0] == "configs" and rel.suffix in (".yaml", ".yml"):
            content = yaml.safe_load((root / rel).read_text(encoding="utf-8"))
            for stem in dict.fromkeys((rel.stem, *aliases.get(rel.stem, ()))):
                target = rel.with_name(f"{stem}.json").as_posix()
                if target not in present:
                    twins[target] = json.dumps(content, indent=4) + "\n"
    return twins


def check_metadata(root: Path) -> str:
    """The bundle's version, after the model zoo's checks of ``configs/metadata.json`` and required files."""
    meta_path = root / "configs" / "metadata.json"
    if not meta_path.is_file():
        raise PackagingError(f"missing {meta_path}")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    version = meta.get("version")
    if not version or version not in meta.get("changelog", {}):
        raise PackagingError(f"{meta_path}: 'version' {version!r} must be a key of 'changelog'")
    for required in ("LICENSE", "docs/README.md", "configs/inference.yaml"):
        if not (root / required).is_file():
            raise PackagingError(f"the model zoo requires {required} (missing under {root})")
    if not (root / "models" / "model.pt").is_file() and "models/model.pt" not in large_file_paths(root):
        raise PackagingError("models/model.pt is neither present nor listed in large_files.yml")
    return version


def package(output_dir: str = "dist", name: str = DEFAULT_NAME, root: str | None = None, max_mb: float = MAX_MB) -> str:
    """Write ``output_dir/<name>_v<version>.zip`` (top-level folder ``<name>/``) and return its path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(name)):
        raise PackagingError(f"--name {name!r}: a bundle name is letters, digits, '_', '.' and '-' (no folders)")
    as_number(max_mb, "max_mb", minimum=1)
    root_path = Path(root).resolve() if root else ROOT
    version = check_metadata(root_path)
    files = bundle_files(root_path, max_mb=max_mb)
    target = Path(output_dir) / f"{name}_v{version}.zip"
    with atomic_path(target) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for rel in files:
                archive.write(root_path / rel, arcname=f"{name}/{rel.as_posix()}")
            for rel, text in json_configs(root_path, files).items():
                archive.writestr(f"{name}/{rel}", text)
        tmp.chmod(0o644)
    print(f"{target} ({len(files)} files, {target.stat().st_size / 2**20:.1f} MB)")
    return str(target)


if __name__ == "__main__":
    run_fire(package)
