"""Block FP8 quantization kernels: the three operand layouts of `titan_megamoe.quant`, bit for bit.

Each launcher writes e4m3 data and one power-of-two fp32 scale per block, with the scale policy and the
saturating round-to-nearest-even cast of `quant.py` (`common.e4m3_scale`, `common.to_e4m3`), so a
kernel's output is bitwise `quant`'s:

  quantize_rows(x_RC)              1x128 blocks along a row: a GEMM's row operand (x, dout, h, dg, du)
                                   = quant.quantize_activation(x_RC)
  quantize_weight_pair(w_ERC)      128x128 blocks of each expert's weight, as W [E, R, C] and W^T
                                   [E, C, R] from one read of w: GEMM1/GEMM2 use W, dgrad/dx use W^T
                                   = quant.quantize_weight(w), quant.quantize_weight(w^T)
                                   (quantize_weight_transposed(w_ERC): W^T alone)
  quantize_token_tiles(src, plan)  the weight-gradient operand: the plan's expert-sorted rows, stored
                                   transposed and tile-padded [C, num_tiles * 128], 1x128 blocks along
                                   the tokens (one block per tile and column)
                                   = quant.quantize_token_tiles(src[order // K], plan)

Every element of every output is written (the tiles past the real count too: zeros, scale 1), so no
output needs a fill first and the POISON checks hold. Sizes follow from the shapes and the plan's
layout: no launcher synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..plan import RoutingPlan
from ..precision import BlockScaled
from ..validation import check_multiple_of
from .common import INTERPRET, cdiv, e4m3_scale, new_output, to_e4m3
from .launch import launch

BLOCK = quant.ACTIVATION_BLOCK[1]  # 128: the side of every scale block here (activations, weights, token blocks)
_FLOAT_INPUTS = (torch.bfloat16, torch.float32)
_HINT = "; block FP8 needs D and H to be multiples of 128: pad them or use precision='bf16'"


@triton.jit
def _fp32(x, INTERPRET: tl.constexpr):
    """x (bf16 or fp32) in fp32. The interpreter's bf16 -> fp32 conversion gets bf16 subnormals wrong
    (6.4e-40 comes out as 8.8e-39), so there the bf16 bits are widened by hand (exact, as on the GPU)."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def _check_input(where: str, t: torch.Tensor, ndims: tuple[int, ...], shape: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() not in ndims:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{where}: expected {shape}, got {got}")
    if t.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported; expected one of "
                        f"{', '.join(map(str, _FLOAT_INPUTS))}")
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"{where}: the Triton kernels run on CUDA (or with TRITON_INTERPRET=1); the tensor is on "
                         f"{t.device}. On CPU use titan_megamoe.quant")


