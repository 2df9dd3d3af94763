"""Tile configurations: one schema for every kernel, tuned offline, never autotuned in training.

Ranks must agree on the kernels they run and autotuning at training time can OOM, so a config is a
pure function of (kernel, precision, shape). `scripts/tune_kernels.py` measures candidates on the GPU
and writes `tuned_configs.json` beside this file:

    {"configs":  {precision: {"DxH": {kernel: {field: value, ...}}}},
     "measured": {precision: {"DxH": {kernel: {"ms": ..., "tflops": ..., "gpu": ..., "date": ...}}}}}

with the fields of `TileConfig`. Shapes not in the table use the defaults below.

A user's own table (`titan-megamoe tune --out FILE`, the same schema) comes first when loaded with
`use_tile_table(FILE)` (the `[mega_moe] tile_table` setting calls it on every rank); what it lacks falls
back to the shipped table and the defaults.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .common import INTERPRET


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # row-tiled kernels: sorted rows per program (a plan tile or an equal part); wgrad: output rows
    block_n: int  # output columns (dgrad_swiglu: per accumulator, a program has two)
    block_k: int  # reduction step (wgrad: expert rows per step)
    num_warps: int
    num_stages: int
    tma: bool = False  # contiguous operands (weights, sorted rows) through TMA descriptors
    # dgrad_swiglu only: the GEMM stores q, a second elementwise kernel does the dSwiGLU (bf16 with tma:
    # dout's rows copied into sorted order first, q from the grouped GEMM through TMA)
    split: bool = False
    # Triton's automatic warp specialisation: gemm2 / dx with tma, and the weight gradients with sorted_copy;
    # with gluon (gemm2, dgrad's GEMM, dx; block_m 128, 8 warps) the persistent warp-specialised Gluon kernel
    # (`fp8_rows_ws_gluon`: a producer warp, two consumer warpgroups of 64 rows; block_n up to 256 there, and
    # GEMM1's block_n 128: its 128 columns in one pass)
    warp_specialize: bool = False
    group_m: int = 1  # row-tiled kernels: row programs walked down each N column together (schedule.row_tile)
    # weight gradients (bf16) with tma: the gathered operand (dout for dW2, x for dW1/dW3) copied into
    # sorted order first, so both operands come through TMA (mainloop.varlen_mainloop)
    sorted_copy: bool = False
    # block FP8 only, GPU only, both operands through TMA (so tma too): the Gluon kernels. Without
    # warp_specialize (gemm1_swiglu, gemm2, dgrad_swiglu's GEMM, dx) one item per program, each K block's
    # scaling overlapped with the next block's MMA (`fp8_gemm1_gluon`, `fp8_rows_gluon`); with it (those and
    # the weight gradients) the persistent warp-specialised kernels (`*_ws_gluon`)
    gluon: bool = False
    # gemm2, dx and dgrad's GEMM (with split and tma: then it is the grouped GEMM's): resident programs per
    # multiprocessor, each walking the tile schedule (grouped_gemm: with one operand pair Triton flattens that
    # loop with the K loop, so the next tile's loads overlap this tile's epilogue; dx's two K loops stay nested
    # unless pairs_in_one_loop; the weight gradients' resident form lost on the GPU, docs/kernels.md); 0: one
    # program per tile. Expert parallelism's symmetric-memory launches (stores to peers, waits for arriving
    # rows) take the one-program-per-tile kernel: same tiles, same per-tile math, bitwise the same result
    persistent: int = 0
    # dgrad_swiglu's own kernel (tma off, so dout is not copied into sorted order first): W2's tiles through TMA
    # descriptors while dout stays gathered by pointer, GEMM1's arrangement for its x and weights (where TMA
    # cannot cover W2, or H fits one column block, the same kernel loads it by pointer: the same result)
    weight_tma: bool = False
    # dx only, with tma: both operand pairs (dg W1, du W3) in one K loop, four tiles per pipeline stage, so a
    # persistent dx's tile loop flattens with it (mainloop.pair_mainloop); the sums in another order than the
    # two-pass loop's (not bitwise equal to it)
    pairs_in_one_loop: bool = False

    @classmethod
    def from_record(cls, raw: "list | dict") -> "TileConfig":
        """A config as a tuning run records it: named fields, or (older runs) the positional list."""
        if isinstance(raw, dict):
            names = {f.name for f in fields(cls)}
            unknown = set(raw) - names
            if unknown:
                raise ValueError(f"tile config: unknown fields {sorted(unknown)}; valid: {sorted(names)}")
            return cls(**raw)
        return cls(*raw)

    def to_record(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ROW_KERNELS = ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dx")
WGRAD_KERNELS = ("wgrad_w2", "wgrad_w13")
KERNELS = ROW_KERNELS + WGRAD_KERNELS
# the routing plan's tile rows: one tile schedule serves every row-tiled kernel, whose programs take a
# tile whole or in equal parts (TileConfig.block_m divides it)
ROW_BLOCK_M = 128
# defaults for shapes the table lacks, by expert size. Small experts: the winners at Qwen3-30B-A3B's shape
# on the H200 (split dgrad and TMA gemm2/dx also won at 235B-A22B's; TMA falls back to pointer loads where
# a tensor does not allow it). Weight gradients: dW2 over the gathered dout (128x256 tiles, s*h through
# TMA); dW1/dW3 from a sorted copy of x, in one-warpgroup programs, two per multiprocessor (1.80 against
# 1.97 ms for the gathered x at 30B-A3B; tune_wgrad_sorted_copy_20261204T1528.json). GEMM2 and dx as
# persistent programs (TileConfig.persistent): 0.710 against 0.772 ms and 1.505 against 1.543 ms at 30B-A3B on
# an H100 (tune_2048x768_20261205T172936.json); dgrad's W2 through TMA (weight_tma): 1.108 against 1.180 ms
# (tune_2048x768_20261205T175258.json)
_GPU_DEFAULTS = {
    "gemm1_swiglu": TileConfig(ROW_BLOCK_M, 128, 64, 8, 3),
    "gemm2": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True, persistent=1),
    "dgrad_swiglu": TileConfig(ROW_BLOCK_M, 128, 64, 8, 4, split=True, weight_tma=True),
    "dx": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True, persistent=1),
    "wgrad_w2": TileConfig(128, 256, 32, 8, 5, tma=True),
    "wgrad_w13": TileConfig(64, 128, 32, 4, 5, tma=True, sorted_copy=True),
}
# large experts (Mixtral-like, H >= LARGE_EXPERT_HIDDEN): the winners at D=4096, H=14336 (E=8, K=2,
# T=8192) on the H200, `titan-megamoe tune` (docs/results/tune_4096x14336_20261204T1249.json). They differ
# from the small-expert defaults most in dW2 (128x256 TMA tiles: 4.41 against 5.32 ms there), then GEMM1
# (one more stage through TMA: 8.26 against 8.50 ms) and dgrad (dout's rows copied into sorted order
# first, q through TMA: 4.13 against 4.22 ms; docs/results/tune_gathered_first_20261204T1300.json). The
# row kernels walk their programs in groups down each N column (group_m): an expert's W1 and W3 (235 MB)
# outgrow L2, and GEMM1 went from 8.26 to 6.53 ms with groups of 16 (tune_grouped_20261204T1318.json).
# The weight gradients read the gathered operand from a sorted copy (sorted_copy, both operands through
# TMA): dW2 4.44 -> 3.59 ms (warp-specialised), dW1/dW3 8.21 -> 6.36 (tune_wgrad_sorted_copy_20261204T1528.json)
LARGE_EXPERT_HIDDEN = 4096
_GPU_DEFAULTS_LARGE_EXPERT = {
    "gemm1_swiglu": TileConfig(ROW_BLOCK_M, 128, 64, 8, 4, tma=True, group_m=16),
    "gemm2": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True, group_m=8),
    "dgrad_swiglu": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True, split=True, group_m=16),  # dout gathered first
    "dx": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True, group_m=16),
    "wgrad_w2": TileConfig(128, 128, 64, 8, 3, tma=True, warp_specialize=True, sorted_copy=True),
    "wgrad_w13": TileConfig(128, 128, 64, 8, 4, tma=True, sorted_copy=True),
}
# block FP8: every reduction step is one 128-wide scale block (BLOCK_K = 128). Shapes the table lacks get
# the persistent warp-specialised Gluon kernels (`*_ws_gluon`) with the tiles that won at both tuned shapes
# (30B-A3B and 235B-A22B: the same tiles there, the stages differ; the fewer of the two here). Where a
# launch cannot take them (expert parallelism's symmetric-memory waits and peer stores, operands TMA cannot
# cover) the same config runs the Triton kernel, as the tuned entries do. Layer fwd+bwd on an H100 against
# the Triton tiles below: Mixtral-like 24.66 against 38.66 ms, OLMoE-like 5.73 against 6.50
# (docs/results/bench_layer_20261206T182007.json, ..._182049.json). Off Hopper (Gluon's wgmma is
# sm_90's) the Triton kernels' tiles below: programs of one warpgroup (64 rows, 4 warps), several per
# multiprocessor, which won every Triton FP8 kernel at both Qwen3 shapes on the H200, e.g. GEMM2 0.77 vs
# 0.95 ms and dW1/dW3 1.34 vs 3.13 ms against 128-row, 8-warp programs at 30B-A3B
# (docs/results/tune_*_fp8_20261204T*.json)
FP8_BLOCK = 128
_FP8_WS = TileConfig(ROW_BLOCK_M, 256, FP8_BLOCK, 8, 3, tma=True, warp_specialize=True, gluon=True)
_GPU_DEFAULTS_FP8 = {
    "gemm1_swiglu": replace(_FP8_WS, block_n=128),  # an item's 128 columns (one scale block of h) in one pass
    "gemm2": replace(_FP8_WS, num_stages=4),
    "dgrad_swiglu": replace(_FP8_WS, split=True),  # its GEMM (q); the dSwiGLU is its own kernel
    "dx": _FP8_WS,
    "wgrad_w2": replace(_FP8_WS, block_n=128, num_stages=4),
    "wgrad_w13": replace(_FP8_WS, block_n=128),
}
# large experts: the row kernels' items walked in groups down each column block (group_m, as for bf16's
# large experts above: an expert's weight outgrows L2); Mixtral-like 24.66 against 25.05 ms with group_m 1
# (bench_layer_20261206T182109.json; one round, within its noise)
_GPU_DEFAULTS_FP8_LARGE_EXPERT = {
    **_GPU_DEFAULTS_FP8,
    **{k: replace(_GPU_DEFAULTS_FP8[k], group_m=_GPU_DEFAULTS_LARGE_EXPERT[k].group_m) for k in ROW_KERNELS},
}
_FP8_HALF_TILE = TileConfig(64, 128, FP8_BLOCK, 4, 3, tma=True)
_GPU_DEFAULTS_FP8_TRITON = {
    "gemm1_swiglu": replace(_FP8_HALF_TILE, block_n=64),
    "gemm2": replace(_FP8_HALF_TILE, num_stages=4),
    "dgrad_swiglu": replace(_FP8_HALF_TILE, split=True),
    "dx": replace(_FP8_HALF_TILE, num_stages=4),
    "wgrad_w2": _FP8_HALF_TILE,  # 64 x 128 tiles of dW2's output
    "wgrad_w13": _FP8_HALF_TILE,
}
# the interpreter runs on CPU: small tiles keep the tests fast (FP8: the blocks above fix BLOCK_K, and
# the plan's tiles, at 128)
_INTERPRETER = TileConfig(16, 32, 32, 4, 1)
_INTERPRETER_FP8 = {  # half-tile programs (block_m 64) in three of the row kernels: both schedules tested
    "gemm1_swiglu": TileConfig(64, 64, FP8_BLOCK, 4, 1),
    "gemm2": TileConfig(64, 64, FP8_BLOCK, 4, 1),
    "dgrad_swiglu": TileConfig(64, 64, FP8_BLOCK, 4, 1, split=True),
    "dx": TileConfig(ROW_BLOCK_M, 64, FP8_BLOCK, 4, 1),
    "wgrad_w2": TileConfig(32, 32, FP8_BLOCK, 4, 1),
    "wgrad_w13": TileConfig(32, 32, FP8_BLOCK, 4, 1),
}
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
_overrides: dict[str, TileConfig] = {}
_user_table: dict = {}  # use_tile_table's configs: {precision: {"DxH": {kernel: TileConfig}}}
_user_table_source: str | None = None


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (decided when they were defined)."""
    return INTERPRET


