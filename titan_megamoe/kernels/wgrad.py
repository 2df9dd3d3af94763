"""Expert weight gradients: grouped GEMMs whose reduction runs over each expert's rows (varlen-K).

For local expert e with sorted positions ``offsets_E1[e] <= p < offsets_E1[e+1]`` both weight gradients
have the form C_e[M, N] = sum_p A[rowA(p), :]^T B[rowB(p), :] (fp32 accumulation), where an operand's row
is the sorted position p or, gathered, the plan's source row order[p] // K:
- dW2[e] (D x H) = sum_p dout[r(p)]^T (s h)[p]     A = dout gathered, B = s*h sorted (the dgrad epilogue
  wrote the score into h, so the main loop has no per-row scaling)
- dW1[e] (H x D) = sum_p dg[p]^T x[r(p)],  dW3[e] likewise with du: A = dg / du sorted, B = x gathered;
  one kernel, two accumulators, one load of each gathered x tile.

One program per output tile (expert, m-tile, n-tile), experts heaviest first (`schedule.expert_output_tile`).
An empty expert runs zero iterations and stores zeros: every output element is written by the kernel,
nothing relies on a memset. No atomics: the result is bitwise reproducible for a given config.

Block FP8 (`expert_wgrad_w2_fp8`, `expert_wgrad_w13_fp8`): the same products over operands in the
token-tile layout (`quant.quantize_token_tiles`: e4m3 [C, num_tiles * 128], one fp32 scale per row and
plan tile), so the reduction walks expert e's consecutive tiles (`mainloop.token_tile_mainloop`) and
needs no gather: the layout already holds the rows in sorted order. Expert e's first tile is the sum
of ceil(count / 128) over the experts before it, computed in the kernel from the offsets (no host sync).
The result is the emulation's (`oracle._fp8_backward`: dequantized token blocks, fp32 GEMM) up to the
order of fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import RoutingPlan
from ..precision import BlockScaled
from ..validation import check_kernel_operand, check_row_alignment, check_wgrad_out_dtype
from .common import INTERPRET, cast_rne, cdiv, new_output, next_power_of_2, tma_ok
from .launch import launch
from .configs import FP8_BLOCK, tile_config
from .mainloop import token_tile_mainloop, varlen_mainloop
from .schedule import expert_output_tile
from .sorted_rows import sorted_rows


@triton.jit
def _store_output(c_ptr, c2_ptr, acc, acc2, expert, offs_m, offs_n, M, N, stride_ce, stride_cm, DUAL: tl.constexpr,
                  EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the accumulator tile(s) of one expert's output tile (masked at the M / N edges)."""
    if OUT_BF16:
        acc = cast_rne(acc, tl.bfloat16, INTERPRET)
        if DUAL:
            acc2 = cast_rne(acc2, tl.bfloat16, INTERPRET)
    c_off = expert.to(tl.int64) * stride_ce + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if EVEN_M and EVEN_N:
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty))
        if DUAL:
            tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty))
    else:
        mask_c = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=mask_c)
        if DUAL:
            tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _expert_wgrad_kernel(
    a_ptr, a2_ptr, b_ptr,  # A [*, M] and B [*, N] rows (pointers, or a TMA descriptor for the sorted one)
    order_ptr, offsets_ptr, expert_slot_ptr,
    c_ptr, c2_ptr,  # [E, M, N]
    M, N, stride_a, stride_b, stride_ce, stride_cm,
    TOP_K: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, DUAL: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr, SORTED_TMA: tl.constexpr,
    WS: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, lo, hi, pid_m, pid_n, offs_m, offs_n = expert_output_tile(tl.program_id(0), M, N, expert_slot_ptr,
                                                                      offsets_ptr, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, acc2 = varlen_mainloop(acc, acc2, a_ptr, a2_ptr, b_ptr, order_ptr, lo, hi, offs_m, offs_n, M, N,
                                stride_a, stride_b, pid_m, pid_n, TOP_K, A_GATHER, B_GATHER, DUAL, EVEN_M, EVEN_N,
                                SORTED_TMA, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, WS)
    _store_output(c_ptr, c2_ptr, acc, acc2, expert, offs_m, offs_n, M, N, stride_ce, stride_cm, DUAL, EVEN_M, EVEN_N,
                  OUT_BF16, INTERPRET)


@triton.jit
def _first_token_tile(offsets_ptr, expert, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert `expert`'s first token tile: the plan's tiles are BLOCK_K rows of one expert, experts in
    order, so it is the number of tiles of the experts before it."""
    e = tl.arange(0, BLOCK_E)
    before = e < expert
    counts = tl.load(offsets_ptr + e + 1, mask=before, other=0) - tl.load(offsets_ptr + e, mask=before, other=0)
    return tl.sum((counts + BLOCK_K - 1) // BLOCK_K, axis=0)


@triton.jit
def _expert_wgrad_fp8_kernel(
    a_src, a2_src, b_src,  # e4m3 token tiles A [M, P], A2 [M, P], B [N, P] (pointers or TMA descriptors)
    a_scale_ptr, a2_scale_ptr, b_scale_ptr,  # fp32 [M, P / 128], [N, P / 128]
    offsets_ptr, expert_slot_ptr,
    c_ptr, c2_ptr,  # [E, M, N]
    M, N, stride_a, stride_b, stride_sa, stride_sb, stride_ce, stride_cm,
    DUAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr, TMA: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert, lo, hi, pid_m, pid_n, offs_m, offs_n = expert_output_tile(tl.program_id(0), M, N, expert_slot_ptr,
                                                                      offsets_ptr, BLOCK_M, BLOCK_N)
    first_tile = _first_token_tile(offsets_ptr, expert, BLOCK_K, BLOCK_E)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, acc2 = token_tile_mainloop(acc, acc2, a_src, a2_src, b_src, a_scale_ptr, a2_scale_ptr, b_scale_ptr,
                                    first_tile, (hi - lo + BLOCK_K - 1) // BLOCK_K, offs_m, offs_n, M, N, stride_a,
                                    stride_b, stride_sa, stride_sb, pid_m, pid_n, DUAL, EVEN_M, EVEN_N, TMA,
                                    BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
    _store_output(c_ptr, c2_ptr, acc, acc2, expert, offs_m, offs_n, M, N, stride_ce, stride_cm, DUAL, EVEN_M, EVEN_N,
                  OUT_BF16, INTERPRET)


def _launch(kernel, a, a2, b, plan: RoutingPlan, M, N, a_gather, outs, dims, precision):
    cfg = tile_config(kernel, *dims, precision)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    dual = a2 is not None  # without DUAL the kernel never reads a2: None, no descriptor built for it
    offsets = plan.offsets_E1
    gathered = (a if a_gather else b) if not cfg.sorted_copy else None
    if cfg.sorted_copy:  # the gathered operand copied into sorted order: nothing is gathered in the kernel
        if a_gather:
            a, a2 = sorted_rows(a, plan), sorted_rows(a2, plan) if dual else None
        else:
            b = sorted_rows(b, plan)
    sorted_ops = [t for t in (a, a2, b) if t is not gathered and t is not None]
    sorted_tma = cfg.tma and tma_ok(*sorted_ops)
    stride_a, stride_b = a.stride(0), b.stride(0)
    if sorted_tma:
        if gathered is not b:
            b, stride_b = TensorDescriptor.from_tensor(b, [bk, bn]), 0
        if gathered is not a:
            a, a2 = (TensorDescriptor.from_tensor(t, [bk, bm]) if t is not None else None for t in (a, a2))
            stride_a = 0
    c, c2 = outs[0], outs[-1]
    grid = (plan.layout.num_experts * cdiv(M, bm) * cdiv(N, bn),)
    launch(
        _expert_wgrad_kernel, grid,
        a, a2, b, plan.order_N, offsets, plan.experts_by_load, c, c2, M, N, stride_a, stride_b, c.stride(0),
        c.stride(1),
        TOP_K=plan.rows_per_token, A_GATHER=gathered is a, B_GATHER=gathered is b, DUAL=dual,
        EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, OUT_BF16=c.dtype == torch.bfloat16, SORTED_TMA=sorted_tma,
        WS=sorted_tma and cfg.warp_specialize and gathered is None, INTERPRET=INTERPRET, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _checked(names_tensors, dims, out_dtype):
    device = names_tensors[0][1].device
    for name, t in names_tensors:
        check_kernel_operand(name, t, torch.bfloat16, 2, device)
    check_row_alignment("expert weight gradient", dims, " (64 or more recommended on the GPU)")
    check_wgrad_out_dtype(out_dtype)


def expert_wgrad_w2(dout_RD, hs_NH, plan: RoutingPlan, out_dtype, precision: str = "bf16"):
    """dW2 [E, D, H] in out_dtype: dw2[e] = sum_{p in e} dout_RD[r(p)]^T hs_NH[p] (hs = s*h, sorted)."""
    _checked([("dout", dout_RD), ("hs_NH", hs_NH)], {"D": dout_RD.shape[1], "H": hs_NH.shape[1]}, out_dtype)
    D, H = dout_RD.shape[1], hs_NH.shape[1]
    dw2 = new_output((plan.layout.num_experts, D, H), out_dtype, dout_RD.device)
    if plan.num_rows == 0:
        return dw2.zero_()
    _launch("wgrad_w2", dout_RD, None, hs_NH, plan, D, H, True, [dw2], (D, H), precision)
    return dw2


def expert_wgrad_w13(dg_NH, du_NH, x_RD, plan: RoutingPlan, out_dtype, precision: str = "bf16"):
    """(dW1, dW3) [E, H, D] in out_dtype: dw1[e] = sum_{p in e} dg_NH[p]^T x_RD[r(p)], dw3 likewise with du.
    One kernel with two accumulators sharing each gathered x tile."""
    _checked([("dg_NH", dg_NH), ("du_NH", du_NH), ("x", x_RD)], {"D": x_RD.shape[1], "H": dg_NH.shape[1]},
             out_dtype)
    D, H = x_RD.shape[1], dg_NH.shape[1]
    dw1, dw3 = (new_output((plan.layout.num_experts, H, D), out_dtype, x_RD.device) for _ in range(2))
    if plan.num_rows == 0:
        return dw1.zero_(), dw3.zero_()
    _launch("wgrad_w13", dg_NH, du_NH, x_RD, plan, H, D, False, [dw1, dw3], (D, H), precision)
    return dw1, dw3


# ------------------------------------------------------------------------------------------------
# Block FP8: operands in the token-tile layout
# ------------------------------------------------------------------------------------------------


def _check_token_tiles(name: str, q: BlockScaled, rows: "int | None", plan: RoutingPlan, device) -> int:
    """q must be `quant.quantize_token_tiles(rows_NC, plan)` of this plan (with `rows` rows, if given);
    returns its row count C."""
    check_kernel_operand(f"{name}.data", q.data, torch.float8_e4m3fn, 2, device)
    check_kernel_operand(f"{name}.scale", q.scale, torch.float32, 2, device)
    rows = q.data.shape[0] if rows is None else rows
    P = plan.layout.num_tiles * FP8_BLOCK
    if tuple(q.block) != (1, FP8_BLOCK) or q.data.shape != (rows, P) or q.scale.shape != (rows, P // FP8_BLOCK):
        raise ValueError(
            f"{name}: expected token tiles of this plan ({plan.layout.num_tiles} tiles of {FP8_BLOCK} rows): data "
            f"[{rows}, {P}], scale [{rows}, {P // FP8_BLOCK}], block (1, {FP8_BLOCK}); got data "
            f"{list(q.data.shape)}, scale {list(q.scale.shape)}, block {tuple(q.block)}. Build it with "
            f"quant.quantize_token_tiles(rows_NC, plan) from the same plan")
    return rows


def _checked_fp8(a_operands, b_operand, dim_names, plan: RoutingPlan, out_dtype) -> tuple[int, int]:
    """Validate (name, operand) pairs: the A operand(s) (same rows M) and B (N rows); returns (M, N)."""
    for name, q in (*a_operands, b_operand):
        if not isinstance(q, BlockScaled):
            raise TypeError(f"{name} must be a precision.BlockScaled in the token-tile layout "
                            f"(quant.quantize_token_tiles(rows, plan)), got {type(q).__name__}")
    if plan.layout.block_m != FP8_BLOCK:
        raise ValueError(f"block-FP8 weight gradients need a plan of {FP8_BLOCK}-row tiles (one token block per "
                         f"tile), got block_m {plan.layout.block_m}: build it with block_m={FP8_BLOCK}")
    device = b_operand[1].data.device
    M = None
    for name, q in a_operands:
        M = _check_token_tiles(name, q, M, plan, device)
    N = _check_token_tiles(*b_operand, None, plan, device)
    check_row_alignment("block-FP8 expert weight gradient", dict(zip(dim_names, (M, N))))
    check_wgrad_out_dtype(out_dtype)
    return M, N


def _launch_fp8(kernel, a: BlockScaled, a2: "BlockScaled | None", b: BlockScaled, plan: RoutingPlan, outs, dims):
    cfg = tile_config(kernel, *dims, "fp8")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if bk != FP8_BLOCK:
        raise ValueError(f"{kernel} (fp8): block_k must be {FP8_BLOCK} (one token tile per step), got {bk}")
    dual = a2 is not None  # without DUAL the kernel never reads a2: None, no descriptor built for it
    M, N = a.data.shape[0], b.data.shape[0]
    srcs = [a.data, a2.data if dual else None, b.data]
    tma = cfg.tma and tma_ok(*(t for t in srcs if t is not None))
    if cfg.gluon:
        if INTERPRET:
            raise ValueError(f"tile config {kernel}: gluon runs on a GPU only (Triton's interpreter cannot run Gluon)")
        if tma:
            from .fp8_wgrad_ws_gluon import fp8_wgrad_ws  # imported only here: Gluon is experimental

            fp8_wgrad_ws(a, a2, b, plan, outs, stages=cfg.num_stages)
            return
        # operands TMA cannot cover run the Triton kernel below: the same block-FP8 math
    if tma:
        srcs = [TensorDescriptor.from_tensor(t, [rows, bk]) if t is not None else None
                for t, rows in zip(srcs, (bm, bm, bn))]
    c, c2 = outs[0], outs[-1]
    grid = (plan.layout.num_experts * cdiv(M, bm) * cdiv(N, bn),)
    launch(
        _expert_wgrad_fp8_kernel, grid,
        *srcs, a.scale, a2.scale if dual else None, b.scale, plan.offsets_E1, plan.experts_by_load, c, c2, M, N,
        a.data.stride(0), b.data.stride(0), a.scale.stride(0), b.scale.stride(0), c.stride(0), c.stride(1),
        DUAL=dual, EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, OUT_BF16=c.dtype == torch.bfloat16, TMA=tma,
        INTERPRET=INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=next_power_of_2(plan.layout.num_experts), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def expert_wgrad_w2_fp8(doutT: BlockScaled, hsT: BlockScaled, plan: RoutingPlan, out_dtype):
    """dW2 [E, D, H] in out_dtype from token tiles (`quant.quantize_token_tiles`) of the expert-sorted dout
    rows (doutT [D, P]) and s*h rows (hsT [H, P]): dw2[e] = sum over e's tiles of doutT[:, t]
    hsT[:, t]^T, dequantized (block scales applied per tile in fp32)."""
    D, H = _checked_fp8([("doutT", doutT)], ("hsT", hsT), ("D", "H"), plan, out_dtype)
    dw2 = new_output((plan.layout.num_experts, D, H), out_dtype, doutT.data.device)
    if plan.num_rows == 0:
        return dw2.zero_()
    _launch_fp8("wgrad_w2", doutT, None, hsT, plan, [dw2], (D, H))
    return dw2


def expert_wgrad_w13_fp8(dgT: BlockScaled, duT: BlockScaled, xT: BlockScaled, plan: RoutingPlan, out_dtype):
    """(dW1, dW3) [E, H, D] in out_dtype from token tiles of dg, du (dgT, duT [H, P]) and x (xT [D, P], the
    expert-sorted x rows): dw1[e] = sum over e's tiles of dgT[:, t] xT[:, t]^T, dw3 likewise with du.
    One kernel with two accumulators sharing each x tile."""
    H, D = _checked_fp8([("dgT", dgT), ("duT", duT)], ("xT", xT), ("H", "D"), plan, out_dtype)
    dw1, dw3 = (new_output((plan.layout.num_experts, H, D), out_dtype, xT.data.device) for _ in range(2))
    if plan.num_rows == 0:
        return dw1.zero_(), dw3.zero_()
    _launch_fp8("wgrad_w13", dgT, duT, xT, plan, [dw1, dw3], (D, H))
    return dw1, dw3
