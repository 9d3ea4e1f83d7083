"""The paper's ablation (Quan et al. CVPR 2023, Table 3 rows) and the gamma / alpha_hat sweeps on one datalist.

    python -m scripts.experiments.ablation run --datalist runs/hamedan/protocol.json --out runs/hamedan \
        [--iterations 500 --seeds "[0,1]" --augmentation "runs/hamedan/aug_{alpha}.yaml" --only "[name,...]"]
    python -m scripts.experiments.ablation select --datalist runs/hamedan/protocol.json --out runs/hamedan
    python -m scripts.experiments.ablation template_rules --datalist runs/hamedan/protocol.json \
        --run_dir runs/hamedan/entropy_s0
    python -m scripts.experiments.ablation report --out runs/hamedan --docs docs [--long runs/hamedan_long]
    python -m scripts.experiments.ablation run --plan converged --datalist runs/hamedan/protocol.json \
        --out runs/hamedan_3000 --iterations 3000 --augmentation runs/hamedan/aug_estimated.yaml
    python -m scripts.experiments.ablation report_plan --plan converged --out runs/hamedan_3000 --docs docs
    python -m scripts.experiments.ablation run --plan comparison --datalist runs/hamedan/protocol.json \
        --out runs/hamedan_comparison --iterations 1500 --augmentation runs/hamedan/aug_estimated.yaml
    python -m scripts.experiments.ablation report_plan --plan comparison --out runs/hamedan_comparison --docs docs

``run`` trains and evaluates every planned run (:func:`plan`) in turn with the bundle's own commands, the
same budget for all, and writes ``OUT/<run>/result.json`` (settings, validation and test metrics, training
time, peak memory); a run whose ``result.json`` exists is skipped, so an interrupted plan continues where it
stopped. ``augmentation`` is a path pattern with ``{alpha}``: the per-group intensities that
``python -m scripts.estimate_augmentation --alpha_hat ALPHA`` wrote. ``select`` scores each finished run on the
labelled images outside the test split (:func:`selection_datalist`), the ranking that chooses the shipped
model. ``template_rules`` compares the template rules of the evaluation on one run, without test images.
``report`` reads the results and writes the tables (``docs/results.md`` between its
``<!-- ablation:begin/end -->`` markers) and the MRE bar plot. ``--plan converged`` runs the ablation at a
length that converges (:func:`plan_converged`), ``--plan comparison`` the paper's comparison with view-mixing
methods on the same network (:func:`plan_comparison`); ``report_plan`` keeps every finished run of either in
``docs/results_ablation_converged.json`` / ``docs/results_comparison.json`` (run folders may not survive a
session) and writes its table between the plan's ``<!-- converged:begin/end -->`` /
``<!-- comparison:begin/end -->`` markers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
from bundle.configs import config_files
from bundle.data.datalist import load_datalist
from bundle.io_utils import write_json_atomic, write_text_atomic
from bundle.metrics import GROSS_ERROR_MM
from bundle.reporting import read_predictions_csv
from bundle.templates.resolution import labelled_training_items
from scripts.bundle_commands import run_command
from scripts.cli import run_fire

ROWS = {  # the paper's ablation rows: (entropy_sampling, adaptive_augmentation)
    "baseline": (False, False),
    "entropy": (True, False),
    "adaptive": (False, True),
    "full": (True, True),
}
ROW_TITLES = {
    "baseline": "baseline (uniform sampling, fixed augmentation)",
    "entropy": "+ entropy sampling",
    "adaptive": "+ adaptive augmentation",
    "full": "+ both (full method)",
}
# row: (entropy_sampling, adaptive_augmentation, factor ranges: None = the run's --augmentation, group_mode)
CONVERGED_ROWS = {
    "baseline": (False, False, None, None),
    "entropy": (True, False, None, None),
    "full_estimated": (True, True, None, "query"),
    "full_authors": (True, True, "configs/authors_ranges.yaml", "query"),
    "full_pixel": (True, True, None, "pixel"),
}
ROW_TITLES.update(
    full_estimated="+ both, factor ranges of the paper's MI estimator (estimated here)",
    full_authors="+ both, the authors' published factor ranges",
    full_pixel="+ both, estimated ranges, groups blended per pixel",
)
COMPARISON_ROWS = {  # row: the training's `mixing` (bundle/losses/mixing.py)
    "baseline": "none",
    "unmix": "unmix",
    "mochi": "mochi",
    "zhu": "zhu",
}
ROW_TITLES.update(
    unmix="Un-mix (Shen et al. 2022): image mixtures of views",
    mochi="MoCHi (Kalantidis et al. 2020): hard negative mixing",
    zhu="Zhu et al. 2021: positive extrapolation, negative interpolation",
)
DEFAULT_GAMMA, DEFAULT_ALPHA = 0.3, 0.8
GAMMAS, ALPHAS = (0.0, 0.1, 0.3, 1.0), (0.4, 0.8, 1.0, 1.7)


def run_spec(
    name: str,
    row: str,
    seed: int,
    entropy_sampling: bool,
    adaptive_augmentation: bool,
    gamma: float,
    alpha_hat: float = DEFAULT_ALPHA,
    **extra,
) -> dict:
    """One planned run: its name (``NAME_sSEED``), row, seed, the paper's two switches and their parameters,
    plus a plan's own keys (``augmentation_file``, ``group_mode``, ``mixing``, ...)."""
    return dict(
        name=f"{name}_s{seed}",
        row=row,
        seed=seed,
        entropy_sampling=entropy_sampling,
        adaptive_augmentation=adaptive_augmentation,
        gamma=gamma,
        alpha_hat=alpha_hat,
        **extra,
    )


