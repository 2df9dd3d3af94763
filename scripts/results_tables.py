#!/usr/bin/env python3
"""Render docs/results/README.md from the result files beside it (no figure is typed by hand).

Reads every `bench_layer_*.json` (scripts/bench_layer.py), `ab_*/ab.json` (titan-megamoe ab) and
`tune_*.json` (scripts/tune_kernels.py --write, or table files of `titan-megamoe tune`) under docs/results
and writes one Markdown index with a table per file, newest first.

    python scripts/results_tables.py [--dir docs/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _env_line(env: dict) -> str:
    commit = (env.get("commit") or "?")[:10]
    if env.get("dirty"):
        commit += " (dirty)"
    src = env.get("commit_source")
    if src and src.startswith("given"):
        commit += " (given by TITAN_MEGAMOE_COMMIT)"
    return f"{env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}, commit {commit}, {env.get('date')}"


def recorded_commit(path: Path) -> str | None:
    """The commit a result file says it was produced at (bench_layer: environment.commit, ab: environment.git,
    the tuner: a top-level commit)."""
    data = json.loads(path.read_text())
    env = data.get("environment") or {}
    return env.get("commit") or (env.get("git") or {}).get("commit") or data.get("commit")


def provenance_line(files: list[Path], root: Path) -> str:
    """What the files record, said from the files: which of them carry no commit."""
    missing = [str(p.relative_to(root)) for p in files if not recorded_commit(p)]
    line = "Each file records the GPU, versions and date it was produced with"
    if not missing:
        return line + ", and its commit."
    return (line + f"; all but {len(missing)} of the {len(files)} also record the commit. No commit in: "
            + ", ".join(f"`{m}`" for m in missing) + ".")


def _note(path: Path) -> list[str]:
    """A result file may carry a hand-written caveat beside it (X.note.md): shown, never merged into figures."""
    note = path.with_suffix(".note.md")
    return [f"> Note: {note.read_text().strip()}", ""] if note.exists() else []


def whole_recompute_estimate_ms(row: dict) -> float:
    """What recomputing the whole fused forward under full AC would cost, from a bench row: the forward+backward
    plus the back-to-back forward (the recompute is queued while the GPU is still busy, so the synchronised
    forward's launch latency is hidden; not profiled). `bench_layer.py` prints it beside its full-AC timing."""
    return row["fused_fwdbwd_ms"] + row["fused_fwd_b2b_ms"]


def bench_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = [f"### {path.name}", "", _env_line(data["environment"]), "", *_note(path),
             "| case | stock fwd ms | fused fwd ms | fwd x | fused fwd TFLOP/s | stock f+b ms | fused f+b ms | f+b x "
             "| fused f+b TFLOP/s | peak GiB stock / fused | max rel. L2 vs stock |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    sac, full_ac = [], []
    skipped = []
    for r in data["results"]:
        if "precision" in r and r["precision"] != "bf16":  # runs with a precision column
            r = {**r, "case": f"{r['case']} {r['precision']}"}
        if "skipped" in r or "failed" in r:
            skipped.append(f"- {r['case']}: {'skipped' if 'skipped' in r else 'FAILED'}: "
                           f"{r.get('skipped', r.get('failed'))}")
            continue
        lines.append(
            f"| {r['case']} | {r['stock_fwd_ms']:.2f} | {r['fused_fwd_ms']:.2f} | {r['fwd_speedup']:.2f} "
            f"| {r['fused_fwd_tflops']:.0f} | {r['stock_fwdbwd_ms']:.2f} | {r['fused_fwdbwd_ms']:.2f} "
            f"| {r['fwdbwd_speedup']:.2f} | {r['fused_fwdbwd_tflops']:.0f} "
            f"| {r['stock_fwdbwd_peak_gib']:.2f} / {r['fused_fwdbwd_peak_gib']:.2f} "
            f"| {max(r['rel_l2_vs_stock'].values()):.1e} |")
        if "stock_fwd_b2b_ms" in r:  # runs since the back-to-back timing was added
            lines.append(
                f"| {r['case']}, back-to-back | {r['stock_fwd_b2b_ms']:.2f} | {r['fused_fwd_b2b_ms']:.2f} "
                f"| {r['fwd_b2b_speedup']:.2f} | {r['fused_fwd_b2b_tflops']:.0f} | {r['stock_fwdbwd_b2b_ms']:.2f} "
                f"| {r['fused_fwdbwd_b2b_ms']:.2f} | {r['fwdbwd_b2b_speedup']:.2f} | {r['fused_fwdbwd_b2b_tflops']:.0f} "
                "| | |")
        if "fused_stock_router_fwd_ms" in r:  # the fused experts behind TorchTitan's router module
            fr, fb = r["fused_stock_router_fwd_ms"], r["fused_stock_router_fwdbwd_ms"]
            lines.append(
                f"| {r['case']}, fused experts + stock router | {r['stock_fwd_ms']:.2f} | {fr:.2f} "
                f"| {r['stock_fwd_ms'] / fr:.2f} | | {r['stock_fwdbwd_ms']:.2f} | {fb:.2f} "
                f"| {r['stock_fwdbwd_ms'] / fb:.2f} | | {r['stock_fwdbwd_peak_gib']:.2f} / "
                f"{r['fused_stock_router_fwdbwd_peak_gib']:.2f} | |")
        if "stock_sac_fwdbwd_ms" in r and "fused_sac_save_fwdbwd_ms" in r:
            sac.append(f"| {r['case']} | {r['stock_sac_fwdbwd_ms']:.2f} / {r['stock_sac_peak_gib']:.2f} "
                       f"| {r['fused_sac_recompute_fwdbwd_ms']:.2f} / {r['fused_sac_recompute_peak_gib']:.2f} "
                       f"| {r['fused_sac_save_fwdbwd_ms']:.2f} / {r['fused_sac_save_peak_gib']:.2f} |")
        if "fused_full_ac_fwdbwd_ms" in r:
            full_ac.append(f"| {r['case']} | {r['stock_full_ac_fwdbwd_ms']:.2f} / {r['stock_full_ac_peak_gib']:.2f} "
                           f"| {r['fused_full_ac_fwdbwd_ms']:.2f} / {r['fused_full_ac_peak_gib']:.2f} "
                           f"| {whole_recompute_estimate_ms(r):.2f} |")
    if skipped:
        lines += ["", "Not measured:", "", *skipped]
    if sac:
        lines += ["", "Under op-level selective AC (forward+backward ms / peak GiB):", "",
                  "| case | stock | fused, op recomputed (default) | fused, op saved (`save_under_sac`) |",
                  "|---|---|---|---|", *sac]
    if full_ac:
        lines += ["", "Under full AC (forward+backward ms / peak GiB; the last column an estimate of what recomputing "
                      "the whole fused forward would cost: its forward+backward plus its back-to-back forward, as the "
                      "recompute is queued while the GPU is still busy, its launch latency hidden; not profiled):", "",
                  "| case | stock | fused | fused forward+backward + back-to-back forward |", "|---|---|---|---|",
                  *full_ac]
    return lines + [""]


def ab_rounds_section(path: Path, data: dict) -> list[str]:
    """A `titan-megamoe ab --rounds N` summary: one line per round and the spread."""
    env = data.get("environment") or {}
    git = env.get("git") or {}
    base, cand = data["arm_order"]
    lines = [f"### {path.parent.name}", "",
             f"{env.get('device')}, torch {(env.get('versions') or {}).get('torch')}, commit "
             f"{(git.get('commit') or '?')[:10]}, {env.get('date')}; `{Path(data['config']).name}`, {data['steps']} "
             f"steps, warm-up {data['warmup']}, deterministic {data['deterministic']}, {data['rounds_run']} rounds",
             "", *_note(path)]
    for r in data["per_round"]:
        lines.append(f"- round {r['round']} ({(r.get('run_order') or ['?'])[0]} first): speedup "
                     + (f"{r['speedup']:.3f}x" if r.get("speedup") else "-") + ", loss |diff| max "
                     + (f"{r['loss_diff_max']:.5f}" if r.get("loss_diff_max") is not None else "-"))
    s = data.get("speedup")
    if s:
        lines.append(f"- speedup ({base} / {cand}): median {s['median']:.3f}x, min {s['min']:.3f}x, max {s['max']:.3f}x")
    return lines + [f"- summary: [{path.parent.name}/ab.md]({path.parent.name}/ab.md)", ""]


def ab_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    if "per_round" in data:
        return ab_rounds_section(path, data)
    cmp_, env = data["comparison"], data["environment"]
    ratios, loss = cmp_["ratios_mega_over_stock"], cmp_["loss_diff"]
    base, cand = cmp_.get("baseline", "stock"), cmp_.get("candidate", "mega_moe")
    git = env.get("git") or {}
    return [f"### {path.parent.name}", "",
            f"{env.get('device')}, torch {env['versions'].get('torch')}, commit {(git.get('commit') or '?')[:10]}, "
            f"{env.get('date')}; `{Path(data['config']).name}`, {data['steps']} steps, warm-up {data['warmup']}, "
            f"deterministic {data['deterministic']}", "", *_note(path.parent / "ab.json"),
            f"- step-time speedup ({base} / {cand}): {cmp_['speedup']:.3f}x; tokens/s ratio {ratios['tps']:.3f}; "
            f"peak memory ratio {ratios['peak_memory']:.3f}",
            f"- loss |{cand} - {base}|: max {loss['max_abs']:.5f} (step {loss['max_abs_step']}), "
            f"mean {loss['mean_abs']:.5f} over {loss['n_steps']} steps",
            f"- full table: [{path.parent.name}/ab.md]({path.parent.name}/ab.md)", ""]


def tune_cli_section(path: Path, data: dict) -> list[str]:
    """A table file of `titan-megamoe tune`: every candidate with its oracle check, per precision and shape."""
    env = data.get("environment", {})
    commit = env["commit"][:10] if env.get("commit") else "not recorded"
    lines = [f"### {path.name}", "", f"`titan-megamoe tune`; {env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}, commit {commit}", ""]
    groups: dict = {}
    for r in data["runs"]:
        groups.setdefault((r["precision"], tuple(r["shape"])), []).append(r)
    for (precision, (D, H, E, K, T)), runs in groups.items():
        lines += [f"{precision}, D={D} H={H} E={E} K={K} T={T}, {min(r['date'] for r in runs)}", "",
                  "| kernel | config | ms | TFLOP/s | oracle check (error / same math's) |", "|---|---|---|---|---|"]
        for r in sorted(runs, key=lambda r: (r["kernel"], r.get("ms", float("inf")))):
            check = r.get("check", {})
            ratio = f"{check['worst_error_vs_same_math']:.2f}x ({check['tensor']})" if check else ""
            timing = (f"{r['ms']:.3f} | {r['tflops']:.0f}" if "ms" in r else f"failed: {r.get('failed', '?')[:90]} | ")
            lines.append(f"| {r['kernel']} | `{json.dumps(r['config'])}` | {timing} | {ratio} |")
        lines.append("")
    return lines


def tune_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    if "configs" in data:
        return tune_cli_section(path, data)
    D, H, E, K, T = data["shape"]
    commit = data["commit"][:10] if data.get("commit") else "not recorded"
    lines = [f"### {path.name}", "", f"{data['gpu']}, torch {data['torch']}, triton {data['triton']}, "
             f"commit {commit}, {data['date']}; D={D} H={H} E={E} K={K} T={T}", "", "| kernel | config | ms | TFLOP/s |", "|---|---|---|---|"]
    for r in sorted(data["runs"], key=lambda r: (r["kernel"], r["ms"])):
        lines.append(f"| {r['kernel']} | `{json.dumps(r['config'])}` | {r['ms']:.3f} | {r['tflops']:.0f} |")
    return lines + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="docs/results")
    a = ap.parse_args()
    root = Path(a.dir)
    files = [*sorted(root.glob("bench_layer_*.json")), *sorted(root.glob("ab_*/ab.json")), *sorted(root.glob("tune_*.json"))]
    out = ["# Measured results", "",
           "Generated by `scripts/results_tables.py` from the JSON files in this folder; do not edit by hand.",
           provenance_line(files, root), "",
           "## Per-layer benchmark: TorchTitan 0.2.2 MoE vs mega_moe (`scripts/bench_layer.py`)", ""]
    for p in sorted(root.glob("bench_layer_*.json"), reverse=True):
        out += bench_section(p)
    out += ["## Training A/B (`titan-megamoe ab`)", ""]
    for p in sorted(root.glob("ab_*/ab.json"), reverse=True):
        out += ab_section(p)
    out += ["## Kernel tile tuning (`scripts/tune_kernels.py`, `titan-megamoe tune`)", ""]
    for p in sorted(root.glob("tune_*.json"), reverse=True):
        out += tune_section(p)
    (root / "README.md").write_text("\n".join(out))
    print(f"wrote {root / 'README.md'}")


if __name__ == "__main__":
    main()
