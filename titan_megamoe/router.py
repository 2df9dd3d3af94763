"""Fused token-choice routing: TorchTitan's router math after the gate GEMM, one Triton launch forward.

`topk_route` returns what `TokenChoiceTopKRouter.forward` returns for its scores and ids (same score
function, expert bias used for the choice only, route_norm, route_scale) and is differentiable in the
logits. The backward is a few torch ops on [T, K] and [T, E] tensors (p is recomputed from the logits):
    d s_j = d_j / S - sum_k d_k s_k / S^2    (route_norm, S = sum_k s_k + 1e-20; d = route_scale * grad)
    dz = p * (dp - sum_k d s_k s_k)           (softmax)      dz = dp * p * (1 - p)   (sigmoid)
with dp the scatter of d s onto the chosen experts.
`oracle.router_reference` is the same math in torch ops (stock's own code path), the oracle of the tests.
"""

from __future__ import annotations

import torch


class _TopKRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, top_k, score_func, route_norm, route_scale):
        from .kernels.router_topk import router_topk

        scores, ids, raw = router_topk(logits_TE, bias_E, top_k, score_func, route_norm, route_scale)
        ctx.save_for_backward(logits_TE, ids, raw)
        ctx.cfg = (score_func, route_norm, route_scale)
        ctx.mark_non_differentiable(ids)
        return scores, ids

    @staticmethod
    def backward(ctx, d_scores_TK, _d_ids):
        from .kernels.router_topk import router_topk_backward

        logits_TE, ids, raw = ctx.saved_tensors
        dz = router_topk_backward(d_scores_TK, logits_TE, ids, raw, *ctx.cfg)
        return dz, None, None, None, None, None


def topk_route(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, score_func: str = "softmax",
               route_norm: bool = True, route_scale: float = 1.0):
    """(top-k scores [T, K] fp32, expert ids [T, K] int64) from gate logits [T, E], fused (CUDA, or the
    Triton interpreter); ids in descending order of p + bias, ties to the lowest id."""
    return _TopKRouting.apply(logits_TE, bias_E, top_k, score_func, route_norm, route_scale)
