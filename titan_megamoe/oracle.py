"""Pure-PyTorch oracle: the `reference` backend and the numerical reference of every kernel.

One place for every reference computation: the MoE layer (`moe_reference`), the routing plan
(`routing_plan`, the oracle of the routing kernel), the router after the gate GEMM
(`router_reference`) and the expert weight gradients (`wgrad_w2_reference`, `wgrad_w13_reference`).
Block FP8 (`fp8`, `fp8_bwd`) has its emulation here, `moe_fp8_emulation`, next to the math it emulates:
the oracle the Triton FP8 kernels must match, and what the `reference` backend runs for those precisions.

`moe_reference` follows stock TorchTitan 0.2.2's rounding points exactly (expert GEMMs in the compute
dtype, the expert output cast to x's dtype, the score-weighted combine as an fp32 bmm), so a training
run on the reference backend reproduces the stock arm step by step. With ``compute_dtype=torch.float64``
it is the high-precision oracle the kernel tests compare against. It loops over experts with sizes read
on the host: one synchronisation per call, acceptable for a reference; the Triton backend has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import PlanLayout, RoutingPlan, RowSource, max_tiles
from .quant import dequantize, quantize_activation, quantize_token_blocks, quantize_weight

# ------------------------------------------------------------------------------------------------
# Routing plan
# ------------------------------------------------------------------------------------------------


def tile_schedule(offsets_E1: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per M-tile (expert, first sorted row); tiles past the real count get expert -1 and row 0.

    Returns int32 tensors of length ``max_tiles(N, E, block_m)``.
    """
    num_experts = offsets_E1.numel() - 1
    n_tiles = max_tiles(num_rows, num_experts, block_m)
    device = offsets_E1.device
    counts_E = (offsets_E1[1:] - offsets_E1[:-1]).to(torch.int64)
    tiles_E = (counts_E + block_m - 1) // block_m
    tile_end_E = torch.cumsum(tiles_E, 0)
    tile_ids = torch.arange(n_tiles, device=device, dtype=torch.int64)
    expert = torch.searchsorted(tile_end_E, tile_ids, right=True)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first_tile = tile_end_E[e] - tiles_E[e]
    row_start = offsets_E1[e].to(torch.int64) + (tile_ids - first_tile) * block_m
    tile_expert = torch.where(valid, e, torch.full_like(e, -1)).to(torch.int32)
    return tile_expert, torch.where(valid, row_start, 0).to(torch.int32)


