"""The fused MoE pipeline on the Triton kernels: dispatch -> expert FFN -> combine, and back.

    forward:   dispatch (routing plan)  ->  ffn_up (GEMM1+SwiGLU)  |  ffn_down (GEMM2)  ->  combine (s-weighted sum)
    backward:  dispatch_grad (dout rows) -> ffn_backward_input (dgrad+dSwiGLU+ds, dx rows) -> combine_grad
               ffn_backward_weights (dW2, dW1/dW3), after dx is on its way

The forward is two calls, `fused_moe_up` (everything the backward needs: the FFN's residuals, then the
packed routing plan, as a flat list of tensors, the custom op's outputs) and `fused_moe_down` (the
output), so that a recompute for the backward can stop after the first (`ops.py`); `fused_moe_forward`
makes both. Nothing here synchronises with the host: an out-of-range expert id trips an asynchronous
device assert.
"""

from __future__ import annotations

import torch

from ..precision import Recipe
from ..validation import check_kernel_shapes
from . import dispatch as local
from .dispatch import gradient_link
from .expert_ffn import (down_proj_count, down_proj_shapes, ffn_backward_input, ffn_backward_weights, ffn_down, ffn_up,
                         quantized_weights, residual_shapes)


def fused_moe_up(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe):
    """The routing plan, then GEMM1 + SwiGLU: (GEMM2's operands, residuals, the dispatch). The first two
    are lists of tensors; the residuals are what the backward needs: the FFN's, then the packed routing
    plan. The dispatch (`dispatch.Dispatched`) is what `fused_moe_down` reads, or `restore_dispatch` remakes."""
    E, H, D = w1_EHD.shape
    check_kernel_shapes(D, H)
    # block FP8's weight copies first: they need no routing, so the GPU runs them while the host builds the
    # plan (a synchronised call's GPU otherwise idled through that host time)
    weights = quantized_weights(w1_EHD, w2_EDH, w3_EHD, recipe)
    d = local.dispatch(x_TD, topk_ids_TK, topk_scores_TK, E, recipe)
    down, ffn_residuals = ffn_up(d.rows_RD, d.plan, w1_EHD, w2_EDH, w3_EHD, recipe, weights=weights)
    # asserted after the launches, off the GPU's critical path: a bad id cannot make the kernels read out
    # of bounds (they only visit sorted rows inside [offsets[0], offsets[E]), and order is a permutation)
    torch._assert_async(d.plan.ids_ok, f"titan_megamoe.moe: topk_ids_TK holds an expert id outside [0, {E})")
    return down, [*ffn_residuals, d.plan.packed], d


def restore_dispatch(topk_scores_TK, packed_plan, num_experts: int, recipe: Recipe) -> local.Dispatched:
    """`fused_moe_up`'s dispatch from its packed plan (for `fused_moe_down`, which reads no rows)."""
    return local.restore(None, topk_scores_TK, packed_plan, num_experts, recipe)


def fused_moe_down(down, d: local.Dispatched, w2_EDH, recipe: Recipe, out_dtype):
    """GEMM2 and the score-weighted combine: out [T, D] in out_dtype from `fused_moe_up`'s GEMM2 operands
    and dispatch."""
    return local.combine_forward(ffn_down(down, d.plan, w2_EDH, recipe), d, out_dtype)


def fused_moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe):
    """(out [T, D] in x's dtype, residuals): `fused_moe_up` then `fused_moe_down` in one call."""
    down, residuals, d = fused_moe_up(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe)
    return fused_moe_down(down, d, w2_EDH, recipe, x_TD.dtype), residuals


def fused_moe_backward(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, residuals,
                       recipe: Recipe):
    """(dx, d scores, dW1, dW2, dW3), each in its input's dtype."""
    *ffn_residuals, packed_plan = residuals
    d = local.restore(x_TD, topk_scores_TK, packed_plan, w1_EHD.shape[0], recipe)
    dy = local.dispatch_grad(dout_TD, d)
    dx_ND, ds_N, saved = ffn_backward_input(dy, d.plan, d.scores_N, w1_EHD, w2_EDH, w3_EHD, ffn_residuals, recipe)
    dx = local.combine_grad(dx_ND, d, x_TD.dtype)
    # the dx rows ([N, D], 1 GiB at 235B-A22B T=16384) are dead once combined: freed before the weight
    # gradients allocate theirs and the sorted copies some tile configs make (TileConfig.sorted_copy)
    del dx_ND
    dw1, dw2, dw3 = ffn_backward_weights(d.rows_RD, d.plan, w1_EHD, w2_EDH, saved, recipe)
    ds = ds_N.view(topk_scores_TK.shape).to(topk_scores_TK.dtype)
    return dx, ds, dw1, dw2, dw3


def residual_specs(x_TD, topk_ids_TK, w1_EHD, recipe: Recipe):
    """(shape, dtype) of every residual `fused_moe_up` returns: the fake implementation's source."""
    T, K = topk_ids_TK.shape
    E, H, D = w1_EHD.shape
    return [*residual_shapes(T * K, E, H, D, recipe),
            ((local.local_layout(T, K, E, recipe).packed_size,), torch.int32)]


def down_specs(x_TD, topk_ids_TK, w1_EHD, recipe: Recipe):
    """(shape, dtype) of each GEMM2 operand `fused_moe_up` returns."""
    T, K = topk_ids_TK.shape
    E, H, D = w1_EHD.shape
    return down_proj_shapes(T * K, E, H, D, recipe)


__all__ = ["down_proj_count", "down_specs", "fused_moe_backward", "fused_moe_down", "fused_moe_forward", "fused_moe_up",
           "gradient_link", "residual_specs", "restore_dispatch"]