def programs_per_plan_tile(cfg: TileConfig, plan_block_m: int) -> int:
    """How many programs of a row-tiled kernel share one plan tile: each takes cfg.block_m of its rows."""
    if plan_block_m % cfg.block_m:
        raise ValueError(f"tile config: block_m {cfg.block_m} does not divide the routing plan's tiles of "
                         f"{plan_block_m} rows; use {plan_block_m} or a divisor of it")
    return plan_block_m // cfg.block_m


def row_block_m(fp8: bool = False) -> int:
    """BLOCK_M of the routing plan's tiles. Block FP8 needs 128 everywhere: a tile is then one token
    block of the weight-gradient operands (quant.quantize_token_tiles)."""
    return _INTERPRETER.block_m if interpreting() and not fp8 else ROW_BLOCK_M


@functools.lru_cache(maxsize=1)
def _tuned_table() -> dict:
    if not TABLE_PATH.exists():  # an install without the package data: stop rather than run untuned tiles
        raise RuntimeError(f"titan-megamoe's shipped tile table {TABLE_PATH} is missing from this install; "
                           f"reinstall titan-megamoe (its wheel carries kernels/tuned_configs.json)")
    return json.loads(TABLE_PATH.read_text())["configs"]


def use_tile_table(path: "str | Path | None") -> str | None:
    """Make the kernels take their configs from a `titan-megamoe tune` table first (None: drop it).
    Every entry is checked here, so a bad file fails at load, naming the entry. Returns a short
    description (path and the first 12 hex digits of its sha256) for logs: ranks can be compared by it."""
    global _user_table, _user_table_source
    from ..validation import check_tile_config

    if path is None:
        _user_table, _user_table_source = {}, None
        _table_config.cache_clear()
        return None
    import hashlib

    path = Path(path)
    try:
        raw = path.read_bytes()
        entries = json.loads(raw)["configs"]
    except FileNotFoundError:
        raise ValueError(f"tile table {path} does not exist; make it with `titan-megamoe tune --out {path}` "
                         f"or unset it") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"tile table {path} is not a `titan-megamoe tune` table ({type(e).__name__}: {e})") from None
    table: dict = {}
    for precision, shapes in entries.items():
        for shape, kernels in shapes.items():
            for kernel, rec in kernels.items():
                where = f"tile table {path}: {precision} {shape} {kernel}"
                if kernel not in KERNELS:
                    raise ValueError(f"{where}: unknown kernel; valid: {', '.join(KERNELS)}")
                try:
                    cfg = TileConfig.from_record(rec)
                    check_tile_config(kernel, cfg, ROW_BLOCK_M, precision)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{where}: {e}") from None
                if cfg.gluon and not _gluon_gpu():  # the shipped table falls back; a user's own choice must not
                    raise ValueError(f"{where}: a Gluon kernel (\"gluon\": true), which issues sm_90 wgmma and needs "
                                     f"a Hopper GPU; this GPU is not one: retune the table on this GPU "
                                     f"(`titan-megamoe tune`) or drop the entry")
                table.setdefault(precision, {}).setdefault(shape, {})[kernel] = cfg
    _user_table = table
    _user_table_source = f"{path} (sha256 {hashlib.sha256(raw).hexdigest()[:12]})"
    _table_config.cache_clear()
    return _user_table_source


