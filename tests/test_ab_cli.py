"""`titan-megamoe ab` end to end: with a fake trainer (fast, checks the plumbing) and with the real one (slow)."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from titan_megamoe.ab import cli as ab_cli
from titan_megamoe.ab import config as cfg
from titan_megamoe.ab.arm import run_arm

FAKE_TRAINER = textwrap.dedent(
    '''
    """Prints a TorchTitan-0.2.2-shaped log; fails like the real trainer on --mega_moe.precision fp8."""
    import datetime as dt, json, os, sys, time
    args = sys.argv[1:]
    def opt(name, default=None):
        return args[args.index(name) + 1] if name in args else default
    mega = "--mega_moe.enable" in args
    assert mega or "--mega_moe.no-enable" in args
    steps = int(opt("--training.steps"))
    lr = float(opt("--optimizer.lr", "8e-4"))  # 1e12: the loss turns NaN from step 3, as a diverging run does
    def log(msg):
        t = dt.datetime.now()
        print(f"[titan] {t:%Y-%m-%d %H:%M:%S},{t.microsecond // 1000:03d} - root - INFO - {msg}", flush=True)
    log("CPU capacity: FakeCPU 9000 with 31.00GiB memory")
    if mega:
        log("[mega_moe] swapped 2 MoE layers to the fused op: precision=bf16, backend=reference, router stock, AC none")
    if mega and opt("--mega_moe.precision") == "fp8":
        print("Traceback (most recent call last):")
        print("NotImplementedError: precision='fp8' is not implemented yet in titan-megamoe")
        sys.exit(1)
    dump = opt("--job.dump_folder")
    os.makedirs(dump, exist_ok=True)
    json.dump({"model": {"name": "qwen3", "flavor": "fake"},
               "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
               "mega_moe": {"enable": mega, "save_under_sac": False}, "optimizer": {"lr": lr}},
              open(os.path.join(dump, opt("--job.save_config_file")), "w"))
    log("Trainer is initialized with local batch size 2, global batch size 2, gradient accumulation steps 1, "
        "sequence length 32, total steps %d (warmup 1)" % steps)
    log("Training starts at step 1")
    for step in range(1, steps + 1):
        time.sleep(0.06)
        loss = 8.0 - 0.25 * step + (0.001 if mega and step > 1 else 0.0)
        gnorm = 1.0
        if lr > 1e6 and step >= 2:
            loss, gnorm = (float("nan"), float("inf")) if step >= 3 else (loss, float("inf"))
        log(f"\\033[31mstep: {step:2}  \\033[32mloss: {loss:8.5f}  grad_norm: {gnorm:7.4f}  "
            f"memory: {0.0:5.2f}GiB(0.00%)  tps: {1066:,}  tflops: 0.00  mfu: 0.00%\\033[39m")
    log("Training completed")
    '''
)


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(ab_cli, "python_module_command", lambda *a: [sys.executable, str(script), *a[1:]])
    config = tmp_path / "c.toml"
    config.write_text('[model]\nname = "qwen3"\n[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n')
    return config


def check_outputs(out: Path, steps: int):
    for name in ("ab.json", "ab.md", "ab.png", "stock.log", "mega_moe.log"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    record = json.loads((out / "ab.json").read_text())
    assert set(record["arms"]) == {"stock", "mega_moe"}
    for arm in record["arms"].values():
        assert arm["ok"] and arm["returncode"] == 0
        assert [s["step"] for s in arm["steps"]] == list(range(1, steps + 1))
        assert all(math.isfinite(s["loss"]) for s in arm["steps"])
        for key in ("step_time_s", "tps_median", "tflops_median", "mfu_pct_median", "peak_memory_gib", "final_loss"):
            assert math.isfinite(arm["summary"][key]), key
        assert arm["summary"]["step_time_s"] > 0
    comp = record["comparison"]
    assert math.isfinite(comp["loss_diff"]["max_abs"]) and comp["loss_diff"]["n_steps"] == steps
    assert math.isfinite(comp["ratios_mega_over_stock"]["step_time"])
    assert "--mega_moe.no-enable" in record["arms"]["stock"]["command"]
    assert "--mega_moe.enable" in record["arms"]["mega_moe"]["command"]
    assert "# titan-megamoe A/B" in (out / "ab.md").read_text()
    return record


def test_fake_trainer_run(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "4", "--warmup", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    record = check_outputs(out, 4)
    assert record["arms"]["stock"]["run_info"]["device_name"] == "FakeCPU 9000"
    assert record["environment"]["device"] == "FakeCPU 9000"
    assert record["arms"]["mega_moe"]["settings"]["ac_saves"].endswith("fused MoE op recomputed (mega_moe.save_under_sac=false)")
    assert record["comparison"]["loss_diff"]["max_abs"] == pytest.approx(0.001)
    assert "[mega_moe] step 4/4 loss 7.0010" in captured.out
    assert captured.out.rstrip().splitlines()[-1].startswith(("step time:", "warning:"))  # the table comes last
    assert "mega/stock" in captured.out and "speedup" in captured.out
    assert "--debug.deterministic" in record["arms"]["stock"]["command"]
    # what differs, said: the flag, and the expert path that ran (the router is stock's in both: reference backend)
    mm = record["arms"]["mega_moe"]["mega_moe"]
    assert (mm["enable"], mm["backend"], mm["router_ran"], mm["experts_ran"]) == (
        True, "auto", "stock", "fused op (reference backend, bf16)")
    assert record["arms"]["stock"]["mega_moe"]["router_ran"] == "stock"
    differ = record["comparison"]["arms_differ_in"]
    assert differ == "mega_moe.enable (False vs True); experts_ran (stock GroupedExperts vs fused op (reference backend, bf16))"
    assert f"arms differ in: {differ}" in captured.out and f"arms differ in: {differ}" in (out / "ab.md").read_text()


def test_per_arm_overrides_and_a_diverging_arm_fails(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "4", "--warmup", "1", "--out", str(out),
                      "--stock-args", "--optimizer.lr 1e12", "--mega-args=--training.seq_len 32", "--", "--debug.x", "1"])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("titan-megamoe ab: stock arm diverged: grad_norm inf at step 2"), last
    record = json.loads((out / "ab.json").read_text())
    stock, mega = record["arms"]["stock"], record["arms"]["mega_moe"]
    assert stock["arm_overrides"] == ["--optimizer.lr", "1e12"] and mega["arm_overrides"] == ["--training.seq_len", "32"]
    assert stock["command"][-4:] == ["--debug.x", "1", "--optimizer.lr", "1e12"] and "1e12" not in mega["command"]
    assert record["ok"] is False and record["diverged"]
    assert stock["summary"]["first_non_finite"] == {"step": 2, "metric": "grad_norm", "value": "inf"}
    assert [s["loss"] for s in stock["steps"]][2:] == ["nan", "nan"]  # visible in ab.json, not null
    ld = record["comparison"]["loss_diff"]
    assert ld["n_steps"] == 2 and ld["n_common_steps"] == 4 and ld["max_abs_step"] == 2
    assert ld["non_finite_steps"] == [3, 4]
    assert {"key": "optimizer.lr", "base": 1e12, "cand": 8e-4} in record["comparison"]["differences"]
    md = (out / "ab.md").read_text()
    assert "overrides (this arm only): `--optimizer.lr 1e12`" in md and "over the 2 of 4 common steps" in md


def test_bad_per_arm_value_stops_before_any_run(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--out", str(out), "--mega-args", "--mega_moe.backend cuda"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("titan-megamoe ab: mega_moe arm: [mega_moe] backend must be one of") and "'cuda'" in err
    assert not (out / "stock.log").exists()
    assert ab_cli.main(["--config", str(fake_trainer), "--out", str(out), "--stock-args", "--mega_moe.enable"]) == 2
    assert "not allowed" in capsys.readouterr().err


def test_noise_floor_runs_one_backend_twice(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "3", "--warmup", "1", "--out", str(out),
                      "--arms", "stock,stock"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    record = json.loads((out / "ab.json").read_text())
    assert record["arm_order"] == ["stock", "stock_repeat"] and set(record["arms"]) == {"stock", "stock_repeat"}
    for arm in record["arms"].values():
        assert "--mega_moe.no-enable" in arm["command"]
    comp = record["comparison"]
    assert (comp["baseline"], comp["candidate"]) == ("stock", "stock_repeat")
    assert comp["loss_diff"]["identical"] and comp["loss_diff"]["max_abs"] == 0.0
    assert (out / "stock_repeat.log").is_file() and (out / "ab.png").is_file()
    assert "stock vs stock_repeat (one backend twice: the run-to-run noise floor)" in captured.out
    assert "stock_repeat/stock" in captured.out and "loss |stock_repeat - stock|" in captured.out
    assert "stock_repeat/stock" in (out / "ab.md").read_text()


def test_repeat_args_change_the_second_arm_only(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "3", "--warmup", "1", "--out", str(out),
                      "--arms", "mega_moe,mega_moe", "--mega-args", "--training.seq_len 32",
                      "--repeat-args", "--optimizer.lr 1e-3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    record = json.loads((out / "ab.json").read_text())
    first, second = (record["arms"][a] for a in ("mega_moe", "mega_moe_repeat"))
    assert first["arm_overrides"] == ["--training.seq_len", "32"]
    assert second["arm_overrides"] == ["--training.seq_len", "32", "--optimizer.lr", "1e-3"]
    assert "--optimizer.lr" not in first["command"] and second["command"][-2:] == ["--optimizer.lr", "1e-3"]
    assert "optimizer.lr" in record["comparison"]["arms_differ_in"]
    assert "mega_moe vs mega_moe_repeat (one backend twice, the second with --repeat-args)" in captured.out


def test_repeat_args_need_a_repeated_arm(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_cli.main(["--repeat-args", "--optimizer.lr 1e-3", "--out", str(tmp_path / "o")])
    assert "--repeat-args needs one kind twice in --arms" in capsys.readouterr().err


def test_an_arm_kinds_args_need_an_arm_of_that_kind(tmp_path, capsys):
    """--mega-args with no mega_moe arm would run nothing it asks for (an fp8 A/B silently without fp8)."""
    with pytest.raises(SystemExit):
        ab_cli.main(["--arms", "stock,stock", "--mega-args", "--mega_moe.precision fp8", "--out", str(tmp_path / "o")])
    assert "--mega-args applies to mega_moe arms and --arms 'stock,stock' has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_cli.main(["--arms", "mega_moe,mega_moe", "--stock-args", "--compile.enable", "--out", str(tmp_path / "o")])
    assert "--stock-args applies to stock arms" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_what_the_mega_arm_cannot_run_here_stops_before_any_arm(tmp_path, capsys, monkeypatch):
    """Not after the stock arm trained (hours on a real config): the checks `train` makes, up front; a reserved
    option is named as such even when written with a value."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cases = [(["--mega-args", "--mega_moe.save_under_sac false"], "--mega_moe.no-save_under_sac for false"),
             (["--", "--compile.enable=true"], "override --compile.enable=true: TorchTitan's bool options"),
             (["--mega-args", "--mega_moe.precision mxfp8"], "needs a Blackwell GPU"),
             (["--mega-args", "--mega_moe.enable false"], "override --mega_moe.enable is not allowed here")]
    if not torch.cuda.is_available():
        cases.append((["--mega-args", "--mega_moe.backend triton"], 'backend = "triton" needs a CUDA GPU'))
    for args, words in cases:
        assert ab_cli.main(["--steps", "3", "--warmup", "1", "--out", str(tmp_path / "o"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()


def test_the_warmup_error_says_it_was_the_default(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_cli.main(["--steps", "2", "--out", str(tmp_path / "o")])
    assert "warmup 2, the default); pass --steps N and --warmup W with W < N" in capsys.readouterr().err


def test_bad_arms_value(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_cli.main(["--arms", "stock,fast", "--out", str(tmp_path / "o")])
    assert "--arms takes two of stock, mega_moe" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_fake_trainer_arm_failure(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "2", "--warmup", "0", "--out", str(out),
                      "--no-deterministic", "--", "--mega_moe.precision", "fp8"])
    captured = capsys.readouterr()
    assert rc == 1
    # the screen ends with the cause, once, and where the full log is
    assert captured.err.strip().splitlines()[-1] == (
        "titan-megamoe ab: [mega_moe] FAILED (exit code 1): NotImplementedError: precision='fp8' is not "
        f"implemented yet in titan-megamoe  [full log: {out / 'mega_moe.log'}]")
    assert captured.err.count("precision='fp8'") == 1
    record = json.loads((out / "ab.json").read_text())
    assert record["ok"] is False and record["arms"]["stock"]["ok"] and not record["arms"]["mega_moe"]["ok"]
    assert "--debug.deterministic" not in record["arms"]["stock"]["command"]
    assert (out / "ab.md").is_file() and (out / "ab.png").is_file()
    assert "FAILED" in captured.out


def test_rounds_alternate_the_first_arm_and_report_the_spread(fake_trainer, tmp_path, capsys):
    """--rounds 3: three full A/Bs in round_1..3, stock first in rounds 1 and 3, mega_moe first in round 2;
    the top-level ab.json/ab.md hold every round's speedup and loss difference and their spread."""
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "3", "--warmup", "1", "--out", str(out),
                      "--rounds", "3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    for i in (1, 2, 3):
        check_outputs(out / f"round_{i}", 3)
    orders = [json.loads((out / f"round_{i}" / "ab.json").read_text())["run_order"] for i in (1, 2, 3)]
    assert orders == [["stock", "mega_moe"], ["mega_moe", "stock"], ["stock", "mega_moe"]]
    # the roles stay: every round compares mega_moe against stock, whichever ran first
    assert all(json.loads((out / f"round_{i}" / "ab.json").read_text())["arm_order"] == ["stock", "mega_moe"]
               for i in (1, 2, 3))
    summary = json.loads((out / "ab.json").read_text())
    assert summary["ok"] is True and summary["rounds"] == summary["rounds_run"] == 3
    speedups = [r["speedup"] for r in summary["per_round"]]
    assert all(math.isfinite(v) and v > 0 for v in speedups)
    assert summary["speedup"]["n"] == 3 and summary["speedup"]["min"] == min(speedups)
    assert summary["speedup"]["max"] == max(speedups) and summary["speedup"]["median"] == sorted(speedups)[1]
    assert [r["loss_diff_max"] for r in summary["per_round"]] == [pytest.approx(0.001)] * 3
    assert [r["dir"] for r in summary["per_round"]] == ["round_1", "round_2", "round_3"]
    md = (out / "ab.md").read_text()
    assert "| 2 | mega_moe |" in md and "over 3 rounds" in md
    assert "speedup (stock step time / mega_moe step time): median" in captured.out
    assert "round 2/3" in captured.out


def test_rounds_with_a_failing_round_fail_the_ab(fake_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    rc = ab_cli.main(["--config", str(fake_trainer), "--steps", "2", "--warmup", "0", "--out", str(out),
                      "--rounds", "2", "--", "--mega_moe.precision", "fp8"])
    captured = capsys.readouterr()
    assert rc == 1
    summary = json.loads((out / "ab.json").read_text())
    assert summary["ok"] is False and [r["ok"] for r in summary["per_round"]] == [False, False]
    assert summary["speedup"] is None  # no round compared both arms
    assert "titan-megamoe ab: round 2: [mega_moe] FAILED (exit code 1)" in captured.err


def test_usage_errors(tmp_path, capsys):
    assert ab_cli.main(["--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text("")
    assert ab_cli.main(["--config", str(config), "--", "--mega_moe.enable"]) == 2
    assert "not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_cli.main(["--steps", "3", "--warmup", "3"])
    with pytest.raises(SystemExit):
        ab_cli.main(["--training.steps", "3"])  # overrides belong after --
    with pytest.raises(SystemExit):
        ab_cli.main(["--rounds", "0", "--out", str(tmp_path / "o")])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_out_naming_a_file_is_a_usage_error(tmp_path, capsys):
    taken = tmp_path / "ab_out"
    taken.write_text("not a directory")
    assert ab_cli.main(["--out", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titan-megamoe ab: --out") and "existing file" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1 and taken.read_text() == "not a directory"


def test_interrupt_terminates_child(tmp_path):
    pid_file = tmp_path / "pid"
    child = [sys.executable, "-c", f"import os,time; open({str(pid_file)!r},'w').write(str(os.getpid())); "
             "print('started', flush=True); time.sleep(60)"]

    def interrupt():
        deadline = time.time() + 20
        while not pid_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # A shell's background job (`pytest &`) starts with SIGINT ignored, so Ctrl-C's signal would never
    # raise KeyboardInterrupt here: install Python's own handler for this test, whatever we inherited.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        t0 = time.time()
        result = run_arm("stock", child, tmp_path / "stock.log", 3, echo=lambda s: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.interrupted and not result.ok and result.failure == "interrupted"
    assert time.time() - t0 < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "interrupted" in (tmp_path / "stock.log").read_text()


# ---------------------------------------------------------------------------------------------------------
# The real trainer (`titan-megamoe train`) on the bundled tiny CPU config.

def _real_trainer_available():
    try:
        import titan_megamoe.integrations.launch  # noqa: F401
    except ImportError:
        return False
    return cfg.DEFAULT_CONFIG in cfg.bundled_configs()


needs_trainer = pytest.mark.skipif(not _real_trainer_available(), reason="titan-megamoe train / tiny_cpu.toml missing")


# the real A/Bs the tests below check, started side by side in one fixture: they are independent runs
# (each torchrun picks its own port) and the suite's time is CI's limit. (arguments before "--", after)
REAL_ABS = {
    # the command: an EP 2 A/B on 2 gloo ranks (also the A/B whose outputs and report are checked)
    "ep2": (("--steps", "4", "--warmup", "1", "--nproc", "2"), ("--", "--parallelism.expert_parallel_degree", "2")),
    "mega_fails": (("--steps", "1", "--warmup", "0", "--nproc", "1"), ("--", "--mega_moe.precision", "fp8")),
    "stock_diverges": (("--steps", "3", "--warmup", "1", "--nproc", "1", "--stock-args", "--optimizer.lr 1e12"), ()),
}


@pytest.fixture(scope="module")
def real_abs(tmp_path_factory):
    """{name: (finished process with .returncode/.stdout/.stderr, its --out directory)} for REAL_ABS."""
    root = tmp_path_factory.mktemp("real_ab")
    running = {}
    for name, (before, after) in REAL_ABS.items():
        out, logs = root / name, [open(root / f"{name}.{k}", "w+") for k in ("stdout", "stderr")]
        cmd = [sys.executable, "-m", "titan_megamoe.cli", "ab", *before, "--out", str(out), *after]
        running[name] = (subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], text=True), logs, out)
    done = {}
    for name, (proc, logs, out) in running.items():
        proc.wait(timeout=900)
        stdout, stderr = (f.seek(0) or f.read() for f in logs)
        for f in logs:
            f.close()
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out)
    return done


@pytest.mark.slow
@needs_trainer
def test_real_ab_with_expert_parallelism(real_abs):
    """The issue's command: an EP 2 A/B on 2 gloo ranks succeeds, the arms agree (seen: identical losses), and
    its outputs and report say what ran."""
    proc, out = real_abs["ep2"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = check_outputs(out, 4)
    diff = record["comparison"]["loss_diff"]
    assert diff["n_common_steps"] == 4 and diff["max_abs"] <= 1e-4, diff
    assert record["config"].endswith(cfg.DEFAULT_CONFIG)
    assert "mega/stock" in proc.stdout and "step time, median (s)" in proc.stdout
    assert "[stock] step 4/4" in proc.stdout and "[mega_moe] step 4/4" in proc.stdout
    # the table comes last, and on this CPU it ends by saying its step times are not a result
    from titan_megamoe.ab.report import CPU_TIMING_NOTE

    assert proc.stdout.rstrip().splitlines()[-1] == CPU_TIMING_NOTE
    assert "(CPU: not meaningful, see below)" in proc.stdout
    # the trainer's own resolved config and swap line say what differs: the flag and the expert path
    assert record["comparison"]["arms_differ_in"].startswith("mega_moe.enable (False vs True); experts_ran")
    assert record["arms"]["mega_moe"]["mega_moe"]["experts_ran"] == "fused op (reference backend, bf16)"


@pytest.mark.slow
@needs_trainer
def test_real_ab_mega_arm_fails(real_abs):
    proc, out = real_abs["mega_fails"]
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    # the debug model's expert hidden dim (96) is not a multiple of FP8's 128-wide scale block
    assert last.startswith("titan-megamoe ab: [mega_moe] FAILED (exit code 1): [mega_moe] ") and \
        "precision='fp8': H (expert hidden dim) must be a multiple of 128" in last and "precision='bf16'" in last, last
    record = json.loads((out / "ab.json").read_text())
    assert record["arms"]["stock"]["ok"] and not record["arms"]["mega_moe"]["ok"]


@pytest.mark.slow
@needs_trainer
def test_real_ab_diverging_stock_arm_fails(real_abs):
    """The issue's repro: the real trainer prints NaN/inf metrics; the A/B must fail and say where."""
    proc, out = real_abs["stock_diverges"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("titan-megamoe ab: stock arm diverged: ") and " at step " in last, last
    record = json.loads((out / "ab.json").read_text())
    bad = record["arms"]["stock"]["summary"]["first_non_finite"]
    assert bad["value"] in ("nan", "inf", "-inf") and record["arms"]["mega_moe"]["summary"]["first_non_finite"] is None
    assert "1e12" not in " ".join(record["arms"]["mega_moe"]["command"])
    ld = record["comparison"]["loss_diff"]
    assert ld["max_abs_step"] not in ld["non_finite_steps"] and ld["n_steps"] + len(ld["non_finite_steps"]) == 3
