"""Pure-PyTorch oracle: the `reference` backend and the numerical reference of every kernel.

One place for every reference computation: the MoE layer (`moe_reference`), the routing plan
(`routing_plan`, the oracle of the routing kernel), the router after the gate GEMM
(`router_reference`) and the expert weight gradients (`wgrad_w2_reference`, `wgrad_w13_reference`).
A precision that quantizes (FP8) adds its emulation here, next to the math it emulates.

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