def plan(seeds) -> list[dict]:
    """Every run: the four ablation rows for each seed, then the first seed's extra sweep points.

    The alpha_hat sweep varies the full method (alpha_hat 0.8 is the "full" row); the gamma sweep varies
    entropy sampling with the fixed augmentation (gamma 0 is the "baseline" row, 0.3 the "entropy" row), so
    that it measures the sampling alone. The extra points run in the order most informative first.
    """

    def spec(name: str, row: str, seed: int, gamma: float = DEFAULT_GAMMA, alpha_hat: float = DEFAULT_ALPHA) -> dict:
        return run_spec(name, row, seed, *ROWS[row], gamma=gamma, alpha_hat=alpha_hat)

    runs = [spec(row, row, seed) for seed in seeds for row in ROWS]
    for kind, value in [("alpha", 1.7), ("gamma", 0.1), ("gamma", 1.0), ("alpha", 1.0), ("alpha", 0.4)]:
        if kind == "alpha":
            runs.append(spec(f"alpha{value}", "full", seeds[0], alpha_hat=value))
        else:
            runs.append(spec(f"gamma{value}", "entropy", seeds[0], gamma=value))
    return runs


def plan_converged(seeds) -> list[dict]:
    """The rows of the ablation at a length that converges, for each seed: baseline, + entropy sampling, and
    the full method with the factor ranges of the paper's estimator (``run --augmentation``) and with the
    authors' published ranges. Those two full rows take one information group per crop, the query pixel's
    (``group_mode: query``, as the authors' code), so that they differ only in the ranges; a third full row
    blends the groups' estimated factors per pixel (``group_mode: pixel``), so that it differs from the first
    only in the form of the augmentation."""
    return [
        run_spec(
            row,
            row,
            seed,
            entropy,
            adaptive,
            gamma=DEFAULT_GAMMA if entropy else 0.0,
            augmentation_file=ranges,
            group_mode=group_mode,
        )
        for seed in seeds
        for row, (entropy, adaptive, ranges, group_mode) in CONVERGED_ROWS.items()
    ]


