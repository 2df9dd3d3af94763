#!/usr/bin/env python3
"""Issue 14's training targets from `titan-megamoe ab` results: FP8 speed and the 200-step loss rule.

Reads the ab.json of several A/B runs of one config (any arms), names each arm by what it ran (expert
path and precision, dense layers' float8 Linear recipe, torch.compile), and writes:

- speed: tokens/s of every arm; mega_moe `fp8` against the fastest of stock's four float8 variants given
  (float8 Linear tensorwise or rowwise, each with or without stock's float8 grouped_mm on the experts;
  target >= 1.6x against the fastest of all four) and against stock bf16 (target >= 1.45x), both compiled
  as the mega_moe arm is. With fewer than four variants given a miss is a miss (the fastest of the four is
  no slower than those given), but a ratio that meets the target leaves `met` null (`met_among_given`
  true) and the report names the missing variants. Arms of different A/B runs ran in different processes
  one after another on the same GPU: the ratios carry that run-to-run noise (stated in the report).
- loss: per step, |mega_moe fp8 - mega_moe bf16| beside |stock float8 - stock bf16| over the same
  steps (the arms with the most steps), as mean, median, max and mean over the second half; each is
  held against stock's (TorchTitan's own FP8 recipe is the accepted tolerance) and reported met or not.
  Beside them, not part of the rule: each pair's signed mean (a curve that stays below or above the other
  shows there, where the |difference| cannot say which) and the bf16 floor |mega_moe bf16 - stock bf16|,
  two bf16 runs that differ only in summation order (and, arms of separate A/B runs, in the run).
- where the curves part, not part of the rule either: for each FP8 pair the first step whose |difference|
  exceeds the largest |difference| of the bf16 floor over the whole run, the pair's signed mean from there
  on, both arms' loss and gradient norm around that step, and each arm's share of steps whose gradient
  norm was clipped (above `training.max_norm`) in the first quarter of the run and after it.

Runs of several `--seed`s (`ab.json`'s seed) are compared within each seed, and a table gives each seed's
signed second-half offsets: an FP8 bias moves mega_moe fp8's the same way in every seed, a chaotic
divergence of one pair of runs either way. The sections before that table show the first seed.

    python scripts/fp8_training_compare.py AB_DIR_OR_JSON[:ARM[,ARM]] [...] --out docs/results/fp8_training_<stamp>

`:ARM` takes only those arms of a file (e.g. to leave out an arm that failed or ran superseded code; the
report lists what was taken from where). `--fp8-arm fp8_bwd` sets mega_moe `fp8_bwd` (bf16 forward, FP8
backward) where mega_moe `fp8` stands above, in the loss rule and the speed ratios (those have targets for
`fp8` only); the JSON keys stay `mega_moe_fp8*` and `fp8_arm` says which precision they hold.

Writes compare.json, compare.md and compare.png (loss curves and differences) into --out. No figure is
typed by hand: everything comes from the ab.json files, which are copied beside the outputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

SPEED_TARGETS = {"stock_float8_fastest": 1.6, "stock_bf16": 1.45}  # issue 14's, for mega_moe fp8
# stock TorchTitan's four float8 variants (experts, dense layers) as describe_arm names them: the 1.6x target
# is against the fastest of all four, so with fewer given only a miss is decided
STOCK_FLOAT8_VARIANTS = tuple((experts, f"float8 Linear {recipe}")
                              for experts in ("stock bf16", "stock float8 rowwise grouped_mm")
                              for recipe in ("tensorwise", "rowwise"))
FP8_ARMS = ("fp8", "fp8_bwd")  # the mega_moe precisions --fp8-arm takes


def _resolved(arm: dict, key: str, default=None):
    node = arm.get("resolved") or arm.get("requested") or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def describe_arm(arm: dict) -> dict:
    """What an arm ran, from its resolved TorchTitan config: experts, dense layers, compile."""
    converters = _resolved(arm, "model.converters", []) or []
    if isinstance(converters, str):
        converters = [c for c in converters.split(",") if c]
    mega = arm.get("mega_moe") or {}
    if mega.get("enable"):
        experts = f"mega_moe {mega.get('precision')}"
    elif any(c.startswith("quantize.grouped_mm.float8") for c in converters):
        experts = "stock float8 rowwise grouped_mm"
    else:
        experts = "stock bf16"
    dense = "bf16 Linear"
    if "quantize.linear.float8" in converters:
        dense = f"float8 Linear {_resolved(arm, 'quantize.linear.float8.recipe_name') or 'tensorwise'}"
    compiled = bool(_resolved(arm, "compile.enable", False))
    label = f"{experts} + {dense}{' (compiled)' if compiled else ''}"
    return {"label": label, "experts": experts, "dense": dense, "compiled": compiled,
            "stock_float8": not mega.get("enable") and (dense != "bf16 Linear" or experts != "stock bf16")}


def load_arms(paths: list[Path], only: dict[Path, list[str] | None]) -> list[dict]:
    arms = []
    for path in paths:
        record = json.loads(path.read_text())
        wanted = only.get(path) or record["arm_order"]
        missing = [a for a in wanted if a not in record["arms"]]
        if missing:
            raise SystemExit(f"{path}: no arm {missing} (arms: {record['arm_order']})")
        for name in wanted:
            arm = record["arms"][name]
            if not arm.get("ok"):
                raise SystemExit(f"{path}: arm {name} failed ({arm.get('failure')}); rerun it before comparing")
            s = arm["summary"]
            arms.append({**describe_arm(arm), "source": str(path), "arm": name, "steps": s["n_steps"],
                         "tps_median": s["tps_median"], "step_time_s": s["step_time_s"],
                         "peak_memory_gib": s["peak_memory_gib"], "final_loss": s["final_loss"],
                         "losses": {st["step"]: st["loss"] for st in arm["steps"]},
                         "grad_norms": {st["step"]: st.get("grad_norm") for st in arm["steps"]},
                         "max_norm": _resolved(arm, "training.max_norm"), "seed": record.get("seed"),
                         "environment": record.get("environment", {})})
    return arms


def _pick(arms: list[dict], pred, what: str, longest: bool = False) -> dict:
    found = [a for a in arms if pred(a)]
    if not found:
        raise SystemExit(f"no arm ran {what}: add the A/B that has one")
    key = (lambda a: (a["steps"], a["tps_median"])) if longest else (lambda a: a["tps_median"])
    return max(found, key=key)


RULE_STATS = ("mean_abs", "median_abs", "max_abs", "mean_abs_last_half")  # the loss rule's statistics


def _stats(signed: list[float]) -> dict:
    """The rule's statistics of |a - b| per step, and the signed mean (a - b) over all and the second half."""
    diffs, half = [abs(d) for d in signed], len(signed) // 2
    return {"mean_abs": statistics.fmean(diffs), "max_abs": max(diffs), "median_abs": statistics.median(diffs),
            "mean_abs_last_half": statistics.fmean(diffs[half:]), "mean_signed": statistics.fmean(signed),
            "mean_signed_last_half": statistics.fmean(signed[half:])}


