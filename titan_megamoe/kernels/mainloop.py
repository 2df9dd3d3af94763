"""The two main loops every GEMM of the layer is built from.

`row_mainloop`: one M-tile of expert-sorted rows times one or two weight blocks, over the whole
reduction dimension (GEMM1 gate+up, GEMM2, dgrad, dx).
  A   rows by pointer at any row offsets (gathered tokens or contiguous sorted rows, `a_off` holds
      them), or contiguous rows through a TMA descriptor (`A_TMA`, starting at sorted row `a_row`);
  B   the expert's weight by pointer (bases `b0_src`, `b1_src` plus the shared offsets `b_off`, moved by
      `stride_bk` per reduction step; dgrad's second column block is the base shifted by BLOCK_N) or TMA
      descriptors over the weight viewed as a matrix (`B_TMA`): stored [n, k] (`B_TRANS`, read at row
      `b_row`) or [k, n] (read at rows `b_row + k`, column `b_col`);
  TWO_B  a second weight block into a second accumulator, sharing every A tile (GEMM1's gate and up,
      dgrad's two column blocks). With TMA both blocks sit at the same coordinates of two descriptors.
`pair_mainloop`: A1 B1 + A2 B2 over the whole reduction in one loop, both pairs through TMA (dx with
`TileConfig.pairs_in_one_loop`).
`varlen_mainloop`: A^T B over one expert's rows [lo, hi), the reduction of the weight gradients; either
operand gathered by token through the plan's order or read in sorted order (optionally through TMA).

  SCALED  block FP8 (e4m3 tiles, BLOCK_K = 128 = one scale block): each K block's product is scaled by
      its row scales (`a_scale + a_scale_off`, [rows, KD/128] with the row offsets precomputed) times the
      weight's block scale (`b0_scale + b0_scale_off`, likewise b1: the scale of the tile's (n-block,
      k-block), the k-block stride 1) and added in fp32. A weight tile lies in one 128x128 block column
      (BLOCK_N <= 128, tiles aligned), so its scale is one number per K block: one multiply per row
      instead of an outer product of row and column scales per element.

Masked rows and columns load as zeros, so partial tiles are exact. The operand dtype is whatever the
tiles hold: bf16, or e4m3 with SCALED.

`token_tile_mainloop`: the block-FP8 weight gradients' reduction over one expert's token tiles
(`quant.quantize_token_tiles`: both operands e4m3 [rows, tiles * 128], tokens contiguous, one fp32 scale
per row and tile), one fresh FP8 product per tile scaled into the fp32 accumulator; pointer or TMA loads.
"""

import triton
import triton.language as tl

from .common import mma


