"""The fused MoE as a torch.library custom op with registered autograd, and the public `moe` function.

`titan_megamoe::moe_forward` runs the Triton pipeline and returns the output plus the residuals the
backward needs (gate and up in expert-sorted order, and the routing metadata). Because the
residuals are op outputs, op-level selective activation checkpointing can save the whole op (see
`integrations.torchtitan`) or recompute it like stock's grouped GEMMs. The fake implementations make
the op traceable by torch.compile.

In plain eager mode `moe()` skips the dispatcher: an autograd.Function calls the same pipeline
functions directly. torch's custom-op autograd wrapper costs ~100 us of host time per forward (measured
on CPU; `torch._library.utils.fill_defaults` alone rebuilds the schema's argument list per argument),
and in the forward that host time is GPU idle time before GEMM1. Whenever something may need to see the
op (torch.compile tracing, or any TorchDispatchMode such as selective activation checkpointing's caching
mode or FakeTensorMode) the custom op is used, so SAC can save or recompute it and compile can trace it.

The reference backend is plain differentiable PyTorch (autograd records it like stock's MoE), not
a custom op: a custom op's implementation runs below autograd, and the reference is most useful as an
oracle when its gradients come from autograd itself.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .precision import Precision, check_precision_supported
from .reference import moe_reference
from .validation import check_backend, check_expert_ids, validate_moe_inputs

_LIB = "titan_megamoe"
_COMPUTE_DTYPE = {Precision.BF16.value: torch.bfloat16}


def _triton_available_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    check_backend(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and not _triton_available_on(device):
        raise ValueError(
            f"titan_megamoe.moe: backend='triton' needs a CUDA GPU but the inputs are on {device}; "
            "use backend='reference' (or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
        )
    return backend


def _residual_shapes(x, ids, w1):
    from .kernels.configs import row_block_m
    from .kernels.routing_meta import packed_size

    T, _ = x.shape
    N = T * ids.shape[1]
    E, H, _ = w1.shape
    return (N, H), (N, H), (packed_size(N, E, row_block_m()),)


@torch.library.custom_op(f"{_LIB}::moe_forward", mutates_args=())
def moe_forward(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    precision: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # host check on CPU (or TITAN_MEGAMOE_DEBUG=1); on CUDA the pipeline asserts asynchronously
    check_expert_ids(topk_ids_TK, w1_EHD.shape[0], device_check=False)
    from .kernels.pipeline import fused_moe_forward

    return fused_moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD)


@moe_forward.register_fake
def _(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, precision, backend):
    out = x_TD.new_empty(x_TD.shape)
    g, u, meta = _residual_shapes(x_TD, topk_ids_TK, w1_EHD)
    bf = torch.bfloat16
    return out, x_TD.new_empty(g, dtype=bf), x_TD.new_empty(u, dtype=bf), x_TD.new_empty(meta, dtype=torch.int32)


@torch.library.custom_op(f"{_LIB}::moe_backward", mutates_args=())
def moe_backward(
    dout_TD: torch.Tensor,
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    saved_gate: torch.Tensor,
    saved_up: torch.Tensor,
    saved_routing: torch.Tensor,
    precision: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dout_TD = dout_TD.contiguous()
    from .kernels.pipeline import fused_moe_backward

    return fused_moe_backward(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                              saved_gate, saved_up, saved_routing)


@moe_backward.register_fake
def _(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, g, u, meta, precision, backend):
    return tuple(t.new_empty(t.shape) for t in (x_TD, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD))


def _setup_context(ctx, inputs, output):
    x, ids, scores, w1, w2, w3, precision, backend = inputs
    ctx.save_for_backward(x, ids, scores, w1, w2, w3, *output[1:])
    # the residual outputs carry no gradient: without these two lines autograd materialises zero
    # gradients for them (two [N, H] fills, measured 0.12 ms per backward at the 30B shape)
    ctx.mark_non_differentiable(*output[1:])
    # ... and since they never get one, autograd must not fill zeros for them either (it does by default)
    ctx.set_materialize_grads(False)
    ctx.precision, ctx.backend = precision, backend


def _backward(ctx, dout, *_residual_grads):
    if dout is None:  # the output did not reach the loss: every gradient is zero
        return (None,) * 8
    x, ids, scores, w1, w2, w3, g, u, meta = ctx.saved_tensors
    dx, ds, dw1, dw2, dw3 = moe_backward(dout, x, ids, scores, w1, w2, w3, g, u, meta, ctx.precision, ctx.backend)
    return dx, None, ds, dw1, dw2, dw3, None, None


moe_forward.register_autograd(_backward, setup_context=_setup_context)


class _FusedMoEEager(torch.autograd.Function):
    """The Triton pipeline under autograd without the dispatcher (plain eager mode only: see the module
    docstring). Same kernels, same residuals, same results as the custom op."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD):
        from .kernels.pipeline import fused_moe_forward

        out, g, u, plan = fused_moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD)
        ctx.save_for_backward(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, g, u, plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        from .kernels.pipeline import fused_moe_backward

        x, ids, scores, w1, w2, w3, g, u, plan = ctx.saved_tensors
        dx, ds, dw1, dw2, dw3 = fused_moe_backward(dout.contiguous(), x, ids, scores, w1, w2, w3, g, u, plan)
        return dx, None, ds, dw1, dw2, dw3


def _op_must_be_visible() -> bool:
    """True when a tracer or dispatch mode (compile, SAC, fake tensors) should see the custom op."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def moe(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    w3_EFD: torch.Tensor,
    *,
    precision: str = "bf16",
    backend: str = "auto",
) -> torch.Tensor:
    """Routed SwiGLU experts with score-weighted combine: out_t = sum_k s_tk * FFN_{e_tk}(x_t).

    Args:
        x_TD: tokens [T, D] (bf16, fp16 or fp32).
        topk_ids_TK: expert of each token's k-th choice [T, K], int32 or int64, values in [0, E).
        topk_scores_TK: routing weight of each choice [T, K] (fp32 as TorchTitan's router makes them).
        w1_EFD, w3_EFD: gate and up projections [E, F, D] (TorchTitan layout); w2_EDF: down [E, D, F].
        precision: "bf16" (implemented); "fp8", "fp8_bwd" (Hopper, coming); "mxfp8" (Blackwell only).
        backend: "triton" (fused kernels, CUDA), "reference" (pure PyTorch, any device) or "auto".

    Differentiable in x, the three weights and the scores. Returns [T, D] in x's dtype.
    """
    validate_moe_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD)
    p = check_precision_supported(precision, x_TD.device)
    resolved = resolve_backend(backend, x_TD.device)
    if resolved == "reference":
        check_expert_ids(topk_ids_TK, w1_EFD.shape[0])
        return moe_reference(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, _COMPUTE_DTYPE[p.value])
    if _op_must_be_visible():
        out, *_ = moe_forward(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, p.value, resolved)
        return out
    check_expert_ids(topk_ids_TK, w1_EFD.shape[0], device_check=False)
    return _FusedMoEEager.apply(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD)
