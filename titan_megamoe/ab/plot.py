"""ab.png: loss per step of both arms, their step times after the warm-up, and |loss difference|.

The step-time panel shows the timed steps only (the warm-up's compile step can take 30x a timed one and
would flatten the rest), and says how many warm-up steps it leaves out; the title carries the speedup.
"""

from __future__ import annotations

import math
from pathlib import Path

COLORS = ("tab:blue", "tab:orange")  # baseline, candidate


def _finite_points(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def title(record: dict) -> str:
    from .report import arm_order, on_cpu

    base, cand = arm_order(record)
    speedup = (record.get("comparison") or {}).get("speedup")
    head = f"titan-megamoe A/B: {Path(record['config']).name}"
    if not speedup:
        return head
    caveat = " (CPU: not a performance result)" if on_cpu(record) else ""
    return f"{head}\nspeedup {speedup:.3f}x ({base} step time / {cand} step time){caveat}"


def build_figure(record: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import arm_order

    fig, (ax_loss, ax_time, ax_diff) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    base, cand = arm_order(record)
    colors = dict(zip((base, cand), COLORS))
    warmup = record.get("warmup", 0)
    for arm, a in record["arms"].items():
        steps = a.get("steps") or []
        if not steps:
            continue
        x, y = _finite_points([s["step"] for s in steps], [s["loss"] for s in steps])
        ax_loss.plot(x, y, marker=".", label=arm, color=colors.get(arm))
        times = (a.get("summary") or {}).get("step_time_s_per_step") or {}
        timed = sorted(int(k) for k in times if int(k) > warmup)
        if timed:
            ax_time.plot(timed, [times[str(k)] for k in timed], marker=".", label=arm, color=colors.get(arm))
    diffs = ((record.get("comparison") or {}).get("loss_diff") or {}).get("per_step") or {}
    if diffs:
        dx, dy = _finite_points(sorted(int(k) for k in diffs), [diffs[k] for k in sorted(diffs, key=int)])
        ax_diff.plot(dx, dy, marker=".", color="tab:red")
    ax_diff.set_ylim(bottom=0)
    ax_loss.set_ylabel("loss")
    left_out = f"steps 1-{warmup}" if warmup > 1 else "step 1" if warmup == 1 else "no steps"
    ax_time.set_ylabel("step time (s)")
    ax_time.set_title(f"step time ({left_out} of warm-up not shown, not timed)", fontsize="medium")
    ax_diff.set_ylabel(f"|loss {cand} - {base}|")
    ax_diff.set_xlabel("step")
    ax_loss.set_title(title(record))
    for ax in (ax_loss, ax_time):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for ax in (ax_loss, ax_time, ax_diff):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_ab(record: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(record)
    fig.savefig(path, dpi=100)
    plt.close(fig)
