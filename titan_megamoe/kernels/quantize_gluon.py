"""Block-FP8 quantizers in Gluon, the GPU defaults in place of `quantize`'s Triton kernels (Triton's
interpreter cannot run Gluon: there the Triton kernels run; both are held to quant.py bit for bit):
- `weight_pair`: W and W^T from one read of each 128x128 block, fp32 weights in one pass too
  (`quantize._WEIGHT_GLUON`; on an H100 1.71x the Triton kernel for bf16 weights, 1.65x for fp32);
- `token_tiles`: the token tiles (`quantize._TOKEN_TILE_GLUON`; 1.36x);
- `store_token_tile_e4m3` (the token tiles and `dswiglu_fp8_gluon`) and `store_rows_e4m3` (`dswiglu_fp8_gluon`): shared stores.

Why: the Triton kernels run at ~1.7 TB/s. The sm_90 compile of the weight kernel shows Triton moving the
input tile through shared memory into the transposed layout and quantizing it there again, and fp32
weights take two passes (a Triton 3.6 miscompile when one program stores both copies from an fp32 tile).
Here the layouts are explicit: 16-byte loads along the rows, the quantization in that layout, the row copy
stored from it, and the transposed copy stored from a layout in which each thread holds 16 consecutive
rows of one column (16-byte stores along its rows). The token tiles move their e4m3 bytes into that
layout (1 byte an element); the weight's W^T moves the input tile and quantizes it again, because moving
the e4m3 tile that was also stored as W wrote wrong bytes on the H100 (docs/kernels.md, "More Gluon").

The scales and casts are quant.py's (`common.e4m3_scale`, `common.to_e4m3`): `EXACT_CAST` rounds in fp32
first, as the Triton kernels do to avoid the miscompile; without it the hardware's saturating
round-to-nearest-even cast does the rounding (fewer instructions). The GPU benchmark
(`bench_row_kernels.py --sections weight_quant token_tiles`) checks each launch bitwise before timing it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .common import E4M3_MAX, e4m3_scale, multiprocessors, to_e4m3
from .fp8_rows_gluon import _cp_async
from .launch import launch

BLOCK = 128  # the weight scale block, both dimensions (host code)


@gluon.jit
def _e4m3(x, inv_scale, EXACT_CAST: gl.constexpr):
    """x * inv_scale in e4m3, saturating: rounded in fp32 first (`common.to_e4m3`) or by the hardware cast."""
    if EXACT_CAST:
        return to_e4m3(x, inv_scale, False)
    return gl.minimum(gl.maximum(x * inv_scale, -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)


@gluon.jit
def store_rows_e4m3(data_ptr, scale_ptr, x, rows, row_ok, cols, col_ok, C, col_block, EXACT_CAST: gl.constexpr):
    """x [rows, 128 columns] (fp32 or bf16, any layout) quantized along each row, one 1x128 block: data
    [N, C] e4m3 at `rows`, scale [N, C / 128] at column `col_block`. bf16 is converted to fp32 here, where it
    is used, so that a caller holding several tiles keeps them at 2 bytes an element."""
    row_scale, row_inv = e4m3_scale(gl.max(gl.abs(x), axis=1).to(gl.float32))
    gl.store(data_ptr + rows.to(gl.int64)[:, None] * C + cols[None, :],
             _e4m3(x.to(gl.float32), row_inv[:, None], EXACT_CAST),
             mask=row_ok[:, None] & col_ok[None, :])
    gl.store(scale_ptr + rows.to(gl.int64) * (C // 128) + col_block, row_scale, mask=row_ok)


@gluon.jit
def store_token_tile_e4m3(data_ptr, scale_ptr, x, tile, col0, C, P, EXACT_CAST: gl.constexpr,
                          num_warps: gl.constexpr):
    """x [128 rows of plan tile `tile`, 128 columns from col0] (fp32 or bf16, as `store_rows_e4m3`; rows past
    the expert's end zero)
    quantized along each column, one block over the tile's rows, into the token-tile layout
    (`quant.quantize_token_tiles`): data [C, P] e4m3 at columns 128 * tile + row, scale [C, P / 128] at
    [c, tile]. The e4m3 tile (1 byte an element) changes layout through shared memory so that each thread
    stores 16 consecutive rows of one column: 16 bytes along a row of data."""
    st_t: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, num_warps], [0, 1])
    scale, inv = e4m3_scale(gl.max(gl.abs(x), axis=0).to(gl.float32))
    q_t = gl.convert_layout(_e4m3(x.to(gl.float32), inv[None, :], EXACT_CAST), st_t)
    i_t = gl.arange(0, 128, layout=gl.SliceLayout(1, st_t))
    cols_t = (col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_t))).to(gl.int64)
    gl.store(data_ptr + cols_t[None, :] * P + tile * 128 + i_t[:, None], q_t, mask=(cols_t < C)[None, :])
    cols = (col0 + gl.arange(0, 128, layout=scale.type.layout)).to(gl.int64)
    gl.store(scale_ptr + cols * (P // 128) + tile, scale, mask=cols < C)


@gluon.jit
def real_items(tile_expert_ptr, num_tiles, num_n, num_warps: gl.constexpr):
    """The work items of the real tiles (`schedule.real_tile_count` * num_n): the tiles with an expert are a
    prefix of the plan's schedule, counted on the device so that no program walks the spare tail."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    count = 0
    for start in range(0, num_tiles, 4096):
        offs = start + gl.arange(0, 4096, layout=layout)
        count += gl.sum((gl.load(tile_expert_ptr + offs, mask=offs < num_tiles, other=-1) >= 0).to(gl.int32), axis=0)
    return count * num_n


@gluon.jit
def item_tile(item, items, num_n, tile_expert_ptr, tile_row_ptr):
    """(first row, expert) of work item `item`'s plan tile, clamped into range: the items past a program's
    last one read the last item's and are never run."""
    tile = gl.maximum(gl.minimum(item, items - 1), 0) // num_n
    return gl.load(tile_row_ptr + tile), gl.load(tile_expert_ptr + tile)


@gluon.jit
def _weight_pair_kernel(w_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, R, C, stride_e, stride_r, stride_c,
                        WRITE_W: gl.constexpr, EXACT_CAST: gl.constexpr, num_warps: gl.constexpr):
    # w [E, R, C] (strided); data [E, R, C], scale [E, R/128, C/128]; data_t [E, C, R], scale_t [E, C/128, R/128]
    # load: 8 consecutive columns per thread (16 B of bf16), a warp covers 2 rows x 128 columns
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    # transposed store: 16 consecutive rows of one column per thread (16 B of e4m3 along a row of W^T)
    st_t: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, num_warps], [0, 1])
    col_block = gl.program_id(0)
    row_block = gl.program_id(1)
    expert = gl.program_id(2).to(gl.int64)
    rows = row_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    cols = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    w_in = gl.load(w_ptr + expert * stride_e + rows[:, None] * stride_r + cols[None, :] * stride_c)
    w = w_in.to(gl.float32)
    scale, inv = e4m3_scale(gl.max(gl.max(gl.abs(w), axis=1), axis=0))
    q = _e4m3(w, inv, EXACT_CAST)
    base = expert * R * C  # both copies hold R * C elements per expert
    n_row_blocks = R // 128
    n_col_blocks = C // 128
    blocks = expert * n_row_blocks * n_col_blocks
    if WRITE_W:
        gl.store(data_ptr + base + rows[:, None] * C + cols[None, :], q)
        gl.store(scale_ptr + blocks + row_block * n_col_blocks + col_block, scale)
    # W^T from the *input* tile moved into the store layout and quantized again there (same scale, same
    # values). Moving the e4m3 tile instead (1 byte an element, as the token-tile kernel does) wrote wrong W^T
    # bytes on the H100 whenever the program also stored that tile as W, as fp8 or as uint8 bytes alike
    # (docs/kernels.md, "More Gluon")
    q_t = _e4m3(gl.convert_layout(w_in, st_t).to(gl.float32), inv, EXACT_CAST)
    rows_t = row_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, st_t))
    cols_t = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, st_t))
    gl.store(data_t_ptr + base + cols_t[None, :] * R + rows_t[:, None], q_t)
    gl.store(scale_t_ptr + blocks + col_block * n_row_blocks + row_block, scale)


