"""The eager fast path (autograd.Function straight to the pipeline) and the custom op give the same
results, and selective activation checkpointing still sees, saves or recomputes the custom op."""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import titan_megamoe
import titan_megamoe.pipeline as pipeline
from moe_cases import forward_backward, make_case, swapped_tiny_moe_layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)


def _via_custom_op(x, ids, s, w1, w2, w3):
    link, h, *residuals = torch.ops.titan_megamoe.moe_up(x, ids, s, w1, w2, w3, "bf16", "triton")
    return torch.ops.titan_megamoe.moe_down(link, s, w2, [h], residuals[-1], "bf16", "triton")


def _via_moe(x, ids, s, w1, w2, w3):
    return titan_megamoe.moe(x, ids, s, w1, w2, w3, backend="triton")


@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_eager_path_equals_custom_op_bitwise(routing):
    case = make_case(37, 64, 32, 6, 3, routing=routing, device=DEVICE, seed=5)
    dout = torch.randn_like(case.x)
    got, want = forward_backward(_via_moe, case, dout), forward_backward(_via_custom_op, case, dout)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.fixture
def forward_calls(monkeypatch):
    """How often each forward step ran: {"up": [...], "down": [...]} (the routing plan and GEMM1; GEMM2)."""
    calls = {"up": [], "down": []}
    for step in calls:
        real = getattr(pipeline, f"fused_moe_{step}")

        def counting(*args, _real=real, _calls=calls[step]):
            _calls.append(1)
            return _real(*args)

        monkeypatch.setattr(pipeline, f"fused_moe_{step}", counting)
    return calls


def _sac_fwd_bwd(case, dout, save_op: bool, early_stop: bool):
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from titan_megamoe.integrations.torchtitan.converter import sac_save_ops

    saved = set(sac_save_ops(early_stop)) if save_op else set()  # as `mega_moe.save_under_sac`

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    with set_checkpoint_early_stop(early_stop):  # TorchTitan passes activation_checkpoint.early_stop
        return forward_backward(lambda *a: checkpoint(_via_moe, *a, use_reentrant=False, context_fn=ctx_fn), case,
                                dout)


@pytest.mark.parametrize("save_op, early_stop, up_calls, down_calls", [
    (True, True, 1, 1), (True, False, 1, 1),  # saved (with early stop moe_up alone, without it both steps)
    (False, True, 2, 1), (False, False, 2, 2),  # recomputed: with early stop the first step only
])
def test_selective_checkpointing_sees_the_op(forward_calls, save_op, early_stop, up_calls, down_calls):
    case = make_case(19, 64, 32, 4, 2, device=DEVICE, seed=7)
    dout = torch.randn_like(case.x)
    got = _sac_fwd_bwd(case, dout, save_op, early_stop)
    assert (len(forward_calls["up"]), len(forward_calls["down"])) == (up_calls, down_calls), forward_calls
    for calls in forward_calls.values():
        calls.clear()
    want = forward_backward(_via_moe, case, dout)
    assert len(forward_calls["up"]) == len(forward_calls["down"]) == 1, "plain eager runs the pipeline once"
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _block(precision):
    """A transformer block's MoE half as TorchTitan's full activation checkpointing wraps it: the output
    only feeds a residual add, which saves nothing for the backward."""

    def block(x, ids, s, w1, w2, w3):
        return x + titan_megamoe.moe(x, ids, s, w1, w2, w3, backend="triton", precision=precision)

    return lambda *a: checkpoint(block, *a, use_reentrant=False)


@pytest.mark.parametrize("precision,compile_backend", [("bf16", None), ("bf16", "aot_eager"), ("fp8", None),
                                                       ("fp8", "aot_eager")])
