"""The tile configs a tuning run tries, per kernel and precision (the schema is `kernels.configs.TileConfig`).

Under Triton's CPU interpreter (tests, CI) the GPU candidates would take hours: `for_kernel` gives the
interpreter's own config and one variant instead, so the whole tuning flow still runs there.
"""

from __future__ import annotations

from dataclasses import replace

from ..kernels import configs
from ..kernels.configs import TileConfig

M = configs.ROW_BLOCK_M
T_ = dict(tma=True)
SPLIT = dict(split=True)
WS = dict(tma=True, warp_specialize=True)
C = TileConfig
CANDIDATES = {
    "gemm1_swiglu": [C(M, 64, 64, 4, 4), C(M, 64, 64, 8, 4), C(M, 128, 64, 8, 3), C(M, 128, 64, 8, 4),
                     C(M, 128, 32, 8, 4), C(M, 128, 64, 8, 5),
                     C(M, 128, 64, 8, 3, **T_), C(M, 128, 64, 8, 4, **T_), C(M, 128, 32, 8, 4, **T_)],
    "gemm2": [C(M, 128, 64, 8, 3), C(M, 128, 64, 8, 4), C(M, 256, 64, 8, 3), C(M, 128, 64, 4, 4),
              C(M, 64, 64, 4, 4), C(M, 256, 32, 8, 4),
              C(M, 256, 64, 8, 3, **T_), C(M, 256, 64, 8, 4, **T_), C(M, 128, 64, 8, 4, **T_),
              C(M, 256, 64, 8, 3, **WS), C(M, 128, 64, 8, 4, **WS)],
    # dgrad's BLOCK_N is per accumulator (two accumulators: a program covers 2*BLOCK_N columns). 16 warps
    # (four warpgroups) halve the registers each thread holds for 2 x [128, 128] accumulators plus the
    # dSwiGLU epilogue, where 8 warps spill; split: the GEMM stores q and an elementwise pass does the
    # dSwiGLU, so GEMM1-sized tiles fit; split + tma: dout's rows copied into sorted order first, q from
    # the grouped GEMM with both operands through TMA (block_n: its whole tile width)
    "dgrad_swiglu": [C(M, 64, 64, 8, 4), C(M, 64, 64, 8, 3), C(M, 128, 64, 16, 3), C(M, 128, 64, 16, 4),
                     C(M, 128, 32, 16, 4), C(M, 64, 64, 16, 4),
                     C(M, 128, 64, 8, 3, **SPLIT), C(M, 128, 64, 8, 4, **SPLIT), C(M, 128, 32, 8, 4, **SPLIT),
                     C(M, 256, 64, 8, 3, **SPLIT, **T_), C(M, 256, 64, 8, 4, **SPLIT, **T_),
                     C(M, 128, 64, 8, 4, **SPLIT, **T_), C(M, 256, 32, 8, 4, **SPLIT, **T_)],
    # weight gradients: the gathered row index costs the pipeliner a stage, so 5 stages give 3 data
    # buffers; tma: the expert-sorted operand (s*h for w2, dg/du for w13) through TMA
    "wgrad_w2": [C(128, 128, 64, 8, 3), C(128, 128, 64, 8, 5), C(128, 128, 32, 8, 5), C(128, 256, 64, 8, 4),
                 C(64, 256, 64, 8, 5), C(128, 128, 32, 8, 6), C(128, 128, 32, 8, 4), C(128, 256, 32, 8, 5),
                 C(256, 128, 32, 8, 5), C(128, 256, 32, 8, 5, **T_), C(128, 128, 32, 8, 5, **T_),
                 C(128, 128, 32, 8, 6, **T_), C(128, 128, 64, 8, 4, **T_)],
}
# dx: GEMM2's pointer-load candidates, then its own TMA and warp-specialised ones
CANDIDATES["dx"] = CANDIDATES["gemm2"][:6] + [C(M, 256, 32, 8, 4, **T_), C(M, 256, 64, 8, 3, **T_),
                                              C(M, 128, 64, 8, 4, **T_), C(M, 256, 64, 8, 3, **WS),
                                              C(M, 256, 32, 8, 4, **WS)]
# grouped row order (`group_m`, schedule.row_tile): the row kernels' usual winners with their row programs
# walked down each N column in groups, so a weight tile is read once per group (large experts' weights
# outgrow L2)
_GROUPED = {"gemm1_swiglu": [C(M, 128, 64, 8, 4, **T_), C(M, 128, 64, 8, 3)],
            "gemm2": [C(M, 256, 64, 8, 3, **WS), C(M, 256, 64, 8, 3, **T_)],
            "dgrad_swiglu": [C(M, 128, 32, 8, 4, **SPLIT), C(M, 256, 64, 8, 3, **SPLIT, **T_)],
            "dx": [C(M, 256, 64, 8, 3, **T_), C(M, 256, 32, 8, 4, **T_)]}
