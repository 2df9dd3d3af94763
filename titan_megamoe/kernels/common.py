"""Small pieces every kernel shares: the MMA and cast helpers, TMA descriptors, output buffers.

INTERPRET is true when the kernels run in Triton's CPU interpreter: Triton decides that when a kernel
is defined (TRITON_INTERPRET=1 at import), so it is read once here from a jitted function, not from the
environment at call time (a test that sets the variable later cannot switch the tile configs under a
compiled kernel). As a constexpr it works around two numerics gaps of Triton 3.6's interpreter so that
CPU tests check the same math the GPU runs: it multiplies bf16 tiles as their uint16 bit patterns, and
it truncates fp32 -> bf16 (and fp32 -> e4m3) instead of rounding to nearest even.

Block FP8 (`e4m3_scale`, `to_e4m3`) follows `titan_megamoe.quant` bit for bit: power-of-two scales
from the block's amax, a saturating round-to-nearest-even cast.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b (bf16 operands, fp32 accumulator)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even (what the GPU's cvt does)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rne_e4m3(x):
    """x (within +-448) rounded to the nearest e4m3 value, ties to even, still in fp32 (`to_e4m3` casts
    the result, which is then exact; the interpreter's own cast truncates): normals keep 3
    mantissa bits; below e4m3's smallest normal 2^-6 values round to multiples of 2^-9, which adding and
    subtracting 1.5 * 2^14 does (fp32's spacing there is 2^-9)."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    rounded = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    # the sign of a value that rounds to zero (-0.0 is e4m3's 0x80, as torch's cast gives)
    return (rounded.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


E4M3_MAX = tl.constexpr(448.0)  # a constexpr global: jitted code may read it


@triton.jit
def e4m3_scale(amax):
    """(scale, 1 / scale) of blocks with this amax (fp32, >= 0): the smallest power of two s >= 2^-126
    with amax / s <= 448, 1 where amax is 0 (`quant.power_of_two_scale`). Built from amax's exponent and
    mantissa bits, so both are exact and no division is needed."""
    # amax = m * 2^e with m in [1, 2): m * 2^(e - k) <= 448 = 1.75 * 2^8 holds from k = e - 8 when m <= 1.75
    # (mantissa bits <= 0x600000), from k = e - 7 otherwise; subnormal amax gets the floor 2^-126, inf the
    # exponent 128 (scale inf, as the division by 448 this replaced gave: the two agree on every non-negative
    # fp32 bit pattern, NaN included: scripts/check_e4m3_scale_bits.py)
    bits = amax.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32)
    k = e - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(e == 255, 128, tl.maximum(k, -126))
    scale = ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, scale, 1.0)
    inv = tl.where(amax > 0, inv, 1.0)
    return scale, inv


@triton.jit
def to_e4m3(x, inv_scale, INTERPRET: tl.constexpr):
    """x * inv_scale (exact: a power of two) as e4m3, saturating at +-448 (e4m3fn has no inf).

    Rounded to an e4m3 value in fp32 first, so the cast itself is exact: Triton 3.6 on the H200 cast
    fp32 -> e4m3 wrongly in a program that stored a tile twice (a 128x128 block and its transpose, found
    by tests/test_quant_kernels.py); bitwise the same result as the hardware's round-to-nearest-even.
    (Casting through fp16 instead, exact for bf16-valued inputs and cheaper, came out wrong on the H200
    in such programs too: docs/results/quantize_20261204/.)"""
    v = tl.minimum(tl.maximum(x * inv_scale, -E4M3_MAX), E4M3_MAX)
    return _rne_e4m3(v).to(tl.float8e4nv)


INTERPRET = isinstance(mma, InterpretedFunction)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code: Triton's is a constexpr function whose host call costs ~1.6 us of
    wrapping; a layer's forward+backward makes ~25 such calls while it launches kernels."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (same values, 0 for 0), without its host-call wrapping."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can cover these tensors: row-major with 16-byte aligned rows and base
    (the kernels fall back to pointer loads otherwise, e.g. for a strided weight view)."""
    return all(t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def matrix_descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """TMA descriptor over t viewed as a matrix [prod(leading dims), last dim]: a per-expert weight
    [E, R, C] becomes [E*R, C], so expert e's rows start at e*R."""
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), block_shape)


def row_copy_blocks(C: int) -> tuple[int, int]:
    """(rows, columns) per program of the row-copy kernels (`sorted_rows`, `peer_rows.scatter_rows`) for
    rows of C elements: up to 1024 columns, small tiles in the interpreter (fast CPU tests)."""
    return (4, min(next_power_of_2(C), 16)) if INTERPRET else (8, min(next_power_of_2(C), 1024))


def new_output(shape, dtype, device):
    """Allocate a kernel output. TITAN_MEGAMOE_POISON=1 fills it with NaN first, so an element a kernel
    forgot to write shows up in the checks instead of silently holding stale memory (integer outputs get
    their dtype's most negative value)."""
    if os.environ.get("TITAN_MEGAMOE_POISON") == "1":
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a persistent kernel's grid is a multiple of it). On the CPU
    (Triton's interpreter) 2, so that the interpreter's programs still each walk several tiles."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count
