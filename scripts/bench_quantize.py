#!/usr/bin/env python3
"""The block-FP8 quantization kernels (titan_megamoe/kernels/quantize.py) on the GPU, one row per kernel
and launch shape: median ms (triton.testing.do_bench, L2 flushed before each call), GB/s and the fraction
of the H200's measured copy bandwidth (4300 GB/s), at Qwen3-30B-A3B's and Qwen3-235B-A22B's expert shapes
(T=16384 tokens, E=128, K=8: N=131072 routed rows in 128-row tiles; random bf16 inputs, random top-8
routing through build_routing_plan).

Rows, per shape (each kernel at every entry of its *_CONFIGS table, the launchers' default marked *):
  sorted rows      quantize_sorted_rows(x, plan): x [T, D] in 1x128 blocks, rows in sorted order
  token tiles      quantize_token_tiles(x, plan): the weight-gradient layout [D, tiles * 128]
  dout rows+tiles  quantize_sorted_rows(dout, plan, with_tiles=True), default launch shapes (both kernels)
  w13 pair, w2 pair  quantize_weight_pair(w): W and W^T of w1/w3 [E, H, D] and of w2 [E, D, H]
Bytes are counted as a gathering kernel moves them: N*D*2 read for the sorted rows and the tiles (each
token row once per routed copy), every output's bytes written. The sorted-rows kernel reads each token row
once (T*D*2), so its fraction of the copy bandwidth can pass 1.

Before it is timed, every result is compared byte for byte with titan_megamoe.quant on a slice (4096
sorted rows, the last 256 columns of the tiles, the first two experts' weights); a mismatch is reported
in its row, not timed, and the script exits 1 after the table.

    python scripts/bench_quantize.py            # both shapes, every launch shape (about a minute on an H200)
    python scripts/bench_quantize.py --quick    # 30B-A3B, the default launch shapes only
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

import torch
import triton

from titan_megamoe import quant
from titan_megamoe.kernels import quantize as Q
from titan_megamoe.kernels.routing_meta import build_routing_plan

DEVICE = "cuda"
COPY_GBPS = 4300.0  # the H200's measured copy bandwidth


class Shape(NamedTuple):
    T: int
    D: int
    H: int
    E: int
    K: int


SHAPES = {"30b-a3b": Shape(16384, 2048, 768, 128, 8), "235b-a22b": Shape(16384, 4096, 1536, 128, 8)}


class Row(NamedTuple):
    shape: str
    kernel: str
    config: str
    gbytes: float
    ms: float | None  # None: not timed (error)
    error: str  # what differs from quant.py, "" if nothing

    def line(self) -> str:
        head = f"{self.shape:10s} {self.kernel:16s} {self.config:8s}"
        if self.error:
            return f"{head} MISMATCH: {self.error}"
        gbps = self.gbytes / self.ms * 1e3
        return f"{head} {self.ms:8.3f} {gbps:8.0f} {gbps / COPY_GBPS:6.2f}"


HEADER = f"{'shape':10s} {'kernel':16s} {'config':8s} {'ms':>8s} {'GB/s':>8s} {'/4300':>6s}"


def time_ms(fn, quick: bool) -> float:
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=50 if quick else 100, return_mode="median")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _mismatch(q, ref, what: str) -> str:
    bad = [name for name in ("data", "scale") if not _same_bytes(getattr(q, name), getattr(ref, name))]
    return f"{what}: {', '.join(bad)} differ from titan_megamoe.quant" if bad else ""


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------ checks
# Each takes what a run returned and says what differs from quant.py on its slice ("" if nothing).


def check_sorted_rows(q, x, plan, sample) -> str:
    ref = quant.quantize_activation(x[plan.order_N[sample].long() // plan.rows_per_token])
    return _mismatch(type(q)(q.data[sample], q.scale[sample], q.block), ref, f"sorted rows {sample.numel()}")


def check_token_tiles(q, x, plan, cols: slice) -> str:
    ref = quant.quantize_token_tiles(x[:, cols][plan.order_N.long() // plan.rows_per_token], plan)
    return _mismatch(type(q)(q.data[cols], q.scale[cols], q.block), ref, f"token tiles, columns {cols}")


def check_weight_pair(pair, w) -> str:
    W, Wt = (type(q)(q.data[:2], q.scale[:2], q.block) for q in pair)
    return (_mismatch(W, quant.quantize_weight(w[:2]), "W")
            or _mismatch(Wt, quant.quantize_weight(w[:2].transpose(-2, -1).contiguous()), "W^T"))


# ------------------------------------------------------------------------------------------------ one shape


def bench_shape(name: str, s: Shape, quick: bool, default_only: bool) -> list[Row]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, dout = (torch.randn(s.T, s.D, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(2))
    w13 = torch.randn(s.E, s.H, s.D, device=DEVICE, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(s.E, s.D, s.H, device=DEVICE, generator=gen).to(torch.bfloat16)
    ids = torch.rand(s.T, s.E, device=DEVICE, generator=gen).topk(s.K, dim=1).indices
    plan = build_routing_plan(ids, s.E, Q.BLOCK)
    N, P = plan.num_rows, plan.layout.num_tiles * Q.BLOCK
    sample = torch.randperm(N, device=DEVICE, generator=gen)[:4096]
    last_cols = slice(s.D - 2 * Q.BLOCK, s.D)
    gathered_read = N * s.D * 2
    rows_written = N * s.D + N * (s.D // Q.BLOCK) * 4
    tiles_written = s.D * P + s.D * (P // Q.BLOCK) * 4

    def weight_bytes(w):
        return _nbytes(w) + 2 * (w.numel() + w.numel() // Q.BLOCK**2 * 4)

    # (kernel, config table, default, run(config), check(result), bytes)
    cases = [
        ("sorted rows", Q.SORTED_ROWS_CONFIGS, Q.DEFAULT_CONFIGS["sorted_rows"],
         lambda c: Q._launch_rows(x, plan.inv_N, s.K, c), lambda q: check_sorted_rows(q, x, plan, sample),
         gathered_read + rows_written),
        ("token tiles", Q.TOKEN_TILE_CONFIGS, Q.DEFAULT_CONFIGS["token_tiles"],
         lambda c: Q._launch_token_tiles(x, plan, s.K, False, c), lambda q: check_token_tiles(q, x, plan, last_cols),
         gathered_read + tiles_written),
        ("dout rows+tiles", {"default": None}, "default",
         lambda c: Q.quantize_sorted_rows(dout, plan, with_tiles=True),
         lambda r: check_sorted_rows(r[0], dout, plan, sample) or check_token_tiles(r[1], dout, plan, last_cols),
         gathered_read + rows_written + tiles_written),
        ("w13 pair", Q.WEIGHT_PAIR_CONFIGS, Q.DEFAULT_CONFIGS["weight_pair"],
         lambda c: Q._launch_weight_pair(w13, c), lambda r: check_weight_pair(r, w13), weight_bytes(w13)),
        ("w2 pair", Q.WEIGHT_PAIR_CONFIGS, Q.DEFAULT_CONFIGS["weight_pair"],
         lambda c: Q._launch_weight_pair(w2, c), lambda r: check_weight_pair(r, w2), weight_bytes(w2)),
    ]
    rows = []
    for kernel, configs, default, run, check, nbytes in cases:
        for config_name, config in configs.items():
            if default_only and config_name != default:
                continue
            error = check(run(config))
            ms = None if error else time_ms(lambda: run(config), quick)
            row = Row(name, kernel, config_name + ("*" if config_name == default else ""), nbytes / 1e9, ms, error)
            print(row.line(), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30B-A3B only, the default launch shapes only, shorter timing")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = ap.parse_args()
    names = [next(iter(SHAPES))] if args.quick else args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}, torch {torch.__version__}, "
          f"triton {triton.__version__}; * = the launchers' default; /4300: the fraction of the copy bandwidth",
          flush=True)
    print(HEADER, flush=True)
    rows = [row for n in names for row in bench_shape(n, SHAPES[n], args.quick, default_only=args.quick)]
    print("\n" + HEADER)
    for row in rows:
        print(row.line())
    failed = [f"{r.shape} {r.kernel} {r.config}" for r in rows if r.error]
    if failed:
        sys.exit(f"{len(failed)} result(s) differ from titan_megamoe.quant: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
