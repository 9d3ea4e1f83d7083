"""The ablation's results written into the docs: the tables between the markers of ``docs/results.md``, the MRE
bar plot, and each plan's record of finished runs under ``docs/``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bundle.io_utils import write_json_atomic, write_text_atomic
from scripts.experiments.ablation_plans import ALPHAS, GAMMAS, ROWS, sweep_run
from scripts.experiments.ablation_tables import (
    REPORTS,
    length_table,
    load_results,
    rows_table,
    selector_agreement,
    tables,
)


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
        pts = [(v, sweep_run(by_name, kind, v, seeds[0] if seeds else 0)) for v in values]
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
