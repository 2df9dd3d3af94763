"""Host cost of the pieces of build_routing_plan and the gemm1 wrapper (no profiler), T=512 30B shapes."""
import statistics, sys, time, os
import torch, triton
from titan_megamoe.kernels import gemm1_swiglu as g1, routing_meta as rm
from titan_megamoe.kernels.common import matrix_descriptor, new_output
from titan_megamoe.kernels.configs import row_block_m, tile_config
from titan_megamoe.plan import PlanLayout

def us(fn, n=300, reps=7):
    fn(); torch.cuda.synchronize(); out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        out.append((time.perf_counter() - t0) / n * 1e6); torch.cuda.synchronize()
    return statistics.median(out)

T, D, H, E, K = int(sys.argv[1]) if len(sys.argv) > 1 else 512, 2048, 768, 128, 8
dev = "cuda"; bf = torch.bfloat16
x = torch.randn(T, D, device=dev, dtype=bf)
ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
w1, w3 = (torch.randn(E, H, D, device=dev, dtype=bf) * 0.02 for _ in range(2))
plan = rm.build_routing_plan(ids, E, row_block_m())
ids_N = ids.reshape(-1); i16 = ids_N.clamp(-1, E).to(torch.int16)
res = {}
res["empty Triton launch x1 (3 args)"] = None
res["ids.reshape(-1)"] = us(lambda: ids.reshape(-1))
res["clamp"] = us(lambda: ids_N.clamp(-1, E))
res["clamp+to(int16)"] = us(lambda: ids_N.clamp(-1, E).to(torch.int16))
res["torch.sort int16 stable"] = us(lambda: torch.sort(i16, stable=True))
res["torch.sort int64 stable"] = us(lambda: torch.sort(ids_N, stable=True))
res["torch.empty packed"] = us(lambda: torch.empty(100000, dtype=torch.int32, device=dev))
res["PlanLayout + from_packed"] = us(lambda: rm.RoutingPlan.from_packed(plan.packed, PlanLayout(T * K, E, 128, K)))
res["build_routing_plan"] = us(lambda: rm.build_routing_plan(ids, E, row_block_m()))
cfg = tile_config("gemm1_swiglu", D, H, "bf16")
print("gemm1 cfg", cfg)
N = T * K
res["new_output x3"] = us(lambda: [new_output((N, H), bf, x.device) for _ in range(3)])
res["torch.empty x3 (device obj)"] = us(lambda: [torch.empty((N, H), dtype=bf, device=x.device) for _ in range(3)])
res["x.device"] = us(lambda: x.device)
res["matrix_descriptor x2"] = us(lambda: [matrix_descriptor(w, [cfg.block_n, cfg.block_k]) for w in (w1, w3)])
res["tile_config"] = us(lambda: tile_config("gemm1_swiglu", D, H, "bf16"))
res["plan.layout.num_tiles"] = us(lambda: plan.layout.num_tiles)
res["gemm1 wrapper"] = us(lambda: g1.gemm1_swiglu(x, w1, w3, plan, bf, "bf16"))
res["gemm1 wrapper (again)"] = us(lambda: g1.gemm1_swiglu(x, w1, w3, plan, bf, "bf16"))
for k, v in res.items():
    if v is not None:
        print(f"{k:<40}{v:8.1f} us")