# ------------------------------------------------------------------------------------------------
# Rows: 1x128 blocks
# ------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(
    x_ptr, data_ptr, scale_ptr,  # x [R, C] (strided); data [R, C] e4m3; scale [R, C / 128] fp32
    R, C, stride_r, stride_c,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < R
    rows = rows.to(tl.int64)
    x = _fp32(tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=ok[:, None], other=0.0),
              INTERPRET)
    scale, inv = e4m3_scale(tl.max(tl.abs(x), axis=1))
    tl.store(data_ptr + rows[:, None] * C + cols[None, :], to_e4m3(x, inv[:, None], INTERPRET), mask=ok[:, None])
    tl.store(scale_ptr + rows * (C // BLOCK_C) + col_block, scale, mask=ok)


_ROWS_PER_PROGRAM = 32


def quantize_rows(x_RC: torch.Tensor) -> BlockScaled:
    """x [R, C] (bf16 or fp32; C a multiple of 128, any R) in e4m3, one scale per 1x128 block of a
    row: data [R, C], scale [R, C / 128], block (1, 128); bitwise `quant.quantize_activation(x_RC)`.

    Why a kernel: a GEMM's row operand (x before GEMM1, dout before dgrad) is quantized once per step
    on the critical path; torch's version makes several full-size passes over x. One program quantizes 32 rows of one
    column block: each row's 128 values are its block, reduced in registers."""
    _check_input("quantize_rows", x_RC, (2,), "a 2-D operand [R, C]")
    R, C = x_RC.shape
    check_multiple_of(f"quantize_rows: shape {tuple(x_RC.shape)} in (1, {BLOCK}) blocks", {"C (columns)": C}, BLOCK,
                      _HINT)
    data = new_output((R, C), quant.E4M3, x_RC.device)
    scale = new_output((R, C // BLOCK), torch.float32, x_RC.device)
    if R == 0 or C == 0:
        return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)
    launch(
        _quantize_rows_kernel, (cdiv(R, _ROWS_PER_PROGRAM), C // BLOCK),
        x_RC, data, scale, R, C, x_RC.stride(0), x_RC.stride(1),
        BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_C=BLOCK, INTERPRET=INTERPRET, num_warps=4,
    )
    return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)


# ------------------------------------------------------------------------------------------------
# Weights: 128x128 blocks, W and W^T in one pass (bf16)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_weight_pair_kernel(
    w_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr,  # w [E, R, C] (strided); data [E, R, C],
    R, C, stride_e, stride_r, stride_c,  # scale [E, R/128, C/128]; data_t [E, C, R], scale_t [E, C/128, R/128]
    WRITE_W: tl.constexpr, WRITE_WT: tl.constexpr, BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row_block = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    rows = row_block * BLOCK + tl.arange(0, BLOCK)
    base = expert * R * C  # both copies hold R * C elements per expert
    n_row_blocks = R // BLOCK
    n_col_blocks = C // BLOCK
    blocks = expert * n_row_blocks * n_col_blocks
    # COL_BLOCKS blocks of one block row in turn: the next block's load overlaps this one's stores
    for col_block in tl.range(tl.program_id(0) * COL_BLOCKS, (tl.program_id(0) + 1) * COL_BLOCKS):
        cols = col_block * BLOCK + tl.arange(0, BLOCK)
        w = _fp32(tl.load(w_ptr + expert * stride_e + rows[:, None] * stride_r + cols[None, :] * stride_c),
                  INTERPRET)
        scale, inv = e4m3_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
        q = to_e4m3(w, inv, INTERPRET)
        if WRITE_W:
            tl.store(data_ptr + base + rows[:, None] * C + cols[None, :], q)
            tl.store(scale_ptr + blocks + row_block * n_col_blocks + col_block, scale)
        if WRITE_WT:
            tl.store(data_t_ptr + base + cols[:, None] * R + rows[None, :], tl.trans(q))
            tl.store(scale_t_ptr + blocks + col_block * n_row_blocks + row_block, scale)


# Launch shape of the weight quantizer per input dtype: (warps, 128x128 blocks per program along C; the
# largest power of two up to it that divides C / 128 is used). Timed on the H200 at the Qwen3-30B-A3B,
# 235B-A22B and Mixtral expert shapes (`bench_row_kernels.py --sections weight_quant`,
# results/bench_row_kernels_20261205T042256.json; every variant bitwise quant.quantize_weight first):
# bf16 30B w1 540 us at (8, 1) -> 462 us at (8, 4); fp32 (two passes, W then W^T) 700 -> 543 us at (4, 2).
# bf16 at (4, 2) spills and runs at 118 GB/s: the knob is per dtype for that reason.
_WEIGHT_LAUNCH = {torch.bfloat16: (8, 4), torch.float32: (4, 2)}


# On a GPU the Gluon kernel runs in its place (`quantize_gluon.weight_pair`: fp32 weights in one pass too):
# (warps, exact cast) per input dtype; a dtype not listed runs the Triton kernel. On the H100 (2026-12-05,
# docs/results/gluon_20261205_h100_r2/, `bench_row_kernels.py --sections weight_quant --quick`, outputs bitwise
# quant.py's at the five expert shapes): bf16 30B-A3B w1 474 -> 276 us, 235B-A22B w1 1855 -> 1085 us; fp32
# 672 -> 407 and 2619 -> 1603 us (exact cast, 4 warps: faster for fp32 than the hardware cast's 460 us at 8).
# Triton's interpreter cannot run Gluon: there the Triton kernel runs.
_WEIGHT_GLUON: dict[torch.dtype, tuple[int, bool]] = {torch.bfloat16: (8, False), torch.float32: (4, True)}


def _weight_launch(dtype: torch.dtype, n_col_blocks: int) -> tuple[int, int]:
    warps, cb = _WEIGHT_LAUNCH[dtype]
    while n_col_blocks % cb:
        cb //= 2
    return warps, max(cb, 1)


def quantize_weight_pair(w_ERC: torch.Tensor) -> tuple[BlockScaled, BlockScaled]:
    """Each expert's weight [E, R, C] (or one weight [R, C]; R and C multiples of 128) in e4m3 with one
    scale per 128x128 block, as W and as W^T:
      W:   data [E, R, C], scale [E, R/128, C/128]   = quant.quantize_weight(w)
      W^T: data [E, C, R], scale [E, C/128, R/128]   = quant.quantize_weight(w.transpose(-2, -1))
    (2-D shapes for a 2-D weight), block (128, 128), bitwise.

    Why one pass: the forward GEMMs read W and the backward's dgrad/dx read W^T, K-major both (what the
    FP8 MMA wants); a transposed block has the same amax, hence the same scale and the same values
    transposed (quant.py), so each program loads its 128x128 block once and writes both copies.

    fp32 weights take two launches (W, then W^T): from an fp32 tile, Triton 3.6 on the H200 rounds about
    a third of W^T's elements wrongly when the same program also stores W (measured: W^T alone, both
    copies from a bf16 tile, or casting values already rounded to e4m3 all come out right)."""
    return _quantize_weight("quantize_weight_pair", w_ERC, want_w=True)


def quantize_weight_transposed(w_ERC: torch.Tensor) -> BlockScaled:
    """W^T alone, as `quantize_weight_pair` makes it (for the `fp8_bwd` backward: its forward ran bf16)."""
    return _quantize_weight("quantize_weight_transposed", w_ERC, want_w=False)[1]


def _quantize_weight(where: str, w_ERC: torch.Tensor, want_w: bool):
    _check_input(where, w_ERC, (2, 3), "a weight [R, C] or one per expert [E, R, C]")
    two_d = w_ERC.dim() == 2
    w = w_ERC.unsqueeze(0) if two_d else w_ERC
    E, R, C = w.shape
    check_multiple_of(f"{where}: shape {tuple(w_ERC.shape)} in ({BLOCK}, {BLOCK}) blocks",
                      {"R (rows)": R, "C (columns)": C}, BLOCK, _HINT)
    device = w.device
    data_t = new_output((E, C, R), quant.E4M3, device)
    scale_t = new_output((E, C // BLOCK, R // BLOCK), torch.float32, device)
    data, scale = ((new_output((E, R, C), quant.E4M3, device), new_output((E, R // BLOCK, C // BLOCK), torch.float32,
                                                                          device))
                   if want_w else (data_t, scale_t))  # not written when W is not wanted
    if E * R * C and w.dtype in _WEIGHT_GLUON and not INTERPRET:
        from . import quantize_gluon  # imported only where it runs: Gluon compiles for GPUs only

        quantize_gluon.weight_pair(w, data, scale, data_t, scale_t, want_w, *_WEIGHT_GLUON[w.dtype])
    elif E * R * C:
        passes = [(want_w, True)] if w.dtype == torch.bfloat16 or not want_w else [(True, False), (False, True)]
        for write_w, write_wt in passes:
            warps, cb = _weight_launch(w.dtype, C // BLOCK)
            launch(
                _quantize_weight_pair_kernel, (C // BLOCK // cb, R // BLOCK, E),
                w, data, scale, data_t, scale_t, R, C, w.stride(0), w.stride(1), w.stride(2),
                WRITE_W=write_w, WRITE_WT=write_wt, BLOCK=BLOCK, COL_BLOCKS=cb, INTERPRET=INTERPRET,
                num_warps=warps,
            )
    if two_d:
        data, scale, data_t, scale_t = data[0], scale[0], data_t[0], scale_t[0]
    wt = BlockScaled(data_t, scale_t, quant.WEIGHT_BLOCK)
    return (BlockScaled(data, scale, quant.WEIGHT_BLOCK) if want_w else None), wt


# ------------------------------------------------------------------------------------------------
# Token tiles: the weight-gradient operand, transposed, 1x128 blocks along the tokens
# ------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_token_tiles_kernel(
    src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    data_ptr, scale_ptr,  # data [C, num_tiles * 128] e4m3; scale [C, num_tiles] fp32
    C, num_tiles, rows_per_token, stride_r, stride_c,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, COL_BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    # a spare tile (expert -1, first row 0) ends at 0: it has no rows and is written as zeros
    end = tl.where(expert >= 0, tl.load(offsets_ptr + tl.maximum(expert, 0) + 1), 0)
    i = tl.arange(0, BLOCK_M)
    rows = row0 + i  # sorted rows of this tile; the ones past the expert's end are zeros
    row_ok = rows < end
    if GATHER:
        src = tl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token
    else:
        src = rows
    src = src.to(tl.int64)
    for col_block in tl.range(tl.program_id(1) * COL_BLOCKS, (tl.program_id(1) + 1) * COL_BLOCKS):
        cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        x = _fp32(tl.load(src_ptr + src[:, None] * stride_r + cols[None, :] * stride_c,
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0), INTERPRET)  # [BLOCK_M, BLOCK_C]
        scale, inv = e4m3_scale(tl.max(tl.abs(x), axis=0))  # one block per column: the tile's rows
        q = to_e4m3(x, inv[None, :], INTERPRET)
        cols = cols.to(tl.int64)
        P = num_tiles * BLOCK_M
        tl.store(data_ptr + cols[:, None] * P + tile * BLOCK_M + i[None, :], tl.trans(q), mask=col_ok[:, None])
        tl.store(scale_ptr + cols * num_tiles + tile, scale, mask=col_ok)


_TOKEN_TILE_COLS = 128
# One-warpgroup programs doing two column blocks in turn (the second block's loads overlap the first's
# transposed store). H200, 30B-A3B shape (T=16384, K=8, D=2048), bitwise the same outputs: 0.886 ms (8 warps,
# 1 block) -> 0.484; docs/results/quantize_20261204/qvar_h200.json.
_TOKEN_TILE_WARPS = 4
# On a GPU the Gluon kernel runs in its place (`quantize_gluon.token_tiles`: each element cast once in its load
# layout, the token tiles stored through a layout change of the e4m3 tile): (warps, exact cast), or None for the
# Triton kernel. On the H100 (2026-12-05, docs/results/gluon_20261205_h100/, `bench_row_kernels.py --sections
# token_tiles`, outputs bitwise the Triton kernel's): 30B-A3B x's tiles 490 -> 360 us, 235B-A22B 965 -> 708.
# Triton's interpreter cannot run Gluon: there the Triton kernel runs (the CPU tests hold it to quant.py; the
# GPU tests hold the Gluon kernel to quant.py).
# dout's sorted rows and tiles were one pass of these kernels until 2026-12-06 (`with_tiles`, removed): its
# rows as x's are made (`quantize_sorted_rows`) and then its tiles here measured faster, 548 against 625 us
# (30B-A3B) and 1093 against 1304 us (235B-A22B) on an H100 (docs/results/bench_row_kernels_20261206T063144.json)
_TOKEN_TILE_GLUON: tuple[int, bool] | None = (4, False)


def quantize_token_tiles(src_RC: torch.Tensor, plan: RoutingPlan, sorted_rows: bool = False) -> BlockScaled:
    """A weight-gradient operand in the layout of `quant.quantize_token_tiles`: the plan's expert-sorted
    rows [N, C], transposed and tile-padded to data [C, P] (P = plan.layout.num_tiles * 128; tile t owns
    columns [128 t, 128 t + 128): its rows, then zeros past its expert's end, all zeros for a tile past
    the real count), scale [C, P / 128] (1 for an all-zero block), block (1, 128).

    Sorted row p reads src_RC[plan.order_N[p] // plan.rows_per_token] (token rows like x or dout, or
    the rows an EP dispatcher received), or src_RC[p] with `sorted_rows` (rows a kernel stored in
    sorted order: h, dg, du); bitwise quant.quantize_token_tiles(those rows, plan).

    Why this layout: a weight-gradient GEMM reduces over each expert's tokens, so its FP8 operands need
    scales along the tokens (a block restarting at each expert's first row, the plan's tiles) and the
    token dimension contiguous (K-major for the MMA). One program gathers one tile's 128 rows for 128
    columns (masked: no copy of the sorted rows is made), takes each column's amax over the rows and
    writes the block transposed."""
    K = _check_gathered("quantize_token_tiles", src_RC, plan, sorted_rows, tiles=True)
    return _token_tiles(src_RC, plan, K, sorted_rows)


def _check_gathered(where: str, src_RC, plan: RoutingPlan, sorted_rows: bool, tiles: bool) -> int:
    """The checks both gathering quantizers share; returns the source rows per plan row's token (K)."""
    _check_input(where, src_RC, (2,), "2-D rows [R, C]")
    bm = plan.layout.block_m
    if tiles and bm != quant.TOKEN_BLOCK[0]:
        raise ValueError(f"{where}: the plan's tiles must be {quant.TOKEN_BLOCK[0]} rows (one token block), got "
                         f"block_m={bm}; build the plan with block_m={quant.TOKEN_BLOCK[0]}")
    K = 1 if sorted_rows else plan.rows_per_token
    N = plan.num_rows
    if src_RC.shape[0] * K != N:
        expected = f"N = {N} sorted rows" if sorted_rows else f"N / rows_per_token = {N} / {K} rows"
        raise ValueError(f"{where}: src_RC has {src_RC.shape[0]} rows but the plan needs {expected}")
    if plan.packed.device != src_RC.device:
        raise ValueError(f"{where}: the plan is on {plan.packed.device} but src_RC on {src_RC.device}")
    return K


def _token_tiles(src_RC, plan: RoutingPlan, K: int, sorted_rows: bool) -> BlockScaled:
    C = src_RC.shape[1]
    num_tiles = plan.layout.num_tiles
    bm = plan.layout.block_m
    dev = src_RC.device
    data = new_output((C, num_tiles * bm), quant.E4M3, dev)
    scale = new_output((C, num_tiles), torch.float32, dev)
    gluon = None if INTERPRET else _TOKEN_TILE_GLUON
    if num_tiles and C and gluon is not None:
        from . import quantize_gluon  # imported only where it runs: Gluon compiles for GPUs only

        quantize_gluon.token_tiles(src_RC, plan, K, not sorted_rows, data, scale, *gluon)
    elif num_tiles and C:
        col_blocks = cdiv(C, _TOKEN_TILE_COLS)
        per_program = 2 if col_blocks % 2 == 0 else 1
        launch(
            _quantize_token_tiles_kernel, (num_tiles, col_blocks // per_program),
            src_RC, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1,
            data, scale, C, num_tiles, K, src_RC.stride(0), src_RC.stride(1),
            GATHER=not sorted_rows, BLOCK_M=bm, BLOCK_C=_TOKEN_TILE_COLS, COL_BLOCKS=per_program,
            INTERPRET=INTERPRET, num_warps=_TOKEN_TILE_WARPS,
        )
    return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)


def quantize_sorted_rows(src_RC: torch.Tensor, plan: RoutingPlan) -> BlockScaled:
    """The plan's expert-sorted rows of src (row p = src_RC[order[p] // rows_per_token]) quantized in 1x128
    row blocks, [N, C] (+ scale [N, C / 128]): bitwise quantize_rows(src_RC)'s rows gathered into sorted
    order. Why: a GEMM whose rows are contiguous in sorted order reads them through TMA, where a gathered
    FP8 tile costs 64 address registers per thread (the gathering GEMM1 and dgrad spilled). Each token is
    quantized once (`quantize_rows`) and its e4m3 row copied into every sorted row it feeds (`_gather_rows`)."""
    K = _check_gathered("quantize_sorted_rows", src_RC, plan, False, tiles=False)
    check_multiple_of(f"quantize_sorted_rows: shape {tuple(src_RC.shape)}", {"C (columns)": src_RC.shape[1]}, BLOCK,
                      _HINT)
    return _gather_rows(quantize_rows(src_RC), plan, K)


@triton.jit
def _gather_rows_kernel(q_ptr, q_scale_ptr, order_ptr, data_ptr, scale_ptr, N, C, rows_per_token,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """Sorted rows [BLOCK_R] x columns [BLOCK_C] of the token-order e4m3 rows (and their scales) copied
    into sorted order: row p = token order[p] // rows_per_token."""
    p = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = p < N
    src = (tl.load(order_ptr + p, mask=ok, other=0) // rows_per_token).to(tl.int64)
    dst = p.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(data_ptr + dst[:, None] * C + cols[None, :], tl.load(q_ptr + src[:, None] * C + cols[None, :],
                                                                  mask=ok[:, None]), mask=ok[:, None])
    n_blocks = C // SCALE_BLOCK
    blocks = tl.program_id(1) * (BLOCK_C // SCALE_BLOCK) + tl.arange(0, BLOCK_C // SCALE_BLOCK)
    tl.store(scale_ptr + dst[:, None] * n_blocks + blocks[None, :],
             tl.load(q_scale_ptr + src[:, None] * n_blocks + blocks[None, :], mask=ok[:, None]), mask=ok[:, None])


# H200, 30B-A3B (T=16384, K=8, D=2048): quantize_rows 0.040 ms + this gather 0.145 ms, against 0.365 ms
# for quantizing the gathered bf16 rows (each token's row read K times; its e4m3 copy, half the bytes, is
# what the gather reads: 33.5 MB, held in the 50 MB L2). docs/results/quantize_20261204/qvar_h200.json.
_GATHER_ROWS, _GATHER_COLS, _GATHER_WARPS = 32, 1024, 8


def _gather_rows(q: BlockScaled, plan: RoutingPlan, K: int) -> BlockScaled:
    """quantize_rows' output for the token rows, in the plan's sorted order (bitwise the same values)."""
    N, C = plan.num_rows, q.data.shape[1]
    data = new_output((N, C), quant.E4M3, q.data.device)
    scale = new_output((N, C // BLOCK), torch.float32, q.data.device)
    if N and C:
        block_c = next(b for b in (_GATHER_COLS, 512, 256, BLOCK) if C % b == 0)
        launch(
            _gather_rows_kernel, (cdiv(N, _GATHER_ROWS), C // block_c),
            q.data, q.scale, plan.order_N, data, scale, N, C, K, BLOCK_R=_GATHER_ROWS, BLOCK_C=block_c,
            SCALE_BLOCK=BLOCK, num_warps=_GATHER_WARPS,
        )
    return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)
