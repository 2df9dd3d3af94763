"""The eager fast path (autograd.Function straight to the pipeline) and the custom op give the same
results, and selective activation checkpointing still sees, saves or recomputes the custom op."""

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import titan_megamoe
import titan_megamoe.pipeline as pipeline
from moe_cases import forward_backward, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)


def _via_custom_op(x, ids, s, w1, w2, w3):
    return torch.ops.titan_megamoe.moe_forward(x, ids, s, w1, w2, w3, "bf16", "triton")[0]


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
    calls = []
    real = pipeline.fused_moe_forward

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(pipeline, "fused_moe_forward", counting)
    return calls


def _sac_fwd_bwd(case, dout, save_op: bool):
    op = torch.ops.titan_megamoe.moe_forward.default

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if save_op and func is op else CheckpointPolicy.PREFER_RECOMPUTE

    ctx_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return forward_backward(lambda *a: checkpoint(_via_moe, *a, use_reentrant=False, context_fn=ctx_fn), case, dout)


@pytest.mark.parametrize("save_op,expected_calls", [(True, 1), (False, 2)])
def test_selective_checkpointing_sees_the_op(forward_calls, save_op, expected_calls):
    case = make_case(19, 64, 32, 4, 2, device=DEVICE, seed=7)
    dout = torch.randn_like(case.x)
    got = _sac_fwd_bwd(case, dout, save_op)
    assert len(forward_calls) == expected_calls, "SAC must save (1 run) or recompute (2 runs) the fused op"
    forward_calls.clear()
    want = forward_backward(_via_moe, case, dout)
    assert len(forward_calls) == 1, "plain eager runs the pipeline once"
    for key in want:
        assert torch.equal(got[key], want[key]), key
