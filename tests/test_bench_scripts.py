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


@pytest.fixture
def on_cpu(bench, monkeypatch):
    """bench_layer on CPU: kernels in the interpreter, TorchTitan's GPU-only routing helpers on CPU, the
    CUDA device queries stood in for."""
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
    return bench


def run_bench(bench, monkeypatch, tmp_path, cases, *args):
    """main() on `cases` {name: (T, D, H, E, K, routing)}; the JSON it wrote."""
    import json

    monkeypatch.setattr(bench, "CASES", cases)
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--cases", *cases, "--out", str(tmp_path), *args])
    bench.main()
    (path,) = tmp_path.glob("bench_layer_*.json")
    return path, json.loads(path.read_text())


def test_whole_benchmark_on_a_tiny_case_writes_json_and_table(on_cpu, monkeypatch, tmp_path, capsys):
    """main() end to end on CPU (kernels in the interpreter): correctness gate, every timing key the
    table and scripts/results_tables.py read, SAC variants, JSON written; nothing about speed."""
    bench = on_cpu
    path, data = run_bench(bench, monkeypatch, tmp_path, {"tiny": (24, 32, 32, 4, 2, "skewed")},
                           "--iters", "1", "--warmup", "0", "--rounds", "2", "--sac")
    out = capsys.readouterr().out
    assert "back-to-back" in out and "stock router" in out and "op-SAC" in out and "full AC" in out
    assert "[bench 1/1] tiny bf16: f+b" in out  # the per-case progress line
    (r,) = data["results"]
    assert r["rounds"] == 2 and max(r["rel_l2_vs_stock"].values()) < 5e-2
    assert (r["T"], r["D"], r["H"], r["E"], r["K"], r["routing"], r["precision"]) == (24, 32, 32, 4, 2, "skewed", "bf16")
    assert "0.02/(e+1)" in r["routing_desc"] and 0 < r["rows_per_expert"]["top8_share"] <= 1
    for arm in ("stock", "fused", "fused_stock_router"):
        for kind in ("fwd", "fwdbwd", "fwd_b2b", "fwdbwd_b2b"):
            assert len(r[f"{arm}_{kind}_all"]) == 2, (arm, kind)
    for key in ("fused_fwdbwd_tflops", "fwdbwd_speedup", "fused_stock_router_fwdbwd_speedup",
                "fused_stock_router_fwdbwd_tflops", "fused_fwd_b2b_tflops", "fwd_b2b_speedup"):
        assert r[key] > 0, key
    assert "vs_bf16_fwdbwd" not in r and data["not_run"] == [] and data["environment"]["gpu"] == "cpu (test)"
    spec = importlib.util.spec_from_file_location("results_tables_under_test", os.path.join(SCRIPTS, "results_tables.py"))
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = "\n".join(tables.bench_section(path))
    assert "tiny, back-to-back" in text and "tiny, fused experts + stock router" in text
    assert r["stock_full_ac_fwdbwd_ms"] > 0 and r["fused_full_ac_fwdbwd_ms"] > 0 and "Under full AC" in text


def test_full_ac_alone_times_no_sac(on_cpu, monkeypatch, tmp_path, capsys):
    """--full-ac times the layer under full activation checkpointing without op-level SAC (whose save list
    needs the package's newer ops), so that an older revision can be timed the same way."""
    bench = on_cpu
    path, data = run_bench(bench, monkeypatch, tmp_path, {"tiny": (24, 32, 32, 4, 2, "skewed")},
                           "--iters", "1", "--warmup", "0", "--rounds", "1", "--full-ac")
    out = capsys.readouterr().out
    assert "full AC" in out and "op-SAC" not in out
    (r,) = data["results"]
    assert r["stock_full_ac_fwdbwd_ms"] > 0 and r["fused_full_ac_fwdbwd_ms"] > 0
    assert not any("sac" in key for key in r), [key for key in r if "sac" in key]


