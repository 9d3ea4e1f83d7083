"""k-shot and pseudo-template measurements on a protocol datalist (docs/results.md, "Several templates").

    python -m scripts.experiments.kshot_study selection --datalist runs/hamedan/protocol.json --template 019 \
        --out runs/kshot
    python -m scripts.experiments.kshot_study test --datalist runs/hamedan/protocol.json --out runs/kshot \
        --runs "[{'name': 'one', 'template': '019'}, {'name': 'five', 'first_labelled': 5}]"

    python -m scripts.experiments.kshot_study vote_weights --datalist runs/hamedan/protocol.json --split validation \
        --template_rule landmarks --pseudo_templates 0
    python -m scripts.experiments.kshot_study few_labels --datalist runs/hamedan/protocol.json \
        --named "[['046'], ['018']]"

``selection`` chooses the pseudo-template settings without the test images: the template's labels are the only ones
used; the first ``pool`` other labelled training images are stripped of their landmarks and serve as the
pseudo-template candidates, and every labelled image outside the test split that is neither the template nor a
candidate (the validation split and the remaining labelled training images) is evaluated, for each setting of
``pseudo_templates`` (M, kept) x ``pseudo_cycle_tolerance``. ``test`` runs the given settings on the test split.
``vote_weights`` matches the evaluation's templates once per image of a split and combines the votes of subsets of
them weighted by their match scores (the choice of ``bundle.kshot.vote_weights``' power). ``few_labels`` scores
pseudo-templates against the number of labelled templates on labelled non-test images (the choice of the
``pseudo_*`` defaults). Each run of the
first two writes ``OUT/<name>/metrics.json`` (the bundle's evaluating command) and the script prints MRE, SDR 2 mm,
the share of errors above 10 mm and the wall time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bundle.configs import config_files
from bundle.data.datalist import load_datalist, save_datalist
from bundle.io_utils import write_json_atomic
from bundle.reporting import read_predictions_csv
from bundle.templates.resolution import labelled_training_items
from scripts.bundle_commands import run_command
from scripts.cli import run_fire


def _find(items: list[dict], stem: str) -> dict:
    matches = [it for it in items if Path(it["image"]).stem == str(stem)]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} labelled training items named {stem!r}")
    return matches[0]


def _absolute(item: dict) -> dict:
    """The item with its image path absolute (load_datalist gives paths relative to the working directory)."""
    return {**item, "image": str(Path(item["image"]).resolve())}


def _study(full: dict, purpose: str, candidates: list[dict], scored: list[dict], **templates) -> dict:
    """A datalist of ``full``'s landmarks whose training items are the pseudo-template ``candidates``, whose test
    items are the ``scored`` labelled images (no validation split), with the ``template`` / ``templates`` given."""
    return {
        "name": f"{full.get('name', 'datalist')} {purpose}",
        "spatial_dims": full["spatial_dims"],
        "landmark_names": full["landmark_names"],
        "training": candidates,
        "validation": [],
        "test": scored,
        **templates,
    }


def _evaluate(datalist: dict, out: Path, ckpt_path: str, **overrides) -> dict:
    """Run the bundle's evaluating command on ``datalist``; return its metrics plus gross-error share and seconds."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    absolute = {
        k: (
            [_absolute(it) for it in v]
            if k in ("training", "validation", "test", "templates")
            else (_absolute(v) if k == "template" else v)
        )
        for k, v in datalist.items()
    }
    path = save_datalist(absolute, out / "datalist.json")
    evaluation = run_command(
        "evaluating",
        config_files("evaluate"),
        dict(
            datalist=path,
            output_dir=out,
            ckpt_path=Path(ckpt_path).resolve(),
            overlays=False,
            progress_bar=False,
            pipeline="templates",  # what matching gives, whatever detector is at hand
            **overrides,
        ),
    )
    metrics, seconds = evaluation.outputs, evaluation.seconds
    errors = np.array([r["error_mm"] for r in read_predictions_csv(out / "predictions.csv")])
    errors = errors[np.isfinite(errors)]
    result = {
        **overrides,
        "mre_mm": metrics["mre_mm"],
        "sdr_2mm": metrics["sdr"]["2.0"],
        "sdr_4mm": metrics["sdr"]["4.0"],
        "median_mm": float(np.median(errors)),
        "over_10mm_percent": float(100 * np.mean(errors > 10.0)),
        "n_images": metrics["n_images"],
        "templates": metrics.get("templates", [metrics["template"]]),
        "seconds": seconds,
    }
    write_json_atomic(out / "result.json", result)
    print(
        f"{out.name}: MRE {result['mre_mm']:.2f} mm, SDR 2 mm {result['sdr_2mm']:.1f} %, > 10 mm "
        f"{result['over_10mm_percent']:.1f} %, {len(result['templates'])} templates, {seconds:.0f} s",
        flush=True,
    )
    return result