@triton.jit
def row_mainloop(acc0, acc1, a_src, a_off, row_ok, a_row, b0_src, b1_src, b_off, b0_ok, b1_ok, b_row, b_col,
                 KD, stride_bk, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_TRANS: tl.constexpr, TWO_B: tl.constexpr,
                 WS: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                 a_scale=None, a_scale_off=None, b0_scale=None, b1_scale=None, b0_scale_off=None, b1_scale_off=None,
                 SCALED: tl.constexpr = False, b1_row=None):
    offs_k = tl.arange(0, BLOCK_K)
    if b1_row is None:  # TMA: the second weight block at its own row of the descriptor (dgrad's next columns)
        b1_row = b_row
    # WS: Triton's automatic warp specialisation (producer warps issue the TMA loads, consumers the MMAs);
    # Hopper support needs descriptor loads, so only the TMA configs turn it on
    for k in tl.range(0, tl.cdiv(KD, BLOCK_K), warp_specialize=WS):
        k_ok = offs_k < KD - k * BLOCK_K
        if A_TMA:
            a = a_src.load([a_row, k * BLOCK_K])
        else:
            a = tl.load(a_src + a_off, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            if B_TRANS:  # B^T stored [n, k]: the tile is [BLOCK_N, BLOCK_K], used transposed
                b0 = b0_src.load([b_row, k * BLOCK_K]).T
                if TWO_B:
                    b1 = b1_src.load([b1_row, k * BLOCK_K]).T
            else:
                b0 = b0_src.load([b_row + k * BLOCK_K, b_col])
                if TWO_B:
                    b1 = b1_src.load([b_row + k * BLOCK_K, b_col])
        else:
            b0 = tl.load(b0_src + b_off, mask=k_ok[:, None] & b0_ok[None, :], other=0.0)
            if TWO_B:
                b1 = tl.load(b1_src + b_off, mask=k_ok[:, None] & b1_ok[None, :], other=0.0)
        if SCALED:
            # block FP8: a fresh accumulator per 128-wide K block, scaled and summed in fp32 (Hopper's FP8
            # MMA accumulates with reduced precision, so a long K must not stay inside it: DeepSeek-V3's
            # promotion); the row scales are [rows, KD / 128], the weight block scales [n_block, k_block]
            sa = tl.load(a_scale + a_scale_off + k, mask=row_ok, other=0.0)
            s0 = sa * tl.load(b0_scale + b0_scale_off + k)
            acc0 += mma(a, b0, tl.zeros_like(acc0), INTERPRET) * s0[:, None]
            if TWO_B:
                s1 = sa * tl.load(b1_scale + b1_scale_off + k)
                acc1 += mma(a, b1, tl.zeros_like(acc1), INTERPRET) * s1[:, None]
        else:
            acc0 = mma(a, b0, acc0, INTERPRET)
            if TWO_B:
                acc1 = mma(a, b1, acc1, INTERPRET)
        a_off += BLOCK_K
        b_off += BLOCK_K * stride_bk
    return acc0, acc1


@triton.jit
def pair_mainloop(acc, a1_src, b1_src, a2_src, b2_src, a_row, b_row, b_col, KD, B_TRANS: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, a1_scale=None, b1_scale=None, a2_scale=None,
                  b2_scale=None, a_scale_off=None, b_scale_off=None, row_ok=None, SCALED: tl.constexpr = False):
    """acc + A1 B1 + A2 B2 over the reduction dimension in one loop: each step loads both pairs' tiles (TMA
    descriptors, at the coordinates `row_mainloop` uses) and runs both MMAs (dx's dg W1 + du W3). One loop
    per tile instead of two is what lets a persistent kernel's tile loop be flattened with it (Triton 3.6
    fuses a loop nest with a single inner loop only). Four operand tiles per pipeline stage instead of two,
    so fewer stages fit; the sums run in another order than two passes (pair 1's steps, then pair 2's), so
    the result is not bitwise theirs.
    bf16: a second accumulator for pair 2, added at the end (two MMAs chained through one accumulator are
    not kept in flight across steps: `wgmma.wait_group 0` after each in the sm_90 compile, Triton 3.6; two
    independent chains are, like GEMM1's gate and up), so 128-column tiles at most.
    SCALED: block FP8, each pair's product of a K block scaled by its row and weight-block scales and added
    in fp32, as in `row_mainloop` (whose MMAs wait for each K block anyway)."""
    acc2 = tl.zeros_like(acc)
    for k in tl.range(0, tl.cdiv(KD, BLOCK_K)):
        a1 = a1_src.load([a_row, k * BLOCK_K])
        a2 = a2_src.load([a_row, k * BLOCK_K])
        if B_TRANS:  # B^T stored [n, k]
            b1 = b1_src.load([b_row, k * BLOCK_K]).T
            b2 = b2_src.load([b_row, k * BLOCK_K]).T
        else:
            b1 = b1_src.load([b_row + k * BLOCK_K, b_col])
            b2 = b2_src.load([b_row + k * BLOCK_K, b_col])
        if SCALED:
            s1 = tl.load(a1_scale + a_scale_off + k, mask=row_ok, other=0.0) * tl.load(b1_scale + b_scale_off + k)
            acc += mma(a1, b1, tl.zeros_like(acc), INTERPRET) * s1[:, None]
            s2 = tl.load(a2_scale + a_scale_off + k, mask=row_ok, other=0.0) * tl.load(b2_scale + b_scale_off + k)
            acc += mma(a2, b2, tl.zeros_like(acc), INTERPRET) * s2[:, None]
        else:
            acc = mma(a1, b1, acc, INTERPRET)
            acc2 = mma(a2, b2, acc2, INTERPRET)
    return acc + acc2


@triton.jit
def varlen_mainloop(acc, acc2, a_src, a2_src, b_src, order_ptr, lo, hi, offs_m, offs_n, M, N, stride_a, stride_b,
                    pid_m, pid_n, TOP_K: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr,
                    DUAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, SORTED_TMA: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                    WS: tl.constexpr = False):
    """acc += sum_p A[row_a(p), offs_m]^T B[row_b(p), offs_n] over sorted rows lo <= p < hi (acc2 likewise
    with A2 when DUAL), where an operand's row is the sorted position p or, gathered, the token
    order[p] // TOP_K. Tiles are loaded [BLOCK_K, BLOCK_{M,N}] with the feature dim last (coalesced);
    A enters the MMA transposed (a shared-memory view on Hopper, no shuffle).

    SORTED_TMA: the sorted operand(s) come through TMA descriptors. With one operand gathered, the sorted
    one's rows past `hi` belong to the next expert, but they meet the gathered operand's rows masked to
    zero, so they add nothing. With neither gathered (the caller copied the gathered one into sorted order
    first) nothing masks them: the loop covers whole BLOCK_K blocks through TMA only (WS: Triton's
    automatic warp specialisation, which needs descriptor loads), and the last partial block zeroes B's
    rows past `hi` in registers, once per program. Columns past M or N are TMA's zero fill.
    """
    offs_k = tl.arange(0, BLOCK_K)
    if SORTED_TMA and not A_GATHER and not B_GATHER:
        full_end = lo + (hi - lo) // BLOCK_K * BLOCK_K
        for k0 in tl.range(lo, full_end, BLOCK_K, warp_specialize=WS):
            b = b_src.load([k0, pid_n * BLOCK_N])
            acc = mma(tl.trans(a_src.load([k0, pid_m * BLOCK_M])), b, acc, INTERPRET)
            if DUAL:
                acc2 = mma(tl.trans(a2_src.load([k0, pid_m * BLOCK_M])), b, acc2, INTERPRET)
        if full_end < hi:
            row_ok = full_end + offs_k < hi
            b = tl.where(row_ok[:, None], b_src.load([full_end, pid_n * BLOCK_N]), 0.0)
            acc = mma(tl.trans(a_src.load([full_end, pid_m * BLOCK_M])), b, acc, INTERPRET)
            if DUAL:
                acc2 = mma(tl.trans(a2_src.load([full_end, pid_m * BLOCK_M])), b, acc2, INTERPRET)
    else:
        for k0 in range(lo, hi, BLOCK_K):
            rows = k0 + offs_k
            row_ok = rows < hi
            if A_GATHER or B_GATHER:
                tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
            if A_GATHER:
                rows_a = tok.to(tl.int64)
            else:
                rows_a = rows.to(tl.int64)
            if B_GATHER:
                rows_b = tok.to(tl.int64)
            else:
                rows_b = rows.to(tl.int64)
            if EVEN_M:
                mask_a = row_ok[:, None]
            else:
                mask_a = row_ok[:, None] & (offs_m < M)[None, :]
            if EVEN_N:
                mask_b = row_ok[:, None]
            else:
                mask_b = row_ok[:, None] & (offs_n < N)[None, :]
            a_off = rows_a[:, None] * stride_a + offs_m[None, :]
            if SORTED_TMA and not B_GATHER:
                b = b_src.load([k0, pid_n * BLOCK_N])
            else:
                b = tl.load(b_src + rows_b[:, None] * stride_b + offs_n[None, :], mask=mask_b, other=0.0)
            if SORTED_TMA and not A_GATHER:
                a = a_src.load([k0, pid_m * BLOCK_M])
            else:
                a = tl.load(a_src + a_off, mask=mask_a, other=0.0)
            acc = mma(tl.trans(a), b, acc, INTERPRET)
            if DUAL:
                if SORTED_TMA and not A_GATHER:
                    a2 = a2_src.load([k0, pid_m * BLOCK_M])
                else:
                    a2 = tl.load(a2_src + a_off, mask=mask_a, other=0.0)
                acc2 = mma(tl.trans(a2), b, acc2, INTERPRET)
    return acc, acc2


@triton.jit
def token_tile_mainloop(acc, acc2, a_src, a2_src, b_src, a_scale_ptr, a2_scale_ptr, b_scale_ptr, first_tile, num_tiles,
                        offs_m, offs_n, M, N, stride_a, stride_b, stride_sa, stride_sb, pid_m, pid_n,
                        DUAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, TMA: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += sum over token tiles first_tile <= t < first_tile + num_tiles of
    (A[offs_m, tile t] * sa_t) (B[offs_n, tile t] * sb_t)^T, acc2 likewise with A2 (DUAL), B shared.

    Operands in the token-tile layout (`quant.quantize_token_tiles`): e4m3 data [rows, P], tile t in
    columns [t BLOCK_K, (t + 1) BLOCK_K) (BLOCK_K = 128: one scale block), fp32 scales [rows, P / 128]
    (`*_scale_ptr`, row stride `stride_s*`), one per row and tile. Both tiles are loaded K-major
    ([BLOCK_M or BLOCK_N, BLOCK_K], tokens contiguous), as Hopper's FP8 MMA wants them, by pointer
    (rows past M / N masked to zero) or through TMA descriptors (`TMA`: rows past the edge zero-filled).
    Each tile's product goes into a fresh fp32 accumulator and is scaled into acc in fp32 (DeepSeek-V3's
    promotion: Hopper's FP8 MMA accumulates with reduced precision). The scales are powers of two, so
    scaling adds no rounding: acc is an fp32 sum of the dequantized operands' products, the emulation's
    GEMM up to summation order (and, on the GPU, up to the MMA's own sum within a tile). The scales of
    tile t+1 are loaded before tile t's MMA (the pipeliner leaves plain loads in the loop, where their
    latency stalls the promotion): 2-12% faster on an H200 at the fastest tiles (64 x 128, 64 x 256).
    """
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_off = offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    b_off = offs_n.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
    sa_off = offs_m * stride_sa
    sb_off = offs_n * stride_sb
    last = first_tile + num_tiles - 1
    t_next = tl.maximum(tl.minimum(first_tile, last), 0)  # a column in range even for an empty expert
    sa_next = tl.load(a_scale_ptr + t_next + sa_off, mask=m_ok, other=0.0)
    sb_next = tl.load(b_scale_ptr + t_next + sb_off, mask=n_ok, other=0.0)
    if DUAL:
        sa2_next = tl.load(a2_scale_ptr + t_next + sa_off, mask=m_ok, other=0.0)
    for t in range(first_tile, first_tile + num_tiles):
        col = t * BLOCK_K
        sa = sa_next
        sb = sb_next[None, :]
        t_next = tl.minimum(t + 1, last)
        sa_next = tl.load(a_scale_ptr + t_next + sa_off, mask=m_ok, other=0.0)
        sb_next = tl.load(b_scale_ptr + t_next + sb_off, mask=n_ok, other=0.0)
        if DUAL:
            sa2 = sa2_next
            sa2_next = tl.load(a2_scale_ptr + t_next + sa_off, mask=m_ok, other=0.0)
        if TMA:
            a = a_src.load([pid_m * BLOCK_M, col])
            b = b_src.load([pid_n * BLOCK_N, col])
        else:
            if EVEN_M:
                a = tl.load(a_src + a_off + col)
            else:
                a = tl.load(a_src + a_off + col, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_src + b_off + col)
            else:
                b = tl.load(b_src + b_off + col, mask=n_ok[:, None], other=0.0)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # (partial * sa) * sb: each step exact, and no product of two small scales that could underflow
        acc += mma(a, tl.trans(b), zero, INTERPRET) * sa[:, None] * sb
        if DUAL:
            if TMA:
                a2 = a2_src.load([pid_m * BLOCK_M, col])
            elif EVEN_M:
                a2 = tl.load(a2_src + a_off + col)
            else:
                a2 = tl.load(a2_src + a_off + col, mask=m_ok[:, None], other=0.0)
            acc2 += mma(a2, tl.trans(b), zero, INTERPRET) * sa2[:, None] * sb
    return acc, acc2