def loss_rule(arms: list[dict], fp8: str = "fp8") -> dict:
    plain = lambda a: a["dense"] == "bf16 Linear"  # noqa: E731
    mega8 = _pick(arms, lambda a: a["experts"] == f"mega_moe {fp8}" and plain(a), f"mega_moe {fp8}", longest=True)
    mega16 = _pick(arms, lambda a: a["experts"] == "mega_moe bf16" and plain(a), "mega_moe bf16", longest=True)
    stock16 = _pick(arms, lambda a: a["experts"] == "stock bf16" and plain(a), "stock bf16", longest=True)
    stock8 = _pick(arms, lambda a: a["stock_float8"], "a stock float8 recipe", longest=True)
    steps = sorted(set(mega8["losses"]) & set(mega16["losses"]) & set(stock16["losses"]) & set(stock8["losses"]))
    if not steps:
        raise SystemExit("the four arms of the loss rule share no logged step")
    mega = [mega8["losses"][s] - mega16["losses"][s] for s in steps]
    stock = [stock8["losses"][s] - stock16["losses"][s] for s in steps]
    floor = [mega16["losses"][s] - stock16["losses"][s] for s in steps]
    ms, ss = _stats(mega), _stats(stock)
    pairs = {"mega_moe_fp8_vs_bf16": (mega8, mega16, mega), "stock_float8_vs_bf16": (stock8, stock16, stock)}
    return {"parting": parting(steps, floor, pairs), "steps": len(steps),
            "arms": {"mega_moe_fp8": mega8["label"], "mega_moe_bf16": mega16["label"],
                     "stock_float8": stock8["label"], "stock_bf16": stock16["label"]},
            "mega_moe_fp8_vs_bf16": ms, "stock_float8_vs_bf16": ss, "bf16_floor": _stats(floor),
            "met": {k: ms[k] <= ss[k] for k in RULE_STATS},
            "per_step": {s: {"mega_moe": abs(m), "stock": abs(t)} for s, m, t in zip(steps, mega, stock)},
            "curves": {name: [a["losses"][s] for s in steps]
                       for name, a in (("mega_moe_fp8", mega8), ("mega_moe_bf16", mega16),
                                       ("stock_float8", stock8), ("stock_bf16", stock16))}}


