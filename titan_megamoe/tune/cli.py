"""`titan-megamoe tune`: tile configs for your own MoE shape, measured on your GPU, in a table file.

    titan-megamoe tune --shape D H E K T [--precision bf16,fp8] [--kernels ...] [--budget-seconds 600]
                       [--out tile_table.json] [--no-sorted-copy]

D, H: the model and expert hidden dims; E experts, top-K, T tokens per GPU (per micro-batch). Runs
offline (not during training), shows one line per candidate, keeps within the time budget, and resumes
where it stopped when run again with the same --out. Point training at the result with
`[mega_moe] tile_table = "tile_table.json"` (every rank reads the same file) or, from Python,
`titan_megamoe.use_tile_table("tile_table.json")`. Shapes and precisions the file lacks keep the shipped
table and defaults.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..kernels.configs import KERNELS

PRECISIONS = ("bf16", "fp8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-megamoe tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--shape", nargs=5, type=int, required=True, metavar=("D", "H", "E", "K", "T"))
    p.add_argument("--precision", default="bf16",
                   help="comma-separated: bf16 (the bf16 kernels) and/or fp8 (the block-FP8 kernels)")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--budget-seconds", type=float, default=600.0,
                   help="stop starting new candidates after this long (default 600); rerun to continue")
    p.add_argument("--out", default="tile_table.json", help="the table file (default ./tile_table.json)")
    p.add_argument("--no-sorted-copy", dest="sorted_copy", action="store_false",
                   help="leave out the weight-gradient configs that first copy an operand into sorted order "
                        "(faster at some shapes, but a transient [T*K, D] copy: 1 GiB at 235B-A22B, T=16384)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    D, H, E, K, T = args.shape
    if min(args.shape) < 1 or K > E:
        parser.error(f"--shape D H E K T must be positive with K <= E, got {args.shape}")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        parser.error(f"--precision takes {', '.join(PRECISIONS)} (comma-separated), got {args.precision!r}")
    if "fp8" in precisions and (D % 128 or H % 128):
        parser.error(f"block FP8 needs D and H multiples of 128 (got D={D}, H={H}); tune bf16 only")
    if args.budget_seconds <= 0:
        parser.error("--budget-seconds must be positive")
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"--out {out} is a directory; pass a file path, e.g. --out {out / 'tile_table.json'}")
    if not out.parent.is_dir():  # checked now: the table is first written after the first kernel is tuned
        parser.error(f"--out {out}: directory {out.parent} does not exist; create it or pass another path")
    import torch

    from .search import interpreter_device, tune

    device = interpreter_device()
    if device == "cuda" and not torch.cuda.is_available():
        print("titan-megamoe tune: needs a CUDA GPU (the timings are the GPU's); on CPU only "
              "TRITON_INTERPRET=1 runs it, as a check of the flow on small shapes", file=sys.stderr)
        return 2
    try:
        for precision in precisions:
            tune((D, H, E, K, T), precision, args.kernels, out, args.budget_seconds, device=device,
                 sorted_copy=args.sorted_copy)
    except ValueError as e:
        print(f"titan-megamoe tune: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"titan-megamoe tune: interrupted; finished candidates are in {out} (run again to continue)",
              file=sys.stderr)
        return 130
    return 0
