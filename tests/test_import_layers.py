"""The package's layers: a module imports only its own layer or lower ones, at module level, and each imports alone.

Read from the source (``ast``), not by importing: a new module must be given a layer here, and an import from a lower
layer to a higher one, or a function-level import of the package's own modules (how import cycles hide), fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bundle"
# lowest first; a module belongs to the layer of its longest listed prefix
LAYERS = [
    # coordinates, files, messages, compiled kernels
    ["bundle", "bundle.io_utils", "bundle.command_errors", "bundle.geometry", "bundle.kernels"],
    [  # data, config values, the matching core and the template file format: torch, MONAI and the layer below only
        "bundle.data",
        "bundle.configs",
        "bundle.settings",
        "bundle.distributed",
        "bundle.progress",
        "bundle.passes",
        "bundle.commands",
        "bundle.networks.features",
        "bundle.networks.matching",
        "bundle.kshot",
        "bundle.template_file",
        "bundle.checkpoints",
        "bundle.information_groups",
        "bundle.engines.cpu_threads",
    ],
    ["bundle.networks", "bundle.transforms", "bundle.metrics", "bundle.information"],
    [
        "bundle.inferers",
        "bundle.losses",
        "bundle.engines",
        "bundle.templates.selection",
        "bundle.templates.pseudo_labels",
    ],
    ["bundle.templates", "bundle.reporting", "bundle.journal"],
    ["bundle.pipeline"],  # which pipeline predicts, the detector's data
    ["bundle.handlers"],  # engines' glue, read by the configs
    ["bundle.pipeline.predictor"],  # what predicts, built from all of the above
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer_of(module: str) -> int:
    best, layer = "", None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, i
    if layer is None:
        raise KeyError(module)
    return layer


def _bundle_imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """``(module, line, at module level)`` of every import of the package's own modules."""
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [(n, node.lineno, id(node) in top) for n in names if n == "bundle" or n.startswith("bundle.")]
    return found


def test_every_module_has_a_layer():
    unplaced = []
    for module in _modules():
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"


def test_no_import_from_a_lower_layer_to_a_higher_one_and_none_inside_functions():
    faults = []
    for module, path in _modules().items():
        own = layer_of(module)
        for imported, line, top_level in _bundle_imports(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
            if not top_level:
                faults.append(f"{where} inside a function or block")
            elif layer_of(imported) > own:
                faults.append(f"{where} (layer {layer_of(imported)} above its own {own})")
    assert not faults, "\n".join(faults)


def test_layer_check_sees_a_violation():
    tree = ast.parse("import torch\nfrom bundle.handlers import X\n\ndef f():\n    from bundle.geometry import y\n")
    imports = _bundle_imports(tree)
    assert imports == [("bundle.handlers", 2, True), ("bundle.geometry", 5, False)]
    assert layer_of("bundle.handlers") > layer_of("bundle.networks.matching") > layer_of("bundle.geometry")


@pytest.mark.slow
def test_each_module_imports_alone():
    """Each module in a fresh import state (the package's modules removed from ``sys.modules`` between them): an
    import cycle that only the usual import order hides fails here."""
    code = (
        "import importlib, sys\n"
        f"modules = {sorted(_modules())!r}\n"
        "failed = []\n"
        "for m in modules:\n"
        "    for k in [k for k in sys.modules if k == 'bundle' or k.startswith('bundle.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
