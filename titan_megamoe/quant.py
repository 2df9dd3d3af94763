"""Block FP8 quantization (DeepSeek-V3's recipe) in plain PyTorch: the one source of the scale policy.

The FP8 emulation (`oracle.moe_fp8_emulation`) calls these functions, and the Triton FP8 kernels must
produce the same bits: same blocks, same scales, same cast.

Format: e4m3 (`torch.float8_e4m3fn`: 3 mantissa bits, largest finite 448, smallest normal 2^-6, no inf).

Blocks (rows, cols) of a 2-D operand, or of each expert's matrix of a 3-D weight [E, R, C]:
- activations, (1, 128): one scale per 128 consecutive elements of a row, along the reduction dimension
  of the GEMM that consumes them (x and dout along D, h, dg and du along H);
- weights, (128, 128): one quantized copy serves both W (GEMM1, GEMM2) and W^T (dgrad, dx);
- token blocks, (128, 1): the operands of the weight-gradient GEMMs, whose reduction runs over tokens:
  one scale per column per 128 consecutive rows of one expert's segment. Blocks restart at each
  expert's first row and the last block of a segment may be partial (what a varlen kernel walking one
  expert's rows does), so `quantize_token_blocks` takes one segment and any row count.

Scale of a block: the smallest power of two s with amax / s <= 448, i.e. s = 2^ceil(log2(amax / 448)),
but never below 2^-126 (fp32's smallest normal, so that s and 1/s are normal numbers the kernels build
from exponent bits; only an amax under 448 * 2^-126 ~ 5e-36 meets that floor), and data = cast_e4m3(clamp(x / s, -448, 448)). Why powers of two:
- x / s and data * s are exact in fp32 (an exponent shift), so the only rounding is the e4m3 cast itself
  and dequantization is exact; the product of two scales (what a block-scaled GEMM multiplies its
  fp32 partial sums by) is exact too, so the kernels may apply scales in any order and still match;
- an element's quantized value depends only on its value and its block's exponent: a transposed copy of
  a 128x128 weight block (same elements, same amax) quantizes to the same values transposed, and
  quantizing a dequantized tensor again gives the same bits;
- DeepSeek-V3 and Prime (and MX formats' E8M0 scales) use them. The price: amax / s lies in (224, 448],
  so up to one binade of e4m3's range goes unused.
An all-zero block gets s = 1 (not 0/0 = NaN): its data is zeros. The clamp makes the cast saturate
(e4m3fn has no inf; out-of-range values would become NaN). Scaled values below e4m3's smallest normal
(2^-6) become e4m3 subnormals (spacing 2^-9) or zero, as torch's round-to-nearest-even cast does.
Non-finite inputs are not handled (a NaN or inf amax gives a non-finite scale).

Rounding bound (tests): with 3 mantissa bits, round-to-nearest moves a scaled normal v by at most half an
ulp, 2^-4 * 2^floor(log2|v|) <= 2^-4 |v|; a scaled subnormal by at most 2^-10. In the input's units:
|x - dequantize(quantize(x))| <= max(2^-4 |x|, 2^-10 s) <= 2^-4 amax of its block.
"""

from __future__ import annotations

import torch

from .precision import FP8_ACTIVATION_BLOCK, FP8_WEIGHT_BLOCK, BlockScaled
from .validation import check_multiple_of

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
ACTIVATION_BLOCK = FP8_ACTIVATION_BLOCK
WEIGHT_BLOCK = FP8_WEIGHT_BLOCK
TOKEN_BLOCK = (FP8_ACTIVATION_BLOCK[1], FP8_ACTIVATION_BLOCK[0])  # (128, 1): along the token dimension


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s >= 2^-126 with amax / s <= 448 (fp32); 1 where amax is 0."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    # ceil(log2(ratio)) without log2's rounding: exponent, less one when the ratio is a power of two
    exponent = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp_min(-126)
    exponent = torch.where(mantissa == 0, -126, exponent)  # amax / 448 underflowed to 0 (amax < 2^-140)
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    # amax / 448 itself rounds: where that rounding went down, amax / s (exact) can exceed 448 by an ulp
    scale = torch.where(amax / scale > E4M3_MAX, scale * 2, scale)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _check_blocks(x: torch.Tensor, block: tuple[int, int], partial_rows: bool) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"quantize: expected a 2-D operand or a 3-D weight [E, R, C], got shape {tuple(x.shape)}")
    rows, cols = x.shape[-2:]
    where = f"quantize: shape {tuple(x.shape)} in {block} blocks"
    hint = "; block FP8 needs D and H to be multiples of 128: pad them or use precision='bf16'"
    check_multiple_of(where, {f"dimension {x.dim() - 1} (columns)": cols}, block[1], hint)
    if not partial_rows:
        check_multiple_of(where, {f"dimension {x.dim() - 2} (rows)": rows}, block[0], hint)


