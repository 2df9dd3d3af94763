"""Expert parallelism, both transports: EP ranks against the single-process op on all tokens.

Each case starts one process per rank (tests/ep_worker.py does the work and the comparison): with a GPU per
rank, NCCL and the compiled kernels; otherwise gloo on CPU with the kernels in Triton's interpreter (also
on a GPU host with fewer GPUs than ranks). The Triton backend must give bitwise the single-GPU result (each
expert sees its rows in the same order); the reference backend agrees to fp32 rounding.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(ep: int, *args: str) -> list[str]:
    port = _free_port()
    procs = []
    gpus = torch.cuda.device_count()
    for rank in range(ep):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ep), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        if gpus < ep:
            env["TRITON_INTERPRET"] = "1"
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "ep_worker.py"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
        assert f"rank {rank} ok" in out, out[-2000:]
    return outs


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("ep,shape,routing", [
    (2, (37, 32, 32, 8, 2), "random"),  # T not a multiple of the EP degree
    (2, (24, 32, 48, 6, 3), "mostly_last"),  # one rank receives most rows
    (2, (16, 32, 32, 4, 2), "rank0_only"),  # rank 1 receives no rows (its experts get no gradient rows)
    (4, (29, 32, 32, 8, 2), "random"),
])
def test_expert_parallel_matches_single_process(backend, ep, shape, routing):
    outs = _run_ranks(ep, "--backend", backend, "--shape", *map(str, shape), "--routing", routing)
    if routing == "rank0_only":
        assert "0 rows received" in outs[1]


@pytest.mark.parametrize("ep,shape,routing", [
    (4, (29, 32, 32, 8, 2), "random"),  # uneven counts between every pair of ranks
    (2, (16, 32, 32, 4, 2), "rank0_only"),  # a rank that receives nothing still joins every barrier
    (2, (24, 32, 48, 6, 3), "mostly_last"),  # one rank receives most rows
])
def test_symmetric_memory_transport_matches_single_process(ep, shape, routing):
    """The symmetric-memory transport: bitwise the single-process op, like the all-to-all (on CPU its
    shared-memory stand-in with gloo barriers; with a GPU per rank, torch symmetric memory)."""
    outs = _run_ranks(ep, "--backend", "triton", "--shape", *map(str, shape), "--routing", routing,
                      "--transport", "symm_mem")
    if routing == "rank0_only":
        assert "0 rows received" in outs[1]


@pytest.mark.parametrize("ep,shape,routing", [
    (4, (32, 32, 32, 8, 2), "random"),
    (2, (16, 32, 32, 4, 2), "rank0_only"),  # rank 0 receives exactly its capacity (2 x its rows), rank 1 none
])
def test_symmetric_memory_with_capacity_matches_single_process(ep, shape, routing):
    """symm_mem with ep_capacity_factor (no host sync; buffers from the bound, rows past the count
    padding): bitwise the single-process op; a too small factor and ranks routing different numbers of
    rows stop the call with their errors on every rank, and the buffers serve the next call."""
    _run_ranks(ep, "--backend", "triton", "--shape", *map(str, shape), "--routing", routing,
               "--transport", "symm_mem", "--capacity-factor", "2.0")


@pytest.mark.parametrize("precision,transport,capacity", [
    ("fp8", "all_to_all", None),
    ("fp8_bwd", "symm_mem", "2.0"),  # the bf16 forward inside the GEMMs, the FP8 backward by whole exchanges
])
def test_block_fp8_under_expert_parallelism_matches_single_process(precision, transport, capacity):
    """Block FP8 under EP: the received rows are quantized where they land, in the same expert-sorted order
    and token tiles as on one GPU, so the result is bitwise the single-process FP8 op."""
    args = ["--backend", "triton", "--shape", "24", "128", "128", "4", "2", "--routing", "mostly_last",
            "--transport", transport, "--precision", precision]
    _run_ranks(2, *args, *(["--capacity-factor", capacity] if capacity else []))


def test_ep_transport_errors_name_the_choices():
    import titan_megamoe
    from moe_cases import make_case

    case = make_case(4, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="ep_transport must be one of all_to_all, symm_mem, got 'nccl'"):
        titan_megamoe.moe(*case.inputs(), backend="reference", ep_transport="nccl")
    with pytest.raises(ValueError, match="ep_transport='symm_mem' runs the Triton backend.*'all_to_all'"):
        titan_megamoe.moe(*case.inputs(), backend="reference", ep_group=object(), ep_transport="symm_mem")
    for bad in (0.5, "2", True, float("nan")):
        with pytest.raises(ValueError, match="ep_capacity_factor must be None .* or a number >= 1"):
            titan_megamoe.moe(*case.inputs(), backend="reference", ep_transport="symm_mem", ep_capacity_factor=bad)
    with pytest.raises(ValueError, match="ep_capacity_factor applies to ep_transport='symm_mem'"):
        titan_megamoe.moe(*case.inputs(), backend="reference", ep_capacity_factor=2.0)
