"""FP8 layer gradients in TorchTitan-1-GPU conditions (fp32 params, fp32 or bf16 x): triton vs emulation vs fp64."""
import json
import os
import sys

import torch

import titan_megamoe
from titan_megamoe.oracle import moe_reference

small = os.environ.get("SMALL") == "1"
dev = "cpu" if small else "cuda"
T, D, H, E, K = (300, 256, 256, 8, 2) if small else (16384, 2048, 768, 128, 8)
g = torch.Generator(device=dev).manual_seed(0)
x0 = torch.randn(T, D, device=dev, generator=g)
logits = torch.randn(T, E, device=dev, generator=g) + torch.linspace(0, 3, E, device=dev)
sc, ids = torch.softmax(logits, -1).topk(K, -1)
sc = sc / sc.sum(-1, keepdim=True)
w1_0 = torch.randn(E, H, D, device=dev, generator=g) * 0.02
w3_0 = torch.randn(E, H, D, device=dev, generator=g) * 0.02
w2_0 = torch.randn(E, D, H, device=dev, generator=g) * 0.02
dout0 = torch.randn(T, D, device=dev, generator=g) * 1e-4


def run(fn, xdt, wdt):
    x = x0.detach().to(xdt).clone().requires_grad_(True)
    s = sc.clone().requires_grad_(True)
    ws = [w.detach().to(wdt).clone().requires_grad_(True) for w in (w1_0, w2_0, w3_0)]
    out = fn(x, ids, s, *ws)
    out.backward(dout0.to(out.dtype))
    return {"out": out.detach().double(), "dx": x.grad.double(), "ds": s.grad.double(),
            "dw1": ws[0].grad.double(), "dw2": ws[1].grad.double(), "dw3": ws[2].grad.double()}


ref = run(lambda x, i, s, a, b, c: moe_reference(x, i, s, a, b, c, torch.float64), torch.float64, torch.float64)
variants = {
    "bf16_triton_x32_w32": ("bf16", "triton", torch.float32, torch.float32),
    "fp8_triton_x32_w32": ("fp8", "triton", torch.float32, torch.float32),
    "fp8_reference_x32_w32": ("fp8", "reference", torch.float32, torch.float32),
    "fp8_triton_xbf_w32": ("fp8", "triton", torch.bfloat16, torch.float32),
    "fp8_triton_xbf_wbf": ("fp8", "triton", torch.bfloat16, torch.bfloat16),
    "fp8_reference_xbf_wbf": ("fp8", "reference", torch.bfloat16, torch.bfloat16),
    "fp8_bwd_triton_x32_w32": ("fp8_bwd", "triton", torch.float32, torch.float32),
}
if small:
    os.environ["TRITON_INTERPRET"] = "1"
res = {}
for name, (p, b, xdt, wdt) in variants.items():
    try:
        got = run(lambda x, i, s, w1, w2, w3: titan_megamoe.moe(x, i, s, w1, w2, w3, precision=p, backend=b), xdt, wdt)
    except Exception as e:  # noqa: BLE001
        res[name] = f"error {type(e).__name__}: {str(e)[:300]}"
        print(name, res[name], flush=True)
        continue
    r = {}
    for k, v in ref.items():
        err = (got[k] - v).norm() / v.norm()
        sign = ((got[k] * v) > 0).double().mean() if k.startswith("dw") else None
        r[k] = {"rel_l2": float(err), **({"sign_agree": float(sign)} if sign is not None else {}),
                "nonfinite": int((~torch.isfinite(got[k])).sum())}
    res[name] = r
    print(name, json.dumps(r), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag.json"), "w"), indent=1)
