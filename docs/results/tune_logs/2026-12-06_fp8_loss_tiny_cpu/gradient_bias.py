# The layer (reference backend, CPU) at D=512 H=256 E=8 K=2 T=2048, three seeds: per output and gradient,
# its projection on the float64 result (<a, r> / <r, r>) and relative L2 error. Run: python3 gradient_bias.py
# projection coefficient <a, r>/<r, r> and rel L2 of each output/gradient vs a float64 reference
import torch, titan_megamoe
torch.manual_seed(0)
T, D, H, E, K = 2048, 512, 256, 8, 2
res = {}
for seed in range(3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    sc, ids = torch.softmax(logits, -1).topk(K, -1)
    w1 = torch.randn(E, H, D, generator=g) / D**0.5
    w3 = torch.randn(E, H, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, H, generator=g) / H**0.5
    dout = torch.randn(T, D, generator=g)
    def run(prec, dtype):
        ts = [t.clone().to(dtype).requires_grad_(True) for t in (x, sc, w1, w2, w3)]
        if dtype == torch.float64:
            from titan_megamoe.oracle import moe_reference
            out = moe_reference(ts[0], ids, ts[1], ts[2], ts[3], ts[4])
        else:
            out = titan_megamoe.moe(ts[0], ids, ts[1], ts[2], ts[3], ts[4], precision=prec, backend="reference")
        out.backward(dout.to(out.dtype))
        return [out.detach().double()] + [t.grad.double() for t in ts]
    ref = run("bf16", torch.float64)
    for prec in ("bf16", "fp8", "fp8_bwd"):
        got = run(prec, torch.float32) if prec != "bf16" else run("bf16", torch.bfloat16)
        for name, a, r in zip(("out", "dx", "ds", "dw1", "dw2", "dw3"), got, ref):
            proj = float((a * r).sum() / (r * r).sum())
            rel = float((a - r).norm() / r.norm())
            res.setdefault((prec, name), []).append((proj, rel))
for k, v in res.items():
    print(k, ' '.join(f"proj {p:.5f} rel {r:.4f}" for p, r in v))
