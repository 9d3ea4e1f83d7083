"""Model zoo: metadata against the shipped schema, the standalone inference config, its scriptable network and
built-in template, the zip (with JSON configs) and its use; the zoo's own CI when a checkout is given."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import bundle
import numpy as np
import pytest
import torch
from bundle.configs import bundle_parser
from bundle.data.synthetic import generate_synthetic_2d
from monai.bundle import ConfigWorkflow, ckpt_export, download, run, verify_metadata, verify_net_in_out
from PIL import Image
from scripts import package as packaging
from scripts import zoo_ci

ROOT = Path(__file__).resolve().parents[1]

INFERENCE = str(ROOT / "configs" / "inference.yaml")
META = ROOT / "configs" / "metadata.json"
SCHEMA = ROOT / "docs" / "meta_schema_20240725.json"
TEMPLATE = ROOT / "models" / "template_features.pt"
HAMEDAN = ROOT.parent / "shared" / "data" / "hamedan_ceph"


@pytest.fixture(scope="module")
def tiny_datalist(tmp_path_factory):
    return generate_synthetic_2d(tmp_path_factory.mktemp("data"), n_training=2, n_validation=0, n_test=2, seed=3)


@pytest.fixture(scope="module")
def zipped(tmp_path_factory) -> Path:
    """The model-zoo archive of the bundle, built by ``scripts/package.py`` (once for the module)."""
    return Path(packaging.package(output_dir=str(tmp_path_factory.mktemp("dist"))))


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_zoo_pins_have_python_3_10_wheels():
    """Every version the zoo's premerge installs (ci/get_bundle_requirements.py reads these keys) is one
    recorded with a CPython 3.10 wheel; the newest scipy, scikit-image, pillow and matplotlib have none."""
    pins = zoo_ci.metadata_pins(json.loads(META.read_text()))
    assert set(pins) == set(zoo_ci.PY310_WHEELS)
    assert {name: v for name, v in pins.items() if zoo_ci.PY310_WHEELS[name] != v} == {}


def test_metadata_verifies_offline_against_the_shipped_schema_and_zoo_rules():
    meta = json.loads(META.read_text())
    assert json.loads(SCHEMA.read_text())["$schema"].startswith("https://json-schema.org/")
    # the official URL stays; the local copy is used because it exists (nothing is downloaded)
    assert meta["schema"].endswith("/meta_schema_20240725.json")
    verify_metadata(meta_file=str(META), filepath=str(SCHEMA))
    assert meta["version"] in meta["changelog"]
    pins = _pins(ROOT / "requirements.txt")
    assert (
        meta["monai_version"] == pins["monai"]
        and meta["pytorch_version"] == pins["torch"] == torch.__version__.split("+")[0]
    )
    assert meta["numpy_version"] == pins["numpy"] and "+" not in meta["pytorch_version"]
    # the same packages as requirements.txt; versions for the zoo's Python 3.10 (test_zoo_pins_have_python_3_10_wheels)
    assert {name.lower() for name in meta["required_packages_version"]} <= set(pins)
    assert (
        bundle.__version__ == meta["version"]
        and max(meta["changelog"], key=lambda v: tuple(map(int, v.split(".")))) == meta["version"]
    )
    assert not re.search(r"^version\s*=", (ROOT / "pyproject.toml").read_text(), re.M)  # one version: the metadata's
    assert "pytorch-ignite" in meta["required_packages_version"]
    # every runtime import pinned (tqdm: the progress bars, bundle.progress); the app it serves, at its pinned version
    assert meta["required_packages_version"]["tqdm"] == pins["tqdm"]
    assert meta["supported_apps"] == {"monai-label": _pins(ROOT / "requirements-monailabel.txt")["monailabel"]}
    fmt = meta["network_data_format"]
    assert list(fmt["inputs"]) == ["image"] and list(fmt["outputs"]) == ["pred"]
    assert fmt["outputs"]["pred"]["format"] == "points" and "points" in fmt["post_processed_outputs"]
    # the shipped weights' model: 1x192x192 in, their template's 19 cephalometric landmarks out
    names = torch.load(TEMPLATE, weights_only=True)["landmark_names"]
    assert len(names) == 19 and names[:2] == ["sella", "nasion"]
    assert fmt["inputs"]["image"]["num_channels"] == 1 and fmt["inputs"]["image"]["spatial_shape"] == [192, 192]
    for out in (fmt["outputs"]["pred"], fmt["post_processed_outputs"]["points"]):
        assert out["num_channels"] == 19 and list(out["channel_def"].values()) == names
    for required in ("LICENSE", "docs/README.md", "configs/inference.yaml", "models/model.pt"):
        assert (ROOT / required).is_file(), required


def test_verify_metadata_rejects_a_broken_file(tmp_path):
    meta = json.loads(META.read_text())
    del meta["network_data_format"]
    bad = tmp_path / "metadata.json"
    bad.write_text(json.dumps(meta))
    with pytest.raises(Exception, match="network_data_format"):
        verify_metadata(meta_file=str(bad), filepath=str(SCHEMA))


def test_shipped_template_file_fits_the_shipped_weights_and_holds_no_image():
    from bundle.template_file import file_sha256, load_template

    template = load_template(TEMPLATE, ROOT / "models" / "model.pt")
    assert TEMPLATE.stat().st_size < 400 * 1024  # 32 x 19 x 4 x 32 floats; one 1340 x 1671 cephalogram is 2.2 MB
    assert template["checkpoint_sha256"] == file_sha256(ROOT / "models" / "model.pt")
    assert template["queries"].shape == (32, 19, 4, 32) and template["strides"] == [16, 8, 4, 2]
    assert template["sources"][0] == "hamedan_ceph/019.png" and len(set(template["sources"])) == 32
    norms = template["queries"].norm(dim=-1)
    assert torch.allclose(norms[~torch.isnan(norms)], torch.ones(()), atol=1e-5)  # unit feature vectors only


def test_standalone_inference_config_has_the_zoo_keys_and_the_inference_properties():
    import yaml

    config = yaml.safe_load(Path(INFERENCE).read_text())
    for key in (
        "imports",
        "bundle_root",
        "device",
        "network_def",
        "inferer",
        "preprocessing",
        "postprocessing",
        "dataset_dir",
        "dataset",
        "evaluator",
        "output_dir",
        "run",
    ):
        assert key in config, key
    assert not any("#" in key for key in config)  # nothing patches another file's keys: it loads alone
    workflow = ConfigWorkflow(
        config_file=INFERENCE,
        meta_file=str(META),
        logging_file=str(ROOT / "configs/logging.conf"),
        workflow_type="inference",
        bundle_root=str(ROOT),
    )
    workflow.initialize()
    assert workflow.check_properties() == []


def _export(path: Path, **override) -> Path:
    """``network_def`` exported as the zoo's CI does (MONAI's ``ckpt_export``: torch.jit.script, no trace)."""
    ckpt_export(
        net_id="network_def",
        filepath=str(path),
        ckpt_file=str(ROOT / "models/model.pt"),
        meta_file=str(META),
        config_file=INFERENCE,
        bundle_root=str(ROOT),
        **override,
    )
    return path


# A plain-PyTorch user of the exported network: torch, NumPy and PIL only. The image read with PIL, resized to the
# network grid with PIL, (1, 1, rows, columns) in [0, 1]; the landmarks (x = column, y = row) scaled back to the
# file's pixels (pixel centres at integers). Prints them as JSON.
PLAIN_TORCH_USER = """
import json, sys
import numpy as np, torch
from PIL import Image

