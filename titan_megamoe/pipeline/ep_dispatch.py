"""Expert parallelism: dispatch and combine through torch.distributed all-to-all (the baseline transport)
or torch symmetric memory (`symm_transport`, `transport="symm_mem"`).

Each rank of the EP group owns E_local experts: rank r holds global experts [r*E_local, (r+1)*E_local)
(TorchTitan's `ExpertParallel` layout, Shard(0) of the expert weights). For one call on one rank:

  route     routed rows n = t*K + k go to rank ids[n] // E_local; the rows are put in send order (by
            global expert, then n: a stable sort, so each destination's rows are contiguous) and the
            per-expert counts all-gathered into the matrix every rank holds (one host sync for the split
            sizes, as stock TorchTitan's EP has; the symmetric-memory transport takes every row's
            destination from it)
  dispatch  x rows, their expert ids (all-to-all only) and scores to the experts' owners; the received
            rows are a contiguous buffer, and the plan over them (`RowSource.CONTIGUOUS`, one row each,
            local expert ids via `first_expert`) is all the expert FFN stage needs
  FFN       `expert_ffn.ffn_up` and `ffn_down` on the received rows, unchanged
  combine   the y rows back to the ranks of their tokens, put back in routed-row order,
            and the deterministic score-weighted sum there (`kernels.combine`)
Backward mirrors it: the dout rows travel like x, dgrad/dx run on the received rows, dx rows and ds go
back, the dx combine sums on the token's rank, and the weight gradients of the local experts are local.

Because the received rows of an expert arrive in (source rank, token) order, which is the global token
order, every kernel sees its rows in the order a single GPU holding all tokens would: the result is
bitwise that of the single-GPU op (tests/test_ep.py checks it).
No token is dropped: receive buffers are sized from the exchanged counts, whatever the skew; or, under
symm_mem with a capacity factor (`route`), from a bound the host knows without a sync, with a device-side
check that stops the step before any row moves if a rank would receive more.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..kernels.combine import combine
from ..kernels.routing_meta import build_routing_plan
from ..plan import RoutingPlan
from ..precision import Recipe
from ..validation import check_kernel_shapes
from .dispatch import gradient_link, plan_block_m
from .expert_ffn import ffn_backward_input, ffn_backward_weights, ffn_down, ffn_up
from .symm_transport import back_from_gemm, exchange_symmetric, expert_sorted_ids, send_counted


@dataclass(frozen=True)
class Route:
    """Where this rank's routed rows go and how many rows it receives from each rank."""

    group: dist.ProcessGroup
    num_local_experts: int
    first_expert: int  # global id of this rank's local expert 0
    send_order_N: torch.Tensor  # routed rows n = t*K + k in send order (by global expert, then n)
    send_ids_N: torch.Tensor  # the global expert of each row in send order (sorted)
    counts_WG: torch.Tensor  # [s][g] on the device: rows rank s routes to global expert g (every rank holds all)
    expert_counts: list[list[int]] | None  # counts_WG on the host (the sync); None with a capacity
    transport: str = "all_to_all"  # or "symm_mem"
    capacity: int | None = None  # rows a rank may receive (symm_mem without the host sync); None: exact sizes
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # the transport's per-route maps

    @functools.cached_property
    def counts(self) -> list[list[int]]:
        """counts[s][q]: rows rank s sends to rank q (host counts: not with a capacity)."""
        assert self.expert_counts is not None, "a route with a capacity has no counts on the host"
        E = self.num_local_experts
        return [[sum(row[q * E:(q + 1) * E]) for q in range(len(row) // E)] for row in self.expert_counts]

    @property
    def send_splits(self) -> list[int]:
        """Rows this rank sends to each rank."""
        return self.counts[dist.get_rank(self.group)]

    @property
    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank."""
        me = dist.get_rank(self.group)
        return [row[me] for row in self.counts]

    @property
    def num_received(self) -> int:
        return sum(self.recv_splits)


def capacity_rows(capacity_factor: float, num_rows: int) -> int:
    """Rows a rank may receive with `ep_capacity_factor`: the factor times the rows each rank routes."""
    return max(1, math.ceil(capacity_factor * num_rows))


def route(topk_ids_TK: torch.Tensor, num_local_experts: int, group: dist.ProcessGroup,
          transport: str = "all_to_all", capacity_factor: float | None = None) -> Route:
    """The route of this rank's rows. Without a capacity factor the counts are read on the host (the one
    host sync: every size exact). With one (symm_mem only) nothing is read on the host: buffers hold
    `capacity_rows` received rows a rank, and a device-side check stops the step, before any row moves,
    when a rank would receive more (or when the ranks route different numbers of rows)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    ids_N = topk_ids_TK.reshape(-1)
    num_experts = num_local_experts * ep
    # by global expert (stable): each destination's rows are contiguous (its experts are), grouped by
    # expert in token order. The plan of the receiving rank sorts by expert again, stably, so an expert
    # sees its rows in (source rank, token) order either way: the single-GPU order
    send_ids_N, send_order_N = torch.sort(ids_N, stable=True)
    # counted with index_add_, not bincount: bincount on CUDA reads the max id on the host (a sync; the
    # capacity path raised under torch's sync debug mode on the H200 with it), and an id out of range stops
    # here at the bounds check instead of addressing a rank that does not exist
    expert_counts = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).index_add_(
        0, ids_N.long(), torch.ones_like(ids_N, dtype=torch.int64))
    gathered = [torch.empty_like(expert_counts) for _ in range(ep)]
    dist.all_gather(gathered, expert_counts, group=group)
    counts_WG = torch.stack(gathered)
    first = rank * num_local_experts
    if capacity_factor is None:
        host = counts_WG.tolist()  # the one host sync: buffer sizes and offsets
        return Route(group, num_local_experts, first, send_order_N, send_ids_N, counts_WG, host, transport)
    n = ids_N.numel()
    capacity = capacity_rows(capacity_factor, n)
    # on the device, in stream order before any row is sent: a failed check stops the step, nothing is
    # dropped or written past a buffer
    # (CUDA's device assert takes messages under 255 characters)
    torch._assert_async((counts_WG.sum(1) == n).all(),
                        "titan_megamoe.moe: with ep_capacity_factor every EP rank must route the same number of rows "
                        "(tokens x top-k); they differ. Use equal local batches, or ep_capacity_factor 0")
    received = counts_WG.view(ep, ep, num_local_experts).sum((0, 2))  # rows each rank receives
    K = topk_ids_TK.shape[1]
    any_routing = ep * min(K, num_local_experts) / K  # a factor that holds every routing
    torch._assert_async((received <= capacity).all(),
                        f"titan_megamoe.moe: an EP rank would receive more rows than ep_capacity_factor="
                        f"{capacity_factor} allows ({capacity}); stopped, nothing dropped. Raise it ({any_routing:g} "
                        f"holds any routing) or set 0 (exact sizes, a host sync)")
    return Route(group, num_local_experts, first, send_order_N, send_ids_N, counts_WG, None, transport, capacity)


def splits(r: Route, back: bool = False) -> tuple[list[int], list[int]]:
    """(rows sent to, rows received from) each rank: out to the experts' owners, or `back` to the sources."""
    return (r.recv_splits, r.send_splits) if back else (r.send_splits, r.recv_splits)


def exchange(rows: torch.Tensor, r: Route, back: bool = False, index: torch.Tensor | None = None) -> torch.Tensor:
    """Rows in send order to their owners (rows[index] when `index` is given: the symmetric-memory
    transport reads them in place, the all-to-all gathers them first), or, `back`, received rows to their
    sources, by the route's transport. The all-to-all delivers rows grouped by source rank, the
    symmetric-memory transport in expert-sorted order (`symm_transport`); back, both return each row to
    its send slot."""
    if r.transport == "symm_mem":
        return exchange_symmetric(rows, r, back, index)
    if index is not None:
        rows = rows[index]
    send, recv = splits(r, back)
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=r.group)
    return out