def test_default_cases_cover_the_acceptance_list(bench):
    """Issue 10's case list: both Qwen3 shapes at T=16384, 30B-A3B at 512, 4096 and 65536, Mixtral- and
    OLMoE-like, a skewed routing, an odd shape; every row names its D, H, E, K, T and routing."""
    want = {"30b-16k": (16384, 2048, 768, 128, 8, "softmax"), "235b-16k": (16384, 4096, 1536, 128, 8, "softmax"),
            "30b-512": (512, 2048, 768, 128, 8, "softmax"), "30b-4k": (4096, 2048, 768, 128, 8, "softmax"),
            "30b-64k": (65536, 2048, 768, 128, 8, "softmax"), "mixtral-8k": (8192, 4096, 14336, 8, 2, "softmax"),
            "olmoe-8k": (8192, 2048, 1024, 64, 8, "softmax"), "30b-16k-skewed": (16384, 2048, 768, 128, 8, "skewed"),
            "odd-777": (777, 832, 320, 40, 5, "softmax")}
    for name, case in want.items():
        assert tuple(bench.CASES[name]) == case, name
        row = bench.case_fields(name, 1)
        assert (row["T"], row["D"], row["H"], row["E"], row["K"], row["routing"]) == case
    assert all(len(name) <= 16 for name in bench.CASES)
    assert {c.routing for c in bench.CASES.values()} <= set(bench.ROUTINGS)
    # the targets' shapes run first, so a --max-seconds budget cuts the extra cases
    assert list(bench.CASES)[:2] == ["30b-16k", "235b-16k"]


def test_skewed_routings_concentrate_the_rows(on_cpu):
    """What the routing names mean, on a small shape: 'hot' piles more rows on a few experts than 'skewed',
    which piles more than the plain router."""
    bench = on_cpu
    share = {}
    for routing in ("softmax", "skewed", "hot"):
        stock, _, x = bench.build_layers(4096, 64, 16, 64, 8, routing, backend="reference")
        with torch.no_grad():
            ids = stock.router(x.view(-1, 64), stock.expert_bias)[1]
        counts = torch.bincount(ids.flatten(), minlength=64).sort(descending=True).values
        share[routing] = (counts[:8].sum() / counts.sum()).item()
    assert share["softmax"] < 0.2 < share["skewed"] < share["hot"] and share["hot"] > 0.4, share


FP8_TINY = (40, 128, 128, 4, 2, "softmax")  # FP8 needs D and H multiples of 128
ODD_TINY = (37, 80, 48, 5, 3, "softmax")


def test_fp8_on_triton_is_a_skipped_row_with_the_kernels_message(on_cpu, monkeypatch, tmp_path, capsys):
    """While the Triton backend has no FP8 kernels (as at this test's writing; stood in for here, so the test
    holds once they land) each fp8 / fp8_bwd row is recorded with the error the kernels raise, untimed,
    never run in bf16 instead; the run succeeds."""
    from titan_megamoe import precision

    monkeypatch.setattr(precision, "TRITON_PRECISIONS", (precision.Precision.BF16,))
    path, data = run_bench(on_cpu, monkeypatch, tmp_path, {"tiny128": FP8_TINY}, "--precision", "fp8,fp8_bwd",
                           "--iters", "1", "--warmup", "0", "--rounds", "1")
    rows = {r["precision"]: r for r in data["results"]}
    assert list(rows) == ["fp8", "fp8_bwd"] and data["precisions"] == ["fp8", "fp8_bwd"]
    for p, r in rows.items():
        assert r["skipped"].startswith("NotImplementedError: ") and f"precision={p!r}" in r["skipped"]
        assert "backend='triton'" in r["skipped"] and "fused_fwd_ms" not in r and "stock_fwd_ms" not in r
        assert (r["D"], r["H"], r["T"]) == (128, 128, 40)
    out = capsys.readouterr().out
    assert "tiny128 fp8: skipped (NotImplementedError" in out and "skipped: NotImplementedError" in out


