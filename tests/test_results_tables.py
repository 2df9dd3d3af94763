"""scripts/results_tables.py: docs/results/README.md is its output, and it says which files carry no commit."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def load_tables():
    spec = importlib.util.spec_from_file_location("results_tables_under_test", REPO / "scripts" / "results_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_provenance_line_names_the_files_without_a_commit(tmp_path):
    tables = load_tables()
    (tmp_path / "bench_layer_1.json").write_text(json.dumps({"environment": {"commit": "abc"}}))
    (tmp_path / "tune_1.json").write_text(json.dumps({"gpu": "H200"}))
    files = sorted(tmp_path.glob("*.json"))
    line = tables.provenance_line(files, tmp_path)
    assert "all but 1 of the 2 also record the commit" in line and "`tune_1.json`" in line
    assert "bench_layer_1" not in line
    assert tables.provenance_line(files[:1], tmp_path).endswith("and its commit.")


def test_committed_results_readme_is_the_generators_output(tmp_path, monkeypatch):
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    monkeypatch.setattr(sys, "argv", ["results_tables.py", "--dir", str(copy)])
    load_tables().main()
    assert (copy / "README.md").read_text() == (RESULTS / "README.md").read_text(), (
        "docs/results/README.md differs from scripts/results_tables.py's output: regenerate it")
    head = (RESULTS / "README.md").read_text().splitlines()[3]
    assert "No commit in:" in head and "tune_4096x1536_20261203T065744.json" in head


def test_a_rounds_ab_gets_one_line_per_round_and_the_spread(tmp_path):
    """An `ab --rounds` summary (titan_megamoe.ab.stats.rounds_summary's shape) in docs/results."""
    run = tmp_path / "ab_x_rounds"
    run.mkdir()
    per_round = [{"round": i, "run_order": order, "speedup": v, "loss_diff_max": 0.01 * i}
                 for i, (order, v) in enumerate([(["stock", "mega_moe"], 1.30), (["mega_moe", "stock"], 1.32)], 1)]
    (run / "ab.json").write_text(json.dumps({
        "config": "/x/qwen3_30b_a3b_1gpu.toml", "steps": 50, "warmup": 5, "deterministic": False, "rounds_run": 2,
        "arm_order": ["stock", "mega_moe"], "per_round": per_round,
        "speedup": {"median": 1.31, "min": 1.30, "max": 1.32, "n": 2},
        "environment": {"device": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "git": {"commit": "f85db02"},
                        "date": "2026-12-04"}}))
    text = "\n".join(load_tables().ab_section(run / "ab.json"))
    assert "commit f85db02" in text and "2 rounds" in text
    assert "- round 2 (mega_moe first): speedup 1.320x, loss |diff| max 0.02000" in text
    assert "median 1.310x, min 1.300x, max 1.320x" in text