def to_routed_order(rows_send: torch.Tensor, r: Route) -> torch.Tensor:
    """Rows in send order -> routed-row order n = t*K + k (the order the combine reads)."""
    out = torch.empty_like(rows_send)
    out[r.send_order_N] = rows_send
    return out


def received_plan(r: Route, topk_ids_TK: torch.Tensor, recipe: Recipe) -> RoutingPlan:
    """The plan over the rows this rank receives, from their global expert ids in the transport's order:
    exchanged under the all-to-all; under symm_mem the rows land sorted by expert, so the ids follow from
    the counts alone (and the plan exists before any row lands; with a capacity, the rows past the count
    are padding)."""
    if r.transport == "symm_mem":
        ids, num_valid = expert_sorted_ids(r)
    else:
        ids, num_valid = exchange(topk_ids_TK.reshape(-1), r, index=r.send_order_N), None
    return build_routing_plan(ids, r.num_local_experts, plan_block_m(recipe), first_expert=r.first_expert,
                              num_valid=num_valid)


def _fused_transport(r: Route, recipe: Recipe, backward: bool = False) -> bool:
    """Whether this side of the layer moves its rows inside the GEMMs (symm_mem, bf16 operands: GEMM1 or
    dgrad wait per expert and read the landing rows in place, GEMM2 or dx's GEMM store rows to the peers).
    Block FP8 quantizes the rows before its GEMMs (a pass over all of them), so under symm_mem an FP8 side
    exchanges whole buffers through symmetric memory (`exchange`) around the same FFN stage instead."""
    return r.transport == "symm_mem" and not recipe.quantized(backward)


