"""One tuning problem: every kernel's operands at one shape, and a call of each kernel on them.

The operands are made by the pipeline's own kernels (GEMM1 makes g, u, h; the dgrad makes dg, du, s*h),
so each kernel is timed on inputs like training's. `call(kernel, problem, precision)` returns a function
that runs that kernel once with whatever tile config is in force (`configs.override_tile_config`).
"""

from __future__ import annotations

import torch

from ..kernels import configs
from ..kernels.dgrad_swiglu import dgrad_swiglu
from ..kernels.gemm1_swiglu import gemm1_swiglu
from ..kernels.grouped_gemm import expert_down_proj, expert_h_grad, expert_input_grad
from ..kernels.quantize import quantize_sorted_rows, quantize_token_tiles, quantize_weight_pair
from ..kernels.routing_meta import build_routing_plan
from ..kernels.wgrad import expert_wgrad_w2, expert_wgrad_w2_fp8, expert_wgrad_w13, expert_wgrad_w13_fp8


def make_problem(D, H, E, K, T, seed=0, device="cuda", fp8=False):
    """Every kernel's bf16 operands at one shape (random top-K routing), made by the kernels themselves."""
    g = torch.Generator(device=device).manual_seed(seed)
    dev = dict(device=device)
    bf = torch.bfloat16
    x = torch.randn(T, D, generator=g, dtype=bf, **dev)
    ids = torch.argsort(torch.rand(T, E, generator=g, **dev), dim=1)[:, :K]
    scores = torch.softmax(torch.randn(T, K, generator=g, **dev), dim=1)
    w = lambda *s: (torch.randn(*s, generator=g, **dev) * 0.02).to(bf)  # noqa: E731
    w1, w3, w2 = w(E, H, D), w(E, H, D), w(E, D, H)
    plan = build_routing_plan(ids, E, configs.row_block_m(fp8))
    g_, u, h = gemm1_swiglu(x, w1, w3, plan, bf, "bf16")
    dout = torch.randn_like(x)
    dg, du, hs, _ = dgrad_swiglu(dout, w2, g_, u, scores.reshape(-1), plan, "bf16")
    return dict(x=x, w1=w1, w2=w2, w3=w3, plan=plan, g=g_, u=u, h=h, dout=dout, dg=dg, du=du, hs=hs,
                s=scores.reshape(-1))


def make_problem_fp8(D, H, E, K, T, seed=0, device="cuda"):
    """The block-FP8 operands of every kernel, made by the kernels that make them in training."""
    p = make_problem(D, H, E, K, T, seed, device, fp8=True)
    plan, bf = p["plan"], torch.bfloat16
    w1q, w2q, w3q = (quantize_weight_pair(p[n]) for n in ("w1", "w2", "w3"))
    x_rows = quantize_sorted_rows(p["x"], plan)
    _, _, h = gemm1_swiglu(x_rows, w1q[0], w3q[0], plan, bf, "fp8", sorted_rows=True)
    dout_rows, dout_tiles = quantize_sorted_rows(p["dout"], plan), quantize_token_tiles(p["dout"], plan)
    dg, du, (dg_t, du_t, hs_t), _ = dgrad_swiglu(dout_rows, w2q[1], p["g"], p["u"], p["s"], plan, "fp8")
    return dict(plan=plan, w1=w1q, w2=w2q, w3=w3q, x_rows=x_rows, h=h, dout_rows=dout_rows, dg=dg, du=du,
                dout_tiles=dout_tiles, dg_tiles=dg_t, du_tiles=du_t, hs_tiles=hs_t,
                x_tiles=quantize_token_tiles(p["x"], plan))


def kernel_call_fp8(kernel, p):
    plan, bf = p["plan"], torch.bfloat16
    return {
        "gemm1_swiglu": lambda: gemm1_swiglu(p["x_rows"], p["w1"][0], p["w3"][0], plan, bf, "fp8", sorted_rows=True),
        "gemm2": lambda: expert_down_proj(p["h"], p["w2"][0], plan, bf, "fp8"),
        "dgrad_swiglu": lambda: expert_h_grad(p["dout_rows"], p["w2"][1], plan, bf, "fp8"),
        "dx": lambda: expert_input_grad(p["dg"], p["du"], p["w1"][1], p["w3"][1], plan, bf, "fp8"),
        "wgrad_w2": lambda: expert_wgrad_w2_fp8(p["dout_tiles"], p["hs_tiles"], plan, bf),
        "wgrad_w13": lambda: expert_wgrad_w13_fp8(p["dg_tiles"], p["du_tiles"], p["x_tiles"], plan, bf),
    }[kernel]


def kernel_call(kernel, p):
    plan, bf = p["plan"], torch.bfloat16
    return {
        "gemm1_swiglu": lambda: gemm1_swiglu(p["x"], p["w1"], p["w3"], plan, bf, "bf16"),
        "gemm2": lambda: expert_down_proj(p["h"], p["w2"], plan, bf, "bf16"),
        "dgrad_swiglu": lambda: dgrad_swiglu(p["dout"], p["w2"], p["g"], p["u"], p["s"], plan, "bf16"),
        "dx": lambda: expert_input_grad(p["dg"], p["du"], p["w1"], p["w3"], plan, bf, "bf16"),
        "wgrad_w2": lambda: expert_wgrad_w2(p["dout"], p["hs"], plan, bf),
        "wgrad_w13": lambda: expert_wgrad_w13(p["dg"], p["du"], p["x"], plan, bf),
    }[kernel]


FLOPS_PER_NDH = {"gemm1_swiglu": 4, "gemm2": 2, "dgrad_swiglu": 2, "dx": 4, "wgrad_w2": 2, "wgrad_w13": 4}


def make(D, H, E, K, T, precision: str, seed=0, device="cuda") -> dict:
    return (make_problem_fp8 if precision == "fp8" else make_problem)(D, H, E, K, T, seed, device)


def call(kernel: str, p: dict, precision: str):
    return (kernel_call_fp8 if precision == "fp8" else kernel_call)(kernel, p)
