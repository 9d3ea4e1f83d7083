"""The model zoo's unit test of the bundle (ci/unit_tests/), run as the zoo's premerge runs it: from a zoo-like tree
holding the packaged archive unpacked as models/<name>/, each workflow initialised, its properties checked
(ConfigWorkflow.check_properties), run and finalised."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from scripts import package as packaging

ROOT = Path(__file__).resolve().parents[1]
UNIT_TEST = ROOT / "ci" / "unit_tests" / f"test_{packaging.DEFAULT_NAME}.py"


@pytest.mark.slow
def test_the_zoos_unit_test_passes_on_the_packaged_bundle(tmp_path):
    archive = packaging.package(output_dir=str(tmp_path / "dist"))
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp_path / "zoo" / "models")
    (tmp_path / "zoo" / "ci" / "unit_tests").mkdir(parents=True)
    shutil.copy(UNIT_TEST, tmp_path / "zoo" / "ci" / "unit_tests" / UNIT_TEST.name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BUNDLE_ROOT")}
    done = subprocess.run(
        [sys.executable, str(Path("ci") / "unit_tests" / UNIT_TEST.name), "-v"],
        cwd=tmp_path / "zoo",
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Ran 2 tests" in done.stderr and "OK" in done.stderr
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir()) == ["ci", "models"]  # it wrote only to its tmp folders