def selection(
    datalist: str,
    template: str,
    out: str = "runs/kshot",
    pool: int = 30,
    keep=(0, 3, 5, 10),
    tolerances=(1.0, 2.0, 4.0),
    ckpt_path: str = "models/model.pt",
) -> list[dict]:
    """Pseudo-template settings scored on labelled non-test images (see the module doc)."""
    full = load_datalist(datalist)
    labelled = labelled_training_items(full)
    chosen = _find(labelled, template)
    others = [it for it in labelled if it is not chosen]
    candidates = [{"image": it["image"]} for it in others[:pool]]
    scored = [dict(it) for it in others[pool:]] + [dict(it) for it in full["validation"]]
    study = _study(full, "selection", candidates, scored, template=chosen)
    results = []
    for m in keep:
        for tol in tolerances if m else tolerances[:1]:
            name = f"sel_m{m}_tol{tol:g}"
            results.append(
                {
                    "name": name,
                    **_evaluate(
                        study,
                        Path(out) / name,
                        ckpt_path,
                        pseudo_candidates=pool,
                        pseudo_templates=m,
                        pseudo_cycle_tolerance=tol,
                    ),
                }
            )
    write_json_atomic(Path(out) / "selection.json", results)
    return results


def test(datalist: str, runs: list, out: str = "runs/kshot", ckpt_path: str = "models/model.pt") -> list[dict]:
    """Each run on the test split: ``template`` (an image stem: that labelled training item alone) or
    ``first_labelled`` (the first K labelled training items as ``templates``), plus any config overrides
    (``pseudo_candidates``, ``pseudo_templates``, ``pseudo_cycle_tolerance``, ``template_combine``)."""
    full = load_datalist(datalist)
    labelled = labelled_training_items(full)
    results = []
    for spec in runs:
        spec = dict(spec)
        name = spec.pop("name")
        variant = dict(full)
        if "template" in spec:
            variant["template"] = _find(labelled, spec.pop("template"))
        if "first_labelled" in spec:
            variant["templates"] = labelled[: int(spec.pop("first_labelled"))]
        results.append({"name": name, **_evaluate(variant, Path(out) / name, ckpt_path, **spec)})
    write_json_atomic(Path(out) / "test.json", results)
    return results


