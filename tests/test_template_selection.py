"""Template selection (bundle/templates/selection.py) with the stand-in network of test_oneshot."""

from __future__ import annotations

import pytest
import torch
from bundle.templates.selection import (
    grid_points,
    landmark_transfer_errors,
    select_template,
    select_template_by_landmarks,
)
from test_oneshot import PatchDescriptorNet, crop, smooth_random_image

SHIFTS = [(0, 0), (3, 1), (-2, 3), (1, -3), (-3, -2)]  # image 0 is the "typical" one, the centre of the others


@pytest.fixture(scope="module")
def images():
    big = smooth_random_image((128, 128), seed=3)
    population = [crop(big, (16 + sx, 16 + sy), (96, 96))[0] for sx, sy in SHIFTS]
    population.append(smooth_random_image((96, 96), seed=9)[0])  # an outlier: unrelated texture
    return population


def test_grid_points_cover_the_interior():
    pts = grid_points((50, 100), 16, margin=0.1)
    assert pts.shape == (16, 2)
    assert pts[:, 0].min() == 5 and pts[:, 0].max() == 44  # round(0.1 * 49), round(0.9 * 49)
    assert pts[:, 1].min() == 10 and pts[:, 1].max() == 89
    assert len(torch.unique(pts, dim=0)) == 16
    assert grid_points((20, 20, 20), 27).shape == (27, 3)
    with pytest.raises(ValueError, match="margin"):
        grid_points((10, 10), 4, margin=0.5)


def test_typical_image_wins_and_outlier_scores_lowest(images):
    net = PatchDescriptorNet().eval()
    order = [3, 5, 0, 1, 4, 2]  # the answer must not depend on the position in the list
    best, scores = select_template(net, [images[i] for i in order], points_per_candidate=49)
    assert order[best] == 0
    assert len(scores) == 6
    assert order[min(range(6), key=scores.__getitem__)] == 5
    assert scores[order.index(5)] < 0.5 * min(s for i, s in zip(order, scores) if i != 5)

    subset_best, subset_scores = select_template(net, images, candidates=[5, 2, 4], points_per_candidate=49)
    assert subset_best in (2, 4) and len(subset_scores) == 3
    assert subset_scores[0] == min(subset_scores)


def test_select_template_rejects_bad_input(images):
    net = PatchDescriptorNet().eval()
    with pytest.raises(ValueError, match="at least 2 images"):
        select_template(net, images[:1])
    with pytest.raises(ValueError, match="candidates"):
        select_template(net, images, candidates=[7])
    with pytest.raises(ValueError, match=r"images\[1\]: grid"):
        select_template(net, [images[0], images[1][:, :64]], points_per_candidate=4)
    with pytest.raises(ValueError, match=r"images\[0\]: expected a channel-first"):
        select_template(net, [images[0][0], images[1]], points_per_candidate=4)


def test_landmark_rule_avoids_a_misannotated_template(images):
    """Crops of one texture: a point P of the big image is at P - shift in each crop. Image 2's annotation
    is 8 px off, so its landmarks transfer 8 px (4 mm at 0.5 mm per pixel) off everywhere."""
    net = PatchDescriptorNet().eval()
    anchors = torch.tensor([[40.0, 45.0], [60.0, 30.0], [55.0, 62.0]])
    points = [anchors - torch.tensor(shift, dtype=torch.float32) for shift in SHIFTS]
    points[2] = points[2] + torch.tensor([8.0, 0.0])
    points[3][1] = float("nan")  # a missing landmark is left out
    to_mm = [torch.diag(torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64))] * len(SHIFTS)
    crops = images[: len(SHIFTS)]
    errors = landmark_transfer_errors(net, crops, points, to_mm)
    assert torch.isnan(errors.diagonal()).all()
    good = [0, 1, 3, 4]
    assert max(float(errors[c, j]) for c in good for j in good if c != j) < 0.5
    assert all(3.0 < float(errors[2, j]) < 5.0 for j in good)
    best, scores = select_template_by_landmarks(net, crops, points, to_mm)
    assert best != 2 and scores[2] == max(scores)
    only = landmark_transfer_errors(net, crops, points, to_mm, templates=[1])
    # a row alone or beside the others: the same matches (the matcher's path, so its rounding, follows the query count)
    assert torch.isnan(only[[0, 2, 3, 4]]).all() and torch.allclose(only[1], errors[1], atol=1e-4, equal_nan=True)
    with pytest.raises(ValueError, match="at least 2 images"):
        landmark_transfer_errors(net, crops, points[:2], to_mm)
