"""End to end: `titan-megamoe train` on the bundled tiny config, CPU, real TorchTitan 0.2.2 trainer runs.

Every run is deterministic (--debug.seed 42 --debug.deterministic) and parsed from its metric lines,
so a run that silently trained nothing (or fewer steps) fails. On CPU the mega_moe arm runs the
reference backend, which is bitwise equal to stock's expert path (same bf16 GEMMs, same casts, fp32
combine; see test_torchtitan_integration.py), so the two arms' losses must agree exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from train_runs import SEED, STEP_RE, Run, ckpt_tensors, flatten, swap_line, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stock4(tmp_path_factory) -> Run:
    """Stock arm, 4 steps, a full checkpoint (model, optimizer, lr, data, step) after every step."""
    dump = tmp_path_factory.mktemp("stock") / "run"
    run = train(dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "1")
    assert sorted(run.steps) == [1, 2, 3, 4], run.log[-3000:]
    assert swap_line(run.log) is None
    assert run.steps[4][0] < run.steps[1][0], "the loss should fall over 4 steps"
    return run


def test_mega_moe_trains_with_stock_losses(stock4, tmp_path):
    mega = train(tmp_path / "mega", "--training.steps", "4", "--mega_moe.enable")
    assert sorted(mega.steps) == [1, 2, 3, 4], mega.log[-3000:]
    assert swap_line(mega.log) == ("[mega_moe] swapped 2 MoE layers to the fused op: precision=bf16, "
                                   "backend=reference, router stock, AC none")
    # bitwise-equal arithmetic: printed loss (5 decimals) and grad norm (4 decimals) agree exactly
    assert mega.steps == stock4.steps, (mega.steps, stock4.steps)


def test_checkpoint_round_trip_stock_mega_stock(stock4, tmp_path):
    stock_ckpt = stock4.dump / "checkpoint"
    # stock step-2 checkpoint -> mega_moe resumes and trains steps 3, 4 (same 4-step lr schedule as stock4)
    mega = train(tmp_path / "mega", "--mega_moe.enable", "--training.steps", "4", "--checkpoint.enable",
                 "--checkpoint.interval", "1", "--checkpoint.initial_load_path", str(stock_ckpt / "step-2"),
                 "--checkpoint.no-initial-load-model-only")
    assert f"Loading the checkpoint from {stock_ckpt / 'step-2'}" in mega.log
    assert "Training starts at step 3" in mega.log and sorted(mega.steps) == [3, 4], mega.log[-3000:]
    assert mega.steps[3] == stock4.steps[3] and mega.steps[4] == stock4.steps[4]
    # mega_moe step-3 checkpoint -> stock resumes and trains step 4
    mega_ckpt = mega.dump / "checkpoint" / "step-3"
    stock = train(tmp_path / "stock", "--training.steps", "4", "--checkpoint.enable",
                  "--checkpoint.initial_load_path", str(mega_ckpt), "--checkpoint.no-initial-load-model-only")
    assert f"Loading the checkpoint from {mega_ckpt}" in stock.log
    assert "Training starts at step 4" in stock.log and sorted(stock.steps) == [4], stock.log[-3000:]
    assert stock.steps[4] == stock4.steps[4]
    # the mega_moe-written step-3 checkpoint equals stock's step-3 one, entry by entry: model weights and
    # buffers, AdamW state, lr scheduler, data loader position, train state
    a = flatten(ckpt_tensors(stock_ckpt / "step-3", tmp_path))
    b = flatten(ckpt_tensors(mega_ckpt, tmp_path))
    assert a.keys() == b.keys()
    for must in ("layers.0.moe.experts.w1", "layers.0.moe.router.gate.weight", "layers.0.moe.expert_bias"):
        assert must in a, sorted(a)[:40]
    assert sum(k.startswith("optimizer.") and "experts.w2" in k for k in a) >= 2  # exp_avg, exp_avg_sq
    for k, v in a.items():
        assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k


def test_fsdp_two_gloo_ranks_with_flag_and_a_tile_table(tmp_path):
    """FSDP over 2 gloo ranks with the flag; `[mega_moe] tile_table`: the converter loads the `titan-megamoe
    tune` file on each rank and the swap line names it with its hash."""
    table = tmp_path / "tiles.json"
    cfg = {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4, "tma": True}
    table.write_text(json.dumps({"configs": {"fp8": {"128x128": {"gemm2": cfg}}}, "runs": []}))
    run = train(tmp_path / "fsdp", "--mega_moe.enable", "--training.steps", "3", "--mega_moe.tile_table", str(table),
                nproc=2)
    assert sorted(run.steps) == [1, 2, 3], run.log[-3000:]
    assert "Applied FSDP to the model" in run.log
    assert "dp_shard=2" in run.log
    lines = [line for line in run.log.splitlines() if "[mega_moe] swapped" in line]
    assert lines and all(f"tiles {table} (sha256 " in line for line in lines), lines
    assert run.steps[3][0] < run.steps[1][0]


PLAIN_TORCHTITAN = """
import importlib.util, runpy, sys
# CPU patches only (loaded by path, so titan_megamoe's TorchTitan package is not imported here); on a
# GPU host this script is just `torchrun -m torchtitan.train`
spec = importlib.util.spec_from_file_location("cpu_patches", {cpu!r})
cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu)
cpu.apply()
assert "titan_megamoe.integrations.torchtitan" not in sys.modules
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
"""


def test_plain_torchrun_torchtitan_train_with_config_lines(tmp_path):
    """`torchrun -m torchtitan.train --job.config_file X.toml`: the TOML's [job]/[experimental] lines suffice."""
    from titan_megamoe.integrations import assets
    from titan_megamoe.integrations.torchtitan import cpu

    script = tmp_path / "plain_torchtitan_train.py"
    script.write_text(PLAIN_TORCHTITAN.format(cpu=cpu.__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
           "--job.config_file", str(assets.CONFIGS_DIR / "tiny_cpu.toml"), "--job.dump_folder",
           str(tmp_path / "out"), "--training.steps", "2", "--mega_moe.enable", *SEED]
    p = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:]
    assert swap_line(p.stdout) is not None
    assert [int(m["step"]) for m in STEP_RE.finditer(p.stdout)] == [1, 2]


