"""Per-arm summaries (warm-up steps dropped for timing) and the mega/stock comparison."""

from __future__ import annotations

import datetime as dt
import math
import statistics
from typing import Sequence

from .metrics import StepMetrics

STEP_TIME_METHOD = (
    "median over the timed steps of the wall-clock between consecutive step log lines "
    "(log_freq 1, millisecond timestamps; step 1 is measured from 'Training starts')"
)
TPS_TIME_METHOD = "tokens per step per rank / (tps * non-data-parallel size), TorchTitan's own perf_counter interval"


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def quartiles(values: Sequence[float]) -> tuple[float, float] | None:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def step_times(steps: Sequence[StepMetrics], start_time: dt.datetime | None = None) -> dict[int, float]:
    """Seconds per step from the log timestamps: each step line minus the previous one."""
    out: dict[int, float] = {}
    prev = start_time
    for s in steps:
        if s.time is not None and prev is not None:
            out[s.step] = (s.time - prev).total_seconds()
        prev = s.time
    return out


def first_non_finite(steps: Sequence[StepMetrics]) -> dict | None:
    """The first step whose loss or grad_norm is NaN or inf (a diverged arm), as {step, metric, value}."""
    for s in steps:
        for metric in ("loss", "grad_norm"):
            value = getattr(s, metric)
            if not math.isfinite(value):
                return {"step": s.step, "metric": metric, "value": value}
    return None


def summarize_arm(
    steps: Sequence[StepMetrics],
    warmup: int,
    start_time: dt.datetime | None = None,
    tokens_per_step: int | None = None,
    non_dp_size: int = 1,
) -> dict:
    """Timing medians over steps > warmup; peak memory over all steps; losses of all steps."""
    times = step_times(steps, start_time)
    timed = [s for s in steps if s.step > warmup]
    wall = [times[s.step] for s in timed if s.step in times]
    from_tps = (
        [tokens_per_step / (s.tps * non_dp_size) for s in timed if s.tps > 0]
        if tokens_per_step
        else []
    )
    step_time = median(wall)
    method = STEP_TIME_METHOD
    if step_time is None and from_tps:
        step_time, method = median(from_tps), TPS_TIME_METHOD
    iqr = quartiles(wall)
    memory = [s.memory_gib for s in steps if math.isfinite(s.memory_gib)]
    return {
        "n_steps": len(steps),
        "n_timed_steps": len(timed),
        "timed_steps": [s.step for s in timed],
        "step_time_s": step_time,
        "step_time_method": method,
        "step_time_iqr_s": list(iqr) if iqr else None,
        "step_time_from_tps_s": median(from_tps),
        "tokens_per_step_per_rank": tokens_per_step,
        "tps_median": median([s.tps for s in timed]),
        "tflops_median": median([s.tflops for s in timed]),
        "mfu_pct_median": median([s.mfu_pct for s in timed]),
        "peak_memory_gib": max(memory) if memory else None,
        "peak_memory_pct": max((s.memory_pct for s in steps), default=None),
        "final_loss": steps[-1].loss if steps else None,
        "first_non_finite": first_non_finite(steps),
        "step_time_s_per_step": {str(k): v for k, v in times.items()},
    }


def ratio(mega: float | None, stock: float | None) -> float | None:
    """mega/stock; None when either is missing, non-finite or 0 (CPU memory, MFU printed as 0.00)."""
    if mega is None or stock is None or 0 in (mega, stock) or not (math.isfinite(mega) and math.isfinite(stock)):
        return None
    return mega / stock


def loss_difference(stock: Sequence[StepMetrics], mega: Sequence[StepMetrics]) -> dict:
    """|loss_mega - loss_stock| over every step both arms logged (warm-up included).

    max and mean are over the steps where the difference is finite, and `n_steps` counts exactly those;
    steps with a NaN/inf difference are listed in `non_finite_steps` (a diverged arm fails the A/B)."""
    a = {s.step: s.loss for s in stock}
    b = {s.step: s.loss for s in mega}
    common = sorted(set(a) & set(b))
    diffs = {k: abs(b[k] - a[k]) for k in common}
    finite = {k: d for k, d in diffs.items() if math.isfinite(d)}
    return {
        "n_steps": len(finite),
        "n_common_steps": len(common),
        "max_abs": max(finite.values()) if finite else None,
        "mean_abs": sum(finite.values()) / len(finite) if finite else None,
        "max_abs_step": max(finite, key=finite.__getitem__) if finite else None,
        "non_finite_steps": [k for k, d in diffs.items() if not math.isfinite(d)],
        "identical": bool(common) and all(a[k] == b[k] for k in common),
        "per_step": {str(k): diffs[k] for k in common},
    }


def compare(stock: dict, mega: dict) -> dict:
    """mega/stock ratios of the arm summaries; speedup = stock step time / mega step time."""
    keys = {
        "step_time": "step_time_s",
        "tps": "tps_median",
        "tflops": "tflops_median",
        "mfu": "mfu_pct_median",
        "peak_memory": "peak_memory_gib",
    }
    ratios = {name: ratio(mega.get(k), stock.get(k)) for name, k in keys.items()}
    st = ratios["step_time"]
    return {"ratios_mega_over_stock": ratios, "speedup": (1 / st) if st else None}


def spread(values: Sequence[float | None]) -> dict | None:
    """median, min and max of the finite values (None when there are none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rounds_summary(records: Sequence[dict], round_dirs: Sequence[str], rounds_asked: int) -> dict:
    """The summary of a `--rounds` A/B: per round (its folder, which arm ran first, ok, speedup, tokens/s and
    peak-memory ratios, loss difference) and the spread of each over the rounds that compared both arms."""
    per_round = []
    for i, (record, folder) in enumerate(zip(records, round_dirs), 1):
        comp = record.get("comparison") or {}
        ratios = comp.get("ratios_mega_over_stock") or {}
        loss = comp.get("loss_diff") or {}
        arms = record.get("arms") or {}
        per_round.append({
            "round": i, "dir": folder, "run_order": record.get("run_order"), "ok": record.get("ok"),
            "step_time_s": {name: (a.get("summary") or {}).get("step_time_s") for name, a in arms.items()},
            "speedup": comp.get("speedup"), "tps_ratio": ratios.get("tps"), "peak_memory_ratio": ratios.get("peak_memory"),
            "loss_diff_max": loss.get("max_abs"), "loss_diff_mean": loss.get("mean_abs"),
        })
    first = records[0]
    return {
        "rounds": rounds_asked, "rounds_run": len(records),
        **{k: first.get(k) for k in ("config", "steps", "warmup", "nproc", "seed", "deterministic", "overrides",
                                       "arm_order")},
        "per_round": per_round,
        "speedup": spread([r["speedup"] for r in per_round]),
        "tps_ratio": spread([r["tps_ratio"] for r in per_round]),
        "loss_diff_max": spread([r["loss_diff_max"] for r in per_round]),
        "arms_differ_in": (first.get("comparison") or {}).get("arms_differ_in"),
        "environment": records[-1].get("environment"),
    }
