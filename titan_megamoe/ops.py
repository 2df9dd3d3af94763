"""The public `moe` function, the fused op as torch.library custom ops, and its one autograd path.

The forward is two ops. `titan_megamoe::moe_up` (the routing plan, GEMM1 + SwiGLU) returns a "link", GEMM2's
operands and the residuals the backward needs (`pipeline.residual_specs`: gate and up in expert-sorted order;
under `fp8` the block-FP8 W1^T, W2^T, W3^T, data and scale each; the packed routing plan);
`titan_megamoe::moe_down` (GEMM2, the score-weighted combine) turns them into the output. moe_up carries the
whole fused backward (`titan_megamoe::moe_backward`); moe_down hands the output's gradient back to it through
the link, a [T, D] tensor with every stride 0 (no memory). Why two: under activation checkpointing the
backward recomputes only what it needs, and it needs moe_up's outputs, never moe_down's. Eager non-reentrant
checkpointing stops its recompute once moe_up has saved its tensors (with early stop on: torch's default,
TorchTitan's `activation_checkpoint.early_stop`, which defaults to false; and when nothing after the op in the
checkpointed region saves one: `MegaMoE` runs its shared experts first), and torch.compile's partitioner
leaves moe_down out of the backward graph, so GEMM2 and the combine run once per step instead of twice
(`tests/test_eager_path.py::test_full_checkpointing_recomputes_no_gemm2`; at 30B-A3B T=16384 bf16 on an H100
GEMM2 took 0.73 ms of a ~2.7 ms forward, docs/kernels.md). Because the residuals are op outputs, op-level
selective activation checkpointing can save both steps (see `integrations.torchtitan`) or recompute them like
stock's grouped GEMMs. The fake implementations make the ops traceable by torch.compile; they take every shape
and dtype from the pipeline and the precision recipe.

In plain eager mode `moe()` skips the dispatcher: two autograd.Functions call the same pipeline functions
directly. torch's custom-op autograd wrapper costs ~100 us of host time per forward (measured on CPU;
`torch._library.utils.fill_defaults` alone rebuilds the schema's argument list per argument), and in the
forward that host time is GPU idle time before GEMM1. Whenever something may need to see the ops
(torch.compile tracing, or any TorchDispatchMode such as selective activation checkpointing's caching
mode or FakeTensorMode) the custom ops are used, so SAC can save or recompute them and compile can trace
them. Both paths save the same tensors and run the same backward (`_save`, `_gradients`).

The reference backend is plain differentiable PyTorch (autograd records it like stock's MoE), not
a custom op: a custom op's implementation runs below autograd, and the reference is most useful as an
oracle when its gradients come from autograd itself. For the block-FP8 precisions (`fp8`, `fp8_bwd`) it
runs `oracle.moe_fp8_emulation` (an autograd.Function with the kernels' quantization points), the oracle
of the Triton backend's FP8 kernels. A precision a backend cannot run stops with an error
(`precision.check_backend_precision`), in `moe()` and in the custom ops alike, never another precision.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .oracle import moe_fp8_emulation, moe_reference
from .precision import Recipe, check_backend_precision, recipe_for
from .validation import (check_backend, check_block_shapes, check_ep_transport, check_expert_ids,
                         check_expert_parallel, validate_moe_inputs)

_LIB = "titan_megamoe"


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


def _kernel_recipe(precision: str, device: torch.device | None = None) -> Recipe:
    """The recipe of a precision the Triton kernels implement; NotImplementedError for any other, ValueError
    for block FP8 on a `device` without FP8 tensor cores."""
    recipe = recipe_for(precision)
    check_backend_precision(recipe, "triton", device)
    return recipe


@torch.library.custom_op(f"{_LIB}::moe_up", mutates_args=())
def moe_up(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    precision: str,
    backend: str,
) -> list[torch.Tensor]:
    """[link, GEMM2's operands..., residuals...]: the routing plan and GEMM1 + SwiGLU."""
    # host check on CPU (or TITAN_MEGAMOE_DEBUG=1); on CUDA the pipeline asserts asynchronously
    check_expert_ids(topk_ids_TK, w1_EHD.shape[0], device_check=False)
    from .pipeline import fused_moe_up, gradient_link

    down, residuals, _ = fused_moe_up(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD,
                                      _kernel_recipe(precision, x_TD.device))
    return [gradient_link(x_TD), *down, *residuals]


@moe_up.register_fake
def _(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, precision, backend):
    from .pipeline import down_specs, gradient_link, residual_specs

    recipe = _kernel_recipe(precision)
    specs = [*down_specs(x_TD, topk_ids_TK, w1_EHD, recipe), *residual_specs(x_TD, topk_ids_TK, w1_EHD, recipe)]
    return [gradient_link(x_TD), *(x_TD.new_empty(shape, dtype=dtype) for shape, dtype in specs)]


@torch.library.custom_op(f"{_LIB}::moe_down", mutates_args=())
def moe_down(
    link_TD: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w2_EDH: torch.Tensor,
    down: list[torch.Tensor],
    packed_plan: torch.Tensor,
    precision: str,
    backend: str,
) -> torch.Tensor:
    """out [T, D] in x's dtype: GEMM2 and the score-weighted combine, from `moe_up`'s outputs."""
    from .pipeline import fused_moe_down, restore_dispatch

    recipe = _kernel_recipe(precision, link_TD.device)
    d = restore_dispatch(topk_scores_TK, packed_plan, w2_EDH.shape[0], recipe)
    return fused_moe_down(list(down), d, w2_EDH, recipe, link_TD.dtype)  # a copy: GEMM2 empties the list it gets


@moe_down.register_fake
def _(link_TD, topk_scores_TK, w2_EDH, down, packed_plan, precision, backend):
    return link_TD.new_empty(link_TD.shape)


@torch.library.custom_op(f"{_LIB}::moe_backward", mutates_args=())
def moe_backward(
    dout_TD: torch.Tensor,
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    residuals: list[torch.Tensor],
    precision: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .pipeline import fused_moe_backward

    return fused_moe_backward(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, residuals,
                              _kernel_recipe(precision))


@moe_backward.register_fake
def _(dout_TD, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, residuals, precision, backend):
    return tuple(t.new_empty(t.shape) for t in (x_TD, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD))


# ------------------------------------------------------------------------------------------------
# The one autograd path: what is saved, and how the backward runs, for the custom op and the eager path
# ------------------------------------------------------------------------------------------------


def _save(ctx, inputs, residuals, precision: str, backend: str) -> None:
    ctx.save_for_backward(*inputs, *residuals)
    ctx.num_inputs = len(inputs)
    ctx.precision, ctx.backend = precision, backend


def _gradients(ctx, dout, backward_fn):
    """(dx, dscores, dw1, dw2, dw3) from the saved tensors; None for all when dout is None (the output
    did not reach the loss)."""
    if dout is None:
        return (None,) * 5
    saved = ctx.saved_tensors
    x, ids, scores, w1, w2, w3 = saved[: ctx.num_inputs]
    return backward_fn(dout, x, ids, scores, w1, w2, w3, list(saved[ctx.num_inputs:]), ctx.precision, ctx.backend)


def _down_count(precision: str) -> int:
    from .pipeline import down_proj_count

    return down_proj_count(recipe_for(precision))


def _up_setup_context(ctx, inputs, output):
    *tensors, precision, backend = inputs
    _save(ctx, tensors, output[1 + _down_count(precision):], precision, backend)
    # GEMM2's operands and the residuals carry no gradient: without these two lines autograd materialises
    # zero gradients for them (two [N, H] fills, measured 0.12 ms per backward at the 30B shape)
    ctx.mark_non_differentiable(*output[1:])
    # ... and since they never get one, autograd must not fill zeros for them either (it does by default)
    ctx.set_materialize_grads(False)


def _up_backward(ctx, grads):
    dx, ds, dw1, dw2, dw3 = _gradients(ctx, grads[0], moe_backward)
    return dx, None, ds, dw1, dw2, dw3, None, None


def _down_setup_context(ctx, inputs, output):
    ctx.num_down = len(inputs[3])


def _down_backward(ctx, dout):
    # the output's gradient to the link: moe_up's backward computes every gradient
    return dout, None, None, [None] * ctx.num_down, None, None, None


moe_up.register_autograd(_up_backward, setup_context=_up_setup_context)
moe_down.register_autograd(_down_backward, setup_context=_down_setup_context)


def _pipeline_backward(dout, x, ids, scores, w1, w2, w3, residuals, precision, backend):
    from .pipeline import fused_moe_backward

    return fused_moe_backward(dout, x, ids, scores, w1, w2, w3, residuals, _kernel_recipe(precision))


class _MoEUpEager(torch.autograd.Function):
    """`moe_up` under autograd without the dispatcher (plain eager mode only: see the module docstring).
    Same kernels, same residuals, same results as the custom ops. Returns (link, the dispatch, GEMM2's
    operands...): the dispatch object itself, which the custom ops remake from the packed plan."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe):
        from .pipeline import fused_moe_up, gradient_link

        down, residuals, d = fused_moe_up(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD, recipe)
        _save(ctx, (x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD), residuals, recipe.precision.value,
              "triton")
        ctx.mark_non_differentiable(*down)
        ctx.set_materialize_grads(False)
        return gradient_link(x_TD), d, *down

    @staticmethod
    def backward(ctx, dlink, *_):
        dx, ds, dw1, dw2, dw3 = _gradients(ctx, dlink, _pipeline_backward)
        return dx, None, ds, dw1, dw2, dw3, None


class _MoEDownEager(torch.autograd.Function):
    """`moe_down` under autograd without the dispatcher: the output, its gradient handed to the link."""

    @staticmethod
    def forward(ctx, link_TD, w2_EDH, recipe, d, down: list):
        from .pipeline import fused_moe_down

        # `down`, GEMM2's operands, comes as one list (not as tensor arguments, which `apply` would hold until
        # it returns): GEMM2 empties it, so h is freed before the combine allocates the output
        return fused_moe_down(down, d, w2_EDH, recipe, link_TD.dtype)

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None, None, None


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
    ep_group=None,
    ep_transport: str = "all_to_all",
    ep_capacity_factor: float | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts with score-weighted combine: out_t = sum_k s_tk * FFN_{e_tk}(x_t).

    Args:
        x_TD: tokens [T, D] (bf16, fp16 or fp32).
        topk_ids_TK: expert of each token's k-th choice [T, K], int32 or int64, values in [0, E).
        topk_scores_TK: routing weight of each choice [T, K] (fp32 as TorchTitan's router makes them).
        w1_EFD, w3_EFD: gate and up projections [E, F, D] (TorchTitan layout); w2_EDF: down [E, D, F].
        precision: "bf16"; "fp8" (block FP8 forward and backward: 1x128 activation and 128x128 weight
            scales) and "fp8_bwd" (bf16 forward, block FP8 backward), D and H multiples of 128, on the
            Triton kernels or emulated by backend="reference" (their oracle); "mxfp8" (Blackwell only: an
            error on Hopper).
        backend: "triton" (fused kernels, CUDA), "reference" (pure PyTorch, any device) or "auto".
        ep_group: a torch.distributed process group for expert parallelism (None: all experts are local).
            Its rank r holds the weights of global experts [r*E_local, (r+1)*E_local) (E_local = the
            weights' first dim, TorchTitan's EP layout); ids are global in [0, E_local * group size). Rows
            travel by `ep_transport` (`pipeline.ep_dispatch`); eager autograd only; FP8 on the Triton
            backend only.
        ep_transport: with ep_group, "all_to_all" (torch.distributed all-to-all) or "symm_mem" (rows
            written into the peers' torch symmetric-memory buffers, `pipeline.symm_transport`; Triton
            backend). Both give the same result.
        ep_capacity_factor: with ep_transport="symm_mem": None (the default) sizes every buffer from the
            expert counts read on the host (one host sync per layer, as stock TorchTitan's EP); a float
            >= 1 reads nothing on the host: each rank's receive buffers hold factor x (T*K) rows, and a
            device-side check stops the step (nothing dropped, nothing written) when a rank would receive
            more, or when the ranks route different numbers of rows. Same result either way.

    Differentiable in x, the three weights and the scores. Returns [T, D] in x's dtype.
    """
    validate_moe_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD)
    check_ep_transport(ep_transport, ep_capacity_factor)
    recipe = recipe_for(precision, x_TD.device)
    resolved = resolve_backend(backend, x_TD.device)
    if resolved == "reference" and x_TD.device.type == "meta":  # it would stop in torch's Tensor.item()
        raise ValueError("titan_megamoe.moe: the inputs are on the meta device, which holds no values, and the "
                         "reference backend reads the routing's expert counts on the host; materialize them first "
                         "(e.g. module.to_empty(device=...) and initialize the weights)")
    # the GPU's FP8 check reads device properties; under torch.compile the custom op's implementation makes it
    check_backend_precision(recipe, resolved, None if torch.compiler.is_compiling() else x_TD.device)
    check_block_shapes(x_TD.shape[1], w1_EFD.shape[1], recipe)
    if ep_group is not None and resolved == "reference" and ep_transport != "all_to_all":
        raise ValueError(f"titan_megamoe.moe: ep_transport={ep_transport!r} runs the Triton backend; the reference "
                         f"backend (the oracle) moves rows by all-to-all: use ep_transport='all_to_all'")
    if ep_group is not None and torch.distributed.get_world_size(ep_group) > 1:
        return _moe_expert_parallel(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe, resolved,
                                    ep_group, ep_transport, ep_capacity_factor)
    if resolved == "reference":
        check_expert_ids(topk_ids_TK, w1_EFD.shape[0])
        if recipe.quantized() or recipe.quantized(backward=True):
            return moe_fp8_emulation(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD,
                                     fp8_forward=recipe.quantized(), fp8_backward=recipe.quantized(backward=True))
        return moe_reference(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe.forward_operand)
    if _op_must_be_visible():
        p = recipe.precision.value
        link, *rest = moe_up(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, p, resolved)
        down = rest[:_down_count(p)]
        return moe_down(link, topk_scores_TK, w2_EDF, down, rest[-1], p, resolved)
    check_expert_ids(topk_ids_TK, w1_EFD.shape[0], device_check=False)
    link, d, *down = _MoEUpEager.apply(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe)
    return _MoEDownEager.apply(link, w2_EDF, recipe, d, down)


def _moe_expert_parallel(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe, backend, group,
                         transport, capacity_factor):
    from .pipeline.ep_dispatch import fused_moe_expert_parallel, moe_reference_ep

    check_expert_parallel(recipe, backend)
    check_expert_ids(topk_ids_TK, w1_EFD.shape[0] * torch.distributed.get_world_size(group), device_check=False)
    if backend == "reference":
        return moe_reference_ep(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe.forward_operand,
                                group)
    return fused_moe_expert_parallel(x_TD, topk_ids_TK, topk_scores_TK, w1_EFD, w2_EDF, w3_EFD, recipe, group,
                                     transport, capacity_factor)
