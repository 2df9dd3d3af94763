"""The expert FFN stage: every routed row through its expert's SwiGLU MLP, forward and backward.

It reads its rows through a routing plan (gathered by token or contiguous, `plan.RowSource`) and knows
nothing of where they came from or where its outputs go: the dispatch and combine stages do.

Forward:  `ffn_up`: GEMM1 (gather rows, gate+up, SwiGLU) -> `ffn_down`: GEMM2 (y rows scattered to row order)
          (two steps: the residuals are complete after the first, which is where a recompute for the
          backward under activation checkpointing stops; `ops.py`)
Backward: dgrad (gather dy rows, W2, dSwiGLU, ds) -> dx rows (row order);
          wgrad dW2 (dy^T s*h, s*h written by dgrad) and dW1/dW3 (dg^T x, du^T x) over each expert's rows
Residuals saved for the backward: g, u [N, H] in sorted order (`Recipe.activation`); h is recomputed from
them in the dgrad epilogue (docs/kernels.md has the measurements behind that).

Block FP8 (`Recipe.quantized`, per side): every GEMM operand is a `BlockScaled` e4m3 tensor. x and dout
are quantized into sorted order in 1x128 row blocks (GEMM1 and dgrad read them through TMA), dout in the
same pass also as token tiles for dW2 (`kernels.quantize`); h is quantized in GEMM1's epilogue, dg and
du in dgrad's (rows for dx, token tiles for dW1/dW3, with s*h for dW2); x once more as token tiles in
the backward; g and u stay bf16 (they feed dSwiGLU's nonlinearity, not a GEMM).

The FP8 weights are made from the weights the call is given, every call: the `fp8` forward quantizes each
weight once into W (its GEMMs) and W^T (dgrad and dx read it; Hopper's FP8 MMA takes K-major operands
only) and hands W^T to the backward as residuals; under `fp8_bwd` the backward quantizes W^T itself.
Nothing is cached across calls: a cache keyed on a weight's version counter served stale weights. The
fused AdamW TorchTitan uses by default (`_fused_adamw_`) updates parameters in place without bumping
their version counters, and a forward's entry outlived its step whenever the backward did not release
it: under activation checkpointing the backward saw the recomputed (another) tensor, and a forward
without a backward releases nothing. On the H200 (2026-12-04) the experts' forward ran on their initial
weights for a whole training run; docs/kernels.md.
"""

from __future__ import annotations

import torch

from ..plan import RoutingPlan
from ..precision import BlockScaled, Recipe
from ..quant import ACTIVATION_BLOCK, E4M3, WEIGHT_BLOCK
from ..kernels.dgrad_swiglu import dgrad_swiglu
from ..kernels.gemm1_swiglu import gemm1_swiglu
from ..kernels.grouped_gemm import PeerRows, expert_down_proj, expert_input_grad
from ..kernels.quantize import (quantize_sorted_rows, quantize_token_tiles, quantize_weight_pair,
                                quantize_weight_transposed)
from ..kernels.wgrad import expert_wgrad_w2, expert_wgrad_w2_fp8, expert_wgrad_w13, expert_wgrad_w13_fp8

# the tile-config precision of a kernel: its operands' (under fp8_bwd the forward kernels run bf16)
BF16, FP8 = "bf16", "fp8"


