"""The ablation's plans: the paper's rows (Quan et al. CVPR 2023, Table 3), the converged rows, the comparison with
view-mixing methods, and the gamma / alpha_hat sweeps, as the runs :mod:`scripts.experiments.ablation_runs` trains."""

from __future__ import annotations

from pathlib import Path

import yaml

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
COMPARISON_ROWS = {  # row: the training's `mixing` (ablation_runs.COMPARISON_CONFIG)
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


PLANS = {"sweep": plan, "converged": plan_converged, "comparison": plan_comparison}


def load_augmentation(path: str) -> dict:
    """The ``augmentation`` section of an intensities file (``python -m scripts.estimate_augmentation``)."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))["augmentation"]


def sweep_run(results: dict, kind: str, value: float, seed: int) -> dict | None:
    """The seed's run of the gamma sweep (fixed augmentation) or of the alpha_hat sweep (full method) at ``value``."""
    if kind == "gamma":
        name = {0.0: "baseline", DEFAULT_GAMMA: "entropy"}.get(value, f"gamma{value}")
    else:
        name = "full" if value == DEFAULT_ALPHA else f"alpha{value}"
    return results.get(f"{name}_s{seed}")
