"""Scoring the ablation's finished runs without their own test choices: on labelled images outside the test split
(the ranking that chooses the shipped model), with the same templates for every run, and the two template rules."""

from __future__ import annotations

import json
from pathlib import Path

from bundle.configs import config_files
from bundle.data.datalist import load_datalist
from bundle.io_utils import write_json_atomic
from bundle.templates.resolution import labelled_training_items
from scripts.bundle_commands import run_command


def _absolute_images(items: list[dict]) -> list[dict]:
    """``items`` with absolute image paths (a derived datalist is written elsewhere than the original)."""
    return [dict(it, image=str(Path(it["image"]).resolve())) for it in items]


def selection_datalist(datalist: dict, template_image: str) -> dict:
    """``datalist`` (as :func:`bundle.data.datalist.load_datalist` returns it) with ``template_image``'s training
    item as its template and, as ``test``, its validation items and its other labelled training items.

    The MRE on these items ranks trained models without touching the test images: the labelled training
    items play no other part than template candidates (the self-supervised stage reads no landmark), so
    they are as unseen as the test images, and there are six times more of them than validation items.
    """

    target = str(Path(template_image).resolve())
    labelled = _absolute_images(labelled_training_items(datalist))
    template = [it for it in labelled if it["image"] == target]
    if not template:
        raise ValueError(f"the template {template_image} is not a labelled training item of the datalist")
    others = [it for it in labelled if it is not template[0]]
    sections = {section: _absolute_images(datalist.get(section, [])) for section in ("training", "validation")}
    return dict(datalist, **sections, template=template[0], test=sections["validation"] + others)


def common_datalist(datalist: dict, k: int) -> dict:
    """``datalist`` with its first ``k`` labelled training items as ``templates`` (k-shot, combined per landmark
    by the evaluation's ``template_combine``) and its ``test`` items: every run is scored with the same
    templates, so that rows are compared without each run's own choice of template."""
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k (the number of common templates) must be a positive integer, got {k!r}")
    labelled = labelled_training_items(datalist)
    if len(labelled) < k:
        raise ValueError(f"{k} common templates asked for, the datalist has {len(labelled)} labelled training items")
    sections = {section: _absolute_images(datalist.get(section, [])) for section in ("training", "validation", "test")}
    rest = {key: value for key, value in datalist.items() if key != "template"}
    return dict(rest, **sections, templates=_absolute_images(labelled[:k]))


def _evaluate_runs(datalist: str, out: str, key: str, make_datalist, describe: str) -> None:
    """Evaluate every finished run of ``out`` on ``make_datalist(datalist, run's metrics.json)`` and add the result
    to its ``result.json`` as ``KEY`` (metrics) and ``KEY_mre_mm``; runs that have it already are skipped."""
    full = load_datalist(datalist)
    for path in sorted(Path(out).glob("*/result.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        if f"{key}_mre_mm" in result:
            print(f"{result['name']}: {key} done already")
            continue
        run_dir = path.parent
        chosen = json.loads((run_dir / "eval" / "metrics.json").read_text(encoding="utf-8"))
        write_json_atomic(run_dir / f"{key}_datalist.json", make_datalist(full, chosen))
        metrics = run_command(
            "evaluating",
            config_files("evaluate"),
            dict(
                datalist=run_dir / f"{key}_datalist.json",
                output_dir=run_dir / key,
                ckpt_path=run_dir / "models" / "model.pt",
                overlays=False,
                pseudo_templates=0,  # the paper's one-shot protocol
                pipeline="templates",
            ),
            run_dir / f"{key}.log",
        ).outputs
        write_json_atomic(path, dict(result, **{key: metrics, f"{key}_mre_mm": metrics["mre_mm"]}))
        print(
            f"{result['name']}: {describe} MRE {metrics['mre_mm']:.2f} mm on {metrics['n_images']} images, "
            f"test {result['test']['mre_mm']:.2f} mm",
            flush=True,
        )


def select(datalist: str, out: str) -> None:
    """Evaluate every finished run of ``out`` on its :func:`selection_datalist` (the template its test evaluation
    chose) and add the result to its ``result.json`` as ``selection`` (metrics) and ``selection_mre_mm``."""
    _evaluate_runs(
        datalist, out, "selection", lambda full, chosen: selection_datalist(full, chosen["template"]), "selection"
    )


def common(datalist: str, out: str, k: int = 5) -> None:
    """Evaluate every finished run of ``out`` on the test items with the same ``k`` templates
    (:func:`common_datalist`) and add the result to its ``result.json`` as ``common`` and ``common_mre_mm``."""
    _evaluate_runs(datalist, out, "common", lambda full, chosen: common_datalist(full, k), f"{k} common templates")


def template_rules(datalist: str, run_dir: str, pool_size: int = 32) -> dict:
    """Compare the two template rules of ``bundle.templates.resolution.resolve_template`` on images outside the test
    split.

    Both rules choose among the first ``pool_size`` labelled training items (a template the datalist names is
    ignored), as the evaluation does; each chosen template is then scored by its one-shot MRE on the other
    labelled training items and the validation items, which neither rule saw. Writes and returns
    ``RUN_DIR/template_rules.json``.
    """
    import torch
    from bundle.configs import bundle_parser
    from bundle.geometry import grid_landmarks
    from bundle.templates.resolution import resolve_template
    from bundle.templates.selection import landmark_transfer_errors

    run_path = Path(run_dir)
    parser = bundle_parser(
        config_files("evaluate"), datalist=datalist, ckpt_path=str(run_path / "models" / "model.pt"), device="cpu"
    )
    network, preprocessing = parser.get_parsed_content("network"), parser.get_parsed_content("validate#preprocessing")
    full = load_datalist(datalist)
    labelled = labelled_training_items(full)
    pool, held = labelled[:pool_size], labelled[pool_size:] + list(full.get("validation", []))
    if not held:
        raise ValueError(
            f"{datalist}: no labelled item outside the first {pool_size} labelled training items to score on"
        )
    chosen = {
        rule: resolve_template(
            dict(full, training=pool, template=None), network, preprocessing, "cpu", max_images=pool_size, rule=rule
        )
        for rule in ("features", "landmarks")
    }
    prepared = [preprocessing(dict(it)) for it in [chosen["features"], chosen["landmarks"]] + held]
    points, matrices = zip(*(grid_landmarks(d) for d in prepared))
    errors = landmark_transfer_errors(
        network, [torch.as_tensor(d["image"]) for d in prepared], points, matrices, templates=[0, 1]
    )
    result = {
        rule: {"template": chosen[rule]["image"], "held_out_mre_mm": float(errors[row, 2:].nanmean())}
        for row, rule in enumerate(("features", "landmarks"))
    }
    result["n_pool"], result["n_held_out"] = len(pool), len(held)
    write_json_atomic(run_path / "template_rules.json", result)
    return result