@gluon.jit
def _token_tiles_kernel(src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, data_ptr, scale_ptr, C,
                        num_tiles, rows_per_token, stride_r, stride_c, GATHER: gl.constexpr, EXACT_CAST: gl.constexpr,
                        num_warps: gl.constexpr):
    # one plan tile (128 sorted rows of one expert) x 128 columns: data [C, num_tiles * 128] e4m3 and scale
    # [C, num_tiles], one block per column over the tile's rows, stored transposed
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    tile = gl.program_id(0)
    col_block = gl.program_id(1)
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row_ptr + tile)
    # a spare tile (expert -1, first row 0) ends at 0: it has no rows and is written as zeros
    end = gl.where(expert >= 0, gl.load(offsets_ptr + gl.maximum(expert, 0) + 1), 0)
    rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    row_ok = rows < end
    if GATHER:
        src = gl.load(order_ptr + rows, mask=row_ok, other=0) // rows_per_token
    else:
        src = rows
    cols = col_block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    col_ok = cols < C
    x = gl.load(src_ptr + src.to(gl.int64)[:, None] * stride_r + cols[None, :] * stride_c,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(gl.float32)
    store_token_tile_e4m3(data_ptr, scale_ptr, x, tile, col_block * 128, C, num_tiles * 128, EXACT_CAST, num_warps)


@gluon.jit
def _tile_sources(row0, expert, N, order_ptr, offsets_ptr, rows_per_token, GATHER: gl.constexpr, ld: gl.constexpr):
    """(source row of each of the 128 rows from row0, the expert's end row; 0 for a spare tile): the two
    loads are independent (order's masked by N, not by the end), so both are in flight at once."""
    rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    end = gl.where(expert >= 0, gl.load(offsets_ptr + gl.maximum(expert, 0) + 1), 0)
    if GATHER:
        src = gl.load(order_ptr + rows, mask=rows < N, other=0) // rows_per_token
    else:
        src = rows
    return src, end


@gluon.jit
def _copy_tile(src_ptr, src, row0, end, col0, C, stride_r, smem, ld: gl.constexpr):
    """Asynchronous copies (cp.async, 16 bytes each) of one item's 128 source rows x 128 columns into `smem`,
    in `ld`: each thread later reads back exactly what it copied."""
    rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    _cp_async(smem, src_ptr + src.to(gl.int64)[:, None] * stride_r + cols[None, :],
              mask=(rows < end)[:, None] & (cols < C)[None, :])


@gluon.jit
def _token_tiles_persistent_kernel(src_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, data_ptr,
                                   scale_ptr, C, N, num_tiles, rows_per_token, stride_r, GATHER: gl.constexpr,
                                   EXACT_CAST: gl.constexpr, num_warps: gl.constexpr):
    # `_token_tiles_kernel`'s items (plan tile x 128 columns, spare tiles too: written as zeros, scale 1),
    # walked by resident programs: item i + 1's source rows are copied into shared memory (two stages) while
    # item i is quantized and stored, and the indices those copies need are loaded before: the first row
    # and expert of item i + 3, the sources and end of item i + 2. One program per item waited for that chain
    # of loads (first row -> order -> the rows themselves) with nothing else to do (3 programs an SM).
    # src's columns are contiguous (stride 1: the wrapper checks)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    num_c = gl.cdiv(C, 128)
    items = num_tiles * num_c
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    smem = gl.allocate_shared_memory(src_ptr.dtype.element_ty, [2, 128, 128],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    row0_a, expert_a = item_tile(pid, items, num_c, tile_expert_ptr, tile_row_ptr)
    src_a, end_a = _tile_sources(row0_a, expert_a, N, order_ptr, offsets_ptr, rows_per_token, GATHER, ld)
    if pid < items:
        _copy_tile(src_ptr, src_a, row0_a, end_a, (pid % num_c) * 128, C, stride_r, smem.index(0), ld)
    async_copy.commit_group()
    row0_b, expert_b = item_tile(pid + G, items, num_c, tile_expert_ptr, tile_row_ptr)
    src_b, end_b = _tile_sources(row0_b, expert_b, N, order_ptr, offsets_ptr, rows_per_token, GATHER, ld)
    row0_c, expert_c = item_tile(pid + 2 * G, items, num_c, tile_expert_ptr, tile_row_ptr)
    for i in range(gl.cdiv(items - pid, G)):
        item = pid + i * G
        stage = i % 2
        # the other stage was read by the same threads in the previous iteration: refill it with item i + 1
        if item + G < items:
            _copy_tile(src_ptr, src_b, row0_b, end_b, ((item + G) % num_c) * 128, C, stride_r,
                       smem.index(1 - stage), ld)
        async_copy.commit_group()
        src_c, end_c = _tile_sources(row0_c, expert_c, N, order_ptr, offsets_ptr, rows_per_token, GATHER, ld)
        row0_d, expert_d = item_tile(item + 3 * G, items, num_c, tile_expert_ptr, tile_row_ptr)
        async_copy.wait_group(1)  # this thread's copies of item i have landed
        rows = row0_a + gl.arange(0, 128, layout=gl.SliceLayout(1, ld))
        cols = (item % num_c) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
        ok = (rows < end_a)[:, None] & (cols < C)[None, :]
        x = gl.where(ok, smem.index(stage).load(ld).to(gl.float32), 0.0)
        store_token_tile_e4m3(data_ptr, scale_ptr, x, item // num_c, (item % num_c) * 128, C, num_tiles * 128,
                              EXACT_CAST, num_warps)
        row0_a, end_a = row0_b, end_b
        row0_b, src_b, end_b = row0_c, src_c, end_c
        row0_c, expert_c = row0_d, expert_d
    async_copy.wait_group(0)


def weight_pair(w_ERC: torch.Tensor, data, scale, data_t, scale_t, write_w: bool, num_warps: int,
                exact_cast: bool) -> None:
    """Fill data_t/scale_t (and data/scale when `write_w`) from w [E, R, C] (R, C multiples of 128; the
    caller checks and allocates, as `quantize._quantize_weight` does)."""
    E, R, C = w_ERC.shape
    launch(_weight_pair_kernel, (C // BLOCK, R // BLOCK, E), w_ERC, data, scale, data_t, scale_t, R, C,
           w_ERC.stride(0), w_ERC.stride(1), w_ERC.stride(2), WRITE_W=write_w, EXACT_CAST=exact_cast,
           num_warps=num_warps)


def token_tiles(src_RC: torch.Tensor, plan, K: int, gather: bool, data, scale, num_warps: int,
                exact_cast: bool, per_multiprocessor: int = 0) -> None:
    """`quantize._token_tiles`' kernel in Gluon: fill the token tiles `data` [C, P] and `scale` [C, P / 128] from
    src_RC's rows in the plan's order (gathered through plan.order_N // K, or src_RC's own rows when not
    `gather`). `per_multiprocessor` > 0: `_token_tiles_persistent_kernel` with that many programs per
    multiprocessor (the next item's rows copied in while this one is stored) where its 16-byte copies can
    read src (bf16 or fp32, columns contiguous, rows 16-byte aligned); else one program per item."""
    C = src_RC.shape[1]
    num_tiles = plan.layout.num_tiles
    if per_multiprocessor and _copyable_rows(src_RC):
        grid = min(per_multiprocessor * multiprocessors(src_RC.device), num_tiles * triton.cdiv(C, BLOCK))
        launch(_token_tiles_persistent_kernel, (grid,), src_RC, plan.order_N, plan.tile_expert, plan.tile_row,
               plan.offsets_E1, data, scale, C, plan.order_N.shape[0], num_tiles, K, src_RC.stride(0),
               GATHER=gather, EXACT_CAST=exact_cast, num_warps=num_warps)
        return
    launch(_token_tiles_kernel, (plan.layout.num_tiles, triton.cdiv(C, BLOCK)), src_RC, plan.order_N,
           plan.tile_expert, plan.tile_row, plan.offsets_E1, data, scale, C, plan.layout.num_tiles, K,
           src_RC.stride(0), src_RC.stride(1), GATHER=gather, EXACT_CAST=exact_cast, num_warps=num_warps)


def _copyable_rows(src_RC: torch.Tensor) -> bool:
    """Rows that 16-byte asynchronous copies can read: bf16 or fp32, contiguous columns, every row 16-byte
    aligned."""
    size = src_RC.element_size()
    return (src_RC.dtype in (torch.bfloat16, torch.float32) and src_RC.stride(1) == 1
            and (src_RC.stride(0) * size) % 16 == 0 and src_RC.data_ptr() % 16 == 0)
