"""Small pieces every kernel shares.

INTERPRET (a constexpr, true only under TRITON_INTERPRET=1) works around two numerics gaps of Triton
3.6's CPU interpreter so that CPU tests check the same math the GPU runs: it multiplies bf16 tiles as
their uint16 bit patterns, and it truncates fp32 -> bf16 instead of rounding to nearest even.
"""

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import interpreting


@triton.jit
def mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b (bf16 operands, fp32 accumulator)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even (what the GPU's cvt does)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def row_tile(pid, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M: tl.constexpr):
    """The work of program `pid` in a row-tiled kernel: (expert, N-tile, sorted rows, row mask).

    N-tiles vary fastest, so consecutive programs reuse the same gathered rows from L2. expert < 0 marks
    a tile past the real count (the grid is sized at the host-known bound): the caller returns at once.
    """
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(tile_expert_ptr + pid_m)
    row_start = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + tl.maximum(expert, 0) + 1)
    rows = row_start + tl.arange(0, BLOCK_M)
    return expert, pid_n, rows, rows < row_end


ROW_ALIGN = 16  # D and H: pointer loads (no TMA) need 16-element (32 B) aligned rows


def check_row_alignment(where: str, dims: dict[str, int], hint: str = "") -> None:
    """The one shape rule every kernel shares: D and H must be multiples of ROW_ALIGN."""
    for name, v in dims.items():
        if v % ROW_ALIGN != 0:
            raise ValueError(f"{where}: {name} must be a multiple of {ROW_ALIGN}, got {v}{hint}")


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can cover these tensors: row-major with 16-byte aligned rows and base
    (the kernels fall back to pointer loads otherwise, e.g. for a strided weight view)."""
    return all(t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def matrix_descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """TMA descriptor over t viewed as a matrix [prod(leading dims), last dim]: a per-expert weight
    [E, R, C] becomes [E*R, C], so expert e's rows start at e*R."""
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), block_shape)


def interpret_flag() -> bool:
    return interpreting()


def new_output(shape, dtype, device):
    """Allocate a kernel output. TITAN_MEGAMOE_POISON=1 fills it with NaN first, so an element a kernel
    forgot to write shows up in the checks instead of silently holding stale memory."""
    if os.environ.get("TITAN_MEGAMOE_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
