"""The fused forward and backward pipelines: routing metadata, kernel launches, residual packing.

Forward:  routing -> GEMM1(gather x, gate+up, SwiGLU) -> GEMM2 (scatter to routed order) -> combine
Backward: dgrad(gather dout, W2, dSwiGLU, ds) -> dx rows -> combine(s=1)
          wgrad dW2 (dout^T s*h, s*h written by dgrad) and dW1/dW3 (dg^T x, du^T x) over each expert's rows
Residuals saved for the backward: g, u [N, H] bf16 in sorted order and the packed routing plan (order,
inverse, offsets, tile schedule), which the backward uses as views; h is recomputed from g, u in the
dgrad epilogue (docs/kernels.md has the measurements behind that).
Nothing here synchronises with the host: an out-of-range expert id trips an asynchronous device assert.
"""

from __future__ import annotations

import torch

from .combine import combine
from .common import check_row_alignment
from .configs import row_block_m
from .dgrad_swiglu import dgrad_swiglu
from .gemm1_swiglu import gemm1_swiglu
from .grouped_gemm import expert_down_proj, expert_input_grad
from .routing_meta import build_routing_plan, unpack
from .wgrad import expert_wgrad_w2, expert_wgrad_w13


def check_kernel_shapes(dim: int, hidden: int) -> None:
    check_row_alignment("titan_megamoe.moe: backend='triton'",
                        {"D (model dim)": dim, "H (expert hidden dim)": hidden},
                        "; use backend='reference' for this shape")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    # checked in Python first: the no-op .to()/.contiguous() calls cost host time before GEMM1
    if t.dtype is torch.bfloat16 and t.is_contiguous():
        return t
    return t.to(torch.bfloat16).contiguous()


def _assert_ids_in_range(ids_ok: torch.Tensor, num_experts: int) -> None:
    torch._assert_async(ids_ok, f"titan_megamoe.moe: topk_ids_TK holds an expert id outside [0, {num_experts})")


def fused_moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD):
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, H, _ = w1_EHD.shape
    check_kernel_shapes(D, H)
    x = _bf16(x_TD)
    packed, plan = build_routing_plan(topk_ids_TK, E, row_block_m())
    g, u, h = gemm1_swiglu(x, _bf16(w1_EHD), _bf16(w3_EHD), plan.order_N, plan.tile_expert, plan.tile_row,
                           plan.offsets_E1, K)
    y_ND = expert_down_proj(h, _bf16(w2_EDH), plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1)
    out = combine(y_ND, topk_scores_TK.float().contiguous(), K, x_TD.dtype)
    # asserted after the launches, off the GPU's critical path: a bad id cannot make the kernels read out
    # of bounds (they only visit sorted rows inside [offsets[0], offsets[E]), and order is a permutation)
    _assert_ids_in_range(plan.ids_ok, E)
    return out, g, u, packed


def fused_moe_backward(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, g, u, packed):
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E = w1_EHD.shape[0]
    plan = unpack(packed, T * K, E, row_block_m())
    scores_N = topk_scores_TK.float().contiguous().reshape(-1)
    dout = _bf16(dout_TD)
    x = _bf16(x_TD)
    w2 = _bf16(w2_EDH)

    dg, du, hs, ds_N = dgrad_swiglu(dout, w2, g, u, scores_N, plan.order_N, plan.tile_expert, plan.tile_row,
                                    plan.offsets_E1, K)
    dx_rows = expert_input_grad(dg, du, _bf16(w1_EHD), _bf16(w3_EHD), plan.order_N, plan.tile_expert,
                                plan.tile_row, plan.offsets_E1)
    dx = combine(dx_rows, None, K, x_TD.dtype)

    dw2 = expert_wgrad_w2(dout, hs, None, plan.order_N, plan.offsets_E1, K, w2_EDH.dtype)
    dw1, dw3 = expert_wgrad_w13(dg, du, x, plan.order_N, plan.offsets_E1, K, w1_EHD.dtype)
    ds = ds_N.view(T, K).to(topk_scores_TK.dtype)
    return dx, ds, dw1, dw2, dw3