def vote_weights(
    datalist: str,
    split: str = "validation",
    powers_per_vote=(0.0, 0.125, 0.25, 1 / 3),
    counts=(3, 5, 10, 20, 32),
    draws: int = 8,
    out: str = "runs/kshot",
    ckpt_path: str = "models/model.pt",
    **overrides,
) -> list[dict]:
    """The evaluation's templates (``evaluating``'s choice with ``overrides``) matched once in each labelled image of
    ``split``; for each template count in ``counts`` (``draws`` seeded random subsets of them, all of them once) their
    votes combined by the geometric median weighted by :func:`bundle.kshot.vote_weights` with each power per vote
    (0: every vote alike). MRE and the share of errors above 10 mm, averaged over the draws, are printed and written
    to ``OUT/vote_weights_<split>.json``."""
    import torch
    from bundle.configs import bundle_parser
    from bundle.data.datalist import section_items
    from bundle.geometry import apply_homogeneous, plain_tensor
    from bundle.inferers.oneshot import OneShotInferer
    from bundle.kshot import geometric_median
    from bundle.kshot import vote_weights as weights_of
    from bundle.templates.resolution import with_templates

    settings = dict(datalist=datalist, ckpt_path=ckpt_path, output_dir=out, overlays=False, **overrides)
    parser = bundle_parser(config_files("evaluate"), **settings)
    network = parser.get_parsed_content("network").eval()
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    device = parser.get_parsed_content("device")
    inferer = with_templates(OneShotInferer(), parser.get_parsed_content("evaluate#templates"), preprocessing, device)
    matches = []
    for item in section_items(parser.get_parsed_content("dataset"), split, datalist, labelled=True):
        data = preprocessing(item)
        found = inferer.match_templates(data["image"][None].to(device), network)
        physical = apply_homogeneous(plain_tensor(data["grid_to_physical"]).double(), found.positions[:, 0].cpu())
        matches.append((physical, found.scores[:, 0].cpu(), plain_tensor(data["label"]).double()))
    generator = torch.Generator().manual_seed(0)
    n_templates = len(inferer.templates)
    results = []
    for count in counts:
        whole = count >= n_templates
        subsets = [torch.arange(n_templates)] if whole else [torch.randperm(n_templates, generator=generator)[:count]]
        subsets += [] if whole else [torch.randperm(n_templates, generator=generator)[:count] for _ in range(draws - 1)]
        for power in powers_per_vote:
            mre, gross = [], []
            for subset in subsets:
                errors = []
                for physical, scores, label in matches:
                    votes = physical[subset]
                    weights = weights_of(scores[subset], votes, power) if power else None
                    errors.append((geometric_median(votes, weights) - label).norm(dim=-1))
                e = torch.cat(errors)
                e = e[torch.isfinite(e)]
                mre.append(float(e.mean()))
                gross.append(float(100 * (e > 10.0).double().mean()))
            result = {"templates": len(subsets[0]), "power_per_vote": power, "draws": len(subsets)}
            result.update(mre_mm=sum(mre) / len(mre), over_10mm_percent=sum(gross) / len(gross))
            results.append(result)
            print(
                f"{split}: {result['templates']} templates, power {power:.3g} per vote: MRE {result['mre_mm']:.3f} mm, "
                f"> 10 mm {result['over_10mm_percent']:.2f} % ({len(subsets)} draws, {len(matches)} images)",
                flush=True,
            )
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(out) / f"vote_weights_{split}.json", results)
    return results


def few_labels(
    datalist: str,
    counts=(3, 5, 10),
    seeds=(0, 1),
    named=(),
    pseudo=(0, 10, 20),
    pool: int = 31,
    out: str = "runs/kshot",
    ckpt_path: str = "models/model.pt",
) -> list[dict]:
    """Pseudo-templates against the number of labelled templates, scored on labelled non-test images.

    The first ``pool`` labelled training images are the labelled templates' source; the other labelled training
    images and the validation split are scored (the test split is not read). For each count K in ``counts`` and
    each seed, K of the pool are drawn (``random.Random(seed)``; ``named``: lists of image stems taken as they
    are) as ``templates``, and the rest of the pool, without landmarks, are the pseudo-template candidates; each
    M in ``pseudo`` adds M pseudo-templates. Writes ``OUT/few_labels.json``."""
    import random

    full = load_datalist(datalist)
    labelled = labelled_training_items(full)
    source = labelled[:pool]
    scored = [dict(it) for it in labelled[pool:]] + [dict(it) for it in full["validation"]]
    template_sets = [(f"{'-'.join(stems)}", [_find(source, stem) for stem in stems]) for stems in named]
    template_sets += [(f"k{k}_s{seed}", random.Random(seed).sample(source, k)) for k in counts for seed in seeds]
    results = []
    for name, templates in template_sets:
        chosen = {it["image"] for it in templates}
        candidates = [{"image": it["image"]} for it in source if it["image"] not in chosen]
        study = _study(full, "few labels", candidates, scored, templates=templates)
        for m in pseudo:
            settings = dict(pseudo_candidates=len(candidates), pseudo_templates=m, pseudo_max_labelled=len(templates))
            result = _evaluate(study, Path(out) / f"{name}_m{m}", ckpt_path, **settings)
            results.append({"run": name, "labelled": sorted(Path(it["image"]).stem for it in templates), **result})
    write_json_atomic(Path(out) / "few_labels.json", results)
    return results


if __name__ == "__main__":
    run_fire({"selection": selection, "test": test, "vote_weights": vote_weights, "few_labels": few_labels})