def test_precision_column_measures_every_precision_against_one_stock(on_cpu, monkeypatch, tmp_path):
    """bf16, fp8 and fp8_bwd of one case in one process (the reference backend stands in for the FP8
    kernels): stock timed once, the FP8 rows' ratios to bf16, their check against the emulation, their
    error against stock recorded; a shape FP8 rejects is a skipped row with the shape message."""
    _, data = run_bench(on_cpu, monkeypatch, tmp_path, {"tiny128": FP8_TINY, "odd": ODD_TINY},
                        "--backend", "reference", "--precision", "bf16,fp8,fp8_bwd",
                        "--iters", "2", "--warmup", "0", "--rounds", "1")
    rows = {(r["case"], r["precision"]): r for r in data["results"]}
    assert list(rows) == [(c, p) for c in ("tiny128", "odd") for p in ("bf16", "fp8", "fp8_bwd")]
    bf16 = rows["tiny128", "bf16"]
    for p in ("fp8", "fp8_bwd"):
        r = rows["tiny128", p]
        assert "skipped" not in r and "failed" not in r
        assert r["stock_fwdbwd_all"] == bf16["stock_fwdbwd_all"]  # one stock measurement per case
        assert r["vs_bf16_fwdbwd"] == pytest.approx(bf16["fused_fwdbwd_ms"] / r["fused_fwdbwd_ms"])
        for key in ("vs_bf16_fwd", "fused_stock_router_vs_bf16_fwd", "fused_stock_router_vs_bf16_fwdbwd",
                    "fused_fwdbwd_tflops", "fwdbwd_speedup"):
            assert r[key] > 0, key
        check = r["emulation_check"]
        assert check["tokens"] == 40 and set(check["tensors"]) == {"out", "dx", "dscores", "dw1", "dw2", "dw3"}
        # the reference backend runs the emulation itself: the same error, ratio 1
        assert all(t["ratio"] == pytest.approx(1.0) for t in check["tensors"].values())
        # FP8 is measurably less accurate than bf16 against stock where it quantizes
        assert r["rel_l2_vs_stock"]["dx"] > 5 * bf16["rel_l2_vs_stock"]["dx"]
    assert rows["tiny128", "fp8"]["rel_l2_vs_stock"]["out"] > 5 * bf16["rel_l2_vs_stock"]["out"]
    assert "vs_bf16_fwd" not in bf16
    assert "skipped" not in rows["odd", "bf16"]
    for p in ("fp8", "fp8_bwd"):
        msg = rows["odd", p]["skipped"]
        assert msg.startswith("ValueError: ") and "multiple" in msg and "128" in msg and "D (model dim)" in msg


def test_a_silent_bf16_fallback_fails_the_fp8_check(on_cpu):
    """A layer asked for fp8 that computes bf16 has ~10x less error than the emulation: the row fails."""
    bench = on_cpu
    stock, fused, x = bench.build_layers(*FP8_TINY, backend="reference")
    rows = {}
    for runs in ("fp8", "bf16"):
        fused.experts.precision = runs
        rows[runs] = {"precision": "fp8", "rel_l2_vs_stock": {"out": 0.0},
                      "emulation_check": bench.emulation_check(stock, fused, x, "fp8")}
    assert bench.check_failure(rows["fp8"]) is None
    assert "is not measurably fp8" in bench.check_failure(rows["bf16"])
    # an error above 2x the emulation's is a wrong kernel
    rows["fp8"]["emulation_check"]["tensors"]["dw2"]["ratio"] = 2.5
    assert "dw2 2.50x" in bench.check_failure(rows["fp8"])


