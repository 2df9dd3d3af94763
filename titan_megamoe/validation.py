"""Every argument check in one place: the public op, the kernels' shape rules, the kernel launchers'
operands, the fused router and the tile configs. Each error names the argument, what was expected and
what came, and where there is one, the fix.

Shape, dtype and device checks are pure metadata (safe under torch.compile and CUDA graphs). The
expert-id range check needs the values: it runs on the host for CPU tensors, and on CUDA as an
asynchronous device assert (no host sync) unless TITAN_MEGAMOE_DEBUG=1 asks for the host check
with a ValueError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "reference", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MoEDims:
    tokens: int  # T
    dim: int  # D
    hidden: int  # H
    experts: int  # E
    top_k: int  # K


def _fail(cls, msg: str):
    raise cls(f"titan_megamoe.moe: {msg}")


def _check_dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        _fail(TypeError, f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, allowed))}")


def _check_ndim(name: str, t: torch.Tensor, shape_name: str) -> None:
    if t.dim() != len(shape_name):
        _fail(ValueError, f"{name} must be {len(shape_name)}-D [{', '.join(shape_name)}], got shape {tuple(t.shape)}")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        _fail(ValueError, f"backend: unknown value {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    return backend


def validate_moe_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1_EHD, w2_EDH, w3_EHD) -> MoEDims:
    named = {
        "x_TD": x_TD, "topk_ids_TK": topk_ids_TK, "topk_scores_TK": topk_scores_TK,
        "w1_EFD": w1_EHD, "w2_EDF": w2_EDH, "w3_EFD": w3_EHD,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_ndim("x_TD", x_TD, "TD")
    _check_ndim("topk_ids_TK", topk_ids_TK, "TK")
    _check_ndim("topk_scores_TK", topk_scores_TK, "TK")
    _check_ndim("w1_EFD", w1_EHD, "EFD")
    _check_ndim("w2_EDF", w2_EDH, "EDF")
    _check_ndim("w3_EFD", w3_EHD, "EFD")

    _check_dtype("x_TD", x_TD, _FLOAT_DTYPES)
    _check_dtype("topk_ids_TK", topk_ids_TK, _ID_DTYPES)
    _check_dtype("topk_scores_TK", topk_scores_TK, _FLOAT_DTYPES)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        _check_dtype(name, named[name], _FLOAT_DTYPES)

    device = x_TD.device
    for name, t in named.items():
        if t.device != device:
            _fail(ValueError, f"{name} is on {t.device} but x_TD is on {device}; move all inputs to one device")

    T, D = x_TD.shape
    E, H, D1 = w1_EHD.shape
    if D1 != D:
        _fail(ValueError, f"w1_EFD has model dim {D1} (shape {tuple(w1_EHD.shape)}) but x_TD has D={D}")
    if tuple(w3_EHD.shape) != (E, H, D):
        _fail(ValueError, f"w3_EFD must have the shape of w1_EFD {(E, H, D)}, got {tuple(w3_EHD.shape)}")
    if tuple(w2_EDH.shape) != (E, D, H):
        _fail(ValueError, f"w2_EDF must be [E, D, F] = {(E, D, H)}, got {tuple(w2_EDH.shape)}")
    if topk_ids_TK.shape[0] != T:
        _fail(ValueError, f"topk_ids_TK has {topk_ids_TK.shape[0]} rows but x_TD has T={T} tokens")
    if tuple(topk_scores_TK.shape) != tuple(topk_ids_TK.shape):
        _fail(ValueError, f"topk_scores_TK shape {tuple(topk_scores_TK.shape)} differs from topk_ids_TK shape "
                          f"{tuple(topk_ids_TK.shape)}")
    K = topk_ids_TK.shape[1]
    if K < 1:
        _fail(ValueError, "top-k must be at least 1 (topk_ids_TK has 0 columns)")
    if E < 1:
        _fail(ValueError, "at least one expert is needed (w1_EFD has E=0)")
    return MoEDims(tokens=T, dim=D, hidden=H, experts=E, top_k=K)


def check_expert_ids(topk_ids_TK: torch.Tensor, num_experts: int, device_check: bool = True) -> None:
    """Expert ids must lie in [0, E). Host check on CPU (or with TITAN_MEGAMOE_DEBUG=1), else an async
    device assert; `device_check=False` leaves that to the caller (the fused pipeline asserts on a flag
    its routing kernel computes anyway, saving five launches)."""
    if topk_ids_TK.numel() == 0:
        return
    if topk_ids_TK.device.type == "cpu" or os.environ.get("TITAN_MEGAMOE_DEBUG") == "1":
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= num_experts:
            _fail(ValueError, f"topk_ids_TK holds expert ids in [{lo}, {hi}] but there are E={num_experts} "
                              f"experts (valid ids: 0..{num_experts - 1})")
    elif device_check:
        ok = (topk_ids_TK.min() >= 0) & (topk_ids_TK.max() < num_experts)
        torch._assert_async(ok, f"titan_megamoe.moe: topk_ids_TK out of range [0, {num_experts})")


# ------------------------------------------------------------------------------------------------
# Kernel shapes, launcher operands, router arguments, tile configs
# ------------------------------------------------------------------------------------------------

ROW_ALIGN = 16  # D and H: pointer loads (no TMA) need 16-element (32 B) aligned rows


def check_multiple_of(where: str, dims: dict[str, int], multiple: int, hint: str = "") -> None:
    for name, v in dims.items():
        if v % multiple != 0:
            raise ValueError(f"{where}: {name} must be a multiple of {multiple}, got {v}{hint}")


def check_row_alignment(where: str, dims: dict[str, int], hint: str = "") -> None:
    """The one shape rule every kernel shares: D and H must be multiples of ROW_ALIGN."""
    check_multiple_of(where, dims, ROW_ALIGN, hint)


def check_block_shapes(dim: int, hidden: int, recipe) -> None:
    """Block FP8 (a recipe with scale blocks) needs D and H to be multiples of its blocks: every GEMM
    reduces over D or H in whole 1x128 / 128x128 blocks (quant.py)."""
    if recipe.weight_block is None:
        return
    check_multiple_of(f"titan_megamoe.moe: precision={recipe.precision.value!r}",
                      {"D (model dim)": dim, "H (expert hidden dim)": hidden}, recipe.weight_block[0],
                      f" (the FP8 scale block); pad the model to multiples of {recipe.weight_block[0]} "
                      f"or use precision='bf16'")


def check_kernel_shapes(dim: int, hidden: int) -> None:
    check_row_alignment("titan_megamoe.moe: backend='triton'",
                        {"D (model dim)": dim, "H (expert hidden dim)": hidden},
                        "; use backend='reference' for this shape")


def check_kernel_operand(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous() or t.device != device:
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D {dtype} tensor on {device}; got {t.dtype} "
            f"shape {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}"
        )


def check_wgrad_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def check_router_args(logits_TE, bias_E, top_k: int, score_func: str, max_experts: int, interpreting: bool) -> None:
    if logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        raise ValueError(f"router_topk: logits_TE must be a 2-D floating tensor [T, E], got {logits_TE.dtype} "
                         f"of shape {tuple(logits_TE.shape)}")
    if logits_TE.device.type != "cuda" and not interpreting:
        raise ValueError(f"router_topk: the fused router runs on CUDA (or with TRITON_INTERPRET=1); logits are on "
                         f"{logits_TE.device}. On CPU use titan_megamoe.oracle.router_reference")
    E = logits_TE.shape[1]
    if bias_E is not None and (bias_E.shape != (E,) or bias_E.device != logits_TE.device):
        raise ValueError(f"router_topk: bias_E must have shape ({E},) on {logits_TE.device}, got "
                         f"{tuple(bias_E.shape)} on {bias_E.device}")
    if E > max_experts:
        raise ValueError(f"router_topk: at most {max_experts} experts in one program's registers, got {E}; "
                         f"use the stock router (mega_moe.fused_router=false)")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"router_topk: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"router_topk: top_k must be in [1, {E}], got {top_k}")


# the block-FP8 GEMMs with Gluon kernels: one item per program (`kernels.fp8_gemm1_gluon`, `fp8_rows_gluon`),
# persistent and warp-specialised (`kernels.fp8_gemm1_ws_gluon`, `fp8_rows_ws_gluon`, `fp8_wgrad_ws_gluon`)
GLUON_KERNELS = ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dx", "wgrad_w2", "wgrad_w13")
PERSISTENT_KERNELS = ("gemm2", "dx", "dgrad_swiglu")  # the grouped GEMM's (kernels/grouped_gemm.py)


def check_tile_config(kernel: str, cfg, row_block_m: int, precision: str | None = None) -> None:
    """A forced tile config must fit its kernel: row-tiled kernels take the plan's tiles whole or in equal
    parts (block_m divides the plan's BLOCK_M), `split` exists only for dgrad, warp specialisation only
    for the TMA loops of gemm2, dx and the sorted-copy weight gradients and for the Gluon kernels, grouped
    row order (group_m) only for the row-tiled kernels, sorted_copy only for the weight gradients with tma,
    gluon only for the block-FP8 GEMM1, GEMM2, dgrad, dx and weight gradients with the shapes its kernel
    takes (`precision`, where the caller knows it: a table entry's), persistent only for the grouped GEMM's
    kernels (gemm2, dx, split dgrad's GEMM), weight_tma only for dgrad's own kernel, pairs_in_one_loop only
    for dx with tma."""
    from .kernels.configs import KERNELS, ROW_KERNELS
    from .kernels.configs import WGRAD_KERNELS as WGRAD

    if kernel not in KERNELS:
        raise ValueError(f"tile config: unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    if kernel in ROW_KERNELS and (cfg.block_m < 16 or row_block_m % cfg.block_m):
        raise ValueError(f"{kernel}: block_m must divide the plan's {row_block_m}-row tiles (shared tile schedule) "
                         f"and be at least 16, got {cfg.block_m}")
    if cfg.split and kernel != "dgrad_swiglu":
        raise ValueError(f"{kernel}: split applies to dgrad_swiglu only")
    if not isinstance(cfg.group_m, int) or cfg.group_m < 1 or (cfg.group_m > 1 and kernel not in ROW_KERNELS):
        raise ValueError(f"{kernel}: group_m must be an integer >= 1, and above 1 only for the row-tiled kernels "
                         f"({', '.join(ROW_KERNELS)}), got {cfg.group_m!r}")
    if cfg.sorted_copy and (kernel not in WGRAD or not cfg.tma):
        raise ValueError(f"{kernel}: sorted_copy applies to the weight gradients ({', '.join(WGRAD)}) with tma only")
    if cfg.warp_specialize and not (kernel in ("gemm2", "dx") or (kernel in WGRAD and cfg.sorted_copy)
                                    or (cfg.gluon and kernel in GLUON_KERNELS)):
        raise ValueError(f"{kernel}: warp_specialize applies to gemm2 and dx (with tma), to the weight gradients "
                         f"with sorted_copy and to the gluon kernels only")
    persistent = cfg.persistent
    if isinstance(persistent, bool) or not isinstance(persistent, int) or persistent < 0 or (persistent and (
            kernel not in PERSISTENT_KERNELS or cfg.warp_specialize or cfg.gluon
            or (kernel == "dgrad_swiglu" and not (cfg.split and cfg.tma)))):
        # (dgrad's GEMM is the grouped GEMM only with split and tma; otherwise its own kernel, never persistent)
        raise ValueError(f"{kernel}: persistent (resident programs per multiprocessor) must be an integer >= 0, "
                         f"and above 0 only for {', '.join(PERSISTENT_KERNELS)} (dgrad_swiglu with split and tma), "
                         f"without warp_specialize or gluon; got {cfg}")
    if cfg.pairs_in_one_loop and (kernel != "dx" or not cfg.tma or cfg.warp_specialize or cfg.gluon
                                  or cfg.block_n > 128):
        # bf16 keeps a second accumulator for the second pair (mainloop.pair_mainloop): 128 columns at most
        raise ValueError(f"{kernel}: pairs_in_one_loop applies to dx with tma only (its two operand pairs through "
                         f"TMA in one K loop), block_n <= 128, without warp_specialize or gluon; got {cfg}")
    if cfg.weight_tma and (kernel != "dgrad_swiglu" or cfg.tma):
        raise ValueError(f"{kernel}: weight_tma applies to dgrad_swiglu without tma only (tma there copies dout's "
                         f"rows into sorted order and runs the grouped GEMM, whose operands are all TMA); got {cfg}")
    if cfg.gluon:
        if kernel not in GLUON_KERNELS or precision not in (None, "fp8"):
            raise ValueError(f"{kernel}: gluon applies to block FP8 {', '.join(GLUON_KERNELS)} only"
                             + (f", not to {precision}" if precision not in (None, "fp8") else ""))
        wrong = [why for bad, why in (
            (not cfg.tma, "tma=True (both operands come through TMA)"),
            (cfg.block_k != 128, "block_k 128 (one scale block)"),
            # the warp-specialised row kernels also take 256 columns as two 128-column sub-tiles
            (128 % cfg.block_n != 0 and not (cfg.warp_specialize and kernel in ("gemm2", "dgrad_swiglu", "dx")
                                             and cfg.block_n == 256),
             "block_n dividing 128 (a weight tile inside one scale block), or 256 for gemm2, dgrad and dx with "
             "warp_specialize"),
            (kernel == "gemm1_swiglu" and cfg.block_n != 64 and not (cfg.warp_specialize and cfg.block_n == 128),
             "block_n 64 for gemm1 (h's 128-column scale block in two 64-column halves), or 128 with "
             "warp_specialize (one pass)"),
            (cfg.block_m % (16 * cfg.num_warps) != 0, "block_m a multiple of 16 * num_warps (16 rows per warp)"),
            # the persistent warp-specialised kernel (`fp8_rows_ws_gluon`): two consumer warpgroups of 64 rows
            (cfg.warp_specialize and (cfg.block_m != 128 or cfg.num_warps != 8),
             "block_m 128 and num_warps 8 with warp_specialize (two consumer warpgroups of 64 rows)"),
            # the weight gradients have the persistent warp-specialised Gluon kernel only (`fp8_wgrad_ws_gluon`)
            (kernel in WGRAD and not cfg.warp_specialize, "warp_specialize=True for the weight gradients"),
            (kernel in WGRAD and cfg.block_n != 128, "block_n 128 for the weight gradients"),
            # the item order: the persistent warp-specialised row kernels walk groups down each column block
            (cfg.group_m != 1 and not (cfg.warp_specialize and kernel in ROW_KERNELS),
             "group_m 1 (above 1 only for the warp-specialised row kernels)"),
            (kernel == "dgrad_swiglu" and not cfg.split, "split=True for dgrad (the kernel is its GEMM alone)"),
        ) if bad]
        if wrong:
            raise ValueError(f"{kernel}: the gluon kernel needs {'; '.join(wrong)}; got {cfg}")


EP_TRANSPORTS = ("all_to_all", "symm_mem")


def check_ep_transport(transport, capacity_factor=None) -> None:
    if transport not in EP_TRANSPORTS:
        raise ValueError(f"titan_megamoe.moe: ep_transport must be one of {', '.join(EP_TRANSPORTS)}, got "
                         f"{transport!r}")
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor >= 1:
        raise ValueError(f"titan_megamoe.moe: ep_capacity_factor must be None (exact sizes) or a number >= 1 (rows "
                         f"a rank may receive, in units of the rows it routes), got {capacity_factor!r}")
    if transport != "symm_mem":
        raise ValueError(f"titan_megamoe.moe: ep_capacity_factor applies to ep_transport='symm_mem' (the all-to-all "
                         f"needs its split sizes on the host), got ep_transport={transport!r}; drop "
                         f"ep_capacity_factor or use ep_transport='symm_mem'")


def check_expert_parallel(recipe, backend: str) -> None:
    """What the expert-parallel path runs today: bf16 on both backends, block FP8 (`fp8`, `fp8_bwd`) on the
    Triton kernels; eager autograd (the all-to-all split sizes are read on the host, which a torch.compile
    graph cannot hold)."""
    if backend == "reference" and (recipe.quantized() or recipe.quantized(backward=True)):
        raise NotImplementedError(f"titan_megamoe.moe: precision={recipe.precision.value!r} with expert "
                                  f"parallelism (ep_group) runs on the Triton kernels only (the reference backend's "
                                  f"FP8 emulation has no EP path yet); use backend='triton' (on CPU with "
                                  f"TRITON_INTERPRET=1) or precision='bf16'")
    if torch.compiler.is_compiling():
        raise NotImplementedError("titan_megamoe.moe: expert parallelism (ep_group) under torch.compile is not "
                                  "implemented yet; run the MoE layers eagerly (TorchTitan: --compile.enable off "
                                  "or compile without the MoE layers)")
