"""Expert weight gradients: grouped GEMMs whose reduction runs over each expert's rows (varlen-K).

For expert e with sorted positions ``offsets_E1[e] <= p < offsets_E1[e+1]`` every weight gradient has
the form

    C_e[M, N] = sum_p A[rowA(p), :]^T B[rowB(p), :]        (fp32 accumulation)

where an operand's row is either the sorted position p (contiguous) or the token ``order_N[p] // K``
(gathered). Two instances:

- dW2[e] (D x H) = sum_p (s_p * dout[tok(p)])^T h[p]      A = dout gathered, B = h sorted; the score
  scales h's tile (default, keeps both wgmma operands in shared memory) or dout's (``scale_b=False``)
- dW1[e] (H x D) = sum_p dg[p]^T x[tok(p)],  dW3[e] likewise with du: A = dg / du sorted, B = x gathered;
  one kernel, two accumulators, one load of each gathered x tile.

Kernel design
- One program per output tile (expert slot, split, m-tile, n-tile), flattened into a 1-D grid, or a
  persistent grid of ``num_programs`` programs that stride over the same tile list.
- The k-loop walks the expert's rows BLOCK_K at a time; rows past the end load as zeros (``other=0`` on
  both operands), so partial tiles are exact. An empty expert runs zero iterations and stores zeros:
  every output element is written by the kernel, nothing relies on a memset.
- Operand tiles are loaded [BLOCK_K, BLOCK_{M,N}] with the contiguous feature dim last (coalesced);
  the A tile enters ``tl.dot`` through ``tl.trans`` (a shared-memory view on Hopper, no shuffle).
- Skew: experts are visited heaviest first (an on-device argsort of the counts, no host sync), so the
  long k-loops start first and short ones fill in behind them. ``split_k > 1`` additionally splits each
  expert's rows into ``split_k`` contiguous chunks whose fp32 partials land in a workspace and are
  summed in a fixed order: deterministic, at the cost of ``split_k * E * M * N * 4`` bytes per output.
- No atomics anywhere: the result is bitwise reproducible for a given config.
- Under TRITON_INTERPRET=1 (CPU tests) the constexpr INTERP works around two interpreter bugs of
  Triton 3.6: tl.dot on bf16 multiplies the raw bit patterns as integers (operands go to fp32 there,
  which is exact), and fp32 -> bf16 casts truncate (rounding is done on the bits there). Compiled
  kernels never take these branches.

The torch reference (``*_reference``) lives at the bottom of this file; the tests compare against it
in float64 and in bf16 (the same GEMMs done by torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from triton.tools.tensor_descriptor import TensorDescriptor

from .common import cast_rne, check_row_alignment, tma_ok
from .configs import tuned_entry

# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _wgrad_tile(
    tile_id,
    a_ptr,
    a2_ptr,
    b_ptr,
    scale_ptr,
    order_ptr,
    offsets_ptr,
    expert_slot_ptr,
    c_ptr,
    c2_ptr,
    M,
    N,
    stride_a,
    stride_b,
    stride_cs,
    stride_ce,
    stride_cm,
    TOP_K: tl.constexpr,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_B: tl.constexpr,
    DUAL: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SORTED_TMA: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # tile id -> (expert slot, split, m-tile, n-tile); n fastest so neighbouring programs share A rows
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_mn = tl.cdiv(M, BLOCK_M) * tiles_n
    slot = tile_id // (SPLIT_K * tiles_mn)
    rem = tile_id % (SPLIT_K * tiles_mn)
    split = rem // tiles_mn
    rem = rem % tiles_mn
    pid_m = rem // tiles_n
    pid_n = rem % tiles_n
    if HEAVY_FIRST:
        expert = tl.load(expert_slot_ptr + slot)
    else:
        expert = slot
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    if SPLIT_K > 1:
        chunk = tl.cdiv(tl.cdiv(hi - lo, SPLIT_K), BLOCK_K) * BLOCK_K
        lo = tl.minimum(lo + split * chunk, hi)
        hi = tl.minimum(lo + chunk, hi)

    offs_m = tl.max_contiguous(tl.multiple_of(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), BLOCK_M), BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DUAL:
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

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
        a_off = rows_a[:, None] * stride_a + offs_m[None, :]  # [BLOCK_K, BLOCK_M], contiguous dim last
        # SORTED_TMA: the sorted (not gathered) operand is a TMA descriptor. Its rows past `hi` belong to
        # the next expert or split, but they meet the gathered operand's rows masked to zero, so they add
        # nothing; columns past M or N are TMA's zero fill
        if SORTED_TMA and not B_GATHER:
            b = b_ptr.load([k0, pid_n * BLOCK_N])
        else:
            b = tl.load(b_ptr + rows_b[:, None] * stride_b + offs_n[None, :], mask=mask_b, other=0.0)
        if SORTED_TMA and not A_GATHER:
            a = a_ptr.load([k0, pid_m * BLOCK_M])
        else:
            a = tl.load(a_ptr + a_off, mask=mask_a, other=0.0)
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
            if SCALE_B:
                b = cast_rne(b.to(tl.float32) * s[:, None], tl.bfloat16, INTERP)
            else:
                a = cast_rne(a.to(tl.float32) * s[:, None], tl.bfloat16, INTERP)
        if INTERP:  # the interpreter's tl.dot multiplies bf16 bit patterns as integers: feed it fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc)
        if DUAL:
            if SORTED_TMA and not A_GATHER:
                a2 = a2_ptr.load([k0, pid_m * BLOCK_M])
            else:
                a2 = tl.load(a2_ptr + a_off, mask=mask_a, other=0.0)
            if INTERP:
                a2 = a2.to(tl.float32)
            acc2 = tl.dot(tl.trans(a2), b, acc2)

    if OUT_BF16:
        acc = cast_rne(acc, tl.bfloat16, INTERP)
        if DUAL:
            acc2 = cast_rne(acc2, tl.bfloat16, INTERP)
    c_off = split.to(tl.int64) * stride_cs + expert.to(tl.int64) * stride_ce
    c_off = c_off + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if EVEN_M and EVEN_N:
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty))
        if DUAL:
            tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty))
    else:
        mask_c = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=mask_c)
        if DUAL:
            tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _expert_wgrad_kernel(
    a_ptr,
    a2_ptr,
    b_ptr,
    scale_ptr,
    order_ptr,
    offsets_ptr,
    expert_slot_ptr,
    c_ptr,
    c2_ptr,
    M,
    N,
    stride_a,
    stride_b,
    stride_cs,
    stride_ce,
    stride_cm,
    num_tiles,
    TOP_K: tl.constexpr,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_B: tl.constexpr,
    DUAL: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SORTED_TMA: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    if PERSISTENT:  # a constexpr branch: the one-tile program keeps fewer live registers than a loop
        for tile_id in range(pid, num_tiles, tl.num_programs(0)):
            _wgrad_tile(
                tile_id, a_ptr, a2_ptr, b_ptr, scale_ptr, order_ptr, offsets_ptr, expert_slot_ptr, c_ptr, c2_ptr,
                M, N, stride_a, stride_b, stride_cs, stride_ce, stride_cm,
                TOP_K, A_GATHER, B_GATHER, HAS_SCALE, SCALE_B, DUAL, HEAVY_FIRST, SPLIT_K,
                EVEN_M, EVEN_N, OUT_BF16, SORTED_TMA, INTERP, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        _wgrad_tile(
            pid, a_ptr, a2_ptr, b_ptr, scale_ptr, order_ptr, offsets_ptr, expert_slot_ptr, c_ptr, c2_ptr,
            M, N, stride_a, stride_b, stride_cs, stride_ce, stride_cm,
            TOP_K, A_GATHER, B_GATHER, HAS_SCALE, SCALE_B, DUAL, HEAVY_FIRST, SPLIT_K,
            EVEN_M, EVEN_N, OUT_BF16, SORTED_TMA, INTERP, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


# True when TRITON_INTERPRET=1 was set before this module was imported (CPU tests)
_INTERPRETED = isinstance(_expert_wgrad_kernel, InterpretedFunction)

# ------------------------------------------------------------------------------------------------
# Config table (the lead tunes it on the H200; every entry can be overridden per call)
# ------------------------------------------------------------------------------------------------

# Keys (all can be passed to the launchers to sweep them):
#   block_m x block_n  output tile;  block_k  rows per k-step;  num_warps, num_stages  as in Triton.
#     The gathered operand's row index is itself a load, so the pipeliner spends a stage on it: at
#     128x128x64, sm_90 compiles show 2 data buffers for num_stages 3 and 4, 3 buffers for 5.
#   num_programs  None: one program per tile (the hardware balances uneven experts); an int: a
#     persistent grid of that many programs striding over the tiles (0: one per SM).
#   split_k  >1 splits every expert's rows into that many chunks; fp32 partials go to a
#     [split_k, E, M, N] workspace and are summed in a fixed order (deterministic, memory-hungry: for
#     a few local experts with skewed loads, not for E=128 at full width).
#   heavy_first  visit experts in descending row count (an on-device argsort, no host sync).
#   tma  the expert-sorted operand (dW2's s*h, dW1/dW3's dg and du) through a TMA descriptor when no
#     per-row scale is applied in the loop; the gathered one stays on pointer loads (Hopper TMA has
#     no row gather).
#   scale_b  (dW2 only) apply the per-row score to h instead of dout. sm_90 compiles show why: scaling
#     dout, the A operand, sends it through registers and every wgmma waits; scaling h keeps both
#     operands in shared memory with back-to-back wgmmas. Rounding point: round(s*h) instead of
#     round(s*dout), equally accurate (the tests check both).
# Defaults read off sm_90 compiles (wgmma, no spills); measured winners live in tuned_configs.json.
_DEFAULT = dict(
    block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=5,
    num_programs=None, split_k=1, heavy_first=True, scale_b=True, tma=False,
)  # fmt: skip
WGRAD_CONFIGS: dict[tuple[str, object], dict] = {
    # dW2: one 128x128 fp32 accumulator, 140 regs/thread, 97 KiB smem at the default
    ("w2", "default"): dict(_DEFAULT),
    # dW1+dW3: two accumulators (~205 regs/thread at 128x128x64, 145 KiB smem); 128x256 spills, 64x256 fits
    ("w13", "default"): dict(_DEFAULT),
}
_CONFIG_KEYS = tuple(_DEFAULT)


def wgrad_config(kind: str, D: int, H: int, **overrides) -> dict:
    """The table's config for ``kind`` in {"w2", "w13"} at (D, H), with non-None overrides applied."""
    if kind not in ("w2", "w13"):
        raise ValueError(f"kind must be 'w2' or 'w13', got {kind!r}")
    unknown = set(overrides) - set(_CONFIG_KEYS)
    if unknown:
        raise TypeError(f"unknown wgrad config keys {sorted(unknown)}; valid keys: {list(_CONFIG_KEYS)}")
    cfg = dict(WGRAD_CONFIGS.get((kind, (D, H)), WGRAD_CONFIGS[(kind, "default")]))
    cfg.update(tuned_entry(f"wgrad_{kind}", D, H) or {})  # the shipped table (scripts/tune_kernels.py)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous() or t.device != device:
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D {dtype} tensor on {device}; got {t.dtype} "
            f"shape {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}"
        )


