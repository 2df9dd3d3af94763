"""Pure-PyTorch MoE: the `reference` backend and the numerical oracle of every kernel.

It follows stock TorchTitan 0.2.2's rounding points exactly (expert GEMMs in the compute dtype, the
expert output cast to x's dtype, the score-weighted combine as an fp32 bmm), so a training run on the
reference backend reproduces the stock arm step by step. With ``compute_dtype=torch.float32`` (or
float64) it is the high-precision oracle the kernel tests compare against.

It loops over experts with sizes read on the host: one synchronisation per call, acceptable for a
reference; the Triton backend has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .routing import build_routing


def moe_reference(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out_t = sum_k s_tk * (silu(x_t W1_e^T) * (x_t W3_e^T)) W2_e^T, differentiable by autograd."""
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    E = w1_EHD.shape[0]
    cd = compute_dtype or x_TD.dtype
    if T == 0:
        return x_TD.new_zeros((0, D)) + 0 * (w1_EHD.sum() + w2_EDH.sum() + w3_EHD.sum() + topk_scores_TK.sum())
    routing = build_routing(topk_ids_TK, E)
    counts = (routing.offsets_E1[1:] - routing.offsets_E1[:-1]).tolist()
    x_ND = x_TD[routing.order_N.long() // K]  # expert-sorted routed rows
    y_parts = []
    for e, x_nD in enumerate(torch.split(x_ND, counts)):
        if x_nD.shape[0] == 0:
            continue
        # one cast per GEMM, as stock does: the two input gradients then meet in x's dtype, not in bf16
        h_nH = F.silu(x_nD.to(cd) @ w1_EHD[e].to(cd).T) * (x_nD.to(cd) @ w3_EHD[e].to(cd).T)
        y_parts.append(h_nH @ w2_EDH[e].to(cd).T)
    y_ND = torch.cat(y_parts).to(x_TD.dtype)[routing.inv_N.long()]  # back to routed-row order
    out_T1D = torch.bmm(topk_scores_TK.reshape(T, 1, K).float(), y_ND.reshape(T, K, D).float())
    return out_T1D.squeeze(1).to(x_TD.dtype)