def fused_moe_expert_parallel(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe, group,
                              transport: str = "all_to_all", capacity_factor: float | None = None):
    """The Triton pipeline under EP (either transport, bf16 or block FP8): [T, D] in x's dtype.
    Differentiable in x, the scores and the local expert weights; eager only (the split sizes are read on
    the host). Two autograd.Functions, as the single-GPU op's two steps (`ops.py`): `FusedMoEExpertParallel`
    (route, rows out, GEMM1: everything the backward needs, and the whole backward) and `_ExpertParallelDown`
    (GEMM2, rows back, combine), so that a recompute under activation checkpointing stops before the
    second: no GEMM2 and no return trip (on every rank alike, so the collectives stay matched)."""
    link, state, *down = FusedMoEExpertParallel.apply(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                                                      recipe, group, transport, capacity_factor)
    return _ExpertParallelDown.apply(link, w2_EDH, recipe, state, down)  # one list: GEMM2 empties it (`ffn_down`)


class FusedMoEExpertParallel(torch.autograd.Function):
    """The EP forward's first step (returns (link, what the second step needs, GEMM2's operands...)) and
    the whole EP backward, which receives the output's gradient through the link."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe: Recipe, group,
                transport: str = "all_to_all", capacity_factor: float | None = None):
        E_local, H, D = w1_EHD.shape
        check_kernel_shapes(D, H)
        K = topk_ids_TK.shape[1]
        r = route(topk_ids_TK, E_local, group, transport, capacity_factor)
        send = r.send_order_N
        plan = received_plan(r, topk_ids_TK, recipe)
        recv_scores = exchange(topk_scores_TK.float().reshape(-1), r, index=send)
        if _fused_transport(r, recipe):
            # GEMM1 starts on the experts whose rows have landed while the rest are on their way; x is
            # cast to the operand dtype before it leaves, so GEMM1 reads the landing rows in place
            landing, arrivals, finish = send_counted(recipe.operand(x_TD), r, send // K)
            down, residuals = ffn_up(landing, plan, w1_EHD, w2_EDH, w3_EHD, recipe, arrivals)
            recv_x = finish()  # the weight gradients need the rows after the buffer is reused
        else:
            recv_x = exchange(x_TD, r, index=send // K)
            down, residuals = ffn_up(recv_x, plan, w1_EHD, w2_EDH, w3_EHD, recipe)
        torch._assert_async(plan.ids_ok, "titan_megamoe.moe: a received expert id is not one of this rank's experts")
        ctx.save_for_backward(recv_x, recv_scores, w1_EHD, w2_EDH, w3_EHD, plan.packed, *residuals)
        ctx.route, ctx.layout, ctx.recipe, ctx.K = r, plan.layout, recipe, K
        ctx.scores_dtype, ctx.x_dtype = topk_scores_TK.dtype, x_TD.dtype
        ctx.mark_non_differentiable(*down)
        ctx.set_materialize_grads(False)
        return gradient_link(x_TD), (r, plan, topk_scores_TK), *down

    @staticmethod
    def backward(ctx, dout_TD, *_):
        if dout_TD is None:  # the output did not reach the loss
            return (None,) * 10
        recv_x, recv_scores, w1, w2, w3, packed, *residuals = ctx.saved_tensors
        r, K = ctx.route, ctx.K
        plan = RoutingPlan.from_packed(packed, ctx.layout)
        if _fused_transport(r, ctx.recipe, backward=True):
            # as the forward: dgrad starts on the experts whose dout rows have landed, reading them in place
            # (they stay in the buffer until the weight gradients have read them: the next exchange out
            # begins with a barrier, after them on every rank's stream); dx's GEMM stores each dx row
            # straight into its token's rank
            landing, arrivals, _ = send_counted(ctx.recipe.operand(dout_TD, backward=True), r, r.send_order_N // K)
            dx_to, dx_back = back_from_gemm(r, plan, ctx.recipe.activation, dout_TD.shape[1:])
            _, ds_recv, saved = ffn_backward_input(landing, plan, recv_scores, w1, w2, w3, residuals, ctx.recipe,
                                                   arrivals=arrivals, dx_to=dx_to)
            dx_ND = to_routed_order(dx_back(), r)
        else:
            recv_dout = exchange(dout_TD, r, index=r.send_order_N // K)
            dx_recv, ds_recv, saved = ffn_backward_input(recv_dout, plan, recv_scores, w1, w2, w3, residuals,
                                                         ctx.recipe)
            dx_ND = to_routed_order(exchange(dx_recv, r, back=True), r)
        ds_N = to_routed_order(exchange(ds_recv, r, back=True), r)
        dx = combine(dx_ND, None, K, ctx.x_dtype)
        dw1, dw2, dw3 = ffn_backward_weights(recv_x, plan, w1, w2, saved, ctx.recipe)
        ds = ds_N.view(-1, K).to(ctx.scores_dtype)
        return dx, None, ds, dw1, dw2, dw3, None, None, None, None


class _ExpertParallelDown(torch.autograd.Function):
    """The EP forward's second step: GEMM2, the y rows back to their tokens' ranks, the combine. Its
    backward hands the output's gradient to the link."""

    @staticmethod
    def forward(ctx, link_TD, w2_EDH, recipe: Recipe, state, down: list):
        r, plan, topk_scores_TK = state
        K = topk_scores_TK.shape[1]
        if _fused_transport(r, recipe):
            # GEMM2 stores each y row straight into its token's rank
            y_to, y_back = back_from_gemm(r, plan, recipe.activation, link_TD.shape[1:])
            ffn_down(down, plan, w2_EDH, recipe, y_to=y_to)
            y_ND = to_routed_order(y_back(), r)
        else:
            y_recv = ffn_down(down, plan, w2_EDH, recipe)
            y_ND = to_routed_order(exchange(y_recv, r, back=True), r)
        return combine(y_ND, topk_scores_TK.float().contiguous(), K, link_TD.dtype)

    @staticmethod
    def backward(ctx, dout_TD):
        return dout_TD, None, None, None, None