def test_a_kernel_that_breaks_fails_its_row_and_the_run_goes_on(on_cpu, monkeypatch, tmp_path):
    """Anything but a rejection (here: an error as a Triton compile error raises it, its cause first in the
    message) fails that row only: the other precisions are timed, the JSON is written, the exit status is 1."""
    import json

    bench = on_cpu

    def broken(*args):
        try:
            raise NameError("Cannot access global variable E4M3_MAX")
        except NameError as e:
            raise RuntimeError("at 5:33: ratio = tl.math.div_rn(amax, E4M3_MAX)") from e

    monkeypatch.setattr(bench, "emulation_check", broken)
    with pytest.raises(SystemExit, match="1 row.s. failed their correctness check: tiny128 fp8"):
        run_bench(bench, monkeypatch, tmp_path, {"tiny128": FP8_TINY}, "--backend", "reference",
                  "--precision", "bf16,fp8", "--iters", "1", "--warmup", "0", "--rounds", "1")
    (path,) = tmp_path.glob("bench_layer_*.json")
    bf16, fp8 = json.loads(path.read_text())["results"]
    assert bf16["fused_fwdbwd_ms"] > 0 and "fused_fwdbwd_ms" not in fp8
    assert fp8["failed"].startswith("NameError: Cannot access global variable E4M3_MAX -> RuntimeError: at 5:33")


def test_time_budget_and_memory_estimate_skip_cases_with_a_reason(on_cpu, monkeypatch, tmp_path, capsys):
    """--max-seconds stops starting cases once spent; a case estimated not to fit is skipped; both are
    rows with the reason; a failed row makes the run exit 1 after the JSON is written."""
    import json

    bench = on_cpu
    now = [0.0]
    monkeypatch.setattr(bench, "clock", lambda: now[0])
    monkeypatch.setattr(bench, "free_memory_gib", lambda: 1.0)
    ran = []

    def fake_case(name, precisions, *args):
        ran.append(name)
        now[0] += 6.0
        verdict = {"failed": "stub: wrong"} if name == "b" else {"skipped": "stub: ran"}
        return [{**bench.case_fields(name, len(precisions)), "precision": p, **verdict} for p in precisions]

    monkeypatch.setattr(bench, "bench_case", fake_case)
    small = (64, 128, 128, 4, 2, "softmax")
    cases = {"a": small, "big": (65536, 4096, 1536, 128, 8, "softmax"), "b": small, "c": small}
    with pytest.raises(SystemExit, match="2 row.s. failed their correctness check: b bf16, b fp8"):
        run_bench(bench, monkeypatch, tmp_path, cases, "--max-seconds", "10", "--precision", "bf16,fp8")
    assert ran == ["a", "b"]
    (path,) = tmp_path.glob("bench_layer_*.json")
    data = json.loads(path.read_text())
    rows = {(r["case"], r["precision"]): r for r in data["results"]}
    assert list(rows) == [(c, p) for c in cases for p in ("bf16", "fp8")]
    assert rows["big", "fp8"]["skipped"].startswith("not run: needs ~") and "1 GiB free" in rows["big", "fp8"]["skipped"]
    assert rows["c", "bf16"]["skipped"] == "not run: --max-seconds 10 spent (12 s elapsed before this case)"
    assert data["not_run"] == ["c"] and data["max_seconds"] == 10
    assert bench.estimate_peak_gib(bench.Case(*cases["big"]), 2) > 1.0 > bench.estimate_peak_gib(bench.Case(*small), 2)
    out = capsys.readouterr().out
    assert "[bench 4/4] c bf16: skipped (not run: --max-seconds 10 spent" in out


def test_precision_names_are_checked(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--precision", "bf16,fp9"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--precision: precision: unknown value 'fp9'" in capsys.readouterr().err


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
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--tokens", "8", "--shape", "128", "128", "4", "2",
                                      "--precision", "bf16,fp8", "--calls", "1", "--repeats", "1",
                                      "--out", str(tmp_path)])
    mod.main()
    (path,) = tmp_path.glob("host_overhead_*.json")
    rows = json.loads(path.read_text())["host_us_per_call"]
    assert len(rows) == 12 + 2 * 3 and all(v > 0 for v in rows.values())
    assert {"fused MoE layer forward+backward [fp8]", "titan_megamoe.moe forward+backward [fp8]",
            "stock MoE layer forward+backward"} <= set(rows)
    assert json.loads(path.read_text())["gpu_us_per_call"] == dict.fromkeys(rows)  # no GPU time on CPU tensors
    assert "fused MoE layer forward [bf16]" in capsys.readouterr().out


