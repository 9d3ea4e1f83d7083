"""Radial error, MRE and SDR (bundle/metrics.py) against hand-computed values, alone and through Ignite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bundle.metrics import (
    RadialErrorMetric,
    SuccessDetectionRateMetric,
    landmark_offsets,
    radial_errors,
    success_detection_rate,
    summarize_errors,
)
from ignite.engine import Engine
from monai.handlers import IgniteMetricHandler, from_engine

NAN = float("nan")
SPACING = np.array([0.1, 0.2])  # anisotropic mm per pixel (x, y)


def _case():
    """Two images, three landmarks, pixel offsets and a missing reference; returns pred/ref in mm and px."""
    ref_px = np.array([[[10.0, 10.0], [20.0, 30.0], [5.0, 5.0]], [[0.0, 0.0], [NAN, NAN], [7.0, 3.0]]])
    offsets = np.array([[[3.0, 4.0], [0.0, 10.0], [-20.0, 0.0]], [[0.0, 0.0], [1.0, 1.0], [6.0, -8.0]]])
    pred_px = ref_px + offsets
    pred_px[1, 1] = [4.0, 4.0]  # a prediction whose reference is missing
    # hand-computed errors: (3, 4) px -> (0.3, 0.8) mm -> sqrt(0.73); (0, 10) -> 2.0 mm; (-20, 0) -> 2.0 mm;
    # (0, 0) -> 0; missing; (6, -8) px -> (0.6, -1.6) mm -> sqrt(2.92)
    expected_mm = np.array([[math.sqrt(0.73), 2.0, 2.0], [0.0, NAN, math.sqrt(2.92)]])
    expected_px = np.array([[5.0, 10.0, 20.0], [0.0, NAN, 10.0]])
    return pred_px * SPACING, ref_px * SPACING, expected_mm, expected_px, pred_px, ref_px


def test_radial_errors_anisotropic_spacing_and_missing():
    pred_mm, ref_mm, expected_mm, expected_px, pred_px, ref_px = _case()
    errors = radial_errors(pred_mm, ref_mm)
    assert errors[0, 0] == pytest.approx(0.8544, abs=1e-4)
    np.testing.assert_allclose(errors, expected_mm, atol=1e-12)
    np.testing.assert_allclose(radial_errors(pred_px, ref_px), expected_px)
    as_tensor = radial_errors(torch.as_tensor(pred_mm), torch.as_tensor(ref_mm))
    assert isinstance(as_tensor, torch.Tensor)
    np.testing.assert_allclose(as_tensor.numpy(), expected_mm, atol=1e-12)
    with pytest.raises(ValueError, match="shape"):
        radial_errors(pred_mm[:, :2], ref_mm)


def test_summarize_errors_leaves_missing_out():
    _, _, expected_mm, expected_px, _, _ = _case()
    summary = summarize_errors(expected_mm, expected_px, landmark_names=["a", "b", "c"])
    measured = np.array([math.sqrt(0.73), 2.0, 2.0, 0.0, math.sqrt(2.92)])
    assert summary["n_images"] == 2 and summary["n_landmarks"] == 3
    assert summary["mre_mm"] == pytest.approx(measured.mean())
    assert summary["mre_std_mm"] == pytest.approx(measured.std())
    assert summary["mre_px"] == pytest.approx(np.mean([5.0, 10.0, 20.0, 0.0, 10.0]))
    assert set(summary["sdr"]) == {"2.0", "2.5", "3.0", "4.0"}
    assert summary["sdr"]["2.5"] == 100.0
    # sorted errors 0, 0.854, 1.709, 2, 2 (the missing one is not counted as a failure)
    tight = summarize_errors(expected_mm, expected_px, thresholds=(0.5, 1.0, 1.8, 2.25))
    assert tight["sdr"] == {"0.5": 20.0, "1.0": 40.0, "1.8": 60.0, "2.25": 100.0}
    assert success_detection_rate([1.0, 2.0, 3.0, NAN], 2.0) == pytest.approx(200 / 3)  # inclusive threshold
    per = summary["per_landmark_mre_mm"]
    assert per["a"] == pytest.approx(math.sqrt(0.73) / 2)
    assert per["b"] == pytest.approx(2.0)  # the missing instance does not count as zero
    assert per["c"] == pytest.approx((2.0 + math.sqrt(2.92)) / 2)
    never = expected_mm.copy()
    never[:, 1] = NAN
    assert summarize_errors(never, expected_px)["per_landmark_mre_mm"]["landmark_1"] is None
    # an image without any reference landmark is not counted among the scored images
    unscored = np.vstack([expected_mm, np.full((1, 3), NAN)])
    assert summarize_errors(unscored, np.vstack([expected_px, np.full((1, 3), NAN)]))["n_images"] == 2
    with pytest.raises(ValueError, match="undefined"):
        summarize_errors(np.full((2, 3), NAN), expected_px)
    with pytest.raises(ValueError, match="landmark_names"):
        summarize_errors(expected_mm, expected_px, landmark_names=["a"])


def test_landmark_offsets_are_each_landmarks_mean_difference_and_what_is_left_without_it():
    # 3 images, 3 landmarks: "a" off by (+1, 0) mm everywhere but for noise, "b" missing once, "c" never measured
    d = np.array(
        [
            [[1.5, 0.0], [0.0, 2.0], [NAN, NAN]],
            [[0.5, 0.0], [NAN, NAN], [NAN, NAN]],
            [[1.0, 3.0], [0.0, 4.0], [NAN, NAN]],
        ]
    )
    result = landmark_offsets(d, ["a", "b", "c"])
    offsets = result["per_landmark_offset_mm"]
    np.testing.assert_allclose(offsets["a"], [1.0, 1.0])
    np.testing.assert_allclose(offsets["b"], [0.0, 3.0])  # the missing instance is not a zero difference
    assert offsets["c"] is None
    left = [math.hypot(0.5, 1.0), math.hypot(0.5, 1.0), 2.0, 1.0, 1.0]
    assert result["mre_offset_removed_mm"] == pytest.approx(np.mean(left))
    # a pure shift leaves nothing: the whole error is the offset
    shifted = landmark_offsets(np.tile([[[3.0, -4.0]]], (4, 1, 1)), ["a"])
    assert shifted["mre_offset_removed_mm"] == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(shifted["per_landmark_offset_mm"]["a"], [3.0, -4.0])
    with pytest.raises(ValueError, match="undefined"):
        landmark_offsets(np.full((2, 1, 2), NAN), ["a"])
    with pytest.raises(ValueError, match=r"\(n_images, 2, D\)"):
        landmark_offsets(d, ["a", "b"])


def test_cumulative_metrics_over_batches():
    pred_mm, ref_mm, expected_mm, _, _, _ = _case()
    mre = RadialErrorMetric()
    sdr = SuccessDetectionRateMetric(threshold=1.8)
    for i in range(2):  # one image per call, as batches
        batch = (torch.as_tensor(pred_mm[i : i + 1]), torch.as_tensor(ref_mm[i : i + 1]))
        mre(*batch)
        sdr(*batch)
    assert float(mre.aggregate()) == pytest.approx(np.nanmean(expected_mm))
    assert float(sdr.aggregate()) == pytest.approx(60.0)  # 0, 0.854, 1.709 of 5 measured
    np.testing.assert_allclose(mre.get_buffer().numpy(), expected_mm, atol=1e-12)
    mre.reset()
    with pytest.raises(ValueError, match="before any prediction"):
        mre.aggregate()
    with pytest.raises(ValueError, match=r"\(B, L, D\)"):
        mre(torch.zeros(3, 2), torch.zeros(3, 2))


def test_ignite_metric_handler_with_decollated_outputs():
    pred_mm, ref_mm, expected_mm, _, _, _ = _case()
    data = [[{"pred": torch.as_tensor(pred_mm[i]), "label": torch.as_tensor(ref_mm[i])}] for i in range(2)]
    engine = Engine(lambda engine, batch: batch)  # the "network output" is the decollated batch itself
    IgniteMetricHandler(RadialErrorMetric(), output_transform=from_engine(["pred", "label"])).attach(engine, "mre_mm")
    IgniteMetricHandler(SuccessDetectionRateMetric(1.8), output_transform=from_engine(["pred", "label"])).attach(
        engine, "sdr_1.8mm"
    )
    state = engine.run(data)
    assert state.metrics["mre_mm"] == pytest.approx(np.nanmean(expected_mm))
    assert state.metrics["sdr_1.8mm"] == pytest.approx(60.0)
    np.testing.assert_allclose(state.metric_details["mre_mm"].numpy(), expected_mm, atol=1e-12)
