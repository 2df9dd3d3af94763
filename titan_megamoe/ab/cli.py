"""`titan-megamoe ab`: train the same config with the stock MoE and with mega_moe, then compare.

Runs the stock arm (`--mega_moe.no-enable`) and then the mega_moe arm (`--mega_moe.enable`) as child
processes of `titan-megamoe train`, same seed and determinism flags, user overrides appended to both.
Writes to the out dir: stock.log, mega_moe.log, ab.json (everything), ab.md (table + settings), ab.png
(loss curves, step times); prints the table last. Exit code 0 when both arms trained and logged metrics,
1 when an arm failed, 2 for a usage error, 130 when interrupted.

`--stock-args "..."` and `--mega-args "..."` add TorchTitan overrides to one arm only (after the common ones),
e.g. stock TorchTitan's float8 recipe as the baseline; ab.json/ab.md record each arm's overrides, its resolved
`[mega_moe]` settings, the router and expert path that ran, and one line "arms differ in: ...". An arm whose
loss or grad_norm turns NaN/inf fails the A/B (exit 1, naming the arm and the first bad step).

`--arms stock,stock` (or `mega_moe,mega_moe`) runs one backend twice instead (`--repeat-args "..."` then
adds overrides to the second arm only, e.g. mega_moe bf16 vs fp8): without them the loss difference and
step-time ratio of that pair are the run-to-run noise floor against which a stock-vs-mega_moe A/B
(especially one without --debug.deterministic) can be read. The second arm is then named `<kind>_repeat`.

`--rounds N` runs the pair N times, each round in `round_<i>/` with its own logs and reports, the arm that
runs first alternating between rounds (a drift of the machine then falls on both arms alike). The top level
gets the summary (ab.json, ab.md): each round's step-time speedup and loss difference, and their median,
min and max, which is what one run's ratio should be read against.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from . import config as cfg
from .arm import ArmResult, python_module_command, run_arm
from .differences import describe, differences, mega_moe_settings
from .environment import environment
from .plot import plot_ab
from .report import format_rounds, format_table, write_json, write_markdown
from .stats import compare, loss_difference, rounds_summary, summarize_arm

DEFAULT_STEPS = 12
DEFAULT_WARMUP = 2
DEFAULT_SEED = 42
ARM_KINDS = {"stock": False, "mega_moe": True}  # kind -> [mega_moe] enable
ARM_ARGS = {"--stock-args": "stock", "--mega-args": "mega_moe",  # per-arm overrides option -> arm kind
            "--repeat-args": "repeat"}  # ... and for the second arm of a repeated kind only
DEFAULT_ARMS = "stock,mega_moe"
SAVED_CONFIG = "resolved_config.json"  # written by the trainer into each arm's dump folder
# Overrides that would break the comparison or the parsing; each has its own option here.
RESERVED = {
    "mega_moe.enable": "the A/B sets it per arm",
    "training.steps": "use --steps",
    "debug.seed": "use --seed",
    "metrics.log_freq": "the A/B needs a metric line every step",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-megamoe ab",
        description="Train one config with the stock TorchTitan MoE and with mega_moe; compare speed, memory, loss.",
        epilog="TorchTitan overrides for both arms go after `--`, e.g. "
        "`titan-megamoe ab --steps 20 -- --activation_checkpoint.mode full`",
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"TOML path or bundled config name (default: bundled {cfg.DEFAULT_CONFIG}, the CPU demo)",
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per arm (default {DEFAULT_STEPS})")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,  # DEFAULT_WARMUP when not given (main), so that its error can say which
        help=f"first steps left out of the timing statistics (default {DEFAULT_WARMUP})",
    )
    p.add_argument("--out", default="ab_out", help="output directory (default ./ab_out)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the pair this many times, alternating which arm runs first; the summary gives "
                   "every round's speedup and their spread (default 1)")
    p.add_argument("--nproc", type=int, default=None, help="processes per arm, passed to `titan-megamoe train`")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"--debug.seed of both arms (default {DEFAULT_SEED})")
    p.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help="the two arms, baseline first: stock,mega_moe (default); stock,stock or mega_moe,mega_moe "
        "measure the run-to-run noise floor of one backend",
    )
    for option, kind in ARM_ARGS.items():  # taken out of argv before argparse (their values start with --)
        if kind == "repeat":
            p.add_argument(option, metavar='"ARGS"', default="",
                           help="with --arms stock,stock or mega_moe,mega_moe: overrides for the second arm only "
                           "(after that kind's own), e.g. --arms mega_moe,mega_moe --repeat-args "
                           "\"--mega_moe.precision fp8\" compares mega_moe bf16 with mega_moe fp8")
            continue
        p.add_argument(option, metavar='"ARGS"', default="",
                       help=f"TorchTitan overrides for the {kind} arm(s) only, one quoted string, "
                       f"e.g. {option} \"--compile.enable\"")
    p.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_false",
        help="do not pass --debug.deterministic (faster on GPU; loss curves then need not match bit for bit)",
    )
    return p


def parse_arms(text: str) -> list[tuple[str, bool]]:
    """'stock,mega_moe' -> [(arm name, mega flag), ...]; a repeated kind gets the name '<kind>_repeat'."""
    kinds = [k.strip() for k in text.split(",")]
    if len(kinds) != 2 or any(k not in ARM_KINDS for k in kinds):
        raise ValueError(f"--arms takes two of {', '.join(ARM_KINDS)} separated by a comma, got {text!r}")
    names = [kinds[0], kinds[1] + "_repeat" if kinds[1] == kinds[0] else kinds[1]]
    return [(name, ARM_KINDS[kind]) for name, kind in zip(names, kinds)]


def take_arm_args(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Remove `--stock-args V` / `--mega-args=V` / `--repeat-args V` from our options: (rest, {arm kind or
    "repeat": overrides}).

    argparse would read a value starting with `--` as an option, so these are taken out first."""
    rest, per_kind, i = [], {kind: [] for kind in ARM_ARGS.values()}, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in ARM_ARGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f'{name} needs a value, e.g. {name} "--optimizer.lr 1e-3"')
                value, i = argv[i + 1], i + 1
            try:
                per_kind[ARM_ARGS[name]] += shlex.split(value)
            except ValueError as e:
                raise ValueError(f"{name} {value!r}: {e}") from None
        else:
            rest.append(argv[i])
        i += 1
    return rest, per_kind


