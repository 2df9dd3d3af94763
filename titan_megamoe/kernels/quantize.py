"""Block FP8 quantization kernels: the three operand layouts of `titan_megamoe.quant`, bit for bit.

Each launcher writes e4m3 data and one power-of-two fp32 scale per block, with the scale policy and the
saturating round-to-nearest-even cast of `quant.py` (`common.e4m3_scale`, `common.to_e4m3`), so a
kernel's output is bitwise `quant`'s:

  quantize_rows(x_RC)              1x128 blocks along a row: a GEMM's row operand (x, dout, h, dg, du)
                                   = quant.quantize_activation(x_RC)
  quantize_weight_pair(w_ERC)      128x128 blocks of each expert's weight, as W [E, R, C] and W^T
                                   [E, C, R] from one read of w: GEMM1/GEMM2 use W, dgrad/dx use W^T
                                   = quant.quantize_weight(w), quant.quantize_weight(w^T)
  quantize_token_tiles(src, plan)  the weight-gradient operand: the plan's expert-sorted rows, stored
                                   transposed and tile-padded [C, num_tiles * 128], 1x128 blocks along
                                   the tokens (one block per tile and column)
                                   = quant.quantize_token_tiles(src[order // K], plan)
  quantize_sorted_rows(src, plan)  quantize_rows(src)'s rows in the plan's sorted order (+ the token tiles)

Every element of every output is written (the tiles past the real count too: zeros, scale 1), so no
output needs a fill first and the POISON checks hold. Sizes follow from the shapes and the plan's
layout: no launcher synchronises with the host.

Speed. These kernels move a few hundred MB per call and should run near HBM bandwidth, but quantizing
one element costs about 17 SASS instructions on sm_90 (most of them `to_e4m3`'s exact rounding), so
instruction issue binds about as much as memory: each choice below removes instructions or registers
(registers decide how many programs share an SM and hide each other's memory latency).
- Sorted rows are quantized once per token and scattered to its K sorted positions (plan.inv_N): a
  gather reads and quantizes each token row K times.
- A transposed e4m3 store goes through `common.transposed_row_pairs` (pairs of rows as 16-bit elements).
- Programs run column blocks first (`_row_major_program`).
- Each kernel has a few launch shapes (`*_CONFIGS`; the launchers use `DEFAULT_CONFIGS`):
  scripts/bench_quantize.py times them all on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..plan import RoutingPlan
from ..precision import BlockScaled
from ..validation import check_multiple_of
from .common import INTERPRET, e4m3_scale, new_output, to_e4m3, transposed_row_pairs

BLOCK = quant.ACTIVATION_BLOCK[1]  # 128: the side of every scale block here (activations, weights, token blocks)
_FLOAT_INPUTS = (torch.bfloat16, torch.float32)
_HINT = "; block FP8 needs D and H to be multiples of 128: pad them or use precision='bf16'"

# Launch shapes, by name: the kernel's block constexpr and launch options; scripts/bench_quantize.py times
# every entry, the launchers use DEFAULT_CONFIGS. Elements per thread set the trade-off: more of them share
# the per-block work (reductions, each block's scale: ~50 instructions) but need more registers, so fewer
# programs fit on an SM. maxnreg 128 keeps two 8-warp (four 4-warp) programs per SM where Triton 3.6
# would take a few registers more for no gain (compiled for sm_90: no spills at 128).
SORTED_ROWS_CONFIGS = {  # BLOCK_R tokens x 128 columns per program, written to K sorted rows each
    "r32w4": dict(BLOCK_R=32, num_warps=4),  # 32 elements per thread, ~64 registers
    "r64w4": dict(BLOCK_R=64, num_warps=4),  # 64 elements per thread
    "r64w8": dict(BLOCK_R=64, num_warps=8),  # 32 elements per thread, half the programs
}
TOKEN_TILE_CONFIGS = {  # one tile (128 sorted rows) x BLOCK_C columns per program
    "c64w2": dict(BLOCK_C=64, num_warps=2),  # 128 elements per thread: fewest instructions, ~250 registers
    "c128w4": dict(BLOCK_C=128, num_warps=4),  # 128 elements per thread, as many registers
    "c128w8": dict(BLOCK_C=128, num_warps=8, maxnreg=128),  # 64 elements per thread: ~1.4x the instructions
    "c64w4": dict(BLOCK_C=64, num_warps=4, maxnreg=128),  # 64 elements per thread, smaller programs
}
WEIGHT_PAIR_CONFIGS = {  # one 128x128 block per program
    "w4": dict(num_warps=4),  # 128 elements per thread: fewest instructions, ~240 registers
    "w8": dict(num_warps=8),  # 64 elements per thread: ~1.25x the instructions, ~128 registers
    "w16": dict(num_warps=16),  # 32 elements per thread, ~64 registers
}
DEFAULT_CONFIGS = {"sorted_rows": "r32w4", "token_tiles": "c64w2", "weight_pair": "w4"}


@triton.jit
def _fp32(x, INTERPRET: tl.constexpr):
    """x (bf16 or fp32) in fp32. The interpreter's bf16 -> fp32 conversion gets bf16 subnormals wrong
    (6.4e-40 comes out as 8.8e-39), so there the bf16 bits are widened by hand (exact, as on the GPU)."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _row_major_program(C, BLOCK_C: tl.constexpr):
    """(row block, column block) of this program, column blocks first: consecutive programs read
    consecutive pieces of the same source rows, so each row streams from DRAM in one go instead of one
    128-column piece per pass over all rows."""
    n_col_blocks = tl.cdiv(C, BLOCK_C)
    return tl.program_id(0) // n_col_blocks, tl.program_id(0) % n_col_blocks


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
# Rows: 1x128 blocks, in place or scattered into sorted order
# ------------------------------------------------------------------------------------------------


