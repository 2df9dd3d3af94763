#!/usr/bin/env python3
"""Offline tile-config tuning on the GPU for the shipped table: writes titan_megamoe/kernels/tuned_configs.json.

The candidates and the problem are the package's (`titan_megamoe.tune`); users tune their own shapes
with `titan-megamoe tune`, which also checks every candidate against the oracle and writes their own table.

Times every candidate of every kernel in isolation on one shape with random top-k routing
(triton.testing.do_bench, median), keeps the fastest, and merges it into the shipped table keyed by
"DxH". Run it in small batches (--kernels) inside a time limit: each candidate compiles once.

    python scripts/tune_kernels.py --shape 2048 768 128 8 16384 --write
    python scripts/tune_kernels.py --precision fp8 --shape 2048 768 128 8 16384 --write   # block FP8
    python scripts/tune_kernels.py --merge docs/results/tune_4096x1536_*.json   # table from a recorded run

--merge also takes the table files `titan-megamoe tune` writes (every candidate oracle-checked first).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import fields

import torch
import triton
import triton.testing

from titan_megamoe.ab.environment import git_commit
from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import TileConfig, override_tile_config
from titan_megamoe.tune.candidates import CANDIDATES, CANDIDATES_FP8
from titan_megamoe.tune.problem import FLOPS_PER_NDH, kernel_call, kernel_call_fp8, make_problem, make_problem_fp8


def bench(fn):
    """(median ms, the outputs of the first call): a candidate is only timed with its result kept."""
    out = fn()  # compiles
    torch.cuda.synchronize()
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), outs


# candidates differ in summation order only: more than this relative L2 difference from the kernel's
# first candidate means a wrong kernel, which must not win on speed
MAX_REL_DIFF = 1e-2


def rel_diff(got, ref) -> float:
    return max(((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item() for g, r in zip(got, ref))


def merge_run(run: dict) -> None:
    """Write the fastest config of each kernel in a recorded run (this script's every-candidate JSON)
    into tuned_configs.json: the table is always derived from a committed measurement."""
    D, H, E, K, T = run["shape"]
    key = f"{D}x{H}"
    precision = run.get("precision", "bf16")
    table = json.loads(configs.TABLE_PATH.read_text()) if configs.TABLE_PATH.exists() else {"configs": {}, "measured": {}}
    winners = table["configs"].setdefault(precision, {}).setdefault(key, {})
    log = table["measured"].setdefault(precision, {}).setdefault(key, {})
    for kernel in dict.fromkeys(r["kernel"] for r in run["runs"]):
        best = min((r for r in run["runs"] if r["kernel"] == kernel), key=lambda r: r["ms"])
        winners[kernel] = TileConfig.from_record(best["config"]).to_record()
        log[kernel] = {"ms": best["ms"], "tflops": best["tflops"], "T": T, "E": E, "K": K, "gpu": run["gpu"],
                       "date": run["date"][:10], "commit": run.get("commit")}
        print(f"table {precision} {key} {kernel}: {winners[kernel]} ({best['ms']:.3f} ms)")
    configs.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {configs.TABLE_PATH}")


def merge_tune_table(table: dict) -> None:
    """Merge a `titan-megamoe tune` table file: its runs, grouped by precision and shape, as recorded runs."""
    env = table.get("environment", {})
    groups: dict = {}
    for r in table["runs"]:
        if "ms" in r:  # candidates that failed to compile or the oracle check carry no time
            groups.setdefault((r["precision"], tuple(r["shape"])), []).append(r)
    for (precision, shape), runs in groups.items():
        merge_run({"shape": list(shape), "precision": precision, "gpu": env.get("gpu"),
                   "date": min(r["date"] for r in runs), "commit": env.get("commit"), "runs": runs})


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", nargs=5, type=int, metavar=("D", "H", "E", "K", "T"), default=[2048, 768, 128, 8, 16384])
    ap.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                    help="the kernels' operand precision (fp8: block FP8, its own candidates and table entries)")
    ap.add_argument("--write", action="store_true", help="merge the winners into tuned_configs.json")
    ap.add_argument("--out", metavar="DIR", help="write the run's JSON (every candidate) into DIR, table untouched "
                                                 "(a device run's record; merge it later with --merge)")
    ap.add_argument("--only-fields", nargs="+", metavar="FIELD", choices=[f.name for f in fields(TileConfig)],
                    help="time only the config in use at this shape (table or default) and the candidates that set one "
                         "of these TileConfig fields (e.g. persistent): a variant's before/after in one process")
    ap.add_argument("--merge", nargs="+", metavar="RUN_JSON",
                    help="no GPU work: rebuild table entries from recorded runs (docs/results/tune_*.json)")
    a = ap.parse_args()
    if a.merge:
        for path in a.merge:
            run = json.loads(open(path).read())
            merge_tune_table(run) if "configs" in run else merge_run(run)
        return
    D, H, E, K, T = a.shape
    fp8 = a.precision == "fp8"
    p = (make_problem_fp8 if fp8 else make_problem)(D, H, E, K, T)
    candidates, call = (CANDIDATES_FP8, kernel_call_fp8) if fp8 else (CANDIDATES, kernel_call)
    nflop = T * K * D * H
    key = f"{D}x{H}"
    commit = git_commit()
    every = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "shape": a.shape,
             "precision": a.precision, "commit": commit and commit["commit"], "runs": []}
    for kernel in a.kernels:
        results = []
        first_outs = None
        todo = candidates[kernel]
        if a.only_fields:
            todo = [configs.tile_config(kernel, D, H, a.precision)] + [
                c for c in todo if any(getattr(c, f) for f in a.only_fields)]
        for cfg in todo:
            cand = cfg.to_record()
            t0 = time.time()
            try:
                with override_tile_config(kernel, cfg):
                    ms, outs = bench(call(kernel, p))
            except Exception as e:  # a config can exceed shared memory or registers: skip it, say so
                print(f"  {kernel} {cand}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            first_outs = first_outs or outs
            if (diff := rel_diff(outs, first_outs)) > MAX_REL_DIFF:
                print(f"  {kernel} {cand}: failed (result differs from the first candidate's, rel. L2 {diff:.1e})",
                      flush=True)
                continue
            tf = FLOPS_PER_NDH[kernel] * nflop / ms / 1e9
            results.append((ms, cand))
            every["runs"].append({"kernel": kernel, "config": cand, "ms": ms, "tflops": tf})
            print(f"  {kernel:<13} {str(tuple(cand.values())):<60} {ms:7.3f} ms {tf:6.0f} TFLOP/s ({time.time() - t0:.0f}s)", flush=True)
        if results:
            ms, best = min(results, key=lambda r: r[0])
            print(f"best {kernel}: {best} {ms:.3f} ms", flush=True)
    if a.write:
        merge_run(every)
    if a.write or a.out:
        folder = a.out or "docs/results"
        os.makedirs(folder, exist_ok=True)
        tag = key if not fp8 else f"{key}_fp8"
        path = f"{folder}/tune_{tag}_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}.json"
        with open(path, "w") as f:
            json.dump(every, f, indent=1)
        print(f"wrote {path} (every candidate)")


if __name__ == "__main__":
    main()
