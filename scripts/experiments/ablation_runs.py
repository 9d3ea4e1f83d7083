"""Running the ablation's plans: each planned run trained and evaluated with the bundle's own commands, its
``OUT/<run>/result.json`` written; a run whose result exists is skipped, an interrupted one resumed."""

from __future__ import annotations

from pathlib import Path

from bundle.configs import config_files
from bundle.io_utils import write_json_atomic
from scripts.bundle_commands import run_command
from scripts.experiments.ablation_plans import PLANS, load_augmentation

# the comparison methods' keys (mixing, mochi_*, zhu_*, unmix_*): merged after configs/train.yaml where a run sets them
COMPARISON_CONFIG = "scripts/experiments/configs/comparison.yaml"


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
        overrides.update(high_group_overrides(load_augmentation(aug)))
    if spec.get("mixing"):
        overrides["mixing"] = spec["mixing"]
    # a run interrupted by a stopped session continues from its last epoch instead of starting again
    resumed = (run_dir / "models" / "last.pt").is_file()
    if resumed:
        overrides["resume"] = True
    configs = [*config_files("train"), *([COMPARISON_CONFIG] if spec.get("mixing") else []), aug]
    train = run_command("training", configs, overrides, run_dir / "train.log", append=resumed)
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