def tile_table_in_use() -> str | None:
    """The user table `use_tile_table` loaded (path and hash), or None."""
    return _user_table_source


def tile_config(kernel: str, dim: int, hidden: int, precision: str = "bf16") -> TileConfig:
    """The config of one kernel at one shape; `precision` is the precision that kernel's operands run
    in ("bf16" or "fp8": under fp8_bwd the forward kernels ask for "bf16", the backward ones "fp8")."""
    if kernel in _overrides:
        return _overrides[kernel]
    if interpreting():
        return _INTERPRETER_FP8[kernel] if precision == "fp8" else _INTERPRETER
    return _table_config(kernel, dim, hidden, precision)


def default_configs(hidden: int, precision: str) -> dict[str, TileConfig]:
    """The configs of a shape the table lacks, by expert size (GPU; before the Hopper check)."""
    large = hidden >= LARGE_EXPERT_HIDDEN
    if precision == "fp8":
        return _GPU_DEFAULTS_FP8_LARGE_EXPERT if large else _GPU_DEFAULTS_FP8
    return _GPU_DEFAULTS_LARGE_EXPERT if large else _GPU_DEFAULTS


@functools.lru_cache(maxsize=1)
def _gluon_gpu() -> bool:
    """False on a CUDA GPU other than Hopper: the Gluon kernels issue sm_90's wgmma. True without CUDA, so
    the table reads the same on a CPU host (nothing launches there)."""
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 9


