"""Run the model zoo's other CI workflow steps on the packaged bundle, as its GitHub workflows run them.

    python -m scripts.zoo_ci ZOO_CHECKOUT [--python TOOLS_PY] [--workdir DIR] [--steps "['requirements','codeformat']"]

``ZOO_CHECKOUT`` is a copy of Project-MONAI/model-zoo (its code is run, not copied here). The archive of
``scripts/package.py`` is staged as ``WORKDIR/models/<name>/`` (``verify_zoo.stage``) beside the zoo's
``setup.cfg`` and ``pyproject.toml``, so that WORKDIR is the zoo's tree as a pull request would make it.

- ``requirements`` (``premerge-cpu.yml``, ``ci/run_premerge_cpu.sh``): ``ci/get_bundle_requirements.py``
  writes the bundle's pins (``ALLOW_MONAI_RC=true``, as the workflow sets it), which the workflow installs
  on Python 3.10; each line is checked with ``pip download --python-version 3.10 --only-binary=:all:
  --no-deps`` (needs the package index; nothing is installed).
- ``codeformat`` (``code-format-check.yml``, ``runtests.sh --codeformat``): ``isort --check``, ``black
  --skip-magic-trailing-comma --check``, ``flake8 --count --statistics`` and ``pytype`` on WORKDIR with
  the zoo's settings, run by ``--python`` (an interpreter with the zoo's ``requirements-dev.txt`` tools;
  the workflow's is Python 3.10).

Exit status 0 when every step passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import package as packaging
from scripts.cli import run_fire
from scripts.verify_zoo import stage

ZOO_PYTHON = "3.10"
# pins of configs/metadata.json checked to have CPython 3.10 wheels (pip download --python-version 3.10
# --only-binary=:all: --no-deps NAME==VERSION); tests/test_model_zoo.py holds the metadata to this list
PY310_WHEELS = {
    "monai": "1.6.1",
    "torch": "2.13.0",
    "numpy": "2.2.6",
    "pytorch-ignite": "0.5.5",
    "nibabel": "5.4.2",
    "SimpleITK": "2.5.7",
    "itk": "5.4.7",
    "fire": "0.7.1",
    "scikit-image": "0.25.2",
    "scipy": "1.15.3",
    "pillow": "12.3.0",
    "PyYAML": "6.0.3",
    "tensorboard": "2.21.0",
    "matplotlib": "3.10.9",
    "tqdm": "4.70.1",
}
ZOO_SETTINGS = ("setup.cfg", "pyproject.toml")


def metadata_pins(meta: dict) -> dict[str, str]:
    """The versions the zoo's ``get_bundle_requirements.py`` pins: monai, torch, numpy and the package dicts."""
    pins = {
        name: meta[key]
        for name, key in (("monai", "monai_version"), ("torch", "pytorch_version"), ("numpy", "numpy_version"))
        if key in meta
    }
    for key in ("optional_packages_version", "required_packages_version"):
        pins.update(meta.get(key, {}))
    return pins


def _run(command: list, cwd: Path, env: dict | None = None) -> int:
    print("$", " ".join(map(str, command)), f"(in {cwd})", flush=True)
    return subprocess.run(command, cwd=cwd, env=env).returncode


def check_requirements(zoo: Path, work: Path, name: str) -> list[str]:
    """The zoo's pins for the bundle that have no Python 3.10 wheel (empty: the premerge install step works)."""
    env = dict(os.environ, ALLOW_MONAI_RC="true")
    done = subprocess.run(
        [sys.executable, str(zoo / "ci" / "get_bundle_requirements.py"), "--b", name, "--p", str(work / "models")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"ci/get_bundle_requirements.py wrote no requirements file: {done.stderr[-2000:]}")
    listed = (work / done.stdout.strip()).read_text(encoding="utf-8")
    lines = [line.strip() for line in listed.splitlines() if line.strip()]
    failed = []
    with tempfile.TemporaryDirectory() as dest:
        for line in lines:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--pre", "--no-deps", "--only-binary=:all:"]
            command += ["--python-version", ZOO_PYTHON, "--dest", dest, line]
            if _run(command, work) != 0:
                failed.append(line)
    return failed


def check_codeformat(work: Path, python: str) -> list[str]:
    """The code-format tools (``runtests.sh --codeformat``) that report findings on WORKDIR."""
    version = subprocess.run(
        [python, "-c", "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    commands = {
        "isort": ["-m", "isort", "--check", str(work)],
        "black": ["-m", "black", "--skip-magic-trailing-comma", "--check", str(work)],
        "flake8": ["-m", "flake8", str(work), "--count", "--statistics"],
        "pytype": ["-m", "pytype", "-j", "2", f"--python-version={version}", str(work)],
    }
    # pytype looks up ``python<version>`` on PATH: the tools' interpreter comes first
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")]))
    return [tool for tool, args in commands.items() if _run([python, *args], work, env) != 0]


def zoo_ci(
    zoo: str,
    python: str = sys.executable,
    workdir: str | None = None,
    name: str = packaging.DEFAULT_NAME,
    steps: tuple = ("requirements", "codeformat"),
) -> int:
    """Stage the bundle in a copy of the zoo's tree and run the chosen workflow steps; 0 when all pass."""
    zoo_path = Path(zoo).resolve()
    missing = [p for p in ("ci/get_bundle_requirements.py", *ZOO_SETTINGS) if not (zoo_path / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{zoo_path} is not a model-zoo checkout (missing {', '.join(missing)})")
    unknown = set(steps) - {"requirements", "codeformat"}
    if unknown:
        raise ValueError(f"unknown steps {sorted(unknown)}: choose among 'requirements', 'codeformat'")
    work = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="zoo_ci_"))
    stage(work, name, zoo_path)
    shutil.rmtree(work / "dist")  # the archive is not part of the zoo's tree
    for settings in ZOO_SETTINGS:
        shutil.copy(zoo_path / settings, work / settings)
    status = 0
    if "requirements" in steps:
        failed = check_requirements(zoo_path, work, name)
        print(f"FAILED: no Python {ZOO_PYTHON} wheel for {failed}" if failed else "PASSED: requirements", flush=True)
        status |= bool(failed)
    if "codeformat" in steps:
        failed = check_codeformat(work, python)
        print(f"FAILED: code format {failed}" if failed else "PASSED: code format", flush=True)
        status |= bool(failed)
    return int(status)


if __name__ == "__main__":
    sys.exit(run_fire(zoo_ci))
