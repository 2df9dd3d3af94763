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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import RoutingPlan
from ..validation import check_kernel_operand, check_row_alignment, check_wgrad_out_dtype
from .common import INTERPRET, cast_rne, new_output, tma_ok
from .configs import tile_config
from .mainloop import varlen_mainloop
from .schedule import expert_output_tile


@triton.jit
def _expert_wgrad_kernel(
    a_ptr, a2_ptr, b_ptr,  # A [*, M] and B [*, N] rows (pointers, or a TMA descriptor for the sorted one)
    order_ptr, offsets_ptr, expert_slot_ptr,
    c_ptr, c2_ptr,  # [E, M, N]
    M, N, stride_a, stride_b, stride_ce, stride_cm,
    TOP_K: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, DUAL: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr, SORTED_TMA: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, lo, hi, pid_m, pid_n, offs_m, offs_n = expert_output_tile(tl.program_id(0), M, N, expert_slot_ptr,
                                                                      offsets_ptr, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, acc2 = varlen_mainloop(acc, acc2, a_ptr, a2_ptr, b_ptr, order_ptr, lo, hi, offs_m, offs_n, M, N,
                                stride_a, stride_b, pid_m, pid_n, TOP_K, A_GATHER, B_GATHER, DUAL, EVEN_M, EVEN_N,
                                SORTED_TMA, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
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


def _launch(kernel, a, a2, b, plan: RoutingPlan, M, N, a_gather, outs, dims, precision):
    cfg = tile_config(kernel, *dims, precision)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    dual = a2 is not None
    a2 = a2 if dual else a
    offsets = plan.offsets_E1
    expert_slot = torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True).to(torch.int32)
    sorted_tma = cfg.tma and tma_ok(b if a_gather else a, b if a_gather else a2)
    stride_a, stride_b = a.stride(0), b.stride(0)
    if sorted_tma:
        if a_gather:
            b, stride_b = TensorDescriptor.from_tensor(b, [bk, bn]), 0
        else:
            a, a2 = (TensorDescriptor.from_tensor(t, [bk, bm]) for t in (a, a2))
            stride_a = 0
    c, c2 = outs[0], outs[-1]
    grid = (plan.layout.num_experts * triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _expert_wgrad_kernel[grid](
        a, a2, b, plan.order_N, offsets, expert_slot, c, c2, M, N, stride_a, stride_b, c.stride(0), c.stride(1),
        TOP_K=plan.rows_per_token, A_GATHER=a_gather, B_GATHER=not a_gather, DUAL=dual,
        EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, OUT_BF16=c.dtype == torch.bfloat16, SORTED_TMA=sorted_tma,
        INTERPRET=INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