def test_host_overhead_gpu_time_needs_the_whole_block_queued(monkeypatch):
    """host_overhead.gpu_us: a block counts only if the host queued every call before the GPU reached the start
    event (else the sleep grows and the block reruns); a call that keeps reaching it (it synchronises) gives None."""
    spec = importlib.util.spec_from_file_location("host_overhead_gpu", os.path.join(SCRIPTS, "host_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sleeps, late = [], []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def query(self):
            return late.pop(0)

        def elapsed_time(self, end):
            return 0.5  # ms for the block

    for name, value in (("Event", Event), ("_sleep", sleeps.append), ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    late[:] = [True, False, False]  # the first block's sleep was too short, then two blocks count
    assert mod.gpu_us(lambda: None, calls=5, repeats=2) == pytest.approx(100.0)
    assert sleeps == [50_000_000, 200_000_000, 200_000_000]
    late[:] = [True, True, True]
    assert mod.gpu_us(lambda: None, calls=5, repeats=2) is None


def test_ncu_layer_reads_ncu_raw_rows(monkeypatch):
    """scripts/ncu_layer.py's reading of ncu's raw CSV page (ncu itself runs on the GPU machine only):
    launches in order, ncu's "ns" in us, thousands separators, stall reasons largest first, a missing
    metric as None, and no CSV at all (no kernel ran inside the profiled window) as an error."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import ncu_layer
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    text = "\n".join([
        "==PROF== Connected to process 1",
        ",".join(f'"{c}"' for c in ["ID", "Kernel Name", "gpu__time_duration.sum",
                                    "lts__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
                                    stall.format("long_scoreboard"), stall.format("wait"),
                                    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"]),
        '"","","ns","%","register/thread","ratio","ratio","%"',
        '"0","_grouped_gemm_kernel(int *, float *)","767,200","81.3","155","0.8","2.5","45.1"',
        '"1","_wgrad_fp8_kernel(int *)","1,341,000","62.0","232","4.1","0","70.2"',
    ])
    first, second = ncu_layer.parse_raw(text)
    assert (first["kernel"], first["us"], first["l2_pct"], first["registers"]) == ("_grouped_gemm_kernel", 767.2, 81.3, 155)
    assert first["dram_pct"] is None
    assert list(first["stalls"]) == ["wait", "long_scoreboard"] and list(second["stalls"]) == ["long_scoreboard"]
    assert second["us"] == 1341.0 and second["tensor_pct"] == 70.2
    assert "| _wgrad_fp8_kernel | 1341.0 | - | 62.0 | - | 70.2 | - (-) | 232 | long_scoreboard 4.1 |" in \
        ncu_layer.markdown({"30b-16k fp8 fwd+bwd": [first, second]})
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_layer.parse_raw("==PROF== No kernels were profiled.\n")


def test_gluon_bench_says_it_needs_a_gpu():
    """scripts/bench_fp8_gluon.py imports and parses its arguments on CPU, then stops with a clear message."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("on a GPU the script runs for real (docs/results/bench_fp8_gluon_*.json)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "scripts/bench_fp8_gluon.py", "--shapes", "30b"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr


def test_host_ab_interleaves_the_two_trees_and_summarises(monkeypatch, tmp_path, capsys):
    """scripts/host_ab.py on CPU with a stand-in for host_overhead.py: each run imports titan_megamoe from its
    side's tree (first on PYTHONPATH), the runs alternate A, B, A, B, and the summary holds each side's
    median and range and the ratio of the medians."""
    import json
    import textwrap

    spec = importlib.util.spec_from_file_location("host_ab_under_test", os.path.join(SCRIPTS, "host_ab.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for side, wall in (("a", 100.0), ("b", 80.0)):
        (tmp_path / side / "titan_megamoe").mkdir(parents=True)
        (tmp_path / side / "titan_megamoe" / "__init__.py").write_text(f"SIDE, WALL = {side!r}, {wall}\n")
    order = tmp_path / "order.txt"
    fake = tmp_path / "fake_host_overhead.py"
    fake.write_text(textwrap.dedent(f"""
        import json, os, sys
        import titan_megamoe as m
        out = sys.argv[sys.argv.index("--out") + 1]
        with open({str(order)!r}, "a") as f:
            f.write(m.SIDE)
        n = len(open({str(order)!r}).read())
        os.makedirs(out)
        env = {{"gpu": "cpu (test)", "torch": "x", "commit": os.environ.get("TITAN_MEGAMOE_COMMIT")}}
        with open(os.path.join(out, "host_overhead_1.json"), "w") as f:
            json.dump({{"environment": env, "host_us_per_call": {{"row": m.WALL + n, "gpu only": None}},
                       "gpu_us_per_call": {{"row": None, "gpu only": 7.0}}}}, f)
    """))
    monkeypatch.setattr(mod, "HOST_OVERHEAD", str(fake))
    monkeypatch.setattr(sys, "argv", ["host_ab.py", "--a", str(tmp_path / "a"), "--a-commit", "abc", "--b",
                                      str(tmp_path / "b"), "--rounds", "3", "--out", str(tmp_path / "res"), "--",
                                      "--tokens", "8"])
    mod.main()
    assert order.read_text() == "ababab"
    (path,) = (tmp_path / "res").glob("host_ab_*.json")
    result = json.loads(path.read_text())
    row = result["summary"]["row"]
    # run n (1-based, in order) reports WALL + n: A's runs are 1, 3, 5 and B's 2, 4, 6
    assert row["a_wall"] == {"median": 103.0, "min": 101.0, "max": 105.0}
    assert row["b_wall"] == {"median": 84.0, "min": 82.0, "max": 86.0}
    assert row["b_over_a_wall"] == pytest.approx(84.0 / 103.0) and row["b_over_a_gpu"] is None
    assert result["summary"]["gpu only"]["b_over_a_gpu"] == 1.0
    assert [r["environment"]["commit"] for r in result["runs"]["a"]] == ["abc"] * 3
    assert result["host_overhead_args"] == ["--tokens", "8"]
    assert "0.816" in capsys.readouterr().out


def test_host_ab_stops_before_a_round_that_would_overrun_and_keeps_the_rounds_done(monkeypatch, tmp_path, capsys):
    """--max-seconds: a round starts only if the slowest so far would still end in time; the JSON, written
    after each complete round, holds the rounds run and the rounds asked for."""
    import json

    spec = importlib.util.spec_from_file_location("host_ab_limit", os.path.join(SCRIPTS, "host_ab.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for side in ("a", "b"):
        (tmp_path / side / "titan_megamoe").mkdir(parents=True)
    clock = [0.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    env = {"gpu": "cpu (test)", "torch": "x"}
    written = []

    def run_side(tree, commit, args, out_dir):  # each side's run takes 40 s of the stand-in clock
        clock[0] += 40.0
        written.append(sorted(p.name for p in (tmp_path / "res").glob("host_ab_*.json")))
        return {"environment": env, "host_us_per_call": {"row": 100.0}, "gpu_us_per_call": {"row": 5.0}}

    monkeypatch.setattr(mod, "run_side", run_side)
    monkeypatch.setattr(sys, "argv", ["host_ab.py", "--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"),
                                      "--rounds", "5", "--max-seconds", "200", "--out", str(tmp_path / "res")])
    mod.main()
    # rounds take 80 s: round 2 starts at 80 (ends 160 <= 200), round 3 would end at 240: not started
    assert len(written) == 4 and written[0] == [] and len(written[2]) == 1  # the JSON exists after round 1
    (path,) = (tmp_path / "res").glob("host_ab_*.json")
    result = json.loads(path.read_text())
    assert (result["rounds"], result["rounds_asked"], len(result["runs"]["a"])) == (2, 5, 2)
    assert "stopping after 2 of 5 rounds" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["host_ab.py", "--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"),
                                      "--max-seconds", "-1"])
    with pytest.raises(SystemExit):
        mod.main()
    assert "--max-seconds must be 0 (no limit) or positive" in capsys.readouterr().err


def test_host_ab_refuses_a_tree_without_the_package(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("host_ab_bad", os.path.join(SCRIPTS, "host_ab.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["host_ab.py", "--a", str(tmp_path), "--b", str(tmp_path)])
    with pytest.raises(SystemExit):
        mod.main()
    assert "holds no titan_megamoe/ package" in capsys.readouterr().err


def test_host_python_runs_the_gpu_host_code_with_launches_stubbed():
    """scripts/host_python.py on CPU: the GPU kernels' host code runs (the table's configs; Gluon's
    descriptors for fp8) with every launch counted instead of made; under the interpreter it refuses."""
    import subprocess

    root = os.path.dirname(SCRIPTS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, os.path.join(SCRIPTS, "host_python.py"), "--shape", "64", "256", "256", "4", "2",
            "--calls", "2"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines()[1:])
    assert lines.keys() == {"bf16", "fp8"}
    launches = {p: int(v.split(", ")[1].split()[0]) for p, v in lines.items()}
    assert launches["bf16"] >= 10 and launches["fp8"] > launches["bf16"]
    refused = subprocess.run(args, capture_output=True, text=True, env={**env, "TRITON_INTERPRET": "1"}, cwd=root,
                             timeout=300)
    assert refused.returncode != 0 and "without TRITON_INTERPRET" in refused.stderr


def test_gpu_acceptance_deadline_cuts_stage_limits_and_skips_what_cannot_fit(tmp_path):
    """scripts/gpu_acceptance.sh DEADLINE: a stage's limit is cut to the seconds left less 15, one with < 30 s
    is skipped and says so; without it the stages keep their own limits. Two quick stages that stop on a host
    without CUDA stand in for the GPU work."""
    import re
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("on a GPU these stages run for real (minutes)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(deadline):
        env = dict(os.environ, STAGES="symm_mem_one_gpu row_kernels", PYTHONPATH=root)
        env.pop("DEADLINE", None)
        if deadline is not None:
            env["DEADLINE"] = str(deadline)
        proc = subprocess.run(["bash", "scripts/gpu_acceptance.sh", str(tmp_path / str(deadline))], cwd=root,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    own = run(None)
    assert re.findall(r"=== (\w+) \(limit (\d+)s\)", own) == [("symm_mem_one_gpu", "120"), ("row_kernels", "120")]
    assert "needs a CUDA GPU" in own  # the stages ran (and stopped, as they should here)
    cut = [(name, int(s)) for name, s in re.findall(r"=== (\w+) \(limit (\d+)s\)", run(100))]
    assert [name for name, _ in cut] == ["symm_mem_one_gpu", "row_kernels"]
    assert all(60 <= s <= 85 for _, s in cut) and cut[1][1] <= cut[0][1]
    skipped = run(44)  # 44 - 15 s for the reports: under 30 s
    assert "=== symm_mem_one_gpu skipped" in skipped and "=== row_kernels skipped" in skipped
    assert "limit" not in skipped and not (tmp_path / "44" / "symm_mem_one_gpu.log").exists()
    bad = subprocess.run(["bash", "scripts/gpu_acceptance.sh", str(tmp_path / "bad")], cwd=root, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, DEADLINE="10m", STAGES="row_kernels"))
    assert bad.returncode == 2 and "DEADLINE: whole seconds expected, got '10m'" in bad.stderr
