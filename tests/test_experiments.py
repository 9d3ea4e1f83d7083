"""The ablation driver (scripts/experiments/ablation*.py), the k-shot study, the results figures
(scripts/experiments/results_figures.py), the self-training datalists (scripts/experiments/self_training.py) and the
landmark offsets carried from one image set to another (scripts/experiments/landmark_offsets.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from bundle.configs import config_files
from bundle.information_groups import information_groups
from bundle.transforms.entropy import local_entropy
from PIL import Image
from scripts.bundle_commands import CommandRun, run_command
from scripts.experiments import ablation_docs, ablation_plans, ablation_runs, ablation_selection, results_figures


def test_plan_covers_rows_seeds_and_sweeps_once():
    runs = ablation_plans.plan([0, 1])
    names = [r["name"] for r in runs]
    assert len(names) == len(set(names)) == 4 * 2 + 2 + 3
    assert {(r["entropy_sampling"], r["adaptive_augmentation"]) for r in runs if r["name"].startswith("baseline")} == {
        (False, False)
    }
    # every sweep value has exactly one run for the first seed, shared points included
    runs_by_name = {r["name"]: r for r in runs}
    for kind, values in (("gamma", ablation_plans.GAMMAS), ("alpha", ablation_plans.ALPHAS)):
        picked = [ablation_plans.sweep_run(runs_by_name, kind, v, 0) for v in values]
        assert all(p is not None for p in picked)
        key = "alpha_hat" if kind == "alpha" else "gamma"
        effective = [p[key] if p["entropy_sampling"] or kind == "alpha" else 0.0 for p in picked]
        assert effective == list(values)
        assert {p["adaptive_augmentation"] for p in picked} == {kind == "alpha"}  # gamma: fixed augmentation


def fake_result(out: Path, spec: dict, mre: float, aug_file: Path) -> None:
    sdr = {t: 100.0 - 10 * mre for t in ("2.0", "2.5", "3.0", "4.0")}
    result = dict(
        spec,
        iterations=500,
        augmentation_file=str(aug_file),
        validation_mre_mm=mre + 0.5,
        template_rule="features",
        test={"mre_mm": mre, "mre_px": mre / 0.12, "sdr": sdr},
    )
    (out / spec["name"]).mkdir(parents=True)
    (out / spec["name"] / "result.json").write_text(json.dumps(result))


def test_report_tables_spread_gain_and_markers(tmp_path):
    aug = tmp_path / "aug.yaml"
    aug.write_text("augmentation:\n  brightness: [0.1, 0.2, 0.3]\n  contrast: [0.4, 0.5, 0.6]\n")
    mre = {
        "baseline_s0": 4.0,
        "baseline_s1": 3.0,
        "full_s0": 2.8,
        "full_s1": 2.4,
        "entropy_s0": 3.3,
        "alpha1.7_s0": 2.2,
        "gamma1.0_s0": 3.9,
    }
    for spec in ablation_plans.plan([0, 1]):
        if spec["name"] in mre:
            fake_result(tmp_path / "runs", spec, mre[spec["name"]], aug)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("intro\n<!-- ablation:begin -->\nold\n<!-- ablation:end -->\noutro\n")
    ablation_docs.report(str(tmp_path / "runs"), str(docs))
    page = (docs / "results.md").read_text()
    assert page.startswith("intro\n<!-- ablation:begin -->\n") and page.endswith("<!-- ablation:end -->\noutro\n")
    assert "old" not in page
    baseline_line = next(line for line in page.splitlines() if line.startswith("| baseline"))
    assert "3.50 ± 0.71" in baseline_line and "4.00 / 3.00" in baseline_line
    full_line = next(line for line in page.splitlines() if line.startswith("| + both"))
    assert "2.60 ± 0.28" in full_line and "+25.7 %" in full_line  # (3.5 - 2.6) / 3.5
    alpha_line = next(line for line in page.splitlines() if line.startswith("| 1.7 |"))
    assert "0.10 / 0.20 / 0.30" in alpha_line and "2.70" in alpha_line and "2.20" in alpha_line
    assert (
        "validation MRE (validation images, the datalist's first labelled item as template): "
        "Spearman's rho with the test MRE +1.00 over 7 runs" in page
    )
    assert "selection MRE (" not in page  # no run was scored on the selection images
    assert (docs / "results_mre.png").stat().st_size > 10_000
    (docs / "results.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        ablation_docs.report(str(tmp_path / "runs"), str(docs))
    with pytest.raises(FileNotFoundError, match="no \\*/result.json"):
        ablation_docs.report(str(tmp_path / "empty"), str(docs))


def test_report_adds_the_longer_runs_beside_their_short_runs(tmp_path):
    aug = tmp_path / "aug.yaml"
    aug.write_text("augmentation:\n  brightness: [0.1, 0.2, 0.3]\n  contrast: [0.4, 0.5, 0.6]\n")
    specs = {s["name"]: s for s in ablation_plans.plan([0])}
    for name, mre in (("baseline_s0", 4.0), ("full_s0", 5.0)):
        fake_result(tmp_path / "short", specs[name], mre, aug)
    for name, mre in (("baseline_s0", 2.5), ("full_s0", 2.0), ("alpha1.0_s0", 3.0)):
        fake_result(tmp_path / "long", specs[name], mre, aug)
        result = json.loads((tmp_path / "long" / name / "result.json").read_text())
        if name == "baseline_s0":  # also evaluated with the label-free template
            result["test_features_rule"] = dict(result["test"], mre_mm=2.9)
        (tmp_path / "long" / name / "result.json").write_text(
            json.dumps(dict(result, iterations=3000, template_rule="landmarks"))
        )
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("<!-- ablation:begin -->\n<!-- ablation:end -->\n")
    ablation_docs.report(str(tmp_path / "short"), str(docs), long=str(tmp_path / "long"))
    page = (docs / "results.md").read_text()
    assert "trained for 3000 iterations" in page
    full_line = [line for line in page.splitlines() if line.startswith("| + both")][-1]
    assert (
        "| 0 | 3000 | landmarks | 5.00 (500, features) | - | 2.00 |" in full_line and "+20.0 %" in full_line
    )  # (2.5 - 2.0) / 2.5
    baseline_line = [line for line in page.splitlines() if line.startswith("| baseline")][-1]
    assert "| 0 | 3000 | landmarks | 4.00 (500, features) | 2.90 | 2.50 |" in baseline_line
    sweep_line = next(line for line in page.splitlines() if line.startswith("| + both (full method), alpha_hat 1 |"))
    assert (
        "| 0 | 3000 | landmarks | - | - | 3.00 |" in sweep_line and "-20.0 %" in sweep_line
    )  # no short run of it here
    with pytest.raises(FileNotFoundError, match="missing"):
        ablation_docs.report(str(tmp_path / "short"), str(docs), long=str(tmp_path / "missing"))


def test_converged_plan_differs_only_in_what_each_row_names():
    runs = {r["name"]: r for r in ablation_plans.plan_converged([0, 1])}
    assert len(runs) == 10 and {r["seed"] for r in runs.values()} == {0, 1}
    estimated, authors = runs["full_estimated_s1"], runs["full_authors_s1"]
    assert authors["augmentation_file"] == "configs/authors_ranges.yaml" and estimated["augmentation_file"] is None
    assert {k: v for k, v in estimated.items() if k not in ("name", "row", "augmentation_file")} == {
        k: v for k, v in authors.items() if k not in ("name", "row", "augmentation_file")
    }
    assert estimated["group_mode"] == "query" and runs["entropy_s0"]["group_mode"] is None
    pixel = runs["full_pixel_s1"]
    assert {k for k in estimated if estimated[k] != pixel[k]} == {"name", "row", "group_mode"}
    assert pixel["group_mode"] == "pixel"
    assert (runs["baseline_s0"]["entropy_sampling"], runs["baseline_s0"]["adaptive_augmentation"]) == (False, False)
    with pytest.raises(ValueError, match="plan must be one of"):
        ablation_runs.run("d.json", str(Path("unused")), plan="long")


def test_converged_report_keeps_earlier_runs_and_gives_both_gains(tmp_path):
    specs = {s["name"]: s for s in ablation_plans.plan_converged([0, 1])}
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("a\n<!-- converged:begin -->\nold\n<!-- converged:end -->\nb\n")
    for name, mre in (("baseline_s0", 3.0), ("entropy_s0", 2.5)):  # a first session
        fake_result(tmp_path / "first", specs[name], mre, tmp_path / "aug.yaml")
    ablation_docs.report_plan(str(tmp_path / "first"), "converged", str(docs))
    for name, mre in (("full_estimated_s0", 2.0), ("baseline_s1", 4.0), ("entropy_s0", 2.4)):  # the next one, a rerun
        fake_result(tmp_path / "next", specs[name], mre, tmp_path / "aug.yaml")
    ablation_docs.report_plan(str(tmp_path / "next"), "converged", str(docs))
    recorded = {
        r["name"]: r["test"]["mre_mm"] for r in json.loads((docs / "results_ablation_converged.json").read_text())
    }
    assert recorded == {"baseline_s0": 3.0, "entropy_s0": 2.4, "full_estimated_s0": 2.0, "baseline_s1": 4.0}
    page = (docs / "results.md").read_text()
    assert (
        page.startswith("a\n<!-- converged:begin -->\n")
        and page.endswith("<!-- converged:end -->\nb\n")
        and "old" not in page
    )
    baseline = next(line for line in page.splitlines() if line.startswith("| baseline"))
    assert "| 0 / 1 | 3.50 ± 0.71 | 3.00 / 4.00 |" in baseline
    full = next(line for line in page.splitlines() if line.startswith("| + both, factor ranges of the paper"))
    # gains over the seeds both rows have: seed 0 only, (3.0 - 2.0) / 3.0 and (2.4 - 2.0) / 2.4
    assert full.endswith("| +33.3 % (1 seed) | +16.7 % (1 seed) |")
    assert not any(line.startswith("| + both, the authors'") for line in page.splitlines())  # not run yet
    fake_result(tmp_path / "sweep", ablation_plans.plan([0])[3], 2.0, tmp_path / "aug.yaml")
    with pytest.raises(ValueError, match="not runs of the converged plan"):
        ablation_docs.report_plan(str(tmp_path / "sweep"), "converged", str(docs))


def test_comparison_report_puts_the_papers_numbers_beside_each_row(tmp_path):
    specs = {s["name"]: s for s in ablation_plans.plan_comparison([0, 1])}
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("<!-- converged:begin -->\nkept\n<!-- converged:end -->\n")
    for name, mre in (("baseline_s0", 3.0), ("mochi_s0", 2.7)):
        fake_result(tmp_path / "runs", specs[name], mre, tmp_path / "aug.yaml")
    result_file = tmp_path / "runs" / "mochi_s0" / "result.json"
    result = json.loads(result_file.read_text())
    result["test"]["template"] = "../data/ceph/images/033.png"
    result["common"] = {"mre_mm": 2.1, "template": "/abs/ceph/001.png", "templates": ["/abs/ceph/001.png", "b/2.png"]}
    result_file.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="comparison:begin"):
        ablation_docs.report_plan(str(tmp_path / "runs"), "comparison", str(docs))
    (docs / "results.md").write_text("x\n<!-- comparison:begin -->\n<!-- comparison:end -->\n")
    ablation_docs.report_plan(str(tmp_path / "runs"), "comparison", str(docs))
    page = (docs / "results.md").read_text()
    mochi = next(line for line in page.splitlines() if line.startswith("| MoCHi"))
    assert mochi.endswith("| +10.0 % (1 seed) | 2.56 / 50.4 |")  # (3.0 - 2.7) / 3.0, the paper's row beside
    assert "| baseline (uniform sampling, high-group estimated intensities everywhere) | 0 |" in page
    assert "The paper's own method scored 2.34 mm / 51.3 %" in page
    recorded = json.loads((docs / "results_comparison.json").read_text())
    assert [r["name"] for r in recorded] == ["baseline_s0", "mochi_s0"]
    # the record names template images by file name, not by where this machine keeps them
    assert recorded[1]["test"]["template"] == "033.png" and recorded[1]["test"]["mre_mm"] == 2.7
    assert recorded[1]["common"] == {"mre_mm": 2.1, "template": "001.png", "templates": ["001.png", "2.png"]}
    with pytest.raises(ValueError, match="not runs of the converged plan"):
        ablation_docs.report_plan(str(tmp_path / "runs"), "converged", str(docs))


def item(name: str, labelled: bool) -> dict:
    """A datalist item ``img/NAME.png``, with one landmark when ``labelled``."""
    return dict(image=f"img/{name}.png", **({"landmarks": [[1.0, 2.0]]} if labelled else {}))


def small_datalist(training: list[dict], test: list[dict], **extra) -> dict:
    """A one-landmark 2D datalist of ``training`` and ``test`` items, one labelled validation item ``v0``."""
    return dict(
        name="d",
        spatial_dims=2,
        landmark_names=["a"],
        training=training,
        validation=[item("v0", True)],
        test=test,
        **extra,
    )


def test_selection_datalist_scores_on_labelled_items_outside_test(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    training = [item("t0", True), item("u0", False), item("t1", True), item("t2", True)]
    datalist = small_datalist(training, [item("x0", True)])
    chosen = ablation_selection.selection_datalist(datalist, "img/../img/t1.png")
    assert chosen["template"]["image"] == str(tmp_path / "img" / "t1.png")
    assert [Path(it["image"]).name for it in chosen["test"]] == ["v0.png", "t0.png", "t2.png"]  # never x0, never t1
    assert all(Path(it["image"]).is_absolute() for it in chosen["training"] + chosen["test"])
    with pytest.raises(ValueError, match="u0.png is not a labelled training item"):
        ablation_selection.selection_datalist(datalist, "img/u0.png")


def test_few_labels_draws_templates_from_the_pool_and_scores_outside_it(tmp_path, monkeypatch):
    from bundle.data.datalist import save_datalist
    from scripts.experiments import kshot_study

    monkeypatch.chdir(tmp_path)
    training = [item(f"t{i}", True) for i in range(5)] + [item("u0", False), item("t5", True)]
    path = save_datalist(small_datalist(training, [item("x0", True)]), tmp_path / "d.json")
    (tmp_path / "img").mkdir()
    for name in ["v0", "x0", "u0"] + [f"t{i}" for i in range(6)]:
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "img" / f"{name}.png")
    runs = []

    def evaluate(study, out, ckpt_path, **settings):
        runs.append((study, out.name, settings))
        return {"mre_mm": 1.0}

    monkeypatch.setattr(kshot_study, "_evaluate", evaluate)
    results = kshot_study.few_labels(str(path), counts=[2], seeds=[0], named=[["t3"]], pseudo=[0, 3], pool=4, out="o")
    assert [name for _, name, _ in runs] == ["t3_m0", "t3_m3", "k2_s0_m0", "k2_s0_m3"]
    pool = {f"t{i}.png" for i in range(4)}
    for study, name, settings in runs:
        templates = {Path(it["image"]).name for it in study["templates"]}
        candidates = {Path(it["image"]).name for it in study["training"]}
        assert all("landmarks" not in it for it in study["training"])
        # scored: the labelled training items outside the pool and the validation split, never the test split
        assert {Path(it["image"]).name for it in study["test"]} == {"t4.png", "t5.png", "v0.png"}
        assert candidates == pool - templates and len(templates) == (1 if name.startswith("t3") else 2)
        assert settings == dict(
            pseudo_candidates=len(candidates), pseudo_templates=int(name[-1]), pseudo_max_labelled=len(templates)
        )
    assert runs[2][0]["templates"] == runs[3][0]["templates"] and len(results) == 4
    assert json.loads((tmp_path / "o" / "few_labels.json").read_text())[0]["labelled"] == ["t3"]


def test_template_rules_score_both_choices_outside_the_pool(tmp_path):
    import torch
    from bundle.configs import bundle_parser
    from bundle.data.synthetic import generate_synthetic_2d

    datalist = Path(generate_synthetic_2d(tmp_path / "data", n_training=5, n_validation=1, n_test=1, seed=2))
    network = bundle_parser(["configs/train.yaml"], datalist=str(datalist)).get_parsed_content("network_def")
    (tmp_path / "run" / "models").mkdir(parents=True)
    torch.save(network.state_dict(), tmp_path / "run" / "models" / "model.pt")
    result = ablation_selection.template_rules(str(datalist), str(tmp_path / "run"), pool_size=3)
    pool = [it["image"] for it in json.loads(datalist.read_text())["training"][:3]]
    assert result["n_pool"] == 3 and result["n_held_out"] == 2 + 1  # two more labelled training items, one validation
    for rule in ("features", "landmarks"):
        assert Path(result[rule]["template"]).name in {Path(p).name for p in pool}
        assert 0.0 < result[rule]["held_out_mre_mm"] < 200.0
    assert json.loads((tmp_path / "run" / "template_rules.json").read_text()) == result


def test_a_failing_bundle_command_names_its_log(tmp_path):
    log = tmp_path / "train.log"
    with pytest.raises(RuntimeError, match="train.log"):
        run_command("training", config_files("train"), {"datalist": tmp_path / "absent.json"}, log)
    assert "absent.json" in log.read_text()


def test_missing_augmentation_estimate_is_named(tmp_path):
    spec = ablation_plans.plan([0])[0]
    with pytest.raises(FileNotFoundError, match="scripts.estimate_augmentation --alpha_hat 0.8"):
        ablation_runs.run_one(spec, "d.json", tmp_path, 10, 10, str(tmp_path / "aug_{alpha}.yaml"))


def write_png(path: Path, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = np.zeros((60, 80), dtype=np.uint8)  # rows, columns
    img[:, 40:] = 200
    img[20:40, 10:30] = rng.integers(0, 255, (20, 20))
    Image.fromarray(img).save(path)
    return img


def test_iie_figure_reports_the_group_shares(tmp_path, capsys):
    img = write_png(tmp_path / "a.png", 0)
    out = results_figures.iie(str(tmp_path / "a.png"), str(tmp_path / "iie.png"), window=5, width=40)
    assert out.stat().st_size > 5_000
    groups = information_groups(local_entropy(img.astype(np.float64) / 255.0, 5).numpy())
    expected = " / ".join(f"{100 * np.mean(groups == g):.1f}" for g in range(3))
    assert expected in capsys.readouterr().out


def test_overlays_pick_the_median_and_the_worst_image(tmp_path):
    items = []
    for i in range(3):
        write_png(tmp_path / f"{i}.png", i)
        items.append({"image": f"{i}.png", "landmarks": [[10.0, 10.0], [50.0, 30.0]], "spacing": [0.5, 0.5]})
    dl = {"name": "t", "spatial_dims": 2, "landmark_names": ["a", "b"], "training": [], "validation": [], "test": items}
    (tmp_path / "dl.json").write_text(json.dumps(dl))
    (tmp_path / "eval").mkdir()
    with open(tmp_path / "eval" / "predictions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "landmark", "x", "y", "error_mm"])
        for i, err in enumerate((1.0, 5.0, 3.0)):
            w.writerow([str(tmp_path / f"{i}.png"), "a", 12.0, 10.0, err])
            w.writerow([str(tmp_path / f"{i}.png"), "b", 50.0, 30.0, ""])
    written = results_figures.overlays(
        str(tmp_path / "dl.json"), str(tmp_path / "eval"), str(tmp_path / "docs"), width=40
    )
    assert [p.name for p in written] == ["results_overlay_2.png", "results_overlay_1.png"]
    assert all(p.stat().st_size > 2_000 for p in written)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "predictions.csv").write_text("image,landmark,x,y,error_mm\n/x/other.png,a,1,1,2.0\n")
    with pytest.raises(ValueError, match="none of the test images"):
        results_figures.overlays(str(tmp_path / "dl.json"), str(tmp_path / "other"), str(tmp_path / "docs"))


def test_comparison_plan_differs_only_in_mixing():
    runs = ablation_plans.plan_comparison([0, 1])
    assert [r["name"] for r in runs[:4]] == ["baseline_s0", "unmix_s0", "mochi_s0", "zhu_s0"] and len(runs) == 8
    assert [r["mixing"] for r in runs[:4]] == ["none", "unmix", "mochi", "zhu"]
    for seed in (0, 1):
        settings = [
            {k: v for k, v in r.items() if k not in ("name", "row", "mixing")} for r in runs if r["seed"] == seed
        ]
        assert all(s == settings[0] for s in settings)
        assert settings[0]["entropy_sampling"] is False and settings[0]["gamma"] == 0.0
        assert settings[0]["adaptive_augmentation"] and settings[0]["high_group_everywhere"]


def test_high_group_overrides_take_the_high_group_for_every_group():
    ranges = {"brightness_ranges": [[0.7, 1.5], [0.7, 1.5], [0.65, 1.63]], "contrast_ranges": [[1, 2], [1, 2], [3, 4]]}
    assert ablation_runs.high_group_overrides(ranges) == {
        "augmentation#brightness_ranges": [[0.65, 1.63]] * 3,
        "augmentation#contrast_ranges": [[3, 4]] * 3,
    }
    symmetric = {"brightness": [0.1, 0.2, 0.3], "contrast": [0.4, 0.5, 0.6], "brightness_ranges": None}
    assert ablation_runs.high_group_overrides(symmetric) == {
        "augmentation#brightness": [0.3] * 3,
        "augmentation#contrast": [0.6] * 3,
    }
    with pytest.raises(ValueError, match="contrast"):
        ablation_runs.high_group_overrides({"brightness": [0.1, 0.2, 0.3]})


def test_run_one_passes_the_mixing_and_the_high_group_augmentation(tmp_path, monkeypatch):
    aug = tmp_path / "aug.yaml"
    aug.write_text(
        "augmentation:\n  brightness_ranges: [[1, 2], [1, 2], [0.5, 1.5]]\n"
        "  contrast_ranges: [[1, 2], [1, 2], [0.6, 1.6]]\n"
    )
    calls = {}

    def fake_run_command(command, configs, overrides, log, append=False):
        calls[command] = dict(overrides, append=append, configs=configs)
        return CommandRun({"val_mre_mm": 2.5} if command == "training" else {"mre_mm": 2.0}, 1.0, 1.0)

    monkeypatch.setattr(ablation_runs, "run_command", fake_run_command)
    spec = next(r for r in ablation_plans.plan_comparison([0]) if r["row"] == "mochi")
    result = ablation_runs.run_one(spec, "d.json", tmp_path / "out", 20, 10, str(aug))
    train = calls["training"]
    assert train["mixing"] == "mochi" and train["entropy_sampling"] is False and train["sampling_gamma"] == 0.0
    assert train["configs"] == [*config_files("train"), ablation_runs.COMPARISON_CONFIG, str(aug)]
    assert train["augmentation#brightness_ranges"] == [[0.5, 1.5]] * 3
    assert train["augmentation#contrast_ranges"] == [[0.6, 1.6]] * 3
    assert result["mixing"] == "mochi" and result["validation_mre_mm"] == 2.5
    assert "resume" not in train and not train["append"] and result["resumed"] is False
    # a run that a stopped session interrupted after an epoch: resumed from its last.pt, its log kept
    (tmp_path / "out" / spec["name"] / "models").mkdir(parents=True, exist_ok=True)
    (tmp_path / "out" / spec["name"] / "models" / "last.pt").write_bytes(b"x")
    result = ablation_runs.run_one(spec, "d.json", tmp_path / "out", 20, 10, str(aug))
    assert calls["training"]["resume"] is True and calls["training"]["append"] and result["resumed"] is True


def test_common_templates_are_the_first_labelled_training_items_for_every_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    training = [item("u0", False), item("t0", True), item("t1", True), item("t2", True)]
    datalist = small_datalist(training, [item("x0", True), item("x1", True)], template=item("t2", True))
    common = ablation_selection.common_datalist(datalist, 2)
    assert [Path(it["image"]).name for it in common["templates"]] == ["t0.png", "t1.png"]
    assert "template" not in common  # the named template would be one more
    assert [Path(it["image"]).name for it in common["test"]] == ["x0.png", "x1.png"]
    assert all(Path(it["image"]).is_absolute() for it in common["templates"] + common["test"])
    with pytest.raises(ValueError, match="4 common templates asked for, the datalist has 3 labelled"):
        ablation_selection.common_datalist(datalist, 4)
    for k in (0, "2"):  # no template would let each run choose its own again
        with pytest.raises(ValueError, match="must be a positive integer"):
            ablation_selection.common_datalist(datalist, k)


def test_converged_report_gives_the_common_template_mre_where_every_seed_has_it(tmp_path):
    specs = {s["name"]: s for s in ablation_plans.plan_converged([0, 1])}
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("<!-- converged:begin -->\n<!-- converged:end -->\n")
    for name, mre in (("baseline_s0", 3.0), ("baseline_s1", 3.2), ("entropy_s0", 2.5)):
        fake_result(tmp_path / "runs", specs[name], mre, tmp_path / "aug.yaml")
    for name, common in (("baseline_s0", 2.0), ("baseline_s1", 2.2)):
        path = tmp_path / "runs" / name / "result.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), common_mre_mm=common)))
    ablation_docs.report_plan(str(tmp_path / "runs"), "converged", str(docs))
    lines = (docs / "results.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| row |"))
    assert "| MRE mm, the same templates for every run (ablation.py common) |" in header
    baseline = next(line for line in lines if line.startswith("| baseline"))
    entropy = next(line for line in lines if line.startswith("| + entropy"))
    assert baseline.endswith("| 2.10 |  | -20.0 % (1 seed) |") and "| - |" in entropy
    assert "selection MRE" not in header  # the run's own template on images its choice read: no column here


def test_self_training_datalists_predict_the_unlabelled_images_then_carry_their_predictions(tmp_path):
    """``pool`` asks for the unlabelled training images as test items; ``labelled`` puts their predictions in the
    datalist's order and refuses an image a landmark was not predicted on, naming it."""
    from estimation_data import write_png_datalist
    from scripts.experiments import self_training

    datalist = write_png_datalist(tmp_path, n_images=4, labelled=False)  # 000.png labelled alone
    pool = json.loads(Path(self_training.pool(str(datalist), str(tmp_path / "pool.json"))).read_text())
    assert [Path(it["image"]).name for it in pool["training"]] == ["000.png"]
    assert [Path(it["image"]).name for it in pool["test"]] == ["001.png", "002.png", "003.png"]
    rows = [
        {"image": it["image"], "landmark": name, "x": 10.0 * i + j, "y": 1.5, "error_mm": ""}
        for i, it in enumerate(pool["test"], 1)
        for j, name in enumerate(pool["landmark_names"])
    ]
    predictions = tmp_path / "predictions.csv"
    with open(predictions, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out = self_training.labelled(str(datalist), str(predictions), str(tmp_path / "self.json"))
    items = json.loads(Path(out).read_text())["training"]
    own = json.loads(datalist.read_text())["training"][0]["landmarks"]
    assert [Path(it["image"]).name for it in items] == ["000.png", "001.png", "002.png", "003.png"]
    assert items[0]["landmarks"] == own and items[2]["landmarks"] == [[20.0, 1.5], [21.0, 1.5], [22.0, 1.5]]
    with open(predictions, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:-1])  # 003.png's last landmark missing
    with pytest.raises(ValueError, match=r"no prediction of \['c'\] on .*003.png"):
        self_training.labelled(str(datalist), str(predictions), str(tmp_path / "self2.json"))


