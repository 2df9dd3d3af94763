"""The expert FFN stage: every routed row through its expert's SwiGLU MLP, forward and backward.

It reads its rows through a routing plan (gathered by token or contiguous, `plan.RowSource`) and knows
nothing of where they came from or where its outputs go: the dispatch and combine stages do.

Forward:  GEMM1 (gather rows, gate+up, SwiGLU) -> GEMM2 (y rows scattered to row order)
Backward: dgrad (gather dy rows, W2, dSwiGLU, ds) -> dx rows (row order);
          wgrad dW2 (dy^T s*h, s*h written by dgrad) and dW1/dW3 (dg^T x, du^T x) over each expert's rows
Residuals saved for the backward: g, u [N, H] in sorted order (`Recipe.activation`); h is recomputed from
them in the dgrad epilogue (docs/kernels.md has the measurements behind that).

Block FP8 (`Recipe.quantized`, per side): every GEMM operand is a `BlockScaled` e4m3 tensor. x and dout
are quantized into sorted order in 1x128 row blocks (GEMM1 and dgrad read them through TMA), dout in the
same pass also as token tiles for dW2 (`kernels.quantize`); h is quantized in GEMM1's epilogue, dg and
du in dgrad's (rows for dx, token tiles for dW1/dW3, with s*h for dW2); x once more as token tiles in
the backward; the weights once per optimizer step (`weight_cache`). g and u stay bf16 (they feed dSwiGLU's nonlinearity, not a GEMM).
"""

from __future__ import annotations

from ..plan import RoutingPlan
from ..precision import Recipe
from ..kernels.dgrad_swiglu import dgrad_swiglu
from ..kernels.gemm1_swiglu import gemm1_swiglu
from ..kernels.grouped_gemm import expert_down_proj, expert_input_grad
from ..kernels.quantize import quantize_sorted_rows, quantize_token_tiles
from ..kernels.wgrad import expert_wgrad_w2, expert_wgrad_w2_fp8, expert_wgrad_w13, expert_wgrad_w13_fp8
from . import weight_cache

# the tile-config precision of a kernel: its operands' (under fp8_bwd the forward kernels run bf16)
BF16, FP8 = "bf16", "fp8"


def residual_shapes(num_rows: int, hidden: int, recipe: Recipe):
    """(shape, dtype) of each residual `ffn_forward` returns, for the op's fake implementation."""
    return [((num_rows, hidden), recipe.activation), ((num_rows, hidden), recipe.activation)]


def ffn_forward(rows_RD, plan: RoutingPlan, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe):
    """(y rows [N, D] in row order, residuals)."""
    if recipe.quantized():
        w1q, w2q, w3q = (weight_cache.quantized(w).w for w in (w1_EHD, w2_EDH, w3_EHD))
        # x in sorted order: GEMM1 reads it through TMA (a gathered FP8 tile costs too many registers)
        g, u, h = gemm1_swiglu(quantize_sorted_rows(rows_RD, plan), w1q, w3q, plan, recipe.activation, FP8,
                               sorted_rows=True)
        return expert_down_proj(h, w2q, plan, recipe.activation, FP8), [g, u]
    p = BF16
    x = recipe.operand(rows_RD)
    g, u, h = gemm1_swiglu(x, recipe.operand(w1_EHD), recipe.operand(w3_EHD), plan, recipe.activation, p)
    y_ND = expert_down_proj(h, recipe.operand(w2_EDH), plan, recipe.activation, p)
    return y_ND, [g, u]


def ffn_backward_input(dy_RD, plan: RoutingPlan, scores_N, w1_EHD, w2_EDH, w3_EHD, residuals, recipe: Recipe):
    """(dx rows [N, D] in row order, ds [N] fp32 in row order, what the weight gradients need). Split from
    the weight gradients so that the dx rows can go on (combine, or the return trip under EP) while the
    weight-gradient GEMMs run."""
    g, u = residuals
    if recipe.quantized(backward=True):
        w1t, w2t, w3t = (weight_cache.quantized(w).wt for w in (w1_EHD, w2_EDH, w3_EHD))
        for w in (w1_EHD, w2_EDH, w3_EHD):  # the last use of this step's copies
            weight_cache.release(w)
        # dout read once: sorted 1x128 rows for dgrad, token tiles for dW2
        dy_rows, dy_tiles = quantize_sorted_rows(dy_RD, plan, with_tiles=True)
        dg, du, tiles, ds_N = dgrad_swiglu(dy_rows, w2t, g, u, scores_N, plan, FP8)
        dx_ND = expert_input_grad(dg, du, w1t, w3t, plan, recipe.activation, FP8)
        return dx_ND, ds_N, (dy_tiles, *tiles)
    p = BF16
    dout = recipe.operand(dy_RD, backward=True)
    dg, du, hs, ds_N = dgrad_swiglu(dout, recipe.operand(w2_EDH, backward=True), g, u, scores_N, plan, p)
    dx_ND = expert_input_grad(dg, du, recipe.operand(w1_EHD, backward=True), recipe.operand(w3_EHD, backward=True),
                              plan, recipe.activation, p)
    return dx_ND, ds_N, (dout, dg, du, hs)


def ffn_backward_weights(rows_RD, plan: RoutingPlan, w1_EHD, w2_EDH, saved, recipe: Recipe):
    """(dW1, dW2, dW3) in the weights' dtypes; `saved` is what ffn_backward_input returned for them."""
    if recipe.quantized(backward=True):
        dy_t, dg_t, du_t, hs_t = saved
        dw2 = expert_wgrad_w2_fp8(dy_t, hs_t, plan, w2_EDH.dtype)
        dw1, dw3 = expert_wgrad_w13_fp8(dg_t, du_t, quantize_token_tiles(rows_RD, plan), plan, w1_EHD.dtype)
        return dw1, dw2, dw3
    p = BF16
    dout, dg, du, hs = saved
    dw2 = expert_wgrad_w2(dout, hs, plan, w2_EDH.dtype, p)
    dw1, dw3 = expert_wgrad_w13(dg, du, recipe.operand(rows_RD, backward=True), plan, w1_EHD.dtype, p)
    return dw1, dw2, dw3