def plan_comparison(seeds) -> list[dict]:
    """The paper's comparison of view-mixing methods on the same network, for each seed: the baseline, Un-mix,
    MoCHi and Zhu et al. As the paper's comparison rows, every row samples queries uniformly and applies the
    intensities estimated for the high-information group to every pixel (``high_group_everywhere``, from the
    run's ``--augmentation``); the rows differ only in ``mixing``."""
    return [
        run_spec(
            row,
            row,
            seed,
            False,
            True,
            gamma=0.0,
            augmentation_file=None,
            group_mode=None,
            high_group_everywhere=True,
            mixing=mixing,
        )
        for seed in seeds
        for row, mixing in COMPARISON_ROWS.items()
    ]


def high_group_overrides(augmentation: dict) -> dict:
    """Training overrides that give all three information groups the high group's intensities of an
    ``augmentation`` section (its factor ranges where it has them, else its symmetric intensities)."""
    overrides = {}
    for name in ("brightness", "contrast"):
        ranges, intensities = augmentation.get(f"{name}_ranges"), augmentation.get(name)
        if ranges is None and intensities is None:
            raise ValueError(f"the augmentation has neither {name}_ranges nor {name}")
        if ranges is not None:
            overrides[f"augmentation#{name}_ranges"] = [list(ranges[2])] * 3
        else:
            overrides[f"augmentation#{name}"] = [intensities[2]] * 3
    return overrides


PLANS = {"sweep": plan, "converged": plan_converged, "comparison": plan_comparison}


