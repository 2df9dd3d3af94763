"""One rank of the expert-parallel checks in tests/test_ep.py (run as a subprocess per rank, gloo on CPU,
or NCCL with one GPU per rank).

Every rank builds the same global problem, runs the EP op on its own tokens and experts, and compares
against the single-process op on all tokens: the output, dx and the score gradient of its tokens, and the
weight gradients of its experts. Prints one line "rank R ok ..." on success.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_cases import forward_backward, make_case  # noqa: E402


def ids_for(routing: str, ids: torch.Tensor, E: int, ep: int) -> torch.Tensor:
    if routing == "rank0_only":  # every row to rank 0's experts: the other ranks receive nothing
        return ids % (E // ep)
    if routing == "mostly_last":  # skew: most rows to the last rank
        last = E - E // ep + ids % (E // ep)
        return torch.where(ids % 5 == 0, ids, last)
    return ids


def check_capacity_errors(op, mine, dout, el: int, rank: int, got: dict) -> None:
    """With a capacity factor, the two device-side checks stop the call (on every rank, before any row
    moves): a rank that would receive more rows than the factor allows, and ranks routing different
    numbers of rows. Afterwards the buffers still serve a good call."""
    import copy

    hot = copy.copy(mine)
    hot.ids = mine.ids % el  # every row to rank 0's experts: EP x the rows a rank routes
    try:
        op(*hot.inputs(), cf=1.0)
        raise AssertionError(f"rank {rank}: a capacity overflow was not caught")
    except RuntimeError as e:
        assert "would receive more rows than ep_capacity_factor=1.0 allows" in str(e), str(e)
        assert len(str(e)) < 255, "CUDA's device assert takes messages under 255 characters"
    short = copy.copy(mine)
    if rank == 0:
        short.x, short.ids, short.scores = mine.x[1:], mine.ids[1:], mine.scores[1:]
    try:
        op(*short.inputs())
        raise AssertionError(f"rank {rank}: unequal rows per rank were not caught")
    except RuntimeError as e:
        assert "must route the same number of rows" in str(e) and len(str(e)) < 255, str(e)
    again = forward_backward(op, mine, dout)
    for name, g in got.items():
        assert torch.equal(again[name], g), f"rank {rank} {name}: the call after the errors differs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["reference", "triton"])
    ap.add_argument("--shape", nargs=5, type=int, metavar=("T", "D", "H", "E", "K"))
    ap.add_argument("--routing", default="random")
    ap.add_argument("--transport", default="all_to_all", choices=["all_to_all", "symm_mem"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "fp8_bwd"])
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="symm_mem without the host sync; then also checks the errors of a too small factor "
                         "and of ranks routing different numbers of rows")
    a = ap.parse_args()
    rank, ep = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and a.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"

    import titan_megamoe

    T, D, H, E, K = a.shape
    dtype = torch.float32 if a.backend == "reference" else torch.bfloat16
    case = make_case(T, D, H, E, K, "skewed" if a.routing == "mostly_last" else "random", dtype=dtype, device=device,
                     seed=T + E)
    case.ids = ids_for(a.routing, case.ids, E, ep)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    whole = forward_backward(lambda *t: titan_megamoe.moe(*t, backend=a.backend, precision=a.precision), case, dout)

    # this rank's tokens (an uneven split when T is not a multiple of ep) and experts
    bounds = [T * r // ep for r in range(ep + 1)]
    tok = slice(bounds[rank], bounds[rank + 1])
    el = E // ep
    exp = slice(rank * el, (rank + 1) * el)
    mine = make_case(1, D, H, E, K, dtype=dtype, device=device)
    mine.x, mine.ids, mine.scores = case.x[tok], case.ids[tok], case.scores[tok]
    mine.w1, mine.w2, mine.w3 = case.w1[exp], case.w2[exp], case.w3[exp]
    group = dist.group.WORLD
    op = lambda *t, cf=a.capacity_factor: titan_megamoe.moe(  # noqa: E731
        *t, backend=a.backend, precision=a.precision, ep_group=group, ep_transport=a.transport,
        ep_capacity_factor=cf)
    got = forward_backward(op, mine, dout[tok])
    if a.transport == "symm_mem":
        # a second call reuses the buffers (epochs and counters go on from the first): the same result
        again = forward_backward(op, mine, dout[tok])
        for name, g in got.items():
            assert torch.equal(again[name], g), f"rank {rank} {name}: a second call differs"

    want = {"out": whole["out"][tok], "dx": whole["dx"][tok], "dscores": whole["dscores"][tok],
            "dw1": whole["dw1"][exp], "dw2": whole["dw2"][exp], "dw3": whole["dw3"][exp]}
    for name, ref in want.items():
        g = got[name]
        assert g.shape == ref.shape, f"rank {rank} {name}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
        if a.backend == "triton":  # same kernels, same row order per expert: bitwise the single-GPU result
            assert torch.equal(g, ref), f"rank {rank} {name}: max diff {(g.float() - ref.float()).abs().max():.3e}"
        else:
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    if a.capacity_factor is not None:
        check_capacity_errors(op, mine, dout[tok], el, rank, got)
    received = sum(int(n) for n in torch.bincount(case.ids.reshape(-1) // el, minlength=ep)[rank:rank + 1])
    print(f"rank {rank} ok: {tok.stop - tok.start} tokens, {received} rows received", flush=True)
    dist.destroy_process_group()
    if not cuda:
        from titan_megamoe.integrations.torchtitan.cpu import exit_skipping_teardown

        exit_skipping_teardown()


if __name__ == "__main__":
    main()
