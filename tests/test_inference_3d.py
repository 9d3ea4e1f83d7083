"""`inferring` on volumes (configs/train_3d.yaml after configs/inference.yaml): read as training and evaluating
read them, so a volume's suggestions are evaluating's predictions, whatever the voxel order of its file; 3D data
given to the 2D command are refused naming the 3D config."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from bundle.command_errors import root_cause
from bundle.configs import bundle_parser, config_files
from bundle.data.datalist import DatalistError, load_datalist
from bundle.data.images import ImageError
from bundle.data.synthetic import generate_synthetic_3d
from monai.bundle import run

from tests.test_3d_pipeline import TINY_3D, _evaluate, _untrained_checkpoint
from tests.test_dicom import write_ct_series

ROOT = Path(__file__).resolve().parents[1]
HINT = "configs/train_3d.yaml after configs/train.yaml to train and evaluate, after configs/inference.yaml to infer"
INFER_3D = [str(ROOT / f) for f in config_files("inference", spatial_dims=3)]


def _rows(path: Path) -> dict[tuple[str, str], np.ndarray]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {(Path(r["image"]).name, r["landmark"]): np.array([float(r[a]) for a in "xyz"]) for r in rows}


def test_volumes_are_prepared_as_evaluating_prepares_them(tmp_path):
    """Inferring's 3D preprocessing (configs/train_3d.yaml merged after inference.yaml) gives what evaluating's
    gives (train_3d.yaml after train.yaml) on a volume: the same voxels, spacing and grid-to-physical map."""
    datalist_path = generate_synthetic_3d(
        tmp_path / "data", n_training=1, n_validation=1, n_test=1, shape=(32, 32, 32), spacing=(3.0, 3.0, 3.0), seed=4
    )
    item = {"image": load_datalist(datalist_path)["test"][0]["image"]}
    inference = bundle_parser(INFER_3D, datalist=str(datalist_path)).get_parsed_content("preprocessing")(dict(item))
    training = bundle_parser(config_files("train", 3), datalist=str(datalist_path))
    evaluation = training.get_parsed_content("validate#preprocessing")(dict(item))
    for key in ("image", "spacing", "grid_to_physical"):
        np.testing.assert_array_equal(np.asarray(inference[key]), np.asarray(evaluation[key]), err_msg=key)


def test_a_volume_s_suggestions_are_evaluating_s_predictions_whatever_its_voxel_order(tmp_path):
    """The same test volume through `inferring` (as it is, and saved with its x axis flipped and its x and y axes
    swapped, the same world geometry) and through `evaluating`: the same world points. Before the 3D configuration the
    inference config read volumes as pictures (no reorientation, no resampling): 18-35 mm off for the reordered
    files."""
    datalist_path = generate_synthetic_3d(
        tmp_path / "data", n_training=3, n_validation=1, n_test=1, shape=(32, 32, 32), spacing=(3.0, 3.0, 3.0), seed=4
    )
    datalist = load_datalist(datalist_path)
    ckpt = _untrained_checkpoint(datalist_path, tmp_path / "untrained.pt")
    volume = Path(datalist["test"][0]["image"])
    image = nib.load(str(volume))
    data, affine = np.asarray(image.dataobj), image.affine
    flip = np.eye(4)
    flip[0, 0], flip[0, 3] = -1, data.shape[0] - 1
    nib.save(nib.Nifti1Image(data[::-1].copy(), affine @ flip), str(tmp_path / "flipped.nii.gz"))
    swap = np.eye(4)[[1, 0, 2, 3]]
    nib.save(nib.Nifti1Image(data.transpose(1, 0, 2).copy(), affine @ swap), str(tmp_path / "swapped.nii.gz"))

    settings = {k: TINY_3D[k] for k in ("target_spacing", "image_size", "seed")}
    settings["network_def#network#channels"] = TINY_3D["network_def#channels"]

    def infer(out: Path, **source) -> dict[tuple[str, str], np.ndarray]:
        """`inferring` with the untrained checkpoint on ``source`` (``images`` or ``dataset_dir``): its predictions."""
        run(
            "inferring",
            config_file=INFER_3D,
            bundle_root=str(ROOT),
            datalist=str(datalist_path),
            output_dir=str(out),
            ckpt_path=str(ckpt),
            pseudo_templates=0,
            template_cache=None,
            **source,
            **settings,
        )
        return _rows(out / "predictions.csv")

    evaluation = _evaluate(datalist_path, tmp_path / "eval", ckpt, pseudo_templates=0)
    inferred = infer(
        tmp_path / "infer", images=[str(volume), str(tmp_path / "flipped.nii.gz"), str(tmp_path / "swapped.nii.gz")]
    )
    # contrast_adaptation auto in both: the same choice of the guard on the validation volume, the same scores
    provenance = json.loads((tmp_path / "infer" / "provenance.json").read_text())
    assert provenance["matching_guard"] == evaluation["matching_guard"]
    assert evaluation["matching_guard"]["validation_images"] == 1
    evaluated = _rows(tmp_path / "eval" / "predictions.csv")
    names = datalist["landmark_names"]
    for name in names:
        for file in (volume.name, "flipped.nii.gz", "swapped.nii.gz"):
            np.testing.assert_allclose(inferred[(file, name)], evaluated[(volume.name, name)], atol=1e-3, err_msg=file)
    assert (tmp_path / "infer" / f"{volume.name.split('.')[0]}.mrk.json").is_file()
    assert not (tmp_path / "infer" / "overlays").exists()

    # --dataset_dir: a folder holding a DICOM series folder (the same volume, lossless: int16 HU in 12 bits) and a
    # volume file; the folder of series gave nothing to run on before, and a series' own folder one item per slice
    studies = tmp_path / "studies"
    affine_lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine
    directions = affine_lps[:3, :3] / np.linalg.norm(affine_lps[:3, :3], axis=0)
    write_ct_series(studies / "series_a", data.astype(np.int16), affine_lps, directions[:, 0], directions[:, 1])
    (studies / "flipped.nii.gz").write_bytes((tmp_path / "flipped.nii.gz").read_bytes())
    from_folder = infer(tmp_path / "infer_dir", dataset_dir=str(studies))
    assert {file for file, _ in from_folder} == {"series_a", "flipped.nii.gz"}
    for name in names:
        for file in ("series_a", "flipped.nii.gz"):
            np.testing.assert_allclose(
                from_folder[(file, name)], evaluated[(volume.name, name)], atol=1e-3, err_msg=file
            )
    assert (tmp_path / "infer_dir" / "series_a.mrk.json").is_file()


def test_3d_data_given_to_the_2d_inferring_are_refused_naming_the_3d_config(tmp_path):
    datalist_path = generate_synthetic_3d(
        tmp_path / "data", n_training=1, n_validation=1, n_test=1, shape=(32, 32, 32), spacing=(3.0, 3.0, 3.0), seed=4
    )
    volume = load_datalist(datalist_path)["test"][0]["image"]
    with pytest.raises(RuntimeError) as raised:  # MONAI wraps the bundle's error
        bundle_parser("configs/inference.yaml", datalist=str(datalist_path)).get_parsed_content("landmark_names")
    assert isinstance(root_cause(raised.value), DatalistError)
    assert (
        "configs/train_3d.yaml after configs/train.yaml to train and evaluate, after configs/inference.yaml to infer"
        in str(root_cause(raised.value))
    )
    parser = bundle_parser("configs/inference.yaml", spatial_dims=3, image_size=[32, 32, 32])
    preprocessing = parser.get_parsed_content("preprocessing")
    with pytest.raises(RuntimeError) as raised:  # MONAI's Compose wraps it
        preprocessing({"image": volume})
    assert isinstance(root_cause(raised.value), ImageError)
    assert (
        "configs/train_3d.yaml after configs/train.yaml to train and evaluate, after configs/inference.yaml to infer"
        in str(root_cause(raised.value))
    )