ts, image, rows, columns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
picture = Image.open(image).convert("L")
width, height = picture.size
grid = np.asarray(picture.resize((columns, rows), Image.Resampling.BOX), dtype=np.float32)  # (rows, columns)
grid = (grid - grid.min()) / (grid.max() - grid.min())
network = torch.jit.load(ts).eval()
with torch.no_grad():
    points = network(torch.from_numpy(grid)[None, None])[0].double().numpy()
points = (points + 0.5) * [width / columns, height / rows] - 0.5
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("monai", "bundle"))
assert not loaded, loaded
print(json.dumps(points.tolist()))
"""


def _plain_torch_points(ts: Path, image: Path) -> np.ndarray:
    """The landmarks (x, y) in ``image``'s pixels that :data:`PLAIN_TORCH_USER` gets from the exported network at
    the grid ``network_data_format`` gives (a fresh process: nothing of MONAI or the bundle imported)."""
    rows, columns = json.loads(META.read_text())["network_data_format"]["inputs"]["image"]["spatial_shape"]
    command = [sys.executable, "-c", PLAIN_TORCH_USER, str(ts), str(image), str(rows), str(columns)]
    done = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.asarray(json.loads(done.stdout.strip().splitlines()[-1]))


def _inferring(image: Path, out: Path, **override) -> np.ndarray:
    """The bundle's ``inferring`` command on one image, matching as the exported network does (``pipeline
    templates``, unless overridden): its predictions.csv as ``(L, 2)`` [x, y] pixels."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(
            "inferring",
            config_file=INFERENCE,
            bundle_root=str(ROOT),
            images=[str(image)],
            output_dir=str(out),
            overlays=False,
            **{"pipeline": "templates", **override},
        )
    return np.asarray([[x, y] for _, x, y in _predictions(out / "predictions.csv")])


