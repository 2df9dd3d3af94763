#!/usr/bin/env python3
"""Where each kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

    ncu --set full --import-source yes --kernel-name regex:NAME -o prof python3 scripts/profile_layer.py ... --ncu
    ncu -i prof.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/ncu_source_stalls.py source.csv [--top 30]

Per kernel in the CSV: the warp-state samples by stall reason (share of all samples), then the instructions
with the most samples, each with its two largest stall reasons. Samples count every resident warp, the
idle ones too (a warp-specialised kernel's padding warps wait at a barrier for the whole kernel).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def kernel_tables(path: str):
    """(kernel name, header, rows) per kernel of ncu's `--page source --csv` output."""
    with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
        rows = list(csv.reader(f))
    i = 0
    while i < len(rows):
        if rows[i] and rows[i][0] == "Kernel Name":
            name, header, j = rows[i][1], rows[i + 1], i + 2
            while j < len(rows) and not (rows[j] and rows[j][0] == "Kernel Name"):
                j += 1
            yield name, header, [r for r in rows[i + 2:j] if len(r) >= len(header)]
            i = j
        else:
            i += 1


def _num(text: str) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass (or that, gzipped)")
    ap.add_argument("--top", type=int, default=25, help="instructions listed per kernel")
    a = ap.parse_args()
    for name, header, body in kernel_tables(a.csv):
        col = {h: k for k, h in enumerate(header)}
        samples = col["Warp Stall Sampling (All Samples)"]
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(_num(r[samples]) for r in body) or 1.0
        by_reason = collections.Counter({h[6:]: sum(_num(r[col[h]]) for r in body) for h in reasons})
        print(f"== {name}: {len(body)} SASS instructions, {total:.0f} samples")
        print("   " + ", ".join(f"{k} {v / total * 100:.1f}%" for k, v in by_reason.most_common(10)))
        for r in sorted(body, key=lambda r: -_num(r[samples]))[:a.top]:
            top2 = collections.Counter({h[6:]: _num(r[col[h]]) for h in reasons}).most_common(2)
            print(f"  {_num(r[samples]) / total * 100:5.1f}%  {r[1][:64]:64s} "
                  + ", ".join(f"{k} {v:.0f}" for k, v in top2))


if __name__ == "__main__":
    main()
