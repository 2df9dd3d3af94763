"""Tile configurations, one table for every row-tiled kernel: tuned offline, never autotuned in training.

Ranks must agree on the kernels they run and autotuning at training time can OOM, so a config is a
pure function of the problem's shape. `scripts/tune_kernels.py` measures candidates on the GPU and
writes `tuned_configs.json` beside this file (keyed by "DxH"); shapes not in it use the defaults.
The weight-gradient kernels keep their own table in wgrad.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # weight (and contiguous-row) operands through TMA descriptors instead of pointer loads
    split: bool = False  # dgrad_swiglu only: GEMM stores q, a second elementwise kernel does the dSwiGLU
    warp_specialize: bool = False  # gemm2 / dx with tma only: Triton's automatic warp specialisation


KERNELS = ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dx")
# every row-tiled kernel uses this BLOCK_M so that one tile schedule serves the whole pipeline
ROW_BLOCK_M = 128
# defaults for shapes the table lacks: the winners at Qwen3-30B-A3B's shape on the H200 (split dgrad and
# TMA gemm2/dx also won at 235B-A22B's; TMA falls back to pointer loads where a tensor does not allow it)
_GPU_DEFAULTS = {
    "gemm1_swiglu": TileConfig(ROW_BLOCK_M, 128, 64, 8, 3),
    "gemm2": TileConfig(ROW_BLOCK_M, 256, 64, 8, 3, tma=True),
    "dgrad_swiglu": TileConfig(ROW_BLOCK_M, 128, 32, 8, 4, split=True),  # BLOCK_N per accumulator (two)
    "dx": TileConfig(ROW_BLOCK_M, 256, 32, 8, 4, tma=True),
}
# the interpreter runs on CPU: small tiles keep the tests fast
_INTERPRETER = TileConfig(16, 32, 32, 4, 1)
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
_overrides: dict[str, TileConfig] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def row_block_m() -> int:
    return _INTERPRETER.block_m if interpreting() else ROW_BLOCK_M


@functools.lru_cache(maxsize=1)
def _tuned_table() -> dict:
    if not TABLE_PATH.exists():
        return {}
    return json.loads(TABLE_PATH.read_text())["configs"]


def tuned_entry(kernel: str, dim: int, hidden: int):
    """The shipped table's raw entry for a kernel at (D, H), or None (also under the interpreter)."""
    if interpreting():
        return None
    return _tuned_table().get(f"{dim}x{hidden}", {}).get(kernel)


def tile_config(kernel: str, dim: int, hidden: int) -> TileConfig:
    if interpreting():
        return _INTERPRETER
    if kernel in _overrides:
        return _overrides[kernel]
    return _table_config(kernel, dim, hidden)


@functools.lru_cache(maxsize=None)
def _table_config(kernel: str, dim: int, hidden: int) -> TileConfig:
    tuned = tuned_entry(kernel, dim, hidden)
    cfg = TileConfig(*tuned) if tuned else _GPU_DEFAULTS[kernel]
    # narrow problems (small D or H) must not ask for tiles wider than the matrix
    n_extent = hidden if kernel in ("gemm1_swiglu", "dgrad_swiglu") else dim
    while cfg.block_n > 64 and cfg.block_n >= 2 * n_extent:
        cfg = replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@contextlib.contextmanager
def override_tile_config(kernel: str, cfg: TileConfig):
    """Force one kernel's config (the tuner uses this); BLOCK_M must stay ROW_BLOCK_M."""
    if cfg.block_m != ROW_BLOCK_M:
        raise ValueError(f"{kernel}: block_m must be {ROW_BLOCK_M} (shared tile schedule), got {cfg.block_m}")
    _overrides[kernel] = cfg
    try:
        yield
    finally:
        del _overrides[kernel]
