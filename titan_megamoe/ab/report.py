"""Turn the A/B record (the dict that becomes ab.json) into the console table, ab.md and ab.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

ARMS = ("stock", "mega_moe")  # the default pair; `--arms` may choose another (record["arm_order"])

# (label, summary key, format, ratio key)
ROWS = (
    ("step time, median (s)", "step_time_s", "{:.4f}", "step_time"),
    ("tokens/s per device, median", "tps_median", "{:,.0f}", "tps"),
    ("TFLOP/s per device, median", "tflops_median", "{:,.2f}", "tflops"),
    ("MFU, median (%)", "mfu_pct_median", "{:.2f}", "mfu"),
    ("peak memory reserved (GiB)", "peak_memory_gib", "{:.2f}", "peak_memory"),
    ("final loss", "final_loss", "{:.5f}", None),
)


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return spec.format(value)


def _arm_column(record: dict, arm: str) -> list[str]:
    a = record["arms"].get(arm)
    if a is None:
        return ["not run"] * (len(ROWS) + 1)
    s = a.get("summary") or {}
    cells = [_fmt(s.get(key), spec) for _, key, spec, _ in ROWS]
    cells.append(f"{s.get('n_steps', 0)} / {s.get('n_timed_steps', 0)}")
    if not a.get("ok"):
        cells[0] = f"FAILED ({a.get('failure')})" if not s.get("step_time_s") else cells[0] + " (FAILED)"
    return cells


def arm_order(record: dict) -> tuple[str, str]:
    """(baseline, candidate) arm names."""
    base, cand = record.get("arm_order") or ARMS
    return base, cand


def _ratio_label(base: str, cand: str) -> str:
    return "mega/stock" if (base, cand) == ARMS else f"{cand}/{base}"


def table_rows(record: dict) -> list[list[str]]:
    ratios = (record.get("comparison") or {}).get("ratios_mega_over_stock") or {}
    base, cand = arm_order(record)
    cols = {arm: _arm_column(record, arm) for arm in (base, cand)}
    rows = [["metric", base, cand, _ratio_label(base, cand)]]
    for i, (label, _, _, rkey) in enumerate(ROWS):
        rows.append([label, cols[base][i], cols[cand][i], _fmt(ratios.get(rkey), "{:.3f}") if rkey else ""])
    rows.append(["steps logged / timed", cols[base][-1], cols[cand][-1], ""])
    return rows


def _title(record: dict) -> str:
    base, cand = arm_order(record)
    if (base, cand) == ARMS:
        return "stock TorchTitan MoE vs mega_moe"
    if cand != f"{base}_repeat":  # e.g. --arms mega_moe,stock
        return f"{base} vs {cand}"
    arms = record["arms"]
    if arms.get(cand, {}).get("arm_overrides") != arms.get(base, {}).get("arm_overrides"):
        return f"{base} vs {cand} (one backend twice, the second with --repeat-args)"
    return f"{base} vs {cand} (one backend twice: the run-to-run noise floor)"


def on_cpu(record: dict) -> bool:
    """Whether the arms trained on a CPU (the device the training log named, else the A/B process's)."""
    return str((record.get("environment") or {}).get("device", "")).lower().startswith("cpu")


CPU_TIMING_NOTE = (
    "CPU run: step times and their ratio are not a performance result. The fused Triton kernels do not run "
    "on a CPU (mega_moe runs the PyTorch reference backend there) and step times on a shared CPU vary from "
    "run to run; read speed from a GPU run, against an --arms stock,stock noise floor"
)


def _notes(record: dict) -> list[str]:
    comp = record.get("comparison") or {}
    ld = comp.get("loss_diff") or {}
    base, cand = arm_order(record)
    notes = list(record.get("diverged") or [])
    if comp.get("arms_differ_in"):
        notes.append(f"arms differ in: {comp['arms_differ_in']}")
    if comp.get("speedup"):
        caveat = " (CPU: not meaningful, see below)" if on_cpu(record) else ""
        notes.append(f"speedup ({base} step time / {cand} step time): {comp['speedup']:.3f}x{caveat}")
    if ld.get("n_steps"):
        same = ", identical" if ld.get("identical") else ""
        common = ld.get("n_common_steps", ld["n_steps"])
        over = f"over {ld['n_steps']} steps" if common == ld["n_steps"] else (
            f"over the {ld['n_steps']} of {common} common steps where it is finite")
        notes.append(
            f"loss |{cand} - {base}| per step: max {_fmt(ld.get('max_abs'), '{:.5f}')} "
            f"(step {ld.get('max_abs_step')}), mean {_fmt(ld.get('mean_abs'), '{:.5f}')} "
            f"{over}{same} (losses as logged, 5 decimals)"
        )
    if ld.get("non_finite_steps"):
        notes.append(f"non-finite loss difference at steps {ld['non_finite_steps']}")
    for arm in (base, cand):
        a = record["arms"].get(arm) or {}
        if a.get("settings"):
            notes.append(f"AC {arm}: {a['settings']['ac_saves']}")
    method = next(
        ((record["arms"][a].get("summary") or {}).get("step_time_method") for a in (base, cand) if a in record["arms"]),
        None,
    )
    if method:
        w = record["warmup"]
        dropped = f"steps 1-{w} (warm-up) left out" if w > 1 else "step 1 (warm-up) left out" if w else "no warm-up steps left out"
        notes.append(f"step time: {method}; {dropped} of all timing medians")
    for w in record.get("warnings", []):
        notes.append(f"warning: {w}")
    if on_cpu(record):
        notes.append(CPU_TIMING_NOTE)
    return notes


def commit_text(env: dict) -> str:
    git = env.get("git") or {}
    if not git.get("commit"):
        return "n/a (not run from a git checkout of this code)"
    return git["commit"][:10] + (" (dirty)" if git.get("dirty") else "")


def _device(env: dict) -> str:
    if str(env.get("device", "")).lower().startswith("cpu") and env.get("cpu"):
        return f"{env['device']} ({env['cpu']}, {env.get('cpu_count')} logical cores)"
    return str(env.get("device"))


def format_table(record: dict) -> str:
    rows = table_rows(record)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    env = record["environment"]
    v = env["versions"]
    commit = commit_text(env)
    lines = [
        f"titan-megamoe A/B: {_title(record)}",
        f"config {record['config']}  steps {record['steps']}  warmup {record['warmup']}  nproc {record['nproc']}"
        f"  seed {record['seed']}  deterministic {record['deterministic']}",
        f"device {_device(env)}  torch {v.get('torch')}  triton {v.get('triton')}  torchtitan {v.get('torchtitan')}"
        f"  commit {commit}",
        "",
    ]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("")
    lines.extend(_notes(record))
    return "\n".join(lines)


def format_markdown(record: dict) -> str:
    rows = table_rows(record)
    env = record["environment"]
    md = [f"# titan-megamoe A/B: {_title(record)}", ""]
    md.append("| " + " | ".join(rows[0]) + " |")
    md.append("|" + "---|" * len(rows[0]))
    md.extend("| " + " | ".join(r) + " |" for r in rows[1:])
    md += ["", *[f"- {n}" for n in _notes(record)], "", "## Settings", ""]
    md += [
        f"- config: `{record['config']}`",
        f"- steps: {record['steps']}, warm-up dropped for timing: {record['warmup']}, nproc: {record['nproc']}",
        f"- seed: {record['seed']}, deterministic: {record['deterministic']}",
        f"- overrides (both arms): `{' '.join(record['overrides']) or '(none)'}`",
        f"- arms differ in: {(record.get('comparison') or {}).get('arms_differ_in', 'n/a (an arm did not run)')}",
    ]
    for arm in arm_order(record):
        a = record["arms"].get(arm)
        if not a:
            continue
        s = a.get("settings") or {}
        info = a.get("run_info") or {}
        md += [
            "",
            f"### {arm}",
            "",
            f"- status: {'ok' if a.get('ok') else 'FAILED: ' + str(a.get('failure'))}, exit code {a.get('returncode')},"
            f" wall {a.get('wall_s', 0):.1f} s, log `{a.get('log')}`",
            f"- command: `{a.get('command_line')}`",
            f"- overrides (this arm only): `{' '.join(a.get('arm_overrides') or []) or '(none)'}`",
            "- [mega_moe]: " + ", ".join(f"{k} {v}" for k, v in (a.get("mega_moe") or {}).items()),
            f"- model: {s.get('model')}, local batch {info.get('local_batch_size', s.get('local_batch_size'))},"
            f" seq len {info.get('seq_len', s.get('seq_len'))},"
            f" tokens/step/rank {(a.get('summary') or {}).get('tokens_per_step_per_rank')}",
            f"- activation checkpointing: {s.get('ac_saves')} (settings from {s.get('source', 'TOML + overrides')})",
        ]
    v = env["versions"]
    git = env.get("git") or {}
    md += [
        "",
        "## Environment",
        "",
        f"- date: {env['date']}, host: {env['host']}, platform: {env['platform']}, python {env['python']}",
        f"- device: {_device(env)} (from the {env['device_source']}), peak FLOPS for MFU: {env.get('peak_flops_for_mfu')}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- git: {git.get('commit') or commit_text(env)}{' (dirty)' if git.get('dirty') else ''}"
        f"{' (' + git['how'] + ')' if git.get('how') else ''}",
        "",
        "TFLOP/s and MFU are TorchTitan's: model FLOPs per token x tps, the same FLOP count in both arms, so their"
        " ratio equals the tps ratio. TorchTitan 0.2.2 takes the A100 peak (3.12e14) for devices it does not know"
        " (CPU included), so MFU there is not a utilisation.",
        "",
    ]
    return "\n".join(md)


def _visible_non_finite(obj: Any) -> Any:
    """JSON has no NaN/inf, and null would read as "missing": store them as the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _visible_non_finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_visible_non_finite(v) for v in obj]
    return obj


def write_json(record: dict, path: Path) -> None:
    path.write_text(json.dumps(_visible_non_finite(record), indent=2, allow_nan=False) + "\n")


def write_markdown(record: dict, path: Path) -> None:
    path.write_text(format_markdown(record))


def format_rounds(summary: dict, markdown: bool = False) -> str:
    """A `--rounds` A/B: one row per round and the spread over the rounds (console text or ab.md)."""
    base, cand = summary["arm_order"]
    label = _ratio_label(base, cand)
    head = ["round", "ran first", f"{base} step s", f"{cand} step s", "speedup", f"tok/s {label}",
            "max loss diff", "ok"]
    rows = [[str(r["round"]), (r.get("run_order") or ["?"])[0], _fmt(r["step_time_s"].get(base), "{:.4f}"),
             _fmt(r["step_time_s"].get(cand), "{:.4f}"), _fmt(r["speedup"], "{:.3f}x"), _fmt(r["tps_ratio"], "{:.3f}"),
             _fmt(r["loss_diff_max"], "{:.5f}"), "yes" if r["ok"] else "NO"] for r in summary["per_round"]]
    env = summary.get("environment") or {}
    title = (f"titan-megamoe A/B, {summary['rounds_run']} of {summary['rounds']} rounds: {base} vs {cand}; "
             f"config {summary['config']}, {summary['steps']} steps, warm-up {summary['warmup']}, "
             f"deterministic {summary['deterministic']}; device {_device(env) if env else '?'}, "
             f"commit {commit_text(env) if env else '?'}")
    notes = []
    for key, what, spec in (("speedup", f"speedup ({base} step time / {cand} step time)", "{:.3f}x"),
                            ("tps_ratio", f"tokens/s {label}", "{:.3f}"),
                            ("loss_diff_max", f"loss |{cand} - {base}| max per round", "{:.5f}")):
        s = summary.get(key)
        if s:
            notes.append(f"{what}: median {spec.format(s['median'])}, min {spec.format(s['min'])}, "
                         f"max {spec.format(s['max'])} over {s['n']} rounds")
    if summary.get("arms_differ_in"):
        notes.append(f"arms differ in: {summary['arms_differ_in']}")
    notes.append("each round's full table, settings and logs: its folder (" +
                 ", ".join(r["dir"] for r in summary["per_round"]) + ")")
    if markdown:
        md = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(md + ["", *[f"- {n}" for n in notes], ""])
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [title, ""] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    return "\n".join(lines + [""] + notes)