def run_one(
    spec: dict,
    datalist: str,
    out: Path,
    iterations: int,
    epoch_length: int,
    augmentation: str,
    template_rule: str = "landmarks",
    settings: dict | None = None,
) -> dict:
    """Train one planned run, evaluate it on the datalist's test items (template chosen by ``template_rule``),
    write and return its result. ``settings``: bundle keys given to both commands of every run (the network and
    grid of a paper-scale run, ``amp``, ``num_workers``), recorded in the result."""
    run_dir = out / spec["name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    aug = spec.get("augmentation_file") or augmentation.format(alpha=spec["alpha_hat"])
    if not Path(aug).is_file():
        raise FileNotFoundError(
            f"{aug}: no estimated intensities for alpha_hat {spec['alpha_hat']} "
            f"(run python -m scripts.estimate_augmentation --alpha_hat {spec['alpha_hat']} --output {aug})"
        )
    epochs = max(1, iterations // epoch_length)
    overrides = dict(
        datalist=datalist,
        output_dir=run_dir / "train",
        ckpt_dir=run_dir / "models",
        seed=spec["seed"],
        entropy_sampling=spec["entropy_sampling"],
        adaptive_augmentation=spec["adaptive_augmentation"],
        sampling_gamma=spec["gamma"],
        epochs=epochs,
        epoch_length=epoch_length,
        val_interval=epochs,
        progress_bar=False,
        **(settings or {}),
    )
    if spec.get("group_mode"):
        overrides["augmentation#group_mode"] = spec["group_mode"]
    if spec.get("high_group_everywhere"):
        overrides.update(high_group_overrides(_load_augmentation(aug)))
    if spec.get("mixing"):
        overrides["mixing"] = spec["mixing"]
    # a run interrupted by a stopped session continues from its last epoch instead of starting again
    resumed = (run_dir / "models" / "last.pt").is_file()
    if resumed:
        overrides["resume"] = True
    train = run_command("training", [*config_files("train"), aug], overrides, run_dir / "train.log", append=resumed)
    evaluation = run_command(
        "evaluating",
        config_files("evaluate"),
        dict(
            datalist=datalist,
            output_dir=run_dir / "eval",
            ckpt_path=run_dir / "models" / "model.pt",
            template_rule=template_rule,
            max_templates=1,  # the paper's one-shot protocol: one template, no pseudo-template, no detector
            pseudo_templates=0,
            pipeline="templates",
            **(settings or {}),
        ),
        run_dir / "eval.log",
    )
    result = dict(
        spec,
        iterations=epochs * epoch_length,
        augmentation_file=aug,
        template_rule=template_rule,
        settings=settings or {},
        validation_mre_mm=train.outputs.get("val_mre_mm"),
        test=evaluation.outputs,
        train_seconds=round(train.seconds, 1),  # of the last (resumed) part only when ``resumed``
        resumed=resumed,
        train_peak_rss_mb=round(train.peak_rss_mb),
        eval_seconds=round(evaluation.seconds, 1),
        eval_peak_rss_mb=round(evaluation.peak_rss_mb),
    )
    write_json_atomic(run_dir / "result.json", result)
    return result


def run(
    datalist: str,
    out: str,
    iterations: int = 500,
    epoch_length: int = 100,
    seeds=(0, 1),
    augmentation: str = "runs/hamedan/aug_{alpha}.yaml",
    only=None,
    template_rule: str = "landmarks",
    plan: str = "sweep",
    settings: dict | None = None,
) -> None:
    """Run every run of the plan (``sweep``, ``converged`` or ``comparison``; or those named in ``only``) that has no
    ``result.json`` yet; ``settings`` are bundle keys given to every run's commands (:func:`run_one`)."""
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {sorted(PLANS)}, got {plan!r}")
    out_dir = Path(out)
    for spec in PLANS[plan](list(seeds)):
        if only is not None and spec["name"] not in only:
            continue
        if (out_dir / spec["name"] / "result.json").is_file():
            print(f"{spec['name']}: done already")
            continue
        res = run_one(spec, datalist, out_dir, iterations, epoch_length, augmentation, template_rule, settings)
        t = res["test"]
        print(
            f"{spec['name']}: test MRE {t['mre_mm']:.2f} mm ({t['mre_px']:.1f} px), SDR 2 mm {t['sdr']['2.0']:.1f} %, "
            f"validation {res['validation_mre_mm']}, {res['train_seconds']:.0f} s",
            flush=True,
        )


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


def load_results(out: str | Path) -> list[dict]:
    """Every ``result.json`` under ``out``, with the median error and the share of gross errors (> 10 mm)
    from the run's ``eval/predictions.csv`` when it exists."""
    results = []
    for path in sorted(Path(out).glob("*/result.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        predictions = path.parent / "eval" / "predictions.csv"
        if predictions.is_file():
            errors = np.array([row["error_mm"] for row in read_predictions_csv(predictions)])
            errors = errors[np.isfinite(errors)]
            result["median_mm"] = float(np.median(errors))
            result["gross_pct"] = float(100.0 * np.mean(errors > GROSS_ERROR_MM))
        results.append(result)
    return results


def _sweep_run(results: dict, kind: str, value: float, seed: int) -> dict | None:
    """The seed's run of the gamma sweep (fixed augmentation) or of the alpha_hat sweep (full method) at ``value``."""
    if kind == "gamma":
        name = {0.0: "baseline", DEFAULT_GAMMA: "entropy"}.get(value, f"gamma{value}")
    else:
        name = "full" if value == DEFAULT_ALPHA else f"alpha{value}"
    return results.get(f"{name}_s{seed}")


def _mean_sd(values: list[float]) -> str:
    """``mean ± SD`` (sample SD) of two or more values, the value alone for one."""
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def _metrics_row(runs: list[dict], score: str = "selection_mre_mm") -> list[str]:
    """MRE mm (mean ± SD over runs) and per run, MRE px, SDR at the four thresholds, median error, gross errors
    and the extra ``score`` of every run (means over runs; ``-`` where a run lacks it)."""
    mm = [r["test"]["mre_mm"] for r in runs]
    cells = [_mean_sd(mm), " / ".join(f"{v:.2f}" for v in mm), f"{np.mean([r['test']['mre_px'] for r in runs]):.1f}"]
    cells += [f"{np.mean([r['test']['sdr'][t] for r in runs]):.1f}" for t in ("2.0", "2.5", "3.0", "4.0")]
    for key, digits in (("median_mm", 2), ("gross_pct", 1), (score, 2)):
        values = [r[key] for r in runs if key in r]
        cells.append(f"{np.mean(values):.{digits}f}" if len(values) == len(runs) else "-")
    return cells


def selector_agreement(results: list[dict]) -> str:
    """How well each model-selection score ranks the runs as the test MRE does (Spearman's rho over the runs)."""
    from scipy.stats import spearmanr

    lines = []
    for key, label in (
        ("validation_mre_mm", "validation MRE (validation images, the datalist's first labelled item as template)"),
        ("selection_mre_mm", "selection MRE (labelled non-test images, the run's own template)"),
    ):
        runs = [r for r in results if r.get(key) is not None]
        if len(runs) >= 3:
            rho = spearmanr([r[key] for r in runs], [r["test"]["mre_mm"] for r in runs]).statistic
            lines.append(f"- {label}: Spearman's rho with the test MRE {rho:+.2f} over {len(runs)} runs")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


METRIC_HEADER = [
    "MRE mm (mean ± SD over seeds)",
    "MRE mm per seed",
    "MRE px",
    "SDR 2 mm %",
    "SDR 2.5 mm %",
    "SDR 3 mm %",
    "SDR 4 mm %",
    "median error mm",
    f"errors > {GROSS_ERROR_MM:g} mm %",
    "selection MRE mm (labelled non-test images)",
]


def tables(results: list[dict]) -> str:
    """The ablation table (rows × seeds) and the gamma and alpha_hat sweep tables, as markdown."""
    by_name = {r["name"]: r for r in results}
    seeds = sorted({r["seed"] for r in results if r["name"] == f"{r['row']}_s{r['seed']}"})
    rows, baseline = [], None
    for row in ROWS:
        runs = [by_name[f"{row}_s{s}"] for s in seeds if f"{row}_s{s}" in by_name]
        if not runs:
            continue
        mean = float(np.mean([r["test"]["mre_mm"] for r in runs]))
        baseline = mean if row == "baseline" else baseline
        change = (
            ""
            if baseline is None or row == "baseline"
            else f"{round(100 * (baseline - mean) / baseline, 1) or 0.0:+.1f} %"
        )
        rows.append([ROW_TITLES[row], str(len(runs))] + _metrics_row(runs) + [change])
    budget, rules = {r["iterations"] for r in results}, {r["template_rule"] for r in results}
    text = [
        f"Budget per run: {', '.join(map(str, sorted(budget)))} iterations of batch 8; seeds {seeds}; "
        f"test template chosen by the rule {' / '.join(sorted(rules))!r}.",
        "",
        _table(["row", "seeds"] + METRIC_HEADER + ["MRE gain over baseline"], rows),
    ]
    first = seeds[0] if seeds else 0
    for kind, values, label in (
        ("gamma", GAMMAS, "gamma (sampling weight H^gamma)"),
        ("alpha", ALPHAS, "alpha_hat (target MI share)"),
    ):
        sweep = []
        for v in values:
            r = _sweep_run(by_name, kind, v, first)
            if r is None:
                continue
            extra = []
            if kind == "alpha":
                aug = _load_augmentation(r["augmentation_file"])
                extra = [
                    " / ".join(f"{a:.2f}" for a in aug["brightness"]),
                    " / ".join(f"{a:.2f}" for a in aug["contrast"]),
                ]
            val = r["validation_mre_mm"]
            cells = _metrics_row([r])
            sweep.append([f"{v:g}"] + extra + [f"{val:.2f}" if val is not None else "-"] + cells[:1] + cells[2:])
        if sweep:
            head = [label] + (["A brightness (low/med/high)", "A contrast (low/med/high)"] if kind == "alpha" else [])
            head += ["validation MRE mm", "test MRE mm"] + METRIC_HEADER[2:]
            rest = "the fixed augmentation" if kind == "gamma" else "entropy sampling with gamma 0.3"
            text += ["", f"Sweep of {label}, seed {first}, with {rest}:", "", _table(head, sweep)]
    return "\n".join(text)


def _run_title(run: dict) -> str:
    """The run's ablation row, with its gamma or alpha_hat where a sweep changed it."""
    extra = []
    if run["entropy_sampling"] and run["gamma"] != DEFAULT_GAMMA:
        extra.append(f"gamma {run['gamma']:g}")
    if run["adaptive_augmentation"] and run["alpha_hat"] != DEFAULT_ALPHA:
        extra.append(f"alpha_hat {run['alpha_hat']:g}")
    return ", ".join([ROW_TITLES[run["row"]]] + extra)


def length_table(short: list[dict], long: list[dict]) -> str:
    """The runs trained longer (``long``) beside the same runs at the sweep budget (``short``), as markdown.

    Each long run is matched by name (row, sweep value and seed) with its short run; the gain is over the
    long baseline of the same seed.
    """
    short_by_name = {r["name"]: r for r in short}
    long_by_name = {r["name"]: r for r in long}
    rows = []
    for r in sorted(long, key=lambda r: (list(ROWS).index(r["row"]), r["name"])):
        base = long_by_name.get(f"baseline_s{r['seed']}")
        gain = (
            ""
            if base is None or r is base
            else f"{100 * (base['test']['mre_mm'] - r['test']['mre_mm']) / base['test']['mre_mm']:+.1f} %"
        )
        before = short_by_name.get(r["name"])
        label_free = r["test"] if r["template_rule"] == "features" else r.get("test_features_rule")
        cells = _metrics_row([r])
        rows.append(
            [
                _run_title(r),
                str(r["seed"]),
                str(r["iterations"]),
                r["template_rule"],
                (
                    f"{before['test']['mre_mm']:.2f} ({before['iterations']}, {before['template_rule']})"
                    if before
                    else "-"
                ),
                f"{label_free['mre_mm']:.2f}" if label_free else "-",
            ]
            + cells[:1]
            + cells[2:]
            + [gain]
        )
    head = [
        "run",
        "seed",
        "iterations",
        "template rule",
        "MRE mm at the sweep budget (iterations, rule)",
        "MRE mm, rule 'features'",
        "MRE mm",
    ] + METRIC_HEADER[2:]
    return _table(head + ["MRE gain over the baseline of this length"], rows)


def _load_augmentation(path: str) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))["augmentation"]


def plot_mre(results: list[dict], path: Path) -> Path:
    """MRE bars (mean over seeds, SD as error bars, each seed a dot) and the two sweeps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_name = {r["name"]: r for r in results}
    seeds = sorted({r["seed"] for r in results if r["name"] == f"{r['row']}_s{r['seed']}"})
    fig = Figure(figsize=(12.0, 4.0), dpi=100)
    ax = fig.add_subplot(1, 3, 1)
    for i, row in enumerate(ROWS):
        mm = [by_name[f"{row}_s{s}"]["test"]["mre_mm"] for s in seeds if f"{row}_s{s}" in by_name]
        if not mm:
            continue
        ax.bar(i, np.mean(mm), yerr=np.std(mm, ddof=1) if len(mm) > 1 else 0, color="tab:blue", alpha=0.6, capsize=6)
        ax.plot([i] * len(mm), mm, "o", color="black", markersize=4)
    ax.set_xticks(range(len(ROWS)), ["baseline", "+entropy", "+adaptive", "+both"])
    ax.set_ylabel("test MRE (mm)")
    ax.set_title(f"ablation (seeds {', '.join(map(str, seeds))})")
    for k, (kind, values, label) in enumerate((("gamma", GAMMAS, "gamma"), ("alpha", ALPHAS, "alpha_hat")), start=2):
        ax = fig.add_subplot(1, 3, k)
        pts = [(v, _sweep_run(by_name, kind, v, seeds[0] if seeds else 0)) for v in values]
        pts = [(v, r) for v, r in pts if r is not None]
        if pts:
            ax.plot([v for v, _ in pts], [r["test"]["mre_mm"] for _, r in pts], "o-", label="test")
            val = [(v, r["validation_mre_mm"]) for v, r in pts if r["validation_mre_mm"] is not None]
            ax.plot([v for v, _ in val], [m for _, m in val], "s--", label="validation (default template)")
        ax.set_xlabel(label)
        ax.set_ylabel("MRE (mm)")
        ax.set_title(f"{label} sweep (seed {seeds[0] if seeds else 0})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=fig.dpi)
    return path


def report(out: str, docs: str = "docs", long: str | None = None) -> None:
    """Write the tables into ``DOCS/results.md`` (between the ablation markers) and ``DOCS/results_mre.png``.

    ``long``: the output folder of ablation rows run again with a longer budget (``run --iterations``);
    their table (:func:`length_table`) follows the others.
    """
    results = load_results(out)
    if not results:
        raise FileNotFoundError(f"{out}: no */result.json yet (run the plan first)")
    long_results = load_results(long) if long is not None else []
    if long is not None and not long_results:
        raise FileNotFoundError(f"{long}: no */result.json yet (run the plan there first)")
    page = Path(docs) / "results.md"
    begin, end = "<!-- ablation:begin -->", "<!-- ablation:end -->"
    text = page.read_text(encoding="utf-8") if page.is_file() else f"{begin}\n{end}\n"
    if begin not in text or end not in text:
        raise ValueError(f"{page}: the markers {begin} and {end} are missing")
    head, rest = text.split(begin, 1)
    table_text = tables(results)
    if long_results:
        budget = ", ".join(map(str, sorted({r["iterations"] for r in long_results})))
        lengths = length_table(results, long_results)
        table_text += f"\n\nTraining length: the same rows trained for {budget} iterations:\n\n{lengths}"
    agreement = selector_agreement(results + long_results)
    if agreement:
        table_text += f"\n\nHow well the scores computed without test images rank the runs:\n\n{agreement}"
    write_text_atomic(page, f"{head}{begin}\n{table_text}\n{end}{rest.split(end, 1)[1]}")
    plot_mre(results, Path(docs) / "results_mre.png")
    print(table_text)


class PlanReport(NamedTuple):
    """How ``report_plan`` shows a plan: its rows, the record of its finished runs under docs/ (its table goes
    between the plan's ``<!-- PLAN:begin/end -->`` markers of results.md), the rows whose MRE the gains are
    measured against, row titles that differ from ``ROW_TITLES``, the paper's (MRE mm, SDR 2 mm %) per row to
    show beside (None: no such column) and a sentence after the table."""

    rows: dict
    record: str
    references: tuple[str, ...]
    titles: dict
    paper: dict | None = None
    footer: str = ""


REPORTS = {
    "converged": PlanReport(CONVERGED_ROWS, "results_ablation_converged.json", ("baseline", "entropy"), {}),
    "comparison": PlanReport(
        COMPARISON_ROWS,
        "results_comparison.json",
        ("baseline",),
        {"baseline": "baseline (uniform sampling, high-group estimated intensities everywhere)"},
        # the paper's comparison with view-mixing methods (ISBI 2015 test set)
        paper={"baseline": (2.91, 39.9), "unmix": (2.54, 44.8), "mochi": (2.56, 50.4), "zhu": (4.19, 24.4)},
        footer="The paper's own method scored 2.34 mm / 51.3 % in the same table.",
    ),
}
GAIN_TITLES = {"baseline": "baseline", "entropy": "+ entropy sampling"}


def rows_table(results: list[dict], plan: str) -> str:
    """The finished runs of a ``converged`` or ``comparison`` plan as markdown: one line per row (mean ± SD over
    its seeds), the MRE gain over each reference row (means over the seeds both have) and, for the comparison,
    the paper's numbers beside."""
    spec = REPORTS[plan]
    titles = {**ROW_TITLES, **spec.titles}
    by_row = {row: sorted((r for r in results if r["row"] == row), key=lambda r: r["seed"]) for row in spec.rows}

    def gain(row: str, reference: str) -> str:
        seeds = {r["seed"] for r in by_row[row]} & {r["seed"] for r in by_row[reference]}
        if row == reference or not seeds:
            return ""
        mean = {k: np.mean([r["test"]["mre_mm"] for r in by_row[k] if r["seed"] in seeds]) for k in (row, reference)}
        gain_pct = 100 * (mean[reference] - mean[row]) / mean[reference]
        return f"{gain_pct:+.1f} % ({len(seeds)} seed{'s' * (len(seeds) > 1)})"

    lines = [
        [titles[row], " / ".join(str(r["seed"]) for r in runs)]
        + _metrics_row(runs, score="common_mre_mm")
        + [gain(row, reference) for reference in spec.references]
        + (["{:.2f} / {:.1f}".format(*spec.paper[row])] if spec.paper else [])
        for row, runs in by_row.items()
        if runs
    ]
    head = ["row", "seeds", *METRIC_HEADER[:-1], "MRE mm, the same templates for every run (ablation.py common)"]
    head += [f"MRE gain over {GAIN_TITLES[r]}" for r in spec.references]
    if spec.paper:
        head.append("the paper (ISBI 2015): MRE mm / SDR 2 mm %")
    budget, rules = sorted({r["iterations"] for r in results}), sorted({r["template_rule"] for r in results})
    text = (
        f"Budget per run: {', '.join(map(str, budget))} iterations of batch 8; test template chosen by the rule "
        f"{' / '.join(rules)!r}.\n\n{_table(head, lines)}"
    )
    return f"{text}\n\n{spec.footer}" if spec.footer else text


def portable(record):
    """``record`` with each ``template`` / ``templates`` image path cut to its file name: the docs' records name the
    data set's images, not where a machine keeps them."""
    if isinstance(record, list):
        return [portable(value) for value in record]
    if not isinstance(record, dict):
        return record
    return {
        key: (
            Path(value).name
            if key == "template" and isinstance(value, str)
            else ([Path(v).name for v in value] if key == "templates" else portable(value))
        )
        for key, value in record.items()
    }


def report_plan(out: str, plan: str = "converged", docs: str = "docs") -> None:
    """Add the finished runs of ``out`` (``--plan converged`` or ``comparison``) to the plan's record under
    ``DOCS`` (runs recorded earlier stay; a run found in both is taken from ``out``; template images by file name,
    :func:`portable`) and write their table into
    ``DOCS/results.md`` between the plan's ``<!-- PLAN:begin/end -->`` markers."""
    if plan not in REPORTS:
        raise ValueError(f"plan must be one of {sorted(REPORTS)}, got {plan!r}")
    rows = REPORTS[plan].rows
    record = Path(docs) / REPORTS[plan].record
    runs = {r["name"]: r for r in (json.loads(record.read_text(encoding="utf-8")) if record.is_file() else [])}
    runs.update({r["name"]: r for r in load_results(out)})
    if not runs:
        raise FileNotFoundError(f"{out}: no */result.json yet and nothing recorded in {record}")
    unknown = sorted(name for name, r in runs.items() if r["row"] not in rows)
    if unknown:
        raise ValueError(f"{out}: {unknown} are not runs of the {plan} plan (rows {list(rows)})")
    page = Path(docs) / "results.md"
    begin, end = f"<!-- {plan}:begin -->", f"<!-- {plan}:end -->"
    text = page.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise ValueError(f"{page}: the markers {begin} and {end} are missing")
    table_text = rows_table(list(runs.values()), plan)
    head, rest = text.split(begin, 1)
    write_json_atomic(record, [portable(runs[name]) for name in sorted(runs)])
    write_text_atomic(page, f"{head}{begin}\n{table_text}\n{end}{rest.split(end, 1)[1]}")
    print(table_text)


if __name__ == "__main__":
    run_fire(
        {
            "run": run,
            "select": select,
            "common": common,
            "template_rules": template_rules,
            "report": report,
            "report_plan": report_plan,
        }
    )
