"""scripts/bench_ep.py end to end on CPU: 2 gloo ranks under torch.distributed.run, tiny shapes.

What is checked is the benchmark's logic, not speed: it runs to the end (correctness gate passed on every
rank), writes both arms' timings, and its byte counts agree with the routing it recorded (every row one
rank sends is a row another receives). The run uses `--transport symm_mem` (on CPU its shared-memory
stand-in; the all-to-all transport is the default and tests/test_ep.py runs both); `--backend reference`
with it stops with a clear message.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_ep.py")
TINY = ["--device", "cpu", "--shape", "32", "32", "4", "2", "--tokens-per-rank", "16", "--iters", "2",
        "--warmup", "0", "--rounds", "2"]


def run_two_ranks(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("on a GPU host the benchmark runs on the GPUs (torchrun scripts/bench_ep.py)")
    out = tmp_path_factory.mktemp("bench_ep")
    # the mega layer without the host sync (2 x the rows a rank routes holds any routing at EP 2)
    p = run_two_ranks(*TINY, "--routing", "skewed", "--transport", "symm_mem", "--capacity-factor", "2",
                      "--out", str(out))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    (path,) = out.glob("bench_ep_*.json")
    return p.stdout, json.loads(path.read_text())


def test_both_arms_timed_and_the_table_says_cpu_timings_mean_nothing(cpu_run):
    stdout, data = cpu_run
    env, (r,) = data["environment"], data["results"]
    assert env["world_size"] == 2 and env["transport"] == "symm_mem" and env["commit"]
    assert env["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert (r["D"], r["H"], r["E"], r["K"], r["tokens_per_rank"], r["routing"]) == (32, 32, 4, 2, 16, "skewed")
    assert r["capacity_factor"] == 2.0
    for arm in ("stock", "mega"):
        for kind in ("fwd", "fwdbwd"):
            assert r[f"{arm}_{kind}_ms"] > 0 and len(r[f"{arm}_{kind}_ms_per_rank"]) == 2
            assert r[f"{arm}_{kind}_tflops_per_gpu"] > 0
    for rank in r["ranks"]:
        assert max(rank["rel_l2_vs_stock"].values()) < 5e-2
        assert all(len(v) == 2 for v in rank["samples_ms"].values())  # --iters 2 over 2 rounds
    assert set(r["transport_calls"]) == {"route", "dispatch_x", "dispatch_ids_scores", "combine_y"}
    assert "MEANINGLESS" in stdout and "mega transport alone" in stdout


def test_bytes_agree_with_the_recorded_routing(cpu_run):
    _, data = cpu_run
    (r,) = data["results"]
    ranks = r["ranks"]
    send = [rank["send_splits"] for rank in ranks]
    recv = [rank["recv_splits"] for rank in ranks]
    assert [sum(s) for s in send] == [16 * 2] * 2  # every routed row (T*K) goes somewhere, none dropped
    assert all(send[src][dst] == recv[dst][src] for src in range(2) for dst in range(2))
    D = r["D"]
    for me, rank in enumerate(ranks):
        t = rank["traffic_bytes"]
        out_rows = sum(send[me]) - send[me][me]
        assert t["rows_sent_off_rank"] == out_rows and t["rows_received_off_rank"] == sum(recv[me]) - recv[me][me]
        assert t["by_transfer"]["mega_fwd"]["x"]["sent"] == out_rows * D * 2
        assert t["by_transfer"]["mega_fwd"]["y"]["received"] == out_rows * D * 2
    for arm in ("stock", "mega"):
        for kind in ("fwd", "fwdbwd"):
            sent, received = r[f"{arm}_{kind}_bytes_sent_per_rank"], r[f"{arm}_{kind}_bytes_received_per_rank"]
            assert sum(sent) == sum(received) > 0, (arm, kind)
    for call in r["transport_calls"].values():
        assert sum(call["bytes_sent_per_rank"]) == sum(call["bytes_received_per_rank"]) > 0


def test_symm_mem_transport_with_the_reference_backend_is_a_clear_error(tmp_path):
    p = run_two_ranks(*TINY, "--transport", "symm_mem", "--backend", "reference", "--out", str(tmp_path))
    assert p.returncode != 0
    assert "--transport symm_mem runs the Triton backend" in p.stdout + p.stderr
    assert not list(tmp_path.glob("bench_ep_*.json"))
