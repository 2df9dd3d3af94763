#!/usr/bin/env python3
"""A/B of two `titan_megamoe` trees with scripts/host_overhead.py, interleaved in fresh processes (CUDA GPU).

One host_overhead.py run per side cannot size a change smaller than the host's run-to-run noise: on the
H100 of 2026-12-07 the rows whose code had not changed moved by up to 545 us between two runs at 30B-A3B
T=512 (docs/kernels.md). This runs host_overhead.py --rounds times per side, alternating A, B, A, B, ...
so that drift of the host lands on both sides, and reports per row each side's median and range of wall
and GPU time and the medians' ratio B/A. A side is a directory holding a `titan_megamoe/` package, put
first on PYTHONPATH (the scripts come from this checkout, so both sides run the same measurement).

    mkdir -p /tmp/a && git archive <commit> titan_megamoe | tar -x -C /tmp/a
    python scripts/host_ab.py --a /tmp/a --a-commit <commit> --b . --rounds 3 -- --tokens 512 --precision bf16,fp8

Everything after `--` goes to host_overhead.py (not --out: each run writes into a temporary folder).
Writes host_ab_<time>.json into --out after every complete round (both sides' runs so far, and their
summary), so a run stopped from outside keeps what it finished. --max-seconds starts a round only if the
slowest round so far would still end within it: on a device call with a hard time limit, three rounds
asked for and 1.5 done left no JSON at all (2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
HOST_OVERHEAD = os.path.join(SCRIPTS, "host_overhead.py")


def run_side(tree: str, commit: str | None, args: list[str], out_dir: str) -> dict:
    """One host_overhead.py run with `tree` first on PYTHONPATH; its JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), *filter(None, [env.get("PYTHONPATH")])])
    if commit:
        env["TITAN_MEGAMOE_COMMIT"] = commit
    proc = subprocess.run([sys.executable, HOST_OVERHEAD, *args, "--out", out_dir], env=env, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"host_overhead.py failed for tree {tree} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    (name,) = [n for n in os.listdir(out_dir) if n.startswith("host_overhead_") and n.endswith(".json")]
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per row and side: median, min, max of wall and GPU us per call over the rounds; B/A of the medians."""
    rows = {}
    for name in runs["a"][0]["host_us_per_call"]:
        row = {}
        for side in ("a", "b"):
            for col, field in (("wall", "host_us_per_call"), ("gpu", "gpu_us_per_call")):
                values = [r[field].get(name) for r in runs[side]]
                values = [v for v in values if v is not None]
                row[f"{side}_{col}"] = ({"median": statistics.median(values), "min": min(values), "max": max(values)}
                                        if values else None)
        for col in ("wall", "gpu"):
            a, b = row[f"a_{col}"], row[f"b_{col}"]
            row[f"b_over_a_{col}"] = b["median"] / a["median"] if a and b else None
        rows[name] = row
    return rows


def _cell(stats) -> str:
    return "-" if stats is None else f"{stats['median']:.0f} [{stats['min']:.0f}-{stats['max']:.0f}]"


def main():
    argv = sys.argv[1:]
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="directory holding side A's titan_megamoe/")
    ap.add_argument("--b", required=True, help="directory holding side B's titan_megamoe/")
    ap.add_argument("--a-commit", help="the commit side A's tree came from (recorded in its runs)")
    ap.add_argument("--b-commit", help="the commit side B's tree came from")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start a round only if the slowest one so far would end within this (0: no limit)")
    ap.add_argument("--out", default="docs/results")
    a = ap.parse_args(ours)
    if "--out" in passed:
        ap.error("--out after '--' would go to host_overhead.py; give it before '--' (host_ab.py's own)")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    for side in (a.a, a.b):
        if not os.path.isdir(os.path.join(side, "titan_megamoe")):
            ap.error(f"{side} holds no titan_megamoe/ package")
    if a.max_seconds < 0:
        ap.error(f"--max-seconds must be 0 (no limit) or positive, got {a.max_seconds}")
    from bench_layer import result_path

    runs = {"a": [], "b": []}
    path = result_path(a.out, "host_ab")
    start, slowest = time.monotonic(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            elapsed = time.monotonic() - start
            if r and a.max_seconds and elapsed + slowest > a.max_seconds:
                print(f"stopping after {r} of {a.rounds} rounds: the next would end past --max-seconds "
                      f"{a.max_seconds:.0f} ({elapsed:.0f} s gone, the slowest round took {slowest:.0f} s)", flush=True)
                break
            for side, tree, commit in (("a", a.a, a.a_commit), ("b", a.b, a.b_commit)):
                print(f"round {r + 1}/{a.rounds}: side {side.upper()} ({tree})", flush=True)
                runs[side].append(run_side(tree, commit, passed, os.path.join(tmp, f"{side}{r}")))
            slowest = max(slowest, time.monotonic() - start - elapsed)
            rows = summarise(runs)
            with open(path, "w") as f:
                json.dump({"a": {"tree": a.a, "commit": a.a_commit}, "b": {"tree": a.b, "commit": a.b_commit},
                           "rounds": r + 1, "rounds_asked": a.rounds, "host_overhead_args": passed, "summary": rows,
                           "runs": runs}, f, indent=1)
    done = len(runs["a"])
    env = runs["b"][0]["environment"]
    print(f"wrote {path}\n{env['gpu']}  torch {env['torch']}  A {a.a_commit or a.a}  B {a.b_commit or a.b}  "
          f"{done} rounds, interleaved")
    head = ("A wall", "B wall", "B/A", "A GPU", "B GPU", "B/A")
    print(f"{'us per call: median [min-max]':<44}" + "".join(f"{h:>{7 if h == 'B/A' else 20}}" for h in head))
    for name, row in rows.items():
        ratios = [f"{row[f'b_over_a_{c}']:.3f}" if row[f"b_over_a_{c}"] else "-" for c in ("wall", "gpu")]
        print(f"{name:<44}{_cell(row['a_wall']):>20}{_cell(row['b_wall']):>20}{ratios[0]:>7}"
              f"{_cell(row['a_gpu']):>20}{_cell(row['b_gpu']):>20}{ratios[1]:>7}")


if __name__ == "__main__":
    main()
