"""The fused forward and backward pipelines: routing metadata, kernel launches, residual packing.

Forward:  routing -> GEMM1(gather x, gate+up, SwiGLU) -> GEMM2 (scatter to routed order) -> combine
Backward: dgrad(gather dout, W2, dSwiGLU, ds) -> dx rows -> combine(s=1)
          wgrad dW2 (dout^T s*h, s*h written by dgrad) and dW1/dW3 (dg^T x, du^T x) over each expert's rows
Residuals saved for the backward: g, u [N, H] bf16 in sorted order and the routing metadata (h is
recomputed from them in the dgrad epilogue: docs/kernels.md has the measurements behind that).
Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch

from ..routing import Routing, build_routing, tile_schedule
from .combine import combine
from .configs import row_block_m
from .dgrad_swiglu import dgrad_swiglu
from .gemm1_swiglu import gemm1_swiglu
from .grouped_gemm import expert_down_proj, expert_input_grad
from .wgrad import expert_wgrad_w2, expert_wgrad_w13

SUPPORTED_MULTIPLE = 16  # D and H: TMA-free pointer loads need 16-element (32 B) aligned rows


def check_kernel_shapes(dim: int, hidden: int) -> None:
    for name, v in (("D (model dim)", dim), ("H (expert hidden dim)", hidden)):
        if v % SUPPORTED_MULTIPLE != 0:
            raise ValueError(
                f"titan_megamoe.moe: backend='triton' needs {name} to be a multiple of {SUPPORTED_MULTIPLE}, "
                f"got {v}; use backend='reference' for this shape"
            )


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).contiguous()


def _pack(r: Routing) -> torch.Tensor:
    return torch.cat([r.order_N, r.inv_N, r.offsets_E1])


def _unpack(packed: torch.Tensor, n: int) -> Routing:
    return Routing(packed[:n], packed[n:2 * n], packed[2 * n:])


def fused_moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD):
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E, H, _ = w1_EHD.shape
    check_kernel_shapes(D, H)
    x = _bf16(x_TD)
    routing = build_routing(topk_ids_TK, E)
    tile_expert, tile_row = tile_schedule(routing.offsets_E1, T * K, row_block_m())
    g, u, h = gemm1_swiglu(x, _bf16(w1_EHD), _bf16(w3_EHD), routing.order_N, tile_expert, tile_row,
                           routing.offsets_E1, K)
    y_ND = expert_down_proj(h, _bf16(w2_EDH), routing.order_N, tile_expert, tile_row, routing.offsets_E1)
    out = combine(y_ND, topk_scores_TK.float().contiguous(), K, x_TD.dtype)
    return out, g, u, _pack(routing)


def fused_moe_backward(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, g, u, packed):
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    N = T * K
    routing = _unpack(packed, N)
    tile_expert, tile_row = tile_schedule(routing.offsets_E1, N, row_block_m())
    scores_N = topk_scores_TK.float().contiguous().reshape(-1)
    dout = _bf16(dout_TD)
    x = _bf16(x_TD)
    w2 = _bf16(w2_EDH)

    dg, du, hs, ds_sorted = dgrad_swiglu(dout, w2, g, u, scores_N, routing.order_N, tile_expert, tile_row,
                                     routing.offsets_E1, K)
    dx_rows = expert_input_grad(dg, du, _bf16(w1_EHD), _bf16(w3_EHD), routing.order_N, tile_expert, tile_row,
                                routing.offsets_E1)
    dx = combine(dx_rows, None, K, x_TD.dtype)

    dw2 = expert_wgrad_w2(dout, hs, None, routing.order_N, routing.offsets_E1, K, w2_EDH.dtype)
    dw1, dw3 = expert_wgrad_w13(dg, du, x, routing.order_N, routing.offsets_E1, K, w1_EHD.dtype)
    ds = ds_sorted[routing.inv_N.long()].reshape(T, K).to(topk_scores_TK.dtype)
    return dx, ds, dw1, dw2, dw3
