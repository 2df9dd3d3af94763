"""Token-choice top-k routing in one launch: score function, expert bias, top-k, gather, normalisation.

TorchTitan's router runs ~10 torch ops after the gate GEMM (fp32 cast, softmax, bias add, top-k, gather,
sum, divide, scale, histc). On the H200 at 30B-A3B, T=16384, they cost ~165 us of GPU time (top-k alone
106 us) and ~300 us of host time, all on the critical path in front of GEMM1. Here one program handles
BLOCK_T tokens with the whole expert row in registers (E <= 256):
    p = softmax(z) or sigmoid(z) in fp32;  choice = p + bias;  K rounds of (max, lowest index of the max,
    mask it out);  s_k = p[id_k];  s_k <- s_k / (sum_k s_k + 1e-20) * route_scale   (as stock)
The backward (`router_topk_backward`) is one launch too, the gradient of the gate logits from the scores'
gradient, p recomputed from the logits (oracle: `oracle.router_logits_grad_reference`, the same math in
torch ops, which took ~20 launches and ~300 us of host time per layer on the H100 at 30B-A3B T=512).
The ids come out in descending order of choice score (stock's `topk(sorted=False)` leaves the order
unspecified; every consumer sums over k). Ties resolve to the lowest expert id; NaN scores rank lowest
(torch.topk ranks them highest), so a diverged step still gets K distinct, valid ids. exp is libdevice's
accurate expf, as in torch's softmax, so that near-ties rank like stock's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..validation import check_router_args
from .common import INTERPRET, cdiv, new_output, next_power_of_2
from .launch import launch

MAX_EXPERTS = 256


@triton.jit
def _probabilities(z, e_ok, SOFTMAX: tl.constexpr, INTERPRET: tl.constexpr):
    """p [BLOCK_T, BLOCK_E] fp32 from logits z: softmax over the real experts (exp of z minus the row's
    max, as torch's softmax) or sigmoid; p = 0 at padded experts, and padded tokens stay finite."""
    z = tl.where(e_ok[None, :], z, float("-inf"))
    if SOFTMAX:
        z = z - tl.max(z, axis=1)[:, None]
        if INTERPRET:
            ez = tl.exp(z)
        else:
            ez = libdevice.exp(z)
        return ez / tl.sum(ez, axis=1)[:, None]
    else:
        if INTERPRET:
            return 1.0 / (1.0 + tl.exp(-z))
        else:
            return 1.0 / (1.0 + libdevice.exp(-z))


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, scores_ptr, ids_ptr, raw_ptr,  # logits [T, E]; outputs [T, K]
    T, E, stride_lt, route_scale,
    K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    z = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_lt + e[None, :],
                mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    p = _probabilities(z, e_ok, SOFTMAX, INTERPRET)
    choice = p
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    # NaN (a diverged step) ranks as -inf; `avail` rather than a -inf sentinel marks what may still be
    # chosen, so a row of -inf or NaN still yields K distinct ids in [0, E) and never an out-of-range one
    choice = tl.where(choice == choice, choice, float("-inf"))
    avail = tl.broadcast_to(e_ok[None, :], (BLOCK_T, BLOCK_E))

    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    s = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for k in tl.static_range(K):
        masked = tl.where(avail, choice, float("-inf"))
        best = tl.max(masked, axis=1)
        idx = tl.min(tl.where(avail & (masked == best[:, None]), e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == idx[:, None]
        s_k = tl.sum(tl.where(hit, p, 0.0), axis=1)
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        s = tl.where(kk[None, :] == k, s_k[:, None], s)
        avail = avail & (e[None, :] != idx[:, None])

    out = s
    if ROUTE_NORM:
        out = s / (tl.sum(s, axis=1) + 1e-20)[:, None]
    out = out * route_scale
    off = t.to(tl.int64)[:, None] * K + kk[None, :]
    ok = t_ok[:, None] & (kk[None, :] < K)
    tl.store(scores_ptr + off, out, mask=ok)
    tl.store(ids_ptr + off, ids.to(tl.int64), mask=ok)
    tl.store(raw_ptr + off, s, mask=ok)


def _token_blocks(E: int) -> tuple[int, int]:
    """(tokens, padded experts) per program of both router kernels: the whole expert row, and ~4K fp32
    lanes per program so that a [tokens, experts] block (p, choice; p, dp) stays in registers."""
    block_e = next_power_of_2(E)
    return max(1, min(32, 4096 // block_e)), block_e


def router_topk(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, score_func: str,
                route_norm: bool, route_scale: float):
    """(top scores [T, K] fp32, expert ids [T, K] int64, unnormalised p at the ids [T, K] fp32)."""
    check_router_args(logits_TE, bias_E, top_k, score_func, MAX_EXPERTS, INTERPRET)
    T, E = logits_TE.shape
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    dev = logits_TE.device
    scores = new_output((T, top_k), torch.float32, dev)
    ids = new_output((T, top_k), torch.int64, dev)
    raw = new_output((T, top_k), torch.float32, dev)
    if T == 0:
        return scores, ids, raw
    block_t, block_e = _token_blocks(E)
    launch(
        _router_topk_kernel, (cdiv(T, block_t),),
        logits_TE, bias_E if bias_E is not None else logits_TE, scores, ids, raw,
        T, E, logits_TE.stride(0), float(route_scale),
        K=top_k, BLOCK_K=next_power_of_2(top_k), SOFTMAX=score_func == "softmax",
        HAS_BIAS=bias_E is not None, ROUTE_NORM=bool(route_norm), BLOCK_T=block_t, BLOCK_E=block_e,
        INTERPRET=INTERPRET, num_warps=4,
    )
    return scores, ids, raw


@triton.jit
def _router_topk_backward_kernel(
    logits_ptr, ids_ptr, raw_ptr, dscores_ptr, dlogits_ptr,  # logits, dlogits [T, E]; the rest [T, K]
    T, E, stride_lt, route_scale,
    K: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, ROUTE_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    t_ok = t < T
    e_ok = e < E
    te_ok = t_ok[:, None] & e_ok[None, :]
    tk = t.to(tl.int64)[:, None] * K + kk[None, :]
    tk_ok = t_ok[:, None] & (kk[None, :] < K)
    d = tl.load(dscores_ptr + tk, mask=tk_ok, other=0.0).to(tl.float32) * route_scale
    raw = tl.load(raw_ptr + tk, mask=tk_ok, other=0.0)
    ids = tl.load(ids_ptr + tk, mask=tk_ok, other=-1).to(tl.int32)
    if ROUTE_NORM:  # s = raw / S: d raw_j = d_j / S - sum_k d_k raw_k / S^2
        S = tl.sum(raw, axis=1)[:, None] + 1e-20
        d = d / S - tl.sum(d * raw, axis=1)[:, None] / (S * S)
    z = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_lt + e[None, :], mask=te_ok, other=0.0).to(tl.float32)
    p = _probabilities(z, e_ok, SOFTMAX, INTERPRET)  # recomputed as the forward made it
    # dp: the gradient of the scores scattered onto the chosen experts (K distinct ids per token)
    dp = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k in tl.static_range(K):
        d_k = tl.sum(tl.where(kk[None, :] == k, d, 0.0), axis=1)
        id_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
        dp += tl.where(e[None, :] == id_k[:, None], d_k[:, None], 0.0)
    if SOFTMAX:  # sum_e dp_e p_e = sum_k d_k raw_k (raw is p at the ids)
        dz = p * (dp - tl.sum(d * raw, axis=1)[:, None])
    else:
        dz = dp * p * (1.0 - p)
    tl.store(dlogits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], dz.to(dlogits_ptr.dtype.element_ty), mask=te_ok)


def router_topk_backward(d_scores_TK: torch.Tensor, logits_TE: torch.Tensor, ids_TK: torch.Tensor,
                         raw_TK: torch.Tensor, score_func: str, route_norm: bool, route_scale: float) -> torch.Tensor:
    """d logits [T, E] in the logits' dtype from d scores [T, K] (the forward's `router_topk` outputs)."""
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    dlogits = new_output((T, E), logits_TE.dtype, logits_TE.device)
    if T == 0:
        return dlogits
    block_t, block_e = _token_blocks(E)
    launch(
        _router_topk_backward_kernel, (cdiv(T, block_t),),
        logits_TE, ids_TK, raw_TK, d_scores_TK.contiguous(), dlogits,
        T, E, logits_TE.stride(0), float(route_scale),
        K=K, BLOCK_K=next_power_of_2(K), SOFTMAX=score_func == "softmax", ROUTE_NORM=bool(route_norm),
        BLOCK_T=block_t, BLOCK_E=block_e, INTERPRET=INTERPRET, num_warps=4,
    )
    return dlogits