def quantize(x: torch.Tensor, block: tuple[int, int], partial_rows: bool = False) -> BlockScaled:
    """x ([R, C] or [E, R, C]) in e4m3 with one power-of-two fp32 scale per (rows, cols) block.

    The blocked dimensions must be multiples of the block; with `partial_rows` the last row block may be
    partial (a token block at the end of an expert's segment). Scale shape: [..., ceil(R/r), C/c]."""
    _check_blocks(x, block, partial_rows)
    r, c = block
    rows, cols = x.shape[-2:]
    n_row_blocks = -(-rows // r)
    x_f = _pad_rows(x.float(), n_row_blocks * r)  # zero rows do not change a block's amax
    blocks = x_f.unflatten(-1, (cols // c, c)).unflatten(-3, (n_row_blocks, r))  # [..., Rb, r, Cb, c]
    scale = power_of_two_scale(blocks.abs().amax(dim=(-3, -1)))  # [..., Rb, Cb]
    scaled = blocks / scale[..., :, None, :, None]  # exact: a power of two
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).flatten(-2).flatten(-3, -2)
    return BlockScaled(data[..., :rows, :], scale, (r, c))


def dequantize(q: BlockScaled) -> torch.Tensor:
    """data * scale in fp32 (exact: the scales are powers of two)."""
    r, c = q.block
    rows, cols = q.data.shape[-2:]
    n_row_blocks = q.scale.shape[-2]
    data = _pad_rows(q.data.float(), n_row_blocks * r).unflatten(-1, (cols // c, c)).unflatten(-3, (n_row_blocks, r))
    return (data * q.scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :rows, :]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = rows - x.shape[-2]
    return x if pad == 0 else torch.cat([x, x.new_zeros((*x.shape[:-2], pad, x.shape[-1]))], dim=-2)


def quantize_activation(x_MK: torch.Tensor) -> BlockScaled:
    """A GEMM's row operand, 1x128 blocks along its reduction dimension K (the last one)."""
    return quantize(x_MK, ACTIVATION_BLOCK)


def quantize_weight(w_ERC: torch.Tensor) -> BlockScaled:
    """A weight [R, C] or one per expert [E, R, C], 128x128 blocks."""
    return quantize(w_ERC, WEIGHT_BLOCK)


def quantize_token_blocks(x_nC: torch.Tensor) -> BlockScaled:
    """One expert's segment of a weight-gradient operand (n rows, any n): 128x1 blocks from its first row."""
    return quantize(x_nC, TOKEN_BLOCK, partial_rows=True)


def quantize_token_tiles(rows_NC: torch.Tensor, plan) -> BlockScaled:
    """The weight-gradient operand layout: expert-sorted rows [N, C] (a `RoutingPlan`'s order) stored
    transposed and tile-padded, [C, P] with P = plan.layout.num_tiles * 128, in 1x128 blocks along P.

    Tile t of the plan (block_m = 128 sorted rows of one expert, restarting at each expert's first row)
    owns columns [128 t, 128 t + 128); its columns past the expert's last row, and every column of a
    tile past the real count, are zeros. Each block is then one token block of `quantize_token_blocks`
    (same elements, same amax), so the values equal that function's per expert segment, transposed; a
    weight-gradient kernel reduces over expert e's tiles, K-major for the FP8 MMA. Scale [C, P / 128]."""
    bm = plan.layout.block_m
    if bm != TOKEN_BLOCK[0]:
        raise ValueError(f"quantize_token_tiles: the plan's tiles must be {TOKEN_BLOCK[0]} rows, got {bm}")
    num_tiles = plan.layout.num_tiles
    expert_T = plan.tile_expert.long()
    row0_T = plan.tile_row.long()
    end_T = plan.offsets_E1.long()[expert_T.clamp_min(0) + 1]
    rows_TB = row0_T[:, None] + torch.arange(bm, device=rows_NC.device)
    ok_TB = (expert_T[:, None] >= 0) & (rows_TB < end_T[:, None])
    padded = rows_NC.float()[rows_TB.clamp(0, max(rows_NC.shape[0] - 1, 0)).reshape(-1)] if num_tiles else \
        rows_NC.new_zeros((0, rows_NC.shape[1]), dtype=torch.float32)
    padded = torch.where(ok_TB.reshape(-1, 1), padded, 0.0)
    return quantize(padded.T.contiguous(), ACTIVATION_BLOCK)
