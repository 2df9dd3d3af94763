"""The reference backend against TorchTitan 0.2.2's own MoE layer: output and every gradient.

fp32 model: the reference reproduces stock's rounding (bf16 expert GEMMs, fp32 combine), so the two
agree to fp32 rounding. bf16 model: both are compared with a float64 run of stock's own for-loop
experts, and ours must stay within 2x of stock's error (the FlashAttention rule).
"""

import copy

import pytest
import torch
from torchtitan.models.moe.moe import MoE, MoEArgs

from titan_megamoe.integrations.torchtitan import cpu
from titan_megamoe.integrations.torchtitan.converter import swap_moe_layers

CASES = [
    # T, D, H, E, K, routing
    (13, 48, 24, 6, 2, "random"),
    (1, 32, 16, 4, 2, "random"),
    (7, 32, 16, 8, 1, "one_expert"),
    (20, 32, 40, 9, 3, "empty_experts"),
    (16, 64, 32, 8, 2, "balanced"),
    (24, 32, 16, 8, 2, "skewed"),
]


@pytest.fixture(scope="module", autouse=True)
def cpu_torchtitan():
    cpu.apply()  # stock's router calls histc on int64 and pads with a CUDA-only kernel: the CPU fixes


def build_stock(D, H, E, K, routing, seed):
    args = MoEArgs(num_experts=E, num_shared_experts=0, top_k=K, score_func="softmax", route_norm=True,
                   score_before_experts=False, _debug_force_load_balance=routing == "balanced")
    torch.manual_seed(seed)
    m = MoE(args, dim=D, hidden_dim=H)
    with torch.no_grad():
        m.init_weights(init_std=0.1, buffer_device=torch.device("cpu"))
        # expert_bias changes only which experts are picked: it makes the routing adversarial
        if routing == "one_expert":
            m.expert_bias[-1] = 10.0
        elif routing == "empty_experts":
            m.expert_bias[torch.arange(E) % 3 != 0] = -10.0
        elif routing == "skewed":
            m.expert_bias.copy_(0.3 / torch.arange(1, E + 1).float())
    return m


def run(layer, x, dout):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(dout.to(out.dtype))
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


def mega_copy(stock):
    mega = copy.deepcopy(stock)
    assert swap_moe_layers(mega, "bf16", "reference") == 1
    return mega


@pytest.mark.parametrize("T,D,H,E,K,routing", CASES)
def test_fp32_model_matches_stock_to_fp32_rounding(T, D, H, E, K, routing):
    stock = build_stock(D, H, E, K, routing, seed=T)
    x = torch.randn(1, T, D)
    dout = torch.randn(1, T, D)
    want, got = run(stock, x, dout), run(mega_copy(stock), x, dout)
    assert set(want) == set(got) >= {"out", "x", "experts.w1", "experts.w2", "experts.w3", "router.gate.weight"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("T,D,H,E,K,routing", CASES)
def test_bf16_model_flash_rule_against_float64(T, D, H, E, K, routing):
    stock32 = build_stock(D, H, E, K, routing, seed=T)
    x = torch.randn(1, T, D)
    dout = torch.randn(1, T, D)
    oracle = copy.deepcopy(stock32).double()
    oracle.experts.use_grouped_mm = False  # stock's own for-loop experts run in float64
    ref = run(oracle, x.double(), dout.double())
    stock_bf16 = copy.deepcopy(stock32).to(torch.bfloat16)
    for layer in (stock_bf16,):
        layer.expert_bias, layer.tokens_per_expert = stock32.expert_bias.clone(), stock32.tokens_per_expert.clone()
    mega_bf16 = mega_copy(stock_bf16)
    base, got = run(stock_bf16, x.bfloat16(), dout), run(mega_bf16, x.bfloat16(), dout)
    for name, r in ref.items():
        err = (got[name].double() - r).abs().max().item()
        base_err = (base[name].double() - r).abs().max().item()
        floor = 2.0**-9 * r.abs().max().item()  # as in moe_cases.assert_flash_rule: replaces, never adds
        assert err <= 2 * max(base_err, floor), f"{name}: mega {err:.3e} vs stock bf16 {base_err:.3e}"