def _check_routing(order_N: torch.Tensor, offsets_E1: torch.Tensor, n_rows: int, device: torch.device) -> int:
    _check("order_N", order_N, torch.int32, 1, device)
    _check("offsets_E1", offsets_E1, torch.int32, 1, device)
    if order_N.numel() != n_rows:
        raise ValueError(f"order_N has {order_N.numel()} rows, expected N = {n_rows}")
    if offsets_E1.numel() < 2:
        raise ValueError("offsets_E1 must hold E+1 >= 2 entries")
    return offsets_E1.numel() - 1


def _launch_wgrad(
    a, a2, b, scale, order_N, offsets_E1, top_k, M, N, a_gather, b_gather, outs, cfg
) -> None:
    E = offsets_E1.numel() - 1
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    split_k = int(cfg["split_k"])
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    dual = a2 is not None
    if split_k > 1:
        targets = [torch.empty((split_k, E, M, N), device=a.device, dtype=torch.float32) for _ in outs]
    else:
        targets = list(outs)
    c, c2 = targets[0], targets[-1]
    num_tiles = E * split_k * triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if cfg["heavy_first"]:
        counts_E = offsets_E1[1:] - offsets_E1[:-1]
        expert_slot = torch.argsort(counts_E, descending=True, stable=True).to(torch.int32)
    else:
        expert_slot = offsets_E1  # unused
    num_programs = cfg["num_programs"]
    persistent = num_programs is not None
    if persistent and num_programs <= 0:
        num_programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    grid = (min(num_programs, num_tiles) if persistent else num_tiles,)
    a2 = a2 if dual else a
    sorted_tma = bool(cfg["tma"]) and scale is None and tma_ok(b if a_gather else a, b if a_gather else a2)
    if sorted_tma:
        if a_gather:
            b = TensorDescriptor.from_tensor(b, [bk, bn])
        else:
            a, a2 = (TensorDescriptor.from_tensor(t, [bk, bm]) for t in (a, a2))
    _expert_wgrad_kernel[grid](
        a, a2, b, scale if scale is not None else b, order_N, offsets_E1, expert_slot, c, c2,
        M, N, a.stride(0) if not (sorted_tma and not a_gather) else 0, b.stride(0) if not (sorted_tma and a_gather) else 0,
        c.stride(0) if split_k > 1 else 0, c.stride(-3), c.stride(-2),
        num_tiles,
        TOP_K=top_k, A_GATHER=a_gather, B_GATHER=b_gather, HAS_SCALE=scale is not None,
        SCALE_B=bool(cfg["scale_b"]), DUAL=dual, HEAVY_FIRST=bool(cfg["heavy_first"]), SPLIT_K=split_k,
        EVEN_M=M % bm == 0, EVEN_N=N % bn == 0, PERSISTENT=persistent,
        OUT_BF16=c.dtype == torch.bfloat16, SORTED_TMA=sorted_tma, INTERP=_INTERPRETED,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_k > 1:
        for out, ws in zip(outs, targets):
            out.copy_(ws.sum(0))  # fixed-order reduction: deterministic


def _alloc_out(out, shape, dtype, device, name):
    if out is None:
        return torch.empty(shape, device=device, dtype=dtype)
    _check(name, out, dtype, len(shape), device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def expert_wgrad_w2(
    dout_TD: torch.Tensor,
    h_NH: torch.Tensor,
    scale_N: torch.Tensor | None,
    order_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    out: torch.Tensor | None = None,
    **config,
) -> torch.Tensor:
    """dw2_EDH[e] = sum_{p in e} (scale_N[p] * dout_TD[order_N[p] // top_k])^T h_NH[p], fp32 accumulation.

    ``h_NH`` and ``scale_N`` are in expert-sorted order; ``dout_TD`` is per token. The score multiplies
    h's row (config ``scale_b=True``, the default) or dout's row, in fp32, rounded to bf16 before the
    GEMM. ``out`` (optional, [E, D, H] of ``out_dtype``) is written in full. Config keys (see
    ``wgrad_config``) override the table per call.
    """
    device = dout_TD.device
    _check("dout_TD", dout_TD, torch.bfloat16, 2, device)
    _check("h_NH", h_NH, torch.bfloat16, 2, device)
    T, D = dout_TD.shape
    n_rows, H = h_NH.shape
    if n_rows != T * top_k:
        raise ValueError(f"h_NH has {n_rows} rows, expected T*top_k = {T}*{top_k}")
    if scale_N is not None:
        _check("scale_N", scale_N, torch.float32, 1, device)
        if scale_N.numel() != n_rows:
            raise ValueError(f"scale_N has {scale_N.numel()} entries, expected N = {n_rows}")
    E = _check_routing(order_N, offsets_E1, n_rows, device)
    check_row_alignment("expert weight gradient", {"D": D, "H": H}, " (64 or more recommended on the GPU)")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    dw2 = _alloc_out(out, (E, D, H), out_dtype, device, "out")
    if n_rows == 0:
        return dw2.zero_()
    cfg = wgrad_config("w2", D, H, **config)
    _launch_wgrad(dout_TD, None, h_NH, scale_N, order_N, offsets_E1, top_k, D, H, True, False, [dw2], cfg)
    return dw2


def expert_wgrad_w13(
    dg_NH: torch.Tensor,
    du_NH: torch.Tensor,
    x_TD: torch.Tensor,
    order_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    **config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dw1_EHD[e] = sum_{p in e} dg_NH[p]^T x_TD[order_N[p] // top_k], dw3_EHD likewise with du_NH.

    One kernel with two accumulators sharing each gathered x tile. ``out`` (optional) is a pair of
    [E, H, D] ``out_dtype`` tensors, written in full.
    """
    device = x_TD.device
    _check("dg_NH", dg_NH, torch.bfloat16, 2, device)
    _check("du_NH", du_NH, torch.bfloat16, 2, device)
    _check("x_TD", x_TD, torch.bfloat16, 2, device)
    T, D = x_TD.shape
    n_rows, H = dg_NH.shape
    if du_NH.shape != dg_NH.shape:
        raise ValueError(f"du_NH shape {tuple(du_NH.shape)} must equal dg_NH shape {tuple(dg_NH.shape)}")
    if n_rows != T * top_k:
        raise ValueError(f"dg_NH has {n_rows} rows, expected T*top_k = {T}*{top_k}")
    E = _check_routing(order_N, offsets_E1, n_rows, device)
    check_row_alignment("expert weight gradient", {"D": D, "H": H}, " (64 or more recommended on the GPU)")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    out1, out3 = out if out is not None else (None, None)
    dw1 = _alloc_out(out1, (E, H, D), out_dtype, device, "out[0]")
    dw3 = _alloc_out(out3, (E, H, D), out_dtype, device, "out[1]")
    if n_rows == 0:
        return dw1.zero_(), dw3.zero_()
    cfg = wgrad_config("w13", D, H, **config)
    _launch_wgrad(dg_NH, du_NH, x_TD, None, order_N, offsets_E1, top_k, H, D, False, True, [dw1, dw3], cfg)
    return dw1, dw3


# ------------------------------------------------------------------------------------------------
# Reference (torch, loops over experts with host-read sizes: tests and debugging only)
# ------------------------------------------------------------------------------------------------


def expert_wgrad_w2_reference(dout_TD, h_NH, scale_N, order_N, offsets_E1, top_k, compute_dtype):
    """dW2 in ``compute_dtype``: float64 is the oracle; bf16 is torch doing the same bf16 GEMMs."""
    tok = order_N.long() // top_k
    dy_ND = dout_TD[tok].to(compute_dtype)
    if scale_N is not None:  # the product in fp32 (as autograd forms dy), in float64 for the oracle
        prod_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        dy_ND = (scale_N.to(prod_dtype)[:, None] * dout_TD[tok].to(prod_dtype)).to(compute_dtype)
    h = h_NH.to(compute_dtype)
    return _grouped_atb(dy_ND, h, offsets_E1)


def expert_wgrad_w13_reference(dg_NH, du_NH, x_TD, order_N, offsets_E1, top_k, compute_dtype):
    x_ND = x_TD[order_N.long() // top_k].to(compute_dtype)
    return (
        _grouped_atb(dg_NH.to(compute_dtype), x_ND, offsets_E1),
        _grouped_atb(du_NH.to(compute_dtype), x_ND, offsets_E1),
    )


def _grouped_atb(a_NM: torch.Tensor, b_NK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    off = offsets_E1.tolist()
    out = a_NM.new_zeros((len(off) - 1, a_NM.shape[1], b_NK.shape[1]))
    for e in range(len(off) - 1):
        if off[e + 1] > off[e]:
            out[e] = a_NM[off[e] : off[e + 1]].T @ b_NK[off[e] : off[e + 1]]
    return out
