"""Expert parallelism, both transports: EP ranks against the single-process op on all tokens.

Each problem starts one process per rank (tests/ep_worker.py does the work, a checker rank per backend and
precision the comparison): with a GPU per rank, NCCL and the compiled kernels; otherwise gloo on CPU with
the kernels in Triton's interpreter (also on a GPU host with fewer GPUs than ranks). The Triton backend must give bitwise the single-GPU result (each
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


def _run_ranks(ep: int, *args: str) -> str:
    """Run tests/ep_worker.py on `ep` ranks; every rank's output, in rank order (the checker ranks print
    their comparisons of every rank)."""
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
    failed = [f"rank {rank} failed (exit {p.returncode}):\n{out[-3000:]}"
              for rank, (p, out) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, "\n".join(failed)  # every failed rank: the first error may be on any of them
    return "".join(outs)


# One process group per problem runs every EP call listed for it (backend:transport:precision[:capacity
# factor]); a checker rank per backend and precision compares them with the single-process op, which it
# computes once.
A2A, A2A_REF, SYMM = "triton:all_to_all:bf16", "reference:all_to_all:bf16", "triton:symm_mem:bf16"
EP_PROBLEMS = {
    # T not a multiple of the EP degree
    "ep2-T37-random": (2, (37, 32, 32, 8, 2), "random", (A2A, A2A_REF)),
    # one rank receives most rows
    "ep2-mostly_last": (2, (24, 32, 48, 6, 3), "mostly_last", (A2A, A2A_REF, SYMM)),
    # rank 1 receives no rows (its experts get no gradient rows) but joins every exchange and barrier; with a
    # capacity factor rank 0 receives exactly its capacity (2 x its rows)
    "ep2-rank0_only": (2, (16, 32, 32, 4, 2), "rank0_only", (A2A, A2A_REF, SYMM, SYMM + ":2.0")),
    # uneven counts between every pair of ranks; symm_mem with a capacity factor (no host sync: buffers from
    # the bound, rows past the count padding), whose device-side checks stop a too small factor and ranks
    # routing different numbers of rows, the buffers serving the next call
    "ep4-random": (4, (32, 32, 32, 8, 2), "random", (A2A, A2A_REF, SYMM, SYMM + ":2.0")),
    # block FP8: the received rows are quantized where they land, in the same expert-sorted order and token
    # tiles as on one GPU; fp8_bwd's bf16 forward inside the GEMMs, its FP8 backward by whole exchanges
    "ep2-fp8": (2, (24, 128, 128, 4, 2), "mostly_last", ("triton:all_to_all:fp8", "triton:symm_mem:fp8_bwd:2.0")),
    # under activation checkpointing (the worker counts each rank's GEMM1 and GEMM2 calls: the recompute
    # stops before GEMM2 and the return trip, on every rank), both transports; results as without it
    "ep2-checkpointed": (2, (24, 32, 48, 6, 3), "mostly_last", (A2A + ":ckpt", SYMM + ":ckpt")),
}


@pytest.mark.parametrize("name", list(EP_PROBLEMS))
def test_expert_parallel_matches_single_process(name):
    """Every EP call of the problem: the Triton backend bitwise the single-process op (each expert sees its
    rows in the same order), the reference backend to fp32 rounding; under symm_mem each call twice in a row
    (the second reuses the buffers: epochs and counters go on from the first)."""
    ep, shape, routing, runs = EP_PROBLEMS[name]
    out = _run_ranks(ep, "--shape", *map(str, shape), "--routing", routing, "--runs", *runs)
    for run in runs:
        for rank in range(ep):
            assert f"rank {rank} ok [{run}]" in out, out[-3000:]
    if routing == "rank0_only":
        assert f"rank 1 ok [{A2A}]: 8 tokens, 0 rows received" in out, out[-3000:]


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
