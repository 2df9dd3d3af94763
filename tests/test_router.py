"""The fused router (`titan_megamoe.topk_route`) against TorchTitan 0.2.2's own router.

On CPU the kernel runs in Triton's interpreter; on a GPU compiled. Same chosen experts per token (as
sets: stock's top-k order is unspecified), the same scores at each chosen expert, and the same gradient
of the gate weight, for softmax and sigmoid scoring, with and without expert bias and route_norm.
"""

import pytest
import torch

from titan_megamoe.kernels.router_topk import router_topk, router_topk_backward
from titan_megamoe.oracle import router_logits_grad_reference, router_reference
from titan_megamoe.router import topk_route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every router output starts as NaN (ids: int64 min), so an element the kernel does not write fails."""
    monkeypatch.setenv("TITAN_MEGAMOE_POISON", "1")


@pytest.fixture(autouse=True)
def _histc_on_cpu(monkeypatch):
    """The stock router counts tokens with torch.histc(int64), which CPU lacks: the same wrapper the
    CPU training path installs (titan_megamoe.integrations.torchtitan.cpu)."""
    from titan_megamoe.integrations.torchtitan.cpu import histc_int_cpu

    monkeypatch.setattr(torch, "histc", histc_int_cpu(torch.histc))


def _by_id(scores, ids):
    """Scores and ids re-ordered by id within each token, so unordered top-k sets compare."""
    ids_sorted, order = ids.sort(dim=1)
    return scores.gather(1, order), ids_sorted


def _stock_router(D, E, K, score_func, route_norm, route_scale):
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    r = TokenChoiceTopKRouter(dim=D, num_experts=E, num_expert_groups=None, num_limited_groups=None, top_k=K,
                              score_func=score_func, route_norm=route_norm, route_scale=route_scale, gate_bias=False)
    torch.nn.init.normal_(r.gate.weight, std=0.5)
    return r.to(DEVICE)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm,route_scale", [(True, 1.0), (False, 2.5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("T,D,E,K", [(37, 32, 8, 2), (1, 16, 60, 4), (3, 16, 128, 8), (65, 32, 256, 16),
                                     (20, 16, 5, 5)])
def test_fused_router_matches_torchtitan_router(score_func, route_norm, route_scale, with_bias, T, D, E, K):
    torch.manual_seed(T * E + K)
    stock = _stock_router(D, E, K, score_func, route_norm, route_scale)
    x = torch.randn(T, D, device=DEVICE)
    bias = (torch.randn(E, device=DEVICE) * 0.05) if with_bias else None

    s_ref, ids_ref, _ = stock(x, bias)
    logits = stock.gate(x)
    s_got, ids_got = topk_route(logits, bias, K, score_func, route_norm, route_scale)
    assert ids_got.dtype == torch.int64 and s_got.dtype == torch.float32 and s_got.shape == (T, K)
    s_ref, ids_ref = _by_id(s_ref, ids_ref)
    s_got_sorted, ids_got_sorted = _by_id(s_got, ids_got)
    assert torch.equal(ids_got_sorted, ids_ref)
    torch.testing.assert_close(s_got_sorted, s_ref, rtol=2e-6, atol=1e-7)
    # ids come out in descending order of p + bias
    p = torch.softmax(logits.float(), 1) if score_func == "softmax" else torch.sigmoid(logits.float())
    choice = (p if bias is None else p + bias).gather(1, ids_got)
    assert (choice[:, :-1] >= choice[:, 1:]).all()

    # gradient into the gate weight through the scores, with a weight per (token, k) that follows the id
    w_TE = torch.randn(T, E, device=DEVICE)
    grads = []
    for s, ids in ((stock(x, bias)[0], stock(x, bias)[1]), topk_route(stock.gate(x), bias, K, score_func,
                                                                      route_norm, route_scale)):
        stock.gate.weight.grad = None
        (s * w_TE.gather(1, ids)).sum().backward()
        grads.append(stock.gate.weight.grad.clone())
    # both fp32, summed over T tokens in different orders: agree to fp32 rounding of the largest entry
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5 * grads[0].abs().max().item())


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("route_norm,route_scale", [(True, 1.0), (False, 2.5), (True, 0.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K", [(1, 8, 1), (45, 60, 4), (33, 128, 8), (17, 256, 16), (9, 5, 5)])
def test_router_backward_kernel_matches_its_torch_oracle(score_func, route_norm, route_scale, dtype, T, E, K):
    """The one-launch backward against the same math in torch ops, on the forward's own ids and raw p,
    with a poisoned output (an element the kernel does not write stays NaN), fp32 and bf16 logits."""
    torch.manual_seed(T + E + K)
    logits = (torch.randn(T, E, device=DEVICE) * 2).to(dtype)
    _, ids, raw = router_topk(logits, None, K, score_func, route_norm, route_scale)
    d_scores = torch.randn(T, K, device=DEVICE)
    got = router_topk_backward(d_scores, logits, ids, raw, score_func, route_norm, route_scale)
    want = router_logits_grad_reference(d_scores, logits, ids, raw, score_func, route_norm, route_scale)
    assert got.dtype == dtype and got.shape == (T, E)
    assert torch.isfinite(got).all()
    # absolute slack on the gradient's own scale, |d scores| * route_scale: with K=1 and route_norm the
    # exact gradient is 0 and both sides hold only rounding noise of that scale
    atol = 1e-6 * route_scale * d_scores.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    else:  # the same fp32 math rounded once to bf16: at most one bf16 ulp apart (2^-7 relative)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=atol)


def test_reference_is_stock_math():
    torch.manual_seed(0)
    stock = _stock_router(32, 16, 4, "softmax", True, 1.0)
    x = torch.randn(50, 32, device=DEVICE)
    bias = torch.randn(16, device=DEVICE) * 0.05
    s_ref, ids_ref, _ = stock(x, bias)
    s, ids = router_reference(stock.gate(x), bias, 4)
    assert torch.equal(ids, ids_ref) and torch.equal(s, s_ref)


def test_ties_pick_the_lowest_expert_id():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = 1.0
    s, ids = topk_route(logits, None, 2)
    assert ids[0].tolist() == [0, 1] and ids[2].tolist() == [0, 1]
    assert ids[1].tolist() == [5, 0]
    torch.testing.assert_close(s.sum(1), torch.ones(3, device=DEVICE))


def test_nan_and_infinite_logits_still_give_distinct_valid_ids():
    logits = torch.randn(4, 12, device=DEVICE)
    logits[0] = float("nan")
    logits[1, :] = float("-inf")
    logits[2, 3:9] = float("nan")  # one NaN makes the whole softmax row NaN
    logits[3, ::2] = float("-inf")
    for score_func in ("softmax", "sigmoid"):
        _, ids = topk_route(logits, None, 8, score_func=score_func)
        assert ((ids >= 0) & (ids < 12)).all(), score_func
        assert all(len(set(row)) == 8 for row in ids.tolist()), score_func
        assert set(ids[3].tolist()[:6]) == {1, 3, 5, 7, 9, 11}, score_func
    # sigmoid is per element: NaN experts rank below every number
    assert set(ids[2].tolist()[:6]) == {0, 1, 2, 9, 10, 11}


def test_bad_router_arguments_are_named():
    logits = torch.randn(4, 300, device=DEVICE)
    with pytest.raises(ValueError, match="at most 256 experts"):
        topk_route(logits, None, 2)
    with pytest.raises(ValueError, match="score_func"):
        topk_route(logits[:, :8], None, 2, score_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        topk_route(logits[:, :8], None, 9)
    with pytest.raises(ValueError, match=r"bias_E must have shape \(8,\)"):
        topk_route(logits[:, :8], torch.zeros(7, device=DEVICE), 2)
    with pytest.raises(ValueError, match="2-D floating"):
        topk_route(logits[0], None, 2)


def test_cpu_without_the_interpreter_is_a_clear_error():
    """Whether the kernels are interpreted is fixed when they are defined (TRITON_INTERPRET at import),
    so a CPU process without the interpreter is checked in a child process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
import pytest, torch
from titan_megamoe.router import topk_route
with pytest.raises(ValueError, match="router_reference"):
    topk_route(torch.randn(4, 8), None, 2)
print("clear error")
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "clear error" in proc.stdout, proc.stdout + proc.stderr
