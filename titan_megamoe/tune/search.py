"""The tuning run: every candidate of every kernel at one shape, checked, timed, the fastest kept.

A candidate first runs the whole layer with its config in force against the float64 oracle
(`oracle_check.LayerCheck`); only one that passes is timed (`triton.testing.do_bench`, median) on the
kernel alone. After every candidate the table file is rewritten (atomically), so a run stopped by its time
budget, an error or Ctrl-C resumes where it stopped: candidates already in the file are not run again.

The file is the shipped table's schema (`kernels/configs.py`) plus every candidate's record:

    {"configs":  {precision: {"DxH": {kernel: {TileConfig fields}}}},
     "measured": {precision: {"DxH": {kernel: {"ms", "tflops", "T", "E", "K", "gpu", "date"}}}},
     "runs": [{"precision", "shape", "kernel", "config", "ms" | "failed", "check", ...}, ...],
     "environment": {"gpu", "torch", "triton", "titan_megamoe", "commit"}}

`[mega_moe] tile_table` (or `titan_megamoe.use_tile_table`) points the kernels at it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
import triton

from ..kernels import configs
from ..kernels.configs import KERNELS, TileConfig, override_tile_config
from . import candidates, problem
from .oracle_check import FACTOR, LayerCheck


def _environment(device) -> dict:
    from .. import __version__
    from ..ab.environment import git_commit

    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu (Triton interpreter)"
    commit = git_commit()
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "titan_megamoe": __version__,
            "commit": commit and commit["commit"]}


def load(path: Path) -> dict:
    if not path.exists():
        return {"configs": {}, "measured": {}, "runs": []}
    try:
        table = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} exists and is not JSON ({e}), so not a table written by `titan-megamoe tune`; "
                         f"pass another --out or delete it") from None
    if not isinstance(table, dict) or not isinstance(table.get("runs"), list) or "configs" not in table:
        raise ValueError(f"{path} is not a table written by `titan-megamoe tune` (no 'runs'/'configs'); "
                         f"pass another --out or delete it")
    return table


def _write(path: Path, table: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)


def _time_ms(fn, device) -> float:
    fn()  # compiles
    if torch.device(device).type != "cuda":  # the interpreter: one run, a plumbing check, not a timing
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune(shape: tuple[int, int, int, int, int], precision: str, kernels: list[str], out: Path,
         budget_s: float, device="cuda", say=print, sorted_copy: bool = True) -> dict:
    """Tune `kernels` at `shape` = (D, H, E, K, T) for one precision; returns the table (also in `out`).
    sorted_copy=False leaves out the weight-gradient configs that copy an operand into sorted order first
    (a transient [T*K, D] copy): neither run nor, if the file holds them from an earlier run, picked."""
    D, H, E, K, T = shape
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; valid: {', '.join(KERNELS)}")
    table = load(out)
    key = f"{D}x{H}"
    done = {(r["precision"], tuple(r["shape"]), r["kernel"], json.dumps(_record(r["config"]), sort_keys=True))
            for r in table["runs"]}
    table["environment"] = _environment(device)
    start = time.monotonic()
    todo = {kernel: [c for c in candidates.for_kernel(kernel, precision) if sorted_copy or not c.sorted_copy]
            for kernel in kernels}
    pending = {(kernel, c) for kernel, cands in todo.items() for c in cands
               if (precision, tuple(shape), kernel, json.dumps(c.to_record(), sort_keys=True)) not in done}
    if pending:  # a finished file is only re-read: no problem to build
        say(f"[tune] {precision} D={D} H={H} E={E} K={K} T={T}: building the problem and the oracle check")
        p = problem.make(D, H, E, K, T, precision, device=device)
        check = LayerCheck(D, H, E, K, precision, device)
    stopped = False
    for kernel in kernels:
        cands = todo[kernel]
        for i, cfg in enumerate(cands, 1):
            rec = cfg.to_record()
            if (kernel, cfg) not in pending:
                continue
            elapsed = time.monotonic() - start
            if elapsed > budget_s:
                stopped = True
                break
            run = {"precision": precision, "shape": list(shape), "kernel": kernel, "config": rec,
                   "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
            try:
                with override_tile_config(kernel, cfg):
                    ratio, worst = check()
                    run["check"] = {"worst_error_vs_same_math": ratio, "tensor": worst, "limit": FACTOR}
                    if ratio > FACTOR:
                        run["failed"] = f"oracle check: {worst} error {ratio:.2f}x the same math's (limit {FACTOR}x)"
                    else:
                        run["ms"] = _time_ms(problem.call(kernel, p, precision), device)
                        run["tflops"] = problem.FLOPS_PER_NDH[kernel] * T * K * D * H / run["ms"] / 1e9
            except Exception as e:  # a config can exceed shared memory or registers: record it, go on
                run["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            table["runs"].append(run)
            timing = ("interpreter run, not a timing" if device == "cpu"
                      else f"{run.get('ms', 0):.3f} ms, {run.get('tflops', 0):.0f} TFLOP/s")
            what = run.get("failed") or f"{timing}, oracle check {ratio:.2f}x the same math's error"
            say(f"[tune] {kernel} {i}/{len(cands)} {_short(cfg)}: {what} "
                f"({time.monotonic() - start:.0f} s of {budget_s:.0f})")
            _pick_winner(table, precision, shape, kernel, sorted_copy)
            _write(out, table)
        if stopped:
            break
    for kernel in kernels:  # also when every candidate was in the file already
        _pick_winner(table, precision, shape, kernel, sorted_copy)
    _write(out, table)
    if stopped:
        say(f"[tune] time budget of {budget_s:.0f} s spent; run the same command again to continue "
            f"(finished candidates are kept in {out})")
    else:
        say(f"[tune] done: {out} holds configs for {precision} {key}: "
            + ", ".join(sorted(table["configs"].get(precision, {}).get(key, {}))))
    return table


def _record(config: dict) -> dict:
    """A recorded config with every TileConfig field: records of older runs lack fields added since (they
    mean the defaults)."""
    return TileConfig.from_record(config).to_record()


def _short(cfg: TileConfig) -> str:
    flags = [f for f in ("tma", "split", "warp_specialize", "sorted_copy") if getattr(cfg, f)]
    group = f" group_m {cfg.group_m}" if cfg.group_m > 1 else ""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + (
        f" {'+'.join(flags)}" if flags else "") + group


def _pick_winner(table: dict, precision: str, shape, kernel: str, sorted_copy: bool = True) -> None:
    D, H, E, K, T = shape
    ok = [r for r in table["runs"] if r["precision"] == precision and tuple(r["shape"][:2]) == (D, H)
          and r["kernel"] == kernel and "ms" in r and (sorted_copy or not _record(r["config"])["sorted_copy"])]
    if not ok:
        return
    best = min(ok, key=lambda r: r["ms"])
    key = f"{D}x{H}"
    table["configs"].setdefault(precision, {}).setdefault(key, {})[kernel] = _record(best["config"])
    gpu = table.get("environment", {}).get("gpu")
    table["measured"].setdefault(precision, {}).setdefault(key, {})[kernel] = {
        "ms": best["ms"], "tflops": best["tflops"], "T": best["shape"][4], "E": best["shape"][2],
        "K": best["shape"][3], "gpu": gpu, "date": best["date"][:10]}


def interpreter_device() -> str:
    return "cpu" if configs.interpreting() else "cuda"
