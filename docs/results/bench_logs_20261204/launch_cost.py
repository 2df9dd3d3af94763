"""Host cost of one launch, piece by piece (no profiler), 30B-A3B shapes at T=512."""
import inspect, statistics, sys, time
import torch, triton
sys.path.insert(0, "scripts")
from titan_megamoe.kernels import grouped_gemm as gg, gemm1_swiglu as g1
from titan_megamoe.kernels.common import matrix_descriptor
from titan_megamoe.kernels.configs import row_block_m, tile_config
from titan_megamoe.kernels.routing_meta import build_routing_plan

def us(fn, n=300, reps=5):
    fn(); torch.cuda.synchronize(); out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        out.append((time.perf_counter() - t0) / n * 1e6); torch.cuda.synchronize()
    return statistics.median(out)

T, D, H, E, K = 512, 2048, 768, 128, 8
dev = "cuda"; bf = torch.bfloat16
x = torch.randn(T, D, device=dev, dtype=bf)
ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
w1, w3 = (torch.randn(E, H, D, device=dev, dtype=bf) * 0.02 for _ in range(2))
w2 = torch.randn(E, D, H, device=dev, dtype=bf) * 0.02
plan = build_routing_plan(ids, E, row_block_m())
g, u, h = g1.gemm1_swiglu(x, w1, w3, plan, bf, "bf16")
res = {}
res["torch.empty"] = us(lambda: torch.empty((4096, 768), dtype=bf, device=dev))
res["matrix_descriptor"] = us(lambda: matrix_descriptor(w2, [256, 64]))
res["build_routing_plan"] = us(lambda: build_routing_plan(ids, E, row_block_m()))
res["gemm1 wrapper"] = us(lambda: g1.gemm1_swiglu(x, w1, w3, plan, bf, "bf16"))
res["gemm2 wrapper"] = us(lambda: gg.expert_down_proj(h, w2, plan, bf, "bf16"))

def capture(kernel, launch):
    """Run `launch` once with kernel.__getitem__ patched to record the grid, args and kwargs."""
    rec = {}
    orig = type(kernel).__getitem__
    def getitem(self, grid):
        def call(*a, **kw):
            rec.update(grid=grid, args=a, kw=kw)
            return orig(self, grid)(*a, **kw)
        return call
    type(kernel).__getitem__ = getitem
    try:
        launch()
    finally:
        type(kernel).__getitem__ = orig
    return rec

for name, kernel, launch in (("gemm1", g1._gemm1_swiglu_kernel, lambda: g1.gemm1_swiglu(x, w1, w3, plan, bf, "bf16")),
                             ("gemm2", gg._grouped_gemm_kernel, lambda: gg.expert_down_proj(h, w2, plan, bf, "bf16"))):
    rec = capture(kernel, launch)
    grid, a, kw = rec["grid"], rec["args"], rec["kw"]
    res[f"{name}: jit launch, args prebuilt"] = us(lambda: kernel[grid](*a, **kw))
    ck = kernel[grid](*a, **kw)
    kw2 = {k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")}
    ba = inspect.signature(kernel.fn).bind(*a, **kw2); ba.apply_defaults()
    vals = list(ba.arguments.values())
    stream = torch.cuda.current_stream().cuda_stream
    try:
        fn = ck.function
        res[f"{name}: CompiledKernel.run direct"] = us(lambda: ck.run(grid[0], 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *vals))
    except Exception as e:
        print(name, "direct failed", type(e).__name__, e)
    try:
        binder = kernel.device_caches[0][-1]
        res[f"{name}: binder only"] = us(lambda: binder(*a, **kw))
    except Exception as e:
        print(name, "binder failed", type(e).__name__, e)
    print(name, "args", len(vals), "descriptors", sum(type(v).__name__ == "TensorDescriptor" for v in vals), flush=True)
for k, v in res.items():
    print(f"{k:<45}{v:8.1f} us")
