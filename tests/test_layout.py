"""docs/layout.md lists every module of the shipped package, the MONAI Label app and the scripts (the layers
themselves: tests/test_import_layers.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")


def _modules(folder: str, relative_to: str) -> list[str]:
    base = ROOT / relative_to
    return sorted(p.relative_to(base).as_posix() for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py")


def test_every_bundle_module_is_listed():
    missing = [m for m in _modules("bundle", "bundle") if not re.search(rf"(?<![\w/]){re.escape(m)}\b", LAYOUT)]
    assert not missing, f"docs/layout.md does not list {missing}"


def test_every_app_and_script_module_is_named():
    names = [Path(m).stem for m in _modules("apps/monailabel", "apps/monailabel") + _modules("scripts", "scripts")]
    missing = sorted({n for n in names if not re.search(rf"\b{re.escape(n)}\b", LAYOUT)})
    assert not missing, f"docs/layout.md does not name {missing}"


def test_the_listed_bundle_modules_exist():
    listed = re.findall(r"^  ([a-z_]+(?:/[a-z_]+)*\.py)\s", LAYOUT, flags=re.M)
    assert listed, "no module list found in docs/layout.md"
    gone = [m for m in listed if not (ROOT / "bundle" / m).is_file()]
    assert not gone, f"docs/layout.md lists modules that do not exist: {gone}"