def test_landmark_offsets_carries_a_calibration_sets_offsets_to_the_test_predictions(tmp_path):
    """Predictions off by a constant shift of one landmark: the calibration's offsets take all the error away, the
    cosine says the two sets' offsets agree, and a landmark without a calibration offset is named."""
    from bundle.data.datalist import load_datalist
    from scripts.experiments import landmark_offsets

    datalist = write_png_datalist_with_test(tmp_path)
    data = load_datalist(datalist)  # the images' paths as the evaluating run writes them
    shift_px = {"a": [2.0, 0.0], "b": [0.0, 0.0], "c": [0.0, 0.0]}
    rows = [
        {"image": it["image"], "landmark": name, "x": x + shift_px[name][0], "y": y + shift_px[name][1], "error_mm": ""}
        for it in data["test"]
        for name, (x, y) in zip(data["landmark_names"], it["landmarks"])
    ]
    predictions = tmp_path / "predictions.csv"
    with open(predictions, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    calibration = tmp_path / "metrics.json"
    calibration.write_text(json.dumps({"per_landmark_offset_mm": {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [0.0, 0.0]}}))
    result = landmark_offsets.main(str(datalist), str(calibration), str(predictions))
    assert result["as predicted"]["mre_mm"] == pytest.approx(1.0 / 3, abs=1e-3)  # 2 px of 0.5 mm on a third
    assert result["calibration offsets removed"]["mre_mm"] == pytest.approx(0.0, abs=1e-3)
    assert result["own offsets removed (mre_offset_removed_mm)"] == pytest.approx(0.0, abs=1e-3)
    assert result["cosine of the two sets' offsets"] == {"a": 1.0, "b": None, "c": None}
    calibration.write_text(json.dumps({"per_landmark_offset_mm": {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": None}}))
    with pytest.raises(ValueError, match=r"metrics.json: no per_landmark_offset_mm for \['c'\]"):
        landmark_offsets.main(str(datalist), str(calibration), str(predictions))


def write_png_datalist_with_test(tmp_path: Path) -> Path:
    """:func:`estimation_data.write_png_datalist`'s images, the last three the labelled test items (0.5 mm pixels)."""
    from estimation_data import write_png_datalist

    path = write_png_datalist(tmp_path)
    data = json.loads(path.read_text())
    data["training"], test = data["training"][:1], data["training"][1:]
    data["test"] = [{**item, "spacing": [0.5, 0.5]} for item in test]
    path.write_text(json.dumps(data))
    return path
