"""scripts/tune_kernels.py --merge: the shipped table is rebuilt from a recorded every-candidate run."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tuner():
    spec = importlib.util.spec_from_file_location("tune_kernels", ROOT / "scripts" / "tune_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merge_keeps_fastest_config_per_kernel(tmp_path, monkeypatch):
    tuner = _tuner()
    table = tmp_path / "tuned_configs.json"
    gemm2 = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "tma": False,
             "split": False, "warp_specialize": False}
    table.write_text(json.dumps({"configs": {"bf16": {"2048x768": {"gemm2": gemm2}}}, "measured": {}}))
    monkeypatch.setattr(tuner.configs, "TABLE_PATH", table)
    run = {"gpu": "NVIDIA H200", "date": "2026-12-02T15:47:00+00:00", "shape": [4096, 1536, 128, 8, 16384],
           "runs": [{"kernel": "dx", "config": [128, 128, 64, 8, 3], "ms": 7.6, "tflops": 431.0},
                    {"kernel": "dx", "config": [128, 256, 32, 8, 4], "ms": 5.8, "tflops": 564.0},
                    {"kernel": "wgrad_w2", "config": {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8,
                                                      "num_stages": 5}, "ms": 4.2, "tflops": 388.0}]}
    tuner.merge_run(run)
    out = json.loads(table.read_text())
    C = tuner.TileConfig
    assert out["configs"]["bf16"]["2048x768"] == {"gemm2": gemm2}, "other shapes stay untouched"
    # recorded configs (positional lists of older runs, or named fields) are written with named fields
    assert out["configs"]["bf16"]["4096x1536"] == {"dx": C(128, 256, 32, 8, 4).to_record(),
                                                   "wgrad_w2": C(128, 128, 32, 8, 5).to_record()}
    assert out["measured"]["bf16"]["4096x1536"]["dx"]["ms"] == 5.8
    assert out["measured"]["bf16"]["4096x1536"]["dx"]["gpu"] == "NVIDIA H200"


def _recorded_groups():
    """Every committed tuning run's candidates, grouped by (precision, "DxH", kernel): the every-candidate
    JSON of scripts/tune_kernels.py (one shape per file) and the table files of `titan-megamoe tune`."""
    groups: dict = {}
    for path in sorted((ROOT / "docs" / "results").glob("tune_*.json")):
        data = json.loads(path.read_text())
        for r in data["runs"]:
            if "ms" not in r:  # a candidate that failed to compile or its oracle check
                continue
            shape = r.get("shape", data.get("shape"))
            precision = r.get("precision", data.get("precision", "bf16"))
            key = (precision, "{}x{}".format(*shape[:2]), r["kernel"], path.name)
            groups.setdefault(key, []).append(r)
    return groups


def test_shipped_table_matches_recorded_runs():
    """Every measured entry of the shipped table is the fastest candidate of one committed run."""
    from titan_megamoe.kernels.configs import TileConfig

    shipped = json.loads((ROOT / "titan_megamoe" / "kernels" / "tuned_configs.json").read_text())
    groups = _recorded_groups()
    assert groups, "the table must come from committed runs"
    for precision, shapes in shipped["measured"].items():
        for key, kernels in shapes.items():
            for kernel, measured in kernels.items():
                cfg = TileConfig.from_record(shipped["configs"][precision][key][kernel])
                sources = [runs for (p, k, kern, _), runs in groups.items() if (p, k, kern) == (precision, key, kernel)
                           and any(r["ms"] == measured["ms"] and TileConfig.from_record(r["config"]) == cfg
                                   for r in runs)]
                assert sources, f"{precision} {key} {kernel}: no committed run has this config at {measured['ms']} ms"
                assert any(min(r["ms"] for r in runs) == measured["ms"] for runs in sources), (
                    f"{precision} {key} {kernel}: not the fastest candidate of its run")
