#!/usr/bin/env python3
"""The symmetric-memory EP transport on one GPU, as far as one GPU allows.

torch's CUDA symmetric memory refuses two ranks on one device (docs/ep.md), so this runs a 1-rank NCCL group:
the EP path (`ep_dispatch.FusedMoEExpertParallel`) with ep_transport symm_mem, then all_to_all, against the
single-process op, forward and backward, bitwise, at two sizes (the second makes the buffers grow). It
checks the CUDA side of `pipeline.symm_transport` (allocation, rendezvous, typed peer views at offsets,
the device barrier, the row-writing kernel at a mapped address and the flags with their device-side
wait, the peer being this rank itself), not the cross-GPU traffic. Writes symm_mem_one_gpu_<UTC time>.json
(GPU, versions, commit, date) into --out.

    python3 scripts/symm_mem_one_gpu.py --out /tmp/symm
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("symm_mem_one_gpu.py needs a CUDA GPU")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29541"),
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)

    from moe_cases import forward_backward, make_case

    import titan_megamoe
    from titan_megamoe.pipeline import symm_transport
    from titan_megamoe.pipeline.ep_dispatch import FusedMoEExpertParallel
    from titan_megamoe.precision import recipe_for

    recipe = recipe_for("bf16", torch.device("cuda"))
    results = []
    for T in (512, 4096):
        case = make_case(T, 2048, 768, 16, 4, "random", device="cuda", dtype=torch.bfloat16, seed=T)
        dout = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        whole = forward_backward(lambda *t: titan_megamoe.moe(*t, backend="triton"), case, dout)
        for transport in ("symm_mem", "all_to_all"):
            ep = forward_backward(lambda *t: FusedMoEExpertParallel.apply(*t, recipe, dist.group.WORLD, transport),
                                  case, dout)
            results.append({"T": T, "transport": transport,
                            "bitwise": {k: bool(torch.equal(whole[k], ep[k])) for k in whole}})
            print(results[-1], flush=True)
    buffers = {f"{k[0]}/{k[1]}": v.nbytes for k, v in symm_transport._BUFFERS.items()}
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_layer import environment, result_path

    with open(result_path(a.out, "symm_mem_one_gpu"), "w") as f:
        json.dump({"environment": environment(), "buffer_bytes": buffers, "results": results}, f, indent=1)
    dist.destroy_process_group()
    if not all(all(r["bitwise"].values()) for r in results):
        raise SystemExit("symm_mem_one_gpu.py: a result differs from the single-process op")


if __name__ == "__main__":
    main()