def _grid_cell(image: Path) -> float:
    """The larger side, in ``image``'s pixels, of one cell of the network grid."""
    rows, columns = json.loads(META.read_text())["network_data_format"]["inputs"]["image"]["spatial_shape"]
    width, height = Image.open(image).size
    return max(width / columns, height / rows)


def _close(distance: np.ndarray, cell: float) -> bool:
    """The exported network on a PIL-resized image against ``inferring`` on MONAI's area resize (the two resizes
    differ): the median within half a grid cell, 90 % within two (a landmark with two near-equal peaks may flip)."""
    return bool(np.median(distance) <= 0.5 * cell and np.mean(distance <= 2 * cell) >= 0.9)


def test_a_datalists_template_features_are_kept_for_the_next_call(tmp_path, tiny_datalist):
    """``inferring --datalist``: the second call reads the template features that the first computed (same
    predictions, the cache file not rewritten); another datalist gets its own; a damaged cache file is computed
    again."""
    datalist = json.loads(Path(tiny_datalist).read_text())
    image = Path(tiny_datalist).parent / datalist["test"][0]["image"]
    cache = tmp_path / "cache"
    first = _inferring(image, tmp_path / "a", datalist=str(tiny_datalist), template_cache=str(cache))
    (kept,) = cache.glob("*.pt")
    stamp = kept.stat().st_mtime_ns
    second = _inferring(image, tmp_path / "b", datalist=str(tiny_datalist), template_cache=str(cache))
    np.testing.assert_array_equal(second, first)
    assert kept.stat().st_mtime_ns == stamp
    # provenance.json says what made the predictions, the cached templates as the computed ones
    provenance = json.loads((tmp_path / "a" / "provenance.json").read_text())
    training = sorted(Path(it["image"]).name for it in datalist["training"])
    pseudo = provenance["pseudo_templates"]
    assert sorted(pseudo) == training  # one labelled template: the training images labelled by matching join it
    assert provenance == {
        "pipeline": "templates",
        "template": "template.png",
        "templates": ["template.png", *pseudo],
        "pseudo_templates": pseudo,
        "checkpoint": str(ROOT / "models" / "model.pt"),
        "xfeat_refinement": None,  # auto: not after matching
        "n_images": 1,
    }
    assert json.loads((tmp_path / "b" / "provenance.json").read_text()) == provenance
    other = Path(tiny_datalist).with_name("other.json")
    other.write_text(json.dumps({**datalist, "template": datalist["training"][1]}))
    _inferring(image, tmp_path / "c", datalist=str(other), template_cache=str(cache))
    assert len(list(cache.glob("*.pt"))) == 2
    kept.write_bytes(b"not a template file")
    again = _inferring(image, tmp_path / "d", datalist=str(tiny_datalist), template_cache=str(cache))
    np.testing.assert_array_equal(again, first)
    assert torch.load(kept, weights_only=True)["format"] == "infoguided-landmarks-template/1"


