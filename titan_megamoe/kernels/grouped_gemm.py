"""Row-tiled grouped GEMM over expert-sorted rows, output scattered back to routed-row order.

    out[order(p)] = A1_p B1_e (+ A2_p B2_e)

Serves two passes with the weight layout given by strides:
  forward GEMM2:  y_n  = h_p W2_e^T              (one pair; B = W2_e read transposed)
  backward dx:    dx_n = dg_p W1_e + du_p W3_e   (two pairs sharing one accumulator)
Writing row order(p) lets the per-token combine read each token's K rows contiguously.

With `TileConfig.tma` both operands come through TMA descriptors: A is contiguous in sorted order (a tile
is rows [tile_row, tile_row + BLOCK_M)) and B is the weight viewed as a matrix. Rows of a tile past its
expert's range, and B rows past expert e's block along N, are computed and masked at the store; along the
reduction dimension the host requires KD % BLOCK_K == 0 so no tile reaches into the next expert's K rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne, interpret_flag, matrix_descriptor, mma, new_output, row_tile, tma_ok
from .configs import tile_config


@triton.jit
def _accumulate(acc, a_ptr, b_ptr, a_off, b_off, row_ok, n_ok, offs_k, KD, stride_bk, BLOCK_K: tl.constexpr,
                INTERPRET: tl.constexpr):
    for k in range(0, tl.cdiv(KD, BLOCK_K)):
        k_ok = offs_k < KD - k * BLOCK_K
        a = tl.load(a_ptr + a_off, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + b_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = mma(a, b, acc, INTERPRET)
        a_off += BLOCK_K
        b_off += BLOCK_K * stride_bk
    return acc


@triton.jit
def _accumulate_tma(acc, a_desc, b_desc, row0, b_row0, n0, KD, B_TRANS: tl.constexpr, BLOCK_K: tl.constexpr,
                    WS: tl.constexpr, INTERPRET: tl.constexpr):
    # WS: Triton's automatic warp specialisation (producer warps issue the TMA loads, consumers the MMAs);
    # Hopper support needs descriptor loads, which is why only this loop offers it
    for k in tl.range(0, tl.cdiv(KD, BLOCK_K), warp_specialize=WS):
        a = a_desc.load([row0, k * BLOCK_K])
        if B_TRANS:  # B^T stored [n, k] (W2 [E, D, H]): the tile is [BLOCK_N, BLOCK_K], used transposed
            b = b_desc.load([b_row0 + n0, k * BLOCK_K]).T
        else:  # B stored [k, n] (W1, W3 [E, H, D])
            b = b_desc.load([b_row0 + k * BLOCK_K, n0])
        acc = mma(a, b, acc, INTERPRET)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    a1_ptr, b1_ptr, a2_ptr, b2_ptr,  # A: [N, KD] sorted rows; B: [E, ...] per expert
    order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    out_ptr,  # [N, ND] routed-row order
    KD, ND,
    stride_be, stride_bk, stride_bn,
    TWO_PAIRS: tl.constexpr, TMA: tl.constexpr, B_TRANS: tl.constexpr, WS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(ND, BLOCK_N)
    expert, pid_n, rows, row_ok = row_tile(tl.program_id(0), num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                           BLOCK_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < ND
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        row0 = tl.load(tile_row_ptr + tl.program_id(0) // num_n)
        b_row0 = expert * (ND if B_TRANS else KD)
        n0 = pid_n * BLOCK_N
        acc = _accumulate_tma(acc, a1_ptr, b1_ptr, row0, b_row0, n0, KD, B_TRANS, BLOCK_K, WS, INTERPRET)
        if TWO_PAIRS:
            acc = _accumulate_tma(acc, a2_ptr, b2_ptr, row0, b_row0, n0, KD, B_TRANS, BLOCK_K, WS, INTERPRET)
    else:
        a_off = rows.to(tl.int64)[:, None] * KD + offs_k[None, :]
        b_off = expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = _accumulate(acc, a1_ptr, b1_ptr, a_off, b_off, row_ok, n_ok, offs_k, KD, stride_bk, BLOCK_K,
                          INTERPRET)
        if TWO_PAIRS:
            # a second pass over K into the same accumulator, not interleaved with the first: an interleaved
            # loop would hold four operand tiles per pipeline stage and overflow shared memory
            acc = _accumulate(acc, a2_ptr, b2_ptr, a_off, b_off, row_ok, n_ok, offs_k, KD, stride_bk, BLOCK_K,
                              INTERPRET)

    dest = tl.load(order_ptr + rows, mask=row_ok, other=0)
    out_off = dest.to(tl.int64)[:, None] * ND + offs_n[None, :]
    tl.store(out_ptr + out_off, cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & n_ok[None, :])


def _launch(kernel_name, a1, b1, a2, b2, b_strides, b_trans, nd, order_N, tile_expert, tile_row, offsets_E1, dim,
            hidden):
    N, kd = a1.shape
    out = new_output((N, nd), torch.bfloat16, a1.device)
    cfg = tile_config(kernel_name, dim, hidden)
    grid = (tile_expert.numel() * triton.cdiv(nd, cfg.block_n),)
    if grid[0] == 0:
        return out
    a2 = a2 if a2 is not None else a1
    two_pairs = b2 is not None
    b2 = b2 if b2 is not None else b1
    use_tma = cfg.tma and kd % cfg.block_k == 0 and tma_ok(a1, a2, b1, b2)
    if use_tma:
        a1, a2 = (matrix_descriptor(a, [cfg.block_m, cfg.block_k]) for a in (a1, a2))
        b_block = [cfg.block_n, cfg.block_k] if b_trans else [cfg.block_k, cfg.block_n]
        b1, b2 = (matrix_descriptor(b, b_block) for b in (b1, b2))
    _grouped_gemm_kernel[grid](
        a1, b1, a2, b2,
        order_N, tile_expert, tile_row, offsets_E1, out, kd, nd, *b_strides,
        TWO_PAIRS=two_pairs, TMA=use_tma, B_TRANS=b_trans, WS=use_tma and cfg.warp_specialize,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INTERPRET=interpret_flag(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def expert_down_proj(h_NH, w2_EDH, order_N, tile_expert, tile_row, offsets_E1):
    """Forward GEMM2: y[order(p)] = h_p W2_e^T, [N, D] bf16 in routed-row order."""
    E, D, H = w2_EDH.shape
    strides = (w2_EDH.stride(0), w2_EDH.stride(2), w2_EDH.stride(1))  # B[k=h, n=d] = W2[e, d, h]
    return _launch("gemm2", h_NH, w2_EDH, None, None, strides, True, D, order_N, tile_expert, tile_row, offsets_E1, D, H)


def expert_input_grad(dg_NH, du_NH, w1_EHD, w3_EHD, order_N, tile_expert, tile_row, offsets_E1):
    """Backward dx rows: dx[order(p)] = dg_p W1_e + du_p W3_e, [N, D] bf16 in routed-row order."""
    E, H, D = w1_EHD.shape
    strides = (w1_EHD.stride(0), w1_EHD.stride(1), w1_EHD.stride(2))  # B[k=h, n=d] = W1[e, h, d]
    return _launch("dx", dg_NH, w1_EHD, du_NH, w3_EHD, strides, False, D, order_N, tile_expert, tile_row, offsets_E1, D, H)