@functools.lru_cache(maxsize=None)
def _table_config(kernel: str, dim: int, hidden: int, precision: str) -> TileConfig:
    user = _user_table.get(precision, {}).get(f"{dim}x{hidden}", {}).get(kernel)
    tuned = _tuned_table().get(precision, {}).get(f"{dim}x{hidden}", {}).get(kernel)
    cfg = user or (TileConfig.from_record(tuned) if tuned else default_configs(hidden, precision)[kernel])
    if cfg.gluon and not _gluon_gpu():  # shipped or default entries only: use_tile_table refuses these
        cfg = _GPU_DEFAULTS_FP8_TRITON[kernel]
    if kernel in ROW_KERNELS and precision != "fp8":
        # narrow problems (small D or H) must not ask for tiles wider than the matrix
        n_extent = hidden if kernel in ("gemm1_swiglu", "dgrad_swiglu") else dim
        while cfg.block_n > 64 and cfg.block_n >= 2 * n_extent:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@contextlib.contextmanager
def override_tile_config(kernel: str, cfg: TileConfig):
    """Force one kernel's config (the tuner and the variant tests use this)."""
    from ..validation import check_tile_config

    check_tile_config(kernel, cfg, ROW_BLOCK_M)  # the launch checks it against the plan in hand
    _overrides[kernel] = cfg
    try:
        yield
    finally:
        del _overrides[kernel]
