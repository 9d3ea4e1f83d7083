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

The command line of the ablation; its jobs live in their own modules. ``run``
(:mod:`~scripts.experiments.ablation_runs`) trains and evaluates every run of a plan
(:mod:`~scripts.experiments.ablation_plans`: :func:`plan`, :func:`plan_converged`, :func:`plan_comparison`) in turn
with the bundle's own commands, the same budget for all, and writes ``OUT/<run>/result.json`` (settings, validation
and test metrics, training time, peak memory); a run whose ``result.json`` exists is skipped, so an interrupted plan
continues where it stopped. ``augmentation`` is a path pattern with ``{alpha}``: the per-group intensities that
``python -m scripts.estimate_augmentation --alpha_hat ALPHA`` wrote. ``select``, ``common`` and ``template_rules``
(:mod:`~scripts.experiments.ablation_selection`) score each finished run on the labelled images outside the test split
(the ranking that chooses the shipped model), score every run with the same templates, and compare the template rules
of the evaluation on one run, without test images. ``report`` (:mod:`~scripts.experiments.ablation_docs`, its tables
from :mod:`~scripts.experiments.ablation_tables`) reads the results and writes the tables (``docs/results.md``
between its ``<!-- ablation:begin/end -->`` markers) and the MRE bar plot. ``--plan converged`` runs the ablation at
a length that converges, ``--plan comparison`` the paper's comparison with view-mixing methods on the same network;
``report_plan`` keeps every finished run of either in ``docs/results_ablation_converged.json`` /
``docs/results_comparison.json`` (run folders may not survive a session) and writes its table between the plan's
``<!-- converged:begin/end -->`` / ``<!-- comparison:begin/end -->`` markers.
"""

from __future__ import annotations

from scripts.cli import run_fire
from scripts.experiments.ablation_docs import report, report_plan
from scripts.experiments.ablation_runs import run
from scripts.experiments.ablation_selection import common, select, template_rules

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
