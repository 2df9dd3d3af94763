"""ab.png: loss per step of both arms, their step times (warm-up shaded) and |loss difference|."""

from __future__ import annotations

from pathlib import Path

COLORS = ("tab:blue", "tab:orange")  # baseline, candidate


def plot_ab(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import arm_order

    fig, (ax_loss, ax_time, ax_diff) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    base, cand = arm_order(record)
    colors = dict(zip((base, cand), COLORS))
    for arm, a in record["arms"].items():
        steps = a.get("steps") or []
        if not steps:
            continue
        x = [s["step"] for s in steps]
        ax_loss.plot(x, [s["loss"] for s in steps], marker=".", label=arm, color=colors.get(arm))
        times = (a.get("summary") or {}).get("step_time_s_per_step") or {}
        if times:
            tx = sorted(int(k) for k in times)
            ax_time.plot(tx, [times[str(k)] for k in tx], marker=".", label=arm, color=colors.get(arm))
    diffs = ((record.get("comparison") or {}).get("loss_diff") or {}).get("per_step") or {}
    if diffs:
        dx = sorted(int(k) for k in diffs)
        ax_diff.plot(dx, [diffs[str(k)] for k in dx], marker=".", color="tab:red")
    warmup = record.get("warmup", 0)
    if warmup:
        ax_time.axvspan(0.5, warmup + 0.5, color="0.9", label="warm-up (not timed)")
    ax_loss.set_ylabel("loss")
    ax_time.set_ylabel("step time (s)")
    ax_diff.set_ylabel(f"|loss {cand} - {base}|")
    ax_diff.set_xlabel("step")
    ax_loss.set_title(f"titan-megamoe A/B: {Path(record['config']).name}")
    for ax in (ax_loss, ax_time):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for ax in (ax_loss, ax_time, ax_diff):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