def routing_plan(expert_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> RoutingPlan:
    """The routing plan built with torch ops (the routing kernel's oracle; the reference backend's sort).

    `expert_ids` is [T, K] (rows gathered from local tokens) or [N] (contiguous rows, K = 1)."""
    rows_per_token = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
    ids_N = expert_ids.reshape(-1).to(torch.int64) - first_expert
    n = ids_N.numel()
    # stable sort: within an expert, rows keep token order (the same order stock TorchTitan uses)
    sorted_ids_N, order_N = torch.sort(ids_N, stable=True)
    experts = torch.arange(num_experts + 1, device=ids_N.device, dtype=torch.int64)
    offsets_E1 = torch.searchsorted(sorted_ids_N, experts, right=False).to(torch.int32)
    inv_N = torch.empty_like(order_N)
    inv_N[order_N] = torch.arange(n, device=ids_N.device, dtype=order_N.dtype)
    source = RowSource.GATHER if expert_ids.dim() == 2 else RowSource.CONTIGUOUS
    layout = PlanLayout(n, num_experts, block_m, rows_per_token, source, first_expert)
    tile_expert, tile_row = tile_schedule(offsets_E1, n, block_m)
    in_range = bool(n == 0 or (int(ids_N.min()) >= 0 and int(ids_N.max()) < num_experts))
    ids_ok = torch.tensor([int(in_range)], dtype=torch.int32, device=ids_N.device)
    packed = torch.cat([order_N.to(torch.int32), inv_N.to(torch.int32), offsets_E1, tile_expert, tile_row, ids_ok])
    return RoutingPlan.from_packed(packed, layout)


def check_routing_invariants(plan: RoutingPlan, expert_ids: torch.Tensor) -> None:
    """Assert the plan's invariants against the ids it was built from (debug and tests; synchronises)."""
    num_experts = plan.layout.num_experts
    ids_N = expert_ids.reshape(-1).to(torch.int64) - plan.layout.first_expert
    n = ids_N.numel()
    order = plan.order_N.to(torch.int64)
    inv = plan.inv_N.to(torch.int64)
    off = plan.offsets_E1.to(torch.int64)
    assert off.numel() == num_experts + 1 and int(off[0]) == 0 and int(off[-1]) == n, "offsets must span [0, N]"
    assert bool((off[1:] >= off[:-1]).all()), "offsets must be non-decreasing"
    counts = torch.bincount(ids_N, minlength=num_experts)
    assert torch.equal(off[1:] - off[:-1], counts), "offsets must match per-expert counts"
    assert torch.equal(torch.sort(order).values, torch.arange(n, device=order.device)), "order must be a permutation"
    assert torch.equal(inv[order], torch.arange(n, device=order.device)), "inv must invert order"
    expert_of_pos = torch.repeat_interleave(torch.arange(num_experts, device=off.device), counts)
    assert torch.equal(ids_N[order], expert_of_pos), "sorted rows must be grouped by expert"


# ------------------------------------------------------------------------------------------------
# MoE layer
# ------------------------------------------------------------------------------------------------


def moe_reference(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                  compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_t = sum_k s_tk * (silu(x_t W1_e^T) * (x_t W3_e^T)) W2_e^T, differentiable by autograd."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E = w1_EHD.shape[0]
    cd = compute_dtype or x_TD.dtype
    if T == 0:
        return x_TD.new_zeros((0, D)) + 0 * (w1_EHD.sum() + w2_EDH.sum() + w3_EHD.sum() + topk_scores_TK.sum())
    plan = routing_plan(topk_ids_TK, E, block_m=1)
    counts = (plan.offsets_E1[1:] - plan.offsets_E1[:-1]).tolist()
    x_ND = x_TD[plan.order_N.long() // K]  # expert-sorted routed rows
    y_parts = []
    for e, x_nD in enumerate(torch.split(x_ND, counts)):
        if x_nD.shape[0] == 0:
            continue
        # one cast per GEMM, as stock does: the two input gradients then meet in x's dtype, not in bf16
        h_nH = F.silu(x_nD.to(cd) @ w1_EHD[e].to(cd).T) * (x_nD.to(cd) @ w3_EHD[e].to(cd).T)
        y_parts.append(h_nH @ w2_EDH[e].to(cd).T)
    y_ND = torch.cat(y_parts).to(x_TD.dtype)[plan.inv_N.long()]  # back to routed-row order
    out_T1D = torch.bmm(topk_scores_TK.reshape(T, 1, K).float(), y_ND.reshape(T, K, D).float())
    return out_T1D.squeeze(1).to(x_TD.dtype)


# ------------------------------------------------------------------------------------------------
# Router (after the gate GEMM)
# ------------------------------------------------------------------------------------------------


def router_probabilities(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    z = logits_TE.to(torch.float32)
    return F.softmax(z, dim=1) if score_func == "softmax" else torch.sigmoid(z)


def expert_schedule_reference(offsets_E1: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.routing_meta.expert_schedule` in torch ops: (experts most rows first, stable; each expert's
    first M-tile of block_m rows), int32 [E] each."""
    rows = offsets_E1[1:] - offsets_E1[:-1]
    by_load = torch.argsort(rows, descending=True, stable=True).to(torch.int32)
    tiles = torch.div(rows + block_m - 1, block_m, rounding_mode="floor")
    return by_load, (torch.cumsum(tiles, 0) - tiles).to(torch.int32)


def router_logits_grad_reference(d_scores_TK, logits_TE, ids_TK, raw_TK, score_func="softmax", route_norm=True,
                                 route_scale=1.0):
    """The fused router's backward in torch ops (`router` module docstring): d logits [T, E] in the logits'
    dtype from d scores [T, K]; raw_TK is p at the chosen ids (before route_norm and route_scale)."""
    d = d_scores_TK.to(torch.float32) * route_scale
    if route_norm:
        S = raw_TK.sum(dim=1, keepdim=True) + 1e-20
        d = d / S - (d * raw_TK).sum(dim=1, keepdim=True) / (S * S)
    p = router_probabilities(logits_TE, score_func)
    dp = torch.zeros_like(p).scatter_add_(1, ids_TK, d)
    if score_func == "softmax":
        dz = p * (dp - (d * raw_TK).sum(dim=1, keepdim=True))
    else:
        dz = dp * p * (1.0 - p)
    return dz.to(logits_TE.dtype)


def router_reference(logits_TE, bias_E, top_k, score_func="softmax", route_norm=True, route_scale=1.0):
    """TorchTitan 0.2.2's router after the gate (node-limited routing excluded): (scores, ids)."""
    p = router_probabilities(logits_TE, score_func)
    choice = p if bias_E is None else p + bias_E
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    s = p.gather(dim=1, index=ids)
    if route_norm:
        s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return s * route_scale, ids


# ------------------------------------------------------------------------------------------------
# Expert weight gradients (loops over experts with host-read sizes)
# ------------------------------------------------------------------------------------------------


def wgrad_w2_reference(dout_TD, hs_NH, plan: RoutingPlan, compute_dtype):
    """dW2[e] = sum_p dout[tok(p)]^T (s h)[p] in ``compute_dtype`` (float64: the oracle; bf16: the same
    GEMMs done by torch). ``hs_NH`` is s*h in expert-sorted order, as the dgrad epilogue writes it."""
    dy_ND = dout_TD[plan.order_N.long() // plan.rows_per_token].to(compute_dtype)
    return _grouped_atb(dy_ND, hs_NH.to(compute_dtype), plan.offsets_E1)


def wgrad_w13_reference(dg_NH, du_NH, x_TD, plan: RoutingPlan, compute_dtype):
    x_ND = x_TD[plan.order_N.long() // plan.rows_per_token].to(compute_dtype)
    return (_grouped_atb(dg_NH.to(compute_dtype), x_ND, plan.offsets_E1),
            _grouped_atb(du_NH.to(compute_dtype), x_ND, plan.offsets_E1))


def _grouped_atb(a_NM: torch.Tensor, b_NK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    off = offsets_E1.tolist()
    out = a_NM.new_zeros((len(off) - 1, a_NM.shape[1], b_NK.shape[1]))
    for e in range(len(off) - 1):
        if off[e + 1] > off[e]:
            out[e] = a_NM[off[e] : off[e + 1]].T @ b_NK[off[e] : off[e + 1]]
    return out


# ------------------------------------------------------------------------------------------------
# Block FP8 emulation: the oracle of the FP8 kernels (the `reference` backend for fp8 / fp8_bwd)
# ------------------------------------------------------------------------------------------------
#
# The kernels' arithmetic in fp32, with quantize -> dequantize (quant.py) at every GEMM input. A GEMM of
# quantized operands is then exact products of exactly dequantized values, accumulated in fp32: what a
# block-scaled MMA computes, up to the order of its fp32 sums. Rounding points are the kernels' stores:
# g, u, h, y, q (dgrad's GEMM, stored for the split dSwiGLU), dg, du, s*h and the dx rows in bf16
# (Recipe.activation); ds stays fp32; the combine sums in fp32. Blocks per GEMM (reduction dimension in brackets):
#   GEMM1  x rows (1x128 along D)  @ W1^T, W3^T (128x128)     [D]
#   GEMM2  h (1x128 along H)       @ W2^T (128x128)           [H]
#   dgrad  dout rows (1x128 along D) @ W2 (the same copy)     [D]
#   dx     dg, du (1x128 along H)  @ W1, W3 (the same copies) [H]
#   wgrad  dout^T (s h), dg^T x, du^T x: 128x1 token blocks per expert segment, restarting at the
#          expert's first row, last block partial             [tokens of one expert]
# Operands are quantized from their values as given (bf16 in training). Without FP8 on a side, that side
# runs the bf16 math: the forward is `moe_reference` in bf16 op for op (bitwise equal to it), the
# backward the kernels' bf16 math (bf16 operands, fp32 accumulation, the same rounding points).


def moe_fp8_emulation(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                      fp8_forward: bool = True, fp8_backward: bool = True) -> torch.Tensor:
    """The MoE layer as the block-FP8 kernels compute it; differentiable in x, the scores and the weights.
    Host-synchronising (per-expert loops), like `moe_reference`."""
    return _MoEFP8Emulation.apply(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                                  fp8_forward, fp8_backward)


class _MoEFP8Emulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, fp8_forward, fp8_backward):
        plan = routing_plan(topk_ids_TK, w1_EHD.shape[0], block_m=1)
        out_TD, g_NH, u_NH = _fp8_forward(x_TD, plan, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, fp8_forward)
        # as the kernels: g and u (bf16, sorted rows) and the plan are the residuals; h is recomputed
        ctx.save_for_backward(x_TD, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, g_NH, u_NH, plan.packed)
        ctx.layout, ctx.fp8_backward = plan.layout, fp8_backward
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        x_TD, scores_TK, w1_EHD, w2_EDH, w3_EHD, g_NH, u_NH, packed = ctx.saved_tensors
        plan = RoutingPlan.from_packed(packed, ctx.layout)
        grads = _fp8_backward(dout_TD, x_TD, plan, scores_TK, w1_EHD, w2_EDH, w3_EHD, g_NH, u_NH, ctx.fp8_backward)
        dx, ds, dw1, dw2, dw3 = grads
        return dx, None, ds, dw1, dw2, dw3, None, None


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 (a kernel store), back in fp32 for the next step's math."""
    return t.to(torch.bfloat16).float()


def _fake_quant(t: torch.Tensor, quantizer, fp8: bool) -> torch.Tensor:
    """A GEMM operand in fp32: quantized and dequantized by `quantizer` (FP8), or rounded to bf16."""
    return dequantize(quantizer(t)) if fp8 else _bf16(t)


def _token_blocks(a_nC: torch.Tensor, fp8: bool) -> torch.Tensor:
    return _fake_quant(a_nC, quantize_token_blocks, fp8)


def _segments(plan: RoutingPlan):
    """(expert, first sorted row, end) of every expert that has rows."""
    off = plan.offsets_E1.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def _combine(y_ND: torch.Tensor, plan: RoutingPlan, weights_TK: torch.Tensor, out_dtype) -> torch.Tensor:
    """out_t = sum_k w_tk y_{tK+k} in fp32 (y in sorted order), cast to out_dtype."""
    T, K = weights_TK.shape
    y_TKD = y_ND[plan.inv_N.long()].float().reshape(T, K, y_ND.shape[1])  # back to routed-row order
    return torch.bmm(weights_TK.reshape(T, 1, K).float(), y_TKD).squeeze(1).to(out_dtype)


def _gate_up_bf16(x_nD, w1_HD, w3_HD):
    """GEMM1 without FP8, op for op as `moe_reference` in bf16: (g, u, h) in bf16."""
    g = x_nD.to(torch.bfloat16) @ w1_HD.to(torch.bfloat16).T
    u = x_nD.to(torch.bfloat16) @ w3_HD.to(torch.bfloat16).T
    return g, u, F.silu(g) * u


def _gate_up_fp8(x_nD, w1q_HD, w3q_HD):
    """GEMM1 on FP8 operands (x 1x128 along D): g, u and h = silu(g) u from the fp32 accumulators, then
    each stored in bf16, as the SwiGLU epilogue does."""
    xq_nD = dequantize(quantize_activation(x_nD))
    g, u = xq_nD @ w1q_HD.T, xq_nD @ w3q_HD.T
    return g.to(torch.bfloat16), u.to(torch.bfloat16), (g * torch.sigmoid(g) * u).to(torch.bfloat16)


def _fp8_forward(x_TD, plan: RoutingPlan, scores_TK, w1_EHD, w2_EDH, w3_EHD, fp8: bool):
    """(out [T, D] in x's dtype, g, u [N, H] bf16 in sorted order)."""
    N, H, D = plan.num_rows, w1_EHD.shape[1], w1_EHD.shape[2]
    x_ND = x_TD[plan.order_N.long() // plan.rows_per_token]  # expert-sorted routed rows
    g_NH, u_NH = (x_TD.new_zeros((N, H), dtype=torch.bfloat16) for _ in range(2))
    y_ND = x_TD.new_zeros((N, D), dtype=torch.bfloat16)
    if fp8:  # one quantized copy of each weight, 128x128 blocks per expert
        w1_EHD, w2_EDH, w3_EHD = (dequantize(quantize_weight(w)) for w in (w1_EHD, w2_EDH, w3_EHD))
    for e, a, b in _segments(plan):
        if fp8:
            g_NH[a:b], u_NH[a:b], h_nH = _gate_up_fp8(x_ND[a:b], w1_EHD[e], w3_EHD[e])
            y_ND[a:b] = dequantize(quantize_activation(h_nH)) @ w2_EDH[e].T  # GEMM2, h 1x128 along H
        else:
            g_NH[a:b], u_NH[a:b], h_nH = _gate_up_bf16(x_ND[a:b], w1_EHD[e], w3_EHD[e])
            y_ND[a:b] = h_nH @ w2_EDH[e].to(torch.bfloat16).T
    return _combine(y_ND.to(x_TD.dtype), plan, scores_TK, x_TD.dtype), g_NH, u_NH


def _dswiglu(q_nH, g_nH, u_nH, s_n):
    """The dgrad epilogue: (dg, du, s*h) rounded to bf16, in fp32, and ds = <q, h> (fp32). h is recomputed
    from the saved bf16 g, u."""
    g, u = g_nH.float(), u_nH.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dh = q_nH * s_n[:, None]
    dg = dh * u * (sig + silu * (1.0 - sig))
    return _bf16(dg), _bf16(dh * silu), _bf16(h * s_n[:, None]), (q_nH * h).sum(dim=1)


def _fp8_backward(dout_TD, x_TD, plan: RoutingPlan, scores_TK, w1_EHD, w2_EDH, w3_EHD, g_NH, u_NH, fp8: bool):
    """(dx, d scores, dW1, dW2, dW3) in their inputs' dtypes."""
    tokens_N = plan.order_N.long() // plan.rows_per_token
    dy_ND, x_ND = dout_TD[tokens_N].float(), x_TD[tokens_N].float()
    s_N = scores_TK.reshape(-1)[plan.order_N.long()].float()
    w1q, w2q, w3q = (_fake_quant(w, quantize_weight, fp8) for w in (w1_EHD, w2_EDH, w3_EHD))
    dx_ND = torch.zeros_like(x_ND)
    ds_N = torch.zeros_like(s_N)
    dw1, dw2, dw3 = (torch.zeros_like(w, dtype=torch.float32) for w in (w1_EHD, w2_EDH, w3_EHD))
    for e, a, b in _segments(plan):
        q_nH = _bf16(_fake_quant(dy_ND[a:b], quantize_activation, fp8) @ w2q[e])  # dgrad: 1x128 along D
        dg, du, hs, ds_N[a:b] = _dswiglu(q_nH, g_NH[a:b], u_NH[a:b], s_N[a:b])
        # dx rows: both products in one fp32 accumulator, stored once in bf16
        dx_ND[a:b] = _bf16(_fake_quant(dg, quantize_activation, fp8) @ w1q[e]
                           + _fake_quant(du, quantize_activation, fp8) @ w3q[e])
        x_tok = _token_blocks(x_ND[a:b], fp8)
        dw2[e] = _token_blocks(dy_ND[a:b], fp8).T @ _token_blocks(hs, fp8)
        dw1[e] = _token_blocks(dg, fp8).T @ x_tok
        dw3[e] = _token_blocks(du, fp8).T @ x_tok
    ds_TK = torch.zeros_like(s_N).index_copy_(0, plan.order_N.long(), ds_N).view(scores_TK.shape)
    dx_TD = _combine(dx_ND, plan, torch.ones_like(scores_TK), x_TD.dtype)  # dx_t = sum_k dx rows, fp32
    return dx_TD, ds_TK.to(scores_TK.dtype), dw1.to(w1_EHD.dtype), dw2.to(w2_EDH.dtype), dw3.to(w3_EHD.dtype)
