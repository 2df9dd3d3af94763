import copy, os, sys
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, "scripts")
from bench_layer import CASES, build_layers, run_fwd_bwd
out = os.environ.get("OUT", "/tmp")
stock, fused, x = build_layers(*CASES["30b-512"])
dout = torch.randn_like(x)
for p in sys.argv[1:] or ["bf16"]:
    layer = copy.deepcopy(fused); layer.experts.precision = p
    fn = lambda: run_fwd_bwd(layer, x, dout)
    for _ in range(5): fn()
    torch.cuda.synchronize()
    for rep in range(3):  # the first profiles pay CUPTI's buffer setup (ms-long stalls); keep the last
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3): fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out}/trace_{p}.json")
    print(f"===== {p}: key averages by self CPU")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t0 = min(e.time_range.start for e in evs)
    print(f"===== {p}: CPU events >= 8 us in start order (thread, start us, dur us, name)")
    for e in sorted(evs, key=lambda e: e.time_range.start):
        d = e.time_range.end - e.time_range.start
        if d >= 8:
            print(f"  t{e.thread % 1000:3d} {e.time_range.start - t0:9.1f} {d:8.1f}  {e.name[:90]}")
