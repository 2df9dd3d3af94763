#!/usr/bin/env python3
"""The symmetric-memory EP transport on one GPU, as far as one GPU allows.

torch's CUDA symmetric memory refuses two ranks on one device (docs/ep.md), so this runs a 1-rank NCCL group:
the EP path (`ep_dispatch.fused_moe_expert_parallel`) with ep_transport symm_mem, then all_to_all, against the
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
    from titan_megamoe.pipeline.ep_dispatch import fused_moe_expert_parallel
    from titan_megamoe.precision import recipe_for

    recipe = recipe_for("bf16", torch.device("cuda"))
    results = []
    for T in (512, 4096):
        case = make_case(T, 2048, 768, 16, 4, "random", device="cuda", dtype=torch.bfloat16, seed=T)
        dout = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        whole = forward_backward(lambda *t: titan_megamoe.moe(*t, backend="triton"), case, dout)
        # symm_mem with exact sizes, symm_mem without the host sync (capacity 1.5: a third of the rows
        # padding), all_to_all
        for transport, cf in (("symm_mem", None), ("symm_mem", 1.5), ("all_to_all", None)):
            ep = forward_backward(
                lambda *t: fused_moe_expert_parallel(*t, recipe, dist.group.WORLD, transport, cf), case, dout)
            results.append({"T": T, "precision": "bf16", "transport": transport, "capacity_factor": cf,
                            "bitwise": {k: bool(torch.equal(whole[k], ep[k])) for k in whole}})
            print(results[-1], flush=True)
        # block FP8 under EP (rows quantized where they land): against the single-process FP8 op
        for precision, transport, cf in (("fp8", "all_to_all", None), ("fp8_bwd", "symm_mem", 1.5)):
            whole8 = forward_backward(lambda *t: titan_megamoe.moe(*t, backend="triton", precision=precision),
                                      case, dout)
            r8 = recipe_for(precision, torch.device("cuda"))
            ep = forward_backward(
                lambda *t: fused_moe_expert_parallel(*t, r8, dist.group.WORLD, transport, cf), case, dout)
            results.append({"T": T, "precision": precision, "transport": transport, "capacity_factor": cf,
                            "bitwise": {k: bool(torch.equal(whole8[k], ep[k])) for k in whole8}})
            print(results[-1], flush=True)
    # the capacity path claims no host sync: run it once more (buffers already big enough) with torch's
    # sync debug mode raising on any synchronising CUDA call, and record what it says
    op = lambda *t: fused_moe_expert_parallel(*t, recipe, dist.group.WORLD, "symm_mem", 1.5)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(op, case, dout)
        host_syncs = "none raised"
    except RuntimeError as e:
        host_syncs = f"raised: {str(e)[:400]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"capacity path under sync debug mode 'error': {host_syncs}", flush=True)
    buffers = {f"{k[0]}/{k[1]}": v.nbytes for k, v in symm_transport._BUFFERS.items()}
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_layer import environment, result_path

    with open(result_path(a.out, "symm_mem_one_gpu"), "w") as f:
        json.dump({"environment": environment(), "buffer_bytes": buffers, "results": results,
                   "capacity_path_host_syncs": host_syncs}, f, indent=1)
    dist.destroy_process_group()
    if not all(all(r["bitwise"].values()) for r in results):
        raise SystemExit("symm_mem_one_gpu.py: a result differs from the single-process op")


if __name__ == "__main__":
    main()
