"""The precision enum: one source of truth for the names users may pass."""

from __future__ import annotations

import enum

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


IMPLEMENTED = (Precision.BF16,)


def check_precision_supported(precision: "str | Precision", device: torch.device | None = None) -> Precision:
    """Raise a clear error for a precision that cannot run here; return the parsed enum."""
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
                f"use precision='bf16' on Hopper"
            )
    if p not in IMPLEMENTED:
        raise NotImplementedError(
            f"precision={p.value!r} is not implemented yet in titan-megamoe; "
            f"available now: {', '.join(repr(q.value) for q in IMPLEMENTED)}"
        )
    return p
