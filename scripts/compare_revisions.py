#!/usr/bin/env python3
"""Bitwise comparison of two revisions of the fused op on the GPU test shapes.

Two revisions of the package cannot share a process (both register the `titan_megamoe::` custom
ops), so each run writes a fingerprint of every output and gradient (SHA-256 of the bytes, plus
sum and max |x| in float64 for a size of any difference) and a third call compares two fingerprints:

    PYTHONPATH=old_checkout python3 scripts/compare_revisions.py --save old.json
    python3 scripts/compare_revisions.py --save new.json
    python3 scripts/compare_revisions.py --compare old.json new.json [--out DIR]

The inputs are the cases of tests/test_gpu_kernels.py (the same `make_case` seeds), run through the
public `titan_megamoe.moe` with the Triton backend, forward and backward.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# T, D, H, E, K, routing: tests/test_gpu_kernels.py's CASES
CASES = {
    "30b-a3b": (4096, 2048, 768, 128, 8, "random"),
    "235b-a22b": (2048, 4096, 1536, 128, 8, "random"),
    "odd-1536x512-e60": (1000, 1536, 512, 60, 4, "random"),
    "T1": (1, 1536, 512, 60, 4, "random"),
    "T3": (3, 2048, 768, 128, 8, "random"),
    "skewed": (2048, 2048, 768, 128, 8, "skewed"),
    "empty-experts": (1000, 1024, 512, 64, 4, "empty_experts"),
    "one-hot-expert": (1000, 1024, 512, 64, 4, "one_expert"),
    "K1": (1500, 2048, 768, 128, 1, "random"),
    "E256-K16": (777, 1088, 320, 256, 16, "random"),
}


def fingerprint(t: torch.Tensor) -> dict:
    t = t.detach().contiguous()
    digest = hashlib.sha256(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    d = t.double()
    return {"sha256": digest, "dtype": str(t.dtype), "shape": list(t.shape), "sum": d.sum().item(),
            "absmax": d.abs().max().item() if t.numel() else 0.0}


def save(path: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import titan_megamoe
    from moe_cases import forward_backward, make_case

    result = {"package": os.path.dirname(titan_megamoe.__file__), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "cases": {}}
    for name, (T, D, H, E, K, routing) in CASES.items():
        case = make_case(T, D, H, E, K, routing, device="cuda", seed=T + E)
        dout = torch.randn(T, D, device="cuda", dtype=torch.bfloat16,
                           generator=torch.Generator(device="cuda").manual_seed(T))
        got = forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton"), case, dout)
        result["cases"][name] = {k: fingerprint(v) for k, v in got.items()}
        print(f"[fingerprint] {name}", flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({result['package']})")


def compare(a_path: str, b_path: str, out_dir: str | None) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    rows, differ = [], 0
    for name in CASES:
        for key, fa in a["cases"][name].items():
            fb = b["cases"][name][key]
            same = fa["sha256"] == fb["sha256"]
            differ += not same
            rel = abs(fa["sum"] - fb["sum"]) / max(abs(fa["sum"]), 1e-30)
            rows.append({"case": name, "tensor": key, "bitwise_equal": same, "rel_sum_diff": rel})
            print(f"{name:<18}{key:<8}{'equal' if same else 'DIFFERENT':<10}"
                  f"{'' if same else f'rel. sum difference {rel:.2e}'}")
    print(f"{len(rows) - differ} of {len(rows)} tensors bitwise equal")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        path = os.path.join(out_dir, f"compare_revisions_{stamp}.json")
        with open(path, "w") as f:
            json.dump({"a": {k: v for k, v in a.items() if k != "cases"},
                       "b": {k: v for k, v in b.items() if k != "cases"}, "rows": rows,
                       "bitwise_equal": len(rows) - differ, "tensors": len(rows)}, f, indent=1)
        print(f"wrote {path}")
    return 1 if differ else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", metavar="JSON")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    ap.add_argument("--out", help="with --compare: directory for the comparison JSON")
    a = ap.parse_args()
    if a.save:
        if not torch.cuda.is_available():
            raise SystemExit("compare_revisions.py --save needs a CUDA GPU")
        save(a.save)
    elif a.compare:
        raise SystemExit(compare(*a.compare, a.out))
    else:
        ap.error("give --save JSON or --compare A_JSON B_JSON")


if __name__ == "__main__":
    main()
