"""Host time of one fused fwd+bwd at 30b-512, split: inside launch() vs everything else; and the call
with launch() stubbed (no kernels: the pure Python/torch host cost). Main thread only (backward run on
the main thread by calling the pipeline's functions through autograd with a single-thread engine? no:
we time the whole call with perf_counter and sum launch() time from both threads)."""
import copy, sys, time, collections, threading
import torch
sys.path.insert(0, "scripts")
from bench_layer import CASES, build_layers, run_fwd_bwd
import titan_megamoe.kernels as K
import importlib
mods = [importlib.import_module("titan_megamoe.kernels." + m) for m in
        "wgrad grouped_gemm gemm1_swiglu dgrad_swiglu dswiglu_fp8_gluon quantize fp8_rows_gluon fp8_rows_ws_gluon routing_meta router_topk sorted_rows fp8_gemm1_gluon combine quantize_gluon".split()]
from titan_megamoe.kernels import launch as L
orig = L.launch
acc = collections.defaultdict(float); cnt = collections.Counter()
STUB = [False]
def timed(kernel, grid, *a, **k):
    t = time.perf_counter()
    if not STUB[0]:
        orig(kernel, grid, *a, **k)
    acc[kernel.fn.__name__] += time.perf_counter() - t; cnt[kernel.fn.__name__] += 1
for m in mods: m.launch = timed
stock, fused, x = build_layers(*CASES["30b-512"])
dout = torch.randn_like(x)
for p in sys.argv[1:] or ["bf16"]:
    layer = copy.deepcopy(fused); layer.experts.precision = p
    fn = lambda: run_fwd_bwd(layer, x, dout)
    for _ in range(10): fn()
    torch.cuda.synchronize()
    for stub in (False, True):
        STUB[0] = stub; acc.clear(); cnt.clear()
        n = 50
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n):
            fn()
            if stub: torch.cuda.synchronize()
        tot = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        print(f"== {p} stub={stub}: {tot:.0f} us/call wall, inside launch() {sum(acc.values())/n*1e6:.0f} us")
        for name, s in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"   {s/n*1e6:7.1f} us  x{cnt[name]//n}  {name}")
    STUB[0] = False
