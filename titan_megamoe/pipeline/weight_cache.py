"""Block-FP8 copies of the expert weights, made once per optimizer step.

A weight W [E, R, C] is quantized in one pass into W (128x128 blocks; GEMM1 and GEMM2 read it) and W^T
[E, C, R] (the same blocks transposed, bit for bit: dgrad and dx read it, since Hopper's FP8 MMA takes
K-major operands only). Quantizing costs a read of the bf16 weight and 2 bytes per element written
(about 0.3 ms per layer at Qwen3-30B-A3B's shapes on an H200), so a forward and its backward share one
copy:

- an entry is valid while the weight is the same live tensor (keyed by its TensorImpl, dropped by a weak
  reference's callback when the tensor dies), at the same storage address and the same version counter. In-place updates (the
  optimizer's step, `copy_`, FSDP's all-gather into the unsharded parameter) bump the version, so the
  next forward re-quantizes; no host sync and no comparison of values is involved;
- the backward releases the entry once it has used it (`release`), so between steps, and under FSDP
  between the layers' backward passes, no FP8 copy outlives its step. What a forward keeps until its
  backward is 2 bytes per expert weight element of the layers in flight.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..kernels.quantize import quantize_weight_pair
from ..precision import BlockScaled


@dataclass(frozen=True)
class QuantizedWeight:
    w: BlockScaled  # [E, R, C], 128x128 blocks
    wt: BlockScaled  # [E, C, R]: the transposed copy


@dataclass
class _Entry:
    ref: weakref.ref
    version: int
    data_ptr: int
    quantized: QuantizedWeight


_cache: dict[int, _Entry] = {}


def _key(w: torch.Tensor) -> int:
    return w._cdata  # the TensorImpl: one per tensor, whatever Python object wraps it


def quantized(w: torch.Tensor) -> QuantizedWeight:
    """The block-FP8 copies of w, from the cache when w has not changed since they were made."""
    key = _key(w)
    entry = _cache.get(key)
    # a dead weight's entry is gone (the weak reference's callback); a live one's TensorImpl is w's
    if (entry is not None and entry.ref() is not None
            and entry.version == w._version and entry.data_ptr == w.data_ptr()):
        return entry.quantized
    with torch.no_grad():
        q = QuantizedWeight(*quantize_weight_pair(w.detach()))
    _cache[key] = _Entry(weakref.ref(w, lambda _, k=key: _cache.pop(k, None)), w._version, w.data_ptr(), q)
    return q


def release(w: torch.Tensor) -> None:
    """Drop w's copies (the backward calls this once it is done with them)."""
    _cache.pop(_key(w), None)


def cached_count() -> int:
    return len(_cache)
