"""The dispatch and combine stages on one rank: every routed row comes from a local token.

dispatch: the routing plan over local tokens (rows gathered from x by token, K rows per token) and the
          score of each row; no rows are copied, GEMM1 gathers them from x in its prologue.
combine:  out_t = sum_k s_tk y_{tK+k}, deterministic (fixed order, fp32, no atomics).
Backward: the output gradient is gathered the same way (dgrad reads dout by token through the plan),
          and dx_t = sum_k dx_{tK+k} (the combine with s = 1).

An expert-parallel dispatcher replaces these four functions: it builds a plan over the rows it received
(`RowSource.CONTIGUOUS`, local expert ids) and sends y rows back before its own combine. The expert FFN
stage (`expert_ffn.py`) and the kernels stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.combine import combine
from ..kernels.configs import row_block_m
from ..kernels.routing_meta import build_routing_plan
from ..plan import PlanLayout, RoutingPlan
from ..precision import Recipe


@dataclass(frozen=True)
class Dispatched:
    """What the expert FFN stage reads: the source rows, the plan over them, each row's score."""

    rows_RD: torch.Tensor  # the plan's source rows (here: x itself, read by token)
    plan: RoutingPlan
    scores: torch.Tensor  # the score of each row, row order (here [T, K]: row n = t*K + k)

    @property
    def scores_N(self) -> torch.Tensor:
        """fp32 [N] (read where it is needed: a cast before GEMM1 would be host time on the critical path)."""
        return self.scores.float().contiguous().reshape(-1)


def plan_block_m(recipe: Recipe) -> int:
    """The plan's tile rows for a recipe (block FP8 on either side needs 128: `configs.row_block_m`)."""
    return row_block_m(fp8=recipe.quantized() or recipe.quantized(backward=True))


def local_layout(num_tokens: int, top_k: int, num_experts: int, recipe: Recipe) -> PlanLayout:
    return PlanLayout(num_tokens * top_k, num_experts, plan_block_m(recipe), top_k)


def gradient_link(x_TD: torch.Tensor) -> torch.Tensor:
    """The forward's first step's differentiable output, for either dispatcher (`ops.py`, `ep_dispatch.py`):
    [T, D] with every stride 0 (no memory). The second step takes it as an input and hands the output's
    gradient back through it unchanged, so that the first step's backward (the whole fused backward)
    receives dout."""
    return x_TD.new_empty(()).expand(x_TD.shape)


def dispatch(x_TD, topk_ids_TK, topk_scores_TK, num_experts: int, recipe: Recipe) -> Dispatched:
    plan = build_routing_plan(topk_ids_TK, num_experts, plan_block_m(recipe))
    return Dispatched(x_TD, plan, topk_scores_TK)


def restore(x_TD, topk_scores_TK, packed_plan: torch.Tensor, num_experts: int, recipe: Recipe) -> Dispatched:
    """The forward's dispatch, for the backward and for the forward's GEMM2 step (which reads no rows: x_TD
    None there): the plan from its saved buffer (nothing is recomputed)."""
    T, K = topk_scores_TK.shape
    plan = RoutingPlan.from_packed(packed_plan, local_layout(T, K, num_experts, recipe))
    return Dispatched(x_TD, plan, topk_scores_TK)


def combine_forward(y_ND, d: Dispatched, out_dtype) -> torch.Tensor:
    return combine(y_ND, d.scores_N, d.plan.rows_per_token, out_dtype)


def dispatch_grad(dout_TD, d: Dispatched) -> torch.Tensor:
    """The output gradient as the FFN's backward reads it: by token through the plan, like x."""
    return dout_TD


def combine_grad(dx_ND, d: Dispatched, out_dtype) -> torch.Tensor:
    return combine(dx_ND, None, d.plan.rows_per_token, out_dtype)
