"""k-shot combination (bundle.kshot), datalist `templates`, and pseudo-template selection
(bundle.templates.pseudo_labels)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from bundle.data.datalist import DatalistError, load_datalist, save_datalist
from bundle.kshot import combine_landmarks, geometric_median, vote_weights
from bundle.templates import resolution
from bundle.templates.pseudo_labels import reliability, select_pseudo_templates
from bundle.templates.resolution import pseudo_template_pool, resolve_templates, template_items
from scipy.optimize import minimize


def test_geometric_median_matches_a_numerical_minimiser_of_summed_distances():
    rng = np.random.default_rng(0)
    for dims in (2, 3):
        points = rng.normal(size=(7, dims)) * [5.0] * dims
        points[0] += 200.0  # a gross outlier
        reference = minimize(
            lambda c: np.linalg.norm(points - c, axis=1).sum(),
            points.mean(0),
            method="Nelder-Mead",
            options={"xatol": 1e-9, "fatol": 1e-12, "maxiter": 20000},
        ).x
        ours = geometric_median(torch.as_tensor(points)[:, None]).numpy()[0]
        assert np.allclose(ours, reference, atol=1e-4)
        assert (
            np.linalg.norm(ours - points[1:].mean(0))
            < 10.0
            < 25.0
            < np.linalg.norm(points.mean(0) - points[1:].mean(0))
        )


def test_weighted_geometric_median_minimises_weighted_distances_and_equals_repeated_points():
    rng = np.random.default_rng(1)
    points = rng.normal(size=(6, 40, 2)) * 4.0
    points[0] += 60.0  # an outlier that the scores give little weight
    weights = rng.integers(1, 5, size=(6, 40)).astype(np.float64)
    weights[0] = 0.05
    ours = geometric_median(torch.as_tensor(points), torch.as_tensor(weights)).numpy()
    for j in (0, 7, 39):
        reference = minimize(
            lambda c: (weights[:, j] * np.linalg.norm(points[:, j] - c, axis=1)).sum(),
            points[:, j].mean(0),
            method="Nelder-Mead",
            options={"xatol": 1e-9, "fatol": 1e-12, "maxiter": 20000},
        ).x
        assert np.allclose(ours[j], reference, atol=1e-4)
    # integer weights: each point counted that many times
    integer = weights.copy()
    integer[0] = 1.0
    repeated = np.full((int(integer.sum(0).max()), 40, 2), np.nan)
    for j in range(40):
        rows = np.repeat(points[:, j], integer[:, j].astype(int), axis=0)
        repeated[: len(rows), j] = rows
    torch.testing.assert_close(
        geometric_median(torch.as_tensor(points), torch.as_tensor(integer)),
        geometric_median(torch.as_tensor(repeated)),
        rtol=0,
        atol=1e-7,
    )
    # weights 0 or NaN drop a vote; a landmark whose votes all weigh 0 counts them alike
    dropped = weights.copy()
    dropped[1] = 0.0
    dropped[2] = np.nan
    kept = points.copy()
    kept[1:3] = np.nan
    torch.testing.assert_close(
        geometric_median(torch.as_tensor(points), torch.as_tensor(dropped)),
        geometric_median(torch.as_tensor(kept), torch.as_tensor(weights)),
        rtol=0,
        atol=1e-9,
    )
    torch.testing.assert_close(
        geometric_median(torch.as_tensor(points), torch.zeros(6, 40)), geometric_median(torch.as_tensor(points))
    )


def test_vote_weights_sharpen_with_the_number_of_votes_and_the_rule_needs_scores():
    nan = float("nan")
    points = torch.tensor([[[0.0, 0.0], [1.0, 1.0]], [[9.0, 0.0], [nan, nan]], [[9.0, 0.0], [2.0, 2.0]]])
    scores = torch.tensor([[0.9, 0.5], [0.6, 0.3], [0.6, 0.8]], dtype=torch.float64)
    # landmark 0 has 3 votes (power 0.75), landmark 1 has 2 (power 0.5)
    expected = torch.stack([scores[:, 0] ** 0.75, scores[:, 1] ** 0.5], dim=1)
    torch.testing.assert_close(vote_weights(scores, points), expected)
    with pytest.raises(ValueError, match="one match score per prediction"):
        combine_landmarks(points, "weighted_geometric_median")
    # three votes: the two that agree outweigh the confident one (0.6 ** 0.75 = 0.68 each against 0.92)
    assert torch.allclose(combine_landmarks(points, "weighted_geometric_median", scores)[0], points[1, 0].double())
    # forty votes: 16 confident ones at (0, 0) outweigh 24 less confident ones at (9, 0) (power 10)
    many = torch.tensor([[[0.0, 0.0]]] * 16 + [[[9.0, 0.0]]] * 24, dtype=torch.float64)
    confident = torch.tensor([[0.95]] * 16 + [[0.8]] * 24, dtype=torch.float64)
    assert torch.allclose(combine_landmarks(many, "weighted_geometric_median", confident), many[0])
    assert torch.allclose(combine_landmarks(many, "geometric_median"), many[-1])


def test_geometric_median_on_a_tied_point_is_exact_and_scales_with_the_points():
    # three templates agree on a grid position, two others scatter: the median is the agreed point itself
    points = torch.tensor([[[4.0, 7.0]], [[4.0, 7.0]], [[4.0, 7.0]], [[9.0, 7.0]], [[4.0, 1.0]]], dtype=torch.float64)
    torch.testing.assert_close(
        geometric_median(points), torch.tensor([[4.0, 7.0]], dtype=torch.float64), rtol=0, atol=1e-12
    )
    # grid-quantised peaks with ties (what K templates give on a feature grid), in pixels and in mm
    g = torch.Generator().manual_seed(3)
    peaks = torch.randint(0, 6, (7, 200, 2), generator=g).to(torch.float64)
    for spacing in (0.1, 0.12, 2.5, 1000.0):
        torch.testing.assert_close(
            geometric_median(spacing * peaks) / spacing, geometric_median(peaks), rtol=0, atol=1e-8
        )
    # each result minimises the summed distances: no grid-neighbour offset of it does better
    median = geometric_median(peaks)
    cost = (peaks - median).norm(dim=-1).sum(0)
    for step in ([1e-3, 0.0], [0.0, 1e-3], [-1e-3, 0.0], [0.0, -1e-3]):
        assert ((peaks - (median + torch.tensor(step, dtype=torch.float64))).norm(dim=-1).sum(0) >= cost - 1e-12).all()


def test_combine_ignores_missing_votes_and_keeps_all_missing_landmarks_nan():
    nan = float("nan")
    p = torch.tensor(
        [
            [[0.0, 0.0], [nan, nan], [nan, nan]],
            [[2.0, 0.0], [5.0, 5.0], [nan, nan]],
            [[1.0, 9.0], [7.0, 5.0], [nan, nan]],
        ]
    )
    for rule in ("geometric_median", "median", "mean"):
        out = combine_landmarks(p, rule)
        assert out.shape == (3, 2) and torch.isnan(out[2]).all()
        assert out[1, 1] == 5.0 and 5.0 <= out[1, 0] <= 7.0  # two votes: any point between them is a median
        expected = {"geometric_median": [1.0, 3**-0.5], "median": [1.0, 0.0], "mean": [1.0, 3.0]}[rule]  # Fermat point
        assert torch.allclose(out[0], torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(combine_landmarks(p[:1]), p[0].double(), equal_nan=True)
    with pytest.raises(ValueError, match="rule"):
        combine_landmarks(p, "vote")


def test_datalist_templates_resolve_paths_and_refuse_a_template_without_landmarks(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    base = {
        "name": "t",
        "spatial_dims": 2,
        "landmark_names": ["p", "q"],
        "training": [{"image": "a.png"}, {"image": "b.png"}],
        "template": {"image": "a.png", "landmarks": [[1, 2], [3, 4]]},
        "templates": [
            {"image": "b.png", "landmarks": [[1, 2], None]},
            {"image": "a.png", "landmarks": [[1, 2], [3, 4]]},
        ],
    }
    path = tmp_path / "d.json"
    path.write_text(json.dumps(base))
    loaded = load_datalist(path)
    assert [t["image"] for t in template_items(loaded)] == [str(tmp_path / "b.png"), str(tmp_path / "a.png")]
    save_datalist(loaded, tmp_path / "copy.json")
    assert json.loads((tmp_path / "copy.json").read_text())["templates"][0]["image"] == "b.png"
    bad = dict(base, templates=[{"image": "b.png", "landmarks": [None, None]}])
    path.write_text(json.dumps(bad))
    with pytest.raises(DatalistError, match=r"templates\[0\].*not null"):
        load_datalist(path)


def test_pseudo_template_pool_leaves_out_templates_and_held_out_images():
    datalist = {
        "training": [{"image": f"{i}.png", "landmarks": [[1, 1]]} for i in range(6)],
        "validation": [{"image": "4.png"}],
        "test": [{"image": "5.png"}],
    }
    pool = pseudo_template_pool(datalist, [{"image": "0.png"}])
    assert [it["image"] for it in pool] == ["1.png", "2.png", "3.png"]
    assert all("landmarks" not in it for it in pool)


def test_select_pseudo_templates_ranks_by_closed_cycles_and_drops_unreliable_landmarks():
    def entry(name, errors):
        return {
            "item": {"image": name, "landmarks": [[float(i), 0.0] for i in range(len(errors))]},
            "cycle_error": np.array(errors),
        }

    labelled = [
        entry("bad", [9.0, 8.0, 0.5]),
        entry("good", [0.1, 0.2, 3.0]),
        entry("best", [0.1, 0.1, 0.1]),
        entry("tie", [0.5, 0.9, 3.0]),
    ]
    assert reliability(labelled[1], 2.0) > reliability(labelled[3], 2.0)  # same closed fraction, smaller median error
    chosen = select_pseudo_templates(labelled, keep=2, cycle_tolerance=2.0)
    assert [c["image"] for c in chosen] == ["best", "good"]
    assert chosen[1]["landmarks"] == [[0.0, 0.0], [1.0, 0.0], None]
    with pytest.raises(ValueError, match="keep"):
        select_pseudo_templates(labelled, keep=-1)


def test_pseudo_templates_are_added_only_to_few_labelled_templates_and_marked(monkeypatch):
    def datalist(n_labelled):
        labelled = [{"image": f"t{i}.png", "landmarks": [[1.0, 1.0]]} for i in range(n_labelled)]
        return {"templates": labelled, "training": [{"image": f"{i}.png"} for i in range(5)], "test": []}

    calls = []

    def fake_label(network, templates, items, preprocessing, device):
        calls.append(([t["image"] for t in templates], [it["image"] for it in items]))
        # the later an image in the pool, the more reliable it looks
        return [
            {"item": {**it, "landmarks": [[0.0, 0.0]]}, "cycle_error": np.array([10.0 - int(it["image"][0])])}
            for it in items
        ]

    monkeypatch.setattr(resolution, "with_templates", lambda inferer, items, *args: items)
    monkeypatch.setattr(resolution, "pseudo_label", fake_label)
    settings = dict(pseudo_candidates=4, pseudo_templates=2, cycle_tolerance=20.0, pseudo_max_labelled=2)
    chosen = resolve_templates(datalist(2), None, None, "cpu", **settings)
    assert [t["image"] for t in chosen] == ["t0.png", "t1.png", "3.png", "2.png"]
    assert [bool(t.get("pseudo_label")) for t in chosen] == [False, False, True, True]
    assert calls == [(["t0.png", "t1.png"], ["0.png", "1.png", "2.png", "3.png"])]
    # more labelled templates than pseudo_max_labelled: they alone, no matching
    assert [t["image"] for t in resolve_templates(datalist(3), None, None, "cpu", **settings)] == [
        "t0.png",
        "t1.png",
        "t2.png",
    ]
    assert len(calls) == 1
    # None: pseudo-templates at any number of labelled templates
    unbounded = resolve_templates(datalist(3), None, None, "cpu", **dict(settings, pseudo_max_labelled=None))
    assert len(unbounded) == 5 and len(calls) == 2
    for bad in (-1, 2.5, "null"):  # the command line's "null" reaches the config as text
        with pytest.raises(ValueError, match="pseudo_max_labelled: expected an integer >= 0"):
            resolve_templates(datalist(3), None, None, "cpu", **dict(settings, pseudo_max_labelled=bad))


def test_max_templates_takes_the_labelled_items_the_rule_ranks_best(tmp_path):
    """With no template named, ``max_templates`` > 1 makes the best-ranked labelled training items the templates
    (k-shot), in the rule's order: by the one-shot transfer errors that ``select_template_by_landmarks`` reports."""
    from bundle.configs import bundle_parser
    from bundle.data.synthetic import generate_synthetic_2d
    from bundle.geometry import grid_landmarks
    from bundle.templates.resolution import ranked_templates, resolve_template, resolve_templates
    from bundle.templates.selection import select_template_by_landmarks

    datalist_path = generate_synthetic_2d(tmp_path / "data")
    parser = bundle_parser(
        ["configs/train.yaml", "configs/evaluate.yaml"], datalist=str(datalist_path), output_dir=str(tmp_path / "o")
    )
    torch.manual_seed(0)
    network = parser.get_parsed_content("network").eval()
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    datalist = dict(parser.get_parsed_content("dataset"))
    datalist.pop("template")  # nothing named: the rule chooses
    datalist["training"] = datalist["training"][:6]
    three = resolve_templates(datalist, network, preprocessing, "cpu", max_templates=3)
    prepared = [preprocessing(dict(it)) for it in datalist["training"]]
    points, matrices = zip(*(grid_landmarks(d) for d in prepared))
    with torch.no_grad():
        _, errors = select_template_by_landmarks(
            network, [torch.as_tensor(d["image"]) for d in prepared], points, matrices
        )
    expected = [datalist["training"][i]["image"] for i in np.argsort(errors, kind="stable")[:3]]
    assert [t["image"] for t in three] == expected
    assert [t["image"] for t in ranked_templates(datalist, network, preprocessing, "cpu")][:3] == expected
    assert resolve_template(datalist, network, preprocessing, "cpu")["image"] == expected[0]
    assert [t["image"] for t in resolve_templates(datalist, network, preprocessing, "cpu")] == expected[:1]
    with pytest.raises(ValueError, match="max_templates must be >= 1, got 0"):
        resolve_templates(datalist, network, preprocessing, "cpu", max_templates=0)