def moe_reference_ep(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, compute_dtype, group):
    """The reference backend under EP: the same transport through autograd's all-to-all, the oracle's
    expert FFN on the received rows, stock's fp32 combine; gradients from autograd."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from ..oracle import moe_reference

    T, K = topk_ids_TK.shape
    E_local = w1_EHD.shape[0]
    r = route(topk_ids_TK, E_local, group)

    def send(rows, back=False):
        s, rv = splits(r, back)
        return all_to_all_single_autograd(rows.contiguous(), rv, s, group)

    recv_x = send(x_TD[r.send_order_N // K])
    with torch.no_grad():
        recv_local_ids = exchange(topk_ids_TK.reshape(-1)[r.send_order_N], r) - r.first_expert
    ones = torch.ones(r.num_received, 1, dtype=torch.float32, device=x_TD.device)
    # K = 1 and score 1: the oracle returns the expert output rows y themselves, in x's dtype
    y_recv = moe_reference(recv_x, recv_local_ids[:, None], ones, w1_EHD, w2_EDH, w3_EHD, compute_dtype)
    if r.num_received == 0:  # keep recv_x in the graph: every rank must join the backward's all-to-all
        y_recv = y_recv + 0 * recv_x.sum()
    y_ND = to_routed_order(send(y_recv, back=True), r)
    out = torch.bmm(topk_scores_TK.reshape(T, 1, K).float(), y_ND.reshape(T, K, -1).float())
    return out.squeeze(1).to(x_TD.dtype)
