"""Run the MONAI model zoo's own pre-merge check (``ci/verify_bundle.py``) on this bundle, offline.

    python -m scripts.verify_zoo ZOO_CHECKOUT [--mode full] [--workdir DIR] [--name NAME]

``ZOO_CHECKOUT`` is a copy of the Project-MONAI/model-zoo repository (its ``ci/`` folder and
``models/model_info.json`` are used; nothing of it is copied into this repository). The bundle is staged
as the zoo would receive it: ``scripts/package.py`` builds the archive (with the JSON twins of the
configs) and it is unpacked into ``WORKDIR/models/<name>/`` beside a copy of the zoo's ``model_info.json``
(the version check reads it); the metadata schema that the zoo's CI downloads into ``<bundle>/eval/schema.json``
is the copy shipped in ``docs/`` (same file name as the metadata's ``schema`` URL). Then, from the zoo
checkout, ``python ci/verify_bundle.py -b <name> -p WORKDIR/models -m <mode>`` runs with this
interpreter: directory and version checks, ``verify_metadata``, the inference properties (skipped by the
zoo when ``supported_apps`` names none), ``verify_net_in_out --net_id network_def`` and the TorchScript
export (``ckpt_export``, scripting) of ``configs/inference``.

Two checks the zoo leaves to the bundle follow on the staged copy: ``ConfigWorkflow(workflow_type=
"inference").check_properties()`` (MONAI's inference properties) and ``monai.bundle.load`` of the
inference and train networks (``configs/<workflow_type>.json``) with ``models/model.pt``, in a fresh Python
started in ``WORKDIR``, not the bundle's folder (the configs' ``initialize`` makes the bundle's package
importable where MONAI does not: ``load`` works from any working directory).
Exit status 0 when everything passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from scripts import package as packaging
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[1]

EXTRA_CHECKS = r"""
import sys, torch
from monai.bundle import ConfigWorkflow, load
models, name = sys.argv[1], sys.argv[2]
root = f"{models}/{name}"
workflow = ConfigWorkflow(config_file=f"{root}/configs/inference.json", meta_file=f"{root}/configs/metadata.json",
                          logging_file=f"{root}/configs/logging.conf", workflow_type="inference", bundle_root=root)
workflow.initialize()
missing = workflow.check_properties()
assert not missing, f"ConfigWorkflow inference properties missing: {missing}"
print("ConfigWorkflow(workflow_type='inference').check_properties(): none missing")
for workflow_type in ("inference", "train"):
    net = load(name=name, bundle_dir=models, workflow_type=workflow_type, source="github", device="cpu",
               copy_model_args={"inplace": True})
    assert isinstance(net, torch.nn.Module), f"monai.bundle.load({workflow_type!r}) returned {type(net).__name__}"
    print(f"monai.bundle.load(workflow_type={workflow_type!r}): {type(net).__name__}")
"""


def stage(workdir: Path, name: str, zoo: Path) -> Path:
    """Unpack the bundle's archive into ``workdir/models/<name>`` with the zoo's model_info.json and the schema."""
    models = workdir / "models"
    if models.exists():
        shutil.rmtree(models)
    models.mkdir(parents=True)
    archive = packaging.package(output_dir=str(workdir / "dist"), name=name)
    with zipfile.ZipFile(archive) as z:
        z.extractall(models)
    shutil.copy(zoo / "models" / "model_info.json", models / "model_info.json")
    bundle = models / name
    schema_url = json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))["schema"]
    local = ROOT / "docs" / schema_url.rsplit("/", 1)[-1]
    if not local.is_file():
        raise FileNotFoundError(f"the metadata's schema {schema_url} has no offline copy at {local}")
    (bundle / "eval").mkdir()
    shutil.copy(local, bundle / "eval" / "schema.json")
    return bundle


def verify(zoo: str, mode: str = "full", workdir: str | None = None, name: str = packaging.DEFAULT_NAME) -> int:
    """Stage the bundle and run the zoo's ``ci/verify_bundle.py`` on it (then the extra checks in ``full`` mode)."""
    zoo_path = Path(zoo).resolve()
    script = zoo_path / "ci" / "verify_bundle.py"
    if not script.is_file():
        raise FileNotFoundError(f"{zoo_path} is not a model-zoo checkout (no ci/verify_bundle.py)")
    work = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="verify_zoo_"))
    bundle = stage(work, name, zoo_path)
    # the bundle's own copy of its code is what the zoo imports (verify_bundle.py puts the bundle folder first)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "2")
    command = [sys.executable, str(script), "-b", name, "-p", str(bundle.parent), "-m", mode]
    print("$", " ".join(command), f"(in {zoo_path})", flush=True)
    done = subprocess.run(command, cwd=zoo_path, env=env)
    if done.returncode != 0:
        print(f"FAILED: the zoo's verify_bundle.py -m {mode} exited with {done.returncode}", flush=True)
        return done.returncode
    print(f"PASSED: the zoo's verify_bundle.py -m {mode} on {bundle}", flush=True)
    if mode == "full":
        # from outside the bundle's folder: the configs themselves make the bundle's code importable
        done = subprocess.run([sys.executable, "-c", EXTRA_CHECKS, str(bundle.parent), name], cwd=work, env=env)
        if done.returncode != 0:
            print("FAILED: extra checks (ConfigWorkflow properties, monai.bundle.load)", flush=True)
            return done.returncode
        print("PASSED: ConfigWorkflow inference properties and monai.bundle.load", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_fire(verify))