def own_overrides(arm_args: dict[str, list[str]], arm: str, mega: bool) -> list[str]:
    """The overrides of one arm only: its kind's, then --repeat-args for the second arm of a repeated kind."""
    own = arm_args["mega_moe" if mega else "stock"]
    return own + arm_args["repeat"] if arm.endswith("_repeat") else own


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def arm_command(args: argparse.Namespace, config_path: Path, out: Path, arm: str, mega: bool, overrides: list[str]):
    cmd = ["train", "--config", str(config_path)]
    if args.nproc is not None:
        cmd += ["--nproc", str(args.nproc)]
    # [mega_moe] enable is a bool field: TorchTitan's CLI (tyro) spells it as a flag pair
    cmd.append("--mega_moe.enable" if mega else "--mega_moe.no-enable")
    cmd += ["--training.steps", str(args.steps), "--debug.seed", str(args.seed)]
    if args.deterministic:
        cmd.append("--debug.deterministic")
    cmd += ["--metrics.log_freq", "1", "--metrics.disable_color_printing"]
    cmd += ["--job.dump_folder", str((out / arm).resolve()), "--job.save_config_file", SAVED_CONFIG]
    return python_module_command(*cmd, *overrides)


def _arm_record(result: ArmResult, args, values: dict, mega: bool, out: Path, arm_args: list[str]) -> dict:
    parser = result.parser
    requested = cfg.apply_overrides(values, [("mega_moe.enable", mega)])  # the flag is on the command line
    saved = cfg.load_saved(out / result.name / SAVED_CONFIG)
    if saved is not None:  # the JobConfig the trainer itself resolved: the authority
        values = saved
        settings = {**cfg.arm_settings(values, mega), "source": str(out / result.name / SAVED_CONFIG)}
    else:
        values = requested
        settings = cfg.arm_settings(values, mega)
    tokens = parser.tokens_per_step
    if tokens is None and isinstance(settings.get("local_batch_size"), int) and isinstance(settings.get("seq_len"), int):
        tokens = settings["local_batch_size"] * settings["seq_len"]
    non_dp = 1
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        non_dp *= int(cfg.setting(values, f"parallelism.{key}") or 1)
    summary = summarize_arm(parser.steps, args.warmup, parser.start_time, tokens, non_dp)
    return {
        "ok": result.ok,
        "failure": result.failure,
        "returncode": result.returncode,
        "interrupted": result.interrupted,
        "wall_s": result.wall_s,
        "command": result.command,
        "command_line": shlex.join(result.command),
        "log": str(result.log_path),
        "arm_overrides": arm_args,
        "settings": settings,
        "mega_moe": mega_moe_settings(values, parser.info.get("mega_moe_swap")),
        "requested": requested,  # TOML + overrides (+ the arm's flag)
        "resolved": saved,  # the trainer's whole JobConfig, None when it wrote none
        "run_info": dict(parser.info),
        "summary": summary,
        "steps": [s.to_json() for s in parser.steps],
    }


NOISY_IQR = 0.25  # interquartile range of the timed step times, relative to their median
FEW_TIMED_STEPS = 5