for _kernel, _configs in _GROUPED.items():
    CANDIDATES[_kernel] = CANDIDATES[_kernel] + [replace(c, group_m=g) for c in _configs for g in (4, 8, 16)]
# weight gradients with the gathered operand copied into sorted order first (`sorted_copy`): both operands
# through TMA, optionally warp-specialised; dW1/dW3's two accumulators spill at 128 x 256
SC = dict(tma=True, sorted_copy=True)
SC_WS = dict(SC, warp_specialize=True)
_SORTED_COPY = [C(128, 128, 32, 8, 5, **SC), C(128, 128, 64, 8, 4, **SC), C(128, 128, 64, 8, 3, **SC_WS),
                C(128, 128, 32, 8, 5, **SC_WS)]
_SORTED_COPY_WIDE = [C(128, 256, 32, 8, 4, **SC), C(128, 256, 64, 8, 3, **SC), C(128, 256, 64, 8, 3, **SC_WS),
                     C(128, 256, 32, 8, 4, **SC_WS)]
# one-warpgroup programs (64 rows, 4 warps): small enough in registers and shared memory for two per
# multiprocessor, so one's epilogue and pipeline fill overlap the other's MMAs (an expert's reduction is
# short: ~1024 rows at the Qwen3 shapes)
_SORTED_COPY_HALF = [C(64, 128, 64, 4, 3, **SC), C(64, 128, 64, 4, 4, **SC), C(64, 128, 32, 4, 5, **SC)]
CANDIDATES["wgrad_w13"] = CANDIDATES["wgrad_w2"] + _SORTED_COPY + _SORTED_COPY_HALF
CANDIDATES["wgrad_w2"] = (CANDIDATES["wgrad_w2"] + _SORTED_COPY + _SORTED_COPY_WIDE + _SORTED_COPY_HALF
                          + [C(64, 256, 64, 4, 3, **SC)])

# persistent (TileConfig.persistent): the grouped GEMM's usual winners as resident programs walking the
# tile schedule, as many per multiprocessor as fit (128-row bf16 tiles: one, by shared memory)
P1 = dict(tma=True, persistent=1)
_PERSISTENT = {"gemm2": [C(M, 256, 64, 8, 3, **P1), C(M, 128, 64, 8, 4, **P1), C(M, 256, 64, 8, 3, group_m=8, **P1)],
               "dx": [C(M, 256, 32, 8, 4, **P1), C(M, 256, 64, 8, 3, **P1), C(M, 256, 64, 8, 3, group_m=16, **P1)],
               "dgrad_swiglu": [C(M, 256, 64, 8, 3, **SPLIT, **P1), C(M, 128, 64, 8, 4, **SPLIT, **P1)]}
for _kernel, _configs in _PERSISTENT.items():
    CANDIDATES[_kernel] = CANDIDATES[_kernel] + _configs
# dgrad's own kernel with W2 through TMA and dout gathered by pointer (weight_tma: GEMM1's arrangement)
WT = dict(split=True, weight_tma=True)
CANDIDATES["dgrad_swiglu"] += [C(M, 128, 64, 8, 4, **WT), C(M, 128, 32, 8, 4, **WT), C(M, 128, 64, 8, 3, **WT),
                               C(M, 128, 64, 8, 4, group_m=8, **WT)]

# block FP8: BLOCK_K is one 128-wide scale block. The block-scaled main loop waits for each K block's MMA
# before scaling it into the accumulator, so a program's tensor cores idle during that step; programs of
# one warpgroup (64 rows, 4 warps) hold half the registers, and several of them per multiprocessor cover
# each other's scaling steps. Row kernels: 64-row halves of the plan's tiles against whole 128-row tiles.
# GEMM1 always covers 2 x 64 columns (one scale block of h); dgrad_swiglu is its GEMM (q, stored sorted)
F = configs.FP8_BLOCK
# (the row kernels' weight tiles stay inside one 128-column scale block: BLOCK_N <= 128)
_FP8_ROWS = [C(64, 128, F, 4, 3, **T_), C(64, 128, F, 4, 4, **T_), C(64, 128, F, 4, 5, **T_), C(M, 128, F, 8, 3, **T_),
             C(M, 128, F, 8, 4, **T_)]
_FP8_WGRAD = [C(64, 128, F, 4, 3, **T_), C(64, 128, F, 4, 4, **T_), C(64, 128, F, 4, 5, **T_), C(64, 256, F, 8, 3, **T_),
              C(128, 128, F, 8, 3, **T_), C(128, 128, F, 8, 4, **T_)]
# persistent: 64-row, 4-warp programs hold ~210 registers and ~106 KB of shared memory at 4 stages in
# the sm_90 compile (Triton 3.6), so two fit on a multiprocessor
_FP8_PERSISTENT = [C(64, 128, F, 4, 4, tma=True, persistent=2), C(64, 128, F, 4, 3, tma=True, persistent=2),
                   C(M, 128, F, 8, 3, tma=True, persistent=1)]
