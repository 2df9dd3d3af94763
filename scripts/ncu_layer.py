#!/usr/bin/env python3
"""Hardware counters of every kernel in one fused-layer call (Nsight Compute), one row per kernel.

The layer benchmark and torch.profiler say how long each kernel takes; they cannot say why. This runs
`scripts/profile_layer.py --ncu` under `ncu`: per precision, two warm-up forward+backward calls and then
one between cudaProfilerStart and Stop, whose kernels alone are profiled. Per kernel it reads duration,
SM / L2 / DRAM throughput as % of peak, tensor-pipe activity, achieved occupancy and its limit, registers
per thread, and the warp stall reasons that dominate. The question it is built for: are the block-FP8
GEMMs (~540-880 TFLOP/s on the H200, about bf16's rate) held back by the L2 (their 64-row tiles read 85
FLOP per byte, as bf16's 128 x 256 tiles do), by the promotion's waits, or by occupancy (docs/kernels.md).

    python scripts/ncu_layer.py --out docs/results/ncu_YYYYMMDD --case 30b-16k --precision bf16,fp8

Writes <out>/ncu_<case>_<precision>.csv (ncu's raw page: every metric of the sections), a JSON with the
per-kernel rows and the run's environment, and a Markdown table. Needs `ncu` on the PATH and a GPU whose
counters it may read (Nsight Compute read them on the Firecracker GPU machines, not under gVisor). Clocks
are left alone (`--clock-control none`), so durations match the benchmark's; every kernel is replayed once
per counter pass, so a call takes minutes (`--timeout`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats")
# (column in the table, ncu's raw metric); the raw page has every metric the sections collect, one column each
FIELDS = (
    ("us", "gpu__time_duration.sum"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("l2_pct", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor_pct", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("occupancy_limit_pct", "sm__maximum_warps_per_active_cycle_pct"),
    ("registers", "launch__registers_per_thread"),
    ("grid", "launch__grid_size"),
)
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def run_ncu(case: str, precision: str, csv_path: str, timeout: int) -> str:
    # the profiled window is profile_layer.py's cudaProfilerStart/Stop around one call: process-wide, so the
    # backward's kernels (launched from autograd's own thread, outside any NVTX range of the main thread) count
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           *[a for s in SECTIONS for a in ("--section", s)], sys.executable,
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_layer.py"),
           "--cases", case, "--precision", precision, "--no-stock", "--ncu"]
    print(f"== {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    with open(csv_path, "w") as f:
        f.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"ncu exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def parse_raw(text: str) -> list[dict]:
    """ncu's `--csv --page raw` (a header of metric names, a row of units, one row per kernel launch) ->
    one dict per launch in launch order: name, the FIELDS and the warp stall reasons (cycles per issued
    instruction), largest first."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV header in the output: no kernel ran between cudaProfilerStart and Stop")
    table = list(csv.reader(io.StringIO(text[start:])))
    header, units, rows = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    out = []
    for row in rows:
        if len(row) != len(header):
            continue
        r = {"kernel": re.sub(r"\(.*", "", row[col["Kernel Name"]])}
        for name, metric in FIELDS:
            r[name] = _number(row[col[metric]], units[col[metric]]) if metric in col else None
        stalls = {STALL.search(m).group(1): _number(row[i], units[i]) for m, i in col.items() if STALL.search(m)}
        r["stalls"] = {m: v for m, v in sorted(stalls.items(), key=lambda kv: -_sortable(kv[1])) if _sortable(v) > 0}
        out.append(r)
    return out


def _sortable(v) -> float:
    return v if isinstance(v, float) else 0.0


def _number(value, unit):
    try:
        v = float(str(value).replace(",", ""))
    except ValueError:
        return value
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    return v * to_us[unit] if unit in to_us else v


def _cell(v, fmt: str = "{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, float) else ("-" if v is None else str(v))


def markdown(rows_by_arm: dict) -> str:
    lines = []
    for arm, rows in rows_by_arm.items():
        lines += [f"### {arm}", "", "| kernel | us | SM % | L2 % | DRAM % | tensor pipe % | warps active % (limit) "
                  "| regs | top stalls (cycles per issue) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            stalls = ", ".join(f"{m} {v:.1f}" for m, v in list(r["stalls"].items())[:3])
            cells = [r["kernel"][:60]] + [_cell(r[c]) for c in ("us", "sm_pct", "l2_pct", "dram_pct", "tensor_pct")]
            occupancy = f"{_cell(r['occupancy_pct'])} ({_cell(r['occupancy_limit_pct'])})"
            cells += [occupancy, _cell(r["registers"], "{:.0f}")]
            lines.append("| " + " | ".join(cells + [stalls]) + " |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the CSVs, the JSON and the Markdown table")
    ap.add_argument("--case", default="30b-16k")
    ap.add_argument("--precision", default="bf16,fp8", help="comma-separated precisions of the fused arm")
    ap.add_argument("--timeout", type=int, default=500, help="seconds per precision before ncu is stopped")
    a = ap.parse_args()
    from bench_layer import CASES, environment

    if a.case not in CASES:
        ap.error(f"--case {a.case!r}: choose one of {', '.join(CASES)}")
    if shutil.which("ncu") is None:
        ap.error("ncu (Nsight Compute) is not on the PATH; it ships with the CUDA toolkit")
    os.makedirs(a.out, exist_ok=True)
    rows_by_arm, failed = {}, {}
    for p in a.precision.split(","):
        csv_path = os.path.join(a.out, f"ncu_{a.case}_{p}.csv")
        try:
            rows_by_arm[f"{a.case} {p} fwd+bwd"] = parse_raw(run_ncu(a.case, p, csv_path, a.timeout))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            failed[p] = str(e)[-2000:]
            print(f"{p}: FAILED {failed[p][-300:]}", flush=True)
    import torch

    result = {"environment": environment(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
              "case": a.case, "sections": SECTIONS, "kernels": rows_by_arm, "failed": failed}
    with open(os.path.join(a.out, f"ncu_{a.case}.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(rows_by_arm)
    with open(os.path.join(a.out, f"ncu_{a.case}.md"), "w") as f:
        f.write(table)
    print(table)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
