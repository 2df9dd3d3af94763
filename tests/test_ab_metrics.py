"""The A/B log parser on sample TorchTitan 0.2.2 log lines (format of components/metrics.py)."""

import datetime as dt
import math

import pytest

from titan_megamoe.ab.metrics import LogParser, parse_log, parse_step_line, strip_ansi

# torchtitan.tools.utils.Color codes, as MetricsProcessor.log wraps each field
RED, GREEN, ORANGE, TURQ, BLUE, CYAN, MAGENTA, RESET = (
    "\033[31m", "\033[32m", "\033[38;2;180;60;0m", "\033[38;2;54;234;195m", "\033[34m", "\033[36m", "\033[35m", "\033[39m",
)


def step_line(step, loss, grad_norm=1.2345, gib=0.12, pct=0.0, tps=1234.4, tflops=0.01, mfu=0.0, color=False,
              time="2026-12-02 12:00:01,234"):
    """A line exactly as torchtitan 0.2.2's MetricsProcessor.log formats it."""
    c = (RED, GREEN, ORANGE, TURQ, BLUE, CYAN, MAGENTA, RESET) if color else ("",) * 8
    msg = (
        f"{c[0]}step: {step:2}  "
        f"{c[1]}loss: {loss:8.5f}  "
        f"{c[2]}grad_norm: {grad_norm:7.4f}  "
        f"{c[3]}memory: {gib:5.2f}GiB"
        f"({pct:.2f}%)  "
        f"{c[4]}tps: {round(tps):,}  "
        f"{c[5]}tflops: {tflops:,.2f}  "
        f"{c[6]}mfu: {mfu:.2f}%{c[7]}"
    )
    return f"[titan] {time} - root - INFO - {msg}"


def test_brief_example_line():
    line = ("[titan] 2026-12-02 12:00:01,234 - root - INFO - step:  3  loss:  7.1234  grad_norm:  1.2345  "
            "memory:  0.12GiB(0.00%)  tps: 1,234  tflops: 0.01  mfu: 0.00%")
    m = parse_step_line(line)
    assert (m.step, m.loss, m.grad_norm, m.memory_gib, m.memory_pct) == (3, 7.1234, 1.2345, 0.12, 0.0)
    assert (m.tps, m.tflops, m.mfu_pct) == (1234, 0.01, 0.0)
    assert m.time == dt.datetime(2026, 12, 2, 12, 0, 1, 234000)


@pytest.mark.parametrize("color", [False, True])
def test_thousands_separators_and_colors(color):
    line = step_line(12, 6.54321, grad_norm=12.5, gib=71.25, pct=51.03, tps=1234567.6, tflops=1234.5, mfu=45.67,
                     color=color)
    assert ("\033[" in line) == color
    m = parse_step_line(line)
    assert m.step == 12 and m.loss == 6.54321 and m.grad_norm == 12.5
    assert m.memory_gib == 71.25 and m.memory_pct == 51.03
    assert m.tps == 1234568 and m.tflops == 1234.5 and m.mfu_pct == 45.67


def test_strip_ansi():
    assert strip_ansi(f"{RED}step: 1{RESET} {ORANGE}x{RESET}") == "step: 1 x"


def test_nan_loss_and_prefixes():
    m = parse_step_line("[rank0]:" + step_line(1, float("nan"), grad_norm=float("inf")))
    assert m.step == 1 and math.isnan(m.loss) and math.isinf(m.grad_norm)


@pytest.mark.parametrize(
    "line",
    [
        "[titan] 2026-12-02 12:00:01,234 - root - INFO - validate step:  5  loss:  7.0000  memory:  0.12GiB(0.00%)  tps: 1,234",
        "[titan] 2026-12-02 12:00:01,234 - root - INFO - Training starts at step 1",
        "random text step: 3 loss: 1",
        "",
    ],
)
def test_other_lines_are_not_steps(line):
    assert parse_step_line(line) is None


SAMPLE_LOG = "\n".join([
    "[titan] 2026-12-02 12:00:00,001 - root - INFO - Starting job: tiny",
    "[titan] 2026-12-02 12:00:00,100 - root - INFO - CPU capacity: AMD EPYC 7B13 with 31.34GiB memory",
    f"[titan] 2026-12-02 12:00:00,200 - root - INFO - {BLUE}Model qwen3 tiny {RED}size: 1,234,567 total parameters{RESET}",
    "[titan] 2026-12-02 12:00:00,300 - root - INFO - Peak FLOPS used for computing MFU: 9.890e+14",
    "[titan] 2026-12-02 12:00:00,400 - root - INFO - Trainer is initialized with local batch size 2, global batch size 4, "
    "gradient accumulation steps 2, sequence length 64, total steps 3 (warmup 1)",
    "[titan] 2026-12-02 12:00:01,000 - root - INFO - Training starts at step 1",
    step_line(1, 7.5, time="2026-12-02 12:00:02,500", color=True),
    "some warning in between",
    step_line(2, 7.25, time="2026-12-02 12:00:03,000", color=True),
    step_line(2, 7.25, time="2026-12-02 12:00:03,001", color=True),  # a second rank printing the same step
    step_line(3, 7.0, time="2026-12-02 12:00:03,400", color=True),
    "[titan] 2026-12-02 12:00:03,500 - root - INFO - Training completed",
])


def test_parse_log_collects_steps_and_facts():
    p = parse_log(SAMPLE_LOG)
    assert [s.step for s in p.steps] == [1, 2, 3]
    assert [s.loss for s in p.steps] == [7.5, 7.25, 7.0]
    assert p.info["device_type"] == "cpu" and p.info["device_name"] == "AMD EPYC 7B13"
    assert p.info["peak_flops"] == 9.89e14
    assert (p.info["model_name"], p.info["model_flavor"], p.info["model_params"]) == ("qwen3", "tiny", 1234567)
    assert p.info["local_batch_size"] == 2 and p.info["seq_len"] == 64 and p.info["grad_accum_steps"] == 2
    assert p.tokens_per_step == 2 * 64 * 2
    assert p.start_time == dt.datetime(2026, 12, 2, 12, 0, 1)


def test_feed_returns_new_steps_only():
    p = LogParser()
    assert p.feed("hello") is None
    assert p.feed(step_line(1, 7.0)).step == 1
    assert p.feed(step_line(1, 7.0)) is None
    assert p.tokens_per_step is None