def test_full_checkpointing_recomputes_no_gemm2(forward_calls, precision, compile_backend):
    """Under full activation checkpointing the backward's recompute runs the routing plan and GEMM1 (the
    residuals) again but not GEMM2 and the combine, whose output the backward does not need: eager (the
    recompute stops early once the residuals are saved) and compiled (the partitioner leaves `moe_down`
    out of the backward graph). Results bitwise those without checkpointing."""
    D = H = 128 if precision == "fp8" else 32
    case = make_case(11, D, H, 3, 2, device=DEVICE, seed=9)
    dout = torch.randn(case.x.shape, generator=torch.Generator().manual_seed(4)).to(case.x)
    fn = _block(precision)
    if compile_backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend=compile_backend)
    got = forward_backward(fn, case, dout)
    assert len(forward_calls["up"]) == 2 and len(forward_calls["down"]) == 1, forward_calls
    want = forward_backward(lambda x, *a: x + titan_megamoe.moe(x, *a, backend="triton", precision=precision),
                            case, dout)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_h_is_freed_before_the_combine(monkeypatch, precision):
    """The eager path holds GEMM2's operands nowhere once GEMM2 is launched: h ([T*K, H], 192 MiB at 30B-A3B
    T=16384) is freed before the combine allocates the output, as when the forward was one call."""
    import weakref

    from titan_megamoe.pipeline import dispatch

    D = H = 128 if precision == "fp8" else 32
    case = make_case(13, D, H, 4, 2, device=DEVICE, seed=3)
    made, alive_at_combine = [], []
    real_down, real_combine = pipeline.ffn_down, dispatch.combine_forward

    def down(operands, *args, **kwargs):
        made.extend(weakref.ref(t) for t in operands)
        return real_down(operands, *args, **kwargs)

    def combine(*args):
        alive_at_combine.append([r() is not None for r in made])
        return real_combine(*args)

    monkeypatch.setattr(pipeline, "ffn_down", down)
    monkeypatch.setattr(dispatch, "combine_forward", combine)
    forward_backward(lambda *a: titan_megamoe.moe(*a, backend="triton", precision=precision), case,
                     torch.randn_like(case.x))
    assert made and alive_at_combine == [[False] * len(made)], alive_at_combine


@pytest.mark.parametrize("shared_experts, early_stop", [(0, True), (1, True), (1, False)])
def test_checkpointed_layer_skips_gemm2_with_shared_experts(monkeypatch, forward_calls, shared_experts, early_stop):
    """The swapped TorchTitan layer under TorchTitan's full activation checkpointing wrapper: with
    `activation_checkpoint.early_stop` the recompute stops before GEMM2, also with shared experts (whose
    Linear layers save tensors: they run before the routed experts); without it (TorchTitan's default) the
    whole layer reruns, GEMM2 included. Output and gradients bitwise those without checkpointing, and the
    load-balancing counts added twice, as stock's (counted before the experts, where the recompute reruns
    them; TorchTitan's optimizer hook halves the counts of checkpointed blocks)."""
    from torchtitan.distributed.activation_checkpoint import ptd_checkpoint_wrapper

    from titan_megamoe.integrations.torchtitan import cpu

    monkeypatch.setattr(torch, "histc", cpu.histc_int_cpu(torch.histc))
    layer, dim = swapped_tiny_moe_layer(DEVICE, shared_experts)
    x = torch.randn(1, 12, dim, device=DEVICE, dtype=torch.bfloat16)
    dout = torch.randn_like(x)

    def run(fn):
        xx = x.detach().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        layer.tokens_per_expert.zero_()
        fn(xx).backward(dout)
        return [xx.grad, *(p.grad for p in layer.parameters()), layer.tokens_per_expert.clone()]

    *want, counts = run(layer)
    for calls in forward_calls.values():
        calls.clear()
    *got, counts_ckpt = run(ptd_checkpoint_wrapper(layer, preserve_rng_state=True, determinism_check="default",
                                                   early_stop=early_stop, debug=False))
    assert len(forward_calls["up"]) == 2 and len(forward_calls["down"]) == (1 if early_stop else 2), forward_calls
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert counts.sum() == 12 * layer.router.top_k and torch.equal(counts_ckpt, 2 * counts)