PARTING_WINDOW = (-3, 8)  # steps shown around the step where a pair's curves part


def _clipped_share(arm: dict, steps: list[int]) -> float | None:
    """Share of `steps` whose gradient norm exceeded the arm's max_norm (so the optimizer clipped it)."""
    norms = [arm["grad_norms"].get(s) for s in steps]
    if not steps or arm["max_norm"] in (None, 0) or any(n is None for n in norms):
        return None
    return sum(n > arm["max_norm"] for n in norms) / len(steps)


def parting(steps: list[int], floor: list[float], pairs: dict) -> dict:
    """Where each FP8 pair's curves leave each other: the first step whose |difference| exceeds the bf16
    floor's largest |difference| over the run (None: never), the signed mean from there on, the two arms'
    losses and gradient norms around it, and the clipped share of each arm's steps (first quarter, rest)."""
    bound = max(abs(f) for f in floor)
    quarter = max(1, len(steps) // 4)
    out = {"bf16_floor_max_abs": bound}
    for name, (a, b, diffs) in pairs.items():
        first = next((i for i, d in enumerate(diffs) if abs(d) > bound), None)
        lo, hi = PARTING_WINDOW
        window = steps[max(0, first + lo):first + hi] if first is not None else []
        out[name] = {
            "first_step_beyond_floor": steps[first] if first is not None else None,
            "mean_signed_from_there": statistics.fmean(diffs[first:]) if first is not None else None,
            "around": [{"step": s, "loss": [a["losses"][s], b["losses"][s]],
                        "grad_norm": [a["grad_norms"].get(s), b["grad_norms"].get(s)]} for s in window],
            "clipped_share": {label: {"first_quarter": _clipped_share(arm, steps[:quarter]),
                                      "rest": _clipped_share(arm, steps[quarter:])}
                              for label, arm in (("fp8", a), ("bf16", b))},
        }
    return out


def speed(arms: list[dict], fp8: str = "fp8") -> dict:
    # the fastest mega_moe fp8 arm, whatever its dense layers (the issue allows torchao's float8 Linear
    # there when it helps); its label says which ran. The bases are compiled as it is (the issue's A/B
    # compiles both arms), and the float8 base is one of stock's four variants, the fastest of those given
    mega8 = _pick(arms, lambda a: a["experts"] == f"mega_moe {fp8}", f"mega_moe {fp8}")
    compiled = mega8.get("compiled", False)
    state = f"{'' if compiled else 'not '}compiled, as the mega_moe {fp8} arm"
    same = [a for a in arms if a.get("compiled", False) == compiled]
    variants = [a for a in same if a["stock_float8"] and (a["experts"], a["dense"]) in STOCK_FLOAT8_VARIANTS]
    bases = {"stock_float8_fastest": _pick(variants, lambda a: True, f"one of stock's four float8 variants ({state})"),
             "stock_bf16": _pick(same, lambda a: a["experts"] == "stock bf16" and a["dense"] == "bf16 Linear",
                                 f"stock bf16 ({state})")}
    out = {"mega_moe_fp8": mega8["label"], "mega_moe_fp8_tps": mega8["tps_median"]}
    for name, base in bases.items():
        ratio = mega8["tps_median"] / base["tps_median"]
        target = SPEED_TARGETS[name] if fp8 == "fp8" else None
        out[name] = {"label": base["label"], "tps": base["tps_median"], "ratio": ratio,
                     "target": target, "met": None if target is None else ratio >= target}
    given = {(a["experts"], a["dense"]) for a in variants}
    fastest = out["stock_float8_fastest"]
    fastest["variants_given"] = [f"{e} + {d}" for e, d in STOCK_FLOAT8_VARIANTS if (e, d) in given]
    fastest["variants_missing"] = [f"{e} + {d}" for e, d in STOCK_FLOAT8_VARIANTS if (e, d) not in given]
    # the target is against the fastest of all four, which is no slower than the fastest given: a miss
    # against those given is a miss, a ratio that meets it is undecided until all four ran
    fastest["met_among_given"] = fastest["met"]
    if fastest["variants_missing"] and fastest["met"]:
        fastest["met"] = None
    return out


def loss_by_seed(arms: list[dict], fp8: str = "fp8") -> dict:
    """The loss rule for each --seed the runs hold (a pair is only compared within one seed)."""
    seeds = sorted({a["seed"] for a in arms}, key=str)
    return {str(seed): loss_rule([a for a in arms if a["seed"] == seed], fp8) for seed in seeds}


def seeds_markdown(by_seed: dict, fp8: str = "fp8") -> list[str]:
    """One row per seed: an FP8 bias moves the signed means the same way in every seed, a chaotic
    divergence moves them either way."""
    lines = ["## Seeds (each seed's four arms compared among themselves)", "",
             f"| seed | steps | mega_moe {fp8} - bf16, signed, second half | stock float8 - bf16, signed, second half "
             "| bf16 floor, signed, second half | rule met |", "|---|---|---|---|---|---|"]
    pairs = ("mega_moe_fp8_vs_bf16", "stock_float8_vs_bf16", "bf16_floor")
    for seed, lr in by_seed.items():
        signed = [lr[k]["mean_signed_last_half"] for k in pairs]
        lines.append(f"| {seed} | {lr['steps']} | " + " | ".join(f"{v:+.5f}" for v in signed)
                     + f" | {'all' if all(lr['met'].values()) else 'not all'} |")
    mega = [lr["mega_moe_fp8_vs_bf16"]["mean_signed_last_half"] for lr in by_seed.values()]
    same = all(v < 0 for v in mega) or all(v > 0 for v in mega)
    signs = "the same sign in every" if same else "both signs across the"
    lines += ["", f"mega_moe {fp8}'s second-half offset has {signs} {len(mega)} seeds.", ""]
    return lines


def markdown(result: dict) -> str:
    sp, lr, fp8 = result["speed"], result["loss"], result["fp8_arm"]
    seeds = list(result.get("loss_by_seed", {}))
    first_seed = f"; seed {seeds[0]} of {', '.join(seeds)}" if len(seeds) > 1 else ""
    title = "FP8 training targets (issue 14)" if fp8 == "fp8" else f"mega_moe {fp8} in training (no target)"
    lines = [f"# {title}, from `titan-megamoe ab` runs", "",
             "| arm | A/B file | steps | tok/s (median) | step s | peak GiB | final loss |", "|---|---|---|---|---|---|---|"]
    for a in sorted(result["arms"], key=lambda a: -a["tps_median"]):
        lines.append(f"| {a['label']} | `{Path(a['source']).name}` ({a['arm']}) | {a['steps']} | "
                     f"{a['tps_median']:,.0f} | {a['step_time_s']:.4f} | {a['peak_memory_gib']:.1f} | {a['final_loss']:.5f} |")
    lines += ["", "## Speed", ""]
    for name in SPEED_TARGETS:
        s = sp[name]
        if s["target"] is None:
            verdict = "no target"
        elif not s.get("variants_missing"):
            verdict = f"target >= {s['target']}x: {'met' if s['met'] else 'MISSED'}"
        else:
            given = f"{len(s['variants_given'])} of stock's four float8 variants given"
            missing = f"missing: {', '.join(s['variants_missing'])}"
            verdict = f"target >= {s['target']}x (against the fastest of the four): " + (
                f"MISSED ({given}; the fastest of the four is no slower than those; {missing})" if s["met"] is False
                else f"not decided, met against the {given} ({missing})")
        lines.append(f"- {sp['mega_moe_fp8']} ({sp['mega_moe_fp8_tps']:,.0f} tok/s) vs {s['label']} "
                     f"({s['tps']:,.0f}): **{s['ratio']:.3f}x**, {verdict}")
    lines += ["- arms of different A/B runs ran one after another in separate processes on the same GPU",
              "", f"## Loss over {lr['steps']} steps (per-step |difference| of the printed losses){first_seed}", "",
              "| pair | mean | median | max | mean, second half | signed mean | signed, second half |",
              "|---|---|---|---|---|---|---|"]
    for key, name in (("mega_moe_fp8_vs_bf16", f"{lr['arms']['mega_moe_fp8']} - {lr['arms']['mega_moe_bf16']}"),
                      ("stock_float8_vs_bf16", f"{lr['arms']['stock_float8']} - {lr['arms']['stock_bf16']}"),
                      ("bf16_floor", f"bf16 floor, not in the rule: {lr['arms']['mega_moe_bf16']} - "
                                     f"{lr['arms']['stock_bf16']}")):
        s = lr[key]
        lines.append(f"| {name} | {s['mean_abs']:.5f} | {s['median_abs']:.5f} | {s['max_abs']:.5f} | "
                     f"{s['mean_abs_last_half']:.5f} | {s['mean_signed']:+.5f} | {s['mean_signed_last_half']:+.5f} |")
    met = lr["met"]
    verdicts = ", ".join(f"{k.replace('_abs', '').replace('_', ' ')} {'met' if v else 'MISSED'}" for k, v in met.items())
    lines += ["", f"mega_moe's difference no larger than stock's, statistic by statistic: {verdicts} "
              f"({'all met' if all(met.values()) else 'not all met'}). Each pair's arms may come from separate "
              "A/B runs (non-deterministic, same seed). The bf16 floor row is two bf16 runs whose experts differ only in "
              "summation order: what a difference of the two FP8 pairs beyond it owes to FP8 (or to the run).", ""]
    pt = lr["parting"]
    lines += ["## Where the curves part (not part of the rule)", "",
              f"The first step whose |difference| exceeds the bf16 floor's largest over the run "
              f"({pt['bf16_floor_max_abs']:.5f}), the signed mean from there on, and the share of steps whose "
              "gradient norm was clipped (above max_norm), first quarter / rest:", "",
              "| pair | parts at step | signed mean from there | clipped, FP8 arm | clipped, bf16 arm |",
              "|---|---|---|---|---|"]

    def share(c):
        return " / ".join("-" if v is None else f"{v:.0%}" for v in (c["first_quarter"], c["rest"]))

    for key in ("mega_moe_fp8_vs_bf16", "stock_float8_vs_bf16"):
        p = pt[key]
        signed = "-" if p["mean_signed_from_there"] is None else f"{p['mean_signed_from_there']:+.5f}"
        lines.append(f"| {key} | {p['first_step_beyond_floor'] or 'never'} | {signed} | "
                     f"{share(p['clipped_share']['fp8'])} | {share(p['clipped_share']['bf16'])} |")
    for key in ("mega_moe_fp8_vs_bf16", "stock_float8_vs_bf16"):
        if pt[key]["around"]:
            lines += ["", f"{key} around that step (loss FP8 / bf16, gradient norm FP8 / bf16):", "",
                      "| step | loss | gradient norm |", "|---|---|---|"]
            for r in pt[key]["around"]:
                gn = " / ".join("-" if g is None else f"{g:.2f}" for g in r["grad_norm"])
                lines.append(f"| {r['step']} | {r['loss'][0]:.4f} / {r['loss'][1]:.4f} | {gn} |")
    if len(result.get("loss_by_seed", {})) > 1:
        lines += ["", *seeds_markdown(result["loss_by_seed"], fp8)]
    lines += ["", "## Environment of each A/B file", ""]
    for source, env in {Path(a["source"]).name: a["environment"] for a in result["arms"]}.items():
        lines.append(f"- `{source}`: {env.get('date')}, {env.get('device')}, {json.dumps(env.get('versions'))}, "
                     f"git {json.dumps(env.get('git'))}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr = result["loss"]
    steps = [int(s) for s in lr["per_step"]]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, ys in lr["curves"].items():
        ax_loss.plot(steps, ys, label=lr["arms"][name], linewidth=0.8)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=7)
    fp8 = result["fp8_arm"]
    ax_diff.plot(steps, [v["mega_moe"] for v in lr["per_step"].values()],
                 label=f"|mega_moe {fp8} - mega_moe bf16|", linewidth=0.8)
    ax_diff.plot(steps, [v["stock"] for v in lr["per_step"].values()], label="|stock float8 - stock bf16|",
                 linewidth=0.8)
    ax_diff.set_yscale("log")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("|loss difference|")
    ax_diff.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="A/B output directories (or their ab.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--fp8-arm", choices=FP8_ARMS, default="fp8",
                   help="the mega_moe precision set against mega_moe bf16 (default fp8, issue 14's targets)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copies, only, sources = [], {}, {}
    for run in args.runs:  # the inputs travel with the outputs
        name, sep, arm_list = run.rpartition(":")
        if not sep or "/" in arm_list:
            name, arm_list = run, ""
        path = Path(name) / "ab.json" if Path(name).is_dir() else Path(name)
        if path.resolve() in sources.values():
            raise SystemExit(f"{path} is given twice: give it once, with every arm wanted (FILE:ARM1,ARM2)")
        dest = out / (f"{path.parent.name}.ab.json" if path.name == "ab.json" else path.name)
        if dest in sources:  # two runs whose folders share a name
            raise SystemExit(f"{path} and {sources[dest]} would both be copied to {dest}: rename one folder")
        sources[dest] = path.resolve()
        if dest.resolve() != path.resolve():
            shutil.copyfile(path, dest)
        copies.append(dest)
        only[dest] = [a for a in arm_list.split(",") if a] or None
    arms = load_arms(copies, only)
    by_seed = loss_by_seed(arms, args.fp8_arm)
    # the sections above the seeds table (and the plot) show the first seed's runs
    result = {"inputs": {c.name: only[c] or "all arms" for c in copies}, "fp8_arm": args.fp8_arm, "arms": arms,
              "speed": speed(arms, args.fp8_arm), "loss": next(iter(by_seed.values())), "loss_by_seed": by_seed}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    (out / "compare.md").write_text(markdown(result))
    plot(result, out / "compare.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