@triton.jit
def _store_row_blocks(data_ptr, scale_ptr, rows, ok, cols, col_block, q, scale, C, BLOCK_C: tl.constexpr):
    tl.store(data_ptr + rows[:, None] * C + cols[None, :], q, mask=ok[:, None])
    tl.store(scale_ptr + rows * (C // BLOCK_C) + col_block, scale, mask=ok)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, dest_ptr, data_ptr, scale_ptr,  # x [R, C] (strided); dest [R * COPIES] int32 (SCATTER);
    R, C, stride_r, stride_c,  # data [R or R * COPIES, C] e4m3; scale [R or R * COPIES, C / 128] fp32
    COPIES: tl.constexpr, SCATTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row_block, col_block = _row_major_program(C, BLOCK_C)
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < R
    rows = rows.to(tl.int64)
    x = _fp32(tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=ok[:, None], other=0.0),
              INTERPRET)
    scale, inv = e4m3_scale(tl.max(tl.abs(x), axis=1))
    q = to_e4m3(x, inv[:, None], INTERPRET, BF16_VALUED=x_ptr.dtype.element_ty == tl.bfloat16)
    if SCATTER:  # row r's copy k goes to output row dest[r * COPIES + k]
        for k in tl.static_range(COPIES):
            dest = tl.load(dest_ptr + rows * COPIES + k, mask=ok, other=0).to(tl.int64)
            _store_row_blocks(data_ptr, scale_ptr, dest, ok, cols, col_block, q, scale, C, BLOCK_C)
    else:
        _store_row_blocks(data_ptr, scale_ptr, rows, ok, cols, col_block, q, scale, C, BLOCK_C)


def _launch_rows(x_RC: torch.Tensor, dest: torch.Tensor | None, copies: int, config: dict) -> BlockScaled:
    """x's rows in 1x128 blocks: in place, or row r's copy k at output row dest[r * copies + k]."""
    R, C = x_RC.shape
    data = new_output((R * copies, C), quant.E4M3, x_RC.device)
    scale = new_output((R * copies, C // BLOCK), torch.float32, x_RC.device)
    if R and C:
        _quantize_rows_kernel[(triton.cdiv(R, config["BLOCK_R"]) * (C // BLOCK),)](
            x_RC, data if dest is None else dest, data, scale, R, C, x_RC.stride(0), x_RC.stride(1),
            COPIES=copies, SCATTER=dest is not None, BLOCK_C=BLOCK, INTERPRET=INTERPRET, **config,
        )
    return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)


_ROWS_CONFIG = dict(BLOCK_R=32, num_warps=4)


def quantize_rows(x_RC: torch.Tensor) -> BlockScaled:
    """x [R, C] (bf16 or fp32; C a multiple of 128, any R) in e4m3, one scale per 1x128 block of a
    row: data [R, C], scale [R, C / 128], block (1, 128); bitwise `quant.quantize_activation(x_RC)`.

    Why a kernel: a GEMM's row operand (x before GEMM1, dout before dgrad) is quantized once per step
    on the critical path; torch's version makes several full-size passes over x. One program quantizes 32 rows of one
    column block: each row's 128 values are its block, reduced in registers."""
    _check_input("quantize_rows", x_RC, (2,), "a 2-D operand [R, C]")
    check_multiple_of(f"quantize_rows: shape {tuple(x_RC.shape)} in (1, {BLOCK}) blocks",
                      {"C (columns)": x_RC.shape[1]}, BLOCK, _HINT)
    return _launch_rows(x_RC, None, 1, _ROWS_CONFIG)


# ------------------------------------------------------------------------------------------------
# Weights: 128x128 blocks, W and W^T in one pass (bf16)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_weight_pair_kernel(
    w_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr,  # w [E, R, C] (strided); data [E, R, C],
    R, C, stride_e, stride_r, stride_c,  # scale [E, R/128, C/128]; data_t [E, C, R], scale_t [E, C/128, R/128]
    WRITE_W: tl.constexpr, WRITE_WT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):
    col_block = tl.program_id(0)
    row_block = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    pair = tl.arange(0, BLOCK // 2)
    even = row_block * BLOCK + 2 * pair  # the block's even rows; the odd ones are a second tile (row pairs)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    w = w_ptr + expert * stride_e + cols[None, :] * stride_c
    w_even = _fp32(tl.load(w + even[:, None] * stride_r), INTERPRET)
    w_odd = _fp32(tl.load(w + (even + 1)[:, None] * stride_r), INTERPRET)
    amax = tl.maximum(tl.max(tl.max(tl.abs(w_even), axis=1), axis=0), tl.max(tl.max(tl.abs(w_odd), axis=1), axis=0))
    scale, inv = e4m3_scale(amax)
    q_even = to_e4m3(w_even, inv, INTERPRET)
    q_odd = to_e4m3(w_odd, inv, INTERPRET)
    base = expert * R * C  # both copies hold R * C elements per expert
    n_row_blocks = R // BLOCK
    n_col_blocks = C // BLOCK
    blocks = expert * n_row_blocks * n_col_blocks
    if WRITE_W:
        tl.store(data_ptr + base + even[:, None] * C + cols[None, :], q_even)
        tl.store(data_ptr + base + (even + 1)[:, None] * C + cols[None, :], q_odd)
        tl.store(scale_ptr + blocks + row_block * n_col_blocks + col_block, scale)
    if WRITE_WT:
        data_t_pairs = data_t_ptr.to(tl.pointer_type(tl.uint16)) + base // 2  # W^T's rows, two bytes at a time
        tl.store(data_t_pairs + cols[:, None] * (R // 2) + (row_block * (BLOCK // 2) + pair)[None, :],
                 transposed_row_pairs(q_even, q_odd))
        tl.store(scale_t_ptr + blocks + col_block * n_row_blocks + row_block, scale)


def _launch_weight_pair(w: torch.Tensor, config: dict) -> tuple[BlockScaled, BlockScaled]:
    E, R, C = w.shape
    device = w.device
    data = new_output((E, R, C), quant.E4M3, device)
    scale = new_output((E, R // BLOCK, C // BLOCK), torch.float32, device)
    data_t = new_output((E, C, R), quant.E4M3, device)
    scale_t = new_output((E, C // BLOCK, R // BLOCK), torch.float32, device)
    if E * R * C:
        passes = [(True, True)] if w.dtype == torch.bfloat16 else [(True, False), (False, True)]
        for write_w, write_wt in passes:
            _quantize_weight_pair_kernel[(C // BLOCK, R // BLOCK, E)](
                w, data, scale, data_t, scale_t, R, C, w.stride(0), w.stride(1), w.stride(2),
                WRITE_W=write_w, WRITE_WT=write_wt, BLOCK=BLOCK, INTERPRET=INTERPRET, **config,
            )
    return BlockScaled(data, scale, quant.WEIGHT_BLOCK), BlockScaled(data_t, scale_t, quant.WEIGHT_BLOCK)


def quantize_weight_pair(w_ERC: torch.Tensor) -> tuple[BlockScaled, BlockScaled]:
    """Each expert's weight [E, R, C] (or one weight [R, C]; R and C multiples of 128) in e4m3 with one
    scale per 128x128 block, as W and as W^T:
      W:   data [E, R, C], scale [E, R/128, C/128]   = quant.quantize_weight(w)
      W^T: data [E, C, R], scale [E, C/128, R/128]   = quant.quantize_weight(w.transpose(-2, -1))
    (2-D shapes for a 2-D weight), block (128, 128), bitwise.

    Why one pass: the forward GEMMs read W and the backward's dgrad/dx read W^T, K-major both (what the
    FP8 MMA wants); a transposed block has the same amax, hence the same scale and the same values
    transposed (quant.py), so each program loads its 128x128 block once, quantizes it once and writes
    both copies (W^T through `common.transposed_row_pairs`). Weights change once per optimizer step: this runs
    once per step, not per micro-batch.

    fp32 weights take two launches (W, then W^T): from an fp32 tile, Triton 3.6 on the H200 rounds about
    a third of W^T's elements wrongly when the same program also stores W (measured: W^T alone, both
    copies from a bf16 tile, or casting values already rounded to e4m3 all come out right)."""
    _check_input("quantize_weight_pair", w_ERC, (2, 3), "a weight [R, C] or one per expert [E, R, C]")
    two_d = w_ERC.dim() == 2
    w = w_ERC.unsqueeze(0) if two_d else w_ERC
    check_multiple_of(f"quantize_weight_pair: shape {tuple(w_ERC.shape)} in ({BLOCK}, {BLOCK}) blocks",
                      {"R (rows)": w.shape[1], "C (columns)": w.shape[2]}, BLOCK, _HINT)
    W, Wt = _launch_weight_pair(w, WEIGHT_PAIR_CONFIGS[DEFAULT_CONFIGS["weight_pair"]])
    if two_d:
        W, Wt = (BlockScaled(q.data[0], q.scale[0], q.block) for q in (W, Wt))
    return W, Wt


# ------------------------------------------------------------------------------------------------
# Token tiles: the weight-gradient operand, transposed, 1x128 blocks along the tokens
# ------------------------------------------------------------------------------------------------


@triton.jit
def _sorted_rows_fp32(src_ptr, order_ptr, rows, end, cols, col_ok, stride_r, stride_c,
                      ROWS_PER_TOKEN: tl.constexpr, GATHER: tl.constexpr, INTERPRET: tl.constexpr):
    """Sorted rows `rows` of the source (read by token through order when GATHER), zeros from row `end` on."""
    ok = rows < end
    if GATHER:  # a constexpr divisor: a shift for K = 8, where a runtime one costs ~20 instructions per row
        src = tl.load(order_ptr + rows, mask=ok, other=0) // ROWS_PER_TOKEN
    else:
        src = rows
    x = tl.load(src_ptr + src.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c,
                mask=ok[:, None] & col_ok[None, :], other=0.0)
    return _fp32(x, INTERPRET)


@triton.jit
def _quantize_token_tiles_kernel(
    src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    data_ptr, scale_ptr,  # data [C, num_tiles * 128] e4m3; scale [C, num_tiles] fp32
    C, num_tiles, stride_r, stride_c,
    ROWS_PER_TOKEN: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile, col_block = _row_major_program(C, BLOCK_C)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    # a spare tile (expert -1, first row 0) ends at 0: it has no rows and is written as zeros
    end = tl.where(expert >= 0, tl.load(offsets_ptr + tl.maximum(expert, 0) + 1), 0)
    pair = tl.arange(0, BLOCK_M // 2)
    even = row0 + 2 * pair  # the tile's even rows; the odd ones are a second tile (row pairs)
    x_even = _sorted_rows_fp32(src_ptr, order_ptr, even, end, cols, col_ok, stride_r, stride_c,
                               ROWS_PER_TOKEN, GATHER, INTERPRET)
    x_odd = _sorted_rows_fp32(src_ptr, order_ptr, even + 1, end, cols, col_ok, stride_r, stride_c,
                              ROWS_PER_TOKEN, GATHER, INTERPRET)
    # one block per column: the tile's rows
    scale, inv = e4m3_scale(tl.maximum(tl.max(tl.abs(x_even), axis=0), tl.max(tl.abs(x_odd), axis=0)))
    pairs = transposed_row_pairs(to_e4m3(x_even, inv[None, :], INTERPRET), to_e4m3(x_odd, inv[None, :], INTERPRET))
    cols = cols.to(tl.int64)
    P = num_tiles * BLOCK_M
    data_pairs = data_ptr.to(tl.pointer_type(tl.uint16))  # the output's rows, two bytes at a time
    tl.store(data_pairs + cols[:, None] * (P // 2) + tile * (BLOCK_M // 2) + pair[None, :], pairs, mask=col_ok[:, None])
    tl.store(scale_ptr + cols * num_tiles + tile, scale, mask=col_ok)


def _launch_token_tiles(src_RC: torch.Tensor, plan: RoutingPlan, K: int, sorted_rows: bool,
                        config: dict) -> BlockScaled:
    C = src_RC.shape[1]
    num_tiles = plan.layout.num_tiles
    bm = plan.layout.block_m
    data = new_output((C, num_tiles * bm), quant.E4M3, src_RC.device)
    scale = new_output((C, num_tiles), torch.float32, src_RC.device)
    if num_tiles and C:
        _quantize_token_tiles_kernel[(num_tiles * triton.cdiv(C, config["BLOCK_C"]),)](
            src_RC, plan.order_N, plan.tile_expert, plan.tile_row, plan.offsets_E1, data, scale,
            C, num_tiles, src_RC.stride(0), src_RC.stride(1),
            ROWS_PER_TOKEN=K, GATHER=not sorted_rows, BLOCK_M=bm, INTERPRET=INTERPRET, **config,
        )
    return BlockScaled(data, scale, quant.ACTIVATION_BLOCK)


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
    token dimension contiguous (K-major for the MMA). One program gathers one tile's 128 rows for a block
    of columns (masked: no copy of the sorted rows is made), takes each column's amax over the rows and
    writes the block transposed (`common.transposed_row_pairs`)."""
    K = _check_gathered("quantize_token_tiles", src_RC, plan, sorted_rows, tiles=True)
    return _launch_token_tiles(src_RC, plan, K, sorted_rows, TOKEN_TILE_CONFIGS[DEFAULT_CONFIGS["token_tiles"]])


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


def quantize_sorted_rows(src_RC: torch.Tensor, plan: RoutingPlan, with_tiles: bool = False):
    """The plan's expert-sorted rows of src (row p = src_RC[order[p] // rows_per_token]) quantized in 1x128
    row blocks, [N, C] (+ scale [N, C / 128]): bitwise quantize_rows(src_RC)'s rows gathered into sorted
    order. With `with_tiles` also `quantize_token_tiles(src_RC, plan)`: returns (rows, tiles). Why: a GEMM
    whose rows are contiguous in sorted order reads them through TMA, where a gathered FP8 tile costs 64
    address registers per thread (the gathering GEMM1 and dgrad spilled).

    Each source row is read and quantized once and its K copies scattered to their sorted positions
    (plan.inv_N[t * K + k]): a sorted row's blocks depend on its token's values only. The tiles take a
    second, gathering kernel: their blocks span the tile's tokens."""
    K = _check_gathered("quantize_sorted_rows", src_RC, plan, False, tiles=with_tiles)
    check_multiple_of(f"quantize_sorted_rows: shape {tuple(src_RC.shape)}", {"C (columns)": src_RC.shape[1]}, BLOCK,
                      _HINT)
    rows = _launch_rows(src_RC, plan.inv_N, K, SORTED_ROWS_CONFIGS[DEFAULT_CONFIGS["sorted_rows"]])
    if not with_tiles:
        return rows
    return rows, _launch_token_tiles(src_RC, plan, K, False, TOKEN_TILE_CONFIGS[DEFAULT_CONFIGS["token_tiles"]])