# dx with both operand pairs in one K loop (pairs_in_one_loop), so a persistent dx's tile loop flattens with
# it; four operand tiles per stage (sm_90 compile, Triton 3.6: bf16 128x128x64 at 3 stages ~197 KB of shared
# memory alone, ~229 KB persistent; FP8 64-row programs ~107 KB at 2 stages, ~148 KB at 3). On an H100 on
# 2026-12-06 block FP8's 128-row persistent form won at both Qwen3 shapes (1.115 against 1.281 ms at 30B-A3B,
# 4.125 against 4.514 at 235B-A22B) and bf16's lost (1.677 against 1.369 ms at 30B-A3B; docs/kernels.md)
ONE = dict(tma=True, pairs_in_one_loop=True)
CANDIDATES["dx"] += [C(M, 128, 64, 8, 3, **ONE), C(M, 128, 32, 8, 4, **ONE), C(M, 128, 64, 8, 3, persistent=1, **ONE),
                     C(M, 128, 32, 8, 4, persistent=1, **ONE)]
_FP8_ONE_LOOP = [C(64, 128, F, 4, 3, **ONE), C(64, 128, F, 4, 2, persistent=2, **ONE),
                 C(64, 128, F, 4, 3, persistent=1, **ONE), C(M, 128, F, 8, 3, persistent=1, **ONE)]
# the persistent warp-specialised Gluon kernels (`fp8_rows_ws_gluon`, `fp8_gemm1_ws_gluon`): a producer warp and
# two consumer warpgroups of 64 rows sharing each weight tile, one program per multiprocessor
_FP8_GLUON_WS = [C(M, 128, F, 8, s, tma=True, gluon=True, warp_specialize=True) for s in (4, 5)]
# the row kernels' 256-column items (two 128-column sub-tiles per consumer: A's tile read once for both,
# 171 FLOP per operand byte against 128), 48 KB a stage; GEMM1's 128-column one pass likewise
_FP8_GLUON_WS_WIDE = [C(M, 256, F, 8, s, tma=True, gluon=True, warp_specialize=True) for s in (3, 4)]
CANDIDATES_FP8 = {
    "gemm1_swiglu": [C(64, 64, F, 4, 3, **T_), C(64, 64, F, 4, 4, **T_), C(64, 64, F, 4, 5, **T_),
                     C(M, 64, F, 8, 3, **T_), C(M, 64, F, 8, 4, **T_)]
    + [replace(c, block_n=64) for c in _FP8_GLUON_WS] + [replace(c, block_n=128) for c in _FP8_GLUON_WS_WIDE],
    # warp specialisation of the 64-row, 4-warp loops stops Triton 3.6 with an internal assertion
    # (TaskIdPropagation.cpp, docs/results/tune_logs/2026-12-04_fp8_tune_2048x768_a.log): 128 rows only
    # (of the Gluon kernels, `TileConfig.gluon`, only the persistent warp-specialised ones are candidates:
    # the one-item kernels were bitwise right and slower on an H100, docs/kernels.md "More Gluon")
    "gemm2": _FP8_ROWS + [C(M, 128, F, 8, 3, **WS)] + _FP8_PERSISTENT + _FP8_GLUON_WS + _FP8_GLUON_WS_WIDE,
    "dgrad_swiglu": [replace(c, split=True) for c in _FP8_ROWS + _FP8_PERSISTENT + _FP8_GLUON_WS + _FP8_GLUON_WS_WIDE],
    "dx": _FP8_ROWS + [C(M, 128, F, 8, 3, **WS)] + _FP8_PERSISTENT + _FP8_ONE_LOOP + _FP8_GLUON_WS + _FP8_GLUON_WS_WIDE,
    "wgrad_w2": _FP8_WGRAD + _FP8_GLUON_WS,
    # dW1/dW3's Gluon items hold both tiles (48 KB stages): 3 or 4 fit in shared memory, 5 do not
    "wgrad_w13": _FP8_WGRAD + [replace(_FP8_GLUON_WS[0], num_stages=3), _FP8_GLUON_WS[0]],
}

# the FP8 defaults' Gluon row kernels with their items walked in groups down each column block (`group_m`:
# large experts' weights outgrow L2; Mixtral-like on an H100, defaults with group_m 16/8 against 1: 24.66 against
# 25.05 ms fwd+bwd, bench_layer_20261206T182007/182109.json)
for _kernel in configs.ROW_KERNELS:
    _base = configs.default_configs(configs.LARGE_EXPERT_HIDDEN, "fp8")[_kernel]
    CANDIDATES_FP8[_kernel] = CANDIDATES_FP8[_kernel] + [replace(_base, group_m=g) for g in (4, 8, 16)]


def for_kernel(kernel: str, precision: str) -> list[TileConfig]:
    """The candidates of one kernel at one precision ("bf16" or "fp8")."""
    if configs.interpreting():
        base = configs.tile_config(kernel, 128, 128, precision)
        return [base, replace(base, num_warps=8 if base.num_warps == 4 else 4)]
    return (CANDIDATES_FP8 if precision == "fp8" else CANDIDATES)[kernel]
