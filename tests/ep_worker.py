"""The ranks of the expert-parallel checks in tests/test_ep.py (one subprocess per rank: gloo on CPU, or
NCCL with one GPU per rank).

One process group runs several EP calls on one global problem (`--runs`: backend/transport/precision/
capacity per run). Every rank builds the same problem and runs each call on its own tokens and experts.
Each (backend, precision) has a checker rank (round robin over the ranks): it gathers every rank's output,
dx, score gradient and expert weight gradients of those calls and, once all EP calls are done, compares
them with the single-process op on all tokens, which it alone computes. On CPU that op in Triton's
interpreter costs as much as all ranks' EP calls together, so computing it on every rank was most of these
tests' time, and the checkers now compute theirs at the same time. A checker prints "rank R ok ..." per
rank and run.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_cases import forward_backward, make_case  # noqa: E402

TRANSPORTS = ("all_to_all", "symm_mem")
PRECISIONS = ("bf16", "fp8", "fp8_bwd")


def parse_run(spec: str) -> dict:
    """`backend:transport:precision[:capacity_factor][:ckpt]`, e.g. `triton:symm_mem:bf16:2.0`; `ckpt`: the
    call under activation checkpointing, whose recompute must run the first forward step and not GEMM2."""
    parts = spec.split(":")
    ckpt = parts[-1] == "ckpt"
    parts = parts[:-1] if ckpt else parts
    if len(parts) not in (3, 4) or parts[0] not in ("triton", "reference") or parts[1] not in TRANSPORTS \
            or parts[2] not in PRECISIONS or (ckpt and parts[0] != "triton"):
        raise SystemExit(f"bad run {spec!r}: want backend:transport:precision[:capacity_factor][:ckpt] (ckpt: triton)")
    return {"label": spec, "backend": parts[0], "transport": parts[1], "precision": parts[2],
            "capacity": float(parts[3]) if len(parts) == 4 else None, "ckpt": ckpt}


def counted_steps():
    """(how often the EP forward's two steps run GEMM1 and GEMM2 on this rank from now on, {"up": n,
    "down": n}; a function that stops counting)."""
    from titan_megamoe.pipeline import ep_dispatch

    calls, reals = {"up": 0, "down": 0}, {}
    for step in calls:
        reals[step] = real = getattr(ep_dispatch, f"ffn_{step}")

        def counting(*args, _real=real, _step=step, **kwargs):
            calls[_step] += 1
            return _real(*args, **kwargs)

        setattr(ep_dispatch, f"ffn_{step}", counting)
    return calls, lambda: [setattr(ep_dispatch, f"ffn_{step}", real) for step, real in reals.items()]


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


def rank_slices(T: int, E: int, rank: int, ep: int) -> tuple[slice, slice]:
    """A rank's tokens (an uneven split when T is not a multiple of ep) and its experts."""
    el = E // ep
    return slice(T * rank // ep, T * (rank + 1) // ep), slice(rank * el, (rank + 1) * el)


def run_ep(run: dict, case, dout, rank: int, ep: int) -> dict:
    """This rank's EP call (twice under symm_mem: the second reuses the buffers and must repeat the first)."""
    import titan_megamoe

    E = case.w1.shape[0]
    tok, exp = rank_slices(case.x.shape[0], E, rank, ep)
    mine = copy.copy(case)
    mine.x, mine.ids, mine.scores = case.x[tok], case.ids[tok], case.scores[tok]
    mine.w1, mine.w2, mine.w3 = case.w1[exp], case.w2[exp], case.w3[exp]
    op = lambda *t, cf=run["capacity"]: titan_megamoe.moe(  # noqa: E731
        *t, backend=run["backend"], precision=run["precision"], ep_group=dist.group.WORLD,
        ep_transport=run["transport"], ep_capacity_factor=cf)
    if run["ckpt"]:
        from torch.utils.checkpoint import checkpoint

        plain, (calls, stop_counting) = op, counted_steps()
        op = lambda *t: checkpoint(plain, *t, use_reentrant=False)  # noqa: E731
    got = forward_backward(op, mine, dout[tok])
    if run["ckpt"]:  # the recompute ran route, rows out and GEMM1, and stopped before GEMM2 and the return trip
        stop_counting()
        assert calls == {"up": 2, "down": 1}, f"rank {rank}: {calls}"
    if run["transport"] == "symm_mem":
        again = forward_backward(op, mine, dout[tok])
        for name, g in got.items():
            assert torch.equal(again[name], g), f"rank {rank} {name}: a second call differs"
    if run["capacity"] is not None:
        check_capacity_errors(op, mine, dout[tok], E // ep, rank, got)
    return {name: g.cpu() for name, g in got.items()}


def compare(run: dict, got_by_rank: list[dict], whole: dict, case, ep: int) -> None:
    """A checker rank: every rank's results against its slice of the single-process op on all tokens."""
    T, E = case.x.shape[0], case.w1.shape[0]
    label = run["label"]
    for rank, got in enumerate(got_by_rank):
        tok, exp = rank_slices(T, E, rank, ep)
        want = {"out": whole["out"][tok], "dx": whole["dx"][tok], "dscores": whole["dscores"][tok],
                "dw1": whole["dw1"][exp], "dw2": whole["dw2"][exp], "dw3": whole["dw3"][exp]}
        for name, ref in want.items():
            g, where = got[name], f"{label}: rank {rank} {name}"
            assert g.shape == ref.shape, f"{where}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
            if run["backend"] == "triton":  # same kernels, same row order per expert: bitwise the single-GPU result
                assert torch.equal(g, ref), f"{where}: max diff {(g.float() - ref.float()).abs().max():.3e}"
            else:
                torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=where)
        received = int((case.ids.reshape(-1) // (E // ep) == rank).sum())
        print(f"rank {rank} ok [{label}]: {tok.stop - tok.start} tokens, {received} rows received", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs=5, type=int, metavar=("T", "D", "H", "E", "K"), required=True)
    ap.add_argument("--routing", default="random")
    ap.add_argument("--runs", nargs="+", type=parse_run, required=True,
                    help="backend:transport:precision[:capacity_factor] per EP call; a capacity factor "
                         "(symm_mem without the host sync) also checks the errors of a too small factor and "
                         "of ranks routing different numbers of rows")
    a = ap.parse_args()
    rank, ep = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"

    import titan_megamoe

    T, D, H, E, K = a.shape
    cases, checkers, gathered = {}, {}, []
    for run in a.runs:
        dtype = torch.float32 if run["backend"] == "reference" else torch.bfloat16
        if dtype not in cases:
            case = make_case(T, D, H, E, K, "skewed" if a.routing == "mostly_last" else "random", dtype=dtype,
                             device=device, seed=T + E)
            case.ids = ids_for(a.routing, case.ids, E, ep)
            dout = torch.randn(T, D, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
            cases[dtype] = (case, dout)
        case, dout = cases[dtype]
        got = run_ep(run, case, dout, rank, ep)
        key = (run["backend"], run["precision"])
        checker = checkers.setdefault(key, len(checkers) % ep)
        got_by_rank = [None] * ep if rank == checker else None
        dist.gather_object(got, got_by_rank, dst=checker)
        if rank == checker:
            gathered.append((run, got_by_rank, case, dout))
    wholes = {}
    for run, got_by_rank, case, dout in gathered:  # every checker at once, after the last collective
        key = (run["backend"], run["precision"])
        if key not in wholes:
            wholes[key] = {n: t.cpu() for n, t in forward_backward(
                lambda *t: titan_megamoe.moe(*t, backend=run["backend"], precision=run["precision"]),
                case, dout).items()}
        compare(run, got_by_rank, wholes[key], case, ep)
    dist.barrier()  # every rank waits for the checkers' comparisons, so a failure there ends the job first
    dist.destroy_process_group()
    if not cuda:
        from titan_megamoe.integrations.torchtitan.cpu import exit_skipping_teardown

        exit_skipping_teardown()


if __name__ == "__main__":
    main()