@pytest.fixture
def cache_warnings(caplog):
    """The template cache's warnings during a ``monai.bundle run`` (its logging.conf replaces the root logger's
    handlers, caplog's among them)."""
    logger = logging.getLogger("bundle.templates.features")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_an_open_umask_makes_the_default_template_cache_private(tmp_path, tiny_datalist, monkeypatch, cache_warnings):
    """Under umask 002 the default cache's folders were made group-writable (after which the kernel cache beside it
    was not trusted); they are made writable by their owner only, and the next run reads the features back."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    datalist = json.loads(Path(tiny_datalist).read_text())
    image = Path(tiny_datalist).parent / datalist["test"][0]["image"]
    mask = os.umask(0o002)
    try:
        first = _inferring(image, tmp_path / "a", datalist=str(tiny_datalist))
    finally:
        os.umask(mask)
    root = tmp_path / "xdg" / "infoguided-landmarks"
    (kept,) = (root / "templates").glob("*.pt")
    assert [p.stat().st_mode & 0o777 for p in (root, root / "templates", kept)] == [0o700, 0o700, 0o644]
    stamp = kept.stat().st_mtime_ns
    np.testing.assert_array_equal(_inferring(image, tmp_path / "b", datalist=str(tiny_datalist)), first)
    assert kept.stat().st_mtime_ns == stamp
    assert [r.getMessage() for r in cache_warnings.records if r.levelno >= logging.WARNING] == []


def test_the_folders_above_the_template_cache_are_checked(tmp_path, tiny_datalist, cache_home, cache_warnings):
    """Only the folders from infoguided-landmarks down were checked: whoever could write to a folder above them (an
    XDG_CACHE_HOME in a mode 0777 folder, or another user's) could swap the cache before the features were read.
    Such a cache is neither read nor written, said once, and inference completes; the user's own folder in a sticky
    one, as /tmp, is used."""
    home, why = cache_home
    datalist = json.loads(Path(tiny_datalist).read_text())
    image = Path(tiny_datalist).parent / datalist["test"][0]["image"]
    predictions = _inferring(image, tmp_path / "out", datalist=str(tiny_datalist))
    assert predictions.shape[0] > 0 and np.isfinite(predictions).all()
    warnings_ = [r.getMessage() for r in cache_warnings.records if r.levelno >= logging.WARNING]
    templates = home / "infoguided-landmarks" / "templates"
    if why is None:
        assert warnings_ == [] and len(list(templates.glob("*.pt"))) == 1
        return
    assert len(warnings_) == 1 and warnings_[0].startswith(f"template cache {templates} not used: {why}"), warnings_
    assert not templates.exists()


@pytest.mark.parametrize("plant", ["open folder", "linked entry"])
def test_template_features_planted_in_the_cache_are_not_read(tmp_path, tiny_datalist, cache_warnings, plant):
    """Anyone who could write to the cache (a folder of mode 0777, a link in it) could plant features under the
    datalist's predictable key and make every match wrong: such a cache is neither read nor written, said once
    naming the folder and why, and the features are computed again."""
    datalist = json.loads(Path(tiny_datalist).read_text())
    image = Path(tiny_datalist).parent / datalist["test"][0]["image"]
    cache = tmp_path / "cache"
    first = _inferring(image, tmp_path / "a", datalist=str(tiny_datalist), template_cache=str(cache))
    (kept,) = cache.glob("*.pt")
    template = torch.load(kept, weights_only=True)
    planted = {**template, "queries": template["queries"].roll(1, dims=1)}  # each landmark matched as another
    if plant == "linked entry":
        torch.save(planted, tmp_path / "elsewhere.pt")
        kept.unlink()
        kept.symlink_to(tmp_path / "elsewhere.pt")
        why = f"{kept} is a symbolic link"
    else:
        torch.save(planted, kept)
        cache.chmod(0o777)
        why = f"{cache} has owner uid {os.getuid()} and mode 0o777"
    planted_bytes = kept.read_bytes()
    again = _inferring(image, tmp_path / "b", datalist=str(tiny_datalist), template_cache=str(cache))
    np.testing.assert_array_equal(again, first)
    warnings_ = [r.getMessage() for r in cache_warnings.records if r.levelno >= logging.WARNING]
    assert len(warnings_) == 1 and warnings_[0].startswith(f"template cache {cache} not used: {why}"), warnings_
    assert kept.read_bytes() == planted_bytes and sorted(p.name for p in cache.iterdir()) == [kept.name]


def test_a_template_cache_that_cannot_be_written_is_skipped_with_one_warning(
    tmp_path, tiny_datalist, monkeypatch, capsys
):
    """A full cache disk (``torch.save`` raises RuntimeError there, not OSError: it stopped ``inferring`` after all the
    template work) is skipped with one warning: the predictions are written, the cache holds no partial file."""
    import bundle.template_file

    def full_disk(obj, path):
        Path(path).write_bytes(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0")

    monkeypatch.setattr(bundle.template_file.torch, "save", full_disk)
    datalist = json.loads(Path(tiny_datalist).read_text())
    image = Path(tiny_datalist).parent / datalist["test"][0]["image"]
    cache = tmp_path / "cache"
    predictions = _inferring(image, tmp_path / "out", datalist=str(tiny_datalist), template_cache=str(cache))
    assert predictions.shape[0] > 0 and np.isfinite(predictions).all()
    log = capsys.readouterr().out  # the command's log (configs/logging.conf: stdout)
    warned = [line for line in log.splitlines() if "WARNING" in line and "template cache" in line]
    assert len(warned) == 1 and "not written" in warned[0] and "PytorchStreamWriter failed" in warned[0], warned
    assert sorted(cache.iterdir()) == []


def test_template_cache_key_follows_the_network_strides_and_the_bundle_version(tmp_path, monkeypatch):
    """Features of other strides, or of another version's code, are not read back from the cache."""
    import bundle.templates.features as features

    datalist_path, checkpoint = tmp_path / "datalist.json", tmp_path / "model.pt"
    datalist_path.write_text("{}")
    checkpoint.write_bytes(b"weights")

    def key(strides=(16, 8, 4, 2)):
        return features.template_cache_key(datalist_path, {}, checkpoint, [192, 192], strides, {"rule": "landmarks"})

    base = key()
    assert key((8, 4, 2)) != base
    choice = {"rule": "landmarks", "pseudo_templates": 10}
    assert features.template_cache_key(datalist_path, {}, checkpoint, [192, 192], (16, 8, 4, 2), choice) != base
    monkeypatch.setattr(features, "__version__", "0.0.0-other")
    assert key() != base


def test_template_cache_is_off_for_the_command_lines_null():
    """``--template_cache null`` reaches the config as the string 'null' (``monai.bundle run`` drops ``None``)."""
    from bundle.templates.features import default_template_cache, template_cache_dir

    for off in (None, False, "", "null", "None", " NULL ", "false", "no"):
        assert template_cache_dir(off) is None, off
    assert template_cache_dir("cache/x") == Path("cache/x")
    assert template_cache_dir("Yes") == template_cache_dir(True) == default_template_cache()


def test_exported_network_takes_a_plain_torch_image_synthetic(tmp_path, tiny_datalist):
    """The exported network fed (1, 1, rows, columns) from PIL, without MONAI, finds what ``inferring`` finds (on a
    non-square synthetic image, its datalist's template built in) and lands near the true landmarks."""
    datalist = json.loads(Path(tiny_datalist).read_text())
    ts = _export(tmp_path / "model.ts", datalist=str(tiny_datalist))
    for item in datalist["test"]:
        image = Path(tiny_datalist).parent / item["image"]
        got = _plain_torch_points(ts, image)
        expected = _inferring(image, tmp_path / Path(item["image"]).stem, datalist=str(tiny_datalist))
        cell = _grid_cell(image)
        distance = np.linalg.norm(got - expected, axis=1)
        assert _close(distance, cell), distance
        truth = np.linalg.norm(got - np.asarray(item["landmarks"]), axis=1)
        assert np.nanmean(truth) < 15, truth  # pixels of a 256 x 288 image; transposed input: ~100


@pytest.mark.skipif(not (HAMEDAN / "images" / "050.png").is_file(), reason="shared Hamedan data not available")
def test_exported_network_takes_a_plain_torch_image_cephalogram(tmp_path):
    """A real cephalogram: the exported network (shipped weights and built-in templates) fed as plain PyTorch holds
    the image gives ``inferring``'s landmarks within a grid cell (8.7 px) or two, and the doctors' within tens of
    pixels."""
    image = HAMEDAN / "images" / "050.png"
    got = _plain_torch_points(_export(tmp_path / "model.ts"), image)
    expected = _inferring(image, tmp_path / "inferring")
    cell = _grid_cell(image)
    distance = np.linalg.norm(got - expected, axis=1)
    assert _close(distance, cell), distance
    truth = np.linalg.norm(got - _doctors("050"), axis=1)
    assert np.mean(truth) < 40 and np.median(truth) < 25, truth  # pixels at 0.12 mm; transposed input: hundreds


def _doctors(stem: str) -> np.ndarray:
    """The mean of the two doctors' landmarks of Hamedan image ``stem``, ``(19, 2)`` [x, y] pixels."""
    doctors = []
    for doctor in ("farhadifar", "mollabashi"):
        shapes = json.loads((HAMEDAN / "annotations" / doctor / f"{stem}.json").read_text())["shapes"]
        points = {s["label"].lower(): s["points"][0] for s in shapes}
        doctors.append([points[f"l{j + 1}"] for j in range(19)])
    return np.mean(doctors, axis=0)


@pytest.mark.skipif(not (HAMEDAN / "images" / "005.png").is_file(), reason="shared Hamedan data not available")
def test_inferring_by_default_predicts_with_the_shipped_fine_tuned_detector(tmp_path):
    """``inferring`` as a user types it (no datalist): the fine-tuned detector shipped beside the built-in templates
    predicts, closer to the doctors than matching on 005 (a test image of the results' split, learnt by neither)."""
    image = HAMEDAN / "images" / "005.png"
    detected = _inferring(image, tmp_path / "auto", pipeline="auto")
    provenance = json.loads((tmp_path / "auto" / "provenance.json").read_text())
    assert provenance["pipeline"] == "detector" and provenance["checkpoint"].endswith("models/finetune/model.pt")
    matched = _inferring(image, tmp_path / "templates")
    errors = {k: np.linalg.norm(v - _doctors("005"), axis=1).mean() for k, v in (("d", detected), ("m", matched))}
    assert errors["d"] < 9 and errors["d"] < errors["m"], errors  # measured: 7.6 and 10.2 px (0.12 mm each)


def test_network_def_verifies_scripts_and_matches_the_python_path(tmp_path, tiny_datalist):
    from bundle.inferers.oneshot import TemplateFeatureInferer

    verify_net_in_out(
        net_id="network_def", meta_file=str(META), config_file=INFERENCE, device="cpu", bundle_root=str(ROOT)
    )
    ts = _export(tmp_path / "model.ts")
    exported = torch.jit.load(str(ts))
    parser = bundle_parser("configs/inference.yaml", pipeline="templates")  # the matching path network_def exports
    preprocessing = parser.get_parsed_content("preprocessing")
    test = json.loads(Path(tiny_datalist).read_text())["test"][0]
    image = torch.as_tensor(preprocessing({"image": str(Path(tiny_datalist).parent / test["image"])})["image"])[
        None
    ].float()
    # reference: the Python path (the one matching core, sub-pixel refinement) on the grid, 6 templates combined by
    # the geometric median
    inferer = TemplateFeatureInferer(parser.get_parsed_content("template"))
    expected = inferer(image, parser.get_parsed_content("encoder").eval()).float()
    with torch.no_grad():
        got = exported(image.transpose(2, 3))  # MONAI's [x, y] grid as torch holds an image: (rows, columns)
    assert got.shape == (1, 19, 2) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    extra = {"metadata.json": ""}
    torch.jit.load(str(ts), _extra_files=extra)
    assert json.loads(extra["metadata.json"])["version"] == json.loads(META.read_text())["version"]


def test_template_features_give_what_the_template_image_gives(tiny_datalist, tmp_path):
    """A template feature file built from a datalist's template matches as the template image itself does."""
    from bundle.inferers.oneshot import OneShotInferer, TemplateFeatureInferer
    from bundle.template_file import load_template
    from bundle.templates.resolution import with_templates
    from scripts import build_template

    datalist = json.loads(Path(tiny_datalist).read_text())
    named = Path(datalist["template"]["image"]).stem
    path = build_template.build(str(tiny_datalist), output=str(tmp_path / "t.pt"), templates=[named])
    template = load_template(path, ROOT / "models" / "model.pt")
    assert template["queries"].shape[:2] == (1, len(datalist["landmark_names"]))
    parser = bundle_parser("configs/inference.yaml", datalist=str(tiny_datalist))
    network = parser.get_parsed_content("encoder").eval()
    preprocessing = parser.get_parsed_content("preprocessing")
    item = {**datalist["test"][0], "image": str(Path(tiny_datalist).parent / datalist["test"][0]["image"])}
    data = preprocessing(item)
    image, g2p = torch.as_tensor(data["image"])[None], torch.as_tensor(data["grid_to_physical"])[None]
    template_item = {**datalist["template"], "image": str(Path(tiny_datalist).parent / datalist["template"]["image"])}
    reference = with_templates(OneShotInferer(), [template_item], preprocessing, "cpu")(image, network, g2p)
    torch.testing.assert_close(TemplateFeatureInferer(template)(image, network, g2p), reference)
    # with no template named, the script and the config given the datalist choose alike: its template plus
    # pseudo-templates from its unlabelled training images (one labelled template is few), the same features
    chosen = load_template(build_template.build(str(tiny_datalist), output=str(tmp_path / "c.pt")))
    computed = parser.get_parsed_content("template")
    assert len(chosen["sources"]) == len(computed["sources"]) > 1
    torch.testing.assert_close(computed["queries"], chosen["queries"], equal_nan=True)  # NaN: unreliable landmarks
    torch.testing.assert_close(computed["queries"][:1], template["queries"])


def test_an_image_on_another_grid_than_the_templates_is_refused():
    """The built-in features were computed on the 192 x 192 grid: another grid is refused by the Python path
    (``inferring --image_size``) and by the exported network, eager and scripted, instead of matching silently."""
    from bundle.inferers.oneshot import TemplateFeatureInferer
    from bundle.networks.contrastive import ContrastiveLandmarkNet
    from bundle.networks.landmark_points import LandmarkPointsNet
    from bundle.template_file import load_template

    template = load_template(ROOT / "models" / "template_features.pt")
    network = ContrastiveLandmarkNet(spatial_dims=2).eval()
    with pytest.raises(ValueError, match=r"computed on the grid \[192, 192\], the input is on \[128, 160\]"):
        TemplateFeatureInferer(template)(torch.rand(1, 1, 128, 160), network)
    exported = LandmarkPointsNet(network, template).eval()
    for net in (exported, torch.jit.script(exported)):
        with pytest.raises(Exception, match="not the template features' "):
            net(torch.rand(1, 1, 160, 128))
        assert net(torch.rand(1, 1, 192, 192)).shape == (1, 19, 2)


def test_scripted_geometric_median_equals_the_eager_one():
    from bundle.kshot import geometric_median

    points = torch.randn(6, 3, 19, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    points[1, 0, 3] = float("nan")
    points[:, 2, 4] = float("nan")
    points[2:, 1, 7] = points[0, 1, 7]
    torch.testing.assert_close(torch.jit.script(geometric_median)(points), geometric_median(points), equal_nan=True)


def test_package_refuses_an_unlisted_large_file(tmp_path):
    root = tmp_path / "bundle_root"
    for name in ("LICENSE", "docs/README.md", "configs/inference.yaml", "configs/metadata.json", "models/model.pt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    (root / "configs/metadata.json").write_text(json.dumps({"version": "1.0", "changelog": {"1.0": "first"}}))
    (root / "models/big.pt").write_bytes(b"0" * 3 * 2**20)
    with pytest.raises(packaging.PackagingError, match="models/big.pt"):
        packaging.package(output_dir=str(tmp_path / "dist"), root=str(root), max_mb=2)
    (root / "large_files.yml").write_text(
        'large_files:\n  - path: "models/big.pt"\n    url: "https://example.org/big.pt"\n'
    )
    zipped = packaging.package(output_dir=str(tmp_path / "dist"), root=str(root), max_mb=2, name="b")
    names = zipfile.ZipFile(zipped).namelist()
    assert "b/models/model.pt" in names and "b/models/big.pt" not in names
    (root / "configs/metadata.json").write_text(json.dumps({"version": "2.0", "changelog": {"1.0": "first"}}))
    with pytest.raises(packaging.PackagingError, match="changelog"):
        packaging.package(output_dir=str(tmp_path / "dist"), root=str(root))


def test_archive_holds_the_product_not_the_experiments_nor_the_result_records(zipped):
    names = {n.split("/", 1)[1] for n in zipfile.ZipFile(zipped).namelist()}
    assert "scripts/package.py" in names and "scripts/prepare_data.py" in names
    assert not any(n.startswith("scripts/experiments/") for n in names)
    # the model card, the guides it links (and theirs), the figures the card itself links, the data's terms; no result
    # record, no other figure
    card = packaging.linked_docs(ROOT, ROOT / "docs" / "README.md")
    figures = {p.relative_to(ROOT).as_posix() for p in card if p.suffix == ".png"}
    assert {"docs/README.md", "docs/results.md", "docs/configuration.md"} | figures <= names
    assert {n for n in names if n.startswith("docs/") and n.endswith(".png")} == figures
    assert "docs/data_license.txt" in names and not any(n.startswith("docs/") and n.endswith(".json") for n in names)
    assert "docs/results_mre.png" not in names


def _predictions(path: Path) -> list[tuple[str, float, float]]:
    with open(path) as f:
        return [(r["landmark"], float(r["x"]), float(r["y"])) for r in csv.DictReader(f)]


def test_zip_downloads_through_monai_and_runs_inference_from_the_unpacked_copy(tmp_path, tiny_datalist, zipped):
    meta = json.loads(META.read_text())
    assert zipped.name == f"{packaging.DEFAULT_NAME}_v{meta['version']}.zip"
    with zipfile.ZipFile(zipped) as archive:
        names = archive.namelist()
        assert {n.split("/")[0] for n in names} == {packaging.DEFAULT_NAME}
        assert all(i.file_size <= 25 * 2**20 for i in archive.infolist())
        assert f"{packaging.DEFAULT_NAME}/models/model.pt" in names and not any("__pycache__" in n for n in names)
        assert f"{packaging.DEFAULT_NAME}/models/template_features.pt" in names
        import yaml

        for config in ("train", "inference"):  # JSON twins for monai.bundle.load, the same content
            twin = json.loads(archive.read(f"{packaging.DEFAULT_NAME}/configs/{config}.json"))
            assert twin == yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())

    bundles = tmp_path / "bundles"
    download(name=packaging.DEFAULT_NAME, url=zipped.as_uri(), bundle_dir=str(bundles), progress=False)
    unpacked = bundles / packaging.DEFAULT_NAME
    assert (unpacked / "configs" / "metadata.json").is_file()

    image = Path(tiny_datalist).parent / json.loads(Path(tiny_datalist).read_text())["test"][0]["image"]
    outputs = {}
    for where, cwd in (("repo", ROOT), ("zip", unpacked)):
        command = [
            sys.executable,
            "-m",
            "monai.bundle",
            "run",
            "inferring",
            "--config_file",
            "configs/inference.yaml",
            "--images",
            f"['{image}']",
            "--output_dir",
            str(tmp_path / where),
        ]
        env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[where] = _predictions(tmp_path / where / "predictions.csv")
    # the unpacked bundle (its own code, weights and built-in template, no data) predicts what the repository does
    assert [name for name, _, _ in outputs["zip"]] == list(
        meta["network_data_format"]["outputs"]["pred"]["channel_def"].values()
    )
    assert outputs["zip"] == outputs["repo"]
    assert not (unpacked / "data").exists()  # nothing was generated or downloaded


# A zoo user: MONAI's download (of the archive's file: URL, no network) then MONAI's load, nothing else; prints
# what load returned as one JSON line after LOADED.
DOWNLOAD_THEN_LOAD = """
import json, sys, torch
from monai.bundle import download, load

name, url, bundles, workflow_type = sys.argv[1:5]
download(name=name, url=url, bundle_dir=bundles, progress=False)
kwargs = {} if workflow_type == "default" else {"workflow_type": workflow_type}
net = load(name, bundle_dir=bundles, source="github", device="cpu", **kwargs).eval()
weights = torch.load(f"{bundles}/{name}/models/model.pt", map_location="cpu", weights_only=True)
shipped = net.network if hasattr(net, "network") else net
same = sorted(weights) == sorted(shipped.state_dict()) and all(
    torch.equal(weights[k], v) for k, v in shipped.state_dict().items())
with torch.no_grad():
    out = net(torch.rand(1, 1, 192, 192))
shapes = [list(out.shape)] if torch.is_tensor(out) else [list(o.shape) for o in out]
code = sys.modules[type(net).__module__].__file__
print("LOADED " + json.dumps({"class": f"{type(net).__module__}.{type(net).__qualname__}", "code": code,
                              "weights": same, "shapes": shapes}))
"""


@pytest.mark.parametrize(
    "workflow_type, network, shapes",
    [
        ("inference", "bundle.networks.landmark_points.LandmarkPointsNet", [[1, 19, 2]]),
        ("infer", "bundle.networks.landmark_points.LandmarkPointsNet", [[1, 19, 2]]),
        (
            "train",
            "bundle.networks.contrastive.ContrastiveLandmarkNet",
            [[1, 32, 12, 12], [1, 32, 24, 24], [1, 32, 48, 48], [1, 32, 96, 96]],
        ),
        (
            "default",
            "bundle.networks.contrastive.ContrastiveLandmarkNet",
            [[1, 32, 12, 12], [1, 32, 24, 24], [1, 32, 48, 48], [1, 32, 96, 96]],
        ),
    ],
)
def test_monai_download_then_load_builds_the_network_from_any_folder(tmp_path, zipped, workflow_type, network, shapes):
    """``monai.bundle.download`` then ``monai.bundle.load`` (``workflow_type`` inference, MONAI's other name for it
    infer, train, or left out) in a fresh Python started in a folder unrelated to the bundle, with no ``PYTHONPATH``
    and no path edit: the network is the bundle's class, from the downloaded copy's own code, with the shipped weights,
    and it runs (not the weights alone, as for a type without its configs/<workflow_type>.json)."""
    bundles, elsewhere = tmp_path / "bundles", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-c", DOWNLOAD_THEN_LOAD, packaging.DEFAULT_NAME, zipped.as_uri(), str(bundles)]
    done = subprocess.run(
        command + [workflow_type], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("LOADED "))[7:])
    assert loaded["class"] == network
    assert Path(loaded["code"]).is_relative_to(bundles / packaging.DEFAULT_NAME / "bundle")
    assert loaded["weights"] and loaded["shapes"] == shapes
    assert not any(elsewhere.iterdir())  # loading wrote nothing into the working directory


@pytest.mark.skipif(
    not os.environ.get("MODEL_ZOO_DIR"), reason="MODEL_ZOO_DIR (a Project-MONAI/model-zoo checkout) not set"
)
def test_the_zoo_verify_bundle_full_passes(tmp_path):
    command = [sys.executable, "-m", "scripts.verify_zoo", os.environ["MODEL_ZOO_DIR"], "--workdir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "PASSED: the zoo's verify_bundle.py -m full" in done.stdout


@pytest.mark.skipif(
    not os.environ.get("MODEL_ZOO_DIR") or not os.environ.get("ZOO_TOOLS_PYTHON"),
    reason="MODEL_ZOO_DIR (a model-zoo checkout) and ZOO_TOOLS_PYTHON (black, isort, flake8, pytype) not both set",
)
def test_the_zoo_premerge_install_and_code_format_steps_pass(tmp_path):
    command = [sys.executable, "-m", "scripts.zoo_ci", os.environ["MODEL_ZOO_DIR"]]
    command += ["--python", os.environ["ZOO_TOOLS_PYTHON"], "--workdir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "PASSED: requirements" in done.stdout and "PASSED: code format" in done.stdout
