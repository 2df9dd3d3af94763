"""Precision: the names users may pass, and the recipe each one means for the kernels.

A `Recipe` is what the pipeline and the fake implementation read instead of hard-coding a dtype: the
operand dtype of the forward and backward GEMMs, the dtype of the saved residuals, and (for block FP8)
the block shapes of the scales. Block-scaled operands travel as `BlockScaled` (data, scale, block), so
kernels and launchers never take loose scale arguments.

Block FP8 (`fp8`, `fp8_bwd`) runs on the Triton kernels (e4m3 operands, per-128 K-block scales applied
in fp32) and, as their oracle, on the pure-PyTorch emulation (`oracle.moe_fp8_emulation`, the
`reference` backend). The scale policy itself is in `quant.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Precision(str, enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"  # Hopper block FP8 (1x128 activations, 128x128 weights), forward and backward
    FP8_BWD = "fp8_bwd"  # bf16 forward, block FP8 backward
    MXFP8 = "mxfp8"  # Blackwell (sm_100) block-scaled MMA only

    @classmethod
    def parse(cls, value: "str | Precision") -> "Precision":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(p.value) for p in cls)
            raise ValueError(
                f"precision: unknown value {value!r}; expected one of {names}"
            ) from None


@dataclass(frozen=True)
class BlockScaled:
    """A block-quantized operand: ``data`` (e.g. float8_e4m3fn) times one fp32 ``scale`` per block of
    ``block`` elements (rows, cols): (1, 128) for activations, (128, 128) for weights."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]


@dataclass(frozen=True)
class Recipe:
    precision: Precision
    forward_operand: torch.dtype  # operand dtype of GEMM1 / GEMM2
    backward_operand: torch.dtype  # operand dtype of dgrad, dx and the weight gradients
    activation: torch.dtype  # dtype of what the kernels write: g, u, h (saved for the backward), y and dx rows
    weight_block: tuple[int, int] | None = None  # scale blocks of quantized weights (the shape rule's divisor)

    def quantized(self, backward: bool = False) -> bool:
        """True when the forward (or backward) GEMM operands are block-scaled 1-byte floats."""
        return (self.backward_operand if backward else self.forward_operand).itemsize == 1

    def operand(self, t: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """t as a GEMM operand of this recipe: contiguous, in the operand dtype."""
        dtype = self.backward_operand if backward else self.forward_operand
        # checked in Python first: the no-op .to()/.contiguous() calls cost host time before GEMM1
        if t.dtype is dtype and t.is_contiguous():
            return t
        return t.to(dtype).contiguous()


# DeepSeek-V3's block FP8: activations one scale per 1x128 block along the consuming GEMM's reduction
# dimension, weights one per 128x128 block (W and W^T share their blocks' scales and values, transposed:
# one read of the weight makes both); quant.py has the rest
FP8_ACTIVATION_BLOCK = (1, 128)
FP8_WEIGHT_BLOCK = (128, 128)
_E4M3 = torch.float8_e4m3fn

RECIPES = {
    Precision.BF16: Recipe(Precision.BF16, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    Precision.FP8: Recipe(Precision.FP8, _E4M3, _E4M3, torch.bfloat16, FP8_WEIGHT_BLOCK),
    Precision.FP8_BWD: Recipe(Precision.FP8_BWD, torch.bfloat16, _E4M3, torch.bfloat16, FP8_WEIGHT_BLOCK),
}

# what the Triton kernels implement (mxfp8 has no recipe: recipe_for stops it first)
TRITON_PRECISIONS = (Precision.BF16, Precision.FP8, Precision.FP8_BWD)


def recipe_for(precision: "str | Precision", device: torch.device | None = None) -> Recipe:
    """The recipe of a precision that can run on `device`; a clear error otherwise."""
    p = Precision.parse(precision)
    if p is Precision.MXFP8:
        major = None
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            major, _ = torch.cuda.get_device_capability(device)
        if major is None or major < 10:
            where = (
                f"this GPU has compute capability {major}.x"
                if major is not None
                else "no Blackwell GPU is in use"
            )
            raise ValueError(
                f"precision='mxfp8' needs a Blackwell GPU (sm_100 block-scaled MMA) but {where}; "
                f"use precision='bf16' (or 'fp8' on Hopper)"
            )
    if p not in RECIPES:
        raise NotImplementedError(
            f"precision={p.value!r} is not implemented yet in titan-megamoe; "
            f"available now: {', '.join(repr(q.value) for q in RECIPES)}"
        )
    return RECIPES[p]


# e4m3 MMAs exist from compute capability 8.9 (Ada) on; the block-FP8 kernels are built and tested for Hopper (9.0)
FP8_MIN_CAPABILITY = (8, 9)


def check_backend_precision(recipe: Recipe, backend: str, device: torch.device | None = None) -> None:
    """A recipe the resolved backend cannot run stops here (NotImplementedError), never falls back; block FP8
    on the Triton backend on a CUDA `device` without FP8 tensor cores stops with a ValueError."""
    if backend == "triton" and recipe.precision not in TRITON_PRECISIONS:
        raise NotImplementedError(
            f"precision={recipe.precision.value!r} is not implemented on backend='triton'; the Triton kernels "
            f"run {', '.join(repr(p.value) for p in TRITON_PRECISIONS)}"
        )
    if (backend == "triton" and device is not None and device.type == "cuda"
            and (recipe.quantized() or recipe.quantized(backward=True))):
        # get_device_properties (cached by torch) rather than get_device_capability: torch.compile folds it
        gpu = torch.cuda.get_device_properties(device)
        if (gpu.major, gpu.minor) < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"precision={recipe.precision.value!r} needs a GPU with FP8 tensor cores (compute capability 8.9 or "
                f"newer; the kernels are built for Hopper, 9.0), but {gpu.name} has {gpu.major}.{gpu.minor}; use "
                f"precision='bf16', or backend='reference' for the FP8 emulation"
            )
