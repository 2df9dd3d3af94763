"""Drop-in subclasses of TorchTitan 0.2.2's MoE modules that route the experts through `titan_megamoe.moe`.

The converter swaps `__class__` on the existing (meta) modules instead of building new ones, so every
parameter, buffer, FQN (`moe.experts.w1/w2/w3`, `moe.router.gate.weight`, `moe.expert_bias`,
`moe.tokens_per_expert`), the load-balancing optimizer hook, FSDP/AC/compile wrapping (which test
`isinstance(..., MoE)` and skip `experts` by name) and the FLOP count stay exactly as stock.

Stock MoE.forward: router -> histc/argsort reorder -> gather -> 3 grouped GEMMs -> scatter -> fp32 bmm
with the scores. MegaMoE.forward keeps the router's gate, the `tokens_per_expert` accounting and the
shared experts, and hands (x, top-k ids, top-k scores) to the experts module, which does routing, GEMMs
and the weighted combine in one op. Calling through `self.experts` keeps FSDP's hooks on that module.

With the fused kernels (`fused_router`, on by default) the router's math after the gate GEMM runs as one
Triton launch (`titan_megamoe.router`); the stock router module runs instead under torch.compile or a
dispatch mode (op-level SAC), for node-limited routing and for the debug balanced routing, and on the
reference backend.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts, MoE

from ...ops import _op_must_be_visible, resolve_backend
from ...ops import moe as fused_moe
from ...kernels.router_topk import MAX_EXPERTS as FUSED_ROUTER_MAX_EXPERTS
from ...router import topk_route


class Fp32Scores:
    """The top-k scores on their way into `MegaGroupedExperts`, past FSDP2's mixed-precision input cast.

    Under EP TorchTitan `fully_shard`s `moe.experts` by itself, and FSDP2 (`cast_forward_inputs`) casts
    every floating-point tensor among a sharded module's forward arguments to `param_dtype` (bf16).
    Stock's experts module is never given the scores (it applies them outside, in fp32); ours is, and a
    bare tensor would reach the op rounded to bf16, with its gradient rounded to bf16 too. FSDP does not
    look inside this holder; the tensor stays in the autograd graph."""

    __slots__ = ("scores",)

    def __init__(self, scores: torch.Tensor):
        self.scores = scores


class MegaGroupedExperts(GroupedExperts):
    """GroupedExperts whose forward takes unsorted routed tokens and returns the combined output."""

    precision: str = "bf16"
    backend: str = "auto"
    ep_transport: str = "all_to_all"
    ep_capacity_factor: float | None = None  # symm_mem without the host sync (`titan_megamoe.moe`)
    ep_mesh = None  # set by expert_parallel.MegaAwareExpertParallel: the weights hold this rank's experts

    def forward(  # type: ignore[override]
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_scores_TK: torch.Tensor | Fp32Scores,
    ) -> torch.Tensor:
        if isinstance(topk_scores_TK, Fp32Scores):
            topk_scores_TK = topk_scores_TK.scores
        w1, w2, w3 = self.w1, self.w2, self.w3
        if isinstance(w1, DTensor):
            # as stock: plain local tensors for the dynamic-shape expert computation
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()  # type: ignore[union-attr]
        group = self.ep_mesh.get_group() if self.ep_mesh is not None else None
        return fused_moe(
            x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, precision=self.precision, backend=self.backend,
            ep_group=group, ep_transport=self.ep_transport,
            ep_capacity_factor=self.ep_capacity_factor if group is not None else None,
        )

    def extra_repr(self) -> str:
        E, H, D = self.w1.shape
        cf = f", capacity factor {self.ep_capacity_factor:g}" if self.ep_capacity_factor else ""
        ep = f", ep={self.ep_mesh.size()} ({self.ep_transport}{cf})" if self.ep_mesh is not None else ""
        return f"experts={E}, dim={D}, hidden={H}, precision={self.precision}, backend={self.backend}{ep}"


class MegaMoE(MoE):
    """MoE with the routed experts fused: no reorder, gather, scatter or separate combine."""

    experts: MegaGroupedExperts
    fused_router: bool = True

    def _router_is_fusable(self, x_TD: torch.Tensor) -> bool:
        r = self.router
        return (self.fused_router and r.num_expert_groups is None and not r._debug_force_load_balance
                and r.num_experts <= FUSED_ROUTER_MAX_EXPERTS and resolve_backend(self.experts.backend, x_TD.device) == "triton"
                and not _op_must_be_visible())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x_TD = x.view(-1, dim)

        num_tokens_per_expert = None
        if self._router_is_fusable(x_TD):
            r = self.router
            top_scores_TK, topk_ids_TK = topk_route(r.gate(x_TD), self.expert_bias, r.top_k, r.score_func,
                                                    r.route_norm, r.route_scale)
        else:
            top_scores_TK, topk_ids_TK, num_tokens_per_expert = self.router(x_TD, self.expert_bias)

        # load-balancing statistics, exactly as stock (the optimizer hook reads and resets them), and where stock
        # counts them, before the experts: a recompute under activation checkpointing with early stop ends in
        # the experts (below), and TorchTitan's hook halves the counts of checkpointed blocks, which assumes
        # the recompute counted them again
        with torch.no_grad():
            if num_tokens_per_expert is None:
                E = self.router.num_experts
                num_tokens_per_expert = torch.histc(topk_ids_TK.view(-1), bins=E, min=0, max=E)
            self.tokens_per_expert.add_(num_tokens_per_expert)

        # the shared experts before the routed ones: a recompute with early stop ends once the last tensor
        # the backward saved is remade, which is then the routed experts' first step, so GEMM2 and the
        # combine (the op's second step) are not rerun (`titan_megamoe.ops`); the sum below is stock's
        shared_TD = self.shared_experts(x_TD) if self.shared_experts is not None else None
        out_TD = self.experts(x_TD, topk_ids_TK, Fp32Scores(top_scores_TK))

        if shared_TD is not None:
            out_TD = shared_TD + out_TD
        return out_TD.reshape(bs, slen, dim)
