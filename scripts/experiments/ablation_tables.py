"""The ablation's results read back and laid out as markdown tables: the rows over seeds, the sweeps, the longer
runs, the converged and comparison plans, and how well the scores without test images rank the runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
from bundle.metrics import GROSS_ERROR_MM
from bundle.reporting import read_predictions_csv
from scripts.experiments.ablation_plans import (
    ALPHAS,
    COMPARISON_ROWS,
    CONVERGED_ROWS,
    DEFAULT_ALPHA,
    DEFAULT_GAMMA,
    GAMMAS,
    ROW_TITLES,
    ROWS,
    load_augmentation,
    sweep_run,
)


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
            r = sweep_run(by_name, kind, v, first)
            if r is None:
                continue
            extra = []
            if kind == "alpha":
                aug = load_augmentation(r["augmentation_file"])
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