def test_a_converter_error_fails_the_job_before_training(tmp_path):
    """A `[mega_moe]` value the converter rejects on every rank and the launcher cannot (here block FP8 on the
    tiny flavor, whose expert hidden dim 96 is not a multiple of 128: the launcher does not know the model's
    dims) stops the job before training; the screen ends with that one line and the log that keeps the rest
    (torchrun's tracebacks)."""
    run = train(tmp_path / "fp8_tiny", "--training.steps", "1", "--mega_moe.enable", "--mega_moe.precision", "fp8",
                check=False)
    assert run.returncode != 0 and not run.steps and "Training starts" not in run.log
    errors = [line for line in run.log.splitlines() if "ValueError: [mega_moe]" in line]
    assert errors and "must be a multiple of 128, got 96" in errors[0] and "megamoe_tiny_fp8" in errors[0], errors
    log = run.dump / "titan-megamoe-train.log"
    assert run.log.rstrip().splitlines()[-1] == (
        f"titan-megamoe train: failed (exit {run.returncode}): {errors[0].split('ValueError: ', 1)[1]}  "
        f"[full log: {log}]")
    assert "ChildFailedError" in log.read_text()


def test_missing_config_file(tmp_path):
    p = subprocess.run([sys.executable, "-m", "titan_megamoe.cli", "train", "--config", str(tmp_path / "no.toml")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 2
    assert "no.toml" in p.stderr and "not found" in p.stderr and "tiny_cpu" in p.stderr


FP8_FLAVOR = ("--model.flavor", "megamoe_tiny_fp8", "--training.steps", "3")


@pytest.fixture(scope="module")
def fp8_flavor_runs(tmp_path_factory) -> dict:
    """Stock and mega_moe fp8 on the tiny flavor with FP8's shapes, 3 steps: shared by the tests below."""
    root = tmp_path_factory.mktemp("fp8_flavor")
    return {"stock": train(root / "stock", *FP8_FLAVOR),
            "fp8": train(root / "fp8", *FP8_FLAVOR, "--mega_moe.enable", "--mega_moe.precision", "fp8")}


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_block_fp8_trains_close_to_stock(precision, fp8_flavor_runs, tmp_path):
    """`[mega_moe] precision = fp8 / fp8_bwd` through the real trainer (on CPU: the reference backend's
    block-FP8 emulation, the Triton kernels' oracle), on the tiny flavor with FP8's shapes: it swaps at the
    precision asked for, trains, and stays near stock bf16's losses without equalling them (a silent bf16
    fallback would equal them: the bf16 reference is bitwise stock here)."""
    stock = fp8_flavor_runs["stock"]
    mega = fp8_flavor_runs["fp8"] if precision == "fp8" else train(
        tmp_path / precision, *FP8_FLAVOR, "--mega_moe.enable", "--mega_moe.precision", precision)
    assert sorted(mega.steps) == sorted(stock.steps) == [1, 2, 3], mega.log[-3000:]
    assert swap_line(mega.log) == (f"[mega_moe] swapped 2 MoE layers to the fused op: precision={precision}, "
                                   "backend=reference, router stock, AC none")
    diffs = [abs(a - b) for a, b in zip(mega.losses(), stock.losses())]
    assert max(diffs) < 0.05, (mega.losses(), stock.losses())
    # the forward of fp8_bwd is bf16 (step 1's loss is computed before any update); fp8's is not
    if precision == "fp8_bwd":
        assert diffs[0] == 0.0
    assert any(d > 0 for d in diffs), "FP8 losses equal bf16's: was FP8 run at all?"


def test_block_fp8_composes_with_torchao_float8_linear(fp8_flavor_runs, tmp_path):
    """mega_moe fp8 on the experts with torchao's float8 Linear converter on the dense layers (emulated on
    CPU): both conversions apply and it trains; asking for torchao's float8 grouped_mm on the experts that
    mega_moe owns is a clear error before training."""
    linear = ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate",
              "--quantize.linear.float8.recipe_name", "rowwise")
    mega = ("--mega_moe.enable", "--mega_moe.precision", "fp8")
    run = train(tmp_path / "both", *FP8_FLAVOR, *linear, *mega)
    assert sorted(run.steps) == [1, 2, 3], run.log[-3000:]
    assert "Float8 training active with recipe rowwise" in run.log
    assert swap_line(run.log) == ("[mega_moe] swapped 2 MoE layers to the fused op: precision=fp8, "
                                  "backend=reference, router stock, AC none")
    assert fp8_flavor_runs["fp8"].losses() != run.losses()  # the dense layers' float8 changed the numbers
    bad = train(tmp_path / "grouped", *FP8_FLAVOR, *mega, "--model.converters", "quantize.grouped_mm.float8",
                "--quantize.grouped_mm.float8.fqns", "experts", check=False)
    assert bad.returncode != 0 and not bad.steps
    assert "quantize.grouped_mm.float8" in bad.log and "--mega_moe.precision" in bad.log
