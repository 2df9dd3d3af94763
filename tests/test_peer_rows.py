"""The symmetric-memory transport's kernels (`kernels.peer_rows`) with several ranks simulated in one
process: each "peer buffer" is an ordinary tensor whose address stands in for the mapped peer pointer.
The multi-process protocol (shared-memory files, gloo barriers, every rank's flags) is tests/test_ep.py's."""

import pytest
import torch

from moe_cases import sm90_compile_results
from titan_megamoe.kernels.common import INTERPRET
from titan_megamoe.kernels.peer_rows import scatter_rows, signal_peers, wait_for_peers

DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="the kernels need a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype,C", [(torch.bfloat16, 40), (torch.float32, 1), (torch.int64, 1),
                                     (torch.bfloat16, 2048)])
def test_scatter_rows_sends_each_row_to_its_rank_and_row(dtype, C):
    """Rows (read by an index, with repeats, or as they are) to their own (rank, row); three simulated
    ranks whose row areas are ordinary tensors; nothing written anywhere else."""
    gen = torch.Generator().manual_seed(C)
    src = (torch.randn(11, C, generator=gen) * 100).to(dtype).to(DEVICE)
    areas = [torch.full((16, C), -7, dtype=dtype, device=DEVICE) for _ in range(3)]
    addresses = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64, device=DEVICE)
    index = torch.tensor([10, 3, 3, 0, 7], device=DEVICE)  # repeats: a token sent to two experts of one rank
    rank = torch.tensor([2, 0, 2, 1, 0], dtype=torch.int32, device=DEVICE)
    row = torch.tensor([15, 0, 4, 9, 1], device=DEVICE)
    scatter_rows(src, rank, row, addresses, index)
    expected = [torch.full((16, C), -7, dtype=dtype) for _ in range(3)]
    for i, (q, p) in enumerate(zip(rank.tolist(), row.tolist())):
        expected[q][p] = src[index[i]].cpu()
    for got, want in zip(areas, expected):
        assert torch.equal(got.cpu(), want)
    rank2 = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    scatter_rows(src, rank2, torch.tensor([12, 13], device=DEVICE), addresses)  # no index: rows 0, 1 as they are
    assert torch.equal(areas[1][12].cpu(), src[0].cpu()) and torch.equal(areas[0][13].cpu(), src[1].cpu())
    scatter_rows(src, rank[:0], row[:0], addresses, index[:0])  # nothing to send: nothing written


def test_flags_carry_the_epoch_from_every_peer():
    world = 3
    flags = [torch.zeros(world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    addresses = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=DEVICE)
    for epoch in (1, 2):
        for me in range(world):
            signal_peers(addresses, me, epoch)
        for me in range(world):
            wait_for_peers(flags[me], epoch)  # returns: every peer has signalled this epoch
            assert flags[me].tolist() == [epoch] * world


@pytest.mark.parametrize("which", ["gemm1", "dgrad", "dgrad_gemm"])
def test_gemm_waits_for_its_experts_rows_to_land(which):
    """GEMM1, dgrad and dgrad's GEMM alone (the grouped GEMM, what dgrad runs on the GPU's split configs)
    with `arrivals` (the EP symmetric-memory path, x and dout rows): started while the
    rows and the per-expert counts are not there yet, the GEMM waits; once the rows are written and the
    counts raised (from another stream on the GPU, another thread in the interpreter, whose launches
    block) it finishes with exactly the result on rows that were there from the start."""
    import threading
    import time

    from titan_megamoe.kernels.configs import row_block_m
    from titan_megamoe.kernels.dgrad_swiglu import dgrad_swiglu
    from titan_megamoe.kernels.gemm1_swiglu import gemm1_swiglu
    from titan_megamoe.kernels.grouped_gemm import expert_h_grad
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    gen = torch.Generator().manual_seed(5)
    E, H, D = 3, 32, 48
    ids = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2], device=DEVICE)  # landed sorted by expert
    n = ids.numel()

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1]**0.5).to(torch.bfloat16).to(DEVICE)

    x = rnd(n, D)
    plan = build_routing_plan(ids, E, row_block_m())  # the tiles the kernels' configs take
    if which == "gemm1":
        w1, w3 = rnd(E, H, D), rnd(E, H, D)

        def run(rows, arrivals=None):
            return gemm1_swiglu(rows, w1, w3, plan, torch.bfloat16, "bf16", arrivals=arrivals)
    elif which == "dgrad_gemm":
        w2 = rnd(E, D, H)

        def run(rows, arrivals=None):
            return (expert_h_grad(rows, w2, plan, torch.bfloat16, "bf16", arrivals=arrivals),)
    else:
        w2, g, u = rnd(E, D, H), rnd(n, H), rnd(n, H)
        scores = torch.rand(n, generator=gen).to(DEVICE)

        def run(rows, arrivals=None):
            return dgrad_swiglu(rows, w2, g, u, scores, plan, "bf16", arrivals=arrivals)
    want = run(x)
    landing = torch.full_like(x, float("nan"))
    arrived = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    expected = torch.bincount(ids, minlength=E).to(torch.int32)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        waiter, feeder = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(waiter):
            got = run(landing, (arrived, expected))
            done = torch.cuda.Event()
            done.record()
        time.sleep(0.5)
        assert not done.query(), f"{which} did not wait for the rows"
        with torch.cuda.stream(feeder):
            landing.copy_(x)  # rows first, counts after them (one stream: in that order)
            arrived.copy_(expected)
        for _ in range(600):
            if done.query():
                break
            time.sleep(0.1)
        assert done.query(), f"{which} still waits after its rows landed"
    else:
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=run(landing, (arrived, expected))))
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive(), f"{which} did not wait for the rows"
        landing.copy_(x)
        arrived.copy_(expected)
        worker.join(timeout=120)
        assert not worker.is_alive()
        got = result["out"]
    for g_, ref in zip(got, want):
        assert torch.equal(g_, ref)


