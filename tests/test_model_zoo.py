"""Model zoo: metadata against the shipped schema, TorchScript export, network I/O check, the zip and its use."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from monai.bundle import ckpt_export, download, verify_metadata, verify_net_in_out

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import package as packaging  # noqa: E402

from bundle.configs import bundle_parser  # noqa: E402

CONFIGS = [str(ROOT / f"configs/{n}.yaml") for n in ("train", "evaluate", "inference")]
META = ROOT / "configs" / "metadata.json"
SCHEMA = ROOT / "docs" / "meta_schema_20240725.json"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_metadata_verifies_offline_against_the_shipped_schema_and_zoo_rules():
    meta = json.loads(META.read_text())
    assert json.loads(SCHEMA.read_text())["$schema"].startswith("https://json-schema.org/")
    # the official URL stays; the local copy is used because it exists (nothing is downloaded)
    assert meta["schema"].endswith("/meta_schema_20240725.json")
    verify_metadata(meta_file=str(META), filepath=str(SCHEMA))
    assert meta["version"] in meta["changelog"]
    pins = _pins(ROOT / "requirements.txt")
    assert meta["monai_version"] == pins["monai"] and meta["pytorch_version"] == pins["torch"] == torch.__version__.split("+")[0]
    assert meta["numpy_version"] == pins["numpy"] and "+" not in meta["pytorch_version"]
    assert set(map(str.lower, meta["required_packages_version"])) <= set(pins)
    assert "pytorch-ignite" in meta["required_packages_version"]
    fmt = meta["network_data_format"]
    assert list(fmt["inputs"]) == ["image"] and list(fmt["outputs"]) == ["pred"]
    assert fmt["outputs"]["pred"]["format"] == "points" and "points" in fmt["post_processed_outputs"]
    for required in ("LICENSE", "docs/README.md", "configs/inference.yaml", "models/model.pt"):
        assert (ROOT / required).is_file(), required


def test_verify_metadata_rejects_a_broken_file(tmp_path):
    meta = json.loads(META.read_text())
    del meta["network_data_format"]
    bad = tmp_path / "metadata.json"
    bad.write_text(json.dumps(meta))
    with pytest.raises(Exception, match="network_data_format"):
        verify_metadata(meta_file=str(bad), filepath=str(SCHEMA))


def test_points_network_verifies_and_exports_to_torchscript_matching_the_inferer(tmp_path):
    verify_net_in_out(net_id="points_network_def", meta_file=str(META), config_file=CONFIGS, device="cpu", bundle_root=str(ROOT))
    ts = tmp_path / "model.ts"
    ckpt_export(
        net_id="points_network_def", filepath=str(ts), ckpt_file=str(ROOT / "models/model.pt"), meta_file=str(META),
        config_file=CONFIGS, use_trace=True, input_shape=[1, 1, 192, 192], bundle_root=str(ROOT),
    )
    exported = torch.jit.load(str(ts))
    # reference: the bundle's own one-shot inferer (integer grid peak) on a test image of the datalist
    parser = bundle_parser(CONFIGS)
    dataset = parser.get_parsed_content("dataset")
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    image = torch.as_tensor(preprocessing(dict(dataset["test"][0]))["image"]).unsqueeze(0).float()
    network = parser.get_parsed_content("network").eval()
    image_t, points_t = parser.get_parsed_content("points_template")
    from bundle.oneshot import OneShotInferer

    inferer = OneShotInferer(refine_radius=0)
    inferer.set_template(image_t, points_t)
    expected = inferer(image, network).float()
    with torch.no_grad():
        got = exported(image)
    assert got.shape == (1, len(dataset["landmark_names"]), 2)
    torch.testing.assert_close(got, expected)
    extra = {"metadata.json": ""}
    torch.jit.load(str(ts), _extra_files=extra)
    assert json.loads(extra["metadata.json"])["version"] == json.loads(META.read_text())["version"]


def test_package_refuses_an_unlisted_large_file(tmp_path):
    root = tmp_path / "bundle_root"
    for name in ("LICENSE", "docs/README.md", "configs/inference.yaml", "configs/metadata.json", "models/model.pt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    (root / "configs/metadata.json").write_text(json.dumps({"version": "1.0", "changelog": {"1.0": "first"}}))
    (root / "models/big.pt").write_bytes(b"0" * 3 * 2**20)
    with pytest.raises(packaging.PackagingError, match="models/big.pt"):
        packaging.package(output_dir=str(tmp_path / "dist"), root=str(root), max_mb=2)
    (root / "large_files.yml").write_text('large_files:\n  - path: "models/big.pt"\n    url: "https://example.org/big.pt"\n')
    zipped = packaging.package(output_dir=str(tmp_path / "dist"), root=str(root), max_mb=2, name="b")
    names = zipfile.ZipFile(zipped).namelist()
    assert "b/models/model.pt" in names and "b/models/big.pt" not in names
    (root / "configs/metadata.json").write_text(json.dumps({"version": "2.0", "changelog": {"1.0": "first"}}))
    with pytest.raises(packaging.PackagingError, match="changelog"):
        packaging.package(output_dir=str(tmp_path / "dist"), root=str(root))


def _predictions(path: Path) -> list[tuple[str, float, float]]:
    with open(path) as f:
        return [(r["landmark"], float(r["x"]), float(r["y"])) for r in csv.DictReader(f)]


def test_zip_downloads_through_monai_and_runs_inference_from_the_unpacked_copy(tmp_path):
    zipped = Path(packaging.package(output_dir=str(tmp_path / "dist")))
    meta = json.loads(META.read_text())
    assert zipped.name == f"{packaging.DEFAULT_NAME}_v{meta['version']}.zip"
    with zipfile.ZipFile(zipped) as archive:
        names = archive.namelist()
        assert {n.split("/")[0] for n in names} == {packaging.DEFAULT_NAME}
        assert all(i.file_size <= 25 * 2**20 for i in archive.infolist())
        assert f"{packaging.DEFAULT_NAME}/models/model.pt" in names and not any("__pycache__" in n for n in names)

    bundles = tmp_path / "bundles"
    download(name=packaging.DEFAULT_NAME, url=zipped.as_uri(), bundle_dir=str(bundles), progress=False)
    unpacked = bundles / packaging.DEFAULT_NAME
    assert (unpacked / "configs" / "metadata.json").is_file()

    image = ROOT / "data/synthetic_2d/images/test_001.png"
    if not image.is_file():  # the embedded set is generated on first use
        from bundle.data.datalist import open_datalist

        open_datalist(ROOT / "data/synthetic_2d/datalist.json")
    outputs = {}
    for where, cwd in (("repo", ROOT), ("zip", unpacked)):
        command = [
            sys.executable, "-m", "monai.bundle", "run", "inferring", "--config_file",
            "['configs/train.yaml','configs/evaluate.yaml','configs/inference.yaml']",
            "--images", f"['{image}']", "--output_dir", str(tmp_path / where), "--progress_bar", "False",
        ]
        env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[where] = _predictions(tmp_path / where / "predictions.csv")
    # the unpacked bundle (its own code, weights and regenerated template) predicts what the repository does
    assert len(outputs["zip"]) == len(meta["network_data_format"]["outputs"]["pred"]["channel_def"])
    assert outputs["zip"] == outputs["repo"]
    assert (unpacked / "data/synthetic_2d/datalist.json").is_file()  # the template set was regenerated there
