"""Shared MoE test inputs and the FlashAttention-style accuracy rule (CPU interpreter and GPU tests).

Realistic scales: x ~ N(0, 1), weights ~ N(0, 1/fan_in) (so activations stay O(1) at any D, H),
softmax-normalised top-k scores in fp32, and routing patterns that stress the kernels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

ROUTINGS = ("random", "skewed", "empty_experts", "one_expert", "duplicate_choices")


@dataclass
class Case:
    x: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor

    def inputs(self):
        return self.x, self.ids, self.scores, self.w1, self.w2, self.w3


def make_ids(T: int, E: int, K: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    if routing == "random":  # K distinct experts per token, like a top-k router
        return torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K]
    if routing == "skewed":  # Zipf-like popularity: a few experts get most rows
        logits = -1.5 * torch.log(torch.arange(1, E + 1, dtype=torch.float64))
        noisy = logits + 0.3 * torch.randn(T, E, generator=gen, dtype=torch.float64)
        return torch.topk(noisy, K, dim=1).indices
    if routing == "empty_experts":  # only every third expert is ever chosen
        used = torch.arange(0, E, 3)
        pick = torch.randint(0, used.numel(), (T, K), generator=gen)
        return used[pick]
    if routing == "one_expert":  # every choice of every token goes to the last expert
        return torch.full((T, K), E - 1, dtype=torch.int64)
    if routing == "duplicate_choices":  # a token may pick the same expert twice
        return torch.randint(0, min(E, 2), (T, K), generator=gen)
    raise ValueError(routing)


def make_case(T, D, H, E, K, routing="random", dtype=torch.bfloat16, device="cpu", seed=0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = make_ids(T, E, K, routing, gen)
    scores = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    w1 = torch.randn(E, H, D, generator=gen) / D**0.5
    w3 = torch.randn(E, H, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, H, generator=gen) / H**0.5
    to = dict(device=device)
    return Case(x.to(dtype=dtype, **to), ids.to(**to), scores.to(**to),
                w1.to(dtype=dtype, **to), w2.to(dtype=dtype, **to), w3.to(dtype=dtype, **to))


def forward_backward(fn, case: Case, dout: torch.Tensor, cast=None):
    """Run fn on leaf copies of the inputs (optionally cast), return out and grads of x, scores, w1, w2, w3."""
    def leaf(t):
        t = t.detach() if cast is None else t.detach().to(cast)
        return t.requires_grad_(True)

    x, s, w1, w2, w3 = (leaf(t) for t in (case.x, case.scores, case.w1, case.w2, case.w3))
    out = fn(x, case.ids, s, w1, w2, w3)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "dx": x.grad, "dscores": s.grad, "dw1": w1.grad, "dw2": w2.grad, "dw3": w3.grad}


def reference_results(case: Case, dout: torch.Tensor):
    """(float64 oracle, the same math done by PyTorch in bf16)."""
    # imported here: scripts/compare_revisions.py uses make_case with older revisions of the package
    from titan_megamoe.oracle import moe_reference

    ref64 = forward_backward(lambda *a: moe_reference(*a, compute_dtype=torch.float64), case, dout, torch.float64)
    torch_bf16 = forward_backward(lambda *a: moe_reference(*a, compute_dtype=torch.bfloat16), case, dout)
    return ref64, torch_bf16


def assert_flash_rule(got: dict, ref64: dict, torch_bf16: dict, factor: float = 2.0):
    """|got - ref64|.max() <= factor * max(|torch_bf16 - ref64|.max(), floor), for every output and gradient."""
    report = []
    for name, ref in ref64.items():
        g = got[name]
        assert g is not None and g.shape == ref.shape, f"{name}: shape {None if g is None else g.shape} != {ref.shape}"
        assert torch.isfinite(g).all(), f"{name}: non-finite values (an unwritten or poisoned element?)"
        err = (g.double() - ref).abs().max().item()
        base = (torch_bf16[name].double() - ref).abs().max().item()
        # floor: one bf16 rounding (2^-9 relative) of the largest value, the least error any bf16 result can
        # promise. It replaces the torch-bf16 error only where that is smaller, which happens for tensors of
        # a handful of elements (T=1, K=1) where torch's rounding errors can be zero or tiny by luck; it is
        # not added on top, so for every realistic tensor the rule is exactly `factor` x torch's error
        floor = 2.0**-9 * ref.abs().max().item()
        report.append(f"{name}: err {err:.3e} torch-bf16 {base:.3e} ({err / max(base, floor):.2f}x)")
        assert err <= factor * max(base, floor), (f"{name}: kernel error {err:.3e} > {factor} x max(torch bf16 error "
                                                  f"{base:.3e}, floor {floor:.3e})")
    return report


# The one-pass warp-specialised GEMM1 (128 columns, the shipped form) as Triton 3.6 (the GPU machine's) compiles
# it since e7cfa9f (block scales from amax's bits): one 64-bit value stored to the stack after an item's K loop
# and loaded back before h's stores (one STL.64 and one LDL.64 in the SASS at 28c30fb, both outside the K
# loop: once per item, not per K block). Triton 3.9 spills nothing there.
GEMM1_ONE_PASS_STACK = 8


def stack_bytes(usage: str) -> int:
    """Bytes of stack a thread uses (register spills) in the usage line of an sm_90 compile (`sm90_resources`)."""
    found = re.search(r"STACK:(\d+)", usage)
    assert found is not None, f"no STACK in the compile's usage line: {usage}"
    return int(found.group(1))


def sm90_compile_results(script: str, timeout: int = 600) -> dict:
    """Run a script that compiles kernels for sm_90 (scripts/sm90_resources.py) in a fresh process from the
    repository root, without TRITON_INTERPRET (under the interpreter nothing compiles), and return the
    JSON object its last output line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=timeout)
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def swapped_tiny_moe_layer(device, num_shared_experts: int = 0):
    """(TorchTitan's MoE layer of the tiny qwen3 flavor, swapped to mega_moe in place (bf16, Triton backend),
    its model dim). Callers on CPU patch torch.histc with `cpu.histc_int_cpu` first (stock's router counts
    integer ids)."""
    import dataclasses

    from torchtitan.models.moe.moe import MoE

    from titan_megamoe.integrations.torchtitan import registry
    from titan_megamoe.integrations.torchtitan.converter import swap_moe_layers

    args = registry.tiny_flavor()
    torch.manual_seed(0)
    layer = MoE(dataclasses.replace(args.moe_args, num_shared_experts=num_shared_experts), dim=args.dim,
                hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
    layer = layer.to(device, torch.bfloat16)
    layer.expert_bias, layer.tokens_per_expert = layer.expert_bias.float(), layer.tokens_per_expert.float()
    holder = torch.nn.Module()
    holder.moe = layer
    swap_moe_layers(holder, "bf16", "triton")
    return layer, args.dim
