"""A/B statistics: step times, warm-up handling, medians, ratios, loss differences."""

import datetime as dt
import math

import pytest

from titan_megamoe.ab.metrics import StepMetrics
from titan_megamoe.ab.stats import compare, first_non_finite, loss_difference, median, quartiles, ratio, step_times, summarize_arm

T0 = dt.datetime(2026, 12, 2, 12, 0, 0)


def steps_at(seconds, losses=None, tps=1000.0, gib=1.0):
    """Step lines logged at T0 + seconds[i]."""
    losses = losses or [7.0 - 0.1 * i for i in range(len(seconds))]
    return [
        StepMetrics(step=i + 1, loss=losses[i], grad_norm=1.0, memory_gib=gib + 0.1 * i, memory_pct=1.0, tps=tps,
                    tflops=2.0 + i, mfu_pct=0.5, time=T0 + dt.timedelta(seconds=s))
        for i, s in enumerate(seconds)
    ]


def test_median_and_quartiles_skip_missing():
    assert median([3.0, 1.0, None, float("nan"), 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    assert median([]) is None
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    assert quartiles([1.0]) is None


def test_step_times_from_timestamps():
    steps = steps_at([5.0, 6.0, 6.5])
    assert step_times(steps) == {2: 1.0, 3: 0.5}
    assert step_times(steps, start_time=T0) == {1: 5.0, 2: 1.0, 3: 0.5}


def test_summary_drops_warmup_for_timing_only():
    # step 1 is slow (compile, allocator warm-up); steps 2..5 take 1.0, 1.2, 0.8, 1.0 s
    steps = steps_at([10.0, 11.0, 12.2, 13.0, 14.0], tps=2048.0)
    s = summarize_arm(steps, warmup=1, start_time=T0, tokens_per_step=2048)
    assert s["n_steps"] == 5 and s["n_timed_steps"] == 4 and s["timed_steps"] == [2, 3, 4, 5]
    assert s["step_time_s"] == pytest.approx(1.0)
    assert s["step_time_from_tps_s"] == pytest.approx(1.0)  # 2048 tokens / 2048 tps
    assert s["tflops_median"] == pytest.approx(4.5)  # median of 3, 4, 5, 6
    assert s["peak_memory_gib"] == pytest.approx(1.4)  # over all steps, warm-up included
    assert s["final_loss"] == pytest.approx(6.6)
    assert s["step_time_s_per_step"]["1"] == 10.0


def test_summary_falls_back_to_tps_without_timestamps():
    steps = steps_at([1.0, 2.0, 3.0], tps=500.0)
    for st in steps:
        st.time = None
    s = summarize_arm(steps, warmup=0, tokens_per_step=1000, non_dp_size=2)
    assert s["step_time_s"] == pytest.approx(1.0)  # 1000 / (500 * 2)
    assert "tps" in s["step_time_method"]


def test_ratio_edge_cases():
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(1.0, 0.0) is None and ratio(0.0, 1.0) is None  # CPU memory reads 0; 0.00 printed MFU
    assert ratio(None, 1.0) is None and ratio(1.0, float("nan")) is None


def test_compare_ratios_and_speedup():
    stock = {"step_time_s": 2.0, "tps_median": 1000.0, "tflops_median": 10.0, "mfu_pct_median": 1.0, "peak_memory_gib": 8.0}
    mega = {"step_time_s": 1.6, "tps_median": 1250.0, "tflops_median": 12.5, "mfu_pct_median": 1.25, "peak_memory_gib": 6.0}
    c = compare(stock, mega)
    r = c["ratios_mega_over_stock"]
    assert r["step_time"] == pytest.approx(0.8) and r["tps"] == pytest.approx(1.25)
    assert r["peak_memory"] == pytest.approx(0.75)
    assert c["speedup"] == pytest.approx(1.25)


def test_loss_difference_all_steps():
    a = steps_at([1, 2, 3, 4], losses=[7.0, 6.5, 6.0, 5.5])
    b = steps_at([1, 2, 3], losses=[7.0, 6.25, 6.125])
    d = loss_difference(a, b)
    assert d["n_steps"] == 3
    assert d["max_abs"] == pytest.approx(0.25) and d["max_abs_step"] == 2
    assert d["mean_abs"] == pytest.approx((0 + 0.25 + 0.125) / 3)
    assert not d["identical"]
    assert loss_difference(a, a)["identical"] and loss_difference(a, a)["max_abs"] == 0.0


def test_loss_difference_nan():
    a = steps_at([1, 2, 3], losses=[7.0, 6.0, 5.0])
    b = steps_at([1, 2, 3], losses=[7.0, 6.5, float("nan")])
    d = loss_difference(a, b)
    assert d["non_finite_steps"] == [3] and d["max_abs"] == 0.5
    assert d["max_abs_step"] == 2  # the largest finite difference, never the NaN step
    assert d["n_steps"] == 2 and d["n_common_steps"] == 3  # "over N steps": the steps averaged
    assert d["mean_abs"] == pytest.approx(0.25)
    assert math.isnan(d["per_step"]["3"])
    all_nan = loss_difference(steps_at([1], losses=[float("nan")]), steps_at([1], losses=[1.0]))
    assert all_nan["n_steps"] == 0 and all_nan["max_abs_step"] is None and all_nan["max_abs"] is None


def test_first_non_finite_loss_or_grad_norm():
    steps = steps_at([1, 2, 3, 4])
    assert first_non_finite(steps) is None
    steps[2].grad_norm = float("inf")
    steps[3].loss = float("nan")
    assert first_non_finite(steps) == {"step": 3, "metric": "grad_norm", "value": float("inf")}
    assert summarize_arm(steps, warmup=1)["first_non_finite"]["step"] == 3
