"""`titan-megamoe tune`: the flow on CPU (kernels in Triton's interpreter, tiny shapes), the table file it
writes and resumes from, its oracle check rejecting a wrong kernel, and the table's use by the kernels and
by `[mega_moe] tile_table`."""

import json
import os
import subprocess
import sys

import pytest

from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import TileConfig
from titan_megamoe.tune import candidates, search
from titan_megamoe.tune.oracle_check import FACTOR, LayerCheck

SHAPE = (128, 128, 4, 2, 64)
# the kernels run where the suite runs them: the interpreter on CPU, compiled on a GPU host
DEVICE = search.interpreter_device()


@pytest.fixture(scope="module")
def gemm2_tuned(tmp_path_factory):
    """One full fp8 gemm2 tune at SHAPE (every candidate run and checked): (table file, returned table, lines)."""
    out = tmp_path_factory.mktemp("tune") / "tiles.json"
    lines = []
    table = search.tune(SHAPE, "fp8", ["gemm2"], out, budget_s=600, device=DEVICE, say=lines.append)
    return out, table, lines


def test_tune_writes_checked_winners_and_resumes(gemm2_tuned, tmp_path):
    first, table, lines = gemm2_tuned
    out = tmp_path / "tiles.json"
    out.write_text(first.read_text())
    runs = [r for r in table["runs"] if r["kernel"] == "gemm2"]
    n = len(candidates.for_kernel("gemm2", "fp8"))
    assert len(runs) == n and all("ms" in r and r["check"]["worst_error_vs_same_math"] <= FACTOR for r in runs)
    best = min(runs, key=lambda r: r["ms"])
    on_disk = json.loads(out.read_text())
    assert on_disk["configs"]["fp8"]["128x128"]["gemm2"] == best["config"]
    assert on_disk["measured"]["fp8"]["128x128"]["gemm2"]["ms"] == best["ms"]
    assert any(f"gemm2 1/{n}" in line for line in lines) and "done" in lines[-1]
    # run again: nothing left to do at this shape, the runs are kept as they were
    again = search.tune(SHAPE, "fp8", ["gemm2"], out, budget_s=600, device=DEVICE, say=lines.append)
    assert again["runs"] == on_disk["runs"]


def test_tune_stops_at_its_budget_and_says_how_to_continue(tmp_path):
    out = tmp_path / "tiles.json"
    lines = []
    table = search.tune(SHAPE, "fp8", ["gemm2", "dx"], out, budget_s=1e-9, device=DEVICE, say=lines.append)
    assert table["runs"] == [] and "run the same command again to continue" in lines[-1]


def test_oracle_check_rejects_a_wrong_kernel(monkeypatch):
    # bf16 at D = H = 64 (a quarter of the interpreter's GEMM programs at 128): the check is shape-blind
    check = LayerCheck(64, 64, 4, 2, "bf16", DEVICE)
    ok, _ = check()
    assert ok <= FACTOR
    from titan_megamoe.kernels import grouped_gemm

    real = grouped_gemm.expert_down_proj
    monkeypatch.setattr("titan_megamoe.pipeline.expert_ffn.expert_down_proj",
                        lambda *a, **k: real(*a, **k) * 1.05)  # a GEMM2 5% off
    bad, which = check()
    assert bad > FACTOR and which in ("out", "dx", "dscores", "dw1", "dw2", "dw3")


def test_use_tile_table_goes_first_and_checks_entries(tmp_path):
    cfg = TileConfig(64, 128, 128, 4, 5, tma=True)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"configs": {"fp8": {"4096x14336": {"gemm2": cfg.to_record()}}}, "runs": []}))
    try:
        desc = configs.use_tile_table(path)
        assert str(path) in desc and "sha256" in desc and configs.tile_table_in_use() == desc
        assert configs._table_config("gemm2", 4096, 14336, "fp8") == cfg
        # not in it
        assert configs._table_config("dx", 4096, 14336, "fp8") == configs.default_configs(14336, "fp8")["dx"]
    finally:
        configs.use_tile_table(None)
    assert configs._table_config("gemm2", 4096, 14336, "fp8") == configs.default_configs(14336, "fp8")["gemm2"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": {"bf16": {"1x1": {"gemm2": dict(cfg.to_record(), block_m=96)}}}}))
    with pytest.raises(ValueError, match="bf16 1x1 gemm2"):
        configs.use_tile_table(bad)
    with pytest.raises(ValueError, match="does not exist"):
        configs.use_tile_table(tmp_path / "missing.json")
    assert configs.tile_table_in_use() is None


def test_cli_usage_errors():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "titan_megamoe.cli", "tune", *args], capture_output=True,
                              text=True, timeout=120)

    p = run("--shape", "192", "128", "4", "2", "64", "--precision", "fp8")
    assert p.returncode == 2 and "multiples of 128" in p.stderr
    p = run("--shape", "128", "128", "4", "8", "64")
    assert p.returncode == 2 and "K <= E" in p.stderr
    p = run("--shape", "128", "128", "4", "2", "64", "--precision", "fp16")
    assert p.returncode == 2 and "--precision takes bf16, fp8" in p.stderr