def _warnings(record: dict, steps: int) -> list[str]:
    out = []
    for arm, a in record["arms"].items():
        s = a["summary"]
        if a["ok"] and s["n_timed_steps"] < FEW_TIMED_STEPS:
            out.append(f"{arm}: only {s['n_timed_steps']} timed steps; use more --steps for a timing comparison")
        if s.get("step_time_iqr_s") and s.get("step_time_s"):
            q1, q3 = s["step_time_iqr_s"]
            spread = (q3 - q1) / s["step_time_s"]
            if spread > NOISY_IQR:
                out.append(
                    f"{arm}: step times are noisy (interquartile range {100 * spread:.0f}% of the median); "
                    f"is the machine shared? treat the timing ratios with care"
                )
        if a["ok"] and s["n_steps"] != steps:
            out.append(f"{arm}: {s['n_steps']} step lines parsed, {steps} requested")
        # step 1's tps interval starts before "Training starts": compare only when step 1 is not timed
        wall, tps = s.get("step_time_s"), s.get("step_time_from_tps_s")
        if record["warmup"] >= 1 and wall and tps and wall > 0.05 and abs(wall - tps) > 0.1 * wall:
            out.append(
                f"{arm}: step time from timestamps ({wall:.4f} s) and from tokens/tps ({tps:.4f} s) differ by >10%"
            )
    return out


def _check_mega_moe(values: dict, arm: str, mega: bool) -> None:
    """The `[mega_moe]` values this arm would start with (and, for a mega_moe arm, whether this machine can run
    them): a bad one is our one-line error before any arm runs, not a failed run after the other arm trained."""
    from ..integrations.launch import check_mega_moe

    problem = check_mega_moe(values, enabled=mega)
    if problem:
        raise cfg.ConfigError(f"{arm} arm: {problem}")


def _divergence(record: dict) -> list[str]:
    out = []
    for arm, a in record["arms"].items():
        bad = (a.get("summary") or {}).get("first_non_finite")
        if bad:
            out.append(f"{arm} arm diverged: {bad['metric']} {bad['value']} at step {bad['step']} (the first "
                       f"non-finite loss or grad_norm); lower the learning rate or check that arm's overrides")
    return out


def _failure_cause(result: ArmResult) -> str:
    """The first error in the arm's log (the trainer's own last line names it), else its log's tail."""
    from ..integrations.failure import first_error

    try:
        cause = first_error(result.log_path.read_text(errors="replace"))
    except OSError:
        cause = None
    return cause or "no error message in the log"


