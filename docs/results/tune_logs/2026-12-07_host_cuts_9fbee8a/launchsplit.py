"""Per-kernel host time inside launch(): _key, building values, compiled.run (Triton launcher incl. TMA
descriptor encoding and cuLaunchKernelEx), at 30b-512 fwd+bwd."""
import copy, sys, time, collections
import torch, triton
sys.path.insert(0, "scripts")
from bench_layer import CASES, build_layers, run_fwd_bwd
from titan_megamoe.kernels import launch as L
acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
def call(self, grid, args, kwargs):
    kernel = self.kernel
    t0 = time.perf_counter()
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    key = self._key(device, args, kwargs)
    compiled = self.compiled.get(key)
    if compiled is None:
        self.compiled[key] = kernel[grid](*args, **kwargs); return
    t1 = time.perf_counter()
    values = list(args)
    for name in self.names[len(args):]:
        values.append(kwargs[name] if name in kwargs else self.defaults[name])
    stream = driver.get_current_stream(device)
    t2 = time.perf_counter()
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *values)
    t3 = time.perf_counter()
    a = acc[kernel.fn.__name__]; a[0] += t1 - t0; a[1] += t2 - t1; a[2] += t3 - t2; a[3] += 1
L._FastLaunch.__call__ = call
stock, fused, x = build_layers(*CASES["30b-512"])
dout = torch.randn_like(x)
for p in sys.argv[1:] or ["bf16"]:
    layer = copy.deepcopy(fused); layer.experts.precision = p
    for _ in range(10): run_fwd_bwd(layer, x, dout)
    torch.cuda.synchronize(); acc.clear()
    n = 50
    for _ in range(n): run_fwd_bwd(layer, x, dout)
    torch.cuda.synchronize()
    print(f"== {p}: us per launch: key, values+stream, compiled.run")
    for name, (k, v, r, c) in sorted(acc.items(), key=lambda kv: -sum(kv[1][:3]) / kv[1][3]):
        print(f"  {k/c*1e6:6.1f} {v/c*1e6:6.1f} {r/c*1e6:6.1f}  x{c//n}  {name}")
