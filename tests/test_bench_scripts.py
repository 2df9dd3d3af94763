"""The GPU benchmark scripts' measurement logic, on CPU with CUDA events and syncs stood in for."""

import importlib.util
import os
import sys

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.fixture
def bench(monkeypatch):
    """scripts/bench_layer.py with a wall-clock stand-in for torch.cuda.Event and a no-op synchronize."""
    import time

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.syspath_prepend(SCRIPTS)
    spec = importlib.util.spec_from_file_location("bench_layer_under_test", os.path.join(SCRIPTS, "bench_layer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_interleaved_rounds_visit_every_arm_in_turn(bench):
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in ("stock", "fused")}
    measurements = {k: (fn, bench.time_ms) for k, fn in fns.items()}
    samples = bench.interleaved(measurements, warmup=2, iters=5, rounds=3)
    assert {k: len(v) for k, v in samples.items()} == {"stock": 6, "fused": 6}  # ceil(5 / 3) per visit
    # warm-up 2 on the first visit, 1 on later ones, then the timed calls: arms alternate by round
    per_visit = [2 + 2, 1 + 2, 1 + 2]
    expected = []
    for n in per_visit:
        expected += ["stock"] * n + ["fused"] * n
    assert order == expected
    assert all(t >= 0 for v in samples.values() for t in v)


def test_back_to_back_timer_times_each_call(bench):
    calls = []
    median, times = bench.time_back_to_back_ms(lambda: calls.append(1), warmup=3, iters=7)
    assert len(calls) == 10 and len(times) == 7 and median == sorted(times)[3]


def test_rounds_must_be_positive(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--rounds and --iters must be at least 1" in capsys.readouterr().err


def test_whole_benchmark_on_a_tiny_case_writes_json_and_table(bench, monkeypatch, tmp_path, capsys):
    """main() end to end on CPU (kernels in the interpreter): correctness gate, every timing key the
    table and scripts/results_tables.py read, SAC variants, JSON written; nothing about speed."""
    import json

    from titan_megamoe.integrations.torchtitan import cpu
    from torchtitan.models.moe import utils as moe_utils

    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real script")
    monkeypatch.setattr(torch, "histc", cpu.histc_int_cpu(torch.histc))
    monkeypatch.setattr(moe_utils, "generate_permute_indices",
                        cpu.permute_indices_cpu(moe_utils.generate_permute_indices))
    for name, value in (("is_available", lambda: True), ("get_device_name", lambda *a: "cpu (test)"),
                        ("memory_allocated", lambda *a: 0), ("max_memory_allocated", lambda *a: 0),
                        ("reset_peak_memory_stats", lambda *a: None), ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "CASES", {"tiny": (48, 64, 32, 4, 2, "skewed")})
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--cases", "tiny", "--iters", "2", "--warmup", "0",
                                      "--rounds", "2", "--sac", "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    assert "back-to-back" in out and "stock router" in out and "op-SAC" in out
    (path,) = tmp_path.glob("bench_layer_*.json")
    r = json.loads(path.read_text())["results"][0]
    assert r["rounds"] == 2 and max(r["rel_l2_vs_stock"].values()) < 5e-2
    for arm in ("stock", "fused", "fused_stock_router"):
        for kind in ("fwd", "fwdbwd", "fwd_b2b", "fwdbwd_b2b"):
            assert len(r[f"{arm}_{kind}_all"]) == 2, (arm, kind)
    spec = importlib.util.spec_from_file_location("results_tables_under_test", os.path.join(SCRIPTS, "results_tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = "\n".join(tables.bench_section(path))
    assert "tiny, back-to-back" in text and "tiny, fused experts + stock router" in text


def test_host_overhead_script_runs_every_stage(bench, monkeypatch, tmp_path, capsys):
    """scripts/host_overhead.py end to end on CPU: every stage it times runs (the numbers mean nothing here)."""
    import json

    from titan_megamoe.integrations.torchtitan import cpu

    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real script")
    monkeypatch.setattr(torch, "histc", cpu.histc_int_cpu(torch.histc))
    for name, value in (("is_available", lambda: True), ("get_device_name", lambda *a: "cpu (test)")):
        monkeypatch.setattr(torch.cuda, name, value)
    spec = importlib.util.spec_from_file_location("host_overhead_under_test", os.path.join(SCRIPTS, "host_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports scripts/bench_layer.py as `bench_layer`
    monkeypatch.setattr(sys.modules["bench_layer"], "DEVICE", "cpu")
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--tokens", "8", "--shape", "64", "32", "4", "2",
                                      "--calls", "1", "--repeats", "1", "--out", str(tmp_path)])
    mod.main()
    (path,) = tmp_path.glob("host_overhead_*.json")
    rows = json.loads(path.read_text())["host_us_per_call"]
    assert len(rows) == 12 and all(v > 0 for v in rows.values())
    assert "fused MoE layer forward" in capsys.readouterr().out