def test_cli_out_errors_come_before_any_tuning(tmp_path):
    """A directory, a missing directory, a file that is not JSON: one line each, before the budget is spent."""
    def run(out):
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.run([sys.executable, "-m", "titan_megamoe.cli", "tune", "--shape", "128", "128", "4", "2",
                               "16", "--kernels", "gemm2", "--budget-seconds", "60", "--out", str(out)],
                              capture_output=True, text=True, timeout=120, env=env)

    p = run(tmp_path)
    assert p.returncode == 2 and "is a directory; pass a file path" in p.stderr, p.stderr
    p = run(tmp_path / "missing" / "t.json")
    assert p.returncode == 2 and "does not exist; create it or pass another path" in p.stderr, p.stderr
    (tmp_path / "notes.txt").write_text("not json\n")
    p = run(tmp_path / "notes.txt")
    assert p.returncode == 2 and "notes.txt exists and is not JSON" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and (tmp_path / "notes.txt").read_text() == "not json\n"


def test_untuned_shapes_get_the_defaults_of_their_expert_size():
    """Shapes the table lacks: large experts (Mixtral-like H) get the large-expert winners, not 30B's."""
    large, small = configs._GPU_DEFAULTS_LARGE_EXPERT, configs._GPU_DEFAULTS
    assert large["wgrad_w2"] != small["wgrad_w2"]
    for kernel in configs.KERNELS:
        assert configs._table_config(kernel, 6144, 16384, "bf16") == large[kernel]  # not in the table
        want = small[kernel]
        got = configs._table_config(kernel, 1536, 512, "bf16")  # narrow: block_n may be halved, nothing else
        assert (got.block_m, got.block_k, got.num_warps, got.num_stages) == (want.block_m, want.block_k,
                                                                            want.num_warps, want.num_stages)
        # the shipped table's own entries win over either default
        assert configs._table_config(kernel, 4096, 14336, "bf16") == configs.TileConfig.from_record(
            configs._tuned_table()["bf16"]["4096x14336"][kernel])


def test_resume_matches_records_written_before_a_field_was_added(gemm2_tuned, tmp_path):
    """A table from before `group_m` existed: its candidates count as done, not run again. Such a table
    held group_m 1 configs only (what a record without the field means); the grouped candidates keep it."""
    out = tmp_path / "tiles.json"
    table = json.loads(gemm2_tuned[0].read_text())
    for r in table["runs"]:
        if r["config"]["group_m"] == 1:
            del r["config"]["group_m"]
    assert any("group_m" not in r["config"] for r in table["runs"])
    out.write_text(json.dumps(table))
    lines = []
    again = search.tune(SHAPE, "fp8", ["gemm2"], out, budget_s=600, device=DEVICE, say=lines.append)
    assert len(again["runs"]) == len(table["runs"]) and not any("gemm2 1/" in line for line in lines)