def _run_round(args, argv, config_path: Path, overrides, arm_args, arm_values, arms, run_order, out: Path):
    """Train both arms once, in `run_order`, into `out`; write ab.json, ab.md, ab.png there and print the
    table. Returns (record, error lines, interrupted)."""
    results: list[tuple[ArmResult, bool]] = []
    interrupted = False

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for arm, mega in run_order:
            command = arm_command(args, config_path, out, arm, mega, overrides + own_overrides(arm_args, arm, mega))
            result = run_arm(arm, command, out / f"{arm}.log", args.steps)
            results.append((result, mega))
            if result.interrupted:
                interrupted = True
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)

    record = {
        "tool": "titan-megamoe ab",
        "argv": argv,
        "config": str(config_path),
        "steps": args.steps,
        "warmup": args.warmup,
        "nproc": args.nproc or 1,
        "seed": args.seed,
        "deterministic": args.deterministic,
        "overrides": overrides,
        "arm_order": [name for name, _ in arms],  # (baseline, candidate): the report's roles
        "run_order": [name for name, _ in run_order],
        "interrupted": interrupted,
        "arms": {
            r.name: _arm_record(r, args, arm_values[r.name], mega, out, own_overrides(arm_args, r.name, mega))
            for r, mega in results
        },
    }
    info = next((r.parser.info for r, _ in results if r.parser.info.get("device_name")), {})
    record["environment"] = environment(info)
    by_name = {r.name: r for r, _ in results}
    (base, _), (cand, _) = arms
    if base in by_name and cand in by_name:
        # "ratios_mega_over_stock" keeps its name in ab.json: it is always the second arm over the first
        comparison = compare(record["arms"][base]["summary"], record["arms"][cand]["summary"])
        comparison["loss_diff"] = loss_difference(by_name[base].parser.steps, by_name[cand].parser.steps)
        comparison["baseline"], comparison["candidate"] = base, cand
        diffs = differences(record["arms"][base], record["arms"][cand])
        comparison["differences"], comparison["arms_differ_in"] = diffs, describe(diffs)
        record["comparison"] = comparison
    record["warnings"] = _warnings(record, args.steps)
    diverged = _divergence(record)
    record["diverged"] = diverged
    ok = len(results) == len(arms) and all(r.ok for r, _ in results) and not interrupted and not diverged
    record["ok"] = ok
    # the lines the screen ends with: why the A/B failed, each with its fix or its log
    errors = [f"[{r.name}] FAILED ({r.failure}): {_failure_cause(r)}  [full log: {r.log_path}]"
              for r, _ in results if not r.ok and not r.interrupted] + diverged

    write_json(record, out / "ab.json")
    write_markdown(record, out / "ab.md")
    try:
        plot_ab(record, out / "ab.png")
    except Exception as e:  # noqa: BLE001 - a plotting problem must not hide the numbers
        print(f"titan-megamoe ab: could not draw ab.png: {e}", file=sys.stderr)
    sys.stderr.flush()
    print(f"\nwrote {out / 'ab.json'}, {out / 'ab.md'}, {out / 'ab.png'}, arm logs in {out}\n")
    print(format_table(record))
    sys.stdout.flush()
    return record, errors, interrupted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, overrides = _split_overrides(argv)
    parser = build_parser()
    try:
        ours, arm_args = take_arm_args(ours)
    except ValueError as e:
        parser.error(str(e))
    args, unknown = parser.parse_known_args(ours)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (TorchTitan overrides go after `--`)")
    given = args.warmup is not None
    if not given:
        args.warmup = DEFAULT_WARMUP
    if args.steps < 1 or args.warmup < 0 or args.warmup >= args.steps:
        parser.error(f"need --steps >= 1 and 0 <= --warmup < --steps (got steps {args.steps}, warmup {args.warmup}"
                     f"{'' if given else ', the default'}); pass --steps N and --warmup W with W < N")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        arms = parse_arms(args.arms)
    except ValueError as e:
        parser.error(str(e))
    for flag, kind in ARM_ARGS.items():  # an arm kind's overrides with no arm of that kind: nothing would use them
        if kind in ARM_KINDS and arm_args[kind] and all(mega != ARM_KINDS[kind] for _, mega in arms):
            parser.error(f"{flag} applies to {kind} arms and --arms {args.arms!r} has none; drop it or change --arms")
    if arm_args["repeat"] and not arms[1][0].endswith("_repeat"):
        parser.error(f"--repeat-args needs one kind twice in --arms (e.g. mega_moe,mega_moe), got {args.arms!r}")
    try:
        config_path = cfg.resolve_config_path(args.config)
        arm_values = {}
        for arm, mega in arms:
            arm_overrides = overrides + own_overrides(arm_args, arm, mega)
            # the keys as written, before parsing values: `--mega_moe.enable false` is reserved first
            keys = {cfg.flag_key(a)[0] for a in arm_overrides if a.startswith("--") and len(a) > 2}
            for key, why in RESERVED.items():
                if key in keys:
                    raise cfg.ConfigError(f"override --{key} is not allowed here: {why}")
            arm_values[arm] = cfg.load_config(config_path, arm_overrides)
            _check_mega_moe(arm_values[arm], arm, mega)
    except cfg.ConfigError as e:
        print(f"titan-megamoe ab: {e}", file=sys.stderr)
        return 2

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"titan-megamoe ab: --out {out} is an existing file, not a directory; "
              f"pass a new or existing directory (e.g. --out {out}_ab)", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"titan-megamoe ab: cannot create --out {out}: {e.strerror or e}; pass a writable directory",
              file=sys.stderr)
        return 2
    records, errors, interrupted = [], [], False
    round_dirs = [out] if args.rounds == 1 else [out / f"round_{i}" for i in range(1, args.rounds + 1)]
    for i, round_out in enumerate(round_dirs):
        if args.rounds > 1:
            round_out.mkdir(parents=True, exist_ok=True)
            print(f"\n== titan-megamoe ab: round {i + 1}/{args.rounds}", flush=True)
        run_order = arms if i % 2 == 0 else arms[::-1]  # alternate which arm runs first
        record, round_errors, interrupted = _run_round(args, argv, config_path, overrides, arm_args, arm_values, arms,
                                                       run_order, round_out)
        records.append(record)
        errors += [f"round {i + 1}: {e}" if args.rounds > 1 else e for e in round_errors]
        if interrupted:
            break
    ok = all(r["ok"] for r in records) and not interrupted
    if args.rounds > 1:
        summary = rounds_summary(records, [str(d.relative_to(out)) for d in round_dirs[:len(records)]], args.rounds)
        summary.update(tool="titan-megamoe ab", argv=argv, ok=ok)
        write_json(summary, out / "ab.json")
        (out / "ab.md").write_text(format_rounds(summary, markdown=True))
        print(f"\nwrote {out / 'ab.json'}, {out / 'ab.md'}; each round's reports in {out}/round_<i>/\n")
        print(format_rounds(summary))
        sys.stdout.flush()
    for line in errors:
        print(f"titan-megamoe ab: {line}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