@pytest.mark.parametrize("which", ["gemm2", "dx"])
def test_gemm_epilogue_stores_rows_at_their_peers(which):
    """GEMM2 and dx's GEMM with `PeerRows` (EP, symmetric memory): each output row n lands at row
    dst_row[n] of rank dst_rank[n]'s area, bitwise the row the GEMM stores locally; nothing else is
    written. Three simulated ranks, skewed routing with an empty expert."""
    from titan_megamoe.kernels.configs import row_block_m
    from titan_megamoe.kernels.grouped_gemm import PeerRows, expert_down_proj, expert_input_grad
    from titan_megamoe.kernels.routing_meta import build_routing_plan

    gen = torch.Generator().manual_seed(11)
    E, H, D = 4, 32, 48
    ids = torch.tensor([3, 0, 0, 3, 3, 1, 3, 0, 3, 3, 3], device=DEVICE)  # expert 2 gets no rows
    n = ids.numel()
    plan = build_routing_plan(ids, E, row_block_m())

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1]**0.5).to(torch.bfloat16).to(DEVICE)

    if which == "gemm2":
        h, w2 = rnd(n, H), rnd(E, D, H)
        run = lambda peers=None: expert_down_proj(h, w2, plan, torch.bfloat16, "bf16", peers=peers)  # noqa: E731
    else:
        dg, du, w1, w3 = rnd(n, H), rnd(n, H), rnd(E, H, D), rnd(E, H, D)
        run = lambda peers=None: expert_input_grad(dg, du, w1, w3, plan, torch.bfloat16, "bf16",  # noqa: E731
                                                    peers=peers)
    want = run()
    areas = [torch.full((8, D), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
    addresses = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64, device=DEVICE)
    rank = torch.tensor([2, 0, 1, 2, 0, 0, 2, 1, 2, 0, 2], device=DEVICE)
    row = torch.tensor([7, 0, 3, 0, 5, 2, 4, 1, 2, 6, 5], device=DEVICE)
    # offsets from rank 1's area, as `symm_transport.back_from_gemm` makes them (some negative), by sorted row
    offsets = ((addresses[rank] - addresses[1]) // 2 + row * D)[plan.order_N]
    assert run(PeerRows(areas[1], offsets)) is None
    expected = [torch.full((8, D), float("nan"), dtype=torch.bfloat16) for _ in range(3)]
    for i, (q, p) in enumerate(zip(rank.tolist(), row.tolist())):
        expected[q][p] = want[i].cpu()
    for got, exp in zip(areas, expected):
        assert torch.equal(got.cpu().isnan(), exp.isnan())
        assert torch.equal(got.cpu().nan_to_num(), exp.nan_to_num())


_SM90 = r"""
import json, sys
sys.path.insert(0, "scripts")
from sm90_resources import compile_sm90
from titan_megamoe.kernels import peer_rows as p
out = {}
for dt in ("*bf16", "*fp32", "*i64"):
    sig = dict(src_ptr=dt, index_ptr="*i64", dst_rank_ptr="*i32", dst_row_ptr="*i64", row_addrs_ptr="*i64",
               dst_expert_ptr="*i32", counter_addrs_ptr="*i64", n_valid_ptr="*i32", n="i32", C="i32",
               stride_src="i32")
    out["scatter" + dt] = compile_sm90(p._scatter_rows_kernel, sig,
                                       dict(HAS_INDEX=True, COUNT=True, VALID_ON_DEVICE=True, BLOCK_R=8,
                                            BLOCK_C=1024),
                                       {k for k in sig if k.endswith("_ptr")}, 4, 1)["usage"]
out["signal"] = compile_sm90(p._signal_kernel, dict(flag_addrs_ptr="*i64", me="i32", epoch="i32", world="i32"),
                             dict(BLOCK=8), {"flag_addrs_ptr"}, 4, 1)["usage"]
out["wait"] = compile_sm90(p._wait_kernel, dict(flags_ptr="*i32", epoch="i32", world="i32"), {}, {"flags_ptr"}, 4,
                           1)["usage"]
from titan_megamoe.kernels.gemm1_swiglu import _gemm1_swiglu_kernel
from titan_megamoe.kernels.configs import tile_config
cfg = tile_config("gemm1_swiglu", 2048, 768)
sig = dict(x_ptr="*bf16", w1_ptr="*bf16", w3_ptr="*bf16", order_ptr="*i32", tile_expert_ptr="*i32",
           tile_row_ptr="*i32", offsets_ptr="*i32", g_ptr="*bf16", u_ptr="*bf16", h_ptr="*bf16", xs_ptr="*bf16",
           w1s_ptr="*bf16", w3s_ptr="*bf16", hs_ptr="*bf16", arrived_ptr="*i32", expected_ptr="*i32", D="i32",
           H="i32", rows_per_token="i32", stride_xt="i32", stride_we="i32", stride_wh="i32")
const = dict(BLOCK_M=cfg.block_m, SUB_TILES=1, GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             A_TMA=False, W_TMA=False, FP8=False, WAIT=True, INTERPRET=False)
r = compile_sm90(_gemm1_swiglu_kernel, sig, const, set(sig), cfg.num_warps, cfg.num_stages)
out["gemm1_wait"] = r["usage"] + (" wgmma" if r["hgmma"] else " NO-WGMMA") + f" fences={r['global_proxy_fences']}"
from titan_megamoe.kernels.grouped_gemm import _grouped_gemm_kernel
cfg = tile_config("gemm2", 2048, 768)
# the shipped GEMM2 config: both operands through TMA, warp-specialised
sig = dict(a1_ptr=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
           b1_ptr=f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>", order_ptr="*i32", tile_expert_ptr="*i32",
           tile_row_ptr="*i32", offsets_ptr="*i32", out_ptr="*bf16", dst_offset_ptr="*i64",
           KD="i32", ND="i32", stride_be="i32", stride_bk="i32", stride_bn="i32")
const = dict(TWO_PAIRS=False, TMA=True, B_TRANS=True, WS=cfg.warp_specialize, SORTED_OUT=False, PEER_OUT=True,
             WAIT=False, BLOCK_M=cfg.block_m, SUB_TILES=1, GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n,
             BLOCK_K=cfg.block_k, FP8=False, INTERPRET=False)  # the arguments named nowhere are None
r = compile_sm90(_grouped_gemm_kernel, sig, const, set(k for k in sig if k.endswith("_ptr")), cfg.num_warps,
                 cfg.num_stages)
out["gemm2_peer"] = r["usage"] + (" wgmma" if r["hgmma"] else " NO-WGMMA")
cfg = tile_config("dgrad_swiglu", 2048, 768)  # dgrad's GEMM on landing dout rows (bf16 split config)
sig.update(a1_ptr=f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
           b1_ptr=f"tensordesc<bf16[{cfg.block_k}, {cfg.block_n}]>", arrived_ptr="*i32", expected_ptr="*i32")
del sig["dst_offset_ptr"]
const.update(B_TRANS=False, WS=cfg.warp_specialize, SORTED_OUT=True, PEER_OUT=False, WAIT=True, BLOCK_M=cfg.block_m,
             GROUP_M=cfg.group_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
r = compile_sm90(_grouped_gemm_kernel, sig, const, set(k for k in sig if k.endswith("_ptr")), cfg.num_warps,
                 cfg.num_stages)
out["dgrad_gemm_wait"] = r["usage"] + (" wgmma" if r["hgmma"] else " NO-WGMMA") + f" fences={r['global_proxy_fences']}"
print(json.dumps(out))
"""


def test_transport_kernels_compile_for_sm90():
    """Integer-to-pointer casts of peer addresses, system-scope release/acquire atomics and the spin loops
    (the flags' wait, GEMM1's and dgrad's GEMM's wait for their expert's rows, which must still lower to
    wgmma and end in one async-proxy fence) and GEMM2's stores to peer rows compile for sm_90 (Triton's
    bundled ptxas, no GPU needed)."""
    usage = sm90_compile_results(_SM90, timeout=300)
    assert set(usage) == {"scatter*bf16", "scatter*fp32", "scatter*i64", "signal", "wait", "gemm1_wait",
                          "gemm2_peer", "dgrad_gemm_wait"}
    for name in ("gemm1_wait", "gemm2_peer", "dgrad_gemm_wait"):
        assert " wgmma" in usage[name], (name, usage[name])
    for name in ("gemm1_wait", "dgrad_gemm_wait"):  # the rows' acquire ordered before TMA (async-proxy) reads
        assert usage[name].endswith(" fences=1"), (name, usage[name])
    assert all(u.startswith("REG:") for u in usage.values()), usage