def test_no_sorted_copy_neither_runs_nor_picks_those_configs(tmp_path, monkeypatch):
    """--no-sorted-copy: the weight-gradient configs that copy an operand into sorted order first (more
    memory) are not run, and not picked either when the file holds them from an earlier run. Only the
    choice is under test: the kernels' run, check and timing are stood in for (the other tests run them)."""
    from dataclasses import replace

    # the GPU default of this shape already copies (small-expert class): both configs are spelled out
    base = replace(configs.tile_config("wgrad_w13", 128, 128), sorted_copy=False, warp_specialize=False)
    copy = replace(base, tma=True, sorted_copy=True)
    monkeypatch.setattr(candidates, "for_kernel", lambda kernel, precision: [base, copy])
    monkeypatch.setattr(search.problem, "make", lambda *a, **k: None)
    monkeypatch.setattr(search.problem, "call", lambda *a, **k: None)
    monkeypatch.setattr(search, "LayerCheck", lambda *a, **k: lambda: (1.0, "out"))
    monkeypatch.setattr(search, "_time_ms", lambda fn, device: 2.0)
    out = tmp_path / "tiles.json"
    lines = []
    table = search.tune(SHAPE, "bf16", ["wgrad_w13"], out, budget_s=600, device=DEVICE, say=lines.append,
                        sorted_copy=False)
    assert [r["config"]["sorted_copy"] for r in table["runs"]] == [False] and "wgrad_w13 1/1" in lines[-2]
    table = search.tune(SHAPE, "bf16", ["wgrad_w13"], out, budget_s=600, device=DEVICE, say=lines.append)
    assert [r["config"]["sorted_copy"] for r in table["runs"] if "ms" in r] == [False, True]  # resumed: one more
    for r in table["runs"]:  # the sorted-copy config made the fastest: only the option keeps it out
        r["ms"] = 1.0 if r["config"]["sorted_copy"] else 2.0
    out.write_text(json.dumps(table))
    again = search.tune(SHAPE, "bf16", ["wgrad_w13"], out, budget_s=600, device=DEVICE, say=lambda _: None)
    assert again["configs"]["bf16"]["128x128"]["wgrad_w13"]["sorted_copy"] is True
    again = search.tune(SHAPE, "bf16", ["wgrad_w13"], out, budget_s=600, device=DEVICE, say=lambda _: None,
                        sorted_copy=False)
    assert again["configs"]["bf16"]["128x128"]["wgrad_w13"] == base.to_record() and len(again["runs"]) == 2


def test_untuned_fp8_shapes_get_the_gluon_kernels_on_hopper_and_triton_elsewhere(monkeypatch):
    """Block FP8 at a shape the table lacks: the persistent warp-specialised Gluon kernels (their row items in
    groups down each column for large experts), every default a valid config; a CUDA GPU other than Hopper
    gets the Triton kernels' tiles instead (Gluon's wgmma is sm_90's), never a Gluon config."""
    from titan_megamoe.validation import check_tile_config

    for hidden in (512, 14336):
        for kernel, cfg in configs.default_configs(hidden, "fp8").items():
            check_tile_config(kernel, cfg, configs.ROW_BLOCK_M, "fp8")
            assert cfg.gluon and cfg.warp_specialize and configs._table_config(kernel, 1024, hidden, "fp8") == cfg
            assert cfg.group_m == (configs._GPU_DEFAULTS_LARGE_EXPERT[kernel].group_m if hidden >= 4096 else 1)
    assert configs.default_configs(14336, "fp8")["gemm1_swiglu"].group_m > 1
    configs._table_config.cache_clear()
    monkeypatch.setattr(configs, "_gluon_gpu", lambda: False)
    try:
        for kernel in configs.KERNELS:
            for dim, hidden in ((1024, 512), (2048, 768)):  # untuned, and tuned (Gluon in the shipped table)
                cfg = configs._table_config(kernel, dim, hidden, "fp8")
                check_tile_config(kernel, cfg, configs.ROW_BLOCK_M, "fp8")
                assert not cfg.gluon and cfg == configs._GPU_DEFAULTS_FP8_TRITON[kernel]
    finally:
        configs._table_config.cache_clear()


def test_a_user_tables_gluon_entry_off_hopper_is_an_error(tmp_path, monkeypatch):
    """The shipped table's Gluon entries fall back to the Triton tiles off Hopper; a table the user chose
    must not be swapped silently: loading it names the entry and the fix."""
    cfg = configs.default_configs(512, "fp8")["gemm2"]
    assert cfg.gluon
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"configs": {"fp8": {"1024x512": {"gemm2": cfg.to_record()}}}, "runs": []}))
    monkeypatch.setattr(configs, "_gluon_gpu", lambda: False)
    with pytest.raises(ValueError, match=r"fp8 1024x512 gemm2: a Gluon kernel.*Hopper.*titan-megamoe tune"):
        configs.use_tile_table(path)
    assert configs.tile_table_in_use() is None


def test_every_gpu_candidate_is_a_valid_config():
    """What `titan-megamoe tune` tries on a GPU passes the checks a table entry must pass (a candidate the
    kernel cannot take would fail at launch, hours into a run), and grouped Gluon items are among FP8's."""
    from titan_megamoe.validation import check_tile_config

    for precision, table in (("bf16", candidates.CANDIDATES), ("fp8", candidates.CANDIDATES_FP8)):
        for kernel, cfgs in table.items():
            assert len(set(cfgs)) == len(cfgs), f"{precision} {kernel}: a candidate listed twice"
            for cfg in cfgs:
                check_tile_config(kernel, cfg, configs.ROW_BLOCK_M, precision)
    for kernel in ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dx"):
        assert any(c.gluon and c.group_m > 1 for c in candidates.CANDIDATES_FP8[kernel])