def residual_shapes(num_rows: int, num_experts: int, hidden: int, dim: int, recipe: Recipe):
    """(shape, dtype) of each residual `ffn_up` returns, for the op's fake implementation: g, u, then
    under `fp8` the data and scale of W1^T, W2^T, W3^T (128x128 blocks)."""
    shapes = [((num_rows, hidden), recipe.activation), ((num_rows, hidden), recipe.activation)]
    if recipe.quantized():
        E, H, D, B = num_experts, hidden, dim, WEIGHT_BLOCK[0]
        for rows, cols in ((D, H), (H, D), (D, H)):  # W1^T [E, D, H], W2^T [E, H, D], W3^T [E, D, H]
            shapes += [((E, rows, cols), E4M3), ((E, rows // B, cols // B), torch.float32)]
    return shapes


def _transposed_weights(residuals):
    """The FP8 W1^T, W2^T, W3^T an `fp8` forward put among its residuals."""
    return [BlockScaled(residuals[i], residuals[i + 1], WEIGHT_BLOCK) for i in (2, 4, 6)]


def quantized_weights(w1_EHD, w2_EDH, w3_EHD, recipe: Recipe):
    """Block FP8's (W, W^T) of W1, W2, W3 (one read of each weight), or None when the forward runs bf16.
    They need no routing: a caller can launch them before the routing plan, so that the GPU works on them
    (~0.8 ms at 30B-A3B T=16384) while the host builds the plan and launches what follows."""
    return [quantize_weight_pair(w) for w in (w1_EHD, w2_EDH, w3_EHD)] if recipe.quantized() else None


def down_proj_shapes(num_rows: int, num_experts: int, hidden: int, dim: int, recipe: Recipe):
    """(shape, dtype) of each of GEMM2's operands `ffn_up` hands to `ffn_down`: h [N, H] in the activation
    dtype; under `fp8` h's e4m3 data and 1x128 scales, then W2's e4m3 data and 128x128 scales (the forward's
    FP8 copy of W2, made with W^T from one read of the weight)."""
    if not recipe.quantized():
        return [((num_rows, hidden), recipe.activation)]
    E, N, H, D, B = num_experts, num_rows, hidden, dim, WEIGHT_BLOCK[0]
    return [((N, H), E4M3), ((N, H // B), torch.float32), ((E, D, H), E4M3), ((E, D // B, H // B), torch.float32)]


def down_proj_count(recipe: Recipe) -> int:
    """How many tensors `ffn_up` hands to `ffn_down` under this recipe."""
    return len(down_proj_shapes(0, 0, 0, 0, recipe))


def ffn_up(rows_RD, plan: RoutingPlan, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe, arrivals=None, weights=None):
    """GEMM1 + SwiGLU: (GEMM2's operands as a list of tensors, residuals), everything the backward needs
    and nothing it does not. `ffn_down` makes the y rows from the first list; split so that a recompute
    of the forward for the backward (activation checkpointing) can stop here (`ops.py`).
    `arrivals` (bf16): GEMM1's programs wait for their expert's rows to land first (`gemm1_swiglu`); rows_RD
    must then already be the operand (read in place). `weights`: `quantized_weights` of these weights made
    earlier (block FP8; None: made here)."""
    if recipe.quantized():
        assert arrivals is None, "expert parallelism runs bf16"
        pairs = weights if weights is not None else quantized_weights(w1_EHD, w2_EDH, w3_EHD, recipe)
        (w1q, w1t), (w2q, w2t), (w3q, w3t) = pairs
        # x in sorted order: GEMM1 reads it through TMA (a gathered FP8 tile costs too many registers)
        g, u, h = gemm1_swiglu(quantize_sorted_rows(rows_RD, plan), w1q, w3q, plan, recipe.activation, FP8,
                               sorted_rows=True)
        return [h.data, h.scale, w2q.data, w2q.scale], [g, u, w1t.data, w1t.scale, w2t.data, w2t.scale, w3t.data,
                                                        w3t.scale]
    x = recipe.operand(rows_RD)
    assert arrivals is None or x is rows_RD, "rows still landing cannot be cast or copied before GEMM1 waits"
    g, u, h = gemm1_swiglu(x, recipe.operand(w1_EHD), recipe.operand(w3_EHD), plan, recipe.activation, BF16,
                           arrivals=arrivals)
    return [h], [g, u]


def ffn_down(down: list, plan: RoutingPlan, w2_EDH, recipe: Recipe, y_to: PeerRows | None = None):
    """GEMM2: the y rows [N, D] in row order from `ffn_up`'s operands. `y_to` (bf16): GEMM2 stores the y
    rows at those destinations instead (returns None). Empties `down`: once GEMM2 is launched, h ([N, H],
    192 MiB at 30B-A3B T=16384) is freed before what follows allocates (the combine's output, the rows'
    return trip), as long as the caller holds it nowhere else."""
    if recipe.quantized():
        assert y_to is None, "expert parallelism runs bf16"
        h, h_scale, w2, w2_scale = down
        down.clear()
        h, w2 = BlockScaled(h, h_scale, ACTIVATION_BLOCK), BlockScaled(w2, w2_scale, WEIGHT_BLOCK)
        return expert_down_proj(h, w2, plan, recipe.activation, FP8)
    (h,) = down
    down.clear()
    return expert_down_proj(h, recipe.operand(w2_EDH), plan, recipe.activation, BF16, peers=y_to)


def ffn_backward_input(dy_RD, plan: RoutingPlan, scores_N, w1_EHD, w2_EDH, w3_EHD, residuals, recipe: Recipe,
                       arrivals=None, dx_to: PeerRows | None = None):
    """(dx rows [N, D] in row order, ds [N] fp32 in row order, what the weight gradients need). Split from
    the weight gradients so that the dx rows can go on (combine, or the return trip under EP) while the
    weight-gradient GEMMs run. Expert parallelism with symmetric memory (bf16): with `arrivals` dgrad's
    programs wait for their expert's dout rows to land in dy_RD (already the operand, in sorted order, read
    in place: `dgrad_swiglu`); with `dx_to` dx's GEMM stores the rows there (dx is then None)."""
    g, u = residuals[:2]
    if recipe.quantized(backward=True):
        assert arrivals is None and dx_to is None, "expert parallelism runs bf16"
        if recipe.quantized():  # made by the forward
            w1t, w2t, w3t = _transposed_weights(residuals)
        else:  # fp8_bwd: the forward ran bf16
            w1t, w2t, w3t = (quantize_weight_transposed(w) for w in (w1_EHD, w2_EDH, w3_EHD))
        # dout's sorted 1x128 rows for dgrad (as x's: each token quantized once, its e4m3 row gathered) and its
        # token tiles for dW2: two launches, faster than one pass writing both (docs/kernels.md)
        dy_rows, dy_tiles = quantize_sorted_rows(dy_RD, plan), quantize_token_tiles(dy_RD, plan)
        dg, du, tiles, ds_N = dgrad_swiglu(dy_rows, w2t, g, u, scores_N, plan, FP8)
        dx_ND = expert_input_grad(dg, du, w1t, w3t, plan, recipe.activation, FP8)
        return dx_ND, ds_N, (dy_tiles, *tiles)
    p = BF16
    dout = recipe.operand(dy_RD, backward=True)
    assert arrivals is None or dout is dy_RD, "rows still landing cannot be cast or copied before dgrad waits"
    dg, du, hs, ds_N = dgrad_swiglu(dout, recipe.operand(w2_EDH, backward=True), g, u, scores_N, plan, p,
                                    arrivals=arrivals)
    dx_ND = expert_input_grad(dg, du, recipe.operand(w1_EHD, backward=True), recipe.operand(w3_EHD, backward=True),
                              plan, recipe.activation, p, peers=dx_to)
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
